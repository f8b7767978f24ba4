"""launch/peers.py with real sockets and real processes: waiting for nodes to answer, and the watcher."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from ma_runtime.errors import LaunchTimedOut
from ma_runtime.launch import peers
from tests.conftest import alive, wait_for_file
from tests.recording import Log


def listener() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    return server


def closed_port() -> int:
    with listener() as server:
        return server.getsockname()[1]


def test_every_node_answers_its_address_in_order():
    with listener() as first, listener() as second:
        ports = [first.getsockname()[1], second.getsockname()[1]]
        assert peers.reach_all([("localhost", ports[0]), ("127.0.0.1", ports[1])], 5, Log(),
                               threading.Event()) == ["127.0.0.1", "127.0.0.1"]


def test_a_node_that_comes_up_late_is_waited_for_and_each_wait_logged():
    port = closed_port()
    server = socket.socket()
    timer = threading.Timer(0.6, lambda: (server.bind(("127.0.0.1", port)), server.listen(1)))
    timer.start()
    log = Log()
    try:
        assert peers.reach_all([("127.0.0.1", port)], 30, log, threading.Event()) == ["127.0.0.1"]
    finally:
        timer.join()
        server.close()
    waits = log.fields("waiting for a node", "info")
    assert waits and "refuses connections" in waits[0]["why"] and waits[0]["host"] == "127.0.0.1"


@pytest.mark.parametrize("host, why", [("no-such-node.invalid", "does not resolve"),
                                       ("127.0.0.1", "refuses connections")])
def test_a_node_that_never_answers_times_out_naming_it(host, why):
    with pytest.raises(LaunchTimedOut) as raised:
        peers.reach_all([(host, closed_port())], 0.5, Log(), threading.Event())
    assert f"node {host} did not answer" in str(raised.value) and why in str(raised.value)
    assert raised.value.exit_code == 81


def test_a_stop_ends_the_wait():
    stopped = threading.Event()
    threading.Timer(0.3, stopped.set).start()
    assert peers.reach_all([("127.0.0.1", closed_port())], 60, Log(), stopped) == []


# The watcher probes every PERIOD_S (1 s); these tests run it probing every 0.1 s, so that what takes the
# watcher GONE_AFTER probes takes 0.3 s here. The windows and the counts it is tested against are unchanged.
PERIOD_S = 0.1


def watcher(endpoints, appear, command=(), gone_seconds=None, **kwargs):
    argv = peers.watcher_argv(endpoints, appear, command, gone_seconds)
    module = argv.index("-m")
    assert argv[module + 1] == peers.__name__
    argv[module:module + 2] = ["-c", f"import sys, {peers.__name__} as peers; peers.PERIOD_S = {PERIOD_S}; "
                                     "sys.exit(peers.main())"]
    return subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, **kwargs)


def probed(server: socket.socket, timeout: float = 30.0) -> None:
    """Returns once the watcher has reached `server` (its probe is a connection): the node was seen answering."""
    server.settimeout(timeout)
    connection, _ = server.accept()
    with connection:  # closed after the probe's own close: the TIME_WAIT is the watcher's, the port free to bind
        connection.settimeout(timeout)
        connection.recv(1)


def test_the_watcher_ends_its_command_and_succeeds_once_the_watched_node_is_gone(tmp_path):
    pid_file = tmp_path / "ps.pid"
    server = listener()
    proc = watcher([("127.0.0.1", server.getsockname()[1])], 30,
                   ["sh", "-c", f"echo $$ > {pid_file}; exec sleep 300"])
    wait_for_file(pid_file)
    probed(server)
    assert proc.poll() is None  # the node still answers: the command keeps running
    server.close()
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert "ma-runtime: every node watched has finished: 127.0.0.1:" in stderr
    assert not alive(int(pid_file.read_text()))


def test_without_a_command_the_watcher_just_ends_when_the_node_goes():
    server = listener()
    proc = watcher([("127.0.0.1", server.getsockname()[1])], 30)
    probed(server)
    server.close()
    assert proc.wait(30) == 0


def test_a_node_that_never_appears_ends_the_watcher_with_81_naming_it():
    port = closed_port()
    proc = watcher([("127.0.0.1", port)], 1, ["sleep", "300"])
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 81
    assert f"ma-runtime: 127.0.0.1:{port} never answered within 1 s (MA_RUNTIME_PEER_WAIT_SECONDS)" in stderr


def test_the_commands_own_exit_decides_first():
    with listener() as server:
        proc = watcher([("127.0.0.1", server.getsockname()[1])], 30, [sys.executable, "-c", "raise SystemExit(3)"])
        assert proc.wait(30) == 3


def test_a_stop_to_the_group_is_the_commands_and_the_watcher_reports_its_status(tmp_path):
    pid_file = tmp_path / "ps.pid"
    with listener() as server:
        proc = watcher([("127.0.0.1", server.getsockname()[1])], 30,
                       ["sh", "-c", f"echo $$ > {pid_file}; exec sleep 300"], start_new_session=True)
        wait_for_file(pid_file)
        os.killpg(proc.pid, signal.SIGTERM)  # as the supervisor stops a worker: once, to the group
        assert proc.wait(30) == 128 + signal.SIGTERM
    assert not alive(int(pid_file.read_text()))


def test_a_bad_endpoint_is_refused():
    done = subprocess.run([sys.executable, "-m", "ma_runtime.launch.peers", "--until-gone", "host-without-port",
                           "--appear-seconds", "1"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "not HOST:PORT" in done.stderr


def test_a_node_closed_for_less_than_the_gone_window_is_not_gone_and_one_closed_longer_is():
    # A TensorFlow worker restarted in place closes its port for a while: the ps must not take that for the end.
    server = listener()
    port = server.getsockname()[1]
    failed_probes = peers.GONE_AFTER * PERIOD_S + 1.0  # 3 failed probes, and slack: gone without the window
    proc = watcher([("127.0.0.1", port)], 30, ["sleep", "300"], gone_seconds=failed_probes + 1.5)
    probed(server)  # seen answering
    server.close()
    time.sleep(failed_probes)
    assert proc.poll() is None
    restarted = socket.socket()
    restarted.bind(("127.0.0.1", port))
    restarted.listen(1)
    probed(restarted)  # answering again: the window starts over
    restarted.close()
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr


def test_the_watchers_stop_set_by_a_signal_handler_ends_its_wait():
    # The watcher's SIGTERM handler sets its stop while the main thread may be inside the wait: a threading.Event
    # there could deadlock the handler on the lock the interrupted wait holds (a watcher hung so in the suite).
    stop = peers.SignalStop()
    previous = signal.signal(signal.SIGALRM, lambda *_: stop.set())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        started = time.monotonic()
        assert stop.wait(30) is True and stop.is_set()
        assert time.monotonic() - started < 25  # a guard against a wait that the handler did not end
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
