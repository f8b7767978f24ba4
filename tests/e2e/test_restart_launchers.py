"""In-place restarts under the launchers (issue 11): RTF with 8 fake NPUs and the device-release wait, real
torchrun (gloo), real msrun (MindSpore CPU), and an RTF job with restarts off.

The ranks are the jobs/restart_*.py scripts: each records its start (and how it ended) in MARKS and prints,
as it starts, which processes of earlier attempts are still alive (jobs/restart_marks.py). The accelerator
tool is the fake npu-smi of ma_runtime/local/fakes, listing the processes the ranks register in FAKE_SMI_PROCESS_DIR.
A plain command's restarts are in test_restarts.py.
"""

import json
import os
import re
from pathlib import Path

from ma_runtime.local.devices import FAKES
from tests.conftest import ROOT, free_port, log_dir, run_ma, task_log
from tests.e2e.test_launchers import JOBS, MS_BIN, TORCH_BIN, launcher_env, needs_mindspore, needs_torch

TABLE = ROOT / "tests" / "data" / "ranktable" / "one_server_8.template2.json"
DEVICES = 8
FAILING_RANK = 3


def marks_dir(tmp_path) -> Path:
    marks = tmp_path / "marks"
    marks.mkdir()
    return marks


def npu_job(job_env, tmp_path, **settings):
    """An 8-NPU pod whose rank table is complete from the start, with the fake npu-smi first on PATH and the
    device wait asking it; rank FAILING_RANK fails on attempt 1."""
    config, dev = tmp_path / "user-config", tmp_path / "dev"
    config.mkdir()
    dev.mkdir()
    for name in [f"davinci{device}" for device in range(DEVICES)] + ["davinci_manager"]:
        (dev / name).touch()
    (config / "jobstart_hccl.json").write_text(TABLE.read_text())
    env = {**job_env, "PATH": f"{FAKES}{os.pathsep}{job_env['PATH']}", "RANK_TABLE_FILE": str(config),
           "VC_TASK_INDEX": "0", "MA_NUM_GPUS": str(DEVICES), "MA_VJ_NAME": "ma-job-0a1b",
           "MA_RUNTIME_PREFLIGHT": "0", "MA_RUNTIME_PREFLIGHT_DEV_DIR": str(dev),
           "MA_RUNTIME_PREFLIGHT_ACCELERATOR": "npu", "MA_RUNTIME_STOP_GRACE_SECONDS": "10",
           "MARKS": str(marks_dir(tmp_path)), "FAIL_RANK": str(FAILING_RANK)}
    env.update({name: str(value) for name, value in settings.items()})
    return env


def run_rtf(env):
    return run_ma(["python", str(JOBS / "restart_rtf_rank.py")], env, timeout=120)


def starts(env):
    """{(attempt, rank): the start record} of every rank that started."""
    found = {}
    for path in Path(env["MARKS"]).glob("start-*.json"):
        _, attempt, rank = path.stem.split("-")
        found[int(attempt), int(rank)] = json.loads(path.read_text())
    return found


def exits(env, attempt):
    """When each rank of `attempt` that recorded its end ended (time.time())."""
    return {int(path.name.split("-")[2]): float(path.read_text())
            for path in Path(env["MARKS"]).glob(f"exit-{attempt}-*")}


def termination(env):
    return json.loads(next(log_dir(env).glob("*-termination.json")).read_text())


def nothing_earlier_alive(output, ranks, attempt=2):
    """Each rank of `attempt` said, as it started, that no process of an earlier attempt was alive."""
    lines = output.splitlines()
    return all(any(line.endswith(f"rank {rank} attempt {attempt}: earlier attempts alive: []") for line in lines)
               for rank in ranks)


# --------------------------------------------------------------------------- RTF


