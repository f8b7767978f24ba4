"""The transfer engine: parallel, resumable, verified, atomic downloads and uploads over any ObjectStore.

Downloads run on one bounded pool. Small objects go whole; large ones go as
ranged parts written with `pwrite` into ONE preallocated partial file, renamed
into place when complete, so there is no second copy at the end (the OBS SDK's
downloadFile copies its .tmp file over).

Partial files live where no key can reach them: `<state_dir>/partial/`, outside
the target tree, when that is on the destination's filesystem and mount (the
rename must not cross either); otherwise `<destination root>/.ma-runtime-partial/`,
a name every key is refused from producing (safety.py), removed once empty. A partial file is
named by a digest of its target path: a fixed length, whatever the key, and no
key's file can ever be another key's partial file. Before the rename, the file
is checked by its descriptor: the path about to be renamed must still be that
very file (same inode), and its size, and its MD5 when the ETag is one, are
read back from it, not taken from the bytes as they were sent: what is renamed
into place is what was verified. Every read names the version listed (its ETag):
an object replaced mid-download fails with ObjectChanged instead of giving a
file made of two versions.

State lives in `options.state_dir`, outside the target tree:
- `<id>.download.json` per large object: the parts already on disk, so a rerun
  fetches only the missing ones (a large object that failed before its first part
  leaves neither record nor partial file);
- `<id>.journal` per download: the ETag each finished file came from, so a
  rerun skips files already there unless the object changed;
- `<id>.upload.json` per multipart upload: its upload id and finished parts.
Every one is written through files.py: atomically, and never over something that
is not a regular file.

Every store call is retried on TransientError for `retry_seconds` (tenacity,
imported only when a transfer starts: its ~30 ms belong to jobs that transfer).
The budget is a deadline: no backoff wait runs past it. Failures name the store
(its endpoint) once, at the engine's edge.
"""

import dataclasses
import errno
import io
import json
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ma_runtime import records
from ma_runtime.files import NotAFile, kind_of, open_append, write_atomically
from ma_runtime.storage import safety
from ma_runtime.storage.base import CorruptTransfer, FileChanged, NotFound, ObjectInfo, StorageError, TransientError
from ma_runtime.storage.progress import MB, Progress
from ma_runtime.storage.url import Location

MiB = 1 << 20
PARTIAL_SUFFIX = ".ma-partial"
# The staging folder at a destination's root, when a rename from `<state_dir>/partial` cannot reach it.
STAGING_NAME = ".ma-runtime-partial"
HASH_CHUNK = 4 * MiB
# Parts shrink towards this to keep every worker busy on a mid-sized object, never below it.
MIN_PART = 8 * MiB
JOURNAL_BATCH = 256  # journal lines written at a time
# S3's multipart limits (OBS's are looser): parts of at least 5 MiB but the last, at most 10 000 parts.
MIN_UPLOAD_PART = 5 * MiB
MAX_UPLOAD_PARTS = 10_000


@dataclasses.dataclass(frozen=True)
class TransferOptions:
    workers: int = 16
    part_size: int = 32 << 20
    large_threshold: int = 64 << 20
    retry_seconds: float = 120.0
    progress_seconds: float = 10.0
    state_dir: Path = Path(os.environ.get("TMPDIR") or "/tmp") / "ma-runtime-transfers"

    @classmethod
    def from_spec(cls, spec, state_dir: Path) -> "TransferOptions":
        return cls(
            workers=spec.storage_workers,
            part_size=int(spec.storage_part_mb * MiB),
            large_threshold=int(spec.storage_large_mb * MiB),
            retry_seconds=spec.storage_retry_seconds,
            progress_seconds=spec.storage_progress_seconds,
            state_dir=Path(state_dir),
        )


@dataclasses.dataclass
class Summary:
    files: int  # fetched by this run
    bytes: int  # moved by this run (a resumed file counts only its missing parts)
    skipped: int  # already at their final path, unchanged
    refused: List[str]  # keys that were not written: outside the destination, unsafe, or in the way of others
    seconds: float
    path: Optional[Path] = None  # the file or folder written


@dataclasses.dataclass(frozen=True)
class _Item:
    """One object to fetch and the file it becomes."""

    info: ObjectInfo
    url: str
    target: Path


# --------------------------------------------------------------------------- retries


class Calls:
    """Calls into the store, each retried on TransientError; `stop` cuts the retrying short."""

    def __init__(self, options: TransferOptions, log, stop: Optional[threading.Event] = None):
        import tenacity  # here, not at the top: only a transfer pays for it (start-up budget)

        self._tenacity = tenacity
        try:
            self._wait = tenacity.wait_exponential_jitter(multiplier=0.2, max=5)
        except TypeError:  # tenacity < 9.2 calls it `initial` (a name 9.2 deprecates)
            self._wait = tenacity.wait_exponential_jitter(initial=0.2, max=5)
        self.seconds = options.retry_seconds
        self.log = log
        self.stop = stop or threading.Event()

    def __call__(self, function, *args):
        # Most calls succeed at once: only a failed one pays for building a Retrying (that was
        # ~12 % of the CPU of a small file's download when every call built one).
        started = time.monotonic()
        try:
            return function(*args)
        except TransientError as exc:
            if self.stop.is_set():
                raise
            return self._retry(function, args, exc, started)

    def _retry(self, function, args, first_failure: TransientError, started: float):
        t = self._tenacity
        failures = [first_failure]
        # The deadline counts from the first attempt, which may itself have taken a timeout's length.
        deadline = started + self.seconds

        def attempt():  # attempt 1 is the call that already failed: tenacity logs it and waits first
            if failures:
                raise failures.pop()
            return function(*args)

        def wait(state) -> float:  # the backoff, cut so that the last wait ends at the deadline, not after
            return min(self._wait(state), max(0.0, deadline - time.monotonic()))

        retrying = t.Retrying(
            retry=t.retry_if_exception_type(TransientError),
            wait=wait,
            stop=lambda state: time.monotonic() >= deadline or self.stop.is_set(),
            sleep=self.stop.wait,  # a wait that ends as soon as the transfer as a whole has failed
            before_sleep=self._log_retry,
            reraise=True,
        )
        try:
            return retrying(attempt)
        except TransientError as exc:
            if self.stop.is_set():
                raise
            attempts = retrying.statistics.get("attempt_number", 1)
            seconds = time.monotonic() - started
            raise TransientError(f"{exc.reason} (failed {attempts} times in {seconds:.1f} s)", hint=exc.hint) from exc

    def _log_retry(self, state) -> None:
        self.log.warning(
            "storage request failed, retrying", error=str(state.outcome.exception()),
            attempt=state.attempt_number, wait_seconds=round(state.next_action.sleep, 2),
        )


