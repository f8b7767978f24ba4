"""The writes the output sync needs (put_bytes, upload_part from a file, delete, list_uploads), on ObsStore
against moto (v4 and v2) and on LocalStore.

moto checks no signature and no Content-MD5, so the ObsStore tests talk to moto through `CheckingProxy`, a
small HTTP proxy that does what a real server does with a presigned request before passing it on: it checks
the signature of the request as it arrived (v4 and v2, computed here from the AWS rules, independently of the
code under test), refuses a body whose MD5 is not its Content-MD5 (400 BadDigest), and notes the connection
each request came on. It can also answer chosen requests itself (`spoil`): a 200 without an ETag, with an
`<Error>` document, with an unreadable body, before or after passing the request on, for the answers a real
server may give and moto never does. Objects are checked with boto3, talking to moto directly.
"""

import base64
import contextlib
import dataclasses
import errno
import hashlib
import hmac
import http.client
import http.server
import os
import socket
import ssl
import threading
from pathlib import Path
from typing import Optional, Tuple
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import pytest
from obs import ObsClient

from ma_runtime.storage import local as local_module
from ma_runtime.storage import signed, transfer
from ma_runtime.storage.base import (
    AccessDenied,
    CorruptTransfer,
    FileChanged,
    NotFound,
    ObjectInfo,
    ObjectRefused,
    StorageError,
    TransientError,
    Upload,
)
from ma_runtime.storage.local import LocalStore, version_of
from ma_runtime.storage.obs import listing as obs_listing
from ma_runtime.storage.obs import store as obs_module
from tests.storage_env import SECRET_KEY, refusing_endpoint
from tests.unit.test_storage_obs import (
    _self_signed_certificate,
    assert_no_secret,
    error_xml,
    fake_env,
    fake_server,
    make_store,
)

MiB = 1 << 20
ODD_KEY = "out/目录/a b+c%20=d.bin"
# Query parameters a v2 signature covers (S3's sub-resources that these requests use).
V2_SUBRESOURCES = {"acl", "delete", "partNumber", "uploadId", "uploads", "versionId"}


