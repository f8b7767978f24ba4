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
import errno
import os
import select
import signal
from typing import Dict, List, Optional, Sequence

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
        """Signals received, in order; [] after `timeout` seconds with none."""
        ready, _, _ = select.select([self._read_fd], [], [], timeout)
        if not ready:
            return []
        try:
            data = os.read(self._read_fd, 4096)
        except BlockingIOError:
            return []
        return list(data)

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
    Statuses of untracked children (orphans re-parented to us) are discarded.
    """
    exited: Dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        except OSError as exc:
            if exc.errno == errno.EINTR:
                continue
            raise
        if pid == 0:
            break
        if pid in tracked:
            exited[pid] = os.waitstatus_to_exitcode(status)
    return exited

