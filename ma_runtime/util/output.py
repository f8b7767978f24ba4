"""Console forwarding and the task log: worker output copied in whole lines.

Each destination (the console's stdout, the console's stderr, the task log
file) is a `Sink` with its own lock; every writer hands it complete lines, so
no line is ever split by, or merged with, another writer's line. A `LinePump`
follows one worker pipe; one reader thread per process (`_Reactor`) reads every
pipe in large chunks, and each pump cuts its chunk after its last line end: the
bytes themselves are never parsed line by line, which is what keeps forwarding
fast. A pump may also give some sinks (the console of a multi-rank job) a
per-line prefix such as `[rank-3] `: only those sinks pay for it, with a few
C-level `bytes.replace` calls per chunk.
"""

import collections
import errno
import os
import select
import threading
import time
from typing import Deque, Dict, List, Optional, Sequence, Tuple, Union

READ_SIZE = 1 << 16
# A read that brings less than this is followed by a short wait for more: a training job prints a
# line at a time, and a wake-up, a read and a write per sink cost the supervisor 60-70 µs of CPU
# however few lines they carry (benchmarks/forwarding.py, paced: 15 lines per read at 5 ms gave
# 4.75 µs per line, issue 29's goal is 2). Waiting COALESCE_SECONDS gathers the lines that follow
# (about 100 at 5 000 lines/s); a line reaches the console at most that much later, which no reader
# of a console sees. A busy writer fills whole reads and never waits (reads of COALESCE_BELOW or more).
COALESCE_BELOW = READ_SIZE // 4
COALESCE_SECONDS = 0.02
# With several pipes printing, the window grows by COALESCE_SECONDS per pipe that gave bytes (`_window`), up to
# COALESCE_MAX_SECONDS: the longest a line waits for the reader ...
COALESCE_MAX_SECONDS = 0.1
# ... and doubles with each round that brought no large read, CALM_ROUNDS times at most (20 ms -> 160 ms: the cap).
CALM_ROUNDS = 3
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


class LinePump:
    """Copies one pipe to its sinks in whole lines until EOF, keeping a tail.

    It has no thread of its own: the process's one reader (`_Reactor`) reads every pipe and feeds each pump
    what came (`_feed`); `start()` hands the pipe to it and `join()` waits for the pipe's EOF, once all its
    lines are written. The pump only holds what a pipe's bytes mean: the unfinished last line, the prefixes,
    the tail.
    """

    def __init__(self, fd: int, sinks: Sequence[SinkSpec], name: str, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES):
        self.name = f"pump-{name}"
        self.fd = fd
        # Raw sinks get whole chunks as read; prefixed ones a rewritten copy.
        self.sinks: List[Sink] = [s for s in sinks if isinstance(s, Sink)]
        self.prefixed = [(s[0], _check_prefix(s[1])) for s in sinks if not isinstance(s, Sink)]
        # The prefixed sinks by prefix (the console and the task log share a rank's): one rewrite per prefix.
        self._by_prefix: Dict[bytes, List[Sink]] = {}
        for sink, prefix in self.prefixed:
            self._by_prefix.setdefault(prefix, []).append(sink)
        self._after_cr = False  # the last chunk ended with `\r`: a leading `\n` completes that line
        self.max_line_bytes = max_line_bytes
        self._pending: List[bytes] = []  # the line being read: bytes after the last line end so far
        self._pending_bytes = 0
        self._tail: Deque[bytes] = collections.deque()
        self._tail_bytes = 0
        self.lines_split = 0
        self._emit_failed = False
        self._started = False
        self._done = threading.Event()  # set at EOF, once every line was handed to the sinks

    def start(self) -> None:
        if self._started:
            raise RuntimeError(f"{self.name} was started already")
        self._started = True
        _reactor.add(self)

    def join(self, timeout: Optional[float] = None) -> None:
        """Waits up to `timeout` seconds for the pipe's EOF (every line written), as Thread.join does."""
        if not self._started:
            raise RuntimeError(f"cannot join {self.name} before it is started")
        if not self._done.is_set():
            # Whoever joins has seen the command end: the reader stops waiting for more lines (not a window later).
            _reactor.hurry()
            self._done.wait(timeout)

    def is_alive(self) -> bool:
        return self._started and not self._done.is_set()

    # ------------------------------------------------------------------ the reader's side

    def _feed(self, chunk: bytes, out: "_Batch") -> None:
        """One read's bytes: the whole lines among them (with what was pending) go out, the rest waits."""
        cut = _last_line_end(chunk)
        if cut < 0:
            self._pending.append(chunk)
            self._pending_bytes += len(chunk)
            if self._pending_bytes >= self.max_line_bytes:
                # Bounded memory wins over one absurd line; counted and logged.
                self.lines_split += 1
                self._emit(b"".join(self._pending) + b"\n", out)
                self._pending, self._pending_bytes = [], 0
            return
        if self._pending:
            self._pending.append(chunk[: cut + 1])
            self._emit(b"".join(self._pending), out)
            self._pending, self._pending_bytes = [], 0
        else:
            self._emit(chunk[: cut + 1], out)  # the whole chunk itself (no copy) when it ends a line
        if cut + 1 < len(chunk):
            rest = chunk[cut + 1 :]
            self._pending, self._pending_bytes = [rest], len(rest)

    def _finish(self, out: "_Batch") -> None:
        """EOF: the command's last words, unterminated, become a line of their own; the pipe is closed."""
        if self._pending:
            self._emit(b"".join(self._pending) + b"\n", out)
            self._pending, self._pending_bytes = [], 0
        try:
            os.close(self.fd)
        except OSError:
            pass

    def _emit(self, data: bytes, out: "_Batch") -> None:
        try:
            for sink in self.sinks:
                out.add(sink, data, self)
            if self.prefixed:
                self._emit_prefixed(data, out)
            self._keep_tail(data)
        except Exception as exc:  # a bug of ours must not stop the draining: the worker would block on its pipe
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        if not self._emit_failed:
            self._emit_failed = True
            reporter.warn("output forwarding failed; the output is still drained", pump=self.name,
                          error=f"{type(exc).__name__}: {exc}")

    def _emit_prefixed(self, data: bytes, out: "_Batch") -> None:
        lead = not (self._after_cr and data[:1] == b"\n")
        self._after_cr = data[-1:] == b"\r"
        for prefix, sinks in self._by_prefix.items():
            rewritten = prefix_lines(data, prefix, lead)
            for sink in sinks:
                out.add(sink, rewritten, self)

    def _keep_tail(self, data: bytes) -> None:
        self._tail.append(data[-TAIL_BYTES:])
        self._tail_bytes += len(self._tail[-1])
        while self._tail_bytes - len(self._tail[0]) >= TAIL_BYTES:
            self._tail_bytes -= len(self._tail.popleft())

    def tail_lines(self, count: int) -> List[str]:
        text = b"".join(self._tail).decode("utf-8", "replace")
        lines = [line for line in text.replace("\r", "\n").split("\n") if line.strip()]
        return lines[-count:]


