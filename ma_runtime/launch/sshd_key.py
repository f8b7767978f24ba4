"""The job's SSH key, when none is mounted: the port it is served on, the key server, and its fetch.

Worker-0, lacking a mounted private key, makes an ed25519 pair (sshd.py) and serves its public half, and
nothing else, on MA_RUNTIME_MPI_KEY_PORT (default MY_SSHD_PORT + 1) from the key server, the job's service like
sshd: `python -m ma_runtime.launch.sshd_key --serve-public-key FILE --port N --pid-file FILE`. Every other node
lacking authorized_keys fetches it from there (`fetch_job_key`, waiting like peers.reach_all) before its sshd
starts. Both ends accept one OpenSSH ed25519 public key line with a printable comment, at most KEY_LIMIT
bytes (`public_key`), and nothing else.
"""

import argparse
import base64
import binascii
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from ma_runtime.errors import ConfigError, ExitCode, LaunchTimedOut
from ma_runtime.util.files import read_regular, write_atomically

JOB_KEY = "id_job_ed25519"  # worker-0's key made for the job: an `id_` name, so ssh_config names it
# What the key server serves and a node accepts: one OpenSSH ed25519 public key line, printable comment.
_PUBLIC_KEY = re.compile(rb"ssh-ed25519 ([A-Za-z0-9+/]+={0,2})( [\x20-\x7e]*)?\n?\Z")
_ED25519_BLOB = b"\x00\x00\x00\x0bssh-ed25519"  # how the base64 part of a real one begins
KEY_LIMIT = 4096  # an ed25519 public key line is about 100 bytes
_SEND_SECONDS = 5.0  # the key server's bound per connection


def key_port(spec) -> int:
    """Where worker-0 serves the job's public key: MA_RUNTIME_MPI_KEY_PORT, else MY_SSHD_PORT + 1 (- 1 at the
    top of the range)."""
    port = spec.mpi_key_port or (spec.sshd_port + 1 if spec.sshd_port < 65535 else spec.sshd_port - 1)
    if port == spec.sshd_port:
        raise ConfigError(f"MA_RUNTIME_MPI_KEY_PORT={port} is MY_SSHD_PORT's port",
                          hint="give the key server a port of its own, the same on every node")
    return port


def fetch_job_key(spec, host: str, log, stopped) -> Optional[bytes]:
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
    """Everything the port sent until it closed, at most KEY_LIMIT + 1 bytes."""
    answer = b""
    while len(answer) <= KEY_LIMIT:
        chunk = connection.recv(KEY_LIMIT + 1 - len(answer))
        if not chunk:
            break
        answer += chunk
    return answer


def _checked_answer(answer: bytes, host: str, port: int) -> bytes:
    public = public_key(answer)
    if public is None:
        raise ConfigError(f"worker-0 ({host}) answered on port {port} with something other than the job's public "
                          f"key (one 'ssh-ed25519 <base64> [comment]' line, {len(answer)} bytes received)",
                          hint="another program may listen on MA_RUNTIME_MPI_KEY_PORT (default MY_SSHD_PORT + 1) "
                               "on worker-0: set another port, the same on every node")
    return public


def public_key(data: bytes) -> Optional[bytes]:
    """`data` as one newline-ended line when it is one ed25519 public key line, else None."""
    match = _PUBLIC_KEY.match(data) if len(data) <= KEY_LIMIT else None  # a longer one was cut off
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
        public = public_key(read_regular(path, KEY_LIMIT) or b"")
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


if __name__ == "__main__":
    sys.exit(main())
