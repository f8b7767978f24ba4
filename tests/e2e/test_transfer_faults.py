"""Network faults between the real ObsStore and moto, made by a small TCP proxy in the test.

The proxy (threads, 127.0.0.1:0) can reset connections, answer 503, delay
responses or cut a response short, for the first N requests of chosen
methods. It reads each client connection request by request, so a request
on a kept-alive connection (ma_runtime's reads) can be spoiled as well as
the first one on a new connection (the SDK's other calls). Each case ends
in one of two ways: the transfer succeeds with the right bytes, or it fails
cleanly with TransientError once `retry_seconds` are spent. Either way, no
file at a final path is ever partial or corrupt.

Writes a store must not take as done, answered without being passed on:
"error-200", a 200 whose body is an `<Error>` document (S3 documents that a
CompleteMultipartUpload may end so), and "no-etag", a 200 without an ETag.
A request is chosen by its method and query markers (`marker` in it, `unless`
not): the complete is a POST with `uploadId=`, a whole object a PUT without it.
Either way the object must end up really stored, or the upload fail cleanly.
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
from ma_runtime.storage.base import TransientError
from ma_runtime.storage.stores import open_store
from tests.uploads import upload_file

MiB = 1 << 20
SLOW_DOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>"
             b"<Message>Please reduce your request rate.</Message><RequestId>proxy</RequestId></Error>")
INTERNAL_ERROR = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>InternalError</Code>"
                  b"<Message>We encountered an internal error. Please try again.</Message>"
                  b"<RequestId>proxy</RequestId></Error>")
# Answers given in place of the server's, to a request that never reaches it; the connection stays open.
ANSWERS = {
    "error-200": b"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(INTERNAL_ERROR), INTERNAL_ERROR),
    "no-etag": b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
}


class FaultProxy:
    """Forwards 127.0.0.1:<port> to the upstream, spoiling the first `count` requests of `methods`."""

    def __init__(self, upstream):
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.lock = threading.Lock()
        self.fault, self.count, self.methods, self.objects_only = None, 0, (), True
        self.delay, self.cut_bytes = 0.0, 0
        self.marker, self.unless = "", None
        self.spoiled = 0
        self.connections = self.requests = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, fault, count=10**9, methods=("GET",), objects_only=True, delay=0.0, cut_bytes=64 * 1024,
            marker="", unless=None):
        """`objects_only`: spoil requests for objects (/bucket/key), not bucket-level ones (listings); `marker`,
        `unless`: only requests whose target holds `marker` and not `unless` ("uploadId=", "partNumber=")."""
        with self.lock:
            self.fault, self.count, self.methods, self.objects_only = fault, count, methods, objects_only
            self.delay, self.cut_bytes, self.spoiled = delay, cut_bytes, 0
            self.marker, self.unless = marker, unless

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
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _take_fault(self, method, path):
        is_object = "/" in path.split("?", 1)[0].lstrip("/")  # path style: /bucket/key
        with self.lock:
            self.requests += 1
            chosen = self.marker in path and not (self.unless and self.unless in path)
            if (self.fault and method in self.methods and (is_object or not self.objects_only) and chosen
                    and self.count > 0):
                self.count -= 1
                self.spoiled += 1
                return self.fault
            return None

    def _serve(self, client):
        """One client connection, request by request (clients keep connections alive): each request goes
        upstream on a connection of its own, and its answer comes back without the upstream's
        `Connection: close`, so the client may send its next request here."""
        buffered = b""
        try:
            while True:
                head, buffered = _read_head(client, buffered)
                if head is None:
                    return
                method, path = (part.decode() for part in head.split(b" ", 2)[:2])
                body, buffered = _read_body(client, head, buffered)
                fault = self._take_fault(method, path)
                if fault == "reset":
                    _reset(client)
                    return
                if fault == "503":
                    client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
                                   b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(SLOW_DOWN), SLOW_DOWN))
                    return
                if fault in ANSWERS:
                    client.sendall(ANSWERS[fault])
                    continue
                if not self._forward(client, head, body, fault):
                    return
        except OSError:
            pass
        finally:
            client.close()

    def _forward(self, client, head, body, fault):
        """Sends one request upstream and its answer back; False when the client connection is done."""
        upstream = socket.create_connection(self.upstream)
        try:
            upstream.sendall(_with_header(head, b"Connection: close") + body)
            answer = b""
            while True:  # the upstream closes after its answer (we asked it to)
                chunk = upstream.recv(1 << 20)
                if not chunk:
                    break
                answer += chunk
        finally:
            upstream.close()
        if fault == "delay":
            time.sleep(self.delay)
        answer_head, _, answer_body = answer.partition(b"\r\n\r\n")
        answer = _without_header(answer_head, b"connection") + b"\r\n\r\n" + answer_body
        if fault == "cut":
            client.sendall(answer[:len(answer_head) + 4 + self.cut_bytes])
            _reset(client)  # mid-body: the client sees the connection die before Content-Length
            return False
        client.sendall(answer)
        return True


def _read_head(sock, buffered):
    """(request head, bytes after it) or (None, b"") when the client closed."""
    data = buffered
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def _read_body(sock, head, buffered):
    """(the request's body, bytes after it), by its Content-Length."""
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    data = buffered
    while len(data) < length:
        chunk = sock.recv(min(length - len(data), 1 << 20))
        if not chunk:
            break
        data += chunk
    return data[:length], data[length:]


def _with_header(head, header):
    return _without_header(head[:-4], b"connection") + b"\r\n" + header + b"\r\n\r\n"


def _without_header(head, name):
    lines = head.split(b"\r\n")
    return b"\r\n".join(line for line in lines if not line.lower().startswith(name + b":"))


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
    """Every file in the tree is complete and correct: partial files live outside it."""
    for path in dest.rglob("*") if dest.exists() else []:
        if not path.is_dir():
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


def test_reads_reuse_connections_and_survive_resets_on_reused_ones(proxy, obs_endpoint, seeded, tmp_path):
    bucket, expected = seeded
    download(proxy, obs_endpoint, tmp_path / "first", bucket, retry_seconds=30)
    assert proxy.requests > proxy.connections  # kept alive: more requests than connections

    store = store_via(proxy, obs_endpoint, tmp_path)
    opts = options(tmp_path, retry_seconds=30)
    location = storage_url.parse(f"obs://{bucket}/data/")
    transfer.download(store, location, tmp_path / "warm", opts, Log())  # every worker now holds a connection
    proxy.arm("reset", 3, ("GET",))
    log = Log()

    summary = transfer.download(store, location, tmp_path / "dest", opts, log)

    assert proxy.spoiled == 3
    assert {p.name: p.read_bytes() for p in (tmp_path / "dest").iterdir()} == expected
    assert summary.files == len(expected)


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


def test_a_cut_listing_is_retried_and_the_files_arrive_whole(proxy, obs_endpoint, seeded, tmp_path):
    bucket, expected = seeded
    proxy.arm("cut", 1, ("GET",), objects_only=False, cut_bytes=400)  # the listing's GET: cut inside its XML

    summary, log = download(proxy, obs_endpoint, tmp_path, bucket, retry_seconds=10)

    assert proxy.spoiled == 1  # the fault was injected, into the first GET: the listing
    assert ("warning", "storage request failed, retrying") in log.events
    assert {p.name: p.read_bytes() for p in (tmp_path / "dest").iterdir()} == expected
    assert (summary.files, summary.refused) == (len(expected), [])


def test_faults_during_a_multipart_upload_are_retried(proxy, obs_endpoint, tmp_path):
    bucket = obs_endpoint.new_bucket()
    data = random.Random(1).randbytes(16 * MiB)
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    store = store_via(proxy, obs_endpoint, tmp_path)
    opts = transfer.TransferOptions(workers=2, part_size=5 * MiB, large_threshold=8 * MiB, retry_seconds=30,
                                    progress_seconds=0, state_dir=tmp_path / "state")
    proxy.arm("reset", 2, ("PUT",))

    upload_file(store, path, storage_url.parse(f"obs://{bucket}/up/model.bin"), opts, Log())

    assert proxy.spoiled == 2
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key="up/model.bin")["Body"].read() == data


