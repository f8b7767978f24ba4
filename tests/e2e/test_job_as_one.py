"""The job as one (issue 26): nodes that meet before each attempt, restart together, and name the node that failed
first. Three real `ma-run`s, each a node in its own network namespace (ma_runtime/local/nodes.py); worker-0's
runtime hosts the coordination store, the others reach it by its DNS name as on the platform.

No timed assertion: the bounds below only keep a broken run from hanging the suite; what is asserted is order
(which node's command ran when, read from the files the commands write) and the exit codes and messages.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from ma_runtime.local import nodes as local_nodes
from ma_runtime.local.nodes import NamespaceError, Nodes
from tests.conftest import MA_RUN

JOB = f"ma-job-one{os.getpid()}"
_MISSING = local_nodes.missing()
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)} for network and UTS "
                                                       "namespaces (ma_runtime/local/nodes.py)")
GUARD = 120.0  # seconds: only against a hang

# Each node's command: writes `<dir>/<node>.<attempt>` with the time it started and what it saw, then does what
# FAIL says for its node and attempt ("3": exit 3 once every node's command of the attempt has started, so that
# each is there to be stopped; "sleep": sleep until stopped, writing when SIGTERM came).
COMMAND = r"""
import os, signal, sys, time
node, attempt = os.environ["VC_TASK_INDEX"], os.environ["MA_PROC_START_CNT"]
out = os.path.join(os.environ["OUT"], f"{node}.{attempt}")
def stopped(signum, _frame):
    with open(out, "a") as f:
        f.write(f"sigterm {time.time()}\n")
    sys.exit(143)
signal.signal(signal.SIGTERM, stopped)  # before `started`: a command said started can say when it was stopped
with open(out, "w") as f:
    f.write(f"started {time.time()}\n")
what = dict(item.split("=") for item in os.environ.get("FAIL", "").split(",") if item).get(f"{node}.{attempt}")
if what and what.isdigit():
    # Under load a node's command can start a second after another's: the failure waits for all (bounded).
    others = [os.path.join(os.environ["OUT"], f"{other}.{attempt}") for other in range(int(os.environ["MA_NUM_HOSTS"]))]
    deadline = time.time() + 30
    while not all(os.path.exists(path) for path in others) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    with open(out, "a") as f:
        f.write(f"failing {time.time()}\n")
    sys.exit(int(what))
time.sleep(float(os.environ.get("WORK", "3")) if attempt == "1" else 1)  # attempt 1 long enough to be stopped
print("done", node, attempt, flush=True)
"""


class Job:
    """N nodes each running `ma-run python -c COMMAND`, their output and termination messages in files."""

    def __init__(self, tmp_path: Path, count: int):
        self.tmp_path = tmp_path
        self.nodes = Nodes(count, job=JOB, prefix="ma-one")
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.processes: List[Optional[subprocess.Popen]] = [None] * count

    def env(self, job_env: Dict[str, str], node: int, **extra) -> Dict[str, str]:
        home = self.tmp_path / f"home-{node}"
        return {**job_env, **self.nodes.environment(node), "MA_HOME": str(home),
                "MA_RUNTIME_TERMINATION_LOG": str(home / "termination-log"), "OUT": str(self.out),
                "MA_RUNTIME_STOP_GRACE_SECONDS": "5", "MA_RUNTIME_PREFLIGHT": "off",
                "MA_RUNTIME_NODE_LOST_SECONDS": "5", "MA_RUNTIME_BARRIER_SECONDS": "60",
                **{name: str(value) for name, value in extra.items()}}

    def start(self, node: int, env: Dict[str, str], command=None) -> subprocess.Popen:
        out = self.tmp_path / f"node-{node}.out"
        command = command or [sys.executable, "-c", COMMAND]
        process = self.nodes.start(node, [MA_RUN, *command], env, stdout=out, stderr=out.with_suffix(".err"))
        self.processes[node] = process
        return process

    def wait(self, timeout: float = GUARD) -> List[Optional[int]]:
        deadline = time.monotonic() + timeout
        while any(p is not None and p.poll() is None for p in self.processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [p.poll() if p is not None else None for p in self.processes]

    def termination(self, node: int) -> dict:
        """Node NODE's termination message (the copy in its log directory)."""
        found = sorted((self.tmp_path / f"home-{node}" / "modelarts" / "log").glob("*-termination.json"))
        return json.loads(found[0].read_text()) if found else {}

    def ran(self, node: int, attempt: int) -> Dict[str, float]:
        """What node NODE's command of attempt ATTEMPT wrote: {started, failing, sigterm: time}."""
        path = self.out / f"{node}.{attempt}"
        if not path.exists():
            return {}
        return {word: float(value) for word, value in (line.split() for line in path.read_text().splitlines())}

    def stderr(self, node: int) -> str:
        return (self.tmp_path / f"node-{node}.err").read_text(errors="replace")

    def report(self) -> str:
        parts = []
        for node, process in enumerate(self.processes):
            if process is None:
                continue
            err = (self.tmp_path / f"node-{node}.err").read_text(errors="replace")[-3000:]
            parts.append(f"--- node {node}: rc={process.poll()}\n{err}")
        parts.append("--- out: " + ", ".join(sorted(os.listdir(self.out))))
        return "\n".join(parts)