def md5_of(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


# --- a proxy in front of moto that checks what moto does not ---------------------------------------------


@dataclasses.dataclass
class Spoiled:
    """An answer the proxy gives in place of the server's, to the next `count` requests of `method` whose target
    holds `marker` and not `unless`. `forward`: the request reaches the server first (the write happens; its
    answer is lost)."""

    method: str
    marker: str = ""
    status: int = 200
    body: bytes = b""
    headers: Tuple[Tuple[str, str], ...] = ()
    forward: bool = False
    count: int = 1
    unless: Optional[str] = None

    def matches(self, method: str, target: str) -> bool:
        return (self.count > 0 and method == self.method and self.marker in target
                and not (self.unless and self.unless in target))


def spoil(proxy, method, marker="", **answer) -> Spoiled:
    spoiled = Spoiled(method, marker, **answer)
    with proxy.lock:
        proxy.spoils.append(spoiled)
    return spoiled


COMPLETE = ("POST", "uploadId=")  # the SDK's CompleteMultipartUpload: POST /bucket/key?uploadId=...
INTERNAL_ERROR = error_xml("InternalError", "We encountered an internal error. Please try again.")


class _Checking(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a real server

    def _handle(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        kind, problem = check_signature(self.command, self.path, self.headers)
        self.server.seen.append((self.command, urlsplit(self.path).path, kind, self.client_address[1]))
        if problem:
            self.server.bad_signatures.append(problem)
            return self._answer(403, error_xml("SignatureDoesNotMatch", problem))
        sent_md5 = self.headers.get("Content-MD5")
        if sent_md5 is not None and sent_md5 != base64.b64encode(hashlib.md5(body).digest()).decode():
            return self._answer(400, error_xml("BadDigest", "The Content-MD5 you specified did not match"))
        spoiled = self._take_spoiled()
        if spoiled is None:
            return self._relay(body)
        if spoiled.forward:
            self._exchange(body)
        self._answer(spoiled.status, spoiled.body, spoiled.headers)

    def _take_spoiled(self) -> Optional[Spoiled]:
        with self.server.lock:
            for spoiled in self.server.spoils:
                if spoiled.matches(self.command, self.path):
                    spoiled.count -= 1
                    return spoiled
        return None

    def _relay(self, body: bytes):
        self._answer(*self._exchange(body))

    def _exchange(self, body: bytes):
        """Sends the request to moto: (status, body, headers, Content-Length) of its answer."""
        upstream = http.client.HTTPConnection(*self.server.upstream, timeout=30)
        try:
            headers = {name: value for name, value in self.headers.items()
                       if name.lower() not in ("connection", "content-length")}
            upstream.request(self.command, self.path, body=body if self.command in ("PUT", "POST") else None,
                             headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
        finally:
            upstream.close()
        passed = [(name, value) for name, value in answer.getheaders()
                  if name.lower() not in ("connection", "content-length", "transfer-encoding", "date", "server")]
        length = answer.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
        return answer.status, data, passed, length

    def _answer(self, status, body, headers=(), length=None):
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", length if length is not None else str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

    def log_message(self, *args):
        pass


def check_signature(method, target, headers):
    """("v4" | "v2" | "header", why the request's signature is wrong or None). Header-signed requests (the
    SDK's own calls) are not checked: only presigned URLs are this module's business."""
    raw_path, _, raw_query = target.partition("?")
    params = [(unquote(name), unquote(value)) for name, _, value in
              (item.partition("=") for item in raw_query.split("&") if item)]
    names = dict(params)
    if "X-Amz-Signature" in names:
        expected = _v4_signature(method, raw_path, params, headers)
        return "v4", None if hmac.compare_digest(expected, names["X-Amz-Signature"]) else f"v4 of {target}"
    if "Signature" in names:
        expected = _v2_signature(method, raw_path, params, headers)
        return "v2", None if hmac.compare_digest(expected, names["Signature"]) else f"v2 of {target}"
    return "header", None


def _v4_signature(method, raw_path, params, headers):
    """As AWS documents Signature Version 4 for a presigned URL (UNSIGNED-PAYLOAD)."""
    names = dict(params)
    canonical_query = "&".join(sorted(f"{quote(name, safe='~')}={quote(value, safe='~')}"
                                      for name, value in params if name != "X-Amz-Signature"))
    signed_headers = names["X-Amz-SignedHeaders"].split(";")
    canonical_headers = "".join(f"{name}:{' '.join(headers.get(name, '').split())}\n" for name in signed_headers)
    canonical_request = "\n".join([method, quote(unquote(raw_path), safe="/~"), canonical_query, canonical_headers,
                                   ";".join(signed_headers), "UNSIGNED-PAYLOAD"])
    _access_key, day, region, service, terminator = names["X-Amz-Credential"].split("/")
    string_to_sign = "\n".join(["AWS4-HMAC-SHA256", names["X-Amz-Date"], f"{day}/{region}/{service}/{terminator}",
                                hashlib.sha256(canonical_request.encode()).hexdigest()])
    key = f"AWS4{SECRET_KEY}".encode()
    for part in (day, region, service, terminator):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()


def _v2_signature(method, raw_path, params, headers):
    """As AWS documents Signature Version 2 for a query-string authenticated request."""
    amz_headers = "".join(f"{name.lower()}:{value.strip()}\n" for name, value in sorted(headers.items())
                          if name.lower().startswith("x-amz-"))
    subresources = sorted((name, value) for name, value in params if name in V2_SUBRESOURCES)
    resource = raw_path + ("?" + "&".join(f"{name}={value}" if value else name for name, value in subresources)
                           if subresources else "")
    string_to_sign = (f"{method}\n{headers.get('Content-MD5', '')}\n{headers.get('Content-Type', '')}\n"
                      f"{dict(params)['Expires']}\n{amz_headers}{resource}")
    digest = hmac.new(SECRET_KEY.encode(), string_to_sign.encode(), hashlib.sha1).digest()
    return base64.b64encode(digest).decode()


@pytest.fixture
def proxy(obs_endpoint):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Checking)
    server.daemon_threads = True
    server.upstream = urlsplit(obs_endpoint.url).hostname, urlsplit(obs_endpoint.url).port
    server.seen, server.bad_signatures = [], []
    server.lock, server.spoils = threading.Lock(), []
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.shutdown()
    server.server_close()
    assert server.bad_signatures == []  # every presigned request was signed as it was sent


@pytest.fixture(params=["v4", "v2"])
def signature(request):
    return request.param


@pytest.fixture
def store(proxy, obs_endpoint, tmp_path, signature):
    return make_store({**obs_endpoint.env(signature), "MA_S3_ENDPOINT": proxy.url}, tmp_path)


@pytest.fixture
def bucket(obs_endpoint):
    return obs_endpoint.new_bucket()


def presigned(proxy, method=None):
    """The (method, path, kind, client port) of every presigned request the proxy saw."""
    return [seen for seen in proxy.seen if seen[2] != "header" and (method is None or seen[0] == method)]


def file_of(tmp_path, data, name="source.bin"):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


# --- put_bytes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key, size", [(ODD_KEY, 70_000), ("out/empty.txt", 0), ("dir/", 0)])
def test_put_bytes_round_trips_as_one_signed_put_with_its_md5(store, obs_endpoint, proxy, bucket, signature, key,
                                                            size):
    data = os.urandom(size)

    info = store.put_bytes(bucket, key, data, md5_of(data))

    assert info == ObjectInfo(key, size, md5_of(data))
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key=key)["Body"].read() == data
    assert [(method, kind) for method, _path, kind, _port in presigned(proxy)] == [("PUT", signature)]


@pytest.mark.parametrize("key, content_type", [
    ("logs/train.log", "text/plain"), ("m/config.JSON", "application/json"), ("m/model.pt", "binary/octet-stream"),
    ("m.d/README", "binary/octet-stream")])
def test_single_puts_get_the_content_type_the_sdk_gives_by_extension(store, obs_endpoint, bucket, tmp_path, key,
                                                                    content_type):
    """As putFile and initiateMultipartUpload do, so that an object looks the same whichever way it went up
    (moto's default for none is binary/octet-stream); the signatures (checked by the proxy) cover it."""
    store.put_bytes(bucket, key, b"{}", md5_of(b"{}"))
    store.put_file(bucket, f"file/{key}", file_of(tmp_path, b"{}"))
    for uploaded in (key, f"file/{key}"):
        assert obs_endpoint.s3.head_object(Bucket=bucket, Key=uploaded)["ContentType"] == content_type


def test_a_body_that_does_not_match_its_md5_is_refused_and_nothing_is_written(store, obs_endpoint, bucket):
    data = b"the bytes read"

    with pytest.raises(CorruptTransfer) as caught:
        store.put_bytes(bucket, "out/x.bin", data, md5_of(b"other bytes"))

    message = str(caught.value)
    assert f"obs://{bucket}/out/x.bin" in message and "BadDigest" in message and "Content-MD5" in message
    assert_no_secret(caught.value)
    assert obs_endpoint.s3.list_objects(Bucket=bucket).get("Contents") is None


@pytest.mark.parametrize("md5_hex", ["", "xyz", "0" * 31, "g" * 32])
def test_put_bytes_refuses_what_is_not_an_md5_without_sending(store, proxy, bucket, md5_hex):
    with pytest.raises(StorageError, match="is not an MD5"):
        store.put_bytes(bucket, "k", b"data", md5_hex)
    assert presigned(proxy) == []


def test_requests_without_a_key_are_refused_they_would_address_the_bucket(store, proxy, bucket):
    with pytest.raises(StorageError, match="an object key is required"):
        store.put_bytes(bucket, "", b"x", md5_of(b"x"))
    with pytest.raises(StorageError, match="an object key is required"):
        store.delete(bucket, "")
    assert presigned(proxy) == []


# --- upload_part from a file -------------------------------------------------------------------------------


def test_parts_sent_from_the_file_complete_into_the_object(store, obs_endpoint, proxy, bucket, signature, tmp_path):
    data = os.urandom(12 * MiB + 12345)
    path = file_of(tmp_path, data)
    part_size = 5 * MiB
    upload_id = store.create_multipart(bucket, ODD_KEY)

    parts = [(number, store.upload_part(bucket, ODD_KEY, upload_id, number, path, offset,
                                        min(part_size, len(data) - offset)))
             for number, offset in enumerate(range(0, len(data), part_size), start=1)]
    info = store.complete_multipart(bucket, ODD_KEY, upload_id, parts)

    assert [etag for _number, etag in parts] == [md5_of(data[offset:offset + part_size])
                                                 for offset in range(0, len(data), part_size)]
    assert (info.size, info.etag.endswith("-3")) == (len(data), True)
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key=ODD_KEY)["Body"].read() == data
    assert [(method, kind) for method, _path, kind, _port in presigned(proxy)] == [("PUT", signature)] * 3


def test_a_part_of_a_file_shorter_than_the_part_is_file_changed(store, bucket, tmp_path):
    path = file_of(tmp_path, b"x" * 100)
    upload_id = store.create_multipart(bucket, "out/short.bin")
    with pytest.raises(FileChanged, match="outside"):
        store.upload_part(bucket, "out/short.bin", upload_id, 1, path, 50, 51)
    store.abort_multipart(bucket, "out/short.bin", upload_id)


def test_a_file_that_shrinks_while_its_part_is_sent_fails_the_part_and_spends_the_connection(
        store, obs_endpoint, proxy, bucket, tmp_path, monkeypatch):
    """The file is cut right after the bounds were checked: the body ends early, the part fails (FileChanged,
    not a network error to retry), and the next request gets a new connection, not one owing the server bytes."""
    path = file_of(tmp_path, os.urandom(6 * MiB))
    upload_id = store.create_multipart(bucket, "out/shrinking.bin")
    checked = obs_module.check_part_bounds

    def check_then_truncate(*args):
        checked(*args)
        os.truncate(path, 2 * MiB)

    monkeypatch.setattr(obs_module, "check_part_bounds", check_then_truncate)
    with pytest.raises(FileChanged, match=r"ended after 2097152 of the 6291456 bytes"):
        store.upload_part(bucket, "out/shrinking.bin", upload_id, 1, path, 0, 6 * MiB)
    monkeypatch.undo()

    store.put_bytes(bucket, "out/after.bin", b"after", md5_of(b"after"))
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key="out/after.bin")["Body"].read() == b"after"
    store.abort_multipart(bucket, "out/shrinking.bin", upload_id)


