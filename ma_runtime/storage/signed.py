"""Requests to OBS over keep-alive connections, by URLs the OBS SDK signs (or signs as it does).

Why not `ObsClient.getObject` / `listObjects` / `putObject` / `uploadPart`: measured on 2 cores
(benchmarks/storage.py), the SDK spends about 1.5 ms of CPU per GET (its response wrapper, a new
connection per request, header parsing in pure Python) and 130 µs per key parsing a listing,
against 0.2 ms for a plain `http.client` GET. For 2000 small files that is the difference between
a third and most of what the endpoint can serve, and a PUT costs it as much as a GET. So the SDK
still decides every request (its `createSignedUrl`: v2, v4 or OBS signature, path or virtual-host
style, security token), and this module only carries it: one connection per thread and host,
kept alive, bodies read into a reused buffer.

Bodies: bytes go in the request as they are; a range of a file (`FileRange`) goes straight from
the file, with `socket.sendfile` (os.sendfile: no copy through Python) on plain HTTP and a read
loop through this thread's buffer on TLS (an SSL socket cannot sendfile, and its fallback sends
8 KiB at a time). A file that ends before the range does raises `BodyCutShort`, and the connection,
owing the server bytes it will never get, is closed. A range with an `unchanged` check keeps its last bytes
back: they are read, then the check runs, and only then are they sent; a False raises `SourceChanged` and the
body is never finished, so the server stores nothing (a PUT is atomic): every byte sent was read before a
check that found the file unchanged. Headers that a v2 signature covers whether or
not they were meant to be signed (Content-MD5, Content-Type) are signed, with v4 too: a URL then
fits one body.

Connections: a reused connection that the server closed while idle fails before any answer
arrives (RemoteDisconnected, reset, broken pipe); the request is then sent again, once, on a new
connection, as urllib3 does (a PUT is idempotent; a file range is sent again from its start).
A server may answer before it has the whole body (a 403 for a part, then a close): when sending
fails, the answer already sent is read and returned, so the caller sees "access denied" rather than
"broken pipe". A response not read to its end closes its connection, so the next request never
reads the rest of an old body.

A signed URL is a credential for its lifetime: it is never logged, and `without_signatures`
blanks the signing parameters in any text that might quote one.
"""

import dataclasses
import hashlib
import hmac
import http.client
import ipaddress
import os
import re
import threading
import time
from typing import IO, Callable, Dict, List, Mapping, Optional, Tuple, Union
from urllib.parse import quote, urlsplit

# Long enough for a request queued behind others; the URL is used at once and never logged.
EXPIRES_SECONDS = 900
ERROR_BODY_LIMIT = 64 * 1024  # an error answer is a short XML document; more is not read
SEND_CHUNK = 1 << 20  # bytes of a file sent at a time over TLS
HELD_BACK = 64 * 1024  # the last bytes of a checked range (FileRange.unchanged), sent once the check passed
STALE_CONNECTION_ERRORS = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
                           ConnectionAbortedError)
# A send failing with one of these means the server closed the connection: it may have answered first.
# (Not a timeout: waiting for an answer then would only wait a second time.)
CLOSED_BY_SERVER = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)
# Headers every signature must cover when sent: v2 signs Content-MD5 and Content-Type by position.
SIGNED_HEADERS = ("content-md5", "content-type")
_CODE = re.compile(rb"<Code>([^<]{0,200})</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]{0,1000})</Message>")
_ERROR_DOCUMENT = re.compile(rb"\A\s*(?:<\?xml[^>]*\?>\s*)?<Error[\s/>]")
_SIGNING_PARAMETER = re.compile(
    r"((?:X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|Signature|AWSAccessKeyId|AccessKeyId)=)[^&\s'\"]*",
    re.IGNORECASE)

Query = Optional[Mapping[str, Optional[str]]]


@dataclasses.dataclass(frozen=True)
class FileRange:
    """`size` bytes of the open file `file` (opened in binary mode) from `offset`: a request body."""

    file: IO[bytes]
    offset: int
    size: int
    # Called before the body's last bytes go (they are read first): False abandons the request (SourceChanged).
    unchanged: Optional[Callable[[], bool]] = None


Body = Union[None, bytes, FileRange]


class BodyCutShort(Exception):
    """The file ended before the range a request announced (it shrank); not a network error."""

    def __init__(self, sent: int, size: int):
        super().__init__(f"the file ended after {sent} of the {size} bytes to send")
        self.sent, self.size = sent, size