class _Batch:
    """What one round of reads gives each sink: written as one write per sink (its lock keeps it whole).

    Each piece is whole lines of one pipe, added in the order read, so a sink still gets every pipe's lines
    in order and never a line cut; what the batch saves is the writes (and lock hand-offs): the console's
    stdout, its stderr and the task log take one write per round whatever the number of ranks, a rank's
    proc log one for its stdout and stderr together.
    """

    def __init__(self) -> None:
        # By the sink object itself (a Sink hashes by identity): its pieces, and the pumps they came from.
        self._by_sink: Dict[Sink, Tuple[List[bytes], List[LinePump]]] = {}

    def add(self, sink: Sink, data: bytes, pump: LinePump) -> None:
        entry = self._by_sink.get(sink)
        if entry is None:
            self._by_sink[sink] = ([data], [pump])
        else:
            entry[0].append(data)
            entry[1].append(pump)

    def flush(self) -> None:
        for sink, (pieces, pumps) in self._by_sink.items():
            try:
                sink.write(pieces[0] if len(pieces) == 1 else b"".join(pieces))
            except Exception as exc:  # a Sink never raises; another destination (a bug of ours) must not stop the reads
                for pump in pumps:
                    pump._failed(exc)
        self._by_sink.clear()


class _Reactor:
    """The process's one reader of every pump's pipe: a thread that waits on them all with epoll.

    A thread per pipe woke once per line a rank printed, and the thread hand-offs grew with the ranks
    (benchmarks/forwarding.py, 64 ranks at 5 000 lines/s in all: 80 µs of supervisor CPU per line, 1.9 with one).
    Here, once a pipe is readable, the reader waits for the coalescing window (`_window`), then reads every
    pipe that is ready, once each, and writes each sink once (`_Batch`). A reader that fills a large part of
    a read (a busy writer) does not wait: the next round starts at once, as a blocked writer needs.

    The thread is a daemon, started with the first pipe and ended when the last one reaches EOF (started again
    by the next). Signals: Python runs handlers in the main thread only, and nothing here is shared with them.
    A fork's child (the guard) gets a fresh reactor without the parent's epoll or thread (`_after_fork_in_child`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the pumps, the epoll and the thread: changed by add() and by the reader
        self._pumps: Dict[int, LinePump] = {}
        self._epoll: Optional[select.epoll] = None
        self._thread: Optional[threading.Thread] = None
        self._warned = False
        self._hurry = threading.Event()  # set by a join: the window ends now

    def add(self, pump: LinePump) -> None:
        with self._lock:
            if self._epoll is None:
                self._epoll = select.epoll()
            # Registered from this thread while the reader may be waiting: epoll takes it at once.
            self._epoll.register(pump.fd, select.EPOLLIN)
            self._pumps[pump.fd] = pump
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, args=(self._epoll,), name="output-reader",
                                                daemon=True)
                self._thread.start()

    def hurry(self) -> None:
        self._hurry.set()

    def _run(self, epoll: select.epoll) -> None:
        busy, reading, calm = False, 1, 0
        while True:
            try:
                events = epoll.poll()
                if not busy and any(event & _GONE == 0 for _, event in events):
                    # A line came: give the lines that follow it, on this pipe and the others, time to come
                    # too. (A pipe whose writers all left has nothing more to wait for; nor has a join.)
                    if self._hurry.wait(_window(reading, calm)):
                        self._hurry.clear()
                    events = epoll.poll(0)
                busy, reading, ended = self._round(events)
                calm = 0 if busy else min(calm + 1, CALM_ROUNDS)
                if ended and self._drop(epoll, ended):
                    return
            except Exception as exc:  # a bug of ours: said once, and the pipes still drained
                self._failed(exc)
                time.sleep(COALESCE_SECONDS)

    def _round(self, events) -> Tuple[bool, int, List[LinePump]]:
        """Reads each ready pipe once and writes what came: (a read was large, pipes that gave bytes, EOFs)."""
        batch = _Batch()
        busy, reading, ended = False, 0, []
        for fd, event in events:
            pump = self._pumps.get(fd)
            if pump is None:
                continue
            chunk = _read(fd)
            if chunk:
                reading += 1
                busy = busy or len(chunk) >= COALESCE_BELOW
                pump._feed(chunk, batch)
                if event & _GONE:  # its writers left: what is left, and the EOF, now rather than a round later
                    while chunk:
                        chunk = _read(fd)
                        if chunk:
                            pump._feed(chunk, batch)
            if chunk is not None and not chunk:
                ended.append(pump)
        for pump in ended:
            self._unregister(pump)  # before its fd is closed: a new pipe may get the same number at once
            pump._finish(batch)
        batch.flush()
        for pump in ended:
            pump._done.set()
        return busy, reading, ended

    def _unregister(self, pump: LinePump) -> None:
        with self._lock:
            if self._pumps.get(pump.fd) is pump:
                del self._pumps[pump.fd]
                self._epoll.unregister(pump.fd)

    def _drop(self, epoll: select.epoll, ended: List[LinePump]) -> bool:
        """True when no pipe is left: the thread ends, and the next `add` starts another."""
        with self._lock:
            if self._pumps or self._epoll is not epoll:
                return False
            self._thread = None
            self._epoll = None
            epoll.close()
            return True

    def _failed(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            reporter.warn("output forwarding failed; the output is still drained", pump="output-reader",
                          error=f"{type(exc).__name__}: {exc}")


_GONE = select.EPOLLHUP | select.EPOLLERR  # every writer of the pipe closed it (or it broke)


def _read(fd: int) -> Optional[bytes]:
    """A chunk of the pipe, b"" at its end, None when nothing is there (a pipe someone made non-blocking)."""
    try:
        return os.read(fd, READ_SIZE)
    except BlockingIOError:
        return None
    except OSError:  # EIO and the like: the pipe is over, as at EOF
        return b""


def _window(reading: int, calm: int) -> float:
    """How long the reader waits after a line for the ones that follow: `reading` pipes gave bytes in the last
    round, and the last `calm` rounds (CALM_ROUNDS at most) brought no large read.

    A round costs a cold wake-up (about 300 µs of CPU with one pipe on 2 shared cores), and a read and a write
    per rank's log (about 26 µs per pipe, 64 ranks) whatever the lines: the longer the window, the more lines
    share them. It starts at COALESCE_SECONDS, as each pipe's own thread once waited, doubles with each calm
    round and grows with the pipes printing, up to COALESCE_MAX_SECONDS: the most a line is held back. A large
    read starts it over (`calm` 0): a writer that bursts is blocked on its full pipe a window at most, once.
    5 000 lines/s from 64 ranks: 8 lines per pipe per round at 100 ms, where 20 ms gave 1.5.
    """
    return min(COALESCE_MAX_SECONDS, COALESCE_SECONDS * max(1, reading) * (1 << calm))


_reactor = _Reactor()


def _after_fork_in_child() -> None:
    # The child (the guard, forked by the supervisor) has no reader thread, and the parent's epoll is shared
    # with it: a fresh reactor, and the inherited epoll closed (in the child only). Nothing is locked here, as
    # the parent's lock may have been held by another thread at the fork.
    global _reactor
    inherited, _reactor = _reactor._epoll, _Reactor()
    if inherited is not None:
        inherited.close()


os.register_at_fork(after_in_child=_after_fork_in_child)


def tail_of(pumps: Sequence[LinePump], count: int, prefer: Optional[LinePump] = None) -> List[str]:
    """The last lines of a worker: stderr first (tracebacks live there), else stdout."""
    ordered = ([prefer] if prefer else []) + [p for p in pumps if p is not prefer]
    for pump in ordered:
        lines = pump.tail_lines(count)
        if lines:
            return lines
    return []
