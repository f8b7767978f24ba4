"""`ma-runtime local` with a real launcher: torchrun (real torch, gloo on CPU) across 2 nodes, with and without the
fake GPUs (`--accelerator gpu`).

What is asserted is what the user gets: each rank's all_reduce (on the console and, written into the job's
output, in --out/bucket), the task logs and termination messages under --out, the summary and the exit code, and
that nothing is left. Torch is imported only by the job; no timed assertion (GUARD only ends a broken run).
"""

import json
import os
import re
import subprocess
import uuid
from pathlib import Path

import pytest

from ma_runtime.local import nodes as local_nodes
from tests.conftest import MA_RUNTIME
from tests.e2e.test_launchers import TORCH_BIN, needs_torch

_MISSING = local_nodes.missing()
pytestmark = [pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)} (ma_runtime/local/nodes.py)"),
              needs_torch]
pytest.importorskip("moto.server")
GUARD = 180
SCRIPT = f"allreduce_{uuid.uuid4().hex[:12]}.py"  # a name no other process on the machine has
RUN_MARK = "LOCAL_LAUNCHERS_TEST_RUN"  # in the runner's environment: every process of the run has it

# Every rank all_reduces rank+1 and says what it saw in one write (ranks share the node's stdout), and writes the
# same line into the job's output (--train_url, synced to the bucket). HOLD_RANK: that rank waits before joining,
# so the others wait in the rendezvous for it, until a fault ends it or the job stops them.
ALLREDUCE = r"""
import argparse, os, sys, time
parser = argparse.ArgumentParser()
parser.add_argument("--train_url")
args, _ = parser.parse_known_args()
if os.environ.get("HOLD_RANK") == os.environ["RANK"]:
    time.sleep(300)
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
line = (f"{os.path.basename(__file__)} node {os.environ['VC_TASK_INDEX']} rank {rank} "
        f"local_rank {os.environ['LOCAL_RANK']} world {dist.get_world_size()} "
        f"num_gpus {os.environ.get('MA_NUM_GPUS')} cuda_visible {os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')} "
        f"all_reduce {value.item():g}")
os.write(1, (line + "\n").encode())
if args.train_url:
    with open(os.path.join(args.train_url, f"rank-{rank}.txt"), "w") as out:
        out.write(line)
dist.destroy_process_group()
"""

JOB = """\
outputs:
  - name: train_url
    url: obs://local-bkt/jobs/allreduce/output/
"""
# One rank's line: node, rank, local rank, world size, MA_NUM_GPUS, CUDA_VISIBLE_DEVICES, the sum.
RANK_LINE = re.compile(rf"^\[node(\d)\] {SCRIPT} node (\d) rank (\d) local_rank (\d) world (\d) num_gpus (\d) "
                       r"cuda_visible (\S+) all_reduce (\d+)$")


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / SCRIPT).write_text(ALLREDUCE)
    (tmp_path / "job.yaml").write_text(JOB)
    return tmp_path


