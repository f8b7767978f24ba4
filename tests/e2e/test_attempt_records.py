"""The attempt record with real `ma-run` (issue 24, items 5 and 6): a poisoned record is set aside and the run is a
first start; one runtime owns a pod's record: a nested one and one started beside it run unrecorded."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import MA_RUN, alive, marked, run_ma, wait_for_file

POD = {"vj_name": None, "task_name": "worker", "task_index": 0, "schedule_cnt": 1}
SHOW = 'echo "CNT=$MA_PROC_START_CNT"'


def record_path(env) -> Path:
    return Path(env["MA_HOME"]) / "modelarts" / ".ma-runtime" / "attempt-worker-0.json"


def records_env(job_env, tmp_path, **settings):
    marks = tmp_path / "marks"
    marks.mkdir(exist_ok=True)
    return {**job_env, "MARKS": str(marks), "MA_RUNTIME_PREFLIGHT": "off", "MA_RUNTIME_RESTART_BACKOFF_SECONDS": "0",
            **{name: str(value) for name, value in settings.items()}}


def poison(env, text: str) -> Path:
    path = record_path(env)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def counts(stdout: str):
    return [int(line[4:]) for line in stdout.splitlines() if line.startswith("CNT=")]


@pytest.mark.parametrize("text", [
    # The three: internal error 70; "gave up after 1000005 attempts" (82); MA_PROC_START_CNT=10^29+1.
    json.dumps({"pod": POD, "attempt": 3, "first": "x", "finished": False}),
    json.dumps({"pod": POD, "attempt": 3, "first": -1000000, "finished": False, "run_id": "r"}),
    json.dumps({"pod": POD, "attempt": "HUGE", "first": 1, "finished": False, "run_id": "r"}).replace(
        '"HUGE"', "100000000000000000000000000000"),
    json.dumps({"pod": POD, "attempt": 3, "first": [1], "finished": False, "run_id": "r"}),
    json.dumps({"pod": POD, "attempt": 3, "first": None, "finished": False, "run_id": "r"}),
    json.dumps({"pod": POD, "attempt": 3, "first": "INF", "finished": False, "run_id": "r"}).replace('"INF"', "1e400"),
], ids=["first-x", "first-minus-a-million", "attempt-1e29", "first-list", "first-null", "first-1e400"])
def test_a_poisoned_record_is_set_aside_and_the_run_is_a_first_start(job_env, tmp_path, text):
    # Restarts on and a first attempt that fails: the budget must count from 1, not from -1000000.
    env = records_env(job_env, tmp_path, MA_RUNTIME_MAX_RESTARTS=2)
    path = poison(env, text)
    script = f'{SHOW}; [ -e "$MARKS/failed" ] || {{ touch "$MARKS/failed"; exit 3; }}'

    done = run_ma(["sh", "-c", script], env)

    assert done.returncode == 0, done.stderr
    assert counts(done.stdout) == [1, 2]
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr
    assert "continuing after a runtime that did not finish" not in done.stderr
    warnings = [line for line in done.stderr.splitlines() if 'msg="record set aside"' in line]
    assert len(warnings) == 1, done.stderr
    (kept,) = path.parent.glob(f"{path.name}.set-aside-*")
    assert kept.read_text() == text  # kept as it was, for whoever wants to look
    assert f"path={path}" in warnings[0] and f"kept_as={kept}" in warnings[0] and "problem=" in warnings[0]
    record = json.loads(path.read_text())  # the run's own record replaced it
    assert (record["attempt"], record["first"], record["finished"]) == (2, 1, True)


def test_a_directory_at_the_record_is_set_aside_and_the_count_is_kept_again(job_env, tmp_path):
    env = records_env(job_env, tmp_path)
    path = record_path(env)
    path.mkdir(parents=True)

    done = run_ma(["sh", "-c", SHOW], env)

    assert done.returncode == 0 and counts(done.stdout) == [1], done.stderr
    assert done.stderr.count('msg="record set aside"') == 1
    assert "could not record the attempt" not in done.stderr
    assert json.loads(path.read_text())["finished"] is True


def test_a_nested_runtime_counts_from_its_parents_attempt_and_leaves_its_record_alone(job_env, tmp_path):
    env = records_env(job_env, tmp_path)
    record = record_path(env)
    # The inner runtime's count, then the outer's record as the inner left it: still the outer's, unfinished.
    script = f'{MA_RUN} sh -c \'{SHOW}\' && cat "{record}"'

    done = run_ma(["sh", "-c", script], env)

    assert done.returncode == 0, done.stderr
    assert counts(done.stdout) == [1]
    assert "continuing after a runtime that did not finish" not in done.stderr
    assert done.stderr.count("attempt not recorded: this runtime runs inside another (MA_RUNTIME_LINEAGE is set)") == 1
    inner_view = json.loads(done.stdout.splitlines()[-1])
    assert (inner_view["attempt"], inner_view["finished"]) == (1, False)
    assert json.loads(record.read_text())["finished"] is True  # the outer finished it


def test_a_runtime_beside_another_leaves_its_record_so_a_sigkill_of_the_first_is_still_continued(job_env, tmp_path):
    env = records_env(job_env, tmp_path, MA_RUNTIME_MAX_RESTARTS=3)
    marker = f"3017.{os.getpid()}"  # a sleep only this test starts
    script = (f'touch "$MARKS/a-$MA_PROC_START_CNT"; [ "$MA_PROC_START_CNT" = 1 ] && exec sleep {marker}; '
              f'{SHOW}')
    first = subprocess.Popen([MA_RUN, "sh", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        wait_for_file(Path(env["MARKS"]) / "a-1")
        recorded = record_path(env).read_text()

        beside = run_ma(["sh", "-c", SHOW], env)

        assert beside.returncode == 0, beside.stderr
        assert counts(beside.stdout) == [1]
        assert "continuing after a runtime that did not finish" not in beside.stderr
        assert beside.stderr.count("attempt not recorded: another runtime in this pod holds the record") == 1
        assert record_path(env).read_text() == recorded  # neither continued nor finished by the second
    finally:
        first.send_signal(signal.SIGKILL)  # the OOM killer's way: no exit steps at all
        first.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in marked(f"sleep {marker}")):  # the guard ends what the runtime left
        assert time.monotonic() < deadline
        time.sleep(0.05)

    again = run_ma(["sh", "-c", script], env)

    assert again.returncode == 0, again.stderr
    assert counts(again.stdout) == [2]
    assert "continuing after a runtime that did not finish" in again.stderr
