"""The hooks stage: pip requirements, CANN's set_env.sh, the ma-pre-start hook; once per pod, after stage-in and
before the rank-table wait, in this order (docs/platform.md, D32-D34).

What they leave is an `Env`: the variables to set and to unset, applied to every worker of every attempt (and to
the plan, so that a PATH the hook prepends finds the launcher). The runtime's own environment is not changed: its
helpers (the uploader) keep the interpreter they were installed for.

A sourced file (`set_env.sh`, `ma-pre-start.sh`) is read the way Spack reads one: bash sources it between two
dumps of the environment made by a Python as JSON, so a multi-line value, an `=` in a value or odd bytes survive,
which parsing `env` would not; the difference is what the file did. An EXIT trap takes the second dump when a hook
ends with `exit 0`; one that sets an EXIT trap of its own keeps it (it runs after the dump). A `.py` hook, and a
`.sh` hook too, may instead write `NAME=value` lines (or `NAME<<EOF` ... `EOF`) to the file named by
`MA_HOOK_ENV_FILE`, GitHub Actions' `$GITHUB_ENV` contract.

Each runs as a worker would: its own session, its output on the console and in the task log behind a prefix
(`[pip] `, `[set_env.sh] `, `[ma-pre-start] `), a timeout (`MA_RUNTIME_HOOK_TIMEOUT_SECONDS`: TERM, the stop grace,
KILL), and a SIGTERM to the runtime ends it with the run (the stage thread's stop). Processes a hook leaves
running (an sshd) are the job's services from then on (`children.adopt_services`): not the command's, stopped
when the run ends.
"""

import dataclasses
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from ma_runtime import children, records
from ma_runtime.errors import (
    TOO_LARGE_HINT,
    ConfigError,
    HookFailed,
    RuntimeFailure,
    exceeds_exec_limits,
    too_large_for_exec,
)
from ma_runtime.files import RECORD_LIMIT, read_regular, write_atomically
from ma_runtime.launch.args import is_shell_form, last_simple_command
from ma_runtime.output import Sink
from ma_runtime.process import lifecycle
from ma_runtime.redact import Masker
from ma_runtime.spec import JobSpec

HOOK_NAMES = ("ma-pre-start.sh", "ma-pre-start.py")  # in this order: the first found runs, alone
REQUIREMENT_NAMES = ("pip-requirement.txt", "requirements.txt")  # the platform's two names; the first found
ENV_FILE_VAR = "MA_HOOK_ENV_FILE"
# Variables for an environment, not data: a file past this is a mistake, refused before it is read.
ENV_FILE_LIMIT = 1 << 20
# CANN's installers put set_env.sh here (root installs, then a user's): the first that exists is sourced.
CANN_SET_ENV_PATHS = ("/usr/local/Ascend/ascend-toolkit/set_env.sh", "/usr/local/Ascend/cann/set_env.sh",
                      "~/Ascend/ascend-toolkit/set_env.sh", "~/Ascend/cann/set_env.sh")
# set_env.sh exports these, naming the toolkit: set to a folder of that toolkit means it is applied already.
CANN_HOME_VARS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
# What bash itself changes in every environment it runs: never what a sourced file did.
_SHELL_NOISE = frozenset(("_", "PWD", "OLDPWD", "SHLVL", ENV_FILE_VAR))
# Each step's output on the console and in the task log behind its own prefix.
_PREFIXES = {"pip": b"[pip] ", "cann": b"[set_env.sh] ", "pre-start": b"[ma-pre-start] "}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PYTHON_NAME = re.compile(r"python[0-9.]*\Z")
# The dump both sides of a sourced file: the whole environment as JSON, with the file's status.
_DUMP = ("import json,os,sys\n"
         "with open(sys.argv[1], 'w') as f: json.dump({'status': int(sys.argv[2]), 'environ': dict(os.environ)}, f)")
