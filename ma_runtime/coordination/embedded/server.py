"""The embedded store's server: one thread, one `selectors` loop, the allow hook (the package's docstring says
how it works and whom it trusts)."""

import collections
import selectors
import socket
import threading
import time
from typing import Any, Callable, Dict, Iterable, Optional, Set, Tuple

from ma_runtime.coordination.embedded.frames import (
    FRAME_LIMIT,
    OUTPUT_LIMIT,
    FrameError,
    FrameReader,
    address_text,
    encode_frame,
)
from ma_runtime.coordination.embedded.table import BadRequest, Table, Waiter, apply, number_field, text_field

BYTE_LIMIT = 64 << 20  # every key and value together, by default: the job's state is small
_SESSIONS_KEPT = 65536  # the last write reply of this many client sessions (a job has at most a few thousand)
_LONGEST_WAIT = 7 * 86400.0  # seconds: a longer wait's deadline is this one's (selectors take no infinity)
_WRITES = frozenset({"set", "add", "cas", "delete"})  # the requests whose replies a resend must get again
ACCEPT_PAUSE = 0.5  # seconds the listener rests after accept() failed (out of descriptors), unless one is freed

# --------------------------------------------------------------------------- the server


class _Connection:
    __slots__ = ("sock", "peer", "reader", "output", "waiters", "writing")

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer
        self.reader = FrameReader()
        self.output = bytearray()
        self.waiters: Set[Waiter] = set()
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
        self._table = Table(byte_limit)
        self._replies: collections.OrderedDict[str, Tuple[Any, Dict[str, Any]]] = collections.OrderedDict()
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_reader, selectors.EVENT_READ, "wake")
        self._connections: Set[_Connection] = set()
        self._closing = False
        self._released = False
        self._accept_again: Optional[float] = None  # while accept() rests: when to try again (monotonic)
        self._accept_failed = False  # a failed accept is said once, until one succeeds again
        self._thread = threading.Thread(target=self._serve, name="ma-runtime-store", daemon=True)

    def connections(self) -> int:
        """How many clients are connected now (read from any thread: the size of a set)."""
        return len(self._connections)

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
                due = [moment for moment in (self._table.next_due(), self._accept_again) if moment is not None]
                timeout = max(min(due) - time.monotonic(), 0.0) if due else None
                for selected, events in self._selector.select(timeout):
                    self._dispatch(selected, events)
                self._table.run_due(time.monotonic())
                if self._accept_again is not None and time.monotonic() >= self._accept_again:
                    self._listen_again()
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
            except OSError as exc:  # out of descriptors, say: the peer waits in the backlog
                self._rest_listener(exc)
                return
            self._accept_failed = False
            if self._allow is not None and not self._allow(peer[0]):
                sock.close()  # before reading a byte
                self._warn("the store refused a peer that is not one of the job's nodes", peer=peer[0])
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = _Connection(sock, peer[0])
            self._connections.add(connection)
            self._selector.register(sock, selectors.EVENT_READ, connection)

    def _rest_listener(self, exc: OSError) -> None:
        """accept() failed: the pending peer stays readable on the listener, so watching it would spin. The
        listener rests until a connection closes (a descriptor freed) or ACCEPT_PAUSE passes."""
        if not self._accept_failed:
            self._accept_failed = True
            self._warn("the store could not accept a connection", error=str(exc))
        if self._accept_again is None:
            self._selector.unregister(self._listener)
        self._accept_again = time.monotonic() + ACCEPT_PAUSE

    def _listen_again(self) -> None:
        if self._accept_again is not None:
            self._accept_again = None
            self._selector.register(self._listener, selectors.EVENT_READ, None)

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
        except (FrameError, BadRequest) as exc:
            self._warn("the store closed a connection that broke its protocol", peer=connection.peer, why=str(exc))
            self._drop(connection)
            return
        self._send_answers()

    def _handle(self, connection: _Connection, request: Dict[str, Any]) -> None:
        number, session = request.get("n"), request.get("s")
        if not isinstance(session, str) or len(session) > 64:
            raise BadRequest("s is not a session")
        if request.get("op") == "wait":
            self._park(connection, request, number)
            return
        kept = self._replies.get(session) if request.get("op") in _WRITES else None
        if kept is not None and kept[0] == number:  # a resend after a lost connection: applied already
            self._reply(connection, kept[1])
            return
        try:
            reply = {"n": number, "r": apply(self._table, request, time.monotonic())}
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
            raise BadRequest("ks is not a list of keys")
        wanted = {text_field({"k": key}, "k") for key in keys}
        timeout = min(number_field(request, "t"), _LONGEST_WAIT)
        now = time.monotonic()
        missing = {key for key in wanted if self._table.live(key, now) is None}
        if not missing or timeout <= 0:
            self._reply(connection, {"n": number, "r": not missing})
            return
        waiter = Waiter(connection, number, wanted, missing)
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
        if not self._closing:
            self._listen_again()  # a descriptor is free: a peer waiting in the backlog can be accepted

    def _warn(self, message: str, **fields: Any) -> None:
        if self._log is not None:
            self._log.warning(message, **fields)




def allow_addresses(addresses: Iterable[str]) -> Callable[[str], bool]:
    """An `allow` hook admitting exactly `addresses` (and loopback: worker-0's own runtime)."""
    allowed = frozenset(addresses) | {"127.0.0.1", "::1"}
    return lambda peer: peer in allowed or peer.startswith("::ffff:") and peer[7:] in allowed
