"""LinePump on a real pipe: whole lines, tails, and the bounded-memory cut."""

import os
import threading
import time

import pytest

from ma_runtime.util import output
from ma_runtime.util.output import READ_SIZE, LinePump, Sink, tail_of


def pump_through(tmp_path, data: bytes, max_line_bytes: int = 1 << 20):
    read_fd, write_fd = os.pipe()
    sink = Sink.open_append(str(tmp_path / "sink"))
    pump = LinePump(read_fd, [sink], "test", max_line_bytes=max_line_bytes)
    pump.start()
    writer = threading.Thread(target=lambda: (os.write(write_fd, data), os.close(write_fd)))
    writer.start()
    writer.join(10)
    pump.join(10)
    sink.close()
    return (tmp_path / "sink").read_bytes(), pump


def test_chunks_are_cut_after_the_last_line_end(tmp_path):
    out, pump = pump_through(tmp_path, b"a\nb\rc\nunfinished")
    assert out == b"a\nb\rc\nunfinished\n"
    assert pump.tail_lines(2) == ["c", "unfinished"]


def test_an_endless_line_is_cut_and_counted(tmp_path):
    out, pump = pump_through(tmp_path, b"x" * 300_000, max_line_bytes=100_000)
    assert pump.lines_split >= 2
    assert out.replace(b"\n", b"") == b"x" * 300_000


def paced_writer(write_fd: int, pieces, pause: float = 0.001):
    """Writes each piece with its own write() and a pause between: lines arriving one by one, or in parts."""
    def run():
        for piece in pieces:
            os.write(write_fd, piece)
            time.sleep(pause)
        os.close(write_fd)
    return threading.Thread(target=run)


def test_lines_arriving_one_write_each_or_in_parts_come_out_whole_and_in_order(tmp_path):
    # A long line (over READ_SIZE, over the coalescing threshold) written in three parts among short lines,
    # and an unfinished last line: every line whole, in order, on the raw sink and on the prefixed console.
    long_line = b"L" * (READ_SIZE + 12_345) + b"\n"
    lines = [b"line %05d\n" % number for number in range(200)]
    pieces = [*lines[:100], long_line[:1000], long_line[1000:READ_SIZE + 7], long_line[READ_SIZE + 7:], *lines[100:],
              b"last words"]
    read_fd, write_fd = os.pipe()
    log, console = Sink.open_append(str(tmp_path / "log")), Sink.open_append(str(tmp_path / "console"))
    pump = LinePump(read_fd, [log, (console.as_console(), b"[rank-3] ")], "test")
    writer = paced_writer(write_fd, pieces)
    pump.start()
    writer.start()
    writer.join(30)
    pump.join(30)
    log.close()
    expected = [*lines[:100], long_line, *lines[100:], b"last words\n"]
    assert (tmp_path / "log").read_bytes() == b"".join(expected)
    assert (tmp_path / "console").read_bytes() == b"".join(b"[rank-3] " + line for line in expected)


def test_ranks_sharing_a_sink_keep_their_lines_whole_and_in_their_order(tmp_path):
    console = Sink.open_append(str(tmp_path / "console"))
    pumps, writers = [], []
    for rank in range(8):
        read_fd, write_fd = os.pipe()
        pumps.append(LinePump(read_fd, [(console.as_console(), b"[rank-%d] " % rank)], f"rank-{rank}"))
        writers.append(paced_writer(write_fd, [b"r%d line %04d\n" % (rank, number) for number in range(300)], 0.0002))
    for thread in (*pumps, *writers):
        thread.start()
    for thread in (*writers, *pumps):
        thread.join(30)
    console.close()
    seen = (tmp_path / "console").read_bytes().split(b"\n")
    assert seen.pop() == b""
    for rank in range(8):
        mine = [line for line in seen if line.startswith(b"[rank-%d] " % rank)]
        assert mine == [b"[rank-%d] r%d line %04d" % (rank, rank, number) for number in range(300)]
    assert len(seen) == 8 * 300


# ---------------------------------------------------------------------- one reader for every pipe (issue 29)

def reader_threads():
    """The threads that read pipes: the one reader, and any thread a pump would have of its own."""
    return [thread for thread in threading.enumerate() if thread.name.startswith(("pump-", "output-reader"))]


