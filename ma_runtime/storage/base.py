"""The object-store contract every backend keeps, and the errors they all raise.

A backend turns its own failure styles (the OBS SDK raises on connection errors
but *returns* HTTP errors as status codes) into these exceptions, so the
transfer engine has one set to retry or report:
- `TransientError`: worth retrying (connection reset, timeout, 5xx, 429, a body cut short);
- `AccessDenied` (403), `NotFound` (404): fail at once, with a clear message;
- `ObjectChanged`: the object is no longer the version that was listed; not retried,
  because a part of the new version must never be written next to parts of the old;
- `StorageError`: anything else, not retried.
All of them end a run with exit code 80, "storage failed".
"""

import dataclasses
from typing import Iterator, List, Optional, Protocol, Tuple

from ma_runtime.errors import Category, ExitCode, RuntimeFailure


class StorageError(RuntimeFailure):
    exit_code = ExitCode.STORAGE_FAILED
    category = Category.INFRASTRUCTURE
    stage = "stage-in"


class TransientError(StorageError):
    """Retryable: the same request may succeed a moment later."""


class AccessDenied(StorageError):
    category = Category.USER


class NotFound(StorageError):
    category = Category.USER


class CorruptTransfer(StorageError):
    """Bytes arrived but do not match the object's size or checksum, even after retrying."""


class ObjectChanged(StorageError):
    """The object was replaced (another ETag, size or file) after it was listed; a rerun fetches the new one."""

    def __init__(self, reason: str, hint: str = "run again: the new version is then fetched from the start",
                 stage=None):
        super().__init__(reason, hint, stage)


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    # Without quotes; "<hex>-<n>" for multipart uploads (not an MD5). Whatever its form, it names one version
    # of the object: `read_range` refuses to read any other (the local backend makes one from the file's stat).
    etag: Optional[str] = None

    @property
    def md5(self) -> Optional[str]:
        """The content MD5 when the ETag is one (single-part upload), else None."""
        etag = (self.etag or "").lower()
        return etag if len(etag) == 32 and all(c in "0123456789abcdef" for c in etag) else None


class ObjectStore(Protocol):
    """What the transfer engine needs. `bucket` is "" for the local backend, whose keys are paths."""

    def list(self, bucket: str, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under `prefix` (all pages), keys in the store's order; directory markers included."""

    def head(self, bucket: str, key: str) -> ObjectInfo:
        """Raises NotFound when there is no such object."""

    def read_range(self, bucket: str, key: str, start: int, length: int, fd: int, offset: int, *,
                   etag: Optional[str] = None, whole: bool = False) -> int:
        """Writes bytes [start, start+length) of the object at `offset` of the open file `fd` (os.pwrite),
        streaming; returns the byte count. A body shorter than asked raises TransientError. `etag`, when
        given, is the version listed: a read of any other version raises ObjectChanged, so the parts of one
        file all come from one version. `whole`: the range is the whole object as listed (the store may
        then skip the Range header)."""

    def put_file(self, bucket: str, key: str, path: str) -> ObjectInfo:
        """Uploads a whole file in one request."""

    def create_multipart(self, bucket: str, key: str) -> str:
        """Starts a multipart upload; returns its upload id."""

    def upload_part(self, bucket: str, key: str, upload_id: str, number: int, path: str, offset: int,
                    size: int) -> str:
        """Uploads `size` bytes of `path` from `offset` as part `number` (1-based); returns the part's ETag."""

    def complete_multipart(self, bucket: str, key: str, upload_id: str, parts: List[Tuple[int, str]]) -> ObjectInfo:
        """Completes the upload from (number, etag) pairs."""

    def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        """Abandons the upload and its parts."""

    def describe(self) -> str:
        """Where this store points, for messages (endpoint and credential source; never a secret)."""
