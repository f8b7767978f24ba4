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
from typing import Any, Callable, Dict, Optional

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