class SourceChanged(Exception):
    """The file changed while its range was sent (its `unchanged` check said so): the body was not finished."""


class V4Presigner:
    """Presigned v4 URLs as `ObsClient.createSignedUrl` makes them (tests compare the two), but
    with the signing key derived once a day instead of for every URL: the SDK's ~90 µs per URL was
    a fifth of the CPU a small file's download costs. v2 and OBS signatures (one HMAC each, ~35 µs)
    stay with the SDK."""

    def __init__(self, endpoint: str, region: str, path_style: bool, access_key: str, secret_key: str,
                 token: Optional[str]):
        parts = urlsplit(endpoint)
        self._scheme = parts.scheme
        self._host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        self._port_suffix = "" if port in (80, 443) else f":{port}"  # the SDK leaves 80 and 443 out of Host
        self._region = region
        # As the SDK does: path style whenever the server is an IPv4 address, whatever it was told.
        self._path_style = path_style or _is_ipv4(self._host)
        self._access_key = access_key
        self._secret_key = secret_key
        self._token = token
        self._days: Dict[str, Tuple[bytes, str, List[Tuple[str, str, str]]]] = {}

    def sign(self, bucket: str, key: Optional[str], query: Query, method: str = "GET",
             headers: Optional[Mapping[str, str]] = None) -> Tuple[str, Dict[str, str]]:
        """(URL, headers to send) for `method` on `key` (or on the bucket, with `query`); `headers`
        are signed too. A query value None is a parameter without one (`?uploads`)."""
        long_date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        day = long_date[:8]
        signing_key, scope, constants = self._for_day(day)
        host = (self._host if self._path_style else f"{bucket}.{self._host}") + self._port_suffix
        params = _query_pieces(query)
        params += constants[:-2]  # token, algorithm, credential: in the SDK's order
        params.append(("X-Amz-Date", f"X-Amz-Date={long_date}", f"X-Amz-Date={long_date}"))
        params.append(constants[-2])  # expires
        signed = {"host": host, **{name.lower(): value for name, value in (headers or {}).items()}}
        names = sorted(signed)
        params.append(constants[-1] if names == ["host"] else _piece("X-Amz-SignedHeaders", ";".join(names)))
        path = quote((f"/{bucket}" if self._path_style else "") + (f"/{key}" if key else "") or "/", "/~")
        canonical_query = "&".join(piece for _name, piece, _url in sorted(params))
        canonical_headers = "".join(f"{name}:{signed[name]}\n" for name in names)
        canonical_request = (f"{method}\n{path}\n{canonical_query}\n{canonical_headers}\n{';'.join(names)}\n"
                             "UNSIGNED-PAYLOAD")
        digest = hashlib.sha256(canonical_request.encode()).hexdigest()
        string_to_sign = f"AWS4-HMAC-SHA256\n{long_date}\n{scope}\n{digest}".encode()
        signature = hmac.new(signing_key, string_to_sign, hashlib.sha256).hexdigest()
        query_text = "&".join(url_piece for _name, _piece, url_piece in params)
        return (f"{self._scheme}://{host}{path}?{query_text}&X-Amz-Signature={signature}",
                {**(headers or {}), "Host": host})

    def _for_day(self, day: str) -> Tuple[bytes, str, List[Tuple[str, str, str]]]:
        """The day's signing key, scope and quoted constant parameters: derived once a day, not per URL
        (the SDK derives the key with four HMACs and quotes every parameter for every URL)."""
        cached = self._days.get(day)
        if cached is None:
            signing_key = f"AWS4{self._secret_key}".encode()
            for part in (day, self._region, "s3", "aws4_request"):
                signing_key = hmac.new(signing_key, part.encode(), hashlib.sha256).digest()
            scope = f"{day}/{self._region}/s3/aws4_request"
            values = [("x-amz-security-token", self._token)] if self._token else []
            values += [("X-Amz-Algorithm", "AWS4-HMAC-SHA256"), ("X-Amz-Credential", f"{self._access_key}/{scope}"),
                       ("X-Amz-Expires", str(EXPIRES_SECONDS)), ("X-Amz-SignedHeaders", "host")]
            cached = (signing_key, scope, [_piece(name, value) for name, value in values])
            self._days = {day: cached}  # replaced, not grown: one day at a time
        return cached


