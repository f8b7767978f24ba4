"""Which object keys may be written under a download's destination, and where.

A bucket is not trusted to be well-formed: a key such as `data/../../etc/x`
or `/etc/x`, or a symlink already sitting in the destination, must never make
a download write outside the folder it was given. Refusing is per key: the
caller logs it, lists it in the summary and goes on with the rest.
"""

from pathlib import Path, PurePosixPath
from typing import Iterable, List, Optional


def normalized(relative: str) -> str:
    """`a//b/./c/` -> `a/b/c`: the path a key names, without the empty and `.` steps S3 keys allow."""
    return "/".join(part for part in relative.split("/") if part not in ("", "."))


def refusal(dest_real: Path, relative: str) -> Optional[str]:
    """Why the key part `relative` may not be written under the resolved destination, or None when it may."""
    if relative.startswith("/"):
        return "absolute path"
    if ".." in relative.split("/"):
        return "'..' in the path"
    path = normalized(relative)
    if not path:
        return "names the destination itself"
    # resolve() follows every symlink that already exists on the way, the last step included,
    # so a planted link (to a folder or a file) shows as a path outside the destination.
    try:
        resolved = (dest_real / path).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # RuntimeError: a symlink loop (< 3.13); ValueError: NUL
        return f"cannot be resolved ({exc})"
    if resolved != dest_real and dest_real not in resolved.parents:
        return f"resolves outside the destination (to {resolved}) through a symlink"
    return None


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
