"""Partial files: the staging folder they are written in (on the destination's filesystem and mount, where no
key can reach), how one is opened, and the check of what is about to be renamed into place."""

import dataclasses
import os
import re
import stat
from pathlib import Path
from typing import List, Optional, Tuple

from ma_runtime.storage.base import CorruptTransfer, ObjectInfo, StorageError
from ma_runtime.storage.transfer.hashing import md5_of
from ma_runtime.storage.transfer.utils import name_digest, remove
from ma_runtime.util.files import NotAFile, kind_of

PARTIAL_SUFFIX = ".ma-partial"
# The staging folder at a destination's root, when a rename from `<state_dir>/partial` cannot reach it.
STAGING_NAME = ".ma-runtime-partial"


@dataclasses.dataclass(frozen=True)
class Item:
    """One object to fetch and the file it becomes."""

    info: ObjectInfo
    url: str
    target: Path


class Staging:
    """The folder partial files are written in: on the destination's filesystem, where no key can reach."""

    def __init__(self, state_dir: Path, root: Path):
        self.root = root
        outside = state_dir / "partial"
        inside = root / STAGING_NAME
        _make_private_folder(outside)
        self.in_tree = not _rename_works_between(outside, root)
        self.folder = inside if self.in_tree else outside
        if self.in_tree:
            _make_private_folder(inside)
        # What keys may never name, wherever they resolve to: both folders, and the records.
        self.reserved = (state_dir.resolve(), root.resolve() / STAGING_NAME)

    def path(self, target: Path) -> str:
        """The partial file of `target`: named by a digest of its path, a fixed length whatever the key."""
        return os.path.join(self.folder, name_digest(str(target)) + PARTIAL_SUFFIX)

    def close(self) -> None:
        """The in-tree folder goes once empty; what a resumable large file left stays for the rerun."""
        if self.in_tree:
            try:
                os.rmdir(self.folder)
            except OSError:
                pass


def _rename_works_between(one: Path, other: Path) -> bool:
    """Same filesystem and same mount: two bind mounts of one filesystem (two Kubernetes emptyDirs) share
    st_dev, yet a rename between them fails with EXDEV."""
    if os.stat(one).st_dev != os.stat(other).st_dev:
        return False
    mounts = _mount_points()
    return mounts is None or _mount_of(os.path.realpath(one), mounts) == _mount_of(os.path.realpath(other), mounts)


def _mount_points() -> Optional[List[Tuple[str, str]]]:
    """(mount id, mount point) of this process's mounts, in mount order; None where /proc says nothing."""
    try:
        with open("/proc/self/mountinfo", "rb") as mountinfo:
            lines = mountinfo.read().splitlines()
    except OSError:
        return None
    mounts = []
    for line in lines:
        fields = line.split(b" ")
        if len(fields) > 4:  # "id parent major:minor root mount-point ...", with octal escapes (\040 a space)
            point = re.sub(rb"\\([0-7]{3})", lambda escape: bytes([int(escape.group(1), 8)]), fields[4])
            mounts.append((fields[0].decode("ascii", "replace"), os.fsdecode(point)))
    return mounts


def _mount_of(path: str, mounts: List[Tuple[str, str]]) -> Optional[str]:
    """The mount `path` is on: the deepest mount point above it, the last one mounted there."""
    found, depth = None, -1
    for mount_id, point in mounts:
        inside = point == "/" or path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= depth:
            found, depth = mount_id, len(point)
    return found


def _make_private_folder(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    mode = os.lstat(folder).st_mode
    if not stat.S_ISDIR(mode):  # a symlink planted there would take the partial files elsewhere
        raise NotAFile(folder, "a symlink" if stat.S_ISLNK(mode) else kind_of(mode))


def open_fresh(path) -> int:
    # O_EXCL | O_NOFOLLOW: never write through a symlink someone left at the partial name.
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o666)
    except FileExistsError:  # a leftover of an earlier run (or that symlink): replace it
        remove(path)
        return os.open(path, flags, 0o666)


def verify(fd: int, partial: str, item: Item, digest: Optional[str] = None,
           composite: Optional[str] = None, by_etag: bool = True) -> Optional[Tuple[str, str]]:
    """(what, detail) wrong with the partial file about to be renamed into place, or None.

    Its size read from the file itself (its descriptor); then, when the ETag is an MD5, the file's MD5
    (`digest`, when given, was read back from it already, else it is read now); when `composite` is given,
    the ETag the parts' MD5s make (taken as the bytes arrived), compared with the object's. Not `by_etag` (the
    object is encrypted with a key, and its ETag says nothing of its bytes): the size alone. The path to be
    renamed must still be that very file: anything else there would be renamed into place unverified."""
    stats = os.fstat(fd)
    # The inode alone: overlayfs before Linux 4.19 gives a descriptor the upper layer's st_dev, and the path
    # the overlay's, for one file; a file put in its place in the same folder has another inode either way.
    if os.lstat(partial).st_ino != stats.st_ino:
        raise StorageError(f"{item.url}: the partial file {partial} was replaced while it was written",
                           hint="something else writes in the runtime's state folder")
    if stats.st_size != item.info.size:
        return "size mismatch", f"{stats.st_size} bytes, expected {item.info.size}"
    if not by_etag:
        return None
    if composite is not None:
        if composite != (item.info.etag or "").lower():
            return "checksum mismatch", f"the parts make ETag {composite}, expected {item.info.etag}"
    elif item.info.md5:
        actual = digest or md5_of(fd, stats.st_size)
        if actual != item.info.md5:
            return "checksum mismatch", f"md5 {actual}, expected {item.info.md5}"
    return None


def corrupt(item: Item, problem: Tuple[str, str]) -> CorruptTransfer:
    return CorruptTransfer(f"{item.url}: {problem[0]} after retry ({problem[1]})",
                           hint="the bytes received differed from the object twice: check the network path "
                                "(proxies) and the object")
