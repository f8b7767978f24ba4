"""LinePump on a real pipe: whole lines, tails, and the bounded-memory cut."""

import os
import threading
import time

from ma_runtime.util.output import READ_SIZE, LinePump, Sink


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
