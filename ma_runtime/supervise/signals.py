"""The signal queue: ma-run's one signal regime, from its first statement to its exit.

Handlers do nothing but wake the main loop through a pipe (gunicorn's arbiter); the loop reads
signal numbers from it and acts there, so a signal never interrupts a stage midway. This module
imports nothing but the standard library's lightest parts: `cli` installs the queue before it
imports anything else, because as PID 1 a signal without a handler is dropped by the kernel.
"""

from __future__ import annotations  # annotations unevaluated: no `typing` import (3 ms) before the queue

import os
import select
import signal

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

    def wait(self, timeout: float | None) -> list[int]:
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
