"""The progress pattern (MA_RUNTIME_PROGRESS_PATTERN): a destination of the workers' output where a line that
matches it is the attempt's progress (supervise/hang.py).

The pattern is the user's, and Python's `re` backtracks: `^(x+x+)+y` against a line of 40 `x` runs for hours,
holding the GIL all along. Matched in the thread that forwards the output, as it once was, it froze the runtime (no
signal answered, no output forwarded, no `command exited`). The choices were a linear-time engine (none in the
standard library; RE2 would be a new dependency, without Python's syntax), refusing patterns that can backtrack (no
test is both sound and complete: `(.*a){25}` is only polynomial, and still runs for hours), a time box in the
runtime (impossible: the GIL is never given back), or matching off the runtime's interpreter. This does the last:
the matching runs in a process of its own, the *matcher* (supervise/matcher.py, `python -I`, standard library
only), and the runtime only hands it lines:

- `ProgressSink.write` (called by util/output.py's reader for every pump) queues the chunk of whole lines; they go
  to the matcher on a socket, without ever waiting, at most every COALESCE_SECONDS (or as soon as 64 KiB wait). A
  matcher that falls behind has lines dropped, and counted; the workers' output never waits for it. A progress line
  lost that way only delays the progress (the next one counts).
- The matcher gives each search matcher.LINE_CPU_SECONDS of CPU at most: a line that takes more is skipped (not
  progress), the next lines are matched as usual (the matcher at a lower priority from then on), and one warning
  names the setting and how to fix it.
- A reader thread takes its answers (counts of messages matched) and calls `on_progress`, and sends what the
  pumps left waiting. A matcher that dies, or does not answer for STALL_SECONDS while it has lines, is killed
  and started again (RESTARTS times per attempt; then the pattern is off for the attempt, with a warning).
- The matcher is a helper child (children.start_helper): the reaping loop leaves it to this module, and the
  supervisor's stops, sweeps and guard, and the hang detector's tree walk, leave it out. `close()`, at the
  attempt's end (attempt_processes._HangWatch), ends it (killed: its answers no longer matter) and says what was not
  matched, if anything.

Cost (benchmarks run through the output reader, 2 shared cores): a chunk costs the reader a lock and a list append, with
a non-blocking send at most 20 times a second, where it used to decode and search it: at 5 000 lines/s, one
line a write, the runtime's CPU per line is within noise of the in-thread search (6-7 us); the matcher adds
about 1 us a line in its own process, and 30 ms of CPU to start, once an attempt.
"""

import select
import socket
import subprocess
import threading
import time
from typing import Callable, List, Optional, Tuple

from ma_runtime.process import children, lifecycle
from ma_runtime.supervise import matcher
from ma_runtime.util import output
from ma_runtime.util.output import Sink

SETTING = "MA_RUNTIME_PROGRESS_PATTERN"
RESTARTS = 3
# A matcher with lines to match that answers nothing for this long is stuck (it answers at least once per
# message that uses up its CPU, MESSAGE_TICKS * TICK_SECONDS = 1 s of CPU): killed, and started again.
STALL_SECONDS = 30.0
CHECK_SECONDS = 1.0
# Lines go to the matcher at most this often (or in full 64 KiB messages), and the reader takes its answers at
# most this often: a training job printing a line at a time costs a send, a matcher wake-up and an answer ~20
# times a second, not once a line. The progress is a tenth of a second late at most: nothing, for a hang window
# of seconds.
COALESCE_SECONDS = 0.05
EXIT_WAIT_SECONDS = 2.0
_SEND_FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
_FIX = ("rewrite it so that no line can be matched in many ways: no repetition of a repetition ((x+)+, (\\w+\\s?)+), "
        "no alternatives that match the same text ((a|a)*, (a|aa)+), anchors and literals instead of a leading .*")


def _lines(data: bytes) -> int:
    return data.count(b"\n") + data.count(b"\r") - data.count(b"\r\n")


