"""The attempt: which start of the command this is, how it is remembered, and whether there is a next.

`Attempt` is the one value that names a start of the command (number and run id): the plan, the
environment, the log lines and the record all read it; nothing else reads `MA_PROC_START_CNT` to find out.
One function writes its number into an environment, launch/base.common_env: every launcher's plan gives it to
the workers, and supervise/attempt_processes.worker_env to the hooks and services.

The number survives the runtime. Before each launch it is written atomically to
`<state>/attempt-<task>-<index>.json` with the pod it belongs to (`MA_VJ_NAME`, `VC_TASK_INDEX`,
`MA_SCHEDULE_CNT`). A runtime started again in the same pod after the last one died without finishing
(SIGKILL, the OOM killer) goes on from the record: the next attempt is the recorded one + 1, and the
restart budget counts from the recorded first attempt. A runtime that finished, whatever its exit code,
marks the record finished, so running the same job again (the demo twice on a laptop) starts afresh.
`MA_PROC_START_CNT` from the platform is a floor: the platform's own restarts count too.

One runtime owns a pod's record at a time: it holds an flock on `attempt-<task>-<index>.lock` beside the record
for the whole run (the kernel lets go when the process dies, SIGKILL included). A runtime that cannot own it runs
unrecorded: nested in another runtime (MA_RUNTIME_LINEAGE names its parent's run), or started beside one that holds
the lock, it counts from the platform's MA_PROC_START_CNT (a nested one inherits its parent's attempt there), says
why in one line, and neither continues, writes nor finishes the record. A record that does not validate field by
field is set aside (records.py) and the run is a first start.

`Policy.decide` is the restart rule: a failed attempt (non-zero exit, or death by a signal) is
started again while the budget (`MA_RUNTIME_MAX_RESTARTS`) lasts, unless its exit code says not to
(`MA_RUNTIME_NO_RESTART_EXIT_CODES`, and the runtime's own 78), a stop was requested, or the same
failure came `MA_RUNTIME_SAME_FAILURE_LIMIT` times in a row (a deterministic bug must not burn the
whole budget). Backoff: the first restart at once, then the base, doubling, up to `BACKOFF_CAP`
(or the base, when that is larger).

A hung attempt (the hang monitor stopped it) is the platform's "hang restart": started again at once, on a
budget of its own (`MA_RUNTIME_HANG_RESTARTS` hung attempts in a row; one that made progress for a window
before it hung starts the count again), and it spends none of `MA_RUNTIME_MAX_RESTARTS`. Used up: the job
ends with the hung attempt's 83.
"""

import dataclasses
import errno
import fcntl
import json
import os
from pathlib import Path
from typing import Any, Dict, Mapping, Sequence

from ma_runtime.errors import ExitCode
from ma_runtime.process.worker import LINEAGE_ENV
from ma_runtime.supervise.supervisor import State
from ma_runtime.util import files, records

BACKOFF_CAP = 60.0
# The runtime's own "bad configuration" is never worth a retry, whatever the setting says.
ALWAYS_FINAL = (int(ExitCode.BAD_CONFIGURATION),)
_RECORD_LIMIT = 64 * 1024
# MA_PROC_START_CNT's documented range (spec/table.py): a recorded attempt past it is not one this runtime made.
MAX_ATTEMPT = 1_000_000
MAX_TASK_INDEX = 99_999  # VC_TASK_INDEX's (spec/table.py)
# The pod records this process owns: lock path -> the descriptor holding its lock, for the whole run.
_owned: Dict[str, int] = {}


@dataclasses.dataclass(frozen=True)
class Attempt:
    number: int  # MA_PROC_START_CNT of this start
    run_id: str
    first: int  # the first attempt of this runtime (or of the one it took over from): the budget counts from it
    # False: another runtime owns the pod's record (this one is nested in it, or beside it): never written.
    recorded: bool = dataclasses.field(default=True, compare=False)

    @property
    def restarts(self) -> int:
        return self.number - self.first


