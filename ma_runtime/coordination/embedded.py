"""The embedded store: the server worker-0's runtime hosts on a thread, and the client every node's runtime uses.

As torch c10d hosts its TCPStore on node 0, worker-0 (VC_TASK_INDEX=0) hosts the job's store itself: nothing the
platform does not already give, pod-to-pod TCP and the job's DNS names. Standard library only.

Server. One thread, one `selectors` loop: 1 000 clients are 1 000 sockets, not 1 000 threads. Every operation is
applied on that thread in the order the requests arrive (the store's receive order, store.py). A `wait` is parked
on the keys it waits for and answered by the write that completes it or by its deadline, never polled; keys with a
time to live expire on the server's monotonic clock. `close()` stops the loop, closes every socket and joins the
thread.

Protocol. Each message is a frame: 4 bytes big-endian length, then that many bytes of a UTF-8 JSON object. A
request is {"op", "n" (the client's request number), "s" (the client's session, random), ...the operation's
fields}, values in base64; the reply is {"n", "r": result} or {"n", "e": "why it was refused"}. A frame longer than
FRAME_LIMIT, or one that is not such a request, closes that connection only: a broken or hostile peer cannot make
the server allocate more than FRAME_LIMIT for it, nor disturb the others; nor can a peer that never reads its
replies (its connection is closed once OUTPUT_LIMIT bytes wait for it). All the values together are bounded too
(`byte_limit`): a write past it is refused.

Client. One TCP connection, one request at a time (a lock). When the connection is lost the client connects again
and resends the request until `reconnect_seconds` after the loss, then raises StoreUnavailable naming host:port.
A resent write is applied once: the server keeps each session's last write reply and answers a repeated request
number with it (so `add` never counts twice, and the winner of `compare_and_set` still reads True).

Trust model (the mpirun key server's, docs/platform.md D38, made stricter). Who may talk to the store: the job's
own nodes. The server calls `allow(peer_ip)` for each connection before reading a byte of it; the runtime passes
the job's node addresses (VC_WORKER_HOSTS resolved by the cluster's DNS, the trust the pod network already
gives), and a refused peer is closed at once and logged by its address only. There is no secret on the wire, so
none to steal or to leak: the store holds the job's coordination (who joined, which attempt, who failed first,
heartbeats), never credentials or the job's environment, and the runtime puts nothing else there. Values are never
logged, by the server or the client. What this does not stop: a process inside an allowed pod (that pod is the
job's own), or a peer that spoofs an allowed address on the pod network (the cluster's network policy is the
boundary, as for sshd and torchrun's TCPStore, which has no check at all). Plain TCP, no TLS, like TCPStore.
"""

import base64
import binascii
import collections
import heapq
import json
import math
import os
import selectors
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from ma_runtime.coordination.store import Store, StoreUnavailable, checked_key, checked_ttl

FRAME_LIMIT = 1 << 20  # bytes of one frame's body: a request or a reply
VALUE_LIMIT = 512 << 10  # bytes of one value (base64 makes it 4/3 larger in its frame)
OUTPUT_LIMIT = 4 * FRAME_LIMIT  # replies waiting for a peer that does not read them
BYTE_LIMIT = 64 << 20  # every key and value together, by default: the job's state is small
_SESSIONS_KEPT = 65536  # the last write reply of this many client sessions (a job has at most a few thousand)
_LONGEST_WAIT = 7 * 86400.0  # seconds: a longer wait's deadline is this one's (selectors take no infinity)
_HEADER = struct.Struct(">I")
_WRITES = frozenset({"set", "add", "cas", "delete"})  # the requests whose replies a resend must get again


class FrameError(ValueError):
    """A frame over the limit, or one that is not a JSON object."""


