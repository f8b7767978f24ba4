"""The uploads of one cycle of a channel's sync, in the order that keeps checkpoints whole.

Owns the order within a cycle (the files that go up whole in a pool: small ones from memory, then those sent in
one PUT; the completion markers that are ready; the files that go in parts one at a time, each in parallel parts;
the markers ready then), the checkpoint-unit rule for markers (a marker goes up
only after every changed file of its unit did, deepest first; a unit with a file not yet whole, refused or
failed keeps its marker back), what each failure means (an outage ends the cycle, a refusal sets one file
aside, anything else is said once), every wait bounded by the deadline, and the cycle's `Result`. What is
uploaded, and how, is the channel's (engine.py `ChannelSync.upload`, `withdraw_markers`).
"""

import dataclasses
import threading
import time
from concurrent.futures import ALL_COMPLETED, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Dict, List, Optional, Set

from ma_runtime.storage.base import StorageError
from ma_runtime.storage.transfer import Calls
from ma_runtime.storage.transfer.upload import goes_in_parts
from ma_runtime.storage.transfer.utils import naming_the_store
from ma_runtime.sync.reading import SMALL_LIMIT, Later, Unreadable
from ma_runtime.sync.tree import Entry
from ma_runtime.sync.units import under

if TYPE_CHECKING:  # the channel drives its cycles; only its type is named here
    from ma_runtime.sync.engine import ChannelSync

# How long a periodic cycle retries one request: the next cycle is the real retry.
PERIODIC_RETRY_SECONDS = 10.0
AT_THE_STOP = "being written at the stop"
REFUSED = "refused by the store"


@dataclasses.dataclass
class Result:
    files: int = 0
    bytes: int = 0
    missing: List[str] = dataclasses.field(default_factory=list)  # relative paths not synced (a final sync)
    error: Optional[str] = None  # the failure that ended the cycle
    seconds: float = 0.0


