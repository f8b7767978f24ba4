"""Reads from OBS over keep-alive connections, by URLs the OBS SDK signs.

Why not `ObsClient.getObject` / `listObjects`: measured on 2 cores (benchmarks/storage.py),
the SDK spends about 1.5 ms of CPU per GET (its response wrapper, a new connection per
request, header parsing in pure Python) and 130 µs per key parsing a listing, against
0.2 ms for a plain `http.client` GET. For 2000 small files that is the difference between
a third and most of what the endpoint can serve. So the SDK still decides every request
(its `createSignedUrl`: v2, v4 or OBS signature, path or virtual-host style, security
token), and this module only carries it: one connection per thread and host, kept alive,
bodies read into a reused buffer.

Connections: a reused connection that the server closed while idle fails before any
answer arrives (RemoteDisconnected, reset, broken pipe); the request is then sent again,
once, on a new connection, as urllib3 does. A response not read to its end closes its
connection, so the next request never reads the rest of an old body.
"""

import hashlib
import hmac
import http.client
import ipaddress
import re
import threading
import time
from typing import Dict, List, Mapping, Optional, Tuple
from urllib.parse import quote, urlsplit

# Long enough for a request queued behind others; the URL is used at once and never logged.
EXPIRES_SECONDS = 900
ERROR_BODY_LIMIT = 64 * 1024  # an error answer is a short XML document; more is not read
STALE_CONNECTION_ERRORS = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
                           ConnectionAbortedError)
_CODE = re.compile(rb"<Code>([^<]{0,200})</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]{0,1000})</Message>")


class V4Presigner:
    """Presigned v4 GET URLs as `ObsClient.createSignedUrl` makes them (tests compare the two), but
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

    def sign(self, bucket: str, key: Optional[str], query: Optional[Mapping[str, str]]) -> Tuple[str, Dict[str, str]]:
        """(URL, headers to send) for a GET of `key` (or of the bucket, with `query`)."""
        long_date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        day = long_date[:8]
        signing_key, scope, constants = self._for_day(day)
        host = (self._host if self._path_style else f"{bucket}.{self._host}") + self._port_suffix
        # (name, piece of the canonical query, piece of the URL): values are quoted with no safe
        # characters in the one and "/" kept in the other, as the SDK does.
        params = [(name, f"{quote(name, '/')}={quote(str(value), '')}", f"{quote(name, '/')}={quote(str(value), '/')}")
                  for name, value in (query or {}).items()]
        params += constants[:-2]  # token, algorithm, credential: in the SDK's order
        params.append(("X-Amz-Date", f"X-Amz-Date={long_date}", f"X-Amz-Date={long_date}"))
        params += constants[-2:]  # expires, signed headers
        path = quote((f"/{bucket}" if self._path_style else "") + (f"/{key}" if key else "") or "/", "/~")
        canonical_query = "&".join(piece for _name, piece, _url in sorted(params))
        canonical_request = f"GET\n{path}\n{canonical_query}\nhost:{host}\n\nhost\nUNSIGNED-PAYLOAD"
        digest = hashlib.sha256(canonical_request.encode()).hexdigest()
        string_to_sign = f"AWS4-HMAC-SHA256\n{long_date}\n{scope}\n{digest}".encode()
        signature = hmac.new(signing_key, string_to_sign, hashlib.sha256).hexdigest()
        query_text = "&".join(url_piece for _name, _piece, url_piece in params)
        return f"{self._scheme}://{host}{path}?{query_text}&X-Amz-Signature={signature}", {"Host": host}

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
            constants = [(name, f"{quote(name, '/')}={quote(value, '')}", f"{quote(name, '/')}={quote(value, '/')}")
                         for name, value in values]
            cached = (signing_key, scope, constants)
            self._days = {day: cached}  # replaced, not grown: one day at a time
        return cached


class SignedReads:
    """GETs signed by an ObsClient (or, for v4, by a V4Presigner that signs as it does), sent over this
    thread's kept-alive connection to the host."""

    def __init__(self, client, timeout: float, v4: Optional[V4Presigner] = None):
        self._client = client
        self._v4 = v4
        self._timeout = timeout
        self._ssl_context = getattr(client, "context", None)  # the SDK's, with our trust fixes (obs.py)
        self._local = threading.local()

    def open(self, bucket: str, key: Optional[str], query: Optional[Mapping[str, str]] = None,
             headers: Optional[Mapping[str, str]] = None) -> http.client.HTTPResponse:
        """Sends the GET; returns the response (any status). The caller must `release` it."""
        signed_url, signed_headers = self._sign(bucket, key, query)
        url = urlsplit(signed_url)
        target = url.path + (f"?{url.query}" if url.query else "")
        send = {**signed_headers, **(headers or {})}
        for attempt in (1, 2):
            connection, reused = self._connection(url.scheme, url.netloc)
            try:
                connection.request("GET", target, headers=send)
                response = connection.getresponse()
            except STALE_CONNECTION_ERRORS:
                self._discard(url.netloc)
                if not reused or attempt == 2:
                    raise
                continue
            except BaseException:
                self._discard(url.netloc)
                raise
            response.ma_netloc = url.netloc
            return response
        raise AssertionError("unreachable")  # pragma: no cover

    def _sign(self, bucket: str, key: Optional[str], query: Optional[Mapping[str, str]]) -> Tuple[str, Dict[str, str]]:
        if self._v4 is not None:
            return self._v4.sign(bucket, key or None, query)
        signed = self._client.createSignedUrl("GET", bucket, key or None, expires=EXPIRES_SECONDS,
                                              queryParams=dict(query) if query else None)
        return signed.signedUrl, signed.actualSignedRequestHeaders

    def release(self, response: http.client.HTTPResponse) -> None:
        """Keeps the connection for the next request if the body was read to its end, else closes it."""
        netloc = getattr(response, "ma_netloc", None)
        held = self._connections().get(netloc)
        if held is not None and response.isclosed() and not response.will_close:
            self._connections()[netloc] = (held[0], True)
            return
        response.close()
        self._discard(netloc)

    def buffer(self, size: int) -> memoryview:
        """This thread's read buffer, at least `size` bytes (reused: no allocation per read)."""
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


def _is_ipv4(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv4Address)
    except ValueError:
        return False


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


def _first(pattern: "re.Pattern[bytes]", body: bytes) -> Optional[str]:
    found = pattern.search(body)
    return found.group(1).decode("utf-8", "replace").strip() if found else None
