"""`ulimit`: the limits RDMA (InfiniBand/RoCE) training needs (docs/platform.md, "Preflight checks").

Checked when an InfiniBand/RoCE device is present (/sys/class/infiniband has
entries) or when MA_RUNTIME_PREFLIGHT_ULIMIT=always. Before judging, a soft
limit that is too low is raised to its hard limit (to just past the threshold
when the hard limit is unlimited: an unlimited stack would change every
worker thread's stack size), and a hard limit that is too low is raised where
the process may (CAP_SYS_RESOURCE). The workers inherit these limits from the
runtime. A limit that cannot be raised is kept as it is, reported, never a
crash. Limits that already pass are left alone. Memory limits are in KB, as
`ulimit -l`/`-s` show them; a limit passes when it is greater than the minimum.
"""

import os
import resource
from typing import List, NamedTuple, Optional

from ma_runtime.stages.preflight.model import Result, Status, passed, skipped

ITEM = "ulimit"
INFINIBAND = "/sys/class/infiniband"


class Limit(NamedTuple):
    target: str
    resource: int
    bytes_per_unit: int
    unit: str
    setting: str  # the JobSpec field holding the minimum


LIMITS = (
    Limit("memlock", resource.RLIMIT_MEMLOCK, 1024, "KB", "preflight_memlock_min_kb"),
    Limit("nofile", resource.RLIMIT_NOFILE, 1, "count", "preflight_nofile_min"),
    Limit("stack", resource.RLIMIT_STACK, 1024, "KB", "preflight_stack_min_kb"),
    Limit("nproc", resource.RLIMIT_NPROC, 1, "count", "preflight_nproc_min"),
)


def run(spec, environ) -> List[Result]:
    reason = _not_applicable(spec.preflight_ulimit)
    if reason:
        return [skipped(ITEM, reason)]
    return [check_limit(limit, getattr(spec, limit.setting)) for limit in LIMITS]


def _not_applicable(mode: str) -> Optional[str]:
    if mode == "never":
        return "MA_RUNTIME_PREFLIGHT_ULIMIT=never"
    if mode == "always":
        return None
    try:
        if os.listdir(INFINIBAND):
            return None
    except OSError:
        pass
    return f"no InfiniBand/RoCE device in {INFINIBAND} (force with MA_RUNTIME_PREFLIGHT_ULIMIT=always)"


def check_limit(limit: Limit, minimum: int) -> Result:
    soft_before, _ = resource.getrlimit(limit.resource)
    refused = None
    if not _passes(soft_before, limit, minimum):
        refused = _raise(limit, (minimum + 1) * limit.bytes_per_unit)
    soft, hard = resource.getrlimit(limit.resource)
    value = _shown(soft, limit)
    detail = {"soft_before": _shown(soft_before, limit), "hard": _shown(hard, limit)}
    if refused:
        detail["not_raised"] = refused
    if _passes(soft, limit, minimum):
        return passed(ITEM, value, minimum, target=limit.target, unit=limit.unit, detail=detail)
    return Result(
        ITEM, Status.FAIL, "ulimit.too-low", value, minimum, target=limit.target, unit=limit.unit, detail=detail,
        hint=f"{limit.target} is {value}, needs more than {minimum}: raise the container's hard limit "
        f"(docker --ulimit {limit.target}=..., or the node's limits.conf)",
    )


def _passes(raw: int, limit: Limit, minimum: int) -> bool:
    return raw == resource.RLIM_INFINITY or raw // limit.bytes_per_unit > minimum


def _raise(limit: Limit, needed: int) -> Optional[str]:
    """Raises the soft limit (and the hard one if it must) to `needed`; returns why not, if refused."""
    soft, hard = resource.getrlimit(limit.resource)
    if hard != resource.RLIM_INFINITY and hard < needed:
        try:
            resource.setrlimit(limit.resource, (needed, needed))
            return None
        except (ValueError, OSError) as exc:
            # Root without CAP_SYS_RESOURCE lands here: keep the hard limit, raise the soft one to it.
            reason = f"hard limit stays {_shown(hard, limit)}: {exc}"
        target = hard
    else:
        reason = None
        target = hard if hard != resource.RLIM_INFINITY else needed
    try:
        resource.setrlimit(limit.resource, (target, hard))
    except (ValueError, OSError) as exc:
        reason = f"soft limit stays {_shown(soft, limit)}: {exc}"
    return reason


def _shown(raw: int, limit: Limit):
    return "unlimited" if raw == resource.RLIM_INFINITY else raw // limit.bytes_per_unit
