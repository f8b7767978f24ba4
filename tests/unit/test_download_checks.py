"""How a download is checked (docs/reference/storage.md, "Downloads: how a file is checked"): an object of a
multipart upload part by part against its composite ETag, as the bytes arrive and never by reading the file back;
an object whose ETag is its MD5 by that MD5; and the part layout a composite ETag was made from, inferred.

Objects are multipart uploads to moto (boto3, 5 MiB parts: moto's ETag is S3's `<md5 of the part MD5s>-N`). A
corruption at rest is made in moto's own storage (the bytes change, the ETag stays); reads of the partial file
are seen by the kernel (inotify IN_ACCESS on the staging folder), not by wrapping our code.
"""

import ctypes
import ctypes.util
import hashlib
import os
import random
import struct

import pytest

from ma_runtime import spec as job_spec
from ma_runtime.storage import transfer
from ma_runtime.storage import url as storage_url
from ma_runtime.storage.base import CorruptTransfer
from ma_runtime.storage.stores import open_store
from ma_runtime.storage.transfer.hashing import MAX_FITTING, PartHashes, UploadLayout
from tests.recording import Log, Wrapper

MiB = 1 << 20
UPLOAD_PART = 5 * MiB  # S3's (and moto's) smallest part


def options(tmp_path, **changes):
    values = {"workers": 8, "part_size": 4 * MiB, "large_threshold": 8 * MiB, "retry_seconds": 5.0,
              "progress_seconds": 0, "state_dir": tmp_path / "state"}
    values.update(changes)
    return transfer.TransferOptions(**values)


def composite_etag(data: bytes, part_size: int) -> str:
    digests = b"".join(hashlib.md5(data[at:at + part_size]).digest() for at in range(0, len(data), part_size))
    return f"{hashlib.md5(digests).hexdigest()}-{-(-len(data) // part_size)}"


def upload_in_parts(endpoint, bucket: str, key: str, data: bytes, part_size: int = UPLOAD_PART) -> str:
    s3 = endpoint.s3
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    parts = []
    for number, at in enumerate(range(0, len(data), part_size), start=1):
        answer = s3.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                Body=data[at:at + part_size])
        parts.append({"PartNumber": number, "ETag": answer["ETag"]})
    s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts})
    return s3.head_object(Bucket=bucket, Key=key)["ETag"].strip('"')


