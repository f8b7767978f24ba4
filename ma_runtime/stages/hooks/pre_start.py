"""The ma-pre-start hook: found beside the boot file or in the code directory, sourced (`.sh`) or run (`.py`);
what it leaves running becomes the job's services."""

import os
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ma_runtime.errors import HookFailed
from ma_runtime.process import children
from ma_runtime.stages.hooks.env import Env, command_words, job_python
from ma_runtime.stages.hooks.running import HookStage, Record, Result, sha256, source, supervised, with_env_file
from ma_runtime.util import records

HOOK_NAMES = ("ma-pre-start.sh", "ma-pre-start.py")  # in this order: the first found runs, alone


def find_hook(command: Sequence[str], code_dir: Path) -> Tuple[Optional[Path], List[Path]]:
    """The hook that runs, and those that do not (found after it). Next to the boot file first (the platform's
    place), then at the top of the code directory; in each folder `.sh` before `.py`."""
    folders: List[Path] = []
    boot = boot_file(command)
    if boot is not None:
        folders.append(boot.parent)
    folders.append(code_dir)
    found: List[Path] = []
    for folder in dict.fromkeys(os.path.realpath(f) for f in folders):
        found.extend(Path(folder) / name for name in HOOK_NAMES if (Path(folder) / name).is_file())
    return (found[0] if found else None), found[1:]


def boot_file(command: Sequence[str]) -> Optional[Path]:
    """The script of the command's last simple command: its first argument naming an existing `.py` or `.sh`
    file (`python -u train.py`; `torchrun --nproc_per_node 8 train.py`; `bash run.sh`), else its first argument
    naming any existing file, else the program itself when given as a path (`./run`)."""
    words = command_words(command)
    files = [word for word in words[1:] if not word.startswith("-") and os.path.isfile(word)]
    scripts = [word for word in files if word.endswith((".py", ".sh"))]
    if words and "/" in words[0] and os.path.isfile(words[0]):
        files.append(words[0])
    chosen = (scripts or files or [None])[0]
    return Path(os.path.abspath(chosen)) if chosen else None


def run_hook(run: HookStage, environ: Dict[str, str]) -> Env:
    if run.spec.hooks_pre_start == "off":
        return Env()
    hook, ignored = find_hook(run.command, run.code_dir)
    for other in ignored:
        run.log.warning("pre-start hook not run: only one runs", path=str(other), runs=str(hook))
    if hook is None:
        return Env()
    record = Record(run.spec.state_dir / "pre-start.json", run.reuse, _valid_pre_start, "the pre-start record",
                     "the pre-start script runs again", run.log, private=True)
    key = {"file": str(hook), "sha256": sha256(hook)}
    previous = record.matches(key)
    # A hook that started a service (an sshd) runs again: the service ended with the runtime that adopted it.
    if previous is not None and not previous["services"]:
        env = Env.from_json(previous["env"])
        run.log.info("pre-start script already ran in this pod; its environment applied again", hook=str(hook),
                     set=len(env.set), unset=len(env.unset))
        return env
    run.log.info("running the pre-start script", hook=str(hook), cwd=str(run.code_dir))
    started = time.monotonic()
    if hook.suffix == ".sh":
        result = source(run, hook, environ, hook.name, "pre-start")
    else:
        result = _python_hook(run, hook, environ)
    if result.code != 0 or result.env is None:
        raise HookFailed(f"pre-start script {hook} failed: {result.why}", stage="pre-start", tail=result.tail,
                         hook_exit_code=result.code,
                         hint=result.hint or "fix the hook (its output is in the task log, prefixed [ma-pre-start]), "
                                             "or set MA_RUNTIME_PRE_START=off")
    services = _adopt_leftovers(run)
    run.log.info("pre-start script finished", hook=str(hook), elapsed_s=round(time.monotonic() - started, 3),
                 set=sorted(result.env.set), unset=sorted(result.env.unset))
    record.write({**key, "env": result.env.to_json(), "services": bool(services)}, run.log, "pre-start script")
    return result.env


def _valid_pre_start(document) -> dict:
    """pre-start.json: the hook file, its hash, the environment it produced, whether it left a service."""
    records.exactly(records.mapping(document, "the record"), ("file", "sha256", "env", "services"), "the record")
    for name in ("file", "sha256"):
        records.text(document[name], f"`{name}`")
    env = records.mapping(document["env"], "`env`")
    records.exactly(env, ("set", "unset"), "`env`")
    # What exec refuses (a name with `=`, a NUL anywhere) would stop every worker's start: not an environment.
    for name, value in records.strings(env["set"], "`env.set`").items():
        if not name or "=" in name or "\0" in name or "\0" in value:
            raise records.Invalid("`env.set`: an entry that no environment can hold (an empty name, `=` in a "
                                  "name, or a NUL)")
    records.string_list(env["unset"], "`env.unset`")
    records.flag(document["services"], "`services`")
    return document


def _python_hook(run: HookStage, hook: Path, environ: Mapping[str, str]) -> "Result":
    python = job_python(environ, run.command)
    if python is None:
        return Result(127, None, [], why="no Python interpreter for the job on PATH to run it with")
    return with_env_file(run, lambda env: supervised(run, [python, str(hook)], env, hook.name, "pre-start"),
                           environ)


def _adopt_leftovers(run: HookStage) -> List[int]:
    """What the hook left running (a daemon it started) lives on as the job's service."""
    left = children.adopt_services(run.exclude)
    if left:
        run.log.info("the pre-start script left processes running: kept as the job's services until it ends",
                     pids=left[:20])
    return left
