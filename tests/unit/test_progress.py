"""The progress pattern's matcher (issue 24, item 3): MA_RUNTIME_PROGRESS_PATTERN is matched in a process of its
own (ma_runtime/supervise/matcher.py), with a CPU limit per line, fed without ever making the output wait.

Real matcher processes throughout; the pathological families against long non-matching lines. And the other
patterns users give the runtime: the sync's globs (MA_RUNTIME_SYNC_MARKERS, MA_RUNTIME_SYNC_EXCLUDE).
"""

import fnmatch
import os
import re
import signal
import threading
import time

import pytest

from ma_runtime.process import children
from ma_runtime.setting import BadValue
from ma_runtime.setting import regex as _regex
from ma_runtime.supervise import matcher, progress
from ma_runtime.supervise.progress import ProgressSink
from ma_runtime.sync.units import Units
from ma_runtime.util import output

PATIENCE = 30.0
# (pattern, a line it backtracks catastrophically on): each runs for hours in plain `re`.
FAMILIES = [
    (r"^(x+x+)+y", "x" * 40),
    (r"(a|a)*b", "a" * 40),
    (r"(a|aa)+$", "a" * 80 + "!"),
    (r"(.*a){25}", "a" * 24 + "b" * 200),
    (r"(\w+\s?)+$", "a" * 40 + "!"),
]
PROGRESS = r"|^step \d+$"  # the line each family's pattern is also given, to show the matching goes on


class _Bounded(Exception):
    pass


@pytest.fixture(autouse=True)
def bounded():
    """A test that wedges fails instead: `re` checks for signals in the main thread (the in-thread matching
    this replaces wedged a test forever)."""
    def expire(signum, frame):
        raise _Bounded("the test did not finish in 120 s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, 120)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


class Warnings(output.Reporter):
    def __init__(self):
        self.seen = []

    def warn(self, message, **fields):
        self.seen.append((message, fields))

    def about(self, words):
        return [(message, fields) for message, fields in self.seen if words in message]


@pytest.fixture
def warnings():
    previous = output.reporter
    caught = Warnings()
    output.set_reporter(caught)
    yield caught
    output.set_reporter(previous)


class Beats:
    """on_progress: counts the calls."""

    def __init__(self):
        self.count = 0
        self.event = threading.Event()

    def __call__(self):
        self.count += 1
        self.event.set()


def until(condition, what):
    deadline = time.monotonic() + PATIENCE
    while not condition():
        assert time.monotonic() < deadline, f"not within {PATIENCE:g} s: {what}"
        time.sleep(0.01)


def settle(sink):
    """Until every line written was sent, and the matcher has answered every message sent."""
    until(lambda: not sink.unsent and sink.answered >= sink.sent, "the matcher answered everything")


@pytest.mark.parametrize("pattern, line", FAMILIES)
def test_each_family_is_pathological_for_plain_re(pattern, line):
    """The control: in-process, each search is still running when a 1 s timer stops it."""
    def stop(signum, frame):
        raise _Bounded()

    signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    with pytest.raises(_Bounded):
        re.compile(pattern, re.MULTILINE).search(line)


@pytest.mark.parametrize("pattern, line", FAMILIES)
def test_a_line_that_backtracks_is_skipped_with_one_warning_and_the_next_progress_counts(pattern, line, warnings):
    beats = Beats()
    sink = ProgressSink(pattern + PROGRESS, beats)
    try:
        sink.write(line.encode() + b"\n")  # alone
        settle(sink)
        sink.write(line.encode() + b"\nstep 1\n")  # before a progress line, in one chunk
        settle(sink)
        assert beats.count == 1 and sink.matched == 1
        sink.write(b"step 2\n")
        settle(sink)
        assert beats.count == 2
        # Proven to backtrack, the matcher burns what the job leaves idle.
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, sink.proc.pid) == min(19, ours + matcher.POLITE_NICE)
    finally:
        sink.close()
    assert sink.skipped == 2
    (warned,) = warnings.about("backtracks catastrophically")
    assert warned[0].startswith("MA_RUNTIME_PROGRESS_PATTERN backtracks catastrophically")
    assert warned[1]["pattern"] == pattern + PROGRESS
    (summary,) = warnings.about("were not matched")
    assert summary[1] == {"behind": 0, "backtracking": 2, "over_64KiB": 0}


def test_normal_patterns_match_and_a_chunk_without_a_match_is_no_progress(warnings):
    beats = Beats()
    sink = ProgressSink(r"^step \d+", beats)
    try:
        sink.write(b"loading data\nepoch 1\n")
        settle(sink)
        assert beats.count == 0
        sink.write(b"loss 0.3\nstep 12 loss 0.2\nlr 0.1\n")
        settle(sink)
        assert beats.count == 1
    finally:
        sink.close()
    assert warnings.seen == []


