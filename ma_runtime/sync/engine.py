"""One channel's sync: a local folder to a store URL, cycle after cycle, crash-consistent and incremental.

A cycle (`ChannelSync.cycle`):
1. scans the folder (tree.py) and keeps the files whose identity differs from what the manifest says was
   uploaded;
2. of those, takes the stable ones: the same identity as at the previous cycle's look (a file still being
   written is taken next cycle). At the final sync the command's processes are gone, so one look is enough;
   logs are append-only, so a growing log is taken as a snapshot of its current length (a prefix of what
   it will be, never a torn mix);
3. uploads them: small ones (< SMALL_LIMIT) read into memory once, checked unchanged after the read, and sent
   from those bytes with their MD5 (the object is exactly the bytes checked, whatever the file does next);
   large ones as a resumable multipart upload (transfer.Multipart) that is completed only when the file is
   still the one it started from;
4. uploads completion markers last: a folder holding a file whose name matches a marker pattern is a unit, and
   its marker goes up only after every other changed file under that folder did, deepest marker first. A unit
   with a file not yet stable, or one that failed, keeps its marker back: the store never shows a marker
   next to a checkpoint that is not all there.
Order within a cycle: small files, the markers that are ready, large files, the markers ready then.

The first storage failure ends a cycle (the endpoint is down or refuses us: trying the 9 999 other files
would only take longer); the next cycle tries again. With a deadline (the final sync), every wait ends by
it, and what was not confirmed uploaded is returned as missing.

Deletes are not propagated unless the channel says `delete: true`, and then only for files this sync
uploaded: an output folder's objects may be a pre-downloaded earlier run's checkpoints that the job rotated
away locally to save disk, and a sync must not turn a full local disk into lost checkpoints.
"""

import dataclasses
import fnmatch
import os
import stat
import threading
import time
from concurrent.futures import ALL_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set

from ma_runtime.storage import url as url_module
from ma_runtime.storage.base import FileChanged, StorageError
from ma_runtime.storage.transfer import (
    Calls,
    EitherStop,
    Multipart,
    TransferOptions,
    md5_of,
    name_digest,
    naming_the_store,
    new_md5,
    object_url,
    settle_uploads,
)
from ma_runtime.sync.manifest import Manifest, Record
from ma_runtime.sync.targets import Target
from ma_runtime.sync.tree import Entry, Skipped, scan

MiB = 1 << 20
# Read into memory and sent with its MD5 below this; bounds memory at workers x SMALL_LIMIT.
SMALL_LIMIT = 4 * MiB
# How long a periodic cycle retries one request: the next cycle is the real retry.
PERIODIC_RETRY_SECONDS = 10.0


@dataclasses.dataclass
class Result:
    files: int = 0
    bytes: int = 0
    missing: List[str] = dataclasses.field(default_factory=list)  # relative paths not synced (a final sync)
    error: Optional[str] = None  # the failure that ended the cycle
    seconds: float = 0.0


class _Later(Exception):
    """Not this cycle: the file changed while it was read, or is not what the scan saw."""


class _Unreadable(Exception):
    pass


