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
(files.writable_target). An upload's ETag is the new file's version.

Behaving as a server does, so that code tested here behaves the same against OBS:
`put_bytes` refuses bytes whose MD5 is not the one given (CorruptTransfer, as a
server's BadDigest), a part whose file ends early is FileChanged, a multipart
upload that is gone (aborted, or an id that names none) is NotFound, and a failure
of the filesystem (a full disk, a directory in the way) is a StorageError naming
the path, not a bare OSError. A write is confirmed as OBS's are (`base.confirmed`):
the file renamed into place has a version and the size written.

Refusals (`refusal`, as a server's 4xx for one object): an error about the key
itself, a name too long (ENAMETOOLONG), one the filesystem does not take (EINVAL,
EILSEQ, a NUL), something in its way (a folder, a file where a folder should be),
a file larger than the filesystem allows (EFBIG), and the BadDigest above. A full
disk, a read-only filesystem, a permission denied are not: they stop every write.

A multipart upload keeps its parts in `.<name>.<upload id>.parts/` beside the
target; `list_uploads` finds them by that name. Upload ids are 8 hex digits, the
part of the id the folder's name has always held, so an id listed is the id
created (an id of 32 digits, from an older version, still finds its folder).

`delete` removes a file, or a symlink as a link: never what a link points to, and
never anything else (a folder, a FIFO), which is not an object of this store.
"""

import contextlib
import errno
import hashlib
import os
import re
import shutil
import stat
import uuid
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

from ma_runtime.storage.base import (
    CorruptTransfer,
    FileChanged,
    NotFound,
    ObjectChanged,
    ObjectInfo,
    StorageError,
    Upload,
    check_part_bounds,
    confirmed,
    refused,
)
from ma_runtime.util.files import kind_of, writable_target, write_atomically, write_atomically_from

CHUNK = 1 << 20
UPLOAD_ID_LENGTH = 8
_UPLOAD_ID = re.compile(r"[0-9a-f]{8,32}\Z")
_PARTS_FOLDER = re.compile(r"\.(?P<name>.+)\.(?P<upload_id>[0-9a-f]{8})\.parts\Z", re.DOTALL)
_MD5_HEX = re.compile(r"[0-9a-fA-F]{32}\Z")
# Failures of a write about its key, not the filesystem (see the module's docstring). EEXIST: NotAFile.
REFUSED_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.EINVAL, errno.EILSEQ, errno.ENOTDIR, errno.EISDIR, errno.EEXIST,
                            errno.ELOOP, errno.EFBIG})


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
                   etag: Optional[str] = None, whole: bool = False, tap: Optional[Callable[[bytes], None]] = None,
                   keyed: Optional[Callable[[], None]] = None) -> int:  # a local file is never encrypted with a key
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
                if tap is not None:
                    tap(chunk)
                os.pwrite(fd, chunk, offset + done)
                done += len(chunk)
            _check_version(source, key, etag)  # rewritten in place while it was read
        finally:
            os.close(source)
        return done

    def put_file(self, bucket: str, key: str, path: str, *, size: Optional[int] = None,
                 unchanged: Optional[Callable[[], bool]] = None) -> ObjectInfo:
        with _as_storage_error("uploading to", key):
            target = _upload_target(key)
            copied = _Count()

            def write(sink) -> None:
                if size is None:
                    copied.copy(source, sink)
                else:
                    _copy_range(source, sink, 0, size, path)
                    copied.bytes = size
                if unchanged is not None and not unchanged():  # before the rename: nothing is stored
                    raise FileChanged(f"uploading to {key}: {path} changed while it was being uploaded")

            with _open_source(path) as source:
                write_atomically_from(target, write)
            return confirmed(f"uploading to {key}", _info_of(key, target), size=copied.bytes)

    def put_bytes(self, bucket: str, key: str, data: bytes, md5_hex: str) -> ObjectInfo:
        if not _MD5_HEX.match(md5_hex or ""):
            raise StorageError(f"uploading to {key}: {md5_hex!r} is not an MD5 (32 hex digits)")
        actual = hashlib.md5(data, usedforsecurity=False).hexdigest()
        if actual != md5_hex.lower():
            raise refused(CorruptTransfer(f"uploading to {key}: the bytes' MD5 is {actual}, not the {md5_hex} given"))
        with _as_storage_error("uploading to", key):
            target = _upload_target(key)
            write_atomically(target, data)
            return confirmed(f"uploading to {key}", _info_of(key, target), size=len(data), md5_hex=md5_hex)

    def delete(self, bucket: str, key: str) -> None:
        with _as_storage_error("deleting", key):
            try:
                mode = os.lstat(key).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return
            if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(key)

    def create_multipart(self, bucket: str, key: str) -> str:
        with _as_storage_error("starting a multipart upload to", key):
            _upload_target(key)  # refused now, not after every part has been sent
            while True:
                upload_id = uuid.uuid4().hex[:UPLOAD_ID_LENGTH]
                try:
                    self._parts_dir(key, upload_id).mkdir()
                    return upload_id
                except FileExistsError:
                    continue  # another upload of this key drew the same id

    def upload_part(self, bucket: str, key: str, upload_id: str, number: int, path: str, offset: int,
                    size: int) -> str:
        action = f"uploading part {number} to"
        parts_dir = self._existing_parts_dir(key, upload_id)
        with _as_storage_error(action, key), _open_source(path) as source:
            check_part_bounds(f"{action} {key}", path, os.fstat(source.fileno()).st_size, offset, size)
            write_atomically_from(parts_dir / f"{number:05d}",
                                  lambda sink: _copy_range(source, sink, offset, size, path))
        return f"{number}-{size}"

    def complete_multipart(self, bucket: str, key: str, upload_id: str, parts: List[Tuple[int, str]]) -> ObjectInfo:
        parts_dir = self._existing_parts_dir(key, upload_id)
        copied = _Count()

        def concatenate(sink) -> None:
            for number, _etag in sorted(parts):
                with open(parts_dir / f"{number:05d}", "rb") as source:
                    copied.copy(source, sink)

        with _as_storage_error("completing the multipart upload to", key):
            target = _upload_target(key)
            write_atomically_from(target, concatenate)
            shutil.rmtree(parts_dir, ignore_errors=True)
            return confirmed(f"completing the multipart upload to {key}", _info_of(key, target), size=copied.bytes)

    def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        if _UPLOAD_ID.match(upload_id):
            shutil.rmtree(self._parts_dir(key, upload_id), ignore_errors=True)

    def list_uploads(self, bucket: str, prefix: str) -> List[Upload]:
        """The part folders under the folder `prefix` names (or sits in), whose keys start with `prefix`. Keys are
        absolute paths: any other prefix names none (and "" is not the whole filesystem)."""
        if not os.path.isabs(prefix):
            return []
        root = prefix if prefix.endswith("/") else os.path.dirname(prefix)
        uploads = []
        with _as_storage_error("listing the multipart uploads under", prefix):
            for directory, subdirs, _files in os.walk(root):
                subdirs.sort()
                for name in list(subdirs):
                    found = _PARTS_FOLDER.match(name)
                    if found is None:
                        continue
                    subdirs.remove(name)  # parts, not keys: nothing to find inside
                    key = os.path.join(directory, found.group("name"))
                    if key.startswith(prefix):
                        uploads.append(Upload(key, found.group("upload_id")))
        return uploads

    @staticmethod
    def _parts_dir(key: str, upload_id: str) -> Path:
        target = Path(key)
        return target.with_name(f".{target.name}.{upload_id[:UPLOAD_ID_LENGTH]}.parts")

    def _existing_parts_dir(self, key: str, upload_id: str) -> Path:
        """The upload's part folder; NotFound, as a server's NoSuchUpload, when there is none (aborted, completed,
        or an id that is not one of ours: it is never made into a path)."""
        parts_dir = self._parts_dir(key, upload_id) if _UPLOAD_ID.match(upload_id) else None
        if parts_dir is None or not parts_dir.is_dir():
            raise NotFound(f"{key}: no multipart upload {upload_id!r} (aborted or completed)")
        return parts_dir


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


def _info_of(key: str, target: Path) -> ObjectInfo:
    stats = target.stat()
    return ObjectInfo(key, stats.st_size, version_of(stats))


def _open_source(path: str):
    """`path` opened for reading when it is a regular file (O_NONBLOCK: a FIFO is refused, not waited on)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise StorageError(f"{path} is {kind_of(mode)}, not a regular file")
    return os.fdopen(fd, "rb")


class _Count:
    """The bytes copied into one upload, for its confirmation."""

    def __init__(self):
        self.bytes = 0

    def copy(self, source, sink) -> None:
        while True:
            chunk = source.read(CHUNK)
            if not chunk:
                return
            sink.write(chunk)
            self.bytes += len(chunk)


def _copy_range(source, sink, offset: int, size: int, path: str) -> None:
    done = 0
    while done < size:
        chunk = os.pread(source.fileno(), min(CHUNK, size - done), offset + done)
        if not chunk:
            raise FileChanged(f"{path} ended after {offset + done} bytes, before the {offset + size} a part needs: it "
                              "changed while it was being uploaded")
        sink.write(chunk)
        done += len(chunk)


@contextlib.contextmanager
def _as_storage_error(action: str, key: str) -> Iterator[None]:
    """An OSError of the filesystem (a full disk, something in the way) as the StorageError a store raises; and the
    ValueError of a path no filesystem takes (a NUL in it)."""
    try:
        yield
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        failure = StorageError(f"{action} {key}: {exc.strerror or exc}{where}")
        raise (refused(failure) if exc.errno in REFUSED_ERRNOS else failure) from exc
    except ValueError as exc:  # a NUL in the key
        raise refused(StorageError(f"{action} {key!r}: {exc}")) from exc