class UploadCycle:
    """The uploads of one cycle: whole files in a pool, markers after their units, files in parts one at a time
    (each in parallel parts), every wait bounded by the deadline."""

    def __init__(self, sync: "ChannelSync", entries: Dict[str, Entry], result: Result, deadline: Optional[float],
                 stop: threading.Event, final: bool):
        self.sync = sync
        self.entries = entries
        self.result = result
        self.deadline = deadline
        self.stop = stop
        retry = max(0.5, deadline - time.monotonic()) if deadline is not None else PERIODIC_RETRY_SECONDS
        options = dataclasses.replace(sync.options, retry_seconds=min(sync.options.retry_seconds, retry)
                                      if not final else retry)
        self.calls = Calls(options, sync.log, stop)
        self.pending: Set[str] = set()
        self.held: Set[str] = set()  # not uploaded this cycle: not whole yet, changed while read, or failed
        self.unreadable: Set[str] = set()  # skipped, not missing; but no marker goes up beside one
        self.refused: Set[str] = set()  # set aside: the store refused them
        self.why: Dict[str, str] = {}  # why a file was held, when a reader should know
        self.units: Dict[str, str] = {}  # marker -> the folder it completes
        self.lock = threading.Lock()

    def all(self, ready: List[str]) -> None:
        markers = [r for r in ready if self.sync.is_marker(r)]
        plain = [r for r in ready if not self.sync.is_marker(r)]
        self.pending.update(ready)
        withdrawn = self.sync.withdraw_markers(plain, self) if plain else []
        if withdrawn is None:
            with self.lock:
                self.held.update(self.pending)
                self.pending.clear()
            return
        for marker in withdrawn:  # unchanged locally: published again, once its unit is whole, this cycle
            entry = self.entries.get(marker) or self.sync.entry_of(marker)
            if entry is not None and marker not in markers:
                self.entries[marker] = entry
                markers.append(marker)
                self.pending.add(marker)
        markers.sort(key=lambda r: -r.count("/"))  # deepest first
        # Small files from memory, smallest first, then the files sent in one PUT (sendfile: no memory held).
        in_parts = [r for r in plain if self._in_parts(self.entries[r].size)]
        whole = sorted(set(plain) - set(in_parts), key=lambda r: (self.entries[r].size >= SMALL_LIMIT,
                                                                   self.entries[r].size))
        self.units = {marker: self.sync.unit_of(marker) for marker in markers}
        workers = min(self.sync.options.workers, max(1, len(whole)))
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sync")
        try:
            self._each(pool, whole)
            markers = self._markers(pool, markers)
            for relative in in_parts:  # each in parallel parts already
                self._each(pool, [relative])
            self._markers(pool, markers)
        finally:
            pool.shutdown(wait=self.deadline is None, cancel_futures=True)

    def _in_parts(self, size: int) -> bool:
        """A file this big goes up in parts (engine.py sends a small one from memory, whatever the threshold)."""
        return size >= SMALL_LIMIT and goes_in_parts(size, self.sync.options)

    def _markers(self, pool, markers: List[str]) -> List[str]:
        """Uploads each marker whose unit is complete, deepest first; returns those still held back.

        The unit is every file under the folder the marker completes. Safety over liveness: a file still being
        written there holds the marker back, even one that is not part of the checkpoint (a metrics file
        appended beside a `*.done` holds it until the final sync; the README says so)."""
        waiting = []
        for marker in markers:
            unit = self.units[marker]
            with self.lock:
                blocked = any(r != marker and under(r, unit)
                              for r in (*self.pending, *self.held, *self.unreadable, *self.refused))
            if blocked:
                waiting.append(marker)
            else:
                self._each(pool, [marker])
        return waiting

    def _each(self, pool, relatives: List[str]) -> None:
        if not relatives:
            return
        if self.out_of_time():
            return
        futures = [pool.submit(self._one, relative) for relative in relatives]
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        done, _ = wait(futures, timeout=timeout, return_when=ALL_COMPLETED)
        if len(done) < len(futures):
            self.stop.set()  # the deadline: what is still pending stays missing

    def out_of_time(self) -> bool:
        return self.stop.is_set() or (self.deadline is not None and time.monotonic() >= self.deadline)

    def _one(self, relative: str) -> None:
        if self.out_of_time():
            return
        entry = self.entries[relative]
        try:
            sent = self.sync.upload(relative, entry, self.calls, self.stop)
        except Later:
            self._hold(relative)
            return
        except Unreadable as exc:
            self.sync.skipped(str(entry.path), f"cannot be read: {exc}")
            self._hold(relative, missing=False)
            with self.lock:
                self.unreadable.add(relative)
            return
        except StorageError as exc:
            if exc.refusal:
                self._refuse(relative, entry, exc)
            else:
                self.fail(relative, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a local failure (a full disk) must not vanish inside the pool
            self.sync.warn_once("sync failed for a file", relative, error=f"{type(exc).__name__}: {exc}")
            self._hold(relative)
            return
        with self.lock:
            self.pending.discard(relative)
            if relative in self.units:
                self.sync.published[relative] = self.units[relative]
            if sent is not None:  # a file only touched (same bytes) is recorded, not counted as uploaded
                self.result.files += 1
                self.result.bytes += sent

    def _refuse(self, relative: str, entry: Entry, exc: StorageError) -> None:
        """The store will not take this object: set it aside until it changes, and go on with the others."""
        self.sync.refused[relative] = entry.identity
        self.sync.warn_once("the store refused a file: set aside until it changes", relative,
                            error=str(naming_the_store(exc, self.sync.store, self.sync.location)))
        with self.lock:
            self.pending.discard(relative)
            self.refused.add(relative)
            self.why[relative] = REFUSED

    def _hold(self, relative: str, missing: bool = True) -> None:
        with self.lock:
            self.pending.discard(relative)
            if missing:
                self.held.add(relative)

    def fail(self, relative: str, exc: StorageError) -> None:
        self._hold(relative)
        named = naming_the_store(exc, self.sync.store, self.sync.location)  # the endpoint, once
        with self.lock:
            if self.result.error is None and not self.stop.is_set():
                self.result.error = str(named)
        self.stop.set()  # the endpoint refuses or is down: the next cycle tries again
