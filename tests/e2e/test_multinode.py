"""Two nodes on one machine: real torchrun and msrun across two network namespaces, and an unresolvable worker-0.

Each node is a network namespace, the two joined by a veth pair, with its own `/etc/netns/<ns>/hosts` naming
both nodes (`ip netns exec` bind-mounts it over /etc/hosts) and its own host name from `unshare --uts`: gloo
looks up the node's own host name, which must resolve to the node's own address (docs/architecture.md, "Tests").
Each node runs `ma-run` with its VC_TASK_INDEX and MA_HOME and the shared VC_WORKER_HOSTS; the runtime builds
the multi-node launcher command line itself (launch/plan.py). Every namespace, hosts file, veth and process a
test makes is removed by the fixture's finalizer, whatever the outcome.
"""

import itertools
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

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

HOSTS = ("job-worker-0.job", "job-worker-1.job")
_pairs = itertools.count()


def _can_make_namespaces() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare") or not shutil.which("hostname"):
        return False
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True)
    return probe.returncode == 0


needs_namespaces = pytest.mark.skipif(
    not _can_make_namespaces(),
    reason="needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), iproute2's `ip`, util-linux's `unshare` and `hostname` "
           "for network and UTS namespaces",
)


class NodePair:
    """Two network namespaces joined by a veth pair, each with a hosts file naming both nodes."""

    def __init__(self, tmp_path: Path):
        number = next(_pairs)
        pid = os.getpid()
        self.tmp_path = tmp_path
        self.namespaces = [f"ma-e2e-{pid}-{number}-{node}" for node in (0, 1)]
        self.veths = [f"mv{pid}-{number % 1000}{'ab'[node]}" for node in (0, 1)]  # at most 14 characters (IFNAMSIZ)
        subnet = f"10.{212 + number % 40}.{pid % 250}"
        self.addresses = [f"{subnet}.{node + 1}" for node in (0, 1)]
        self.processes: List[subprocess.Popen] = []
        self.outputs: List[Path] = []

    def create(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "add", ns)
        _ip("link", "add", self.veths[0], "type", "veth", "peer", "name", self.veths[1])
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{address} {host} {host.split('.')[0]}\n" for address, host in zip(self.addresses, HOSTS))
        for ns, veth, address in zip(self.namespaces, self.veths, self.addresses):
            _ip("link", "set", veth, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)

    def start(self, node: int, env: Dict[str, str], command: List[str]) -> subprocess.Popen:
        """`ma-run COMMAND` as node NODE: in its namespace, under its own host name; output to files."""
        out = self.tmp_path / f"node-{node}.out"
        err = self.tmp_path / f"node-{node}.err"
        argv = ["ip", "netns", "exec", self.namespaces[node], "unshare", "--uts",
                "sh", "-c", 'hostname "$0" && exec "$@"', HOSTS[node], MA_RUN, *command]
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr)
        self.processes.append(process)
        self.outputs.append(out)
        return process

    def wait(self, timeout: float, after_a_failure: float = 60.0) -> List[Optional[int]]:
        """Every node's exit code, None for one still running at the deadline. A node that fails can leave
        the other waiting for it for minutes (gloo, msrun's cluster timeout): the rest get AFTER_A_FAILURE."""
        deadline = time.monotonic() + timeout
        while any(process.poll() is None for process in self.processes) and time.monotonic() < deadline:
            if any(process.returncode not in (None, 0) for process in self.processes):
                deadline = min(deadline, time.monotonic() + after_a_failure)
            time.sleep(0.2)
        return [process.poll() for process in self.processes]

    def report(self, extra_logs=()) -> str:
        """Each node's exit code and the ends of its output, for an assertion message."""
        parts = []
        for node, process in enumerate(self.processes):
            out, err = self.outputs[node], self.outputs[node].with_suffix(".err")
            parts.append(f"--- node {node}: rc={process.poll()}\n[stdout]\n{_tail(out)}\n[stderr]\n{_tail(err)}")
        for path in extra_logs:
            parts.append(f"--- {path}\n{_tail(path)}")
        return "\n".join(parts)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # ma-run stops its launcher and the ranks
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        for ns in self.namespaces:
            # Anything still in our namespaces (orphans of a killed launcher) is ours: killed by pid.
            for _ in range(20):
                listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
                pids = [int(word) for word in listed.stdout.split() if word.isdigit()]
                if listed.returncode != 0 or not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.2)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        for veth in self.veths:  # left in the host namespace only when creation stopped half-way
            subprocess.run(["ip", "link", "del", veth], capture_output=True)


@pytest.fixture
def node_pair(request, tmp_path):
    pair = NodePair(tmp_path)
    request.addfinalizer(pair.close)
    try:
        pair.create()
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"could not set up the namespaces: {' '.join(exc.cmd)}: {exc.stderr}")
    return pair


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"({exc.strerror})"


def node_env(job_env, tmp_path: Path, node: int, bin_dir: Path, **extra) -> Dict[str, str]:
    """Node NODE's environment: its own MA_HOME and VC_TASK_INDEX, the job's shared VC_WORKER_HOSTS."""
    home = tmp_path / f"home-{node}"
    return launcher_env(
        job_env, bin_dir, MA_HOME=home, MA_RUNTIME_TERMINATION_LOG=home / "termination-log",
        MA_NUM_HOSTS=2, VC_TASK_INDEX=node, VC_WORKER_HOSTS=",".join(HOSTS),
        MA_VJ_NAME=f"ma-job-e2e{os.getpid()}", MA_RUNTIME_STOP_GRACE_SECONDS=5, **extra,
    )


@needs_namespaces
@needs_torch
def test_torchrun_on_two_nodes_all_reduces_over_four_ranks(job_env, tmp_path, node_pair):
    port = free_port()
    envs = [node_env(job_env, tmp_path, node, TORCH_BIN, MA_RUN_METHOD="torchrun", MA_NUM_GPUS=2,
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
        for flag in ("--nnodes=2", "--nproc_per_node=2", f"--node_rank={node}", f"--master_addr={HOSTS[0]}",
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
        envs.append(node_env(job_env, tmp_path, node, MS_BIN, MA_RUN_METHOD="msrun", MA_NUM_GPUS=1,
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
                       VC_WORKER_HOSTS="no-such-host.invalid,other.invalid", MA_RUNTIME_MASTER_RESOLVE_SECONDS=1)

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
