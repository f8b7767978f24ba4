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
  Without them, keys made for the job (`_job_key`, sshd_key.py): worker-0, lacking a private key, makes an ed25519 pair
  there (`id_job_ed25519`), adds its public half to its authorized_keys and serves that public half, and
  nothing else, on MA_RUNTIME_MPI_KEY_PORT (default MY_SSHD_PORT + 1) from a key server, the job's service
  like sshd (`python -m ma_runtime.launch.sshd_key --serve-public-key`); every other node lacking authorized_keys
  fetches it from there (`sshd_key.fetch_job_key`, waiting like peers.reach_all) before its sshd starts. The trust:
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

This module starts and stops the services (sshd, the key server) and holds the order of `start`; the folder, the
trust files, the config files and the keys are sshd_files.py; the job's key served and fetched is sshd_key.py.
"""

import os
import shutil
import signal
import sys
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

from ma_runtime.errors import ConfigError
from ma_runtime.launch import sshd_files, sshd_key
from ma_runtime.process import children, lifecycle
from ma_runtime.util.files import read_regular

_START_SECONDS = 10.0  # far beyond what binding a port takes
_POLL = 0.02
_running: List[object] = []  # the sshd Workers: kept, so that no Popen is collected and polled by subprocess


def start(spec, environ: Mapping[str, str], log, stopped, sinks: Sequence[object], client: bool,
          worker_0: str) -> None:
    """Starts this node's sshd and returns once it listens (or once `stopped` is set). `client`: this node also
    runs mpirun's ssh, so it needs a private key (the others need authorized_keys): without mounted ones, it
    makes and serves the job's key; the others fetch it from `worker_0`. Raises ConfigError (78),
    LaunchTimedOut (81)."""
    sshd, keygen = _program(environ, "sshd", "/usr/sbin/sshd"), _program(environ, "ssh-keygen", "/usr/bin/ssh-keygen")
    home = sshd_files.private_folder(sshd_files.folder(spec))
    named = sshd_files.link(home, sshd_files.named_folder(spec))
    keys = sshd_files.copy_trust(sshd_files.trust_folder(spec), home / "ssh", log)
    if client and not sshd_files.private_keys(keys):
        keys = _job_key(spec, home, keys, keygen, environ, log, stopped, sinks)
    elif not client and sshd_files.AUTHORIZED not in keys:
        public = sshd_key.fetch_job_key(spec, worker_0, log, stopped)
        if public is None:
            return  # the run is stopping: the caller has seen the signal
        sshd_files.write_private(home / "ssh" / sshd_files.AUTHORIZED, public.decode())
        log.info("authorized worker-0's public key", host=worker_0, port=sshd_key.key_port(spec))
        keys = sorted([*keys, sshd_files.AUTHORIZED])
    if stopped.is_set():
        return
    sshd_files.keygen(home / "ssh_host_ed25519_key", keygen, "sshd's host key")
    config = home / "sshd_config"
    sshd_files.write_private(config, sshd_files.sshd_config_text(spec, named))
    client_config = sshd_files.ssh_config_text(named / "ssh", sshd_files.named_keys(keys, log))
    sshd_files.write_private(home / "ssh_config", client_config)
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # its privilege separation folder, made at boot only
    pid_file = home / "sshd.pid"
    sshd_files.remove(pid_file)  # an earlier run's would read as started
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
             trust=str(sshd_files.trust_folder(spec)), keys=keys)


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


def _job_key(spec, home: Path, keys: Sequence[str], keygen: str, environ: Mapping[str, str], log, stopped,
             sinks: Sequence[object]) -> List[str]:
    """Worker-0 without a mounted private key: a key pair made for this run, its public half authorized here
    too (after the mounted authorized_keys, if any) and served to the other nodes. Returns the trust files'
    names."""
    trust = home / "ssh"
    sshd_files.keygen(trust / sshd_key.JOB_KEY, keygen, "the job's key", comment="ma-runtime-job")
    public = sshd_key.public_key(read_regular(trust / f"{sshd_key.JOB_KEY}.pub", sshd_key.KEY_LIMIT) or b"")
    if public is None:
        raise ConfigError(f"ssh-keygen made no ed25519 public key in {trust / (sshd_key.JOB_KEY + '.pub')}",
                          hint="check that the image's ssh-keygen is OpenSSH's")
    mounted = sshd_files.read_config(trust / sshd_files.AUTHORIZED) or ""
    separator = "\n" if mounted and not mounted.endswith("\n") else ""
    sshd_files.write_private(trust / sshd_files.AUTHORIZED, mounted + separator + public.decode())
    port = sshd_key.key_port(spec)
    _serve_public_key(trust / f"{sshd_key.JOB_KEY}.pub", port, environ, home, stopped, sinks)
    log.info("serving the job's public key", port=port, path=str(trust / f"{sshd_key.JOB_KEY}.pub"))
    return sorted({*keys, sshd_key.JOB_KEY, f"{sshd_key.JOB_KEY}.pub", sshd_files.AUTHORIZED})


def _serve_public_key(public: Path, port: int, environ: Mapping[str, str], home: Path, stopped,
                      sinks: Sequence[object]) -> None:
    """The key server, as the job's service (like sshd); returns once it listens, else ConfigError (78)."""
    pid_file = home / "key-server.pid"
    sshd_files.remove(pid_file)
    isolated = ["-I"] if sys.flags.isolated else []  # the runtime's own interpreter, isolated when it is
    argv = [sys.executable, *isolated, "-m", sshd_key.__name__, "--serve-public-key", str(public), "--port", str(port),
            "--pid-file", str(pid_file)]
    worker = _spawn(argv, environ, home, sinks, "key server")
    why = _wait_started(worker, pid_file, stopped)
    if why:
        _stop(worker)
        raise ConfigError(f"the job's key server did not start on port {port}: {why}",
                          hint="another process may use MA_RUNTIME_MPI_KEY_PORT (default MY_SSHD_PORT + 1): set "
                               "another port, the same on every node; or mount the job's SSH trust files (the "
                               "\"generate SSH trust files\" option)")


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
    """"" once sshd has written its pid file (or the run stops), else why not."""
    return children.wait_started(worker, lambda: _pid_in(pid_file) == worker.pid, _START_SECONDS,
                                 f"no pid file after {_START_SECONDS:g} s", stopped, poll=_POLL)


def _pid_in(path: Path) -> Optional[int]:
    try:
        return int((read_regular(path, 64) or b"").strip() or 0)
    except (OSError, ValueError):
        return None


def _stop(worker) -> None:
    worker.signal_group(signal.SIGKILL)
    lifecycle.wait(worker.popen, 5)

