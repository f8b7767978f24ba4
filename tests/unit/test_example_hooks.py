"""The example pre-start hooks in hooks/, run for real: each .sh sourced by bash, and a .py of the job's own
beside them, as hooks/README.md composes them.

A sourced hook is judged by what it leaves in the shell that sourced it: its status, the exported
environment (read by a Python child, as a worker would see it), and no helper function or variable
of its own. The sshd hook runs the real sshd, as a user other than root (the platform's ma-user is
uid 1000), and only where one is installed.
"""

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HOOKS = Path(__file__).resolve().parents[2] / "hooks"
ASCEND = HOOKS / "ascend" / "ma-pre-start.sh"
SSHD = HOOKS / "mpi-sshd" / "ma-pre-start.sh"

# Sources the hook ($1), then writes a report ($2): the status, the environment as a child process
# sees it, and the names of the shell's functions and variables.
_HARNESS = r'''
. "$1" && status=0 || status=$?
"$PYTHON_FOR_REPORT" -c '
import json, os, sys
env = dict(os.environ)
env.pop("PYTHON_FOR_REPORT")
report = {"status": int(sys.argv[2]), "env": env, "functions": sys.argv[3].split(), "variables": sys.argv[4].split()}
open(sys.argv[1], "w").write(json.dumps(report))
' "$2" "$status" "$(compgen -A function)" "$(compgen -v)"
'''


class Sourced:
    def __init__(self, report, stdout, stderr):
        self.status = report["status"]
        self.env = report["env"]
        self.functions = report["functions"]
        self.variables = report["variables"]
        self.stdout, self.stderr = stdout, stderr


