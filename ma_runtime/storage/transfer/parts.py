"""A large object fetched as ranged parts into one preallocated partial file, resumable by its record, and
checked without a pass of its own: a multipart upload's object (a composite ETag) part by part as the bytes
arrive, in every worker at once; an object whose ETag is its MD5 by one MD5 followed in order as the parts land."""

import errno
import os
import stat
import threading
from typing import Dict, Optional, Set

from ma_runtime.storage.base import TransientError
from ma_runtime.storage.transfer.hashing import InOrderHash, PartHashes, UploadLayout, composite_etag, md5_of, new_md5
from ma_runtime.storage.transfer.journal import valid_download
from ma_runtime.storage.transfer.options import MiB, TransferOptions
from ma_runtime.storage.transfer.partial import Item, corrupt, open_fresh, verify
from ma_runtime.storage.transfer.utils import name_digest, remove, write_json
from ma_runtime.util import records

# Parts shrink towards this to keep every worker busy on a mid-sized object, never below it.
MIN_PART = 8 * MiB


class LargeFile:
    """One large object fetched as ranged parts into a preallocated partial file, resumable by its record."""

    def __init__(self, fetcher, item: Item):  # fetcher: download.py's, whose pool, calls and progress it shares
        from concurrent.futures import Future

        self.fetcher = fetcher
        self.item = item
        # A composite ETag's parts, by the likeliest part size that fits: each ranged read covers whole upload parts,
        # and hashes them as they arrive; the other sizes that fit are tried from the file only if that one's fails.
        self.layouts = UploadLayout.fitting(item.info.etag, item.info.size)
        self.layout = self.layouts[0] if self.layouts else None
        self.part_size = _part_size(fetcher.options, item.info.size, self.layout)
        self.parts = -(-item.info.size // self.part_size)
        self.hasher: Optional[InOrderHash] = None
        self.part_hashes = PartHashes(self.layout) if self.layout and self.layout.count > 1 else None
        self.partial = fetcher.staging.path(item.target)
        self.record_path = fetcher.options.state_dir / f"{name_digest(item.url, item.target)}.download.json"
        self.outcome = Future()
        self.lock = threading.Lock()
        self.fd: Optional[int] = None
        self.done: Set[int] = set()
        self.retried = False
        self.placed = False
        # The object is encrypted with a KMS or customer key (an answer said so): its ETag says nothing of its bytes.
        self.keyed = False

    def start(self):
        """Submits the missing parts; returns a Future that settles when the file is in place (or failed)."""
        if not self._resume():
            self._begin()
        self.fetcher.progress.adjust_total(-sum(self._length(index) for index in self.done))
        self._start_hasher()
        self._submit_missing()
        return self.outcome

    def _start_hasher(self) -> None:
        """A composite ETag's part MD5s are taken as the bytes arrive (`_read_part`); those of the parts a
        previous run fetched are read from the file here. An object whose ETag is its MD5 (or an MD5's MD5, a
        one-part upload's) has one MD5 in byte order, followed while later parts download: it reads the parts
        back from the page cache, one thread, which bounds a download at MD5's rate on one core."""
        if self.part_hashes is not None:
            self.part_hashes.forget()
            for index in sorted(self.done):
                start = index * self.part_size
                self.part_hashes.hash_file(self.fd, start, start + self._length(index))
            return
        if not (self.item.info.md5 or self.layout):
            return
        self.hasher = InOrderHash(self.fd, self.part_size, self.parts, self.item.info.size)
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
            remove(self.partial)
            remove(self.record_path)

    def _record_identity(self) -> Dict[str, object]:
        info = self.item.info
        return {"url": self.item.url, "size": info.size, "etag": info.etag, "part_size": self.part_size}

    def _resume(self) -> bool:
        record = records.load(self.record_path, valid_download, self.fetcher.log, "a download's record",
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
        remove(self.record_path)  # first, so a crash now cannot pair an old record with a new file
        self.fd = open_fresh(self.partial)
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
            write_json(self.record_path, {**self._record_identity(), "done": sorted(self.done)})
            complete = len(self.done) == self.parts
        if self.hasher is not None:
            self.hasher.part_done(index)
        if complete:
            self._finish()

    def _read_part(self, index: int) -> None:
        start, length = index * self.part_size, self._length(index)
        # A retried read gets a new tap: the digests of a read cut short are replaced by its retry's.
        tap = {"tap": self.part_hashes.tap(start)} if self.part_hashes is not None else {}
        written = self.fetcher.store.read_range(self.fetcher.bucket, self.item.info.key, start, length, self.fd,
                                                start, etag=self.item.info.etag, keyed=self._keyed, **tap)
        if written != length:
            raise TransientError(f"{self.item.url}: {written} of {length} bytes at offset {start}")

    def _keyed(self) -> None:
        self.keyed = True

    def _finish(self) -> None:
        problem = verify(self.fd, self.partial, self.item, *self._digests(), by_etag=not self.keyed)
        self.close()
        if problem is None:
            os.replace(self.partial, self.item.target)
            self.placed = True
            remove(self.record_path)
            self.fetcher.finished(self.item)
            self._settle()
            return
        # Corrupt bytes are not resumable: drop the partial file and its record either way.
        remove(self.record_path)
        remove(self.partial)
        self.done = set()
        if self.part_hashes is not None:
            self.part_hashes.forget()
        if self.retried:
            raise corrupt(self.item, problem)
        self.retried = True
        self.fetcher.log_refetch(self.item, problem)
        self._begin()
        self._start_hasher()
        self._submit_missing()


    def _digests(self):
        """(the MD5 followed in order, the composite ETag the bytes make): what `verify` compares."""
        digest = self.hasher.result() if self.hasher is not None else None
        if self.keyed:
            return None, None
        if self.part_hashes is not None:
            made = composite_etag(self.fd, self.layouts, self.part_hashes.etag(), (self.item.info.etag or "").lower())
            return None, made or "(a part not hashed)"
        if self.layout is not None:  # one part: the ETag is the MD5 of the object's MD5
            whole = digest or md5_of(self.fd, self.item.info.size)
            return None, f"{new_md5(bytes.fromhex(whole)).hexdigest()}-1"
        return digest, None


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


def _part_size(options: "TransferOptions", size: int, layout: Optional[UploadLayout] = None) -> int:
    """The configured part size, smaller for objects that would otherwise leave workers idle; for an object
    checked part by part, the whole number of its upload parts nearest that (one at least)."""
    per_worker = -(-size // options.workers)
    wanted = min(options.part_size, max(MIN_PART, per_worker))
    if layout is None or layout.count == 1:
        return wanted
    return max(1, round(wanted / layout.part_size)) * layout.part_size