class _Md5Echo(http.server.BaseHTTPRequestHandler):
    """Answers a PUT with the MD5 of the body it received as the ETag, as S3 does for a part."""

    protocol_version = "HTTP/1.1"

    def do_PUT(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("ETag", f'"{md5_of(body)}"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_over_tls_a_part_goes_through_the_buffer_whole(tmp_path):
    """An SSL socket cannot sendfile: the part is read into the thread's buffer and sent, all of it, in order."""
    cert_path, key_path = _self_signed_certificate(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_path, key_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Md5Echo)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    data = os.urandom(3 * signed.SEND_CHUNK + 12345)
    path = file_of(tmp_path, data)
    try:
        store = make_store({**fake_env(f"https://127.0.0.1:{server.server_address[1]}"), "S3_VERIFY_SSL": "0"},
                           tmp_path)
        etags = [store.upload_part("bkt", "k", "up1", 1, path, 1000, len(data) - 1000),
                 store.upload_part("bkt", "k", "up1", 2, path, 0, 10)]
    finally:
        server.shutdown()
        server.server_close()
    assert etags == [md5_of(data[1000:]), md5_of(data[:10])]


def test_a_part_into_an_upload_that_is_gone_is_not_found(tmp_path):
    """S3 and OBS answer 404 NoSuchUpload (moto answers 500, so a small server stands in): NotFound, which the
    engine takes as "start over"."""
    path = file_of(tmp_path, b"x" * 1000)
    with fake_server(404, error_xml("NoSuchUpload", "The specified upload does not exist")) as url:
        store = make_store(fake_env(url), tmp_path)
        with pytest.raises(NotFound, match="NoSuchUpload"):
            store.upload_part("bkt", "out/gone.bin", "up1", 1, path, 0, 1000)


def test_put_file_goes_the_same_way(store, obs_endpoint, proxy, bucket, signature, tmp_path):
    data = os.urandom(3 * MiB)
    info = store.put_file(bucket, "out/file.bin", file_of(tmp_path, data))
    assert info == ObjectInfo("out/file.bin", len(data), md5_of(data))
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key="out/file.bin")["Body"].read() == data
    assert [(method, kind) for method, _path, kind, _port in presigned(proxy)] == [("PUT", signature)]


@pytest.mark.parametrize("kind", ["fifo", "directory", "missing"])
def test_a_source_that_is_not_a_regular_file_is_refused_without_blocking(store, proxy, bucket, tmp_path, kind):
    source = tmp_path / "source"
    if kind == "fifo":
        os.mkfifo(source)
    elif kind == "directory":
        source.mkdir()
    with pytest.raises(StorageError, match=str(source)):
        store.upload_part(bucket, "k", "up1", 1, str(source), 0, 10)
    with pytest.raises(StorageError, match=str(source)):
        store.put_file(bucket, "k", str(source))
    assert presigned(proxy) == []


# --- a write counts only when the store confirmed it -------------------------------------------------------


class Log:
    def __init__(self):
        self.events = []

    def info(self, event, **fields):
        self.events.append(("info", event))

    def warning(self, event, **fields):
        self.events.append(("warning", event))

    error = warning


def retrying(tmp_path, seconds=10):
    return transfer.TransferOptions(workers=2, part_size=5 * MiB, large_threshold=5 * MiB, retry_seconds=seconds,
                                    progress_seconds=0, state_dir=tmp_path / "state")


def single_writes(store, bucket, tmp_path, data=b"the bytes of the file"):
    """The whole-object and part writes, each as (name, zero-argument callable)."""
    path = file_of(tmp_path, data)
    yield "put_bytes", lambda: store.put_bytes(bucket, "out/w.bin", data, md5_of(data))
    yield "put_file", lambda: store.put_file(bucket, "out/w.bin", path)
    upload_id = store.create_multipart(bucket, "out/w.bin")
    yield "upload_part", lambda: store.upload_part(bucket, "out/w.bin", upload_id, 1, path, 0, len(data))


def object_keys(obs_endpoint, bucket):
    return [item["Key"] for item in obs_endpoint.s3.list_objects(Bucket=bucket).get("Contents", [])]


def test_a_write_answered_200_without_an_etag_is_not_confirmed(store, obs_endpoint, proxy, bucket, tmp_path):
    for name, write in single_writes(store, bucket, tmp_path):
        spoil(proxy, "PUT")  # 200, no ETag, and the request never reached the server
        with pytest.raises(TransientError, match=f"obs://{bucket}/out/w.bin: not confirmed .*no ETag") as caught:
            write()
        assert_no_secret(caught.value)
        assert object_keys(obs_endpoint, bucket) == [], name


def test_a_put_without_an_etag_is_sent_again_by_the_transfer_engine(store, obs_endpoint, proxy, bucket, tmp_path):
    data = b"checkpoint bytes"
    spoiled = spoil(proxy, "PUT")
    log = Log()

    info = transfer.Calls(retrying(tmp_path), log)(store.put_bytes, bucket, "out/ckpt.bin", data, md5_of(data))

    assert (spoiled.count, info) == (0, ObjectInfo("out/ckpt.bin", len(data), md5_of(data)))
    assert ("warning", "storage request failed, retrying") in log.events
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key="out/ckpt.bin")["Body"].read() == data