# --------------------------------------------------------------------------- download


def download(store, location: Location, dest: Path, options: TransferOptions, log,
             into_folder: bool = False, select: Optional[Callable[[List[ObjectInfo], str], List[ObjectInfo]]] = None
             ) -> Summary:
    """Fetches an object to the file `dest` (into the folder `dest`, under its own name, with `into_folder`),
    or every object under a prefix into the folder `dest`; `select(listed, prefix)`, for a prefix: the objects
    of its listing to fetch (the others are neither fetched nor counted)."""
    started = time.monotonic()
    dest = Path(dest).absolute()
    calls = Calls(options, log)
    try:
        objects, prefix = _find(store, location, calls)
        if prefix is None and into_folder:
            dest = dest / location.last_part
        root = dest.parent if prefix is None else dest
        root.mkdir(parents=True, exist_ok=True)
        options.state_dir.mkdir(parents=True, exist_ok=True)
        staging = _Staging(options.state_dir, root)
        try:
            if prefix is None:
                items, refused = _plan_object(objects[0], location, dest, staging)
            else:
                items, refused = _plan_tree(objects, prefix, dest, location, staging, log, select)
            moved, todo = _fetch(store, location, dest, options, items, refused, staging, log)
        finally:
            staging.close()
    except StorageError as exc:
        raise naming_the_store(exc, store, location) from exc
    except OSError as exc:  # the local side: disk full, permissions, a file where a folder must be
        raise StorageError(f"{location.text} -> {dest}: {_oserror_text(exc)}") from exc
    seconds = time.monotonic() - started
    summary = Summary(len(todo), moved, len(items) - len(todo), refused, round(seconds, 3), dest)
    log.info("download completed", url=location.text, dest=str(dest), files=summary.files, bytes=moved,
             skipped=summary.skipped, refused=len(refused), seconds=summary.seconds,
             rate_mb_s=round(moved / MB / max(seconds, 1e-6), 1))
    return summary


def _fetch(store, location: Location, dest: Path, options: TransferOptions, items: List[_Item], refused: List[str],
           staging: "_Staging", log) -> Tuple[int, List[_Item]]:
    """(bytes moved, items fetched): the items not already in place, on one pool."""
    journal = _Journal(options.state_dir / f"{name_digest(location.text, dest)}.journal", log)
    todo = [item for item in items if not _already_there(item, journal)]
    log.info("download started", url=location.text, dest=str(dest), files=len(todo),
             bytes=sum(item.info.size for item in todo), skipped=len(items) - len(todo), refused=len(refused))
    try:
        moved = _Fetcher(store, location, options, journal, staging, log).run(todo)
    finally:
        journal.close()
    journal.compact({item.info.key for item in items})
    return moved, todo


def naming_the_store(exc: StorageError, store, location: Location) -> StorageError:
    """The same failure, its message naming the store it talked to (the endpoint), once."""
    if not location.remote:
        return exc
    where = store.describe()
    if where in exc.reason:
        return exc
    return type(exc)(f"{exc.reason}; {where}", hint=exc.hint, stage=exc.stage)


def _find(store, location: Location, calls: Calls) -> Tuple[List[ObjectInfo], Optional[str]]:
    """The objects to fetch and the prefix they sit under (None for a single object)."""
    if not location.is_prefix:
        try:
            return [calls(store.head, location.bucket, location.key)], None
        except NotFound:
            pass  # perhaps a folder written without its trailing slash
    prefix = location.key if location.is_prefix else location.key + "/"
    # A generator cannot be retried half-way, so the listing is retried whole.
    objects = calls(lambda: list(store.list(location.bucket, prefix)))
    if not objects:
        raise NotFound(f"{location.text}: no such object or prefix", hint="check the URL, and that the data is there")
    return objects, prefix


def _plan_object(info: ObjectInfo, location: Location, dest: Path,
                 staging: "_Staging") -> Tuple[List[_Item], List[str]]:
    """The single object's item; refused (and the download failed) when something other than a file,
    or the engine's own files, sit at `dest`."""
    destination = safety.Destination(staging.root.resolve(), staging.reserved)
    path, reason = destination.place(dest.name)
    if reason:
        raise StorageError(f"{location.text} -> {dest}: {reason}", hint="remove what is in the way, or choose "
                           "another path")
    return [_Item(info, object_url(location, info.key), destination.dest_real / path)], []


