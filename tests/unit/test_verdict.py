"""The verdict: exit code, category, reason, failing rank, for every state of an attempt, one worker or
several (issue 11), and torchrun's root cause (issue 10, item 19)."""

import types

import pytest

from ma_runtime import verdict
from ma_runtime.launch import plan as plan_module
from ma_runtime.launch import torchrun
from ma_runtime.supervise.supervisor import Outcome, State
from ma_runtime.util.output import LinePump

SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_05:00:49
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 19876)
"""


def torchrun_worker(summary: str):
    pump = LinePump(-1, [], "torchrun-stderr")
    pump._keep_tail(summary.encode())
    return types.SimpleNamespace(pid=123, pumps=[LinePump(-1, [], "torchrun-stdout"), pump], stderr_pump=pump)


def torchrun_plan():
    worker = plan_module.WorkerPlan("torchrun", ("torchrun", "t.py"), {})
    return plan_module.Plan(plan_module.TORCHRUN, "test", (worker,), 1, 2)


@pytest.mark.parametrize(
    "code, exit_code, reason, signal",
    [
        ("3", 3, "rank 1 failed first: the command exited with code 3", None),
        ("-9", 137, "rank 1 failed first: the command was killed by SIGKILL", "SIGKILL"),
        ("-11", 139, "rank 1 failed first: the command died of SIGSEGV", "SIGSEGV"),
    ],
)
def test_torchruns_failing_rank_gives_the_code_the_reason_and_the_signal(code, exit_code, reason, signal):
    worker = torchrun_worker(SUMMARY.format(code=code))
    outcome = Outcome(returncode=1, exit_code=1, worker=worker)  # torchrun's own 1, whatever the ranks did
    found = verdict.of(outcome, torchrun_plan(), torchrun.LAUNCHER.root_cause)
    assert (found.state, found.exit_code, found.rank, found.reason, found.signal) == (
        State.FAILED, exit_code, 1, reason, signal)


def test_without_a_summary_torchruns_own_code_stands():
    worker = torchrun_worker("RuntimeError: something else\n")
    found = verdict.of(Outcome(returncode=1, exit_code=1, worker=worker), torchrun_plan(), torchrun.LAUNCHER.root_cause)
    assert (found.exit_code, found.reason, found.rank) == (1, "the command exited with code 1", None)


def a_worker(name="command", lines=("last words",)):
    pump = LinePump(-1, [], f"{name}-stderr")
    pump._keep_tail("".join(line + "\n" for line in lines).encode())
    return types.SimpleNamespace(pid=7, name=name, pumps=[LinePump(-1, [], f"{name}-stdout"), pump],
                                 stderr_pump=pump)


def rtf_plan(count):
    workers = tuple(plan_module.WorkerPlan(f"rank-{r}", ("python", "t.py"), {}, rank=r) for r in range(count))
    return plan_module.Plan(plan_module.RTF, "test", workers, 1, count)


PLAIN = plan_module.Plan(plan_module.PLAIN, "test", (plan_module.WorkerPlan("command", ("true",), {}),), 1, 1)
# state, outcome fields -> exit code, category, reason, rank (one worker: plain; several: RTF, rank-2 deciding)
CASES = {
    "succeeded": (dict(returncode=0, exit_code=0), State.SUCCEEDED, 0, "user", "", None),
    "failed": (dict(returncode=5, exit_code=5), State.FAILED, 5, "user", "the command exited with code 5", 2),
    "died": (dict(returncode=-11, exit_code=139), State.FAILED, 139, "user", "the command died of SIGSEGV", 2),
    "oom": (dict(returncode=-9, exit_code=137), State.FAILED, 137, "infrastructure",
            "the command was killed by SIGKILL", 2),
    "stopped": (dict(returncode=-15, exit_code=143, stop_signal=15), State.STOPPED, 143, "platform",
                "stopped by SIGTERM", None),
    "stopped-clean": (dict(returncode=7, exit_code=7, stop_signal=15), State.STOPPED, 7, "platform",
                      "stopped by SIGTERM", None),
    "stopped-forced": (dict(returncode=-9, exit_code=143, stop_signal=15, forced=True), State.STOPPED, 143,
                       "platform", "stopped by SIGTERM; the command did not exit within the grace period and was "
                       "killed", None),
}


@pytest.mark.parametrize("several", [False, True], ids=["one", "several"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_state_with_one_worker_or_several(case, several):
    fields, state, exit_code, category, reason, rank = CASES[case]
    worker = a_worker("rank-2" if several else "command")
    failed = "rank-2" if several and state is State.FAILED else None
    outcome = Outcome(worker=worker, failed_worker=failed, duration=1.5, **fields)
    found = verdict.of(outcome, rtf_plan(4) if several else PLAIN)
    expected_rank = rank if several else None
    expected_reason = f"rank {rank} failed first: {reason}" if several and rank is not None else reason
    assert (found.state, found.exit_code, found.category, found.reason, found.rank) == (
        state, exit_code, category, expected_reason, expected_rank)
    assert found.tail == (["last words"] if exit_code else found.tail)
    assert found.summary(3) == {"attempt": 3, "exit_code": exit_code, "signal": found.signal, "rank": expected_rank,
                                "reason": expected_reason, "duration_s": 1.5}


def test_the_signal_named_is_the_stop_not_the_death():
    found = verdict.of(Outcome(returncode=-9, exit_code=143, stop_signal=15, forced=True, worker=a_worker()), PLAIN)
    assert found.signal == "SIGTERM"
    found = verdict.of(Outcome(returncode=-6, exit_code=134, worker=a_worker()), PLAIN)
    assert found.signal == "SIGABRT"


def test_after_a_stop_the_command_keeps_its_own_code_unless_the_kill_ended_it():
    # Issue 24 item 9: `command exited exit_code=143 returncode=1`. The supervisor now says forced only when its
    # grace-over SIGKILL is what a worker died of (tests/e2e/test_stop_codes.py: the race, real processes).
    outcome = Outcome(returncode=1, exit_code=1, stop_signal=15, forced=False, worker=a_worker())
    found = verdict.of(outcome, PLAIN)
    assert (found.exit_code, found.returncode, found.reason, found.signal) == (1, 1, "stopped by SIGTERM", "SIGTERM")
    # Died of the forwarded SIGTERM by itself: 143, and not "killed".
    died = verdict.of(Outcome(returncode=-15, exit_code=143, stop_signal=15, worker=a_worker()), PLAIN)
    assert (died.exit_code, died.reason) == (143, "stopped by SIGTERM")
    # A launcher whose code after a stop is its own: 128+N whatever it exited with.
    assert verdict.of(outcome, torchrun_plan(), own_code_after_stop=False).exit_code == 143
    # Killed: 128+N, and the reason says so.
    killed = verdict.of(Outcome(returncode=-9, exit_code=143, stop_signal=15, forced=True, worker=a_worker()), PLAIN)
    assert (killed.exit_code, killed.reason.endswith("did not exit within the grace period and was killed")) == (
        143, True)


def test_giving_up_is_82_with_the_last_attempts_reason_and_rank():
    last = verdict.of(Outcome(returncode=5, exit_code=5, worker=a_worker("rank-1"), failed_worker="rank-1"),
                      rtf_plan(2))
    final = verdict.gave_up(last, "the same failure 3 times in a row")
    assert final.exit_code == 82 and final.rank == 1 and final.tail == last.tail
    assert final.reason == "the same failure 3 times in a row; the last attempt: rank 1 failed first: the command " \
                           "exited with code 5"
    assert "MA_RUNTIME_MAX_RESTARTS" in final.hint


def test_two_failures_are_the_same_by_code_rank_and_last_line():
    def failed(code=5, rank="rank-1", line="ValueError: bad"):
        return verdict.of(Outcome(returncode=code, exit_code=code, worker=a_worker(rank, ("x", line)),
                                  failed_worker=rank), rtf_plan(2))

    assert failed().failure_key == failed().failure_key
    assert failed().failure_key != failed(code=6).failure_key
    assert failed().failure_key != failed(rank="rank-0").failure_key
    assert failed().failure_key != failed(line="ValueError: other").failure_key


# --------------------------------------------------------------------------- a hung attempt (issue 13)


def a_hang(device_fault=None, odd=(), progressed=False):
    from ma_runtime.supervise.hang import Hang

    stacks = types.SimpleNamespace(odd=list(odd), describe=lambda: "rank 3 is elsewhere (t.py:9 in load)")
    return Hang("no IO and at most 0.01 CPU cores for 600 s", device_fault, progressed, 1.0, stacks)


@pytest.mark.parametrize("odd, rank", [(["rank 3"], 3), (["rank 3", "rank 5"], None), ([], None)])
def test_a_hung_attempt_is_83_suspected_hung_with_where_it_was_and_the_odd_rank(odd, rank):
    outcome = Outcome(returncode=-15, exit_code=83, worker=a_worker("rank-0"), hang=a_hang(odd=odd))
    found = verdict.of(outcome, rtf_plan(8))
    assert (found.state, found.exit_code, found.category, found.rank) == (State.HUNG, 83, "user", rank)
    assert found.reason == "job suspected hung: no IO and at most 0.01 CPU cores for 600 s; rank 3 is elsewhere " \
                           "(t.py:9 in load)"
    assert found.signal is None and not found.progressed


def test_a_hang_with_a_device_fault_is_the_infrastructures():
    outcome = Outcome(returncode=-15, exit_code=83, worker=a_worker(), hang=a_hang("nvidia-smi: GPU 2: lost", (),
                                                                                    True))
    found = verdict.of(outcome, PLAIN)
    assert found.category == "infrastructure" and "GPU 2: lost" in found.hint and found.progressed


def test_a_stop_request_during_a_hang_stop_is_still_a_hang_a_stop_before_it_a_stop():
    assert Outcome(returncode=-15, exit_code=83, hang=a_hang()).state is State.HUNG
    assert Outcome(returncode=-15, exit_code=143, stop_signal=15, hang=a_hang()).state is State.STOPPED