def source(hook, env, workdir, options="", user=None):
    """Sources `hook` with bash in `workdir` under the shell `options` (e.g. `set -eu`), as `user` when given."""
    report = Path(workdir) / "report.json"
    command = ["bash", "-c", options + "\n" + _HARNESS, "bash", str(hook), str(report)]
    python = sys.executable
    if user is not None:
        command = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", *command]
        # Ours may sit in a folder only its owner may enter (pyenv under /root).
        python = next((path for path in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(path)), None)
        if python is None:
            pytest.skip("no system python3 that another user can run")
    done = subprocess.run(command, env={**env, "PYTHON_FOR_REPORT": python}, cwd=workdir,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and report.exists(), done.stderr
    return Sourced(json.loads(report.read_text()), done.stdout, done.stderr)


def base_env(tmp_path):
    return {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"), "LANG": "C.UTF-8"}


def assert_leaves_nothing_behind(sourced, baseline):
    """No function, and no variable but those it exported, that the same shell without the hook lacks."""
    assert sourced.functions == baseline.functions
    assert set(sourced.variables) - set(baseline.variables) - set(sourced.env) == set()


@pytest.fixture
def empty_hook_baseline(tmp_path):
    def baseline(env, options=""):
        empty = tmp_path / "empty-hook.sh"
        empty.write_text("")
        return source(empty, env, tmp_path, options)
    return baseline


# --- hooks/ascend ---------------------------------------------------------------------------------------------

ASCEND_DEFAULTS = {"ASCEND_GLOBAL_LOG_LEVEL": "3", "ASCEND_SLOG_PRINT_TO_STDOUT": "0",
                   "ASCEND_GLOBAL_EVENT_ENABLE": "0"}


@pytest.fixture
def cann_env(tmp_path):
    toolkit = tmp_path / "Ascend" / "ascend-toolkit" / "latest"
    toolkit.mkdir(parents=True)
    return {**base_env(tmp_path), "ASCEND_TOOLKIT_HOME": str(toolkit), "ASCEND_HOME_PATH": str(toolkit)}


@pytest.mark.parametrize("options", ["", "set -euo pipefail"])
def test_ascend_sets_the_log_defaults_and_the_plog_path_of_this_worker(tmp_path, cann_env, empty_hook_baseline,
                                                                        options):
    env = {**cann_env, "MA_LOG_DIR": str(tmp_path / "log"), "VC_TASK_INDEX": "3"}
    sourced, baseline = source(ASCEND, env, tmp_path, options), empty_hook_baseline(env, options)
    assert sourced.status == 0, sourced.stderr
    added = {name: value for name, value in sourced.env.items() if baseline.env.get(name) != value}
    assert added == {**ASCEND_DEFAULTS, "ASCEND_PROCESS_LOG_PATH": f"{tmp_path}/log/plog/worker-3"}
    assert "ASCEND_GLOBAL_LOG_LEVEL=3" in sourced.stdout
    assert_leaves_nothing_behind(sourced, baseline)


def test_ascend_without_a_task_index_is_worker_0_and_without_a_log_dir_leaves_the_plog_path_to_cann(tmp_path,
                                                                                                  cann_env):
    with_log_dir = source(ASCEND, {**cann_env, "MA_LOG_DIR": "/logs"}, tmp_path)
    assert with_log_dir.env["ASCEND_PROCESS_LOG_PATH"] == "/logs/plog/worker-0"
    without = source(ASCEND, cann_env, tmp_path)
    assert without.status == 0 and "ASCEND_PROCESS_LOG_PATH" not in without.env
    assert {name: without.env[name] for name in ASCEND_DEFAULTS} == ASCEND_DEFAULTS


@pytest.mark.parametrize("name", [*ASCEND_DEFAULTS, "ASCEND_PROCESS_LOG_PATH"])
def test_ascend_keeps_each_value_the_job_set_and_fills_only_the_others(tmp_path, cann_env, name):
    env = {**cann_env, "MA_LOG_DIR": "/logs", name: "1" if name != "ASCEND_PROCESS_LOG_PATH" else "/job/plog"}
    sourced = source(ASCEND, env, tmp_path)
    assert sourced.status == 0
    assert sourced.env[name] == env[name]
    expected = {**ASCEND_DEFAULTS, "ASCEND_PROCESS_LOG_PATH": "/logs/plog/worker-0"}
    del expected[name]
    assert {other: sourced.env[other] for other in expected} == expected


def test_ascend_takes_an_empty_value_as_not_set(tmp_path, cann_env):
    sourced = source(ASCEND, {**cann_env, "ASCEND_GLOBAL_LOG_LEVEL": ""}, tmp_path)
    assert sourced.env["ASCEND_GLOBAL_LOG_LEVEL"] == "3"


@pytest.mark.parametrize("case", ["neither set", "toolkit home missing", "home path a file", "one good one missing"])
def test_ascend_stops_the_job_with_one_line_when_cann_is_not_applied(tmp_path, cann_env, empty_hook_baseline, case):
    env = base_env(tmp_path)
    (tmp_path / "a-file").write_text("")
    env.update({
        "neither set": {},
        "toolkit home missing": {"ASCEND_TOOLKIT_HOME": str(tmp_path / "absent")},
        "home path a file": {"ASCEND_HOME_PATH": str(tmp_path / "a-file")},
        "one good one missing": {"ASCEND_HOME_PATH": cann_env["ASCEND_HOME_PATH"],
                                 "ASCEND_TOOLKIT_HOME": str(tmp_path / "absent")},
    }[case])
    sourced = source(ASCEND, env, tmp_path)
    assert sourced.status == 1
    lines = sourced.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[ascend] ")
    named = "ASCEND_HOME_PATH" if case == "home path a file" else "ASCEND_TOOLKIT_HOME"
    assert named in lines[0] and ("set_env.sh" in lines[0])
    assert "ASCEND_GLOBAL_LOG_LEVEL" not in sourced.env
    assert_leaves_nothing_behind(sourced, empty_hook_baseline(env))


def test_ascend_accepts_ascend_home_path_alone(tmp_path, cann_env):
    env = {**cann_env}
    del env["ASCEND_TOOLKIT_HOME"]
    assert source(ASCEND, env, tmp_path).status == 0


# --- hooks/mpi-sshd --------------------------------------------------------------------------------------------

STANDARD_PATH = "/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"


def _installed_sshd():
    """The sshd the hook will find: on PATH, as `command -v` does, or in /usr/sbin."""
    return shutil.which("sshd") or shutil.which("sshd", path=STANDARD_PATH)


needs_sshd = pytest.mark.skipif(_installed_sshd() is None,
                                reason="no sshd installed (Debian: apt-get install openssh-server)")


@pytest.fixture
def shared_dir():
    """A folder another user can use (tmp_path sits under a folder only root may enter). Every sshd a hook
    started in it is stopped by its pid file afterwards, whatever the test found."""
    folder = Path(tempfile.mkdtemp(prefix="ma-sshd-test."))
    folder.chmod(0o755)
    yield folder
    for pid_file in folder.glob("tmp/ma-sshd.*/sshd.pid"):
        stop_sshd(pid_file)
    shutil.rmtree(folder, ignore_errors=True)


def _sshd_users():
    if os.geteuid() != 0:
        return [pytest.param(None, id="this user")]
    as_root = pytest.param("root", id="root", marks=pytest.mark.skipif(
        _has_no_user("sshd"), reason="sshd as root needs the package's privilege separation user 'sshd'"))
    return [pytest.param("nobody", id="nobody"), as_root]


def _has_no_user(name):
    try:
        pwd.getpwnam(name)
    except KeyError:
        return True
    return False


def sshd_job(folder, user_name, port, image_config=None):
    """MA_HOME with the platform's trust files, owned by the user the hook runs as."""
    home = folder / "home"
    ssh = home / ".ssh"
    ssh.mkdir(parents=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / "id_ed25519")], check=True)
    shutil.copy(ssh / "id_ed25519.pub", ssh / "authorized_keys")
    (ssh / "config").write_text("StrictHostKeyChecking no\n")
    if image_config is not None:
        (home / "etc" / "ssh").mkdir(parents=True)
        (home / "etc" / "ssh" / "sshd_config").write_text(image_config)
    (folder / "tmp").mkdir()
    user = pwd.getpwnam(user_name) if user_name else None
    if user is not None:
        for path in [folder, *folder.rglob("*")]:
            os.chown(path, user.pw_uid, user.pw_gid)
    env = {"PATH": f"{Path(_installed_sshd()).parent}:{STANDARD_PATH}", "HOME": str(home), "MA_HOME": str(home),
           "TMPDIR": str(folder / "tmp"), "MY_SSHD_PORT": str(port), "LANG": "C.UTF-8"}
    return env, user


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop_sshd(pid_file):
    pid = int(Path(pid_file).read_text())
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30  # a guard against a hang, not a speed check
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists()


