"""Storage against hostile input: keys, URLs, credentials, replaced objects, hanging endpoints.

Each finding of the attack on the storage code (issue 10) has a test that reproduces it
against the real esdk-obs-python and moto (or the local backend, where that is the
point), and tests for its family:
- keys shaped like the engine's own partial files, staging folder and records;
- the file renamed into place is the file verified, not the bytes as they were sent;
- keys with a 256- or 300-byte part, or a path of 4096 bytes or more;
- a FIFO, a directory or a symlink where a file would land, and at the engine's records;
- an object replaced during a ranged download (MD5 and multipart ETags, a server that
  ignores If-Match, a local file replaced or rewritten);
- `.`, `..` and empty last parts in every kind of URL;
- control characters in every credential variable;
- a hanging and a refusing endpoint with a small retry budget.
"""

import hashlib
import http.server
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ma_runtime import spec as job_spec
from ma_runtime.errors import ConfigError
from ma_runtime.storage import transfer
from ma_runtime.storage import url as storage_url
from ma_runtime.storage.base import AccessDenied, NotFound, ObjectInfo, StorageError, TransientError
from ma_runtime.storage.local import LocalStore
from ma_runtime.storage.stores import open_store
from tests.storage_env import ACCESS_KEY, SECRET_KEY, refusing_endpoint
from tests.uploads import upload_file

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
STAGING_NAME = ".ma-runtime-partial"  # transfer.STAGING_NAME: a promise (README), so spelt out here


class Log:
    def __init__(self):
        self.records = []
        self.lock = threading.Lock()

    def _add(self, level, event, **fields):
        with self.lock:
            self.records.append((level, event, fields))

    def info(self, event, **fields):
        self._add("info", event, **fields)

    def warning(self, event, **fields):
        self._add("warning", event, **fields)

    error = warning

    def refused(self):
        return {fields["key"]: fields["reason"] for _, event, fields in self.records
                if event == "download refused a key"}


class Wrapper:
    def __init__(self, store):
        self.inner = store

    def __getattr__(self, name):
        return getattr(self.inner, name)


def options(tmp_path, **changes):
    values = {"workers": 4, "part_size": 4 * MiB, "large_threshold": 8 * MiB, "retry_seconds": 5.0,
              "progress_seconds": 0, "state_dir": tmp_path / "state"}
    values.update(changes)
    return transfer.TransferOptions(**values)


def obs_store(endpoint, tmp_path, **env_changes):
    env = {**endpoint.env("v4"), "MA_HOME": str(tmp_path / "home"), **env_changes}
    return open_store(storage_url.parse("obs://b/"), job_spec.load({}, env), env)


def seed(endpoint, objects):
    bucket = endpoint.new_bucket()
    for key, data in objects.items():
        endpoint.put(bucket, key, data)
    return bucket


def files_under(root: Path):
    """Every non-directory under `root`, relative, with its bytes (None for what is not a regular file)."""
    found = {}
    for path in sorted(root.rglob("*")) if root.exists() else []:
        if path.is_symlink() or not path.is_dir():
            found[str(path.relative_to(root))] = path.read_bytes() if path.is_file() else None
    return found


# --------------------------------------------------------------------------- 1. the engine's own names


PARTIAL_LOOKALIKES = {
    "c/b.txt": b"bbbb",
    "c/.b.txt.ma-partial": b"victim2",  # the finding: the old partial name of c/b.txt
    "c/..b.txt.ma-partial.ma-partial": b"victim3",  # the old partial name of that key
    "c/.ma-partial": b"victim4",
    "c/b.txt.ma-partial": b"victim5",
}


def test_keys_named_like_partial_files_land_as_themselves_and_touch_no_other_file(obs_endpoint, tmp_path):
    bucket = seed(obs_endpoint, PARTIAL_LOOKALIKES)
    store = obs_store(obs_endpoint, tmp_path)
    for run in range(5):
        dest = tmp_path / f"dest{run}"

        summary = transfer.download(store, storage_url.parse(f"obs://{bucket}/c/"), dest,
                                    options(tmp_path, workers=8), Log())

        expected = {key[len("c/"):]: data for key, data in PARTIAL_LOOKALIKES.items()}
        assert files_under(dest) == expected, f"run {run}"
        assert (summary.files, summary.refused) == (len(expected), [])


