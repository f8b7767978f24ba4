"""The verdict on an attempt, and on the job: exit code, category, reason, hint, failing rank.

One attempt's verdict comes from its `Outcome` (supervise/supervisor.py) and the plan that ran:
- SUCCEEDED: 0.
- STOPPED (SIGTERM/SIGINT): 128+N when the stop's SIGKILL ended the command, or when the launcher's
  code after a stop is its own and not the command's (torchrun's 1, msrun's 0); else the command's own
  code (a handler that saved and exited 7 gives 7). `forced` is the supervisor's: its grace-over SIGKILL is what
  a worker died of; a command whose own exit landed as the grace ended keeps its code.
- FAILED: the status of the worker that failed first; for a launcher that names a root cause in its
  output (torchrun exits 1 whatever its ranks did), that rank and its status.
- HUNG: 83, `job suspected hung: <evidence>; <where the stacks say the ranks are>`; category user unless
  the accelerator tool reported a device lost or unhealthy, or could read none (infrastructure); the rank
  when the stacks found exactly one odd one out.

The job's verdict is the last attempt's, unless the runtime gave up restarting (`gave_up`, exit 82).
"""

import dataclasses
from typing import Any, Callable, Dict, Optional, Sequence

from ma_runtime.errors import Category, ExitCode
from ma_runtime.process import lifecycle
from ma_runtime.process.worker import SIGNAL_NAMES, tail
from ma_runtime.supervise.supervisor import Outcome, State

# How much of the deciding worker's output a launcher's root-cause parser reads.
ROOT_CAUSE_LINES = 60
RootCauseOf = Callable[[Sequence[str]], Any]  # lines -> a RootCause (rank, returncode) or None


@dataclasses.dataclass(frozen=True)
class Verdict:
    state: State
    exit_code: int
    returncode: int  # the deciding status, Popen style (-N: signal N)
    rank: Optional[int] = None  # the rank that failed first, when one did
    signal: Optional[str] = None  # the signal that explains the exit code: the stop's, else the death's
    reason: str = ""
    category: str = Category.USER.value
    hint: str = ""
    tail: Sequence[str] = ()
    duration: float = 0.0
    progressed: bool = False  # HUNG: it made progress for a window first, so the count of hangs in a row starts over

    @property
    def cause(self) -> str:
        """The reason without "rank N failed first: ": for a record that names the rank beside it."""
        prefix = _rank_first(self.rank, "")
        return self.reason[len(prefix):] if self.rank is not None and self.reason.startswith(prefix) else self.reason

    @property
    def failure_key(self) -> tuple:
        """What makes two failures "the same": code or signal, rank, and the last line the command printed."""
        return self.exit_code, self.signal, self.rank, self.tail[-1].strip() if self.tail else ""

    def summary(self, attempt: int) -> Dict[str, Any]:
        """One entry of the termination message's `attempts`."""
        return {"attempt": attempt, "exit_code": self.exit_code, "signal": self.signal, "rank": self.rank,
                "reason": self.reason, "duration_s": round(self.duration, 3)}


def of(outcome: Outcome, plan=None, root_cause: Optional[RootCauseOf] = None, own_code_after_stop: bool = True
       ) -> Verdict:
    """`root_cause` and `own_code_after_stop`: the launcher's (launch/<method>.py)."""
    worker = outcome.worker
    if outcome.state is State.HUNG:
        return _hung(outcome)
    if outcome.state is State.ELSEWHERE:
        return elsewhere(outcome.elsewhere or "", outcome.returncode, tail(worker) if worker is not None else (),
                         outcome.duration)
    rank, returncode, exit_code = _failed_rank(outcome, plan, root_cause)
    killed = outcome.forced
    if outcome.stop_signal is not None:
        # The launcher's own code after a stop says nothing of the command; our SIGKILL's says only that we killed.
        exit_code = 128 + outcome.stop_signal if killed or not own_code_after_stop else lifecycle.exit_code(returncode)
    death = SIGNAL_NAMES.get(-returncode) if returncode < 0 else None
    stop = SIGNAL_NAMES.get(outcome.stop_signal) if outcome.stop_signal else None
    reason, category, hint = (("", Category.USER.value, "") if exit_code == 0 else
                              _explain(outcome, death, exit_code, killed))
    if rank is not None and outcome.stop_signal is None and exit_code != 0:
        reason = _rank_first(rank, reason)
    return Verdict(outcome.state, exit_code, returncode, rank, stop or death, reason, category, hint,
                   tail(worker) if worker is not None else (), outcome.duration)