# When the second dump cannot run (the file exported more than exec takes: E2BIG), bash writes the exported
# variables with builtins alone, `NAME=value` NUL-separated, to `<after>.raw`, for the runtime to say which is too
# large. `${!n-}`: a file's `set -u` must not end the shell here.
_RAW_DUMP = r"""for __ma_rt_n in $(compgen -e); do printf '%s=%s\0' "$__ma_rt_n" "${!__ma_rt_n-}"; done \
> "$__ma_rt_after.raw" 2>/dev/null"""
# `bash -c` this, with $1.. = python, dump code, before, after, the file, the raw dump. The names are the shell's
# own variables (not exported, so in neither dump); `set --` keeps our arguments from the sourced file's $1.
# The second dump is taken when the file returns; the EXIT trap takes it for a file that ends with `exit`. A file
# may replace that trap with its own (a cleanup): it still runs, when the shell exits after the dump. The raw dump
# is bash's alone (`${!n}` is no sh syntax): evaluated only under bash.
_SOURCE = r"""__ma_rt_py=$1 __ma_rt_dump=$2 __ma_rt_after=$4 __ma_rt_file=$5 __ma_rt_raw=$6 __ma_rt_done=
"$__ma_rt_py" -I -S -c "$__ma_rt_dump" "$3" 0 || exit 125
trap '__ma_rt_status=$?; trap - EXIT
[ -n "$__ma_rt_done" ] || "$__ma_rt_py" -I -S -c "$__ma_rt_dump" "$__ma_rt_after" "$__ma_rt_status" ||
{ [ -z "${BASH_VERSION-}" ] || eval "$__ma_rt_raw"; }
exit "$__ma_rt_status"' EXIT
set --
. "$__ma_rt_file"
__ma_rt_status=$? __ma_rt_done=1
"$__ma_rt_py" -I -S -c "$__ma_rt_dump" "$__ma_rt_after" "$__ma_rt_status" ||
{ [ -z "${BASH_VERSION-}" ] || eval "$__ma_rt_raw"; }
exit "$__ma_rt_status"
"""


@dataclasses.dataclass(frozen=True)
class Env:
    """Variables to set and to unset: what the hooks did to the environment."""

    set: Mapping[str, str] = dataclasses.field(default_factory=dict)
    unset: FrozenSet[str] = frozenset()

    def apply(self, environ: Mapping[str, str]) -> Dict[str, str]:
        result = {name: value for name, value in environ.items() if name not in self.unset}
        result.update(self.set)
        return result

    def then(self, later: "Env") -> "Env":
        """This, then `later` on top."""
        merged = {name: value for name, value in self.set.items() if name not in later.unset}
        merged.update(later.set)
        return Env(merged, (self.unset - frozenset(later.set)) | later.unset)

    def to_json(self) -> dict:
        return {"set": dict(self.set), "unset": sorted(self.unset)}

    @classmethod
    def from_json(cls, data: dict) -> "Env":
        return cls(dict(data["set"]), frozenset(data["unset"]))

    def __bool__(self) -> bool:
        return bool(self.set or self.unset)


def diff(before: Mapping[str, str], after: Mapping[str, str]) -> Env:
    changed = {name: value for name, value in after.items() if before.get(name) != value and name not in _SHELL_NOISE}
    gone = frozenset(name for name in before if name not in after and name not in _SHELL_NOISE)
    return Env(changed, gone)


@dataclasses.dataclass
class _Run:
    """Where and how the hooks stage runs."""

    spec: JobSpec
    environ: Mapping[str, str]  # the runtime's, once stage-in is done
    command: Sequence[str]
    task_log: Optional[Sink]
    log: object
    reuse: bool  # a later runtime in the same pod: what a record says was done is not done again
    exclude: Sequence[int] = ()  # our children that are not the hooks' (the guard)

    @property
    def code_dir(self) -> Path:
        """The downloaded code directory, else where the command runs."""
        if self.spec.code_url:
            from ma_runtime.stagein import code_dir

            return code_dir(self.spec)
        return Path.cwd()


def prepare(spec: JobSpec, environ: Mapping[str, str], command: Sequence[str], task_log: Optional[Sink], log,
            reuse: bool, exclude: Sequence[int] = ()) -> Env:
    """pip, CANN, the pre-start hook: the Env every worker gets. `reuse`: a later runtime in this pod."""
    run = _Run(spec, environ, command, task_log, log, reuse, exclude)
    if spec.hooks_pip_install:
        _pip_install(run)
    cann = _cann(run)
    hook = _pre_start(run, cann.apply(environ))
    total = cann.then(hook)
    if total:
        _write_debug_copy(spec, environ, cann, hook, log)
    return total


# -- pip ------------------------------------------------------------------------------------------------------


