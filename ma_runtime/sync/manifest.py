"""What a channel's sync has put in the store: per file, the identity it was read with, its MD5 and the ETag.

One JSON document per channel in `${state dir}/sync/`, outside every synced tree (a manifest inside the tree
would be uploaded, and a job could overwrite it). Written atomically (files.py) after a cycle that changed
it, and every SAVE_SECONDS during a long one: a runtime killed mid-cycle re-sends at most what it sent
since. A manifest that does not validate entry by entry is set aside (records.py) and started afresh: the
cost is one more look at each file (an upload, or its MD5 against the store's), never a wrong skip. At start
the sync checks it against a listing of the store (`keep_listed`): an object deleted or replaced behind our
back is uploaded again.
"""

import functools
import json
import time
from pathlib import Path
from typing import Any, Dict, Iterable, NamedTuple, Optional, Tuple

from ma_runtime.util import records
from ma_runtime.util.files import write_atomically

VERSION = 1
SAVE_SECONDS = 2.0  # during a long cycle; at its end always


class Record(NamedTuple):
    identity: Tuple[int, int, int]  # size, mtime_ns, inode, as read
    md5: Optional[str]
    etag: Optional[str]
    # When the inode read was created (births.py), None when that cannot be told: an inode number the filesystem
    # gave a new file after the uploaded one was freed is not that file rewritten in place.
    born: Optional[int] = None


class Manifest:
    def __init__(self, path: Path, url: str):
        self.path = path
        self.url = url
        self.files: Dict[str, Record] = {}
        self.dirty = False
        self._saved_at = time.monotonic()

    @classmethod
    def load(cls, path: Path, url: str, log) -> "Manifest":
        """The manifest at `path`, empty when there is none, when it is another channel's or another version's, or
        when it is damaged (then set aside, records.py: every file is checked against the store again)."""
        manifest = cls(path, url)
        manifest.files = records.load(
            path, functools.partial(_valid, url=url), log, "the sync manifest",
            then="each file of the channel is looked at again (uploaded, or its MD5 compared with the store's)") or {}
        return manifest

    def get(self, relative: str) -> Optional[Record]:
        return self.files.get(relative)

    def put(self, relative: str, record: Record) -> None:
        self.files[relative] = record
        self.dirty = True

    def drop(self, relative: str) -> None:
        if self.files.pop(relative, None) is not None:
            self.dirty = True

    def keep_listed(self, listed: Dict[str, Optional[str]], key_of) -> int:
        """Forgets the files whose object is missing or has another ETag than the one recorded; returns how many."""
        stale = [relative for relative, record in self.files.items()
                 if key_of(relative) not in listed or (record.etag and listed[key_of(relative)] != record.etag)]
        for relative in stale:
            self.drop(relative)
        return len(stale)

    def save(self, force: bool = True) -> None:
        """Atomically; `force=False` only every SAVE_SECONDS. Raises OSError."""
        if not self.dirty or (not force and time.monotonic() - self._saved_at < SAVE_SECONDS):
            return
        files = {relative: [*record.identity, record.md5, record.etag, record.born]
                 for relative, record in self.files.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, json.dumps({"version": VERSION, "url": self.url, "files": files},
                                               separators=(",", ":")))
        self.dirty = False
        self._saved_at = time.monotonic()

    def relatives(self) -> Iterable[str]:
        return list(self.files)


def _valid(document: Any, url: str) -> Dict[str, Record]:
    """The files of a manifest of this channel ({} for another channel's, or another version's: not ours to judge);
    records.Invalid for anything a save of ours could not have written."""
    records.mapping(document, "the manifest")
    if records.integer(records.field(document, "version"), "`version`", 1) != VERSION:
        return {}  # another version's: its format is not this one's to judge
    if records.text(records.field(document, "url"), "`url`") != url:
        return {}
    result: Dict[str, Record] = {}
    for relative, entry in records.mapping(records.field(document, "files"), "`files`").items():
        if not _relative(relative):
            raise records.Invalid("`files`: a name that is not a relative path inside the channel's folder")
        # Five fields as an earlier runtime wrote them (no birth: the careful rule for that file, readiness.py).
        if type(entry) is not list or len(entry) not in (5, 6):
            raise records.Invalid(f"`files`: an entry is {records.described(entry)}, not [size, mtime_ns, inode, "
                                  "md5, etag, born]")
        size, mtime_ns, ino, md5, etag, born = (*entry, None) if len(entry) == 5 else entry
        if not (type(size) is int and 0 <= size <= records.INT_MAX and type(mtime_ns) is int
                and records.INT_MIN <= mtime_ns <= records.INT_MAX and type(ino) is int and 0 <= ino <= records.INT_MAX
                and (md5 is None or type(md5) is str) and (etag is None or type(etag) is str)
                and (born is None or (type(born) is int and records.INT_MIN <= born <= records.INT_MAX))):
            raise records.Invalid("`files`: an entry is not [size >= 0, mtime_ns, inode >= 0, md5 or null, "
                                  "etag or null, born or null]")
        result[relative] = Record((size, mtime_ns, ino), md5, etag, born)
    return result


def _relative(name: str) -> bool:
    """A path a walk of the folder gives: `a/b.txt`, never absolute, empty, `.`, `..` or holding a NUL."""
    return bool(name) and "\0" not in name and not name.startswith("/") and all(
        part not in ("", ".", "..") for part in name.split("/"))
