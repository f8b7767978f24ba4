"""Which object keys may be written under a download's destination, and where.

A bucket is not trusted to be well-formed: a key such as `data/../../etc/x`
or `/etc/x`, or a symlink already sitting in the destination, must never make
a download write outside the folder it was given. Refusing is per key: the
caller logs it, lists it in the summary and goes on with the rest.
"""

import os
import stat
from pathlib import Path, PurePosixPath
from typing import Dict, Iterable, List, Optional


def normalized(relative: str) -> str:
    """`a//b/./c/` -> `a/b/c`: the path a key names, without the empty and `.` steps S3 keys allow."""
    return "/".join(part for part in relative.split("/") if part not in ("", "."))


class Destination:
    """Decides, key by key, what may be written under one resolved destination folder.

    Each folder is resolved once (2000 keys in a few folders cost a few resolutions, not 2000
    walks of every path step), and each file name is checked with one lstat.
    """

    def __init__(self, dest_real: Path):
        self.dest_real = dest_real
        self._root = str(dest_real)
        self._folders: Dict[str, Path] = {"": dest_real}

    def refusal(self, relative: str) -> Optional[str]:
        """Why the key part `relative` may not be written here, or None when it may."""
        if relative.startswith("/"):
            return "absolute path"
        if ".." in relative.split("/"):
            return "'..' in the path"
        path = normalized(relative)
        if not path:
            return "names the destination itself"
        folder, _, name = path.rpartition("/")
        # Every symlink already on the way counts, the last step included: a planted link (to a
        # folder or a file) shows as a path outside the destination.
        try:
            resolved = _step(self._folder(folder), name)
        except (OSError, RuntimeError, ValueError) as exc:  # RuntimeError: a symlink loop (< 3.13); ValueError: NUL
            return f"cannot be resolved ({exc})"
        text = str(resolved)
        if text != self._root and not text.startswith(self._root.rstrip("/") + "/"):
            return f"resolves outside the destination (to {resolved}) through a symlink"
        return None

    def _folder(self, folder: str) -> Path:
        resolved = self._folders.get(folder)
        if resolved is None:
            parent, _, name = folder.rpartition("/")
            resolved = self._folders[folder] = _step(self._folder(parent), name)
        return resolved


def _step(base: Path, name: str) -> Path:
    """`base / name` with a symlink at `name` followed to its end (`base` is already resolved)."""
    path = base / name
    try:
        is_link = stat.S_ISLNK(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return path  # nothing there yet: nothing to follow
    return path.resolve() if is_link else path


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