def test_keys_that_reach_the_staging_or_state_folder_are_refused(obs_endpoint, tmp_path):
    objects = {
        f"p/{STAGING_NAME}/x.ma-partial": b"into the staging folder",
        f"p/{STAGING_NAME}": b"the staging folder as a file",
        "p/state/records.journal": b"into the state folder",
        "p/state": b"the state folder as a file",
        "p/ok.txt": b"fine",
    }
    bucket = seed(obs_endpoint, objects)
    dest = tmp_path / "dest"
    log = Log()

    # The state folder inside the destination, as when MA_JOB_DIR's code folder holds MA_MOUNT_PATH.
    summary = transfer.download(obs_store(obs_endpoint, tmp_path), storage_url.parse(f"obs://{bucket}/p/"), dest,
                                options(tmp_path, state_dir=dest / "state"), log)

    refused = log.refused()
    assert sorted(refused) == sorted(key for key in objects if key != "p/ok.txt")
    assert all("the runtime's own files" in reason for reason in refused.values())
    assert (dest / "ok.txt").read_bytes() == b"fine" and summary.files == 1
    assert not (dest / STAGING_NAME).exists()
    assert not any(path.read_bytes() in objects.values() for path in (dest / "state").rglob("*") if path.is_file())


class SwappingStore(Wrapper):
    """After the first read of `key`, replaces the file at the path being written (found through the descriptor)
    with another file of the same size: what the finding's colliding key did to its victim's partial file."""

    def __init__(self, store, key):
        super().__init__(store)
        self.key, self.swaps = key, 0
        self.lock = threading.Lock()

    def read_range(self, bucket, key, start, length, fd, offset, **kwargs):
        count = self.inner.read_range(bucket, key, start, length, fd, offset, **kwargs)
        with self.lock:
            if key == self.key and not self.swaps:
                path = os.readlink(f"/proc/self/fd/{fd}")
                impostor = path + ".impostor"
                Path(impostor).write_bytes(b"X" * os.fstat(fd).st_size)
                os.replace(impostor, path)
                self.swaps += 1
        return count


@pytest.mark.parametrize("size", [3000, 12 * MiB], ids=["small", "large"])
def test_the_file_renamed_into_place_is_the_file_that_was_verified(obs_endpoint, tmp_path, size):
    data = os.urandom(size)
    bucket = seed(obs_endpoint, {"p/f.bin": data})
    store = SwappingStore(obs_store(obs_endpoint, tmp_path), "p/f.bin")
    dest = tmp_path / "dest"

    with pytest.raises(StorageError) as caught:
        transfer.download(store, storage_url.parse(f"obs://{bucket}/p/"), dest, options(tmp_path), Log())

    assert store.swaps == 1
    assert "was replaced" in str(caught.value) and f"obs://{bucket}/p/f.bin" in str(caught.value)
    assert not (dest / "f.bin").exists()


# --------------------------------------------------------------------------- 11. long names


LONG_KEYS = {
    "p/" + "a" * 256: b"256",  # one byte over NAME_MAX
    "p/" + "b" * 300: b"300",  # the finding
    "p/" + "c" * 256 + "/inner.txt": b"a folder of 256",
    "p/" + "/".join(["d" * 250] * 17): b"a path of 4267 bytes",  # every part fits, the path does not
}


@pytest.mark.parametrize("dest_exists", [False, True])
def test_keys_too_long_for_a_filesystem_are_refused_by_name_and_the_rest_lands(obs_endpoint, tmp_path, dest_exists):
    bucket = seed(obs_endpoint, {**LONG_KEYS, "p/ok.txt": b"fine", "p/" + "e" * 255: b"255 is fine"})
    dest = tmp_path / "dest"
    if dest_exists:
        dest.mkdir()
    log = Log()

    summary = transfer.download(obs_store(obs_endpoint, tmp_path), storage_url.parse(f"obs://{bucket}/p/"), dest,
                                options(tmp_path), log)

    assert sorted(summary.refused) == sorted(LONG_KEYS)
    reasons = log.refused()
    assert "300 bytes long" in reasons["p/" + "b" * 300] and "256 bytes long" in reasons["p/" + "a" * 256]
    assert "4096 bytes or longer" in reasons["p/" + "/".join(["d" * 250] * 17)]
    assert files_under(dest) == {"ok.txt": b"fine", "e" * 255: b"255 is fine"}


# --------------------------------------------------------------------------- 4. what sits at a target