@needs_sshd
@pytest.mark.parametrize("user_name", _sshd_users())
def test_mpi_sshd_starts_sshd_on_the_port_from_a_private_copy_of_the_image_config(shared_dir, user_name):
    port = free_port()
    image_config = "Port {{MY_SSHD_PORT}}\nLogLevel VERBOSE\nPidFile /var/run/image-sshd.pid\nUsePAM yes\n"
    env, user = sshd_job(shared_dir, user_name, port, image_config)
    sourced = source(SSHD, env, shared_dir, user=user)
    pid_file = sourced.env.get("MA_SSHD_PID_FILE")
    assert sourced.status == 0, sourced.stderr
    assert sourced.env["MY_SSHD_PORT"] == str(port)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        assert connection.recv(64).startswith(b"SSH-2.0-")
    private = Path(pid_file).parent
    assert private.parent == shared_dir / "tmp" and private.stat().st_mode & 0o077 == 0
    config = (private / "sshd_config").read_text()
    assert f"Port {port}\n" in config and "{{MY_SSHD_PORT}}" not in config
    assert config.index(f"PidFile {pid_file}") < config.index("PidFile /var/run/image-sshd.pid")
    assert config.index("UsePAM no") < config.index("UsePAM yes")
    assert f"AuthorizedKeysFile {env['MA_HOME']}/.ssh/authorized_keys" in config
    assert (shared_dir / "home" / "etc" / "ssh" / "sshd_config").read_text() == image_config  # never edited
    assert sourced.env["MA_SSH_DIR"] == f"{env['MA_HOME']}/.ssh"
    stop_sshd(pid_file)  # as a later step would: by the exported pid file
    assert not Path(pid_file).exists()  # sshd removes it when it stops, so no stale one misleads a later step


@needs_sshd
def test_mpi_sshd_without_an_image_config_writes_a_minimal_one_and_a_job_host_key(shared_dir, empty_hook_baseline):
    user_name = "nobody" if os.geteuid() == 0 else None
    env, user = sshd_job(shared_dir, user_name, free_port())
    sourced = source(SSHD, env, shared_dir, "set -euo pipefail", user=user)
    pid_file = sourced.env.get("MA_SSHD_PID_FILE")
    assert sourced.status == 0, sourced.stderr
    assert_leaves_nothing_behind(sourced, empty_hook_baseline(env, "set -euo pipefail"))
    private = Path(pid_file).parent
    config = (private / "sshd_config").read_text()
    assert f"HostKey {private}/ssh_host_ed25519_key" in config and "PasswordAuthentication no" in config
    assert (private / "ssh_host_ed25519_key").stat().st_mode & 0o077 == 0


def _port_is_free(port):
    try:
        with socket.socket() as probe:
            probe.bind(("0.0.0.0", port))
    except OSError:
        return False
    return True


