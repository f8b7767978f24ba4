"""MA_RUN_METHOD=ray with the real `ray` (CPU resources, one CPU per node, no dashboard) across two network
namespaces (ma_runtime/local/nodes.py, tests/e2e/test_multinode.py's NodePair): worker-0's runtime starts the head,
node 1's joins it, the driver (tests/e2e/jobs/ray_hosts.py) runs one task on each node. Kept to three runs: Ray's
start-up is slow on two cores.

Both nodes share this machine's file system and process table: each node's Ray gets a temp folder of its own
(MA_RUNTIME_EXTRA_RAY_PARAMS=--temp-dir=..., short: Ray's socket paths must fit 107 characters), and what is left
is looked for by namespace.
"""

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import alive, wait_for_file
from tests.e2e import test_multinode as multinode
from tests.e2e.test_launchers import JOBS, launcher_env
from tests.e2e.test_multinode import needs_namespaces, node_env

BIN = Path(sys.executable).parent  # the test venv's: python with ray, and its `ray`
DRIVER = ["python", str(JOBS / "ray_hosts.py")]


def _ray_missing() -> str:
    if sys.version_info < (3, 10):
        return "ray 2.60.0 has no wheel for Python 3.9"
    probe = subprocess.run([sys.executable, "-c", "import ray"], capture_output=True)
    return "" if probe.returncode == 0 and (BIN / "ray").exists() else "ray is not in the test venv"


needs_ray = pytest.mark.skipif(bool(_ray_missing()), reason=f"needs ray in the test venv (scripts/test.sh installs "
                                                            f"it): {_ray_missing()}")
node_pair = multinode.node_pair  # the fixture: two network namespaces, cleaned up whatever happens


@pytest.fixture
def temp_dirs():
    """A short temp folder per node for Ray's sessions, removed after the test."""
    made = [tempfile.mkdtemp(prefix=f"ray{node}-", dir="/tmp") for node in (0, 1)]
    yield made
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)


def ray_env(pair, job_env, tmp_path, node, temp_dir, **extra):
    settings = dict(MA_RUN_METHOD="ray", MA_RUNTIME_EXTRA_RAY_PARAMS=f"--num-cpus=1 --temp-dir={temp_dir}",
                    MA_RUNTIME_PEER_WAIT_SECONDS=120, MA_RUNTIME_PEER_GONE_SECONDS=2)
    return node_env(pair, job_env, tmp_path, node, BIN, **{**settings, **extra})


def ray_pids(pair):
    """The Ray processes (`ray start`, raylet, gcs_server, Ray's workers and agents and Python daemons) and the
    runtime's keepers in either namespace, as `pid comm: command line`."""
    found = []
    for pid in pair.nodes.pids():
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            line = b" ".join(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")).decode(errors="replace")
        except OSError:
            continue
        if alive(pid) and (comm.startswith("ray") or comm == "gcs_server" or "/site-packages/ray/" in line
                           or "ma_runtime.launch.ray_node" in line):
            found.append(f"{pid} {comm}: {line[:160]}")
    return found


@needs_namespaces
@needs_ray
def test_the_driver_runs_a_task_on_each_node_a_restart_reuses_the_cluster_and_node_1_exits_0(
        job_env, tmp_path, node_pair, temp_dirs):
    for node in (0, 1):  # attempt 1's driver exits 3; attempt 2 runs against the same cluster
        env = ray_env(node_pair, job_env, tmp_path, node, temp_dirs[node], RAY_FAIL_ATTEMPT=1,
                      MA_RUNTIME_MAX_RESTARTS=1)
        node_pair.start(node, env, DRIVER)

    codes = node_pair.wait(timeout=300)

    report = node_pair.report()
    assert codes == [0, 0], report
    out = (tmp_path / "node-0.out").read_text()
    clusters = [line.split(": ", 1)[1] for line in out.splitlines() if " cluster " in line]
    assert len(clusters) == 2 and clusters[0] == clusters[1], report  # the same head, session and all
    assert f"attempt 2: hosts {','.join(sorted(node_pair.hosts))}" in out, report
    err = [(tmp_path / f"node-{node}.err").read_text() for node in (0, 1)]
    assert "every node joined the Ray cluster" in err[0] and 'msg="Ray head started"' in err[0], report
    assert 'msg="joining the Ray head"' in err[1], report
    assert err[0].count('msg="Ray head started"') == 1 and err[1].count('msg="joining the Ray head"') == 1
    assert ray_pids(node_pair) == []


@needs_namespaces
@needs_ray
def test_sigterm_to_worker_0_leaves_no_ray_process_in_either_namespace(job_env, tmp_path, node_pair, temp_dirs):
    hold = tmp_path / "holding"
    for node in (0, 1):
        node_pair.start(node, ray_env(node_pair, job_env, tmp_path, node, temp_dirs[node], RAY_HOLD=hold), DRIVER)
    wait_for_file(hold, timeout=240)
    running = ray_pids(node_pair)
    comms = [entry.split(":")[0].split()[1] for entry in running]
    assert comms.count("raylet") == 2 and comms.count("gcs_server") == 1, "\n".join(running)

    node_pair.processes[0].send_signal(signal.SIGTERM)
    codes = node_pair.wait(timeout=120)

    report = node_pair.report()
    assert codes == [128 + signal.SIGTERM, 0], report
    assert ray_pids(node_pair) == [], report
    assert "Traceback" not in (tmp_path / "node-0.err").read_text()


@needs_ray
def test_a_node_that_never_joins_is_waited_for_then_81_names_it(job_env, tmp_path):
    from tests.conftest import free_port, run_ma
    from tests.e2e.test_launchers import termination

    # Worker-0 by this machine's address as Ray finds it (a loopback address Ray replaces with that one).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: the route chooses the source address
        address = probe.getsockname()[0]
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        env = launcher_env(job_env, BIN, MA_RUN_METHOD="ray", MA_NUM_HOSTS=2, MA_CURRENT_IP=address,
                           VC_WORKER_HOSTS=f"{address},no-such-node.invalid", MA_RUNTIME_PEER_WAIT_SECONDS=40,
                           MA_RUNTIME_COORDINATOR="off", MA_RUNTIME_RAY_PORT=free_port(),
                           MA_RUNTIME_EXTRA_RAY_PARAMS=f"--num-cpus=1 --temp-dir={temp_dir}")
        done = run_ma(DRIVER, env, timeout=180)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)

    assert done.returncode == 81, done.stderr[-3000:]
    assert "waiting for the Ray cluster's nodes: 1 of 2 joined" in done.stderr, done.stderr[-3000:]
    assert f"1 of 2 nodes joined the Ray cluster at {address}:" in done.stderr, done.stderr[-3000:]
    assert f"missing: no-such-node.invalid; joined: {address}" in done.stderr
    assert termination(env)["exit_code"] == 81
    assert not [line for line in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
                .splitlines() if temp_dir in line]  # nothing of its Ray left
