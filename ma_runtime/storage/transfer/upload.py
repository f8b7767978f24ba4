"""Uploads: a file in one PUT or as a resumable multipart upload (its record: upload id and parts sent), which of
the two a file gets (`upload_file`), the stop of one upload's parts, and the settling of uploads a crash left
unfinished.

One PUT or parts (`upload_file`): a file below the large threshold (`MA_RUNTIME_STORAGE_LARGE_MB`, the one that
also decides ranged downloads) goes in one PUT, a file at or above it in parallel parts; a file over 5 GiB always
in parts (the most one PUT may carry on OBS and S3). Both are as safe against a torn object: a PUT is atomic (a
crash or a cut connection mid-body stores nothing), and its last bytes are sent only after a check that the file
is unchanged (signed.py), as a multipart upload is completed only after that check. What parts add is resuming:
their record lets a later run send only the missing parts, where a PUT interrupted starts again from byte 0; and
parallel streams, which OBS's own guidance recommends from about 100 MB for throughput. So a file whose
unfinished multipart upload is recorded goes on in parts (resumed, or aborted when the file changed), whatever
its size."""

import functools
import io
import os
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Optional

from ma_runtime.storage.base import FileChanged, NotFound, ObjectInfo, StorageError, TransientError
from ma_runtime.storage.progress import Progress
from ma_runtime.storage.transfer.journal import valid_upload
from ma_runtime.storage.transfer.options import MiB, TransferOptions
from ma_runtime.storage.transfer.retry import Calls
from ma_runtime.storage.transfer.utils import (
    name_digest,
    oserror_text,
    remove,
    write_json,
)
from ma_runtime.util import records

# S3's multipart limits (OBS's are looser): parts of at least 5 MiB but the last, at most 10 000 parts.
MIN_UPLOAD_PART = 5 * MiB
MAX_UPLOAD_PARTS = 10_000
MAX_PUT = 5 << 30  # the most one PUT may carry (OBS and S3: 5 GiB); larger objects go up in parts only


def upload_file(store, bucket: str, key: str, url: str, path: Path, stats: os.stat_result, options: TransferOptions,
                log, *, size: Optional[int] = None, unchanged: Optional[Callable[[], bool]] = None,
                stop: Optional[threading.Event] = None, quiet: bool = False,
                source: Optional[str] = None) -> ObjectInfo:
    """One file up, in one PUT or in parts (the rule in this module's docstring); the arguments are Multipart's.
    `unchanged` is checked before the object is stored either way: False raises FileChanged, nothing stored."""
    parts = Multipart(store, bucket, key, url, path, stats, options, log, size=size, unchanged=unchanged, stop=stop,
                      quiet=quiet, source=source)
    if goes_in_parts(parts.size, options) or parts.recorded():
        return parts.run()
    calls = Calls(options, log, parts.stop)
    put = functools.partial(store.put_file, size=parts.size, unchanged=unchanged)
    return calls(put, bucket, key, parts.source)


def goes_in_parts(size: int, options: TransferOptions) -> bool:
    """A file this big goes up as a multipart upload, not in one PUT."""
    return size >= options.large_threshold or size > MAX_PUT


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

    def recorded(self) -> bool:
        """A record of this file's upload is there: a run before was interrupted (resume it, or abort it)."""
        return os.path.lexists(self.record_path)

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
        record = records.load(self.record_path, valid_upload, self.log, "an upload's record",
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
            write_json(self.record_path, record)
        except OSError as exc:
            self.records_written = False
            self.log.warning("the upload's record cannot be written: kept in memory (a runtime started again "
                             "sends the whole file)", url=self.url, path=str(self.record_path),
                             error=oserror_text(exc))

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
        remove(self.record_path)
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
            remove(self.record_path)
            return
        try:
            self.calls(self.store.abort_multipart, self.bucket, self.key, self.upload_id)
        except StorageError as exc:  # the failure being reported matters more than the leftover parts
            self.log.warning("upload abort failed", url=self.url, error=str(exc))
        remove(self.record_path)


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
        record = records.load(record_path, valid_upload, log, "an upload's record",
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
            remove(record_path)
    return aborted


def _upload_part_size(wanted: int, size: int) -> int:
    """At least S3's minimum, and big enough that the file fits in the most parts allowed (whole MiB)."""
    fitting = -(-size // MAX_UPLOAD_PARTS)
    return max(wanted, MIN_UPLOAD_PART, -(-fitting // MiB) * MiB)