def test_rtf_a_rank_failing_once_stops_all_8_and_relaunches_them_with_the_next_count(job_env, tmp_path):
    env = npu_job(job_env, tmp_path, MA_RUNTIME_MAX_RESTARTS=1)

    done = run_rtf(env)

    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(starts(env)) == [(attempt, rank) for attempt in (1, 2) for rank in range(DEVICES)]
    # Every rank of attempt 1 was stopped (they hold on until then), and none was left when attempt 2 began.
    assert sorted(exits(env, 1)) == list(range(DEVICES))
    assert nothing_earlier_alive(done.stdout, range(DEVICES))
    assert f'attempt=2 reason="rank {FAILING_RANK} failed first: the command exited with code 1" restarts_left=0' \
        in task_log(env, "modelarts-job-0a1b-worker-0").read_text()
    run_id = re.search(r"run_id=([0-9a-f]{12})", done.stderr)[1]
    for rank in range(DEVICES):
        proc_log = log_dir(env) / f"modelarts-job-0a1b-proc-rank-{rank}-device-{rank}.txt"
        headers = [line for line in proc_log.read_text().splitlines() if line.startswith("==== ")]
        assert headers == [f"==== ma-runtime: attempt {n} (run {run_id}) ====" for n in (1, 2)]


def test_rtf_the_relaunch_waits_until_npu_smi_no_longer_lists_the_ranks(job_env, tmp_path):
    processes = tmp_path / "processes"
    processes.mkdir()
    env = npu_job(job_env, tmp_path, MA_RUNTIME_MAX_RESTARTS=1, FAKE_SMI_PROCESS_DIR=processes,
                  FAKE_SMI_RELEASE_SECONDS=2)

    done = run_rtf(env)

    assert done.returncode == 0, done.stderr[-3000:]
    # The fake keeps a dead rank listed 2 s after it first saw it dead, so after the last rank's end.
    first_start = min(record["started"] for (attempt, _), record in starts(env).items() if attempt == 2)
    assert first_start - max(exits(env, 1).values()) >= 1.8
    log = task_log(env, "modelarts-job-0a1b-worker-0").read_text()
    assert 0 <= log.index('msg="restarting command"') < log.index(
        'msg="waiting for the accelerators to be released"') < log.index('msg="accelerators released"') < \
        log.index("rank 0 attempt 2")
    assert nothing_earlier_alive(done.stdout, range(DEVICES))


def test_rtf_devices_never_released_end_the_job_with_84_naming_them_and_no_second_attempt(job_env, tmp_path):
    processes = tmp_path / "processes"
    processes.mkdir()
    env = npu_job(job_env, tmp_path, MA_RUNTIME_MAX_RESTARTS=1, FAKE_SMI_PROCESS_DIR=processes,
                  FAKE_SMI_NEVER_RELEASE=1, MA_RUNTIME_DEVICE_RELEASE_SECONDS=2)

    done = run_rtf(env)

    assert done.returncode == 84, done.stderr[-3000:]
    assert sorted(starts(env)) == [(1, rank) for rank in range(DEVICES)]
    message = termination(env)
    assert (message["exit_code"], message["category"]) == (84, "infrastructure")
    failed = starts(env)[1, FAILING_RANK]["pid"]
    assert f"NPU {FAILING_RANK} pid {failed} (python)" in message["reason"]
    assert "Traceback" not in done.stderr


def test_rtf_with_restarts_off_a_failing_rank_ends_the_job_with_its_code_as_before(job_env, tmp_path):
    env = npu_job(job_env, tmp_path)

    done = run_rtf(env)

    assert done.returncode == 1, done.stderr[-3000:]
    assert sorted(starts(env)) == [(1, rank) for rank in range(DEVICES)]
    assert "restarting command" not in task_log(env, "modelarts-job-0a1b-worker-0").read_text()
    message = termination(env)
    assert (message["exit_code"], message["rank"], message.get("attempts")) == (1, FAILING_RANK, None)


# --------------------------------------------------------------------------- torchrun, msrun


@needs_torch
def test_torchrun_is_restarted_in_place_by_its_one_agent_and_each_rank_has_its_attempt(job_env, tmp_path):
    env = launcher_env(job_env, TORCH_BIN, MA_RUN_METHOD="torchrun", MA_NUM_GPUS=0, MA_RUNTIME_NPROC_PER_NODE=2,
                       MA_RUNTIME_MAX_RESTARTS=2, MARKS=marks_dir(tmp_path))

    done = run_ma(["python", str(JOBS / "restart_torch.py")], env, timeout=240)

    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("torchrun started for the run: its ranks restart in place") == 1, done.stderr[-3000:]
    started = re.findall(r'msg="starting command".*method=torchrun.* attempt=(\d+)', done.stderr)
    assert started == ["1", "2"]
    # MA_PROC_START_CNT in every rank is the runtime's attempt; one agent ran both, each rank under a shim of its
    # attempt, and nothing of attempt 1's ranks lived on when attempt 2's started.
    records = starts(env)
    assert sorted(records) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert len({record["agent"] for record in records.values()}) == 1, records
    assert records[1, 0]["launcher"] != records[2, 0]["launcher"]
    for rank in (0, 1):
        assert f"rank {rank} attempt 2: all_reduce=3.0" in done.stdout
    assert nothing_earlier_alive(done.stdout, (0, 1))