@pytest.fixture
def job3(request, tmp_path):
    job = Job(tmp_path, 3)
    try:
        job.nodes.create()
    except NamespaceError as exc:
        pytest.fail(f"could not set up the namespaces: {exc}")
    request.addfinalizer(job.nodes.close)
    return job


def test_a_failure_on_one_node_restarts_every_node_with_the_same_attempt(job_env, job3):
    for node in range(3):
        job3.start(node, job3.env(job_env, node, FAIL="1.1=3", WORK=30, MA_RUNTIME_MAX_RESTARTS=2))
    codes = job3.wait()
    assert codes == [0, 0, 0], job3.report()
    failed_at = job3.ran(1, 1)["failing"]
    for node in range(3):
        assert job3.ran(node, 2), f"node {node} did not run attempt 2\n{job3.report()}"
        assert not job3.ran(node, 3)
    for node in (0, 2):  # stopped by the job, soon after node 1's failure (the bound is only against a hang)
        first = job3.ran(node, 1)
        assert "sigterm" in first, job3.report()
        assert first["sigterm"] - failed_at < 30, job3.report()
        # No node starts attempt 2 before every node's attempt 1 ended: the barrier.
    ends = [job3.ran(node, 1).get("sigterm") or job3.ran(node, 1).get("failing") for node in range(3)]
    assert min(job3.ran(node, 2)["started"] for node in range(3)) > max(ends), job3.report()
    assert all("every node joined" in job3.stderr(node) for node in range(3))


def test_restarts_off_the_failing_node_keeps_its_code_and_the_others_exit_86_naming_it(job_env, job3):
    for node in range(3):  # on a port of the job's choosing
        job3.start(node, job3.env(job_env, node, FAIL="1.1=3", WORK=60, MA_RUNTIME_COORDINATOR_PORT=29811))
    codes = job3.wait()
    assert codes == [86, 3, 86], job3.report()
    assert 'msg="coordination store started" Component=ma-runtime port=29811' in job3.stderr(0)
    origins = [job3.termination(node).get("origin") for node in range(3)]
    assert origins[0] == origins[1] == origins[2], origins
    origin = origins[0]
    assert (origin["task_index"], origin["exit_code"], origin["attempt"], origin["kind"]) == (1, 3, 1, "failed")
    assert origin["host"] == job3.nodes.hosts[1]
    for node in (0, 2):
        message = job3.termination(node)
        assert message["exit_code"] == 86 and message["category"] == "platform"
        assert message["reason"].startswith(f"{job3.nodes.hosts[1]} (task 1)"), message["reason"]
        assert "failed first: the command exited with code 3" in message["reason"]
        assert "another node failed first" in job3.stderr(node)
    assert job3.termination(1)["exit_code"] == 3


def test_a_node_that_starts_late_holds_every_node_at_the_barrier(job_env, job3):
    for node in (0, 1):
        job3.start(node, job3.env(job_env, node, WORK=1))
    time.sleep(5)
    assert not os.listdir(job3.out), "a command started before every node joined"
    job3.start(2, job3.env(job_env, 2, WORK=1))
    assert job3.wait() == [0, 0, 0], job3.report()
    assert all(job3.ran(node, 1) for node in range(3))


