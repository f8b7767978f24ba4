"""The other nodes of a multi-node job: waiting until they answer, and seeing them go.

Two uses, one notion of "a node answers": its host name resolves (IPv4) and a real TCP connect to its port
succeeds. Not `ping` (absent from most images), not bash's `/dev/tcp` (the platform's run_mpi.sh got it wrong:
`[ cat < /dev/null >/dev/tcp/... ]` tests a string, never connects).

- `reach_all`, in the runtime's stage thread: worker-0 of an mpirun job waits until every node's sshd answers
  before it starts mpirun, bounded, each wait logged, 81 naming the node that never answered.
- The watcher, a program run as a plan's worker (`watcher_argv`): a node that has nothing to run by itself (an
  mpirun peer, whose ranks come through its sshd) or whose command never ends by itself (a TensorFlow parameter
  server) watches the nodes its job depends on, and ends when they are gone: an endpoint that answered once and
  then failed GONE_AFTER probes in a row, PERIOD_S apart, for at least `--gone-seconds` (a TensorFlow worker
  restarted in place closes its port for a while: that is not its end). With a command it wraps, it ends the
  command then and exits 0 (the others finished); the command's own exit decides first. It stays out of the
  signal regime: the supervisor signals the whole process group once (the command too), and the watcher then
  only waits for the command and exits with its status.
"""

import argparse
import errno
import functools
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from ma_runtime.errors import ExitCode, LaunchTimedOut, too_large_for_exec
from ma_runtime.process import lifecycle

PERIOD_S = 1.0
GONE_AFTER = 3  # probes in a row: one lost SYN is not a node gone
# A connect to a host that drops packets blocks this long: the watcher answers a stop between two probes, so
# this bounds how late (a cluster's SYN gets its answer in milliseconds; the wait retries anyway).
CONNECT_TIMEOUT_S = 1.0
# Backoff of the waits for a node to appear: quick at first (pods start together), then every 2 s.
FIRST_PAUSE_S, MAX_PAUSE_S = 0.25, 2.0
# The watched command gets this long between SIGTERM and SIGKILL once the others are gone.
COMMAND_GRACE_S = 10.0
_PREFIX = "ma-runtime: "

Endpoint = Tuple[str, int]
T = TypeVar("T")


def exchange(host: str, port: int, talk: Optional[Callable[[socket.socket], T]] = None) -> Tuple[Any, str]:
    """(what `talk(connection)` returns, or the host's IPv4 address without one, "") when a TCP connect to it
    succeeds, else (None, why not)."""
    try:
        address = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return None, "does not resolve"
    try:
        with socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S) as connection:
            return (talk(connection) if talk is not None else address), ""
    except socket.timeout:
        return None, f"{address}:{port} does not answer"
    except OSError as exc:
        return None, f"{address}:{port} refuses connections ({exc.strerror or exc})"


def probe(host: str, port: int) -> Tuple[Optional[str], str]:
    """(the host's IPv4 address, "") when a TCP connect to it succeeds, else (None, why)."""
    return exchange(host, port)


def wait_until(ask: Callable[[], Tuple[Optional[T], str]], deadline: float, log, stopped: threading.Event,
               waiting: str, timed_out: Callable[[str], Exception], **fields: Any) -> Optional[T]:
    """`ask()`'s answer once it has one, asking again with a backoff (FIRST_PAUSE_S doubling to MAX_PAUSE_S),
    each wait logged as `waiting` with `fields` and why; `timed_out(why)` raised at the monotonic `deadline`;
    None when `stopped` is set meanwhile (the caller has seen the signal)."""
    pause, tries = FIRST_PAUSE_S, 0
    while True:
        answer, why = ask()
        if answer is not None:
            return answer
        tries += 1
        left = deadline - time.monotonic()
        if left <= 0:
            raise timed_out(why)
        log.info(waiting, **fields, why=why, tries=tries, wait_s=round(pause, 2))
        if stopped.wait(min(pause, left)):
            return None
        pause = min(pause * 2, MAX_PAUSE_S)


def reach_all(endpoints: Sequence[Endpoint], seconds: float, log, stopped: threading.Event) -> List[str]:
    """Each endpoint's IPv4 address, in order, once each has answered a TCP connect; LaunchTimedOut (81) naming
    the first that did not within `seconds` in all. [] when `stopped` is set meanwhile (the caller has seen the
    signal)."""
    deadline = time.monotonic() + seconds
    addresses = []
    for host, port in endpoints:
        def timed_out(why: str, host: str = host, port: int = port) -> LaunchTimedOut:
            return LaunchTimedOut(f"node {host} did not answer on port {port} within {seconds:g} s ({why})",
                                  hint="check that its container runs and its sshd started (its task log), "
                                       "and VC_WORKER_HOSTS; MA_RUNTIME_PEER_WAIT_SECONDS sets the wait")

        address = wait_until(functools.partial(probe, host, port), deadline, log, stopped, "waiting for a node",
                             timed_out, host=host, port=port)
        if address is None:
            return []
        addresses.append(address)
    return addresses


