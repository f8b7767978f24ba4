"""The restart rule, the backoff, and the attempt record that survives the runtime (issue 11)."""

import json
import types
from pathlib import Path

import pytest

from ma_runtime import attempt as attempt_module
from ma_runtime import spec as spec_module
from ma_runtime.attempt import Attempt, Policy
from ma_runtime.supervise.supervisor import State
from tests.recording import Log


def verdict(code=5, state=State.FAILED, line="boom"):
    return types.SimpleNamespace(state=state, exit_code=code, failure_key=(code, None, None, line))


POLICY = Policy(max_restarts=5, no_restart_codes=(93, 78), same_failure_limit=3, backoff=1.0)


def test_a_failure_restarts_while_the_budget_lasts_then_gives_up():
    history = []
    for number, line in zip(range(1, 7), "abcdef"):
        history.append(verdict(line=line))
        decision = POLICY.decide(Attempt(number, "r", 1), history[-1], history, stop_requested=False)
        assert decision.restart == (number <= 5), number
    assert decision.gave_up and "MA_RUNTIME_MAX_RESTARTS=5" in decision.why


def test_the_budget_counts_from_the_first_attempt_of_this_runtime():
    history = [verdict()]
    assert POLICY.decide(Attempt(9, "r", 5), history[-1], history, False).restart  # 4 restarts so far
    decision = POLICY.decide(Attempt(9, "r", 4), history[-1], history, False)
    assert decision.gave_up and decision.why.startswith("gave up after 6 attempts")


@pytest.mark.parametrize("state", [State.SUCCEEDED, State.STOPPED])
def test_success_and_a_requested_stop_never_restart(state):
    history = [verdict(0 if state is State.SUCCEEDED else 143, state)]
    decision = POLICY.decide(Attempt(1, "r", 1), history[-1], history, False)
    assert not decision.restart and not decision.gave_up


def test_a_failure_during_a_stop_is_not_restarted():
    history = [verdict()]
    decision = POLICY.decide(Attempt(1, "r", 1), history[-1], history, stop_requested=True)
    assert not decision.restart and not decision.gave_up


@pytest.mark.parametrize("code", [93, 78])
def test_a_no_restart_code_ends_the_job_with_that_code(code):
    history = [verdict(code)]
    decision = POLICY.decide(Attempt(1, "r", 1), history[-1], history, False)
    assert not decision.restart and not decision.gave_up and str(code) in decision.why


def test_restarts_off_leave_the_command_its_own_code():
    off = Policy(0, (93, 78), 3, 1.0)
    history = [verdict()]
    decision = off.decide(Attempt(1, "r", 1), history[-1], history, False)
    assert not decision.restart and not decision.gave_up


def test_the_same_failure_three_times_in_a_row_gives_up_early():
    history = [verdict(line="other"), verdict(), verdict()]
    assert POLICY.decide(Attempt(3, "r", 1), history[-1], history, False).restart  # two in a row
    history.append(verdict())
    decision = POLICY.decide(Attempt(4, "r", 1), history[-1], history, False)
    assert decision.gave_up and decision.why == "the same failure 3 times in a row"
    unlimited = Policy(5, (), 0, 0)
    assert unlimited.decide(Attempt(4, "r", 1), history[-1], history, False).restart


def test_backoff_first_restart_at_once_then_doubling_to_the_cap():
    assert [POLICY.delay(n) for n in range(1, 10)] == [0, 1, 2, 4, 8, 16, 32, 60, 60]
    assert Policy(5, (), 3, 0).delay(4) == 0
    assert Policy(5, (), 3, 100).delay(3) == 100  # a base above the cap is its own cap


@pytest.fixture
def spec(tmp_path):
    return spec_module.load({}, {"MA_HOME": str(tmp_path), "MA_VJ_NAME": "ma-job-1", "VC_TASK_INDEX": "2"})


def test_a_runtime_that_died_unfinished_is_continued(spec):
    log = Log()
    attempt_module.record(spec, Attempt(2, "old", 1))
    assert attempt_module.first(spec, "new", log) == Attempt(3, "new", 1)


def test_a_finished_run_starts_afresh(spec):
    log = Log()
    attempt_module.record(spec, Attempt(2, "old", 1), finished=True)
    assert attempt_module.first(spec, "new", log) == Attempt(1, "new", 1)


def test_another_pod_or_schedule_does_not_continue_the_record(spec, tmp_path):
    log = Log()
    attempt_module.record(spec, Attempt(2, "old", 1))
    rescheduled = spec_module.load({}, {"MA_HOME": str(tmp_path), "MA_VJ_NAME": "ma-job-1", "VC_TASK_INDEX": "2",
                                        "MA_SCHEDULE_CNT": "2"})
    assert attempt_module.first(rescheduled, "new", log).number == 1


