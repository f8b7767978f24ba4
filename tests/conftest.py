"""The platform in a box, the parts this suite needs so far.

- `job_env`: a job environment (MA_HOME and friends) under a temporary directory;
- `ma_run`: the installed `ma-run` console script, run as a real process;
- helpers to find a PID namespace's init and to wait for marker files.
"""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ma_runtime import termination
from ma_runtime.process.worker import LINEAGE_ENV
from ma_runtime.spec.jobfile import CONFIG_ENV
from ma_runtime.spec.table import VARIABLES
from ma_runtime.stages.ranktable.node import POD_IP_VARIABLE, POD_NAME_VARIABLES

pytest_plugins = ["tests.storage_env", "tests.suite_plugin"]  # suite_plugin: timing, skips, strict

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MA_RUN = str(BIN / "ma-run")
MA_RUNTIME = str(BIN / "ma-runtime")
ACTOR = str(ROOT / "tests" / "e2e" / "actor.py")

# Variables of the machine running the tests that would leak into a job's view: every setting's (the table's),
# and the few the runtime reads that are not settings.
_JOB_VARIABLES = (*VARIABLES, CONFIG_ENV, termination.PATH_ENV, LINEAGE_ENV,
                  *POD_NAME_VARIABLES[:1], POD_IP_VARIABLE)  # not HOSTNAME: the machine's own


@pytest.fixture
def job_env(tmp_path):
    """A clean job environment whose MA_HOME is a temporary directory."""
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES}
    env["MA_HOME"] = str(tmp_path / "home")
    env["MA_RUNTIME_TERMINATION_LOG"] = str(tmp_path / "termination-log-absent")
    # Tests that set MA_NUM_GPUS for other reasons must not fail the GPU check on
    # this accelerator-less machine; the accelerator checks have their own tests.
    env["MA_RUNTIME_PREFLIGHT_ACCELERATOR"] = "none"
    return env


def log_dir(env) -> Path:
    return Path(env["MA_HOME"]) / "modelarts" / "log"


def task_log(env, stem="modelarts-job-local-worker-0") -> Path:
    return log_dir(env) / f"{stem}.log"


def run_ma(args, env, timeout=60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([MA_RUN, *args], env=env, capture_output=True, text=True, timeout=timeout, **kwargs)


def wait_for_file(path: Path, timeout: float = 15.0) -> Path:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)
    return path


def child_pids(pid: int):
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        if int(data[data.rfind(b")") + 2 :].split()[1]) == pid:
            found.append(int(entry))
    return found


def namespace_init(unshare_pid: int, timeout: float = 10.0) -> int:
    """Host pid of the process that `unshare --fork` made PID 1 of the new namespace."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = child_pids(unshare_pid)
        if children:
            return children[0]
        time.sleep(0.01)
    raise AssertionError("unshare did not start its child")


def free_port() -> int:
    """A TCP port nothing listens on right now (for a launcher's master port)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def marked(marker: str):
    """Living processes (ours excepted) whose command line contains `marker`: what a test started, by the
    unique text it gave them."""
    found = []
    wanted = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if wanted in cmdline and alive(int(entry)):
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 :].split()[0] != b"Z"


def can_unshare_pid() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return probe.returncode == 0


needs_pid_namespace = pytest.mark.skipif(
    not can_unshare_pid(), reason="needs root (CAP_SYS_ADMIN) for unshare --pid --mount-proc"
)


@pytest.fixture
def tmpfs(tmp_path):
    """Mounts small real tmpfs filesystems: tmpfs('name', '16m') -> path (a full disk on demand)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount tmpfs")
    mounted = []

    def mount(name, size):
        path = tmp_path / name
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount tmpfs: {done.stderr.decode().strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)
