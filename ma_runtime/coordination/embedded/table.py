"""The embedded store's state, without I/O: keys, values, their expiry, the waits parked on keys, and each request
applied to it in the order the server received it."""

import base64
import binascii
import heapq
import math
from typing import Any, Dict, List, Optional, Set, Tuple

from ma_runtime.coordination.store import checked_key, checked_ttl

# --------------------------------------------------------------------------- the table (state, no I/O)


class _Entry:
    __slots__ = ("value", "expires")

    def __init__(self, value: bytes, expires: Optional[float]):
        self.value = value
        self.expires = expires


class Waiter:
    """A parked `wait`: the connection and request number to answer, the keys still missing."""

    __slots__ = ("reply_to", "number", "keys", "missing", "done")

    def __init__(self, reply_to: Any, number: Any, keys: Set[str], missing: Set[str]):
        self.reply_to = reply_to
        self.number = number
        self.keys = keys
        self.missing = missing
        self.done = False


class Table:
    """The keys, their expiry, the parked waits. Every method runs on the server's thread; `answered` collects
    the waits a call completed, (waiter, result), for the server to reply to."""

    def __init__(self, byte_limit: int):
        self.entries: Dict[str, _Entry] = {}
        self._bytes = 0
        self._byte_limit = byte_limit
        self._expiries: List[Tuple[float, str]] = []
        self._waiting: Dict[str, Set[Waiter]] = {}
        self._deadlines: List[Tuple[float, int, Waiter]] = []
        self._tick = 0  # orders deadlines that are equal
        self.answered: List[Tuple[Waiter, bool]] = []

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

    def park(self, waiter: Waiter, deadline: float) -> None:
        for key in waiter.keys:
            self._waiting.setdefault(key, set()).add(waiter)
        self._tick += 1
        heapq.heappush(self._deadlines, (deadline, self._tick, waiter))

    def unpark(self, waiter: Waiter) -> None:
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


class BadRequest(Exception):
    """A request that does not follow the protocol: its connection is closed."""


def text_field(request: Dict[str, Any], field: str) -> str:
    value = request.get(field)
    if not isinstance(value, str):
        raise BadRequest(f"{field} is not a text")
    try:
        return checked_key(value)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def _value(request: Dict[str, Any], field: str) -> Optional[bytes]:
    value = request.get(field)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest(f"{field} is not base64")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{field} is not base64") from None


def number_field(request: Dict[str, Any], field: str, kind: type = float) -> Any:
    value = request.get(field)
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise BadRequest(f"{field} is not a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"{field} is not a finite number")
    return value


def _ttl(request: Dict[str, Any]) -> Optional[float]:
    if request.get("ttl") is None:
        return None
    try:
        return checked_ttl(number_field(request, "ttl"))
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def _add(table: Table, key: str, amount: int, now: float) -> int:
    entry = table.live(key, now)
    try:
        total = (int(entry.value.decode("ascii")) if entry else 0) + amount
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"add: {key} does not hold an integer") from None
    remaining = None if entry is None or entry.expires is None else entry.expires - now
    table.write(key, str(total).encode("ascii"), remaining, now)
    return total


def _compare_and_set(table: Table, request: Dict[str, Any], now: float) -> bool:
    key = text_field(request, "k")
    entry = table.live(key, now)
    if (entry.value if entry else None) != _value(request, "x"):
        return False
    table.write(key, _value(request, "v") or b"", _ttl(request), now)
    return True


def apply(table: Table, request: Dict[str, Any], now: float) -> Any:
    """The result of one request other than `wait`; ValueError for one the store refuses."""
    op = request.get("op")
    if op == "set":
        table.write(text_field(request, "k"), _value(request, "v") or b"", _ttl(request), now)
        return None
    if op == "get":
        entry = table.live(text_field(request, "k"), now)
        return None if entry is None else base64.b64encode(entry.value).decode("ascii")
    if op == "add":
        return _add(table, text_field(request, "k"), number_field(request, "a", int), now)
    if op == "cas":
        return _compare_and_set(table, request, now)
    if op == "delete":
        return table.delete(text_field(request, "k"), now)
    if op == "keys":
        prefix = request.get("p", "")
        if not isinstance(prefix, str):
            raise BadRequest("p is not a text")
        return sorted(key for key in list(table.entries) if key.startswith(prefix) and table.live(key, now))
    raise BadRequest(f"unknown operation {str(op)[:40]!r}")