def _pip_install(run: _Run) -> None:
    found = _first_file(run.code_dir, REQUIREMENT_NAMES)
    if found is None:
        return
    python = job_python(run.environ, run.command)
    if python is None:
        raise HookFailed(f"cannot install {found}: no Python interpreter for the job on PATH",
                         hint="put the job's python3 on PATH (or set ANACONDA_DIR and DEFAULT_CONDA_ENV_NAME), "
                              "or turn the install off with MA_RUNTIME_PIP_INSTALL=off", stage="pip")
    record = _Record(run.spec.state_dir / "pip.json", run.reuse, _valid_pip, "the pip record",
                     "the requirements are installed again", run.log)
    key = {"file": str(found), "sha256": _sha256(found), "python": python}
    if record.matches(key):
        run.log.info("pip requirements already installed in this pod; not installed again", file=str(found))
        return
    argv = [python, "-m", "pip", "install", "--no-input", "--disable-pip-version-check", "-r", str(found),
            *_index_options(run.environ)]
    run.log.info("installing pip requirements", file=str(found), python=python)
    started = time.monotonic()
    result = _supervised(run, argv, run.environ, "pip install", "pip")
    if result.code != 0:
        what = result.why if result.hint else f"with exit code {result.code}"  # not started: why, in its words
        raise HookFailed(f"pip install -r {found.name} failed {what}", hint=result.hint or _pip_hint(run),
                         stage="pip", tail=result.tail, hook_exit_code=result.code)
    run.log.info("pip requirements installed", file=str(found), elapsed_s=round(time.monotonic() - started, 3))
    record.write(key, run.log, "pip install")


def _index_options(environ: Mapping[str, str]) -> List[str]:
    """The platform's pip source (MA_PIP_URL, and MA_PIP_HOST as trusted: it is often plain HTTP), unless the job
    chose its own index (PIP_INDEX_URL), which wins."""
    url = environ.get("MA_PIP_URL", "").strip()
    if not url or environ.get("PIP_INDEX_URL"):
        return []
    host = environ.get("MA_PIP_HOST", "").strip()
    return ["--index-url", url, *(["--trusted-host", host] if host else [])]


def _pip_hint(run: _Run) -> str:
    hint = "the lines above are pip's; fix the requirements file, or set MA_RUNTIME_PIP_INSTALL=off and install " \
           "the packages in the image"
    if run.spec.num_hosts > 10 and not run.environ.get("MA_PIP_URL"):
        hint += " (the platform removes its pip source from jobs of more than 10 nodes)"
    return hint


def job_python(environ: Mapping[str, str], command: Sequence[str]) -> Optional[str]:
    """The job's interpreter, not the runtime's: the platform's conda environment (ANACONDA_DIR and
    DEFAULT_CONDA_ENV_NAME), else the command's own python (`python3.9 train.py`), else python3, python on PATH."""
    conda, name = environ.get("ANACONDA_DIR"), environ.get("DEFAULT_CONDA_ENV_NAME")
    if conda and name:
        candidate = Path(conda) / "envs" / name / "bin" / "python"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    words = _command_words(command)
    path = environ.get("PATH", os.defpath)
    if words and _PYTHON_NAME.match(os.path.basename(words[0])):
        found = shutil.which(words[0], path=path)
        if found:
            return found
    for name in ("python3", "python"):
        found = shutil.which(name, path=path)
        if found:
            return found
    return None


# -- CANN -----------------------------------------------------------------------------------------------------


def _cann(run: _Run) -> Env:
    """CANN's set_env.sh sourced, unless off, absent, or applied already (its home variable names its toolkit)."""
    setting = run.spec.hooks_cann_set_env
    if setting == "off":
        return Env()
    script = _cann_script(setting, run.environ)
    if script is None:
        return Env()
    toolkit = os.path.realpath(script.parent)
    for name in CANN_HOME_VARS:
        value = run.environ.get(name)
        if value and (os.path.realpath(value) + "/").startswith(toolkit + "/"):
            run.log.info("CANN environment already applied; set_env.sh not sourced again", file=str(script),
                         **{name: value})
            return Env()
    started = time.monotonic()
    result = _source(run, script, run.environ, "CANN set_env.sh", "cann")
    if result.code != 0 or result.env is None:
        raise HookFailed(f"sourcing CANN's {script} failed: {result.why}",
                         hint=result.hint or "fix the toolkit's installation, point MA_RUNTIME_CANN_SET_ENV at the "
                                             "right set_env.sh, or set MA_RUNTIME_CANN_SET_ENV=off", stage="cann",
                         tail=result.tail, hook_exit_code=result.code)
    run.log.info("CANN environment applied", file=str(script), set=len(result.env.set),
                 unset=len(result.env.unset), elapsed_s=round(time.monotonic() - started, 3))
    return result.env


