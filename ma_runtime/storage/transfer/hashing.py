"""MD5s of files: whole (`md5_of`), followed part by part as a download's parts land (`InOrderHash`), or one per
part of a multipart upload, as the bytes arrive, to check against its composite ETag (`UploadLayout`, `PartHashes`,
`composite_etag`)."""

import os
import re
import threading
from typing import Callable, List, Optional, Sequence, Set

from ma_runtime.storage.transfer.options import MiB

HASH_CHUNK = 4 * MiB
# The ETag S3 and OBS give an object completed from N parts: the MD5 of the parts' MD5s, then "-N".
_COMPOSITE_ETAG = re.compile(r"(?P<digest>[0-9a-f]{32})-(?P<count>[1-9][0-9]{0,4})\Z")


class InOrderHash:
    """MD5 of a partial file, fed part by part in order as the parts land (a follower thread)."""

    def __init__(self, fd: int, part_size: int, parts: int, size: int):
        self.digest = new_md5()
        self.fd, self.part_size, self.parts, self.size = fd, part_size, parts, size
        self.ready: Set[int] = set()
        self.cancelled = False
        self.failed = False
        self.condition = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="md5-follower", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def part_done(self, index: int) -> None:
        with self.condition:
            self.ready.add(index)
            self.condition.notify()

    def cancel(self) -> None:
        """Stops the follower and waits for it (a chunk's read at most)."""
        with self.condition:
            self.cancelled = True
            self.condition.notify()
        if self.thread.is_alive():
            self.thread.join()

    def result(self) -> Optional[str]:
        """The hex digest once every part is hashed; None if hashing was cancelled or failed
        (the caller then hashes the file itself)."""
        self.thread.join()
        return None if self.cancelled or self.failed else self.digest.hexdigest()

    def _run(self) -> None:
        try:
            self._follow()
        except OSError:
            self.failed = True

    def _follow(self) -> None:
        for index in range(self.parts):
            with self.condition:
                while index not in self.ready and not self.cancelled:
                    self.condition.wait()
            start = index * self.part_size
            end = min(start + self.part_size, self.size)
            while start < end:
                if self.cancelled:
                    return
                chunk = os.pread(self.fd, min(HASH_CHUNK, end - start), start)
                if not chunk:
                    return
                self.digest.update(chunk)
                start += len(chunk)


def new_md5(data: bytes = b""):
    import hashlib

    return hashlib.md5(data, usedforsecurity=False)  # an integrity check: allowed on FIPS hosts too


def md5_of(fd: int, size: int) -> str:
    """The MD5 of the first `size` bytes of the open file `fd`, read in HASH_CHUNK pieces."""
    digest = new_md5()
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(HASH_CHUNK, size - offset), offset)
        if not chunk:
            break
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


class UploadLayout:
    """The parts a composite ETag (`<md5 of the parts' MD5s>-N`) was made from: N parts of `part_size` bytes, the
    last one shorter. The ETag does not say the part size: `fitting` gives every size the object's size and N
    allow, the likeliest first (docs/guides/storage.md, "Atomic and verified")."""

    def __init__(self, digest: str, count: int, part_size: int, size: int):
        self.digest, self.count, self.part_size, self.size = digest, count, part_size, size

    @classmethod
    def fitting(cls, etag: Optional[str], size: int) -> List["UploadLayout"]:
        """The layouts a composite ETag may have been made from, the likeliest first; none when it is not a
        composite ETag or when too many part sizes fit to try them all."""
        found = _COMPOSITE_ETAG.match((etag or "").lower())
        if found is None:
            return []
        count = int(found.group("count"))
        return [cls(found.group("digest"), count, part_size, size) for part_size in _upload_part_sizes(size, count)]

    def bounds(self, index: int):
        """(start, end) of upload part `index` (0-based)."""
        start = index * self.part_size
        return start, min(start + self.part_size, self.size)


# The most part sizes a download tries when several fit: a wrong first guess costs a read of the file per size.
MAX_FITTING = 8


