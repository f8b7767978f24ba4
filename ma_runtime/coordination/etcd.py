"""The coordination store in an existing etcd cluster (`etcd://host:port[,host:port...]`), for clusters that run
one, through etcd's HTTP gateway and the `etcd3gw` client (the `etcd` extra: `pip install 'ma-runtime[etcd]'`).

How each operation maps onto etcd's KV API (every key under the job's `prefix`, so one etcd hosts many jobs):
  set(ttl)              a lease granted for this write (whole seconds, rounded up), then a put on it; without ttl a
                        put with no lease, which makes the key permanent again
  get, delete, keys     a range (keys: the prefix's range, keys only, sorted by key), a delete range
  add                   read, then a transaction: if the key's mod_revision is still the one read (create_revision
                        0 when it was absent), put the sum on the key's own lease; else read again and retry
  compare_and_set       a transaction: if value == expected (create_revision == 0 for None), put
  wait                  a transaction reading every key at one revision, then one watch from the next revision over
                        the keys' range, until every key exists after one revision's events or the deadline

Several endpoints: a request that cannot reach one goes to the next, until `reconnect_seconds` pass (then
StoreUnavailable naming them all). A resent `compare_and_set` whose first reply was lost counts as won when the key
holds its value; an `add` is resent only when the first try surely never reached etcd (an add cannot tell whether
it counted), else StoreUnavailable.
"""

import base64
import http.client
import json
import math
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from ma_runtime.coordination.embedded.frames import VALUE_LIMIT
from ma_runtime.coordination.store import Store, StoreUnavailable, checked_key, checked_ttl, checked_wait
from ma_runtime.errors import ConfigError

SCHEME = "etcd://"
INSTALL_HINT = "pip install 'ma-runtime[etcd]'"


def parse_endpoints(url: str) -> List[Tuple[str, int]]:
    """(host, port) of each endpoint in `etcd://host:port[,host:port...]` (IPv6 hosts in brackets); ConfigError
    for anything else."""
    hint = "write etcd://host:port, several separated by commas (etcd://10.0.0.5:2379,10.0.0.6:2379)"
    if not isinstance(url, str) or not url.startswith(SCHEME) or not url[len(SCHEME):].strip():
        raise ConfigError(f"an etcd coordinator is etcd://host:port[,host:port...], not {url!r:.200}", hint=hint)
    endpoints = []
    for part in url[len(SCHEME):].rstrip("/").split(","):
        host, _, port = part.strip().rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not host or "/" in host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"the etcd endpoint {part.strip()!r:.100} in {url!r:.200} is not host:port", hint=hint)
        endpoints.append((host, int(port)))
    return endpoints


def _etcd3gw():
    """The etcd3gw package, imported only when an etcd is used (the extra is optional)."""
    try:
        import etcd3gw
        from etcd3gw import exceptions
    except ImportError:
        raise ConfigError("an etcd coordinator needs the etcd3gw package, which is not installed",
                          hint=INSTALL_HINT) from None
    return etcd3gw, exceptions


