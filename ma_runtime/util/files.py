"""Every file the runtime writes goes through here: atomically, and never over something that is not a file.

A path the runtime writes to (the termination message, the converted rank table,
its records, a file `ranktable convert` is told to write) may already hold
something else: a device (`/dev/full`), a FIFO, a socket, a directory. Renaming a
temporary file over it would replace that node with a regular file, so the rule
is one place: the target must be absent or a regular file (a symlink is followed
to one, and the link is kept). Anything else is refused with `NotAFile`, which
callers turn into their own one-line error.
"""

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO, Callable, Optional, Union

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


class NotAFile(OSError):
    """The path holds something the runtime must not replace; `strerror` says what it is."""

    def __init__(self, path: Union[str, Path], kind: str):
        super().__init__(errno.EEXIST, f"{kind} is in the way (only a regular file is ever replaced)", str(path))
        self.kind = kind


def kind_of(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def writable_target(path: Union[str, Path]) -> Path:
    """The path to write: `path`, or the file a symlink at `path` leads to. Raises NotAFile when that
    exists and is not a regular file."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode  # follows symlinks: a link to a regular file is fine
    except FileNotFoundError:
        return Path(os.path.realpath(path)) if os.path.islink(path) else path  # a dangling link: write its target
    except NotADirectoryError:
        raise NotAFile(path, "a file where a directory should be") from None
    if not stat.S_ISREG(mode):
        raise NotAFile(path, kind_of(mode))
    return Path(os.path.realpath(path)) if os.path.islink(path) else path


def write_atomically(path: Union[str, Path], data: Union[bytes, str], mode: int = 0o644) -> None:
    """Writes `data` to a temporary file beside the target, then renames it into place: a reader sees the
    old file or the new one, never half of one. Raises NotAFile (see `writable_target`) or the OSError."""
    payload = data.encode("utf-8", "backslashreplace") if isinstance(data, str) else data
    write_atomically_from(path, lambda sink: sink.write(payload), mode)


def write_atomically_from(path: Union[str, Path], write: Callable[[BinaryIO], object], mode: int = 0o644) -> None:
    """`write_atomically` for what is written in pieces (a copy larger than memory): `write(sink)` fills a
    temporary file beside the target, which is renamed into place once complete."""
    target = writable_target(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as sink:
            write(sink)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# The runtime's own records (a download's journal of 10^5 keys is a few MB): more is not one of them.
RECORD_LIMIT = 64 << 20


class TooLarge(OSError):
    """A file over the size its reader allows; `size` is what it holds (or at least how much was found)."""

    def __init__(self, path: Union[str, Path], size: int, limit: int):
        super().__init__(errno.EFBIG, f"{size} bytes, over the {limit} a reader of it takes", str(path))
        self.size = size


def read_regular(path: Union[str, Path], limit: int) -> Optional[bytes]:
    """The bytes of a regular file, None when there is none: the one reader of what the runtime is given or
    keeps (a job file, a rank table, its records, the termination file).

    Opened O_NONBLOCK, so a FIFO at the path is refused (NotAFile, like a device or a directory) instead
    of waited on for a writer; a file over `limit` bytes is refused (TooLarge) from its size, before it is
    read, and if it grows past `limit` while read. The size fstat gives sizes the first read: one read
    for a whole file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise NotAFile(path, kind_of(status.st_mode))
        if status.st_size > limit:
            raise TooLarge(path, status.st_size, limit)
        chunks, total = [], 0
        while total <= limit:  # one byte past the limit tells a file that grew
            chunk = os.read(fd, min(limit + 1 - total, max(status.st_size - total + 1, 1 << 16)))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    if total > limit:
        raise TooLarge(path, total, limit)
    return b"".join(chunks)


def open_append(path: Union[str, Path]) -> int:
    """A descriptor appending to `path` (created if absent); NotAFile for anything but a regular file.

    O_NONBLOCK on the open: a FIFO at the path must be refused, not waited on for a reader."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO without reader, a directory
            writable_target(path)  # raises NotAFile naming what is there
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotAFile(path, kind_of(mode))
    os.set_blocking(fd, True)
    return fd