class ProgressSink(Sink):
    """A destination of the workers' output that writes nothing: a line matching the pattern is progress."""

    def __init__(self, pattern: str, on_progress: Callable[[], None], on_off: Callable[[], None] = lambda: None):
        super().__init__(-1, "progress pattern", console=False)
        self.pattern = pattern
        self.on_progress = on_progress
        self.on_off = on_off  # told once the pattern is off for the attempt: the hang monitor's metrics decide
        self._lock = threading.Lock()  # the channel, and what was sent on it
        self._channel: Optional[socket.socket] = None  # None: closed, or no matcher now (lines are dropped)
        self._sent = 0  # messages sent to the current matcher
        # Lines waiting to be sent: the pumps send at most every COALESCE_SECONDS (or a full message), the reader
        # thread sends what waits after that.
        self._waiting: List[bytes] = []
        self._waiting_bytes = 0
        self._next_send = 0.0
        self.proc: Optional[subprocess.Popen] = None  # the current matcher
        # Messages sent, answered and matched over the attempt (all its matchers).
        self.sent = self.answered = self.matched = 0
        self._closing = False
        self._off = False  # no matcher any more (it could not be started, or restarted too often): nothing counted
        # Lines not matched: the matcher was behind (or restarting), a search used up its CPU, a line too long.
        self.dropped = self.skipped = self.too_long = 0
        self.restarts_left = RESTARTS
        self._warned = False
        started = self._start()
        self._reader = threading.Thread(target=self._run, args=(started,), name="progress-matcher", daemon=True)
        self._reader.start()

    @property
    def broken(self) -> bool:
        return False

    @property
    def unsent(self) -> int:
        """Bytes of lines waiting to be sent to the matcher."""
        return self._waiting_bytes

    # ------------------------------------------------------------------ the pumps' side

    def write(self, data: bytes) -> None:
        if len(data) > matcher.MAX_MESSAGE:
            self._write_long(data)
            return
        with self._lock:  # never held across a wait: a send does not block
            if self._channel is None:
                if not (self._closing or self._off):
                    self.dropped += _lines(data)
                return
            if self._waiting_bytes + len(data) > matcher.MAX_MESSAGE:
                self._send_waiting()  # a full message goes now
            self._waiting.append(data)
            self._waiting_bytes += len(data)
            if time.monotonic() >= self._next_send:
                self._send_waiting()

    def _send_waiting(self) -> None:
        """With the lock held: what waits, as one message, now; dropped (and counted) when the socket is full."""
        if not self._waiting:
            return
        data = self._waiting[0] if len(self._waiting) == 1 else b"".join(self._waiting)
        self._waiting.clear()
        self._waiting_bytes = 0
        self._next_send = time.monotonic() + COALESCE_SECONDS
        try:
            self._channel.send(data, _SEND_FLAGS)
        except OSError:  # full (the matcher is behind), or the matcher is gone
            self.dropped += _lines(data)
            return
        self._sent += 1
        self.sent += 1

    def _send_late(self, channel: socket.socket) -> None:
        """The reader's turn: what the pumps left waiting (they send at most every COALESCE_SECONDS)."""
        with self._lock:
            if self._channel is channel and time.monotonic() >= self._next_send:
                self._send_waiting()

    def _write_long(self, data: bytes) -> None:
        """A chunk larger than a message, in messages cut at line ends; a line longer than one is not matched
        (a progress line is short)."""
        start = 0
        while start < len(data):
            end = start + matcher.MAX_MESSAGE
            if end >= len(data):
                self.write(data[start:])
                return
            cut = max(data.rfind(b"\n", start, end), data.rfind(b"\r", start, end))
            if cut < start:
                with self._lock:
                    self.too_long += 1
                ends = [found for found in (data.find(b"\n", end), data.find(b"\r", end)) if found >= 0]
                start = min(ends) + 1 if ends else len(data)
                continue
            self.write(data[start:cut + 1])
            start = cut + 1

    def close(self) -> None:
        """Ends the matcher (its reader kills it), and says what was not matched."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            channel, self._channel = self._channel, None
        if channel is not None:
            _shut(channel)  # the reader wakes, and kills the matcher
        self._reader.join(EXIT_WAIT_SECONDS + CHECK_SECONDS + 1.0)
        if self.dropped or self.skipped or self.too_long:
            output.reporter.warn(f"{SETTING}: some output lines were not matched in this attempt",
                                 behind=self.dropped, backtracking=self.skipped, over_64KiB=self.too_long)

    # ------------------------------------------------------------------ the matcher, in the reader thread

    def _start(self) -> Optional[Tuple[subprocess.Popen, socket.socket]]:
        """A new matcher and its channel, or None (a warning) when it cannot be started."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # neither inheritable (PEP 446)
        try:
            proc = children.start_module("ma_runtime.supervise.matcher", theirs.fileno())
        except OSError as exc:
            ours.close()
            self._turn_off("its matcher could not be started", error=exc.strerror or str(exc))
            return None
        finally:
            theirs.close()  # the child's copy only: its death is then the end of our end
        try:
            ours.send(self.pattern.encode("utf-8", "surrogateescape"), socket.MSG_NOSIGNAL)
        except OSError:
            pass  # it died at once: the reader sees the end
        with self._lock:
            if self._closing:  # close() came first: this one ends at once
                _shut(ours)
            else:
                self._channel, self._sent, self.proc = ours, 0, proc
        return proc, ours

    def _run(self, started: Optional[Tuple[subprocess.Popen, socket.socket]]) -> None:
        while started is not None:
            proc, channel = started
            try:
                why: Optional[str] = self._serve(proc, channel)
            except Exception as exc:  # a bug of ours: the output and the run carry on without the pattern
                why = None
                self._turn_off("its reader failed", error=f"{type(exc).__name__}: {exc}")
            with self._lock:
                if self._channel is channel:
                    self._channel = None  # lines are dropped (and counted) until the next one
            _shut(channel)
            code = _end(proc, at_once=self._closing)
            channel.close()
            if why is None or self._closing:
                return
            if self.restarts_left <= 0:
                self._turn_off(f"its matcher {why} (no restarts left)", exit_code=code)
                return
            self.restarts_left -= 1
            output.reporter.warn(f"the matcher of {SETTING} {why}; starting a fresh one", exit_code=code,
                                 restarts_left=self.restarts_left)
            started = self._start()

    def _turn_off(self, why: str, **fields) -> None:
        self._off = True
        output.reporter.warn(f"{SETTING} is off for this attempt: {why}; the hang detector's metrics decide", **fields)
        self.on_off()

    def _serve(self, proc: subprocess.Popen, channel: socket.socket) -> str:
        """Takes the matcher's answers until its channel ends or it stalls; why it ended."""
        seen = (0, 0, 0)  # its last answer: messages done, messages matched, lines skipped
        waiting_since: Optional[float] = None  # since when it has had lines and said nothing
        answers = select.poll()  # not select(): a job with many ranks has descriptors above FD_SETSIZE
        answers.register(channel, select.POLLIN)
        while True:
            # Sooner when lines wait to be sent (read without the lock: a hint).
            wait = max(0.0, self._next_send - time.monotonic()) if self._waiting else CHECK_SECONDS
            if answers.poll(wait * 1000):
                answer, ended = _answers(channel)
                if answer is not None:
                    self._take(seen, answer)
                    seen, waiting_since = answer, None
                if ended:
                    return "exited"
                time.sleep(COALESCE_SECONDS)
                self._send_late(channel)
                continue
            self._send_late(channel)
            with self._lock:
                waiting = self._sent > seen[0] and self._channel is channel
            now = time.monotonic()
            if not waiting:
                waiting_since = None
            elif waiting_since is None:
                waiting_since = now
            elif now - waiting_since >= STALL_SECONDS:
                proc.kill()
                return f"did not answer for {STALL_SECONDS:g} s"

    def _take(self, seen: Tuple[int, int, int], answer: Tuple[int, int, int]) -> None:
        if answer[1] > seen[1]:
            self.on_progress()
        self.matched += answer[1] - seen[1]
        if answer[2] > seen[2]:
            self.skipped += answer[2] - seen[2]
            if not self._warned:
                self._warned = True
                output.reporter.warn(
                    f"{SETTING} backtracks catastrophically: matching an output line took over "
                    f"{matcher.LINE_CPU_SECONDS:g} s of CPU; such lines are skipped (not progress), the output and "
                    f"the run carry on; {_FIX}", pattern=self.pattern)
        self.answered += answer[0] - seen[0]  # last: whoever sees it sees the rest done


def _answers(channel: socket.socket) -> Tuple[Optional[Tuple[int, int, int]], bool]:
    """(the last of the answers waiting, whether the channel ended)."""
    last = None
    flags = 0
    while True:
        try:
            message = channel.recv(matcher.ANSWER.size, flags)
        except BlockingIOError:
            return last, False
        except OSError:  # ECONNRESET: it died
            return last, True
        if not message:
            return last, True
        if len(message) == matcher.ANSWER.size:
            last = matcher.ANSWER.unpack(message)
        flags = socket.MSG_DONTWAIT


def _shut(channel: socket.socket) -> None:
    try:
        channel.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _end(proc: subprocess.Popen, at_once: bool) -> Optional[int]:
    """Its exit status (killed after EXIT_WAIT_SECONDS, or `at_once`); then it is no longer a helper.

    At close it is killed at once: what is still queued for it (a socket full of lines that each use up their
    CPU) would keep it busy long after the end of its socket, and its answers no longer matter."""
    if at_once:
        proc.kill()
    code = lifecycle.wait_or_kill(proc, EXIT_WAIT_SECONDS)
    children.end_helper(proc.pid)
    return code