class ChannelSync:
    def __init__(self, target: Target, store, options: TransferOptions, markers, log, state_dir: Path):
        self.target = target
        self.store = store
        self.log = log
        self.markers = tuple(markers)
        self.location = url_module.parse(target.url, f"output {target.name}")
        key = self.location.key
        self.prefix = key if (not key or key.endswith("/")) else key + "/"
        self.url_prefix = object_url(self.location, self.prefix)
        self.options = dataclasses.replace(options, state_dir=Path(state_dir) / "parts")
        self.manifest = Manifest.load(Path(state_dir) / f"{name_digest(target.url, target.root)}.manifest.json",
                                      target.url)
        self.seen: Dict[str, tuple] = {}  # the identity of each changed file at the last look
        self.walk_cpu = 0.0  # CPU seconds of the last cycle's walk of the folder
        self.skipped = Skipped(log.warning)
        self.lock = threading.Lock()  # the manifest, from the upload threads

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Once per uploader: forget what the store lost, and settle the multipart uploads a crash left."""
        try:
            listed = {info.key: info for info in self.store.list(self.location.bucket, self.prefix)}
            forgotten = self.manifest.keep_listed({key: info.etag for key, info in listed.items()}, self.key_of)
            if forgotten:
                self.log.info("objects missing or replaced in the store will be uploaded again", name=self.target.name,
                              files=forgotten)
            self._adopt(listed)
            aborted = settle_uploads(self.store, self.options.state_dir, self.url_prefix, self._still_same, self.log)
            if aborted:
                self.log.info("aborted unfinished uploads of files that changed", name=self.target.name,
                              uploads=aborted)
        except StorageError as exc:  # the first cycle will say it again; the manifest is trusted meanwhile
            self.log.warning(f"{self._kind} upload failed", name=self.target.name, url=self.target.url,
                             error=str(exc))

    def _adopt(self, listed) -> None:
        """Files already in the store byte for byte (a pre-downloaded output) are recorded, not uploaded again.
        Only an object whose ETag is its MD5 can be compared so; a multipart one is uploaded once more."""
        for relative, entry in scan(str(self.target.root), self.skipped).items():
            info = listed.get(self.key_of(relative))
            if self.manifest.get(relative) or info is None or info.size != entry.size or not info.md5:
                continue
            try:
                md5 = _md5_of_file(entry)
            except OSError:
                continue
            if md5 == info.md5:
                self.manifest.put(relative, Record(entry.identity, md5, info.etag))
        self._save_manifest()

    def key_of(self, relative: str) -> str:
        return self.prefix + relative

    # ------------------------------------------------------------------ a cycle

    def cycle(self, final: bool = False, deadline: Optional[float] = None, only: Optional[Callable[[str], bool]] = None,
              stop: Optional[threading.Event] = None) -> Result:
        started = time.monotonic()
        # The cycle's own stop (a failure ends this cycle), which the caller's (the final sync asked for) also sets.
        stop = EitherStop(stop) if stop is not None else threading.Event()
        present: Optional[Set[str]] = set() if self.target.delete and only is None else None
        walk_started = time.thread_time()
        entries = scan(str(self.target.root), self.skipped, self.manifest.files, present)  # changed files only
        self.walk_cpu = time.thread_time() - walk_started
        if only is not None:
            entries = {relative: entry for relative, entry in entries.items() if only(relative)}
        changed = list(entries)
        if final or self.target.is_log:
            ready = changed
        else:
            ready = [relative for relative in changed if self.seen.get(relative) == entries[relative].identity]
        self.seen = {relative: entries[relative].identity for relative in changed}
        result = Result()
        run = _Run(self, entries, result, deadline, stop, final)
        run.held.update(set(changed) - set(ready))
        if ready:
            run.all(ready)
        if present is not None:
            self._delete_vanished(present.union(entries), run)
        with self.lock:
            self._save_manifest()
        result.seconds = time.monotonic() - started
        with run.lock:  # after a deadline, upload threads may still be finishing
            result.missing = sorted(self._missing(run.held | run.pending)) if final else []
        self._report(result, final, whole=only is None)
        return result

    def _missing(self, relatives: Set[str]) -> List[str]:
        """What a final sync did not upload. A log with an earlier copy in the store is not missing: a log only
        grows, so the store has all of it but the last lines (the next sync of the same folder sends them)."""
        if not self.target.is_log:
            return list(relatives)
        return [relative for relative in relatives if self.manifest.get(relative) is None]

    def is_marker(self, relative: str) -> bool:
        name = relative.rpartition("/")[2]
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.markers)

    # ------------------------------------------------------------------ one file

    def upload(self, relative: str, entry: Entry, calls, stop: threading.Event) -> Optional[int]:
        """Uploads one file; returns the bytes sent, None when the store had them already (only the file's
        times changed). Raises _Later, _Unreadable or StorageError."""
        if entry.size < SMALL_LIMIT:
            return self._put_small(relative, entry, calls)
        return self._put_large(relative, entry, stop)

    def _put_small(self, relative: str, entry: Entry, calls) -> Optional[int]:
        data = self._read(entry)
        digest = new_md5()  # usedforsecurity=False: an integrity check, allowed on FIPS hosts
        digest.update(data)
        md5 = digest.hexdigest()
        record = self.manifest.get(relative)
        if record is not None and record.md5 == md5 and record.etag:
            self._record(relative, Record(entry.identity, md5, record.etag))  # touched, not changed
            return None
        info = calls(self.store.put_bytes, self.location.bucket, self.key_of(relative), data, md5)
        self._record(relative, Record(entry.identity, md5, info.etag))
        return len(data)

    def _read(self, entry: Entry) -> bytes:
        """The file's bytes as the scan saw it, or _Later. O_NONBLOCK: a FIFO put there since never blocks."""
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except PermissionError:
            raise _Unreadable("permission denied") from None
        except FileNotFoundError:
            raise _Later() from None
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode) or not self._same(entry, before):
                raise _Later()
            data = _read_exactly(fd, entry.size)
            if len(data) < entry.size or not self._same(entry, os.fstat(fd), after_read=True):
                raise _Later()
            return data
        except OSError as exc:
            raise _Unreadable(exc.strerror or str(exc)) from None
        finally:
            os.close(fd)

    def _same(self, entry: Entry, stats: os.stat_result, after_read: bool = False) -> bool:
        """Still the file the scan saw. A log may have grown (its first `size` bytes are what is sent)."""
        if stats.st_ino != entry.ino:
            return False
        if self.target.is_log:
            return stats.st_size >= entry.size
        return (stats.st_size, stats.st_mtime_ns) == (entry.size, entry.mtime_ns)

    def _put_large(self, relative: str, entry: Entry, stop: threading.Event) -> int:
        try:
            stats = os.stat(entry.path)
        except FileNotFoundError:
            raise _Later() from None
        if not self._same(entry, stats):
            raise _Later()
        url = object_url(self.location, self.key_of(relative))

        def unchanged() -> bool:
            try:
                return self._same(entry, os.stat(entry.path))
            except OSError:
                return False

        upload = Multipart(self.store, self.location.bucket, self.key_of(relative), url, Path(entry.path), stats,
                            self.options, self.log, size=entry.size, unchanged=unchanged, stop=stop, quiet=True)
        try:
            info = upload.run()
        except FileChanged:
            raise _Later() from None
        except PermissionError:
            raise _Unreadable("permission denied") from None
        self._record(relative, Record(entry.identity, None, info.etag))
        return entry.size

    def _still_same(self, record: dict) -> bool:
        """An unfinished upload's file is unchanged since it started: resume it rather than abort it."""
        try:
            stats = os.stat(record["path"])
        except (OSError, KeyError):
            return False
        return (stats.st_mtime_ns, stats.st_ino) == (record.get("mtime_ns"), record.get("ino")) and (
            stats.st_size == record.get("size") or (self.target.is_log and stats.st_size >= record.get("size", 0)))

    def _record(self, relative: str, record: Record) -> None:
        with self.lock:
            self.manifest.put(relative, record)
            self._save_manifest(force=False)

    def _save_manifest(self, force: bool = True) -> None:
        try:
            self.manifest.save(force)
        except OSError as exc:  # costs re-uploads after a restart, not the job
            self.log.warning("could not save the sync manifest", path=str(self.manifest.path), error=str(exc))

    # ------------------------------------------------------------------ deletes and events

    def _delete_vanished(self, present: Set[str], run: "_Run") -> None:
        calls = run.calls
        for relative in self.manifest.relatives():
            if run.out_of_time():
                return
            if relative in present or not _vanished(os.path.join(self.target.root, relative)):
                continue  # present (perhaps skipped, or in a folder we may not list): never deleted for that
            try:
                calls(self.store.delete, self.location.bucket, self.key_of(relative))
            except StorageError as exc:
                run.fail(relative, exc)
                return
            with self.lock:
                self.manifest.drop(relative)
            self.log.info("deleted from the store: removed locally", name=self.target.name, path=relative)

    @property
    def _kind(self) -> str:
        return "log" if self.target.is_log else "output"

    def _report(self, result: Result, final: bool, whole: bool) -> None:
        """The platform's event for each cycle that uploaded something, and at the end of a final sync that
        left nothing out, whatever it uploaded (the channel is then complete in the store)."""
        complete_at_the_end = final and whole and not result.missing and not result.error
        if result.files or complete_at_the_end:
            self.log.info(f"{self._kind} upload completed", name=self.target.name, elapsed_s=round(result.seconds, 3),
                          files=result.files, bytes=result.bytes, final=True if final else None)
        if result.error:
            self.log.warning(f"{self._kind} upload failed", name=self.target.name, url=self.target.url,
                             error=result.error, next=None if final else "retried next cycle")


