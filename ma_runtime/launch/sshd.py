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
  Without them, keys made for the job (`_job_key`): worker-0, lacking a private key, makes an ed25519 pair
  there (`id_job_ed25519`), adds its public half to its authorized_keys and serves that public half, and
  nothing else, on MA_RUNTIME_MPI_KEY_PORT (default MY_SSHD_PORT + 1) from a key server, the job's service
  like sshd (`python -m ma_runtime.launch.sshd --serve-public-key`); every other node lacking authorized_keys
  fetches it from there (`_fetch_job_key`, waiting like peers.reach_all) before its sshd starts. The trust:
  the key served by the host named worker-0, i.e. the cluster's DNS, what ssh without host-key checks
  already trusts; the private key never leaves worker-0. Mounted files win: nothing is made or fetched for
  what they provide.
- `ssh_config`, what mpirun's ssh reads (`-F`): no host-key check (each node's host key is made when it
  starts, so none can be known beforehand; the trust is in the job's keys), never a prompt, the copied keys,
  then the job's own config.
- `hostfile`, written by the run from mpirun's plan.

Every path the runtime writes into sshd's and ssh's config files and into mpirun's `plm_rsh_args` names this
folder as `named_folder(spec)`: the folder itself when its path holds only plain characters (letters, digits,
`_./+,:@-`), else a link to it, `/tmp/ma-runtime-<uid>-<hash of the folder's path>`, made by `start`. None of
those consumers can take a space or a shell character in a path: Open MPI splits `plm_rsh_args` at every space
(no quoting) and quotes it again into orted's remote shell command; OpenSSH's config files split words at spaces
and quotes (old versions know no escape), expand `%` tokens and `${VAR}`, and AuthorizedKeysFile takes several
files. So `MA_HOME` (`MA_MOUNT_PATH`) may hold any character, a newline included. A trust file whose own name is
not plain is copied but not named in `ssh_config` (a warning says so).

sshd runs in the foreground (-D -e): its lines reach the console and the task log prefixed `[sshd] `. The
runtime waits, bounded, for its pid file (written once the port is bound), or stops with 78 and sshd's last line.
"""

import argparse
import base64
import binascii
import errno
import hashlib
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

from ma_runtime.errors import ConfigError, ExitCode, LaunchTimedOut, too_large_for_exec
from ma_runtime.process import children, lifecycle
from ma_runtime.util.files import NotAFile, read_regular, write_atomically

PLACEHOLDER = "{{MY_SSHD_PORT}}"
_FILE_LIMIT = 1 << 20  # a trust file or a config is a few KiB
_START_SECONDS = 10.0  # far beyond what binding a port takes
_KEYGEN_SECONDS = 60.0
_POLL = 0.02
_PRIVATE_KEY_PREFIX = "id_"
_JOB_KEY = "id_job_ed25519"  # worker-0's key made for the job: an `id_` name, so ssh_config names it
AUTHORIZED = "authorized_keys"
# What the key server serves and a node accepts: one OpenSSH ed25519 public key line, printable comment.
_PUBLIC_KEY = re.compile(rb"ssh-ed25519 ([A-Za-z0-9+/]+={0,2})( [\x20-\x7e]*)?\n?\Z")
_ED25519_BLOB = b"\x00\x00\x00\x0bssh-ed25519"  # how the base64 part of a real one begins
_KEY_LIMIT = 4096  # an ed25519 public key line is about 100 bytes
_SEND_SECONDS = 5.0  # the key server's bound per connection
_running: List[object] = []  # the sshd Workers: kept, so that no Popen is collected and polled by subprocess
# A path these characters make up reaches Open MPI's and OpenSSH's words as it is (module docstring); `=` is out
# too: old OpenSSH splits a config line at an `=` as at a space.
_PLAIN = re.compile(r"[A-Za-z0-9_./+,:@-]+\Z")
_LINKS = Path("/tmp")  # where the link to a folder whose path is not plain goes


def folder(spec) -> Path:
    """This node's private folder (its name says which node: the state folder may be shared)."""
    return spec.state_dir / f"mpi-{spec.task_name}-{spec.task_index}"


