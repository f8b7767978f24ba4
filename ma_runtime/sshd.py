"""The sshd of a multi-node mpirun job: one per node, started by the runtime as the job's service.

mpirun on worker-0 starts its daemons (orted) on the other nodes over ssh, so every node runs an sshd on
MY_SSHD_PORT (36666, the platform's run_mpi.sh default). The runtime starts it once per run, after the hooks
(their PATH applies), as the job's service (`children.start_service`): no process of the command's, alive across
restarts, swept with everything else when the run ends (which is how the other nodes learn that worker-0's run
ended: launch/mpirun.py). The job's user runs it: a non-root sshd lets that user alone log in.

Everything lives in one private folder of this node (0700), `folder(spec)`, under the runtime's state folder:
- `sshd_config`: the runtime's lines first, since sshd keeps the first value it reads for most keywords, then
  a copy of `${MA_HOME}/etc/ssh/sshd_config` (the MPI images' convention) with `{{MY_SSHD_PORT}}` replaced
  (the image's file is never edited). The runtime's: the pid file here; UsePAM no and StrictModes no (a
  non-root sshd has no PAM; the keys are the runtime's copies); the copied authorized_keys; a host key
  generated for this node when missing (a non-root sshd cannot read /etc/ssh's); keys only; LogLevel FATAL,
  since every other node probes worker-0's sshd once a second and sshd logs two lines for each probe at any
  lower level (INFO with MA_RUNTIME_LOG_LEVEL=debug, to see logins fail).
- `ssh/`: copies of the job's trust files from `${MA_HOME}/.ssh`, where the platform's "generate SSH trust
  files" option puts authorized_keys, id_rsa, id_rsa.pub and config, each 0600: ssh refuses a private key
  others can read, the mounted ones are often read-only with other modes, and a copy it owns is never refused.
- `ssh_config`, what mpirun's ssh reads (`-F`): no host-key check (each node's host key is made when it
  starts, so none can be known beforehand; the trust is in the job's keys), never a prompt, the copied keys,
  then the job's own config.
- `hostfile`, written by the run from mpirun's plan.

sshd runs in the foreground (-D -e): its lines reach the console and the task log prefixed `[sshd] `. The
runtime waits, bounded, for its pid file (written once the port is bound), or stops with 78 and sshd's last line.
"""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

from ma_runtime import children
from ma_runtime.errors import ConfigError
from ma_runtime.files import NotAFile, read_regular, write_atomically

PLACEHOLDER = "{{MY_SSHD_PORT}}"
_FILE_LIMIT = 1 << 20  # a trust file or a config is a few KiB
_START_SECONDS = 10.0  # far beyond what binding a port takes
_KEYGEN_SECONDS = 60.0
_POLL = 0.02
_PRIVATE_KEY_PREFIX = "id_"
_running: List[object] = []  # the sshd Workers: kept, so that no Popen is collected and polled by subprocess


def folder(spec) -> Path:
    """This node's private folder (its name says which node: the state folder may be shared)."""
    return spec.state_dir / f"mpi-{spec.task_name}-{spec.task_index}"


def client_config(spec) -> Path:
    return folder(spec) / "ssh_config"


def trust_folder(spec) -> Path:
    return spec.ma_home / ".ssh"