@needs_sshd
@pytest.mark.skipif(not _port_is_free(36666), reason="port 36666 is taken here")
def test_mpi_sshd_defaults_to_the_port_of_the_platforms_run_mpi_sh(shared_dir):
    env, user = sshd_job(shared_dir, "nobody" if os.geteuid() == 0 else None, 0)
    del env["MY_SSHD_PORT"]
    sourced = source(SSHD, env, shared_dir, user=user)
    assert sourced.status == 0, sourced.stderr
    assert sourced.env["MY_SSHD_PORT"] == "36666"
    with socket.create_connection(("127.0.0.1", 36666), timeout=30) as connection:
        assert connection.recv(64).startswith(b"SSH-2.0-")


@needs_sshd
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the trust files to other users")
def test_mpi_sshd_fixes_modes_in_place_and_copies_what_it_cannot_fix(shared_dir):
    env, user = sshd_job(shared_dir, "nobody", free_port())
    ssh = shared_dir / "home" / ".ssh"
    (ssh / "id_ed25519").chmod(0o644)  # ours: fixable in place
    os.chown(ssh / "config", 4321, 4321)  # another user's config: ssh refuses it, and we cannot chmod it
    sourced = source(SSHD, env, shared_dir, user=user)
    pid_file = sourced.env.get("MA_SSHD_PID_FILE")
    assert sourced.status == 0, sourced.stderr
    assert (ssh / "id_ed25519").stat().st_mode & 0o777 == 0o600
    copies = Path(sourced.env["MA_SSH_DIR"])
    assert copies == Path(pid_file).parent / "ssh" and copies.stat().st_mode & 0o777 == 0o700
    assert {p.name: p.stat().st_mode & 0o777 for p in copies.iterdir()} == {
        "id_ed25519": 0o600, "id_ed25519.pub": 0o600, "authorized_keys": 0o600, "config": 0o600}
    assert (copies / "config").read_text() == f"IdentityFile {copies}/id_ed25519\nStrictHostKeyChecking no\n"
    assert f"AuthorizedKeysFile {copies}/authorized_keys" in (copies.parent / "sshd_config").read_text()
    assert "using copies" in sourced.stderr