@pytest.mark.parametrize("headers, confirms", [
    ((("ETag", f'"{md5_of(b"other bytes")}"'),), False),
    ((("ETag", f'"{md5_of(b"the bytes").upper()}"'),), True),
    ((("ETag", '"not-an-md5"'),), True),  # not an MD5's form: nothing to compare
    ((("ETag", f'"{md5_of(b"other bytes")}"'), ("x-amz-server-side-encryption", "aws:kms")), True),
    ((("ETag", f'"{md5_of(b"other bytes")}"'), ("x-obs-server-side-encryption", "kms")), True),
], ids=["another-md5", "upper-case", "opaque", "sse-kms", "obs-kms"])
def test_a_put_bytes_etag_must_be_the_md5_sent(store, proxy, bucket, headers, confirms):
    """S3's and OBS's single-PUT ETag is the MD5 of the bytes stored, except for objects encrypted with a KMS or
    customer key."""
    spoil(proxy, "PUT", headers=headers)
    if confirms:
        assert store.put_bytes(bucket, "out/x.bin", b"the bytes", md5_of(b"the bytes")).etag
        return
    with pytest.raises(TransientError, match=f"not the MD5 of the bytes sent, {md5_of(b'the bytes')}"):
        store.put_bytes(bucket, "out/x.bin", b"the bytes", md5_of(b"the bytes"))


def test_an_error_document_in_a_200_to_a_put_is_not_stored(store, obs_endpoint, proxy, bucket, tmp_path):
    for name, write in single_writes(store, bucket, tmp_path, b"data"):
        spoil(proxy, "PUT", body=INTERNAL_ERROR, headers=(("ETag", f'"{md5_of(b"data")}"'),))
        with pytest.raises(TransientError, match=r"HTTP 200 with an error document \(InternalError: We encountered"):
            write()
        assert object_keys(obs_endpoint, bucket) == [], name


def sent_parts(store, bucket, key, tmp_path, data):
    """A multipart upload of `data` in parts of 5 MiB, all sent: (upload id, parts)."""
    path = file_of(tmp_path, data, name=f"parts-{md5_of(data)}.bin")
    upload_id = store.create_multipart(bucket, key)
    parts = [(number, store.upload_part(bucket, key, upload_id, number, path, offset, min(5 * MiB, len(data) - offset)))
             for number, offset in enumerate(range(0, len(data), 5 * MiB), start=1)]
    return upload_id, parts


def stored_etag(obs_endpoint, bucket, key):
    return obs_endpoint.s3.head_object(Bucket=bucket, Key=key)["ETag"].strip('"')


@pytest.mark.parametrize("forward", [False, True], ids=["not-completed", "completed-then-error"])
def test_an_error_document_in_a_200_to_the_complete_fails_it_and_a_retry_completes(store, obs_endpoint, proxy,
                                                                                  bucket, tmp_path, forward):
    """What the SDK gives for it: status 200, no errorCode, a result whose every field is None. Sent again, the
    complete completes (moto, like S3, also answers a second complete of a completed upload with its result)."""
    data = os.urandom(5 * MiB + 1000)
    upload_id, parts = sent_parts(store, bucket, "out/big.bin", tmp_path, data)
    spoil(proxy, *COMPLETE, body=INTERNAL_ERROR, forward=forward)

    with pytest.raises(TransientError, match=f"obs://{bucket}/out/big.bin: HTTP 200 with an error document"):
        store.complete_multipart(bucket, "out/big.bin", upload_id, parts)
    assert object_keys(obs_endpoint, bucket) == (["out/big.bin"] if forward else [])

    info = store.complete_multipart(bucket, "out/big.bin", upload_id, parts)

    assert info == ObjectInfo("out/big.bin", len(data), stored_etag(obs_endpoint, bucket, "out/big.bin"))
    assert info.etag == obs_module.multipart_etag(etag for _number, etag in parts)
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key="out/big.bin")["Body"].read() == data


def test_a_multipart_upload_through_an_error_in_a_200_ends_really_complete(store, obs_endpoint, proxy, bucket,
                                                                           tmp_path):
    data = os.urandom(11 * MiB)
    path = Path(file_of(tmp_path, data))
    spoiled = spoil(proxy, *COMPLETE, body=INTERNAL_ERROR)
    options = retrying(tmp_path)
    log = Log()

    info = transfer.Multipart(store, bucket, "out/model.bin", f"obs://{bucket}/out/model.bin", path, path.stat(),
                              options, log).run()

    assert spoiled.count == 0 and ("warning", "storage request failed, retrying") in log.events
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key="out/model.bin")["Body"].read() == data
    assert info == ObjectInfo("out/model.bin", len(data), stored_etag(obs_endpoint, bucket, "out/model.bin"))
    assert list(options.state_dir.iterdir()) == []  # no record left: the upload is done


@pytest.mark.parametrize("forward", [True, False], ids=["completed", "not-completed"])
def test_an_unreadable_answer_to_the_complete_is_decided_by_the_object(store, obs_endpoint, proxy, bucket,
                                                                       tmp_path, forward):
    """A 200 whose body the SDK cannot parse (cut short, empty) says nothing: a HEAD decides, by the ETag the
    parts make and their size. An older object of the same size at the key is not taken for the new one."""
    data = os.urandom(5 * MiB + 10)
    obs_endpoint.put(bucket, "out/big.bin", os.urandom(len(data)))  # the version before: same size
    upload_id, parts = sent_parts(store, bucket, "out/big.bin", tmp_path, data)
    spoil(proxy, *COMPLETE, body=b"<CompleteMultipartUploadResult><Bucket>", forward=forward)

    if forward:
        info = store.complete_multipart(bucket, "out/big.bin", upload_id, parts)
        assert info == ObjectInfo("out/big.bin", len(data), obs_module.multipart_etag(e for _n, e in parts))
    else:
        with pytest.raises(TransientError, match="unreadable answer, and the object is not the one its parts make"):
            store.complete_multipart(bucket, "out/big.bin", upload_id, parts)
        store.complete_multipart(bucket, "out/big.bin", upload_id, parts)
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key="out/big.bin")["Body"].read() == data