class EtcdStore(Store):
    """A client of the etcd at `url`, its keys under `prefix` (`/ma-runtime/<job>/`). Reaches an endpoint at once
    (within `reconnect_seconds`, else StoreUnavailable); `reply_seconds` bounds one reply."""

    def __init__(self, url: str, prefix: str, reconnect_seconds: float = 30.0, reply_seconds: float = 30.0):
        self.endpoints = parse_endpoints(url)
        if not isinstance(prefix, str) or not prefix.strip("/"):
            raise ValueError(f"an etcd store's prefix names the job (/ma-runtime/<job>/), not {prefix!r}")
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.address = ",".join(f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in
                                self.endpoints)
        etcd3gw, self._errors = _etcd3gw()
        self._clients = [etcd3gw.client(host=host, port=port, timeout=reply_seconds) for host, port in self.endpoints]
        self._current = 0
        self._reconnect_seconds = reconnect_seconds
        self._reply_seconds = reply_seconds
        self._lock = threading.Lock()
        self._closed = False
        self._watch_socket: Optional[socket.socket] = None
        self._request("connect", lambda client, _resent: client.api_path)  # the gateway's version: /v3/ on 3.4+

    # The operations (store.Store).

    def set(self, key: str, value: bytes, ttl: Optional[float] = None) -> None:
        put = {"key": self._key(key), "value": _encoded(value)}
        ttl = checked_ttl(ttl)

        def write(client, _resent):
            if ttl is not None:  # a new lease per write: the last write's ttl counts; the old one expires alone
                put["lease"] = client.lease(_lease_seconds(ttl)).id
            client.post(client.get_url("/kv/put"), json=put)

        self._request("set", write)

    def get(self, key: str) -> Optional[bytes]:
        item = self._request("get", lambda client, _resent: _first(self._range(client, self._key(key))))
        return None if item is None else _decoded(item.get("value", ""))

    def add(self, key: str, amount: int = 1) -> int:
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise ValueError(f"add takes an integer amount, not {amount!r}")
        full = self._key(key)

        def add(client, _resent):
            item = _first(self._range(client, full))
            while True:
                total = _integer(item, key) + amount
                put = {"key": full, "value": _encoded(str(total).encode("ascii"))}
                if item is not None and item.get("lease"):
                    put["lease"] = item["lease"]  # the key keeps its time to live
                try:
                    reply = self._transaction(client, _unchanged(full, item), put)
                except self._errors.Etcd3Exception as exc:
                    if "lease not found" not in _detail(exc):
                        raise
                    item = _first(self._range(client, full))  # its lease expired meanwhile: the key is gone too
                    continue
                if reply.get("succeeded"):
                    return total
                item = _first(reply["responses"][0]["response_range"])  # changed meanwhile: again from its value

        # An add resent after its reply was lost could count twice: it is resent only when it never reached etcd.
        return self._request("add", add, resend_ambiguous=False)

    def compare_and_set(self, key: str, expected: Optional[bytes], value: bytes, ttl: Optional[float] = None) -> bool:
        full, ttl = self._key(key), checked_ttl(ttl)
        put = {"key": full, "value": _encoded(value)}
        if expected is None:
            compare = {"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": 0}
        else:
            compare = {"key": full, "target": "VALUE", "result": "EQUAL", "value": _encoded(expected)}

        def swap(client, resent):
            if ttl is not None:
                put["lease"] = client.lease(_lease_seconds(ttl)).id
            reply = self._transaction(client, compare, put)
            if reply.get("succeeded"):
                return True
            # Resent after a lost reply: the first try wrote it when the key now holds this value.
            current = _first(reply["responses"][0]["response_range"])
            return bool(resent and current is not None and current.get("value", "") == put["value"])

        return self._request("compare_and_set", swap)

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        keys = checked_wait(keys, timeout)
        if not keys:
            return True
        wanted = {self._full(key) for key in keys}
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._lock:
            while True:
                present, revision = self._request("wait", lambda client, _resent: self._present(client, wanted),
                                                  locked=True)
                if present == wanted:
                    return True
                if time.monotonic() >= deadline:
                    return False
                done = self._watch(wanted, present, revision + 1, deadline)
                if done is not None:
                    return done
                # None: the watch was lost or cancelled; read again, then watch from there

    def delete(self, key: str) -> bool:
        reply = self._request("delete", lambda client, _resent: client.post(
            client.get_url("/kv/deleterange"), json={"key": self._key(key)}))
        return int(reply.get("deleted", 0)) > 0

    def keys(self, prefix: str = "") -> List[str]:
        start = (self.prefix + prefix).encode("utf-8")
        items = self._request("keys", lambda client, _resent: self._range(
            client, _b64(start), range_end=_b64(_prefix_end(start)), keys_only=True, sort_order=1, sort_target=0))
        return sorted(_decoded(item["key"]).decode("utf-8")[len(self.prefix):] for item in items)

    def close(self) -> None:
        self._closed = True
        watch_socket = self._watch_socket
        if watch_socket is not None:
            _shut(watch_socket)  # wakes a thread in `wait`, which then sees the client closed
        with self._lock:
            for client in self._clients:
                client.session.close()

    # The requests.

    def _request(self, what: str, action: Callable[[Any, bool], Any], resend_ambiguous: bool = True,
                 locked: bool = False) -> Any:
        """action(client, resent) on the current endpoint, and on the next ones after each failure to reach one,
        until `reconnect_seconds` from the first failure."""
        if locked:
            return self._retrying(what, action, resend_ambiguous)
        with self._lock:
            return self._retrying(what, action, resend_ambiguous)

    def _retrying(self, what: str, action: Callable[[Any, bool], Any], resend_ambiguous: bool) -> Any:
        deadline, pause, resent = None, 0.05, False
        while True:
            if self._closed:
                raise StoreUnavailable(self.address, "the client was closed")
            client = self._clients[self._current]
            try:
                return action(client, resent)
            except self._errors.Etcd3Exception as exc:
                if what == "connect" and not self._unreachable(exc):
                    raise StoreUnavailable(self.address, f"connect: {client.host}:{client.port} answered as something "
                                                         f"other than etcd's HTTP gateway ({_detail(exc)})") from None
                if not self._unreachable(exc):
                    raise ValueError(f"coordination store {self.address} refused {what}: {_detail(exc)}") from None
                if not resend_ambiguous and not _surely_unsent(exc):
                    raise StoreUnavailable(self.address, f"{what}: {_detail(exc)}; it may have been applied, so it "
                                                         f"is not resent") from None
                resent = resent or not _surely_unsent(exc)
                self._current = (self._current + 1) % len(self._clients)
                now = time.monotonic()
                deadline = now + self._reconnect_seconds if deadline is None else deadline
                if now >= deadline:
                    raise StoreUnavailable(self.address, f"{what}: {_detail(exc)} (for {self._reconnect_seconds:g} s)"
                                           ) from None
                if self._current == 0:  # every endpoint tried once more: a pause before the next round
                    time.sleep(min(pause, max(deadline - now, 0.0)))
                    pause = min(pause * 2, 1.0)

    def _unreachable(self, exc: Exception) -> bool:
        errors = self._errors
        return isinstance(exc, (errors.ConnectionFailedError, errors.ConnectionTimeoutError,
                                errors.InternalServerError))

    def _full(self, key: str) -> bytes:
        """The key in etcd: under the job's prefix."""
        return (self.prefix + checked_key(key)).encode("utf-8")

    def _key(self, key: str) -> str:
        """The key in etcd as the gateway takes it (base64)."""
        return _b64(self._full(key))

    @staticmethod
    def _range(client, key: str, **options) -> List[Dict[str, Any]]:
        return client.post(client.get_url("/kv/range"), json={"key": key, **options}).get("kvs", [])

    @staticmethod
    def _transaction(client, compare: Dict[str, Any], put: Dict[str, Any]) -> Dict[str, Any]:
        """put if compare holds; otherwise the key's current item (in responses[0])."""
        return client.transaction({"compare": [compare], "success": [{"request_put": put}],
                                   "failure": [{"request_range": {"key": put["key"]}}]})

    @staticmethod
    def _present(client, wanted: Set[bytes]) -> Tuple[Set[bytes], int]:
        """Which of `wanted` exist, all read at one revision, and that revision."""
        ordered = sorted(wanted)
        reply = client.transaction({"compare": [], "success": [
            {"request_range": {"key": _b64(key), "count_only": True}} for key in ordered], "failure": []})
        present = {key for key, response in zip(ordered, reply["responses"])
                   if int(response["response_range"].get("count", 0)) > 0}
        return present, int(reply["header"]["revision"])

    # The watch: etcd3gw's own runs in a thread pool with no deadline and drops a lost stream silently, so this
    # one reads the gateway's stream itself, on a socket it owns: every read bounded by the deadline left, the
    # socket closed on return, a lost stream seen at once.

    def _watch(self, wanted: Set[bytes], present: Set[bytes], start: int, deadline: float) -> Optional[bool]:
        """True once every wanted key exists after one revision's events, False at the deadline, None when the
        stream was lost or cancelled."""
        client = self._clients[self._current]
        low, high = min(wanted), max(wanted)
        request = {"create_request": {"key": _b64(low), "range_end": _b64(high + b"\0"), "start_revision": start}}
        connect_seconds = max(min(self._reply_seconds, deadline - time.monotonic()), 0.01)
        connection = http.client.HTTPConnection(client.host, client.port, timeout=connect_seconds)
        try:
            connection.request("POST", client.api_path + "watch", body=json.dumps(request),
                               headers={"Content-Type": "application/json"})
            self._watch_socket = connection.sock
            reply = connection.getresponse()
            if reply.status != 200:
                return None
            return self._follow(reply, connection.sock, wanted, set(present), deadline)
        except socket.timeout:
            return False if time.monotonic() >= deadline else None
        except (OSError, http.client.HTTPException, ValueError):
            if not self._closed:
                self._current = (self._current + 1) % len(self._clients)  # the next check tries the next endpoint
            return None
        finally:
            self._watch_socket = None
            connection.close()

    def _follow(self, reply, sock: socket.socket, wanted: Set[bytes], present: Set[bytes],
                deadline: float) -> Optional[bool]:
        pending = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            sock.settimeout(left)
            data = reply.read1(1 << 16)
            if not data:
                return None  # the stream ended: etcd stopped or the gateway closed it
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                result = json.loads(line).get("result")
                if result is None or result.get("canceled"):
                    return None  # an error, or the revision compacted away: read again
                for event in result.get("events", ()):
                    name = _decoded(event["kv"]["key"])
                    if name in wanted:
                        (present.discard if event.get("type") == "DELETE" else present.add)(name)
                if present == wanted:  # after all the events of one response: one revision, one moment
                    return True