def _plan_tree(objects, prefix: str, dest: Path, location: Location, staging: "_Staging",
               log, select=None) -> Tuple[List[_Item], List[str]]:
    """Files to fetch under `dest`, and the keys refused; makes the folders (markers and parents)."""
    if select is not None:
        objects = select(list(objects), prefix)
    destination = safety.Destination(dest.resolve(), staging.reserved)
    files: List[Tuple[ObjectInfo, str]] = []
    folders: List[str] = []
    refused: List[str] = []
    for info in objects:
        relative = info.key[len(prefix):]
        is_folder = info.key.endswith("/")
        if is_folder and not safety.normalized(relative):
            continue  # the prefix's own marker
        # The path as resolved: two keys that reach one file through a symlink are one path here.
        path, reason = destination.place(relative, folder=is_folder)
        if reason:
            _refuse(log, refused, location, info.key, reason)
        elif is_folder:
            folders.append(path)
        else:
            files.append((info, path))
    items = []
    for (info, path), reason in zip(files, safety.conflicts([path for _, path in files], folders)):
        if reason:
            _refuse(log, refused, location, info.key, reason)
        else:
            items.append(_Item(info, object_url(location, info.key), destination.dest_real / path))
    _make_folders(destination.dest_real, folders, items)
    return items, refused


def _refuse(log, refused: List[str], location: Location, key: str, reason: str) -> None:
    log.warning("download refused a key", url=location.text, key=key, reason=reason)
    refused.append(key)


def _make_folders(dest: Path, folders: List[str], items: List[_Item]) -> None:
    needed = {dest} | {dest / folder for folder in folders} | {item.target.parent for item in items}
    for folder in sorted(needed):  # parents sort before their children
        folder.mkdir(parents=True, exist_ok=True)


def _already_there(item: _Item, journal: "_Journal") -> bool:
    """The right size at the final path, and not written from another version of the object."""
    try:
        stats = os.stat(item.target)
    except OSError:
        return False
    if not stat.S_ISREG(stats.st_mode) or stats.st_size != item.info.size:
        return False
    known, etag = journal.lookup(item.info.key)
    return not known or etag == item.info.etag


class _Staging:
    """The folder partial files are written in: on the destination's filesystem, where no key can reach."""

    def __init__(self, state_dir: Path, root: Path):
        self.root = root
        outside = state_dir / "partial"
        inside = root / STAGING_NAME
        _make_private_folder(outside)
        self.in_tree = not _rename_works_between(outside, root)
        self.folder = inside if self.in_tree else outside
        if self.in_tree:
            _make_private_folder(inside)
        # What keys may never name, wherever they resolve to: both folders, and the records.
        self.reserved = (state_dir.resolve(), root.resolve() / STAGING_NAME)

    def path(self, target: Path) -> str:
        """The partial file of `target`: named by a digest of its path, a fixed length whatever the key."""
        return os.path.join(self.folder, name_digest(str(target)) + PARTIAL_SUFFIX)

    def close(self) -> None:
        """The in-tree folder goes once empty; what a resumable large file left stays for the rerun."""
        if self.in_tree:
            try:
                os.rmdir(self.folder)
            except OSError:
                pass


def _rename_works_between(one: Path, other: Path) -> bool:
    """Same filesystem and same mount: two bind mounts of one filesystem (two Kubernetes emptyDirs) share
    st_dev, yet a rename between them fails with EXDEV."""
    if os.stat(one).st_dev != os.stat(other).st_dev:
        return False
    mounts = _mount_points()
    return mounts is None or _mount_of(os.path.realpath(one), mounts) == _mount_of(os.path.realpath(other), mounts)


def _mount_points() -> Optional[List[Tuple[str, str]]]:
    """(mount id, mount point) of this process's mounts, in mount order; None where /proc says nothing."""
    try:
        with open("/proc/self/mountinfo", "rb") as mountinfo:
            lines = mountinfo.read().splitlines()
    except OSError:
        return None
    mounts = []
    for line in lines:
        fields = line.split(b" ")
        if len(fields) > 4:  # "id parent major:minor root mount-point ...", with octal escapes (\040 a space)
            point = re.sub(rb"\\([0-7]{3})", lambda escape: bytes([int(escape.group(1), 8)]), fields[4])
            mounts.append((fields[0].decode("ascii", "replace"), os.fsdecode(point)))
    return mounts


def _mount_of(path: str, mounts: List[Tuple[str, str]]) -> Optional[str]:
    """The mount `path` is on: the deepest mount point above it, the last one mounted there."""
    found, depth = None, -1
    for mount_id, point in mounts:
        inside = point == "/" or path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= depth:
            found, depth = mount_id, len(point)
    return found


