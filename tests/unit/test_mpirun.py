"""mpirun's plans field by field, its `-x` list, its root causes and stop forwarding against the real Open MPI,
and the sshd service (sshd.py) with the real sshd and ssh."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from ma_runtime import spec
from ma_runtime.errors import ConfigError, ExitCode, LaunchTimedOut
from ma_runtime.launch import mpirun, plan, sshd, sshd_files, sshd_key
from ma_runtime.launch.base import RootCause
from ma_runtime.process import children
from ma_runtime.process.table import processes
from ma_runtime.util.output import Sink
from tests.conftest import alive, free_port, wait_for_file
from tests.recording import Log
from tests.unit.test_plan import job_variables

VJ = "ma-job-0f8e2c1a"
HOSTS = [f"{VJ}-worker-{index}.{VJ}" for index in range(3)]
IPS = ["192.0.2.10", "192.0.2.11", "192.0.2.12"]
PATH = "/usr/local/bin:/usr/bin:/bin"
PRESETS = ["-x", "NCCL_SOCKET_IFNAME=eth0,bond0", "-x", "NCCL_SOCKET_FAMILY=AF_INET", "-x", "NCCL_DEBUG=INFO",
           "-x", "HOROVOD_MPI_THREADS_DISABLE=1"]
SECRET = "s3cr3t-value-9f2c"
_SBIN_PATH = f"{os.environ.get('PATH', os.defpath)}{os.pathsep}/usr/sbin"


def _which(name):
    return shutil.which(name, path=_SBIN_PATH)


needs_mpirun = pytest.mark.skipif(
    not _which("mpirun") or subprocess.run([sys.executable, "-c", "import mpi4py.MPI"]).returncode != 0,
    reason="needs Open MPI's mpirun (apt-get install openmpi-bin) and mpi4py in the test venv")
needs_sshd = pytest.mark.skipif(not (_which("sshd") and _which("ssh") and _which("ssh-keygen")),
                                reason="needs OpenSSH's sshd, ssh and ssh-keygen (openssh-server, openssh-client)")


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def job(tmp_path):
    """job(**variables) -> (JobSpec, environ) of an mpirun job under tmp_path: the platform's variables only."""

    def make(**variables):
        environ = {"MA_HOME": str(tmp_path / "home"), "PATH": PATH, "MA_RUN_METHOD": "mpirun"}
        environ.update({name: str(value) for name, value in variables.items()})
        return spec.load({}, environ), environ

    return make


def nodes(job, **variables):
    base = {"MA_NUM_HOSTS": 2, "VC_TASK_INDEX": 0, "MA_VJ_NAME": VJ, "VC_WORKER_HOSTS": ",".join(HOSTS[:2])}
    base.update(variables)
    return job(**{name: value for name, value in base.items() if value is not None})


class Reach:
    """The run's wait for the nodes: records what it was asked, answers the IPs."""

    def __init__(self):
        self.asked = []

    def __call__(self, endpoints):
        self.asked.append(list(endpoints))
        return IPS[:len(endpoints)]


def build(job_spec, environ, argv=("python", "train.py"), reach=None, exported=(), installed=("mpirun",)):
    def which(name, path=None):
        return f"/opt/bin/{name}" if name in installed else None

    context = plan.Context(list(argv), environ, which=which, reach=reach or Reach(), exported=tuple(exported))
    return plan.build(job_spec, context)


def state(job_spec):
    return job_spec.state_dir / f"mpi-{job_spec.task_name}-{job_spec.task_index}"


def x_names(argv):
    return [argv[index + 1] for index, word in enumerate(argv) if word == "-x"]


# --------------------------------------------------------------------------- one node


