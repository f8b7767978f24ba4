"""Real mpirun across two nodes: network namespaces with their own host names, each node's sshd started by its
runtime, trust files made by the test in each node's MA_HOME/.ssh (in one test none: the job's own key),
mpi4py ranks (2 per node).

Each node runs `ma-run` as worker-0 or worker-1 (tests/e2e/test_multinode.py's NodePair, over
ma_runtime/local/nodes.py): worker-0 waits for
both sshd, writes the hostfile and runs mpirun; worker-1 runs the peers watcher and ends once worker-0's sshd
is gone. The namespaces isolate the ports, so the platform's default MY_SSHD_PORT (36666) is used.
"""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ma_runtime import spec
from ma_runtime.launch import sshd_files
from tests.conftest import alive, free_port, run_ma, wait_for_file
from tests.e2e import test_multinode as multinode
from tests.e2e.test_launchers import JOBS, launcher_env, termination
from tests.e2e.test_multinode import needs_namespaces, node_env

BIN = Path(sys.executable).parent  # the test venv's: python with mpi4py
SCRIPT = str(JOBS / "mpi_allreduce.py")
# `python -m mpi4py`: an uncaught exception or a non-zero sys.exit in a rank calls MPI_Abort (README, "mpirun").
COMMAND = ["python", "-m", "mpi4py", SCRIPT]
# A folder name with what a shell, Open MPI (plm_rsh_args is split at spaces, then quoted for the remote shell)
# and OpenSSH's config files (quotes, `%` tokens, `${}` variables) each take apart.
HOSTILE = "my home $(touch pwned);\"q'\\b %d ${HOME}\nline two"


def _missing() -> str:
    tools = [name for name in ("mpirun", "sshd", "ssh", "ssh-keygen") if not shutil.which(name, path=_PATH)]
    probe = subprocess.run([sys.executable, "-c", "import mpi4py.MPI"], capture_output=True)
    return ", ".join(tools + ([] if probe.returncode == 0 else ["mpi4py"]))


_PATH = f"{os.environ.get('PATH', os.defpath)}{os.pathsep}/usr/sbin"
needs_mpi = pytest.mark.skipif(bool(_missing()), reason=f"needs Open MPI's mpirun, OpenSSH's sshd and ssh, and "
                                                        f"mpi4py in the test venv; missing: {_missing()}")


node_pair = multinode.node_pair  # the fixture: two network namespaces, cleaned up whatever happens


@pytest.fixture
def nodes(node_pair):
    """The two nodes: test_multinode.py's node_pair, removed whatever the outcome."""
    return node_pair


@pytest.fixture
def trusted(tmp_path):
    """trusted(env): the job's trust files in the node's MA_HOME/.ssh, the same key pair on every node. The
    private key is readable by all (ssh would refuse it): the runtime's copy must fix that."""
    key = tmp_path / "job-key"
    if not key.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)

    def give(env):
        ssh = Path(env["MA_HOME"]) / ".ssh"
        ssh.mkdir(parents=True)
        shutil.copy(key, ssh / "id_ed25519")
        os.chmod(ssh / "id_ed25519", 0o644)
        shutil.copy(f"{key}.pub", ssh / "id_ed25519.pub")
        shutil.copy(f"{key}.pub", ssh / "authorized_keys")
        return env

    return give


def mpi_env(nodes, job_env, tmp_path, node, **extra):
    # Root in the test: mpirun refuses it unless both variables are set; the runtime passes them on as found.
    # The test's own variables reach the other node's ranks only by name (MA_RUNTIME_MPI_EXPORT).
    settings = dict(MA_RUN_METHOD="mpirun", MY_MPI_SLOTS=2, OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1,
                    MA_RUNTIME_PEER_WAIT_SECONDS=30, OBS_SECRET_ACCESS_KEY="do-not-ship-this-3f9a",
                    MA_RUNTIME_MPI_EXPORT="FAIL_RANK,FAIL_ATTEMPT,HOLD,PIDS_DIR")
    return node_env(nodes, job_env, tmp_path, node, BIN, **{**settings, **extra})


def start_both(nodes, envs, command=COMMAND):
    for node in (0, 1):
        nodes.start(node, envs[node], command)


def namespace_pids(nodes):
    return [pid for pid in nodes.nodes.pids() if alive(pid)]


def describe(pids):
    lines = []
    for pid in pids:
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        lines.append(f"{pid}: {b' '.join(words).decode(errors='replace')}")
    return "\n".join(lines)


