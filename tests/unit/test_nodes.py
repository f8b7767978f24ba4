"""ma_runtime/local/nodes.py: real network namespaces, nodes that reach each other by name, and a teardown that
leaves no namespace, hosts file, link or process behind, whatever ended the work (an error, an interrupt, a
failed creation)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ma_runtime.local import nodes as nodes_module
from ma_runtime.local.nodes import NamespaceError, Nodes
from tests.conftest import alive, free_port

MISSING = nodes_module.missing()
needs_namespaces = pytest.mark.skipif(bool(MISSING), reason=f"network namespaces need {', '.join(MISSING)}")

# Each node serves its host name on PORT and asks every other node for theirs, by domain name.
EXCHANGE = """\
import json, os, socket, sys, threading, time
port, hosts = int(sys.argv[1]), os.environ["VC_WORKER_HOSTS"].split(",")
me = int(os.environ["VC_TASK_INDEX"])
server = socket.create_server(("", port))
def serve():
    for _ in range(len(hosts) - 1):
        connection, _ = server.accept()
        with connection:
            connection.sendall(socket.gethostname().encode())
serving = threading.Thread(target=serve, daemon=True)
serving.start()
heard = {}
for index, host in enumerate(hosts):
    if index == me:
        continue
    deadline = time.monotonic() + 30
    while host not in heard:
        try:
            with socket.create_connection((host, port), timeout=5) as connection:
                heard[host] = connection.recv(256).decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
serving.join(30)
print(json.dumps({"hostname": socket.gethostname(), "address": socket.gethostbyname(socket.gethostname()),
                  "heard": heard, "env": dict(os.environ)}))
"""
PLATFORM_NAMES = ("MA_VJ_NAME", "MA_TASK_NAME", "MA_NUM_HOSTS", "VC_WORKER_NUM", "VC_TASK_INDEX", "VC_WORKER_HOSTS",
                  "MA_CURRENT_IP", "MA_CURRENT_INSTANCE_NAME")


def test_each_node_gets_the_platforms_names_and_variables():
    nodes = Nodes(3, job="ma-job-abc", task="worker")  # nothing is made before create()

    hosts = ["ma-job-abc-worker-0.ma-job-abc", "ma-job-abc-worker-1.ma-job-abc", "ma-job-abc-worker-2.ma-job-abc"]
    assert nodes.hosts == hosts
    assert nodes.environment(1) == {
        "MA_VJ_NAME": "ma-job-abc", "MA_TASK_NAME": "worker", "MA_NUM_HOSTS": "3", "VC_WORKER_NUM": "3",
        "VC_TASK_INDEX": "1", "VC_WORKER_HOSTS": ",".join(hosts), "MA_CURRENT_IP": nodes.addresses[1],
        "MA_CURRENT_INSTANCE_NAME": "ma-job-abc-worker-1",
    }
    assert len(set(nodes.addresses)) == 3 and len(set(nodes.namespaces)) == 3
    assert nodes.argv(2, ["python", "x.py"])[-3:] == [hosts[2], "python", "x.py"]


@pytest.mark.parametrize("count", [0, nodes_module.MAX_NODES + 1])
def test_a_count_the_subnet_cannot_hold_is_refused(count):
    with pytest.raises(ValueError, match="nodes: between 1 and"):
        Nodes(count)


def test_the_runtimes_start_path_does_not_import_the_nodes():
    code = ("import sys, ma_runtime.cli, ma_runtime.bootstrap; "
            "print([name for name in sys.modules if name.startswith('ma_runtime.local')])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.root
@needs_namespaces
def test_three_nodes_reach_each_other_by_name_under_their_own_host_names(tmp_path):
    port = free_port()  # any port: each node has its own
    with Nodes(3, job="ma-job-reach", prefix="ma-node-test") as nodes:
        outputs = [tmp_path / f"node-{index}.out" for index in range(3)]
        for index in range(3):
            nodes.start(index, [sys.executable, "-c", EXCHANGE, str(port)], stdout=outputs[index],
                        stderr=outputs[index].with_suffix(".err"))
        codes = nodes.wait(timeout=60)
        report = "\n".join(f"node {i}: {path.with_suffix('.err').read_text()}" for i, path in enumerate(outputs))
        assert codes == [0, 0, 0], report
        for index, path in enumerate(outputs):
            seen = json.loads(path.read_text())
            assert seen["hostname"] == nodes.hosts[index]
            assert seen["address"] == nodes.addresses[index]  # its own name resolves to its own address
            assert seen["heard"] == {host: host for i, host in enumerate(nodes.hosts) if i != index}
            platform = {name: seen["env"][name] for name in PLATFORM_NAMES}
            assert platform == nodes.environment(index)


@pytest.mark.root
@needs_namespaces
def test_close_kills_every_process_and_leaves_no_namespace_hosts_file_or_link(tmp_path):
    links_before = _host_links()
    nodes = Nodes(2, prefix="ma-node-test").create()
    made = [*nodes.namespaces, nodes.switch]
    assert set(made) <= set(_namespaces())
    # A command that ignores SIGTERM, and a daemon it left behind in its own session: both must go.
    pid_file = tmp_path / "daemon.pid"
    stubborn = nodes.start(0, ["sh", "-c", f"trap '' TERM; setsid sleep 300 & echo $! > {pid_file}; sleep 300"])
    nodes.start(1, ["sleep", "300"])
    daemon = _read_pid(pid_file)

    nodes.close(grace=0.5)

    assert stubborn.poll() is not None and not alive(daemon)
    assert not set(made) & set(_namespaces())
    assert not [path for path in made if (nodes_module.ETC_NETNS / path).exists()]
    assert _host_links() <= links_before  # no end of a veth, no bridge, ever in the host's namespace
    assert nodes.pids() == [] and nodes.started == []
    nodes.close()  # again: nothing to do, no error


@pytest.mark.root
@needs_namespaces
def test_an_interrupt_inside_the_block_still_removes_everything(tmp_path):
    with pytest.raises(KeyboardInterrupt), Nodes(2, prefix="ma-node-test") as nodes:
        made = [*nodes.namespaces, nodes.switch]
        running = nodes.start(1, ["sleep", "300"])
        raise KeyboardInterrupt

    assert running.poll() is not None
    assert not set(made) & set(_namespaces())
    assert not [path for path in made if (nodes_module.ETC_NETNS / path).exists()]


@pytest.mark.root
@needs_namespaces
def test_a_creation_that_fails_half_way_removes_what_it_made_and_says_what_failed():
    links_before = _host_links()
    nodes = Nodes(3, prefix="ma-node-test")
    nodes._ports[1] = "a-name-longer-than-ifnamsiz"  # `ip link add` refuses it: node 1's link fails

    with pytest.raises(NamespaceError, match=r"`ip -n \S+ link add a-name-longer-than-ifnamsiz .*` failed: "):
        nodes.create()

    made = [*nodes.namespaces, nodes.switch]
    assert not set(made) & set(_namespaces())
    assert not [path for path in made if (nodes_module.ETC_NETNS / path).exists()]
    assert _host_links() <= links_before


def _namespaces():
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


def _host_links():
    """The links of this machine's own namespace whose names this module could have given."""
    listed = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True)
    names = {line.split(":")[1].strip().split("@")[0] for line in listed.stdout.splitlines()}
    return {name for name in names if name.startswith(f"m{os.getpid():x}-") or name == nodes_module.BRIDGE}


def _read_pid(path: Path) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = path.read_text().strip() if path.exists() else ""
        if text.endswith("\n") or text.isdigit():
            return int(text)
        time.sleep(0.05)
    raise AssertionError(f"{path}: no pid written")
