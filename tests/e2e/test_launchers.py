"""The real launchers under `ma-run`: torchrun (gloo) and msrun (MindSpore CPU) on one node.

torchrun comes from the venv of the interpreter running the tests (`pip install torch==2.13.0`,
scripts/test.sh), msrun from `.venv-ms` (MindSpore apart from the runtime, as a job's own interpreter
would be). Tests skip with the reason when either is missing.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ma_runtime.launch import registry
from ma_runtime.local.devices import FAKES
from tests.conftest import MA_RUN, ROOT, alive, free_port, run_ma

JOBS = ROOT / "tests" / "e2e" / "jobs"
# The job's tools (torchrun, python with torch, mpi4py and lightning) are the running interpreter's: found beside
# it, whatever venv runs the suite and wherever it lies, never by the repository's layout.
TORCH_BIN = Path(sys.executable).parent
MS_BIN = ROOT / ".venv-ms" / "bin"
# torch 2.13 (and Lightning and the Trainer on it) needs Python >= 3.10: on the 3.9 pass its tests skip, expectedly.
_NO_TORCH_WHEEL = " (no wheel for Python 3.9)" if sys.version_info < (3, 10) else ""


def _has(binary: Path, module: str) -> bool:
    python = binary.parent / "python"
    return binary.exists() and subprocess.run([str(python), "-c", f"import {module}"],
                                              capture_output=True).returncode == 0


needs_torch = pytest.mark.skipif(not _has(TORCH_BIN / "torchrun", "torch"),
                                 reason=f"torch is not installed beside {sys.executable} (scripts/test.sh installs "
                                        f"torch==2.13.0){_NO_TORCH_WHEEL}")
needs_mindspore = pytest.mark.skipif(not _has(MS_BIN / "msrun", "mindspore"),
                                     reason="MindSpore is not installed in .venv-ms (scripts/test.sh installs it)")


def launcher_env(job_env, bin_dir: Path, **extra):
    env = {**job_env, "PATH": f"{bin_dir}{os.pathsep}{job_env['PATH']}", "MA_RUNTIME_PREFLIGHT": "0"}
    env.update({name: str(value) for name, value in extra.items()})
    return env


def termination(env) -> dict:
    log_dir = Path(env["MA_HOME"]) / "modelarts" / "log"
    return json.loads(next(log_dir.glob("*-termination.json")).read_text())


@needs_torch
def test_torchrun_on_one_node_runs_every_rank_with_the_appended_arguments(job_env, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("hyperparameters:\n  lr: 0.1\n")
    env = launcher_env(job_env, TORCH_BIN, MA_RUN_METHOD="torchrun", MA_NUM_GPUS=2)

    done = run_ma(["--config", str(config), "python", str(JOBS / "torch_allreduce.py"), "--own=1"], env, timeout=180)

    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2: all_reduce=3.0 args=['--own=1', '--lr=0.1']" in done.stdout
    assert 'method=torchrun' in done.stderr and "--standalone" in done.stderr


@needs_torch
def test_a_torchrun_rank_that_exits_3_fails_the_job_with_3_naming_the_rank(job_env):
    env = launcher_env(job_env, TORCH_BIN, MA_RUN_METHOD="torchrun", MA_NUM_GPUS=2, FAIL_RANK=1)

    done = run_ma(["python", str(JOBS / "torch_allreduce.py")], env, timeout=180)

    assert done.returncode == 3, done.stderr[-3000:]
    message = termination(env)
    assert (message["exit_code"], message["rank"]) == (3, 1)
    # The reason speaks of the rank's own code, as the exit code does (it said torchrun's 1).
    assert message["reason"] == "rank 1 failed first: the command exited with code 3"


def test_torchrun_missing_is_one_line_naming_the_package(job_env, tmp_path):
    env = {**job_env, "PATH": f"{tmp_path}{os.pathsep}/usr/bin:/bin", "MA_RUN_METHOD": "torchrun",
           "MA_RUNTIME_PREFLIGHT": "0"}

    done = run_ma(["python", "train.py"], env)

    assert done.returncode == 78
    assert "torchrun is not installed" in done.stderr and "pip install torch" in done.stderr
    assert "Traceback" not in done.stderr


@needs_mindspore
def test_msrun_on_one_node_runs_a_graph_mode_all_reduce(job_env, tmp_path):
    env = launcher_env(job_env, MS_BIN, MA_RUN_METHOD="msrun", MA_NUM_GPUS=2, PIDS_DIR=tmp_path,
                       MA_RUNTIME_MSRUN_MASTER_PORT=free_port())

    done = run_ma(["python", str(JOBS / "ms_allreduce.py")], env, timeout=300)

    assert done.returncode == 0, done.stderr[-3000:]
    log_dir = Path(env["MA_HOME"]) / "modelarts" / "log" / "msrun" / "attempt-1"
    logs = "".join(path.read_text(errors="replace") for path in log_dir.glob("worker_*.log"))
    assert "rank 0 of 2: all_reduce=3.0" in logs and "rank 1 of 2: all_reduce=3.0" in logs
    # The ranks' lines reach the console through the runtime, each with its rank, and no `tail -f` of msrun's.
    for rank in (0, 1):
        assert f"[rank-{rank}] rank {rank} of 2: all_reduce=3.0" in done.stdout.splitlines()


@needs_mindspore
def test_msrun_beside_the_commands_python_runs_although_path_lacks_it(job_env, tmp_path):
    """`.venv-ms/bin/python SCRIPT` with MA_RUN_METHOD=msrun: the msrun installed with that Python runs, and its
    rank runs with that Python too. One rank, no MindSpore import: only the launch is under test."""
    script = tmp_path / "where.py"
    script.write_text('import os, sys\nprint(f"rank {os.environ[\'RANK_ID\']} ran {sys.executable}", flush=True)\n')
    path = os.pathsep.join(part for part in job_env["PATH"].split(os.pathsep) if not (Path(part) / "msrun").exists())
    env = {**job_env, "PATH": path, "MA_RUN_METHOD": "msrun", "MA_RUNTIME_PREFLIGHT": "0",
           "MA_RUNTIME_MSRUN_MASTER_PORT": str(free_port())}

    done = run_ma([os.path.join(".venv-ms", "bin", "python"), str(script)], env, cwd=ROOT, timeout=180)

    assert done.returncode == 0, done.stderr[-3000:]
    assert f"[rank-0] rank 0 ran {MS_BIN / 'python'}" in done.stdout.splitlines()
    assert str(MS_BIN / "msrun") in done.stderr  # the `starting command` line's argv
    # msrun's own warning, documented in the README: untrue here, the runtime follows the rank's log itself.
    assert "So this worker 0's log will not be output to console" in done.stderr


@needs_mindspore
def test_sigterm_to_the_runtime_leaves_no_msrun_process_alive(job_env, tmp_path):
    env = launcher_env(job_env, MS_BIN, MA_RUN_METHOD="msrun", MA_NUM_GPUS=2, PIDS_DIR=tmp_path, SLEEP=300,
                       MA_RUNTIME_STOP_GRACE_SECONDS=5, MA_RUNTIME_MSRUN_MASTER_PORT=free_port())
    runtime = subprocess.Popen([MA_RUN, "python", str(JOBS / "ms_allreduce.py")], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        ranks = _wait_for_pids(tmp_path, 2, timeout=240)
        family = _lineage_pids(env, runtime.pid)
        assert len(family) >= 4  # msrun, its scheduler, two ranks
        assert not [pid for pid in family if _comm(pid) == "tail"]  # msrun's own tails are off

        runtime.send_signal(signal.SIGTERM)
        runtime.wait(timeout=60)
    finally:
        if runtime.poll() is None:
            runtime.kill()
    time.sleep(0.5)
    assert not [pid for pid in ranks + family if alive(pid)], "processes survived the runtime"


def _wait_for_pids(folder: Path, count: int, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = list(folder.glob("rank-*.pid"))
        if len(files) == count:
            time.sleep(1.0)  # past the write
            return [int(path.read_text()) for path in files]
        time.sleep(0.2)
    raise AssertionError(f"the ranks did not start within {timeout} s")


def _lineage_pids(env, runtime_pid: int):
    """Every process whose environment carries a lineage naming the runtime's run (its whole family)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == runtime_pid:
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if b"MA_RUNTIME_LINEAGE=" in environ and env["MA_HOME"].encode() in environ:
            found.append(int(entry))
    return found


