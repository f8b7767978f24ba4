"""Exit codes, failure categories and the exceptions that carry them.

This is the one table of the runtime's own exit codes; the README repeats it.
A training command's own exit code passes through unchanged, and a death by
signal N becomes 128+N, so the runtime's codes sit where shells and sysexits(3)
leave room: 70 and 78 are EX_SOFTWARE and EX_CONFIG, 79-85 follow EX_CONFIG.
"""

import enum
from typing import Optional, Sequence


class ExitCode(enum.IntEnum):
    OK = 0
    INTERNAL_ERROR = 70
    BAD_CONFIGURATION = 78
    PREFLIGHT_FAILED = 79
    STORAGE_FAILED = 80
    TIMED_OUT = 81
    RESTARTS_EXHAUSTED = 82
    HANG_DETECTED = 83
    DEVICE_NOT_RELEASED = 84
    HOOK_FAILED = 85
    COMMAND_NOT_EXECUTABLE = 126
    COMMAND_NOT_FOUND = 127


class Category(str, enum.Enum):
    """Who has to act: the job's author, the platform, or the node/network."""

    USER = "user"
    PLATFORM = "platform"
    INFRASTRUCTURE = "infrastructure"


class RuntimeFailure(Exception):
    """A failure of one of the runtime's own stages; ends the run with `exit_code`."""

    exit_code = ExitCode.INTERNAL_ERROR
    category = Category.PLATFORM
    stage = "runtime"

    def __init__(self, reason: str, hint: str = "", stage: Optional[str] = None):
        super().__init__(reason)
        self.reason = reason
        self.hint = hint
        if stage:
            self.stage = stage


class ConfigError(RuntimeFailure):
    exit_code = ExitCode.BAD_CONFIGURATION
    category = Category.USER
    stage = "spec"


class CommandNotFound(RuntimeFailure):
    exit_code = ExitCode.COMMAND_NOT_FOUND
    category = Category.USER
    stage = "launch"


class CommandNotExecutable(RuntimeFailure):
    exit_code = ExitCode.COMMAND_NOT_EXECUTABLE
    category = Category.USER
    stage = "launch"


def exit_code_of_status(returncode: int) -> int:
    """Popen-style return code (negative = killed by signal) to a shell exit code."""
    return 128 - returncode if returncode < 0 else returncode


class LaunchTimedOut(RuntimeFailure):
    """A launcher could not start in time: worker-0's address never resolved."""

    exit_code = ExitCode.TIMED_OUT
    category = Category.INFRASTRUCTURE
    stage = "launch"


class PreflightFailed(RuntimeFailure):
    """A bad node: the platform should reschedule the job elsewhere."""

    exit_code = ExitCode.PREFLIGHT_FAILED
    category = Category.INFRASTRUCTURE
    stage = "preflight"


class DeviceNotReleased(RuntimeFailure):
    """Between attempts, the accelerator tool still lists processes on this container's devices.

    Infrastructure: whatever holds them (a rank stuck in the driver, another container, a hung
    driver) is the node's problem, and relaunching onto a dirty device fails again or worse.
    """

    exit_code = ExitCode.DEVICE_NOT_RELEASED
    category = Category.INFRASTRUCTURE
    stage = "restart"


class HookFailed(RuntimeFailure):
    """pip requirements, CANN's set_env.sh or the pre-start hook failed or timed out: the job's own set-up, so
    the job's author acts; the tail of its output goes into the termination message."""

    exit_code = ExitCode.HOOK_FAILED
    category = Category.USER
    stage = "pre-start"

    def __init__(self, reason: str, hint: str = "", stage: Optional[str] = None, tail: Sequence[str] = (),
                 hook_exit_code: Optional[int] = None):
        super().__init__(reason, hint, stage)
        self.tail = list(tail)
        self.hook_exit_code = hook_exit_code
