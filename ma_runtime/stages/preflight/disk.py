"""`disk-size`: the root filesystem, /dev/shm and /cache are big enough (docs/platform.md, "Preflight checks").

The platform's rule is "> 32 GB" for the item named disk-*size*: it checks that
the flavour's disks are attached at their full size, so the threshold is on the
filesystem's **total** size, in decimal GB (10^9 bytes, as disks are sold). Free
space is measured and reported next to it. A missing /cache is skipped (not
every flavour has one); a missing root or /dev/shm is a failure.

Each target has its own fix, and its hint says that one: / lies on the node's
disk; /dev/shm is memory, sized by the container runtime (`--shm-size`) or a
memory-backed emptyDir, never by a larger disk; /cache is the flavour's local disk.
"""

import os
from pathlib import Path
from typing import List

from ma_runtime.stages.preflight.model import Result, Status, passed, skipped

ITEM = "disk-size"
GB = 10**9
_OPTIONAL_TARGETS = ("cache",)
_SHM_SIZE = ("docker/podman run --shm-size=8g; Kubernetes: an emptyDir volume with medium: Memory and a sizeLimit, "
             "mounted at /dev/shm")
# target -> how to get a larger one
_FIXES = {
    "root": "the container's root filesystem lies on the node's disk: run on a node with a larger disk",
    "shm": f"shared memory is RAM, not disk: give the container more of it ({_SHM_SIZE})",
    "cache": "/cache is the flavour's local disk: choose a flavour with a larger /cache",
}
# target -> what to do when its filesystem is not there at all
_MOUNTS = {
    "root": "the container has no root filesystem there; check the image and MA_RUNTIME_PREFLIGHT_DISK_TARGETS",
    "shm": f"the container has no shared memory mounted; give it some ({_SHM_SIZE})",
}


def run(spec, environ) -> List[Result]:
    return [
        check_target(target, path, getattr(spec, f"preflight_{target}_min_gb"))
        for target, path in spec.preflight_disk_targets
    ]


def check_target(target: str, path: Path, minimum_gb: float) -> Result:
    try:
        stats = os.statvfs(path)
    except FileNotFoundError:
        if target in _OPTIONAL_TARGETS:
            return skipped(ITEM, f"{path} does not exist on this flavour", target=target)
        return Result(ITEM, Status.FAIL, "disk-size.missing", threshold=minimum_gb, target=target, unit="GB",
                      hint=f"{path} does not exist: {_MOUNTS.get(target, 'mount it')}")
    except OSError as exc:
        return Result(ITEM, Status.FAIL, "disk-size.unreadable", threshold=minimum_gb, target=target, unit="GB",
                      hint=f"cannot stat {path}: {exc.strerror}")
    total_gb = round(stats.f_blocks * stats.f_frsize / GB, 3)
    free_gb = round(stats.f_bavail * stats.f_frsize / GB, 3)
    detail = {"path": str(path), "total_gb": total_gb, "free_gb": free_gb}
    if total_gb > minimum_gb:
        return passed(ITEM, total_gb, minimum_gb, target=target, unit="GB", detail=detail)
    return Result(
        ITEM, Status.FAIL, "disk-size.too-small", total_gb, minimum_gb, target=target, unit="GB", detail=detail,
        hint=f"{path} is {total_gb:g} GB, the job needs more than {minimum_gb:g} GB: {_FIXES[target]}; "
        f"or lower MA_RUNTIME_PREFLIGHT_{target.upper()}_MIN_GB",
    )
