"""Network faults between the real ObsStore and moto, made by a small TCP proxy in the test.

The proxy (threads, 127.0.0.1:0) can reset connections, answer 503, delay
responses or cut a response short, for the first N requests of chosen
methods (the SDK opens one connection per request, so a connection is a
request). Each case ends in one of two ways: the transfer succeeds with the
right bytes, or it fails cleanly with TransientError once `retry_seconds` are
spent. Either way, no file at a final path is ever partial or corrupt.
"""

import hashlib
import random
import socket
import struct
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from ma_runtime import spec as job_spec
from ma_runtime.storage import transfer
from ma_runtime.storage import url as storage_url
from ma_runtime.storage.base import StorageError, TransientError
from ma_runtime.storage.stores import open_store

MiB = 1 << 20
SLOW_DOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>"
             b"<Message>Please reduce your request rate.</Message><RequestId>proxy</RequestId></Error>")


class FaultProxy:
    """Forwards 127.0.0.1:<port> to the upstream, spoiling the first `count` requests of `methods`."""

    def __init__(self, upstream):
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.lock = threading.Lock()
        self.fault, self.count, self.methods, self.objects_only = None, 0, (), True
        self.delay, self.cut_bytes = 0.0, 0
        self.spoiled = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, fault, count=10**9, methods=("GET",), objects_only=True, delay=0.0, cut_bytes=64 * 1024):
        """`objects_only`: spoil requests for objects (/bucket/key), not bucket-level ones (listings)."""
        with self.lock:
            self.fault, self.count, self.methods, self.objects_only = fault, count, methods, objects_only
            self.delay, self.cut_bytes, self.spoiled = delay, cut_bytes, 0

    def disarm(self):
        self.arm(None, 0)

    def close(self):
        self.listener.close()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _take_fault(self, method, path):
        is_object = "/" in path.split("?", 1)[0].lstrip("/")  # path style: /bucket/key
        with self.lock:
            if self.fault and method in self.methods and (is_object or not self.objects_only) and self.count > 0:
                self.count -= 1
                self.spoiled += 1
                return self.fault
            return None

    def _serve(self, client):
        try:
            head, rest = _read_head(client)
            if head is None:
                return
            method, path = (part.decode() for part in head.split(b" ", 2)[:2])
            fault = self._take_fault(method, path)
            if fault == "reset":
                _reset(client)
            elif fault == "503":
                _drain_body(client, head, rest)
                client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
                               b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(SLOW_DOWN), SLOW_DOWN))
            else:
                self._forward(client, head + rest, fault)
        except OSError:
            pass
        finally:
            client.close()

    def _forward(self, client, first_bytes, fault):
        upstream = socket.create_connection(self.upstream)
        try:
            upstream.sendall(first_bytes)
            threading.Thread(target=_pump, args=(client, upstream, None), daemon=True).start()
            if fault == "delay":
                time.sleep(self.delay)
            _pump(upstream, client, self.cut_bytes if fault == "cut" else None)
            if fault == "cut":
                _reset(client)  # mid-body: the client sees the connection die before Content-Length
        finally:
            upstream.close()


def _read_head(sock):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def _drain_body(sock, head, rest):
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            remaining = int(line.split(b":", 1)[1]) - len(rest)
            while remaining > 0:
                chunk = sock.recv(min(remaining, 1 << 20))
                if not chunk:
                    return
                remaining -= len(chunk)


def _pump(source, sink, limit):
    """Copies until EOF (or `limit` bytes), then shuts both down so the other direction ends too."""
    sent = 0
    try:
        while limit is None or sent < limit:
            chunk = source.recv(65536 if limit is None else min(65536, limit - sent))
            if not chunk:
                break
            sink.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _reset(sock):
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
    sock.close()


class Log:
    def __init__(self):
        self.events = []

    def info(self, event, **fields):
        self.events.append(("info", event))

    def warning(self, event, **fields):
        self.events.append(("warning", event))

    error = warning


@pytest.fixture
def proxy(obs_endpoint):
    parts = urlsplit(obs_endpoint.url)
    running = FaultProxy((parts.hostname, parts.port))
    yield running
    running.close()


@pytest.fixture
def seeded(obs_endpoint):
    """A bucket with a few small objects and one large one (3 parts of 4 MiB), and their bytes."""
    bucket = obs_endpoint.new_bucket()
    rng = random.Random(42)
    objects = {f"data/small-{i}.bin": rng.randbytes(rng.randint(1000, 50_000)) for i in range(6)}
    objects["data/big.bin"] = rng.randbytes(10 * MiB + 17)
    for key, data in objects.items():
        obs_endpoint.put(bucket, key, data)
    return bucket, {key[len("data/"):]: data for key, data in objects.items()}


def store_via(proxy, obs_endpoint, tmp_path, signature="v4"):
    env = {**obs_endpoint.env(signature), "MA_S3_ENDPOINT": proxy.url, "MA_HOME": str(tmp_path / "home")}
    return open_store(storage_url.parse("obs://b/"), job_spec.load({}, env), env)


def options(tmp_path, retry_seconds):
    return transfer.TransferOptions(workers=4, part_size=4 * MiB, large_threshold=8 * MiB,
                                    retry_seconds=retry_seconds, progress_seconds=0, state_dir=tmp_path / "state")


def assert_nothing_wrong_at_final_paths(dest: Path, expected):
    """Every visible file is complete and correct; only hidden partial files may be anything."""
    for path in dest.rglob("*") if dest.exists() else []:
        if path.is_file() and not path.name.endswith(transfer.PARTIAL_SUFFIX):
            relative = str(path.relative_to(dest))
            assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(expected[relative]).digest(), relative


