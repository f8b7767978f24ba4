"""Locating the platform's rank table (`RANK_TABLE_FILE`: the file or its folder), reading it (one reader for
the wait, `peek` and `convert`), and waiting for its `status: completed` until a deadline."""

import codecs
import dataclasses
import os
import time
from pathlib import Path
from typing import Callable

from ma_runtime.stages.ranktable.convert import parse_json
from ma_runtime.stages.ranktable.model import COMPLETED, FILE_NAME, NotYet, RankTableError, RankTableTimeout
from ma_runtime.util import files

POLL_SECONDS = 0.5
PROGRESS_SECONDS = 10.0
# The largest realistic table, 4096 servers x 16 devices, is 11 MB; a bigger file is no rank table, and reading
# and parsing one (100 MB: a minute, 1.8 GB) must not be what a job spends its start on.
MAX_TABLE_BYTES = 32 << 20


def locate(configured: str) -> Path:
    """`RANK_TABLE_FILE` as a file path: a directory (existing, or a missing path not ending in .json) gets
    FILE_NAME. Anything else that exists is the table itself: a device or FIFO is refused by `read_table`,
    not waited on as a folder it can never be."""
    path = Path(configured)
    if os.path.isdir(path) or (path.suffix.lower() != ".json" and not os.path.exists(path)):
        return path / FILE_NAME
    return path


@dataclasses.dataclass
class Seen:
    """What the last look at the file found: a state for the progress and timeout lines."""

    state: str  # "missing", "unreadable (<error>)", "empty", "incomplete JSON", "status=<value>", "completed"
    text: str = ""


def read_table(path: Path) -> str:
    """The file's text, for every reader of a rank table. NotYet for what a writer may still change;
    RankTableError for what it never will (see the module's docstring)."""
    try:
        data = files.read_regular(path, MAX_TABLE_BYTES)  # non-blocking: a FIFO is refused, not waited on
    except files.NotAFile as exc:  # a device or FIFO never becomes a table: no waiting for it
        raise RankTableError(f"{path} is {exc.kind}, not a rank table (expected a JSON file)",
                             hint="a rank table is the platform's jobstart_hccl.json (RANK_TABLE_FILE names it or "
                                  "its folder)") from None
    except files.TooLarge as exc:
        raise RankTableError(f"{path} is {exc.size} bytes, over the {MAX_TABLE_BYTES >> 20} MiB a rank table may "
                             "have (4096 servers of 16 devices take 11 MB)") from None
    except OSError as exc:
        raise NotYet(f"unreadable ({exc.__class__.__name__})",
                     f"cannot read the rank table {path}: {exc.strerror or exc}") from None
    if data is None:
        raise NotYet("missing", f"cannot read the rank table {path}: No such file or directory")
    return _decode(data, path)


def _decode(data: bytes, path: Path) -> str:
    # No JSON text holds a raw NUL; UTF-16 and UTF-32 text of ASCII JSON always does, or starts with a BOM.
    if data[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE) or b"\0" in data:
        raise RankTableError(f"{path}: UTF-16 or UTF-32 text (a byte-order mark or NUL bytes); a rank table is "
                             f"UTF-8 JSON", hint="write the table as UTF-8")
    codec = "utf-8-sig" if data[:3] == codecs.BOM_UTF8 else "utf-8"
    try:
        return data.decode(codec)
    except UnicodeDecodeError as exc:
        if _cut_at_the_end(data, codec):
            raise NotYet("incomplete JSON", f"{path}: ends inside a UTF-8 character (byte {exc.start}): "
                                            f"half-written") from None
        raise RankTableError(f"{path}: not UTF-8 (byte {exc.start}); a rank table is UTF-8 JSON",
                             hint="write the table as UTF-8") from None


def _cut_at_the_end(data: bytes, codec: str) -> bool:
    """True when `data` is valid up to an incomplete character at its very end (a writer mid-character)."""
    decoder = codecs.getincrementaldecoder(codec)()
    try:
        decoder.decode(data, final=False)
    except UnicodeDecodeError:
        return False
    return bool(decoder.getstate()[0])


def look(path: Path) -> Seen:
    """What the file holds now; RankTableError (not a Seen) when it can never become a completed table."""
    try:
        text = read_table(path)
    except NotYet as pending:
        return Seen(pending.state)
    if not text or text.isspace():
        return Seen("empty")
    try:
        document = parse_json(text, str(path))
    except ValueError:
        return Seen("incomplete JSON", text)  # half-written: the next look may find it whole
    status = document.get("status") if isinstance(document, dict) else None
    if status == COMPLETED:
        return Seen(COMPLETED, text)
    return Seen(f"status={status!r}" if status is not None else "no status", text)


def wait(path: Path, timeout: float, log, poll: float = POLL_SECONDS, progress: float = PROGRESS_SECONDS,
         clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> str:
    """Polls until the file says `status: completed`; returns its text. Raises RankTableTimeout at the deadline,
    RankTableError at once for a file that can never become a table."""
    started = clock()
    next_line = started + progress
    seen = look(path)
    while seen.state != COMPLETED:
        now = clock()
        if now - started >= timeout:
            raise RankTableTimeout(
                f"rank table {path} not completed after {timeout:g} s; last seen: {seen.state}",
                hint="the platform writes it once every pod of the job is scheduled; raise "
                     "MA_RUNTIME_RANKTABLE_TIMEOUT if scheduling is slow",
            )
        if now >= next_line:
            log.info("rank table waiting", path=str(path), seen=seen.state, elapsed_s=round(now - started, 1),
                     remaining_s=round(timeout - (now - started), 1))
            next_line += progress
        sleep(min(poll, max(0.0, timeout - (now - started))))
        seen = look(path)
    return seen.text
