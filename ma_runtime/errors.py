"""Exit codes, failure categories and the exceptions that carry them.

This is the one table of the runtime's own exit codes; the README repeats it.
A training command's own exit code passes through unchanged, and a death by
signal N becomes 128+N, so the runtime's codes sit where shells and sysexits(3)
leave room: 70 and 78 are EX_SOFTWARE and EX_CONFIG, 79-85 follow EX_CONFIG.
"""

import enum
import errno
import os
from typing import Mapping, Optional, Sequence, Tuple


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
    STOPPED_FOR_JOB = 86  # another node failed, hung or was lost first (coordinator.py)
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


# --------------------------------------------------------------------------- exec's size limits (E2BIG)

# Linux's limit on one argument or one NAME=value string, its NUL included (32 pages: MAX_ARG_STRLEN).
MAX_ARG_STRLEN = 32 * 4096
# The floor and the ceiling of the total the kernel allows (ARG_MAX, and 3/4 of _STK_LIM): fs/exec.c.
_ARG_MAX_FLOOR = 32 * 4096
_ARG_MAX_CEILING = 6 << 20
_POINTER = 8


class TooLargeForExec(OSError):
    """An exec refused with E2BIG, its text the sizes (`too_large_for_exec`): for callers that log `str(exc)`."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]):
        super().__init__(errno.E2BIG, too_large_for_exec(argv, env))

    def __str__(self) -> str:
        return self.strerror


def too_large_for_exec(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """The one line for an exec refused with E2BIG: `the environment (or the arguments) is too large for exec: N
    bytes; largest: NAME (M bytes)`, and which of Linux's two limits it is past."""
    total, largest, size = exec_sizes(argv, env)
    line = f"the environment (or the arguments) is too large for exec: {total} bytes; largest: {largest} ({size} bytes)"
    if size > MAX_ARG_STRLEN:
        return line + ", over Linux's 128 KiB limit on one string (MAX_ARG_STRLEN)"
    return line + f", over the {exec_total_limit()} bytes Linux takes for all of them (a quarter of `ulimit -s`)"


# Said with every E2BIG: what to do about it.
TOO_LARGE_HINT = ("pass large data in a file and its path in the variable or argument; the environment is the job's, "
                  "with what the hooks exported (the pre-start script, MA_HOOK_ENV_FILE, CANN's set_env.sh)")


def exceeds_exec_limits(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether Linux would refuse an exec of `argv` with `env` (E2BIG): one string over MAX_ARG_STRLEN, or all of them
    with their pointers over the total (`exec_total_limit`)."""
    total, _, size = exec_sizes(argv, env)
    return size > MAX_ARG_STRLEN or total + _POINTER * (max(len(argv), 1) + len(env)) > exec_total_limit()


def exec_sizes(argv: Sequence[str], env: Mapping[str, str]) -> Tuple[int, str, int]:
    """(bytes of every argument and NAME=value string with its NUL, the largest one's name, its bytes). An
    argument is named `argument N` (0: the program)."""
    total, largest, size = 0, "", -1
    for index, word in enumerate(argv):
        length = len(os.fsencode(word)) + 1
        total += length
        if length > size:
            largest, size = f"argument {index}", length
    for name, value in env.items():
        length = len(os.fsencode(name)) + len(os.fsencode(value)) + 2
        total += length
        if length > size:
            largest, size = name, length
    return total, largest, max(size, 0)


def exec_total_limit() -> int:
    """What Linux allows for every argument and environment string of one exec, pointers included: a quarter of the
    stack's soft limit, at least 128 KiB, at most 6 MiB (fs/exec.c)."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_STACK)[0]
    quarter = _ARG_MAX_CEILING if soft == resource.RLIM_INFINITY else soft // 4
    return max(min(quarter, _ARG_MAX_CEILING), _ARG_MAX_FLOOR)