def _piece(name: str, value: Optional[str]) -> Tuple[str, str, str]:
    """(name, piece of the canonical query, piece of the URL): values are quoted with no safe characters
    in the one and "/" kept in the other, and a parameter without a value is `name=` in the one and
    `name` in the other, as the SDK does."""
    quoted = quote(name, "/")
    if value is None:
        return name, f"{quoted}=", quoted
    return name, f"{quoted}={quote(str(value), '')}", f"{quoted}={quote(str(value), '/')}"


def _query_pieces(query: Query) -> List[Tuple[str, str, str]]:
    # The SDK's URLs name the parameters without a value first.
    items = sorted((query or {}).items(), key=lambda item: item[1] is not None)
    return [_piece(name, value) for name, value in items]


class SignedRequests:
    """Requests signed by an ObsClient (or, for v4, by a V4Presigner that signs as it does), sent over
    this thread's kept-alive connection to the host."""

    def __init__(self, client, timeout: float, v4: Optional[V4Presigner] = None):
        self._client = client
        self._v4 = v4
        self._timeout = timeout
        self._ssl_context = getattr(client, "context", None)  # the SDK's, with our trust fixes (storage/obs/client.py)
        self._local = threading.local()

    def open(self, bucket: str, key: Optional[str], query: Query = None,
             headers: Optional[Mapping[str, str]] = None) -> http.client.HTTPResponse:
        """Sends a GET; returns the response (any status). The caller must `release` it."""
        return self.send("GET", bucket, key, query, headers)

    def send(self, method: str, bucket: str, key: Optional[str], query: Query = None,
             headers: Optional[Mapping[str, str]] = None, body: Body = None) -> http.client.HTTPResponse:
        """Sends the request; returns the response (any status). The caller must `release` it."""
        headers = dict(headers or {})
        to_sign = {name: value for name, value in headers.items() if name.lower() in SIGNED_HEADERS}
        signed_url, signed_headers = self._sign(method, bucket, key, query, to_sign)
        url = urlsplit(signed_url)
        target = url.path + (f"?{url.query}" if url.query else "")
        send = {**signed_headers, **headers}
        for attempt in (1, 2):
            connection, reused = self._connection(url.scheme, url.netloc)
            try:
                response = self._exchange(connection, method, target, send, body)
            except STALE_CONNECTION_ERRORS as exc:
                _mark_not_connected(exc, connection)
                self._discard(url.netloc)
                if not reused or attempt == 2:
                    raise
                continue
            except BaseException as exc:
                _mark_not_connected(exc, connection)
                self._discard(url.netloc)
                raise
            response.ma_netloc = url.netloc
            return response
        raise AssertionError("unreachable")  # pragma: no cover

    def _sign(self, method: str, bucket: str, key: Optional[str], query: Query,
              headers: Dict[str, str]) -> Tuple[str, Dict[str, str]]:
        if self._v4 is not None:
            return self._v4.sign(bucket, key or None, query, method, headers)
        signed = self._client.createSignedUrl(method, bucket, key or None, expires=EXPIRES_SECONDS,
                                              headers=headers or None, queryParams=dict(query) if query else None)
        return signed.signedUrl, signed.actualSignedRequestHeaders

    def _exchange(self, connection: http.client.HTTPConnection, method: str, target: str, headers: Dict[str, str],
                  body: Body) -> http.client.HTTPResponse:
        try:
            if isinstance(body, FileRange):
                connection.putrequest(method, target, skip_host=True)
                for name, value in {**headers, "Content-Length": str(body.size)}.items():
                    connection.putheader(name, value)
                connection.endheaders()
                self._send_file(connection, body)
            else:
                connection.request(method, target, body=body, headers=headers)
        except CLOSED_BY_SERVER:
            response = _answer_sent_early(connection)
            if response is None:
                raise
            response.ma_spent = True  # the request was not sent whole: the connection is of no further use
            return response
        return connection.getresponse()

    def _send_file(self, connection: http.client.HTTPConnection, body: FileRange) -> None:
        held = min(HELD_BACK, body.size) if body.unchanged is not None else 0
        first = dataclasses.replace(body, size=body.size - held)
        if isinstance(connection, http.client.HTTPSConnection):
            sent = self._send_file_through_buffer(connection.sock, first)
        else:
            sent = connection.sock.sendfile(first.file, first.offset, first.size) if first.size else 0
        if sent < first.size:
            raise BodyCutShort(sent, body.size)
        if held:
            tail = os.pread(body.file.fileno(), held, body.offset + sent)  # read before the check, sent after it
            if len(tail) < held:
                raise BodyCutShort(sent + len(tail), body.size)
            if not body.unchanged():
                raise SourceChanged()
            connection.sock.sendall(tail)

    def _send_file_through_buffer(self, sock, body: FileRange) -> int:
        buffer = self.buffer(SEND_CHUNK)
        fd = body.file.fileno()
        sent = 0
        while sent < body.size:
            count = os.preadv(fd, [buffer[:min(SEND_CHUNK, body.size - sent)]], body.offset + sent)
            if not count:
                break
            sock.sendall(buffer[:count])
            sent += count
        return sent

    def release(self, response: http.client.HTTPResponse) -> None:
        """Keeps the connection for the next request if the body was read to its end, else closes it."""
        netloc = getattr(response, "ma_netloc", None)
        held = self._connections().get(netloc)
        reusable = response.isclosed() and not response.will_close and not getattr(response, "ma_spent", False)
        if held is not None and reusable:
            self._connections()[netloc] = (held[0], True)
            return
        response.close()
        self._discard(netloc)

    def buffer(self, size: int) -> memoryview:
        """This thread's buffer, at least `size` bytes (reused: no allocation per request)."""
        held = getattr(self._local, "buffer", None)
        if held is None or len(held) < size:
            held = self._local.buffer = memoryview(bytearray(size))
        return held

    def _connections(self) -> Dict[str, Tuple[http.client.HTTPConnection, bool]]:
        connections = getattr(self._local, "connections", None)
        if connections is None:
            connections = self._local.connections = {}
        return connections

    def _connection(self, scheme: str, netloc: str) -> Tuple[http.client.HTTPConnection, bool]:
        """(connection, whether it served a request before)."""
        connections = self._connections()
        held = connections.get(netloc)
        if held is not None:
            return held
        if scheme == "https":
            connection = http.client.HTTPSConnection(netloc, timeout=self._timeout, context=self._ssl_context)
        else:
            connection = http.client.HTTPConnection(netloc, timeout=self._timeout)
        connections[netloc] = (connection, False)
        return connection, False

    def _discard(self, netloc: Optional[str]) -> None:
        held = self._connections().pop(netloc, None)
        if held is not None:
            held[0].close()