def named_folder(spec) -> Path:
    """The folder as ssh's and Open MPI's words name it: itself when its path is plain, else the link `start` makes
    to it in /tmp, named after the uid and the folder's path (the same folder gets the same link every run)."""
    real = folder(spec)
    if is_plain(str(real)):
        return real
    digest = hashlib.sha256(os.fsencode(str(real))).hexdigest()[:16]
    return _LINKS / f"ma-runtime-{os.geteuid()}-{digest}"


def is_plain(text: str) -> bool:
    return bool(_PLAIN.match(text))


def client_config(spec) -> Path:
    """What mpirun's ssh reads (`-F`), as plm_rsh_args names it."""
    return named_folder(spec) / "ssh_config"


def trust_folder(spec) -> Path:
    return spec.ma_home / ".ssh"


def key_port(spec) -> int:
    """Where worker-0 serves the job's public key: MA_RUNTIME_MPI_KEY_PORT, else MY_SSHD_PORT + 1 (- 1 at the
    top of the range)."""
    port = spec.mpi_key_port or (spec.sshd_port + 1 if spec.sshd_port < 65535 else spec.sshd_port - 1)
    if port == spec.sshd_port:
        raise ConfigError(f"MA_RUNTIME_MPI_KEY_PORT={port} is MY_SSHD_PORT's port",
                          hint="give the key server a port of its own, the same on every node")
    return port


def start(spec, environ: Mapping[str, str], log, stopped, sinks: Sequence[object], client: bool,
          worker_0: str) -> None:
    """Starts this node's sshd and returns once it listens (or once `stopped` is set). `client`: this node also
    runs mpirun's ssh, so it needs a private key (the others need authorized_keys): without mounted ones, it
    makes and serves the job's key; the others fetch it from `worker_0`. Raises ConfigError (78),
    LaunchTimedOut (81)."""
    sshd, keygen = _program(environ, "sshd", "/usr/sbin/sshd"), _program(environ, "ssh-keygen", "/usr/bin/ssh-keygen")
    home = _private_folder(folder(spec))
    named = _link(home, named_folder(spec))
    keys = _copy_trust(trust_folder(spec), home / "ssh", log)
    if client and not private_keys(keys):
        keys = _job_key(spec, home, keys, keygen, environ, log, stopped, sinks)
    elif not client and AUTHORIZED not in keys:
        public = _fetch_job_key(spec, worker_0, log, stopped)
        if public is None:
            return  # the run is stopping: the caller has seen the signal
        _write(home / "ssh" / AUTHORIZED, public.decode())
        log.info("authorized worker-0's public key", host=worker_0, port=key_port(spec))
        keys = sorted([*keys, AUTHORIZED])
    if stopped.is_set():
        return
    _keygen(home / "ssh_host_ed25519_key", keygen, "sshd's host key")
    config = home / "sshd_config"
    _write(config, _sshd_config(spec, named))
    _write(home / "ssh_config", _client_config(named / "ssh", _named_keys(keys, log)))
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # its privilege separation folder, made at boot only
    pid_file = home / "sshd.pid"
    _remove(pid_file)  # an earlier run's would read as started
    worker = _spawn([sshd, "-D", "-e", "-f", str(config), "-p", str(spec.sshd_port)], environ, home, sinks,
                    "sshd")
    why = _wait_started(worker, pid_file, stopped)
    if why:
        _stop(worker)
        raise ConfigError(f"sshd did not start on port {spec.sshd_port}: {why}",
                          hint="another process may use MY_SSHD_PORT (an sshd of the pre-start hook?): set another "
                               f"port, or fix {spec.ma_home / 'etc' / 'ssh' / 'sshd_config'}; sshd's lines are in "
                               "the task log, prefixed [sshd]")
    log.info("sshd listens", port=spec.sshd_port, pid=worker.pid, config=str(config),
             trust=str(trust_folder(spec)), keys=keys)