def start(spec, environ: Mapping[str, str], log, stopped, sinks: Sequence[object], client: bool) -> None:
    """Starts this node's sshd and returns once it listens. `client`: this node also runs mpirun's ssh, so it
    needs a private key (the others need authorized_keys). Raises ConfigError (78)."""
    sshd, keygen = _program(environ, "sshd", "/usr/sbin/sshd"), _program(environ, "ssh-keygen", "/usr/bin/ssh-keygen")
    home = _private_folder(folder(spec))
    keys = _copy_trust(trust_folder(spec), home / "ssh", log)
    _check_trust(spec, keys, client)
    host_key = _host_key(home / "ssh_host_ed25519_key", keygen)
    config = home / "sshd_config"
    _write(config, _sshd_config(spec, home, host_key))
    _write(client_config(spec), _client_config(home / "ssh", keys))
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # its privilege separation folder, made at boot only
    pid_file = home / "sshd.pid"
    _remove(pid_file)  # an earlier run's would read as started
    worker = _spawn([sshd, "-D", "-e", "-f", str(config), "-p", str(spec.sshd_port)], environ, home, sinks)
    why = _wait_started(worker, pid_file, stopped)
    if why:
        _stop(worker)
        raise ConfigError(f"sshd did not start on port {spec.sshd_port}: {why}",
                          hint="another process may use MY_SSHD_PORT (an sshd of the pre-start hook?): set another "
                               f"port, or fix {spec.ma_home / 'etc' / 'ssh' / 'sshd_config'}; sshd's lines are in "
                               "the task log, prefixed [sshd]")
    log.info("sshd listens", port=spec.sshd_port, pid=worker.pid, config=str(config),
             trust=str(trust_folder(spec)), keys=keys)


def _program(environ: Mapping[str, str], name: str, usual: str) -> str:
    """Its absolute path (sshd re-executes itself, so it needs one): on the job's PATH, else where Debian puts it
    (/usr/sbin is often missing from a non-root PATH)."""
    found = shutil.which(name, path=environ.get("PATH", os.defpath))
    if found and os.path.isabs(found):
        return found
    if os.access(usual, os.X_OK):
        return usual
    raise ConfigError(f"mpirun across nodes needs OpenSSH's {name}, and it is neither on PATH nor at {usual}",
                      hint="install it in the image: openssh-server and openssh-client (Debian, Ubuntu, EulerOS)")


def _private_folder(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o700)  # keys inside
    except OSError as exc:
        raise ConfigError(f"cannot make sshd's folder {path}: {exc.strerror or exc}",
                          hint="a multi-node mpirun job needs a writable MA_MOUNT_PATH (the runtime's state "
                               "folder is in it)") from None
    return path


def _copy_trust(source: Path, target: Path, log) -> List[str]:
    """Every regular file of `source` (links followed: a Kubernetes secret volume holds links into `..data`),
    copied into `target`, recreated, each 0600. Returns their names."""
    shutil.rmtree(target, ignore_errors=True)
    try:
        target.mkdir(mode=0o700)
        names = sorted(os.listdir(source))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ConfigError(f"cannot read the trust files in {source}: {exc.strerror or exc}",
                          hint="the job's user must be able to read it") from None
    copied = []
    for name in names:
        if name.startswith("."):
            continue
        try:
            data = read_regular(source / name, _FILE_LIMIT)
            if data is not None:
                write_atomically(target / name, data, mode=0o600)
                copied.append(name)
        except NotAFile:
            continue  # a folder
        except OSError as exc:
            log.warning("trust file not copied", path=str(source / name), error=exc.strerror or str(exc))
    return copied


def private_keys(names: Sequence[str]) -> List[str]:
    return [name for name in names if name.startswith(_PRIVATE_KEY_PREFIX) and not name.endswith(".pub")]


def _check_trust(spec, names: Sequence[str], client: bool) -> None:
    """Worker-0 logs in to the others with a private key; they accept it by their authorized_keys."""
    missing = ("a private key (id_rsa, id_ed25519, ...)" if client and not private_keys(names) else
               "authorized_keys" if not client and "authorized_keys" not in names else None)
    if missing:
        raise ConfigError(f"mpirun across nodes needs the job's SSH trust files in {trust_folder(spec)}, and it "
                          f"has no {missing}",
                          hint="turn on the training job's \"generate SSH trust files\" option (it mounts "
                               "authorized_keys, id_rsa, id_rsa.pub and config there), or build the same files "
                               "into the image")