def wait_for(predicate, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_64_open_pipes_are_read_by_one_thread_which_ends_with_the_last_pipe(tmp_path):
    console = Sink.open_append(str(tmp_path / "console"))
    pumps, write_fds = [], []
    for rank in range(64):
        read_fd, write_fd = os.pipe()
        pumps.append(LinePump(read_fd, [(console.as_console(), b"[rank-%d] " % rank)], f"rank-{rank}-stdout"))
        write_fds.append(write_fd)
        pumps[-1].start()
    for rank, write_fd in enumerate(write_fds):  # one line each, the writers still open: read without any EOF
        os.write(write_fd, b"hello from %d\n" % rank)
    assert wait_for(lambda: (tmp_path / "console").read_bytes().count(b"\n") == 64)
    assert [thread.name for thread in reader_threads()] == ["output-reader"]
    assert all(pump.is_alive() for pump in pumps)
    for write_fd in write_fds:
        os.close(write_fd)
    for pump in pumps:
        pump.join(10)
        assert not pump.is_alive()
    assert wait_for(lambda: not reader_threads())  # no thread left once no pipe is
    console.close()
    lines = sorted((tmp_path / "console").read_bytes().splitlines())
    assert lines == sorted(b"[rank-%d] hello from %d" % (rank, rank) for rank in range(64))


def test_the_reader_starts_again_for_a_pipe_after_the_last_one_ended(tmp_path):
    first, _ = pump_through(tmp_path, b"one\n")
    assert wait_for(lambda: not reader_threads())
    (tmp_path / "sink").unlink()
    second, _ = pump_through(tmp_path, b"two\nthree")
    assert (first, second) == (b"one\n", b"two\nthree\n")


def test_progress_bars_keep_their_carriage_returns_and_one_prefix_per_line_across_reads(tmp_path):
    # Each piece its own read (pauses longer than the window): `\r\n` split across reads is one line end.
    read_fd, write_fd = os.pipe()
    log, console = Sink.open_append(str(tmp_path / "log")), Sink.open_append(str(tmp_path / "console"))
    pump = LinePump(read_fd, [log, (console.as_console(), b"[rank-0] ")], "bar")
    writer = paced_writer(write_fd, [b"10%\r", b"20%\r", b"\n", b"done\r\n", b"\r\nafter\n"], pause=0.15)
    pump.start()
    writer.start()
    writer.join(30)
    pump.join(30)
    log.close()
    assert (tmp_path / "log").read_bytes() == b"10%\r20%\r\ndone\r\n\r\nafter\n"
    assert (tmp_path / "console").read_bytes() == (
        b"[rank-0] 10%\r[rank-0] 20%\r\n[rank-0] done\r\n[rank-0] \r\n[rank-0] after\n")


def test_a_stdout_and_a_stderr_sharing_a_log_each_keep_their_order(tmp_path):
    log = Sink.open_append(str(tmp_path / "log"))
    pumps, writers = [], []
    for stream in ("out", "err"):
        read_fd, write_fd = os.pipe()
        pumps.append(LinePump(read_fd, [log], stream))
        writers.append(paced_writer(write_fd, [b"%s %04d\n" % (stream.encode(), n) for n in range(500)], 0.0001))
    for thread in (*pumps, *writers):
        thread.start()
    for thread in (*writers, *pumps):
        thread.join(30)
    log.close()
    seen = (tmp_path / "log").read_bytes().splitlines()
    for stream in (b"out", b"err"):
        assert [line for line in seen if line.startswith(stream)] == [b"%s %04d" % (stream, n) for n in range(500)]
    assert len(seen) == 1000


class BrokenSink(Sink):
    def __init__(self):
        super().__init__(-1, "broken", console=False)
        self.calls = 0

    def write(self, data: bytes) -> None:
        self.calls += 1
        raise RuntimeError("a bug in a destination")


class Warnings(output.Reporter):
    def __init__(self):
        self.seen = []

    def warn(self, message: str, **fields) -> None:
        self.seen.append((message, fields))


def test_a_failing_destination_is_said_once_and_the_pipes_and_other_sinks_carry_on(tmp_path, monkeypatch):
    warnings = Warnings()
    monkeypatch.setattr(output, "reporter", warnings)
    broken, log = BrokenSink(), Sink.open_append(str(tmp_path / "log"))
    read_fd, write_fd = os.pipe()
    pump = LinePump(read_fd, [broken, log], "failing")
    writer = paced_writer(write_fd, [b"line %03d\n" % n for n in range(50)], 0.005)
    pump.start()
    writer.start()
    writer.join(30)
    pump.join(30)
    log.close()
    assert not pump.is_alive()
    assert (tmp_path / "log").read_bytes() == b"".join(b"line %03d\n" % n for n in range(50))
    assert broken.calls >= 2
    assert [(message, fields["pump"]) for message, fields in warnings.seen] == [
        ("output forwarding failed; the output is still drained", "pump-failing")]
    assert pump.tail_lines(1) == ["line 049"]


def test_an_endless_line_among_whole_ones_is_cut_and_its_pipe_closed_at_eof(tmp_path):
    read_fd, write_fd = os.pipe()
    log = Sink.open_append(str(tmp_path / "log"))
    pump = LinePump(read_fd, [log], "long", max_line_bytes=10_000)
    writer = paced_writer(write_fd, [b"before\n", *[b"y" * 4000] * 6, b"\nafter\nlast"], 0.03)
    pump.start()
    writer.start()
    writer.join(30)
    pump.join(30)
    log.close()
    out = (tmp_path / "log").read_bytes()
    assert out.startswith(b"before\n") and out.endswith(b"\nafter\nlast\n")
    pieces = out.split(b"\n")[1:-3]  # the long line, in the pieces it was cut into (as the reads grouped it)
    assert b"".join(pieces) == b"y" * 24_000
    assert pump.lines_split == len(pieces) - 1 >= 1
    assert all(len(piece) < 10_000 + READ_SIZE for piece in pieces)
    assert tail_of([pump], 2) == ["after", "last"]
    with pytest.raises(OSError):  # the pipe was closed at EOF
        os.fstat(read_fd)


def test_a_forked_child_gets_a_reader_of_its_own(tmp_path):
    # The guard is a fork of the supervisor: the parent's reader (its thread, its epoll) must not be the child's.
    read_fd, write_fd = os.pipe()
    parent_log = Sink.open_append(str(tmp_path / "parent"))
    parent_pump = LinePump(read_fd, [parent_log], "parent")
    parent_pump.start()
    os.write(write_fd, b"before the fork\n")
    assert wait_for(lambda: (tmp_path / "parent").read_bytes() == b"before the fork\n")
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's verdict is its exit status
        status = 1
        try:
            child_read, child_write = os.pipe()
            child_log = Sink.open_append(str(tmp_path / "child"))
            child_pump = LinePump(child_read, [child_log], "child")
            child_pump.start()
            os.write(child_write, b"in the child\nlast")
            os.close(child_write)
            child_pump.join(10)
            if (tmp_path / "child").read_bytes() == b"in the child\nlast\n" and not child_pump.is_alive():
                status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    os.write(write_fd, b"after the fork\n")
    os.close(write_fd)
    parent_pump.join(10)
    parent_log.close()
    assert (tmp_path / "parent").read_bytes() == b"before the fork\nafter the fork\n"


def test_no_line_waits_longer_than_the_longest_window_however_many_pipes_print():
    assert output._window(1, 0) == output.COALESCE_SECONDS  # one pipe, after a burst: as its own thread waited
    assert output._window(2, 0) == output._window(1, 1) == 2 * output.COALESCE_SECONDS
    windows = [output._window(pipes, calm) for pipes in range(1, 1025) for calm in range(output.CALM_ROUNDS + 1)]
    assert max(windows) == output.COALESCE_MAX_SECONDS


def test_a_pump_is_joined_after_it_is_started_and_started_once():
    read_fd, write_fd = os.pipe()
    pump = LinePump(read_fd, [], "once")
    with pytest.raises(RuntimeError, match="before it is started"):
        pump.join(0)
    assert not pump.is_alive()
    pump.start()
    with pytest.raises(RuntimeError, match="started already"):
        pump.start()
    os.close(write_fd)
    pump.join(10)
    assert not pump.is_alive()
