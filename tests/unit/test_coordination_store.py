"""The coordination store (issue 26): one conformance suite written against the interface (store.Store), run
against every backend (`backend` below: the embedded store, and a real etcd started on loopback), then what only
the embedded server has (its allow hook, its frames) and what only the etcd client has (its URL, its endpoints).
Real sockets, threads and processes; no timed assertions: a bound only guards against a hang."""

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from ma_runtime.coordination import embedded
from ma_runtime.coordination.embedded import EmbeddedStoreClient, EmbeddedStoreServer, FrameError, FrameReader
from ma_runtime.coordination.store import Store, StoreUnavailable
from ma_runtime.errors import ConfigError
from tests.recording import Log

ROOT = Path(__file__).resolve().parents[2]
GUARD = 30.0  # seconds: only against a hang
ETCD = shutil.which("etcd") or "/usr/bin/etcd"  # Debian's etcd-server
ETCD_MISSING = "the etcd backend needs {what} (scripts/test.sh installs Debian's etcd-server and the etcd extra)"


def child_environment():
    """The environment of a client in another process: this tree first, then the import path of this one."""
    path = [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


class EmbeddedBackend:
    """The store worker-0 hosts, on loopback."""

    short_ttl = 0.2  # seconds: a time to live the store keeps to its resolution

    def __init__(self, **server_options):
        self.server = EmbeddedStoreServer("127.0.0.1", 0, **server_options).start()
        self.clients = []

    def connect(self, reconnect_seconds: float = 5.0) -> Store:
        client = EmbeddedStoreClient("127.0.0.1", self.server.port, reconnect_seconds=reconnect_seconds)
        self.clients.append(client)
        return client

    def client_source(self) -> str:
        """Python that makes a client in another process."""
        return ("from ma_runtime.coordination.embedded import EmbeddedStoreClient\n"
                f"client = EmbeddedStoreClient('127.0.0.1', {self.server.port})\n")

    def stop(self) -> None:
        self.server.close()

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.server.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EtcdServer:
    """One real etcd on loopback for the session (free ports, a temporary data directory), started again after a
    test stopped it. A short election timeout makes etcd's shortest lease 1 s instead of 2 s."""

    def __init__(self):
        self.process = None
        self.directory = tempfile.mkdtemp(prefix="ma-runtime-etcd-")

    def url(self) -> str:
        if self.process is None or self.process.poll() is not None:
            self._start()
        return f"etcd://127.0.0.1:{self.client_port}"

    def _start(self) -> None:
        self.client_port, peer_port = free_port(), free_port()
        data = tempfile.mkdtemp(dir=self.directory)
        client_url, peer_url = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{peer_port}"
        with open(os.path.join(self.directory, "etcd.log"), "ab") as log:  # the child keeps its own copy
            self.process = subprocess.Popen(
                [ETCD, "--name", "test", "--data-dir", data, "--listen-client-urls", client_url,
                 "--advertise-client-urls", client_url, "--listen-peer-urls", peer_url,
                 "--initial-advertise-peer-urls", peer_url, "--initial-cluster", f"test={peer_url}",
                 "--heartbeat-interval", "10", "--election-timeout", "100", "--logger", "zap", "--log-level", "error"],
                stdout=subprocess.DEVNULL, stderr=log)
        assert until(self._healthy), f"etcd did not start: {self.directory}/etcd.log"

    def _healthy(self) -> bool:
        assert self.process.poll() is None, f"etcd exited: {self.directory}/etcd.log"
        try:
            with socket.create_connection(("127.0.0.1", self.client_port), timeout=1) as sock:
                sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                return b'"health":"true"' in sock.recv(4096)
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


class EtcdBackend:
    """A fresh job prefix in the session's etcd: each test sees only its own keys."""

    short_ttl = 1.0  # seconds: etcd's leases count whole seconds

    def __init__(self, server: EtcdServer):
        from ma_runtime.coordination.etcd import EtcdStore

        self.server, self.store_class = server, EtcdStore
        self.url, self.prefix = server.url(), f"/ma-runtime/test-{uuid.uuid4().hex}/"
        self.clients = []

    def connect(self, reconnect_seconds: float = 5.0) -> Store:
        client = self.store_class(self.url, self.prefix, reconnect_seconds=reconnect_seconds)
        self.clients.append(client)
        return client

    def client_source(self) -> str:
        return ("from ma_runtime.coordination.etcd import EtcdStore\n"
                f"client = EtcdStore({self.url!r}, {self.prefix!r})\n")

    def stop(self) -> None:
        self.server.stop()  # the next test's backend starts it again

    def close(self) -> None:
        for client in self.clients:
            client.close()


@pytest.fixture(scope="module")  # gone after this file: a later test may count this process's children
def etcd_server():
    if not os.access(ETCD, os.X_OK):
        pytest.skip(ETCD_MISSING.format(what=f"{ETCD}"))
    pytest.importorskip("etcd3gw", reason=ETCD_MISSING.format(what="the etcd3gw package"))
    server = EtcdServer()
    yield server
    server.close()


BACKENDS = {"embedded": lambda request: EmbeddedBackend(),
            "etcd": lambda request: EtcdBackend(request.getfixturevalue("etcd_server"))}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    made = BACKENDS[request.param](request)
    yield made
    made.close()


@pytest.fixture
def store(backend):
    return backend.connect()


def in_threads(count, work):
    """work(index) in `count` threads started together; their results in order."""
    results, start = [None] * count, threading.Barrier(count)

    def run(index):
        start.wait(GUARD)
        results[index] = work(index)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(GUARD)
        assert not thread.is_alive()
    return results


def until(condition, guard=GUARD):
    """Polls `condition` until true; False only when the guard passes (a hang)."""
    deadline = time.monotonic() + guard
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# --------------------------------------------------------------------------- conformance: every backend


def test_set_get_delete_and_keys(store):
    assert store.get("job/a") is None
    store.set("job/a", b"1")
    store.set("job/b", b"")
    store.set("other", b"x")
    assert store.get("job/a") == b"1" and store.get("job/b") == b""
    store.set("job/a", b"2")
    assert store.get("job/a") == b"2"
    assert store.keys("job/") == ["job/a", "job/b"]
    assert store.keys() == ["job/a", "job/b", "other"]
    assert store.delete("job/a") is True and store.delete("job/a") is False
    assert store.get("job/a") is None and store.keys("job/") == ["job/b"]


def test_values_are_any_bytes(store):
    every_byte = bytes(range(256)) * 4
    store.set("bytes", every_byte)
    assert store.get("bytes") == every_byte


def test_add_counts_from_zero_and_refuses_a_value_that_is_no_integer(store):
    assert store.add("count", 1) == 1
    assert store.add("count", 5) == 6
    assert store.add("count", -2) == 4
    assert store.get("count") == b"4"
    store.set("text", b"not a number")
    with pytest.raises(ValueError, match="does not hold an integer"):
        store.add("text", 1)
    assert store.get("text") == b"not a number"


def test_compare_and_set_only_if_absent_or_expected(store):
    assert store.compare_and_set("origin", None, b"node 1") is True
    assert store.compare_and_set("origin", None, b"node 2") is False
    assert store.get("origin") == b"node 1"
    assert store.compare_and_set("origin", b"node 2", b"node 3") is False
    assert store.compare_and_set("origin", b"node 1", b"node 3") is True
    assert store.get("origin") == b"node 3"


def test_a_key_with_a_time_to_live_disappears_from_get_keys_and_wait(store):
    store.set("heartbeat/1", b"alive", ttl=0.1)
    store.set("heartbeat/2", b"alive")
    assert until(lambda: store.get("heartbeat/1") is None)
    assert store.keys("heartbeat/") == ["heartbeat/2"]
    assert store.wait(["heartbeat/1"], 0.05) is False
    assert store.compare_and_set("heartbeat/1", None, b"back") is True  # an expired key is an absent one


def test_writing_again_refreshes_or_removes_the_time_to_live(backend, store):
    store.set("refreshed", b"1", ttl=backend.short_ttl)
    store.set("refreshed", b"2", ttl=GUARD)  # the last write's ttl counts
    store.set("permanent", b"1", ttl=backend.short_ttl)
    store.set("permanent", b"2")
    store.set("control", b"1", ttl=backend.short_ttl)
    assert until(lambda: store.get("control") is None)  # the short ttl has passed
    assert store.get("refreshed") == b"2" and store.get("permanent") == b"2"


def test_add_keeps_the_time_to_live_of_its_key(store):
    store.set("ticket", b"1", ttl=0.1)
    store.add("ticket", 1)
    assert until(lambda: store.get("ticket") is None)


def test_wait_returns_at_once_for_existing_keys_and_false_at_the_deadline(store):
    store.set("joined/0", b"")
    store.set("joined/1", b"")
    assert store.wait(["joined/0", "joined/1"], GUARD) is True
    assert store.wait(["joined/0", "joined/2"], 0.1) is False
    assert store.wait(["joined/2"], 0) is False


def test_a_wait_is_released_by_another_clients_set(backend):
    waiter, writer = backend.connect(), backend.connect()
    result = {}
    thread = threading.Thread(target=lambda: result.update(done=waiter.wait(["go/a", "go/b"], GUARD)))
    thread.start()
    writer.set("go/a", b"")
    time.sleep(0.05)  # most likely parked by now; either order must end True
    assert "done" not in result  # one key of two releases nothing
    writer.set("go/b", b"")
    thread.join(GUARD)
    assert result == {"done": True}


def test_a_key_deleted_before_the_others_exist_does_not_release_a_wait(backend):
    waiter, writer = backend.connect(), backend.connect()
    writer.set("a", b"")
    result = {}
    thread = threading.Thread(target=lambda: result.update(done=waiter.wait(["a", "b"], 0.5)))
    thread.start()
    time.sleep(0.05)
    writer.delete("a")
    writer.set("b", b"")
    thread.join(GUARD)
    # Whether the wait saw "a" before its delete or not, "a" and "b" never existed together.
    assert result == {"done": False}


def test_compare_and_set_racing_clients_have_exactly_one_winner(backend):
    clients = [backend.connect() for _ in range(16)]
    for round_ in range(5):
        key = f"attempt/{round_}/origin"
        won = in_threads(len(clients), lambda index, key=key: clients[index].compare_and_set(key, None, b"%d" % index))
        assert won.count(True) == 1
        assert clients[0].get(key) == b"%d" % won.index(True)


def test_threads_sharing_one_client_race_the_same(store):
    won = in_threads(8, lambda index: store.compare_and_set("shared/origin", None, b"%d" % index))
    assert won.count(True) == 1


def test_add_from_many_clients_loses_no_update(backend):
    clients = [backend.connect() for _ in range(8)]
    stamps = in_threads(len(clients), lambda index: [clients[index].add("seq", 1) for _ in range(50)])
    every = sorted(stamp for stamps_of_one in stamps for stamp in stamps_of_one)
    assert every == list(range(1, 401))  # each stamp once: the store's receive order
    assert clients[0].get("seq") == b"400"


def test_two_clients_in_separate_processes(backend, store):
    child = backend.client_source() + (
        "client.add('joined', 1)\n"
        "assert client.wait(['go'], 30)\n"
        "client.set('child/won', b'%d' % client.compare_and_set('origin', None, b'child'))\n")
    process = subprocess.Popen([sys.executable, "-c", child], env=child_environment())
    try:
        assert store.wait(["joined"], GUARD)
        store.set("go", b"")
        assert store.wait(["child/won"], GUARD)
        assert process.wait(GUARD) == 0
    finally:
        process.kill()
        process.wait()
    assert store.get("child/won") == b"1" and store.get("origin") == b"child"
    assert store.compare_and_set("origin", None, b"parent") is False


def test_a_stopped_store_is_one_line_naming_its_address(backend):
    client = backend.connect(reconnect_seconds=0.3)
    client.set("k", b"v")
    backend.stop()
    with pytest.raises(StoreUnavailable) as raised:
        client.get("k")
    message = str(raised.value)
    assert "\n" not in message and raised.value.address in message and "unavailable" in message


def test_a_wait_in_progress_when_the_store_stops_ends_in_the_same_error(backend):
    client = backend.connect(reconnect_seconds=0.3)
    errors = []

    def wait():
        try:
            client.wait(["never"], GUARD)
        except StoreUnavailable as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.05)
    backend.stop()
    thread.join(GUARD)
    assert not thread.is_alive() and len(errors) == 1