def _host_key(path: Path, keygen: str) -> Path:
    """This node's host key, made once per pod."""
    if path.is_file():
        return path
    argv = [keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(path)]
    with children.owned(lambda: subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT)) as proc:
        try:
            output, _ = proc.communicate(timeout=_KEYGEN_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
    if proc.returncode != 0 or not path.is_file():
        last = output.decode(errors="replace").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise ConfigError(f"cannot make sshd's host key {path}: {last[0]}", hint="check that ssh-keygen works")
    return path


def _sshd_config(spec, home: Path, host_key: Path) -> str:
    lines = [
        "# Written by ma-runtime for this node's sshd. sshd keeps the first value it reads for most keywords:",
        "# these lines come before the image's own config.",
        f"PidFile {home / 'sshd.pid'}",
        "UsePAM no",
        "StrictModes no",
        f"AuthorizedKeysFile {home / 'ssh' / 'authorized_keys'}",
        f"HostKey {host_key}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "ChallengeResponseAuthentication no",
        f"LogLevel {'INFO' if spec.log_level == 'debug' else 'FATAL'}",
    ]
    image = spec.ma_home / "etc" / "ssh" / "sshd_config"
    text = _read(image)
    if text is not None:
        lines += [f"# {image}, its {PLACEHOLDER} replaced:", text.replace(PLACEHOLDER, str(spec.sshd_port))]
    return "\n".join(lines) + "\n"


def _client_config(trust: Path, names: Sequence[str]) -> str:
    lines = [
        "# Written by ma-runtime: what mpirun's ssh reads (-F). Each node's host key is made when it starts, so",
        "# none is known beforehand: the trust is in the job's keys.",
        "StrictHostKeyChecking no",
        "UserKnownHostsFile /dev/null",
        "BatchMode yes",
        "LogLevel ERROR",
        "ConnectTimeout 30",
        *(f"IdentityFile {trust / name}" for name in private_keys(names)),
    ]
    if "config" in names:
        lines += [f"# {trust / 'config'}:", (trust / "config").read_text(errors="replace")]
    return "\n".join(lines) + "\n"


def _read(path: Path) -> Optional[str]:
    try:
        data = read_regular(path, _FILE_LIMIT)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}",
                          hint="it must be a readable file of sshd's configuration") from None
    return None if data is None else data.decode("utf-8", "replace")


def _write(path: Path, text: str) -> None:
    try:
        write_atomically(path, text, mode=0o600)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}",
                          hint="a multi-node mpirun job needs a writable MA_MOUNT_PATH") from None


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _spawn(argv: Sequence[str], environ: Mapping[str, str], home: Path, sinks: Sequence[object]):
    """sshd as the job's service, in the environment of nothing but PATH and the run's lineage (the guard's mark):
    its sessions start from their own anyway, and it needs none of the job's variables."""
    from ma_runtime.supervise.guard import LINEAGE_ENV
    from ma_runtime.supervise.worker import spawn

    env = {name: environ[name] for name in ("PATH", LINEAGE_ENV) if name in environ}
    worker = children.start_service(lambda: spawn(argv, env, str(home), list(sinks), list(sinks), name="sshd",
                                                  console_prefix=b"[sshd] "))
    _running.append(worker)
    return worker


def _wait_started(worker, pid_file: Path, stopped) -> str:
    """"" once sshd has written its pid file, else why not."""
    deadline = time.monotonic() + _START_SECONDS
    while not stopped.is_set():
        code = worker.popen.poll()
        if code is not None:
            worker.join_output(1.0)
            return _last_line(worker) or f"it exited with code {code}"
        if _pid_in(pid_file) == worker.pid:
            return ""
        if time.monotonic() >= deadline:
            return f"no pid file after {_START_SECONDS:g} s"
        time.sleep(_POLL)
    return ""  # the run is stopping: the caller has seen the signal


def _pid_in(path: Path) -> Optional[int]:
    try:
        return int((read_regular(path, 64) or b"").strip() or 0)
    except (OSError, ValueError):
        return None


def _last_line(worker) -> str:
    from ma_runtime.output import tail_of

    lines = [line.strip() for line in tail_of(worker.pumps, 5, prefer=worker.stderr_pump) if line.strip()]
    return lines[-1] if lines else ""


def _stop(worker) -> None:
    worker.signal_group(signal.SIGKILL)
    try:
        worker.popen.wait(5)
    except subprocess.TimeoutExpired:
        pass
