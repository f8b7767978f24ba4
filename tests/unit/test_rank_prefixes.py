"""Rank prefixes on the console: every line labelled, the log file's copy untouched."""

import os
import threading
import time

import pytest

from ma_runtime.util.output import LinePump, Sink, prefix_lines

P = b"[rank 3] "


@pytest.mark.parametrize(
    "data, expected",
    [
        (b"a\n", b"[rank 3] a\n"),
        (b"a\nb\n\n", b"[rank 3] a\n[rank 3] b\n[rank 3] \n"),
        (b"10%\r50%\r", b"[rank 3] 10%\r[rank 3] 50%\r"),
        (b"win\r\ndows\r\n", b"[rank 3] win\r\n[rank 3] dows\r\n"),
    ],
)
def test_every_line_gets_the_prefix_and_crlf_is_one_line_end(data, expected):
    assert prefix_lines(data, P) == expected


def test_a_chunk_that_completes_a_cr_does_not_start_a_line():
    assert prefix_lines(b"\nnext\n", P, lead=False) == b"\n[rank 3] next\n"


def test_a_prefix_with_a_line_end_is_refused():
    with pytest.raises(ValueError):
        LinePump(0, [(Sink(1, "<stdout>"), b"bad\n")], "test")


def test_console_sinks_are_the_runtime_stdout_and_stderr(tmp_path):
    log_file = Sink.open_append(str(tmp_path / "log"))
    assert Sink(1, "<stdout>").console and Sink(2, "<stderr>").console
    assert not log_file.console
    assert Sink(7, "other", console=True).console
    log_file.close()


def start_pump(tmp_path, name, sinks):
    read_fd, write_fd = os.pipe()
    pump = LinePump(read_fd, sinks, name)
    pump.start()
    return pump, write_fd


def test_prefixed_and_raw_sinks_of_one_pump(tmp_path):
    console = Sink.open_append(str(tmp_path / "console"))
    raw = Sink.open_append(str(tmp_path / "raw"))
    pump, write_fd = start_pump(tmp_path, "one", [(console, P), raw])
    os.write(write_fd, b"a\nb\rc\nunfinished")
    os.close(write_fd)
    pump.join(10)
    assert (tmp_path / "console").read_bytes() == b"[rank 3] a\n[rank 3] b\r[rank 3] c\n[rank 3] unfinished\n"
    assert (tmp_path / "raw").read_bytes() == b"a\nb\rc\nunfinished\n"
    assert pump.tail_lines(1) == ["unfinished"]


def test_crlf_split_across_two_reads_stays_one_line_end(tmp_path):
    console = Sink.open_append(str(tmp_path / "console"))
    pump, write_fd = start_pump(tmp_path, "crlf", [(console, P)])
    os.write(write_fd, b"a\r")
    deadline = time.monotonic() + 10
    # Wait until the pump has emitted the first chunk, so that the `\n` is a read of its own.
    while (tmp_path / "console").stat().st_size == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    os.write(write_fd, b"\nb\n")
    os.close(write_fd)
    pump.join(10)
    assert (tmp_path / "console").read_bytes() == b"[rank 3] a\r\n[rank 3] b\n"


def test_two_prefixed_pumps_on_one_console_never_mix_lines(tmp_path):
    console = Sink.open_append(str(tmp_path / "console"))
    pumps, writers = [], []
    for rank in range(2):
        raw = Sink.open_append(str(tmp_path / f"raw-{rank}"))
        pump, write_fd = start_pump(tmp_path, f"rank-{rank}", [(console, f"[rank {rank}] ".encode()), raw])
        pumps.append(pump)
        # Odd-sized writes: chunks end mid-line, as a real worker's do.
        data = b"".join(f"rank {rank} line {i:04d}\n".encode() for i in range(2000))
        writers.append(threading.Thread(target=write_in_pieces, args=(write_fd, data, 777)))
    for writer in writers:
        writer.start()
    for thread in writers + pumps:
        thread.join(30)
    lines = (tmp_path / "console").read_text().splitlines()
    assert len(lines) == 4000
    for rank in range(2):
        mine = [line for line in lines if line.startswith(f"[rank {rank}] ")]
        assert mine == [f"[rank {rank}] rank {rank} line {i:04d}" for i in range(2000)]
        raw_lines = (tmp_path / f"raw-{rank}").read_text().splitlines()
        assert raw_lines == [f"rank {rank} line {i:04d}" for i in range(2000)]


def write_in_pieces(fd, data, size):
    for start in range(0, len(data), size):
        os.write(fd, data[start : start + size])
    os.close(fd)