@needs_namespaces
@needs_mpi
def test_an_allreduce_over_two_nodes_and_four_ranks(job_env, tmp_path, nodes, trusted):
    envs = [trusted(mpi_env(nodes, job_env, tmp_path, node)) for node in (0, 1)]

    start_both(nodes, envs, [*COMMAND, "--own=1"])
    codes = nodes.wait(timeout=120)

    report = nodes.report()
    assert codes == [0, 0], report
    stdout = nodes.outputs[0].read_text(errors="replace")
    for rank in range(4):  # every rank's output comes through worker-0's mpirun
        # The credential in the job's environment: worker-0's own ranks inherit mpirun's environment, but -x
        # does not carry it to the other node.
        assert (f"rank {rank} of 4 on {nodes.hosts[rank // 2]}: allreduce=10 args=['--own=1'] secret={rank < 2}"
                in stdout), report
    stderr = [nodes.outputs[node].with_suffix(".err").read_text(errors="replace") for node in (0, 1)]
    assert "sshd listens" in stderr[0] and "sshd listens" in stderr[1], report
    # worker-1 ran no command of its own: its watcher saw worker-0's sshd go once worker-0's run had ended.
    assert "ma-runtime: every node watched has finished" in stderr[1], report
    assert "-np 4" in stderr[0] and "-x NCCL_SOCKET_IFNAME=eth0,bond0" in stderr[0], report
    # The credential reached neither mpirun's argv nor the hostfile nor any rank through -x.
    hostfile = Path(envs[0]["MA_HOME"]) / "modelarts" / ".ma-runtime" / "mpi-worker-0" / "hostfile"
    assert hostfile.read_text() == "".join(f"{address} slots=2\n" for address in nodes.addresses)
    assert "OBS_SECRET_ACCESS_KEY" not in stderr[0] and "do-not-ship-this" not in stderr[0]
    assert namespace_pids(nodes) == [], describe(namespace_pids(nodes))


@needs_namespaces
@needs_mpi
def test_a_rank_exiting_3_ends_both_nodes_and_worker_0_exits_3(job_env, tmp_path, nodes, trusted):
    envs = [trusted(mpi_env(nodes, job_env, tmp_path, node, FAIL_RANK=3, HOLD=1)) for node in (0, 1)]

    start_both(nodes, envs)
    codes = nodes.wait(timeout=120)

    report = nodes.report()
    assert codes == [3, 86], report  # worker-0's code is the job's; worker-1 was stopped for the job
    message = termination(envs[0])
    assert (message["exit_code"], message["rank"]) == (3, 3), report
    other = termination(envs[1])
    assert other["exit_code"] == 86 and other["origin"] == message["origin"], report
    assert (other["origin"]["task_index"], other["origin"]["exit_code"]) == (0, 3), report
    assert namespace_pids(nodes) == [], describe(namespace_pids(nodes))


@needs_namespaces
@needs_mpi
def test_sigterm_to_worker_0_leaves_no_rank_orted_or_sshd_on_either_node(job_env, tmp_path, nodes, trusted):
    pids = tmp_path / "pids"
    pids.mkdir()
    envs = [trusted(mpi_env(nodes, job_env, tmp_path, node, HOLD=1, PIDS_DIR=pids)) for node in (0, 1)]
    start_both(nodes, envs)
    for rank in range(4):
        wait_for_file(pids / f"rank-{rank}", timeout=60)
    running = namespace_pids(nodes)
    assert "orted" in describe(running) and "sshd" in describe(running), describe(running)

    nodes.processes[0].send_signal(signal.SIGTERM)
    codes = nodes.wait(timeout=60)

    report = nodes.report()
    assert codes == [128 + signal.SIGTERM, 0], report
    left = namespace_pids(nodes)
    assert left == [], describe(left)
    rank_pids = [int((pids / f"rank-{rank}").read_text()) for rank in range(4)]
    assert not [pid for pid in rank_pids if alive(pid)]


