"""Console forwarding and the task log: worker output copied in whole lines.

Each destination (the console's stdout, the console's stderr, the task log
file) is a `Sink` with its own lock; every writer hands it complete lines, so
no line is ever split by, or merged with, another writer's line. A `LinePump`
thread reads one worker pipe in large chunks and cuts each chunk after its last
line end: the bytes themselves are never parsed line by line, which is what
keeps forwarding fast. A pump may also give some sinks (the console of a
multi-rank job) a per-line prefix such as `[rank-3] `: only those sinks pay for
it, with a few C-level `bytes.replace` calls per chunk.
"""

import collections
import errno
import os
import select
import threading
import time
from typing import Deque, List, Optional, Sequence, Tuple, Union

READ_SIZE = 1 << 16
# A read that brings less than this is followed by a short wait for more: a training job prints a
# line at a time, and a wake-up, a read and a write per sink cost the supervisor 60-70 µs of CPU
# however few lines they carry (benchmarks/forwarding.py, paced: 15 lines per read at 5 ms gave
# 4.75 µs per line, issue 29's goal is 2). Waiting COALESCE_SECONDS gathers the lines that follow
# (about 100 at 5 000 lines/s); a line reaches the console at most that much later, which no reader
# of a console sees. A busy writer fills whole reads and never waits.
COALESCE_BELOW = READ_SIZE // 4
COALESCE_SECONDS = 0.02
# `\r` ends a line too: progress bars (tqdm) redraw with it and never print `\n`.
LINE_ENDS = (b"\n", b"\r")
DEFAULT_MAX_LINE_BYTES = 64 << 20
TAIL_BYTES = 16 << 10


class Reporter:
    """How sinks tell of their troubles; `logs` installs one that writes runtime log lines."""

    def warn(self, message: str, **fields) -> None:
        """A warning for the runtime's log (called outside every sink's lock)."""

    def line(self, message: str, **fields) -> bytes:
        """One log line to write into a sink that works again."""
        return f"{message}\n".encode("utf-8", "backslashreplace")


reporter = Reporter()


def set_reporter(new: Reporter) -> None:
    global reporter
    reporter = new


