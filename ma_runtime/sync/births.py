"""When a file's inode was created (statx's birth time): what tells a new file from the one it replaced when both
have the same inode number.

Why: ext4 (and XFS, and overlayfs over them) give a freed inode's number to the next file created. A checkpoint
renamed into place every step (Lightning's `last.ckpt`: a temporary file, then a rename over the old one) comes
back with the number of the version the sync uploaded, every second save on ext4. By (size, mtime, inode) it then
looks rewritten in place, and that takes two looks that agree, which never happens for a file replaced faster than
the cycle: the checkpoint reached the store only at the final sync. The birth time says which it is: a new inode
is born after the old one was freed, a file rewritten in place keeps its birth.

statx(2) (Linux 4.11, glibc 2.28, musl 1.2.5) through ctypes: Python has no `os.statx` before 3.15. None when it
cannot be told (no statx, a filesystem that keeps no birth time, an inode other than the one asked about): the
caller then keeps its careful rule. Loaded at the first call: a runtime that never asks pays nothing.
"""

import ctypes
import os
import struct
import threading
from typing import Callable, Optional

_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000  # the descriptor itself, not a path under it
_STATX_INO = 0x100
_STATX_BTIME = 0x800
_BUFFER = 256  # sizeof(struct statx)
_MASK = struct.Struct("=I")  # stx_mask, at 0
_INO = struct.Struct("=Q")  # stx_ino, at 32
_BTIME = struct.Struct("=qI")  # stx_btime: tv_sec, tv_nsec, at 80
_INO_AT, _BTIME_AT = 32, 80

_loaded = threading.Lock()
_function: Optional[Callable] = None
_tried = False


def born(path: str, inode: int) -> Optional[int]:
    """When the file at `path` was created (ns since the epoch), if it is still inode `inode`; else None."""
    return _birth(_AT_FDCWD, os.fsencode(path), 0, inode)


def born_of_descriptor(fd: int, inode: int) -> Optional[int]:
    """When the file open as `fd` was created (ns since the epoch), if it is inode `inode`; else None."""
    return _birth(fd, b"", _AT_EMPTY_PATH, inode)


def _birth(directory: int, path: bytes, flags: int, inode: int) -> Optional[int]:
    function = _statx()
    if function is None:
        return None
    buffer = ctypes.create_string_buffer(_BUFFER)
    if function(directory, path, flags, _STATX_INO | _STATX_BTIME, buffer) != 0:
        return None
    (mask,) = _MASK.unpack_from(buffer.raw, 0)
    (found,) = _INO.unpack_from(buffer.raw, _INO_AT)
    if mask & (_STATX_INO | _STATX_BTIME) != (_STATX_INO | _STATX_BTIME) or found != inode:
        return None
    seconds, nanoseconds = _BTIME.unpack_from(buffer.raw, _BTIME_AT)
    return seconds * 1_000_000_000 + nanoseconds


def _statx() -> Optional[Callable]:
    global _function, _tried
    with _loaded:
        if not _tried:
            _tried = True
            _function = _load()
    return _function


def _load() -> Optional[Callable]:
    try:
        function = ctypes.CDLL(None, use_errno=True).statx  # the C library the interpreter runs on
    except (OSError, AttributeError):  # no statx in this libc
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p)
    function.restype = ctypes.c_int
    return function

