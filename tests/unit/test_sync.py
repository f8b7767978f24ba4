"""The sync engine's mechanisms, one at a time (issue 12): real files, real stores, no uploader process
except where the process is what is tested.

LocalStore (a target folder in tmp) for most: it behaves as a server does (Content-MD5 checked, parts in
their own folder, an aborted upload gone), so what holds here holds for OBS. Moto with the real OBS SDK
where the store matters: unfinished multipart uploads, which only a server can list. Faults come from
small store wrappers (record, deny, change the file after a part) and from running code between the scan
and the read (`after_scan`), so each assertion can fail for one reason only. The end-to-end behaviour
(`ma-run` with a trainer) is in tests/e2e/test_sync*.py.

A file written here gets an mtime far in the past (`write`): a rewrite a millisecond later then has
another mtime even where the kernel's clock is coarse, so "changed" never depends on timing.
"""

import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from ma_runtime import spec as job_spec
from ma_runtime import termination
from ma_runtime.errors import ConfigError, ExitCode
from ma_runtime.storage import transfer
from ma_runtime.storage import url as storage_url
from ma_runtime.storage.base import AccessDenied, TransientError
from ma_runtime.storage.local import LocalStore
from ma_runtime.storage.stores import open_store
from ma_runtime.sync import control, engine, reading, targets, tree, units, upload_cycle, writers
from ma_runtime.sync.engine import ChannelSync, Target
from ma_runtime.sync.manifest import Manifest, Record
from tests.conftest import _JOB_VARIABLES, alive
from tests.recording import Log, Wrapper

MiB = 1 << 20
MARKERS = ("latest_checkpointed_iteration.txt", "*.done")
LARGE = reading.SMALL_LIMIT + MiB  # goes as a multipart upload, whatever SMALL_LIMIT becomes
PAST_NS = 1_000_000_000 * 1_000_000_000  # 2001-09-09: far from any mtime a write gives now
WAIT_SECONDS = 30.0  # a guard against a hang, never an expectation of speed


# --------------------------------------------------------------------------- helpers


class Recording(Wrapper):
    """Records the keys written, in the order they became objects (a PUT, a multipart completed), the part
    numbers sent and the keys deleted."""

    def __init__(self, store):
        super().__init__(store)
        self.written = []
        self.parts = []
        self.deleted = []
        self.whole_puts = []  # keys sent from a file in one PUT

    def put_bytes(self, bucket, key, data, md5_hex):
        info = self.inner.put_bytes(bucket, key, data, md5_hex)
        with self.lock:
            self.written.append(key)
        return info

    def put_file(self, bucket, key, path, **kwargs):
        info = self.inner.put_file(bucket, key, path, **kwargs)
        with self.lock:
            self.written.append(key)
            self.whole_puts.append(key)
        return info

    def upload_part(self, bucket, key, upload_id, number, path, offset, size):
        etag = self.inner.upload_part(bucket, key, upload_id, number, path, offset, size)
        with self.lock:
            self.parts.append(number)
        return etag

    def complete_multipart(self, bucket, key, upload_id, parts):
        info = self.inner.complete_multipart(bucket, key, upload_id, parts)
        with self.lock:
            self.written.append(key)
        return info

    def delete(self, bucket, key):
        self.inner.delete(bucket, key)
        with self.lock:
            self.deleted.append(key)


class Denying(Recording):
    """Refuses every PUT and part (as OBS does for a key without write permission) while `deny` is set."""

    def __init__(self, store):
        super().__init__(store)
        self.deny = True
        self.refused = 0

    def _refuse(self, key):
        with self.lock:
            self.refused += 1
        raise AccessDenied(f"uploading to {key}: access denied")

    def put_bytes(self, bucket, key, data, md5_hex):
        if self.deny:
            self._refuse(key)
        return super().put_bytes(bucket, key, data, md5_hex)

    def create_multipart(self, bucket, key):
        if self.deny:
            self._refuse(key)
        return self.inner.create_multipart(bucket, key)


class AfterParts(Recording):
    """Runs `action` once, right after the part numbered `after` went up."""

    def __init__(self, store, action, after=1):
        super().__init__(store)
        self.action = action
        self.after = after

    def upload_part(self, bucket, key, upload_id, number, path, offset, size):
        etag = super().upload_part(bucket, key, upload_id, number, path, offset, size)
        if number == self.after:
            self.action()
        return etag


class Crash(BaseException):
    """A kill -9 in mid-call, as far as the code under test can tell: nothing after it runs."""


class CrashAfterCreate(Recording):
    def create_multipart(self, bucket, key):
        self.inner.create_multipart(bucket, key)
        raise Crash()


class Channel:
    """One channel's sync: `root` (src) to the local folder `dest` (or `url`), its state in `state`."""

    def __init__(self, tmp_path, store=None, *, url=None, is_log=False, delete=False, workers=4,
                 part_size=5 * MiB, markers=MARKERS, large_threshold=reading.SMALL_LIMIT):
        self.root = tmp_path / "src"
        self.root.mkdir(exist_ok=True)
        self.dest = tmp_path / "dest"
        self.state = tmp_path / "state"
        self.store = Recording(LocalStore()) if store is None else store
        self.log = Log()
        self.target = Target("train_url", self.root, url or str(self.dest), is_log=is_log, delete=delete)
        # Every file from SMALL_LIMIT up in parts, unless a test says otherwise: the multipart mechanisms are what
        # most tests here drive (the default threshold sends files below 64 MiB in one PUT).
        self.options = transfer.TransferOptions(workers=workers, part_size=part_size, retry_seconds=1.0,
                                                progress_seconds=0, large_threshold=large_threshold,
                                                state_dir=tmp_path / "unused")
        self.markers = markers
        self.sync = self.restarted()

    def restarted(self) -> ChannelSync:
        """A new ChannelSync on the same state, as a restarted uploader makes."""
        return ChannelSync(self.target, self.store, self.options, self.markers, self.log, self.state)

    def cycle(self, **kwargs) -> upload_cycle.Result:
        return self.sync.cycle(**kwargs)

    def uploaded(self):
        """{relative: bytes} of what the target folder holds (multipart parts folders left out)."""
        if not self.dest.exists():
            return {}
        return {str(p.relative_to(self.dest)): p.read_bytes() for p in sorted(self.dest.rglob("*"))
                if p.is_file() and ".parts" not in str(p.relative_to(self.dest))}

    def parts_records(self):
        return sorted((self.state / "parts").glob("*.upload.json")) if (self.state / "parts").exists() else []


def write(path: Path, data: bytes, mtime_ns: int = PAST_NS) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


def rewrite_same_size(path: Path) -> None:
    data = path.read_bytes()
    with open(path, "r+b") as f:  # in place: same inode, same size, new bytes and mtime
        f.write(bytes([data[0] ^ 0xFF]))


def append(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"appended")


def replace_by_rename(path: Path) -> None:
    fresh = path.with_name(path.name + ".new")
    fresh.write_bytes(path.read_bytes()[::-1])  # same size, another inode
    os.replace(fresh, path)


CHANGES = {"rewritten in place": rewrite_same_size, "appended to": append, "replaced by rename": replace_by_rename}


