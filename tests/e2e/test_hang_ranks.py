"""Hang detection watches the ranks, not the launcher (issue 24): real torchrun (gloo), msrun (MindSpore CPU) and
Open MPI hangs with no progress signal, found (how soon: benchmarks/hang.py); a CPU-bound job on a loaded node that
is not; a second attempt's busy start before its first progress line that is not. CPU jobs (no accelerator), so
MA_RUNTIME_HANG_DETECT=on; the window is 5 s (period 1 s, start-up allowance 10 s).
"""

import os
import re
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port, run_ma
from tests.e2e.test_hang import named, termination
from tests.e2e.test_launchers import MS_BIN, TORCH_BIN, launcher_env, needs_mindspore, needs_torch

JOB = ROOT / "tests" / "e2e" / "jobs" / "hang_ranks.py"
WINDOW = 5.0


def hang_env(job_env, tmp_path, bin_dir=TORCH_BIN, **settings):
    marks = tmp_path / "marks"
    marks.mkdir()
    defaults = dict(MARKS=marks, MA_RUNTIME_HANG_DETECT="on", MA_RUNTIME_HANG_DETECT_SECONDS=WINDOW,
                    MA_RUNTIME_HANG_RESTARTS=0, MA_RUNTIME_STOP_GRACE_SECONDS=5, MA_RUNTIME_LOG_FORMAT="json")
    return launcher_env(job_env, bin_dir, **{**defaults, **settings})


def detected_after_the_last_step(env) -> float:
    """Seconds from the last rank's last step to the `job suspected hung` line."""
    steps = max(float(path.read_text()) for path in Path(env["MARKS"]).glob("steps-1-*"))
    (found,) = named(env, "job suspected hung")
    return datetime.fromisoformat(found["time"].replace("Z", "+00:00")).timestamp() - steps


def assert_found_naming_rank_1(env, result):
    assert result.returncode == 83, result.stderr[-3000:]
    # Found after the ranks stopped, not before; how soon is benchmarks/hang.py's (no timed assertion here: the
    # machines are shared).
    assert detected_after_the_last_step(env) > 0
    message = termination(env)
    assert message["exit_code"] == 83 and message["rank"] == 1, message
    # No traceback of ours (the argv the runtime logs names its own files: torchrun's gate).
    assert "pt_elastic" not in message["reason"] and not re.search(r'File "[^"]*ma_runtime/', result.stderr)
    return message["reason"]


@needs_torch
def test_torchrun_two_ranks_one_in_a_barrier_one_blocked_is_found_and_the_blocked_rank_named(job_env, tmp_path):
    env = hang_env(job_env, tmp_path, MODE="torch", MA_RUN_METHOD="torchrun", MA_NUM_GPUS=2)

    result = run_ma(["python", str(JOB)], env, timeout=240)

    reason = assert_found_naming_rank_1(env, result)
    assert reason.startswith("job suspected hung: no IO for 5 s, and every rank idle throughout"), reason
    # The stacks say who: rank 1 outside any collective while rank 0 waits in torch.distributed's barrier.
    assert "rank 1 is elsewhere (threading.py" in reason and "while the other waits in" in reason, reason
    assert "in barrier" in reason, reason
    (stack,) = [event for event in named(env, "stack of a hung process") if event["process"] == "rank 1"]
    assert "wait" in stack["at"]


@needs_torch
def test_torchrun_a_hung_attempt_is_restarted_in_place_and_its_ranks_run_as_attempt_2(job_env, tmp_path):
    # Attempt 1 hangs; the hang restart runs attempt 2 on the same torchrun agent, and it ends well.
    env = hang_env(job_env, tmp_path, MODE="torch", MA_RUN_METHOD="torchrun", MA_NUM_GPUS=2,
                   MA_RUNTIME_HANG_RESTARTS=1, HANG_ATTEMPTS=1)

    result = run_ma(["python", str(JOB)], env, timeout=240)

    assert result.returncode == 0, result.stderr[-3000:]
    assert len(named(env, "job suspected hung")) == 1
    assert [event["attempt"] for event in named(env, "restarting command")] == [2]
    assert len(named(env, "torchrun started for the run: its ranks restart in place")) == 1
    # Each rank's MA_PROC_START_CNT named its attempt: both attempts' ranks made their steps.
    assert sorted(path.name for path in Path(env["MARKS"]).glob("steps-*")) == [
        "steps-1-0", "steps-1-1", "steps-2-0", "steps-2-1"]


def _has_mpi4py() -> bool:
    python = TORCH_BIN / "python"  # the job's interpreter: the one running the tests, as for the runtime
    return python.exists() and subprocess.run([str(python), "-c", "import mpi4py"], capture_output=True).returncode == 0