def _local_source(tmp_path, objects):
    source = tmp_path / "source"
    for key, data in objects.items():
        (source / key).parent.mkdir(parents=True, exist_ok=True)
        (source / key).write_bytes(data)
    return storage_url.parse(f"{source}/")


def test_a_fifo_a_directory_or_a_link_to_one_at_a_target_is_refused_and_left_alone(tmp_path):
    names = ["fifo.txt", "dir.txt", "link-to-fifo.txt", "file/inner.txt", "link.txt", "ok.txt"]
    location = _local_source(tmp_path, {name: f"data of {name}".encode() for name in names})
    dest = tmp_path / "dest"
    dest.mkdir()
    os.mkfifo(dest / "fifo.txt")
    (dest / "dir.txt").mkdir()
    (dest / "dir.txt" / "kept").write_bytes(b"kept")
    (dest / "link-to-fifo.txt").symlink_to(dest / "fifo.txt")
    (dest / "file").write_bytes(b"a file where a folder would be")
    (dest / "real.txt").write_bytes(b"old")
    (dest / "link.txt").symlink_to(dest / "real.txt")  # inside: followed, as files.py does; the link stays
    log = Log()

    summary = transfer.download(LocalStore(), location, dest, options(tmp_path), log)

    refused = {Path(key).relative_to(location.key).as_posix(): reason for key, reason in log.refused().items()}
    assert sorted(refused) == ["dir.txt", "fifo.txt", "file/inner.txt", "link-to-fifo.txt"]
    assert "a FIFO is in the way" in refused["fifo.txt"] and "a directory is in the way" in refused["dir.txt"]
    assert "a file is in the way of the folder file" in refused["file/inner.txt"]
    assert stat.S_ISFIFO(os.lstat(dest / "fifo.txt").st_mode) and (dest / "dir.txt" / "kept").read_bytes() == b"kept"
    assert (dest / "file").read_bytes() == b"a file where a folder would be"
    assert (dest / "link.txt").is_symlink() and (dest / "real.txt").read_bytes() == b"data of link.txt"
    assert (dest / "ok.txt").read_bytes() == b"data of ok.txt" and summary.files == 2


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_single_object_is_not_renamed_over_what_is_not_a_file(tmp_path, kind):
    (tmp_path / "model.bin").write_bytes(b"weights")
    dest = tmp_path / "out" / "model.bin"
    dest.parent.mkdir()
    os.mkfifo(dest) if kind == "fifo" else dest.mkdir()

    with pytest.raises(StorageError, match="is in the way"):
        transfer.download(LocalStore(), storage_url.parse(str(tmp_path / "model.bin")), dest, options(tmp_path),
                          Log())

    assert stat.S_ISFIFO(os.lstat(dest).st_mode) if kind == "fifo" else dest.is_dir()


def _in_a_thread(function, timeout=20):
    """Runs `function`; returns its exception. Fails (instead of hanging the suite) when it blocks."""
    outcome = {}

    def run():
        try:
            function()
        except BaseException as exc:  # noqa: B036 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return thread.is_alive(), outcome.get("error")


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_a_directory_at_the_journal_is_set_aside_without_hanging(tmp_path, kind):
    """Issue 24: a record that is not one is set aside (kept, renamed), and the download goes on without it."""
    location = _local_source(tmp_path, {"a.txt": b"a"})
    dest = tmp_path / "dest"
    state = tmp_path / "state"
    state.mkdir()
    journal = state / f"{transfer.name_digest(location.text, dest)}.journal"
    os.mkfifo(journal) if kind == "fifo" else journal.mkdir()
    log = Log()
    try:
        hung, error = _in_a_thread(lambda: transfer.download(LocalStore(), location, dest, options(tmp_path), log))
    finally:
        if kind == "fifo" and os.path.exists(journal) and stat.S_ISFIFO(os.lstat(journal).st_mode):
            os.close(os.open(journal, os.O_RDWR | os.O_NONBLOCK))  # releases a reader the old code left blocked

    assert not hung, "the download waited on the FIFO"
    assert error is None and (dest / "a.txt").read_bytes() == b"a"
    (warning,) = [fields for level, event, fields in log.records if event == "record set aside"]
    assert warning["path"] == str(journal) and ("FIFO" if kind == "fifo" else "directory") in warning["problem"]
    kept = Path(warning["kept_as"])
    assert stat.S_ISFIFO(os.lstat(kept).st_mode) if kind == "fifo" else kept.is_dir()


