"""What a check returns, and the contract every check module follows.

A check module exposes `run(spec, environ) -> List[Result]`: one Result per
thing it measured (`disk-size` has one per target, root/shm/cache). Checks never
raise for a bad node; they report it. The runner times them, turns the failures
of warn-only checks into warnings, logs one `item=` line per Result, and decides.

A check that may wait long (`dns`) also takes `progress`, a `Progress` callback:
checks do not log, so they hand the runner a message and its fields instead.
"""

import dataclasses
import enum
import errno
import os
import signal
import subprocess
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from ma_runtime import children
from ma_runtime.errors import too_large_for_exec

# A message and its fields, which the runner logs while a check is still waiting.
Progress = Callable[[str, Dict[str, Any]], None]


class Status(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    WARN = "warn"
    SKIP = "skip"


@dataclasses.dataclass
class Result:
    item: str  # dns, disk-size, ulimit, gpu, npu
    status: Status
    code: str  # machine-readable, "<item>.<reason>", e.g. "gpu.too-few"; "ok" on a pass
    value: Any = None  # what was measured
    threshold: Any = None  # what it was compared with
    hint: str = ""  # one line: what to do about it
    target: Optional[str] = None  # disk-size: root/shm/cache; ulimit: memlock/nofile/stack/nproc
    unit: Optional[str] = None  # GB, KB, count, ...
    detail: Dict[str, Any] = dataclasses.field(default_factory=dict)  # anything else worth a look
    duration_ms: Optional[float] = None  # set by the runner when the check leaves it None

    def to_dict(self) -> Dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        return data


def passed(item: str, value: Any = None, threshold: Any = None, **extra: Any) -> Result:
    return Result(item, Status.PASS, "ok", value, threshold, **extra)


def skipped(item: str, reason: str, **extra: Any) -> Result:
    """A check that does not apply here; `reason` says why, in the hint."""
    return Result(item, Status.SKIP, f"{item}.not-applicable", hint=reason, **extra)


class ToolError(Exception):
    """An external tool (nvidia-smi, npu-smi) that is missing, hangs, or fails."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code  # "missing", "timeout" or "failed"
        self.message = message


def run_tool(argv: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None) -> Tuple[int, str, str]:
    """(returncode, stdout, stderr) of a short-lived tool; its whole group is killed after `timeout` s."""
    def start() -> subprocess.Popen:
        return subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace", env=env,
            start_new_session=True,
        )

    try:
        # Owned: the supervisor's reaping loop, if it runs meanwhile, must not take the tool's status.
        with children.owned(start) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                # The group, not just the tool: a helper it forked would hold the pipes open.
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise ToolError("timeout", f"{argv[0]} did not answer within {timeout:g} s") from None
    except FileNotFoundError:
        raise ToolError("missing", f"{argv[0]} not found on PATH") from None
    except OSError as exc:
        why = too_large_for_exec(argv, os.environ if env is None else env) if exc.errno == errno.E2BIG else exc.strerror
        raise ToolError("failed", f"{argv[0]} could not run: {why}") from None
    return proc.returncode, out, err