@pytest.mark.skipif(not shutil.which("mpirun") or not _has_mpi4py(),
                    reason="needs Open MPI's mpirun and mpi4py beside the test interpreter (scripts/test.sh: both)")
def test_mpirun_one_rank_busy_polling_in_a_barrier_one_blocked_is_found_and_the_blocked_rank_named(job_env, tmp_path):
    env = hang_env(job_env, tmp_path, MODE="mpi", MA_RUN_METHOD="mpirun", MY_MPI_SLOTS=2, OMPI_ALLOW_RUN_AS_ROOT=1,
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, OMPI_MCA_rmaps_base_oversubscribe=1)

    result = run_ma(["python", str(JOB)], env, timeout=240)  # the test interpreter's python, first on PATH

    reason = assert_found_naming_rank_1(env, result)
    # Open MPI spins a core in MPI_Barrier: rank 0 is busy without IO, rank 1 idle, and mpirun itself not counted.
    assert "rank 1 idle throughout" in reason and "rank 0 busy without IO" in reason, reason
    assert named(env, "job suspected hung")[0]["suspects"] == "rank 1"


@needs_mindspore
def test_msrun_ranks_blocked_while_its_scheduler_keeps_logging_is_found(job_env, tmp_path):
    env = hang_env(job_env, tmp_path, MS_BIN, MODE="ms", MA_RUN_METHOD="msrun", MA_NUM_GPUS=2,
                   MA_RUNTIME_MSRUN_MASTER_PORT=free_port())

    result = run_ma(["python", str(JOB)], env, timeout=300)

    assert result.returncode == 83, result.stderr[-3000:]
    # Found after the ranks stopped, not before; how soon is benchmarks/hang.py's (no timed assertion here: the
    # machines are shared).
    assert detected_after_the_last_step(env) > 0
    reason = termination(env)["reason"]
    assert reason.startswith("job suspected hung: no IO for 5 s, and every rank idle throughout"), reason
    # Both ranks' stacks, not the scheduler's (which runs the same script with RANK_ID=0).
    stacks = {event["process"] for event in named(env, "stack of a hung process")}
    assert stacks == {"rank 0", "rank 1"}, stacks


@pytest.fixture
def loaded_node():
    """Busy loops outside the job, four per core: a node where a CPU-bound rank gets a fraction of a core."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4 * (os.cpu_count() or 1))]
    yield
    for spinner in spinners:
        spinner.kill()
        spinner.wait()


@pytest.mark.parametrize("mode", ["busy", "burst"])
def test_a_cpu_bound_job_on_a_loaded_node_is_not_a_hang(job_env, tmp_path, loaded_node, mode):
    """A busy loop got 0.43 of a core at load 8.7 and was declared hung (`at most 0.43 CPU cores`); so was one that
    computes 70 ms and sleeps 30 ms. Three windows of either, at the lowest priority on a node loaded four times
    over (tests/e2e/jobs/hang_ranks.py: the job gives way to the busy loops): not hung."""
    env = hang_env(job_env, tmp_path, MODE=mode, SECONDS=3 * WINDOW, MA_RUNTIME_HANG_STARTUP_SECONDS=WINDOW)

    result = run_ma([sys.executable, str(JOB)], env, timeout=240)

    assert result.returncode == 0, result.stderr[-3000:]
    assert not named(env, "job suspected hung")
    # The load was there: the job got well under the core it asked for (0.7 for burst on a quiet node).
    assert float((Path(env["MARKS"]) / "share").read_text()) < 0.5


def test_a_second_attempt_computing_before_its_first_progress_line_is_not_hung(job_env, tmp_path):
    """With a progress pattern, attempt 1 hangs and is restarted; attempt 2 computes (imports) for longer than the
    start-up allowance before its first `step` line: the metrics decide until the first line, and it is working."""
    env = hang_env(job_env, tmp_path, MODE="warm_then_steps", SECONDS=2.5 * WINDOW, MA_RUNTIME_HANG_RESTARTS=1,
                   MA_RUNTIME_HANG_STARTUP_SECONDS=WINDOW, MA_RUNTIME_PROGRESS_PATTERN=r"^step \d+$")

    result = run_ma([sys.executable, str(JOB)], env, timeout=240)

    assert result.returncode == 0, result.stderr[-3000:]
    (found,) = named(env, "job suspected hung")
    assert found["evidence"].startswith("no progress signal (output pattern) for 5 s")
    assert [event["attempt"] for event in named(env, "restarting command")] == [2]
