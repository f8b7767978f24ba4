"""The transfer engine against LocalStore and the real ObsStore on moto (v4 and v2).

Objects are seeded with plain file writes (local) or boto3 (moto), independent
of the code under test. Faults come from small store wrappers (count, fail
after N parts, flip a byte), so each assertion can fail for one reason only.
Sizes: LocalStore trees have 2000 small files and one 200 MB file; moto trees
300 small files and one 40 MB file in 8 MB parts (moto reads the whole object
for every ranged GET and serves ~200 small objects/s).
"""

import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ma_runtime import spec as job_spec
from ma_runtime.storage import safety, transfer
from ma_runtime.storage import url as storage_url
from ma_runtime.storage.base import (
    AccessDenied,
    CorruptTransfer,
    NotFound,
    ObjectChanged,
    ObjectInfo,
    StorageError,
    TransientError,
)
from ma_runtime.storage.local import LocalStore
from ma_runtime.storage.progress import Progress, render_bar
from ma_runtime.storage.stores import open_store
from ma_runtime.storage.transfer import journal as journal_module
from ma_runtime.storage.transfer import upload as upload_module
from tests.recording import Log, Wrapper
from tests.uploads import upload_file

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- helpers


class CountingStore(Wrapper):
    def __init__(self, store):
        super().__init__(store)
        self.reads = []  # (key, start)
        self.parts = []  # upload part numbers
        self.creates = 0

    def read_range(self, bucket, key, start, length, fd, offset, **kwargs):
        with self.lock:
            self.reads.append((key, start))
        return self.inner.read_range(bucket, key, start, length, fd, offset, **kwargs)

    def upload_part(self, bucket, key, upload_id, number, path, offset, size):
        with self.lock:
            self.parts.append(number)
        return self.inner.upload_part(bucket, key, upload_id, number, path, offset, size)

    def create_multipart(self, bucket, key):
        self.creates += 1
        return self.inner.create_multipart(bucket, key)


class FailAfterReads(Wrapper):
    """Ranged reads of `key` succeed `allowed` times, then raise `error` (non-transient by default)."""

    def __init__(self, store, key, allowed, error=StorageError):
        super().__init__(store)
        self.key, self.allowed, self.error = key, allowed, error

    def read_range(self, bucket, key, start, length, fd, offset, **kwargs):
        if key == self.key:
            with self.lock:
                self.allowed -= 1
                exhausted = self.allowed < 0
            if exhausted:
                raise self.error(f"injected failure reading {key} at {start}")
        return self.inner.read_range(bucket, key, start, length, fd, offset, **kwargs)


class FlippingStore(Wrapper):
    """Flips one byte of what each of the first `times` reads of a key wrote to the file."""

    def __init__(self, store, times=99):
        super().__init__(store)
        self.times = times
        self.flips = {}

    def read_range(self, bucket, key, start, length, fd, offset, **kwargs):
        count = self.inner.read_range(bucket, key, start, length, fd, offset, **kwargs)
        with self.lock:
            flip = self.flips.get(key, 0) < self.times and count > 0
            if flip:
                self.flips[key] = self.flips.get(key, 0) + 1
        if flip:
            byte = os.pread(fd, 1, offset)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset)
        return count


class Md5LocalStore(LocalStore):
    """LocalStore whose ObjectInfo carries the content MD5, as a single-part upload's ETag does (its reads then
    check no version: the MD5 is not the local one)."""

    def list(self, bucket, prefix):
        for info in super().list(bucket, prefix):
            yield info if info.key.endswith("/") else ObjectInfo(info.key, info.size, md5_of(Path(info.key)))

    def head(self, bucket, key):
        info = super().head(bucket, key)
        return ObjectInfo(info.key, info.size, md5_of(Path(key)))

    def read_range(self, *args, etag=None, **kwargs):
        return super().read_range(*args, **kwargs)


class MemoryStore:
    """Objects in a dict, with any key S3 allows; ETags are MD5s, checked on every read as If-Match does."""

    def __init__(self, objects):
        self.objects = dict(objects)

    def describe(self):
        return "memory"

    def _info(self, key):
        data = self.objects[key]
        return ObjectInfo(key, len(data), hashlib.md5(data).hexdigest())

    def list(self, bucket, prefix):
        return iter([self._info(key) for key in sorted(self.objects) if key.startswith(prefix)])

    def head(self, bucket, key):
        if key not in self.objects:
            raise NotFound(f"memory://{key} not found")
        return self._info(key)

    def read_range(self, bucket, key, start, length, fd, offset, etag=None, whole=False, tap=None, keyed=None):
        if etag is not None and etag != self._info(key).etag:
            raise ObjectChanged(f"memory://{key} changed after it was listed")
        data = self.objects[key][start:start + length]
        if tap is not None:
            tap(data)
        os.pwrite(fd, data, offset)
        return len(data)