def encode_frame(message: Dict[str, Any], limit: int = FRAME_LIMIT) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode("utf-8")
    if len(body) > limit:
        raise FrameError(f"a frame of {len(body)} bytes is over the limit of {limit}")
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Turns the bytes a connection received into messages; never holds more than one frame's limit."""

    def __init__(self, limit: int = FRAME_LIMIT):
        self._limit = limit
        self._buffer = bytearray()

    def feed(self, data: bytes) -> List[Dict[str, Any]]:
        """The messages completed by `data`; FrameError as soon as a frame announces more than the limit or is
        not a JSON object."""
        self._buffer += data
        messages = []
        while len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            if length > self._limit:
                raise FrameError(f"a frame of {length} bytes is over the limit of {self._limit}")
            if len(self._buffer) < _HEADER.size + length:
                break
            body = bytes(self._buffer[_HEADER.size:_HEADER.size + length])
            del self._buffer[:_HEADER.size + length]
            messages.append(_decoded(body))
        return messages


def _decoded(body: bytes) -> Dict[str, Any]:
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise FrameError("a frame that is not UTF-8 JSON") from None
    if not isinstance(message, dict):
        raise FrameError("a frame that is not a JSON object")
    return message


def address_text(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --------------------------------------------------------------------------- the table (state, no I/O)


class _Entry:
    __slots__ = ("value", "expires")

    def __init__(self, value: bytes, expires: Optional[float]):
        self.value = value
        self.expires = expires


class _Waiter:
    """A parked `wait`: the connection and request number to answer, the keys still missing."""

    __slots__ = ("reply_to", "number", "keys", "missing", "done")

    def __init__(self, reply_to: Any, number: Any, keys: Set[str], missing: Set[str]):
        self.reply_to = reply_to
        self.number = number
        self.keys = keys
        self.missing = missing
        self.done = False


class _Table:
    """The keys, their expiry, the parked waits. Every method runs on the server's thread; `answered` collects
    the waits a call completed, (waiter, result), for the server to reply to."""

    def __init__(self, byte_limit: int):
        self.entries: Dict[str, _Entry] = {}
        self._bytes = 0
        self._byte_limit = byte_limit
        self._expiries: List[Tuple[float, str]] = []
        self._waiting: Dict[str, Set[_Waiter]] = {}
        self._deadlines: List[Tuple[float, int, _Waiter]] = []
        self._tick = 0  # orders deadlines that are equal
        self.answered: List[Tuple[_Waiter, bool]] = []

    def live(self, key: str, now: float) -> Optional[_Entry]:
        entry = self.entries.get(key)
        if entry is not None and entry.expires is not None and entry.expires <= now:
            self._remove(key)  # its expiry is due but not yet run: the same as run
            return None
        return entry

    def write(self, key: str, value: bytes, ttl: Optional[float], now: float) -> None:
        old = self.live(key, now)
        grown = len(value) - (len(old.value) if old else -len(key.encode()))
        if grown > 0 and self._bytes + grown > self._byte_limit:
            raise ValueError(f"the store is full ({self._byte_limit} bytes of keys and values)")
        self._bytes += grown
        expires = None if ttl is None else now + ttl
        self.entries[key] = _Entry(value, expires)
        if expires is not None:
            heapq.heappush(self._expiries, (expires, key))
        if old is None:
            self._created(key)

    def delete(self, key: str, now: float) -> bool:
        if self.live(key, now) is None:
            return False
        self._remove(key)
        return True

    def park(self, waiter: _Waiter, deadline: float) -> None:
        for key in waiter.keys:
            self._waiting.setdefault(key, set()).add(waiter)
        self._tick += 1
        heapq.heappush(self._deadlines, (deadline, self._tick, waiter))

    def unpark(self, waiter: _Waiter) -> None:
        waiter.done = True
        for key in waiter.keys:
            parked = self._waiting.get(key)
            if parked is not None:
                parked.discard(waiter)
                if not parked:
                    del self._waiting[key]

    def run_due(self, now: float) -> None:
        """Expires the keys and ends the waits whose time has come."""
        while self._expiries and self._expiries[0][0] <= now:
            expires, key = heapq.heappop(self._expiries)
            entry = self.entries.get(key)
            if entry is not None and entry.expires == expires:  # not refreshed since
                self._remove(key)
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, waiter = heapq.heappop(self._deadlines)
            if not waiter.done:
                self.unpark(waiter)
                self.answered.append((waiter, False))

    def next_due(self) -> Optional[float]:
        while self._deadlines and self._deadlines[0][2].done:
            heapq.heappop(self._deadlines)  # answered or gone: its deadline is nobody's
        times = [heap[0][0] for heap in (self._expiries, self._deadlines) if heap]
        return min(times) if times else None

    def _created(self, key: str) -> None:
        for waiter in list(self._waiting.get(key, ())):
            waiter.missing.discard(key)
            if not waiter.missing:
                self.unpark(waiter)
                self.answered.append((waiter, True))

    def _remove(self, key: str) -> None:
        entry = self.entries.pop(key)
        self._bytes -= len(entry.value) + len(key.encode())
        for waiter in self._waiting.get(key, ()):
            waiter.missing.add(key)  # a wait is for every key at one moment


# --------------------------------------------------------------------------- requests


class _BadRequest(Exception):
    """A request that does not follow the protocol: its connection is closed."""


def _text(request: Dict[str, Any], field: str) -> str:
    value = request.get(field)
    if not isinstance(value, str):
        raise _BadRequest(f"{field} is not a text")
    try:
        return checked_key(value)
    except ValueError as exc:
        raise _BadRequest(str(exc)) from None


def _value(request: Dict[str, Any], field: str) -> Optional[bytes]:
    value = request.get(field)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _BadRequest(f"{field} is not base64")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise _BadRequest(f"{field} is not base64") from None


def _number(request: Dict[str, Any], field: str, kind: type = float) -> Any:
    value = request.get(field)
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise _BadRequest(f"{field} is not a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise _BadRequest(f"{field} is not a finite number")
    return value


def _ttl(request: Dict[str, Any]) -> Optional[float]:
    if request.get("ttl") is None:
        return None
    try:
        return checked_ttl(_number(request, "ttl"))
    except ValueError as exc:
        raise _BadRequest(str(exc)) from None


def _add(table: _Table, key: str, amount: int, now: float) -> int:
    entry = table.live(key, now)
    try:
        total = (int(entry.value.decode("ascii")) if entry else 0) + amount
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"add: {key} does not hold an integer") from None
    remaining = None if entry is None or entry.expires is None else entry.expires - now
    table.write(key, str(total).encode("ascii"), remaining, now)
    return total


def _compare_and_set(table: _Table, request: Dict[str, Any], now: float) -> bool:
    key = _text(request, "k")
    entry = table.live(key, now)
    if (entry.value if entry else None) != _value(request, "x"):
        return False
    table.write(key, _value(request, "v") or b"", _ttl(request), now)
    return True


def _apply(table: _Table, request: Dict[str, Any], now: float) -> Any:
    """The result of one request other than `wait`; ValueError for one the store refuses."""
    op = request.get("op")
    if op == "set":
        table.write(_text(request, "k"), _value(request, "v") or b"", _ttl(request), now)
        return None
    if op == "get":
        entry = table.live(_text(request, "k"), now)
        return None if entry is None else base64.b64encode(entry.value).decode("ascii")
    if op == "add":
        return _add(table, _text(request, "k"), _number(request, "a", int), now)
    if op == "cas":
        return _compare_and_set(table, request, now)
    if op == "delete":
        return table.delete(_text(request, "k"), now)
    if op == "keys":
        prefix = request.get("p", "")
        if not isinstance(prefix, str):
            raise _BadRequest("p is not a text")
        return sorted(key for key in list(table.entries) if key.startswith(prefix) and table.live(key, now))
    raise _BadRequest(f"unknown operation {str(op)[:40]!r}")


# --------------------------------------------------------------------------- the server


class _Connection:
    __slots__ = ("sock", "peer", "reader", "output", "waiters", "writing")

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self.reader = FrameReader()
        self.output = bytearray()
        self.waiters: Set[_Waiter] = set()
        self.writing = False


class EmbeddedStoreServer:
    """The job's store on `host`:`port` (port 0: any free one, `port` says which), served by one thread from
    `start()` until `close()`. `allow(peer_ip)` decides each connection (None: every peer); `log`, a logger with
    `.warning(msg, **fields)`, hears of refused peers and broken frames (never of values)."""

    def __init__(self, host: str = "", port: int = 0, allow: Optional[Callable[[str], bool]] = None,
                 log: Any = None, byte_limit: int = BYTE_LIMIT):
        self._listener = socket.create_server((host, port), backlog=4096)
        self._listener.setblocking(False)
        self.host, self.port = self._listener.getsockname()[:2]
        self._allow = allow
        self._log = log
        self._table = _Table(byte_limit)
        self._replies: collections.OrderedDict[str, Tuple[Any, Dict[str, Any]]] = collections.OrderedDict()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_reader, selectors.EVENT_READ, "wake")
        self._connections: Set[_Connection] = set()
        self._closing = False
        self._released = False
        self._thread = threading.Thread(target=self._serve, name="ma-runtime-store", daemon=True)

    @property
    def address(self) -> str:
        return address_text(self.host, self.port)

    def start(self) -> "EmbeddedStoreServer":
        self._thread.start()
        return self

    def close(self) -> None:
        """Stops serving: every connection and the listening socket closed, the thread joined. Idempotent."""
        self._closing = True
        try:
            self._wake_writer.send(b"x")
        except OSError:
            pass  # already closed
        if self._thread.is_alive():
            self._thread.join()
        else:
            self._release()

    def __enter__(self) -> "EmbeddedStoreServer":
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.close()

    def _serve(self) -> None:
        try:
            while not self._closing:
                due = self._table.next_due()
                timeout = None if due is None else max(due - time.monotonic(), 0.0)
                for selected, events in self._selector.select(timeout):
                    self._dispatch(selected, events)
                self._table.run_due(time.monotonic())
                self._send_answers()
        finally:
            self._release()

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        for connection in list(self._connections):
            self._drop(connection)
        for sock in (self._listener, self._wake_reader, self._wake_writer):
            sock.close()
        self._selector.close()

    def _dispatch(self, selected: selectors.SelectorKey, events: int) -> None:
        if selected.data is None:
            self._accept()
        elif selected.data == "wake":
            self._wake_reader.recv(64)
        else:
            connection = selected.data
            if events & selectors.EVENT_WRITE:
                self._flush(connection)
            if events & selectors.EVENT_READ and connection in self._connections:
                self._receive(connection)

    def _accept(self) -> None:
        while True:  # every pending connection: 1 000 nodes connect at once
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the peer retries
                self._warn("the store could not accept a connection", error=str(exc))
                return
            if self._allow is not None and not self._allow(peer[0]):
                sock.close()  # before reading a byte
                self._warn("the store refused a peer that is not one of the job's nodes", peer=peer[0])
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = _Connection(sock, peer[0])
            self._connections.add(connection)
            self._selector.register(sock, selectors.EVENT_READ, connection)

    def _receive(self, connection: _Connection) -> None:
        try:
            data = connection.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(connection)
            return
        try:
            for request in connection.reader.feed(data):
                self._handle(connection, request)
        except (FrameError, _BadRequest) as exc:
            self._warn("the store closed a connection that broke its protocol", peer=connection.peer, why=str(exc))
            self._drop(connection)
            return
        self._send_answers()

    def _handle(self, connection: _Connection, request: Dict[str, Any]) -> None:
        number, session = request.get("n"), request.get("s")
        if not isinstance(session, str) or len(session) > 64:
            raise _BadRequest("s is not a session")
        if request.get("op") == "wait":
            self._park(connection, request, number)
            return
        kept = self._replies.get(session) if request.get("op") in _WRITES else None
        if kept is not None and kept[0] == number:  # a resend after a lost connection: applied already
            self._reply(connection, kept[1])
            return
        try:
            reply = {"n": number, "r": _apply(self._table, request, time.monotonic())}
        except ValueError as exc:
            reply = {"n": number, "e": str(exc)}
        if request.get("op") in _WRITES:
            self._keep(session, number, reply)
        self._reply(connection, reply)

    def _keep(self, session: str, number: Any, reply: Dict[str, Any]) -> None:
        self._replies[session] = (number, reply)
        self._replies.move_to_end(session)
        if len(self._replies) > _SESSIONS_KEPT:
            self._replies.popitem(last=False)

    def _park(self, connection: _Connection, request: Dict[str, Any], number: Any) -> None:
        keys = request.get("ks")
        if not isinstance(keys, list) or not keys:
            raise _BadRequest("ks is not a list of keys")
        wanted = {_text({"k": key}, "k") for key in keys}
        timeout = min(_number(request, "t"), _LONGEST_WAIT)
        now = time.monotonic()
        missing = {key for key in wanted if self._table.live(key, now) is None}
        if not missing or timeout <= 0:
            self._reply(connection, {"n": number, "r": not missing})
            return
        waiter = _Waiter(connection, number, wanted, missing)
        connection.waiters.add(waiter)
        self._table.park(waiter, now + timeout)

    def _send_answers(self) -> None:
        answered, self._table.answered = self._table.answered, []
        for waiter, result in answered:
            connection = waiter.reply_to
            connection.waiters.discard(waiter)
            if connection in self._connections:
                self._reply(connection, {"n": waiter.number, "r": result})

    def _reply(self, connection: _Connection, reply: Dict[str, Any]) -> None:
        try:
            frame = encode_frame(reply)
        except FrameError:  # a `keys` answer too long for one frame
            frame = encode_frame({"n": reply.get("n"), "e": f"the reply is over the frame limit of {FRAME_LIMIT} "
                                                             "bytes (ask for a narrower prefix)"})
        connection.output += frame
        self._flush(connection)

    def _flush(self, connection: _Connection) -> None:
        try:
            sent = connection.sock.send(connection.output) if connection.output else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(connection)
            return
        del connection.output[:sent]
        if len(connection.output) > OUTPUT_LIMIT:
            self._warn("the store closed a connection that does not read its replies", peer=connection.peer)
            self._drop(connection)
            return
        writing = bool(connection.output)
        if writing != connection.writing:  # watch for room to write only while there is something to write
            connection.writing = writing
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if writing else 0)
            self._selector.modify(connection.sock, events, connection)

    def _drop(self, connection: _Connection) -> None:
        if connection not in self._connections:
            return
        self._connections.discard(connection)
        for waiter in list(connection.waiters):
            self._table.unpark(waiter)
        connection.waiters.clear()
        try:
            self._selector.unregister(connection.sock)
        except (KeyError, ValueError):
            pass
        connection.sock.close()

    def _warn(self, message: str, **fields: Any) -> None:
        if self._log is not None:
            self._log.warning(message, **fields)


