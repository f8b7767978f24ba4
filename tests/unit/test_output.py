"""LinePump on a real pipe: whole lines, tails, and the bounded-memory cut."""

import os
import threading

from ma_runtime.util.output import LinePump, Sink


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