def test_one_node_runs_mpirun_with_a_local_hostfile_and_no_ssh(job):
    job_spec, environ = job(MY_MPI_SLOTS=4)

    result = build(job_spec, environ, ["python", "train.py", "--lr=0.1"])

    (worker,) = result.workers
    hostfile = str(state(job_spec) / "hostfile")
    assert (result.method, result.nodes, result.processes_per_node) == ("mpirun", 1, 4)
    assert worker.name == "mpirun"
    assert worker.argv == ("/opt/bin/mpirun", "-np", "4", "-hostfile", hostfile, "-bind-to", "none", "-map-by",
                           "slot", "-mca", "pml", "ob1", "-mca", "btl", "^openib", *PRESETS,
                           "-x", "MA_HOME", "-x", "MA_PROC_START_CNT", "-x", "MA_RUN_METHOD", "-x", "MA_SCHEDULE_CNT",
                           "-x", "PATH", "python", "train.py", "--lr=0.1")
    assert worker.files == {hostfile: "localhost slots=4\n"}
    assert worker.env == {"MA_PROC_START_CNT": "1", "MA_SCHEDULE_CNT": "1",
                          **job_variables("localhost", 18888, 1, 0, 4)}
    assert worker.logs == {"task": str(job_spec.task_log_path)}


@pytest.mark.parametrize("variables, slots", [
    ({}, 1),
    ({"MA_NUM_GPUS": 8}, 8),
    ({"MA_NUM_GPUS": 8, "MA_RUNTIME_NPROC_PER_NODE": 2}, 2),
    ({"MA_NUM_GPUS": 8, "MA_RUNTIME_NPROC_PER_NODE": 2, "MY_MPI_SLOTS": 3}, 3),
])
def test_slots_are_my_mpi_slots_else_the_process_count_else_the_cards_else_one(job, variables, slots):
    job_spec, environ = nodes(job, **variables)
    reach = Reach()

    result = build(job_spec, environ, reach=reach)

    assert result.processes_per_node == slots
    assert result.workers[0].argv[1:3] == ("-np", str(2 * slots))
    assert list(result.workers[0].files.values()) == [f"{IPS[0]} slots={slots}\n{IPS[1]} slots={slots}\n"]


# --------------------------------------------------------------------------- several nodes


def test_worker_0_waits_for_every_sshd_and_runs_mpirun_over_ssh_on_the_platforms_port(job):
    job_spec, environ = nodes(job, MA_NUM_HOSTS=3, VC_WORKER_HOSTS=",".join(HOSTS), MA_NUM_GPUS=8)
    reach = Reach()

    result = build(job_spec, environ, reach=reach)

    assert reach.asked == [[(host, 36666) for host in HOSTS]]  # worker-0 itself too: its IP is in the hostfile
    (worker,) = result.workers
    folder = state(job_spec)
    assert worker.argv[:15] == (
        "/opt/bin/mpirun", "-np", "24", "-hostfile", str(folder / "hostfile"),
        "-mca", "plm_rsh_args", f"-p 36666 -F {folder / 'ssh_config'}",
        "-bind-to", "none", "-map-by", "slot", "-mca", "pml", "ob1")
    assert worker.argv[15:20] == ("-mca", "btl", "^openib", "-mca", "plm_rsh_no_tree_spawn")
    assert worker.argv[-2:] == ("python", "train.py")
    assert worker.files == {str(folder / "hostfile"): "".join(f"{ip} slots=8\n" for ip in IPS)}
    assert (result.nodes, result.processes_per_node) == (3, 8)


def test_my_sshd_port_is_where_worker_0_waits_and_where_ssh_connects(job):
    job_spec, environ = nodes(job, MY_SSHD_PORT=2222)
    reach = Reach()

    argv = build(job_spec, environ, reach=reach).workers[0].argv

    assert reach.asked == [[(HOSTS[0], 2222), (HOSTS[1], 2222)]]
    assert argv[argv.index("plm_rsh_args") + 1].startswith("-p 2222 -F ")


def test_without_vc_worker_hosts_the_nodes_are_the_platforms_volcano_names(job):
    job_spec, environ = nodes(job, VC_WORKER_HOSTS=None, MA_TASK_NAME="launcher")
    reach = Reach()

    build(job_spec, environ, reach=reach)

    assert reach.asked == [[(f"{VJ}-launcher-{index}.{VJ}", 36666) for index in (0, 1)]]


def test_without_any_node_name_the_plan_is_a_configuration_error(job):
    job_spec, environ = nodes(job, VC_WORKER_HOSTS=None, MA_VJ_NAME=None)
    with pytest.raises(ConfigError, match="VC_WORKER_HOSTS and MA_VJ_NAME are unset"):
        build(job_spec, environ)


