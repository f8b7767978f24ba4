"""Ray's processes on a node (launch/ray.py): the node's keeper, and the wait before the driver.

- `start_service`, in the runtime's stage thread: this node's keeper as the job's service (graceful: at the run's
  end it alone gets SIGTERM and stops Ray). Worker-0 waits, bounded, until the head it starts answers; every other
  node first waits for the head (81 naming worker-0), then starts its keeper, which joins it.
- The keeper (`python -m ma_runtime.launch.ray_node keep [--head HOST:PORT] -- ray start ... --block`) runs
  `ray start --block` and keeps it running: one that ends after it was up STEADY_S is started again (after the
  head answers again, on a node that joins one), so that a cluster that died is whole again for the next attempt;
  on a joining node, a head gone (GONE_AFTER probes in a row) stops the node, which joins the head once it is back.
  A `ray start` that ends sooner failed to start: the keeper ends with its code. On SIGTERM it sends SIGTERM to
  `ray start` once (which stops raylet, then the GCS, then the rest, as `ray stop` does) and waits for it.
- The wait before the driver (`python -m ma_runtime.launch.ray_node await ... -- CMD`), worker-0's plan: asks the
  cluster which nodes are alive (`ray.nodes()`, in a process of the job's Python: the runtime never imports ray)
  until every node has joined, logging how many have, then becomes the command (exec) with RAY_ADDRESS set; after
  the bound (MA_RUNTIME_PEER_WAIT_SECONDS) it exits 81 naming the nodes whose address is not in the cluster.
"""

import argparse
import errno
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence, Tuple

from ma_runtime.errors import ConfigError, ExitCode, LaunchTimedOut
from ma_runtime.launch import peers

STEADY_S = 10.0  # a `ray start` that ran this long was up: its end is a node that died, started again
RESTART_PAUSE_S = 2.0
GONE_AFTER = peers.GONE_AFTER  # probes in a row
PROBE_S = 1.0
ASK_AGAIN_S = 2.0  # a cluster query that ended is started again after this
_PREFIX = "ma-runtime: "
# Run by the job's Python: the alive nodes' addresses, once a second, as a JSON list on a line of its own.
NODES_QUERY = (
    "import json, logging, sys, time\n"
    "import ray\n"
    "ray.init(address=sys.argv[1], logging_level=logging.ERROR, log_to_driver=False)\n"
    "while True:\n"
    "    print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n.get('Alive')]), flush=True)\n"
    "    time.sleep(1)\n"
)


def _module_argv(*words: str) -> List[str]:
    """This module as a program on the runtime's own interpreter (isolated when the runtime is)."""
    return [sys.executable, *(["-I"] if sys.flags.isolated else []), "-m", __name__, *words]


def _endpoint(text: str) -> Tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


# --------------------------------------------------------------------------- in the runtime: the service


def start_service(spec, service, head: str, environ, log, stopped: threading.Event, sinks) -> None:
    """This node's keeper running `service` (a WorkerPlan: `ray start ... --block`), as the job's service."""
    from ma_runtime.process import children
    from ma_runtime.process.worker import spawn

    host, port = _endpoint(head)
    from ma_runtime.launch.role import role

    joins = not role(spec).is_master
    if joins and not _wait_for_head(host, port, spec.peer_wait_seconds, log, stopped):
        return  # the run is stopping: the caller has seen the signal
    argv = _module_argv("keep", *(["--head", head] if joins else []), "--", *service.argv)
    env = {**environ, **service.env}
    keeper = children.start_service(lambda: spawn(argv, env, None, list(sinks), list(sinks), name=service.name,
                                                  console_prefix=b"[ray] "), graceful=True)
    if joins:
        log.info("joining the Ray head", head=head, pid=keeper.pid)
        return
    # The head's own address, by its name as the other nodes reach it (one node: 127.0.0.1).
    why = _wait_started(keeper, host, port, spec.peer_wait_seconds, stopped)
    if why:
        raise ConfigError(f"the Ray head did not start on port {port}: {why}",
                          hint="`ray start`'s lines are in the task log, prefixed [ray]; another process may hold "
                               "MA_RUNTIME_RAY_PORT, or MA_RUNTIME_EXTRA_RAY_PARAMS has a bad flag")
    log.info("Ray head started", head=head, pid=keeper.pid)