def local(workdir: Path, *args: str, **env) -> subprocess.CompletedProcess:
    """`ma-runtime local --nodes 2 --method torchrun ARGS -- python SCRIPT`, torch's venv first on PATH (where a
    user's `python` would be), none of this machine's MA_, VC_ or CUDA_ variables; the run's mark in its
    environment (every process of the run inherits it) and the runner's pid (its namespaces' names) in `.pid`."""
    environ = {name: value for name, value in os.environ.items() if not name.startswith(("MA_", "VC_", "CUDA_"))}
    environ.update({"PATH": f"{TORCH_BIN}{os.pathsep}{environ.get('PATH', os.defpath)}", RUN_MARK: str(workdir),
                    **{name: str(value) for name, value in env.items()}})
    runner = subprocess.Popen([MA_RUNTIME, "local", "--nodes", "2", "--method", "torchrun", "--out",
                               str(workdir / "out"), *args, "--", "python", SCRIPT],
                              cwd=workdir, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = runner.communicate(timeout=GUARD)
    except subprocess.TimeoutExpired:
        runner.kill()
        raise
    result = subprocess.CompletedProcess(runner.args, runner.returncode, out, err)
    result.pid = runner.pid
    return result


def ranks(result) -> list:
    """(console node, node, rank, local rank, world, MA_NUM_GPUS, CUDA_VISIBLE_DEVICES, sum) of each rank's line."""
    found = [RANK_LINE.match(line) for line in result.stdout.splitlines()]
    return sorted(tuple(int(value) if value.isdigit() else value for value in match.groups())
                  for match in found if match)


def node_lines(result, node: int, event: str) -> list:
    return [line for line in result.stdout.splitlines() if line.startswith(f"[node{node}] ") and event in line]


def summary_of(result) -> str:
    return result.stdout[result.stdout.index("ma-runtime local: summary"):]


def termination(workdir: Path, node: int) -> dict:
    text = (workdir / "out" / f"node{node}" / "termination-log").read_text()
    return json.loads(text) if text.strip() else {}


def assert_nothing_left(result, workdir: Path) -> None:
    """No namespace of this run (`ma-local-<runner pid>-...`, nodes.py) and no process with its mark: other runs
    of `ma-runtime local` on the machine are not this test's."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"ma-local-{result.pid}-" not in listed, listed
    assert not marked_by_environment(f"{RUN_MARK}={workdir}"), "a process of the run outlived it"


def agent_lines(result, node: int) -> list:
    """The node's `torchrun started for the run` lines: the agent that restarts its ranks in place, with its flags."""
    return node_lines(result, node, 'msg="torchrun started for the run: its ranks restart in place"')


def marked_by_environment(assignment: str) -> list:
    wanted = assignment.encode() + b"\0"
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if wanted in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def test_torchrun_on_two_nodes_all_reduces_and_the_summary_says_succeeded(workdir):
    result = local(workdir, "--config", "job.yaml", MA_RUNTIME_PREFLIGHT="off")

    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    # No accelerator: MA_NUM_GPUS=0, one rank per node, global ranks in node order, each sum 1+2.
    assert ranks(result) == [(0, 0, 0, 0, 2, 0, "unset", 3), (1, 1, 1, 0, 2, 0, "unset", 3)], result.stdout[-4000:]
    for node in (0, 1):
        started = node_lines(result, node, 'msg="starting command"')
        assert len(started) == 1 and "method=torchrun" in started[0], started
        # Restarted in place on several nodes too: the flags are the agent's, started once for the run.
        agent = agent_lines(result, node)
        assert len(agent) == 1 and f"--nproc_per_node=1 --node_rank={node} " in agent[0], agent
        assert "--master_addr=ma-job-local-worker-0.ma-job-local" in agent[0]
        log = workdir / "out" / f"node{node}" / "log" / f"modelarts-job-local-worker-{node}.log"
        assert "all_reduce 3" in log.read_text(), "the rank's line is in its node's task log"
        assert termination(workdir, node) == {}, "a node that exited 0 writes no termination message"
        written = workdir / "out" / "bucket" / "local-bkt" / "jobs" / "allreduce" / "output" / f"rank-{node}.txt"
        assert written.read_text().endswith(f"rank {node} local_rank 0 world 2 num_gpus 0 cuda_visible unset "
                                            "all_reduce 3")
    summary = summary_of(result)
    for node in (0, 1):
        assert f"node{node}: exit 0, attempts 1, final sync completed" in summary
    assert "verdict: succeeded" in summary
    assert "2 object(s) written by the job, 2 in all" in summary
    assert summary.rstrip().endswith("exit code: 0")
    assert_nothing_left(result, workdir)


def test_an_exit_fault_on_a_torchrun_rank_fails_the_job_with_the_rank_s_code_and_its_origin(workdir):
    # Rank 1 (node1's only one) waits before joining; the fault ends it with 3; rank 0 waits in the rendezvous
    # until the job stops it. No rank=: the node's first rank, 1 here (rank 0, the default once, is not on node1:
    # the fault waited until node1 ended, then said "not done").
    result = local(workdir, "--inject", "exit@1:code=3", MA_RUNTIME_PREFLIGHT="off", MA_RUNTIME_MAX_RESTARTS=0,
                   HOLD_RANK=1)

    # Node1's code is the rank's 3, read from torchrun's root cause (torchrun itself exits 1).
    assert result.returncode == 3, result.stdout[-4000:] + result.stderr
    assert "[node1] ma-runtime local: exit fault: exiting with code 3" in result.stdout
    failed, followed = termination(workdir, 1), termination(workdir, 0)
    assert (failed["exit_code"], failed["category"], failed["rank"]) == (3, "user", 1), failed
    assert failed["reason"] == "rank 1 failed first: the command exited with code 3"
    host = "ma-job-local-worker-1.ma-job-local"
    assert (followed["exit_code"], followed["category"]) == (86, "platform"), followed
    assert followed["reason"] == f"{host} (task 1) rank 1 failed first: the command exited with code 3"
    assert followed["origin"] == failed["origin"] == {
        "task_index": 1, "host": host, "rank": 1, "exit_code": 3, "signal": None, "attempt": 1, "kind": "failed",
        "reason": "the command exited with code 3"}
    for node in (0, 1):
        assert (workdir / "out" / f"node{node}" / "log" / f"modelarts-job-local-worker-{node}.log").stat().st_size
    summary = summary_of(result)
    assert "node0: exit 86, attempts 1, final sync none" in summary
    assert "node1: exit 3, attempts 1, final sync none" in summary
    assert "verdict: node1 failed first (failed, exit 3, attempt 1)" in summary
    assert "volcano: no policy for node0's exit 86, node1's exit 3: the job fails" in summary
    assert "fault: exit on node1 (its first rank exits 3) at 0s: done (rank 1, pid " in summary
    assert summary.rstrip().endswith("exit code: 3")
    assert_nothing_left(result, workdir)


def test_fake_gpus_pass_the_preflight_and_torchrun_starts_one_rank_per_gpu(workdir):
    result = local(workdir, "--accelerator", "gpu", "--devices", "2", MA_RUNTIME_PREFLIGHT_CHECKS="gpu")

    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    for node in (0, 1):
        # The runtime's GPU check read the fake nvidia-smi: 2 healthy GPUs for MA_NUM_GPUS=2.
        checked = node_lines(result, node, 'msg="preflight check"')
        assert len(checked) == 1 and "item=gpu result=pass value=2 threshold=2 unit=count code=ok" in checked[0], \
            checked
        assert len(node_lines(result, node, 'msg="preflight passed"')) == 1
        agent = agent_lines(result, node)
        assert len(agent) == 1 and f"--nnodes=2 --nproc_per_node=2 --node_rank={node} " in agent[0], agent
    # 4 ranks: RANK 0-3 in node order, LOCAL_RANK 0-1 on each node, each sum 1+2+3+4. Nothing sets
    # CUDA_VISIBLE_DEVICES (the runtime leaves a rank's device to the job: LOCAL_RANK), as on the platform.
    assert ranks(result) == [(rank // 2, rank // 2, rank, rank % 2, 4, 2, "unset", 10) for rank in range(4)], \
        result.stdout[-4000:]
    summary = summary_of(result)
    assert "node0: exit 0, attempts 1" in summary and "node1: exit 0, attempts 1" in summary
    assert "verdict: succeeded" in summary and summary.rstrip().endswith("exit code: 0")
    assert_nothing_left(result, workdir)