def resolve_until(host: str, seconds: float) -> str:
    """Worker-0's IP (msrun wants one): retried, since a node's DNS record can lag the pod's start."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise LaunchTimedOut(
                    f"worker-0's address {host} did not resolve within {seconds:g} s ({exc})",
                    hint="check VC_WORKER_HOSTS and the cluster DNS; MA_RUNTIME_MASTER_RESOLVE_SECONDS sets the wait",
                ) from None
            time.sleep(1.0)


def watcher_argv(endpoints: Sequence[Endpoint], appear_seconds: float, command: Sequence[str] = (),
                 gone_seconds: Optional[float] = None) -> List[str]:
    """The watcher program's command line, on the runtime's own interpreter (isolated when the runtime is)."""
    isolated = ["-I"] if sys.flags.isolated else []
    argv = [sys.executable, *isolated, "-m", __name__, "--until-gone", *(f"{host}:{port}" for host, port in
                                                                           endpoints),
            "--appear-seconds", f"{appear_seconds:g}"]
    if gone_seconds is not None:
        argv += ["--gone-seconds", f"{gone_seconds:g}"]
    return argv + ["--", *command] if command else argv


def _endpoint(text: str) -> Endpoint:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r}")
    return host, int(port)


class _PeerStates:
    """The watcher's state: which endpoints have answered, and each one's failures in a row since."""

    def __init__(self, endpoints: Sequence[Endpoint], gone_seconds: float):
        self.endpoints = list(endpoints)
        self.gone_seconds = gone_seconds
        self.seen = set()
        self.failures = {endpoint: 0 for endpoint in self.endpoints}
        self.failing_since: Dict[Endpoint, float] = {}

    def look(self, stop: threading.Event) -> None:
        for endpoint in self.endpoints:
            if stop.is_set():
                return  # a stop is answered within one probe, however many endpoints are watched
            if self.gone(endpoint):
                continue  # gone stays gone: a later answer is someone else (a restarted pod is a new job run)
            address, _ = probe(*endpoint)
            if address is not None:
                self.seen.add(endpoint)
                self.failures[endpoint] = 0
                self.failing_since.pop(endpoint, None)
            else:
                self.failures[endpoint] += 1
                self.failing_since.setdefault(endpoint, time.monotonic())

    def gone(self, endpoint: Endpoint) -> bool:
        return (endpoint in self.seen and self.failures[endpoint] >= GONE_AFTER
                and time.monotonic() - self.failing_since[endpoint] >= self.gone_seconds)

    def missing(self) -> List[Endpoint]:
        return [endpoint for endpoint in self.endpoints if endpoint not in self.seen]

    def all_gone(self) -> bool:
        return all(self.gone(endpoint) for endpoint in self.endpoints)


def _say(text: str) -> None:
    sys.stderr.write(_PREFIX + text + "\n")
    sys.stderr.flush()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ma_runtime.launch.peers")
    parser.add_argument("--until-gone", nargs="+", type=_endpoint, required=True, metavar="HOST:PORT")
    parser.add_argument("--appear-seconds", type=float, required=True)
    parser.add_argument("--gone-seconds", type=float, default=0.0,
                        help="how long an endpoint must fail before it is gone (at least GONE_AFTER probes)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    # A stop reaches the whole group at once (the supervisor's killpg): the command has it already.
    stop = stop_on_signals()
    try:
        child = subprocess.Popen(command) if command else None
    except OSError as exc:  # one line, as the runtime's own spawn says it, never a traceback
        return _not_started(command, exc)
    code = _watch(_PeerStates(args.until_gone, args.gone_seconds), args.appear_seconds, child, stop)
    return code


def stop_on_signals() -> "SignalStop":
    """A stop that SIGTERM and SIGINT set: the watcher's here, and ray_node.py's keeper and wait."""
    stop = SignalStop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    return stop


class SignalStop:
    """A stop set by a signal handler. Not a threading.Event: Event.set takes the lock that the main thread holds
    inside Event.wait, and a handler run while it holds it waits for itself forever (a SIGTERMed watcher hung so,
    its command dead). A flag and a pipe written by the handler, which ends select's wait in any thread."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._set = False

    def set(self) -> None:
        self._set = True
        try:
            os.write(self._write, b"x")
        except BlockingIOError:  # the pipe is full of earlier stops: one is enough
            pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: Optional[float] = None) -> bool:
        if not self._set:
            select.select([self._read], [], [], timeout)
        return self._set


def _not_started(command: Sequence[str], exc: OSError) -> int:
    if exc.errno == errno.E2BIG:
        _say(f"cannot start {command[0]}: {too_large_for_exec(command, os.environ)}")
        return ExitCode.COMMAND_NOT_EXECUTABLE
    _say(f"cannot start {command[0]}: {exc.strerror or exc}")
    return ExitCode.COMMAND_NOT_FOUND if exc.errno == errno.ENOENT else ExitCode.COMMAND_NOT_EXECUTABLE


def _watch(watch: _PeerStates, appear_seconds: float, child: Optional[subprocess.Popen], stop: SignalStop) -> int:
    deadline = time.monotonic() + appear_seconds
    while True:
        if child is not None and child.poll() is not None:
            return lifecycle.exit_code(child.returncode)  # the command's own end decides
        if stop.is_set():
            return lifecycle.exit_code(child.wait()) if child is not None else 128 + signal.SIGTERM
        watch.look(stop)
        if watch.all_gone():
            _say("every node watched has finished: " + ", ".join(f"{h}:{p}" for h, p in watch.endpoints))
            if child is not None:
                _end(child)
            return 0
        missing = watch.missing()
        if missing and time.monotonic() >= deadline:
            host, port = missing[0]
            _say(f"{host}:{port} never answered within {appear_seconds:g} s (MA_RUNTIME_PEER_WAIT_SECONDS)")
            if child is not None:
                _end(child)
            return ExitCode.TIMED_OUT
        stop.wait(PERIOD_S)


def _end(child: subprocess.Popen) -> None:
    lifecycle.stop(child, COMMAND_GRACE_S)


if __name__ == "__main__":
    sys.exit(main())