def corrupt_at_rest(bucket: str, key: str, offset: int) -> None:
    """Flips one byte of the object in moto's storage; its ETag stays what the upload made."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    stored = s3_backends[DEFAULT_ACCOUNT_ID]["global"].buckets[bucket].keys[key]
    buffer = stored._value_buffer
    buffer.seek(offset)
    byte = buffer.read(1)
    buffer.seek(offset)
    buffer.write(bytes([byte[0] ^ 0xFF]))


class FileReads:
    """The reads of files in a folder, as the kernel reports them (inotify IN_ACCESS: read, pread, readv)."""

    IN_ACCESS = 0x1

    def __init__(self, folder):
        self.libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        folder.mkdir(parents=True, exist_ok=True)
        assert self.libc.inotify_add_watch(self.fd, os.fsencode(folder), self.IN_ACCESS) >= 0

    def count(self) -> int:
        events = 0
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return events
            at = 0
            while at < len(data):
                _wd, _mask, _cookie, length = struct.unpack_from("iIII", data, at)
                events += 1
                at += 16 + length

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def bucket_store(obs_endpoint, tmp_path):
    bucket = obs_endpoint.new_bucket()
    env = {**obs_endpoint.env("v4"), "MA_HOME": str(tmp_path / "home")}
    store = open_store(storage_url.parse(f"obs://{bucket}/x"), job_spec.load({}, env), env)
    return bucket, store


def data_of(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


# --------------------------------------------------------------------------- the layout a composite ETag has


@pytest.mark.parametrize("size, count, part_sizes", [
    (512 * MiB, 32, [16 * MiB]),  # 16 to 16.5 MiB fit: one whole MiB
    (512 * MiB, 16, [32 * MiB, 33 * MiB, 34 * MiB]),  # equal parts first: this runtime's own 32 MiB parts
    (17 * MiB, 4, [5 * MiB]),
    (64 * MiB, 8, [8 * MiB, 9 * MiB]),  # 8 and 9 MiB parts both make 8 parts (the OBS SDK's 9 MiB)
    (13 * MiB, 2, [mib * MiB for mib in range(7, 13)]),
    (100 * MiB, 4, []),  # 25 to 33 MiB: more than MAX_FITTING, so the size alone is checked
    (10, 4, [3]),  # only one size fits at all
    (12345, 3, []),  # no whole MiB among the sizes that fit
    (7 * MiB, 1, [7 * MiB]),
    (5, 9, []),  # fewer bytes than parts
])
def test_the_part_sizes_that_fit_likeliest_first(size, count, part_sizes):
    layouts = UploadLayout.fitting(f"{'a' * 32}-{count}", size)
    assert [layout.part_size for layout in layouts] == part_sizes
    assert len(part_sizes) <= MAX_FITTING


@pytest.mark.parametrize("etag", [None, "", "0" * 32, "zz" * 16 + "-2", "a" * 32 + "-0", "a" * 31 + "-2"])
def test_only_a_composite_etag_has_a_layout(etag):
    assert UploadLayout.fitting(etag, 20 * MiB) == []


def test_part_hashes_make_the_composite_etag_whatever_the_pieces():
    data = data_of(3 * 1000 + 17, seed=1)
    layout = UploadLayout(composite_etag(data, 1000).split("-")[0], 4, 1000, len(data))
    hashes = PartHashes(layout)
    # Two reads of two upload parts each, fed in odd pieces that straddle the parts' bounds.
    for start in (0, 2000):
        tap = hashes.tap(start)
        end = min(start + 2000, len(data))
        at = start
        for piece in (1, 999, 1500, 7):
            tap(data[at:min(at + piece, end)])
            at = min(at + piece, end)
        tap(data[at:end])
    assert hashes.etag() == composite_etag(data, 1000)
    with pytest.raises(ValueError):
        hashes.tap(1500)  # not the start of an upload part


# --------------------------------------------------------------------------- downloads


def test_a_multipart_object_is_checked_part_by_part_and_never_read_back(bucket_store, tmp_path, obs_endpoint):
    bucket, store = bucket_store
    data = data_of(4 * UPLOAD_PART + 3 * MiB, seed=2)
    etag = upload_in_parts(obs_endpoint, bucket, "big.bin", data)
    assert etag == composite_etag(data, UPLOAD_PART)  # the server's ETag is S3's composite one
    reads = FileReads(tmp_path / "state" / "partial")
    log = Log()
    try:
        transfer.download(store, storage_url.parse(f"obs://{bucket}/big.bin"), tmp_path / "out.bin",
                          options(tmp_path), log)
        assert reads.count() == 0  # the partial file was written, never read
    finally:
        reads.close()
    assert (tmp_path / "out.bin").read_bytes() == data


def test_the_reads_of_the_file_are_seen_when_the_etag_is_an_md5(bucket_store, tmp_path, obs_endpoint):
    """The observation above can see reads: an object whose ETag is its MD5 is hashed in order from the file."""
    bucket, store = bucket_store
    data = data_of(12 * MiB, seed=3)
    obs_endpoint.put(bucket, "single.bin", data)
    reads = FileReads(tmp_path / "state" / "partial")
    try:
        transfer.download(store, storage_url.parse(f"obs://{bucket}/single.bin"), tmp_path / "out.bin",
                          options(tmp_path), Log())
        assert reads.count() > 0
    finally:
        reads.close()
    assert (tmp_path / "out.bin").read_bytes() == data


def test_a_multipart_object_whose_part_is_corrupt_is_rejected_and_nothing_stays(bucket_store, tmp_path, obs_endpoint):
    bucket, store = bucket_store
    data = data_of(4 * UPLOAD_PART + 3 * MiB, seed=4)
    upload_in_parts(obs_endpoint, bucket, "big.bin", data)
    corrupt_at_rest(bucket, "big.bin", 2 * UPLOAD_PART + 12345)  # inside the third upload part
    log = Log()

    with pytest.raises(CorruptTransfer, match="checksum mismatch after retry"):
        transfer.download(store, storage_url.parse(f"obs://{bucket}/big.bin"), tmp_path / "out.bin",
                          options(tmp_path), log)

    assert "download verification failed, fetching again" in log.events("warning")
    assert not (tmp_path / "out.bin").exists()
    assert not list((tmp_path / "state" / "partial").iterdir())
    assert not list((tmp_path / "state").glob("*.download.json"))


class CorruptInTransit(Wrapper):
    """The network between the store and us: flips the first byte of the first `times` bodies of `key`."""

    def __init__(self, store, key, times):
        super().__init__(store)
        self.key, self.times = key, times

    def read_range(self, bucket, key, start, length, fd, offset, tap=None, **kwargs):
        with self.lock:
            corrupt = key == self.key and self.times > 0
            self.times -= corrupt
        if not corrupt:
            return self.inner.read_range(bucket, key, start, length, fd, offset, tap=tap, **kwargs)
        received = os.memfd_create("body")
        try:
            count = self.inner.read_range(bucket, key, start, length, received, 0, **kwargs)
            body = bytearray(os.pread(received, count, 0))
        finally:
            os.close(received)
        body[0] ^= 0xFF
        if tap is not None:
            tap(memoryview(body))
        os.pwrite(fd, body, offset)
        return count


def test_a_part_corrupt_in_transit_is_fetched_again(bucket_store, tmp_path, obs_endpoint):
    bucket, store = bucket_store
    data = data_of(3 * UPLOAD_PART + 3 * MiB, seed=5)
    etag = upload_in_parts(obs_endpoint, bucket, "big.bin", data)
    assert UploadLayout.fitting(etag, len(data))[0].part_size == UPLOAD_PART
    log = Log()

    transfer.download(CorruptInTransit(store, "big.bin", times=1), storage_url.parse(f"obs://{bucket}/big.bin"),
                      tmp_path / "out.bin", options(tmp_path), log)

    assert (tmp_path / "out.bin").read_bytes() == data
    assert [f["problem"] for f in log.fields("download verification failed, fetching again")] == ["checksum mismatch"]


def download_counting_reads(store, bucket, key, tmp_path, **changes):
    """(the log, the reads of the partial file the kernel saw) of one download of `key` to out.bin."""
    reads = FileReads(tmp_path / "state" / "partial")
    log = Log()
    try:
        transfer.download(store, storage_url.parse(f"obs://{bucket}/{key}"), tmp_path / "out.bin",
                          options(tmp_path, **changes), log)
        return log, reads.count()
    finally:
        reads.close()


# Fetched in ranged parts (above large_threshold), and whole in one GET (below it): one rule for both.
WAYS = {"in parts": {}, "whole": {"large_threshold": 64 * MiB}}


@pytest.mark.parametrize("way", WAYS)
def test_equal_parts_of_a_size_the_etag_leaves_open_are_checked_as_they_arrive(bucket_store, tmp_path, obs_endpoint,
                                                                               way):
    """14 MiB in 2 parts of 7 MiB: 7 to 13 MiB parts all make 2 parts. The likeliest, equal parts, is right: the
    ETag is checked from the bytes as they arrived, and the file is never read back."""
    bucket, store = bucket_store
    data = data_of(14 * MiB, seed=6)
    etag = upload_in_parts(obs_endpoint, bucket, "even.bin", data, part_size=7 * MiB)
    assert len(UploadLayout.fitting(etag, len(data))) > 1
    _log, reads = download_counting_reads(store, bucket, "even.bin", tmp_path, **WAYS[way])
    assert reads == 0
    assert (tmp_path / "out.bin").read_bytes() == data


@pytest.mark.parametrize("way", WAYS)
def test_a_part_size_guessed_wrong_is_settled_from_the_file(bucket_store, tmp_path, obs_endpoint, way):
    """13 MiB in parts of 9 MiB (9 + 4): 7 MiB is tried first and makes another ETag; 9 MiB, read from the file,
    makes the object's, so the good file is placed without a refetch."""
    bucket, store = bucket_store
    data = data_of(13 * MiB, seed=8)
    upload_in_parts(obs_endpoint, bucket, "odd.bin", data, part_size=9 * MiB)
    log, reads = download_counting_reads(store, bucket, "odd.bin", tmp_path, **WAYS[way])
    assert reads > 0
    assert not log.events("warning")
    assert (tmp_path / "out.bin").read_bytes() == data