def test_a_retried_complete_finding_the_upload_gone_is_confirmed_by_the_etag_of_its_parts(store, obs_endpoint,
                                                                                         proxy, bucket, tmp_path):
    """OBS answers a second complete of a completed upload 404 NoSuchUpload: the object made of these parts (its
    ETag) is the confirmation. An older object is not: the upload is gone, NotFound, and a rerun starts over."""
    data = os.urandom(5 * MiB + 10)
    upload_id, parts = sent_parts(store, bucket, "out/big.bin", tmp_path, data)
    spoil(proxy, *COMPLETE, body=INTERNAL_ERROR, forward=True)
    spoil(proxy, *COMPLETE, status=404, body=error_xml("NoSuchUpload", "The specified upload does not exist"))
    with pytest.raises(TransientError):
        store.complete_multipart(bucket, "out/big.bin", upload_id, parts)

    info = store.complete_multipart(bucket, "out/big.bin", upload_id, parts)

    assert info == ObjectInfo("out/big.bin", len(data), stored_etag(obs_endpoint, bucket, "out/big.bin"))

    upload_id, parts = sent_parts(store, bucket, "out/big.bin", tmp_path, os.urandom(len(data)))
    spoil(proxy, *COMPLETE, status=404, body=error_xml("NoSuchUpload", "The specified upload does not exist"))
    with pytest.raises(NotFound, match="NoSuchUpload") as caught:
        store.complete_multipart(bucket, "out/big.bin", upload_id, parts)
    assert caught.value.refusal is False
    assert obs_endpoint.s3.get_object(Bucket=bucket, Key="out/big.bin")["Body"].read() == data
    store.abort_multipart(bucket, "out/big.bin", upload_id)


# --- delete ------------------------------------------------------------------------------------------------


def test_delete_removes_the_object_and_an_absent_one_is_no_error(store, obs_endpoint, proxy, bucket, signature):
    obs_endpoint.put(bucket, ODD_KEY, b"old")
    store.delete(bucket, ODD_KEY)
    store.delete(bucket, ODD_KEY)
    store.delete(bucket, "never/there")
    assert obs_endpoint.s3.list_objects(Bucket=bucket).get("Contents") is None
    assert [(method, kind) for method, _path, kind, _port in presigned(proxy)] == [("DELETE", signature)] * 3


def test_delete_in_a_missing_bucket_is_not_found(store):
    with pytest.raises(NotFound, match="does not exist"):
        store.delete("no-such-bucket-ma", "k")


def test_a_404_for_the_key_is_taken_as_gone(tmp_path):
    """S3 and OBS answer 204; a server answering 404 NoSuchKey means the same."""
    with fake_server(404, error_xml("NoSuchKey", "none")) as url:
        make_store(fake_env(url), tmp_path).delete("bkt", "k")


# --- list_uploads ------------------------------------------------------------------------------------------


def test_list_uploads_under_a_prefix(store, obs_endpoint, proxy, bucket, signature):
    assert store.list_uploads(bucket, "out/") == []
    first = store.create_multipart(bucket, ODD_KEY)
    second = store.create_multipart(bucket, "out/b.bin")
    elsewhere = store.create_multipart(bucket, "other/c.bin")

    listed = store.list_uploads(bucket, "out/")

    assert sorted((upload.key, upload.upload_id) for upload in listed) == sorted(
        [(ODD_KEY, first), ("out/b.bin", second)])
    assert all(upload.initiated == 1289422113.0 for upload in listed)  # moto's fixed "2010-11-10T20:48:33.000Z"
    assert {upload.upload_id for upload in store.list_uploads(bucket, "")} == {first, second, elsewhere}
    assert ("GET", signature) in [(method, kind) for method, _path, kind, _port in presigned(proxy)]