def test_a_closed_client_raises_the_same_error(store):
    store.close()
    store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        store.get("k")


def test_bad_arguments_are_refused_before_the_store(store):
    for call in (lambda: store.set("", b"v"), lambda: store.set("k", "text"), lambda: store.set("k", b"v", ttl=0),
                 lambda: store.set("k" * 2000, b"v"), lambda: store.wait(["k"], float("inf")),
                 lambda: store.add("k", 1.5)):
        with pytest.raises(ValueError):
            call()
    assert store.keys() == []


# --------------------------------------------------------------------------- the embedded server only


def raw_connection(server):
    return socket.create_connection(("127.0.0.1", server.port), timeout=GUARD)


def closed_by_peer(sock) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_allow_hook_refuses_a_peer_at_once():
    asked, log = [], Log()
    with EmbeddedStoreServer("127.0.0.1", 0, allow=lambda peer: asked.append(peer) or False, log=log) as server:
        with raw_connection(server) as sock:
            assert closed_by_peer(sock)
        with pytest.raises(StoreUnavailable) as raised:
            EmbeddedStoreClient("127.0.0.1", server.port, reconnect_seconds=0.2).get("k")
        assert f"127.0.0.1:{server.port}" in str(raised.value)
    assert asked and set(asked) == {"127.0.0.1"}
    assert log.fields("the store refused a peer that is not one of the job's nodes")[0] == {"peer": "127.0.0.1"}


