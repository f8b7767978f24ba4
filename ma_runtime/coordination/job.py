"""The job's shared state in the coordination store: who is alive, who joined which attempt, who failed first.

One node's view is a `JobState` over one store client (store.py). Every rule that several nodes must apply alike
lives here, so that they cannot disagree: the barrier's release, "first" by the store's receive order, lost.

Keys (the embedded store holds one job; an etcd backend puts them under the job's prefix):
  node/<i>               node i's heartbeat, with a time to live of MA_RUNTIME_NODE_LOST_SECONDS: {"host", "stage"}
  next                   the attempt the job gathers for (a replacement pod joins that one, not its own count)
  first                  the job's first attempt: the restart budget counts from it on every node
  a/<n>/joined/<i>       node i joined attempt n (written once: a node that joins twice counts once)
  a/<n>/joined           how many joined; the node whose `add` reaches the node count writes a/<n>/go
  a/<n>/go               the barrier's end: every waiting node's `wait` returns at once; "1" when every node
                         joined, else the reason of the first node whose wait ran out (each node ends with it)
  a/<n>/origin           the first failure of attempt n (compare_and_set: the first the store received wins)
  a/<n>/seq              stamps, in the store's receive order, for every failure reported
  a/<n>/secondary/<i>    node i's failure that came after the origin: listed, never named as the cause
  a/<n>/ended/<i>        node i's workers all exited 0 by themselves; the last of the node count writes a/<n>/over
  a/<n>/over             attempt n's outcome is known: an origin, or every node ended
  a/<n>/saw/<i>          node i read attempt n's outcome (worker-0 keeps the store up until every node has)

A record (`Failure`) is JSON; no value holds the job's environment, its command line or its output beyond the
failing command's last line, which the termination message carries anyway (masked there and here alike).
"""

import dataclasses
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ma_runtime.coordination.store import Store

RELEASED = b"1"  # a/<n>/go when every node joined; otherwise the reason the first node whose wait ran out gave
# What a failure record may say (its `kind`).
FAILED, HUNG, LOST = "failed", "hung", "lost"


