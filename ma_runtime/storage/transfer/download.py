"""Downloads: an object or every object under a prefix, planned (refusals, folders), skipping what is in place,
fetched on one bounded pool: small files whole, large ones as ranged parts (parts.py)."""

import collections
import dataclasses
import functools
import os
import stat
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from ma_runtime.storage import safety
from ma_runtime.storage.base import NotFound, ObjectInfo, StorageError
from ma_runtime.storage.progress import MB, Progress
from ma_runtime.storage.transfer.hashing import PartHashes, UploadLayout, composite_etag
from ma_runtime.storage.transfer.journal import Journal
from ma_runtime.storage.transfer.options import TransferOptions
from ma_runtime.storage.transfer.partial import Item, Staging, corrupt, open_fresh, verify
from ma_runtime.storage.transfer.parts import LargeFile
from ma_runtime.storage.transfer.retry import Calls
from ma_runtime.storage.transfer.utils import name_digest, naming_the_store, object_url, oserror_text, remove
from ma_runtime.storage.url import Location


@dataclasses.dataclass
class Summary:
    files: int  # fetched by this run
    bytes: int  # moved by this run (a resumed file counts only its missing parts)
    skipped: int  # already at their final path, unchanged
    refused: List[str]  # keys that were not written: outside the destination, unsafe, or in the way of others
    seconds: float
    path: Optional[Path] = None  # the file or folder written


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
        staging = Staging(options.state_dir, root)
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
        raise StorageError(f"{location.text} -> {dest}: {oserror_text(exc)}") from exc
    seconds = time.monotonic() - started
    summary = Summary(len(todo), moved, len(items) - len(todo), refused, round(seconds, 3), dest)
    log.info("download completed", url=location.text, dest=str(dest), files=summary.files, bytes=moved,
             skipped=summary.skipped, refused=len(refused), seconds=summary.seconds,
             rate_mb_s=round(moved / MB / max(seconds, 1e-6), 1))
    return summary


def _fetch(store, location: Location, dest: Path, options: TransferOptions, items: List[Item], refused: List[str],
           staging: "Staging", log) -> Tuple[int, List[Item]]:
    """(bytes moved, items fetched): the items not already in place, on one pool."""
    journal = Journal(options.state_dir / f"{name_digest(location.text, dest)}.journal", log)
    todo = [item for item in items if not _already_there(item, journal)]
    log.info("download started", url=location.text, dest=str(dest), files=len(todo),
             bytes=sum(item.info.size for item in todo), skipped=len(items) - len(todo), refused=len(refused))
    try:
        moved = _Fetcher(store, location, options, journal, staging, log).run(todo)
    finally:
        journal.close()
    journal.compact({item.info.key for item in items})
    return moved, todo


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
                 staging: "Staging") -> Tuple[List[Item], List[str]]:
    """The single object's item; refused (and the download failed) when something other than a file,
    or the engine's own files, sit at `dest`."""
    destination = safety.Destination(staging.root.resolve(), staging.reserved)
    path, reason = destination.place(dest.name)
    if reason:
        raise StorageError(f"{location.text} -> {dest}: {reason}", hint="remove what is in the way, or choose "
                           "another path")
    return [Item(info, object_url(location, info.key), destination.dest_real / path)], []


def _plan_tree(objects, prefix: str, dest: Path, location: Location, staging: "Staging",
               log, select=None) -> Tuple[List[Item], List[str]]:
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
            items.append(Item(info, object_url(location, info.key), destination.dest_real / path))
    _make_folders(destination.dest_real, folders, items)
    return items, refused


def _refuse(log, refused: List[str], location: Location, key: str, reason: str) -> None:
    log.warning("download refused a key", url=location.text, key=key, reason=reason)
    refused.append(key)


def _make_folders(dest: Path, folders: List[str], items: List[Item]) -> None:
    needed = {dest} | {dest / folder for folder in folders} | {item.target.parent for item in items}
    for folder in sorted(needed):  # parents sort before their children
        folder.mkdir(parents=True, exist_ok=True)


def _already_there(item: Item, journal: "Journal") -> bool:
    """The right size at the final path, and not written from another version of the object."""
    try:
        stats = os.stat(item.target)
    except OSError:
        return False
    if not stat.S_ISREG(stats.st_mode) or stats.st_size != item.info.size:
        return False
    known, etag = journal.lookup(item.info.key)
    return not known or etag == item.info.etag


