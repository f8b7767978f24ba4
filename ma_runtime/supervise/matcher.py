"""The progress pattern's matcher: a small process of its own that runs MA_RUNTIME_PROGRESS_PATTERN over the
workers' output (supervise/progress.py starts it and talks to it).

Why a process: Python's `re` holds the GIL for a whole match, and a pattern that backtracks catastrophically
(`^(x+x+)+y` against a line of 40 `x`: 2^40 ways to split it) never gives it back. Run in one of the runtime's
threads, it froze PID 1: no signal handled, no output forwarded, no `command exited`. Here it can only slow
this process down.

Why it never wedges itself: `re` checks for signals as it backtracks (CPython 3.9 and later, checked
here on both), so a SIGPROF timer counting this process's CPU time stops a search that has used more than
LINE_CPU_SECONDS: the line is skipped (it is not progress) and counted; the next lines are matched as usual.

Standard library only: it runs as `python -I` (supervise/progress.py), beside a job whose own modules must
never load into it. Protocol, over a SOCK_SEQPACKET socket pair (messages keep their bounds): the first message
is the pattern (UTF-8); each later message is whole lines of output (`\\n` or `\\r` ends a line). After each
batch of messages it finds waiting, and at once after a message with a match or a skipped line, it answers
with ANSWER: (messages done, messages with a match, lines skipped), all counted since it started. End of the
socket: it exits.
"""

import os
import re
import signal
import socket
import struct
import sys
from typing import List, Optional, Tuple

MAX_MESSAGE = 1 << 16  # the sender splits larger chunks at line ends (supervise/progress.py)
ANSWER = struct.Struct("<QQQ")
# CPU time, not wall time: a matcher starved on a loaded node is slow, not catastrophic. A sane pattern takes
# microseconds on a line and about a millisecond on a full 64 KiB read; a search using TICKS_PER_LINE ticks
# (0.2 to 0.25 s of CPU) is a pattern that backtracks, and a message gets MESSAGE_TICKS in all (its first search
# over all its lines, then each line on its own).
TICK_SECONDS = 0.05
TICKS_PER_LINE = 5
MESSAGE_TICKS = 20
LINE_CPU_SECONDS = TICK_SECONDS * TICKS_PER_LINE
# The matcher's niceness once a line has used up its CPU: a tenth of a core against one busy process of the job,
# enough to answer well within the runtime's STALL_SECONDS (supervise/progress.py).
POLITE_NICE = 10


class _OverBudget(Exception):
    """Raised by the SIGPROF handler inside a search that used up its CPU."""


class _Budget:
    """The CPU ticks (SIGPROF) spent on the current search and on the current message."""

    def __init__(self) -> None:
        self.armed = False  # a search is running: a tick may stop it
        self.search = 0
        self.message = 0

    def tick(self, signum, frame) -> None:
        if not self.armed:
            return
        self.search += 1
        self.message += 1
        if self.search >= TICKS_PER_LINE or self.message >= MESSAGE_TICKS:
            self.armed = False  # one exception per search, raised inside its `try`
            raise _OverBudget()

    @property
    def spent(self) -> bool:
        return self.message >= MESSAGE_TICKS


_budget = _Budget()


def search(pattern: "re.Pattern[str]", text: str) -> Optional[bool]:
    """Whether `pattern` is found in `text`; None when the search used up its CPU (it backtracks)."""
    _budget.search = 0
    try:
        _budget.armed = True  # inside the `try`: a tick between this and the search is caught too
        found = pattern.search(text) is not None
        _budget.armed = False
    except _OverBudget:
        return None
    return found


def matches(pattern: "re.Pattern[str]", text: str) -> Tuple[bool, int]:
    """(whether a line of `text` matches, how many of its lines were skipped for using up the CPU).

    One search over all the lines first (one C-level scan: the common case); when it uses up its CPU, line by
    line, so that the progress line after a pathological one still counts, until the message's CPU is spent."""
    _budget.message = 0
    found = search(pattern, text)
    if found is not None:
        return found, 0
    lines = (text[:-1] if text.endswith("\n") else text).split("\n")
    if len(lines) == 1:
        return False, 1  # that line was the search
    skipped = 0
    for index, line in enumerate(lines):
        found = search(pattern, line)
        if found:
            return True, skipped
        if found is None:
            skipped += 1
            if _budget.spent:  # the rest of the message is not searched at all
                return False, skipped + len(lines) - index - 1
    return False, skipped


def serve(channel: socket.socket) -> int:
    """Answers until the runtime closes its end; the exit status."""
    first = channel.recv(MAX_MESSAGE)
    if not first:
        return 0
    pattern = re.compile(first.decode("utf-8", "surrogateescape"), re.MULTILINE)
    signal.signal(signal.SIGPROF, _budget.tick)
    signal.setitimer(signal.ITIMER_PROF, TICK_SECONDS, TICK_SECONDS)
    done = matched = skipped = 0
    while True:
        message = channel.recv(MAX_MESSAGE)
        if not message:
            return 0
        while message:
            found, lost = matches(pattern, message.decode("utf-8", "replace").replace("\r", "\n"))
            if lost and not skipped:
                # The pattern is proven to backtrack: the CPU it burns on such lines (each up to the limit) should
                # come from what the job leaves idle, not from the job.
                os.nice(POLITE_NICE)
            done, matched, skipped = done + 1, matched + found, skipped + lost
            if found or lost:
                break  # said at once, not after the batch: the progress, the warning, a matcher that is not stuck
            try:
                message = channel.recv(MAX_MESSAGE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                message = None
        channel.send(ANSWER.pack(done, matched, skipped))
        if message == b"":
            return 0


def main(argv: List[str]) -> int:
    fd = int(argv[argv.index("--channel") + 1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runtime ends it (its channel's end), never a Ctrl-C
    with socket.socket(fileno=fd) as channel:
        try:
            return serve(channel)
        except (BrokenPipeError, ConnectionResetError):
            return 0  # the runtime went away mid-answer


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
