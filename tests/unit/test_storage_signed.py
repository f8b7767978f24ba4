"""signed.py: the v4 presigner against the SDK's own createSignedUrl, listing parsing, and the
keep-alive connections (reuse, a stale connection, a body left unread)."""

import http.server
import os
import threading
from urllib.parse import parse_qsl, urlsplit

import pytest
from obs import ObsClient

from ma_runtime.storage import obs as obs_module
from ma_runtime.storage import signed
from ma_runtime.storage.base import ObjectInfo
from ma_runtime.storage.obs import listing as obs_listing

KEYS = ["plain.bin", "a b/ü+~x.bin", "dir/κλειδί (1).txt", "x%2Fy", "semi;colon=eq&amp"]
QUERIES = [None, {"prefix": "ünï /+", "max-keys": "1000", "encoding-type": "url", "marker": "a b+c"}]


def sdk_client(endpoint, path_style, token):
    return ObsClient(access_key_id="AKID", secret_access_key="SECRET/+key", security_token=token, server=endpoint,
                     signature="v4", region="cn-north-4", path_style=path_style, is_signature_negotiation=False)


def same_second(endpoint, path_style, token, bucket, key, query):
    """Both URLs signed within one second (X-Amz-Date has one-second resolution). The clients are built
    first: on a loaded machine building an ObsClient between the two signings can cross a second."""
    presigner = signed.V4Presigner(endpoint, "cn-north-4", path_style, "AKID", "SECRET/+key", token)
    client = sdk_client(endpoint, path_style, token)
    for _ in range(50):
        ours = presigner.sign(bucket, key, query)
        theirs = client.createSignedUrl("GET", bucket, key, expires=signed.EXPIRES_SECONDS,
                                        queryParams=dict(query) if query else None)
        theirs = theirs.signedUrl, theirs.actualSignedRequestHeaders
        if dict(parse_qsl(urlsplit(ours[0]).query))["X-Amz-Date"] == \
                dict(parse_qsl(urlsplit(theirs[0]).query))["X-Amz-Date"]:
            return ours, theirs
    raise AssertionError("could not sign twice within one second")


@pytest.mark.parametrize("endpoint", ["https://obs.cn-north-4.myhuaweicloud.com", "http://127.0.0.1:9000",
                                      "http://10.0.0.5:80"])
@pytest.mark.parametrize("path_style", [True, False])
@pytest.mark.parametrize("token", [None, "TOKEN/with+odd=chars"])
@pytest.mark.parametrize("key", KEYS + [None])
def test_v4_presigned_urls_are_the_sdks(endpoint, path_style, token, key):
    query = QUERIES[1] if key is None else None  # a listing is a GET of the bucket with a query
    (our_url, our_headers), (sdk_signed_url, sdk_headers) = same_second(endpoint, path_style, token, "bkt", key,
                                                                        query)
    ours, theirs = urlsplit(our_url), urlsplit(sdk_signed_url)
    assert (ours.scheme, ours.netloc, ours.path) == (theirs.scheme, theirs.netloc, theirs.path)
    assert parse_qsl(ours.query) == parse_qsl(theirs.query)  # names, values, order: the signature included
    assert our_headers == sdk_headers


def test_the_signing_key_is_derived_once_a_day(monkeypatch):
    presigner = signed.V4Presigner("http://127.0.0.1:9000", "r", True, "AK", "SK", None)
    calls = []
    original = signed.hmac.new
    monkeypatch.setattr(signed.hmac, "new", lambda *args: calls.append(args) or original(*args))
    for index in range(50):
        presigner.sign("b", f"k{index}", None)
    assert len(calls) == 4 + 50  # the key's four HMACs once, then one signature per URL


def test_only_v4_stores_get_the_presigner(tmp_path):
    from ma_runtime import spec
    from tests.storage_env import ACCESS_KEY, SECRET_KEY

    def store(signature):
        environ = {"MA_S3_ENDPOINT": "http://127.0.0.1:9", "OBS_ACCESS_KEY_ID": ACCESS_KEY,
                   "OBS_SECRET_ACCESS_KEY": SECRET_KEY, "MA_RUNTIME_STORAGE_SIGNATURE": signature,
                   "MA_HOME": str(tmp_path)}
        return obs_module.ObsStore.from_settings(spec.load({}, environ), environ)

    assert isinstance(store("v4")._requests._v4, signed.V4Presigner)
    assert store("v2")._requests._v4 is None and store("obs")._requests._v4 is None


# --- listings ----------------------------------------------------------------------------------------


def test_listing_in_obs_namespace_with_url_encoded_keys():
    body = (b'<?xml version="1.0" encoding="UTF-8"?>'
            b'<ListBucketResult xmlns="http://obs.myhuaweicloud.com/doc/2015-06-30/"><Name>b</Name>'
            b"<Prefix>p%2F</Prefix><EncodingType>url</EncodingType><IsTruncated>true</IsTruncated>"
            b"<NextMarker>p%2Fz+z</NextMarker>"
            b'<Contents><Key>p%2F%C3%BC+x%2By</Key><Size>12</Size><ETag>"abc"</ETag></Contents>'
            b"<Contents><Key>p%2Fdir%2F</Key><Size>0</Size></Contents></ListBucketResult>")
    page = obs_listing.parse_listing(body)
    assert page.objects == [ObjectInfo("p/ü x+y", 12, "abc"), ObjectInfo("p/dir/", 0, None)]
    assert (page.truncated, page.next_marker) == (True, "p/z z")


