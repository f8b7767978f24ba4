"""The restart rule, the backoff, and the attempt record that survives the runtime (issue 11)."""

import json
import types

import pytest

from ma_runtime import attempt as attempt_module
from ma_runtime import spec as spec_module
from ma_runtime.attempt import Attempt, Policy
from ma_runtime.supervise.supervisor import State


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
    log = types.SimpleNamespace(info=lambda *a, **k: None)
    attempt_module.record(spec, Attempt(2, "old", 1))
    assert attempt_module.first(spec, "new", log) == Attempt(3, "new", 1)


def test_a_finished_run_starts_afresh(spec):
    log = types.SimpleNamespace(info=lambda *a, **k: None)
    attempt_module.record(spec, Attempt(2, "old", 1), finished=True)
    assert attempt_module.first(spec, "new", log) == Attempt(1, "new", 1)


def test_another_pod_or_schedule_does_not_continue_the_record(spec, tmp_path):
    log = types.SimpleNamespace(info=lambda *a, **k: None)
    attempt_module.record(spec, Attempt(2, "old", 1))
    rescheduled = spec_module.load({}, {"MA_HOME": str(tmp_path), "MA_VJ_NAME": "ma-job-1", "VC_TASK_INDEX": "2",
                                        "MA_SCHEDULE_CNT": "2"})
    assert attempt_module.first(rescheduled, "new", log).number == 1


def test_the_platforms_count_is_a_floor(spec, tmp_path):
    log = types.SimpleNamespace(info=lambda *a, **k: None)
    attempt_module.record(spec, Attempt(2, "old", 1))
    later = spec_module.load({}, {"MA_HOME": str(tmp_path), "MA_VJ_NAME": "ma-job-1", "VC_TASK_INDEX": "2",
                                  "MA_PROC_START_CNT": "7"})
    assert attempt_module.first(later, "new", log).number == 7


@pytest.mark.parametrize("content", [b"", b"not json", b"[]", b'{"attempt": "2"}', b"\xff" * 10])
def test_an_unreadable_record_starts_from_the_platforms_count(spec, content):
    log = types.SimpleNamespace(info=lambda *a, **k: None)
    path = attempt_module.record_path(spec)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    assert attempt_module.first(spec, "new", log).number == 1


def test_the_record_names_the_pod(spec):
    attempt_module.record(spec, Attempt(4, "run", 3))
    document = json.loads(attempt_module.record_path(spec).read_text())
    assert document == {"pod": {"vj_name": "ma-job-1", "task_name": "worker", "task_index": 2, "schedule_cnt": 1},
                        "attempt": 4, "first": 3, "run_id": "run", "finished": False}
