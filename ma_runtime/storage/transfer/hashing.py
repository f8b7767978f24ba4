"""MD5s of files: whole (`md5_of`), or followed part by part as a download's parts land (`InOrderHash`)."""

import os
import threading
from typing import Optional, Set

from ma_runtime.storage.transfer.options import MiB

HASH_CHUNK = 4 * MiB


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


def new_md5():
    import hashlib

    return hashlib.md5(usedforsecurity=False)  # an integrity check: allowed on FIPS hosts too


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
