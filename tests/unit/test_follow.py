"""LogFollower: msrun's rank log files onto the console, whole lines, each with its rank."""

import os
import time

from ma_runtime.supervise.follow import LogFollower
from ma_runtime.util.output import Sink


def follow(tmp_path, interval=0.02):
    out = tmp_path / "console"
    sink = Sink(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "console", owns_fd=True)
    follower = LogFollower(tmp_path / "logs", [sink], interval)
    follower.start()
    return follower, out


def test_lines_arrive_whole_with_their_rank_even_when_written_in_pieces(tmp_path):
    follower, out = follow(tmp_path)
    (tmp_path / "logs").mkdir()  # after the follower started: msrun makes it later
    with open(tmp_path / "logs" / "worker_0.log", "ab", buffering=0) as rank0, \
            open(tmp_path / "logs" / "worker_12.log", "ab", buffering=0) as rank12:
        rank0.write(b"first li")
        time.sleep(0.1)  # the follower polls meanwhile and must not emit half a line
        rank0.write(b"ne\nsecond\n")
        rank12.write(b"from twelve\n")
        time.sleep(0.1)
    follower.stop()

    lines = out.read_text().splitlines()
    assert sorted(lines) == sorted(["[rank-0] first line", "[rank-0] second", "[rank-12] from twelve"])
    assert lines.index("[rank-0] first line") < lines.index("[rank-0] second")


def test_an_unfinished_last_line_is_forwarded_at_the_end(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "worker_1.log").write_bytes(b"done\nno line end")
    (tmp_path / "logs" / "scheduler.log").write_bytes(b"not a rank's\n")
    follower, out = follow(tmp_path, interval=10)  # only the final poll runs

    follower.stop()

    assert out.read_text() == "[rank-1] done\n[rank-1] no line end\n"