def test_a_directory_at_a_part_record_is_set_aside_and_the_download_completes(tmp_path):
    big = os.urandom(10 * MiB)
    location = _local_source(tmp_path, {"big.bin": big})
    dest = tmp_path / "dest"
    url = str(Path(location.key) / "big.bin")
    record = tmp_path / "state" / f"{transfer.name_digest(url, dest / 'big.bin')}.download.json"
    record.mkdir(parents=True)
    log = Log()

    transfer.download(LocalStore(), location, dest, options(tmp_path), log)

    assert (dest / "big.bin").read_bytes() == big
    (warning,) = [fields for level, event, fields in log.records if event == "record set aside"]
    assert warning["path"] == str(record) and Path(warning["kept_as"]).is_dir()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_local_upload_never_replaces_what_is_not_a_file(tmp_path, kind):
    source = tmp_path / "model.bin"
    source.write_bytes(os.urandom(1000))
    target = tmp_path / "bucket" / "model.bin"
    target.parent.mkdir()
    os.mkfifo(target) if kind == "fifo" else target.mkdir()

    with pytest.raises(StorageError, match="is in the way"):
        upload_file(LocalStore(), source, storage_url.parse(str(target)), options(tmp_path), Log())

    assert stat.S_ISFIFO(os.lstat(target).st_mode) if kind == "fifo" else target.is_dir()
    assert [path.name for path in target.parent.iterdir()] == ["model.bin"]  # no temporary file left


# --------------------------------------------------------------------------- 11. nothing left in the tree


class FailingParts(Wrapper):
    """Ranged reads of `key` succeed `allowed` times, then raise AccessDenied (not retried)."""

    def __init__(self, store, key, allowed):
        super().__init__(store)
        self.key, self.allowed = key, allowed
        self.lock = threading.Lock()

    def read_range(self, bucket, key, start, length, fd, offset, **kwargs):
        if key == self.key:
            with self.lock:
                self.allowed -= 1
                if self.allowed < 0:
                    raise AccessDenied(f"injected failure reading {key} at {start}")
        return self.inner.read_range(bucket, key, start, length, fd, offset, **kwargs)


def test_a_large_object_failing_before_its_first_part_leaves_nothing_anywhere(obs_endpoint, tmp_path):
    bucket = seed(obs_endpoint, {"in/big.bin": os.urandom(12 * MiB)})
    store = FailingParts(obs_store(obs_endpoint, tmp_path), "in/big.bin", allowed=0)
    dest = tmp_path / "dest"

    with pytest.raises(AccessDenied):
        transfer.download(store, storage_url.parse(f"obs://{bucket}/in/"), dest, options(tmp_path, workers=1), Log())

    assert files_under(dest) == {}
    assert [path.name for path in (tmp_path / "state").rglob("*") if path.is_file()] == []


def test_a_large_object_with_finished_parts_keeps_them_outside_the_tree_and_resumes(obs_endpoint, tmp_path):
    data = os.urandom(12 * MiB)
    bucket = seed(obs_endpoint, {"in/big.bin": data})
    location = storage_url.parse(f"obs://{bucket}/in/")
    dest = tmp_path / "dest"
    with pytest.raises(AccessDenied):
        transfer.download(FailingParts(obs_store(obs_endpoint, tmp_path), "in/big.bin", allowed=1), location, dest,
                          options(tmp_path, workers=1), Log())
    assert files_under(dest) == {}
    assert len(list((tmp_path / "state").glob("*.download.json"))) == 1
    assert len(list((tmp_path / "state" / "partial").glob("*" + transfer.PARTIAL_SUFFIX))) == 1
    log = Log()

    transfer.download(obs_store(obs_endpoint, tmp_path), location, dest, options(tmp_path, workers=1), log)

    assert (dest / "big.bin").read_bytes() == data and files_under(dest).keys() == {"big.bin"}
    assert "download resumed" in [event for _, event, _ in log.records]
    assert list((tmp_path / "state" / "partial").iterdir()) == []


def test_partial_files_stay_in_the_tree_only_when_the_state_folder_is_on_another_filesystem(tmp_path):
    if os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    location = _local_source(tmp_path, {"a.txt": b"a", "big.bin": os.urandom(10 * MiB)})
    dest = tmp_path / "dest"
    seen = []

    class Watching(LocalStore):
        def read_range(self, bucket, key, start, length, fd, offset, **kwargs):
            seen.append(os.readlink(f"/proc/self/fd/{fd}"))
            return super().read_range(bucket, key, start, length, fd, offset, **kwargs)

    state = Path("/dev/shm") / f"ma-runtime-test-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        transfer.download(Watching(), location, dest, options(tmp_path, state_dir=state), Log())
    finally:
        shutil.rmtree(state, ignore_errors=True)

    assert {str(Path(path).parent) for path in seen} == {str(dest / STAGING_NAME)}
    assert files_under(dest).keys() == {"a.txt", "big.bin"}  # the staging folder is gone once empty


