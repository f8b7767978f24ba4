"""The job's keys and the rules every node applies alike (coordination/job.py), and the job-wide decision
(together.Together) over a real embedded store on loopback: several nodes are several clients in one process.
No timed assertion: a bound only guards against a hang."""

import threading
import time

import pytest

from ma_runtime import spec as spec_module
from ma_runtime import together
from ma_runtime import verdict as verdict_module
from ma_runtime.attempt import Attempt, Decision
from ma_runtime.coordination.embedded import EmbeddedStoreClient, EmbeddedStoreServer
from ma_runtime.coordination.job import FAILED, HUNG, LOST, Failure, JobState
from ma_runtime.errors import ExitCode
from ma_runtime.supervise.supervisor import State
from tests.recording import Log

GUARD = 30.0
HOSTS = ("node-a.job", "node-b.job", "node-c.job")


@pytest.fixture
def server():
    with EmbeddedStoreServer("127.0.0.1", 0) as started:  # started by `with`, closed after
        yield started


def client(server) -> EmbeddedStoreClient:
    return EmbeddedStoreClient("127.0.0.1", server.port, reconnect_seconds=2.0)


def nodes(server, count: int = 3):
    return [JobState(client(server), index, HOSTS[index], count) for index in range(count)]


def failure(index: int, attempt: int = 1, kind: str = FAILED, code: int = 3) -> Failure:
    return Failure(kind, index, HOSTS[index], attempt, f"the command exited with code {code}", exit_code=code)


# --------------------------------------------------------------------------- the barrier


def test_the_barrier_opens_when_the_last_node_joins_and_a_node_joining_twice_counts_once(server):
    a, b, c = nodes(server)
    a.join(1, {})
    a.join(1, {})  # a runtime that joins again (it restarted in the same pod) is still one node
    b.join(1, {})
    assert a.released(1, 0.2) is None
    assert [index for index, _ in a.missing(1)] == [2]
    c.join(1, {})
    assert a.released(1, GUARD) == b.released(1, GUARD) == c.released(1, GUARD) == ""
    assert a.missing(1) == []


def test_the_first_node_whose_wait_runs_out_ends_the_barrier_for_every_node_with_its_reason(server):
    a, b, c = nodes(server)
    a.join(1, {})
    b.join(1, {})
    assert a.end_barrier(1, "node-c.job (task 2): never joined") == "node-c.job (task 2): never joined"
    assert b.released(1, GUARD) == "node-c.job (task 2): never joined"  # woken at once, with the same reason
    assert b.end_barrier(1, "another reason") == "node-c.job (task 2): never joined"  # the first one stays
    c.join(1, {})  # too late: the barrier ended
    assert c.released(1, GUARD) == "node-c.job (task 2): never joined"


def test_a_node_whose_wait_runs_out_as_the_last_one_joins_is_released(server):
    a, b = nodes(server, 2)
    a.join(1, {})
    b.join(1, {})
    assert a.end_barrier(1, "too late") == ""


def test_a_waiting_node_is_released_by_the_last_join_without_polling(server):
    a, b, c = nodes(server)
    a.join(1, {})
    b.join(1, {})
    released = []
    waiter = threading.Thread(target=lambda: released.append(a.released(1, GUARD)))
    waiter.start()
    time.sleep(0.2)
    c.join(1, {})
    waiter.join(GUARD)
    assert released == [""]


def test_missing_nodes_say_their_last_stage_or_nothing_when_never_heard_of(server):
    a, b, _c = nodes(server)
    b.beat("stage-in", ttl=30)
    a.join(4, {})
    assert a.missing(4) == [(1, {"host": HOSTS[1], "stage": "stage-in"}), (2, None)]


def test_a_replacement_pod_joins_the_attempt_the_job_gathers_for_not_its_own_count(server):
    a, b, c = nodes(server)
    assert a.gathering(1) == 1 and a.first_attempt(1) == 1
    a.gather_next(3)  # the job decided on attempt 3 after a node was lost
    assert c.gathering(1) == 3  # the rescheduled pod starts at the platform's count
    assert c.first_attempt(3) == 1  # and the budget still counts from the job's first
    assert b.gathering(4) == 4  # a later count of its own wins


# --------------------------------------------------------------------------- the origin


def test_the_first_report_the_store_received_is_the_origin_and_later_ones_are_secondary(server):
    a, b, c = nodes(server)
    assert b.report(failure(1)) == a.origin(1) == b.origin(1)
    later = c.report(failure(2, code=1))
    assert later.task_index == 1  # what c is told: the origin, not itself
    secondary = a.secondary(1)
    assert [(f.task_index, f.exit_code) for f in secondary] == [(2, 1)]
    assert secondary[0].stamp > a.origin(1).stamp  # the store's receive order
    assert a.over(1, GUARD)


def test_a_nodes_second_report_of_its_own_failure_is_not_a_secondary_failure(server):
    a, b, _c = nodes(server)
    b.report(failure(1))  # the supervisor's, the moment it saw the exit
    b.report(failure(1))  # the verdict's, after the attempt
    assert a.secondary(1) == [] and a.origin(1).task_index == 1


