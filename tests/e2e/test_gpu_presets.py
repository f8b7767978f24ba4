"""The PyTorch-GPU and TensorFlow-GPU presets under `ma-run`, as black boxes.

- pytorch-gpu: real torch (gloo, CPU) across two network namespaces, one process per node, the boot file
  (jobs/torch_init_method.py) reading the platform's `--init_method --rank --world_size`; and a failed attempt
  restarted with the same flags.
- tensorflow-gpu: no TensorFlow here, so a fake ps/worker pair: fake workers listening on the ports of
  TF_WORKER_HOSTS, and `ma-run` as a ps whose command never ends by itself. It must end the ps and exit 0 once
  every worker has gone, not before; and 81 when a worker never shows up.
"""

import json
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import List

import pytest

from ma_runtime.launch import peers
from tests.conftest import MA_RUN, alive, free_port, marked, run_ma, wait_for_file
from tests.e2e import test_multinode as multinode
from tests.e2e.test_launchers import JOBS, TORCH_BIN, launcher_env, needs_torch, termination
from tests.e2e.test_multinode import needs_namespaces, node_env

node_pair = multinode.node_pair  # the same fixture: two network namespaces, cleaned up whatever happens

BOOT_FILE = str(JOBS / "torch_init_method.py")
# Variables of this machine that would change a TensorFlow plan.
_TF_VARIABLES = ("TF_PS_HOSTS", "TF_WORKER_HOSTS", "MA_RUNTIME_PEER_WAIT_SECONDS")

# A TensorFlow worker's server, as the ps sees it: a port that answers until `<dir>/stop` appears. It accepts
# every connection (the watcher's probes must not fill its backlog) and writes `<dir>/ready` once listening.
FAKE_WORKER = textwrap.dedent("""
    import os, socket, sys
    folder, port = sys.argv[1], int(sys.argv[2])
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(16)
    server.settimeout(0.1)
    open(os.path.join(folder, "ready"), "w").close()
    while not os.path.exists(os.path.join(folder, "stop")):
        try:
            server.accept()[0].close()
        except socket.timeout:
            pass
""")
# A parameter server: records its pid and arguments, then serves forever; a SIGTERM is noted, then obeyed.
FAKE_PS = textwrap.dedent("""
    import json, os, signal, sys, time
    folder = os.environ["PS_DIR"]
    def stopped(signum, frame):
        open(os.path.join(folder, "terminated"), "w").close()
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, stopped)
    with open(os.path.join(folder, "ps.json.tmp"), "w") as handle:
        json.dump({"pid": os.getpid(), "argv": sys.argv[1:]}, handle)
    os.replace(os.path.join(folder, "ps.json.tmp"), os.path.join(folder, "ps.json"))
    while True:
        time.sleep(1)
""")


# --------------------------------------------------------------------------- pytorch-gpu


@needs_namespaces
@needs_torch
def test_pytorch_gpu_on_two_nodes_all_reduces_with_the_platforms_arguments(job_env, tmp_path, node_pair):
    port = free_port()
    # 2 GPUs per node, and still one process per node: world_size is the node count.
    envs = [node_env(node_pair, job_env, tmp_path, node, TORCH_BIN, MA_RUN_METHOD="pytorch-gpu", MA_NUM_GPUS=2,
                     MA_RUNTIME_INIT_METHOD_PORT=port) for node in (0, 1)]

    for node in (0, 1):
        node_pair.start(node, envs[node], ["python", BOOT_FILE, "--own=1"])
    codes = node_pair.wait(timeout=300)

    report = node_pair.report()
    assert codes == [0, 0], report
    for node in (0, 1):
        stdout = node_pair.outputs[node].read_text(errors="replace")
        assert (f"attempt 1: init_method=tcp://{node_pair.hosts[0]}:{port} rank={node} world_size=2 unknown=['--own=1']"
                in stdout), report
        assert f"rank {node} of 2: all_reduce=3.0" in stdout, report
        assert "method=pytorch-gpu" in node_pair.outputs[node].with_suffix(".err").read_text(errors="replace")


@needs_torch
def test_a_failed_pytorch_gpu_attempt_restarts_with_the_same_flags(job_env):
    port = free_port()
    env = launcher_env(job_env, TORCH_BIN, MA_RUN_METHOD="pytorch-gpu", MA_RUNTIME_INIT_METHOD_PORT=port,
                       MA_RUNTIME_MAX_RESTARTS=1, MA_RUNTIME_RESTART_BACKOFF_SECONDS=0, FAIL_ATTEMPT=1)

    done = run_ma(["python", BOOT_FILE], env, timeout=180)

    assert done.returncode == 0, done.stderr[-3000:]
    given = f"init_method=tcp://127.0.0.1:{port} rank=0 world_size=1 unknown=[]"
    assert f"attempt 1: {given}" in done.stdout and f"attempt 2: {given}" in done.stdout, done.stdout
    assert "rank 0 of 1: all_reduce=1.0" in done.stdout
    starts = [line for line in done.stderr.splitlines() if 'msg="starting command"' in line]
    assert len(starts) == 2 and all(f"tcp://127.0.0.1:{port}" in line for line in starts), starts
    assert "restarting command" in done.stderr


# --------------------------------------------------------------------------- tensorflow-gpu: a fake ps/worker pair