def _link(real: Path, named: Path) -> Path:
    """`named`, once it leads to `real`: the link made, or found made by this uid for this folder; ConfigError (78)
    when something else has the name or the link cannot be made. /tmp is sticky: a link we own stays ours."""
    if named == real:
        return named
    try:
        os.symlink(real, named)
        return named
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot link {named} to sshd's folder: {exc.strerror or exc}", hint=_LINK_HINT) from None
    try:
        found = os.lstat(named)
        ours = stat.S_ISLNK(found.st_mode) and found.st_uid == os.geteuid() and os.readlink(named) == str(real)
    except OSError:
        ours = False
    if not ours:
        raise ConfigError(f"{named} exists and is not this runtime's link to sshd's folder {str(real)!r}",
                          hint=f"remove {named}; " + _LINK_HINT)
    return named


# Why the link, and the way around it.
_LINK_HINT = ("the folder's path (under MA_MOUNT_PATH) has characters Open MPI and ssh cannot take in their options, "
              "so the runtime names it through a link in /tmp; /tmp must be writable, or give MA_MOUNT_PATH a path of "
              "letters, digits and _./+,:@- only")


def _named_keys(names: Sequence[str], log) -> List[str]:
    """The trust files whose names ssh_config can hold as they are; the others are left out, with a warning."""
    for name in names:
        if not is_plain(name):
            log.warning("trust file not named in ssh_config: its name has characters ssh_config would take apart",
                        name=name, hint="rename it, e.g. id_rsa")
    return [name for name in names if is_plain(name)]


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


# --------------------------------------------------------------------------- the job's key, when none is mounted


def _job_key(spec, home: Path, keys: Sequence[str], keygen: str, environ: Mapping[str, str], log, stopped,
             sinks: Sequence[object]) -> List[str]:
    """Worker-0 without a mounted private key: a key pair made for this run, its public half authorized here
    too (after the mounted authorized_keys, if any) and served to the other nodes. Returns the trust files'
    names."""
    trust = home / "ssh"
    _keygen(trust / _JOB_KEY, keygen, "the job's key", comment="ma-runtime-job")
    public = _public_key(read_regular(trust / f"{_JOB_KEY}.pub", _KEY_LIMIT) or b"")
    if public is None:
        raise ConfigError(f"ssh-keygen made no ed25519 public key in {trust / (_JOB_KEY + '.pub')}",
                          hint="check that the image's ssh-keygen is OpenSSH's")
    mounted = _read(trust / AUTHORIZED) or ""
    _write(trust / AUTHORIZED, mounted + ("\n" if mounted and not mounted.endswith("\n") else "") + public.decode())
    port = key_port(spec)
    _serve_public_key(trust / f"{_JOB_KEY}.pub", port, environ, home, stopped, sinks)
    log.info("serving the job's public key", port=port, path=str(trust / f"{_JOB_KEY}.pub"))
    return sorted({*keys, _JOB_KEY, f"{_JOB_KEY}.pub", AUTHORIZED})


def _serve_public_key(public: Path, port: int, environ: Mapping[str, str], home: Path, stopped,
                      sinks: Sequence[object]) -> None:
    """The key server, as the job's service (like sshd); returns once it listens, else ConfigError (78)."""
    pid_file = home / "key-server.pid"
    _remove(pid_file)
    isolated = ["-I"] if sys.flags.isolated else []  # the runtime's own interpreter, isolated when it is
    argv = [sys.executable, *isolated, "-m", __name__, "--serve-public-key", str(public), "--port", str(port),
            "--pid-file", str(pid_file)]
    worker = _spawn(argv, environ, home, sinks, "key server")
    why = _wait_started(worker, pid_file, stopped)
    if why:
        _stop(worker)
        raise ConfigError(f"the job's key server did not start on port {port}: {why}",
                          hint="another process may use MA_RUNTIME_MPI_KEY_PORT (default MY_SSHD_PORT + 1): set "
                               "another port, the same on every node; or mount the job's SSH trust files (the "
                               "\"generate SSH trust files\" option)")