@pytest.mark.parametrize("way", WAYS)
def test_a_corrupt_object_of_a_size_the_etag_leaves_open_is_rejected(bucket_store, tmp_path, obs_endpoint, way):
    """Before, several fitting part sizes meant the size alone was checked, and a corrupt object was placed."""
    bucket, store = bucket_store
    data = data_of(13 * MiB, seed=9)
    upload_in_parts(obs_endpoint, bucket, "odd.bin", data, part_size=9 * MiB)
    corrupt_at_rest(bucket, "odd.bin", 10 * MiB + 7)
    with pytest.raises(CorruptTransfer, match="checksum mismatch after retry"):
        download_counting_reads(store, bucket, "odd.bin", tmp_path, **WAYS[way])
    assert not (tmp_path / "out.bin").exists()
    assert not list((tmp_path / "state" / "partial").iterdir())


def test_a_composite_etag_with_too_many_fitting_sizes_is_checked_by_size(bucket_store, tmp_path, obs_endpoint):
    """20 MiB in 2 parts (15 + 5): any whole MiB from 10 to 19 makes 2 parts, more than MAX_FITTING to read the file
    for, so the size alone is checked, as boto3 and the SDK's downloadFile do."""
    bucket, store = bucket_store
    data = data_of(20 * MiB, seed=10)
    etag = upload_in_parts(obs_endpoint, bucket, "wide.bin", data, part_size=15 * MiB)
    assert UploadLayout.fitting(etag, len(data)) == []
    _log, reads = download_counting_reads(store, bucket, "wide.bin", tmp_path)
    assert reads == 0
    assert (tmp_path / "out.bin").read_bytes() == data


