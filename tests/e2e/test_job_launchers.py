"""The job as one (issue 26) under the real launchers: a rank failing once on one node restarts every node's
launcher with the same MA_PROC_START_CNT, and attempt 2's collective is right. Real torchrun (gloo, static
rendezvous as the runtime builds it for the platform), real msrun (MindSpore CPU), RTF with fake NPUs and a rank
table per node, real mpirun (Open MPI over each node's sshd). Each node is a network namespace
(ma_runtime/local/nodes.py) running `ma-run`, worker-0's runtime hosting the coordination store
(tests/e2e/test_job_as_one.py's Job).

No timed assertion: what is asserted is which attempts ran where, what their collectives gave, the exit codes and
the termination messages.
"""

import json
import os
import re

import pytest

from ma_runtime.local.devices import FAKES
from tests.conftest import free_port, wait_for_file
from tests.e2e import test_mpirun as mpirun_tests
from tests.e2e.test_job_as_one import GUARD, Job
from tests.e2e.test_launchers import JOBS, MS_BIN, TORCH_BIN, needs_mindspore, needs_torch
from tests.e2e.test_mpirun import needs_mpi

trusted = mpirun_tests.trusted  # the fixture: the job's SSH trust files in a node's MA_HOME/.ssh


@pytest.fixture
def nodes(request, tmp_path):
    """nodes(count): a Job of `count` nodes (namespaces made now, removed whatever the outcome)."""
    def make(count: int) -> Job:
        job = Job(tmp_path, count)
        request.addfinalizer(job.nodes.close)
        job.nodes.create()
        return job

    return make


def stdout(job: Job, node: int) -> str:
    return (job.tmp_path / f"node-{node}.out").read_text(errors="replace")


def report(job: Job) -> str:
    return job.report() + "".join(f"\n--- node {node} stdout\n{stdout(job, node)[-2000:]}"
                                  for node in range(len(job.processes)))


# --------------------------------------------------------------------------- torchrun


def torch_job(job: Job, job_env, **settings):
    """Every node: `ma-run python jobs/job_torch.py` as the platform launches it (MA_RUN_METHOD=torchrun: the
    runtime builds the static rendezvous at worker-0), one rank per node, rank 1 (node 1) failing in attempt 1."""
    port = free_port()
    for node in range(len(job.nodes.nodes)):
        env = job.env(job_env, node, PATH=f"{TORCH_BIN}{os.pathsep}{job_env['PATH']}", MA_RUN_METHOD="torchrun",
                      MA_NUM_GPUS=1, MA_TORCHRUN_MASTER_PORT=port, FAIL_RANK=1, **settings)
        job.start(node, env, ["python", str(JOBS / "job_torch.py")])
    return job.wait()


@needs_torch
def test_torchrun_a_rank_failing_once_restarts_every_node_and_attempt_2_all_reduces(job_env, nodes):
    job = nodes(3)

    codes = torch_job(job, job_env, MA_RUNTIME_MAX_RESTARTS=1)

    assert codes == [0, 0, 0], report(job)
    for node in range(3):  # one rank per node: rank = node; attempt 2 on every node, its sum over all three
        # Restarted in place: one torchrun agent per node for the run (torch imported once there), which started
        # both attempts' rank; the rendezvous is the platform's static one, its node rank VC_TASK_INDEX.
        (agent,) = re.findall(r'msg="torchrun started for the run: its ranks restart in place".* pid=(\d+)',
                              job.stderr(node))
        for attempt in (1, 2):
            assert f"rank {node} attempt {attempt}: all_reduce=6.0 agent {agent}\n" in stdout(job, node), report(job)
        started = re.findall(r'msg="starting command".*method=torchrun.* attempt=(\d+)', job.stderr(node))
        assert started == ["1", "2"], report(job)
        assert "--rdzv_backend=static" in job.stderr(node) and f"--node_rank={node}" in job.stderr(node)
    for node in (0, 2):  # nothing failed there: the job stopped their rank
        assert "stopping the workers for the job" in job.stderr(node), report(job)