@pytest.mark.parametrize("index", [1, 2])
def test_the_other_nodes_run_the_watcher_of_worker_0s_sshd_and_no_mpirun(job, index):
    job_spec, environ = nodes(job, MA_NUM_HOSTS=3, VC_WORKER_HOSTS=",".join(HOSTS), VC_TASK_INDEX=index,
                              MY_SSHD_PORT=2222, MA_RUNTIME_PEER_WAIT_SECONDS=45)
    reach = Reach()

    result = build(job_spec, environ, reach=reach, installed=())  # no mpirun needed on this node

    (worker,) = result.workers
    assert reach.asked == []  # it waits for nothing before it starts
    assert worker.name == "watcher"
    assert worker.argv[1:] == ("-m", "ma_runtime.launch.peers", "--until-gone", f"{HOSTS[0]}:2222",
                               "--appear-seconds", "45")
    assert worker.files == {}
    assert worker.env == {"MA_PROC_START_CNT": "1", "MA_SCHEDULE_CNT": "1",
                          **job_variables(HOSTS[0], 18888, 3, index, result.processes_per_node)}
    assert (result.method, result.nodes) == ("mpirun", 3)


def test_a_task_index_beyond_the_nodes_is_a_configuration_error(job):
    job_spec, environ = nodes(job, VC_TASK_INDEX=2)
    with pytest.raises(ConfigError, match="VC_TASK_INDEX=2 is not below MA_NUM_HOSTS=2"):
        build(job_spec, environ)


def test_a_stop_during_the_wait_ends_the_plan_without_one(job):
    job_spec, environ = nodes(job)
    with pytest.raises(Exception, match="stopped while waiting for the other nodes"):
        build(job_spec, environ, reach=lambda endpoints: [])


def test_mpirun_not_installed_is_a_configuration_error_naming_the_package(job):
    job_spec, environ = job()
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ, installed=())
    assert "mpirun is not installed" in caught.value.reason and "openmpi-bin" in caught.value.hint


# --------------------------------------------------------------------------- what every rank gets