def _rank_first(rank: Optional[int], reason: str) -> str:
    return f"rank {rank} failed first: {reason}"


def _hung(outcome: Outcome) -> Verdict:
    hang = outcome.hang
    if hang.device_fault:
        category = Category.INFRASTRUCTURE.value
        hint = f"the accelerator tool reported a device fault while the job hung ({hang.device_fault}): drain the " \
               "node and reschedule the job"
    else:
        category = Category.USER.value
        hint = "see where each rank was stuck (the stacks above and in the log directory): the odd one out is " \
               "usually the cause; a progress signal (MA_RUNTIME_PROGRESS_FILE, MA_RUNTIME_PROGRESS_PATTERN) or a " \
               "longer MA_HANG_DETECT_TIME avoids false alarms"
    return Verdict(State.HUNG, int(ExitCode.HANG_DETECTED), outcome.returncode, hang.rank, None, hang.describe(),
                   category, hint, tail(outcome.worker) if outcome.worker is not None else (), outcome.duration,
                   hang.progressed)


def elsewhere(reason: str, returncode: int = 0, lines: Sequence[str] = (), duration: float = 0.0) -> Verdict:
    """86: this node's workers were stopped, or its command's failure came second, because another node of the job
    failed, hung or was lost first (`reason` names that node: coordinator.py)."""
    return Verdict(State.ELSEWHERE, int(ExitCode.STOPPED_FOR_JOB), returncode, None, None, reason,
                   Category.PLATFORM.value, "the node named first is where to look: its log and its termination "
                   "message say why; this node only followed the job", tuple(lines), duration)


def gave_up(last: Verdict, why: str) -> Verdict:
    """The job's verdict when no further attempt is made although the last one failed (exit 82)."""
    return dataclasses.replace(
        last,
        exit_code=int(ExitCode.RESTARTS_EXHAUSTED),
        reason=f"{why}; the last attempt: {last.reason}",
        hint=last.hint if last.category != Category.USER.value else
        "fix the failure shown in the tail; MA_RUNTIME_MAX_RESTARTS and MA_RUNTIME_SAME_FAILURE_LIMIT set how often "
        "the runtime retries",
    )


def _failed_rank(outcome: Outcome, plan, root_cause: Optional[RootCauseOf]) -> tuple:
    """(rank that failed first or None, its Popen-style status, the attempt's exit code)."""
    if outcome.exit_code == 0 or plan is None:
        return None, outcome.returncode, outcome.exit_code
    if root_cause is not None and outcome.stop_signal is None and outcome.worker is not None:
        cause = root_cause(tail(outcome.worker, ROOT_CAUSE_LINES))
        if cause is not None and cause.returncode != 0:
            return cause.rank, cause.returncode, lifecycle.exit_code(cause.returncode)
    ranks = {planned.name: planned.rank for planned in plan.workers}
    return ranks.get(outcome.failed_worker), outcome.returncode, outcome.exit_code


def _explain(outcome: Outcome, death: Optional[str], exit_code: int, killed: bool):
    """(reason, category, hint) for a non-zero exit; `killed`: the stop's SIGKILL ended the command."""
    if outcome.stop_signal is not None:
        stop = SIGNAL_NAMES[outcome.stop_signal]
        if killed:
            return (
                f"stopped by {stop}; the command did not exit within the grace period and was killed",
                Category.PLATFORM.value,
                "handle SIGTERM in the training code (save and exit), or raise MA_RUNTIME_STOP_GRACE_SECONDS",
            )
        return f"stopped by {stop}", Category.PLATFORM.value, ""
    if death == "SIGKILL":
        return (
            "the command was killed by SIGKILL",
            Category.INFRASTRUCTURE.value,
            "SIGKILL from nobody we know of is often the out-of-memory killer: check memory use",
        )
    if death:
        return f"the command died of {death}", Category.USER.value, "see the last lines of its output"
    return f"the command exited with code {exit_code}", Category.USER.value, "see the last lines of its output"