BIND_MOUNTED_STATE = """
import json, os, sys
from pathlib import Path
from ma_runtime.storage import transfer, url
from ma_runtime.storage.local import LocalStore

seen = []


class Watching(LocalStore):
    def read_range(self, bucket, key, start, length, fd, offset, **kwargs):
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        return super().read_range(bucket, key, start, length, fd, offset, **kwargs)


class Log:
    def info(self, *args, **kwargs):
        pass

    warning = info


source, dest, state = sys.argv[1:4]
options = transfer.TransferOptions(workers=2, part_size=4 << 20, large_threshold=8 << 20, progress_seconds=0,
                                   state_dir=Path(state))
transfer.download(Watching(), url.parse(source + "/"), Path(dest), options, Log())
print(json.dumps(sorted({os.path.dirname(path) for path in seen})))
"""


def test_a_state_folder_on_another_mount_of_the_same_filesystem_stages_in_the_tree(tmp_path):
    """Two bind mounts of one filesystem share st_dev, yet a rename between them fails (EXDEV)."""
    if not shutil.which("unshare") or subprocess.run(["unshare", "--mount", "true"]).returncode != 0:
        pytest.skip("needs root (CAP_SYS_ADMIN) for a private mount namespace")
    location = _local_source(tmp_path, {"a.txt": b"a", "big.bin": os.urandom(10 * MiB)})
    (tmp_path / "state-real").mkdir()
    (tmp_path / "state").mkdir()
    dest = tmp_path / "dest"
    mount_and_run = f'mount --bind "$1" "$2" && exec {sys.executable} -c "$0" "$3" "$4" "$2"'

    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", mount_and_run,
                             BIND_MOUNTED_STATE, str(tmp_path / "state-real"), str(tmp_path / "state"),
                             location.key.rstrip("/"), str(dest)],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [str(dest / STAGING_NAME)]
    assert files_under(dest).keys() == {"a.txt", "big.bin"}


# --------------------------------------------------------------------------- 2. replaced objects


class ReplacingStore(Wrapper):
    """After the first ranged read of `key`, replaces the object (`replace()`), as an uploader would."""

    def __init__(self, store, key, replace):
        super().__init__(store)
        self.key, self.replace, self.reads = key, replace, 0

    def read_range(self, bucket, key, start, length, fd, offset, **kwargs):
        if key != self.key:
            return self.inner.read_range(bucket, key, start, length, fd, offset, **kwargs)
        self.reads += 1
        count = self.inner.read_range(bucket, key, start, length, fd, offset, **kwargs)
        if self.reads == 1:
            self.replace()
        return count


def _multipart_put(endpoint, bucket, key, data, part_size=5 * MiB):
    upload = endpoint.s3.create_multipart_upload(Bucket=bucket, Key=key)
    parts = []
    for number, start in enumerate(range(0, len(data), part_size), start=1):
        answer = endpoint.s3.upload_part(Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=number,
                                         Body=data[start:start + part_size])
        parts.append({"PartNumber": number, "ETag": answer["ETag"]})
    endpoint.s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload["UploadId"],
                                          MultipartUpload={"Parts": parts})


@pytest.mark.parametrize("upload", ["single", "multipart"], ids=["md5-etag", "multipart-etag"])
def test_an_object_replaced_during_a_ranged_download_fails_naming_it(obs_endpoint, tmp_path, upload):
    first, second = os.urandom(12 * MiB), os.urandom(12 * MiB)
    bucket = obs_endpoint.new_bucket()
    put = obs_endpoint.put if upload == "single" else lambda b, k, d: _multipart_put(obs_endpoint, b, k, d)
    put(bucket, "in/big.bin", first)
    store = ReplacingStore(obs_store(obs_endpoint, tmp_path), "in/big.bin", lambda: put(bucket, "in/big.bin", second))
    dest = tmp_path / "dest"

    with pytest.raises(StorageError) as caught:
        transfer.download(store, storage_url.parse(f"obs://{bucket}/in/"), dest, options(tmp_path, workers=1), Log())

    assert type(caught.value).__name__ == "ObjectChanged" and caught.value.exit_code == 80
    assert f"obs://{bucket}/in/big.bin" in str(caught.value) and "changed after it was listed" in str(caught.value)
    assert store.reads == 2  # the second part was refused, not written
    assert not (dest / "big.bin").exists()