def test_many_pumps_write_at_once(warnings):
    """One sink takes every rank's stdout and stderr pumps: lines from many threads at once stay whole lines."""
    beats = Beats()
    sink = ProgressSink(r"^step \d+ of rank \d+$", beats)

    def pump(rank):
        for n in range(2000):
            sink.write(b"loss 0.1\nstep %d of rank %d\n" % (n, rank))

    try:
        threads = [threading.Thread(target=pump, args=(rank,)) for rank in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        settle(sink)
        assert beats.count >= 1 and sink.matched == sink.answered  # every message sent held a whole step line
    finally:
        sink.close()


def test_progress_bars_redrawn_with_carriage_returns_count(warnings):
    """tqdm never prints `\\n`: each `\\r` ends a line, so `^` anchors at each redraw."""
    beats = Beats()
    sink = ProgressSink(r"^ *\d+%\|", beats)
    try:
        sink.write(b"\r 10%|#         | 1/10\r 20%|##        | 2/10\r")
        settle(sink)
        assert beats.count == 1
    finally:
        sink.close()


def test_a_matcher_that_falls_behind_never_makes_the_output_wait(warnings):
    """Megabytes of lines the matcher needs a quarter of a second each for: every write returns at once (the
    socket is full: dropped, counted), and the matcher ends at close."""
    sink = ProgressSink(FAMILIES[0][0], Beats())
    chunk = FAMILIES[0][1].encode() + b"\n"
    try:
        for _ in range(50_000):
            sink.write(chunk)
    finally:
        sink.close()
    assert 0 < sink.dropped < 50_000
    (summary,) = warnings.about("were not matched")
    assert summary[1]["behind"] == sink.dropped


def test_the_matcher_is_a_helper_left_out_of_the_command_tree_and_ended_by_close(warnings):
    sink = ProgressSink(r"^step", Beats())
    proc = sink.proc
    assert proc is not None and proc.poll() is None
    assert proc.pid in children.NotTheCommand()  # no stop, sweep, guard or hang-tree walk counts it
    sink.close()
    assert proc.poll() is not None
    assert proc.pid not in children.NotTheCommand()
    sink.write(b"step 1\n")  # after close: nothing, no error
    sink.close()


def test_a_matcher_killed_from_outside_is_restarted_and_progress_counts_again(warnings):
    beats = Beats()
    sink = ProgressSink(r"^step", beats)
    try:
        first = sink.proc
        os.kill(first.pid, signal.SIGKILL)
        until(lambda: sink.proc is not first and sink.proc is not None, "a fresh matcher")
        sink.write(b"step 1\n")
        settle(sink)
        assert beats.count == 1
    finally:
        sink.close()
    (restarted,) = warnings.about("starting a fresh one")
    assert restarted[0] == "the matcher of MA_RUNTIME_PROGRESS_PATTERN exited; starting a fresh one"
    assert restarted[1]["exit_code"] == -signal.SIGKILL
    assert first.pid not in children.NotTheCommand()


def test_a_matcher_that_stops_answering_is_killed_and_then_the_pattern_is_off(warnings, monkeypatch):
    """The backstop behind the CPU limit: a matcher with lines that says nothing for STALL_SECONDS (here a
    stopped one) is killed; past RESTARTS the pattern is off for the attempt, and writes cost nothing."""
    monkeypatch.setattr(progress, "STALL_SECONDS", 0.5)
    monkeypatch.setattr(progress, "CHECK_SECONDS", 0.1)
    monkeypatch.setattr(progress, "RESTARTS", 0)
    turned_off = []
    sink = ProgressSink(r"^step", Beats(), on_off=lambda: turned_off.append(True))
    try:
        proc = sink.proc
        os.kill(proc.pid, signal.SIGSTOP)
        sink.write(b"step 1\n")
        until(lambda: warnings.about("is off for this attempt"), "the pattern turned off")
        assert proc.poll() == -signal.SIGKILL
        sink.write(b"step 2\n")
    finally:
        sink.close()
    (off,) = warnings.about("is off for this attempt")
    assert off[0] == ("MA_RUNTIME_PROGRESS_PATTERN is off for this attempt: its matcher did not answer for 0.5 s "
                      "(no restarts left); the hang detector's metrics decide")
    assert turned_off == [True]  # the hang monitor is told (tests/unit/test_hang.py: then the metrics decide)
    assert not warnings.about("were not matched")  # once off, nothing is counted
    assert proc.pid not in children.NotTheCommand()


def test_a_chunk_larger_than_a_message_is_cut_at_line_ends_and_a_line_over_64_kib_is_not_matched(warnings):
    beats = Beats()
    sink = ProgressSink(r"^long", beats)
    try:
        sink.write(b"long" + b"y" * 100_000 + b"\nother\n")
        settle(sink)
        assert beats.count == 0 and sink.too_long == 1
        sink.write(b"z" * 40_000 + b"\n" + b"z" * 40_000 + b"\nlong enough\n")
        settle(sink)
        assert beats.count == 1
    finally:
        sink.close()


@pytest.mark.parametrize("value", ["a{99999999999999999999}", "(unclosed", " ", "x" * 1001])
def test_a_pattern_python_cannot_compile_is_a_bad_value(value):
    with pytest.raises(BadValue):
        _regex(value)


GLOBS = ["*a*a*a*a*a*a*a*a*a*a*b", "*" + "a*" * 100 + "b", "*?" * 100 + "b", "*[ab]" * 60 + "*c"]


@pytest.mark.parametrize("glob", GLOBS)
def test_many_star_globs_are_linear_on_long_names(glob):
    """MA_RUNTIME_SYNC_MARKERS and MA_RUNTIME_SYNC_EXCLUDE are fnmatch globs: since Python 3.9 fnmatch.translate
    makes every star but the last an atomic group, so they never backtrack (the `bounded` timer would stop
    an exponential one; names of 100 000 characters, far beyond a file system's 255)."""
    units = Units(markers=[glob], excludes=[glob])
    name = "a" * 100_000
    assert not units.is_marker("out/" + name) and not units.excluded(name)
    assert not fnmatch.fnmatchcase(name, glob)
