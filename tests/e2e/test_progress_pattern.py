"""A progress pattern that backtracks catastrophically (issue 24, item 3), with the real `ma-run`.

`^(x+x+)+y` against a line of 40 `x` runs for hours in Python's `re`, holding the GIL: matched inside the
runtime it froze PID 1 (no output forwarded, SIGTERM unanswered, no `command exited`). The matcher is now a
process of its own with a CPU limit per line (ma_runtime/supervise/matcher.py).
"""

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import MA_RUN, namespace_init, needs_pid_namespace, run_ma, task_log

PATHOLOGICAL = r"^(x+x+)+y"
# Prints the line the pattern chokes on, then a numbered line every 0.1 s until it is stopped.
CHATTY = ("import sys, time\n"
          "print('x' * 40, flush=True)\n"
          "n = 0\n"
          "while True:\n"
          "    print(f'alive {n}', flush=True)\n"
          "    n += 1\n"
          "    time.sleep(0.1)\n")
# Patience for a machine shared by several test runs; the old runtime never got there at all.
PATIENCE = 60.0


def events(env):
    lines = task_log(env, "modelarts-job-local-worker-0").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def wait_for_line(proc: subprocess.Popen, wanted: bytes, timeout: float) -> bytes:
    """What `proc` printed on stdout up to and including the first line holding `wanted`."""
    seen = b""
    deadline = time.monotonic() + timeout
    while wanted not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            raise AssertionError(f"{wanted!r} not printed within {timeout:g} s; got {seen[-500:]!r}")
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            raise AssertionError(f"stdout ended before {wanted!r}; got {seen[-500:]!r}")
        seen += chunk
    return seen


def wait_for_event(env, start: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not task_log(env).exists() or not [e for e in events(env) if e["msg"].startswith(start)]:
        if time.monotonic() > deadline:
            raise AssertionError(f"no {start!r} in the task log within {timeout:g} s")
        time.sleep(0.05)


@pytest.fixture
def pattern_env(job_env):
    # A long window: nothing here is a hang, the point is the pattern's matching.
    return {**job_env, "MA_RUNTIME_PREFLIGHT": "0", "MA_RUNTIME_HANG_DETECT": "on",
            "MA_RUNTIME_HANG_DETECT_SECONDS": "300", "MA_RUNTIME_PROGRESS_PATTERN": PATHOLOGICAL,
            "MA_RUNTIME_LOG_FORMAT": "json", "MA_RUNTIME_STOP_GRACE_SECONDS": "5"}


@pytest.mark.parametrize("as_pid1", [False, pytest.param(True, marks=needs_pid_namespace)])
def test_a_catastrophic_pattern_leaves_the_output_flowing_and_sigterm_answered(pattern_env, as_pid1):
    argv = [MA_RUN, sys.executable, "-c", CHATTY]
    if as_pid1:
        argv = ["unshare", "--pid", "--fork", "--mount-proc", *argv]
    proc = subprocess.Popen(argv, env=pattern_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        runtime = namespace_init(proc.pid) if as_pid1 else proc.pid
        # The console goes on after the line the pattern chokes on.
        printed = wait_for_line(proc, b"alive 5\n", PATIENCE)
        assert b"x" * 40 + b"\n" in printed
        wait_for_event(pattern_env, "MA_RUNTIME_PROGRESS_PATTERN backtracks", PATIENCE)
        wait_for_line(proc, b"alive", PATIENCE)  # and after the matcher gave up on it
        os.kill(runtime, signal.SIGTERM)
        code = proc.wait(PATIENCE)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr = proc.stderr.read().decode()
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    found = events(pattern_env)
    (exited,) = [event for event in found if event["msg"] == "command exited"]
    assert exited["exit_code"] == 128 + signal.SIGTERM
    warned = [event for event in found if event["msg"].startswith("MA_RUNTIME_PROGRESS_PATTERN backtracks")]
    assert len(warned) == 1 and warned[0]["pattern"] == PATHOLOGICAL
    # The task log kept the worker's lines too, after the pathological one.
    text = task_log(pattern_env, "modelarts-job-local-worker-0").read_text()
    assert "alive 5" in text
    assert "Traceback" not in stderr


def test_progress_lines_after_a_pathological_line_still_count(pattern_env):
    """Lines the pattern chokes on, among lines it matches: the hang clock is reset by those, so a job that
    prints them for longer than the window and the start-up allowance is not stopped; the command's own end
    is the run's."""
    job = ("import time\n"
           "for n in range(24):\n"
           "    if n % 8 == 0:\n"
           "        print('x' * 40, flush=True)\n"
           "    print(f'step {n}', flush=True)\n"
           "    time.sleep(0.5)\n")
    env = {**pattern_env, "MA_RUNTIME_PROGRESS_PATTERN": PATHOLOGICAL + r"|^step \d+$",
           "MA_RUNTIME_HANG_DETECT_SECONDS": "5", "MA_RUNTIME_HANG_STARTUP_SECONDS": "5",
           "MA_RUNTIME_HANG_RESTARTS": "0", "MA_RUNTIME_HANG_STACKS": "off"}
    result = run_ma([sys.executable, "-c", job], env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 23" in result.stdout
    found = events(env)
    assert not [event for event in found if event["msg"] == "job suspected hung"]
    assert [event for event in found if event["msg"].startswith("MA_RUNTIME_PROGRESS_PATTERN backtracks")]
    (summary,) = [event for event in found if "were not matched" in event["msg"]]
    assert summary["backtracking"] >= 3


@pytest.mark.parametrize("value", ["a{99999999999999999999}", "x{4294967295}"])
def test_a_pattern_python_cannot_compile_is_one_line_and_78(job_env, value):
    result = run_ma(["true"], {**job_env, "MA_RUNTIME_PROGRESS_PATTERN": value})
    assert result.returncode == 78, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error,exiting" in line]
    assert len(errors) == 1 and "MA_RUNTIME_PROGRESS_PATTERN" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
