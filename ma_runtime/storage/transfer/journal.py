"""The state a download or upload keeps between runs: the ETag journal of a download's files, and the checks
of the download and upload records read back."""

import json
import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from ma_runtime.storage.transfer.utils import remove
from ma_runtime.util import records
from ma_runtime.util.files import open_append, write_atomically

JOURNAL_BATCH = 256  # journal lines written at a time


# How every line of a journal begins (json.dumps of {"key": ..., "etag": ...}): what a torn line still shows.
_JOURNAL_LINE_START = '{"key": '


class Journal:
    """The ETag each file of one download was written from, as JSON lines appended as files land.

    Lines are written in batches of JOURNAL_BATCH (and at the end) by one write(2) on a descriptor
    opened once: per file, that is a list append. A crash loses at most the last batch, which
    costs nothing but a check: a file at its final path with the right size and no journal line
    is taken as it is, as after a download by another tool; only a change of ETag at the same size
    goes unnoticed for those files. A torn last line is skipped on reading, and the next batch
    starts on a line of its own. A store without ETags writes no journal.
    """

    def __init__(self, path: Path, log):
        self.path = path
        self.lock = threading.Lock()
        self.fd: Optional[int] = None
        self.pending: List[str] = []
        self.torn = False  # the file ends inside a line: the next batch starts on a new one
        self.etags: Dict[str, Optional[str]] = {}
        found = records.load(path, lambda journal: journal, log, "a download's journal",
                             then="files already in place are taken by their size", parse=_parse_journal)
        if found is not None:
            self.etags, self.torn = found

    def lookup(self, key: str) -> Tuple[bool, Optional[str]]:
        return key in self.etags, self.etags.get(key)

    def add(self, key: str, etag: Optional[str]) -> None:
        if etag is None:
            return
        with self.lock:
            self.etags[key] = etag
            self.pending.append(key)
            if len(self.pending) >= JOURNAL_BATCH:
                self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        lines = "".join(json.dumps({"key": key, "etag": self.etags[key]}, ensure_ascii=False) + "\n"
                        for key in self.pending)
        self.pending = []
        if self.fd is None:
            self.fd = open_append(self.path)
            if self.torn:
                lines = "\n" + lines  # after a torn last line, so it does not swallow the next one
        os.write(self.fd, lines.encode("utf-8", "surrogateescape"))

    def close(self) -> None:
        """Writes what is pending and closes the file; on a full disk, the lines are lost, not the download."""
        with self.lock:
            try:
                self._flush()
            except OSError:
                pass
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None

    def compact(self, keys: Set[str]) -> None:
        """Rewrites the journal with only the keys still listed, so reruns do not grow it."""
        self.close()
        with self.lock:
            kept = {key: etag for key, etag in self.etags.items() if key in keys}
            if not kept:
                remove(self.path)
                return
            write_atomically(self.path, "".join(json.dumps({"key": k, "etag": e}, ensure_ascii=False) + "\n"
                                                for k, e in kept.items()).encode("utf-8", "surrogateescape"))


def valid_download(document: Any) -> dict:
    """A download's record: the object's identity as listed, the part size, and the parts already in the file."""
    records.exactly(records.mapping(document, "the record"), ("url", "size", "etag", "part_size", "done"),
                    "the record")
    records.text(document["url"], "`url`")
    records.text(document["etag"], "`etag`", optional=True)
    parts = _parts_of(document)
    done = document["done"]
    if not isinstance(done, list):
        raise records.Invalid(f"`done`: a list is wanted, found {records.described(done)}")
    for index in done:
        records.integer(index, "`done`: a part", 0, parts - 1)
    return document


_UPLOAD_FIELDS = ("url", "bucket", "key", "path", "size", "mtime_ns", "ino", "part_size", "upload_id", "parts")


def valid_upload(document: Any) -> dict:
    """An upload's record: the file's identity, the upload id ("" before the upload was created), the parts sent."""
    records.mapping(document, "the record")
    records.exactly({name: value for name, value in document.items() if name != "started"}, _UPLOAD_FIELDS,
                    "the record")
    for name in ("url", "bucket", "key", "path", "upload_id"):
        records.text(document[name], f"`{name}`")
    records.integer(document["mtime_ns"], "`mtime_ns`")
    records.integer(document["ino"], "`ino`", 0)
    if "started" in document:
        records.number(document["started"], "`started`")
    parts = _parts_of(document)
    for number, etag in records.mapping(document["parts"], "`parts`").items():
        if not (number.isascii() and number.isdigit() and 1 <= int(number) <= parts):
            raise records.Invalid(f"`parts`: a part number that is not one of 1..{parts}")
        records.text(etag, "`parts`: an ETag")
    return document


def _parts_of(document: dict) -> int:
    """How many parts the record's `size` and `part_size` make."""
    size = records.integer(document["size"], "`size`", 0)
    return -(-size // records.integer(document["part_size"], "`part_size`", 1))


def _parse_journal(data: bytes) -> Tuple[Dict[str, Optional[str]], bool]:
    """(key -> ETag, whether the last line is torn). A line a crash cut short (a start of `{"key": ...`: the last
    line, or one the next batch's newline ended) is skipped; any other line that is not {"key": str, "etag": str}
    makes the journal Invalid."""
    etags: Dict[str, Optional[str]] = {}
    torn = bool(data) and not data.endswith(b"\n")
    lines = data.split(b"\n")
    for line in lines[:-1]:  # the last is b"" after a newline, or the torn line
        text = line.decode("utf-8", "surrogateescape")  # as written: a key may hold bytes that are not UTF-8
        try:
            entry = records.decode_text(text)
        except records.NotJSON:
            if text.startswith(_JOURNAL_LINE_START) or _JOURNAL_LINE_START.startswith(text):
                continue
            raise
        records.exactly(records.mapping(entry, "a line"), ("key", "etag"), "a line")
        etags[records.text(entry["key"], "a line's `key`")] = records.text(entry["etag"], "a line's `etag`")
    return etags, torn