def _fetch_job_key(spec, host: str, log, stopped) -> Optional[bytes]:
    """The public key worker-0 serves, once it answers: waits like peers.reach_all, every wait logged,
    LaunchTimedOut (81) naming worker-0 after MA_RUNTIME_PEER_WAIT_SECONDS; ConfigError (78) for an answer
    that is not one. None when `stopped` is set meanwhile."""
    from ma_runtime.launch import peers

    port, seconds = key_port(spec), spec.peer_wait_seconds

    def timed_out(why: str) -> LaunchTimedOut:
        return LaunchTimedOut(f"worker-0 ({host}) did not serve the job's public key on port {port} within "
                              f"{seconds:g} s ({why})",
                              hint="check that its container runs and its key server started (its task log), "
                                   "VC_WORKER_HOSTS and MA_RUNTIME_MPI_KEY_PORT; or mount the job's SSH trust "
                                   "files on every node (the \"generate SSH trust files\" option); "
                                   "MA_RUNTIME_PEER_WAIT_SECONDS sets the wait")

    answer = peers.wait_until(lambda: peers.exchange(host, port, _read_all), time.monotonic() + seconds, log,
                              stopped, "waiting for worker-0's public key", timed_out, host=host, port=port)
    return None if answer is None else _checked_answer(answer, host, port)


def _read_all(connection: socket.socket) -> bytes:
    """Everything the port sent until it closed, at most _KEY_LIMIT + 1 bytes."""
    answer = b""
    while len(answer) <= _KEY_LIMIT:
        chunk = connection.recv(_KEY_LIMIT + 1 - len(answer))
        if not chunk:
            break
        answer += chunk
    return answer


def _checked_answer(answer: bytes, host: str, port: int) -> bytes:
    public = _public_key(answer)
    if public is None:
        raise ConfigError(f"worker-0 ({host}) answered on port {port} with something other than the job's public "
                          f"key (one 'ssh-ed25519 <base64> [comment]' line, {len(answer)} bytes received)",
                          hint="another program may listen on MA_RUNTIME_MPI_KEY_PORT (default MY_SSHD_PORT + 1) "
                               "on worker-0: set another port, the same on every node")
    return public


def _public_key(data: bytes) -> Optional[bytes]:
    """`data` as one newline-ended line when it is one ed25519 public key line, else None."""
    match = _PUBLIC_KEY.match(data) if len(data) <= _KEY_LIMIT else None  # a longer one was cut off
    if match is None:
        return None
    try:
        blob = base64.b64decode(match.group(1), validate=True)
    except (binascii.Error, ValueError):
        return None
    return data.rstrip(b"\n") + b"\n" if blob.startswith(_ED25519_BLOB) else None


def serve_public_key(path: Path, port: int, pid_file: Path) -> int:
    """The key server: sends the public key in `path`, checked to be one (never anything else), to whoever
    connects, then closes; one connection at a time, each bounded. Writes its pid once it listens."""
    try:
        public = _public_key(read_regular(path, _KEY_LIMIT) or b"")
    except OSError:
        public = None
    if public is None:
        _say(f"{path} is not an ed25519 public key: it is not served")
        return ExitCode.BAD_CONFIGURATION
    try:
        server = socket.create_server(("", port))  # IPv4, as the other nodes resolve worker-0 (peers.probe)
    except OSError as exc:
        _say(f"cannot listen on port {port}: {exc.strerror or exc}")
        return ExitCode.BAD_CONFIGURATION
    with server:
        write_atomically(pid_file, f"{os.getpid()}\n", mode=0o600)
        while True:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(_SEND_SECONDS)
                try:
                    conn.sendall(public)
                except OSError:
                    pass  # that peer's problem: it asks again


