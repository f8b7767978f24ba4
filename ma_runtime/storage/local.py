"""The local backend: local paths and file:// URLs behave like a bucket, so ma-run needs no object store.

Keys are absolute paths and `bucket` is always "". Uploads are atomic
(write-temp-then-rename), like every write the runtime makes.
"""

import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator, List, Tuple

from ma_runtime.storage.base import NotFound, ObjectInfo, StorageError

CHUNK = 1 << 20


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
                yield ObjectInfo(path, os.path.getsize(path))

    def head(self, bucket: str, key: str) -> ObjectInfo:
        try:
            stats = os.stat(key)
        except OSError:
            raise NotFound(f"{key} does not exist") from None
        if not os.path.isfile(key):
            raise NotFound(f"{key} is not a file")
        return ObjectInfo(key, stats.st_size)

    def read_range(self, bucket: str, key: str, start: int, length: int, fd: int, offset: int,
                   digest=None, whole: bool = False) -> int:
        done = 0
        try:
            with open(key, "rb") as source:
                while done < length:
                    chunk = os.pread(source.fileno(), min(CHUNK, length - done), start + done)
                    if not chunk:
                        raise StorageError(f"{key} is shorter than expected ({start + done} bytes)")
                    os.pwrite(fd, chunk, offset + done)
                    if digest is not None:
                        digest.update(chunk)
                    done += len(chunk)
        except FileNotFoundError:
            raise NotFound(f"{key} does not exist") from None
        return done

    def put_file(self, bucket: str, key: str, path: str) -> ObjectInfo:
        target = Path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
        shutil.copyfile(path, tmp)
        os.replace(tmp, target)
        return ObjectInfo(key, target.stat().st_size)

    def create_multipart(self, bucket: str, key: str) -> str:
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
        target = Path(key)
        tmp = target.with_name(f".{target.name}.{upload_id[:8]}.tmp")
        with open(tmp, "wb") as sink:
            for number, _etag in sorted(parts):
                with open(parts_dir / f"{number:05d}", "rb") as source:
                    shutil.copyfileobj(source, sink, CHUNK)
        os.replace(tmp, target)
        shutil.rmtree(parts_dir, ignore_errors=True)
        return ObjectInfo(key, target.stat().st_size)

    def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        shutil.rmtree(self._parts_dir(key, upload_id), ignore_errors=True)

    @staticmethod
    def _parts_dir(key: str, upload_id: str) -> Path:
        target = Path(key)
        return target.with_name(f".{target.name}.{upload_id[:8]}.parts")
