"""The old home of torchrun's root-cause parser, now launch/torchrun.py's `root_cause`: kept until its last
caller (bootstrap) reads it through the launcher registry."""

from ma_runtime.launch.base import RootCause
from ma_runtime.launch.torchrun import root_cause as torchrun_root_cause

__all__ = ["RootCause", "torchrun_root_cause"]