def _say(text: str) -> None:
    sys.stderr.write(f"ma-runtime: {text}\n")
    sys.stderr.flush()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("--serve-public-key", type=Path, required=True, metavar="FILE")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pid-file", type=Path, required=True)
    args = parser.parse_args(argv)
    return serve_public_key(args.serve_public_key, args.port, args.pid_file)


# --------------------------------------------------------------------------- files


def _keygen(path: Path, keygen: str, what: str, comment: Optional[str] = None) -> Path:
    """An ed25519 key pair at `path` (and `path`.pub), unless one is there: the host key, made once per pod."""
    if path.is_file():
        return path
    argv = [keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(path), *(["-C", comment] if comment else [])]
    try:
        with children.owned(lambda: subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                     stderr=subprocess.STDOUT)) as proc:
            try:
                output, _ = proc.communicate(timeout=_KEYGEN_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
    except OSError as exc:  # it could not be started: one line, E2BIG with the sizes
        why = too_large_for_exec(argv, os.environ) if exc.errno == errno.E2BIG else exc.strerror or str(exc)
        raise ConfigError(f"cannot make {what} {path}: cannot run {keygen}: {why}",
                          hint="check that ssh-keygen works") from None
    if proc.returncode != 0 or not path.is_file():
        last = output.decode(errors="replace").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise ConfigError(f"cannot make {what} {path}: {last[0]}", hint="check that ssh-keygen works")
    return path


def _sshd_config(spec, named: Path) -> str:
    """sshd's config; `named`: the folder as its words name it (plain)."""
    lines = [
        "# Written by ma-runtime for this node's sshd. sshd keeps the first value it reads for most keywords:",
        "# these lines come before the image's own config.",
        f"PidFile {named / 'sshd.pid'}",
        "UsePAM no",
        "StrictModes no",
        f"AuthorizedKeysFile {named / 'ssh' / 'authorized_keys'}",
        f"HostKey {named / 'ssh_host_ed25519_key'}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "ChallengeResponseAuthentication no",
        f"LogLevel {'INFO' if spec.log_level == 'debug' else 'FATAL'}",
    ]
    image = spec.ma_home / "etc" / "ssh" / "sshd_config"
    text = _read(image)
    if text is not None:
        # The path stays out of the comment: a newline in it would make the rest a config line.
        lines += [f"# ${{MA_HOME}}/etc/ssh/sshd_config, its {PLACEHOLDER} replaced:",
                  text.replace(PLACEHOLDER, str(spec.sshd_port))]
    return "\n".join(lines) + "\n"


def _client_config(trust: Path, names: Sequence[str]) -> str:
    """ssh's config; `trust`: the copied trust files' folder as its words name it (plain)."""
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


def _spawn(argv: Sequence[str], environ: Mapping[str, str], home: Path, sinks: Sequence[object], name: str):
    """sshd or the key server as the job's service, in the environment of nothing but PATH, PYTHONPATH (the
    key server's import) and the run's lineage (the guard's mark): sshd's sessions start from their own anyway,
    and neither needs the job's variables. Their lines are prefixed `[sshd] `."""
    from ma_runtime.process.worker import LINEAGE_ENV, spawn

    env = {key: environ[key] for key in ("PATH", "PYTHONPATH", LINEAGE_ENV) if key in environ}
    worker = children.start_service(lambda: spawn(argv, env, str(home), list(sinks), list(sinks), name=name,
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
    from ma_runtime.util.output import tail_of

    lines = [line.strip() for line in tail_of(worker.pumps, 5, prefer=worker.stderr_pump) if line.strip()]
    return lines[-1] if lines else ""


def _stop(worker) -> None:
    worker.signal_group(signal.SIGKILL)
    lifecycle.wait(worker.popen, 5)


if __name__ == "__main__":
    sys.exit(main())
