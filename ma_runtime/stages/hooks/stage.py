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

import json
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ma_runtime.spec import JobSpec
from ma_runtime.stages.hooks import cann, pip, pre_start
from ma_runtime.stages.hooks.env import Env
from ma_runtime.stages.hooks.running import HookStage
from ma_runtime.util.files import write_atomically
from ma_runtime.util.output import Sink
from ma_runtime.util.redact import Masker


def run_hooks(spec: JobSpec, environ: Mapping[str, str], command: Sequence[str], task_log: Optional[Sink], log,
            reuse: bool, exclude: Sequence[int] = ()) -> Env:
    """pip, CANN, the pre-start hook: the Env every worker gets. `reuse`: a later runtime in this pod."""
    run = HookStage(spec, environ, command, task_log, log, reuse, exclude)
    if spec.hooks_pip_install:
        pip.install(run)
    cann_env = cann.set_env(run)
    hook_env = pre_start.run_hook(run, cann_env.apply(environ))
    total = cann_env.then(hook_env)
    if total:
        _write_debug_copy(spec, environ, cann_env, hook_env, log)
    return total


def debug_path(spec: JobSpec) -> Path:
    return spec.log_dir / f"{spec.log_stem}-hook-env.json"


def _write_debug_copy(spec: JobSpec, environ: Mapping[str, str], cann_env: Env, hook_env: Env, log) -> None:
    """What CANN and the hook added, for whoever debugs the job: secrets masked, by name and by value."""
    masker = Masker.from_environ({**environ, **cann_env.set, **hook_env.set})
    document = masker.data({"cann": cann_env.to_json(), "pre_start": hook_env.to_json()})
    try:
        write_atomically(debug_path(spec), json.dumps(document, indent=1, ensure_ascii=False) + "\n")
    except OSError as exc:
        log.warning("could not write the hooks' environment", path=str(debug_path(spec)), error=str(exc))