@needs_torch
def test_torchrun_restarts_off_the_ranks_node_keeps_its_code_and_the_others_exit_86(job_env, nodes):
    job = nodes(3)

    codes = torch_job(job, job_env)

    assert codes == [86, 3, 86], report(job)  # node 1: the rank's code, as on one node (torchrun's own is 1)
    origins = [job.termination(node).get("origin") for node in range(3)]
    assert origins[0] == origins[1] == origins[2], origins
    # The rank and its own code, as torchrun's error summary names them: not torchrun's own 1.
    assert (origins[0]["task_index"], origins[0]["host"], origins[0]["attempt"]) == (1, job.nodes.hosts[1], 1)
    assert (origins[0]["rank"], origins[0]["exit_code"]) == (1, 3), origins[0]
    for node in (0, 2):
        message = job.termination(node)
        assert (message["exit_code"], message["category"]) == (86, "platform")
        assert message["reason"] == (f"{job.nodes.hosts[1]} (task 1) rank 1 failed first: the command exited with "
                                     "code 3"), message["reason"]
    assert (job.termination(1)["exit_code"], job.termination(1)["rank"]) == (3, 1)


# --------------------------------------------------------------------------- msrun


@needs_mindspore
def test_msrun_a_rank_failing_once_restarts_both_nodes_and_attempt_2_all_reduces(job_env, nodes, tmp_path):
    job = nodes(2)
    marks = tmp_path / "marks"
    marks.mkdir()
    port = free_port()
    for node in (0, 1):  # jobs/restart_ms.py: rank 1 (node 1) exits 1 in attempt 1, rank 0 waits to be stopped
        env = job.env(job_env, node, PATH=f"{MS_BIN}{os.pathsep}{job_env['PATH']}", MA_RUN_METHOD="msrun",
                      MA_NUM_GPUS=1, MA_RUNTIME_MSRUN_MASTER_PORT=port, MA_RUNTIME_MAX_RESTARTS=1, MARKS=marks,
                      MS_NODE_TIMEOUT=15)
        job.start(node, env, ["python", str(JOBS / "restart_ms.py")])

    codes = job.wait()

    logs = [job.tmp_path / f"home-{node}" / "modelarts" / "log" / "msrun" for node in (0, 1)]
    second = ["".join(path.read_text(errors="replace") for path in (folder / "attempt-2").glob("worker_*.log"))
              for folder in logs]
    assert codes == [0, 0], report(job) + "\n".join(second)
    for node in (0, 1):
        assert f"rank {node} attempt 2: all_reduce=3.0" in second[node], report(job)
        assert f"rank {node} attempt 2: earlier attempts alive: []" in second[node]
    assert "stopping the workers for the job" in job.stderr(0), report(job)


# --------------------------------------------------------------------------- RTF


def rank_table(job: Job, node: int, devices: int, network: int) -> str:
    """The platform's template-two table for every node (pod names and IPs from the namespaces), devices'
    IPs in 192.<network>.<node>.x: a new `network` is a table the platform rewrote."""
    instances = [{"pod_name": each.name, "server_id": each.address,
                  "devices": [{"device_id": str(d), "device_ip": f"192.{network}.{each.index}.{10 + d}"}
                              for d in range(devices)]} for each in job.nodes.nodes]
    return json.dumps({"status": "completed", "group_count": "1", "group_list": [
        {"group_name": "worker", "device_count": str(devices * len(instances)),
         "instance_count": str(len(instances)), "instance_list": instances}]})