def test_a_node_that_never_joins_ends_the_others_with_81_naming_it(job_env, job3):
    for node in (0, 1):
        job3.start(node, job3.env(job_env, node, WORK=1, MA_RUNTIME_BARRIER_SECONDS=6))
    codes = job3.wait()
    assert codes[:2] == [81, 81], job3.report()
    assert not os.listdir(job3.out)
    assert job3.termination(0)["reason"] == job3.termination(1)["reason"]  # one end of the barrier for every node
    for node in (0, 1):
        message = job3.termination(node)
        assert message["stage"] == "barrier"
        assert f"{job3.nodes.hosts[2]} (task 2): never joined" in message["reason"], message["reason"]
        assert "MA_RUNTIME_BARRIER_SECONDS=6" in message["reason"]


def test_a_node_whose_runtime_is_killed_is_lost_and_the_others_exit_86_naming_it(job_env, job3):
    for node in range(3):
        job3.start(node, job3.env(job_env, node, WORK=120))
    _wait_running(job3, range(3))
    runtime_2 = _runtime_pid(job3.processes[2].pid)
    os.kill(runtime_2, signal.SIGKILL)
    codes = job3.wait()
    assert codes[0] == codes[1] == 86, job3.report()
    for node in (0, 1):
        message = job3.termination(node)
        assert message["origin"]["task_index"] == 2 and message["origin"]["kind"] == "lost", message
        assert f"{job3.nodes.hosts[2]} (task 2) was lost" in message["reason"]


def test_worker_0s_runtime_killed_ends_the_others_with_86_coordinator_lost(job_env, job3):
    for node in range(3):
        job3.start(node, job3.env(job_env, node, WORK=120))
    _wait_running(job3, range(3))
    os.kill(_runtime_pid(job3.processes[0].pid), signal.SIGKILL)
    codes = job3.wait()
    assert codes[1] == codes[2] == 86, job3.report()
    for node in (1, 2):
        assert f"coordinator on {job3.nodes.hosts[0]} lost" in job3.termination(node)["reason"]


def test_a_stop_is_not_a_failure_every_node_exits_143_without_origin(job_env, job3):
    for node in range(3):
        job3.start(node, job3.env(job_env, node, WORK=120, MA_RUNTIME_MAX_RESTARTS=2))
    _wait_running(job3, range(3))
    for node in range(3):
        os.kill(_runtime_pid(job3.processes[node].pid), signal.SIGTERM)
    assert job3.wait() == [143, 143, 143], job3.report()
    assert not any(job3.ran(node, 2) for node in range(3))
    assert not any("origin" in job3.termination(node) for node in range(3))


def _runtime_pid(launcher_pid: int) -> int:
    """The `ma-run` process under `ip netns exec ... unshare ... sh -c 'hostname; exec ma-run'`: the launcher's
    descendant whose command line names ma-run."""
    import psutil

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher_pid).children(recursive=True) + [psutil.Process(launcher_pid)]:
            try:
                if any("ma-run" in part for part in child.cmdline()[:2]):
                    return child.pid
            except psutil.Error:
                continue
        time.sleep(0.1)
    raise AssertionError("no ma-run process found")


def _wait_running(job: Job, nodes, attempt: int = 1) -> None:
    deadline = time.monotonic() + GUARD
    while not all(job.ran(node, attempt) for node in nodes):
        assert time.monotonic() < deadline, job.report()
        time.sleep(0.1)


# Nodes 0 and 2 print a progress line every 0.3 s; node 1 prints one and then blocks, idle, in a read.
PROGRESSING = r"""
import os, sys, time
node, attempt = os.environ["VC_TASK_INDEX"], os.environ["MA_PROC_START_CNT"]
with open(os.path.join(os.environ["OUT"], f"{node}.{attempt}"), "w") as f:
    f.write(f"started {time.time()}\n")
print("step 0", flush=True)
if node == "1":
    os.read(os.pipe()[0], 1)  # blocks: no IO, no CPU, no progress
for step in range(1, 1000):
    time.sleep(0.3)
    print(f"step {step}", flush=True)
"""


