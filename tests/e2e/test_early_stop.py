"""A stop before the command started (here: during the rank-table wait) ends the run at once with 128+N.

As PID 1 a signal without a handler is ignored, so without one the runtime would sit out the whole
wait (30 minutes by default) while the platform waits for it to stop.
"""

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import MA_RUN, can_unshare_pid, namespace_init


def waiting_runtime(job_env, tmp_path, as_pid1: bool):
    env = {**job_env, "RANK_TABLE_FILE": str(tmp_path / "never"), "MA_RUNTIME_PREFLIGHT": "0",
           "MA_RUN_METHOD": "plain"}
    argv = [MA_RUN, "sh", "-c", "echo RAN"]
    if as_pid1:
        argv = ["unshare", "--pid", "--fork", "--mount-proc", *argv]
    runtime = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    target = namespace_init(runtime.pid) if as_pid1 else runtime.pid
    log = Path(env["MA_HOME"]) / "modelarts" / "log"
    deadline = time.monotonic() + 20
    while "rank table wait started" not in _task_log(log):
        assert time.monotonic() < deadline, "the runtime never started waiting"
        time.sleep(0.05)
    return runtime, target, log


def _task_log(log: Path) -> str:
    return "".join(path.read_text() for path in log.glob("*.log")) if log.exists() else ""


@pytest.mark.parametrize("as_pid1", [False, True], ids=["child", "pid1"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_during_the_rank_table_wait_ends_the_run_at_once(job_env, tmp_path, as_pid1, signum):
    if as_pid1 and not can_unshare_pid():
        pytest.skip("needs unshare --pid (root)")
    runtime, target, log = waiting_runtime(job_env, tmp_path, as_pid1)

    subprocess.run(["kill", f"-{int(signum)}", str(target)], check=True)
    out, err = runtime.communicate(timeout=30)

    assert runtime.returncode == 128 + signum  # within communicate's 30 s: a stop that waited the stage out fails
    assert "RAN" not in out and "Traceback" not in err
    assert f"stopped by {signal.Signals(signum).name} before the command started" in err
    message = json.loads(next(log.glob("*-termination.json")).read_text())
    assert (message["exit_code"], message["stage"]) == (128 + signum, "startup")