def test_rtf_a_rank_failing_once_rereads_the_rank_table_and_every_node_runs_attempt_2(job_env, nodes, tmp_path):
    job = nodes(2)
    devices, failing = 2, 3  # rank 3: node 1's second device
    marks = tmp_path / "marks"
    marks.mkdir()
    tables = []
    for node in (0, 1):
        config, dev = tmp_path / f"user-config-{node}", tmp_path / f"dev-{node}"
        config.mkdir()
        dev.mkdir()
        for name in [f"davinci{device}" for device in range(devices)] + ["davinci_manager"]:
            (dev / name).touch()
        tables.append(config / "jobstart_hccl.json")
        tables[-1].write_text(rank_table(job, node, devices, network=98))
        # No MA_RUN_METHOD: the rank table makes it RTF. The fake npu-smi answers the device-release wait.
        env = job.env(job_env, node, PATH=f"{FAKES}{os.pathsep}{job_env['PATH']}", RANK_TABLE_FILE=config,
                      MA_NUM_GPUS=devices, MA_RUNTIME_PREFLIGHT_ACCELERATOR="npu",
                      MA_RUNTIME_PREFLIGHT_DEV_DIR=dev, MA_RUNTIME_MAX_RESTARTS=1, MARKS=marks, FAIL_RANK=failing)
        job.start(node, env, ["python", str(JOBS / "job_rtf_rank.py")])
    for rank in range(2 * devices):
        wait_for_file(marks / f"start-1-{rank}", timeout=GUARD)
    for node in (0, 1):  # the platform rewrites the table (a rescheduled pod's devices): attempt 2 must see it
        tables[node].write_text(rank_table(job, node, devices, network=99))
    (marks / "fail").touch()

    codes = job.wait()

    assert codes == [0, 0], report(job)
    started = {path.name[len("start-"):]: path.read_text() for path in marks.glob("start-*")}
    assert sorted(started) == sorted(f"{attempt}-{rank}" for attempt in (1, 2) for rank in range(2 * devices))
    for rank in range(2 * devices):
        node, device = divmod(rank, devices)
        assert started[f"1-{rank}"] == f"192.98.{node}.{10 + device}"
        assert started[f"2-{rank}"] == f"192.99.{node}.{10 + device}", started  # the table read again
    for node in (0, 1):
        assert "the rank table changed since the last attempt: converting it again" in job.stderr(node)
    # The job's decision named the origin on node 0 too (its termination message is attempt 2's: no origin).
    assert f"{job.nodes.hosts[1]} (task 1) rank {failing} failed first" in job.stderr(0), report(job)


# --------------------------------------------------------------------------- mpirun


@needs_mpi
def test_mpirun_a_rank_failing_once_reruns_mpirun_on_worker_0_and_every_node_ends_0(job_env, nodes, trusted):
    job = nodes(2)
    for node in (0, 1):  # jobs/mpi_allreduce.py: rank 3 (node 1's second) exits 3 in attempt 1
        env = job.env(job_env, node, PATH=f"{mpirun_tests.BIN}{os.pathsep}{job_env['PATH']}", MA_RUN_METHOD="mpirun",
                      MY_MPI_SLOTS=2, OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1,
                      MA_RUNTIME_PEER_WAIT_SECONDS=30, MA_RUNTIME_MPI_EXPORT="FAIL_RANK,FAIL_ATTEMPT", FAIL_RANK=3,
                      FAIL_ATTEMPT=1, MA_RUNTIME_MAX_RESTARTS=1)
        job.start(node, trusted(env), mpirun_tests.COMMAND)

    codes = job.wait()

    assert codes == [0, 0], report(job)
    for rank in range(4):  # attempt 2's allreduce, every rank's line through worker-0's mpirun
        assert f"rank {rank} of 4 on {job.nodes.hosts[rank // 2]}: allreduce=10" in stdout(job, 0), report(job)
    for node in (0, 1):
        started = re.findall(r'msg="starting command".* attempt=(\d+)', job.stderr(node))
        assert started == ["1", "2"], report(job)
        assert job.stderr(node).count('msg="sshd listens"') == 1  # the same sshd for both attempts
    # Worker-1 followed the job: stopped when worker-0's mpirun failed, ended when worker-0's attempt 2 did.
    assert f"{job.nodes.hosts[0]} (task 0) rank 3 failed first" in job.stderr(1), report(job)
    assert "ma-runtime: every node watched has finished" in job.stderr(1), report(job)
