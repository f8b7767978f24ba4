"""What a channel's sync has put in the store: per file, the identity it was read with, its MD5 and the ETag.

One JSON document per channel in `${state dir}/sync/`, outside every synced tree (a manifest inside the tree
would be uploaded, and a job could overwrite it). Written atomically (files.py) after a cycle that changed
it, and every SAVE_SECONDS during a long one: a runtime killed mid-cycle re-sends at most what it sent
since. A manifest that cannot be read is started afresh: the cost is one upload of each file, never a
wrong skip. At start the sync checks it against a listing of the store (`keep_listed`): an object deleted
or replaced behind our back is uploaded again.
"""

import json
import time
from pathlib import Path
from typing import Dict, Iterable, NamedTuple, Optional, Tuple

from ma_runtime.files import RECORD_LIMIT, read_regular, write_atomically

VERSION = 1
SAVE_SECONDS = 2.0  # during a long cycle; at its end always


class Record(NamedTuple):
    identity: Tuple[int, int, int]  # size, mtime_ns, inode, as read
    md5: Optional[str]
    etag: Optional[str]


class Manifest:
    def __init__(self, path: Path, url: str):
        self.path = path
        self.url = url
        self.files: Dict[str, Record] = {}
        self.dirty = False
        self._saved_at = time.monotonic()

    @classmethod
    def load(cls, path: Path, url: str) -> "Manifest":
        manifest = cls(path, url)
        try:
            document = json.loads(read_regular(path, RECORD_LIMIT) or b"null")
        except (OSError, ValueError):
            document = None
        if isinstance(document, dict) and document.get("version") == VERSION and document.get("url") == url:
            try:
                for relative, (size, mtime_ns, ino, md5, etag) in document["files"].items():
                    manifest.files[relative] = Record((size, mtime_ns, ino), md5, etag)
            except (AttributeError, KeyError, TypeError, ValueError):  # not ours, or edited: start afresh
                manifest.files = {}
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
        files = {relative: [*record.identity, record.md5, record.etag] for relative, record in self.files.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, json.dumps({"version": VERSION, "url": self.url, "files": files},
                                               separators=(",", ":")))
        self.dirty = False
        self._saved_at = time.monotonic()

    def relatives(self) -> Iterable[str]:
        return list(self.files)