def test_a_small_object_replaced_after_the_listing_fails_naming_it(obs_endpoint, tmp_path):
    bucket = seed(obs_endpoint, {"in/a.txt": b"version-1"})
    store = obs_store(obs_endpoint, tmp_path)
    listed = list(store.list(bucket, "in/"))
    obs_endpoint.put(bucket, "in/a.txt", b"version-2")  # the same size: only the ETag tells
    fd = os.open(tmp_path / "sink", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(StorageError, match="changed after it was listed") as caught:
            store.read_range(bucket, "in/a.txt", 0, listed[0].size, fd, 0, etag=listed[0].etag, whole=True)
    finally:
        os.close(fd)
    assert type(caught.value).__name__ == "ObjectChanged"


class _IgnoresIfMatch(http.server.BaseHTTPRequestHandler):
    """Serves b"new" * n for any GET, with ETag "new-etag", whatever If-Match says."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        body = b"n" * 100
        self.send_response(206 if self.headers.get("Range") else 200)
        self.send_header("ETag", '"new-etag"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("whole", [False, True], ids=["range", "whole"])
def test_a_server_ignoring_if_match_is_caught_by_the_etag_it_sends(tmp_path, whole):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _IgnoresIfMatch)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {"MA_S3_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}", "OBS_ACCESS_KEY_ID": ACCESS_KEY,
           "OBS_SECRET_ACCESS_KEY": SECRET_KEY, "MA_HOME": str(tmp_path)}
    store = open_store(storage_url.parse("obs://b/"), job_spec.load({}, env), env)
    fd = os.open(tmp_path / "sink", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(StorageError, match=r"ETag listed-etag when listed, new-etag now") as caught:
            store.read_range("b", "k", 0, 100, fd, 0, etag="listed-etag", whole=whole)
        assert store.read_range("b", "k", 0, 100, fd, 0, etag="new-etag", whole=whole) == 100
    finally:
        os.close(fd)
        server.shutdown()
        server.server_close()
    assert type(caught.value).__name__ == "ObjectChanged"


@pytest.mark.parametrize("how", ["replaced", "rewritten"])
def test_a_local_file_changed_during_a_ranged_download_fails_naming_it(tmp_path, how):
    location = _local_source(tmp_path, {"big.bin": os.urandom(12 * MiB)})
    path = Path(location.key) / "big.bin"

    def change():
        if how == "replaced":  # another file renamed over it: a new inode
            (tmp_path / "new.bin").write_bytes(os.urandom(12 * MiB))
            os.replace(tmp_path / "new.bin", path)
        else:  # the same inode, written in place: a new mtime
            time.sleep(0.02)  # past the filesystem's timestamp granularity
            with open(path, "r+b") as file:
                file.write(b"changed")

    store = ReplacingStore(LocalStore(), str(path), change)
    dest = tmp_path / "dest"

    with pytest.raises(StorageError, match="changed after it was listed") as caught:
        transfer.download(store, location, dest, options(tmp_path, workers=1), Log())

    assert type(caught.value).__name__ == "ObjectChanged" and str(path) in str(caught.value)
    assert not (dest / "big.bin").exists()


def test_local_etags_name_the_version_and_are_never_taken_for_an_md5(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 10)
    info = LocalStore().head("", str(path))
    assert info.etag and info.md5 is None
    assert [i.etag for i in LocalStore().list("", f"{tmp_path}/") if i.key == str(path)] == [info.etag]
    os.replace(tmp_path / "f.bin", tmp_path / "g.bin")
    (tmp_path / "f.bin").write_bytes(b"x" * 10)
    assert LocalStore().head("", str(path)).etag != info.etag


def test_a_fifo_in_a_local_source_is_not_an_object(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "a.txt").write_bytes(b"a")
    os.mkfifo(source / "pipe")
    (source / "dangling").symlink_to(source / "nowhere")

    assert [Path(info.key).name for info in LocalStore().list("", f"{source}/")] == ["source", "a.txt"]
    with pytest.raises(NotFound):
        LocalStore().head("", str(source / "pipe"))


# --------------------------------------------------------------------------- 3. URLs


URL_BASES = ["obs://bucket/tra", "s3://bucket/tra", "file:///tmp/tra", "/tmp/tra", "tra"]
BAD_ENDINGS = ["/..", "/../", "/.", "/./", "//"]


@pytest.mark.parametrize("text", [base + ending for base in URL_BASES for ending in BAD_ENDINGS]
                         + [base + "/%2E%2E" for base in URL_BASES[:3]])  # in a plain path, %2E%2E is a name
def test_a_url_ending_in_dot_dot_dot_or_nothing_is_bad_configuration(text):
    with pytest.raises(ConfigError) as caught:
        storage_url.parse(text, "code URL")

    assert caught.value.exit_code == 78 and "code URL" in caught.value.reason
    assert "'..'" in caught.value.reason or "'.'" in caught.value.reason or "empty part" in caught.value.reason


@pytest.mark.parametrize("text", ["obs://b/a/../b/", "s3://b/./x", "obs://b/a/%2e%2e/x", "obs://../x", "obs://./",
                                  "obs://b:9000/x", "/", "file:///", ".", "..", "obs://b/x\ny", "/tmp/a\x00b",
                                  "obs://b/" + "x" * 256])
def test_other_urls_that_name_no_safe_folder_are_bad_configuration(text):
    with pytest.raises(ConfigError):
        storage_url.parse(text)


@pytest.mark.parametrize("text, key, last", [
    ("../data/", os.path.normpath(os.path.join(os.getcwd(), "..", "data")) + "/", "data"),
    ("/a/b/../c", "/a/c", "c"),
    ("/a//b/./c/", "/a/b/c/", "c"),
    ("file:///a/b/../c/", "/a/c/", "c"),
    ("obs://bucket/a//b/", "a//b/", "b"),
    ("obs://bucket/k?v=1#frag", "k?v=1#frag", "k?v=1#frag"),
    ("obs://bucket", "", "bucket"),
    ("obs://bucket/" + "y" * 255, "y" * 255, "y" * 255),
])
def test_usable_urls_are_normalised_and_keep_their_last_part(text, key, last):
    location = storage_url.parse(text)
    assert (location.key, location.last_part) == (key, last)


def test_the_code_url_of_the_finding_is_refused_when_the_job_is_loaded(tmp_path):
    env = {"MA_HOME": str(tmp_path), "MA_RUNTIME_CODE_URL": "obs://b/tra/.."}
    with pytest.raises(ConfigError, match="MA_RUNTIME_CODE_URL") as caught:
        job_spec.load({}, env)
    assert caught.value.exit_code == 78


# --------------------------------------------------------------------------- 6. credentials


@pytest.mark.parametrize("variable", ["OBS_ACCESS_KEY_ID", "OBS_SECRET_ACCESS_KEY", "OBS_SECURITY_TOKEN"])
@pytest.mark.parametrize("char", ["\n", "\r", "\t", "\x00", "\x7f"], ids=["LF", "CR", "TAB", "NUL", "DEL"])
def test_a_control_character_in_a_credential_is_bad_configuration_naming_the_variable(tmp_path, variable, char):
    secret = f"Secret-Part-One{char}Secret-Part-Two"
    env = {"MA_S3_ENDPOINT": "http://127.0.0.1:9", "OBS_ACCESS_KEY_ID": ACCESS_KEY,
           "OBS_SECRET_ACCESS_KEY": SECRET_KEY, "MA_HOME": str(tmp_path), variable: secret}

    with pytest.raises(ConfigError) as caught:
        open_store(storage_url.parse("obs://b/"), job_spec.load({}, env), env)

    text = f"{caught.value.reason} {caught.value.hint}"
    assert variable in caught.value.reason and caught.value.exit_code == 78 and caught.value.stage == "stage-in"
    assert "Secret-Part" not in text and SECRET_KEY not in text and ACCESS_KEY not in text


# --------------------------------------------------------------------------- 11. deadlines


def test_no_backoff_wait_runs_past_the_retry_budget():
    import tenacity

    attempts = []

    def refused():
        attempts.append(time.monotonic())
        raise TransientError("connection refused")

    log = Log()
    calls = transfer.Calls(transfer.TransferOptions(retry_seconds=1.0), log)
    calls._wait = tenacity.wait_fixed(0.7)  # attempts at 0 and 0.7; a third wait of 0.7 would end at 1.4
    started = time.monotonic()

    with pytest.raises(TransientError, match=r"failed \d+ times"):
        calls(refused)

    waits = [fields["wait_seconds"] for _, event, fields in log.records if event == "storage request failed, retrying"]
    assert waits[0] == 0.7 and sum(waits) <= 1.0 + 0.01  # the last wait cut to end at the deadline
    assert attempts[-1] - started < 1.0 + 0.5  # and no attempt starts long after it (slack for a busy machine)


def test_the_socket_timeout_never_exceeds_the_retry_budget(tmp_path):
    env = {"MA_S3_ENDPOINT": "http://127.0.0.1:9", "OBS_ACCESS_KEY_ID": ACCESS_KEY,
           "OBS_SECRET_ACCESS_KEY": SECRET_KEY, "MA_HOME": str(tmp_path)}
    for budget, expected in (("3", 3.0), ("120", 60.0), ("0", 1.0)):
        env["MA_RUNTIME_STORAGE_RETRY_SECONDS"] = budget
        store = open_store(storage_url.parse("obs://b/"), job_spec.load({}, env), env)
        assert (store._requests._timeout, store._client.timeout) == (expected, expected), budget


@pytest.mark.parametrize("kind", ["hanging", "refusing"])
def test_a_dead_endpoint_fails_within_the_budget_and_one_timeout_naming_it(tmp_path, request, kind):
    endpoint = request.getfixturevalue("hanging_endpoint") if kind == "hanging" else refusing_endpoint()
    env = {"MA_S3_ENDPOINT": endpoint, "OBS_ACCESS_KEY_ID": ACCESS_KEY, "OBS_SECRET_ACCESS_KEY": SECRET_KEY,
           "MA_HOME": str(tmp_path), "MA_RUNTIME_STORAGE_RETRY_SECONDS": "2"}
    spec = job_spec.load({}, env)
    store = open_store(storage_url.parse("obs://b/"), spec, env)
    started = time.monotonic()

    with pytest.raises(TransientError) as caught:
        transfer.download(store, storage_url.parse("obs://bucket/data/"), tmp_path / "dest",
                          transfer.TransferOptions.from_spec(spec, tmp_path / "state"), Log())

    # A bound at the wrong wait, not a speed budget: the SDK's own 60 s socket timeout, which socket_timeout cuts
    # to the 2 s budget, would take at least 60 s here (and a retry without the budget, forever).
    assert time.monotonic() - started < 45
    assert endpoint in str(caught.value) and str(caught.value).count("obs://bucket/data/") == 1


def test_the_engine_names_the_endpoint_once_for_a_missing_prefix(obs_endpoint, tmp_path):
    bucket = obs_endpoint.new_bucket()

    with pytest.raises(NotFound) as caught:
        transfer.download(obs_store(obs_endpoint, tmp_path), storage_url.parse(f"obs://{bucket}/nothing"),
                          tmp_path / "dest", options(tmp_path), Log())

    message = str(caught.value)
    assert message.count(obs_endpoint.url) == 1 and message.count(f"obs://{bucket}/nothing") == 1


# --------------------------------------------------------------------------- per-file cost


def test_a_small_file_is_checked_by_reading_it_back_once(tmp_path, monkeypatch):
    """The checks a small file adds to open, write, rename and close: one fstat, one lstat, one pread."""
    data = os.urandom(3000)
    location = _local_source(tmp_path, {"a.bin": data})
    md5 = hashlib.md5(data).hexdigest()

    class Md5Etag(LocalStore):  # an MD5 ETag, as OBS gives for a single-part upload
        def list(self, bucket, prefix):
            for found in super().list(bucket, prefix):
                yield found if found.key.endswith("/") else ObjectInfo(found.key, found.size, md5)

        def read_range(self, *args, etag=None, **kwargs):
            return super().read_range(*args, **kwargs)

    counts = {"fstat": 0, "lstat": 0, "pread": 0}
    for name in counts:
        original = getattr(os, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            if threading.current_thread().name.startswith("download"):
                counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(os, name, counting)

    transfer.download(Md5Etag(), location, tmp_path / "dest", options(tmp_path), Log())

    assert (tmp_path / "dest" / "a.bin").read_bytes() == data
    # One pread is LocalStore's, of the source; its version checks (two fstat) are off here (no etag passed).
    assert counts == {"fstat": 1, "lstat": 1, "pread": 2}
