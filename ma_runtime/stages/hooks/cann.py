"""CANN's set_env.sh, sourced once, unless off, absent or applied already."""

import os
import time
from pathlib import Path
from typing import Mapping, Optional

from ma_runtime.errors import ConfigError, HookFailed
from ma_runtime.stages.hooks.env import Env
from ma_runtime.stages.hooks.running import HookStage, source

# CANN's installers put set_env.sh here (root installs, then a user's): the first that exists is sourced.
CANN_SET_ENV_PATHS = ("/usr/local/Ascend/ascend-toolkit/set_env.sh", "/usr/local/Ascend/cann/set_env.sh",
                      "~/Ascend/ascend-toolkit/set_env.sh", "~/Ascend/cann/set_env.sh")
# set_env.sh exports these, naming the toolkit: set to a folder of that toolkit means it is applied already.
CANN_HOME_VARS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")


def set_env(run: HookStage) -> Env:
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
    result = source(run, script, run.environ, "CANN set_env.sh", "cann")
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