def test_allow_addresses_admits_the_nodes_and_loopback():
    allow = embedded.allow_addresses(["10.0.0.2", "10.0.0.3"])
    assert allow("10.0.0.2") and allow("127.0.0.1") and allow("::ffff:10.0.0.3")
    assert not allow("10.0.0.4") and not allow("::ffff:10.0.0.4")


def test_a_frame_over_the_limit_closes_that_connection_only():
    log = Log()
    with EmbeddedStoreServer("127.0.0.1", 0, log=log) as server, \
            EmbeddedStoreClient("127.0.0.1", server.port) as good:
        good.set("k", b"v")
        with raw_connection(server) as hostile:
            hostile.sendall(struct.pack(">I", embedded.FRAME_LIMIT + 1) + b"{")
            assert closed_by_peer(hostile)
        assert good.get("k") == b"v"
    assert log.events("warning") == ["the store closed a connection that broke its protocol"]


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"op": "set", "s": "x", "n": 1}',
                                  b'{"op": "drop-everything", "s": "x", "n": 1}',
                                  b'{"op": "wait", "s": "x", "n": 1, "ks": ["a"], "t": "soon"}'])
def test_a_malformed_request_closes_that_connection_only(body):
    with EmbeddedStoreServer("127.0.0.1", 0) as server, EmbeddedStoreClient("127.0.0.1", server.port) as good:
        waiting = threading.Thread(target=good.wait, args=(["later"], GUARD))
        waiting.start()
        with raw_connection(server) as broken:
            broken.sendall(struct.pack(">I", len(body)) + body)
            assert closed_by_peer(broken)
        with EmbeddedStoreClient("127.0.0.1", server.port) as other:
            other.set("later", b"")  # the parked wait of the good client is still served
        waiting.join(GUARD)
        assert not waiting.is_alive()


