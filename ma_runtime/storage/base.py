"""The object-store contract every backend keeps, and the errors they all raise.

A backend turns its own failure styles (the OBS SDK raises on connection errors
but *returns* HTTP errors as status codes) into these exceptions, so the
transfer engine has one set to retry or report:
- `TransientError`: worth retrying (connection reset, timeout, 5xx, 429, a body cut short);
  `Unreached` is one that never reached the endpoint (refused, not resolved, connect timeout, no route);
- `EndpointDead`: an endpoint that never answered in this run failed its first-contact attempts (reach.py);
  not retried;
- `AccessDenied` (403), `NotFound` (404): fail at once, with a clear message;
- `ObjectChanged`: the object is no longer the version that was listed; not retried,
  because a part of the new version must never be written next to parts of the old;
- `FileChanged`: the local file being uploaded changed under the upload (it ended before
  the bytes announced); not retried: the caller takes the file again once it is stable;
- `CorruptTransfer`: bytes that do not match their checksum (a download's after its retry,
  an upload's body the server refused for its Content-MD5);
- `StorageError`: anything else, not retried.
All of them end a run with exit code 80, "storage failed".

`refusal` (any of them): the store refused this one object, its name, size or bytes
(`ObjectRefused`, or a NotFound for a key, a CorruptTransfer for a body, marked by
`refused`), not an outage: a sync sets the file aside and goes on with the others.

A write is done only when the store confirmed it (`confirmed`, the one rule every
backend applies to every write it makes: a whole object, a part, a completion): its
answer names the version written, an ETag; where the size written is known it is the
size sent; and where an MD5 was sent (`put_bytes`' Content-MD5) and the ETag has the form
of one, 32 hex digits, it is that MD5. Anything less is a TransientError naming the
object: the write is sent again, and a caller never records an unconfirmed one, because
it never gets its ObjectInfo.
"""

import dataclasses
from typing import Callable, Iterator, List, Optional, Protocol, Tuple, TypeVar

from ma_runtime.errors import Category, ExitCode, RuntimeFailure


class StorageError(RuntimeFailure):
    exit_code = ExitCode.STORAGE_FAILED
    category = Category.INFRASTRUCTURE
    stage = "stage-in"
    # True when the store refused this one object (its name, its size, its bytes), not us: the other objects may
    # still go, so a sync sets the file aside and goes on. An outage (unreachable, 5xx, throttled, access denied,
    # a missing bucket) is not a refusal: it ends a sync's cycle.
    refusal = False


class ObjectRefused(StorageError):
    """A 4xx for one object that is not authentication, throttling or a missing bucket (a key the store will not
    take: too long, a control character; an entity too large)."""

    refusal = True


class TransientError(StorageError):
    """Retryable: the same request may succeed a moment later."""


class Unreached(TransientError):
    """The request never reached `endpoint`: the connection was refused, the name not resolved, the connect timed
    out, or there was no route. Retried as any TransientError once the endpoint answered in this run; before that,
    only a few times (reach.py)."""

    def __init__(self, reason: str, hint: str = "", stage=None, endpoint: str = ""):
        super().__init__(reason, hint, stage)
        self.endpoint = endpoint  # "" in a copy made to reword the reason: reach.py keeps the facts


class EndpointDead(StorageError):
    """An endpoint that never answered in this run could not be reached (reach.py): a wrong endpoint, most likely.
    Not retried."""

    def __init__(self, reason: str, hint: str = "", stage=None, endpoint: str = ""):
        super().__init__(reason, hint or dead_hint(endpoint), stage)
        self.endpoint = endpoint


def dead_hint(endpoint: str) -> str:
    return (f"check the endpoint ({endpoint}): MA_S3_ENDPOINT or storage.endpoint, its scheme (S3_USE_HTTPS), host "
            "and port, and that the container can reach it")


class AccessDenied(StorageError):
    category = Category.USER


class NotFound(StorageError):
    category = Category.USER


class CorruptTransfer(StorageError):
    """Bytes arrived but do not match their size or checksum: a download's even after retrying, or an upload's
    body that the server found not to match the Content-MD5 sent (400 BadDigest)."""


class FileChanged(StorageError):
    """The local file being uploaded changed while it was sent (it ended before the bytes announced)."""


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


Failure = TypeVar("Failure", bound=StorageError)


def refused(failure: Failure) -> Failure:
    """`failure` marked as the store's refusal of its one object; its class stays, for the callers that catch it
    (NotFound for a read, CorruptTransfer for a body)."""
    failure.refusal = True
    return failure