def _wait_for_head(host: str, port: int, seconds: float, log, stopped: threading.Event) -> bool:
    """The peers wait for worker-0's head: True once it answers, False on a stop, LaunchTimedOut (81) naming it."""
    def timed_out(why: str) -> LaunchTimedOut:
        return LaunchTimedOut(f"worker-0's Ray head {host}:{port} did not answer within {seconds:g} s ({why})",
                              hint="check worker-0's task log (its Ray head's lines, prefixed [ray]) and "
                                   "VC_WORKER_HOSTS; MA_RUNTIME_PEER_WAIT_SECONDS sets the wait")

    answer = peers.wait_until(lambda: peers.probe(host, port), time.monotonic() + seconds, log, stopped,
                              "waiting for the Ray head", timed_out, host=host, port=port)
    return answer is not None


def _wait_started(keeper, host: str, port: int, seconds: float, stopped: threading.Event) -> str:
    """"" once the head answers on its port (or the run stops), else why not."""
    from ma_runtime.process.children import wait_started

    return wait_started(keeper, lambda: peers.probe(host, port)[0] is not None, seconds,
                        f"its port did not answer within {seconds:g} s (MA_RUNTIME_PEER_WAIT_SECONDS)", stopped)


def await_argv(address: str, python: str, hosts: Sequence[str], seconds: float) -> List[str]:
    """The wait before the driver, for the plan (the command follows `--`)."""
    return _module_argv("await", "--address", address, "--python", python, *(f"--node={host}" for host in hosts),
                        "--seconds", f"{seconds:g}")


# --------------------------------------------------------------------------- the programs


def _say(text: str) -> None:
    sys.stderr.write(_PREFIX + text + "\n")
    sys.stderr.flush()


def _stop_event() -> peers.SignalStop:
    return peers.stop_on_signals()  # not a threading.Event, which a signal handler can deadlock on


def keep(argv: Sequence[str], head: Optional[Tuple[str, int]]) -> int:
    stop = _stop_event()
    while True:
        if head is not None and not _until_answers(head, stop):
            return 0
        started = time.monotonic()
        try:
            child = subprocess.Popen(list(argv))
        except OSError as exc:
            _say(f"cannot start {argv[0]}: {exc.strerror or exc}")
            return ExitCode.COMMAND_NOT_FOUND if exc.errno == errno.ENOENT else ExitCode.COMMAND_NOT_EXECUTABLE
        gone = _run(child, head, stop)
        if stop.is_set():
            return 0
        if gone:
            _say(f"the Ray head {head[0]}:{head[1]} is gone: this node joins it again once it answers")
        elif time.monotonic() - started < STEADY_S:
            _say(f"`ray start` ended with code {child.returncode} before its node was up")
            return child.returncode if child.returncode > 0 else 128 - child.returncode
        else:
            _say(f"the Ray node ended with code {child.returncode}: starting it again")
        if stop.wait(RESTART_PAUSE_S):
            return 0


def _until_answers(head: Tuple[str, int], stop: threading.Event) -> bool:
    """True once the head answers; False on a stop."""
    while not stop.is_set():
        if peers.probe(*head)[0] is not None:
            return True
        stop.wait(PROBE_S)
    return False


def _run(child: subprocess.Popen, head: Optional[Tuple[str, int]], stop: threading.Event) -> bool:
    """Waits while `ray start` runs; on a stop, or once the head it joined is gone (returns True then), SIGTERM to
    it, once, and its end waited for (the runtime's grace bounds that wait)."""
    failures = 0
    while child.poll() is None:
        if stop.wait(PROBE_S):
            break
        if head is not None:
            failures = 0 if peers.probe(*head)[0] is not None else failures + 1
            if failures >= GONE_AFTER:
                break
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
        child.wait()
        return not stop.is_set()
    return False