def random_bytes(size: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(size)


def after_scan(monkeypatch, action):
    """Runs `action` once, right after the engine's next scan: the file changes between scan and read."""
    real = engine.scan
    todo = [action]

    def scan(root, skipped, *more):
        found = real(root, skipped, *more)
        while todo:
            todo.pop()()
        return found

    monkeypatch.setattr(engine, "scan", scan)


def wait_until(condition, what: str):
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {WAIT_SECONDS} s")
        time.sleep(0.02)


# Root bypasses permission bits (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH): to see what a job's user sees of a
# chmod 000 file, the calling thread drops them from its effective set for a while (threads started meanwhile,
# the engine's pool, inherit that), and takes them back after: they stay in the permitted set.
_CAP_VERSION_3 = 0x20080522
_DAC_CAPS = (1 << 1) | (1 << 2)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _capabilities(data=None):
    libc = ctypes.CDLL(None, use_errno=True)
    header = _CapHeader(_CAP_VERSION_3, 0)
    if data is None:
        data = (_CapData * 2)()
        if libc.capget(ctypes.byref(header), data) != 0:
            raise OSError(ctypes.get_errno(), "capget")
        return data
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    return data


@contextlib.contextmanager
def as_an_ordinary_user():
    """Permission bits apply in this thread (and threads it starts) inside the block."""
    if os.geteuid() != 0:
        yield
        return
    caps = _capabilities()
    saved = caps[0].effective
    caps[0].effective &= ~_DAC_CAPS
    _capabilities(caps)
    try:
        yield
    finally:
        caps[0].effective = saved
        _capabilities(caps)


# --------------------------------------------------------------------------- tree.scan


def test_scan_takes_regular_files_of_nested_folders_with_their_identity(tmp_path):
    root = tmp_path / "src"
    files = {"a.txt": b"a", "ck/iter_1/shard_0.bin": b"s0" * 10, "ck/iter_1/deep/er/x.bin": b"", "b": b"bb"}
    for relative, data in files.items():
        write(root / relative, data)
    (root / "empty" / "folder").mkdir(parents=True)
    log = Log()

    found = tree.scan(str(root), tree.Skipped(log.warning))

    assert sorted(found) == sorted(files)
    for relative, entry in found.items():
        stats = os.stat(root / relative)
        assert entry.identity == (stats.st_size, stats.st_mtime_ns, stats.st_ino)
        assert entry.path == str(root / relative)
    assert log.records == []
    assert tree.scan(str(tmp_path / "missing"), tree.Skipped(log.warning)) == {}


def test_scan_takes_a_link_to_a_file_inside_with_the_targets_identity_also_through_a_linked_root(tmp_path):
    root = tmp_path / "src"
    target = write(root / "ck" / "model.bin", b"weights")
    os.symlink(target, root / "absolute.bin")
    os.symlink("ck/model.bin", root / "relative.bin")
    os.symlink(root, tmp_path / "alias")  # the job was given the folder through a link

    for seen_as in (root, tmp_path / "alias"):
        found = tree.scan(str(seen_as), tree.Skipped(Log().warning))

        assert sorted(found) == ["absolute.bin", "ck/model.bin", "relative.bin"]
        stats = os.stat(target)
        for name in ("absolute.bin", "relative.bin"):
            assert found[name].identity == (stats.st_size, stats.st_mtime_ns, stats.st_ino)
            assert Path(found[name].path).read_bytes() == b"weights"


def test_scan_skips_what_cannot_be_synced_with_one_warning_per_path_across_scans(tmp_path, monkeypatch):
    root = tmp_path / "src"
    write(root / "good.txt", b"good")
    write(root / "sub" / "inner.txt", b"inner")
    outside = write(tmp_path / "outside.txt", b"not the job's")
    sibling = write(tmp_path / "src-other" / "f.txt", b"a folder whose name starts like the root's")
    skipped_paths = {
        "link-outside": outside,
        "link-sibling": sibling,  # commonpath, not a string prefix
        "link-folder": root / "sub",
        "dangling": root / "nothing-here",
    }
    for name, points_to in skipped_paths.items():
        os.symlink(points_to, root / name)
    os.mkfifo(root / "fifo")
    os.symlink(root / "fifo", root / "link-fifo")
    os.symlink("loop-b", root / "loop-a")
    os.symlink("loop-a", root / "loop-b")
    monkeypatch.chdir(root)  # a socket's path must fit in 108 bytes: bound by a relative name
    listener = socket.socket(socket.AF_UNIX)
    listener.bind("sock")
    listener.close()
    bad_file = os.path.join(os.fsencode(root), b"bad-\xff.txt")
    bad_folder = os.path.join(os.fsencode(root), b"bad-\xfe")
    with open(bad_file, "wb") as f:
        f.write(b"x")
    os.mkdir(bad_folder)
    with open(os.path.join(bad_folder, b"inside.txt"), "wb") as f:
        f.write(b"x")
    log = Log()
    skipped = tree.Skipped(log.warning)

    first = tree.scan(str(root), skipped)
    second = tree.scan(str(root), skipped)

    assert sorted(first) == sorted(second) == ["good.txt", "sub/inner.txt"]
    warnings = log.fields("sync skipped a file", "warning")
    reasons = {w["path"]: w["reason"] for w in warnings}
    assert len(warnings) == len(reasons) == 11, warnings  # once each, though scanned twice
    expected = {
        "link-outside": "outside the folder", "link-sibling": "outside the folder", "link-folder": "a directory",
        "dangling": "to nothing", "fifo": "FIFO", "sock": "socket", "link-fifo": "a FIFO", "loop-a": "link",
        "loop-b": "link",
    }
    for name, words in expected.items():
        assert words in reasons[str(root / name)], reasons
    for bad in (bad_file, bad_folder):
        assert "not UTF-8" in reasons[os.fsdecode(bad)]


# --------------------------------------------------------------------------- manifest


def test_manifest_round_trip(tmp_path):
    path = tmp_path / "state" / "m.manifest.json"
    manifest = Manifest.load(path, "obs://b/out/", Log())
    manifest.put("a.txt", Record((1, 2, 3), "0" * 32, "etag-a"))
    manifest.put("ck/big.bin", Record((10, 20, 30), None, "etag-big-2", 1_795_775_605_208_373_052))
    manifest.save()

    loaded = Manifest.load(path, "obs://b/out/", Log())

    assert loaded.files == manifest.files
    assert not loaded.dirty
    assert os.listdir(path.parent) == [path.name]  # no temporary file left beside it


def test_a_manifest_an_earlier_runtime_wrote_without_births_is_kept(tmp_path):
    path = tmp_path / "m.manifest.json"
    path.write_text('{"version":1,"url":"obs://b/out/","files":{"a.txt":[1,2,3,null,"etag-a"]}}')

    assert Manifest.load(path, "obs://b/out/", Log()).files == {"a.txt": Record((1, 2, 3), None, "etag-a", None)}


@pytest.mark.parametrize("content", [
    pytest.param(lambda good: good[: len(good) // 2], id="torn"),
    pytest.param(lambda good: good.replace(b"obs://b/out/", b"obs://b/other/"), id="another-channels-url"),
    pytest.param(lambda good: good.replace(b'"version":1', b'"version":99'), id="another-version"),
    pytest.param(lambda good: good.replace(b"[1,2,3,", b"[1,2,"), id="edited-entry"),
    pytest.param(lambda good: good.replace(b'"files":{', b'"files":{"x":7,'), id="entry-not-a-list"),
    pytest.param(lambda good: good.replace(b'"etag-a",null]', b'"etag-a","x"]'), id="birth-not-a-number"),
    pytest.param(lambda good: b"[1, 2]", id="a-list"),
    pytest.param(lambda good: b"", id="empty"),
    pytest.param(lambda good: b"\xff\xfe not json", id="binary"),
])
def test_an_unusable_manifest_starts_afresh(tmp_path, content):
    path = tmp_path / "m.manifest.json"
    manifest = Manifest.load(path, "obs://b/out/", Log())
    manifest.put("a.txt", Record((1, 2, 3), "0" * 32, "etag-a"))
    manifest.put("b.txt", Record((4, 5, 6), "1" * 32, "etag-b"))
    manifest.save()
    path.write_bytes(content(path.read_bytes()))

    assert Manifest.load(path, "obs://b/out/", Log()).files == {}


@pytest.mark.parametrize("what", ["fifo", "folder"])
def test_something_else_at_the_manifests_path_is_set_aside_without_blocking(tmp_path, what):
    path = tmp_path / "m.manifest.json"
    if what == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    log = Log()

    manifest = Manifest.load(path, "obs://b/out/", log)

    assert manifest.files == {}
    (warning,) = log.fields("record set aside", "warning")
    assert not os.path.lexists(path) and os.path.lexists(warning["kept_as"])
    manifest.put("a.txt", Record((1, 2, 3), None, "e"))
    manifest.save()  # the path is free again for the manifest
    assert Manifest.load(path, "obs://b/out/", Log()).files == manifest.files


def test_keep_listed_forgets_entries_whose_object_is_missing_or_replaced(tmp_path):
    manifest = Manifest.load(tmp_path / "m.json", "obs://b/out/", Log())
    manifest.put("same.txt", Record((1, 1, 1), None, "e1"))
    manifest.put("replaced.txt", Record((2, 2, 2), None, "e2"))
    manifest.put("missing.txt", Record((3, 3, 3), None, "e3"))
    manifest.put("no-etag.txt", Record((4, 4, 4), None, None))  # a store without ETags: present is enough
    manifest.dirty = False
    listed = {"out/same.txt": "e1", "out/replaced.txt": "other", "out/no-etag.txt": "whatever"}

    forgotten = manifest.keep_listed(listed, lambda relative: "out/" + relative)

    assert forgotten == 2
    assert sorted(manifest.files) == ["no-etag.txt", "same.txt"]
    assert manifest.dirty


# --------------------------------------------------------------------------- ChannelSync.cycle, LocalStore


@pytest.fixture
def writers_unknown(monkeypatch):
    """Who writes what cannot be told (a /proc with hidepid): the sync falls back to two looks that agree."""
    monkeypatch.setattr(writers, "open_for_writing", lambda roots, inodes: None)


def test_a_new_file_closed_by_its_writer_goes_up_at_its_first_look(tmp_path):
    channel = Channel(tmp_path)
    write(channel.root / "ck" / "a.bin", b"abc")

    first = channel.cycle()

    assert (first.files, first.bytes) == (1, 3)
    assert channel.uploaded() == {"ck/a.bin": b"abc"}


def test_a_file_held_open_for_writing_waits_until_its_writer_closes_it_or_two_looks_agree(tmp_path):
    channel = Channel(tmp_path)
    path = channel.root / "ck" / "a.bin"
    path.parent.mkdir(parents=True)
    with open(path, "wb") as writer:
        writer.write(b"half")
        writer.flush()
        assert channel.cycle().files == 0  # open for writing: not whole yet
        writer.write(b" and the rest")
        writer.flush()
        assert channel.cycle().files == 0  # changed since the last look, and still open
    assert channel.uploaded() == {}

    assert channel.cycle().files == 1  # closed
    assert channel.uploaded() == {"ck/a.bin": b"half and the rest"}


def test_writers_seen_through_proc_name_only_the_files_open_for_writing(tmp_path):
    from ma_runtime.sync import writers

    (tmp_path / "closed.bin").write_bytes(b"x")
    with open(tmp_path / "closed.bin", "rb"), open(tmp_path / "open.bin", "ab"):  # read, and written
        inodes = {os.stat(tmp_path / name).st_ino for name in ("closed.bin", "open.bin")}
        assert writers.open_for_writing([str(tmp_path)], inodes) == {os.stat(tmp_path / "open.bin").st_ino}
        assert writers.open_for_writing([str(tmp_path / "elsewhere")], inodes) == set()


def test_a_file_replaced_by_rename_every_cycle_reaches_the_store_at_each_cycle(tmp_path):
    """Lightning's last.ckpt, saved every second by an atomic writer: the version each look sees goes up."""
    channel = Channel(tmp_path)
    path = channel.root / "last.ckpt"
    for version in range(3):
        write(channel.root / ".last.ckpt.tmp", b"version %d" % version)
        os.replace(channel.root / ".last.ckpt.tmp", path)

        result = channel.cycle()

        assert result.files == 1, version
        assert channel.uploaded() == {"last.ckpt": b"version %d" % version}  # never the temporary name


def test_a_large_file_renamed_over_while_its_parts_go_up_completes_with_the_version_it_started_with(tmp_path):
    store = AfterParts(LocalStore(), lambda: replace_by_rename(path))
    channel = Channel(tmp_path, store, workers=1)
    path = write(channel.root / "big.bin", random_bytes(12 * MiB))
    started_with = path.read_bytes()

    first = channel.cycle()

    assert (first.files, first.error) == (1, None)
    assert channel.uploaded()["big.bin"] == started_with  # whole: one version, not a mix
    store.action = lambda: None
    assert channel.cycle().files == 1  # the newer version, next cycle
    assert channel.uploaded()["big.bin"] == path.read_bytes() == started_with[::-1]


def test_a_new_file_goes_up_on_the_second_periodic_look_when_writers_cannot_be_told(tmp_path, writers_unknown):
    channel = Channel(tmp_path)
    write(channel.root / "ck" / "a.bin", b"abc")

    first = channel.cycle()
    assert (first.files, channel.uploaded()) == (0, {})

    second = channel.cycle()
    assert (second.files, second.bytes) == (1, 3)
    assert channel.uploaded() == {"ck/a.bin": b"abc"}
    assert channel.log.fields("output upload completed")[-1]["files"] == 1


def test_a_file_that_changes_between_two_looks_waits_until_two_looks_agree(tmp_path, writers_unknown):
    channel = Channel(tmp_path)
    path = write(channel.root / "a.bin", b"first")
    channel.cycle()
    append(path)

    assert channel.cycle().files == 0  # looked different than at the last look
    assert channel.uploaded() == {}
    assert channel.cycle().files == 1
    assert channel.uploaded() == {"a.bin": b"firstappended"}


def test_the_final_cycle_takes_a_new_file_on_its_first_look(tmp_path):
    channel = Channel(tmp_path)
    write(channel.root / "a.bin", b"abc")
    write(channel.root / "big.bin", random_bytes(LARGE))

    result = channel.cycle(final=True)

    assert (result.files, result.bytes, result.missing, result.error) == (2, 3 + LARGE, [], None)
    assert channel.uploaded() == {"a.bin": b"abc", "big.bin": random_bytes(LARGE)}
    assert channel.log.fields("output upload completed")[-1]["final"] is True


def test_unchanged_files_are_not_uploaded_again_also_after_a_restart(tmp_path):
    channel = Channel(tmp_path)
    for i in range(5):
        write(channel.root / f"f{i}.txt", b"x" * i)
    write(channel.root / "big.bin", random_bytes(LARGE))
    assert channel.cycle(final=True).files == 6
    sent = (list(channel.store.written), list(channel.store.parts))

    again = channel.cycle()
    channel.sync = channel.restarted()
    channel.sync.start()
    after_restart = channel.cycle(final=True)

    assert (again.files, again.bytes, after_restart.files, after_restart.bytes) == (0, 0, 0, 0)
    assert (channel.store.written, channel.store.parts) == sent


@pytest.mark.parametrize("how", ["touched", "copied over"])
def test_a_small_file_with_new_identity_but_the_same_content_is_not_sent_again(tmp_path, how):
    channel = Channel(tmp_path)
    path = write(channel.root / "a.txt", b"same bytes")
    channel.cycle(final=True)
    if how == "touched":
        os.utime(path, ns=(PAST_NS + 10**9, PAST_NS + 10**9))
    else:
        replace_by_rename(path)
        replace_by_rename(path)  # reversed twice: the same bytes in another inode

    result = channel.cycle(final=True)

    assert (result.bytes, channel.store.written) == (0, [str(channel.dest / "a.txt")])
    assert channel.cycle(final=True).files == 0  # the new identity was recorded: not even read again


@pytest.mark.parametrize("size", [1024, LARGE], ids=["small", "large"])
@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_a_file_that_changes_between_scan_and_read_is_held_then_taken_as_it_is_now(tmp_path, monkeypatch, size,
                                                                                  change):
    channel = Channel(tmp_path)
    path = write(channel.root / "ck" / "model.bin", random_bytes(size))
    write(channel.root / "other.txt", b"other")
    after_scan(monkeypatch, lambda: CHANGES[change](path))

    held = channel.cycle(final=True)

    assert (held.files, held.missing, held.error) == (1, ["ck/model.bin"], None)
    assert channel.uploaded() == {"other.txt": b"other"}
    assert channel.sync.manifest.get("ck/model.bin") is None
    assert channel.parts_records() == []
    taken = channel.cycle(final=True)
    assert (taken.files, taken.missing) == (1, [])
    assert channel.uploaded()["ck/model.bin"] == path.read_bytes()


@pytest.mark.parametrize("change", ["rewritten in place", "appended to", "truncated"])
def test_a_large_file_that_changes_while_its_parts_go_up_is_abandoned_and_taken_next_cycle(tmp_path, change):
    changes = {**CHANGES, "truncated": lambda p: os.truncate(p, 6 * MiB)}
    store = AfterParts(LocalStore(), lambda: changes[change](path))
    channel = Channel(tmp_path, store, workers=1)
    path = write(channel.root / "big.bin", random_bytes(12 * MiB))
    write(channel.root / "small.txt", b"small")

    abandoned = channel.cycle(final=True)

    assert (abandoned.error, abandoned.missing) == (None, ["big.bin"])
    assert channel.uploaded() == {"small.txt": b"small"}
    assert LocalStore().list_uploads("", str(channel.dest) + "/") == []  # aborted, not left behind
    assert channel.parts_records() == []
    store.action = lambda: None
    taken = channel.cycle(final=True)
    assert (taken.files, taken.missing) == (1, [])
    assert channel.uploaded()["big.bin"] == path.read_bytes()


def test_a_growing_log_goes_up_each_cycle_as_the_snapshot_of_its_length_at_the_scan(tmp_path, monkeypatch):
    channel = Channel(tmp_path, is_log=True)
    log_file = write(channel.root / "task.log", b"line 1\n")
    written = [b"line 1\n"]

    def grow():
        with open(log_file, "ab") as f:
            f.write(b"line %d\n" % (len(written) + 1))
        written.append(log_file.read_bytes())

    for cycle in range(3):
        after_scan(monkeypatch, grow)
        result = channel.cycle()  # a periodic cycle: a log needs no second look

        assert result.files == 1
        uploaded = channel.uploaded()["task.log"]
        assert uploaded == written[cycle], cycle  # what the scan saw, a prefix of what is there now
        assert log_file.read_bytes().startswith(uploaded)


# --------------------------------------------------------------------------- completion markers


def checkpoint(root: Path) -> None:
    write(root / "ck" / "iter_1" / "shard_0.bin", b"shard 0")
    write(root / "ck" / "iter_1" / "shard_1.bin", b"shard 1")
    write(root / "ck" / "iter_1" / "sub" / "optimizer.bin", b"optimizer")
    write(root / "ck" / "iter_1" / "x.done", b"done")
    write(root / "latest_checkpointed_iteration.txt", b"1")


MARKER_FILES = ("ck/iter_1/x.done", "latest_checkpointed_iteration.txt")


@pytest.mark.parametrize("file", ["ck/iter_1/shard_1.bin", "ck/iter_1/sub/optimizer.bin"])
def test_a_marker_waits_for_an_unstable_file_of_its_unit_and_goes_up_the_cycle_after(tmp_path, file,
                                                                                    writers_unknown):
    channel = Channel(tmp_path)
    checkpoint(channel.root)
    channel.cycle()
    append(channel.root / file)  # still being written at the second look

    second = channel.cycle()

    assert second.files == 2  # the two other files of the checkpoint, not the markers
    assert not set(MARKER_FILES) & set(channel.uploaded())
    third = channel.cycle()
    assert third.files == 3
    assert channel.store.written[-2:] == [str(channel.dest / marker) for marker in MARKER_FILES]
    assert channel.uploaded()[file] == (channel.root / file).read_bytes()


def test_a_marker_waits_for_a_file_of_its_unit_that_changed_while_read(tmp_path, monkeypatch):
    channel = Channel(tmp_path)
    checkpoint(channel.root)
    after_scan(monkeypatch, lambda: append(channel.root / "ck" / "iter_1" / "shard_0.bin"))

    held = channel.cycle(final=True)

    assert sorted(held.missing) == ["ck/iter_1/shard_0.bin", *MARKER_FILES]
    assert not set(MARKER_FILES) & set(channel.uploaded())
    assert channel.cycle(final=True).missing == []
    assert channel.store.written[-2:] == [str(channel.dest / marker) for marker in MARKER_FILES]


def test_a_marker_waits_for_an_unreadable_file_of_its_unit(tmp_path):
    channel = Channel(tmp_path)
    checkpoint(channel.root)
    os.chmod(channel.root / "ck" / "iter_1" / "shard_1.bin", 0)

    with as_an_ordinary_user():
        channel.cycle(final=True)

    assert "ck/iter_1/shard_1.bin" not in channel.uploaded()
    assert channel.log.fields("sync skipped a file")  # said, at least
    assert not set(MARKER_FILES) & set(channel.uploaded())


def test_markers_go_up_after_the_files_of_their_unit_deepest_first(tmp_path):
    channel = Channel(tmp_path)
    checkpoint(channel.root)
    write(channel.root / "ck" / "iter_2" / "model.bin", random_bytes(LARGE))  # multipart, after small files
    write(channel.root / "ck" / "iter_2" / "iter_2.done", b"done")
    write(channel.root / "ck" / "iter_2" / "deeper" / "part.done", b"done")
    write(channel.root / "ck" / "iter_2" / "deeper" / "part.bin", b"part")

    result = channel.cycle(final=True)

    assert (result.files, result.missing) == (9, [])
    order = [str(Path(key).relative_to(channel.dest)) for key in channel.store.written]
    position = {relative: order.index(relative) for relative in order}
    units = {"ck/iter_1/x.done": "ck/iter_1/", "ck/iter_2/iter_2.done": "ck/iter_2/",
             "ck/iter_2/deeper/part.done": "ck/iter_2/deeper/", "latest_checkpointed_iteration.txt": ""}
    for marker, folder in units.items():
        inside = [r for r in order if r.startswith(folder) and r != marker]
        assert all(position[r] < position[marker] for r in inside), (marker, order)
    assert position["ck/iter_2/deeper/part.done"] < position["ck/iter_2/iter_2.done"]
    assert order[-1] == "latest_checkpointed_iteration.txt"


# --------------------------------------------------------------------------- deletes


def test_with_delete_a_vanished_uploaded_file_is_removed_from_the_target(tmp_path):
    channel = Channel(tmp_path, delete=True)
    write(channel.root / "keep.txt", b"keep")
    gone = write(channel.root / "ck" / "old.bin", b"rotated away")
    write(channel.dest / "not-ours.txt", b"a pre-downloaded file this sync never uploaded")
    channel.cycle(final=True)
    gone.unlink()

    channel.cycle()

    assert channel.uploaded() == {"keep.txt": b"keep", "not-ours.txt": b"a pre-downloaded file this sync never "
                                                                           b"uploaded"}
    assert channel.store.deleted == [str(channel.dest / "ck" / "old.bin")]
    assert channel.sync.manifest.get("ck/old.bin") is None
    assert channel.log.fields("deleted from the store: removed locally")[0]["path"] == "ck/old.bin"


def test_without_delete_a_vanished_file_stays_in_the_target(tmp_path):
    channel = Channel(tmp_path)
    gone = write(channel.root / "old.bin", b"rotated away")
    channel.cycle(final=True)
    gone.unlink()

    channel.cycle()
    channel.cycle(final=True)

    assert channel.uploaded() == {"old.bin": b"rotated away"}
    assert channel.store.deleted == []


def _chmod_000(root: Path, relative: str) -> None:
    path = root / relative
    append(path)  # changed too: the sync tries to read it again
    os.chmod(path, 0)


def _unlistable_folder(root: Path, relative: str) -> None:
    os.chmod((root / relative).parent, 0)


def _listable_not_searchable(root: Path, relative: str) -> None:
    os.chmod((root / relative).parent, 0o644)


def _unlistable_root(root: Path, relative: str) -> None:
    os.chmod(root, 0)


def _fifo_in_its_place(root: Path, relative: str) -> None:
    (root / relative).unlink()
    os.mkfifo(root / relative)


def _link_outside_in_its_place(root: Path, relative: str) -> None:
    (root / relative).unlink()
    os.symlink(root.parent / "outside.txt", root / relative)


@pytest.mark.parametrize("make_unsyncable", [
    _chmod_000,
    _unlistable_folder,
    _listable_not_searchable,
    _unlistable_root,
    _fifo_in_its_place,
    _link_outside_in_its_place,
])
def test_delete_never_removes_the_object_of_a_file_that_is_still_there(tmp_path, make_unsyncable):
    channel = Channel(tmp_path, delete=True)
    relative = "ck/iter_1/shard_0.bin"
    write(channel.root / relative, b"shard")
    write(tmp_path / "outside.txt", b"outside")
    channel.cycle(final=True)
    make_unsyncable(channel.root, relative)

    try:
        with as_an_ordinary_user():
            channel.cycle()
            channel.cycle(final=True)
    finally:
        os.chmod(channel.root, 0o755)
        os.chmod(channel.root / "ck" / "iter_1", 0o755)

    assert channel.store.deleted == []
    assert channel.uploaded() == {relative: b"shard"}


# --------------------------------------------------------------------------- deadline and failures


def test_a_final_cycle_past_its_deadline_uploads_nothing_and_names_every_changed_file_missing(tmp_path):
    channel = Channel(tmp_path)
    checkpoint(channel.root)
    write(channel.root / "big.bin", random_bytes(LARGE))
    write(channel.root / "done-before.txt", b"up already")
    channel.cycle(final=True, only=lambda relative: relative == "done-before.txt")
    channel.store.written.clear()

    result = channel.cycle(final=True, deadline=time.monotonic() - 1)

    changed = sorted(["big.bin", "ck/iter_1/shard_0.bin", "ck/iter_1/shard_1.bin", "ck/iter_1/sub/optimizer.bin",
                      *MARKER_FILES])
    assert (result.files, result.bytes, result.missing) == (0, 0, changed)
    assert (channel.store.written, channel.store.parts) == ([], [])
    assert sorted(channel.sync.manifest.files) == ["done-before.txt"]


class Hanging(Recording):
    """PUTs of `key` wait until `release` is set (a hung connection, as far as the sync can tell)."""

    def __init__(self, store, key):
        super().__init__(store)
        self.key = key
        self.release = threading.Event()
        self.entered = threading.Event()

    def put_bytes(self, bucket, key, data, md5_hex):
        if key == self.key:
            self.entered.set()
            self.release.wait(WAIT_SECONDS)
        return super().put_bytes(bucket, key, data, md5_hex)


def test_a_final_cycle_returns_at_its_deadline_while_an_upload_hangs_and_names_what_is_missing(tmp_path):
    store = Hanging(LocalStore(), str(tmp_path / "dest" / "ck" / "iter_1" / "shard_1.bin"))
    channel = Channel(tmp_path, store)
    checkpoint(channel.root)
    try:
        result = channel.cycle(final=True, deadline=time.monotonic() + 1.0)
        returned_while_hanging = not store.release.is_set() and store.entered.is_set()
    finally:
        store.release.set()

    assert returned_while_hanging
    assert "ck/iter_1/shard_1.bin" in result.missing and set(MARKER_FILES) <= set(result.missing)
    assert not set(MARKER_FILES) & set(channel.uploaded())


def test_a_final_cycle_past_its_deadline_makes_no_store_call_not_even_a_delete(tmp_path):
    channel = Channel(tmp_path, delete=True)
    gone = write(channel.root / "old.bin", b"rotated away")
    channel.cycle(final=True)
    gone.unlink()

    channel.cycle(final=True, deadline=time.monotonic() - 1)

    assert channel.store.deleted == []


def test_a_refused_upload_ends_the_cycle_records_nothing_and_the_next_cycle_retries(tmp_path):
    store = Denying(LocalStore())
    channel = Channel(tmp_path, store, workers=1)
    checkpoint(channel.root)
    write(channel.root / "big.bin", random_bytes(LARGE))

    refused = channel.cycle(final=True)

    assert store.refused == 1  # the first refusal ends the cycle: no call for the 5 other files
    assert "access denied" in refused.error
    assert (refused.files, channel.uploaded(), channel.sync.manifest.files) == (0, {}, {})
    manifest = json.loads(channel.sync.manifest.path.read_bytes()) if channel.sync.manifest.path.exists() else None
    assert manifest is None or manifest["files"] == {}
    warning = channel.log.fields("output upload failed", "warning")[-1]
    assert (warning["name"], warning["url"], warning["error"]) == ("train_url", str(channel.dest), refused.error)
    store.deny = False
    assert channel.cycle(final=True).files == 6
    assert MARKER_FILES[-1] in channel.uploaded()


# --------------------------------------------------------------------------- multipart resume and settle (moto)


class ObsChannel:
    """A channel to `obs://<new bucket>/out/` on moto, through the real OBS SDK."""

    def __init__(self, endpoint, tmp_path, large_threshold=reading.SMALL_LIMIT, store=Recording):
        self.endpoint = endpoint
        self.bucket = endpoint.new_bucket()
        env = {**endpoint.env(), "MA_HOME": str(tmp_path / "home")}
        url = f"obs://{self.bucket}/out/"
        self.obs = open_store(storage_url.parse(url), job_spec.load({}, env), env)
        self.store = store(self.obs)
        self.channel = Channel(tmp_path, self.store, url=url, workers=1, large_threshold=large_threshold)
        self.big = write(self.channel.root / "big.bin", random_bytes(12 * MiB))

    def multipart(self, store=None):
        """A Multipart of big.bin, made as the sync makes it (so the sync finds its record); by default its
        stop is set once part 1 is up: an upload interrupted after one part."""
        stop = threading.Event()
        stats = os.stat(self.big)
        options = self.channel.sync.options
        key = "out/big.bin"
        upload = transfer.Multipart(store or AfterParts(self.obs, stop.set), self.bucket, key,
                                     f"obs://{self.bucket}/{key}", Path(str(self.channel.root) + "/big.bin"), stats,
                                     options, Log(), stop=stop, quiet=True)
        return upload

    def unfinished(self):
        return [u["Key"] for u in self.endpoint.s3.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])]

    def object(self, key):
        return self.endpoint.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()


def test_an_interrupted_multipart_upload_keeps_its_record_and_is_resumed_with_only_the_missing_parts(
        obs_endpoint, tmp_path):
    obs = ObsChannel(obs_endpoint, tmp_path)
    with pytest.raises(TransientError, match="interrupted"):
        obs.multipart().run()
    (record_path,) = obs.channel.parts_records()
    record = json.loads(record_path.read_bytes())
    assert record["upload_id"] and list(record["parts"]) == ["1"]
    assert obs.unfinished() == ["out/big.bin"]

    obs.channel.sync.start()  # settles: the file is unchanged, so the upload is kept for resuming
    assert (obs.channel.parts_records(), obs.unfinished()) == ([record_path], ["out/big.bin"])
    result = obs.channel.cycle(final=True)

    assert (result.files, result.missing, result.error) == (1, [], None)
    assert sorted(obs.store.parts) == [2, 3]  # part 1 was not sent again
    assert obs.object("out/big.bin") == obs.big.read_bytes()
    assert (obs.channel.parts_records(), obs.unfinished()) == ([], [])
    assert obs.channel.log.fields("upload resumed")[0]["parts_done"] == 1


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_an_interrupted_upload_of_a_file_that_changed_since_is_aborted_at_start(obs_endpoint, tmp_path, change):
    obs = ObsChannel(obs_endpoint, tmp_path)
    with pytest.raises(TransientError):
        obs.multipart().run()
    CHANGES[change](obs.big)

    obs.channel.sync.start()

    assert (obs.channel.parts_records(), obs.unfinished()) == ([], [])
    assert obs.channel.log.fields("aborted unfinished uploads of files that changed")[0]["uploads"] == 1
    assert obs.channel.cycle(final=True).files == 1
    assert sorted(obs.store.parts) == [1, 2, 3]
    assert obs.object("out/big.bin") == obs.big.read_bytes()


def test_an_upload_created_but_never_recorded_is_found_by_its_key_and_aborted_at_start(obs_endpoint, tmp_path):
    obs = ObsChannel(obs_endpoint, tmp_path)
    with pytest.raises(Crash):  # killed between the upload's creation and the record of its id
        obs.multipart(CrashAfterCreate(obs.obs)).run()
    (record_path,) = obs.channel.parts_records()
    assert json.loads(record_path.read_bytes())["upload_id"] == ""
    assert obs.unfinished() == ["out/big.bin"]

    obs.channel.sync.start()

    assert (obs.channel.parts_records(), obs.unfinished()) == ([], [])


def test_settle_leaves_the_uploads_of_other_channels_alone(obs_endpoint, tmp_path):
    obs = ObsChannel(obs_endpoint, tmp_path)
    with pytest.raises(TransientError):
        obs.multipart().run()
    append(obs.big)  # changed: its own channel would abort it

    aborted = transfer.settle_uploads(obs.obs, obs.channel.state / "parts", f"obs://{obs.bucket}/out-other/",
                                      lambda record: False, Log())

    assert aborted == 0
    assert obs.unfinished() == ["out/big.bin"]
    assert len(obs.channel.parts_records()) == 1


# --------------------------------------------------------------------------- targets and settings


def load_spec(tmp_path, outputs=(), env=(), **top):
    job = tmp_path / "job.json"  # JSON is YAML
    job.write_text(json.dumps({"outputs": list(outputs), **top}))
    return job_spec.load({}, {"MA_HOME": str(tmp_path / "home"), **dict(env)}, str(job))


def output_dir(tmp_path, name="train_url", index=0) -> Path:
    return tmp_path / "home" / "modelarts" / "outputs" / f"{name}_{index}"


@pytest.mark.parametrize("where", ["the folder itself", "a folder inside", "a link leading inside", "file URL"])
def test_a_local_output_target_inside_its_own_folder_is_refused(tmp_path, where):
    inside = output_dir(tmp_path)
    inside.mkdir(parents=True)
    os.symlink(inside / "copy", tmp_path / "link")
    url = {"the folder itself": str(inside), "a folder inside": str(inside / "copy"),
           "a link leading inside": str(tmp_path / "link"), "file URL": f"file://{inside}/copy/"}[where]
    spec = load_spec(tmp_path, [{"name": "train_url", "url": url}])

    with pytest.raises(ConfigError) as caught:
        targets.of(spec)

    assert caught.value.exit_code == ExitCode.BAD_CONFIGURATION
    assert "output 'train_url'" in caught.value.reason and "inside the folder it syncs" in caught.value.reason


def test_local_targets_inside_each_others_folders_are_refused(tmp_path):
    outputs = [{"name": "a", "url": str(output_dir(tmp_path, "b", 1) / "copy-of-a")},
               {"name": "b", "url": str(output_dir(tmp_path, "a", 0) / "copy-of-b")}]
    spec = load_spec(tmp_path, outputs)

    with pytest.raises(ConfigError, match="inside"):
        targets.of(spec)


def test_a_log_url_inside_the_log_folder_is_refused(tmp_path):
    spec = load_spec(tmp_path, env={"MA_RUNTIME_LOG_URL": str(tmp_path / "home" / "modelarts" / "log" / "up")})

    with pytest.raises(ConfigError, match="MA_RUNTIME_LOG_URL"):
        targets.of(spec)


def test_a_local_target_beside_its_folder_with_a_name_that_starts_alike_is_taken(tmp_path):
    url = str(output_dir(tmp_path)) + "-copy"
    spec = load_spec(tmp_path, [{"name": "train_url", "url": url}])

    (target,) = targets.of(spec)

    assert (target.root, target.url) == (output_dir(tmp_path), url)


@pytest.mark.parametrize("log_url_from", ["job file", "env"])
def test_targets_leave_out_sync_false_and_add_the_log_channel_for_a_log_url(tmp_path, log_url_from):
    outputs = [{"name": "train_url", "url": "obs://b/train/", "delete": True},
               {"name": "scratch", "url": "obs://b/scratch/", "sync": False},
               {"name": "eval_url", "url": "obs://b/eval/"}]
    log_url = "obs://b/logs/"
    top, env = ({"log_url": log_url}, {}) if log_url_from == "job file" else ({}, {"MA_RUNTIME_LOG_URL": log_url})
    spec = load_spec(tmp_path, outputs, env, **top)

    found = targets.of(spec)

    assert [(t.name, t.url, t.is_log, t.delete) for t in found] == [
        ("train_url", "obs://b/train/", False, True), ("eval_url", "obs://b/eval/", False, False),
        (targets.LOG_CHANNEL, log_url, True, False)]
    assert found[1].root == output_dir(tmp_path, "eval_url", 2)
    assert found[2].root == spec.log_dir
    assert [t.name for t in targets.of(load_spec(tmp_path, outputs))] == ["train_url", "eval_url"]


@pytest.mark.parametrize("key", ["sync", "delete"])
@pytest.mark.parametrize("value", ["yes", "true", 1, 0, None, [True]])
def test_an_outputs_sync_and_delete_must_be_booleans(tmp_path, key, value):
    with pytest.raises(ConfigError) as caught:
        load_spec(tmp_path, [{"name": "train_url", "url": "obs://b/train/", key: value}])

    assert caught.value.exit_code == ExitCode.BAD_CONFIGURATION
    assert f"{key} must be true or false" in caught.value.reason
    assert "outputs[0]" in caught.value.reason


@pytest.mark.parametrize("markers", ["/abs.done", "../up.done", "ck/../x", ",", "+", "/"])
def test_bad_sync_markers_are_refused(tmp_path, markers):
    with pytest.raises(ConfigError) as caught:
        load_spec(tmp_path, env={"MA_RUNTIME_SYNC_MARKERS": markers})

    assert caught.value.exit_code == ExitCode.BAD_CONFIGURATION
    assert "MA_RUNTIME_SYNC_MARKERS" in caught.value.reason and "bad pattern" in caught.value.reason


def test_sync_markers_replace_the_defaults_or_extend_them_with_a_leading_plus(tmp_path):
    replaced = load_spec(tmp_path, env={"MA_RUNTIME_SYNC_MARKERS": " *.done , COMPLETE,*.done, ck-*/state.json"})
    extended = load_spec(tmp_path, env={"MA_RUNTIME_SYNC_MARKERS": "+step.ok"})
    default = load_spec(tmp_path)

    assert replaced.sync_markers == ("*.done", "COMPLETE", "ck-*/state.json")
    assert default.sync_markers == units.DEFAULT_MARKERS
    assert "checkpoint-*/trainer_state.json" in default.sync_markers
    assert extended.sync_markers == (*units.DEFAULT_MARKERS, "step.ok")


@pytest.mark.parametrize("name, value, says", [
    ("MA_RUNTIME_SYNC_EXCLUDE", "ckpt/*.bak", "no '/'"),
    ("MA_RUNTIME_RESUME", "sometimes", "auto"),
])
def test_bad_exclude_and_resume_settings_are_refused_in_one_line(tmp_path, name, value, says):
    with pytest.raises(ConfigError) as caught:
        load_spec(tmp_path, env={name: value})

    assert caught.value.exit_code == ExitCode.BAD_CONFIGURATION
    assert name in caught.value.reason and says in caught.value.reason and "\n" not in caught.value.reason


def test_sync_exclude_extends_the_writers_temporary_files(tmp_path):
    spec = load_spec(tmp_path, env={"MA_RUNTIME_SYNC_EXCLUDE": "*.bak, scratch"})

    assert spec.sync_exclude == (*units.DEFAULT_EXCLUDES, "*.bak", "scratch")
    assert load_spec(tmp_path).sync_exclude == units.DEFAULT_EXCLUDES


@pytest.mark.parametrize("value", ["0", "0.05", "3601", "-1", "nan", "inf", "five"])
def test_a_sync_interval_outside_0_1_to_3600_seconds_is_refused(tmp_path, value):
    with pytest.raises(ConfigError) as caught:
        load_spec(tmp_path, env={"MA_RUNTIME_SYNC_INTERVAL_SECONDS": value})

    assert caught.value.exit_code == ExitCode.BAD_CONFIGURATION
    assert "MA_RUNTIME_SYNC_INTERVAL_SECONDS" in caught.value.reason


@pytest.mark.parametrize("value", ["0.1", "3600"])
def test_a_sync_interval_at_the_ends_of_its_range_is_taken(tmp_path, value):
    assert load_spec(tmp_path, env={"MA_RUNTIME_SYNC_INTERVAL_SECONDS": value}).sync_interval_seconds == float(value)


# --------------------------------------------------------------------------- termination message


def test_a_termination_message_with_500_unsynced_files_is_cut_under_4096_bytes_saying_how_many_more(tmp_path):
    unsynced = [f"train_url: ck/iter_{i:04d}/model_states_rank_{i:04d}.pt" for i in range(500)]
    message = termination.build(stage="sync", category="platform", exit_code=80, reason="final sync incomplete: "
                                "500 files not uploaded", tail=["x" * 200] * 5, unsynced=unsynced)

    data = termination.render(message)

    assert len(data) <= termination.MAX_BYTES
    kept = json.loads(data)["unsynced"]
    assert kept[:-1] == unsynced[: len(kept) - 1] and len(kept) > 1
    assert kept[-1].startswith(f"... and {500 - (len(kept) - 1)} more")


# --------------------------------------------------------------------------- the uploader process


@pytest.fixture
def uploader_job(tmp_path, monkeypatch):
    """The environment a real uploader process inherits, and a job file with one output to a local folder."""
    for name in _JOB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MA_RUNTIME_SYNC_INTERVAL_SECONDS", "3600")  # no periodic upload races the final one
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"outputs": [{"name": "train_url", "url": str(tmp_path / "dest")}]}))
    files = {"a.txt": b"a", "ck/iter_1/shard.bin": b"shard" * 100, "ck/iter_1/x.done": b"done"}
    for relative, data in files.items():
        write(output_dir(tmp_path) / relative, data)
    (tmp_path / "home" / "modelarts" / "log").mkdir(parents=True)  # the runtime makes it before the uploader
    return str(job), files


