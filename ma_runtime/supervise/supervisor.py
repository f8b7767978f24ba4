"""The supervision loop: wait, forward, reap, stop with a deadline, leave nothing behind.

It supervises one worker or several (one per rank). With several, the first to
fail (while no stop is under way) stops the others, and its status is the job's.
One attempt is one `run()`; its `Outcome` says how it ended (`State`) and when a
stop was requested, and the attempt loop (bootstrap) decides what comes next.

Each process gets a stop signal once (`_stop_all`): a killpg per worker group,
and a descendant outside those groups directly, unless its launcher passes the
stop on itself (`forwards`, from launch/<method>.forwards_to). A second stop
request is not passed on: it would interrupt the cleanup the first one started.

Every SIGKILL it sends goes through process/lifecycle.sweep (stop the tree, then kill it,
until it is empty): the grace-over kill and the kill of leftovers alike, so a
tree that forks faster than it is killed still ends. While the workers run, it
records its descendants for the guard about once a second (one /proc scan, a
millisecond or two), so that the guard still finds them if the runtime is
SIGKILLed after they dropped every mark they inherited.
"""

import dataclasses
import enum
import functools
import os
import signal
import time
from typing import Any, Callable, Collection, Dict, List, Mapping, Optional, Sequence, Set, Union

from ma_runtime.errors import ExitCode
from ma_runtime.process import children, lifecycle
from ma_runtime.process.lifecycle import kill_all, sweep
from ma_runtime.process.table import Proc, descendants, processes
from ma_runtime.process.worker import SIGNAL_NAMES, Worker
from ma_runtime.supervise import ranks
from ma_runtime.supervise.pid1 import reap
from ma_runtime.supervise.signals import STOPPING, SignalQueue

# Upper bound on one loop turn, in case a wake-up is ever lost.
_TICK = 1.0
_POLL = 0.02
# How long to wait for SIGKILLed processes to vanish (D state can delay it).
_KILL_WAIT = 5.0
# How often the guard hears of new descendants: the cost of a /proc scan, against
# the window in which a process that dropped every mark would escape the guard.
_RECORD_EVERY = 1.0
# How long output may keep flowing after every process is gone (a pipe held by
# something outside our tree must not hang the exit).
_OUTPUT_DRAIN = 2.0


class State(enum.Enum):
    """How an attempt ended (torch elastic's WorkerState, the states that end one)."""

    SUCCEEDED = "succeeded"  # every worker exited 0
    FAILED = "failed"  # a worker exited non-zero or died of a signal, nobody having asked it to stop
    STOPPED = "stopped"  # a stop was requested (SIGTERM/SIGINT) and the workers ended
    HUNG = "hung"  # the hang monitor (supervise/hang.py) found them stuck, and they were stopped
    ELSEWHERE = "stopped for the job"  # another node of the job failed, hung or was lost first (coordinator.py)


# Which processes a launcher signals itself when it gets a stop (launch/<method>.forwards_to): given
# the launcher's pid and the process table, the pids it will reach, so that we do not reach them twice.
Forwards = Callable[[int, Mapping[int, Proc]], Collection[int]]


def _forwards_nothing(_pid: int, _table: Mapping[int, Proc]) -> Set[int]:
    return set()


