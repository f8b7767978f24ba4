"""Where a job-wide decision sits: after this node's own (`attempt.Policy.decide`) and before its next plan.

A multi-node job is one job: when one node restarts its workers, every node must (issue 26's coordinator makes
the nodes agree, and names the node that caused it). Alone, a node agrees with itself: `Alone` returns its own
decision unchanged, which is what every job gets today.
"""

from typing import Protocol

from ma_runtime.attempt import Attempt, Decision


class Coordinator(Protocol):
    def agree(self, attempt: Attempt, verdict, decision: Decision) -> Decision:
        """The decision the whole job takes after `attempt` ended with `verdict`, given this node's `decision`."""


class Alone:
    """One node, or nodes that do not coordinate: this node's decision is the job's."""

    def agree(self, attempt: Attempt, verdict, decision: Decision) -> Decision:
        return decision


def for_job(spec) -> Coordinator:
    return Alone()