def upload_options(tmp_path, retry_seconds=30):
    return transfer.TransferOptions(workers=2, part_size=5 * MiB, large_threshold=8 * MiB,
                                    retry_seconds=retry_seconds, progress_seconds=0, state_dir=tmp_path / "state")


def test_an_error_in_a_200_to_the_complete_is_retried_and_the_object_is_whole(proxy, obs_endpoint, tmp_path):
    bucket = obs_endpoint.new_bucket()
    data = random.Random(2).randbytes(12 * MiB + 5)
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    log = Log()
    proxy.arm("error-200", 1, ("POST",), marker="uploadId=")

    info = upload_file(store_via(proxy, obs_endpoint, tmp_path), path,
                                storage_url.parse(f"obs://{bucket}/up/model.bin"), upload_options(tmp_path), log)

    assert proxy.spoiled == 1 and ("warning", "storage request failed, retrying") in log.events
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key="up/model.bin")["Body"].read() == data
    assert info.etag == obs_endpoint.s3.head_object(Bucket=bucket, Key="up/model.bin")["ETag"].strip('"')


def test_a_put_answered_200_without_an_etag_is_sent_again(proxy, obs_endpoint, tmp_path):
    bucket = obs_endpoint.new_bucket()
    path = tmp_path / "metrics.json"
    path.write_bytes(b'{"loss": 0.25}')
    log = Log()
    proxy.arm("no-etag", 1, ("PUT",), unless="uploadId=")

    info = upload_file(store_via(proxy, obs_endpoint, tmp_path), path,
                                storage_url.parse(f"obs://{bucket}/up/"), upload_options(tmp_path), log)

    assert proxy.spoiled == 1 and ("warning", "storage request failed, retrying") in log.events
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key="up/metrics.json")["Body"].read() == path.read_bytes()
    assert info.etag == hashlib.md5(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- faults that do not pass


@pytest.mark.parametrize("fault", ["reset", "503", "cut"])
def test_endless_faults_fail_cleanly_after_retry_seconds(proxy, obs_endpoint, seeded, tmp_path, fault):
    bucket, expected = seeded
    proxy.arm(fault, methods=("GET",), cut_bytes=1000)  # 1000: inside the body of even the smallest object
    started = time.monotonic()

    with pytest.raises(TransientError, match=r"failed \d+ times in"):
        download(proxy, obs_endpoint, tmp_path, bucket, retry_seconds=3)

    assert time.monotonic() - started >= 3  # it retried for the whole budget before giving up
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


def test_endless_errors_in_200_to_the_complete_fail_cleanly_and_a_rerun_completes(proxy, obs_endpoint, tmp_path):
    """Never taken as done: the upload fails once `retry_seconds` are spent, nothing is at the key, and the
    upload's record stays, so a rerun completes it without sending its parts again."""
    bucket = obs_endpoint.new_bucket()
    data = random.Random(3).randbytes(12 * MiB)
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    location = storage_url.parse(f"obs://{bucket}/up/model.bin")
    store = store_via(proxy, obs_endpoint, tmp_path)
    proxy.arm("error-200", methods=("POST",), marker="uploadId=")

    with pytest.raises(TransientError, match=r"error document.*failed \d+ times in"):
        upload_file(store, path, location, upload_options(tmp_path, retry_seconds=2), Log())

    assert proxy.spoiled >= 2
    assert obs_endpoint.s3.list_objects(Bucket=bucket).get("Contents") is None
    proxy.arm("reset", methods=("PUT",))  # a part sent again would fail: none is
    log = Log()

    upload_file(store, path, location, upload_options(tmp_path), log)

    assert ("info", "upload resumed") in log.events and proxy.spoiled == 0
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key="up/model.bin")["Body"].read() == data