def _upload_part_sizes(size: int, count: int) -> List[int]:
    """The part sizes N parts of `size` bytes may have been uploaded in (every part but the last has it, the last
    is not empty and not longer), the likeliest first. When one size fits, that one; else the whole numbers of MiB
    that fit (boto3, the AWS CLI, the OBS SDK, rclone and this runtime upload in whole MiB), smallest first: the
    parts are then equal or nearly, as a file cut in its tool's part size most often is (512 MiB in 16 parts: 32 to
    34 MiB, 32 first). Empty when no whole MiB fits among several sizes, or more than MAX_FITTING do (100 MiB in 4
    parts: 25 to 33 MiB)."""
    if count == 1:
        return [size] if size else []
    if size < count:
        return []
    lowest, highest = -(-size // count), (size - 1) // (count - 1)
    if lowest == highest:
        return [lowest]
    whole = [mib * MiB for mib in range(-(-lowest // MiB), highest // MiB + 1)]
    return whole if len(whole) <= MAX_FITTING else []


def composite_etag(fd: int, layouts: Sequence[UploadLayout], received: Optional[str], expected: str) -> Optional[str]:
    """The composite ETag the file makes, for the check before its rename. `received` is the first layout's, taken
    from the bytes as they arrived (None: not taken); when it is not `expected` and other part sizes fit, the file
    is read once for each of them and the first that makes `expected` gives it (a read only after a wrong guess, or
    for a corrupt file, which no size makes right). Else `received`, or the first layout's from the file."""
    if received == expected:
        return received
    for layout in layouts[1:] if received is not None else layouts:
        hashes = PartHashes(layout)
        hashes.hash_file(fd, 0, layout.size)
        made = hashes.etag()
        if made == expected:
            return made
        received = received or made
    return received


class PartHashes:
    """One MD5 per part of an upload layout, each fed with the part's bytes as they arrive (`tap`), or read from
    the file for parts a previous run fetched (`hash_file`); `etag()` is then the composite ETag they make."""

    def __init__(self, layout: UploadLayout):
        self.layout = layout
        self.digests: List[Optional[bytes]] = [None] * layout.count

    def tap(self, start: int) -> Callable[[memoryview], None]:
        """What a ranged read starting at `start` (an upload part's first byte) feeds its body to, in order: each
        upload part's MD5 is kept once its last byte has passed. A read that fails leaves no digest behind, and its
        retry gets a new tap."""
        layout = self.layout
        index = start // layout.part_size
        if start != layout.bounds(index)[0]:
            raise ValueError(f"a read at {start} does not start an upload part of {layout.part_size} bytes")
        state = {"index": index, "digest": new_md5(), "left": _length(layout, index)}

        def feed(data) -> None:
            view = memoryview(data)
            while view:
                take = min(len(view), state["left"])
                state["digest"].update(view[:take])
                state["left"] -= take
                view = view[take:]
                if state["left"] == 0:
                    self.digests[state["index"]] = state["digest"].digest()
                    state["index"] += 1
                    if state["index"] < layout.count:
                        state["digest"], state["left"] = new_md5(), _length(layout, state["index"])
                    elif view:
                        raise ValueError("bytes past the object's end")

        return feed

    def hash_file(self, fd: int, start: int, end: int) -> None:
        """The digests of the upload parts in [start, end) of the file: bytes this run did not receive."""
        tap = self.tap(start)
        while start < end:
            chunk = os.pread(fd, min(HASH_CHUNK, end - start), start)
            if not chunk:
                return  # the file is short: its size check fails
            tap(chunk)
            start += len(chunk)

    def forget(self) -> None:
        self.digests = [None] * self.layout.count

    def etag(self) -> Optional[str]:
        """The composite ETag the parts' digests make; None while one is missing."""
        if any(digest is None for digest in self.digests):
            return None
        joined = b"".join(self.digests)  # type: ignore[arg-type]
        return f"{new_md5(joined).hexdigest()}-{self.layout.count}"


def _length(layout: UploadLayout, index: int) -> int:
    start, end = layout.bounds(index)
    return end - start
