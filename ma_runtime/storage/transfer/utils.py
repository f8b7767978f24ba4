"""What the download and the upload sides share: the URLs and digests that name objects and state files, the
failure naming the store, the runtime's own files written and removed."""

import json
import os
import stat
from pathlib import Path

from ma_runtime.storage.base import StorageError
from ma_runtime.storage.url import Location
from ma_runtime.util.files import write_atomically


def object_url(location: Location, key: str) -> str:
    if not location.remote:
        return key
    scheme = location.text.split("://", 1)[0].lower()
    return f"{scheme}://{location.bucket}/{key}"


def name_digest(*parts) -> str:
    import hashlib

    return hashlib.sha256("\0".join(str(part) for part in parts).encode("utf-8", "surrogateescape")).hexdigest()[:32]


def naming_the_store(exc: StorageError, store, location: Location) -> StorageError:
    """The same failure, its message naming the store it talked to (the endpoint), once."""
    if not location.remote:
        return exc
    where = store.describe()
    if where in exc.reason:
        return exc
    return type(exc)(f"{exc.reason}; {where}", hint=exc.hint, stage=exc.stage)


def write_json(path: Path, data: dict) -> None:
    """Atomic (files.py): a crash leaves the old record or the new one, never half of one."""
    write_atomically(path, json.dumps(data, ensure_ascii=False))


def remove(path) -> None:
    """Removes the runtime's own file (or a link left in its place) at `path`; whatever else sits there (a FIFO,
    a folder) is not the runtime's to remove."""
    try:
        mode = os.lstat(path).st_mode
        if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
            os.unlink(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (a file where the folder should be)
        pass


def oserror_text(exc: OSError) -> str:
    where = f": {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"
