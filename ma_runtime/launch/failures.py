"""Which rank failed first, from what a launcher prints when it gives up.

torchrun exits 1 whatever its ranks did; its summary on stderr names the root
cause (the first observed failure), e.g.:

    Root Cause (first observed failure):
    [0]:
      time      : 2026-11-22_05:00:49
      host      : localhost
      rank      : 1 (local_rank: 1)
      exitcode  : 3 (pid: 19876)

The runtime reports that rank and its exit code instead of torchrun's 1.
"""

import re
from typing import NamedTuple, Optional, Sequence

_ROOT = "Root Cause (first observed failure):"
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


class RootCause(NamedTuple):
    rank: int
    returncode: int  # Popen style: -N for death by signal N


def torchrun_root_cause(lines: Sequence[str]) -> Optional[RootCause]:
    """The root cause from the last summary in `lines` (the launcher's output tail), or None."""
    start = max((index for index, line in enumerate(lines) if _ROOT in line), default=None)
    if start is None:
        return None
    rank = returncode = None
    for line in lines[start + 1:]:
        rank = rank if rank is not None else _first_int(_RANK, line)
        returncode = returncode if returncode is not None else _first_int(_EXIT, line)
    if rank is None or returncode is None:
        return None
    return RootCause(rank, returncode)


def _first_int(pattern: "re.Pattern[str]", line: str) -> Optional[int]:
    found = pattern.match(line)
    return int(found.group(1)) if found else None