def test_the_x_list_has_the_platforms_families_by_name_and_never_a_secret(job):
    job_spec, environ = nodes(
        job, MA_FOO="1", VC_WORKER_NUM="2", S3_ENDPOINT="http://obs", SHARED_DIR="/shared", NCCL_IB_HCA="mlx5",
        HCCL_CONNECT_TIMEOUT="600", HOROVOD_FUSION_THRESHOLD="1", OMP_NUM_THREADS="4", PYTHONPATH="/code",
        LD_LIBRARY_PATH="/usr/local/lib", OBS_SECRET_ACCESS_KEY=SECRET, S3_SECRET_ACCESS_KEY=SECRET,
        MA_API_TOKEN=SECRET, MA_AK=SECRET, VC_TASK_INDEX=0, MA_CURRENT_IP="10.0.0.1", MA_TASK_INDEX="0",
        UNRELATED="1", HOSTNAME="node-0")

    result = build(job_spec, environ)

    names = x_names(result.workers[0].argv)
    for name in ("MA_FOO", "VC_WORKER_NUM", "VC_WORKER_HOSTS", "S3_ENDPOINT", "SHARED_DIR", "NCCL_IB_HCA",
                 "HCCL_CONNECT_TIMEOUT", "HOROVOD_FUSION_THRESHOLD", "OMP_NUM_THREADS", "PYTHONPATH",
                 "LD_LIBRARY_PATH", "PATH", "MA_PROC_START_CNT", "MA_SCHEDULE_CNT"):
        assert name in names, name
    # Credentials, this node's own values, and variables of no family stay home.
    for name in ("OBS_SECRET_ACCESS_KEY", "S3_SECRET_ACCESS_KEY", "MA_API_TOKEN", "MA_AK", "VC_TASK_INDEX",
                 "MA_CURRENT_IP", "MA_TASK_INDEX", "UNRELATED", "HOSTNAME"):
        assert name not in names, name
    document = json.dumps(result.to_dict())
    assert "SECRET" not in document and "TOKEN" not in document and SECRET not in document
    # Names only: no value of the job's own variables in argv (the presets are the platform's constants).
    assert all("=" not in name for name in names[len(PRESETS) // 2:]) and SECRET not in result.workers[0].argv


def test_ma_runtime_mpi_export_passes_the_names_it_lists_secrets_included(job):
    job_spec, environ = nodes(job, MA_RUNTIME_MPI_EXPORT="HF_TOKEN,FAIL_RANK,ABSENT", HF_TOKEN=SECRET, FAIL_RANK=3)

    argv = build(job_spec, environ).workers[0].argv

    names = x_names(argv)
    assert names[-2:] == ["HF_TOKEN", "FAIL_RANK"]  # the job asked for them by name
    assert "ABSENT" not in names  # mpirun would warn about a variable it cannot find
    assert SECRET not in argv


def test_what_the_hooks_and_stage_in_set_is_passed_by_name(job):
    job_spec, environ = nodes(job, MY_HOOK_SETTING="on", data_url="/cache/data", HOOK_TOKEN=SECRET)

    names = x_names(build(job_spec, environ, exported=("MY_HOOK_SETTING", "data_url", "HOOK_TOKEN")).workers[0].argv)

    assert "MY_HOOK_SETTING" in names and "data_url" in names
    assert "HOOK_TOKEN" not in names


def test_the_jobs_own_value_of_a_preset_wins_and_my_mpi_btl_tcp_if_sets_nccls_interfaces(job):
    job_spec, environ = nodes(job, MY_MPI_BTL_TCP_IF="ib0,eth1", NCCL_DEBUG="WARN")

    names = x_names(build(job_spec, environ).workers[0].argv)

    assert names[:4] == ["NCCL_SOCKET_IFNAME=ib0,eth1", "NCCL_SOCKET_FAMILY=AF_INET", "NCCL_DEBUG",
                         "HOROVOD_MPI_THREADS_DISABLE=1"]
    assert names.count("NCCL_DEBUG") == 1


def test_extra_mpirun_params_come_after_the_runtimes_and_before_the_command(job):
    job_spec, environ = job(MA_RUNTIME_EXTRA_MPIRUN_PARAMS="--mca btl_tcp_if_include 'eth0' --report-bindings")

    argv = build(job_spec, environ).workers[0].argv

    assert argv[-6:] == ("--mca", "btl_tcp_if_include", "eth0", "--report-bindings", "python", "train.py")


def test_unbalanced_extra_params_are_a_configuration_error(job):
    job_spec, environ = job(MA_RUNTIME_EXTRA_MPIRUN_PARAMS="--x 'open")
    with pytest.raises(ConfigError, match="MA_RUNTIME_EXTRA_MPIRUN_PARAMS cannot be split"):
        build(job_spec, environ)


@pytest.mark.parametrize("name, value, expected", [
    ("MY_SSHD_PORT", "70000", "between 1 and 65535"),
    ("MA_RUNTIME_MPI_KEY_PORT", "0", "between 1 and 65535"),
    ("MY_MPI_SLOTS", "0", "between 1 and 1024"),
    ("MY_MPI_BTL_TCP_IF", "eth0 eth1", "not a valid list of network interfaces"),
    ("MA_RUNTIME_MPI_EXPORT", "GOOD,1BAD", "'1BAD', not a variable name"),
])
def test_bad_mpi_settings_name_the_variable(job, name, value, expected):
    with pytest.raises(ConfigError) as caught:
        job(**{name: value})
    assert name in caught.value.reason and expected in caught.value.reason


# --------------------------------------------------------------------------- root causes (Open MPI 4.1.4's text)

EXITED = """--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[15347,1],2]
  Exit code:    3
--------------------------------------------------------------------------"""
SIGNALLED = """--------------------------------------------------------------------------
mpirun noticed that process rank 3 with PID 0 on node 10.214.7.2 exited on signal 9 (Killed).
--------------------------------------------------------------------------"""
ABORTED = """--------------------------------------------------------------------------
MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD
with errorcode 5.

NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.
You may or may not see output from other processes, depending on
exactly when Open MPI kills them.
--------------------------------------------------------------------------"""


@pytest.mark.parametrize("text, cause", [(EXITED, RootCause(2, 3)), (SIGNALLED, RootCause(3, -9)),
                                         (ABORTED, RootCause(1, 5)), ("Traceback ...\nValueError: x", None)])
def test_the_root_cause_is_the_rank_mpiruns_summary_names(text, cause):
    assert mpirun.LAUNCHER.root_cause(["rank 0 says hello", *text.splitlines()]) == cause


def test_the_last_summary_wins():
    assert mpirun.LAUNCHER.root_cause([*ABORTED.splitlines(), *EXITED.splitlines()]) == RootCause(2, 3)


# --------------------------------------------------------------------------- the real mpirun on one node

RANKS = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    child = subprocess.Popen(["sleep", "60"])  # in the rank's process group
    folder = sys.argv[1]
    with open(os.path.join(folder, f"rank-{rank}"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    if os.environ.get("FAIL_RANK") == str(rank):
        time.sleep(0.3)
        os._exit(3)
    signal.signal(signal.SIGTERM, lambda *_: (child.kill(), os._exit(7)))
    time.sleep(60)
""")


def _mpirun(tmp_path, ranks, **env):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    argv = [_which("mpirun"), "-np", str(ranks), "--oversubscribe", "-bind-to", "none", sys.executable, str(script),
            str(tmp_path)]
    return subprocess.Popen(argv, env={**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1",
                                       "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@needs_mpirun
def test_real_mpirun_exits_with_the_failed_ranks_code_and_its_summary_names_the_rank(tmp_path):
    process = _mpirun(tmp_path, 2, FAIL_RANK="1")
    output, _ = process.communicate(timeout=60)

    assert process.returncode == 3, output
    assert mpirun.LAUNCHER.root_cause(output.splitlines()) == RootCause(1, 3), output


@needs_mpirun
def test_real_mpirun_signals_each_ranks_group_itself_on_sigterm_and_exits_1(tmp_path):
    process = _mpirun(tmp_path, 2)
    try:
        pids = [_pids(tmp_path / f"rank-{rank}") for rank in (0, 1)]
        table = processes()
        reached = mpirun.LAUNCHER.forwards_to(process.pid, table)
        # Each rank and the child in its group: mpirun's own children lead the groups it signals.
        assert {pid for pair in pids for pid in pair} <= reached

        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 1, output  # its own code after a stop, not the ranks' 7
    assert mpirun.LAUNCHER.OWN_CODE_AFTER_STOP is False
    # mpirun exits once its own children have; a rank's child, signalled in the same group, may still be on its
    # way out under load (seen in CI at load 10): it must die, not necessarily before mpirun's exit.
    guard = time.monotonic() + 20
    while [pid for pair in pids for pid in pair if alive(pid)] and time.monotonic() < guard:
        time.sleep(0.05)
    assert not [pid for pair in pids for pid in pair if alive(pid)]


def _pids(path: Path):
    """The rank's pid and its child's, once the rank has written both."""
    wait_for_file(path, 30)
    while len(path.read_text().split()) < 2:
        time.sleep(0.01)
    return [int(word) for word in path.read_text().split()]


# --------------------------------------------------------------------------- the sshd service


@pytest.fixture
def node(tmp_path):
    """node(index, **variables) -> JobSpec of node `index` of a two-node mpirun job, with a free sshd port; every
    sshd it starts is killed afterwards."""
    started = []

    def make(index=1, **variables):
        environ = {"MA_HOME": str(tmp_path / f"home-{index}"), "PATH": _SBIN_PATH, "MA_RUN_METHOD": "mpirun",
                   "MA_NUM_HOSTS": "2", "VC_TASK_INDEX": str(index), "VC_WORKER_HOSTS": "localhost,localhost",
                   "MY_SSHD_PORT": str(free_port())}
        environ.update({name: str(value) for name, value in variables.items()})
        return spec.load({}, environ), environ

    yield make, started
    for pid in started:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
        children._SERVICES.discard(pid)


def trust(home: Path, *names, key=None):
    """The job's trust files in MA_HOME/.ssh, as the platform mounts them; the private key readable by all."""
    folder = home / ".ssh"
    folder.mkdir(parents=True)
    key = key or home / "job-key"
    if not key.exists():
        subprocess.run([_which("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    contents = {"id_ed25519": key.read_bytes(), "id_ed25519.pub": Path(f"{key}.pub").read_bytes(),
                "authorized_keys": Path(f"{key}.pub").read_bytes(), "config": b"ServerAliveInterval 30\n"}
    for name in names:
        (folder / name).write_bytes(contents[name])
        os.chmod(folder / name, 0o644)
    return folder


def start(job_spec, environ, started, sinks=(), client=False, log=None):
    before = set(children._SERVICES)
    try:
        sshd.start(job_spec, environ, log or Log(), threading.Event(), list(sinks), client=client,
                   worker_0="localhost")
    finally:
        started.extend(set(children._SERVICES) - before)


def login(client_config: Path, port: int):
    """What mpirun's ssh does: the same -p and -F, to this machine."""
    return subprocess.run([_which("ssh"), "-p", str(port), "-F", str(client_config), "127.0.0.1", "echo",
                           "logged-in"], capture_output=True, text=True, timeout=30)


@needs_sshd
def test_sshd_listens_as_the_jobs_service_and_lets_worker_0s_key_in_through_the_copied_trust_files(node, tmp_path):
    make, started = node
    job_spec, environ = make(1)
    home = Path(environ["MA_HOME"])
    trust(home, "id_ed25519", "id_ed25519.pub", "authorized_keys", "config")
    image = home / "etc" / "ssh" / "sshd_config"
    image.parent.mkdir(parents=True)
    image.write_text("Port {{MY_SSHD_PORT}}\nClientAliveInterval 60\n")

    start(job_spec, environ, started, client=True)

    (pid,) = started
    assert pid in children._SERVICES and alive(pid)
    folder = sshd_files.folder(job_spec)
    assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
    for name in ("id_ed25519", "authorized_keys", "config"):
        assert oct(os.stat(folder / "ssh" / name).st_mode & 0o777) == "0o600", name
    config = (folder / "sshd_config").read_text()
    assert config.index("StrictModes no") < config.index(f"Port {job_spec.sshd_port}")  # the runtime's lines first
    assert image.read_text() == "Port {{MY_SSHD_PORT}}\nClientAliveInterval 60\n"  # the image's file, untouched
    client = (folder / "ssh_config").read_text()
    assert f"IdentityFile {folder / 'ssh' / 'id_ed25519'}" in client and "ServerAliveInterval 30" in client
    done = login(folder / "ssh_config", job_spec.sshd_port)
    assert done.stdout.strip() == "logged-in", done.stderr
    # The mounted files win: no key made, none served.
    assert "id_job_ed25519" not in client and not (folder / "ssh" / "id_job_ed25519").exists()


def _taken_port() -> socket.socket:
    """A port in use on every address, IPv4 and IPv6 (sshd starts if it can bind either)."""
    if not socket.has_dualstack_ipv6():
        return socket.create_server(("0.0.0.0", 0))
    return socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)


@needs_sshd
def test_sshd_that_cannot_bind_its_port_is_78_with_its_own_line_prefixed_in_the_task_log(node, tmp_path):
    make, started = node
    with _taken_port() as taken:
        job_spec, environ = make(1, MY_SSHD_PORT=taken.getsockname()[1])
        trust(Path(environ["MA_HOME"]), "authorized_keys")
        task_log = tmp_path / "task.log"
        sink = Sink.open_append(str(task_log)).as_console()

        with pytest.raises(ConfigError) as caught:
            start(job_spec, environ, started, sinks=[sink])

    assert caught.value.exit_code == ExitCode.BAD_CONFIGURATION
    assert f"sshd did not start on port {job_spec.sshd_port}" in caught.value.reason
    assert "Address already in use" in caught.value.reason or "bind" in caught.value.reason.lower()
    assert "MY_SSHD_PORT" in caught.value.hint
    assert any(line.startswith("[sshd] ") for line in task_log.read_text().splitlines())
    assert not [pid for pid in started if alive(pid)]


def _answer(port):
    """Everything the port sends until it closes."""
    chunks = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        while True:
            chunk = conn.recv(4096)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


@contextlib.contextmanager
def answering(answer: bytes):
    """A port on 127.0.0.1 that sends `answer` to whoever connects, then closes: not worker-0's key server."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.shutdown(socket.SHUT_RDWR)  # wakes the accept
        server.close()


def test_the_key_port_is_its_setting_else_the_sshd_port_plus_one_and_never_the_sshd_port(job):
    assert sshd_key.key_port(job(MY_SSHD_PORT=2222)[0]) == 2223
    assert sshd_key.key_port(job(MY_SSHD_PORT=65535)[0]) == 65534
    assert sshd_key.key_port(job(MY_SSHD_PORT=2222, MA_RUNTIME_MPI_KEY_PORT=4000)[0]) == 4000
    with pytest.raises(ConfigError, match="MA_RUNTIME_MPI_KEY_PORT=4000 is MY_SSHD_PORT's port"):
        sshd_key.key_port(job(MY_SSHD_PORT=4000, MA_RUNTIME_MPI_KEY_PORT=4000)[0])


@needs_sshd
def test_worker_0_without_trust_files_makes_the_jobs_key_and_serves_its_public_half_only(node):
    make, started = node
    job_spec, environ = make(0, MA_RUNTIME_MPI_KEY_PORT=free_port())
    log = Log()

    start(job_spec, environ, started, client=True, log=log)

    assert len(started) == 2 and all(alive(pid) for pid in started)  # the key server and sshd, the job's services
    keys = sshd_files.folder(job_spec) / "ssh"
    public = (keys / "id_job_ed25519.pub").read_bytes()
    assert _answer(job_spec.mpi_key_port) == public == _answer(job_spec.mpi_key_port)  # to anyone, every time
    assert public.startswith(b"ssh-ed25519 ") and public.count(b"\n") == 1
    assert (keys / "authorized_keys").read_bytes() == public
    assert oct(os.stat(keys / "id_job_ed25519").st_mode & 0o777) == "0o600"
    assert log.fields("serving the job's public key") == [{"port": job_spec.mpi_key_port,
                                                           "path": str(keys / "id_job_ed25519.pub")}]
    # Its ssh logs in with that key (its own sshd authorizes it too).
    done = login(sshd_files.folder(job_spec) / "ssh_config", job_spec.sshd_port)
    assert done.stdout.strip() == "logged-in", done.stderr


@needs_sshd
def test_a_key_server_that_cannot_bind_its_port_is_78_with_its_own_line(node):
    make, started = node
    with _taken_port() as taken:
        job_spec, environ = make(0, MA_RUNTIME_MPI_KEY_PORT=taken.getsockname()[1])

        with pytest.raises(ConfigError) as caught:
            start(job_spec, environ, started, client=True)

    assert caught.value.reason.startswith(f"the job's key server did not start on port {job_spec.mpi_key_port}: "
                                          f"ma-runtime: cannot listen on port {job_spec.mpi_key_port}: ")
    assert "MA_RUNTIME_MPI_KEY_PORT" in caught.value.hint
    assert not [pid for pid in started if alive(pid)]  # and no sshd was started


@needs_sshd
def test_the_key_server_refuses_to_serve_a_private_key(tmp_path):
    key = tmp_path / "key"
    subprocess.run([_which("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)

    done = subprocess.run([sys.executable, "-m", "ma_runtime.launch.sshd_key", "--serve-public-key", str(key), "--port",
                           str(free_port()), "--pid-file", str(tmp_path / "pid")],
                          capture_output=True, text=True, timeout=30)

    assert done.returncode == ExitCode.BAD_CONFIGURATION, done.stderr
    assert f"ma-runtime: {key} is not an ed25519 public key: it is not served" in done.stderr
    assert not (tmp_path / "pid").exists()


@needs_sshd
def test_a_peer_without_authorized_keys_fetches_worker_0s_public_key_and_worker_0_logs_in(node):
    make, started = node
    port = free_port()
    zero, zero_environ = make(0, MA_RUNTIME_MPI_KEY_PORT=port)
    one, one_environ = make(1, MA_RUNTIME_MPI_KEY_PORT=port)

    start(zero, zero_environ, started, client=True)
    start(one, one_environ, started)

    authorized = sshd_files.folder(one) / "ssh" / "authorized_keys"
    assert authorized.read_bytes() == (sshd_files.folder(zero) / "ssh" / "id_job_ed25519.pub").read_bytes()
    assert oct(os.stat(authorized).st_mode & 0o777) == "0o600"
    assert not [name for name in os.listdir(sshd_files.folder(one) / "ssh") if name.startswith("id_")]  # no private key
    done = login(sshd_files.folder(zero) / "ssh_config", one.sshd_port)  # mpirun's ssh, worker-0 to worker-1
    assert done.stdout.strip() == "logged-in", done.stderr


_BAD_ANSWERS = {
    "an sshd's banner": b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n",
    "nothing": b"",
    "an RSA key": b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ== job\n",
    "an RSA blob labelled ed25519": b"ssh-ed25519 AAAAB3NzaC1yc2EAAAADAQABAAABAQ== job\n",
    "two keys": b"ssh-ed25519 {key} a\nssh-ed25519 {key} b\n",
    "options first": b'command="sh" ssh-ed25519 {key} job\n',
    "too long": b"ssh-ed25519 {key} " + b"x" * 5000 + b"\n",
}


@needs_sshd
@pytest.mark.parametrize("what", sorted(_BAD_ANSWERS))
def test_an_answer_that_is_not_one_ed25519_public_key_is_78_and_authorizes_nothing(node, tmp_path, what):
    make, started = node
    key = tmp_path / "key"
    subprocess.run([_which("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    answer = _BAD_ANSWERS[what].replace(b"{key}", Path(f"{key}.pub").read_bytes().split()[1])

    with answering(answer) as port:
        job_spec, environ = make(1, MA_RUNTIME_MPI_KEY_PORT=port)
        with pytest.raises(ConfigError) as caught:
            start(job_spec, environ, started)

    assert caught.value.exit_code == ExitCode.BAD_CONFIGURATION
    assert f"worker-0 (localhost) answered on port {port} with something other than the job's public key" in (
        caught.value.reason)
    assert "MA_RUNTIME_MPI_KEY_PORT" in caught.value.hint
    assert started == [] and not (sshd_files.folder(job_spec) / "ssh" / "authorized_keys").exists()


@needs_sshd
def test_worker_0_never_serving_its_key_is_81_naming_it_after_logged_waits(node):
    make, started = node
    port = free_port()  # nothing listens there
    job_spec, environ = make(1, MA_RUNTIME_MPI_KEY_PORT=port, MA_RUNTIME_PEER_WAIT_SECONDS=1)
    log = Log()

    with pytest.raises(LaunchTimedOut) as caught:
        start(job_spec, environ, started, log=log)

    assert caught.value.exit_code == ExitCode.TIMED_OUT
    assert caught.value.reason.startswith(f"worker-0 (localhost) did not serve the job's public key on port {port} "
                                          "within 1 s (127.0.0.1:")
    assert "generate SSH trust files" in caught.value.hint and "MA_RUNTIME_PEER_WAIT_SECONDS" in caught.value.hint
    waits = log.fields("waiting for worker-0's public key")
    assert waits and waits[0]["host"] == "localhost" and waits[0]["port"] == port
    assert "refuses connections" in waits[0]["why"]
    assert started == []


@needs_sshd
def test_a_peer_with_mounted_authorized_keys_asks_worker_0_for_nothing(node):
    make, started = node
    with answering(b"not a key\n") as port:  # asking it would be 78
        job_spec, environ = make(1, MA_RUNTIME_MPI_KEY_PORT=port)
        mounted = trust(Path(environ["MA_HOME"]), "authorized_keys")

        start(job_spec, environ, started)

    copied = sshd_files.folder(job_spec) / "ssh" / "authorized_keys"
    assert copied.read_bytes() == (mounted / "authorized_keys").read_bytes()


def test_one_node_starts_no_sshd(job):
    job_spec, environ = job()
    before = set(children._SERVICES)

    mpirun.LAUNCHER.start_services(job_spec, environ, Log(), threading.Event(), [])

    assert set(children._SERVICES) == before