def test_the_uploader_process_does_the_final_sync_and_close_leaves_no_process(uploader_job, tmp_path):
    job, files = uploader_job
    uploader = control.Uploader(job_spec.load({}, os.environ, job), Log())
    uploader.start()
    pid = uploader.proc.pid
    try:
        result = uploader.final(time.monotonic() + WAIT_SECONDS)
    finally:
        uploader.close()

    assert (result.answered, result.files, result.bytes, result.missing, result.error) == (
        True, 3, sum(map(len, files.values())), [], None)
    assert {r: (tmp_path / "dest" / r).read_bytes() for r in files} == files
    assert not alive(pid)
    assert uploader.proc is None


def test_the_uploader_syncs_the_outputs_the_runtime_resolved_not_a_job_file_edited_since(uploader_job, tmp_path,
                                                                                            monkeypatch):
    # The uploader once loaded the settings again from the flags, the environment and the job file: a job file
    # (or a variable) changed after the start sent the outputs somewhere the runtime never named.
    job, files = uploader_job
    spec = job_spec.load({}, os.environ, job)
    Path(job).write_text(json.dumps({"outputs": [{"name": "train_url", "url": str(tmp_path / "elsewhere")}]}))
    monkeypatch.setenv("MA_RUNTIME_LOG_LEVEL", "not-a-level")  # would make a second load fail
    uploader = control.Uploader(spec, Log())
    uploader.start()
    try:
        result = uploader.final(time.monotonic() + WAIT_SECONDS)
    finally:
        uploader.close()

    assert (result.answered, result.missing, result.error) == (True, [], None)
    assert {r: (tmp_path / "dest" / r).read_bytes() for r in files} == files
    assert not (tmp_path / "elsewhere").exists()


