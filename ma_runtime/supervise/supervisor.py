"""The supervision loop: wait, forward, reap, stop with a deadline, leave nothing behind."""

import dataclasses
import os
import signal
import time
from typing import List, Optional, Sequence

from ma_runtime.errors import exit_code_of_status
from ma_runtime.supervise.pid1 import STOPPING, SignalQueue, reap
from ma_runtime.supervise.worker import SIGNAL_NAMES, Worker, descendants, kill_all

# Upper bound on one loop turn, in case a wake-up is ever lost.
_TICK = 1.0
_POLL = 0.02
# How long to wait for SIGKILLed processes to vanish (D state can delay it).
_KILL_WAIT = 5.0
# How long output may keep flowing after every process is gone (a pipe held by
# something outside our tree must not hang the exit).
_OUTPUT_DRAIN = 2.0


@dataclasses.dataclass
class Outcome:
    returncode: int  # Popen style: exit status, or -N for death by signal N
    exit_code: int
    stop_signal: Optional[int] = None  # SIGTERM/SIGINT that started a stop
    forced: bool = False  # the command outlived the grace period and was SIGKILLed
    leftovers: int = 0  # processes still running after the command exited
    duration: float = 0.0


class Supervisor:
    def __init__(self, worker: Worker, signals: SignalQueue, grace_seconds: float, log, exclude: Sequence[int] = ()):
        self.worker = worker
        self.signals = signals
        self.grace_seconds = grace_seconds
        self.log = log
        # Our own helpers (the guard) are children too, but never targets.
        self.exclude = tuple(exclude)
        self._me = os.getpid()

    def run(self) -> Outcome:
        worker = self.worker
        started = time.monotonic()
        stop_signal: Optional[int] = None
        deadline: Optional[float] = None
        forced = False
        killed_at: Optional[float] = None
        while worker.returncode is None:
            timeout = _TICK if deadline is None else min(_TICK, max(0.0, deadline - time.monotonic()))
            for signum in self.signals.wait(timeout):
                if signum == signal.SIGCHLD:
                    continue
                if stop_signal == signal.SIGINT and signum == signal.SIGINT:
                    self.log.warning("second SIGINT: killing the command now")
                    deadline = time.monotonic()
                if signum in STOPPING:
                    # Also reach descendants that left the group (setsid, msrun's ranks).
                    self._kill_tree(signum)
                else:
                    worker.signal_group(signum)
                self.log.info("forwarded signal", signal=SIGNAL_NAMES.get(signum, signum), pid=worker.pid)
                if signum in STOPPING and stop_signal is None:
                    stop_signal = signum
                    deadline = time.monotonic() + self.grace_seconds
            self._reap()
            if worker.returncode is None and deadline is not None and time.monotonic() >= deadline:
                self.log.warning(
                    "grace period over: killing the command and its descendants",
                    grace_seconds=self.grace_seconds,
                )
                self._kill_tree(signal.SIGKILL)
                forced, deadline, killed_at = True, None, time.monotonic()
            if worker.returncode is None and killed_at is not None and time.monotonic() - killed_at > _KILL_WAIT:
                # Uninterruptible sleep (a hung NFS or device): do not hang with it.
                self.log.error("the command survived SIGKILL; giving up on it", pid=worker.pid)
                worker.exited(-signal.SIGKILL)
        leftovers = self._stop_leftovers()
        worker.join_output(_OUTPUT_DRAIN)
        code = exit_code_of_status(worker.returncode)
        if forced and stop_signal is not None:
            # The stop request, not our SIGKILL, is why the command ended.
            code = 128 + stop_signal
        return Outcome(worker.returncode, code, stop_signal, forced, leftovers, time.monotonic() - started)

    def _reap(self) -> None:
        exited = reap({self.worker.pid: None})
        if self.worker.pid in exited:
            self.worker.exited(exited[self.worker.pid])

    def _tree(self) -> List[int]:
        return descendants(self._me, exclude=self.exclude)

    def _kill_tree(self, signum: int) -> None:
        """The command's process group and every descendant, wherever its group."""
        self.worker.signal_group(signum)
        kill_all(self._tree(), signum)

    def _stop_leftovers(self) -> int:
        """TERM, grace, KILL for whatever the command left running (tini #180)."""
        leftovers = self._tree()
        if not leftovers:
            return 0
        self.log.warning("the command left processes running; stopping them", count=len(leftovers), pids=leftovers[:20])
        self._kill_tree(signal.SIGTERM)
        if not self._wait_gone(self.grace_seconds):
            self.log.warning("processes outlived the grace period; killing them", grace_seconds=self.grace_seconds)
            self._kill_tree(signal.SIGKILL)
            if not self._wait_gone(_KILL_WAIT):
                self.log.error("processes survived SIGKILL (uninterruptible sleep?)", pids=self._tree()[:20])
        return len(leftovers)

    def _wait_gone(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while True:
            self._reap()
            if not self._tree():
                return True
            if time.monotonic() >= deadline:
                return False
            self.signals.wait(_POLL)