class _State:
    """What every Sink on one descriptor shares: the lock that keeps lines whole, and how writing goes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gone = False  # for good: a console whose reader left, or a closed sink
        self.failure: Optional[OSError] = None  # writing failed; tried again every RETRY_SECONDS
        self.retry_at = 0.0
        self.lost = 0  # bytes dropped since the failure
        self.mid_line = False  # the failed write stopped inside a line


class Sink:
    """One output file descriptor, shared by several writers.

    A write never raises: a worker's pipe must be drained whatever happens to one destination, or
    the worker blocks on a full pipe. A console whose reader went away (EPIPE, EBADF) is dropped for
    good. Any other failure (ENOSPC, EDQUOT, EFBIG, EROFS, EIO, ...) sets the sink aside with one
    warning, counts what is lost, and tries again every RETRY_SECONDS: when space comes back the
    sink carries on, after a line saying how much was lost.
    """

    RETRY_SECONDS = 1.0

    def __init__(self, fd: int, name: str, owns_fd: bool = False, console: Optional[bool] = None,
                 state: Optional[_State] = None):
        self.fd = fd
        self.name = name
        self._owns_fd = owns_fd
        # The console is the runtime's own stdout/stderr (what `kubectl logs` shows);
        # it alone gets a rank prefix, a log file keeps the worker's raw lines.
        self.console = (not owns_fd and fd in (1, 2)) if console is None else console
        self._state = state or _State()

    @classmethod
    def open_append(cls, path: str) -> "Sink":
        from ma_runtime.util.files import open_append

        return cls(open_append(path), path, owns_fd=True)

    def as_console(self) -> "Sink":
        """The same destination, labelled like a console (rank prefixes), sharing its lock and state."""
        return Sink(self.fd, self.name, console=True, state=self._state)

    @property
    def broken(self) -> bool:
        return self._state.gone or self._state.failure is not None

    @property
    def lost(self) -> int:
        return self._state.lost

    def write(self, data: bytes) -> None:
        state = self._state
        with state.lock:
            if state.gone:
                return
            if state.failure is not None and not self._resume(data):
                return
            news = self._write_all(data)
        if news:
            reporter.warn(news[0], **news[1])

    def _write_all(self, data: bytes):
        """Writes `data`; on failure records it and returns the warning to give, else None."""
        view = memoryview(data)
        try:
            while view:
                try:
                    view = view[os.write(self.fd, view):]
                except BlockingIOError:  # a console someone else made non-blocking: wait, as a blocking write would
                    select.select([], [self.fd], [], self.RETRY_SECONDS)
        except OSError as exc:
            return self._fail(exc, data, len(data) - len(view))
        return None

    def _fail(self, exc: OSError, data: bytes, written: int):
        state = self._state
        state.lost += len(data) - written
        if not self._owns_fd and exc.errno in (errno.EPIPE, errno.EBADF):
            # `ma-run ... | head`: the reader is gone and will not come back.
            state.gone = True
            return ("output stopped: its reader went away", {"sink": self.name, "error": exc.strerror})
        state.failure = exc
        state.retry_at = time.monotonic() + self.RETRY_SECONDS
        state.mid_line = written > 0 and data[written - 1:written] not in LINE_ENDS
        return (f"cannot write {self.name}: set aside, retried every {self.RETRY_SECONDS:g} s; the command and the "
                "other outputs carry on", {"error": exc.strerror or str(exc)})

    def _resume(self, data: bytes) -> bool:
        """Called with the lock held while failing: True once the sink works again (the note is written)."""
        state = self._state
        now = time.monotonic()
        if now < state.retry_at:
            state.lost += len(data)
            return False
        note = (b"\n" if state.mid_line else b"") + reporter.line(
            f"{state.lost} bytes of output were lost while {self.name} could not be written",
            error=state.failure.strerror or str(state.failure), level="warning")
        try:
            written = os.write(self.fd, note)
        except OSError:
            state.retry_at = now + self.RETRY_SECONDS
            state.lost += len(data)
            return False
        if written < len(note):  # space for part of the note only: the disk is still full
            state.mid_line, state.retry_at = True, now + self.RETRY_SECONDS
            state.lost += len(data)
            return False
        state.failure, state.lost, state.mid_line = None, 0, False
        return True

    def close(self) -> None:
        with self._state.lock:
            if self._owns_fd:
                os.close(self.fd)
                self._owns_fd = False
            self._state.gone = True


def _last_line_end(chunk: bytes) -> int:
    return max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))  # LINE_ENDS, without a generator per chunk


# A sink, or a (sink, prefix) pair whose sink gets `prefix` before every line.
SinkSpec = Union[Sink, Tuple[Sink, bytes]]


def prefix_lines(data: bytes, prefix: bytes, lead: bool = True) -> bytes:
    r"""`data` (whole lines) with `prefix` at the start of every line.

    `\r\n` is one line end, not two (else a Windows-style line would gain an
    empty prefixed line). `lead=False` leaves the first line bare: it is the `\n`
    that completes a `\r` the previous chunk ended with.
    """
    if not prefix:
        return data
    out = data.replace(b"\n", b"\n" + prefix)
    if b"\r" in data:
        out = out.replace(b"\r", b"\r" + prefix).replace(b"\r" + prefix + b"\n", b"\r\n")
    # `data` ends with a line end, so `out` ends with a prefix that starts no line.
    return (prefix if lead else b"") + out[: -len(prefix)]


def _check_prefix(prefix: bytes) -> bytes:
    # A line end inside the prefix would break the very lines it labels.
    if not isinstance(prefix, bytes) or any(end in prefix for end in LINE_ENDS):
        raise ValueError(f"a line prefix must be bytes without line ends, not {prefix!r}")
    return prefix


class LinePump(threading.Thread):
    """Copies one pipe to its sinks in whole lines until EOF, keeping a tail."""

    def __init__(self, fd: int, sinks: Sequence[SinkSpec], name: str, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES):
        super().__init__(name=f"pump-{name}", daemon=True)
        self.fd = fd
        # Raw sinks get whole chunks as read; prefixed ones a rewritten copy.
        self.sinks: List[Sink] = [s for s in sinks if isinstance(s, Sink)]
        self.prefixed = [(s[0], _check_prefix(s[1])) for s in sinks if not isinstance(s, Sink)]
        self._after_cr = False  # the last chunk ended with `\r`: a leading `\n` completes that line
        self.max_line_bytes = max_line_bytes
        self._tail: Deque[bytes] = collections.deque()
        self._tail_bytes = 0
        self.lines_split = 0
        self._emit_failed = False

    def run(self) -> None:
        pending: List[bytes] = []
        pending_bytes = 0
        try:
            while True:
                chunk = self._read()
                if not chunk:
                    break
                cut = _last_line_end(chunk)
                if cut < 0:
                    pending.append(chunk)
                    pending_bytes += len(chunk)
                    if pending_bytes >= self.max_line_bytes:
                        # Bounded memory wins over one absurd line; counted and logged.
                        self.lines_split += 1
                        self._emit(b"".join(pending) + b"\n")
                        pending, pending_bytes = [], 0
                    continue
                pending.append(chunk[: cut + 1])
                self._emit(b"".join(pending))
                rest = chunk[cut + 1 :]
                pending, pending_bytes = ([rest], len(rest)) if rest else ([], 0)
        finally:
            if pending:
                # The command's last words, unterminated: keep them as their own line.
                self._emit(b"".join(pending) + b"\n")
            os.close(self.fd)

    def _read(self) -> bytes:
        """The next chunk, b"" at EOF; a small one grows by what arrives in the next COALESCE_SECONDS."""
        chunk = os.read(self.fd, READ_SIZE)
        if not chunk or len(chunk) >= COALESCE_BELOW:
            return chunk
        time.sleep(COALESCE_SECONDS)
        parts = [chunk]
        size = len(chunk)
        # Only what is there already. EOF (readable, empty) ends the gathering; the next read sees it again.
        while size < READ_SIZE and select.select([self.fd], [], [], 0)[0]:
            more = os.read(self.fd, READ_SIZE - size)
            if not more:
                break
            parts.append(more)
            size += len(more)
        return b"".join(parts)

    def _emit(self, data: bytes) -> None:
        try:
            self._emit_all(data)
        except Exception as exc:  # a bug of ours must not stop the draining: the worker would block on its pipe
            if not self._emit_failed:
                self._emit_failed = True
                reporter.warn("output forwarding failed; the output is still drained", pump=self.name,
                              error=f"{type(exc).__name__}: {exc}")

    def _emit_all(self, data: bytes) -> None:
        for sink in self.sinks:
            sink.write(data)
        if self.prefixed:
            self._emit_prefixed(data)
        self._keep_tail(data)

    def _emit_prefixed(self, data: bytes) -> None:
        # One write per sink for the whole chunk: the Sink's lock keeps it whole.
        lead = not (self._after_cr and data[:1] == b"\n")
        self._after_cr = data[-1:] == b"\r"
        for sink, prefix in self.prefixed:
            sink.write(prefix_lines(data, prefix, lead))

    def _keep_tail(self, data: bytes) -> None:
        self._tail.append(data[-TAIL_BYTES:])
        self._tail_bytes += len(self._tail[-1])
        while self._tail_bytes - len(self._tail[0]) >= TAIL_BYTES:
            self._tail_bytes -= len(self._tail.popleft())

    def tail_lines(self, count: int) -> List[str]:
        text = b"".join(self._tail).decode("utf-8", "replace")
        lines = [line for line in text.replace("\r", "\n").split("\n") if line.strip()]
        return lines[-count:]


def tail_of(pumps: Sequence[LinePump], count: int, prefer: Optional[LinePump] = None) -> List[str]:
    """The last lines of a worker: stderr first (tracebacks live there), else stdout."""
    ordered = ([prefer] if prefer else []) + [p for p in pumps if p is not prefer]
    for pump in ordered:
        lines = pump.tail_lines(count)
        if lines:
            return lines
    return []
