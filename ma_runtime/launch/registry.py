"""The launchers by MA_RUN_METHOD name: one module each in this package (launch/base.py names their interface).

spec.py reads METHODS at start-up to validate MA_RUN_METHOD, so this module
imports nothing heavy: a launcher module is imported by name only when the plan
asks for it. Adding a launcher is its module plus its name here (`-` in the name is `_` in the module's).
"""

import importlib
from types import ModuleType

# The order of the list of valid values in the error for a bad MA_RUN_METHOD.
METHODS = ("rtf", "torchrun", "msrun", "mpirun", "pytorch-gpu", "tensorflow-gpu", "plain")


def launcher(name: str) -> ModuleType:
    if name not in METHODS:
        raise ValueError(f"no launcher {name!r}: the launchers are {', '.join(METHODS)}")
    # A module name has no hyphen: pytorch-gpu lives in pytorch_gpu.py.
    return importlib.import_module(f"{__package__}.{name.replace('-', '_')}")


def settings() -> tuple:
    """Every launcher's own settings (its module's `SETTINGS` rows), in METHODS order: spec's table collects them,
    so a launcher's knobs are declared beside the code that reads them. Imports every launcher module (standard
    library only, a few milliseconds)."""
    return tuple(setting for name in METHODS for setting in getattr(launcher(name), "SETTINGS", ()))
