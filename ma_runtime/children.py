"""Children the runtime starts and waits for itself, so that the reaping loop leaves their status alone.

The supervisor reaps with `waitpid(-1)` (supervise/pid1.reap): it has to, for the orphans that come to a
subreaper or PID 1. A tool the runtime runs meanwhile (`npu-smi` between attempts, later hooks and
uploaders) is waited for by its own `Popen`; if the loop reaped it first, `Popen` would see ECHILD and
report the tool's status as 0. So such a child is started through `start`, under the lock the reaping loop
also holds, and its pid stays in `_OWNED` until its owner has waited for it: the loop never takes a pid
it finds there.
"""

import contextlib
import threading
from typing import Callable, Iterator, Set, TypeVar

LOCK = threading.Lock()
_OWNED: Set[int] = set()
T = TypeVar("T")


@contextlib.contextmanager
def owned(start: Callable[[], T]) -> Iterator[T]:
    """`with owned(lambda: Popen(...)) as proc:` the reaping loop leaves `proc` to us until the block ends.

    Started under the lock: a child that exits at once is still registered before the loop can look."""
    with LOCK:
        proc = start()
        _OWNED.add(proc.pid)
    try:
        yield proc
    finally:
        with LOCK:
            _OWNED.discard(proc.pid)


def is_owned(pid: int) -> bool:
    """Call with LOCK held."""
    return pid in _OWNED