@dataclasses.dataclass(frozen=True)
class Decision:
    restart: bool
    why: str = ""  # why not, when the job ends on a failure: the reason of an exit 82
    gave_up: bool = False  # the job ends with 82: restarts were on and did not help
    delay: float = 0.0  # backoff before the next attempt
    left: int = 0  # restarts of this kind still allowed after this one


@dataclasses.dataclass(frozen=True)
class Policy:
    max_restarts: int
    no_restart_codes: Sequence[int]
    same_failure_limit: int
    backoff: float
    hang_restarts: int = 0

    @classmethod
    def of(cls, spec) -> "Policy":
        return cls(spec.max_restarts, tuple(spec.no_restart_exit_codes) + ALWAYS_FINAL, spec.same_failure_limit,
                   spec.restart_backoff_seconds, spec.hang_restarts)

    def decide(self, attempt: Attempt, verdict, history: Sequence[Any], stop_requested: bool) -> Decision:
        """`history`: the verdicts of this runtime's attempts so far, the last one `verdict`."""
        if verdict.state not in (State.FAILED, State.HUNG):
            return Decision(False)
        if stop_requested:
            return Decision(False, "a stop was requested")
        if verdict.state is State.HUNG:
            return self._after_hang(history)
        if self.max_restarts == 0:
            return Decision(False)  # restarts off: the command's own code, as without the runtime
        if verdict.exit_code in self.no_restart_codes:
            return Decision(False, f"exit code {verdict.exit_code} means do not restart")
        if self.same_failure_limit and _repeats(history) >= self.same_failure_limit:
            return Decision(False, f"the same failure {_repeats(history)} times in a row", gave_up=True)
        # Hang restarts have a budget of their own (the platform's: they "do not consume max restarts").
        spent = attempt.restarts - sum(1 for earlier in history[:-1] if earlier.state is State.HUNG)
        if spent >= self.max_restarts:
            return Decision(False, f"gave up after {attempt.restarts + 1} attempts: MA_RUNTIME_MAX_RESTARTS="
                                   f"{self.max_restarts} restart(s) spent", gave_up=True)
        return Decision(True, delay=self.delay(spent + 1), left=self.max_restarts - spent - 1)

    def _after_hang(self, history: Sequence[Any]) -> Decision:
        hung = _hangs_in_a_row(history)
        if hung > self.hang_restarts:
            return Decision(False, f"{hung} hung attempt(s) in a row: MA_RUNTIME_HANG_RESTARTS={self.hang_restarts}")
        return Decision(True, left=self.hang_restarts - hung)

    def delay(self, restart: int) -> float:
        """Seconds before restart number `restart` (1, 2, ...)."""
        if restart <= 1 or self.backoff <= 0:
            return 0.0
        return min(self.backoff * 2 ** (restart - 2), max(BACKOFF_CAP, self.backoff))


def _hangs_in_a_row(history: Sequence[Any]) -> int:
    """Hung attempts at the end of `history`, back to (and with) the last one that had made progress."""
    count = 0
    for verdict in reversed(history):
        if verdict.state is not State.HUNG:
            break
        count += 1
        if verdict.progressed:
            break
    return count


def _repeats(history: Sequence[Any]) -> int:
    """How many of the last verdicts in a row are the same failure as the last one."""
    count = 0
    for verdict in reversed(history):
        if verdict.failure_key != history[-1].failure_key:
            break
        count += 1
    return count


# --------------------------------------------------------------------------- the record


def record_path(spec) -> Path:
    return spec.state_dir / f"attempt-{spec.task_name}-{spec.task_index}.json"


def lock_path(spec) -> Path:
    """Beside the record, a file of its own: the record is replaced by a rename, which a lock would not survive."""
    return spec.state_dir / f"attempt-{spec.task_name}-{spec.task_index}.lock"


def _pod(spec) -> Dict[str, Any]:
    return {"vj_name": spec.vj_name, "task_name": spec.task_name, "task_index": spec.task_index,
            "schedule_cnt": spec.schedule_cnt}