# The name from before writes came this way.
SignedReads = SignedRequests


def _mark_not_connected(exc: BaseException, connection: http.client.HTTPConnection) -> None:
    """Marks a failure that came before the connection was made (no socket yet: refused, a name not resolved, a
    connect timeout): the request never reached the endpoint (storage/reach.py's rule)."""
    if connection.sock is None and isinstance(exc, OSError):
        try:
            exc.ma_not_connected = True
        except AttributeError:  # pragma: no cover - an exception type without a __dict__
            pass


def _answer_sent_early(connection: http.client.HTTPConnection) -> Optional[http.client.HTTPResponse]:
    """The answer the server sent before the request failed to go out whole, or None when there is none
    (a connection closed while idle, a reset)."""
    if connection.sock is None:
        return None
    try:
        return connection.getresponse()
    except (OSError, http.client.HTTPException):
        return None


def _is_ipv4(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv4Address)
    except ValueError:
        return False


def without_signatures(text: str) -> str:
    """`text` with the value of every signing parameter of a signed URL blanked."""
    return _SIGNING_PARAMETER.sub(r"\1***", text)


def error_of(response: http.client.HTTPResponse) -> Tuple[Optional[str], Optional[str]]:
    """(error code, message) of an error answer: OBS's headers, else the S3-style XML body."""
    code = response.getheader("x-obs-error-code") or response.getheader("x-amz-error-code")
    message = response.getheader("x-obs-error-message") or response.getheader("x-amz-error-message")
    try:
        body = response.read(ERROR_BODY_LIMIT)
    except (OSError, http.client.HTTPException):
        body = b""  # the status says enough
    code = code or _first(_CODE, body)
    message = message or _first(_MESSAGE, body)
    return code, message


def error_document(body: bytes) -> Optional[str]:
    """"<Code>: <Message>" when `body` is an S3-style `<Error>` document (which S3 may send with a 200: the request
    then failed), else None."""
    if not _ERROR_DOCUMENT.match(body):
        return None
    return ": ".join(part for part in (_first(_CODE, body), _first(_MESSAGE, body)) if part) or "Error"


def _first(pattern: "re.Pattern[bytes]", body: bytes) -> Optional[str]:
    found = pattern.search(body)
    return found.group(1).decode("utf-8", "replace").strip() if found else None
