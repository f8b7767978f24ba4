"""The nodes of one job on this machine: one network namespace each, seeing each other as a Volcano job's pods do.

What `Nodes(count).create()` makes, all of it inside namespaces (nothing is added to the machine's own network,
so every group of nodes can use the same subnet, and two groups never meet):
- a switch namespace holding a bridge;
- one namespace per node, whose `eth0` is a veth with the other end a port of that bridge, at 10.200.0.<index+1>;
- each node's `/etc/netns/<namespace>/hosts` naming every node (`ip netns exec` bind-mounts it over /etc/hosts);
- each command's own UTS namespace (`unshare --uts`), its host name the node's domain name: `ip netns exec`
  gives none, and gloo looks up its own host name, which must resolve to the node's address.

Names as the platform makes them (docs/platform.md, "Environment variables" and "Node addresses"): node i of
job J with task T is the instance
`J-T-i`, its domain name `J-T-i.J`. `environment(i)` holds the variables such a node gets (MA_VJ_NAME,
MA_TASK_NAME, MA_NUM_HOSTS, VC_WORKER_NUM, VC_TASK_INDEX, VC_WORKER_HOSTS, MA_CURRENT_IP,
MA_CURRENT_INSTANCE_NAME); `start(i, command)` runs a command as node i, with them unless given an environment.

Teardown (`close`, which the context manager calls whatever ends the block, KeyboardInterrupt and SystemExit
included): the commands started get SIGTERM and `grace` seconds; then every process still in a node's
namespace (daemons they left, an sshd say) is killed by its pid; then the namespaces are deleted (the veths and
the bridge go with them) and their /etc/netns folders removed. A SIGTERM to the caller skips all of that unless
the caller turns it into an exception (benchmarks/launchers.py does). `create` cleans up after itself when it fails.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), iproute2's `ip`, util-linux's `unshare` and `hostname`: `missing()`
says what is lacking. The standard library only: the local job runner ships it, the runtime never imports it.
"""

import contextlib
import dataclasses
import itertools
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Dict, Iterator, List, Optional, Sequence, Union

SUBNET = "10.200.0"  # inside the namespaces only: the host never routes it
PREFIX_LENGTH = 24
MAX_NODES = 253  # the subnet's host addresses, .1 to .253
SERVICE_ADDRESS = f"{SUBNET}.254"  # the switch's own address (`add_service_address`): a service every node reaches
INTERFACE = "eth0"  # each node's link to the others, named as in a pod
BRIDGE = "br0"
ETC_NETNS = Path("/etc/netns")
SWEEP_ROUNDS = 50  # rounds of killing what is left in the namespaces, 0.1 s apart
_groups = itertools.count()

Output = Union[None, int, IO, Path]  # where a command's stdout or stderr goes; a Path is a file written afresh


class NamespaceError(RuntimeError):
    """A namespace, veth or hosts file could not be made: the `ip` command and what it said."""


@dataclasses.dataclass(frozen=True)
class Node:
    index: int
    name: str  # the instance name, `<job>-<task>-<index>` (MA_CURRENT_INSTANCE_NAME)
    host: str  # its domain name, `<name>.<job>`: VC_WORKER_HOSTS's entry and the node's host name
    address: str
    namespace: str


def missing() -> List[str]:
    """What this machine lacks to make nodes (empty when nothing)."""
    lacking = [] if os.geteuid() == 0 else ["root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"]
    lacking += [f"`{tool}`" for tool in ("ip", "unshare", "hostname") if shutil.which(tool) is None]
    if not lacking:
        probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            lacking.append(f"network and UTS namespaces (`unshare --net --uts`: {probe.stderr.strip()})")
    return lacking