def test_racing_reports_have_exactly_one_origin_that_every_node_reads(server):
    states = nodes(server)
    barrier = threading.Barrier(3)
    told = [None] * 3

    def report(index):
        barrier.wait()
        told[index] = states[index].report(failure(index))

    threads = [threading.Thread(target=report, args=(index,)) for index in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(GUARD)
    origin = states[0].origin(1)
    assert all(seen == origin for seen in told)
    assert sorted(f.task_index for f in states[0].secondary(1)) == sorted({0, 1, 2} - {origin.task_index})


def test_an_attempt_is_over_when_every_node_ended_or_when_worker_0_closes_it_alone(server):
    a, b, c = nodes(server)
    a.ended(1)
    b.ended(1)
    assert not a.over(1, 0.2)
    c.ended(1)
    assert a.over(1, GUARD) and a.origin(1) is None
    a.ended(2, closes=True)  # mpirun: worker-0's command decides
    assert b.over(2, GUARD)


# --------------------------------------------------------------------------- lost nodes


def test_a_joined_node_whose_heartbeat_expired_is_lost_and_one_that_ended_is_not(server):
    a, b, c = nodes(server)
    for state in (a, b, c):
        state.beat("running", ttl=30)
        state.join(1, {})
    b.beat("running", ttl=0.3)
    c.beat("running", ttl=0.3)
    c.ended(1)
    deadline = time.monotonic() + GUARD
    while set(a.alive()) != {0}:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert a.lost(1) == [1]


def test_worker_0_waits_only_for_the_live_nodes_that_have_not_seen_the_outcome(server):
    a, b, c = nodes(server)
    for state in (a, b, c):
        state.beat("running", ttl=30)
    assert a.still_here(1, [1, 2]) == [1, 2]
    b.saw(1)
    assert a.still_here(1, [1, 2]) == [2]


# --------------------------------------------------------------------------- the decision, on every node alike


def node_of(server, index: int, **settings) -> together.Together:
    environ = {"MA_NUM_HOSTS": "3", "VC_TASK_INDEX": str(index), "VC_WORKER_HOSTS": ",".join(HOSTS),
               "MA_RUNTIME_NODE_LOST_SECONDS": "5", **{name: str(value) for name, value in settings.items()}}
    spec = spec_module.load({}, environ, None)
    return together.Together(spec, Log(), lambda _first: client(server), HOSTS)


def failed(code: int, line: str = "boom") -> verdict_module.Verdict:
    return verdict_module.Verdict(State.FAILED, code, code, reason=f"the command exited with code {code}",
                                  tail=(line,))


def succeeded() -> verdict_module.Verdict:
    return verdict_module.Verdict(State.SUCCEEDED, 0, 0)


def agree_all(jobs, attempt: Attempt, verdicts):
    results = [None] * len(jobs)

    def agree(index):
        results[index] = jobs[index].agree(attempt, verdicts[index], Decision(False), threading.Event())

    threads = [threading.Thread(target=agree, args=(index,)) for index in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(GUARD)
    return results


@pytest.fixture
def jobs(server, request):
    settings = getattr(request, "param", {})
    made = [node_of(server, index, **settings) for index in range(3)]
    yield made
    for job in made:
        job.close()


@pytest.mark.parametrize("jobs", [{"MA_RUNTIME_MAX_RESTARTS": 2}], indirect=True)
def test_every_node_takes_the_same_decision_and_only_the_origin_keeps_its_code(jobs):
    attempt = Attempt(1, "run", 1)
    for job in jobs:
        job.first = 1
    results = agree_all(jobs, attempt, [verdict_module.elsewhere("stopped"), failed(3), succeeded()])
    assert [r.decision.restart for r in results] == [True, True, True]
    assert [r.verdict.exit_code for r in results] == [86, 3, 86]
    assert results[0].origin == results[1].origin == results[2].origin
    assert results[0].verdict.reason == f"{HOSTS[1]} (task 1) failed first: the command exited with code 3"
    assert results[0].fields()["origin"]["task_index"] == 1


def test_a_rank_named_in_the_verdict_is_named_once_on_every_node(jobs):
    # verdict.of names the rank in its reason; the record names it beside the cause, and says it once (a record
    # made from the verdict, when the in-flight report had not gone out first, said "rank 1 failed first" twice).
    ranked = verdict_module.Verdict(State.FAILED, 3, 3, rank=1, reason="rank 1 failed first: the command exited "
                                    "with code 3", tail=("boom",))
    results = agree_all(jobs, Attempt(1, "run", 1), [succeeded(), ranked, succeeded()])
    expected = f"{HOSTS[1]} (task 1) rank 1 failed first: the command exited with code 3"
    assert results[0].verdict.reason == results[2].verdict.reason == expected
    assert results[1].verdict.reason == "rank 1 failed first: the command exited with code 3"  # its own, as before
    assert results[0].origin.reason == "the command exited with code 3"


@pytest.mark.parametrize("jobs", [{"MA_RUNTIME_MAX_RESTARTS": 5, "MA_RUNTIME_SAME_FAILURE_LIMIT": 2}],
                         indirect=True)
def test_the_same_failure_limit_counts_across_the_job_whichever_node_failed(jobs):
    for job in jobs:
        job.first = 1
    first = agree_all(jobs, Attempt(1, "run", 1), [failed(3), succeeded(), succeeded()])
    assert all(r.decision.restart for r in first)
    # Attempt 2: the same failure, now on node 2. Two in a row for the job: every node stops restarting.
    second = agree_all(jobs, Attempt(2, "run", 1), [succeeded(), succeeded(), failed(3)])
    assert [r.decision.restart for r in second] == [False, False, False]
    assert second[2].decision.gave_up and [r.verdict.exit_code for r in second[:2]] == [86, 86]
    assert not second[0].decision.gave_up  # 86 there: only the origin node reports 82


@pytest.mark.parametrize("jobs", [{"MA_RUNTIME_MAX_RESTARTS": 1}], indirect=True)
def test_the_restart_budget_counts_from_the_jobs_first_attempt_on_a_replacement_too(jobs):
    for job in jobs:
        job.first = 1
    agree_all(jobs, Attempt(1, "run", 1), [failed(3), succeeded(), succeeded()])
    # Node 2 is a replacement whose own count began at 2: the job's budget (1 restart) is spent all the same.
    attempts = [Attempt(2, "run", 1), Attempt(2, "run", 1), Attempt(2, "run", 2)]
    results = [None] * 3

    def agree(index, verdict):
        results[index] = jobs[index].agree(attempts[index], verdict, Decision(False), threading.Event())

    threads = [threading.Thread(target=agree, args=(i, v)) for i, v in
               enumerate([succeeded(), failed(4, "other"), succeeded()])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(GUARD)
    assert [r.decision.restart for r in results] == [False, False, False]


def test_every_node_ending_well_is_a_success_with_no_origin(jobs):
    results = agree_all(jobs, Attempt(1, "run", 1), [succeeded()] * 3)
    assert [r.verdict.exit_code for r in results] == [0, 0, 0]
    assert all(r.origin is None and r.fields() == {} for r in results)


def test_a_stop_is_not_a_failure_its_node_agrees_at_once(jobs):
    stopped = verdict_module.Verdict(State.STOPPED, 143, -15, signal="SIGTERM")
    result = jobs[1].agree(Attempt(1, "run", 1), stopped, Decision(False, "a stop was requested"), threading.Event())
    assert result.verdict is stopped and result.origin is None


def test_the_reason_names_a_lost_or_hung_origin_as_such():
    lost = Failure(LOST, 2, HOSTS[2], 1, "no heartbeat for MA_RUNTIME_NODE_LOST_SECONDS=30")
    hung = Failure(HUNG, 1, HOSTS[1], 1, "job suspected hung: no progress for 600 s", rank=3,
                   exit_code=int(ExitCode.HANG_DETECTED))
    assert together._elsewhere_reason(lost) == f"{HOSTS[2]} (task 2) was lost: no heartbeat for " \
                                                  "MA_RUNTIME_NODE_LOST_SECONDS=30"
    assert together._elsewhere_reason(hung).startswith(f"{HOSTS[1]} (task 1) rank 3 hung first: job suspected")
    assert together._verdict_of(hung).state is State.HUNG
    assert together._verdict_of(lost).exit_code == ExitCode.STOPPED_FOR_JOB


def test_a_record_round_trips_and_ignores_fields_it_does_not_know():
    record = failure(1)
    assert Failure.decoded(record.encoded()) == record
    assert Failure.decoded(record.encoded()[:-1] + b', "later": 1}') == record


# --------------------------------------------------------------------------- worker-0's store


def test_a_taken_port_is_one_line_naming_the_setting_and_exit_78(tmp_path):
    import socket

    from ma_runtime.errors import ConfigError

    taken = socket.create_server(("", 0))
    port = taken.getsockname()[1]
    try:
        spec = spec_module.load({}, {"MA_NUM_HOSTS": "2", "MA_RUNTIME_COORDINATOR_PORT": str(port)}, None)
        with pytest.raises(ConfigError) as raised:
            together._serve(spec, HOSTS[:2], Log())
    finally:
        taken.close()
    assert raised.value.exit_code == 78
    assert f"port {port}" in raised.value.reason and "MA_RUNTIME_COORDINATOR_PORT" in raised.value.hint


def test_the_store_admits_the_jobs_nodes_and_loopback_only_and_looks_again_for_names_not_yet_resolved():
    # The job's names resolving to the nodes' addresses is proven across namespaces (e2e/test_job_as_one.py).
    peers = together._JobPeers(["localhost", "not-yet.invalid", "task 3"])
    assert peers("127.0.0.1") and peers("::ffff:127.0.0.1")
    assert not peers("10.9.9.9")  # not one of the job's names: refused, and no exception for the bad name