def first(spec, run_id: str, log, environ: Mapping[str, str] = os.environ) -> Attempt:
    """The first attempt of this runtime: the platform's count, or the record of a runtime that died. A runtime that
    does not own the pod's record (nested in another, or beside one) counts from the platform's alone, unrecorded."""
    floor = spec.proc_start_cnt
    why_not = _not_the_owner(spec, environ)
    if why_not:
        level = log.info if environ.get(LINEAGE_ENV) else log.warning
        level(f"attempt not recorded: {why_not}", attempt=floor, record=str(record_path(spec)))
        return Attempt(floor, run_id, floor, recorded=False)
    previous = records.load(record_path(spec), _valid, log, "the attempt record",
                            then="this run starts as a first start", limit=_RECORD_LIMIT)
    if previous and previous["pod"] == _pod(spec) and not previous["finished"]:
        number = max(floor, previous["attempt"] + 1)
        log.info("continuing after a runtime that did not finish", previous_attempt=previous["attempt"],
                 attempt=number, record=str(record_path(spec)))
        return Attempt(number, run_id, previous["first"])
    return Attempt(floor, run_id, floor)


def record(spec, attempt: Attempt, finished: bool = False) -> None:
    """Before each launch (finished=False) and at the end of the run (finished=True); nothing for an attempt that is
    not recorded (`first`)."""
    if not attempt.recorded:
        return
    document = {"pod": _pod(spec), "attempt": attempt.number, "first": attempt.first, "run_id": attempt.run_id,
                "finished": finished}
    path = record_path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_atomically(path, (json.dumps(document) + "\n").encode())


def release(spec) -> None:
    """Lets go of the pod's record (the process's exit does it too)."""
    fd = _owned.pop(str(lock_path(spec)), None)
    if fd is not None:
        os.close(fd)


def _forget_in_child() -> None:
    """In a child forked without exec (the guard, which outlives a SIGKILLed runtime while it sweeps): its copies
    closed, so the lock is the runtime's alone and goes with it. A child that execs drops them anyway (CLOEXEC)."""
    for fd in _owned.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _owned.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _not_the_owner(spec, environ: Mapping[str, str]) -> str:
    """Why this runtime must leave the pod's record alone, or "" once it holds the record's lock for the run.

    A nested runtime (`ma-run ma-run ...`: its parent's MA_RUNTIME_LINEAGE) runs inside an attempt its parent
    counts. Beside another runtime, the lock is that one's. A lock that cannot be had for another reason (a
    read-only state folder, a file system without locks) leaves the record as it was before locks: read, and
    written when it can be."""
    if environ.get(LINEAGE_ENV):
        return f"this runtime runs inside another ({LINEAGE_ENV} is set), which counts the attempts"
    path = lock_path(spec)
    if str(path) in _owned:
        return ""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Close-on-exec: no command, hook or helper holds the lock after the runtime is gone.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError:
        return ""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return f"another runtime in this pod holds the record ({path})"
        return ""
    _owned[str(path)] = fd
    return ""


def _valid(document: Any) -> Dict[str, Any]:
    """The record's fields, each of its type and range, `first` no later than `attempt`; else records.Invalid."""
    records.mapping(document, "the record")
    records.exactly(document, ("pod", "attempt", "first", "run_id", "finished"), "the record")
    pod = records.mapping(document["pod"], "`pod`")
    records.exactly(pod, ("vj_name", "task_name", "task_index", "schedule_cnt"), "`pod`")
    records.text(pod["vj_name"], "`pod.vj_name`", optional=True)
    records.text(pod["task_name"], "`pod.task_name`")
    records.integer(pod["task_index"], "`pod.task_index`", 0, MAX_TASK_INDEX)
    records.integer(pod["schedule_cnt"], "`pod.schedule_cnt`", 1, MAX_ATTEMPT)
    # The next start is the recorded one + 1, and MA_PROC_START_CNT stays in its documented range.
    attempt = records.integer(document["attempt"], "`attempt`", 1, MAX_ATTEMPT - 1)
    records.integer(document["first"], "`first`", 1, attempt)
    records.text(document["run_id"], "`run_id`")
    records.flag(document["finished"], "`finished`")
    return document