def md5_of(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def sha256_tree(root: Path):
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*")) if path.is_file()
    }


def snapshot(root: Path):
    return sorted((str(p.relative_to(root)), p.is_symlink() or p.is_file() and p.read_bytes())
                  for p in root.rglob("*"))


def partials(root: Path):
    return [p for p in root.rglob("*") if p.name.endswith(transfer.PARTIAL_SUFFIX)]


def random_bytes(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def options(tmp_path, **changes):
    values = {"workers": 8, "part_size": 4 * MiB, "large_threshold": 8 * MiB, "retry_seconds": 5.0,
              "progress_seconds": 0, "state_dir": tmp_path / "state"}
    values.update(changes)
    return transfer.TransferOptions(**values)


def small_tree(count: int, seed: int = 1):
    """`count` files of 0-4 KB in two levels of folders."""
    rng = random.Random(seed)
    return {f"d{i % 10}/e{i % 7}/f{i:05d}.bin": rng.randbytes(rng.randint(0, 4096)) for i in range(count)}


class Source:
    """Where objects are seeded: a local folder (LocalStore) or a moto bucket (ObsStore)."""

    def __init__(self, kind, tmp_path, endpoint=None):
        self.kind = kind
        self.root = tmp_path / "source"
        self.endpoint = endpoint
        self.bucket = endpoint.new_bucket() if endpoint else ""
        self.env = {**endpoint.env(kind.split("-")[1]), "MA_HOME": str(tmp_path / "home")} if endpoint else {}

    @property
    def remote(self):
        return self.endpoint is not None

    def put(self, key, data: bytes):
        if self.remote:
            self.endpoint.put(self.bucket, key, data)
        elif key.endswith("/"):
            (self.root / key).mkdir(parents=True, exist_ok=True)
        else:
            (self.root / key).parent.mkdir(parents=True, exist_ok=True)
            (self.root / key).write_bytes(data)

    def put_many(self, objects):
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda item: self.put(*item), objects.items()))

    def location(self, key):
        if self.remote:
            return storage_url.parse(f"obs://{self.bucket}/{key}")
        return storage_url.parse(str(self.root / key) + ("/" if key.endswith("/") else ""))

    def store(self):
        location = self.location("")
        return open_store(location, job_spec.load({}, self.env), self.env) if self.remote else LocalStore()

    def key(self, key):
        """The key the store reports for `key`."""
        return key if self.remote else str(self.root / key)

    def read(self, key) -> bytes:
        if self.remote:
            return self.endpoint.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        return (self.root / key).read_bytes()


@pytest.fixture(params=["local", "obs-v4", "obs-v2"])
def source(request, tmp_path):
    endpoint = request.getfixturevalue("obs_endpoint") if request.param != "local" else None
    return Source(request.param, tmp_path, endpoint)


@pytest.fixture(params=["local", "obs-v4"])
def any_store(request, tmp_path):
    """For behaviour the signature cannot change: one local and one OBS run."""
    endpoint = request.getfixturevalue("obs_endpoint") if request.param != "local" else None
    return Source(request.param, tmp_path, endpoint)


# --------------------------------------------------------------------------- whole trees


def test_tree_of_small_files_and_a_large_file_arrives_identical(source, tmp_path):
    # Many small files and a large one in several parts, over 16 workers: what the engine does differently at
    # scale. Its speed at realistic sizes is benchmarks/storage.py's to measure, not this test's.
    small_count, large_size, part_size = (600, 64 * MiB, 8 * MiB) if not source.remote else (150, 24 * MiB, 8 * MiB)
    objects = small_tree(small_count)
    objects["models/big.bin"] = random_bytes(large_size, seed=7)
    source.put_many(objects)
    dest = tmp_path / "dest"
    log = Log()
    opts = options(tmp_path, workers=16, part_size=part_size, large_threshold=16 * MiB)

    started = time.monotonic()
    summary = transfer.download(source.store(), _tree_location(source), dest, opts, log)
    print(f"{source.kind}: {len(objects)} files, {summary.bytes / MiB:.0f} MiB in {time.monotonic() - started:.2f} s")

    expected = {key: hashlib.sha256(data).hexdigest() for key, data in objects.items()}
    assert sha256_tree(dest) == expected
    assert (summary.files, summary.skipped, summary.refused) == (len(objects), 0, [])
    assert summary.bytes == sum(len(data) for data in objects.values())
    assert partials(dest) == []
    assert not list((tmp_path / "state").glob("*.download.json"))  # records go once their file is in place
    assert "download completed" in log.events("info")


def _tree_location(source):
    """The whole source: the bucket's root, or the local folder."""
    return source.location("") if source.remote else storage_url.parse(str(source.root) + "/")