# --------------------------------------------------------------------------- RTF: one process per NPU


def npu_job(job_env, tmp_path, devices=8, **extra):
    """An 8-device NPU pod: fake davinci<N> device nodes, and the platform's writer stand-in filling a template-two
    table into a /user/config stand-in after the runtime starts (missing, half-written, initializing, completed).
    No MA_RUN_METHOD: the runtime must pick the rank-table launch itself."""
    config, dev = tmp_path / "user-config", tmp_path / "dev"
    config.mkdir()
    dev.mkdir()
    for device in range(devices):
        (dev / f"davinci{device}").touch()
    table = {
        "group_count": "1", "status": "completed",
        "group_list": [{"device_count": str(devices), "group_name": "job-worker", "instance_count": "1",
                        "instance_list": [{"pod_name": "job-worker-0", "server_id": "10.0.0.1",
                                           "devices": [{"device_id": str(d), "device_ip": f"192.1.0.{d + 1}"}
                                                       for d in range(devices)]}]}],
    }
    source = tmp_path / "table.json"
    source.write_text(json.dumps(table))
    writer = subprocess.Popen([sys.executable, str(FAKES / "ranktable_writer.py"),
                               "--path", str(config / "jobstart_hccl.json"), "--table", str(source),
                               "--delay-create", "0.5", "--initializing", "0.5"], stdout=subprocess.DEVNULL)
    WRITERS.append(writer)
    env = {**job_env, "RANK_TABLE_FILE": str(config), "VC_TASK_INDEX": "0", "MA_NUM_GPUS": str(devices),
           "MA_VJ_NAME": "ma-job-0a1b", "MA_RUNTIME_PREFLIGHT": "0", "MA_RUNTIME_PREFLIGHT_DEV_DIR": str(dev)}
    env.update({name: str(value) for name, value in extra.items()})
    return env


