"""In-place restarts of a plain command (issue 11): the count each attempt sees, giving up (82), the
no-restart codes, a stop during an attempt or between attempts, and the count across a SIGKILLed runtime.

The launchers' restarts (RTF, torchrun, msrun, the device wait) are in test_restart_launchers.py.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ma_runtime.local.devices import FAKES
from tests.conftest import MA_RUN, alive, log_dir, marked, run_ma, task_log, wait_for_file

# Fails with 5 until MA_PROC_START_CNT reaches 3; every attempt leaves `<dir>/attempt-<N>`.
FLAKY = 'touch "$MARKS/attempt-$MA_PROC_START_CNT"; echo "attempt $MA_PROC_START_CNT"; ' \
        '[ "$MA_PROC_START_CNT" -ge 3 ] || { echo "failed at $MA_PROC_START_CNT" >&2; exit 5; }'


def restart_env(job_env, tmp_path, **settings):
    marks = tmp_path / "marks"
    marks.mkdir(exist_ok=True)
    return {**job_env, "MARKS": str(marks), "MA_RUNTIME_PREFLIGHT": "off", "MA_RUNTIME_RESTART_BACKOFF_SECONDS": "0",
            **{name: str(value) for name, value in settings.items()}}


def attempts_seen(env):
    return sorted(int(path.name.split("-")[1]) for path in Path(env["MARKS"]).glob("attempt-*"))


def termination(env):
    return json.loads(next(log_dir(env).glob("*-termination.json")).read_text())


def test_a_failing_command_is_restarted_until_it_succeeds(job_env, tmp_path):
    env = restart_env(job_env, tmp_path, MA_RUNTIME_MAX_RESTARTS=2)
    done = run_ma(["sh", "-c", FLAKY], env)
    assert done.returncode == 0, done.stderr
    assert attempts_seen(env) == [1, 2, 3]
    assert done.stdout.splitlines() == ["attempt 1", "attempt 2", "attempt 3"]
    log = task_log(env).read_text()
    assert log.count('msg="restarting command"') == 2
    assert 'attempt=2 reason="the command exited with code 5" restarts_left=1' in log
    assert not (log_dir(env) / "modelarts-job-local-worker-0-termination.json").exists()


def test_the_budget_spent_gives_82_and_lists_the_attempts(job_env, tmp_path):
    env = restart_env(job_env, tmp_path, MA_RUNTIME_MAX_RESTARTS=1)
    done = run_ma(["sh", "-c", FLAKY], env)
    assert done.returncode == 82, done.stderr
    assert attempts_seen(env) == [1, 2]
    message = termination(env)
    assert (message["exit_code"], message["stage"], message["command_exit_code"], message["attempt"]) == (
        82, "supervise", 5, 2)
    assert [(a["attempt"], a["exit_code"]) for a in message["attempts"]] == [(1, 5), (2, 5)]
    assert "MA_RUNTIME_MAX_RESTARTS=1" in message["reason"] and message["tail"] == ["failed at 2"]
    assert "error,exiting: gave up after 2 attempts" in done.stderr


def test_the_same_failure_three_times_ends_the_job_early(job_env, tmp_path):
    env = restart_env(job_env, tmp_path, MA_RUNTIME_MAX_RESTARTS=50)
    done = run_ma(["sh", "-c", 'touch "$MARKS/attempt-$MA_PROC_START_CNT"; echo "no such file" >&2; exit 2'], env)
    assert done.returncode == 82
    assert attempts_seen(env) == [1, 2, 3]
    message = termination(env)
    assert message["reason"].startswith("the same failure 3 times in a row")
    assert len(message["attempts"]) == 3


@pytest.mark.parametrize("code", [93, 78, 42])
def test_a_no_restart_exit_code_passes_through_at_once(job_env, tmp_path, code):
    env = restart_env(job_env, tmp_path, MA_RUNTIME_MAX_RESTARTS=5, MA_RUNTIME_NO_RESTART_EXIT_CODES="93,42")
    done = run_ma(["sh", "-c", f'touch "$MARKS/attempt-$MA_PROC_START_CNT"; exit {code}'], env)
    assert done.returncode == code
    assert attempts_seen(env) == [1]
    assert f"exit code {code} means do not restart" in task_log(env).read_text()


def test_restarts_off_by_default_leave_the_commands_code(job_env, tmp_path):
    env = restart_env(job_env, tmp_path)
    assert run_ma(["sh", "-c", FLAKY], env).returncode == 5
    assert attempts_seen(env) == [1]
    assert "attempts" not in termination(env)


def start(env, script):
    return subprocess.Popen([MA_RUN, "sh", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def test_a_stop_during_attempt_two_ends_the_job_without_a_third(job_env, tmp_path):
    env = restart_env(job_env, tmp_path, MA_RUNTIME_MAX_RESTARTS=5)
    marker = f"300.{os.getpid()}"  # a sleep only this test starts
    runtime = start(env, f'touch "$MARKS/attempt-$MA_PROC_START_CNT"; [ "$MA_PROC_START_CNT" = 1 ] && exit 5; '
                         f'exec sleep {marker}')
    wait_for_file(Path(env["MARKS"]) / "attempt-2")
    time.sleep(0.2)
    runtime.send_signal(signal.SIGTERM)
    out, err = runtime.communicate(timeout=30)
    assert runtime.returncode == 143, err
    assert attempts_seen(env) == [1, 2]
    assert marked(marker) == []
    message = termination(env)
    assert (message["reason"], message["attempt"]) == ("stopped by SIGTERM", 2)


def test_a_stop_during_the_backoff_ends_the_job_at_once(job_env, tmp_path):
    env = restart_env(job_env, tmp_path, MA_RUNTIME_MAX_RESTARTS=5, MA_RUNTIME_RESTART_BACKOFF_SECONDS=60)
    runtime = start(env, 'touch "$MARKS/attempt-$MA_PROC_START_CNT"; echo "failed $MA_PROC_START_CNT" >&2; exit 5')
    wait_for_file(Path(env["MARKS"]) / "attempt-2")
    deadline = time.monotonic() + 15
    while "backoff_s=60" not in (task_log(env).read_text() if task_log(env).exists() else ""):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    runtime.send_signal(signal.SIGTERM)
    out, err = runtime.communicate(timeout=30)  # under the 60 s backoff: a runtime that waited it out fails here
    assert runtime.returncode == 143, err
    assert attempts_seen(env) == [1, 2]
    message = termination(env)
    assert (message["stage"], message["reason"]) == ("restart", "stopped by SIGTERM between attempts 2 and 3")


def test_a_runtime_killed_during_attempt_two_is_continued_by_the_next(job_env, tmp_path):
    env = restart_env(job_env, tmp_path, MA_RUNTIME_MAX_RESTARTS=5, MA_VJ_NAME="ma-job-7")
    script = ('touch "$MARKS/attempt-$MA_PROC_START_CNT"; [ "$MA_PROC_START_CNT" = 1 ] && exit 5; '
              '[ "$MA_PROC_START_CNT" = 2 ] && exec sleep 300; exit 0')
    runtime = start(env, script)
    wait_for_file(Path(env["MARKS"]) / "attempt-2")
    runtime.send_signal(signal.SIGKILL)  # the OOM killer's way: no exit steps at all
    runtime.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in marked("sleep 300")):  # the guard ends what the runtime left
        assert time.monotonic() < deadline
        time.sleep(0.05)
    done = run_ma(["sh", "-c", script], env)
    assert done.returncode == 0, done.stderr
    assert attempts_seen(env) == [1, 2, 3]
    assert "continuing after a runtime that did not finish" in done.stderr
    # It finished: the next run in this pod starts afresh, as running a job twice should.
    for path in Path(env["MARKS"]).iterdir():
        path.unlink()
    assert run_ma(["sh", "-c", 'touch "$MARKS/attempt-$MA_PROC_START_CNT"'], env).returncode == 0
    assert attempts_seen(env) == [1]


def test_a_stop_during_the_device_wait_ends_the_job_at_once(job_env, tmp_path):
    fakes = FAKES
    held = tmp_path / "npu-processes"
    held.mkdir()
    (held / f"0-{os.getpid()}").write_text("python")  # NPU 0 held for as long as this test runs
    env = restart_env(job_env, tmp_path, MA_RUNTIME_MAX_RESTARTS=5, MA_RUN_METHOD="plain",
                      MA_RUNTIME_PREFLIGHT_ACCELERATOR="npu", MA_RUNTIME_DEVICE_RELEASE_SECONDS=300,
                      FAKE_SMI_PROCESS_DIR=held, PATH=f"{fakes}{os.pathsep}{job_env['PATH']}")
    runtime = start(env, 'touch "$MARKS/attempt-$MA_PROC_START_CNT"; exit 5')
    deadline = time.monotonic() + 20
    while "waiting for the accelerators to be released" not in (
            task_log(env).read_text() if task_log(env).exists() else ""):
        assert time.monotonic() < deadline, "the runtime never waited for the devices"
        time.sleep(0.05)
    runtime.send_signal(signal.SIGTERM)
    out, err = runtime.communicate(timeout=30)  # under the 300 s device wait: one that waited it out fails here
    assert runtime.returncode == 143, err
    assert attempts_seen(env) == [1]
    assert "NPU 0 pid" in task_log(env).read_text()
    message = termination(env)
    assert (message["stage"], message["reason"]) == ("restart", "stopped by SIGTERM between attempts 1 and 2")


def test_the_same_failure_limit_and_the_budget_can_be_set_by_env_and_flag(job_env, tmp_path):
    env = restart_env(job_env, tmp_path, MA_RUNTIME_SAME_FAILURE_LIMIT=2)
    always = 'touch "$MARKS/attempt-$MA_PROC_START_CNT"; echo "no such file" >&2; exit 2'
    done = run_ma(["--max-restarts=9", "sh", "-c", always], env)
    assert done.returncode == 82
    assert attempts_seen(env) == [1, 2]
    assert termination(env)["reason"].startswith("the same failure 2 times in a row")


@pytest.mark.parametrize("value", ["abc", "0", "256", "93,,x", "-1"])
def test_a_bad_no_restart_list_is_one_line_and_78(job_env, tmp_path, value):
    env = restart_env(job_env, tmp_path, MA_RUNTIME_MAX_RESTARTS=1, MA_RUNTIME_NO_RESTART_EXIT_CODES=value)
    done = run_ma(["sh", "-c", 'touch "$MARKS/attempt-$MA_PROC_START_CNT"'], env)
    assert done.returncode == 78
    assert "Traceback" not in done.stderr and attempts_seen(env) == []
    (line,) = [line for line in done.stderr.splitlines() if "MA_RUNTIME_NO_RESTART_EXIT_CODES" in line]
    assert "exit codes from 1 to 255" in line