def _ignores(pid: int, signum: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        ignored = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(ignored & (1 << (signum - 1)))


def test_the_uploader_ignores_terminal_signals_and_ends_by_itself_at_the_end_of_its_channel(uploader_job):
    job, _ = uploader_job
    log = Log()
    uploader = control.Uploader(job_spec.load({}, os.environ, job), log)
    uploader.start()
    proc = uploader.proc
    try:
        wait_until(lambda: all(_ignores(proc.pid, s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)),
                   "the uploader's signal dispositions")
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            os.kill(proc.pid, signum)
        result = uploader.final(time.monotonic() + WAIT_SECONDS)
        assert uploader.proc is proc  # the same process answered
    finally:
        uploader.channel.close()  # what the runtime's death does to it
        try:
            code = proc.wait(WAIT_SECONDS)
        finally:
            uploader.close()  # kills it if it did not end: a failing test leaves no process either

    assert (result.answered, result.files) == (True, 3)
    assert code == 0  # it exited by itself, not killed by close()
    assert log.fields(control.DIED_EVENT) == []


def test_an_uploader_that_dies_during_the_final_sync_is_replaced_by_a_fresh_one_that_answers(uploader_job):
    job, _ = uploader_job
    log = Log()
    uploader = control.Uploader(job_spec.load({}, os.environ, job), log)
    uploader.start()
    proc = uploader.proc
    os.kill(proc.pid, signal.SIGSTOP)  # it cannot answer before it is killed
    answers = []
    asking = threading.Thread(target=lambda: answers.append(uploader.final(time.monotonic() + WAIT_SECONDS)))
    asking.start()
    try:
        wait_until(lambda: uploader.ending, "the final sync's start")
        os.kill(proc.pid, signal.SIGKILL)
        asking.join(WAIT_SECONDS + control.ANSWER_GRACE_SECONDS + 5)
    finally:
        uploader.close()

    (result,) = answers
    assert (result.answered, result.complete, result.files) == (True, True, 3)
    assert log.fields(control.DIED_EVENT) == []  # not the event of a death mid-run: files are still synced
    assert len(log.fields("upload process restarted")) == 1
    assert not alive(proc.pid)


def test_the_final_sync_runs_even_when_the_log_folder_is_gone(uploader_job, tmp_path):
    job, files = uploader_job
    (tmp_path / "home" / "modelarts" / "log").rmdir()
    uploader = control.Uploader(job_spec.load({}, os.environ, job), Log())
    uploader.start()
    try:
        result = uploader.final(time.monotonic() + WAIT_SECONDS)
    finally:
        uploader.close()

    assert (result.answered, result.files, result.missing) == (True, 3, [])


def test_a_killed_uploader_is_restarted_once_then_not_and_the_final_sync_still_runs(uploader_job, tmp_path):
    job, files = uploader_job
    log = Log()
    uploader = control.Uploader(job_spec.load({}, os.environ, job), log)
    uploader.start()
    pids = [uploader.proc.pid]
    try:
        os.kill(pids[0], signal.SIGKILL)
        wait_until(lambda: log.fields("upload process restarted"), "the restart")
        with uploader.lock:
            pids.append(uploader.proc.pid)
        assert pids[1] != pids[0]
        died = log.fields(control.DIED_EVENT, "warning")
        assert [(d["exit_code"], d["pid"]) for d in died] == [(-signal.SIGKILL, pids[0])]

        os.kill(pids[1], signal.SIGKILL)
        wait_until(lambda: len(log.fields(control.DIED_EVENT)) == 2, "the second death's event")
        with uploader.lock:  # the watcher has done all it will do
            assert uploader.proc is None
        assert len(log.fields("upload process restarted")) == 1

        result = uploader.final(time.monotonic() + WAIT_SECONDS)  # in a fresh process
        pids.append(uploader.proc.pid)
    finally:
        uploader.close()

    assert (result.answered, result.files, result.missing) == (True, 3, [])
    assert (tmp_path / "dest" / "ck" / "iter_1" / "x.done").read_bytes() == b"done"
    assert not any(alive(pid) for pid in pids)
    assert len(log.fields(control.DIED_EVENT)) == 2  # the exit at close() is not a death


def test_a_log_whose_earlier_copy_is_in_the_store_is_not_missing_when_its_last_lines_miss_the_deadline(tmp_path):
    store = Hanging(LocalStore(), str(tmp_path / "dest" / "task.log"))
    channel = Channel(tmp_path, store, is_log=True)
    task_log = channel.root / "task.log"
    never = channel.root / "never-sent.log"
    task_log.write_bytes(b"first lines\n")
    store.release.set()
    channel.cycle(final=True)  # a copy of the first lines is in the store
    store.release.clear()
    with open(task_log, "ab") as f:
        f.write(b"the lines since\n")
    never.write_bytes(b"a log the store never had\n")
    store.key = str(tmp_path / "dest" / "task.log")
    try:
        blocked = Hanging(store, str(tmp_path / "dest" / "never-sent.log"))
        channel.sync.store = blocked
        result = channel.cycle(final=True, deadline=time.monotonic() + 1.0)
    finally:
        store.release.set()
        blocked.release.set()

    assert result.missing == ["never-sent.log"]


def test_a_failed_cycle_ends_itself_and_not_the_callers_event(tmp_path):
    channel = Channel(tmp_path, Denying(LocalStore()))
    write(channel.root / "a.bin", b"a")
    outer = threading.Event()

    result = channel.cycle(final=True, stop=outer)

    assert result.error and not outer.is_set()  # the uploader goes on cycling; only this cycle ended


def test_the_first_logs_of_a_final_sync_get_a_third_of_the_time_left_and_the_outputs_the_rest():
    from ma_runtime.sync import uploader

    class Seen:
        def __init__(self, is_log):
            self.target = Target("log" if is_log else "train_url", Path("/nonexistent"), "/x", is_log=is_log)
            self.store = None  # no endpoint: none found dead to skip
            self.deadlines = []

        def cycle(self, final, deadline, only=None, stopped_at=None):
            self.deadlines.append((only is not None, deadline - time.monotonic()))
            return upload_cycle.Result()

    logs, outputs = Seen(True), Seen(False)
    uploads = uploader.Uploads.__new__(uploader.Uploads)
    uploads.logs, uploads.outputs = [logs], [outputs]

    answer = uploads.final(time.monotonic() + 30.0, "all")

    (first, first_left), (rest, rest_left) = logs.deadlines
    assert (first, rest) == (True, False)
    assert 5 < first_left <= 10.5 and 25 < rest_left <= 30  # a third first; the whole deadline after
    assert 25 < outputs.deadlines[0][1] <= 30
    assert answer["missing"] == []


@pytest.mark.parametrize("unsynced, answered, expected", [
    (["train_url: a.pt"], True, "outputs not synced: 1 file(s) did not reach the store within "
                                "MA_RUNTIME_FINAL_SYNC_SECONDS=3: train_url: a.pt"),
    ([f"train_url: {n}.pt" for n in range(5)] + ["log: x.log"], True, "outputs not synced: 6 file(s) did not "
     "reach the store within MA_RUNTIME_FINAL_SYNC_SECONDS=3: train_url: 0.pt, train_url: 1.pt, train_url: 2.pt, "
     "and 3 more"),
    (["log: x.log"], True, "logs not synced: 1 file(s) did not reach the store within "
                           "MA_RUNTIME_FINAL_SYNC_SECONDS=3: log: x.log"),
    (["(unknown)"], False, "outputs not synced: the final sync did not finish"),
])
def test_the_exit_80_reason_names_the_first_files_missing(unsynced, answered, expected):
    from ma_runtime import ending

    result = control.FinalResult(missing=unsynced, answered=answered)
    assert ending.unsynced_reason(unsynced, result, 3.0) == expected


def test_a_folder_whose_walk_is_costly_is_walked_less_often(tmp_path):
    from ma_runtime.sync import uploader

    channel = Channel(tmp_path)
    for index in range(300):
        write(channel.root / f"f{index}", b"x")
    channel.cycle()

    assert channel.sync.walk_cpu > 0  # measured each cycle
    assert uploader.pause(5.0, 0.04) == 5.0  # 10 000 files: the interval stands
    assert uploader.pause(5.0, 4.0) == 80.0  # a million: at most 5 % of a core on walking


def test_the_end_of_a_complete_final_sync_is_an_event_even_with_nothing_left_to_upload(tmp_path):
    channel = Channel(tmp_path)
    write(channel.root / "a.bin", b"a")
    channel.cycle(final=True)
    channel.log.records.clear()

    channel.cycle(final=True)  # the periodic cycles had sent everything

    assert channel.log.fields("output upload completed") == [
        {"name": "train_url", "elapsed_s": pytest.approx(0, abs=5), "files": 0, "bytes": 0, "final": True}]


def test_a_final_sync_that_left_files_out_is_not_announced_as_completed(tmp_path):
    channel = Channel(tmp_path)
    write(channel.root / "a.bin", b"a")

    result = channel.cycle(final=True, deadline=time.monotonic() - 1)

    assert result.missing == ["a.bin"]
    assert channel.log.fields("output upload completed") == []


def test_the_sync_section_of_the_job_file_sets_the_sync_settings(tmp_path):
    spec = load_spec(tmp_path, sync={"interval_seconds": 2, "log_interval_seconds": 60, "final_seconds": 10,
                                     "markers": ["step.ok", "*.done"]}, log_url=str(tmp_path / "logs-up"))

    assert (spec.sync_interval_seconds, spec.sync_log_interval_seconds, spec.sync_final_seconds) == (2, 60, 10)
    assert spec.sync_markers == ("step.ok", "*.done")
    assert spec.log_url == str(tmp_path / "logs-up")
    assert spec.sources["sync_interval_seconds"] == "file"


def test_a_local_target_inside_a_synced_folder_stops_the_run_before_anything_is_fetched(tmp_path, job_env):
    from tests.conftest import run_ma

    data = tmp_path / "data"
    data.mkdir()
    (data / "x.txt").write_text("input")
    home = Path(job_env["MA_HOME"])
    job = tmp_path / "job.json"
    job.write_text(json.dumps({
        "inputs": [{"name": "data_url", "url": str(data) + "/"}],
        "outputs": [{"name": "train_url", "url": str(home / "modelarts" / "outputs" / "train_url_0" / "copy")}]}))

    done = run_ma(["--config", str(job), "--", "true"], {**job_env, "MA_RUNTIME_PREFLIGHT": "off"})

    assert done.returncode == ExitCode.BAD_CONFIGURATION, done.stderr
    assert "output 'train_url': the URL" in done.stderr and "is inside the folder it syncs" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (home / "modelarts" / "inputs").exists()  # nothing staged in for a run that cannot sync