def _cann_script(setting: str, environ: Mapping[str, str]) -> Optional[Path]:
    if setting != "auto":
        path = Path(setting).expanduser()
        if not path.is_file():
            raise ConfigError(f"MA_RUNTIME_CANN_SET_ENV={setting}: no such file",
                              hint="name CANN's set_env.sh, or auto (the usual places), or off")
        return path
    home = environ.get("HOME", "")
    for candidate in CANN_SET_ENV_PATHS:
        path = Path(candidate.replace("~", home, 1) if candidate.startswith("~") else candidate)
        if (home or not candidate.startswith("~")) and path.is_file():
            return path
    return None


# -- the pre-start hook ---------------------------------------------------------------------------------------


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
    words = _command_words(command)
    files = [word for word in words[1:] if not word.startswith("-") and os.path.isfile(word)]
    scripts = [word for word in files if word.endswith((".py", ".sh"))]
    if words and "/" in words[0] and os.path.isfile(words[0]):
        files.append(words[0])
    chosen = (scripts or files or [None])[0]
    return Path(os.path.abspath(chosen)) if chosen else None


def _command_words(command: Sequence[str]) -> List[str]:
    words = last_simple_command(command[0]) if is_shell_form(command) else list(command)
    # `VAR=value python train.py`: the assignments are not the program.
    while words and "=" in words[0] and _NAME.match(words[0].split("=", 1)[0]):
        words = words[1:]
    return words


def _pre_start(run: _Run, environ: Dict[str, str]) -> Env:
    if run.spec.hooks_pre_start == "off":
        return Env()
    hook, ignored = find_hook(run.command, run.code_dir)
    for other in ignored:
        run.log.warning("pre-start hook not run: only one runs", path=str(other), runs=str(hook))
    if hook is None:
        return Env()
    record = _Record(run.spec.state_dir / "pre-start.json", run.reuse, _valid_pre_start, "the pre-start record",
                     "the pre-start script runs again", run.log, private=True)
    key = {"file": str(hook), "sha256": _sha256(hook)}
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
        result = _source(run, hook, environ, hook.name, "pre-start")
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


def _valid_pip(document) -> dict:
    """pip.json: the requirements file, its hash and the interpreter that installed it."""
    records.exactly(records.mapping(document, "the record"), ("file", "sha256", "python"), "the record")
    for name in ("file", "sha256", "python"):
        records.text(document[name], f"`{name}`")
    return document


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


def _python_hook(run: _Run, hook: Path, environ: Mapping[str, str]) -> "_Result":
    python = job_python(environ, run.command)
    if python is None:
        return _Result(127, None, [], why="no Python interpreter for the job on PATH to run it with")
    return _with_env_file(run, lambda env: _supervised(run, [python, str(hook)], env, hook.name, "pre-start"),
                           environ)


def _adopt_leftovers(run: _Run) -> List[int]:
    """What the hook left running (a daemon it started) lives on as the job's service."""
    left = children.adopt_services(run.exclude)
    if left:
        run.log.info("the pre-start script left processes running: kept as the job's services until it ends",
                     pids=left[:20])
    return left


# -- running a hook -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Result:
    code: int  # the exit status (128+N: killed by signal N)
    env: Optional[Env]  # what it did to the environment; None when that could not be read
    tail: List[str]
    why: str = ""
    hint: str = ""  # what to do, when it is not the step's usual (E2BIG)


def _source(run: _Run, script: Path, environ: Mapping[str, str], name: str, step: str) -> _Result:
    """`script` sourced by bash in the code directory; the environment's difference."""
    bash = shutil.which("bash", path=environ.get("PATH", os.defpath)) or "/bin/sh"

    def source(env: Dict[str, str]) -> _Result:
        with _scratch("before") as before, _scratch("after") as after:
            argv = [bash, "-c", _SOURCE, name, sys.executable, _DUMP, str(before), str(after), str(script), _RAW_DUMP]
            result = _supervised(run, argv, env, name, step)
            dumps = [_read_dump(before), _read_dump(after)]
            raw = _read_raw_dump(Path(f"{after}.raw")) if dumps[1] is None else None
        if result.code != 0:
            return result
        if None in dumps:
            result.code, result.why, result.hint = 125, *_unread_why(raw, str(after))
            return result
        result.env = diff(dumps[0], dumps[1])
        return result

    return _with_env_file(run, source, environ)