def confirmed(where: str, info: ObjectInfo, size: Optional[int] = None, md5_hex: Optional[str] = None) -> ObjectInfo:
    """`info`, the store's answer to a write, when it confirms the write (see the module's docstring): an ETag; the
    `size` written, when given; the `md5_hex` sent, when given and the ETag is an MD5's form. TransientError
    naming `where` (the action and the object) otherwise."""
    if not info.etag:
        raise TransientError(f"{where}: not confirmed by the store (no ETag in its answer); the write is not taken "
                             "as stored")
    if size is not None and info.size != size:
        raise TransientError(f"{where}: not confirmed by the store ({info.size} bytes stored, {size} sent)")
    if md5_hex and info.md5 is not None and info.md5 != md5_hex.lower():
        raise TransientError(f"{where}: not confirmed by the store (ETag {info.etag}, not the MD5 of the bytes "
                             f"sent, {md5_hex.lower()})")
    return info


@dataclasses.dataclass(frozen=True)
class Upload:
    """An unfinished multipart upload on the server."""

    key: str
    upload_id: str
    initiated: Optional[float] = None  # epoch seconds, when the server says


def check_part_bounds(where: str, path: str, file_size: int, offset: int, size: int) -> None:
    """Raises for a part that is not inside the file: StorageError for bounds no file has, FileChanged for a
    file shorter than the part (it was longer when the parts were planned)."""
    if offset < 0 or size <= 0:
        raise StorageError(f"{where}: bytes {offset}+{size} are outside {path} ({file_size} bytes)")
    if offset + size > file_size:
        raise FileChanged(f"{where}: bytes {offset}+{size} are outside {path} ({file_size} bytes): it changed while "
                          "it was being uploaded")


class ObjectStore(Protocol):
    """What the transfer engine needs. `bucket` is "" for the local backend, whose keys are paths."""

    def list(self, bucket: str, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under `prefix` (all pages), keys in the store's order; directory markers included."""

    def head(self, bucket: str, key: str) -> ObjectInfo:
        """Raises NotFound when there is no such object."""

    def read_range(self, bucket: str, key: str, start: int, length: int, fd: int, offset: int, *,
                   etag: Optional[str] = None, whole: bool = False, tap: Optional[Callable[[bytes], None]] = None,
                   keyed: Optional[Callable[[], None]] = None) -> int:
        """Writes bytes [start, start+length) of the object at `offset` of the open file `fd` (os.pwrite),
        streaming; returns the byte count. A body shorter than asked raises TransientError. `etag`, when
        given, is the version listed: a read of any other version raises ObjectChanged, so the parts of one
        file all come from one version. `whole`: the range is the whole object as listed (the store may
        then skip the Range header). `tap`, when given, is called with every piece of the body, in order,
        just before it is written (the engine hashes a download's parts as they arrive). `keyed`, when given, is
        called when the answer says the object is encrypted with a KMS or customer-provided key: its ETag then
        says nothing of its bytes, so the engine checks its size alone."""

    def put_file(self, bucket: str, key: str, path: str, *, size: Optional[int] = None,
                 unchanged: Optional[Callable[[], bool]] = None) -> ObjectInfo:
        """Uploads a file in one request: its first `size` bytes (None: its size when opened). FileChanged if it
        ends before that, or if `unchanged`, called once every byte has been read and before the object is
        stored, says False: then nothing is stored (the object keeps its previous version)."""

    def put_bytes(self, bucket: str, key: str, data: bytes, md5_hex: str) -> ObjectInfo:
        """One PUT of `data` with its MD5 (`md5_hex`, as Content-MD5): a body that does not match is refused,
        CorruptTransfer. Returns the object's info (size, ETag)."""

    def create_multipart(self, bucket: str, key: str) -> str:
        """Starts a multipart upload; returns its upload id."""

    def upload_part(self, bucket: str, key: str, upload_id: str, number: int, path: str, offset: int,
                    size: int) -> str:
        """Uploads `size` bytes of `path` from `offset` as part `number` (1-based); returns the part's ETag.
        FileChanged if the file ends before `offset + size`; NotFound when the upload is gone."""

    def complete_multipart(self, bucket: str, key: str, upload_id: str, parts: List[Tuple[int, str]]) -> ObjectInfo:
        """Completes the upload from (number, etag) pairs."""

    def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        """Abandons the upload and its parts."""

    def delete(self, bucket: str, key: str) -> None:
        """Removes the object; an object already gone is not an error."""

    def list_uploads(self, bucket: str, prefix: str) -> List[Upload]:
        """Every unfinished multipart upload under `prefix` (all pages)."""

    def describe(self) -> str:
        """Where this store points, for messages (endpoint and credential source; never a secret)."""