class _UploadPages(http.server.BaseHTTPRequestHandler):
    """Two pages of uploads; the second only for the markers the first ends with."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        query = dict(parse_qsl(urlsplit(self.path).query, keep_blank_values=True))
        self.server.queries.append(query)
        if "key-marker" not in query:
            body = _uploads_xml([("a%2Fone", "u1"), ("a%2Ftwo", "u2")], truncated=True, next_markers=("a%2Ftwo", "u2"))
        elif (query["key-marker"], query.get("upload-id-marker")) == ("a/two", "u2"):
            body = _uploads_xml([("a%2Fthree+x", "u3")], truncated=False)
        else:
            body = error_xml("InvalidArgument", "unexpected markers")
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _uploads_xml(uploads, truncated, next_markers=None):
    entries = "".join(f"<Upload><Key>{key}</Key><UploadId>{upload_id}</UploadId>"
                      "<Initiated>2024-05-01T12:00:00.500Z</Initiated></Upload>" for key, upload_id in uploads)
    markers = (f"<NextKeyMarker>{next_markers[0]}</NextKeyMarker><NextUploadIdMarker>{next_markers[1]}"
               "</NextUploadIdMarker>" if next_markers else "")
    return (f'<?xml version="1.0" encoding="UTF-8"?><ListMultipartUploadsResult xmlns="http://obs.example/doc/">'
            f"<Bucket>bkt</Bucket><EncodingType>url</EncodingType><IsTruncated>{str(truncated).lower()}</IsTruncated>"
            f"{markers}{entries}</ListMultipartUploadsResult>").encode()


def test_list_uploads_follows_every_page(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _UploadPages)
    server.queries = []
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        store = make_store(fake_env(f"http://127.0.0.1:{server.server_address[1]}"), tmp_path)
        listed = store.list_uploads("bkt", "a/")
    finally:
        server.shutdown()
        server.server_close()
    assert listed == [Upload("a/one", "u1", 1714564800.5), Upload("a/two", "u2", 1714564800.5),
                      Upload("a/three x", "u3", 1714564800.5)]
    assert [query.get("prefix") for query in server.queries] == ["a/", "a/"]
    assert all("uploads" in query for query in server.queries)


@pytest.mark.parametrize("body", [b"<ListMultipartUploadsResult><Upload><Key>a</Key>", b"<Error/>",
                                  b"<ListMultipartUploadsResult><Upload><Key>a</Key></Upload>"
                                  b"</ListMultipartUploadsResult>"])
def test_unreadable_upload_listings_are_value_errors(body):
    with pytest.raises(ValueError):
        obs_listing.parse_uploads(body)


# --- connections -------------------------------------------------------------------------------------------


def test_one_thread_sends_every_write_over_one_kept_alive_connection(store, proxy, bucket, tmp_path):
    path = file_of(tmp_path, os.urandom(6 * MiB))
    upload_id = store.create_multipart(bucket, "out/big.bin")
    for index in range(5):
        store.put_bytes(bucket, f"out/{index}.txt", b"x" * index, md5_of(b"x" * index))
    etag = store.upload_part(bucket, "out/big.bin", upload_id, 1, path, 0, 6 * MiB)
    store.complete_multipart(bucket, "out/big.bin", upload_id, [(1, etag)])
    store.delete(bucket, "out/0.txt")
    store.list_uploads(bucket, "out/")
    list(store.list(bucket, "out/"))

    requests = presigned(proxy)
    assert len(requests) == 5 + 1 + 1 + 1 + 1
    assert len({port for _method, _path, _kind, port in requests}) == 1


def test_a_server_answering_before_the_body_is_sent_is_heard(tmp_path):
    """A server that refuses a part (403) as soon as it has the headers, and closes: the answer is read, not
    taken for a broken connection to retry."""
    listener = socket.create_server(("127.0.0.1", 0))
    answer = error_xml("AccessDenied", "no")

    def refuse():
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                               b"Content-Length: " + str(len(answer)).encode() + b"\r\n\r\n" + answer)

    threading.Thread(target=refuse, daemon=True).start()
    path = file_of(tmp_path, os.urandom(32 * MiB))
    store = make_store(fake_env(f"http://127.0.0.1:{listener.getsockname()[1]}"), tmp_path)
    try:
        with pytest.raises(AccessDenied) as caught:
            store.upload_part("bkt", "k", "up1", 1, path, 0, 32 * MiB)
    finally:
        listener.close()
    assert "AccessDenied" in str(caught.value)


# --- failures ----------------------------------------------------------------------------------------------


def every_write(store, tmp_path):
    """One call of each new kind, for the error tests; yields (name, zero-argument callable)."""
    path = file_of(tmp_path, b"x" * 100)
    yield "put_bytes", lambda: store.put_bytes("bkt", "k", b"data", md5_of(b"data"))
    yield "upload_part", lambda: store.upload_part("bkt", "k", "up1", 1, path, 0, 100)
    yield "delete", lambda: store.delete("bkt", "k")
    yield "list_uploads", lambda: store.list_uploads("bkt", "p/")


def assert_no_signature(exc):
    text = f"{exc} {getattr(exc, 'hint', '')}"
    assert "Signature=" not in text and "X-Amz-Credential" not in text


@pytest.mark.parametrize("signature", ["v4", "v2"])
def test_403_is_access_denied_naming_the_bucket_and_the_credential_variables(tmp_path, signature):
    with fake_server(403, error_xml("SignatureDoesNotMatch", "bad signature"),
                     {"Content-Type": "application/xml"}) as url:
        store = make_store(fake_env(url, signature), tmp_path)
        for name, call in every_write(store, tmp_path):
            with pytest.raises(AccessDenied) as caught:
                call()
            message = str(caught.value)
            assert "'bkt'" in message and "OBS_ACCESS_KEY_ID/OBS_SECRET_ACCESS_KEY" in message, name
            assert "SignatureDoesNotMatch" in message, name
            assert_no_secret(caught.value)
            assert_no_signature(caught.value)


@pytest.mark.parametrize("status", [503, 500, 429])
def test_5xx_and_429_are_transient(tmp_path, status):
    with fake_server(status, error_xml("ServiceUnavailable", "slow down")) as url:
        store = make_store(fake_env(url), tmp_path)
        for _name, call in every_write(store, tmp_path):
            with pytest.raises(TransientError, match=f"HTTP {status}"):
                call()


def writes_of_one_object(store, tmp_path):
    """Every write about one object, by both ways requests go (signed URLs, SDK calls): (name, callable)."""
    path = file_of(tmp_path, b"x" * 100)
    yield "put_bytes", lambda: store.put_bytes("bkt", "k", b"data", md5_of(b"data"))
    yield "put_file", lambda: store.put_file("bkt", "k", path)
    yield "upload_part", lambda: store.upload_part("bkt", "k", "up1", 1, path, 0, 100)
    yield "create_multipart", lambda: store.create_multipart("bkt", "k")
    yield "complete_multipart", lambda: store.complete_multipart("bkt", "k", "up1", [(1, md5_of(b"x"))])


@pytest.mark.parametrize("status, code, failure", [
    (400, "KeyTooLongError", ObjectRefused),
    (400, "InvalidArgument", ObjectRefused),
    (400, "InvalidObjectName", ObjectRefused),
    (404, "NoSuchKey", NotFound),
    (413, "EntityTooLarge", ObjectRefused),
    (414, "RequestURITooLong", ObjectRefused),
    (400, "BadDigest", CorruptTransfer),
])
def test_a_4xx_about_the_object_is_its_refusal(tmp_path, status, code, failure):
    """The store will not take this object (its name, size, bytes): the others may still go."""
    with fake_server(status, error_xml(code, "refused")) as url:
        store = make_store(fake_env(url), tmp_path)
        for name, write in writes_of_one_object(store, tmp_path):
            with pytest.raises(failure, match=code) as caught:
                write()
            assert caught.value.refusal is True, name
            assert "obs://bkt/k" in str(caught.value), name


@pytest.mark.parametrize("status, code, failure", [
    (403, "AccessDenied", AccessDenied),
    (401, "Unauthorized", StorageError),
    (400, "ExpiredToken", StorageError),
    (429, "SlowDown", TransientError),
    (503, "ServiceUnavailable", TransientError),
    (400, "RequestTimeout", TransientError),
    (409, "OperationAborted", TransientError),
    (404, "NoSuchBucket", NotFound),
    (404, "NoSuchUpload", NotFound),
])
def test_authentication_throttling_outages_and_missing_buckets_are_no_refusal(tmp_path, status, code, failure):
    """They are about every object: a sync's cycle ends (a missing upload: started over), it does not go on."""
    with fake_server(status, error_xml(code, "not about the object")) as url:
        store = make_store(fake_env(url), tmp_path)
        for name, write in writes_of_one_object(store, tmp_path):
            with pytest.raises(failure, match=code) as caught:
                write()
            assert caught.value.refusal is False, name


def test_an_unreachable_endpoint_is_transient_naming_the_object(tmp_path):
    store = make_store(fake_env(refusing_endpoint()), tmp_path)
    for name, call in every_write(store, tmp_path):
        with pytest.raises(TransientError) as caught:
            call()
        assert "ConnectionRefusedError" in str(caught.value) and "obs://bkt/" in str(caught.value), name
        assert_no_secret(caught.value)
        assert_no_signature(caught.value)