def test_a_value_over_the_limit_is_refused_and_the_store_bounds_its_bytes():
    with EmbeddedStoreServer("127.0.0.1", 0, byte_limit=4096) as server, \
            EmbeddedStoreClient("127.0.0.1", server.port) as client:
        with pytest.raises(ValueError, match="at most"):
            client.set("big", b"x" * (embedded.VALUE_LIMIT + 1))
        client.set("a", b"x" * 3000)
        with pytest.raises(ValueError, match="store is full"):
            client.set("b", b"x" * 3000)
        client.set("a", b"x" * 10)  # shrinking frees its bytes
        client.set("b", b"x" * 3000)


def test_a_resent_write_after_a_lost_connection_is_applied_once():
    with EmbeddedStoreServer("127.0.0.1", 0) as server, EmbeddedStoreClient("127.0.0.1", server.port) as client:
        assert client.add("count", 1) == 1
        frame = embedded.encode_frame({"op": "add", "k": "count", "a": 1, "s": client._session, "n": 7})
        for _ in range(2):  # the same request twice, as a client resends it on a new connection
            with raw_connection(server) as sock:
                sock.sendall(frame)
                reply = FrameReader().feed(sock.recv(4096))
                assert reply == [{"n": 7, "r": 2}]
        assert client.get("count") == b"2"


