"""One request to OBS and what its answer means: the layer ObsStore's operations stand on.

`ObsWire` sends a request, either signed and over a kept-alive connection (signed.py) or through the SDK, maps
every failure to a StorageError (failures.py) with the credentials' values and the signatures masked, reads a
2xx answer's body to its end (the connection is then kept) or copies it into a file, and confirms what a PUT
stored (obs/__init__.py: a write is done only when the server confirmed it).
"""

import os
from typing import Any, Callable, Dict, Mapping, Optional

from obs import ObsClient

from ma_runtime.storage import reach, signed
from ma_runtime.storage.base import FileChanged, ObjectInfo, StorageError, TransientError, confirmed
from ma_runtime.storage.obs import failures
from ma_runtime.storage.obs.client import one_line
from ma_runtime.storage.obs.listing import unquote_etag
from ma_runtime.util.redact import Masker

CHUNK = 1 << 20  # bytes read from a body and written to the file at a time
# Answer headers saying the object is encrypted with a KMS or customer key: its ETag is then not its MD5.
KEY_ENCRYPTION_HEADERS = ("x-amz-server-side-encryption-customer-algorithm",
                          "x-obs-server-side-encryption-customer-algorithm")
KMS_ENCRYPTION_HEADERS = ("x-amz-server-side-encryption", "x-obs-server-side-encryption")


class ObsWire:
    """The client, the signed requests and the masker; ObsStore's operations send every request through here."""

    def __init__(self, client: ObsClient, requests: signed.SignedRequests, masker: Masker, credential_source: str,
                 endpoint: str = ""):
        self._client = client
        self.endpoint = endpoint
        self._answered = False  # reach.py knows once: then a failure to connect is an outage, retried in full
        self._requests = requests
        self._masker = masker
        self._credential_source = credential_source

    def _call(self, action: str, bucket: str, key: str, method: Callable[..., Any], *args, **kwargs) -> Any:
        """Runs one SDK request; raises the mapped StorageError for a raised exception or a status >= 300."""
        try:
            resp = method(*args, **kwargs)
        except Exception as exc:
            raise self._failure_of_exception(exc, action, bucket, key) from exc
        self._heard()
        if resp.status >= 300:
            raise self._failure_of_status(int(resp.status), resp.errorCode, resp.errorMessage, action, bucket, key)
        return resp

    def _request(self, action: str, bucket: str, key: str, method: str = "GET",
                 query: Optional[Mapping[str, Optional[str]]] = None, headers: Optional[Dict[str, str]] = None,
                 body: signed.Body = None, listing: bool = False, path: Optional[str] = None,
                 missing_ok: bool = False) -> Any:
        """Sends a signed request (signed.py); returns a 2xx response, else raises the mapped StorageError.
        `missing_ok`: a 404 for the key (not for the bucket) returns None. `path`: the file a body comes from."""
        try:
            response = self._requests.send(method, bucket, None if listing else key, query, headers, body)
        except signed.BodyCutShort as exc:
            raise FileChanged(f"{action} {object_url(bucket, key)}: {path} ended after {exc.sent} of the {exc.size} "
                              "bytes to send: it changed while it was being uploaded") from None
        except signed.SourceChanged:
            raise FileChanged(f"{action} {object_url(bucket, key)}: {path} changed while it was being uploaded "
                              "(the request was left unfinished: nothing stored)") from None
        except Exception as exc:
            raise self._failure_of_exception(exc, action, bucket, key) from exc
        self._heard()
        if response.status < 300:
            return response
        try:
            code, message = signed.error_of(response)
        finally:
            self._requests.release(response)
        if missing_ok and response.status == 404 and code != "NoSuchBucket":
            return None
        raise self._failure_of_status(response.status, code, message, action, bucket, key, one_object=not listing)

    def _drain(self, response: Any, action: str, bucket: str, key: str) -> bytes:
        """The body of a 2xx answer, read to its end (the connection is then kept for the next request)."""
        try:
            return response.read()
        except Exception as exc:  # cut short (IncompleteRead), reset, timeout
            raise self._failure_of_exception(exc, action, bucket, key) from exc
        finally:
            self._requests.release(response)

    def _confirmed_put(self, response: Any, action: str, bucket: str, key: str, size: int,
                       md5_hex: Optional[str] = None) -> ObjectInfo:
        """The object a PUT's 2xx answer confirms (see obs/__init__.py); TransientError otherwise."""
        where = f"{action} {object_url(bucket, key)}"
        etag = unquote_etag(response.getheader("ETag"))
        if encrypted_with_a_key(response.getheader):
            md5_hex = None
        error = signed.error_document(self._drain(response, action, bucket, key))
        if error:
            raise TransientError(self._masked(f"{where}: HTTP {response.status} with an error document ({error}): "
                                              "not stored"))
        return confirmed(where, ObjectInfo(key, size, etag), md5_hex=md5_hex)

    def _heard(self) -> None:
        """The endpoint answered (any status): recorded for the run, once per store."""
        if not self._answered:
            self._answered = True
            reach.answered(self.endpoint)

    def _failure_of_exception(self, exc: BaseException, action: str, bucket: str, key: str) -> StorageError:
        return failures.of_exception(exc, f"{action} {object_url(bucket, key)}", self._masked, self.endpoint)

    def _failure_of_status(self, status: int, code: Optional[str], message: Optional[str], action: str, bucket: str,
                           key: str, one_object: bool = True) -> StorageError:
        return failures.of_status(status, code, message, f"{action} {object_url(bucket, key)}", bucket,
                                  self._credential_source, self._masked, one_object)

    def _body_of(self, resp: Any, action: str, bucket: str, key: str) -> Any:
        # The SDK logs and swallows a parse error of a 2xx answer, leaving the body None. That is
        # what a body cut short in transit looks like, so it is worth another try.
        if resp.body is None:
            raise TransientError(f"{action} {object_url(bucket, key)}: unreadable answer (HTTP {resp.status})")
        return resp.body

    def _copy_body(self, response: Any, length: int, fd: int, offset: int, url: str,
                   tap: Optional[Callable[[memoryview], None]] = None) -> int:
        """Reads the body into this thread's buffer and writes it at `offset` of `fd`, CHUNK at a time, each
        piece shown to `tap` first (see base.ObjectStore.read_range)."""
        buffer = self._requests.buffer(CHUNK)
        done = 0
        while done < length:
            try:
                count = response.readinto(buffer[:min(CHUNK, length - done)])
            except Exception as exc:  # IncompleteRead, a reset, a timeout
                raise TransientError(f"reading {url}: body cut short after {done} of {length} bytes "
                                     f"({type(exc).__name__}: {one_line(exc)})") from exc
            if not count:
                raise TransientError(f"reading {url}: body cut short after {done} of {length} bytes")
            if tap is not None:
                tap(buffer[:count])
            _pwrite_all(fd, buffer[:count], offset + done)
            done += count
        return done

    def _masked(self, message: str) -> str:
        return signed.without_signatures(self._masker.text(message))


def object_url(bucket: str, key: str) -> str:
    return f"obs://{bucket}/{key}"


def encrypted_with_a_key(header: Callable[[str], Optional[str]]) -> bool:
    """True when an answer (a PUT's, a GET's) says the object is encrypted with a KMS or customer-provided key: S3
    then gives an ETag that is not the MD5 of its bytes."""
    if any(header(name) for name in KEY_ENCRYPTION_HEADERS):
        return True
    return any("kms" in (header(name) or "").lower() for name in KMS_ENCRYPTION_HEADERS)


def _pwrite_all(fd: int, data: bytes, position: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        view = view[written:]
        position += written