@dataclasses.dataclass
class Outcome:
    returncode: int  # Popen style: exit status, or -N for death by signal N
    exit_code: int
    stop_signal: Optional[int] = None  # SIGTERM/SIGINT that started a stop
    # The grace-over SIGKILL ended a worker (its status says so): a worker whose own exit came as the grace ran out,
    # after the last look and before the kill, exited by itself and keeps its code (issue 24 item 9).
    forced: bool = False
    leftovers: int = 0  # processes still running after the command exited
    duration: float = 0.0
    # The worker whose status is the job's: the first to fail, else the first
    # non-zero one, else the last to exit.
    worker: Optional[Worker] = None
    failed_worker: Optional[str] = None  # its name, when it failed first with no stop under way
    workers_stopped: int = 0  # how many others we stopped because it failed
    # When the stop was requested (time.monotonic()), for what must still happen within the platform's grace.
    stop_requested_at: Optional[float] = None
    hang: Any = None  # a hang.Hang: the monitor found the attempt stuck and the supervisor stopped it
    # When the workers were asked to stop (time.time(): file times are compared with it), by a signal, a hang or
    # another worker's failure; None when they all ended by themselves. The final sync keeps a file written
    # since from replacing the store's whole version.
    workers_stopped_at: Optional[float] = None
    # Why the job stopped this node's workers (another node failed, hung or was lost first), when it did.
    elsewhere: Optional[str] = None

    @property
    def state(self) -> State:
        if self.stop_signal is not None:
            return State.STOPPED
        if self.hang is not None:
            return State.HUNG
        if self.elsewhere is not None:
            return State.ELSEWHERE
        return State.SUCCEEDED if self.exit_code == 0 else State.FAILED


@dataclasses.dataclass
class _Stop:
    """Where the stop stands during one run."""

    signal: Optional[int] = None  # a stop requested by a signal
    requested_at: Optional[float] = None
    failed: Optional[Worker] = None  # a stop started by a worker's failure
    hang: Any = None  # a stop started by the hang monitor (a hang.Hang)
    elsewhere: Optional[str] = None  # a stop started by the job: another node's failure, hang or loss (why)
    stopped: int = 0
    deadline: Optional[float] = None
    forced: bool = False
    killed: List[Worker] = dataclasses.field(default_factory=list)  # the workers still running at the grace-over kill
    killed_at: Optional[float] = None
    exits: List[Worker] = dataclasses.field(default_factory=list)  # in the order they exited
    began_at: Optional[float] = None  # time.time() when the workers were first asked to stop

    def begin(self, on_stop: Optional[Callable[[float], None]]) -> None:
        if self.began_at is None:
            self.began_at = time.time()
            if on_stop is not None:
                on_stop(self.began_at)

    @property
    def under_way(self) -> bool:
        return (self.signal is not None or self.failed is not None or self.hang is not None
                or self.elsewhere is not None)