def _unread_why(raw: Optional[Dict[str, str]], after: str) -> Tuple[str, str]:
    """(why, hint) the environment after a sourced file could not be read: more than exec takes (the raw dump shows
    it), else the file ended its shell before the dump (the step's own hint)."""
    dump_argv = [sys.executable, "-I", "-S", "-c", _DUMP, after, "0"]
    if raw is not None and exceeds_exec_limits(dump_argv, raw):
        return too_large_for_exec(dump_argv, raw), TOO_LARGE_HINT
    return ("its environment could not be read: a sourced script must not exec, nor end with exit after setting an "
            "EXIT trap of its own"), ""


def _fits_exec(result: "_Result", environ: Mapping[str, str]) -> "_Result":
    """`result`, without an environment (a failure, its own status kept) when the environment it leaves is more
    than exec takes: every later start (the command's) would fail with E2BIG, so the step that did it is named
    now."""
    if result.code == 0 and result.env is not None:
        after = result.env.apply(environ)
        if exceeds_exec_limits([], after):
            return _Result(result.code, None, result.tail, why=too_large_for_exec([], after), hint=TOO_LARGE_HINT)
    return result


def _read_raw_dump(path: Path) -> Optional[Dict[str, str]]:
    """`NAME=value` strings, NUL-separated (bash's builtins' dump); None when there is none."""
    try:
        data = read_regular(path, RECORD_LIMIT)
    except OSError:
        return None
    if data is None:
        return None
    pairs = (item.split(b"=", 1) for item in data.split(b"\0") if b"=" in item)
    return {os.fsdecode(name): os.fsdecode(value) for name, value in pairs}


def _with_env_file(run: _Run, start, environ: Mapping[str, str]) -> _Result:
    """`start(env)` with MA_HOOK_ENV_FILE naming a fresh file; its NAME=value lines are applied on top."""
    with _scratch("env", create=True) as env_file:
        result = start({**environ, ENV_FILE_VAR: str(env_file)})
        if result.code != 0:
            return result
        try:
            data = read_regular(env_file, ENV_FILE_LIMIT) or b""
            written = parse_env_file(data.decode("utf-8", "surrogateescape"))
        except (OSError, ValueError) as exc:  # replaced by a FIFO, grown past the limit, a bad line
            return _Result(1, None, result.tail, why=f"{ENV_FILE_VAR}: {exc}")
    result.env = (result.env or Env()).then(Env(written))
    return _fits_exec(result, environ)


def _supervised(run: _Run, argv: Sequence[str], env: Mapping[str, str], name: str, step: str) -> _Result:
    """Runs like a worker, output prefixed on the console and in the task log, within the hook timeout."""
    from ma_runtime import logs
    from ma_runtime.supervise.worker import spawn
    from ma_runtime.verdict import tail

    sinks = [Sink(1, "<stdout>"), *([run.task_log.as_console()] if run.task_log else [])]
    try:
        worker = spawn(argv, env, str(run.code_dir), sinks, [logs.stderr_sink(), *sinks[1:]], name=name,
                       console_prefix=_PREFIXES[step])
    except RuntimeFailure as failure:  # not started (E2BIG: what an earlier step exported): the step's failure
        return _Result(int(failure.exit_code), None, [], why=failure.reason, hint=failure.hint)
    seconds = run.spec.hooks_timeout_seconds
    code = lifecycle.wait(worker.popen, seconds)
    if code is None:
        run.log.warning(f"{name} timed out: stopping it", timeout_s=seconds, pid=worker.pid)
        code = lifecycle.exit_code(lifecycle.stop(worker.popen, run.spec.stop_grace_seconds, group=True))
        worker.join_output(1.0)
        return _Result(code or 1, None, tail(worker), why=f"timed out after {seconds:g} s "
                       "(MA_RUNTIME_HOOK_TIMEOUT_SECONDS)")
    worker.join_output(1.0)
    why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    return _Result(lifecycle.exit_code(code), None, tail(worker), why=why)