class _Fetcher:
    """Fetches items on one bounded pool: small ones whole, large ones as ranged parts."""

    def __init__(self, store, location: Location, options: TransferOptions, journal: "Journal",
                 staging: Staging, log):
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

    def run(self, items: List[Item]) -> int:
        """Returns the bytes moved; raises the first failure once the work in flight has stopped."""
        if not items:
            return 0
        from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

        self.progress = Progress("download", self.log, len(items), sum(i.info.size for i in items),
                                 self.options.progress_seconds, url=self.location.text)
        threshold = self.options.large_threshold
        large_files = [LargeFile(self, item) for item in items if item.info.size >= threshold]
        self.pool = ThreadPoolExecutor(max_workers=self.options.workers, thread_name_prefix="download")
        self.progress.start()
        try:
            # Large files first: their parts are the long pole, small files fill the gaps at the end.
            outcomes = [large.start() for large in large_files]
            small = collections.deque(item for item in items if item.info.size < threshold)
            # Small files are taken from one queue by a worker task each, not submitted one by one: a Future
            # per file (its condition, the pool's queue, the waiter told of every result) was 11-13 % of the
            # client CPU of 2000 x 4 KiB (issue 29, item 3).
            outcomes += [self.pool.submit(self._drain, small) for _ in range(min(self.options.workers, len(small)))]
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

    def _drain(self, small: "collections.deque[Item]") -> None:
        """Fetches small files from the shared queue until it is empty, or until the download has failed."""
        while not self.calls.stop.is_set():
            try:
                item = small.popleft()  # atomic: each file is taken by one worker
            except IndexError:
                return
            self._fetch_small(item)

    def _fetch_small(self, item: Item) -> None:
        # The hot path of many small files. Each syscall is a GIL hand-off among the workers, and
        # those hand-offs, not the bytes, are what small files cost: open, write, then the checks
        # of what is renamed (fstat, lstat, and one pread for the MD5), rename, close.
        target = str(item.target)
        partial = self.staging.path(item.target)
        problem: Optional[Tuple[str, str]] = None
        # A multipart upload's object (a composite ETag): its parts' MD5s are taken from the one body as it arrives.
        layouts = UploadLayout.fitting(item.info.etag, item.info.size)
        for attempt in (1, 2):
            fd = open_fresh(partial)
            placed = False
            try:
                hashes = PartHashes(layouts[0]) if layouts else None
                keyed: List[bool] = []
                written = self.calls(self._read_whole, item, fd, hashes, functools.partial(keyed.append, True))
                composite = None if hashes is None or keyed else composite_etag(fd, layouts, hashes.etag(),
                                                                                item.info.etag.lower())
                problem = verify(fd, partial, item, composite=composite, by_etag=not keyed)
                if problem is None:
                    os.replace(partial, target)
                    placed = True
            finally:
                os.close(fd)
                if not placed:
                    remove(partial)
            if placed:
                self.finished(item, written)
                return
            self.progress.add(written)
            if attempt == 1:
                self.log_refetch(item, problem)
        raise corrupt(item, problem)

    def _read_whole(self, item: Item, fd: int, hashes: Optional[PartHashes], keyed: Callable[[], None]) -> int:
        """The bytes written; a retry starts afresh at offset 0 (and with fresh part digests)."""
        if item.info.size == 0:
            return 0  # a zero-length range cannot be asked for
        tap = {}
        if hashes is not None:
            hashes.forget()
            tap["tap"] = hashes.tap(0)
        return self.store.read_range(self.bucket, item.info.key, 0, item.info.size, fd, 0, etag=item.info.etag,
                                     whole=True, keyed=keyed, **tap)

    def finished(self, item: Item, nbytes: int = 0) -> None:
        self.journal.add(item.info.key, item.info.etag)
        self.progress.add(nbytes, files=1)

    def log_refetch(self, item: Item, problem: Tuple[str, str]) -> None:
        self.log.warning("download verification failed, fetching again", url=item.url, problem=problem[0],
                         detail=problem[1])
        self.progress.adjust_total(item.info.size)