def test_rerun_skips_files_already_there_without_reading(any_store, tmp_path):
    any_store.put_many(small_tree(50))
    dest = tmp_path / "dest"
    transfer.download(any_store.store(), _tree_location(any_store), dest, options(tmp_path), Log())
    counting = CountingStore(any_store.store())

    summary = transfer.download(counting, _tree_location(any_store), dest, options(tmp_path), Log())

    assert (summary.files, summary.skipped, counting.reads) == (0, 50, [])


def test_a_changed_object_of_the_same_size_is_fetched_again(obs_endpoint, tmp_path):
    source = Source("obs-v4", tmp_path, obs_endpoint)
    source.put_many({"a.txt": b"version-1", "b.txt": b"stays"})
    dest = tmp_path / "dest"
    transfer.download(source.store(), source.location(""), dest, options(tmp_path), Log())
    source.put("a.txt", b"version-2")  # same size, new ETag

    summary = transfer.download(source.store(), source.location(""), dest, options(tmp_path), Log())

    assert (summary.files, summary.skipped) == (1, 1)
    assert (dest / "a.txt").read_bytes() == b"version-2"


def test_the_journal_writes_in_batches_and_keeps_every_line(tmp_path):
    path = tmp_path / "j.journal"
    journal = journal_module.Journal(path, Log())
    count = journal_module.JOURNAL_BATCH + 7
    for index in range(count):
        journal.add(f"k{index}", f"etag{index}")
    assert len(path.read_text().splitlines()) == journal_module.JOURNAL_BATCH  # one batch out, the rest pending
    journal.close()

    assert journal_module.Journal(path, Log()).etags == {f"k{index}": f"etag{index}" for index in range(count)}


def test_a_torn_journal_line_does_not_swallow_the_next_batch(tmp_path):
    path = tmp_path / "j.journal"
    path.write_text('{"key": "a", "etag": "1"}\n{"key": "b", "et')  # a crash mid-line
    journal = journal_module.Journal(path, Log())
    journal.add("c", "3")
    journal.close()

    assert journal_module.Journal(path, Log()).etags == {"a": "1", "c": "3"}


def test_files_whose_journal_lines_were_lost_are_kept_when_their_size_is_right(tmp_path):
    """What a crash before a batch was written leaves: files in place, no lines. They are not fetched again."""
    objects = {f"p/f{index}.txt": f"data-{index}".encode() for index in range(5)}
    store = CountingStore(MemoryStore(objects))
    dest = tmp_path / "dest"
    transfer.download(store, storage_url.parse("obs://b/p/"), dest, options(tmp_path), Log())
    for journal in (tmp_path / "state").glob("*.journal"):
        journal.unlink()
    store.reads.clear()

    summary = transfer.download(store, storage_url.parse("obs://b/p/"), dest, options(tmp_path), Log())

    assert (summary.files, summary.skipped, store.reads) == (0, 5, [])


def test_a_local_file_of_another_size_is_fetched_again(tmp_path):
    source = Source("local", tmp_path)
    source.put_many({"a.txt": b"12345", "b.txt": b"stays"})
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "a.txt").write_bytes(b"12")  # left by an earlier, different run

    summary = transfer.download(LocalStore(), _tree_location(source), dest, options(tmp_path), Log())

    assert (summary.files, (dest / "a.txt").read_bytes()) == (2, b"12345")


# --------------------------------------------------------------------------- single objects and prefixes


@pytest.mark.parametrize("size", [0, 1000, 20 * MiB + 3], ids=["empty", "small", "large"])
def test_single_object_lands_at_the_given_path(source, tmp_path, size):
    data = random_bytes(size, seed=size)
    source.put("dir/model.bin", data)
    dest = tmp_path / "out" / "model.bin"

    summary = transfer.download(source.store(), source.location("dir/model.bin"), dest, options(tmp_path), Log())

    assert dest.read_bytes() == data
    assert (summary.files, summary.bytes) == (1, size)
    assert partials(dest.parent) == []


def test_prefix_without_trailing_slash_is_a_folder(any_store, tmp_path):
    any_store.put_many({"data/x/1.txt": b"1", "data/2.txt": b"22", "database.txt": b"not in it"})
    dest = tmp_path / "dest"

    transfer.download(any_store.store(), any_store.location("data"), dest, options(tmp_path), Log())

    assert sha256_tree(dest).keys() == {"x/1.txt", "2.txt"}


def test_missing_url_is_not_found_naming_it(any_store, tmp_path):
    any_store.put("present.txt", b"1")
    location = any_store.location("absent/thing")

    with pytest.raises(NotFound, match="absent/thing"):
        transfer.download(any_store.store(), location, tmp_path / "dest", options(tmp_path), Log())
    assert not (tmp_path / "dest").exists()