@needs_namespaces
@needs_mpi
def test_without_trust_files_the_jobs_own_key_serves_and_a_restart_reuses_the_same_sshd(job_env, tmp_path, nodes):
    # No MA_HOME/.ssh on either node: worker-0 makes the job's key and serves its public half, worker-1 fetches it.
    envs = [mpi_env(nodes, job_env, tmp_path, node, FAIL_RANK=2, FAIL_ATTEMPT=1, MA_RUNTIME_MAX_RESTARTS=1)
            for node in (0, 1)]

    start_both(nodes, envs)
    codes = nodes.wait(timeout=120)

    report = nodes.report()
    assert codes == [0, 0], report
    stderr = [nodes.outputs[node].with_suffix(".err").read_text(errors="replace") for node in (0, 1)]
    assert "restarting command" in stderr[0] and stderr[0].count("sshd listens") == 1, report  # one sshd, 2 attempts
    assert stderr[0].count("serving the job's public key") == 1, report
    assert "authorized worker-0's public key" in stderr[1] and nodes.hosts[0] in stderr[1], report
    assert f"rank 2 of 4 on {nodes.hosts[1]}: allreduce=10" in nodes.outputs[0].read_text(errors="replace"), report
    assert not any((Path(env["MA_HOME"]) / ".ssh").exists() for env in envs)
    assert namespace_pids(nodes) == [], describe(namespace_pids(nodes))  # the key server swept too


@needs_namespaces
@needs_mpi
def test_a_home_with_spaces_and_shell_characters_runs_across_two_nodes(job_env, tmp_path, nodes, trusted):
    # Issue 24 item 7: `plm_rsh_args "-p 36666 -F /.../my home/.../ssh_config"` reached ssh as two words.
    envs = []
    for node in (0, 1):
        home = tmp_path / HOSTILE / f"home-{node}"
        env = mpi_env(nodes, job_env, tmp_path, node)
        env.update(MA_HOME=str(home), MA_RUNTIME_TERMINATION_LOG=str(home / "termination-log"))
        envs.append(trusted(env))

    links = [sshd_files.named_folder(spec.load({}, env)) for env in envs]  # in /tmp: the runtime leaves them for reuse
    try:
        start_both(nodes, envs)
        codes = nodes.wait(timeout=120)
    finally:
        for link in links:
            if link.is_symlink():
                link.unlink()

    report = nodes.report()
    assert codes == [0, 0], report
    stdout = nodes.outputs[0].read_text(errors="replace")
    for rank in range(4):
        assert f"rank {rank} of 4 on {nodes.hosts[rank // 2]}: allreduce=10" in stdout, report
    stderr = nodes.outputs[0].with_suffix(".err").read_text(errors="replace")
    assert f"-F {links[0]}/ssh_config" in stderr and sshd_files.is_plain(str(links[0])), report  # ssh's -F: one word
    assert not list(tmp_path.rglob("pwned")) and not (Path.cwd() / "pwned").exists()  # nothing was evaluated
    assert namespace_pids(nodes) == [], describe(namespace_pids(nodes))


@needs_mpi
def test_one_node_runs_every_rank_itself_without_sshd(job_env):
    env = launcher_env(job_env, BIN, MA_RUN_METHOD="mpirun", MY_MPI_SLOTS=2, OMPI_ALLOW_RUN_AS_ROOT=1,
                       OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)

    done = run_ma(COMMAND, env, timeout=60)

    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2 on " in done.stdout and "allreduce=3" in done.stdout, done.stdout
    assert "sshd" not in done.stderr and "plm_rsh_args" not in done.stderr
    hostfile = Path(env["MA_HOME"]) / "modelarts" / ".ma-runtime" / "mpi-worker-0" / "hostfile"
    assert hostfile.read_text() == "localhost slots=2\n"


@needs_mpi
def test_a_node_whose_sshd_never_answers_is_waited_for_then_81_names_it(job_env, tmp_path, trusted):
    # Worker-0 alone, on this machine's network: its own sshd answers, the other node's name never resolves. (With
    # the job as one, the barrier would name the node first: tests/e2e/test_job_as_one.py.)
    env = trusted(launcher_env(job_env, BIN, MA_RUN_METHOD="mpirun", MA_NUM_HOSTS=2, MY_SSHD_PORT=free_port(),
                               VC_WORKER_HOSTS="localhost,no-such-node.invalid", MA_RUNTIME_PEER_WAIT_SECONDS=2,
                               MA_RUNTIME_COORDINATOR="off",  # mpirun's own wait for the sshd, not the barrier
                               OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1))

    done = run_ma(COMMAND, env, timeout=60)

    assert done.returncode == 81, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error,exiting" in line]
    assert len(errors) == 1 and "no-such-node.invalid" in errors[0], done.stderr[-3000:]
    assert "waiting for a node" in done.stderr and "Traceback" not in done.stderr
    message = termination(env)
    assert message["exit_code"] == 81 and "no-such-node.invalid" in message["reason"]
    sshd_pid = int(done.stderr.split("msg=\"sshd listens\"")[1].split("pid=")[1].split()[0])
    assert not alive(sshd_pid)  # the service was swept with the run