def test_the_platforms_count_is_a_floor(spec, tmp_path):
    log = Log()
    attempt_module.record(spec, Attempt(2, "old", 1))
    later = spec_module.load({}, {"MA_HOME": str(tmp_path), "MA_VJ_NAME": "ma-job-1", "VC_TASK_INDEX": "2",
                                  "MA_PROC_START_CNT": "7"})
    assert attempt_module.first(later, "new", log).number == 7


@pytest.mark.parametrize("content", [b"", b"not json", b"[]", b'{"attempt": "2"}', b"\xff" * 10])
def test_an_unreadable_record_is_set_aside_and_the_run_starts_from_the_platforms_count(spec, content):
    log = Log()
    path = attempt_module.record_path(spec)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    assert attempt_module.first(spec, "new", log).number == 1
    (warning,) = log.fields("record set aside", "warning")
    assert warning["path"] == str(path) and not path.exists()
    assert Path(warning["kept_as"]).read_bytes() == content  # kept, for whoever wants to look


def test_the_record_names_the_pod(spec):
    attempt_module.record(spec, Attempt(4, "run", 3))
    document = json.loads(attempt_module.record_path(spec).read_text())
    assert document == {"pod": {"vj_name": "ma-job-1", "task_name": "worker", "task_index": 2, "schedule_cnt": 1},
                        "attempt": 4, "first": 3, "run_id": "run", "finished": False}


# --------------------------------------------------------------------------- hang restarts (issue 13)


def hung(progressed=False):
    return types.SimpleNamespace(state=State.HUNG, exit_code=83, progressed=progressed,
                                 failure_key=(83, None, None, ""))


HANGS = Policy(max_restarts=0, no_restart_codes=(93, 78), same_failure_limit=3, backoff=1.0, hang_restarts=3)


def test_hung_attempts_restart_at_once_three_times_in_a_row_then_the_job_ends_with_their_83():
    history = []
    for number in range(1, 5):
        history.append(hung())
        decision = HANGS.decide(Attempt(number, "r", 1), history[-1], history, False)
        if number <= 3:
            assert decision.restart and decision.delay == 0 and decision.left == 3 - number, number
    assert not decision.restart and not decision.gave_up  # 83 stays: the job hung, restarts did not help
    assert "4 hung attempt(s) in a row: MA_RUNTIME_HANG_RESTARTS=3" in decision.why


def test_an_attempt_that_made_progress_before_it_hung_starts_the_count_again():
    history = [hung(), hung(), hung(progressed=True), hung(), hung()]
    decision = HANGS.decide(Attempt(5, "r", 1), history[-1], history, False)
    assert decision.restart and decision.left == 0  # 3 in a row, counting the one that progressed


def test_a_failure_breaks_the_run_of_hangs_and_hang_restarts_spend_no_failure_restarts():
    policy = Policy(max_restarts=1, no_restart_codes=(93, 78), same_failure_limit=3, backoff=1.0, hang_restarts=1)
    history = [hung(), verdict(line="a")]
    # Attempt 2 is the first failure: one restart spent of one, though this is the runtime's second restart.
    assert policy.decide(Attempt(2, "r", 1), history[-1], history, False).restart
    history += [hung()]
    assert policy.decide(Attempt(3, "r", 1), history[-1], history, False).restart  # one hang in a row
    history += [verdict(line="b")]
    decision = policy.decide(Attempt(4, "r", 1), history[-1], history, False)
    assert decision.gave_up  # the second failure: the one failure restart is spent


def test_hang_restarts_off_end_the_job_at_the_first_hang_and_a_stop_request_wins():
    off = Policy(0, (93, 78), 3, 1.0, hang_restarts=0)
    history = [hung()]
    assert not off.decide(Attempt(1, "r", 1), history[-1], history, False).restart
    decision = HANGS.decide(Attempt(1, "r", 1), history[-1], history, stop_requested=True)
    assert not decision.restart and decision.why == "a stop was requested"


@pytest.mark.parametrize("decision", [attempt_module.Decision(True, delay=2.0, left=1),
                                      attempt_module.Decision(False, "gave up after 3 attempts", gave_up=True),
                                      attempt_module.Decision(False)])
@pytest.mark.parametrize("settings", [{}, {"MA_NUM_HOSTS": "4", "MA_RUNTIME_COORDINATOR": "off"}])
def test_a_node_alone_takes_its_own_decision_as_the_jobs(decision, settings):
    """The seam for a job-wide decision (coordinator.py): one node, or MA_RUNTIME_COORDINATOR=off, keeps its own
    decision and verdict, and starts no store (no thread, no port)."""
    import threading

    from ma_runtime import coordinator
    from ma_runtime import spec as spec_module

    before = threading.active_count()
    job = coordinator.for_job(spec_module.load({}, settings, None), None)
    assert isinstance(job, coordinator.Alone) and threading.active_count() == before
    agreed = job.agree(Attempt(2, "run", 1), "its verdict", decision, threading.Event())
    assert agreed.decision is decision and agreed.verdict == "its verdict" and agreed.fields() == {}
