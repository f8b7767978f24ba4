"""The coordination store's interface: what every backend (the embedded store worker-0 hosts, an etcd) promises.

The semantics are those the anchors rely on (torch c10d's TCPStore, etcd's KV API):
  set(key, value, ttl)        write; with `ttl` seconds the key disappears unless written again before then
  get(key)                    the value, or None (absent or expired)
  add(key, amount)            atomic counter (the value is the decimal integer's ASCII bytes); returns the new value
  compare_and_set(key, expected, value, ttl)
                              write only if the current value is `expected` (None: only if the key is absent);
                              True when written. Exactly one of several racing writers wins.
  wait(keys, timeout)         True once every key exists, False at the deadline; the server parks the request (no
                              polling), so a set by any client releases it
  delete(key), keys(prefix), close()

Keys are text (at most KEY_LIMIT bytes of UTF-8), values bytes. A key with a time to live is a heartbeat: the
node refreshes it with another `set(..., ttl=...)`; one that stops refreshing is gone once the ttl passes, by the
store's clock alone, so clock skew between the nodes never matters. A `set` without ttl makes the key permanent
again.

Order, by the store's receive time. A backend applies operations one at a time in the order it receives them (the
embedded server on its one thread, etcd through its raft log): every operation is linearizable. So "the first
failure by the store's clock" is `compare_and_set("attempt/3/origin", None, record)`: the first writer the store
received wins, whatever the nodes' clocks say, and every later one reads the winner with `get`. To order many
events (the failures after the origin), take a stamp with `add("attempt/3/seq", 1)`: the numbers follow the
store's receive order. Keys carry the attempt in their name (a stale round's keys are never the current one's).

Every backend raises StoreUnavailable, one line naming host:port, when the store cannot be reached within the
client's reconnect deadline or the client was closed; ValueError for a request the store refuses (a value over
its limit, `add` on a key that does not hold an integer).
"""

import abc
import math
from typing import List, Optional, Sequence

KEY_LIMIT = 1024  # bytes of UTF-8; the job's keys are short paths ("attempt/3/joined/12")


class StoreUnavailable(Exception):
    """The store could not be reached (refused, lost, timed out) or the client was closed. `str()` is one line
    naming the store's address."""

    def __init__(self, address: str, why: str):
        super().__init__(f"coordination store {address} unavailable: {why}")
        self.address = address
        self.why = why


class Store(abc.ABC):
    """One client of the job's store. A client runs one request at a time (a thread blocked in `wait` holds
    it): a runtime that heart-beats while it waits uses a client per thread, as with TCPStore."""

    @abc.abstractmethod
    def set(self, key: str, value: bytes, ttl: Optional[float] = None) -> None:
        """Writes `value`; with `ttl` (seconds, > 0) the key disappears that long after this write."""

    @abc.abstractmethod
    def get(self, key: str) -> Optional[bytes]:
        """The value, or None when the key is absent or expired."""

    @abc.abstractmethod
    def add(self, key: str, amount: int = 1) -> int:
        """Adds `amount` to the integer at `key` (0 when absent) atomically; returns the sum. The key keeps its
        time to live, if any."""

    @abc.abstractmethod
    def compare_and_set(self, key: str, expected: Optional[bytes], value: bytes, ttl: Optional[float] = None) -> bool:
        """Writes `value` only if the key holds `expected` (None: only if it is absent); True when written."""

    @abc.abstractmethod
    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        """True once every one of `keys` exists (all at one moment), False when `timeout` seconds pass first."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Removes the key; True when it existed."""

    @abc.abstractmethod
    def keys(self, prefix: str = "") -> List[str]:
        """The live keys that start with `prefix`, sorted."""

    @abc.abstractmethod
    def close(self) -> None:
        """Closes the client (never the store); any later call raises StoreUnavailable. Idempotent."""

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


def checked_key(key: str) -> str:
    """`key` when it is a non-empty text of at most KEY_LIMIT bytes, else ValueError."""
    if not isinstance(key, str) or not key or len(key.encode("utf-8", "surrogatepass")) > KEY_LIMIT:
        raise ValueError(f"a store key is a non-empty text of at most {KEY_LIMIT} bytes, not {key!r:.80}")
    return key


def checked_wait(keys: Sequence[str], timeout: float) -> List[str]:
    """The keys of a `wait` (one key alone is a list of one), each checked, when `timeout` is a finite number of
    seconds; else ValueError."""
    keys = [checked_key(key) for key in ([keys] if isinstance(keys, str) else keys)]
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout):
        raise ValueError(f"a wait's timeout is a finite number of seconds, not {timeout!r}")
    return keys


def checked_ttl(ttl: Optional[float]) -> Optional[float]:
    """`ttl` when it is None or a positive number of seconds, else ValueError."""
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0
                            or not math.isfinite(ttl)):
        raise ValueError(f"a time to live is a positive, finite number of seconds, not {ttl!r}")
    return ttl
