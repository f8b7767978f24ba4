"""Names looked up concurrently until they resolve or a deadline passes: the dns check's resolver.

Failures are retried in rounds, with jittered backoff (pods of one job start together, and their retries must
not hit the DNS server in step). Lookups run on a small pool of daemon threads: `socket.getaddrinfo` cannot be
cancelled, and a hung one must neither hold up the check past its timeout nor keep the interpreter from exiting
(which concurrent.futures' workers would do); a worker stuck in a lookup is replaced, not waited for. The wait
is reported while it lasts: once the first round has left names unresolved, then every PROGRESS_SECONDS.
"""

import dataclasses
import queue
import random
import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

WORKERS_MAX = 64
BACKOFF_FIRST_SECONDS = 0.25
BACKOFF_MAX_SECONDS = 5.0
TIMEOUT_MIN_SECONDS = 0.05
PROGRESS_SECONDS = 5.0  # between two progress reports

# Runs one lookup; returns None when the name resolved, else what went wrong.
Lookup = Callable[[str], Optional[str]]
# Told, while the check waits: the names still unresolved, seconds since the start, seconds left.
OnWait = Callable[[List[str], float, float], None]


@dataclasses.dataclass
class Resolution:
    resolved: List[str]
    unresolved: List[str]  # in the order the names were given
    errors: Dict[str, str]  # unresolved name -> last thing that went wrong
    rounds: int


def getaddrinfo_lookup(name: str) -> Optional[str]:
    try:
        socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except Exception as exc:  # gaierror, or UnicodeError for a label IDNA rejects: a failed lookup either way
        return str(exc) or type(exc).__name__
    return None


def resolve(
    names: List[str],
    timeout: float,
    deadline: float,
    lookup: Lookup = getaddrinfo_lookup,
    progress: Optional[OnWait] = None,
    every: float = PROGRESS_SECONDS,
) -> Resolution:
    """Looks every name up concurrently, retrying failures in rounds until all resolve or `deadline` s pass.

    Each attempt is waited on for at most `timeout` s. A deadline shorter than
    one timeout (0: try once) still lets the first round's attempts run their full timeout.
    `progress` hears about the wait after the first round that leaves names unresolved, then every `every` s.
    """
    # A zero timeout would abandon every lookup the moment it starts.
    timeout = max(timeout, TIMEOUT_MIN_SECONDS)
    started = time.monotonic()
    end = started + deadline
    tracker = _Tracker(names)
    pool = _Pool(min(WORKERS_MAX, len(names)), lookup)
    reporter = _Reporter(tracker, progress, every, started, end)
    rounds = 0
    backoff = BACKOFF_FIRST_SECONDS
    try:
        while True:
            batch = tracker.retryable()
            if batch:
                rounds += 1
                tracker.start(batch)
                pool.submit(batch)
                round_end = max(end, started + timeout) if rounds == 1 else end
                _wait_round(pool, tracker, batch, timeout, round_end, reporter)
            if _finished(tracker, end):
                break
            reporter.first_round_over()
            _pause(pool, tracker, _jittered(backoff), end, reporter)
            backoff = min(backoff * 2, BACKOFF_MAX_SECONDS)
            if _finished(tracker, end):
                break
    finally:
        pool.close()
    return tracker.resolution(rounds)


def _finished(tracker: "_Tracker", end: float) -> bool:
    return tracker.all_resolved() or time.monotonic() >= end


def _jittered(backoff: float) -> float:
    # Pods of one job start together; jitter keeps their retries from hitting the DNS server in step.
    return backoff + random.uniform(0, backoff / 2)


def _wait_round(
    pool: "_Pool", tracker: "_Tracker", batch: List[str], timeout: float, end: float, reporter: "_Reporter"
) -> None:
    """Until every attempt of `batch` succeeded, failed or ran past `timeout`, or `end` comes."""
    waiting = set(batch)
    while waiting:
        now = time.monotonic()
        if now >= end:
            return
        for name, started in pool.running().items():
            if name in waiting and now - started >= timeout:
                pool.abandon(name)
                tracker.time_out(name, timeout)
                waiting.discard(name)
        # A lookup not started yet times out no earlier than `now + timeout`; started ones may sooner.
        wake = min([end, now + timeout] + [started + timeout for started in pool.running().values()])
        for name in _collect(pool, tracker, max(0.0, wake - now), reporter):
            waiting.discard(name)


def _pause(pool: "_Pool", tracker: "_Tracker", seconds: float, end: float, reporter: "_Reporter") -> None:
    """The backoff between rounds; results of earlier, overdue lookups still count when they come in."""
    until = min(time.monotonic() + seconds, end)
    while not tracker.all_resolved():
        left = until - time.monotonic()
        if left <= 0:
            return
        _collect(pool, tracker, left, reporter)


def _collect(pool: "_Pool", tracker: "_Tracker", wait: float, reporter: "_Reporter") -> List[str]:
    """Names whose lookup finished: waits up to `wait` s for the first (less when a report is due first),
    then takes what else is there."""
    finished = []
    item = pool.next_outcome(min(wait, reporter.seconds_to_due()))
    while item is not None:
        name, error = item
        tracker.finish(name, error)
        finished.append(name)
        item = pool.next_outcome(0)
    reporter.report_if_due()
    return finished


