"""The duties of an init process, one small function each (tini's shape).

- `become_subreaper`: outside a PID namespace, orphans come to us instead of init.
- `SignalQueue`: handlers do nothing but wake the main loop through a pipe
  (gunicorn's arbiter); the loop reads signal numbers from it and acts there.
- `reap`: the single `waitpid(-1)` loop of the process. It records the status of
  the pids the supervisor tracks and discards the rest, so `Popen.wait` never
  races it for a status (we never call `Popen.wait`).
- `set_process_name`, `set_command_line`: the name and the command line a
  forked helper (the guard) shows, so that nothing aimed at ma-run hits it.
"""

import ctypes
import ctypes.util
import os
import select
import signal
from typing import Dict, List, Optional, Sequence

from ma_runtime import children

PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36

# Signals passed on to the command's process group (SIGCHLD only wakes the loop).
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
# Signals that start a stop: forward, wait the grace period, then SIGKILL.
STOPPING = (signal.SIGTERM, signal.SIGINT)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _prctl(option: int, value) -> bool:
    return _libc.prctl(option, value, 0, 0, 0) == 0


def is_pid1() -> bool:
    return os.getpid() == 1


def become_subreaper() -> bool:
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def set_process_name(name: str) -> None:
    _prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def set_command_line(words: Sequence[str]) -> bool:
    """Rewrites our own argv in place, as ps, `pkill -f` and /proc/self/cmdline see it.

    A forked process keeps its parent's command line, and PR_SET_NAME changes
    only the 15-byte name. The kernel reads the command line from the argument
    area of our memory (/proc/self/stat fields 48 and 49): overwriting it there,
    NUL-padded and cut to its size, costs nothing (setproctitle's way, without
    the module). Python keeps its own copy of argv, so nothing else changes.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])
    except (OSError, IndexError, ValueError):
        return False
    size = end - start
    if start <= 0 or size <= 1:
        return False
    text = b"\0".join(word.encode() for word in words)[: size - 1]
    ctypes.memmove(start, text.ljust(size, b"\0"), size)
    return True


# No signal has number 0: the byte `wake` writes.
_WAKE = 0


class SignalQueue:
    """Turns asynchronous signals into numbers read synchronously by the main loop."""

    def __init__(self, signals=FORWARDED) -> None:
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._previous = {}
        for signum in tuple(signals) + (signal.SIGCHLD,):
            # The handler is empty on purpose: the C-level handler has already
            # written the signal number to the wake-up pipe.
            self._previous[signum] = signal.signal(signum, _ignore_in_python)

    def wait(self, timeout: Optional[float]) -> List[int]:
        """Signals received, in order; [] after `timeout` seconds with none, or after a `wake`."""
        ready, _, _ = select.select([self._read_fd], [], [], timeout)
        if not ready:
            return []
        try:
            data = os.read(self._read_fd, 4096)
        except BlockingIOError:
            return []
        return [signum for signum in data if signum != _WAKE]

    def wake(self) -> None:
        """Ends a `wait` from another thread (a stage that finished), as a signal would."""
        try:
            os.write(self._write_fd, bytes([_WAKE]))
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        os.close(self._read_fd)
        os.close(self._write_fd)


def _ignore_in_python(_signum, _frame) -> None:
    return None


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
