"""The duties of an init process, one small function each (tini's shape).

- `become_subreaper`: outside a PID namespace, orphans come to us instead of init.
- the signal queue is supervise/signals.py's (light enough to be the CLI's first import):
  handlers do nothing but wake the main loop through a pipe (gunicorn's arbiter).
- `reap`: the single `waitpid(-1)` loop of the process. It records the status of
  the pids the supervisor tracks and discards the rest, so `Popen.wait` never
  races it for a status (we never call `Popen.wait`).
- `set_process_name`, `set_command_line`: the name and the command line a
  forked helper (the guard) shows, so that nothing aimed at ma-run hits it.
"""

import os
from typing import Dict, Optional, Sequence

from ma_runtime.process import children
from ma_runtime.process.table import argument_area

PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value) -> bool:
    # ctypes is imported here, not with the module: a run as PID 1 never calls prctl (and the guard calls it
    # in its own process). The C library is the one the interpreter runs on (dlopen(NULL), as sync/births.py
    # does): ctypes.util.find_library("c") cost an `ldconfig -p` child and ctypes.util's imports at every start.
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0


def is_pid1() -> bool:
    return os.getpid() == 1


def become_subreaper() -> bool:
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def set_process_name(name: str) -> None:
    import ctypes

    _prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def set_command_line(words: Sequence[str]) -> bool:
    """Rewrites our own argv in place, as ps, `pkill -f` and /proc/self/cmdline see it.

    A forked process keeps its parent's command line, and PR_SET_NAME changes
    only the 15-byte name. The kernel reads the command line from the argument
    area of our memory (/proc/self/stat fields 48 and 49): overwriting it there,
    NUL-padded and cut to its size, costs nothing (setproctitle's way, without
    the module). Python keeps its own copy of argv, so nothing else changes.
    """
    area = argument_area()
    if area is None:
        return False
    start, end = area
    size = end - start
    if start <= 0 or size <= 1:
        return False
    text = b"\0".join(word.encode() for word in words)[: size - 1]
    import ctypes

    ctypes.memmove(start, text.ljust(size, b"\0"), size)
    return True


def reap(tracked: Dict[int, Optional[int]]) -> Dict[int, int]:
    """Reaps every exited child; returns {pid: returncode} for the tracked ones.

    returncode follows Popen: the exit status, or -N for death by signal N.
    Statuses of untracked children (orphans re-parented to us) are discarded,
    except those of the tools the runtime waits for itself (`children.owned`):
    their owner takes them.
    """
    exited: Dict[int, int] = {}
    # The tracked first, by pid: a tool's zombie at the head of the list must not delay a worker's exit.
    for pid in tracked:
        status = _wait(pid)
        if status is not None:
            exited[pid] = status
    with children.LOCK:
        while True:
            found = _peek()
            # An owned tool's zombie is its owner's (Popen waits for it at once); the orphans
            # behind it are taken at the next wake-up.
            if found is None or children.is_owned(found):
                break
            status = _wait(found)
            if found in tracked and status is not None:
                exited[found] = status
    return exited


def _peek() -> Optional[int]:
    """The pid of an exited child, left unreaped (WNOWAIT), or None."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return None
        except InterruptedError:
            continue
        return info.si_pid if info is not None and info.si_pid else None


def _wait(pid: int) -> Optional[int]:
    """The Popen-style status of child `pid` if it has exited (and reaps it), else None."""
    while True:
        try:
            found, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        except InterruptedError:
            continue
        return os.waitstatus_to_exitcode(status) if found else None