def test_a_hang_on_one_node_stops_every_node_with_stacks_everywhere_83_there_86_elsewhere(job_env, job3):
    hang = dict(MA_RUNTIME_HANG_DETECT="on", MA_RUNTIME_HANG_DETECT_SECONDS=5, MA_RUNTIME_HANG_STARTUP_SECONDS=5,
                MA_RUNTIME_PROGRESS_PATTERN=r"^step \d+$", MA_RUNTIME_HANG_RESTARTS=0)
    for node in range(3):
        job3.start(node, job3.env(job_env, node, **hang), [sys.executable, "-c", PROGRESSING])
    codes = job3.wait()
    assert codes == [86, 83, 86], job3.report()
    for node in range(3):
        stem = f"modelarts-job-{JOB[len('ma-job-'):]}-worker-{node}"
        stacks = job3.tmp_path / f"home-{node}" / "modelarts" / "log" / f"{stem}-stacks" / "attempt-1"
        assert stacks.is_dir() and any(stacks.iterdir()), f"no stacks on node {node}\n{job3.report()}"
        origin = job3.termination(node)["origin"]
        assert (origin["task_index"], origin["kind"], origin["exit_code"]) == (1, "hung", 83), origin
    assert "hung first: job suspected hung" in job3.termination(0)["reason"]


def test_a_lost_node_with_restarts_left_is_waited_for_and_its_replacement_joins_the_same_attempt(job_env, job3):
    for node in range(3):
        job3.start(node, job3.env(job_env, node, WORK=120, MA_RUNTIME_MAX_RESTARTS=1))
    _wait_running(job3, range(3))
    os.kill(_runtime_pid(job3.processes[2].pid), signal.SIGKILL)
    job3.processes[2].wait(30)
    # The survivors stop their workers, then wait at the barrier of attempt 2 for a replacement.
    deadline = time.monotonic() + GUARD
    while not all("sigterm" in job3.ran(node, 1) for node in (0, 1)):
        assert time.monotonic() < deadline, job3.report()
        time.sleep(0.1)
    assert not job3.ran(0, 2) and not job3.ran(1, 2)
    # The rescheduled pod: a new runtime, its own count from the platform (1), a fresh home.
    job3.start(2, job3.env(job_env, 2, WORK=120, MA_RUNTIME_MAX_RESTARTS=1, MA_SCHEDULE_CNT=2,
                           MA_HOME=job3.tmp_path / "home-2b"))
    assert job3.wait() == [0, 0, 0], job3.report()
    assert all(job3.ran(node, 2) for node in range(3)), job3.report()


def test_a_node_whose_link_is_cut_is_lost(job_env, job3):
    for node in range(3):
        job3.start(node, job3.env(job_env, node, WORK=120))
    _wait_running(job3, range(3))
    node = job3.nodes.nodes[1]
    subprocess.run(["ip", "netns", "exec", node.namespace, "ip", "link", "set", "eth0", "down"], check=True)
    codes = job3.wait()
    assert codes[0] == codes[2] == 86, job3.report()
    for index in (0, 2):
        assert job3.termination(index)["origin"]["task_index"] == 1, job3.report()
    assert codes[1] == 86 and "coordinator on" in job3.termination(1)["reason"], job3.report()


def test_an_etcd_holds_the_job_when_the_coordinator_is_an_etcd_url(job_env, job3, tmp_path):
    etcd = "/usr/bin/etcd"
    if not os.access(etcd, os.X_OK):
        pytest.skip("etcd is not installed (scripts/test.sh installs Debian's etcd-server)")
    address = job3.nodes.addresses[0]
    job3.nodes.start(0, [etcd, "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls", f"http://{address}:2379",
                         "--advertise-client-urls", f"http://{address}:2379",
                         "--listen-peer-urls", f"http://{address}:2380"],
                     stdout=tmp_path / "etcd.out", stderr=subprocess.STDOUT)
    url = f"etcd://{address}:2379"
    for node in range(3):
        job3.start(node, job3.env(job_env, node, FAIL="1.1=3", WORK=60, MA_RUNTIME_COORDINATOR=url))
    codes = job3.wait()
    assert codes == [86, 3, 86], job3.report()
    assert job3.termination(0)["origin"] == job3.termination(2)["origin"] == job3.termination(1)["origin"]
    assert "coordination store started" not in job3.stderr(0)  # worker-0 hosts nothing


def test_a_stop_while_waiting_at_the_barrier_ends_the_node_at_once_with_143(job_env, job3):
    job3.start(1, job3.env(job_env, 1, MA_RUNTIME_BARRIER_SECONDS=600))  # worker-0 never starts: no store
    deadline = time.monotonic() + GUARD
    while "preflight skipped" not in job3.stderr(1):
        assert time.monotonic() < deadline, job3.report()
        time.sleep(0.1)
    os.kill(_runtime_pid(job3.processes[1].pid), signal.SIGTERM)
    assert job3.wait(30)[1] == 143, job3.report()  # not the 600 s of the barrier