WRITERS = []


@pytest.fixture(autouse=True)
def _stop_writers():
    yield
    while WRITERS:
        writer = WRITERS.pop()
        if writer.poll() is None:
            writer.kill()
        writer.wait()


def test_rtf_starts_one_process_per_npu_with_its_env_and_proc_log(job_env, tmp_path):
    env = npu_job(job_env, tmp_path)
    script = ('echo "rank=$RANK_ID logical=$ASCEND_DEVICE_ID device=$DEVICE_ID size=$RANK_SIZE job=$JOB_ID '
              'table=$RANK_TABLE_FILE $1"')

    done = run_ma(["sh", "-c", script, "sh", "--x=1"], env, timeout=60)

    assert done.returncode == 0, done.stderr[-2000:]
    log_dir = Path(env["MA_HOME"]) / "modelarts" / "log"
    converted = Path(env["MA_HOME"]) / "modelarts" / ".ma-runtime" / "rank_table" / "jobstart_hccl.json"
    for rank in range(8):
        line = f"rank={rank} logical={rank} device={rank} size=8 job=0a1b table={converted} --x=1"
        assert f"[rank-{rank}] {line}" in done.stdout.splitlines()
        proc_log = log_dir / f"modelarts-job-0a1b-proc-rank-{rank}-device-{rank}.txt"
        header, *lines = proc_log.read_text().splitlines()
        assert re.fullmatch(r"==== ma-runtime: attempt 1 \(run [0-9a-f]{12}\) ====", header) and lines == [line]
    assert "method=rtf" in done.stderr


def test_rtf_the_first_failing_rank_stops_the_others_and_decides_the_code(job_env, tmp_path):
    env = npu_job(job_env, tmp_path, MA_RUNTIME_STOP_GRACE_SECONDS=5)
    script = 'if [ "$RANK_ID" = 3 ]; then sleep 0.5; exit 7; fi; exec sleep 120'

    done = run_ma(["sh", "-c", script], env, timeout=60)  # under the others' 120 s: waiting for them fails here

    assert done.returncode == 7, done.stderr[-2000:]
    assert "a worker failed: stopping the others" in done.stderr
    message = termination(env)
    assert (message["exit_code"], message["rank"]) == (7, 3)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_rtf_with_more_gpus_asked_than_the_table_gives_is_bad_configuration(job_env, tmp_path):
    env = npu_job(job_env, tmp_path, devices=8)
    env["MA_NUM_GPUS"] = "16"

    done = run_ma(["sh", "-c", "echo RAN"], env)

    assert done.returncode == 78 and "RAN" not in done.stdout
    assert "MA_NUM_GPUS=16" in done.stderr and "8 device(s)" in done.stderr and "Traceback" not in done.stderr


def test_an_unknown_run_method_is_one_line_naming_the_accepted_values(job_env):
    done = run_ma(["sh", "-c", "echo RAN"], {**job_env, "MA_RUN_METHOD": "horovod"})

    assert done.returncode == 78 and "RAN" not in done.stdout
    assert ", ".join(registry.METHODS) in done.stderr
    assert "Traceback" not in done.stderr