class FakeWorkers:
    """Fake TensorFlow workers, each a process with its own folder; all killed by close()."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.folders: List[Path] = []
        self.processes: List[subprocess.Popen] = []
        self.ports: List[int] = []

    def start(self) -> int:
        folder = self.tmp_path / f"worker-{len(self.folders)}"
        folder.mkdir()
        port = free_port()
        self.processes.append(subprocess.Popen([sys.executable, "-c", FAKE_WORKER, str(folder), str(port)]))
        self.folders.append(folder)
        self.ports.append(port)
        wait_for_file(folder / "ready", timeout=30)
        return port

    def finish(self, index: int) -> None:
        (self.folders[index] / "stop").touch()
        self.processes[index].wait(timeout=30)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def fake_workers(request, tmp_path):
    workers = FakeWorkers(tmp_path)
    request.addfinalizer(workers.close)
    return workers


def ps_env(job_env, tmp_path, worker_ports, **extra):
    """A ps container (task 0 of 2) of a two-node TensorFlow job whose workers listen on 127.0.0.1."""
    ps_dir = tmp_path / "ps"
    ps_dir.mkdir()
    env = {name: value for name, value in job_env.items() if name not in _TF_VARIABLES}
    env.update(MA_RUN_METHOD="tensorflow-gpu", MA_NUM_HOSTS="2", MA_TASK_NAME="ps", VC_TASK_INDEX="0",
               TF_PS_HOSTS=f"[127.0.0.1:{free_port()},127.0.0.1:{free_port()}]",
               TF_WORKER_HOSTS="[" + ",".join(f"127.0.0.1:{port}" for port in worker_ports) + "]",
               # Gone after 3 failed probes: the window for a restarting worker is tested in tests/unit/test_peers.py.
               MA_RUNTIME_PREFLIGHT="0", PS_DIR=str(ps_dir), MA_RUNTIME_PEER_GONE_SECONDS="0")
    env.update({name: str(value) for name, value in extra.items()})
    return env


def start_ps(env, tmp_path):
    """`ma-run` as the ps; its fake command carries the ps folder as a marker (conftest.marked finds it)."""
    with open(tmp_path / "ma-run.err", "wb") as err:
        return subprocess.Popen([MA_RUN, sys.executable, "-c", FAKE_PS, f"--marker={env['PS_DIR']}"], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_the_ps_ends_with_success_once_every_worker_has_finished(job_env, tmp_path, fake_workers):
    ports = [fake_workers.start(), fake_workers.start()]
    env = ps_env(job_env, tmp_path, ports)
    ma_run = start_ps(env, tmp_path)
    try:
        ps = json.loads(wait_for_file(Path(env["PS_DIR"]) / "ps.json", timeout=60).read_text())
        # The platform's arguments reached the ps, the brackets dropped.
        assert ps["argv"] == [f"--marker={env['PS_DIR']}", "--task_index", "0", "--ps_hosts",
                              env["TF_PS_HOSTS"][1:-1], "--worker_hosts", f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}",
                              "--job_name", "ps"]

        fake_workers.finish(0)
        # Long enough for the watcher to count worker 0 gone; worker 1 still serves, so the ps must too.
        time.sleep((peers.GONE_AFTER + 3) * peers.PERIOD_S)
        assert ma_run.poll() is None and alive(ps["pid"]), (tmp_path / "ma-run.err").read_text()

        fake_workers.finish(1)
        code = ma_run.wait(timeout=60)
    finally:
        stop(ma_run)

    stderr = (tmp_path / "ma-run.err").read_text()
    assert code == 0, stderr[-3000:]
    assert "ma-runtime: every node watched has finished" in stderr
    assert (Path(env["PS_DIR"]) / "terminated").exists()  # asked to stop, not killed
    assert not alive(ps["pid"]) and marked(env["PS_DIR"]) == []
    assert not list(Path(env["MA_HOME"]).glob("modelarts/log/*-termination.json"))  # written on failures only


def test_a_worker_that_never_answers_ends_the_ps_with_81(job_env, tmp_path):
    silent = free_port()
    env = ps_env(job_env, tmp_path, [silent], MA_RUNTIME_PEER_WAIT_SECONDS=3)
    ma_run = start_ps(env, tmp_path)
    try:
        code = ma_run.wait(timeout=60)
    finally:
        stop(ma_run)

    stderr = (tmp_path / "ma-run.err").read_text()
    assert code == 81, stderr[-3000:]
    assert re.search(rf"ma-runtime: 127\.0\.0\.1:{silent} never answered within 3 s", stderr), stderr[-3000:]
    assert marked(env["PS_DIR"]) == []  # the ps command is not left running
    assert termination(env)["exit_code"] == 81
    assert "Traceback" not in stderr


def test_a_tensorflow_worker_without_the_host_lists_fails_with_78_in_one_line(job_env, tmp_path):
    env = {name: value for name, value in job_env.items() if name not in _TF_VARIABLES}
    env.update(MA_RUN_METHOD="tensorflow-gpu", MA_NUM_HOSTS="2", MA_RUNTIME_PREFLIGHT="0",
               TF_PS_HOSTS="[127.0.0.1:5000]")
    marker = tmp_path / "command-ran"

    done = run_ma(["sh", "-c", f"touch {marker}"], env)

    assert done.returncode == 78, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error,exiting" in line]
    assert len(errors) == 1 and "TF_WORKER_HOSTS is unset" in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and not marker.exists()
    assert termination(env)["exit_code"] == 78