def test_close_leaves_no_thread_and_no_socket():
    before = set(os.listdir("/proc/self/fd"))
    threads = threading.active_count()
    server = EmbeddedStoreServer("127.0.0.1", 0).start()
    clients = [EmbeddedStoreClient("127.0.0.1", server.port) for _ in range(3)]
    clients[0].wait(["never"], 0.01)
    for client in clients:
        client.close()
    server.close()
    server.close()
    assert threading.active_count() == threads
    assert set(os.listdir("/proc/self/fd")) <= before


def test_something_else_on_the_port_is_named_as_such():
    with socket.create_server(("127.0.0.1", 0)) as impostor:
        port = impostor.getsockname()[1]

        def answer():
            conn, _ = impostor.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(struct.pack(">I", 2) + b"[]")

        thread = threading.Thread(target=answer)
        thread.start()
        with pytest.raises(StoreUnavailable, match="something other than the store's protocol"):
            EmbeddedStoreClient("127.0.0.1", port).get("k")
        thread.join(GUARD)


# --------------------------------------------------------------------------- the etcd client only


@pytest.fixture
def etcd_url(etcd_server):
    return etcd_server.url()


def test_etcd_keys_live_under_the_job_prefix_so_jobs_share_one_etcd(etcd_url):
    from ma_runtime.coordination.etcd import EtcdStore

    with EtcdStore(etcd_url, "/ma-runtime/job-a") as job_a, EtcdStore(etcd_url, "/ma-runtime/job-b/") as job_b:
        job_a.set("attempt/1/origin", b"a")
        assert job_b.get("attempt/1/origin") is None and job_b.keys() == []
        assert job_b.compare_and_set("attempt/1/origin", None, b"b") is True
        assert job_a.keys() == ["attempt/1/origin"] and job_a.get("attempt/1/origin") == b"a"


def test_etcd_a_dead_endpoint_is_passed_over_and_all_dead_is_one_line_naming_them(etcd_url):
    from ma_runtime.coordination.etcd import EtcdStore

    dead = free_port()
    live = etcd_url[len("etcd://"):]
    with EtcdStore(f"etcd://127.0.0.1:{dead},{live}", "/ma-runtime/failover/") as store:
        assert store.add("count", 1) == 1 and store.get("count") == b"1"
    other = free_port()
    with pytest.raises(StoreUnavailable) as raised:
        EtcdStore(f"etcd://127.0.0.1:{dead},[::1]:{other}", "/ma-runtime/failover/", reconnect_seconds=0.2)
    message = str(raised.value)
    assert "\n" not in message and f"127.0.0.1:{dead},[::1]:{other}" in message