def parse_env_file(text: str) -> Dict[str, str]:
    """`NAME=value` lines, `NAME<<DELIM` ... `DELIM` for a multi-line value; blank lines and `#` comments skipped."""
    result: Dict[str, str] = {}
    lines = iter(enumerate(text.split("\n"), 1))
    for number, line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            name, delimiter = line.split("<<", 1)
            value = _until(lines, delimiter.strip(), number)
        elif "=" in line:
            name, value = line.split("=", 1)
        else:
            # Its words are not repeated: a line such as `API_TOKEN s3cret` would put a secret in the message.
            raise ValueError(f"line {number} is not NAME=value (no `=`)")
        if not _NAME.match(name):
            raise ValueError(f"line {number}: what comes before `=` or `<<` is not a variable name (letters, digits "
                             "and _, not starting with a digit)")
        if "\0" in value:  # no environment can hold it: exec would refuse the worker
            raise ValueError(f"line {number}: the value of {name} holds a NUL byte")
        result[name] = value
    return result


def _until(lines, delimiter: str, start: int) -> str:
    if not delimiter:
        raise ValueError(f"line {start}: `NAME<<` needs a delimiter")
    collected = []
    for _number, line in lines:
        if line == delimiter:
            return "\n".join(collected)
        collected.append(line)
    raise ValueError(f"line {start}: no closing {delimiter!r} for the multi-line value")


# -- records and files ----------------------------------------------------------------------------------------


class _Record:
    """A JSON record in the state folder: what was done in this pod (read only by a later runtime there). One that
    does not validate is set aside (records.py), and what it recorded is done again."""

    def __init__(self, path: Path, reuse: bool, validate, what: str, then: str, log, private: bool = False):
        self.path, self.private = path, private
        self.previous = records.load(path, validate, log, what, then=then) if reuse else None

    def matches(self, key: Mapping[str, str]) -> Optional[dict]:
        previous = self.previous
        ok = isinstance(previous, dict) and all(previous.get(name) == value for name, value in key.items())
        return previous if ok else None

    def write(self, document: dict, log, what: str) -> None:
        """Best effort: an unusable state folder costs a later runtime in this pod a second run, not the job."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # The hook's raw environment may hold a secret: readable by the job's user alone, and never logged.
            write_atomically(self.path, json.dumps(document), mode=0o600 if self.private else 0o644)
        except OSError as exc:
            log.warning(f"could not record the {what}: a later runtime in this pod will run it again",
                        path=str(self.path), error=exc.strerror or str(exc))


class _scratch:
    """A file of one hook run in a private folder of its own (mode 0700, under TMPDIR), removed after it: the
    state folder may be unusable (a read-only mount), which costs the records, not the hooks."""

    def __init__(self, kind: str, create: bool = False):
        self.kind, self.create = kind, create
        self.folder: Optional[str] = None

    def __enter__(self) -> Path:
        import tempfile

        self.folder = tempfile.mkdtemp(prefix="ma-hook-")
        path = Path(self.folder) / self.kind
        if self.create:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        return path

    def __exit__(self, *_exc) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _read_dump(path: Path) -> Optional[Dict[str, str]]:
    """The environment a dump holds; None when there is none, or none that can be used (a scratch file of this run:
    nothing to set aside)."""
    try:
        return records.read(path, _valid_dump, RECORD_LIMIT)
    except records.Invalid:
        return None


def _valid_dump(document) -> Dict[str, str]:
    records.mapping(document, "the dump")
    records.integer(records.field(document, "status"), "`status`")
    return records.strings(records.field(document, "environ"), "`environ`")


def _first_file(folder: Path, names: Sequence[str]) -> Optional[Path]:
    for name in names:
        if (folder / name).is_file():
            return folder / name
    return None


def _sha256(path: Path) -> str:
    """The file's content hash, "" when it cannot be read (what runs it then says why, in its own words)."""
    import hashlib  # only when there is a file to record: loading OpenSSL costs 4 ms of every start

    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return ""


def debug_path(spec: JobSpec) -> Path:
    return spec.log_dir / f"{spec.log_stem}-hook-env.json"


def _write_debug_copy(spec: JobSpec, environ: Mapping[str, str], cann: Env, hook: Env, log) -> None:
    """What CANN and the hook added, for whoever debugs the job: secrets masked, by name and by value."""
    masker = Masker.from_environ({**environ, **cann.set, **hook.set})
    document = masker.data({"cann": cann.to_json(), "pre_start": hook.to_json()})
    try:
        write_atomically(debug_path(spec), json.dumps(document, indent=1, ensure_ascii=False) + "\n")
    except OSError as exc:
        log.warning("could not write the hooks' environment", path=str(debug_path(spec)), error=str(exc))