# --------------------------------------------------------------------------- helpers


def _lease_seconds(ttl: float) -> int:
    """etcd counts a lease's time to live in whole seconds (and raises it to its own minimum)."""
    return max(1, math.ceil(ttl))


def _unchanged(full: str, item: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The transaction's guard: the key is as it was read (absent: never created since)."""
    if item is None:
        return {"key": full, "target": "CREATE", "result": "EQUAL", "create_revision": 0}
    return {"key": full, "target": "MOD", "result": "EQUAL", "mod_revision": item["mod_revision"]}


def _integer(item: Optional[Dict[str, Any]], key: str) -> int:
    if item is None:
        return 0
    try:
        return int(_decoded(item.get("value", "")).decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"add: {key} does not hold an integer") from None


def _first(response: Any) -> Optional[Dict[str, Any]]:
    items = response.get("kvs", []) if isinstance(response, dict) else response
    return items[0] if items else None


def _encoded(value: bytes) -> str:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ValueError(f"a store value is bytes, not {type(value).__name__}")
    if len(value) > VALUE_LIMIT:
        raise ValueError(f"a store value is at most {VALUE_LIMIT} bytes, not {len(value)}")
    return _b64(bytes(value))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _decoded(text: str) -> bytes:
    return base64.b64decode(text)


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with `prefix` (etcd's range_end for a prefix)."""
    trimmed = prefix.rstrip(b"\xff")
    return trimmed[:-1] + bytes([trimmed[-1] + 1]) if trimmed else b"\0"


def _surely_unsent(exc: Exception) -> bool:
    """True when the request never reached etcd (the connection could not be made), so resending it is safe."""
    import requests
    from urllib3.exceptions import ConnectTimeoutError  # NewConnectionError (refused, unreachable) is one too

    cause = exc.__context__
    if isinstance(cause, requests.exceptions.ConnectTimeout):
        return True
    reason = getattr(cause.args[0], "reason", None) if isinstance(cause, requests.ConnectionError) and cause.args \
        else None
    return isinstance(reason, ConnectTimeoutError)


def _detail(exc: Exception) -> str:
    """One line from an etcd3gw error: the gateway's message, else the connection error's."""
    text = getattr(exc, "detail_text", None) or str(exc) or type(exc).__name__
    try:
        text = json.loads(text).get("error") or json.loads(text).get("message") or text
    except (ValueError, AttributeError):
        pass
    return " ".join(str(text).split())[:300]


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
