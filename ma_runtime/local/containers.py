"""`ma-runtime local --image IMAGE`: each node a podman container of IMAGE, as the platform runs the job's pods.

Each node's container (`podman run --rm`, named `ma-local-<runner pid>-<node>`):
- joins its node's network namespace (`--network ns:/run/netns/<namespace>`, local/nodes.py), so the nodes, the
  store on their switch and the coordinator's port are where they are without --image; its host name is the
  node's domain name and its /etc/hosts the node's hosts file (read-only), as Volcano's svc plugin gives a pod;
- starts through the image's own ENTRYPOINT with the command as its arguments: the runtime in the image is PID 1,
  the process podman signals and whose exit code podman returns;
- runs as uid 1000, gid 100 (ma-user, ma-group: the platform's), with a memory-backed /dev/shm of SHM_SIZE
  (podman's default 64 MB fails the runtime's preflight, as a pod without the platform's would);
- gets the variables by name only (`--env NAME`: podman takes the value from its own environment), so no value,
  the store's keys included, is ever on a command line; PATH alone by value, since podman itself needs this
  machine's;
- gets the run's folders bound in (`Mount`), at the platform's paths where the platform has one
  (/home/ma-user/modelarts, its log folder, /dev/termination-log) and under MOUNT_ROOT for the box's own.

Only podman: docker cannot join a network namespace by its path (`--network container:` and `host` are all it
has), and the nodes' namespaces are what makes the job's names, the store and the faults the same with or
without --image. `missing(image)` says in one line what this machine lacks.
"""

import dataclasses
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ma_runtime.local.nodes import Nodes

ENGINE = "podman"
UID, GID = 1000, 100  # ma-user and ma-group: the platform runs every training container as them
SHM_SIZE = "2g"
MOUNT_ROOT = "/opt/ma-local"  # the box's own folders inside a container (faults, fake tools, devices)
PLATFORM_MOUNT = "/home/ma-user/modelarts"  # MA_MOUNT_PATH's default: the platform's mount, the job's home
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # an image that sets none
INSPECT_SECONDS = 60.0
REMOVE_SECONDS = 5  # `podman rm -t`: what a container still running at the end gets before SIGKILL


@dataclasses.dataclass(frozen=True)
class Mount:
    source: Path
    target: str
    read_only: bool = False

    def option(self) -> str:
        return f"{self.source}:{self.target}{':ro' if self.read_only else ''}"


def missing(image: str) -> str:
    """'' when this machine can run IMAGE's containers, else the one line saying what is lacking."""
    if shutil.which(ENGINE) is None:
        engine = " (docker cannot join the nodes' network namespaces)" if shutil.which("docker") else ""
        return f"--image needs podman{engine}: install it (apt install podman), or run without --image"
    exists = subprocess.run([ENGINE, "image", "exists", image], capture_output=True, text=True)
    if exists.returncode != 0:
        return (f"--image {image}: no such image here: build it (docker/build.sh cpu) or pull it "
                f"(podman pull {image})")
    return ""


def image_path(image: str) -> str:
    """The PATH the image sets (its ENV), where the box puts its fake tools first."""
    listed = subprocess.run([ENGINE, "image", "inspect", "--format", "{{range .Config.Env}}{{println .}}{{end}}",
                             image], capture_output=True, text=True)
    for line in listed.stdout.splitlines():
        if line.startswith("PATH="):
            return line[len("PATH="):]
    return DEFAULT_PATH


def give_to_job_user(*paths: Path) -> None:
    """The folders and files the job's uid writes into through a mount."""
    for path in paths:
        os.chown(path, UID, GID)


def give_back(folder: Path) -> None:
    """Everything under `folder` the containers wrote, owned again by whoever runs the box."""
    uid, gid = os.getuid(), os.getgid()
    for path in [folder, *folder.rglob("*")]:
        try:
            os.chown(path, uid, gid, follow_symlinks=False)
        except OSError:
            pass  # gone meanwhile: nothing to give back


class Containers:
    """The nodes' containers of one run: started, signalled, found by pid, removed."""

    def __init__(self, image: str, nodes: Nodes):
        self.image, self.nodes = image, nodes
        self.names = [f"ma-local-{os.getpid()}-{node.index}" for node in nodes.nodes]
        self.clients: List[subprocess.Popen] = []
        self._pids: Dict[int, int] = {}

    def argv(self, index: int, env: Dict[str, str], mounts: Sequence[Mount], command: Sequence[str]) -> List[str]:
        node = self.nodes.nodes[index]
        hosts = Mount(Path("/etc/netns") / node.namespace / "hosts", "/etc/hosts", read_only=True)
        argv = [ENGINE, "run", "--rm", "--name", self.names[index], "--pull", "never",
                "--network", f"ns:/run/netns/{node.namespace}", "--hostname", node.host,
                "--user", f"{UID}:{GID}", "--shm-size", SHM_SIZE]
        for mount in (hosts, *mounts):
            argv += ["--volume", mount.option()]
        for name in sorted(env):
            argv += ["--env", f"PATH={env[name]}" if name == "PATH" else name]
        return [*argv, self.image, *command]

    def start(self, index: int, env: Dict[str, str], mounts: Sequence[Mount], command: Sequence[str],
              **popen) -> subprocess.Popen:
        """Node `index`'s container; `env` is all it gets, each variable passed by name (see the docstring)."""
        client_env = {**env, "PATH": os.environ.get("PATH", os.defpath)}  # podman's own, its helpers found by it
        # A session of its own: a terminal's Ctrl-C reaches the runner, which stops the nodes, not podman's proxy.
        client = subprocess.Popen(self.argv(index, env, mounts, command), env=client_env,
                                  stdin=subprocess.DEVNULL, start_new_session=True, **popen)
        self.clients.append(client)
        return client

    def runtime_pid(self, index: int) -> Optional[int]:
        """The host's pid of node `index`'s PID 1 (the runtime), None while the container is not running."""
        if index not in self._pids:
            found = subprocess.run([ENGINE, "inspect", "--format", "{{.State.Pid}}", self.names[index]],
                                   capture_output=True, text=True, timeout=INSPECT_SECONDS)
            pid = found.stdout.strip()
            if found.returncode != 0 or not pid.isdigit() or pid == "0":
                return None
            self._pids[index] = int(pid)
        return self._pids[index]

    def signal(self, index: int, signum: int) -> None:
        """`signum` to node `index`'s PID 1, as the platform stops a pod (podman kill); to the client while the
        container is not there yet, whose signal proxy passes it on or which then never starts it."""
        sent = subprocess.run([ENGINE, "kill", "--signal", str(int(signum)), self.names[index]],
                              capture_output=True, text=True, timeout=INSPECT_SECONDS)
        if sent.returncode != 0 and self.clients[index].poll() is None:
            try:
                os.kill(self.clients[index].pid, signum)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Every container of the run removed (stopped first when still running), every client reaped."""
        if self.names:
            subprocess.run([ENGINE, "rm", "--force", "--ignore", "--time", str(REMOVE_SECONDS), *self.names],
                           capture_output=True, text=True, timeout=INSPECT_SECONDS + REMOVE_SECONDS)
        deadline = time.monotonic() + REMOVE_SECONDS
        for client in self.clients:
            try:
                client.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                client.send_signal(signal.SIGKILL)
                client.wait()