def wait_for_nodes(address: str, python: str, hosts: Sequence[str], seconds: float,
                   stop: threading.Event) -> Tuple[List[str], str]:
    """(the alive nodes' addresses, "") once every node has joined; else (those that did, why not) at the bound or a
    stop ("stopped")."""
    deadline = time.monotonic() + seconds
    joined: List[str] = []
    said = -1
    last = ""
    while True:
        lines: queue.Queue[Optional[str]] = queue.Queue()
        query = subprocess.Popen([python, "-c", NODES_QUERY, address], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace")
        threading.Thread(target=_read_lines, args=(query, lines), daemon=True).start()
        try:
            while True:
                if stop.is_set():
                    return joined, "stopped"
                left = deadline - time.monotonic()
                if left <= 0:
                    return joined, last
                try:
                    line = lines.get(timeout=min(left, 1.0))
                except queue.Empty:
                    continue
                if line is None:
                    break  # the query ended: asked again below
                nodes = _nodes(line)
                if nodes is None:
                    last = line.strip() or last
                    continue
                joined = nodes
                if len(joined) >= len(hosts):
                    return joined, ""
                if len(joined) != said:
                    said = len(joined)
                    _say(f"waiting for the Ray cluster's nodes: {len(joined)} of {len(hosts)} joined")
        finally:
            _end(query)
        if stop.wait(min(ASK_AGAIN_S, max(0.0, deadline - time.monotonic()))):
            return joined, "stopped"


def _read_lines(query: subprocess.Popen, lines: "queue.Queue[Optional[str]]") -> None:
    for line in query.stdout:
        lines.put(line)
    lines.put(None)


def _nodes(line: str) -> Optional[List[str]]:
    text = line.strip()
    if not text.startswith("["):
        return None
    try:
        nodes = json.loads(text)
    except ValueError:
        return None
    return [str(node) for node in nodes] if isinstance(nodes, list) else None


def _end(query: subprocess.Popen) -> None:
    if query.poll() is None:
        query.terminate()
        try:
            query.wait(5)
        except subprocess.TimeoutExpired:
            query.kill()
            query.wait()


def missing(hosts: Sequence[str], joined: Sequence[str]) -> List[str]:
    """The hosts whose IPv4 address is not a joined node's (one whose name does not resolve is missing too)."""
    import socket

    found = []
    for host in hosts:
        try:
            address = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        except OSError:
            address = None
        if address not in joined and not (address is not None and address.startswith("127.") and len(hosts) == 1):
            found.append(host)
    return found


def await_then_exec(address: str, python: str, hosts: Sequence[str], seconds: float, command: Sequence[str]) -> int:
    stop = _stop_event()
    joined, why = wait_for_nodes(address, python, hosts, seconds, stop)
    if why == "stopped":
        return 128 + signal.SIGTERM
    if len(joined) < len(hosts):
        absent = missing(hosts, joined) or [f"{len(hosts) - len(joined)} node(s)"]
        _say(f"{len(joined)} of {len(hosts)} nodes joined the Ray cluster at {address} within {seconds:g} s; "
             f"missing: {', '.join(absent)}; joined: {', '.join(joined) or 'none'}" + (f" ({why})" if why else "")
             + " (MA_RUNTIME_PEER_WAIT_SECONDS)")
        return ExitCode.TIMED_OUT
    _say(f"every node joined the Ray cluster at {address} ({len(joined)}): starting the driver")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)  # the driver's own, as if it had been started directly
    try:
        os.execvp(command[0], list(command))
    except OSError as exc:
        _say(f"cannot start {command[0]}: {exc.strerror or exc}")
        return ExitCode.COMMAND_NOT_FOUND if exc.errno == errno.ENOENT else ExitCode.COMMAND_NOT_EXECUTABLE
    return ExitCode.INTERNAL_ERROR  # not reached: exec replaced this program


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    commands = parser.add_subparsers(dest="what", required=True)
    keeper = commands.add_parser("keep")
    keeper.add_argument("--head", type=_endpoint, default=None, metavar="HOST:PORT")
    keeper.add_argument("ray", nargs=argparse.REMAINDER)
    waiter = commands.add_parser("await")
    waiter.add_argument("--address", required=True)
    waiter.add_argument("--python", required=True)
    waiter.add_argument("--node", action="append", required=True)
    waiter.add_argument("--seconds", type=float, required=True)
    waiter.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.what == "keep":
        return keep(_after_dashes(args.ray), args.head)
    return await_then_exec(args.address, args.python, args.node, args.seconds, _after_dashes(args.command))


def _after_dashes(words: Sequence[str]) -> List[str]:
    return list(words[1:]) if words[:1] == ["--"] else list(words)


if __name__ == "__main__":
    sys.exit(main())