class Supervisor:
    def __init__(
        self,
        workers: Union[Worker, Sequence[Worker]],
        signals: SignalQueue,
        grace_seconds: float,
        log,
        exclude: Sequence[int] = (),
        guard=None,  # a guard.Guard: told the workers' pipes and the tree as it grows
        forwards: Forwards = _forwards_nothing,
        hangs=None,  # a hang.Monitor for this attempt, or None: hang detection off
        on_stop: Optional[Callable[[float], None]] = None,  # told when the workers are first asked to stop
        job=None,  # the job across nodes (together.Watch): told of a failure or hang here, says one elsewhere
    ):
        self.workers: List[Worker] = [workers] if isinstance(workers, Worker) else list(workers)
        if not self.workers:
            raise ValueError("Supervisor needs at least one worker")
        self.signals = signals
        self.grace_seconds = grace_seconds
        self.log = log
        # Our own helpers (the guard) are children too, but never targets.
        self.exclude = children.NotTheCommand((*exclude, *((guard.pid,) if guard is not None else ())))
        self.guard = guard
        self.forwards = forwards
        self.hangs = hangs
        self.on_stop = on_stop
        self.job = job
        self._me = os.getpid()
        self._next_record = 0.0
        # pid -> start time of every process a stop signal reached (the pid alone could be reused).
        self._signalled: Dict[int, int] = {}

    def run(self) -> Outcome:
        started = time.monotonic()
        stop = _Stop()
        if self.guard is not None:
            self.guard.watch_pipes(inode for worker in self.workers for inode in worker.pipe_inodes)
        if self.hangs is not None:
            self.hangs.start(functools.partial(self._job, ranks.Finder()), self.signals.wake)
        try:
            while self._live():
                self._record_tree()
                # Each signal once per wake-up, as the kernel merges a pending one: a flood of SIGHUPs costs a
                # forward and a log line per turn, not per signal.
                for signum in dict.fromkeys(self.signals.wait(self._timeout(stop))):
                    self._on_signal(stop, signum)
                for worker in self._reap():
                    self._on_exit(stop, worker)
                self._check_hang(stop)
                self._check_job(stop)
                self._escalate(stop)
        finally:
            if self.hangs is not None:
                self.hangs.stop()
        leftovers = self._stop_leftovers(stop)
        self._join_output()
        return self._outcome(stop, leftovers, time.monotonic() - started)

    def _live(self) -> List[Worker]:
        return [w for w in self.workers if w.returncode is None]

    def _timeout(self, stop: _Stop) -> float:
        # Wake up at the deadline, not up to a tick after it.
        if stop.deadline is None:
            return _TICK
        return min(_TICK, max(0.0, stop.deadline - time.monotonic()))

    def _on_signal(self, stop: _Stop, signum: int) -> None:
        if signum == signal.SIGCHLD:
            return  # only there to wake the loop: _reap follows
        if signum not in STOPPING:
            for worker in self._live():
                worker.signal_group(signum)
            self.log.info("forwarded signal", signal=SIGNAL_NAMES.get(signum, signum), **self._pids())
            return
        if stop.requested_at is None:
            stop.requested_at = time.monotonic()  # even during a failure's stop: no restart after it
        if stop.under_way:
            # Each process gets a stop once: a second one would interrupt the cleanup the first started.
            # A stop already under way (a failed worker's) keeps its deadline and its cause.
            if stop.signal == signal.SIGINT and signum == signal.SIGINT:
                self.log.warning("second SIGINT: killing the command now")
                stop.deadline = time.monotonic()
            else:
                self.log.info("stop already under way", signal=SIGNAL_NAMES.get(signum, signum))
            return
        stop.begin(self.on_stop)
        self._stop_all(signum)
        self.log.info("forwarded signal", signal=SIGNAL_NAMES.get(signum, signum), **self._pids())
        stop.signal, stop.deadline = signum, time.monotonic() + self.grace_seconds

    def _on_exit(self, stop: _Stop, worker: Worker) -> None:
        stop.exits.append(worker)
        # Exits during a stop are what we asked for, not failures of their own.
        if worker.returncode == 0 or stop.under_way:
            return
        stop.failed = worker
        if self.job is not None:  # the other nodes stop theirs now, not after this node's grace
            self.job.failed_here(worker)
        others = self._live()
        stop.stopped = len(others)
        if not others:
            return
        # One rank down stalls the others in their next collective: stop them
        # now rather than let them hang until a timeout.
        self.log.warning(
            "a worker failed: stopping the others",
            worker=worker.name,
            exit_code=lifecycle.exit_code(worker.returncode),
            others=len(others),
        )
        stop.begin(self.on_stop)
        self._stop_all(signal.SIGTERM)
        stop.deadline = time.monotonic() + self.grace_seconds

    def _check_hang(self, stop: _Stop) -> None:
        """A hang the monitor found: show where each rank is stuck, then stop the attempt as in a failure."""
        hang = self.hangs.found() if self.hangs is not None and not stop.under_way else None
        if hang is None or not self._live():  # every worker ended meanwhile: their exits decide
            return
        self.log.error("job suspected hung", evidence=hang.evidence, device_fault=hang.device_fault,
                       **({"suspects": ", ".join(hang.suspects)} if hang.suspects else {}), **self._pids(self._live()))
        if self.job is not None:
            self.job.hung_here(hang)
        self.hangs.show_where(hang, self._ranks_by_worker(self._job(ranks.Finder())))
        stop.hang = hang
        self.log.warning("stopping the hung attempt", grace_seconds=self.grace_seconds)
        stop.begin(self.on_stop)
        self._stop_all(signal.SIGTERM)
        stop.deadline = time.monotonic() + self.grace_seconds

    def _check_job(self, stop: _Stop) -> None:
        """Another node failed, hung or was lost first: stop this node's workers as in a failure. When it hung,
        this node's ranks' stacks first: the job's stacks, not only the finder's."""
        why = self.job.elsewhere() if self.job is not None and not stop.under_way else None
        if why is None or not self._live():
            return
        self.log.warning("stopping the workers for the job", reason=why, grace_seconds=self.grace_seconds)
        hang = self.job.hang_elsewhere()  # a hang.Hang naming the node that found it, or None
        if self.hangs is not None and hang is not None:
            self.hangs.show_where(hang, self._ranks_by_worker(self._job(ranks.Finder())))
        stop.elsewhere = why
        stop.begin(self.on_stop)
        self._stop_all(signal.SIGTERM)
        stop.deadline = time.monotonic() + self.grace_seconds

    def _escalate(self, stop: _Stop) -> None:
        """SIGKILL after the grace period; give up on what even SIGKILL cannot end."""
        live = self._live()
        if not live:
            return
        now = time.monotonic()
        if stop.deadline is not None and now >= stop.deadline:
            self.log.warning(
                "grace period over: killing the command and its descendants",
                grace_seconds=self.grace_seconds,
            )
            self._kill_sweep()
            stop.forced, stop.deadline, stop.killed_at, stop.killed = True, None, now, live
        elif stop.killed_at is not None and now - stop.killed_at > _KILL_WAIT:
            # Uninterruptible sleep (a hung NFS or device): do not hang with it.
            self.log.error("the command survived SIGKILL; giving up on it", **self._pids(live))
            for worker in live:
                worker.exited(-signal.SIGKILL)
                stop.exits.append(worker)

    def _outcome(self, stop: _Stop, leftovers: int, duration: float) -> Outcome:
        # A non-zero status is never hidden behind a later zero.
        decider = stop.failed or next((w for w in stop.exits if w.returncode != 0), stop.exits[-1])
        code = lifecycle.exit_code(decider.returncode)
        # Forced when our SIGKILL is what a worker died of; one that exited by itself meanwhile has its own status.
        forced = any(worker.returncode == -signal.SIGKILL for worker in stop.killed)
        if forced and stop.signal is not None:
            # The stop request, not our SIGKILL, is why the command ended.
            code = 128 + stop.signal
        elif stop.hang is not None and stop.signal is None:
            code = int(ExitCode.HANG_DETECTED)  # whatever the stop made the workers exit with
        return Outcome(
            decider.returncode,
            code,
            stop.signal,
            forced,
            leftovers,
            duration,
            worker=decider,
            failed_worker=stop.failed.name if stop.failed else None,
            workers_stopped=stop.stopped,
            stop_requested_at=stop.requested_at,
            hang=stop.hang,
            workers_stopped_at=stop.began_at,
            elsewhere=stop.elsewhere,
        )

    def _pids(self, workers: Optional[Sequence[Worker]] = None) -> dict:
        # One worker logs `pid=` as it always has; several log their list.
        workers = self.workers if workers is None else workers
        return {"pid": workers[0].pid} if len(self.workers) == 1 else {"pids": [w.pid for w in workers]}

    def _join_output(self) -> None:
        # One drain deadline for all: a pipe held outside our tree costs it once, not per worker.
        deadline = time.monotonic() + _OUTPUT_DRAIN
        for worker in self.workers:
            worker.join_output(max(0.0, deadline - time.monotonic()))

    def _reap(self) -> List[Worker]:
        """Workers that exited since the last call, in the order they were reaped."""
        live = {w.pid: w for w in self.workers if w.returncode is None}
        exited = reap(dict.fromkeys(live))
        for pid, returncode in exited.items():
            live[pid].exited(returncode)
        return [live[pid] for pid in exited]

    def _tree(self) -> List[int]:
        return descendants(self._me, exclude=self.exclude)

    def _job(self, finder: ranks.Finder) -> Dict[int, ranks.Unit]:
        """{pid: its rank} for the processes that run the training code (supervise/ranks.py): the ranks and what
        they started, in the workers' trees and, started by an MPI daemon, in the services' (sshd's)."""
        exclude = children.NotTheCommand(self.exclude.pids, services=True)
        return finder.find({worker.name: worker.pid for worker in self._live()}, children.services(), processes(),
                           exclude)

    @staticmethod
    def _ranks_by_worker(job: Mapping[int, ranks.Unit]) -> Dict[str, List[int]]:
        """{worker: its ranks' pids, each rank first, then what they started}: whose stacks a hang takes."""
        trees: Dict[str, List[int]] = {}
        for pid, unit in sorted(job.items(), key=lambda item: (item[1].root, item[0] != item[1].root, item[0])):
            trees.setdefault(unit.worker, []).append(pid)
        return trees

    def _members(self) -> Dict[int, Proc]:
        table = processes()
        return {pid: table[pid] for pid in descendants(self._me, self.exclude, table)}

    def _record_tree(self) -> None:
        """Tells the guard our descendants, at most once per _RECORD_EVERY."""
        now = time.monotonic()
        if self.guard is None or now < self._next_record:
            return
        self._next_record = now + _RECORD_EVERY
        self.guard.record({pid: proc.start for pid, proc in self._members().items()})

    def _kill_sweep(self, between=lambda: None) -> Dict[int, Proc]:
        """SIGKILLs the whole tree, frozen first; returns what survived _KILL_WAIT."""
        survivors = sweep(self._members, _KILL_WAIT, between)
        # Exited leaders too: their groups may still hold processes outside our tree.
        for worker in self.workers:
            worker.signal_group(signal.SIGKILL)
        return survivors

    def _stop_all(self, signum: int) -> None:
        """Each process of the tree gets `signum` once: every worker's group with one killpg, and a
        descendant outside those groups (a setsid escapee, msrun's ranks) directly, unless a launcher
        we signalled will pass it on (torchrun stops its ranks' groups itself). What it reached is
        remembered, so that stopping the leftovers later does not signal it again."""
        table = processes()
        tree = descendants(self._me, self.exclude, table)
        reached: Set[int] = set()
        # Exited leaders too: their groups may still hold processes outside our tree.
        for worker in self.workers:
            worker.signal_group(signum)
            if worker.pid in table:
                reached.add(worker.pid)
                reached.update(self.forwards(worker.pid, table))
        groups = {worker.pid for worker in self.workers} | {table[pid].pgid for pid in reached if pid in table}
        direct = [pid for pid in tree if pid not in reached and table[pid].pgid not in groups]
        kill_all(direct, signum)
        for pid in tree:
            self._signalled[pid] = table[pid].start

    def _stop_leftovers(self, stop: _Stop) -> int:
        """TERM, grace, KILL for whatever the command left running (tini #180). What a stop already reached
        gets no second SIGTERM (it may be in the middle of its cleanup); only the rest of the grace period."""
        leftovers = self._tree()
        if not leftovers:
            return 0
        self.log.warning("the command left processes running; stopping them", count=len(leftovers), pids=leftovers[:20])
        if self._signalled:
            table = processes()
            kill_all([pid for pid in leftovers if pid in table and self._signalled.get(pid) != table[pid].start],
                     signal.SIGTERM)
        else:
            self._stop_all(signal.SIGTERM)
        grace = self.grace_seconds if stop.deadline is None else max(0.0, stop.deadline - time.monotonic())
        if not self._wait_gone(grace, stop):
            self.log.warning("processes outlived the grace period; killing them", grace_seconds=self.grace_seconds)
            survivors = self._kill_sweep(self._reap)
            if survivors:
                self.log.error("processes survived SIGKILL (uninterruptible sleep?); exiting without them",
                               count=len(survivors), pids=sorted(survivors)[:20])
        return len(leftovers)

    def _wait_gone(self, seconds: float, stop: _Stop) -> bool:
        deadline = time.monotonic() + seconds
        while True:
            self._reap()
            if not self._tree():
                return True
            if time.monotonic() >= deadline:
                return False
            for signum in self.signals.wait(_POLL):
                # The leftovers are being stopped already; a stop request now still means: no restart.
                if signum in STOPPING and stop.requested_at is None:
                    stop.requested_at = time.monotonic()