class Nodes:
    """`count` nodes of job `job`, each a network namespace; every process started in them is killed by pid."""

    def __init__(self, count: int, job: str = "ma-job-local", task: str = "worker", prefix: str = "ma-node"):
        if not 1 <= count <= MAX_NODES:
            raise ValueError(f"{count} nodes: between 1 and {MAX_NODES} fit the subnet")
        group, pid = next(_groups), os.getpid()
        base = f"{prefix}-{pid}-{group}"  # unique on the machine while this process lives
        self.job, self.task = job, task
        self.switch = f"{base}-switch"
        self.nodes = [Node(index, f"{job}-{task}-{index}", f"{job}-{task}-{index}.{job}", f"{SUBNET}.{index + 1}",
                           f"{base}-{index}") for index in range(count)]
        # The bridge's ports, in the switch namespace: at most 15 characters (IFNAMSIZ).
        self._ports = [f"m{pid:x}-{group % 256:x}-{index}" for index in range(count)]
        self._made: List[str] = []  # the namespaces added so far, for the teardown
        self.started: List[subprocess.Popen] = []

    @property
    def hosts(self) -> List[str]:
        return [node.host for node in self.nodes]

    @property
    def addresses(self) -> List[str]:
        return [node.address for node in self.nodes]

    @property
    def namespaces(self) -> List[str]:
        return [node.namespace for node in self.nodes]

    def __enter__(self) -> "Nodes":
        return self.create()

    def __exit__(self, *_exc_info) -> None:
        self.close()

    def create(self) -> "Nodes":
        """Makes the switch, the nodes and their hosts files; on any failure removes what it made, then raises
        NamespaceError (or what interrupted it)."""
        try:
            self._add_namespace(self.switch)
            _ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
            _ip("-n", self.switch, "link", "set", BRIDGE, "up")
            for node, port in zip(self.nodes, self._ports):
                self._add_node(node, port)
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, namespace: str) -> None:
        self._made.append(namespace)  # first: a half-made one is removed too
        _ip("netns", "add", namespace)

    def _add_node(self, node: Node, port: str) -> None:
        self._add_namespace(node.namespace)
        etc = ETC_NETNS / node.namespace
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(self._hosts_file())
        # Made in the switch namespace with its peer straight in the node's: no end ever sits in the host's.
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", INTERFACE, "netns", node.namespace)
        _ip("-n", self.switch, "link", "set", port, "master", BRIDGE, "up")
        _ip("-n", node.namespace, "addr", "add", f"{node.address}/{PREFIX_LENGTH}", "dev", INTERFACE)
        _ip("-n", node.namespace, "link", "set", INTERFACE, "up")
        _ip("-n", node.namespace, "link", "set", "lo", "up")

    def _hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost"] + [f"{node.address} {node.host} {node.name}" for node in self.nodes]
        return "".join(line + "\n" for line in lines)

    def add_service_address(self) -> str:
        """Gives the bridge SERVICE_ADDRESS, so that a process started with `start_on_switch` (an object store) is
        reached by every node there, still without touching the machine's own network."""
        _ip("-n", self.switch, "addr", "add", f"{SERVICE_ADDRESS}/{PREFIX_LENGTH}", "dev", BRIDGE)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        return SERVICE_ADDRESS

    def start_on_switch(self, command: Sequence[str], **popen) -> subprocess.Popen:
        """Starts `command` in the switch namespace (killed by `close` with the nodes' processes)."""
        process = subprocess.Popen(["ip", "netns", "exec", self.switch, *command], start_new_session=True, **popen)
        self.started.append(process)
        return process

    def environment(self, index: int) -> Dict[str, str]:
        """The platform's variables of node `index` (docs/platform.md, "Environment variables")."""
        node = self.nodes[index]
        count = str(len(self.nodes))
        return {"MA_VJ_NAME": self.job, "MA_TASK_NAME": self.task, "MA_NUM_HOSTS": count, "VC_WORKER_NUM": count,
                "VC_TASK_INDEX": str(index), "VC_WORKER_HOSTS": ",".join(self.hosts), "MA_CURRENT_IP": node.address,
                "MA_CURRENT_INSTANCE_NAME": node.name}

    def argv(self, index: int, command: Sequence[str]) -> List[str]:
        """`command` as node `index`: in its namespace, under its host name (a UTS namespace of its own)."""
        node = self.nodes[index]
        return ["ip", "netns", "exec", node.namespace, "unshare", "--uts",
                "sh", "-c", 'hostname "$0" && exec "$@"', node.host, *command]

    def start(self, index: int, command: Sequence[str], env: Optional[Dict[str, str]] = None,
              stdout: Output = None, stderr: Output = None) -> subprocess.Popen:
        """Starts `command` as node `index` (its own session: a terminal's Ctrl-C reaches the caller, which stops
        the nodes). `env`: the whole environment; by default this process's plus `environment(index)`."""
        if env is None:
            env = {**os.environ, **self.environment(index)}
        with _opened(stdout) as out, _opened(stderr) as err:
            process = subprocess.Popen(self.argv(index, command), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                       stderr=err, start_new_session=True)
        self.started.append(process)
        return process

    def wait(self, timeout: float, after_a_failure: float = 60.0) -> List[Optional[int]]:
        """Each started command's exit code, None for one still running at the deadline. A node that fails can
        leave the others waiting for it for minutes (gloo, msrun's cluster timeout): they get AFTER_A_FAILURE."""
        deadline = time.monotonic() + timeout
        while any(process.poll() is None for process in self.started) and time.monotonic() < deadline:
            if any(process.returncode not in (None, 0) for process in self.started):
                deadline = min(deadline, time.monotonic() + after_a_failure)
            time.sleep(0.2)
        return [process.poll() for process in self.started]

    def pids(self) -> List[int]:
        """The processes in the nodes' namespaces, by pid."""
        found: List[int] = []
        for namespace in self._made:
            listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
            found += [int(word) for word in listed.stdout.split() if word.isdigit()]
        return found

    def sweep(self) -> int:
        """Kills whatever still runs in the namespaces (SIGKILL, by pid) and reaps the commands started; returns
        the most processes found at once."""
        found = 0
        for _ in range(SWEEP_ROUNDS):
            pids = self.pids()
            if not pids:
                break
            found = max(found, len(pids))
            for pid in pids:
                _kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        for process in self.started:
            if process.poll() is None:
                _kill(process.pid, signal.SIGKILL)
            process.wait()
        self.started.clear()
        return found

    def close(self, grace: float = 20.0) -> None:
        """Stops everything and removes every namespace and hosts file made; safe to call again."""
        self._terminate(grace)
        self.sweep()
        for namespace in reversed(self._made):  # the nodes, then the switch
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
            shutil.rmtree(ETC_NETNS / namespace, ignore_errors=True)
        self._made.clear()

    def _terminate(self, grace: float) -> None:
        """SIGTERM to the commands still running (a runtime stops its own workers then), `grace` seconds for all."""
        running = [process for process in self.started if process.poll() is None]
        if grace <= 0 or not running:
            return
        for process in running:
            _kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise NamespaceError(f"`ip {' '.join(args)}` failed: {done.stderr.strip() or f'exit {done.returncode}'}")


def _kill(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


@contextlib.contextmanager
def _opened(output: Output) -> Iterator[Union[None, int, IO]]:
    """A Path opened for writing (closed once the child has its copy); anything else as it is."""
    if not isinstance(output, Path):
        yield output
        return
    with open(output, "wb") as handle:
        yield handle
