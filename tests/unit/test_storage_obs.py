"""ObsStore: the real esdk-obs-python against moto (v4 and v2), and small local HTTP servers for the
answers moto does not give (moto checks no signatures, so 403 comes from a fake server that answers it).

Objects are seeded and checked with boto3, a client independent of the code under test.
"""

import contextlib
import hashlib
import http.server
import ipaddress
import os
import socket
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from ma_runtime import spec
from ma_runtime.storage.base import AccessDenied, NotFound, ObjectInfo, StorageError, TransientError
from ma_runtime.storage.obs import ObsStore
from ma_runtime.storage.obs import wire as obs_wire
from ma_runtime.storage.obs.client import signing_region, uses_path_style
from tests.storage_env import ACCESS_KEY, SECRET_KEY

SIGNATURES = ["v4", "v2"]
MB = 1 << 20
PAGED_KEYS = [f"many/{i:05d}" for i in range(1005)]
ODD_KEYS = ["ünï/κλειδί.txt", "ünï/空 格+plus.bin", "dir/"]


def make_store(env, tmp_path) -> ObsStore:
    environ = {**env, "MA_HOME": str(tmp_path)}
    return ObsStore.from_settings(spec.load({}, environ), environ)


def assert_no_secret(exc: BaseException) -> None:
    text = f"{exc} {getattr(exc, 'hint', '')}"
    assert SECRET_KEY not in text
    assert "\n" not in str(exc)


@pytest.fixture(params=SIGNATURES)
def signature(request):
    return request.param


@pytest.fixture
def store(obs_endpoint, tmp_path, signature):
    return make_store(obs_endpoint.env(signature), tmp_path)


@pytest.fixture
def bucket(obs_endpoint):
    return obs_endpoint.new_bucket()


@pytest.fixture(scope="module")
def paged_bucket(obs_endpoint):
    """Over one listing page of tiny keys, plus unicode keys and a directory marker; seeded once."""
    name = obs_endpoint.new_bucket()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda key: obs_endpoint.put(name, key, b"" if key.endswith("/") else key.encode()),
                      PAGED_KEYS + ODD_KEYS))
    return name