def _make_private_folder(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    mode = os.lstat(folder).st_mode
    if not stat.S_ISDIR(mode):  # a symlink planted there would take the partial files elsewhere
        raise NotAFile(folder, "a symlink" if stat.S_ISLNK(mode) else kind_of(mode))


class _Fetcher:
    """Fetches items on one bounded pool: small ones whole, large ones as ranged parts."""

    def __init__(self, store, location: Location, options: TransferOptions, journal: "_Journal",
                 staging: _Staging, log):
        self.store = store
        self.location = location
        self.bucket = location.bucket
        self.options = options
        self.journal = journal
        self.staging = staging
        self.log = log
        self.calls = Calls(options, log)
        self.progress: Optional[Progress] = None
        self.pool = None

    def run(self, items: List[_Item]) -> int:
        """Returns the bytes moved; raises the first failure once the work in flight has stopped."""
        if not items:
            return 0
        from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

        self.progress = Progress("download", self.log, len(items), sum(i.info.size for i in items),
                                 self.options.progress_seconds, url=self.location.text)
        threshold = self.options.large_threshold
        large_files = [_LargeFile(self, item) for item in items if item.info.size >= threshold]
        self.pool = ThreadPoolExecutor(max_workers=self.options.workers, thread_name_prefix="download")
        self.progress.start()
        try:
            # Large files first: their parts are the long pole, small files fill the gaps at the end.
            outcomes = [large.start() for large in large_files]
            outcomes += [self.pool.submit(self._fetch_small, item) for item in items if item.info.size < threshold]
            done, _ = wait(outcomes, return_when=FIRST_EXCEPTION)
            for outcome in done:
                if outcome.exception() is not None:
                    raise outcome.exception()
        finally:
            self.calls.stop.set()  # on failure: end the retries still sleeping in other workers
            self.pool.shutdown(wait=True, cancel_futures=True)
            for large in large_files:
                large.close()
                large.discard_if_unfinished()
            self.progress.stop()
        return self.progress.bytes_done

    def _fetch_small(self, item: _Item) -> None:
        # The hot path of many small files. Each syscall is a GIL hand-off among the workers, and
        # those hand-offs, not the bytes, are what small files cost: open, write, then the checks
        # of what is renamed (fstat, lstat, and one pread for the MD5), rename, close.
        target = str(item.target)
        partial = self.staging.path(item.target)
        problem: Optional[Tuple[str, str]] = None
        for attempt in (1, 2):
            fd = _open_fresh(partial)
            placed = False
            try:
                written = self.calls(self._read_whole, item, fd)
                problem = _verify(fd, partial, item)
                if problem is None:
                    os.replace(partial, target)
                    placed = True
            finally:
                os.close(fd)
                if not placed:
                    _remove(partial)
            if placed:
                self.finished(item, written)
                return
            self.progress.add(written)
            if attempt == 1:
                self.log_refetch(item, problem)
        raise _corrupt(item, problem)

    def _read_whole(self, item: _Item, fd: int) -> int:
        """The bytes written; a retry starts afresh at offset 0."""
        if item.info.size == 0:
            return 0  # a zero-length range cannot be asked for
        return self.store.read_range(self.bucket, item.info.key, 0, item.info.size, fd, 0, etag=item.info.etag,
                                     whole=True)

    def finished(self, item: _Item, nbytes: int = 0) -> None:
        self.journal.add(item.info.key, item.info.etag)
        self.progress.add(nbytes, files=1)

    def log_refetch(self, item: _Item, problem: Tuple[str, str]) -> None:
        self.log.warning("download verification failed, fetching again", url=item.url, problem=problem[0],
                         detail=problem[1])
        self.progress.adjust_total(item.info.size)


def _corrupt(item: _Item, problem: Tuple[str, str]) -> CorruptTransfer:
    return CorruptTransfer(f"{item.url}: {problem[0]} after retry ({problem[1]})",
                           hint="the bytes received differed from the object twice: check the network path "
                                "(proxies) and the object")


class _LargeFile:
    """One large object fetched as ranged parts into a preallocated partial file, resumable by its record."""

    def __init__(self, fetcher: _Fetcher, item: _Item):
        from concurrent.futures import Future

        self.fetcher = fetcher
        self.item = item
        self.part_size = _part_size(fetcher.options, item.info.size)
        self.parts = -(-item.info.size // self.part_size)
        self.hasher: Optional[_InOrderHash] = None
        self.partial = fetcher.staging.path(item.target)
        self.record_path = fetcher.options.state_dir / f"{name_digest(item.url, item.target)}.download.json"
        self.outcome = Future()
        self.lock = threading.Lock()
        self.fd: Optional[int] = None
        self.done: Set[int] = set()
        self.retried = False
        self.placed = False

    def start(self):
        """Submits the missing parts; returns a Future that settles when the file is in place (or failed)."""
        if not self._resume():
            self._begin()
        self.fetcher.progress.adjust_total(-sum(self._length(index) for index in self.done))
        self._start_hasher()
        self._submit_missing()
        return self.outcome

    def _start_hasher(self) -> None:
        """MD5 in part order while later parts download: no serial pass over the file at the end. It reads
        the parts back from the file, so it checks what is on disk, not what was sent."""
        if not self.item.info.md5:
            return
        self.hasher = _InOrderHash(self.fd, self.part_size, self.parts, self.item.info.size)
        for index in self.done:
            self.hasher.part_done(index)
        self.hasher.start()

    def close(self) -> None:
        if self.hasher is not None:
            self.hasher.cancel()  # and wait for it: its reads must end before the descriptor does
        with self.lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None

    def discard_if_unfinished(self) -> None:
        """After a failure: a file without a finished part has nothing to resume, so nothing of it stays."""
        if not self.placed and not self.done:
            _remove(self.partial)
            _remove(self.record_path)

    def _record_identity(self) -> Dict[str, object]:
        info = self.item.info
        return {"url": self.item.url, "size": info.size, "etag": info.etag, "part_size": self.part_size}

    def _resume(self) -> bool:
        record = records.load(self.record_path, _valid_download, self.fetcher.log, "a download's record",
                              then="the file is downloaded from its start")
        if not record or any(record[k] != v for k, v in self._record_identity().items()):
            return False  # none, or the object (size/etag) or the part size changed: start over
        try:
            fd = os.open(self.partial, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False
        stats = os.fstat(fd)
        if not stat.S_ISREG(stats.st_mode) or stats.st_size != self.item.info.size:
            os.close(fd)
            return False
        self.fd = fd
        self.done = set(record["done"])
        self.fetcher.log.info("download resumed", url=self.item.url, parts_done=len(self.done), parts=self.parts)
        return True

    def _begin(self) -> None:
        _remove(self.record_path)  # first, so a crash now cannot pair an old record with a new file
        self.fd = _open_fresh(self.partial)
        _preallocate(self.fd, self.item.info.size)
        self.done = set()

    def _submit_missing(self) -> None:
        missing = [index for index in range(self.parts) if index not in self.done]
        if not missing:
            self.fetcher.pool.submit(self._guarded, self._finish)
        for index in missing:
            self.fetcher.pool.submit(self._guarded, self._fetch_part, index)

    def _guarded(self, function, *args) -> None:
        try:
            function(*args)
        except BaseException as exc:  # noqa: B036 - it must reach the waiting thread, whatever it is
            self._settle(exc)

    def _settle(self, error: Optional[BaseException] = None) -> None:
        with self.lock:
            if self.outcome.done():
                return
            if error is None:
                self.outcome.set_result(None)
            else:
                self.outcome.set_exception(error)

    def _length(self, index: int) -> int:
        return min(self.part_size, self.item.info.size - index * self.part_size)

    def _fetch_part(self, index: int) -> None:
        if self.fetcher.calls.stop.is_set() or self.outcome.done():
            return
        self.fetcher.calls(self._read_part, index)
        self.fetcher.progress.add(self._length(index))
        with self.lock:
            self.done.add(index)
            _write_json(self.record_path, {**self._record_identity(), "done": sorted(self.done)})
            complete = len(self.done) == self.parts
        if self.hasher is not None:
            self.hasher.part_done(index)
        if complete:
            self._finish()

    def _read_part(self, index: int) -> None:
        start, length = index * self.part_size, self._length(index)
        written = self.fetcher.store.read_range(self.fetcher.bucket, self.item.info.key, start, length, self.fd,
                                                start, etag=self.item.info.etag)
        if written != length:
            raise TransientError(f"{self.item.url}: {written} of {length} bytes at offset {start}")

    def _finish(self) -> None:
        digest = self.hasher.result() if self.hasher is not None else None
        problem = _verify(self.fd, self.partial, self.item, digest)
        self.close()
        if problem is None:
            os.replace(self.partial, self.item.target)
            self.placed = True
            _remove(self.record_path)
            self.fetcher.finished(self.item)
            self._settle()
            return
        # Corrupt bytes are not resumable: drop the partial file and its record either way.
        _remove(self.record_path)
        _remove(self.partial)
        self.done = set()
        if self.retried:
            raise _corrupt(self.item, problem)
        self.retried = True
        self.fetcher.log_refetch(self.item, problem)
        self._begin()
        self._start_hasher()
        self._submit_missing()


# --------------------------------------------------------------------------- upload


class Multipart:
    """A multipart upload whose record (upload id, finished parts) lets a rerun continue it.

    The record is written before the upload is created (without an id) and again with it: a crash between the
    two leaves a record that names the key, so the next run can find and abort the upload (`settle_uploads`).
    Records are an optimisation: a state folder that cannot take one (full, read-only) costs a resume, not the
    upload, and is said once per upload.

    `source`: where the parts are read from, when not `path` (a /proc/self/fd/N of a descriptor the caller holds:
    the version it opened, whatever happens to the path meanwhile)."""

    def __init__(self, store, bucket: str, key: str, url: str, path: Path, stats: os.stat_result,
                 options: TransferOptions, log, *, size: Optional[int] = None,
                 unchanged: Optional[Callable[[], bool]] = None, stop: Optional[threading.Event] = None,
                 quiet: bool = False, source: Optional[str] = None):
        self.store, self.bucket, self.key, self.url, self.path = store, bucket, key, url, path
        self.source = source or str(path)
        self.records_written = True  # False once a record could not be written (said once)
        # `size`: the first bytes only (a growing log's snapshot); the whole file otherwise.
        self.size = stats.st_size if size is None else size
        self.options = options
        self.log = log
        self.stop = stop or threading.Event()
        self.calls = Calls(options, log, self.stop)
        self.unchanged = unchanged  # checked before the upload is completed: False abandons it
        self.quiet = quiet
        self.part_size = _upload_part_size(options.part_size, self.size)
        self.parts = -(-self.size // self.part_size)
        self.record_path = options.state_dir / f"{name_digest(url, path)}.upload.json"
        # The file's size, mtime and inode: a changed file must not be finished from parts of the old one.
        self.identity = {"url": url, "bucket": bucket, "key": key, "path": str(path), "size": self.size,
                         "mtime_ns": stats.st_mtime_ns, "ino": stats.st_ino, "part_size": self.part_size}
        self.upload_id = ""
        self.etags: Dict[int, str] = {}
        self.lock = threading.Lock()

    def run(self) -> ObjectInfo:
        if self._resume():
            try:
                return self._complete()
            except NotFound:
                # The recorded upload is gone (aborted, or expired on the server): start over, once.
                self.log.warning("upload could not be resumed, starting over", url=self.url)
        self.etags = {}
        self._keep({**self.identity, "upload_id": "", "started": time.time(), "parts": {}})
        self.upload_id = self.calls(self.store.create_multipart, self.bucket, self.key)
        self._save()
        return self._complete()

    def _resume(self) -> bool:
        record = records.load(self.record_path, _valid_upload, self.log, "an upload's record",
                              then="the file is uploaded from its start")
        if not record or not record["upload_id"]:
            return False
        self.upload_id = record["upload_id"]
        if any(record[k] != v for k, v in self.identity.items()):
            self._abort()  # the file (or part size) changed: the old upload's parts can never be used
            return False
        self.etags = {int(number): etag for number, etag in record["parts"].items()}
        self.log.info("upload resumed", url=self.url, parts_done=len(self.etags), parts=self.parts)
        return True

    def _save(self) -> None:
        parts = {str(number): etag for number, etag in sorted(self.etags.items())}
        self._keep({**self.identity, "upload_id": self.upload_id, "parts": parts})

    def _keep(self, record: dict) -> None:
        """Writes the record; a state folder that cannot take it (full, read-only, a file in its place) is said
        once, and the upload goes on with its parts in memory."""
        if not self.records_written:
            return
        try:
            self.options.state_dir.mkdir(parents=True, exist_ok=True)
            _write_json(self.record_path, record)
        except OSError as exc:
            self.records_written = False
            self.log.warning("the upload's record cannot be written: kept in memory (a runtime started again "
                             "sends the whole file)", url=self.url, path=str(self.record_path),
                             error=_oserror_text(exc))

    def _complete(self) -> ObjectInfo:
        try:
            self._send_missing()
            if self.stop.is_set():
                raise TransientError(f"{self.url}: upload interrupted")  # the record stays: a rerun continues it
            if self.unchanged is not None and not self.unchanged():
                raise FileChanged(f"{self.path} changed while it was being uploaded")
            info = self.calls(self.store.complete_multipart, self.bucket, self.key, self.upload_id,
                              sorted(self.etags.items()))
        except TransientError:
            raise  # the record stays: a rerun continues this upload
        except StorageError:
            self._abort()
            raise
        _remove(self.record_path)
        return info

    def _send_missing(self) -> None:
        from concurrent.futures import ThreadPoolExecutor, as_completed

        missing = [number for number in range(1, self.parts + 1) if number not in self.etags]
        if not missing:
            return
        calls = Calls(self.options, self.log, EitherStop(self.stop))
        progress = Progress("upload", self.log, 1, sum(self._length(n) for n in missing),
                            0.0 if self.quiet else self.options.progress_seconds,
                            stream=io.StringIO() if self.quiet else None, url=self.url)
        pool = ThreadPoolExecutor(max_workers=min(self.options.workers, len(missing)), thread_name_prefix="upload")
        progress.start()
        try:
            for outcome in as_completed([pool.submit(self._send_part, calls, progress, n) for n in missing]):
                outcome.result()
        finally:
            calls.stop.set()  # on failure: end the retries still sleeping in other workers
            pool.shutdown(wait=True, cancel_futures=True)
            progress.stop()

    def _length(self, number: int) -> int:
        return min(self.part_size, self.size - (number - 1) * self.part_size)

    def _send_part(self, calls: Calls, progress: Progress, number: int) -> None:
        if calls.stop.is_set():
            return
        offset = (number - 1) * self.part_size
        etag = calls(self.store.upload_part, self.bucket, self.key, self.upload_id, number, self.source, offset,
                     self._length(number))
        progress.add(self._length(number))
        with self.lock:
            self.etags[number] = etag
            self._save()

    def _abort(self) -> None:
        """Best effort: the server drops the parts; the record goes either way."""
        if not self.upload_id:
            _remove(self.record_path)
            return
        try:
            self.calls(self.store.abort_multipart, self.bucket, self.key, self.upload_id)
        except StorageError as exc:  # the failure being reported matters more than the leftover parts
            self.log.warning("upload abort failed", url=self.url, error=str(exc))
        _remove(self.record_path)


class EitherStop:
    """The stop of one upload's parts: set by the upload itself (a part failed), or by its owner (`owner`, the
    sync's deadline), without the upload's own ending ever stopping the owner."""

    POLL_SECONDS = 0.1

    def __init__(self, owner: threading.Event):
        self.owner = owner
        self.own = threading.Event()

    def set(self) -> None:
        self.own.set()

    def is_set(self) -> bool:
        return self.own.is_set() or self.owner.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = self.POLL_SECONDS if deadline is None else min(self.POLL_SECONDS, deadline - time.monotonic())
            if left <= 0:
                break
            self.own.wait(left)
        return self.is_set()


def settle_uploads(store, state_dir: Path, url_prefix: str, still_same: Callable[[dict], bool], log) -> int:
    """The unfinished multipart uploads this state folder recorded under `url_prefix`: one whose file is
    unchanged (`still_same(record)`) is left to be resumed by its next upload; the others are aborted, so no
    upload of ours is orphaned. A record without an upload id (a crash right after the upload was created)
    names its key: every unfinished upload of that key is aborted. Returns how many were aborted."""
    aborted = 0
    for record_path in sorted(Path(state_dir).glob("*.upload.json")):
        record = records.load(record_path, _valid_upload, log, "an upload's record",
                              then="its upload, if any, is left to the store's lifecycle rules")
        if not record or not record["url"].startswith(url_prefix):
            continue
        if record.get("upload_id") and still_same(record):
            continue
        ids = [record["upload_id"]] if record.get("upload_id") else [
            upload.upload_id for upload in store.list_uploads(record["bucket"], record["key"])
            if upload.key == record["key"]]
        for upload_id in ids:
            try:
                store.abort_multipart(record["bucket"], record["key"], upload_id)
                aborted += 1
            except NotFound:
                pass
            except StorageError as exc:
                log.warning("upload abort failed", url=record.get("url"), error=str(exc))
                break
        else:
            _remove(record_path)
    return aborted


def _upload_part_size(wanted: int, size: int) -> int:
    """At least S3's minimum, and big enough that the file fits in the most parts allowed (whole MiB)."""
    fitting = -(-size // MAX_UPLOAD_PARTS)
    return max(wanted, MIN_UPLOAD_PART, -(-fitting // MiB) * MiB)


# --------------------------------------------------------------------------- files and records


# How every line of a journal begins (json.dumps of {"key": ..., "etag": ...}): what a torn line still shows.
_JOURNAL_LINE_START = '{"key": '


class _Journal:
    """The ETag each file of one download was written from, as JSON lines appended as files land.

    Lines are written in batches of JOURNAL_BATCH (and at the end) by one write(2) on a descriptor
    opened once: per file, that is a list append. A crash loses at most the last batch, which
    costs nothing but a check: a file at its final path with the right size and no journal line
    is taken as it is, as after a download by another tool; only a change of ETag at the same size
    goes unnoticed for those files. A torn last line is skipped on reading, and the next batch
    starts on a line of its own. A store without ETags writes no journal.
    """

    def __init__(self, path: Path, log):
        self.path = path
        self.lock = threading.Lock()
        self.fd: Optional[int] = None
        self.pending: List[str] = []
        self.torn = False  # the file ends inside a line: the next batch starts on a new one
        self.etags: Dict[str, Optional[str]] = {}
        found = records.load(path, lambda journal: journal, log, "a download's journal",
                             then="files already in place are taken by their size", parse=_parse_journal)
        if found is not None:
            self.etags, self.torn = found

    def lookup(self, key: str) -> Tuple[bool, Optional[str]]:
        return key in self.etags, self.etags.get(key)

    def add(self, key: str, etag: Optional[str]) -> None:
        if etag is None:
            return
        with self.lock:
            self.etags[key] = etag
            self.pending.append(key)
            if len(self.pending) >= JOURNAL_BATCH:
                self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        lines = "".join(json.dumps({"key": key, "etag": self.etags[key]}, ensure_ascii=False) + "\n"
                        for key in self.pending)
        self.pending = []
        if self.fd is None:
            self.fd = open_append(self.path)
            if self.torn:
                lines = "\n" + lines  # after a torn last line, so it does not swallow the next one
        os.write(self.fd, lines.encode("utf-8", "surrogateescape"))

    def close(self) -> None:
        """Writes what is pending and closes the file; on a full disk, the lines are lost, not the download."""
        with self.lock:
            try:
                self._flush()
            except OSError:
                pass
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None

    def compact(self, keys: Set[str]) -> None:
        """Rewrites the journal with only the keys still listed, so reruns do not grow it."""
        self.close()
        with self.lock:
            kept = {key: etag for key, etag in self.etags.items() if key in keys}
            if not kept:
                _remove(self.path)
                return
            write_atomically(self.path, "".join(json.dumps({"key": k, "etag": e}, ensure_ascii=False) + "\n"
                                                for k, e in kept.items()).encode("utf-8", "surrogateescape"))


def object_url(location: Location, key: str) -> str:
    if not location.remote:
        return key
    scheme = location.text.split("://", 1)[0].lower()
    return f"{scheme}://{location.bucket}/{key}"


def name_digest(*parts) -> str:
    import hashlib

    return hashlib.sha256("\0".join(str(part) for part in parts).encode("utf-8", "surrogateescape")).hexdigest()[:32]


def _open_fresh(path) -> int:
    # O_EXCL | O_NOFOLLOW: never write through a symlink someone left at the partial name.
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o666)
    except FileExistsError:  # a leftover of an earlier run (or that symlink): replace it
        _remove(path)
        return os.open(path, flags, 0o666)


def _preallocate(fd: int, size: int) -> None:
    """Reserves the space up front, so a full disk fails now and not after most of the download."""
    try:
        os.posix_fallocate(fd, 0, size)
    except AttributeError:  # no posix_fallocate on this platform
        os.ftruncate(fd, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)  # a filesystem without fallocate: a sparse file does


def _part_size(options: "TransferOptions", size: int) -> int:
    """The configured part size, smaller for objects that would otherwise leave workers idle."""
    per_worker = -(-size // options.workers)
    return min(options.part_size, max(MIN_PART, per_worker))


class _InOrderHash:
    """MD5 of a partial file, fed part by part in order as the parts land (a follower thread)."""

    def __init__(self, fd: int, part_size: int, parts: int, size: int):
        self.digest = new_md5()
        self.fd, self.part_size, self.parts, self.size = fd, part_size, parts, size
        self.ready: Set[int] = set()
        self.cancelled = False
        self.failed = False
        self.condition = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="md5-follower", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def part_done(self, index: int) -> None:
        with self.condition:
            self.ready.add(index)
            self.condition.notify()

    def cancel(self) -> None:
        """Stops the follower and waits for it (a chunk's read at most)."""
        with self.condition:
            self.cancelled = True
            self.condition.notify()
        if self.thread.is_alive():
            self.thread.join()

    def result(self) -> Optional[str]:
        """The hex digest once every part is hashed; None if hashing was cancelled or failed
        (the caller then hashes the file itself)."""
        self.thread.join()
        return None if self.cancelled or self.failed else self.digest.hexdigest()

    def _run(self) -> None:
        try:
            self._follow()
        except OSError:
            self.failed = True

    def _follow(self) -> None:
        for index in range(self.parts):
            with self.condition:
                while index not in self.ready and not self.cancelled:
                    self.condition.wait()
            start = index * self.part_size
            end = min(start + self.part_size, self.size)
            while start < end:
                if self.cancelled:
                    return
                chunk = os.pread(self.fd, min(HASH_CHUNK, end - start), start)
                if not chunk:
                    return
                self.digest.update(chunk)
                start += len(chunk)


def new_md5():
    import hashlib

    return hashlib.md5(usedforsecurity=False)  # an integrity check: allowed on FIPS hosts too


def _verify(fd: int, partial: str, item: _Item, digest: Optional[str] = None) -> Optional[Tuple[str, str]]:
    """(what, detail) wrong with the partial file about to be renamed into place, or None.

    Read from the file itself (its descriptor): its size, then its MD5 when the ETag is one (`digest`,
    when given, was read back from it already). The path to be renamed must still be that very file:
    anything else there would be renamed into place unverified."""
    stats = os.fstat(fd)
    # The inode alone: overlayfs before Linux 4.19 gives a descriptor the upper layer's st_dev, and the path
    # the overlay's, for one file; a file put in its place in the same folder has another inode either way.
    if os.lstat(partial).st_ino != stats.st_ino:
        raise StorageError(f"{item.url}: the partial file {partial} was replaced while it was written",
                           hint="something else writes in the runtime's state folder")
    if stats.st_size != item.info.size:
        return "size mismatch", f"{stats.st_size} bytes, expected {item.info.size}"
    if item.info.md5:
        actual = digest or md5_of(fd, stats.st_size)
        if actual != item.info.md5:
            return "checksum mismatch", f"md5 {actual}, expected {item.info.md5}"
    return None


def md5_of(fd: int, size: int) -> str:
    """The MD5 of the first `size` bytes of the open file `fd`, read in HASH_CHUNK pieces."""
    digest = new_md5()
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(HASH_CHUNK, size - offset), offset)
        if not chunk:
            break
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _valid_download(document: Any) -> dict:
    """A download's record: the object's identity as listed, the part size, and the parts already in the file."""
    records.exactly(records.mapping(document, "the record"), ("url", "size", "etag", "part_size", "done"),
                    "the record")
    records.text(document["url"], "`url`")
    records.text(document["etag"], "`etag`", optional=True)
    parts = _parts_of(document)
    done = document["done"]
    if not isinstance(done, list):
        raise records.Invalid(f"`done`: a list is wanted, found {records.described(done)}")
    for index in done:
        records.integer(index, "`done`: a part", 0, parts - 1)
    return document


_UPLOAD_FIELDS = ("url", "bucket", "key", "path", "size", "mtime_ns", "ino", "part_size", "upload_id", "parts")


def _valid_upload(document: Any) -> dict:
    """An upload's record: the file's identity, the upload id ("" before the upload was created), the parts sent."""
    records.mapping(document, "the record")
    records.exactly({name: value for name, value in document.items() if name != "started"}, _UPLOAD_FIELDS,
                    "the record")
    for name in ("url", "bucket", "key", "path", "upload_id"):
        records.text(document[name], f"`{name}`")
    records.integer(document["mtime_ns"], "`mtime_ns`")
    records.integer(document["ino"], "`ino`", 0)
    if "started" in document:
        records.number(document["started"], "`started`")
    parts = _parts_of(document)
    for number, etag in records.mapping(document["parts"], "`parts`").items():
        if not (number.isascii() and number.isdigit() and 1 <= int(number) <= parts):
            raise records.Invalid(f"`parts`: a part number that is not one of 1..{parts}")
        records.text(etag, "`parts`: an ETag")
    return document


def _parts_of(document: dict) -> int:
    """How many parts the record's `size` and `part_size` make."""
    size = records.integer(document["size"], "`size`", 0)
    return -(-size // records.integer(document["part_size"], "`part_size`", 1))


def _parse_journal(data: bytes) -> Tuple[Dict[str, Optional[str]], bool]:
    """(key -> ETag, whether the last line is torn). A line a crash cut short (a start of `{"key": ...`: the last
    line, or one the next batch's newline ended) is skipped; any other line that is not {"key": str, "etag": str}
    makes the journal Invalid."""
    etags: Dict[str, Optional[str]] = {}
    torn = bool(data) and not data.endswith(b"\n")
    lines = data.split(b"\n")
    for line in lines[:-1]:  # the last is b"" after a newline, or the torn line
        text = line.decode("utf-8", "surrogateescape")  # as written: a key may hold bytes that are not UTF-8
        try:
            entry = records.decode_text(text)
        except records.NotJSON:
            if text.startswith(_JOURNAL_LINE_START) or _JOURNAL_LINE_START.startswith(text):
                continue
            raise
        records.exactly(records.mapping(entry, "a line"), ("key", "etag"), "a line")
        etags[records.text(entry["key"], "a line's `key`")] = records.text(entry["etag"], "a line's `etag`")
    return etags, torn


def _write_json(path: Path, data: dict) -> None:
    """Atomic (files.py): a crash leaves the old record or the new one, never half of one."""
    write_atomically(path, json.dumps(data, ensure_ascii=False))


def _remove(path) -> None:
    """Removes the runtime's own file (or a link left in its place) at `path`; whatever else sits there (a FIFO,
    a folder) is not the runtime's to remove."""
    try:
        mode = os.lstat(path).st_mode
        if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
            os.unlink(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (a file where the folder should be)
        pass


def _oserror_text(exc: OSError) -> str:
    where = f": {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"