def test_directory_markers_make_folders_and_the_prefix_marker_is_ignored(any_store, tmp_path):
    any_store.put_many({"p/": b"", "p/empty/": b"", "p/d/": b"", "p/d/f.txt": b"f"})
    dest = tmp_path / "dest"

    summary = transfer.download(any_store.store(), any_store.location("p/"), dest, options(tmp_path), Log())

    assert (dest / "empty").is_dir() and list((dest / "empty").iterdir()) == []
    assert (dest / "d" / "f.txt").read_bytes() == b"f"
    assert (summary.files, summary.refused) == (1, [])


def test_an_empty_prefix_gives_an_empty_folder(obs_endpoint, tmp_path):
    source = Source("obs-v4", tmp_path, obs_endpoint)
    source.put("empty/", b"")
    dest = tmp_path / "dest"

    summary = transfer.download(source.store(), source.location("empty/"), dest, options(tmp_path), Log())

    assert dest.is_dir() and list(dest.iterdir()) == []
    assert summary.files == 0


def test_unicode_keys(source, tmp_path):
    objects = {"数据/файл ü.txt": b"one", "emoji 😀/a b+c%20.txt": b"two", "ünï/κλειδί": b"three"}
    source.put_many(objects)
    dest = tmp_path / "dest"

    transfer.download(source.store(), _tree_location(source), dest, options(tmp_path), Log())

    assert {key: (dest / key).read_bytes() for key in objects} == objects


# --------------------------------------------------------------------------- safety


UNSAFE_KEYS = ["p/../x", "p//etc/ma-runtime-transfer-test", "p/a/../../x", "p/link/evil", "p/filelink",
               "p/link/again", "p/link/deeper/evil"]  # the link's folder is resolved once: each key still refused


@pytest.mark.parametrize("kind", ["memory", "obs-v4"])
def test_keys_that_leave_the_destination_are_refused(kind, tmp_path, request):
    objects = {key: b"evil" for key in UNSAFE_KEYS}
    objects.update({"p/ok.txt": b"fine", "p/sub/ok2.txt": b"fine too"})
    if kind == "memory":
        store = MemoryStore(objects)
        location = storage_url.parse("obs://bucket/p/")
    else:
        source = Source(kind, tmp_path, request.getfixturevalue("obs_endpoint"))
        source.put_many(objects)
        store, location = source.store(), source.location("p/")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "file").write_bytes(b"original")
    dest = tmp_path / "work" / "dest"
    dest.mkdir(parents=True)
    (dest / "link").symlink_to(outside)  # planted: a folder link leading out
    (dest / "filelink").symlink_to(outside / "file")  # planted: a file link leading out
    before = snapshot(tmp_path)
    log = Log()

    summary = transfer.download(store, location, dest, options(tmp_path), log)

    assert sorted(summary.refused) == sorted(UNSAFE_KEYS)
    assert [f["key"] for lvl, event, f in log.records if event == "download refused a key"] == summary.refused
    assert summary.files == 2
    assert (dest / "ok.txt").read_bytes() == b"fine" and (dest / "sub" / "ok2.txt").read_bytes() == b"fine too"
    after = [entry for entry in snapshot(tmp_path) if entry not in before]
    assert sorted(path for path, _ in after if not path.startswith("state")) == [
        "work/dest/ok.txt", "work/dest/sub", "work/dest/sub/ok2.txt"]
    assert (outside / "file").read_bytes() == b"original"
    assert not Path("/etc/ma-runtime-transfer-test").exists()


def test_keys_naming_one_path_twice_or_a_file_inside_a_file_are_refused(tmp_path):
    store = MemoryStore({"p/a": b"file", "p/a/b": b"inner", "p/x/y": b"first", "p/x//y": b"second"})

    summary = transfer.download(store, storage_url.parse("obs://b/p/"), tmp_path / "dest", options(tmp_path), Log())

    assert sorted(summary.refused) == ["p/a", "p/x/y"]  # "p/x//y" lists first ("/" < "y") and wins
    assert sha256_tree(tmp_path / "dest").keys() == {"a/b", "x/y"}
    assert (tmp_path / "dest" / "x" / "y").read_bytes() == b"second"


def test_destination_follows_links_that_stay_inside_and_refuses_loops(tmp_path):
    dest = tmp_path / "dest"
    (dest / "real").mkdir(parents=True)
    (dest / "inner").symlink_to(dest / "real")  # a link that stays inside is fine
    (dest / "chain").symlink_to(dest / "inner")
    (dest / "loop").symlink_to(dest / "loop")
    (dest / "out").symlink_to(tmp_path)
    destination = safety.Destination(dest.resolve())

    assert destination.refusal("inner/a.txt") is None
    assert destination.refusal("chain/deep/b.txt") is None
    assert "cannot be resolved" in destination.refusal("loop/x")
    assert "outside the destination" in destination.refusal("out")
    assert destination.refusal("chain/../../x") == "'..' in the path"
    assert destination.refusal("/etc/passwd") == "absolute path"
    assert destination.refusal(".//./") == "names the destination itself"


