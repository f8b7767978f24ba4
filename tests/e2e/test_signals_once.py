"""One SIGTERM to ma-run reaches each process of the job exactly once (issue 11).

The counting processes are tests/e2e/jobs/count_signals.py: a plain command, a grandchild of it
that left the group and the session (setsid), and each rank under a real torchrun. Each counts the
SIGTERMs delivered to it and stays a while after the first, so a second one would be counted.
A signal sent twice can still merge into one before the kernel delivers it; hence the repeated
rounds.

Why once matters: a second SIGTERM interrupts the cleanup the first one started (a checkpoint
half-written, a KeyboardInterrupt inside a `finally`), and turns a handler's own exit code into 143.
"""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import MA_RUN, alive, marked
from tests.e2e.test_launchers import JOBS, needs_torch

COUNTER = str(JOBS / "count_signals.py")
PYTHON = sys.executable  # the test interpreter; torchrun is found beside the command's interpreter


def start_job(env, directory: Path, *arguments: str) -> subprocess.Popen:
    (directory / "ready").mkdir(parents=True)
    # A generous grace: every counter ends by itself within 2 s; the SIGKILL must not decide the run.
    env = {**env, "MA_RUNTIME_PREFLIGHT": "0", "MA_RUNTIME_STOP_GRACE_SECONDS": "60"}
    return subprocess.Popen([MA_RUN, PYTHON, COUNTER, str(directory), *arguments], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_ready(runtime: subprocess.Popen, directory: Path, roles, timeout: float):
    """pid -> role of the counters, once every one of `roles` (a list, one entry per process) is ready."""
    deadline = time.monotonic() + timeout
    while True:
        ready = sorted(path.name for path in (directory / "ready").iterdir() if not path.name.endswith(".tmp"))
        if sorted(name.rsplit("-", 1)[0] for name in ready) == sorted(roles):
            return {int(name.rsplit("-", 1)[1]): name.rsplit("-", 1)[0] for name in ready}
        if runtime.poll() is not None:
            raise AssertionError(f"ma-run exited {runtime.returncode} before the counters were ready: "
                                 f"{runtime.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            runtime.kill()
            raise AssertionError(f"ready: {ready}, wanted {roles}")
        time.sleep(0.05)


def stop_once(runtime: subprocess.Popen, timeout: float = 90):
    runtime.send_signal(signal.SIGTERM)
    try:
        return runtime.communicate(timeout=timeout)
    finally:
        if runtime.poll() is None:
            runtime.kill()
            runtime.wait()


def counts(directory: Path, counters) -> dict:
    """'role-pid' -> SIGTERMs it counted (0 if none reached it)."""
    found = {}
    for pid, role in counters.items():
        path = directory / f"{role}-{pid}"
        found[f"{role}-{pid}"] = len(path.read_text().splitlines()) if path.exists() else 0
    return found


def assert_none_left(directory: Path, counters):
    deadline = time.monotonic() + 5  # zombies of processes just reaped
    while [pid for pid in counters if alive(pid)] or marked(str(directory)):
        assert time.monotonic() < deadline, f"left running: {marked(str(directory))}"
        time.sleep(0.05)


@pytest.mark.parametrize("round", range(5))
def test_a_plain_command_and_its_setsid_grandchild_each_get_one_sigterm(job_env, tmp_path, round):
    """The grandchild outlives the command by 0.5 s: what the command leaves behind during a stop already
    has its SIGTERM, and gets no second one when the command ends (only SIGKILL when the grace is over)."""
    runtime = start_job({**job_env, "MA_RUN_METHOD": "plain"}, tmp_path / "counts", "command", "--grandchild")
    counters = wait_ready(runtime, tmp_path / "counts", ["command", "grandchild"], timeout=30)

    _, err = stop_once(runtime)

    once = {f"{role}-{pid}": 1 for pid, role in counters.items()}
    assert (counts(tmp_path / "counts", counters), runtime.returncode) == (once, 143), err[-3000:]
    assert "Traceback" not in err
    assert_none_left(tmp_path / "counts", counters)


def test_a_second_sigterm_is_logged_and_not_passed_on(job_env, tmp_path):
    runtime = start_job({**job_env, "MA_RUN_METHOD": "plain"}, tmp_path / "counts", "command")
    counters = wait_ready(runtime, tmp_path / "counts", ["command"], timeout=30)
    runtime.send_signal(signal.SIGTERM)
    time.sleep(0.3)  # the first is forwarded; the command is in its cleanup

    _, err = stop_once(runtime)

    assert (counts(tmp_path / "counts", counters), runtime.returncode) == (
        {f"command-{pid}": 1 for pid in counters}, 143), err[-3000:]
    assert 'msg="stop already under way" Component=ma-runtime signal=SIGTERM' in err


@pytest.mark.parametrize("round", range(5))
def test_a_handler_that_cleans_up_and_exits_7_gives_7(job_env, tmp_path, round):
    """The README: a command that exits by itself after the forwarded signal keeps its own code."""
    runtime = start_job({**job_env, "MA_RUN_METHOD": "plain"}, tmp_path / "counts", "command", "--exit-7")
    counters = wait_ready(runtime, tmp_path / "counts", ["command"], timeout=30)

    _, err = stop_once(runtime)

    once = {f"command-{pid}": 1 for pid in counters}
    assert (counts(tmp_path / "counts", counters), runtime.returncode) == (once, 7), err[-3000:]
    assert_none_left(tmp_path / "counts", counters)


@needs_torch
@pytest.mark.parametrize("round", range(2))
def test_each_torchrun_rank_gets_one_sigterm(job_env, tmp_path, round):
    """torchrun forwards the stop to its ranks (each in a session of its own) itself. It then exits 1 with a
    SignalException traceback; the ranks died of the SIGTERM that was asked for, so the job's code is 143."""
    env = {**job_env, "MA_RUN_METHOD": "torchrun", "MA_NUM_GPUS": "0", "MA_RUNTIME_NPROC_PER_NODE": "2"}
    runtime = start_job(env, tmp_path / "counts", "rank")
    counters = wait_ready(runtime, tmp_path / "counts", ["rank", "rank"], timeout=180)

    _, err = stop_once(runtime)

    once = {f"rank-{pid}": 1 for pid in counters}
    assert (counts(tmp_path / "counts", counters), runtime.returncode) == (once, 143), err[-3000:]
    assert_none_left(tmp_path / "counts", counters)
