"""files.py: the one writer and the one reader of the runtime's files, never fooled by what is not a file."""

import os

import pytest

from ma_runtime.util import files


def test_read_regular_reads_a_file_and_says_none_for_a_missing_one(tmp_path):
    path = tmp_path / "record"
    path.write_bytes(b"x" * 100_000)
    assert files.read_regular(path, 100_000) == b"x" * 100_000
    assert files.read_regular(tmp_path / "absent", 10) is None


@pytest.mark.parametrize("kind", ["a FIFO", "a directory", "a character device"])
def test_read_regular_refuses_what_is_not_a_file_without_blocking(tmp_path, kind):
    path = {"a FIFO": tmp_path / "fifo", "a directory": tmp_path, "a character device": "/dev/zero"}[kind]
    if kind == "a FIFO":
        os.mkfifo(path)  # opened for reading without a writer: a blocking open would hang here
    with pytest.raises(files.NotAFile) as caught:
        files.read_regular(path, 1 << 20)
    assert caught.value.kind == kind


def test_read_regular_refuses_a_file_over_its_limit_before_reading_it(tmp_path):
    path = tmp_path / "big"
    path.write_bytes(b"y" * 1001)
    with pytest.raises(files.TooLarge) as caught:
        files.read_regular(path, 1000)
    assert caught.value.size == 1001


@pytest.mark.parametrize("kind", ["a FIFO", "a directory"])
def test_write_atomically_never_replaces_what_is_not_a_file(tmp_path, kind):
    path = tmp_path / "target"
    os.mkfifo(path) if kind == "a FIFO" else path.mkdir()
    with pytest.raises(files.NotAFile):
        files.write_atomically(path, b"data")
    assert path.is_fifo() if kind == "a FIFO" else path.is_dir()
    assert [p.name for p in tmp_path.iterdir()] == ["target"]  # no temporary file left behind


def test_write_atomically_follows_a_link_to_a_file_and_keeps_the_link(tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    real.write_bytes(b"old")
    link.symlink_to(real)
    files.write_atomically(link, "new")
    assert link.is_symlink() and real.read_bytes() == b"new"


def test_a_failed_streaming_write_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "target"
    path.write_bytes(b"old")

    def fail_half_way(sink):
        sink.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        files.write_atomically_from(path, fail_half_way)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["target"]