def test_a_resumed_multipart_object_hashes_the_parts_of_the_earlier_run(bucket_store, tmp_path, obs_endpoint):
    bucket, store = bucket_store
    data = data_of(4 * UPLOAD_PART + 3 * MiB, seed=7)
    etag = upload_in_parts(obs_endpoint, bucket, "big.bin", data)
    assert UploadLayout.fitting(etag, len(data))[0].part_size == UPLOAD_PART
    location = storage_url.parse(f"obs://{bucket}/big.bin")

    class StopAfter(Wrapper):
        def __init__(self, store):
            super().__init__(store)
            self.allowed = 2

        def read_range(self, *args, **kwargs):
            with self.lock:
                self.allowed -= 1
                if self.allowed < 0:
                    raise CorruptTransfer("injected stop")
            return self.inner.read_range(*args, **kwargs)

    with pytest.raises(CorruptTransfer, match="injected stop"):
        transfer.download(StopAfter(store), location, tmp_path / "out.bin", options(tmp_path, workers=1), Log())
    log = Log()
    transfer.download(store, location, tmp_path / "out.bin", options(tmp_path, workers=1), log)

    assert log.fields("download resumed")[0]["parts_done"] == 2
    assert (tmp_path / "out.bin").read_bytes() == data




def encrypted_with_kms(obs_endpoint, bucket: str, key: str, data: bytes, etag: str) -> None:
    """An object as S3 stores one encrypted with a KMS key: the answers say so, and its ETag is not its MD5."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    obs_endpoint.s3.put_object(Bucket=bucket, Key=key, Body=data, ServerSideEncryption="aws:kms")
    s3_backends[DEFAULT_ACCOUNT_ID]["global"].buckets[bucket].keys[key]._etag = etag


@pytest.mark.parametrize("etag", ["3" * 32, "4" * 32 + "-3"], ids=["one PUT", "multipart"])
@pytest.mark.parametrize("way", WAYS)
def test_an_object_encrypted_with_a_key_is_checked_by_its_size(bucket_store, tmp_path, obs_endpoint, etag, way):
    """Its ETag says nothing of its bytes (S3 with SSE-KMS or SSE-C): checking the bytes against it would reject
    every such object as corrupt. The GET's answer says the object is encrypted with a key."""
    bucket, store = bucket_store
    data = data_of(13 * MiB, seed=11)
    encrypted_with_kms(obs_endpoint, bucket, "kms.bin", data, etag)
    log, _reads = download_counting_reads(store, bucket, "kms.bin", tmp_path, **WAYS[way])
    assert not log.events("warning")
    assert (tmp_path / "out.bin").read_bytes() == data
