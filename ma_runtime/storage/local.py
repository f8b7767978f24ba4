"""The local backend: local paths and file:// URLs behave like a bucket, so ma-run needs no object store.

Keys are absolute paths and `bucket` is always "". Only regular files (a symlink
followed to one) are objects: a FIFO, socket or device in the source tree is not
listed, and reading it would block or never end.

A file's version, its "ETag", is made from its stat: inode, size and mtime. A
file replaced (renamed over) or rewritten after it was listed has another one, and
`read_range` checks it with fstat around every read: the parts of one download
all come from the version listed, as If-Match makes sure of for OBS.

Uploads are atomic (a temporary file beside the target, then a rename) and, like
every write the runtime makes, never replace what is not a regular file
(files.writable_target).
"""

import os
import shutil
import stat
import uuid
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from ma_runtime.files import writable_target, write_atomically_from
from ma_runtime.storage.base import NotFound, ObjectChanged, ObjectInfo, StorageError

CHUNK = 1 << 20


def version_of(stats: os.stat_result) -> str:
    """The ETag of a local file. Never 32 hex digits, so it is never taken for an MD5. No st_dev: overlayfs
    before Linux 4.19 gives stat() and fstat() of one lower-layer file different devices."""
    return f"local-{stats.st_ino:x}-{stats.st_size:x}-{stats.st_mtime_ns:x}"


class LocalStore:
    def describe(self) -> str:
        return "the local filesystem"

    def list(self, bucket: str, prefix: str) -> Iterator[ObjectInfo]:
        root = Path(prefix)
        if not root.is_dir():
            return
        # The directory's own marker: an existing empty directory is an empty prefix, not a missing one.
        yield ObjectInfo(str(root).rstrip("/") + "/", 0)
        for directory, subdirs, files in os.walk(root):
            subdirs.sort()
            if not files and not subdirs and Path(directory) != root:
                yield ObjectInfo(directory.rstrip("/") + "/", 0)  # an empty directory, as a marker key
            for name in sorted(files):
                path = os.path.join(directory, name)
                info = _file_info(path)
                if info is not None:
                    yield info

    def head(self, bucket: str, key: str) -> ObjectInfo:
        try:
            stats = os.stat(key)
        except (OSError, ValueError):  # ValueError: a NUL in the path
            raise NotFound(f"{key} does not exist") from None
        if not stat.S_ISREG(stats.st_mode):
            raise NotFound(f"{key} is not a file")
        return ObjectInfo(key, stats.st_size, version_of(stats))

    def read_range(self, bucket: str, key: str, start: int, length: int, fd: int, offset: int, *,
                   etag: Optional[str] = None, whole: bool = False) -> int:
        try:
            source = os.open(key, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise NotFound(f"{key} does not exist") from None
        try:
            _check_version(source, key, etag)
            done = 0
            while done < length:
                chunk = os.pread(source, min(CHUNK, length - done), start + done)
                if not chunk:
                    raise StorageError(f"{key} is shorter than expected ({start + done} bytes)")
                os.pwrite(fd, chunk, offset + done)
                done += len(chunk)
            _check_version(source, key, etag)  # rewritten in place while it was read
        finally:
            os.close(source)
        return done

    def put_file(self, bucket: str, key: str, path: str) -> ObjectInfo:
        target = _upload_target(key)
        with open(path, "rb") as source:
            write_atomically_from(target, lambda sink: shutil.copyfileobj(source, sink, CHUNK))
        return ObjectInfo(key, target.stat().st_size)

    def create_multipart(self, bucket: str, key: str) -> str:
        _upload_target(key)  # refused now, not after every part has been sent
        upload_id = uuid.uuid4().hex
        self._parts_dir(key, upload_id).mkdir(parents=True)
        return upload_id

    def upload_part(self, bucket: str, key: str, upload_id: str, number: int, path: str, offset: int,
                    size: int) -> str:
        part = self._parts_dir(key, upload_id) / f"{number:05d}"
        with open(path, "rb") as source, open(part, "wb") as sink:
            source.seek(offset)
            sink.write(source.read(size))
        return f"{number}-{size}"

    def complete_multipart(self, bucket: str, key: str, upload_id: str, parts: List[Tuple[int, str]]) -> ObjectInfo:
        parts_dir = self._parts_dir(key, upload_id)
        target = _upload_target(key)

        def concatenate(sink) -> None:
            for number, _etag in sorted(parts):
                with open(parts_dir / f"{number:05d}", "rb") as source:
                    shutil.copyfileobj(source, sink, CHUNK)

        write_atomically_from(target, concatenate)
        shutil.rmtree(parts_dir, ignore_errors=True)
        return ObjectInfo(key, target.stat().st_size)

    def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        shutil.rmtree(self._parts_dir(key, upload_id), ignore_errors=True)

    @staticmethod
    def _parts_dir(key: str, upload_id: str) -> Path:
        target = Path(key)
        return target.with_name(f".{target.name}.{upload_id[:8]}.parts")


def _file_info(path: str) -> Optional[ObjectInfo]:
    """The object a directory entry is, or None: vanished, a dangling link, or not a regular file."""
    try:
        stats = os.stat(path)
    except OSError:
        return None
    return ObjectInfo(path, stats.st_size, version_of(stats)) if stat.S_ISREG(stats.st_mode) else None


def _check_version(source: int, key: str, etag: Optional[str]) -> None:
    if etag is None:
        return
    now = version_of(os.fstat(source))
    if now != etag:
        raise ObjectChanged(f"{key} changed after it was listed (version {etag} when listed, {now} now)")


def _upload_target(key: str) -> Path:
    """The file an upload to `key` writes (a symlink followed); NotAFile if something else is there."""
    target = Path(key)
    target.parent.mkdir(parents=True, exist_ok=True)
    return writable_target(target)