class _Reporter:
    """Calls `progress` when a report is due and names are still unresolved; every wait is cut short to it."""

    def __init__(self, tracker: "_Tracker", progress: Optional[OnWait], every: float, started: float, end: float):
        self.tracker = tracker
        self.progress = progress
        self.every = every
        self.started = started
        self.end = end
        self.due = started + every if progress else float("inf")
        self.announced = False

    def first_round_over(self) -> None:
        """Names are left unresolved: the wait is announced at once, not one interval after the start."""
        if self.progress and not self.announced:
            self.announced = True
            self.due = min(self.due, time.monotonic())

    def seconds_to_due(self) -> float:
        return max(0.0, self.due - time.monotonic())

    def report_if_due(self) -> None:
        now = time.monotonic()
        if now < self.due:
            return
        if self.progress is None or now >= self.end:
            # Never due again: a due time left in the past would make every wait a poll (round one may outlive
            # the deadline).
            self.due = float("inf")
            return
        self.due = now + self.every
        if not self.tracker.all_resolved():
            self.progress(self.tracker.unresolved(), now - self.started, self.end - now)


class _Tracker:
    """What the main thread knows about each name: resolved, last error, lookup in flight."""

    def __init__(self, names: List[str]):
        self.names = names
        self.resolved: Set[str] = set()
        self.errors: Dict[str, str] = {}
        self.in_flight: Set[str] = set()  # submitted, outcome not in yet (queued, running or overdue)

    def retryable(self) -> List[str]:
        # A name whose previous lookup still runs (a hung resolver call) gets no second one.
        return [name for name in self.names if name not in self.resolved and name not in self.in_flight]

    def start(self, batch: List[str]) -> None:
        self.in_flight.update(batch)

    def finish(self, name: str, error: Optional[str]) -> None:
        self.in_flight.discard(name)
        if error is None:
            self.resolved.add(name)
            self.errors.pop(name, None)
        else:
            self.errors[name] = error

    def time_out(self, name: str, timeout: float) -> None:
        self.errors[name] = f"no answer within {timeout:g} s"

    def all_resolved(self) -> bool:
        return len(self.resolved) == len(self.names)

    def unresolved(self) -> List[str]:
        return [name for name in self.names if name not in self.resolved]

    def resolution(self, rounds: int) -> Resolution:
        unresolved = self.unresolved()
        # Without an error, a name's first lookup was still queued or running when the deadline came.
        errors = {name: self.errors.get(name, "no answer before the deadline") for name in unresolved}
        resolved = [name for name in self.names if name in self.resolved]
        return Resolution(resolved, unresolved, errors, rounds)


class _Seat:
    """One worker thread's place in the pool; `abandoned` once its lookup ran past the timeout."""

    def __init__(self) -> None:
        self.abandoned = False


class _Pool:
    """A fixed number of live daemon workers; a worker stuck in a lookup is replaced, not waited for."""

    def __init__(self, size: int, lookup: Lookup):
        self._size = size
        self._lookup = lookup
        self._todo: queue.Queue[Optional[str]] = queue.Queue()
        self._outcomes: queue.Queue[Tuple[str, Optional[str]]] = queue.Queue()
        self._lock = threading.Lock()  # guards _running and the seats' `abandoned`
        self._running: Dict[str, Tuple[float, _Seat]] = {}  # name -> (monotonic start, seat)
        for _ in range(size):
            self._start_worker()

    def submit(self, names: List[str]) -> None:
        for name in names:
            self._todo.put(name)

    def running(self) -> Dict[str, float]:
        """Start times of the lookups running now and not abandoned."""
        with self._lock:
            return {name: started for name, (started, seat) in self._running.items() if not seat.abandoned}

    def abandon(self, name: str) -> None:
        with self._lock:
            entry = self._running.get(name)
            if entry is None or entry[1].abandoned:
                return  # finished meanwhile: its outcome is on the way
            entry[1].abandoned = True
            # Keeps `size` workers free for the other names; the stuck one exits if its call ever returns.
            self._start_worker()

    def next_outcome(self, wait: float) -> Optional[Tuple[str, Optional[str]]]:
        try:
            return self._outcomes.get(timeout=wait) if wait > 0 else self._outcomes.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        # Names not started yet are dropped: the check is over, nobody will read their outcome.
        try:
            while True:
                self._todo.get_nowait()
        except queue.Empty:
            pass
        for _ in range(self._size):
            self._todo.put(None)

    def _start_worker(self) -> None:
        seat = _Seat()
        threading.Thread(target=self._work, args=(seat,), name="preflight-dns", daemon=True).start()

    def _work(self, seat: _Seat) -> None:
        while True:
            name = self._todo.get()
            if name is None:
                return
            with self._lock:
                self._running[name] = (time.monotonic(), seat)
            error = self._lookup(name)
            with self._lock:
                del self._running[name]
                abandoned = seat.abandoned
            self._outcomes.put((name, error))
            if abandoned:
                return  # a replacement took this seat