# --------------------------------------------------------------------------- the client


class EmbeddedStoreClient(Store):
    """A client of the store at `host`:`port`: connects at once (within `reconnect_seconds`, else
    StoreUnavailable), and again after a loss. `reply_seconds` bounds the wait for one reply (a `wait` gets its
    own timeout on top)."""

    def __init__(self, host: str, port: int, reconnect_seconds: float = 30.0, reply_seconds: float = 30.0):
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
            self._retrying(lambda: self._connection(), "connect")

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
        keys = [checked_key(key) for key in ([keys] if isinstance(keys, str) else keys)]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout):
            raise ValueError(f"a wait's timeout is a finite number of seconds, not {timeout!r}")
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

    def _retrying(self, action: Callable[[], Any], what: str) -> Any:
        """`action()`, done again on a new connection after each loss until `reconnect_seconds` from the first."""
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
                deadline = now + self._reconnect_seconds if deadline is None else deadline
                if now >= deadline:
                    raise StoreUnavailable(self.address, f"{what}: {_why(exc)} (for {self._reconnect_seconds:g} s)") \
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


def allow_addresses(addresses: Iterable[str]) -> Callable[[str], bool]:
    """An `allow` hook admitting exactly `addresses` (and loopback: worker-0's own runtime)."""
    allowed = frozenset(addresses) | {"127.0.0.1", "::1"}
    return lambda peer: peer in allowed or peer.startswith("::ffff:") and peer[7:] in allowed