def download(proxy, obs_endpoint, tmp_path, bucket, retry_seconds, signature="v4"):
    store = store_via(proxy, obs_endpoint, tmp_path, signature)
    log = Log()
    summary = transfer.download(store, storage_url.parse(f"obs://{bucket}/data/"), tmp_path / "dest",
                                options(tmp_path, retry_seconds), log)
    return summary, log


# --------------------------------------------------------------------------- faults that pass


@pytest.mark.parametrize("signature", ["v4", "v2"])
@pytest.mark.parametrize(
    "fault, count, methods",
    [("reset", 5, ("GET",)), ("503", 5, ("GET", "HEAD")), ("cut", 4, ("GET",))],
    ids=["reset", "503", "cut"],
)
def test_a_few_faults_are_retried_and_the_bytes_are_right(proxy, obs_endpoint, seeded, tmp_path, fault, count,
                                                          methods, signature):
    bucket, expected = seeded
    proxy.arm(fault, count, methods)

    summary, log = download(proxy, obs_endpoint, tmp_path, bucket, retry_seconds=30, signature=signature)

    assert proxy.spoiled == count
    assert summary.files == len(expected)
    assert {p.name: p.read_bytes() for p in (tmp_path / "dest").iterdir()} == expected
    assert ("warning", "storage request failed, retrying") in log.events


def test_a_single_large_object_through_resets_of_head_and_get(proxy, obs_endpoint, seeded, tmp_path):
    bucket, expected = seeded
    store = store_via(proxy, obs_endpoint, tmp_path)
    proxy.arm("reset", 4, ("HEAD", "GET"))
    dest = tmp_path / "out" / "big.bin"

    summary = transfer.download(store, storage_url.parse(f"obs://{bucket}/data/big.bin"), dest,
                                options(tmp_path, retry_seconds=30), Log())

    assert proxy.spoiled == 4
    assert (summary.files, dest.read_bytes() == expected["big.bin"]) == (1, True)


def test_slow_responses_arrive_whole(proxy, obs_endpoint, seeded, tmp_path):
    bucket, expected = seeded
    proxy.arm("delay", methods=("GET",), delay=0.3)

    summary, _ = download(proxy, obs_endpoint, tmp_path, bucket, retry_seconds=3)

    assert {p.name: p.read_bytes() for p in (tmp_path / "dest").iterdir()} == expected
    assert summary.files == len(expected)


def test_a_cut_listing_is_retried_or_fails_cleanly(proxy, obs_endpoint, seeded, tmp_path):
    bucket, expected = seeded
    proxy.arm("cut", 1, ("GET",), objects_only=False, cut_bytes=400)  # the listing's GET: cut inside its XML

    try:
        download(proxy, obs_endpoint, tmp_path, bucket, retry_seconds=10)
    except StorageError:
        pass  # a clean failure is allowed; what follows is not negotiable
    assert_nothing_wrong_at_final_paths(tmp_path / "dest", expected)


def test_faults_during_a_multipart_upload_are_retried(proxy, obs_endpoint, tmp_path):
    bucket = obs_endpoint.new_bucket()
    data = random.Random(1).randbytes(16 * MiB)
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    store = store_via(proxy, obs_endpoint, tmp_path)
    opts = transfer.TransferOptions(workers=2, part_size=5 * MiB, large_threshold=8 * MiB, retry_seconds=30,
                                    progress_seconds=0, state_dir=tmp_path / "state")
    proxy.arm("reset", 2, ("PUT",))

    transfer.upload_file(store, path, storage_url.parse(f"obs://{bucket}/up/model.bin"), opts, Log())

    assert proxy.spoiled == 2
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key="up/model.bin")["Body"].read() == data


# --------------------------------------------------------------------------- faults that do not pass


@pytest.mark.parametrize("fault", ["reset", "503", "cut"])
def test_endless_faults_fail_cleanly_after_retry_seconds(proxy, obs_endpoint, seeded, tmp_path, fault):
    bucket, expected = seeded
    proxy.arm(fault, methods=("GET",), cut_bytes=1000)  # 1000: inside the body of even the smallest object
    started = time.monotonic()

    with pytest.raises(TransientError, match=r"failed \d+ times in"):
        download(proxy, obs_endpoint, tmp_path, bucket, retry_seconds=3)

    assert 3 <= time.monotonic() - started < 20
    assert_nothing_wrong_at_final_paths(tmp_path / "dest", expected)
    proxy.disarm()

    summary, _ = download(proxy, obs_endpoint, tmp_path, bucket, retry_seconds=3)

    assert {p.name: p.read_bytes() for p in (tmp_path / "dest").iterdir()} == expected
    assert summary.files + summary.skipped == len(expected)  # files finished before the failure are kept


def test_cut_large_parts_resume_after_the_fault_clears(proxy, obs_endpoint, seeded, tmp_path):
    bucket, expected = seeded
    proxy.arm("cut", methods=("GET",))
    with pytest.raises(TransientError):
        download(proxy, obs_endpoint, tmp_path, bucket, retry_seconds=2)
    assert_nothing_wrong_at_final_paths(tmp_path / "dest", expected)
    proxy.disarm()

    summary, _ = download(proxy, obs_endpoint, tmp_path, bucket, retry_seconds=3)

    assert (tmp_path / "dest" / "big.bin").read_bytes() == expected["big.bin"]
    assert summary.files + summary.skipped == len(expected)
