"""Console forwarding and the task log: worker output copied in whole lines.

Each destination (the console's stdout, the console's stderr, the task log
file) is a `Sink` with its own lock; every writer hands it complete lines, so
no line is ever split by, or merged with, another writer's line. A `LinePump`
thread reads one worker pipe in large chunks and cuts each chunk after its last
line end: the bytes themselves are never parsed line by line, which is what
keeps forwarding fast. A pump may also give some sinks (the console of a
multi-rank job) a per-line prefix such as `[rank 3] `: only those sinks pay for
it, with a few C-level `bytes.replace` calls per chunk.
"""

import collections
import errno
import os
import threading
from typing import Deque, List, Optional, Sequence, Tuple, Union

READ_SIZE = 1 << 16
# `\r` ends a line too: progress bars (tqdm) redraw with it and never print `\n`.
LINE_ENDS = (b"\n", b"\r")
DEFAULT_MAX_LINE_BYTES = 64 << 20
TAIL_BYTES = 16 << 10


class Sink:
    """One output file descriptor, shared by several writers."""

    def __init__(self, fd: int, name: str, owns_fd: bool = False, console: Optional[bool] = None):
        self.fd = fd
        self.name = name
        self._owns_fd = owns_fd
        # The console is the runtime's own stdout/stderr (what `kubectl logs` shows);
        # it alone gets a rank prefix, a log file keeps the worker's raw lines.
        self.console = (not owns_fd and fd in (1, 2)) if console is None else console
        self._lock = threading.Lock()
        self.broken = False

    @classmethod
    def open_append(cls, path: str) -> "Sink":
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        return cls(os.open(path, flags, 0o644), path, owns_fd=True)

    def write(self, data: bytes) -> None:
        with self._lock:
            if self.broken:
                return
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(self.fd, view) :]
            except OSError as exc:
                # A closed console (`ma-run ... | head`) must not stop the task log
                # or the worker: stop writing here and carry on elsewhere.
                if exc.errno not in (errno.EPIPE, errno.EBADF, errno.EIO, errno.ENOSPC):
                    raise
                self.broken = True

    def close(self) -> None:
        with self._lock:
            if self._owns_fd:
                os.close(self.fd)
                self._owns_fd = False
            self.broken = True


def _last_line_end(chunk: bytes) -> int:
    return max(chunk.rfind(end) for end in LINE_ENDS)


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

    def run(self) -> None:
        pending: List[bytes] = []
        pending_bytes = 0
        try:
            while True:
                chunk = os.read(self.fd, READ_SIZE)
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

    def _emit(self, data: bytes) -> None:
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
