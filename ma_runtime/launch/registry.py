"""The launchers by MA_RUN_METHOD name: one module each in this package, whose `LAUNCHER` implements
launch/base.py's `Launcher`.

spec/table.py reads METHODS at start-up to validate MA_RUN_METHOD, so this module
imports nothing heavy: a launcher module is imported by name only when the plan,
or a list of every launcher's traits (supervise/ranks.py), asks for it. Adding a
launcher is its module plus its name here (`-` in the name is `_` in the module's).
"""

import importlib
from typing import TYPE_CHECKING, Tuple

if TYPE_CHECKING:  # the launchers' base, for the annotations only: importing it here would cost every start-up
    from ma_runtime.launch.base import Launcher

# The order of the list of valid values in the error for a bad MA_RUN_METHOD.
METHODS = ("rtf", "torchrun", "msrun", "mpirun", "ray", "pytorch-gpu", "tensorflow-gpu", "plain")


def launcher(name: str) -> "Launcher":
    if name not in METHODS:
        raise ValueError(f"no launcher {name!r}: the launchers are {', '.join(METHODS)}")
    return _module(name).LAUNCHER


def launchers() -> Tuple["Launcher", ...]:
    """Every launcher, in METHODS' order."""
    return tuple(launcher(name) for name in METHODS)


def settings() -> tuple:
    """Every launcher's own settings (its module's `SETTINGS` rows), in METHODS order: spec's table collects them,
    so a launcher's knobs are declared beside the code that reads them. Imports every launcher module (standard
    library only, a few milliseconds)."""
    return tuple(setting for name in METHODS for setting in getattr(_module(name), "SETTINGS", ()))


def _module(name: str):
    # A module name has no hyphen: pytorch-gpu lives in pytorch_gpu.py.
    return importlib.import_module(f"{__package__}.{name.replace('-', '_')}")