# --- a local HTTP server for answers moto does not give ----------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    answer = None  # (status, headers, body, declared length or None); set per server

    def _reply(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)  # drain an upload, so the client reads our answer, not a reset
        status, headers, body, declared = self.server.answer
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body) if declared is None else declared))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.close_connection = True

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _reply

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def fake_server(status, body=b"", headers=None, declared_length=None, tls_context=None):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.answer = (status, headers or {}, body, declared_length)
    if tls_context is not None:
        server.socket = tls_context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    scheme = "https" if tls_context is not None else "http"
    try:
        yield f"{scheme}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def error_xml(code, message):
    return (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>req-1</RequestId></Error>").encode()


def fake_env(url, signature="v4"):
    return {"MA_S3_ENDPOINT": url, "OBS_ACCESS_KEY_ID": ACCESS_KEY, "OBS_SECRET_ACCESS_KEY": SECRET_KEY,
            "MA_RUNTIME_STORAGE_SIGNATURE": signature}


def every_request(store, tmp_path):
    """One call of each kind, for the error tests; yields (name, zero-argument callable)."""
    source = tmp_path / "source.bin"
    source.write_bytes(b"x" * 100)
    fd = os.open(tmp_path / "sink.bin", os.O_RDWR | os.O_CREAT)
    try:
        yield "list", lambda: list(store.list("bkt", "p/"))
        yield "head", lambda: store.head("bkt", "k")
        yield "read_range", lambda: store.read_range("bkt", "k", 10, 20, fd, 0)
        yield "put_file", lambda: store.put_file("bkt", "k", str(source))
        yield "create_multipart", lambda: store.create_multipart("bkt", "k")
        yield "upload_part", lambda: store.upload_part("bkt", "k", "up1", 1, str(source), 0, 100)
        yield "complete_multipart", lambda: store.complete_multipart("bkt", "k", "up1", [(1, "abc")])
        yield "abort_multipart", lambda: store.abort_multipart("bkt", "k", "up1")
    finally:
        os.close(fd)


# --- listing and reading ---------------------------------------------------------------------------


def test_list_pages_past_1000_keys_with_unicode_keys_and_directory_markers(store, paged_bucket):
    listed = list(store.list(paged_bucket, ""))
    assert [info.key for info in listed] == sorted(PAGED_KEYS + ODD_KEYS)
    by_key = {info.key: info for info in listed}
    assert by_key["dir/"].size == 0
    assert by_key["ünï/空 格+plus.bin"] == ObjectInfo(
        "ünï/空 格+plus.bin", len("ünï/空 格+plus.bin".encode()), hashlib.md5("ünï/空 格+plus.bin".encode()).hexdigest()
    )


def test_list_under_a_prefix(store, paged_bucket):
    assert [info.key for info in store.list(paged_bucket, "ünï/")] == sorted(ODD_KEYS[:2])
    assert list(store.list(paged_bucket, "nothing-here/")) == []


def test_head_gives_size_and_etag(store, obs_endpoint, bucket):
    data = os.urandom(1234)
    obs_endpoint.put(bucket, "a/b.bin", data)
    assert store.head(bucket, "a/b.bin") == ObjectInfo("a/b.bin", 1234, hashlib.md5(data).hexdigest())


def test_read_range_writes_the_middle_bytes_at_an_offset(store, obs_endpoint, bucket, tmp_path):
    data = os.urandom(3 * MB + 17)
    obs_endpoint.put(bucket, "big.bin", data)
    start, length, offset = 1000, 2 * MB + 500, 4096
    target = tmp_path / "target.bin"
    target.write_bytes(b"\0" * offset)
    fd = os.open(target, os.O_RDWR)
    try:
        assert store.read_range(bucket, "big.bin", start, length, fd, offset) == length
    finally:
        os.close(fd)
    assert target.read_bytes() == b"\0" * offset + data[start : start + length]


def test_read_range_of_a_whole_object(store, obs_endpoint, bucket, tmp_path):
    data = os.urandom(100_000)
    obs_endpoint.put(bucket, "whole.bin", data)
    target = tmp_path / "whole.bin"
    fd = os.open(target, os.O_RDWR | os.O_CREAT)
    try:
        assert store.read_range(bucket, "whole.bin", 0, len(data), fd, 0) == len(data)
        assert store.read_range(bucket, "whole.bin", 5, 0, fd, 0) == 0  # an empty range asks nothing
    finally:
        os.close(fd)
    assert target.read_bytes() == data


def test_body_is_copied_in_bounded_chunks_through_one_buffer(tmp_path):
    """The body streams: no read asks for more than CHUNK, whatever the range's length, and every read
    lands in the same reused buffer (no allocation per read)."""

    class Stream:
        def __init__(self, size):
            self.left, self.asked, self.buffers = size, [], set()

        def readinto(self, view):
            self.asked.append(len(view))
            self.buffers.add(id(view.obj))
            taken = min(len(view), self.left)
            view[:taken] = b"x" * taken
            self.left -= taken
            return taken

    store = make_store(fake_env("http://127.0.0.1:9"), tmp_path)  # nothing is sent
    stream = Stream(5 * obs_wire.CHUNK + 3)
    sink = tmp_path / "sink"
    fd = os.open(sink, os.O_RDWR | os.O_CREAT)
    try:
        assert store._copy_body(stream, 5 * obs_wire.CHUNK + 3, fd, 7, "obs://b/k") == 5 * obs_wire.CHUNK + 3
    finally:
        os.close(fd)
    assert max(stream.asked) <= obs_wire.CHUNK and len(stream.buffers) == 1
    assert sink.stat().st_size == 7 + 5 * obs_wire.CHUNK + 3


# --- writing ---------------------------------------------------------------------------------------


def test_put_file_is_seen_by_boto3(store, obs_endpoint, bucket, tmp_path):
    data = os.urandom(70_000)
    source = tmp_path / "up.bin"
    source.write_bytes(data)
    info = store.put_file(bucket, "out/up.bin", str(source))
    assert info == ObjectInfo("out/up.bin", len(data), hashlib.md5(data).hexdigest())
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key="out/up.bin")["Body"].read() == data


def test_multipart_upload_in_5_mb_parts(store, obs_endpoint, bucket, tmp_path):
    data = os.urandom(12 * MB + 12345)
    source = tmp_path / "big.bin"
    source.write_bytes(data)
    part_size = 5 * MB
    upload_id = store.create_multipart(bucket, "out/big.bin")
    parts = []
    for number, offset in enumerate(range(0, len(data), part_size), start=1):
        size = min(part_size, len(data) - offset)
        parts.append((number, store.upload_part(bucket, "out/big.bin", upload_id, number, str(source), offset, size)))
    assert [etag for _number, etag in parts] == [
        hashlib.md5(data[offset : offset + part_size]).hexdigest() for offset in range(0, len(data), part_size)
    ]
    info = store.complete_multipart(bucket, "out/big.bin", upload_id, parts)
    assert (info.key, info.size, info.etag.endswith("-3"), info.md5) == ("out/big.bin", len(data), True, None)
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key="out/big.bin")["Body"].read() == data


