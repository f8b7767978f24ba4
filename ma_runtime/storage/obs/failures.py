"""The one mapping of failures to storage errors (obs/__init__.py, "refusals"): an exception an SDK call or a
request raised, or an HTTP error answer, becomes a TransientError (retried), a refusal of one object, or an
error naming the credentials, the bucket or the upload."""

import errno
import http.client
import socket
import ssl
from typing import Callable, Optional

from ma_runtime.storage.base import (
    AccessDenied,
    CorruptTransfer,
    NotFound,
    ObjectChanged,
    ObjectRefused,
    StorageError,
    TransientError,
    Unreached,
    refused,
)
from ma_runtime.storage.obs.client import one_line

try:  # requests (an SDK dependency) brings urllib3, whose errors are not all OSErrors
    from urllib3.exceptions import HTTPError as Urllib3Error
except ImportError:  # pragma: no cover - urllib3 comes with the SDK
    Urllib3Error = OSError

RETRYABLE_STATUSES = (429,)  # and every status >= 500
# 4xx answers that ask to try again: S3's RequestTimeout is a 400, OperationAborted a 409.
RETRYABLE_CODES = frozenset({"RequestTimeout", "OperationAborted", "SlowDown"})
# 4xx answers about the credentials (401, 403, 407), throttling (429), or a version read that changed (412).
NOT_REFUSAL_STATUSES = (401, 403, 407, 412, 429)
# 4xx codes about the credentials, the bucket or the multipart upload, not the object: no refusal of it.
NOT_ABOUT_THE_OBJECT = frozenset({
    "AccessDenied", "AccountProblem", "AllAccessDisabled", "AuthorizationHeaderMalformed",
    "AuthorizationQueryParametersError", "ExpiredToken", "InvalidAccessKeyId", "InvalidSecurity", "InvalidToken",
    "MissingSecurityHeader", "RequestTimeTooSkewed", "SignatureDoesNotMatch", "TokenRefreshRequired",
    "InvalidBucketName", "InvalidBucketState", "NoSuchBucket", "PermanentRedirect",
    "NoSuchUpload",
})
# A connect that failed with one of these never reached the endpoint (reach.py's rule).
UNREACHED_ERRNOS = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL})
# OSErrors about our own files, not the network: retrying does not help.
LOCAL_FILE_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


class UploadGone(NotFound):
    """404 NoSuchUpload: the multipart upload was completed or abandoned (a NotFound: the engine starts over)."""


def of_exception(exc: BaseException, where: str, masked: Callable[[str], str], endpoint: str = "") -> StorageError:
    """The error for an exception an SDK call or a request raised; `Unreached` when it never reached `endpoint`."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        # Retrying does not fix a certificate; say how to turn verification off.
        return StorageError(masked(f"{where}: certificate not trusted ({one_line(exc)})"),
                            hint="install the CA certificate, or set S3_VERIFY_SSL=0")
    if endpoint and never_connected(exc):
        return Unreached(masked(f"{where}: {type(exc).__name__}: {one_line(exc)}"), endpoint=endpoint)
    if is_network_error(exc):
        return TransientError(masked(f"{where}: {type(exc).__name__}: {one_line(exc)}"))
    return StorageError(masked(f"{where}: {type(exc).__name__}: {one_line(exc)}"))


def of_status(status: int, code: Optional[str], message: Optional[str], where: str, bucket: str,
              credential_source: str, masked: Callable[[str], str], one_object: bool = True) -> StorageError:
    """The error for an HTTP error answer; `one_object`: the request was about one object (not a listing), so
    a 4xx may be its refusal (see obs/__init__.py)."""
    answer = " ".join(str(part) for part in (f"HTTP {status}", code, message) if part)
    if status >= 500 or status in RETRYABLE_STATUSES or code in RETRYABLE_CODES:
        return TransientError(masked(f"{where}: {answer}"))
    refusal = one_object and is_refusal(status, code)
    failure = _client_failure(status, code, where, answer, bucket, refusal, credential_source, masked)
    return refused(failure) if refusal else failure


def _client_failure(status: int, code: Optional[str], where: str, answer: str, bucket: str, refusal: bool,
                    credential_source: str, masked: Callable[[str], str]) -> StorageError:
    if status == 403:
        return AccessDenied(
            masked(f"{where}: access denied to bucket {bucket!r} ({answer}) with the credentials from "
                   f"{credential_source}"),
            hint=f"check that the credentials in {credential_source} may use bucket {bucket!r}",
        )
    if code == "NoSuchUpload":
        return UploadGone(masked(f"{where}: the multipart upload is gone, completed or abandoned ({answer})"))
    if status == 404:
        missing = f"bucket {bucket!r} does not exist" if code == "NoSuchBucket" else "not found"
        return NotFound(masked(f"{where}: {missing} ({answer})"))
    if status == 412:  # only reads send a precondition: If-Match, the ETag listed
        return ObjectChanged(masked(f"{where}: the object changed after it was listed ({answer})"))
    if code == "BadDigest":  # see obs/__init__.py: not retried
        return CorruptTransfer(masked(f"{where}: the server received bytes whose MD5 is not the "
                                      f"Content-MD5 sent ({answer})"))
    return (ObjectRefused if refusal else StorageError)(masked(f"{where}: {answer}"))


def is_network_error(exc: BaseException) -> bool:
    """True for failures worth retrying: refused/reset connections, DNS, timeouts, broken HTTP streams."""
    if isinstance(exc, LOCAL_FILE_ERRORS):
        return False
    # requests' and socket's errors, TimeoutError and ssl.SSLError are OSErrors; http.client's are not.
    return isinstance(exc, (OSError, http.client.HTTPException, Urllib3Error))


def never_connected(exc: BaseException) -> bool:
    """True when the request never reached the endpoint: signed.py marks a failure before its connection was
    made; for the SDK's own requests, the errors only a connect raises (refused, no route, a name not resolved)."""
    if getattr(exc, "ma_not_connected", False):
        return True
    cause = exc
    for _ in range(4):  # urllib3 and requests wrap the socket's error
        if isinstance(cause, socket.gaierror) or getattr(cause, "errno", None) in UNREACHED_ERRNOS:
            return True
        cause = cause.__cause__ or cause.__context__
        if cause is None:
            return False
    return False


def is_refusal(status: int, code: Optional[str]) -> bool:
    """True when an error answer to a request about one object refuses that object (see obs/__init__.py)."""
    return 400 <= status < 500 and status not in NOT_REFUSAL_STATUSES and code not in NOT_ABOUT_THE_OBJECT
