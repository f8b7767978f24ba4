"""Two nodes on one machine: real torchrun and msrun across two network namespaces, and an unresolvable worker-0.

The nodes are ma_runtime/local/nodes.py's: each a network namespace with a hosts file naming every node and
its own host name (gloo looks up the node's own host name, which must resolve to the node's own address). Each
node runs `ma-run` with that node's platform variables (VC_TASK_INDEX, the shared VC_WORKER_HOSTS, ...) and its
own MA_HOME; the runtime builds the multi-node launcher command line itself (launch/plan.py). Every namespace,
hosts file, link and process a test makes is removed by the fixture's finalizer, whatever the outcome.
"""

import os
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from ma_runtime.local import nodes as local_nodes
from ma_runtime.local.nodes import NamespaceError, Nodes
from tests.conftest import MA_RUN, free_port, run_ma
from tests.e2e.test_launchers import (
    JOBS,
    MS_BIN,
    TORCH_BIN,
    launcher_env,
    needs_mindspore,
    needs_torch,
    termination,
)

JOB = f"ma-job-e2e{os.getpid()}"
_MISSING = local_nodes.missing()
needs_namespaces = pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)} for network and UTS "
                                                             "namespaces (ma_runtime/local/nodes.py)")


class NodePair:
    """Two nodes (ma_runtime/local/nodes.py) each running `ma-run`, their output in files for the assertions."""

    def __init__(self, tmp_path: Path):
        self.nodes = Nodes(2, job=JOB, prefix="ma-e2e")
        self.tmp_path = tmp_path
        self.hosts, self.addresses, self.namespaces = self.nodes.hosts, self.nodes.addresses, self.nodes.namespaces
        self.processes: List[subprocess.Popen] = []
        self.outputs: List[Path] = []

    def start(self, node: int, env: Dict[str, str], command: List[str]) -> subprocess.Popen:
        """`ma-run COMMAND` as node NODE; output to files."""
        out = self.tmp_path / f"node-{node}.out"
        process = self.nodes.start(node, [MA_RUN, *command], env, stdout=out, stderr=out.with_suffix(".err"))
        self.processes.append(process)
        self.outputs.append(out)
        return process

    def wait(self, timeout: float, after_a_failure: float = 60.0) -> List[Optional[int]]:
        return self.nodes.wait(timeout, after_a_failure)

    def report(self, extra_logs=()) -> str:
        """Each node's exit code and the ends of its output, for an assertion message."""
        parts = []
        for node, process in enumerate(self.processes):
            out, err = self.outputs[node], self.outputs[node].with_suffix(".err")
            parts.append(f"--- node {node}: rc={process.poll()}\n[stdout]\n{_tail(out)}\n[stderr]\n{_tail(err)}")
        for path in extra_logs:
            parts.append(f"--- {path}\n{_tail(path)}")
        return "\n".join(parts)


@pytest.fixture
def node_pair(request, tmp_path):
    pair = NodePair(tmp_path)
    try:
        pair.nodes.create()  # removes what it made when it fails
    except NamespaceError as exc:
        pytest.fail(f"could not set up the namespaces: {exc}")
    request.addfinalizer(pair.nodes.close)  # ma-run gets SIGTERM and stops its launcher and ranks, then the sweep
    return pair


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"({exc.strerror})"


def node_env(pair: NodePair, job_env, tmp_path: Path, node: int, bin_dir: Path, **extra) -> Dict[str, str]:
    """Node NODE's environment: the platform's variables of that node (VC_TASK_INDEX, the job's shared
    VC_WORKER_HOSTS, ...), its own MA_HOME."""
    home = tmp_path / f"home-{node}"
    return launcher_env(
        job_env, bin_dir, MA_HOME=home, MA_RUNTIME_TERMINATION_LOG=home / "termination-log",
        **pair.nodes.environment(node), MA_RUNTIME_STOP_GRACE_SECONDS=5, **extra,
    )