def test_complete_by_another_store_asks_the_size(store, obs_endpoint, bucket, tmp_path, signature):
    source = tmp_path / "small.bin"
    source.write_bytes(b"abc" * 1000)
    upload_id = store.create_multipart(bucket, "out/small.bin")
    etag = store.upload_part(bucket, "out/small.bin", upload_id, 1, str(source), 0, 3000)
    other = make_store(obs_endpoint.env(signature), tmp_path)  # e.g. after a restart: no part sizes in memory
    assert other.complete_multipart(bucket, "out/small.bin", upload_id, [(1, etag)]).size == 3000


def test_a_transient_failure_reading_the_completed_size_is_retried(store, obs_endpoint, bucket, tmp_path,
                                                                    signature, monkeypatch):
    """The full suite once saw moto answer that metadata read with HTTP 500: the complete had been done, so the
    upload could not be completed again (NoSuchUpload) and the object was called failed while it was whole."""
    source = tmp_path / "small.bin"
    source.write_bytes(b"abc" * 1000)
    upload_id = store.create_multipart(bucket, "out/small.bin")
    etag = store.upload_part(bucket, "out/small.bin", upload_id, 1, str(source), 0, 3000)
    other = make_store(obs_endpoint.env(signature), tmp_path)
    real_head, failures = other.head, []

    def head_failing_twice(*args):
        if len(failures) < 2:
            failures.append(args)
            raise TransientError("reading the metadata of obs://b/out/small.bin: HTTP 500")
        return real_head(*args)

    monkeypatch.setattr(other, "head", head_failing_twice)
    assert other.complete_multipart(bucket, "out/small.bin", upload_id, [(1, etag)]).size == 3000
    assert len(failures) == 2


def test_abort_drops_the_upload(store, obs_endpoint, bucket, tmp_path):
    source = tmp_path / "part.bin"
    source.write_bytes(os.urandom(1000))
    upload_id = store.create_multipart(bucket, "out/aborted.bin")
    store.upload_part(bucket, "out/aborted.bin", upload_id, 1, str(source), 0, 1000)
    assert len(obs_endpoint.s3.list_multipart_uploads(Bucket=bucket)["Uploads"]) == 1
    store.abort_multipart(bucket, "out/aborted.bin", upload_id)
    assert obs_endpoint.s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    with pytest.raises(NotFound):
        store.head(bucket, "out/aborted.bin")
    # (moto answers a complete of an aborted upload with 500, not S3's 404 NoSuchUpload: not tested.)


def test_unicode_key_with_spaces_and_plus_round_trips(store, obs_endpoint, bucket, tmp_path):
    """Keys the signatures must encode: non-ASCII, a space, '+', '%', '='."""
    key = "目录/a b+c%20=d.bin"
    source = tmp_path / "u.bin"
    source.write_bytes(b"unicode body")
    store.put_file(bucket, key, str(source))
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key=key)["Body"].read() == b"unicode body"
    assert store.head(bucket, key).size == 12
    assert [info.key for info in store.list(bucket, "目录/")] == [key]
    fd = os.open(tmp_path / "u.out", os.O_RDWR | os.O_CREAT)
    try:
        assert store.read_range(bucket, key, 8, 4, fd, 0) == 4
    finally:
        os.close(fd)
    assert (tmp_path / "u.out").read_bytes() == b"body"


def test_upload_part_rejects_bounds_outside_the_file(store, bucket, tmp_path):
    """The SDK would quietly upload from byte 0 or only the rest of the file."""
    source = tmp_path / "short.bin"
    source.write_bytes(b"x" * 100)
    for offset, size in ((100, 10), (50, 51), (0, 0), (-1, 10)):
        with pytest.raises(StorageError, match="outside"):
            store.upload_part(bucket, "k", "up", 1, str(source), offset, size)


def test_put_file_refuses_a_directory_and_an_empty_key(store, bucket, tmp_path):
    with pytest.raises(StorageError, match="not a regular file"):
        store.put_file(bucket, "k", str(tmp_path))
    source = tmp_path / "f.bin"
    source.write_bytes(b"x")
    with pytest.raises(StorageError, match="key is required"):
        store.put_file(bucket, "", str(source))


# --- errors ----------------------------------------------------------------------------------------


