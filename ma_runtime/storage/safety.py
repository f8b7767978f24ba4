"""Which object keys may be written under a download's destination, and where.

A bucket is not trusted to be well-formed: a key such as `data/../../etc/x`
or `/etc/x`, or a symlink already sitting in the destination, must never make
a download write outside the folder it was given. Nor may a key reach what the
transfer engine keeps for itself (its state folder, its staging folder for
partial files, when those sit inside the destination), name a file no
filesystem can hold (a part over 255 bytes, a path of 4096 bytes or more), or
land where something other than a regular file sits (a directory, a FIFO, a
device): only a regular file is ever replaced, as everywhere in the runtime
(files.py). Refusing is per key: the caller logs it, lists it in the summary
and goes on with the rest.
"""

import os
import stat
from pathlib import Path, PurePosixPath
from typing import Dict, Iterable, List, Optional, Tuple, Union

from ma_runtime.util.files import kind_of

NAME_MAX = 255  # bytes in one path part (Linux)
PATH_MAX = 4096  # bytes in a path, its terminating NUL included


def normalized(relative: str) -> str:
    """`a//b/./c/` -> `a/b/c`: the path a key names, without the empty and `.` steps S3 keys allow."""
    return "/".join(part for part in relative.split("/") if part not in ("", "."))


class _Refused(Exception):
    """A folder on the way cannot hold the key; the message says why."""


class Destination:
    """Decides, key by key, what may be written under one resolved destination folder, and where.

    Each folder is resolved once (2000 keys in a few folders cost a few resolutions, not 2000
    walks of every path step), and each file name is checked with one lstat.
    """

    def __init__(self, dest_real: Path, reserved: Iterable[Path] = ()):
        self.dest_real = dest_real
        self._root = str(dest_real)
        self._inside = self._root.rstrip("/") + "/"
        self._inside_bytes = len(self._inside.encode("utf-8", "surrogateescape"))
        # Only what lies inside the destination can be reached by a key; usually nothing does.
        self._reserved = [str(path) for path in reserved if str(path).startswith(self._inside)]
        self._folders: Dict[str, Union[Path, _Refused]] = {"": dest_real}

    def refusal(self, relative: str, folder: bool = False) -> Optional[str]:
        """Why the key part `relative` may not be written here, or None when it may."""
        return self.place(relative, folder)[1]

    def place(self, relative: str, folder: bool = False) -> Tuple[Optional[str], Optional[str]]:
        """(the path the key part `relative` resolves to, relative to the destination, None), or
        (None, why it may not be written). `folder`: the key is a directory marker."""
        if relative.startswith("/"):
            return None, "absolute path"
        if ".." in relative.split("/"):
            return None, "'..' in the path"
        path = normalized(relative)
        if not path:
            return None, "names the destination itself"
        too_long = _too_long(path, self._inside_bytes)
        if too_long:
            return None, too_long
        parent, _, name = path.rpartition("/")
        # Every symlink already on the way counts, the last step included: a planted link (to a
        # folder or a file) shows as a path outside the destination.
        try:
            resolved, mode = _step(self._folder(parent), name)
        except _Refused as refused:
            return None, str(refused)
        except (OSError, RuntimeError, ValueError) as exc:  # RuntimeError: a symlink loop (< 3.13); ValueError: NUL
            return None, f"cannot be resolved ({exc})"
        text = str(resolved)
        if not text.startswith(self._inside):
            if text == self._root:
                return None, "names the destination itself"
            return None, f"resolves outside the destination (to {resolved}) through a symlink"
        return self._check(text, mode, folder)

    def _check(self, text: str, mode: Optional[int], folder: bool) -> Tuple[Optional[str], Optional[str]]:
        if len(text.encode("utf-8", "surrogateescape")) >= PATH_MAX:  # again: a symlink on the way may lengthen it
            return None, _PATH_TOO_LONG
        for reserved in self._reserved:
            if text == reserved or text.startswith(reserved + "/"):
                return None, f"names the runtime's own files ({reserved})"
        if mode is not None and not (stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode)):
            return None, f"{_kind(mode)} is in the way (only a regular file is ever replaced)"
        return text[len(self._inside):], None

    def _folder(self, folder: str) -> Path:
        """The resolved folder; raises _Refused when something other than a directory sits on the way."""
        resolved = self._folders.get(folder)
        if resolved is None:
            parent, _, name = folder.rpartition("/")
            try:
                path, mode = _step(self._folder(parent), name)
                if mode is not None and not stat.S_ISDIR(mode):
                    raise _Refused(f"{_kind(mode)} is in the way of the folder {folder}")
                resolved = path
            except _Refused as refused:
                resolved = refused
            self._folders[folder] = resolved
        if isinstance(resolved, _Refused):
            raise resolved
        return resolved


def _step(base: Path, name: str) -> Tuple[Path, Optional[int]]:
    """(`base / name` with a symlink at `name` followed to its end, the mode of what is there or None)."""
    path = base / name
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return path, None  # nothing there yet: nothing to follow
    if not stat.S_ISLNK(mode):
        return path, mode
    resolved = path.resolve()
    try:
        return resolved, os.stat(resolved).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return resolved, None  # a dangling link: what it names can be written


_PATH_TOO_LONG = f"the local path would be {PATH_MAX} bytes or longer, more than a path can be"


def _too_long(path: str, root_bytes: int) -> Optional[str]:
    """Why `path`, under a root of `root_bytes`, cannot be a file name here, or None. Checked before any
    lookup: the system answers ENAMETOOLONG only once the folders before it exist."""
    encoded = path.encode("utf-8", "surrogateescape")
    if len(encoded) > NAME_MAX:  # else no part can be longer than the whole
        longest = max(len(part) for part in encoded.split(b"/"))
        if longest > NAME_MAX:
            return f"a path part is {longest} bytes long, more than the {NAME_MAX} a file name can be"
    return _PATH_TOO_LONG if root_bytes + len(encoded) >= PATH_MAX else None


def _kind(mode: int) -> str:
    return "a file" if stat.S_ISREG(mode) else kind_of(mode)


def conflicts(files: List[str], folders: Iterable[str]) -> List[Optional[str]]:
    """For each file path, why a filesystem cannot hold it next to the others, or None.

    S3 allows objects `a` and `a/b`, and `a/b` and `a//b` (one path here); a folder
    cannot also be a file, and two objects cannot share a file. The first file for a
    path wins; a file where a folder must be loses to the folder, which holds more.
    """
    needed_folders = set(folders)
    for path in files:
        needed_folders.update(str(parent) for parent in PurePosixPath(path).parents)
    seen = set()
    reasons: List[Optional[str]] = []
    for path in files:
        if path in needed_folders:
            reasons.append("a folder of the same name has objects")
        elif path in seen:
            reasons.append("another key names the same file")
        else:
            reasons.append(None)
        seen.add(path)
    return reasons