@dataclasses.dataclass(frozen=True)
class Failure:
    """A failure of attempt `attempt` on one node, as every node reads it."""

    kind: str  # FAILED (a worker exited non-zero or died), HUNG, LOST (the node's runtime went silent)
    task_index: int
    host: str
    attempt: int
    reason: str
    rank: Optional[int] = None
    exit_code: Optional[int] = None
    signal: Optional[str] = None
    last_line: str = ""  # the failing command's last line: what makes two failures "the same" (attempt.Policy)
    progressed: bool = False  # a hang after progress: the count of hangs in a row starts over (attempt.Policy)
    stamp: int = 0  # its place in the store's receive order among attempt `attempt`'s failures

    def encoded(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def decoded(cls, data: bytes) -> "Failure":
        fields = json.loads(data)
        return cls(**{field.name: fields[field.name] for field in dataclasses.fields(cls) if field.name in fields})

    def where(self) -> str:
        """`job-worker-1.job (task 1) rank 3`: the node, and the rank when one is known."""
        return f"{self.host} (task {self.task_index})" + (f" rank {self.rank}" if self.rank is not None else "")

    def origin_fields(self) -> Dict[str, Any]:
        """The termination message's `origin` (and each `secondary` entry)."""
        return {"task_index": self.task_index, "host": self.host, "rank": self.rank, "exit_code": self.exit_code,
                "signal": self.signal, "reason": self.reason, "attempt": self.attempt, "kind": self.kind}


class BarrierTimedOut(Exception):
    """Not every node joined in time: `missing` is [(task index, what its heartbeat last said or None)]."""

    def __init__(self, attempt: int, missing: List[Tuple[int, Optional[Dict[str, Any]]]]):
        super().__init__(f"attempt {attempt}: {len(missing)} node(s) missing")
        self.attempt = attempt
        self.missing = missing


def _attempt_key(attempt: int, *parts: Any) -> str:
    return "/".join(("a", str(attempt), *map(str, parts)))


class JobState:
    """One node's operations on the job's keys, over one client (a client runs one request at a time: a thread
    that waits holds its own)."""

    def __init__(self, store: Store, task_index: int, host: str, hosts: int):
        self.store = store
        self.task_index = task_index
        self.host = host
        self.hosts = hosts  # the node count (MA_NUM_HOSTS)

    # ---------------------------------------------------------------- liveness

    def beat(self, stage: str, ttl: float) -> None:
        document = {"host": self.host, "stage": stage}
        self.store.set(f"node/{self.task_index}", json.dumps(document).encode(), ttl=ttl)

    def alive(self) -> Dict[int, Dict[str, Any]]:
        """{task index: its heartbeat} of the nodes whose heartbeat has not expired."""
        found = {}
        for key in self.store.keys("node/"):
            value = self.store.get(key)
            if value is not None:
                found[int(key.split("/", 1)[1])] = json.loads(value)
        return found

    def lost(self, attempt: int) -> List[int]:
        """The nodes that joined `attempt` and did not end it well, whose heartbeat expired."""
        joined = self._indexes(_attempt_key(attempt, "joined", ""))
        done = self._indexes(_attempt_key(attempt, "ended", ""))
        live = {int(key.split("/", 1)[1]) for key in self.store.keys("node/")}
        return sorted(joined - done - live)

    def _indexes(self, prefix: str) -> set:
        return {int(key[len(prefix):]) for key in self.store.keys(prefix)}

    # ---------------------------------------------------------------- the barrier

    def gathering(self, own: int) -> int:
        """The attempt this node joins: its own count, or the one the job gathers for when that is later (a
        replacement pod starts at the platform's count)."""
        self.store.compare_and_set("next", None, str(own).encode())
        current = self.store.get("next")
        return max(own, int(current)) if current is not None else own

    def first_attempt(self, own: int) -> int:
        """The job's first attempt (the first node to ask sets it)."""
        self.store.compare_and_set("first", None, str(own).encode())
        value = self.store.get("first")
        return int(value) if value is not None else own

    def join(self, attempt: int, timings: Dict[str, float]) -> None:
        """Joins the barrier of `attempt`; the node that completes it releases every node."""
        mine = _attempt_key(attempt, "joined", self.task_index)
        joined = self.store.compare_and_set(mine, None, json.dumps({"host": self.host, "timings": timings}).encode())
        if joined and self.store.add(_attempt_key(attempt, "joined")) >= self.hosts:
            # Only if no node's wait ran out first: every node reads one outcome of the barrier.
            self.store.compare_and_set(_attempt_key(attempt, "go"), None, RELEASED)

    def released(self, attempt: int, timeout: float) -> Optional[str]:
        """"" once every node joined `attempt`; the reason when a node's wait ran out first (end_barrier); None
        when `timeout` passed first."""
        if not self.store.wait([_attempt_key(attempt, "go")], timeout):
            return None
        value = self.store.get(_attempt_key(attempt, "go"))
        return "" if value in (None, RELEASED) else value.decode(errors="replace")

    def end_barrier(self, attempt: int, reason: str) -> Optional[str]:
        """This node's wait ran out: the barrier ends for every node with `reason` (the first node whose wait ran
        out gives it), unless the last node joined meanwhile. Returns what `released` would now."""
        self.store.compare_and_set(_attempt_key(attempt, "go"), None, reason.encode())
        return self.released(attempt, 0.0)

    def missing(self, attempt: int) -> List[Tuple[int, Optional[Dict[str, Any]]]]:
        """[(task index, its last heartbeat or None: never heard of)] of the nodes that did not join `attempt`."""
        joined = self._indexes(_attempt_key(attempt, "joined", ""))
        alive = self.alive()
        return [(index, alive.get(index)) for index in range(self.hosts) if index not in joined]

    def gather_next(self, attempt: int) -> None:
        """Every node decided on a restart: the job gathers for `attempt` now (a replacement joins it)."""
        self.store.set("next", str(attempt).encode())

    # ---------------------------------------------------------------- the attempt's outcome

    def report(self, failure: Failure) -> Failure:
        """Records this node's failure; returns the origin of the attempt (this one when it came first)."""
        stamp = self.store.add(_attempt_key(failure.attempt, "seq"))
        failure = dataclasses.replace(failure, stamp=stamp)
        origin_key = _attempt_key(failure.attempt, "origin")
        if self.store.compare_and_set(origin_key, None, failure.encoded()):
            self.store.set(_attempt_key(failure.attempt, "over"), b"1")
            return failure
        origin = self.origin(failure.attempt) or failure
        # The same node's second report (the supervisor's at once, the verdict's after) is not a second failure.
        if (origin.task_index, origin.kind) != (failure.task_index, failure.kind):
            self.store.set(_attempt_key(failure.attempt, "secondary", failure.task_index), failure.encoded())
        return origin

    def ended(self, attempt: int, closes: bool = False) -> None:
        """This node's workers all exited 0; the last node to say so closes the attempt, or this one when it
        `closes` it alone (worker-0 of a launcher whose outcome is worker-0's)."""
        first_time = self.store.compare_and_set(_attempt_key(attempt, "ended", self.task_index), None, b"1")
        if first_time and (self.store.add(_attempt_key(attempt, "ended")) >= self.hosts or closes):
            self.store.set(_attempt_key(attempt, "over"), b"1")

    def over(self, attempt: int, timeout: float) -> bool:
        return self.store.wait([_attempt_key(attempt, "over")], timeout)

    def origin(self, attempt: int) -> Optional[Failure]:
        value = self.store.get(_attempt_key(attempt, "origin"))
        return Failure.decoded(value) if value is not None else None

    def secondary(self, attempt: int) -> List[Failure]:
        """The failures reported after the origin, in the store's receive order."""
        found = []
        for key in self.store.keys(_attempt_key(attempt, "secondary", "")):
            value = self.store.get(key)
            if value is not None:
                found.append(Failure.decoded(value))
        return sorted(found, key=lambda failure: failure.stamp)

    # ---------------------------------------------------------------- the end

    def saw(self, attempt: int) -> None:
        self.store.set(_attempt_key(attempt, "saw", self.task_index), b"1")

    def still_here(self, attempt: int, hosts: Sequence[int]) -> List[int]:
        """Of `hosts`, those alive that have not read `attempt`'s outcome."""
        done = self._indexes(_attempt_key(attempt, "saw", ""))
        live = {int(key.split("/", 1)[1]) for key in self.store.keys("node/")}
        return [index for index in hosts if index in live and index not in done]