def test_a_symlink_at_the_partial_name_is_not_written_through(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"original")
    dest = tmp_path / "dest"
    dest.mkdir()
    staging = tmp_path / "state" / "partial"
    staging.mkdir(parents=True)
    (staging / f"{transfer.name_digest(str(dest / 'f.txt'))}{transfer.PARTIAL_SUFFIX}").symlink_to(outside)

    transfer.download(MemoryStore({"p/f.txt": b"data"}), storage_url.parse("obs://b/p/"), dest, options(tmp_path),
                      Log())

    assert outside.read_bytes() == b"original"
    assert (dest / "f.txt").read_bytes() == b"data"


def test_a_symlink_at_the_staging_folder_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "partial").symlink_to(elsewhere)

    with pytest.raises(StorageError, match="a symlink is in the way"):
        transfer.download(MemoryStore({"p/f.txt": b"data"}), storage_url.parse("obs://b/p/"), tmp_path / "dest",
                          options(tmp_path), Log())

    assert list(elsewhere.iterdir()) == []


# --------------------------------------------------------------------------- resume


def test_interrupted_large_download_resumes_with_only_the_missing_parts(any_store, tmp_path):
    data = random_bytes(40 * MiB + 5, seed=3)
    any_store.put_many({"big.bin": data, "small.txt": b"s"})
    key = any_store.key("big.bin")
    dest = tmp_path / "dest"
    opts = options(tmp_path, workers=2, part_size=4 * MiB)  # 11 parts
    failing = FailAfterReads(any_store.store(), key, allowed=4)

    with pytest.raises(StorageError, match="injected failure"):
        transfer.download(failing, _tree_location(any_store), dest, opts, Log())

    assert not (dest / "big.bin").exists()
    (record_path,) = (tmp_path / "state").glob("*.download.json")
    done = json.loads(record_path.read_text())["done"]
    assert 4 <= len(done) < 11 and partials(dest) == []  # kept for the rerun, outside the tree
    assert len(list((tmp_path / "state" / "partial").glob("*" + transfer.PARTIAL_SUFFIX))) == 1
    counting = CountingStore(any_store.store())

    summary = transfer.download(counting, _tree_location(any_store), dest, opts, Log())

    starts = sorted(start for read_key, start in counting.reads if read_key == key)
    assert starts == [index * 4 * MiB for index in range(11) if index not in done]
    assert (dest / "big.bin").read_bytes() == data
    missing_bytes = len(data) - sum(min(4 * MiB, len(data) - i * 4 * MiB) for i in done)
    assert summary.bytes == missing_bytes + (summary.files - 1)  # + small.txt's byte unless the first run got it
    assert not record_path.exists() and partials(dest) == []


def test_a_killed_download_resumes_with_only_the_missing_parts(tmp_path):
    data = random_bytes(20 * MiB, seed=5)
    (tmp_path / "big.bin").write_bytes(data)
    dest = tmp_path / "dest" / "big.bin"
    opts = options(tmp_path, workers=1, part_size=1 * MiB, large_threshold=4 * MiB)
    child = subprocess.Popen([sys.executable, "-c", SLOW_CHILD, str(tmp_path / "big.bin"), str(dest),
                              str(opts.state_dir)], cwd=ROOT)
    try:
        record_path = _wait_for_record(opts.state_dir, parts=3)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    done = json.loads(record_path.read_text())["done"]
    assert 3 <= len(done) < 20 and not dest.exists()
    counting = CountingStore(LocalStore())

    transfer.download(counting, storage_url.parse(str(tmp_path / "big.bin")), dest, opts, Log())

    assert sorted(start for _, start in counting.reads) == [i * MiB for i in range(20) if i not in done]
    assert dest.read_bytes() == data


SLOW_CHILD = """
import sys, time
from pathlib import Path
from ma_runtime.util.logs import get_logger
from ma_runtime.storage import transfer, url
from ma_runtime.storage.local import LocalStore

class Slow(LocalStore):
    def read_range(self, *args, **kwargs):
        time.sleep(0.1)
        return super().read_range(*args, **kwargs)

options = transfer.TransferOptions(workers=1, part_size=1 << 20, large_threshold=4 << 20, progress_seconds=0,
                                   state_dir=Path(sys.argv[3]))
transfer.download(Slow(), url.parse(sys.argv[1]), Path(sys.argv[2]), options, get_logger())
"""


