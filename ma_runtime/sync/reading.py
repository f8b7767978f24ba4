"""A changed file read as the scan saw it: the sync's one way to open, read and check a file before it goes up.

Owns the rule "still the file the scan saw" (same inode; same size and mtime, or a log that only grew), the
read of a small file into memory checked unchanged after the read, the descriptor a large upload sends its
parts from, the MD5 of a file already in the store, and whether an unfinished multipart upload's file is
unchanged (resume it rather than abort it). Raises `Later` (not this cycle) or `Unreadable` (skipped, said
once); the cycle (upload_cycle.py) decides what each means.
"""

import os
import stat
from typing import Optional, Tuple

from ma_runtime.storage.transfer.hashing import md5_of
from ma_runtime.sync import births
from ma_runtime.sync.tree import Entry

MiB = 1 << 20
# Read into memory and sent with its MD5 below this; bounds memory at workers x SMALL_LIMIT.
SMALL_LIMIT = 4 * MiB


class Later(Exception):
    """Not this cycle: the file changed while it was read, or is not what the scan saw."""


class Unreadable(Exception):
    pass


def read(entry: Entry, is_log: bool) -> Tuple[bytes, Optional[int]]:
    """The file's bytes as the scan saw it, and when its inode was created (births.py; None when that cannot be
    told), or Later. O_NONBLOCK: a FIFO put there since never blocks."""
    fd = open_as_scanned(entry, is_log)
    try:
        data = _read_exactly(fd, entry.size)
        if len(data) < entry.size or not same(entry, os.fstat(fd), is_log):
            raise Later()
        return data, births.born_of_descriptor(fd, entry.ino)
    except OSError as exc:
        raise Unreadable(exc.strerror or str(exc)) from None
    finally:
        os.close(fd)


def open_as_scanned(entry: Entry, is_log: bool) -> int:
    """A descriptor of the very file the scan saw (its version stays readable whatever the path does next),
    or Later / Unreadable."""
    try:
        fd = os.open(entry.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except PermissionError:
        raise Unreadable("permission denied") from None
    except FileNotFoundError:
        raise Later() from None
    except OSError as exc:
        raise Unreadable(exc.strerror or str(exc)) from None
    try:
        before = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise Unreadable(exc.strerror or str(exc)) from None
    if not stat.S_ISREG(before.st_mode) or not same(entry, before, is_log):
        os.close(fd)
        raise Later()
    return fd


def same(entry: Entry, stats: os.stat_result, is_log: bool) -> bool:
    """Still the file the scan saw. A log may have grown (its first `size` bytes are what is sent)."""
    if stats.st_ino != entry.ino:
        return False
    if is_log:
        return stats.st_size >= entry.size
    return (stats.st_size, stats.st_mtime_ns) == (entry.size, entry.mtime_ns)


def still_same(record: dict, is_log: bool) -> bool:
    """An unfinished upload's file is unchanged since it started: resume it rather than abort it."""
    try:
        stats = os.stat(record["path"])
    except (OSError, KeyError):
        return False
    return (stats.st_mtime_ns, stats.st_ino) == (record.get("mtime_ns"), record.get("ino")) and (
        stats.st_size == record.get("size") or (is_log and stats.st_size >= record.get("size", 0)))


def md5_of_file(entry: Entry) -> str:
    fd = os.open(entry.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO swapped in never blocks
    try:
        return md5_of(fd, entry.size)
    finally:
        os.close(fd)


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