def test_etcd_something_else_on_the_port_is_named_as_such(etcd_server):
    from ma_runtime.coordination.etcd import EtcdStore

    with socket.create_server(("127.0.0.1", 0)) as impostor:
        port = impostor.getsockname()[1]

        def answer():
            conn, _ = impostor.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

        thread = threading.Thread(target=answer)
        thread.start()
        with pytest.raises(StoreUnavailable, match="something other than etcd's HTTP gateway"):
            EtcdStore(f"etcd://127.0.0.1:{port}", "/ma-runtime/x/", reconnect_seconds=0.2)
        thread.join(GUARD)


def test_etcd_a_wait_that_ends_leaves_no_watch_socket_and_no_thread(etcd_url):
    from ma_runtime.coordination.etcd import EtcdStore

    with EtcdStore(etcd_url, f"/ma-runtime/test-{uuid.uuid4().hex}/") as store:
        store.get("warm")  # the pooled connection of the client's own requests exists before counting
        sockets, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
        for index in range(5):
            assert store.wait([f"never/{index}"], 0.05) is False
        assert len(os.listdir("/proc/self/fd")) == sockets and threading.active_count() == threads


@pytest.mark.parametrize("url", ["http://127.0.0.1:2379", "etcd://", "etcd://host", "etcd://host:port",
                                 "etcd://host:99999", "etcd://a:1,,b:2", "etcd://:2379"])
def test_etcd_a_url_that_is_not_etcd_host_port_is_one_config_error(url):
    from ma_runtime.coordination.etcd import parse_endpoints

    with pytest.raises(ConfigError) as raised:
        parse_endpoints(url)
    assert "\n" not in str(raised.value) and "etcd://host:port" in raised.value.hint + str(raised.value)


def test_etcd_endpoints_parse_with_ipv6_and_spaces():
    from ma_runtime.coordination.etcd import parse_endpoints

    assert parse_endpoints("etcd://10.0.0.5:2379, [fd00::1]:2379/") == [("10.0.0.5", 2379), ("fd00::1", 2379)]


def test_etcd_without_etcd3gw_is_one_config_error_naming_the_extra(monkeypatch):
    from ma_runtime.coordination.etcd import EtcdStore

    monkeypatch.setitem(sys.modules, "etcd3gw", None)  # an import of it fails as when it is not installed
    with pytest.raises(ConfigError, match="etcd3gw") as raised:
        EtcdStore("etcd://127.0.0.1:2379", "/ma-runtime/job/")
    assert raised.value.hint == "pip install 'ma-runtime[etcd]'"


def test_the_etcd_module_imports_etcd3gw_only_when_used():
    code = ("import sys\nimport ma_runtime.coordination.etcd\nassert 'etcd3gw' not in sys.modules\n"
            "assert 'requests' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], env=child_environment(), check=True, timeout=GUARD)


# --------------------------------------------------------------------------- the framing


def test_frames_round_trip_whatever_the_chunks():
    messages = [{"n": 1, "r": None}, {"n": 2, "r": ["a", "b"]}, {"n": 3, "e": "é"}]
    stream = b"".join(embedded.encode_frame(message) for message in messages)
    for size in (1, 3, 7, len(stream)):
        reader, got = FrameReader(), []
        for start in range(0, len(stream), size):
            got += reader.feed(stream[start:start + size])
        assert got == messages


def test_a_frame_is_refused_from_its_header_before_its_body_arrives():
    reader = FrameReader(limit=16)
    assert reader.feed(struct.pack(">I", 16) + b"{}") == []
    with pytest.raises(FrameError, match="over the limit"):
        FrameReader(limit=16).feed(struct.pack(">I", 17))
    with pytest.raises(FrameError, match="over the limit"):
        embedded.encode_frame({"k": "x" * 16}, limit=16)


@pytest.mark.parametrize("body", [b"\xff", b"nope", b"3", json.dumps(["a"]).encode()])
def test_a_frame_that_is_not_a_json_object_is_refused(body):
    with pytest.raises(FrameError):
        FrameReader().feed(struct.pack(">I", len(body)) + body)