def test_a_hanging_endpoint_times_a_part_out(tmp_path, hanging_endpoint):
    """The endpoint takes the connection and reads nothing: the part's body fills the socket's buffers and
    the send times out (one socket timeout: the retry budget, 1 s), instead of hanging."""
    path = file_of(tmp_path, os.urandom(32 * MiB))
    store = make_store({**fake_env(hanging_endpoint), "MA_RUNTIME_STORAGE_RETRY_SECONDS": "1"}, tmp_path)
    outcome = {}

    def upload():
        try:
            store.upload_part("bkt", "k", "up1", 1, path, 0, 32 * MiB)
        except BaseException as exc:  # noqa: B036 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=upload, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "upload_part hung"
    assert isinstance(outcome.get("error"), TransientError) and "timed out" in str(outcome["error"])


def test_signatures_are_blanked_in_any_text_that_quotes_a_signed_url():
    presigner = signed.V4Presigner("http://127.0.0.1:9000", "us-east-1", True, "AKID", "SECRET", "TOKEN")
    url, _headers = presigner.sign("b", "k", {"partNumber": "1", "uploadId": "u"}, "PUT")
    text = signed.without_signatures(f"failed: {url!r}")
    assert "X-Amz-Signature=***" in text and "X-Amz-Credential=***" in text and "x-amz-security-token=***" in text
    assert url.rsplit("=", 1)[1] not in text and "TOKEN" not in text and "AKID" not in text
    client = ObsClient(access_key_id="AKID", secret_access_key="SECRET", server="http://127.0.0.1:9000",
                       signature="v2", path_style=True, is_signature_negotiation=False)
    v2_url = client.createSignedUrl("PUT", "b", "k", expires=60).signedUrl
    v2_text = signed.without_signatures(v2_url)
    assert "Signature=***" in v2_text and "AWSAccessKeyId=***" in v2_text and "AKID" not in v2_text


# --- v4 presigning of writes, against the SDK's --------------------------------------------------------------


@pytest.mark.parametrize("method, key, query, headers", [
    ("PUT", "a b/ü+~x.bin", None, {"Content-MD5": "1B2M2Y8AsgTpgAmY7PhCfg=="}),
    ("PUT", "dir/part.bin", {"partNumber": "7", "uploadId": "2~a+b/c=="}, None),
    ("DELETE", "x%2Fy", None, None),
    ("GET", None, {"uploads": None, "prefix": "ünï /+", "max-uploads": "1000", "key-marker": "a b",
                   "upload-id-marker": "u+1"}, None),
])
@pytest.mark.parametrize("token", [None, "TOKEN/with+odd=chars"])
def test_v4_presigned_writes_are_the_sdks(method, key, query, headers, token):
    presigner = signed.V4Presigner("https://obs.cn-north-4.myhuaweicloud.com", "cn-north-4", False, "AKID",
                                   "SECRET/+key", token)
    client = ObsClient(access_key_id="AKID", secret_access_key="SECRET/+key", security_token=token,
                       server="https://obs.cn-north-4.myhuaweicloud.com", signature="v4", region="cn-north-4",
                       path_style=False, is_signature_negotiation=False)
    for _ in range(50):  # both within one second: X-Amz-Date has one-second resolution
        ours = presigner.sign("bkt", key, query, method, headers)
        theirs = client.createSignedUrl(method, "bkt", key, expires=signed.EXPIRES_SECONDS, headers=headers,
                                        queryParams=dict(query) if query else None)
        ours_url, theirs_url = urlsplit(ours[0]), urlsplit(theirs.signedUrl)
        if dict(parse_qsl(ours_url.query))["X-Amz-Date"] == dict(parse_qsl(theirs_url.query))["X-Amz-Date"]:
            break
    assert (ours_url.netloc, ours_url.path) == (theirs_url.netloc, theirs_url.path)
    assert parse_qsl(ours_url.query, keep_blank_values=True) == parse_qsl(theirs_url.query, keep_blank_values=True)
    assert ours[1] == theirs.actualSignedRequestHeaders


# --- LocalStore --------------------------------------------------------------------------------------------


def test_local_put_bytes_replaces_the_file_atomically_making_its_folders(tmp_path):
    target = tmp_path / "dest" / "deep" / "f.txt"
    store = LocalStore()
    store.put_bytes("", str(target), b"old", md5_of(b"old"))
    with open(target, "rb") as reader:  # a reader of the old file keeps the old bytes: renamed over, not rewritten
        info = store.put_bytes("", str(target), b"new contents", md5_of(b"new contents"))
        assert reader.read() == b"old"
    assert target.read_bytes() == b"new contents"
    assert info == ObjectInfo(str(target), 12, version_of(target.stat()))
    assert sorted(os.listdir(target.parent)) == ["f.txt"]


def test_local_put_bytes_refuses_bytes_that_are_not_their_md5_and_what_is_in_the_way(tmp_path):
    target = tmp_path / "f.txt"
    store = LocalStore()
    with pytest.raises(CorruptTransfer):
        store.put_bytes("", str(target), b"data", md5_of(b"other"))
    assert not target.exists()
    target.mkdir()
    with pytest.raises(StorageError, match="a directory is in the way"):
        store.put_bytes("", str(target), b"data", md5_of(b"data"))
    assert target.is_dir() and os.listdir(tmp_path) == ["f.txt"]


def test_local_delete_removes_files_and_links_never_their_targets_nor_folders(tmp_path):
    store = LocalStore()
    (tmp_path / "file").write_bytes(b"x")
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me")
    (tmp_path / "link").symlink_to(outside)
    (tmp_path / "folder").mkdir()

    for name in ("file", "link", "folder", "absent", "absent-dir/file", "file/below-a-file"):
        store.delete("", str(tmp_path / name))

    assert sorted(os.listdir(tmp_path)) == ["folder", "outside.txt"]
    assert outside.read_bytes() == b"keep me"


def test_local_multipart_uploads_are_listed_under_their_prefix_with_the_ids_created(tmp_path):
    store = LocalStore()
    dest = tmp_path / "dest"
    assert store.list_uploads("", f"{dest}/") == []
    first = store.create_multipart("", f"{dest}/a.bin")
    second = store.create_multipart("", f"{dest}/sub/b.bin")
    store.create_multipart("", f"{tmp_path}/other/c.bin")

    listed = store.list_uploads("", f"{dest}/")

    assert sorted(listed, key=lambda upload: upload.key) == [Upload(f"{dest}/a.bin", first),
                                                             Upload(f"{dest}/sub/b.bin", second)]
    assert store.list_uploads("", f"{dest}/sub/b") == [Upload(f"{dest}/sub/b.bin", second)]
    store.abort_multipart("", f"{dest}/a.bin", first)
    assert store.list_uploads("", f"{dest}/") == [Upload(f"{dest}/sub/b.bin", second)]