@needs_sshd
def test_mpi_sshd_fails_with_sshds_reason_when_the_port_is_taken(shared_dir):
    port = free_port()
    holders = []
    for family, address in [(socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")]:
        holder = socket.socket(family)
        try:
            if family == socket.AF_INET6:
                holder.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            holder.bind((address, port))
            holder.listen()
            holders.append(holder)
        except OSError:
            holder.close()  # no IPv6 here: sshd cannot bind it either
    user_name = "nobody" if os.geteuid() == 0 else None
    env, user = sshd_job(shared_dir, user_name, port)
    try:
        sourced = source(SSHD, env, shared_dir, user=user)
    finally:
        for holder in holders:
            holder.close()
    assert sourced.status == 1
    assert f"[mpi-sshd] sshd did not start on port {port}: " in sourced.stderr
    assert "bind" in sourced.stderr.lower() and "MA_SSHD_PID_FILE" not in sourced.env
    assert not list(shared_dir.glob("tmp/ma-sshd.*/sshd.pid"))  # nothing left running


# What sshd's and ssh's config files, Open MPI's plm_rsh_args and a shell each take apart (issue 24 item 7).
HOSTILE = "my home $(touch pwned);\"q'\\b %d ${HOME}\nline two"


@needs_sshd
def test_mpi_sshd_with_a_hostile_home_and_tmpdir_names_only_plain_paths_in_the_configs(shared_dir):
    folder = shared_dir / HOSTILE
    folder.mkdir()
    env, user = sshd_job(folder, "nobody" if os.geteuid() == 0 else None, free_port(), "Port {{MY_SSHD_PORT}}\n")
    sourced = source(SSHD, env, folder, user=user)
    pid_file = sourced.env.get("MA_SSHD_PID_FILE")
    try:
        assert sourced.status == 0, sourced.stderr
        private, copies = Path(pid_file).parent, Path(sourced.env["MA_SSH_DIR"])
        assert private.parent == Path("/tmp") and copies == private / "ssh"  # TMPDIR and MA_HOME: not plain
        for config in (private / "sshd_config", copies / "config"):
            text = config.read_text()
            assert "my home" not in text and "line two" not in text, text
        assert f"AuthorizedKeysFile {copies}/authorized_keys" in (private / "sshd_config").read_text()
        assert (copies / "config").read_text().startswith(f"IdentityFile {copies}/id_ed25519\n")
        with socket.create_connection(("127.0.0.1", int(env["MY_SSHD_PORT"])), timeout=30) as connection:
            assert connection.recv(64).startswith(b"SSH-2.0-")  # sshd took its config
        assert "its path has characters sshd's and ssh's config files cannot take" in sourced.stderr
        assert not list(shared_dir.rglob("pwned"))
    finally:
        if pid_file:
            stop_sshd(pid_file)
            shutil.rmtree(Path(pid_file).parent, ignore_errors=True)


@pytest.mark.skipif(os.path.exists("/usr/sbin/sshd") or shutil.which("sshd", path="/usr/bin:/bin"),
                    reason="sshd is installed here")
def test_mpi_sshd_without_sshd_stops_the_job_with_one_line(tmp_path, empty_hook_baseline):
    env = {**base_env(tmp_path), "MA_HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path)}
    sourced = source(SSHD, env, tmp_path)
    assert sourced.status == 1
    assert sourced.stderr.splitlines() == [
        "[mpi-sshd] sshd not found on PATH or at /usr/sbin/sshd: install OpenSSH's server in the image"
        " (Debian/Ubuntu: openssh-server; EulerOS/CentOS: openssh-server)"]
    assert not list(tmp_path.glob("ma-sshd.*"))  # nothing made before failing
    assert_leaves_nothing_behind(sourced, empty_hook_baseline(env))


@pytest.mark.parametrize("port", ["ssh", "0", "65536", "-1", "22 23", "99999999999999999999"])
def test_mpi_sshd_refuses_a_port_that_is_not_one(tmp_path, empty_hook_baseline, port):
    env = {**base_env(tmp_path), "MY_SSHD_PORT": port, "TMPDIR": str(tmp_path)}
    sourced = source(SSHD, env, tmp_path)
    assert sourced.status == 1
    assert sourced.stderr.splitlines() == [
        f"[mpi-sshd] MY_SSHD_PORT={port} is not a port number: set it to a number from 1 to 65535"]
    assert_leaves_nothing_behind(sourced, empty_hook_baseline(env))


# --- together --------------------------------------------------------------------------------------------------

def parse_env_file(data: bytes) -> dict:
    """The MA_HOOK_ENV_FILE format, as GitHub Actions reads $GITHUB_ENV: NAME=value, or NAME<<DELIM ... DELIM."""
    lines, parsed, at = data.split(b"\n"), {}, 0
    assert lines[-1] == b"", "the file ends with a line break"
    while at < len(lines) - 1:
        line = lines[at]
        if b"<<" in line and (b"=" not in line or line.index(b"<<") < line.index(b"=")):
            name, delimiter = line.split(b"<<", 1)
            end = lines.index(delimiter, at + 1)
            parsed[name.decode()] = b"\n".join(lines[at + 1:end])
            at = end + 1
        else:
            name, value = line.split(b"=", 1)
            parsed[name.decode()] = value
            at += 1
    return parsed


def test_the_examples_compose_as_hooks_readme_shows(tmp_path, cann_env):
    code = tmp_path / "code"
    code.mkdir()
    shutil.copy(ASCEND, code / "ascend-pre-start.sh")
    # A .py of the job's own beside it, passing a variable through the env file the .sh receives too.
    (code / "my-pre-start.py").write_text('import os\n'
                                          'open(os.environ["MA_HOOK_ENV_FILE"], "a").write("MY_SETTING=on\\n")\n')
    (code / "ma-pre-start.sh").write_text(". ./ascend-pre-start.sh || return 1\n"
                                          "python3 ./my-pre-start.py || return 1\n")
    env_file = tmp_path / "hook.env"
    env = {**cann_env, "PATH": f"{Path(sys.executable).parent}:{cann_env['PATH']}", "MA_HOOK_ENV_FILE": str(env_file)}
    sourced = source(code / "ma-pre-start.sh", env, code)
    assert sourced.status == 0, sourced.stderr
    assert {name: sourced.env[name] for name in ASCEND_DEFAULTS} == ASCEND_DEFAULTS
    assert parse_env_file(env_file.read_bytes()) == {"MY_SETTING": b"on"}
    del env["ASCEND_TOOLKIT_HOME"], env["ASCEND_HOME_PATH"]
    env_file.unlink()
    failed = source(code / "ma-pre-start.sh", env, code)
    assert failed.status == 1 and not env_file.exists()  # the first failure stops the rest