def test_missing_key_is_not_found_naming_the_url(store, bucket, tmp_path):
    with pytest.raises(NotFound) as caught:
        store.head(bucket, "no/such.key")
    assert f"obs://{bucket}/no/such.key" in str(caught.value)
    assert_no_secret(caught.value)
    fd = os.open(tmp_path / "sink", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(NotFound) as caught:
            store.read_range(bucket, "no/such.key", 0, 10, fd, 0)
    finally:
        os.close(fd)
    assert f"obs://{bucket}/no/such.key" in str(caught.value) and "NoSuchKey" in str(caught.value)
    assert_no_secret(caught.value)


def test_missing_bucket_is_not_found(store):
    with pytest.raises(NotFound) as caught:
        list(store.list("no-such-bucket-ma", "x/"))
    assert "obs://no-such-bucket-ma/x/" in str(caught.value) and "does not exist" in str(caught.value)
    assert_no_secret(caught.value)


@pytest.mark.parametrize("signature", SIGNATURES)
def test_403_is_access_denied_naming_bucket_and_credential_variables(tmp_path, signature):
    with fake_server(403, error_xml("SignatureDoesNotMatch", "bad signature"),
                     {"Content-Type": "application/xml"}) as url:
        store = make_store(fake_env(url, signature), tmp_path)
        for name, call in every_request(store, tmp_path):
            with pytest.raises(AccessDenied) as caught:
                call()
            message = str(caught.value)
            assert "'bkt'" in message and "OBS_ACCESS_KEY_ID/OBS_SECRET_ACCESS_KEY" in message, name
            assert_no_secret(caught.value)
    assert "SignatureDoesNotMatch" in message


@pytest.fixture
def connections(monkeypatch):
    """The TCP connections opened since (attempts included): one per request, as the fake server closes each, so
    more means the SDK retried. Counted, not timed: a retry's backoff may be shorter than a loaded machine's delay."""
    opened = []
    connect = socket.socket.connect

    def counting(sock, address):
        opened.append(address)
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", counting)
    return opened


@pytest.mark.parametrize("status", [503, 500, 429])
def test_5xx_and_429_are_transient(tmp_path, status, connections):
    with fake_server(status, error_xml("ServiceUnavailable", "slow down")) as url:
        store = make_store(fake_env(url), tmp_path)
        for name, call in every_request(store, tmp_path):
            connections.clear()
            with pytest.raises(TransientError) as caught:
                call()
            assert f"HTTP {status}" in str(caught.value), name
            assert len(connections) == 1, f"{name}: the SDK retried"
            assert_no_secret(caught.value)


def test_other_statuses_are_storage_errors_with_status_and_code(tmp_path):
    with fake_server(400, error_xml("InvalidArgument", "bad argument")) as url:
        store = make_store(fake_env(url), tmp_path)
        with pytest.raises(StorageError) as caught:
            list(store.list("bkt", "p/"))
    assert type(caught.value) is StorageError
    assert caught.value.refusal is False  # a listing is about a prefix: no one object to set aside
    assert "HTTP 400 InvalidArgument" in str(caught.value) and "obs://bkt/p/" in str(caught.value)


def test_unreachable_endpoint_is_transient_at_once(tmp_path, connections):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed when the block ends: nothing listens there
    store = make_store(fake_env(f"http://127.0.0.1:{port}"), tmp_path)
    for name, call in every_request(store, tmp_path):
        connections.clear()
        with pytest.raises(TransientError) as caught:
            call()
        assert len(connections) == 1, f"{name}: the SDK retried"
        assert "ConnectionRefusedError" in str(caught.value)
        assert_no_secret(caught.value)


def test_body_cut_short_is_transient(tmp_path):
    headers = {"Content-Range": "bytes 10-109/1000", "ETag": '"abc"'}
    with fake_server(206, b"y" * 40, headers, declared_length=100) as url:
        store = make_store(fake_env(url), tmp_path)
        fd = os.open(tmp_path / "sink", os.O_RDWR | os.O_CREAT)
        try:
            with pytest.raises(TransientError, match="cut short after 40 of 100 bytes"):
                store.read_range("bkt", "k", 10, 100, fd, 0)
        finally:
            os.close(fd)


def test_a_server_ignoring_range_is_refused(tmp_path):
    with fake_server(200, b"z" * 1000) as url:
        store = make_store(fake_env(url), tmp_path)
        fd = os.open(tmp_path / "sink", os.O_RDWR | os.O_CREAT)
        try:
            with pytest.raises(StorageError, match="ignored Range"):
                store.read_range("bkt", "k", 10, 100, fd, 0)
            assert store.read_range("bkt", "k", 0, 100, fd, 0) == 100  # from byte 0 the prefix is right
        finally:
            os.close(fd)
    assert (tmp_path / "sink").read_bytes() == b"z" * 100


def test_untrusted_certificate_is_not_retried_and_verification_can_be_off(tmp_path, monkeypatch):
    cert_path, key_path = _self_signed_certificate(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_path, key_path)
    with fake_server(404, error_xml("NoSuchKey", "none"), tls_context=context) as url:
        verifying = make_store({**fake_env(url), "S3_VERIFY_SSL": "1"}, tmp_path)
        with pytest.raises(StorageError) as caught:
            verifying.head("bkt", "k")
        assert not isinstance(caught.value, TransientError)
        assert "certificate" in str(caught.value) and "S3_VERIFY_SSL" in caught.value.hint
        trusting = make_store({**fake_env(url), "S3_VERIFY_SSL": "0"}, tmp_path)
        with pytest.raises(NotFound):
            trusting.head("bkt", "k")
        # Trusted through the default store (which the SDK's own context never loads), the request goes through.
        monkeypatch.setenv("SSL_CERT_FILE", cert_path)
        trusted = make_store({**fake_env(url), "S3_VERIFY_SSL": "1"}, tmp_path)
        with pytest.raises(NotFound):
            trusted.head("bkt", "k")


def _self_signed_certificate(tmp_path):
    pytest.importorskip("cryptography")
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    address = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1)).add_extension(address, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


# --- settings --------------------------------------------------------------------------------------


def test_missing_endpoint_names_the_settings(tmp_path):
    env = fake_env("x")
    del env["MA_S3_ENDPOINT"]
    with pytest.raises(StorageError) as caught:
        make_store(env, tmp_path)
    assert str(caught.value) == "no OBS endpoint: set MA_S3_ENDPOINT or storage.endpoint in the job file"


@pytest.mark.parametrize("missing", ["OBS_ACCESS_KEY_ID", "OBS_SECRET_ACCESS_KEY"])
def test_missing_credentials_name_the_variable_without_values(tmp_path, missing):
    env = fake_env("http://127.0.0.1:9")
    env[missing] = ""
    with pytest.raises(StorageError) as caught:
        make_store(env, tmp_path)
    assert missing in str(caught.value)
    assert ACCESS_KEY not in str(caught.value) + caught.value.hint
    assert_no_secret(caught.value)


def test_describe_names_endpoint_and_variables_only(tmp_path):
    store = make_store({**fake_env("obs.cn-north-4.myhuaweicloud.com"), "OBS_SECURITY_TOKEN": "tok-secret-123"},
                       tmp_path)
    text = store.describe()
    assert text == ("OBS endpoint https://obs.cn-north-4.myhuaweicloud.com (credentials from "
                    "OBS_ACCESS_KEY_ID/OBS_SECRET_ACCESS_KEY/OBS_SECURITY_TOKEN)")
    assert SECRET_KEY not in text and "tok-secret-123" not in text and ACCESS_KEY not in text


def test_endpoint_without_scheme_follows_s3_use_https(tmp_path):
    store = make_store({**fake_env("10.0.0.5:8080"), "S3_USE_HTTPS": "0"}, tmp_path)
    assert "http://10.0.0.5:8080 " in store.describe()


@pytest.mark.parametrize(
    "configured, host, region",
    [
        ("", "obs.cn-north-4.myhuaweicloud.com", "cn-north-4"),
        ("", "obs.ap-southeast-1.myhuaweicloud.com", "ap-southeast-1"),
        ("", "obs.region-a.example-cloud.com", "region-a"),
        ("", "obs.example.com", "us-east-1"),
        ("", "127.0.0.1", "us-east-1"),
        ("", "minio.local", "us-east-1"),
        ("eu-west-101", "obs.cn-north-4.myhuaweicloud.com", "eu-west-101"),
    ],
)
def test_signing_region(configured, host, region):
    assert signing_region(configured, host) == region


@pytest.mark.parametrize(
    "setting, host, path_style",
    [
        ("auto", "obs.cn-north-4.myhuaweicloud.com", False),
        ("auto", "obs.eu-west-101.huaweicloud.com", False),
        ("auto", "127.0.0.1", True),
        ("auto", "::1", True),
        ("auto", "localhost", True),
        ("auto", "obs.private-cloud.example", True),
        ("auto", "notmyhuaweicloud.com", True),
        ("on", "obs.cn-north-4.myhuaweicloud.com", True),
        ("off", "127.0.0.1", False),
    ],
)
def test_path_style(setting, host, path_style):
    assert uses_path_style(setting, host) is path_style