class _Run:
    """The uploads of one cycle: small files in a pool, markers after their units, large files one at a time
    (each in parallel parts), every wait bounded by the deadline."""

    def __init__(self, sync: ChannelSync, entries: Dict[str, Entry], result: Result, deadline: Optional[float],
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
        self.held: Set[str] = set()  # not uploaded this cycle: not stable yet, changed while read, or failed
        self.unreadable: Set[str] = set()  # skipped, not missing; but no marker goes up beside one
        self.lock = threading.Lock()

    def all(self, ready: List[str]) -> None:
        markers = sorted((r for r in ready if self.sync.is_marker(r)), key=lambda r: -r.count("/"))
        plain = [r for r in ready if not self.sync.is_marker(r)]
        small = sorted((r for r in plain if self.entries[r].size < SMALL_LIMIT), key=lambda r: self.entries[r].size)
        large = [r for r in plain if self.entries[r].size >= SMALL_LIMIT]
        self.pending.update(ready)
        workers = min(self.sync.options.workers, max(1, len(small)))
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sync")
        try:
            self._each(pool, small)
            markers = self._markers(pool, markers)
            for relative in large:  # each in parallel parts already
                self._each(pool, [relative])
            self._markers(pool, markers)
        finally:
            pool.shutdown(wait=self.deadline is None, cancel_futures=True)

    def _markers(self, pool, markers: List[str]) -> List[str]:
        """Uploads each marker whose unit is complete, deepest first; returns those still held back.

        The unit is every file under the marker's folder. Safety over liveness: a file still being written
        there holds the marker back, even one that is not part of the checkpoint (a metrics file appended
        beside `latest_checkpointed_iteration.txt` holds it until the final sync; the README says so)."""
        waiting = []
        for marker in markers:
            folder = marker.rpartition("/")[0]
            with self.lock:
                blocked = any(r != marker and (not folder or r.startswith(folder + "/"))
                              for r in (*self.pending, *self.held, *self.unreadable))
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
        except _Later:
            self._hold(relative)
            return
        except _Unreadable as exc:
            self.sync.skipped(str(entry.path), f"cannot be read: {exc}")
            self._hold(relative, missing=False)
            with self.lock:
                self.unreadable.add(relative)
            return
        except StorageError as exc:
            self.fail(relative, exc)
            return
        with self.lock:
            self.pending.discard(relative)
            if sent is not None:  # a file only touched (same bytes) is recorded, not counted as uploaded
                self.result.files += 1
                self.result.bytes += sent

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


def _md5_of_file(entry: Entry) -> str:
    fd = os.open(entry.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO swapped in never blocks
    try:
        return md5_of(fd, entry.size)
    finally:
        os.close(fd)


def _vanished(path: str) -> bool:
    """Only a file certainly gone: a folder we may not search (EACCES) hides a file, it does not remove it."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return False


def _read_exactly(fd: int, size: int) -> bytes:
    """`size` bytes from the start, fewer only at an early end of file."""
    chunks = []
    offset = 0
    while offset < size:
        chunk = os.pread(fd, size - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