@needs_torch
def test_torchrun_in_place_the_same_failure_limit_ends_the_job_and_its_agent(job_env, tmp_path):
    env = launcher_env(job_env, TORCH_BIN, MA_RUN_METHOD="torchrun", MA_NUM_GPUS=0, MA_RUNTIME_NPROC_PER_NODE=2,
                       MA_RUNTIME_MAX_RESTARTS=5, MA_RUNTIME_SAME_FAILURE_LIMIT=2, FAIL_ATTEMPTS=99,
                       MARKS=marks_dir(tmp_path))

    done = run_ma(["python", str(JOBS / "restart_torch.py")], env, timeout=240)

    assert done.returncode == 82, done.stderr[-3000:]
    # The agent had started attempt 3's ranks, waiting at the gate: none ran, and the run's end stopped them all.
    records = starts(env)
    assert sorted(records) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    message = termination(env)
    assert (message["rank"], message["attempt"], len(message["attempts"])) == (1, 2, 2), message
    assert "the same failure 2 times in a row" in message["reason"], message
    (agent,) = {record["agent"] for record in records.values()}
    assert not Path(f"/proc/{agent}").exists()


@needs_torch
def test_torchrun_is_restarted_whole_and_the_second_attempt_all_reduces(job_env, tmp_path):
    env = launcher_env(job_env, TORCH_BIN, MA_RUN_METHOD="torchrun", MA_NUM_GPUS=0, MA_RUNTIME_NPROC_PER_NODE=2,
                       MA_RUNTIME_MAX_RESTARTS=1, MARKS=marks_dir(tmp_path), MA_RUNTIME_TORCHRUN_IN_PLACE="off")

    done = run_ma(["python", str(JOBS / "restart_torch.py")], env, timeout=240)

    assert done.returncode == 0, done.stderr[-3000:]
    started = re.findall(r'msg="starting command".*method=torchrun.* attempt=(\d+)', done.stderr)
    assert started == ["1", "2"]
    for rank in (0, 1):
        assert f"rank {rank} attempt 2: all_reduce=3.0" in done.stdout
    # torchrun of attempt 1 and both its ranks were gone when attempt 2's ranks started.
    assert nothing_earlier_alive(done.stdout, (0, 1))
    records = starts(env)
    assert records[1, 0]["launcher"] != records[2, 0]["launcher"]
    assert records[1, 0]["agent"] != records[2, 0]["agent"]  # a new torchrun


@needs_mindspore
def test_msrun_a_rank_failing_once_reruns_in_its_own_log_folder_with_nothing_of_attempt_1_left(job_env, tmp_path):
    # MindSpore's scheduler waits MS_NODE_TIMEOUT (30 s) for the crashed rank before msrun exits; a shorter wait
    # keeps the test lean and still leaves a loaded machine's heartbeats room.
    env = launcher_env(job_env, MS_BIN, MA_RUN_METHOD="msrun", MA_NUM_GPUS=2, MA_RUNTIME_MAX_RESTARTS=1,
                       MARKS=marks_dir(tmp_path), MA_RUNTIME_MSRUN_MASTER_PORT=free_port(), MS_NODE_TIMEOUT=15)

    done = run_ma(["python", str(JOBS / "restart_ms.py")], env, timeout=400)

    assert done.returncode == 0, done.stderr[-3000:]
    msrun_logs = log_dir(env) / "msrun"
    first = "".join(path.read_text(errors="replace") for path in (msrun_logs / "attempt-1").glob("worker_*.log"))
    second = "".join(path.read_text(errors="replace") for path in (msrun_logs / "attempt-2").glob("worker_*.log"))
    assert "rank 1 attempt 1: earlier attempts alive: []" in first and "all_reduce" not in first
    for rank in (0, 1):
        assert f"rank {rank} attempt 2: all_reduce=3.0" in second
    assert nothing_earlier_alive(second, (0, 1))