def test_listing_without_encoding_keeps_keys_as_they_are():
    body = (b"<ListBucketResult><IsTruncated>false</IsTruncated>"
            b"<Contents><Key>a+b%20c</Key><Size>1</Size></Contents></ListBucketResult>")
    page = obs_listing.parse_listing(body)
    assert page.objects[0].key == "a+b%20c" and not page.truncated


@pytest.mark.parametrize("body", [b"<ListBucketResult><Contents><Key>a</Key>", b"<Error/>", b"",
                                  b"<ListBucketResult><Contents><Size>x</Size></Contents></ListBucketResult>"])
def test_unreadable_listings_are_value_errors(body):
    with pytest.raises(ValueError):
        obs_listing.parse_listing(body)


# --- connections -------------------------------------------------------------------------------------


class _KeepAlive(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.server.seen.append(self.client_address[1])  # the client's port: one per connection
        self.server.ranges.append(self.headers.get("Range"))
        self.server.if_match.append(self.headers.get("If-Match"))
        body = b"x" * 100_000
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if self.server.close_after_each:
            self.close_connection = True  # without saying so: the client finds out on its next request

    def log_message(self, *args):
        pass


@pytest.fixture
def keep_alive_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeepAlive)
    server.seen, server.ranges, server.if_match, server.close_after_each = [], [], [], False
    server.handle_error = lambda *args: None  # a client's reset is part of some tests, not news
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def reads_for(server):
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    client = ObsClient(access_key_id="AK", secret_access_key="SK", server=endpoint, signature="v2", path_style=True,
                       is_signature_negotiation=False)
    return signed.SignedReads(client, 5)


def test_a_connection_is_reused_once_its_body_is_read(keep_alive_server):
    reads = reads_for(keep_alive_server)
    for _ in range(3):
        response = reads.open("b", "k")
        response.read()
        reads.release(response)
    assert len(keep_alive_server.seen) == 3 and len(set(keep_alive_server.seen)) == 1


def test_a_body_left_unread_closes_its_connection(keep_alive_server):
    reads = reads_for(keep_alive_server)
    response = reads.open("b", "k")
    response.read(10)
    reads.release(response)
    response = reads.open("b", "k")
    assert len(response.read()) == 100_000  # the new answer, not the rest of the old one
    reads.release(response)
    assert len(set(keep_alive_server.seen)) == 2


def test_a_connection_the_server_closed_is_replaced_without_an_error(keep_alive_server):
    keep_alive_server.close_after_each = True
    reads = reads_for(keep_alive_server)
    for _ in range(3):
        response = reads.open("b", "k")
        assert len(response.read()) == 100_000
        reads.release(response)
    assert len(set(keep_alive_server.seen)) == 3


def test_each_thread_has_its_own_buffer():
    reads = signed.SignedReads(None, 5)
    mine = reads.buffer(1024)
    other = []
    thread = threading.Thread(target=lambda: other.append(reads.buffer(1024)))
    thread.start()
    thread.join()
    assert mine.obj is not other[0].obj and reads.buffer(512).obj is mine.obj
    assert len(reads.buffer(4096)) >= 4096


def test_no_file_descriptor_leaks_over_many_requests(keep_alive_server):
    reads = reads_for(keep_alive_server)
    before = len(os.listdir("/proc/self/fd"))
    for index in range(50):
        response = reads.open("b", "k")
        response.read(10 if index % 2 else 200_000)
        reads.release(response)
    assert len(os.listdir("/proc/self/fd")) <= before + 1


def test_a_whole_object_is_read_without_a_range_and_a_changed_size_is_caught(keep_alive_server, tmp_path):
    from ma_runtime import spec
    from ma_runtime.storage.base import ObjectChanged

    environ = {"MA_S3_ENDPOINT": f"http://127.0.0.1:{keep_alive_server.server_address[1]}",
               "OBS_ACCESS_KEY_ID": "AK", "OBS_SECRET_ACCESS_KEY": "SK", "MA_HOME": str(tmp_path)}
    store = obs_module.ObsStore.from_settings(spec.load({}, environ), environ)
    fd = os.open(tmp_path / "sink", os.O_RDWR | os.O_CREAT)
    try:
        assert store.read_range("b", "k", 0, 100_000, fd, 0, whole=True) == 100_000
        assert store.read_range("b", "k", 0, 10, fd, 0) == 10  # a part: asked for with a Range
        with pytest.raises(ObjectChanged, match="changed after it was listed"):
            store.read_range("b", "k", 0, 500, fd, 0, whole=True)  # listed at 500 bytes, 100 000 now
    finally:
        os.close(fd)
    assert keep_alive_server.ranges == [None, "bytes=0-9", None]


def test_every_read_names_the_version_listed(keep_alive_server, tmp_path):
    from ma_runtime import spec

    environ = {"MA_S3_ENDPOINT": f"http://127.0.0.1:{keep_alive_server.server_address[1]}",
               "OBS_ACCESS_KEY_ID": "AK", "OBS_SECRET_ACCESS_KEY": "SK", "MA_HOME": str(tmp_path)}
    store = obs_module.ObsStore.from_settings(spec.load({}, environ), environ)
    fd = os.open(tmp_path / "sink", os.O_RDWR | os.O_CREAT)
    try:
        store.read_range("b", "k", 0, 100_000, fd, 0, etag="abc-3", whole=True)
        store.read_range("b", "k", 0, 10, fd, 0, etag="0123456789abcdef0123456789abcdef")
        store.read_range("b", "k", 0, 10, fd, 0)
    finally:
        os.close(fd)
    assert keep_alive_server.if_match == ['"abc-3"', '"0123456789abcdef0123456789abcdef"', None]