@needs_namespaces
@needs_torch
def test_torchrun_on_two_nodes_all_reduces_over_four_ranks(job_env, tmp_path, node_pair):
    port = free_port()
    envs = [node_env(node_pair, job_env, tmp_path, node, TORCH_BIN, MA_RUN_METHOD="torchrun", MA_NUM_GPUS=2,
                     MA_TORCHRUN_MASTER_PORT=port) for node in (0, 1)]

    for node in (0, 1):
        node_pair.start(node, envs[node], ["python", str(JOBS / "torch_allreduce.py")])
    codes = node_pair.wait(timeout=300)

    report = node_pair.report()
    assert codes == [0, 0], report
    for node in (0, 1):
        stdout = node_pair.outputs[node].read_text(errors="replace")
        stderr = node_pair.outputs[node].with_suffix(".err").read_text(errors="replace")
        for rank in (2 * node, 2 * node + 1):
            assert f"rank {rank} of 4: all_reduce=10.0" in stdout, report
        # The multi-node plan: static rendezvous at worker-0's name, this node's rank.
        for flag in ("--nnodes=2", "--nproc_per_node=2", f"--node_rank={node}", f"--master_addr={node_pair.hosts[0]}",
                     f"--master_port={port}", "--rdzv_backend=static"):
            assert flag in stderr, report


@needs_namespaces
@needs_mindspore
def test_msrun_on_two_nodes_runs_a_graph_mode_all_reduce(job_env, tmp_path, node_pair):
    port = free_port()
    envs = []
    for node in (0, 1):
        pids = tmp_path / f"pids-{node}"
        pids.mkdir()
        envs.append(node_env(node_pair, job_env, tmp_path, node, MS_BIN, MA_RUN_METHOD="msrun", MA_NUM_GPUS=1,
                             PIDS_DIR=pids, MA_RUNTIME_MSRUN_MASTER_PORT=port))

    for node in (0, 1):
        node_pair.start(node, envs[node], ["python", str(JOBS / "ms_allreduce.py")])
    codes = node_pair.wait(timeout=420)

    log_dirs = [Path(env["MA_HOME"]) / "modelarts" / "log" / "msrun" / "attempt-1" for env in envs]
    msrun_logs = sorted(path for folder in log_dirs for path in folder.glob("*.log"))
    report = node_pair.report(msrun_logs)
    assert codes == [0, 0], report
    for node in (0, 1):
        # The worker log, or the console where the runtime forwards the workers' lines.
        seen = node_pair.outputs[node].read_text(errors="replace") + "".join(
            path.read_text(errors="replace") for path in log_dirs[node].glob("worker_*.log"))
        assert f"rank {node} of 2: all_reduce=3.0" in seen, report
        # msrun wants an IP: worker-0's name, resolved inside the namespace through its hosts file.
        stderr = node_pair.outputs[node].with_suffix(".err").read_text(errors="replace")
        for flag in ("--worker_num=2", "--local_worker_num=1", f"--node_rank={node}",
                     f"--master_addr={node_pair.addresses[0]}", f"--master_port={port}"):
            assert flag in stderr, report


def test_an_unresolvable_worker_0_fails_with_81_naming_the_host(job_env, tmp_path):
    # A stand-in msrun, so that the test needs no MindSpore: the launch must stop before running it.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "msrun"
    fake.write_text("#!/bin/sh\necho 'the stand-in msrun ran'\n")
    fake.chmod(0o755)
    env = launcher_env(job_env, bin_dir, MA_RUN_METHOD="msrun", MA_NUM_HOSTS=2,
                       VC_WORKER_HOSTS="no-such-host.invalid,other.invalid", MA_RUNTIME_MASTER_RESOLVE_SECONDS=1,
                       MA_RUNTIME_COORDINATOR="off")  # msrun's own wait for the name, not the barrier's

    done = run_ma(["python", "train.py"], env, timeout=60)

    output = done.stdout + done.stderr
    assert done.returncode == 81, output[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error,exiting" in line]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "no-such-host.invalid" in errors[0]
    assert "Traceback" not in output
    assert "the stand-in msrun ran" not in output  # and within run_ma's 60 s: the 1 s resolve setting held
    message = termination(env)
    assert (message["exit_code"], message["stage"]) == (81, "launch")
    assert "no-such-host.invalid" in message["reason"]
