"""The job as one: where the nodes of a multi-node job meet, agree and learn who failed first.

A multi-node job is one job (issue 26): no node starts its command before every node is ready, the first
failure of an attempt anywhere stops every node's workers, and one decision (restart or end) is taken for the
job. `for_job` says which this node is:
- `Alone` (one node, MA_RUNTIME_COORDINATOR=off, or a launcher whose tasks end apart): the node's own decision is
  the job's, and nothing more is imported, started or opened (a single node's start-up is unchanged);
- `together.Together`, this node's part of the job over the job's coordination store (together.py).
The attempt loop (bootstrap._attempts) asks either the same things: `barrier` before an attempt, `watch` during
it (for the supervisor), `agree` after it (an `Agreement`), `leave` before the final sync, `close` at the end.
"""

import dataclasses
import threading
from typing import Any, Callable, Dict, Sequence

from ma_runtime.attempt import Attempt, Decision
from ma_runtime.launch import registry


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What the job decided after an attempt: this node's verdict (86 unless it failed first), the decision, the
    first failure by the store's clock and those after it."""

    verdict: Any  # verdict.Verdict
    decision: Decision
    origin: Any = None  # a coordination.job.Failure
    secondary: Sequence[Any] = ()

    def fields(self) -> Dict[str, Any]:
        """The termination message's `origin` and `secondary`."""
        if self.origin is None:
            return {}
        return {"origin": self.origin.origin_fields(),
                "secondary": [failure.origin_fields() for failure in self.secondary] or None}


class Alone:
    """One node, or nodes that do not coordinate: this node's decision is the job's."""

    def stage(self, name: str) -> None:
        pass

    def barrier(self, attempt: Attempt, _stopped: threading.Event) -> Attempt:
        return attempt

    def watch(self, attempt: Attempt, plan, wake: Callable[[], None]) -> None:
        return None

    def agree(self, attempt: Attempt, verdict, decision: Decision, _stopped: threading.Event) -> Agreement:
        return Agreement(verdict, decision)

    def leave(self, attempt: Attempt, stopped: bool) -> None:
        pass

    def close(self) -> None:
        pass


def for_job(spec, log) -> Any:
    """`Alone` for a one-node job, MA_RUNTIME_COORDINATOR=off or a launcher whose tasks end apart; else this node's
    part of the job (together.start)."""
    if spec.num_hosts <= 1 or spec.coordinator == "off":
        return Alone()
    if spec.run_method and not registry.launcher(spec.run_method).JOB_AS_ONE:
        log.info("the job's nodes act alone", reason=f"MA_RUN_METHOD={spec.run_method}: its tasks end apart")
        return Alone()
    from ma_runtime import together  # only a multi-node job pays for it

    return together.start(spec, log)