def _wait_for_record(state_dir: Path, parts: int) -> Path:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for path in state_dir.glob("*.download.json"):
            try:
                if len(json.loads(path.read_text())["done"]) >= parts:
                    return path
            except (OSError, ValueError):
                pass
        time.sleep(0.02)
    raise AssertionError(f"no record with {parts} parts done in {state_dir}")


def test_a_changed_object_restarts_the_resumed_file(tmp_path):
    store = MemoryStore({"p/big": random_bytes(10 * MiB, seed=1)})
    dest = tmp_path / "dest"
    with pytest.raises(StorageError):
        transfer.download(FailAfterReads(store, "p/big", allowed=1), storage_url.parse("obs://b/p/"), dest,
                          options(tmp_path, workers=1), Log())
    store.objects["p/big"] = random_bytes(10 * MiB, seed=2)  # new ETag: the record no longer applies
    counting = CountingStore(store)

    transfer.download(counting, storage_url.parse("obs://b/p/"), dest, options(tmp_path), Log())

    assert len(counting.reads) == 3
    assert (dest / "big").read_bytes() == store.objects["p/big"]


# --------------------------------------------------------------------------- verification and retries


@pytest.mark.parametrize("size", [3000, 12 * MiB], ids=["small", "large"])
def test_corrupt_bytes_are_fetched_again_then_fail_loudly(any_store, tmp_path, size):
    any_store.put("f.bin", random_bytes(size, seed=11))
    store = FlippingStore(Md5LocalStore() if not any_store.remote else any_store.store())
    dest = tmp_path / "dest"

    with pytest.raises(CorruptTransfer, match="checksum mismatch after retry"):
        transfer.download(store, _tree_location(any_store), dest, options(tmp_path), Log())

    reads_per_fetch = 1 if size < 8 * MiB else -(-size // (4 * MiB))  # whole, or 4 MiB parts
    assert store.flips[any_store.key("f.bin")] == 2 * reads_per_fetch  # the first fetch and one retry, both corrupt
    assert not (dest / "f.bin").exists() and partials(dest) == []
    assert not list((tmp_path / "state").glob("*.download.json"))


@pytest.mark.parametrize("size", [3000, 12 * MiB], ids=["small", "large"])
def test_a_corrupt_fetch_is_retried_once(tmp_path, size):
    data = random_bytes(size, seed=12)
    store = FlippingStore(MemoryStore({"p/f.bin": data}), times=1)
    log = Log()

    transfer.download(store, storage_url.parse("obs://b/p/"), tmp_path / "dest", options(tmp_path), log)

    assert (tmp_path / "dest" / "f.bin").read_bytes() == data
    assert "download verification failed, fetching again" in log.events("warning")


def test_transient_errors_are_retried(tmp_path, monkeypatch):
    # The real backoff (0.2 s doubling, plus up to 1 s of jitter each time) is 3 s of waiting here, and this test
    # is about the retries, not their pacing: a 10 ms wait instead. Patched where the retry loop builds it.
    import tenacity

    monkeypatch.setattr(tenacity, "wait_exponential_jitter", lambda *_, **__: tenacity.wait_fixed(0.01))
    data = random_bytes(10 * MiB, seed=4)
    store = FailAfterReads(MemoryStore({"p/big": data}), "p/big", allowed=0, error=TransientError)
    calls = {"n": 0}
    failing_read = store.read_range

    def read_range(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] <= 3:
            return failing_read(*args, **kwargs)  # the first three raise TransientError
        return store.inner.read_range(*args, **kwargs)

    store.read_range = read_range
    log = Log()

    transfer.download(store, storage_url.parse("obs://b/p/"), tmp_path / "dest", options(tmp_path, workers=1), log)

    assert (tmp_path / "dest" / "big").read_bytes() == data
    # Logged once, then counted (issue 30): the success after them says how many there were.
    assert log.events("warning").count("storage request failed, retrying") == 1
    assert log.events("info").count("storage request succeeded after retrying") == 1


def test_transient_errors_give_up_after_retry_seconds(tmp_path):
    store = FailAfterReads(MemoryStore({"p/f": b"x" * 100}), "p/f", allowed=0, error=TransientError)
    started = time.monotonic()

    with pytest.raises(TransientError, match=r"failed \d+ times in"):
        transfer.download(store, storage_url.parse("obs://b/p/"), tmp_path / "dest",
                          options(tmp_path, retry_seconds=0.3), Log())

    assert time.monotonic() - started >= 0.3  # it retried for the whole budget before giving up
    assert not (tmp_path / "dest" / "f").exists() and partials(tmp_path / "dest") == []


def test_access_denied_fails_at_once(tmp_path):
    store = FailAfterReads(MemoryStore({"p/f": b"x"}), "p/f", allowed=0, error=AccessDenied)
    counting = CountingStore(store)

    with pytest.raises(AccessDenied):
        transfer.download(counting, storage_url.parse("obs://b/p/"), tmp_path / "dest", options(tmp_path), Log())

    assert len(counting.reads) == 1


def test_after_a_small_file_fails_no_worker_starts_another(obs_endpoint, tmp_path):
    """Small files are taken from one queue by each worker in turn: a failure ends the worker, and the stop it
    causes ends the others before their next file (one worker here: nothing after the failing first file)."""
    source = Source("obs-v4", tmp_path, obs_endpoint)
    source.put_many({f"f{index:03d}": b"x" * 100 for index in range(50)})
    counting = CountingStore(FailAfterReads(source.store(), "f000", allowed=0, error=AccessDenied))

    with pytest.raises(AccessDenied):
        transfer.download(counting, source.location(""), tmp_path / "dest", options(tmp_path, workers=1), Log())

    assert [key for key, _ in counting.reads] == ["f000"]
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").iterdir())


# --------------------------------------------------------------------------- upload


class FailingParts(Wrapper):
    """Part uploads succeed `allowed` times, then raise `error`; records aborts."""

    def __init__(self, store, allowed, error):
        super().__init__(store)
        self.allowed, self.error, self.aborted = allowed, error, False

    def upload_part(self, *args):
        with self.lock:
            self.allowed -= 1
            if self.allowed < 0:
                raise self.error("injected part failure")
        return self.inner.upload_part(*args)

    def abort_multipart(self, *args):
        self.aborted = True
        return self.inner.abort_multipart(*args)


@pytest.mark.parametrize("size", [1000, 13 * MiB], ids=["single-put", "multipart"])
def test_upload_file(source, tmp_path, size):
    data = random_bytes(size, seed=9)
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    counting = CountingStore(source.store())
    source.put("up/", b"")

    info = upload_file(counting, path, source.location("up/"), options(tmp_path, part_size=5 * MiB), Log())

    assert source.read("up/model.bin") == data
    assert info.key == source.key("up/model.bin")
    assert sorted(counting.parts) == ([] if size < 8 * MiB else [1, 2, 3])
    assert not list((tmp_path / "state").glob("*.upload.json"))


def test_interrupted_multipart_upload_resumes_with_only_the_missing_parts(any_store, tmp_path):
    data = random_bytes(21 * MiB, seed=10)  # 5 parts of 5 MiB
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    any_store.put("up/", b"")
    opts = options(tmp_path, workers=1, part_size=5 * MiB, retry_seconds=0.3)

    with pytest.raises(TransientError):
        upload_file(FailingParts(any_store.store(), 2, TransientError), path, any_store.location("up/x"),
                             opts, Log())

    (record_path,) = (tmp_path / "state").glob("*.upload.json")
    assert sorted(json.loads(record_path.read_text())["parts"]) == ["1", "2"]
    counting = CountingStore(any_store.store())

    upload_file(counting, path, any_store.location("up/x"), opts, Log())

    assert (sorted(counting.parts), counting.creates) == ([3, 4, 5], 0)
    assert any_store.read("up/x") == data
    assert not record_path.exists()


def test_a_failed_multipart_upload_is_aborted(any_store, tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(random_bytes(11 * MiB, seed=8))
    any_store.put("up/", b"")
    store = FailingParts(any_store.store(), 1, AccessDenied)

    with pytest.raises(AccessDenied):
        upload_file(store, path, any_store.location("up/x"), options(tmp_path, part_size=5 * MiB), Log())

    assert store.aborted
    assert not list((tmp_path / "state").glob("*.upload.json"))


def test_a_resumed_upload_whose_id_is_gone_starts_over(tmp_path):
    data = random_bytes(11 * MiB, seed=6)
    path = tmp_path / "model.bin"
    path.write_bytes(data)
    target = tmp_path / "up" / "x"
    target.parent.mkdir()
    location = storage_url.parse(str(target))
    opts = options(tmp_path, workers=1, part_size=5 * MiB, retry_seconds=0.2)
    store = LocalStore()
    with pytest.raises(TransientError):
        upload_file(FailingParts(store, 1, TransientError), path, location, opts, Log())
    (record_path,) = (tmp_path / "state").glob("*.upload.json")
    store.abort_multipart("", str(target), json.loads(record_path.read_text())["upload_id"])

    class Gone(Wrapper):  # LocalStore reports a vanished upload as FileNotFoundError; a server says 404
        def upload_part(self, bucket, key, upload_id, *args):
            if upload_id == gone_id:
                raise NotFound("NoSuchUpload")
            return self.inner.upload_part(bucket, key, upload_id, *args)

    gone_id = json.loads(record_path.read_text())["upload_id"]
    log = Log()

    upload_file(Gone(store), path, location, opts, log)

    assert target.read_bytes() == data
    assert "upload could not be resumed, starting over" in log.events("warning")


def test_a_changed_file_starts_a_new_upload_and_drops_the_old_one(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(random_bytes(11 * MiB, seed=1))
    location = storage_url.parse(str(tmp_path / "up" / "x"))
    (tmp_path / "up").mkdir()
    opts = options(tmp_path, workers=1, part_size=5 * MiB, retry_seconds=0.2)
    with pytest.raises(TransientError):
        upload_file(FailingParts(LocalStore(), 1, TransientError), path, location, opts, Log())
    new_data = random_bytes(11 * MiB, seed=2)
    path.write_bytes(new_data)  # same size, new mtime: the recorded part 1 is of the old content
    store = FailingParts(CountingStore(LocalStore()), 99, TransientError)

    upload_file(store, path, location, opts, Log())

    assert store.aborted and store.inner.creates == 1 and sorted(store.inner.parts) == [1, 2, 3]
    assert (tmp_path / "up" / "x").read_bytes() == new_data
    assert not list((tmp_path / "up").glob(".*"))  # the old upload's parts are gone


def test_upload_part_size_respects_the_s3_limits():
    assert upload_module._upload_part_size(1 * MiB, 100 * MiB) == 5 * MiB
    assert upload_module._upload_part_size(32 * MiB, 100 * MiB) == 32 * MiB
    assert upload_module._upload_part_size(5 * MiB, 100_000 * MiB) == 10 * MiB  # 10 000 parts at most


# --------------------------------------------------------------------------- options, progress, imports


def test_options_from_spec(tmp_path):
    env = {"MA_HOME": str(tmp_path), "MA_RUNTIME_STORAGE_WORKERS": "4", "MA_RUNTIME_STORAGE_PART_MB": "8",
           "MA_RUNTIME_STORAGE_LARGE_MB": "16.5", "MA_RUNTIME_STORAGE_RETRY_SECONDS": "3",
           "MA_RUNTIME_STORAGE_PROGRESS_SECONDS": "0"}

    opts = transfer.TransferOptions.from_spec(job_spec.load({}, env), tmp_path / "s")

    assert opts == transfer.TransferOptions(4, 8 * MiB, int(16.5 * MiB), 3.0, 0.0, tmp_path / "s")


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_logs_lines_and_draws_a_bar_on_a_terminal():
    log, terminal = Log(), FakeTerminal()
    progress = Progress("download", log, files_total=4, bytes_total=4000, interval=0.1, stream=terminal, url="obs://b/")
    progress.start()
    progress.add(1000, files=1)
    time.sleep(0.65)
    progress.stop()

    lines = [fields for _, event, fields in log.records if event == "download progress"]
    assert len(lines) >= 3
    assert (lines[-1]["bytes_done"], lines[-1]["bytes_total"], lines[-1]["files_done"]) == (1000, 4000, 1)
    assert lines[-1]["url"] == "obs://b/"
    assert lines[-1]["rate_mb_s"] >= 0 and lines[-1]["eta_seconds"] > 0
    assert "\r[" in terminal.getvalue() and "files 1/4" in terminal.getvalue()
    assert terminal.getvalue().endswith("\r\033[K")  # the bar is gone once the transfer ends


def test_progress_bar_text():
    fields = {"bytes_done": 50_000_000, "bytes_total": 200_000_000, "files_done": 3, "files_total": 9,
              "rate_mb_s": 25.0, "eta_seconds": 6.0}
    assert render_bar(fields) == "[#######-----------------------]  25%  50.0/200.0 MB  25.0 MB/s  ETA 6s  files 3/9"


def test_no_progress_thread_when_off_and_not_a_terminal():
    progress = Progress("download", Log(), 1, 1, interval=0, stream=io.StringIO())
    progress.start()
    assert progress._thread is None
    progress.stop()


def test_tenacity_is_imported_only_when_a_transfer_starts():
    code = ("import sys; import ma_runtime.storage.transfer; import ma_runtime.storage.stores; "
            "assert 'tenacity' not in sys.modules, 'tenacity imported at import time'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_an_empty_local_folder_is_an_empty_prefix_not_a_missing_one(tmp_path):
    source = tmp_path / "empty"
    source.mkdir()
    dest = tmp_path / "dest"
    summary = transfer.download(LocalStore(), storage_url.parse(str(source) + "/"), dest, options(tmp_path), Log())
    assert summary.files == 0 and dest.is_dir() and list(dest.iterdir()) == []
    with pytest.raises(NotFound):
        transfer.download(LocalStore(), storage_url.parse(str(tmp_path / "absent") + "/"), tmp_path / "d2",
                          options(tmp_path), Log())
