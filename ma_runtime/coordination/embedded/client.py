"""The embedded store's client: one connection, one request at a time, reconnect and resend within a deadline (a
resent write is applied once: the package's docstring)."""

import base64
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from ma_runtime.coordination.embedded.frames import VALUE_LIMIT, FrameError, FrameReader, address_text, encode_frame
from ma_runtime.coordination.store import Store, StoreUnavailable, checked_key, checked_ttl, checked_wait

# --------------------------------------------------------------------------- the client


class EmbeddedStoreClient(Store):
    """A client of the store at `host`:`port`: connects at once (within `connect_seconds`, by default
    `reconnect_seconds`, else StoreUnavailable), and again after a loss (within `reconnect_seconds`).
    `reply_seconds` bounds the wait for one reply (a `wait` gets its own timeout on top). The first connection may
    be given longer: a node's runtime can start long before worker-0's, whose store is not up yet."""

    def __init__(self, host: str, port: int, reconnect_seconds: float = 30.0, reply_seconds: float = 30.0,
                 connect_seconds: Optional[float] = None):
        self.host, self.port = host, port
        self.address = address_text(host, port)
        self._reconnect_seconds = reconnect_seconds
        self._reply_seconds = reply_seconds
        self._session = os.urandom(8).hex()
        self._number = 0
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._closed = False
        with self._lock:
            self._retrying(lambda: self._connection(), "connect",
                           reconnect_seconds if connect_seconds is None else connect_seconds)

    # The operations (store.Store).

    def set(self, key: str, value: bytes, ttl: Optional[float] = None) -> None:
        self._call({"op": "set", "k": checked_key(key), "v": _encoded(value), "ttl": checked_ttl(ttl)})

    def get(self, key: str) -> Optional[bytes]:
        value = self._call({"op": "get", "k": checked_key(key)})
        return None if value is None else base64.b64decode(value)

    def add(self, key: str, amount: int = 1) -> int:
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise ValueError(f"add takes an integer amount, not {amount!r}")
        return self._call({"op": "add", "k": checked_key(key), "a": amount})

    def compare_and_set(self, key: str, expected: Optional[bytes], value: bytes, ttl: Optional[float] = None) -> bool:
        return self._call({"op": "cas", "k": checked_key(key), "x": None if expected is None else _encoded(expected),
                           "v": _encoded(value), "ttl": checked_ttl(ttl)})

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        keys = checked_wait(keys, timeout)
        if not keys:
            return True
        return self._call({"op": "wait", "ks": keys, "t": max(float(timeout), 0.0)}, extra=max(timeout, 0.0))

    def delete(self, key: str) -> bool:
        return self._call({"op": "delete", "k": checked_key(key)})

    def keys(self, prefix: str = "") -> List[str]:
        return self._call({"op": "keys", "p": prefix})

    def close(self) -> None:
        self._closed = True
        sock = self._sock
        if sock is not None:
            try:  # wakes a thread blocked in a reply, which then sees the client closed and lets go of the lock
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            self._disconnect()

    # The connection.

    def _call(self, request: Dict[str, Any], extra: float = 0.0) -> Any:
        with self._lock:
            if self._closed:
                raise StoreUnavailable(self.address, "the client was closed")
            self._number += 1
            request.update(n=self._number, s=self._session)
            frame = encode_frame(request)
            reply = self._retrying(lambda: self._exchange(frame, self._reply_seconds + extra), request["op"])
        if reply.get("n") != request["n"]:
            raise self._not_a_store()
        if "e" in reply:
            raise ValueError(f"coordination store {self.address} refused {request['op']}: {reply['e']}")
        return reply.get("r")

    def _retrying(self, action: Callable[[], Any], what: str, seconds: Optional[float] = None) -> Any:
        """`action()`, done again on a new connection after each loss until `seconds` (`reconnect_seconds`) from
        the first."""
        seconds = self._reconnect_seconds if seconds is None else seconds
        deadline, pause = None, 0.05
        while True:
            try:
                return action()
            except FrameError:
                self._disconnect()
                raise self._not_a_store() from None
            except OSError as exc:
                self._disconnect()
                if self._closed:
                    raise StoreUnavailable(self.address, "the client was closed") from None
                now = time.monotonic()
                deadline = now + seconds if deadline is None else deadline
                if now >= deadline:
                    raise StoreUnavailable(self.address, f"{what}: {_why(exc)} (for {seconds:g} s)") \
                        from None
                time.sleep(min(pause, deadline - now))
                pause = min(pause * 2, 1.0)

    def _exchange(self, frame: bytes, seconds: float) -> Dict[str, Any]:
        sock = self._connection()
        sock.settimeout(seconds)
        sock.sendall(frame)
        reader = FrameReader()
        while True:
            data = sock.recv(1 << 16)
            if not data:
                raise ConnectionResetError("the store closed the connection")
            replies = reader.feed(data)
            if replies:
                return replies[0]  # one request at a time: nothing else can follow

    def _connection(self) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=self._reply_seconds)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _not_a_store(self) -> StoreUnavailable:
        return StoreUnavailable(self.address, "it answered with something other than the store's protocol "
                                              "(another program on that port?)")


def _encoded(value: bytes) -> str:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ValueError(f"a store value is bytes, not {type(value).__name__}")
    if len(value) > VALUE_LIMIT:
        raise ValueError(f"a store value is at most {VALUE_LIMIT} bytes, not {len(value)}")
    return base64.b64encode(bytes(value)).decode("ascii")


def _why(exc: OSError) -> str:
    if isinstance(exc, socket.timeout):
        return "no reply in time"
    return exc.strerror or str(exc) or type(exc).__name__
