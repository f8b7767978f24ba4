"""The hooks stage's entry (`run_hooks`): pip, CANN, the pre-start hook in turn, and the masked debug copy of
what they set; how the hooks run is the package's docstring."""

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