def test_local_parts_complete_and_a_gone_upload_is_not_found(tmp_path):
    store = LocalStore()
    data = os.urandom(3 * MiB + 5)
    path = file_of(tmp_path, data)
    key = str(tmp_path / "dest" / "big.bin")
    upload_id = store.create_multipart("", key)
    parts = [(number, store.upload_part("", key, upload_id, number, path, offset, min(MiB, len(data) - offset)))
             for number, offset in enumerate(range(0, len(data), MiB), start=1)]
    assert store.list_uploads("", key) == [Upload(key, upload_id)]
    info = store.complete_multipart("", key, upload_id, parts)
    assert Path(key).read_bytes() == data and info.size == len(data)
    assert store.list_uploads("", key) == []
    with pytest.raises(NotFound):
        store.upload_part("", key, upload_id, 1, path, 0, 10)  # completed: gone
    with pytest.raises(NotFound):
        store.complete_multipart("", key, upload_id, parts)


@pytest.mark.parametrize("upload_id", ["../../escape", "/etc", "ABCDEF12", ""])
def test_a_local_upload_id_that_is_not_one_is_never_made_into_a_path(tmp_path, upload_id):
    store = LocalStore()
    path = file_of(tmp_path, b"x" * 10)
    key = str(tmp_path / "dest" / "f.bin")
    (tmp_path / "dest").mkdir()
    with pytest.raises(NotFound):
        store.upload_part("", key, upload_id, 1, path, 0, 10)
    store.abort_multipart("", key, upload_id)
    assert os.listdir(tmp_path / "dest") == [] and sorted(os.listdir(tmp_path)) == ["dest", "source.bin"]


def test_a_local_part_of_a_file_shorter_than_the_part_is_file_changed(tmp_path):
    store = LocalStore()
    path = file_of(tmp_path, b"x" * 100)
    key = str(tmp_path / "dest" / "f.bin")
    upload_id = store.create_multipart("", key)
    with pytest.raises(FileChanged, match="outside"):
        store.upload_part("", key, upload_id, 1, path, 50, 51)
    with pytest.raises(StorageError, match="outside"):
        store.upload_part("", key, upload_id, 1, path, -1, 10)


def test_local_failures_of_the_filesystem_are_storage_errors(tmp_path):
    store = LocalStore()
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(StorageError, match="file"):
        store.put_bytes("", str(tmp_path / "file" / "below"), b"x", md5_of(b"x"))
    with pytest.raises(StorageError, match="file"):
        store.create_multipart("", str(tmp_path / "file" / "below"))
    with contextlib.suppress(FileExistsError):
        os.mkfifo(tmp_path / "fifo")
    with pytest.raises(StorageError, match="a FIFO, not a regular file"):
        store.put_file("", str(tmp_path / "out"), str(tmp_path / "fifo"))


def test_local_writes_confirm_what_they_stored(tmp_path, monkeypatch):
    """The rule OBS's writes keep: a file renamed into place with fewer bytes than sent is not confirmed."""
    store = LocalStore()
    written = local_module.write_atomically
    monkeypatch.setattr(local_module, "write_atomically", lambda target, data: written(target, data[:-1]))
    with pytest.raises(TransientError, match=r"not confirmed by the store \(3 bytes stored, 4 sent\)"):
        store.put_bytes("", str(tmp_path / "f.bin"), b"data", md5_of(b"data"))


@pytest.mark.parametrize("key", ["x" * 300, "a\0b", "file/below", "folder"])
def test_a_local_key_the_filesystem_will_not_take_is_a_refusal(tmp_path, key):
    """Too long, a NUL, a file where a folder should be, a folder where the file should be: that key only."""
    store = LocalStore()
    (tmp_path / "file").write_bytes(b"x")
    (tmp_path / "folder").mkdir()
    for write in (lambda: store.put_bytes("", f"{tmp_path}/{key}", b"x", md5_of(b"x")),
                  lambda: store.put_file("", f"{tmp_path}/{key}", file_of(tmp_path, b"x")),
                  lambda: store.create_multipart("", f"{tmp_path}/{key}")):
        with pytest.raises(StorageError) as caught:
            write()
        assert caught.value.refusal is True


def test_local_bytes_that_are_not_their_md5_are_a_refusal(tmp_path):
    with pytest.raises(CorruptTransfer) as caught:
        LocalStore().put_bytes("", str(tmp_path / "f"), b"data", md5_of(b"other"))
    assert caught.value.refusal is True


@pytest.mark.parametrize("name", ["ENAMETOOLONG", "EINVAL", "EILSEQ", "EFBIG",
                                  "ENOSPC", "EDQUOT", "EACCES", "EPERM", "EROFS", "EIO"])
def test_local_failures_of_the_filesystem_are_no_refusal_failures_of_the_key_are(tmp_path, monkeypatch, name):
    error = getattr(errno, name)
    refusal = name in ("ENAMETOOLONG", "EINVAL", "EILSEQ", "EFBIG")  # about the key (its name, its size)

    def failing(target, *_args):
        raise OSError(error, os.strerror(error), str(target))

    monkeypatch.setattr(local_module, "write_atomically", failing)
    monkeypatch.setattr(local_module, "write_atomically_from", failing)
    store = LocalStore()
    key = str(tmp_path / "dest" / "f.bin")
    upload_id = store.create_multipart("", key)
    for write in (lambda: store.put_bytes("", key, b"x", md5_of(b"x")),
                  lambda: store.put_file("", key, file_of(tmp_path, b"x")),
                  lambda: store.complete_multipart("", key, upload_id, [])):
        with pytest.raises(StorageError, match=os.strerror(error)) as caught:
            write()
        assert caught.value.refusal is refusal


def test_the_proxy_refuses_a_wrong_signature(proxy, bucket):
    """The checks this module relies on can fail: URLs signed with another secret are refused, v4 and v2."""
    v4_url, headers = signed.V4Presigner(proxy.url, "us-east-1", True, "testak", "not-the-secret", None).sign(
        bucket, "k", None, "PUT")
    client = ObsClient(access_key_id="testak", secret_access_key="not-the-secret", server=proxy.url, signature="v2",
                       path_style=True, is_signature_negotiation=False)
    v2_url = client.createSignedUrl("PUT", bucket, "k", expires=60).signedUrl
    for url in (v4_url, v2_url):
        parts = urlsplit(url)
        connection = http.client.HTTPConnection(parts.netloc, timeout=10)
        connection.request("PUT", f"{parts.path}?{parts.query}", body=b"x", headers={"Host": parts.netloc})
        assert connection.getresponse().status == 403
        connection.close()
    assert len(proxy.bad_signatures) == 2
    proxy.bad_signatures.clear()
