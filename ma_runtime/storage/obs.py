"""The OBS backend: Huawei's esdk-obs-python `ObsClient` behind the ObjectStore contract.

Settings (spec.py) and the decisions made from them:
- endpoint: `MA_S3_ENDPOINT` / `storage.endpoint`; without a scheme, https:// or
  http:// per `S3_USE_HTTPS`.
- credentials: `OBS_ACCESS_KEY_ID`, `OBS_SECRET_ACCESS_KEY` and the optional
  `OBS_SECURITY_TOKEN`, passed to the SDK explicitly. Its own provider chain stays
  off (`security_provider_policy` unset), so it never queries the ECS metadata
  service. The values appear in no message: messages name the variables, and
  every message built here is masked for the values too. A value holding a control
  character (a line-wrapped token) is refused when read, as bad configuration: sent
  on, it would fail inside http.client with the value escaped in the exception's
  text, where no masker recognises it.
- region (signs v4 requests): `storage.region`, else `<region>` of a host shaped
  `obs.<region>.<domain>.<tld>` (obs.cn-north-4.myhuaweicloud.com), else
  "us-east-1", what S3-compatible servers (MinIO, moto) expect by default.
- path style: "auto" is on for IP addresses and any host outside
  myhuaweicloud.com / huaweicloud.com (private clouds, S3-compatible servers,
  localhost); Huawei's public endpoints get virtual-host style (bucket.obs...).
- signature: as configured, with the SDK's per-bucket negotiation off. Note the
  SDK quirk: "obs" together with path style is silently signed as "v2".
- retries: the SDK's are off (`max_retry_count=0`); the transfer engine retries
  TransientError itself, with its own deadline.
- timeout: the SDK has one, applied to every socket operation (connect, each
  send, each receive), not a connect/read pair; the reads of signed.py use the same.
  60 s, the SDK's default (a CompleteMultipartUpload of many parts can take a while
  to answer, and a retried complete would fail with NoSuchUpload), but never more
  than the retry budget (`MA_RUNTIME_STORAGE_RETRY_SECONDS`): a hanging endpoint
  must not hold a run past the time it was given. At least 1 s.
- versions: every GET of an object names the version listed (`If-Match: <ETag>`), and
  the ETag of the answer is compared too, for servers that ignore If-Match: parts of
  one file never come from two versions, whether or not the ETag is an MD5.
- the requests made per file go through `signed.py`: GETs of objects and listing
  pages, PUTs of objects and parts, DELETEs, listings of multipart uploads. The SDK
  signs each one (`createSignedUrl`; v4 by a presigner that signs as it does), and
  it travels over a kept-alive connection per thread, a body read into a reused
  buffer, a file's bytes sent straight from the file (sendfile). Measured, that is
  what makes many small files fast (see signed.py). The rest (HEAD, starting,
  completing and abandoning a multipart upload) are SDK calls, one connection per
  request (its default, `long_conn_mode` off).
- writes: `put_bytes` sends Content-MD5 (the caller's MD5 of the bytes); a server
  that finds the body does not match answers 400 BadDigest, which is CorruptTransfer,
  not retried: the bytes and their MD5 come from one read of memory, so a retry of
  the same request has nothing new to offer, and the caller (the sync engine) reads
  the file again next cycle. A part's body is checked by its length (a file that
  ended early fails the part: it changed while it was sent); no MD5 is computed for
  parts (a core's worth of CPU for 500 MB/s, on a machine whose training owns the cores).
- a write is done only when the server confirmed it (`base.confirmed`, the rule every
  backend keeps), else it is a TransientError naming the object, sent again:
  - a PUT (object or part): its answer has an ETag, and no `<Error>` document for a
    body; for `put_bytes` the ETag is the MD5 sent when it has an MD5's form (S3's and
    OBS's single-PUT ETags are), unless the answer says the object is encrypted with a
    KMS or customer key (S3 then gives an ETag that is not the MD5);
  - a completion: its CompleteMultipartUploadResult has an ETag. S3 documents that it
    may answer 200 and then fail, with an `<Error>` document for a body; the SDK then
    returns status 200, no errorCode, and a result whose every field (ETag, Key) is None.
    Where the answer says nothing (a body the SDK could not parse: cut short, empty),
    a HEAD decides: the object must have the parts' size (when this store sent them)
    and, when the parts' ETags are MD5s, the ETag S3 and OBS make of them (the MD5 of
    their digests, "-<count>"). A completion answered 404 NoSuchUpload (a retry after an
    attempt whose answer was lost, which completed it) is confirmed by that ETag only;
    otherwise the upload is gone (`UploadGone`, a NotFound: a rerun starts over).
  The rule costs no request where the answer confirms the write; a HEAD only where
  a completion's answer was unreadable or its upload gone.
- refusals: a 4xx about one object that is not authentication (401, 403, a credential
  code), throttling (429) or a missing bucket or upload (NoSuchBucket, NoSuchUpload)
  is the store refusing that object (`refusal`: ObjectRefused; a NotFound for a key, a
  CorruptTransfer for BadDigest, marked). A 4xx that asks to try again (400
  RequestTimeout, 409 OperationAborted) is a TransientError.
- a signed URL is a credential for 15 minutes: no message quotes one (signed.py).

The SDK has two failure styles: connection problems raise, HTTP errors come back
as `resp.status` / `resp.errorCode`. `ObsStore._call` is the one place both go
through, and `_failure_of_exception` / `_failure_of_status` the one mapping.
"""

import base64
import calendar
import hashlib
import http.client
import ipaddress
import os
import re
import ssl
import stat
import threading
import time
import unicodedata
import warnings
from typing import IO, Any, Callable, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Tuple
from urllib.parse import unquote_plus, urlsplit
from xml.etree import ElementTree

from obs import CompleteMultipartUploadRequest, CompletePart, ObsClient
from obs.const import MIME_TYPES

from ma_runtime.credentials import ACCESS_KEY_VARIABLE, SECRET_KEY_VARIABLE, TOKEN_VARIABLE
from ma_runtime.errors import ConfigError
from ma_runtime.redact import Masker
from ma_runtime.storage import signed
from ma_runtime.storage.base import (
    AccessDenied,
    CorruptTransfer,
    FileChanged,
    NotFound,
    ObjectChanged,
    ObjectInfo,
    ObjectRefused,
    StorageError,
    TransientError,
    Upload,
    check_part_bounds,
    confirmed,
    refused,
)

try:  # requests (an SDK dependency) brings urllib3, whose errors are not all OSErrors
    from urllib3.exceptions import HTTPError as Urllib3Error
except ImportError:  # pragma: no cover - urllib3 comes with the SDK
    Urllib3Error = OSError

CREDENTIAL_SOURCE = f"{ACCESS_KEY_VARIABLE}/{SECRET_KEY_VARIABLE}"

CHUNK = 1 << 20  # bytes read from a body and written to the file at a time
PAGE_SIZE = 1000  # keys (or multipart uploads) per listing request, the server's maximum
TIMEOUT_SECONDS = 60
MIN_TIMEOUT_SECONDS = 1.0  # below this, a healthy endpoint's answers would time out too
DEFAULT_REGION = "us-east-1"
HUAWEI_DOMAINS = ("myhuaweicloud.com", "huaweicloud.com")
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
# Answer headers saying the object is encrypted with a KMS or customer key: its ETag is then not its MD5.
KEY_ENCRYPTION_HEADERS = ("x-amz-server-side-encryption-customer-algorithm",
                          "x-obs-server-side-encryption-customer-algorithm")
KMS_ENCRYPTION_HEADERS = ("x-amz-server-side-encryption", "x-obs-server-side-encryption")
# OSErrors about our own files, not the network: retrying does not help.
LOCAL_FILE_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
_MD5_HEX = re.compile(r"[0-9a-fA-F]{32}\Z")
_MULTIPART_ETAG = re.compile(r"[0-9a-fA-F]{32}-[0-9]+\Z")


class UploadGone(NotFound):
    """404 NoSuchUpload: the multipart upload was completed or abandoned (a NotFound: the engine starts over)."""


class ObsStore:
    def __init__(self, client: ObsClient, endpoint: str, masker: Masker, credential_source: str = CREDENTIAL_SOURCE,
                 presigner: Optional[signed.V4Presigner] = None, timeout: float = TIMEOUT_SECONDS):
        self._client = client
        self._requests = signed.SignedRequests(client, timeout, presigner)
        self._endpoint = endpoint
        self._masker = masker
        self._credential_source = credential_source
        # upload id -> part number -> size, for the ObjectInfo of complete_multipart (the engine uses threads).
        self._part_sizes: Dict[str, Dict[int, int]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, spec, environ: Mapping[str, str]) -> "ObsStore":
        endpoint = endpoint_url(spec.storage_endpoint, spec.storage_use_https)
        access_key, secret_key, token = read_credentials(environ)
        masker = Masker(value for value in (access_key, secret_key, token) if value)
        timeout = socket_timeout(spec.storage_retry_seconds)
        client = new_client(spec, endpoint, access_key, secret_key, token, masker, timeout)
        source = CREDENTIAL_SOURCE + (f"/{TOKEN_VARIABLE}" if token else "")
        presigner = None
        if spec.storage_signature.lower() == "v4":
            host = urlsplit(endpoint).hostname or ""
            region = signing_region(spec.storage_region, host)
            path_style = uses_path_style(spec.storage_path_style, host)
            presigner = signed.V4Presigner(endpoint, region, path_style, access_key, secret_key, token)
        return cls(client, endpoint, masker, source, presigner, timeout)

    def describe(self) -> str:
        return f"OBS endpoint {self._endpoint} (credentials from {self._credential_source})"

    # --- reading -----------------------------------------------------------------------------------

    def list(self, bucket: str, prefix: str) -> Iterator[ObjectInfo]:
        marker: Optional[str] = None
        while True:
            page = self._list_page(bucket, prefix, marker)
            yield from page.objects
            if not page.truncated:
                return
            marker = self._next_marker(page, marker, bucket, prefix)

    def head(self, bucket: str, key: str) -> ObjectInfo:
        resp = self._call("reading the metadata of", bucket, key, self._client.getObjectMetadata, bucket, key)
        metadata = self._body_of(resp, "reading the metadata of", bucket, key)
        if metadata.contentLength is None:
            raise StorageError(f"reading the metadata of {object_url(bucket, key)}: no Content-Length in the answer")
        return ObjectInfo(key, int(metadata.contentLength), unquote_etag(metadata.etag))

    def read_range(self, bucket: str, key: str, start: int, length: int, fd: int, offset: int, *,
                   etag: Optional[str] = None, whole: bool = False) -> int:
        if length <= 0:
            return 0  # "bytes=5-4" is not a range; there is nothing to fetch
        url = object_url(bucket, key)
        headers = {"If-Match": f'"{etag}"'} if etag else {}
        # The whole object goes without a Range header: a ranged GET costs the server more (6-8 %
        # on s3rver), and a small file's download is all server time.
        byte_range = None if whole and start == 0 else f"bytes={start}-{start + length - 1}"
        if byte_range:
            headers["Range"] = byte_range
        response = self._request("reading", bucket, key, headers=headers or None)
        try:
            if byte_range and response.status != 206 and start != 0:
                # A 200 carries the object from byte 0: writing it at `offset` would corrupt the file.
                raise StorageError(f"reading {url}: the server ignored Range {byte_range}")
            served = unquote_etag(response.getheader("ETag"))
            if etag and served and served != etag:  # a server that ignores If-Match
                raise ObjectChanged(f"reading {url}: the object changed after it was listed (ETag {etag} when "
                                    f"listed, {served} now)")
            if not byte_range and response.length is not None and response.length != length:
                raise ObjectChanged(f"reading {url}: the object changed after it was listed ({length} bytes when "
                                    f"listed, {response.length} now)")
            return self._copy_body(response, length, fd, offset, url)
        finally:
            self._requests.release(response)

    # --- writing -----------------------------------------------------------------------------------

    def put_file(self, bucket: str, key: str, path: str) -> ObjectInfo:
        action = "uploading to"
        _require_key(action, bucket, key)
        with _open_regular(path, action, bucket, key) as source:
            size = os.fstat(source.fileno()).st_size
            response = self._request(action, bucket, key, "PUT", headers=_content_type(key),
                                     body=signed.FileRange(source, 0, size), path=path)
        return self._confirmed_put(response, action, bucket, key, size)

    def put_bytes(self, bucket: str, key: str, data: bytes, md5_hex: str) -> ObjectInfo:
        action = "uploading to"
        _require_key(action, bucket, key)
        if not _MD5_HEX.match(md5_hex or ""):
            raise StorageError(f"{action} {object_url(bucket, key)}: {md5_hex!r} is not an MD5 (32 hex digits)")
        content_md5 = base64.b64encode(bytes.fromhex(md5_hex)).decode("ascii")
        headers = {"Content-MD5": content_md5, **_content_type(key)}
        response = self._request(action, bucket, key, "PUT", headers=headers, body=bytes(data))
        return self._confirmed_put(response, action, bucket, key, len(data), md5_hex)

    def create_multipart(self, bucket: str, key: str) -> str:
        _require_key("starting a multipart upload to", bucket, key)
        resp = self._call("starting a multipart upload to", bucket, key, self._client.initiateMultipartUpload,
                          bucket, key)
        upload_id = self._body_of(resp, "starting a multipart upload to", bucket, key).uploadId
        if not upload_id:
            raise StorageError(f"starting a multipart upload to {object_url(bucket, key)}: no upload id in the answer")
        return upload_id

    def upload_part(self, bucket: str, key: str, upload_id: str, number: int, path: str, offset: int,
                    size: int) -> str:
        action = f"uploading part {number} to"
        with _open_regular(path, action, bucket, key) as source:
            check_part_bounds(f"{action} {object_url(bucket, key)}", path, os.fstat(source.fileno()).st_size,
                              offset, size)
            query = {"partNumber": str(number), "uploadId": upload_id}
            response = self._request(action, bucket, key, "PUT", query=query,
                                     body=signed.FileRange(source, offset, size), path=path)
        etag = self._confirmed_put(response, action, bucket, key, size).etag
        with self._lock:
            self._part_sizes.setdefault(upload_id, {})[number] = size
        return etag

    def complete_multipart(self, bucket: str, key: str, upload_id: str, parts: List[Tuple[int, str]]) -> ObjectInfo:
        # The request body carries ETags quoted, as servers hand them out.
        request = CompleteMultipartUploadRequest(
            parts=[CompletePart(partNum=number, etag=f'"{unquote_etag(etag)}"') for number, etag in sorted(parts)]
        )
        action = "completing the multipart upload to"
        where = f"{action} {object_url(bucket, key)}"
        try:
            resp = self._call(action, bucket, key, self._client.completeMultipartUpload, bucket, key, upload_id,
                              request)
        except UploadGone:
            # Completed by an earlier attempt whose answer was lost, or abandoned: only the parts' ETag tells.
            found = self._completed_as_found(bucket, key, upload_id, parts, etag_required=True)
            if found is None:
                raise
            return found
        if resp.body is None:  # an answer the SDK could not parse (cut short, empty): the object tells
            found = self._completed_as_found(bucket, key, upload_id, parts, etag_required=False)
            if found is None:
                raise TransientError(self._masked(f"{where}: HTTP {resp.status} with an unreadable answer, and the "
                                                  "object is not the one its parts make: not completed"))
            return found
        if not resp.body.etag:
            # What the SDK makes of an <Error> document in a 200 (see the module's docstring).
            raise TransientError(self._masked(f"{where}: HTTP {resp.status} with an error document in place of the "
                                              "result: not completed"))
        etag = unquote_etag(resp.body.etag)
        return confirmed(where, ObjectInfo(key, self._completed_size(bucket, key, upload_id, parts), etag))

    def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        self._call("abandoning the multipart upload to", bucket, key, self._client.abortMultipartUpload,
                   bucket, key, upload_id)
        with self._lock:
            self._part_sizes.pop(upload_id, None)

    def delete(self, bucket: str, key: str) -> None:
        action = "deleting"
        _require_key(action, bucket, key)
        # S3 and OBS answer 204 for a key that is not there; a server answering 404 NoSuchKey means the same.
        response = self._request(action, bucket, key, "DELETE", missing_ok=True)
        if response is not None:
            self._drain(response, action, bucket, key)

    def list_uploads(self, bucket: str, prefix: str) -> List[Upload]:
        uploads: List[Upload] = []
        markers: Tuple[Optional[str], Optional[str]] = (None, None)
        while True:
            page = self._uploads_page(bucket, prefix, markers)
            uploads += page.uploads
            if not page.truncated:
                return uploads
            markers = self._next_upload_markers(page, markers, bucket, prefix)

    # --- helpers -----------------------------------------------------------------------------------

    def _completed_size(self, bucket: str, key: str, upload_id: str, parts: List[Tuple[int, str]]) -> int:
        # The answer to a complete carries no size: sum the parts this store uploaded, else ask.
        size = self._sent_size(upload_id, parts)
        with self._lock:
            self._part_sizes.pop(upload_id, None)
        if size is not None:
            return size
        try:
            return self.head(bucket, key).size
        except StorageError as exc:
            # Not a TransientError: retrying the complete itself would now fail with NoSuchUpload.
            raise StorageError(f"completed {object_url(bucket, key)}, but reading its size failed: {exc}") from exc

    def _sent_size(self, upload_id: str, parts: List[Tuple[int, str]]) -> Optional[int]:
        """The size of the object these parts make, when this store sent them all; else None."""
        with self._lock:
            sizes = dict(self._part_sizes.get(upload_id, {}))
        if all(number in sizes for number, _etag in parts):
            return sum(sizes[number] for number, _etag in parts)
        return None

    def _completed_as_found(self, bucket: str, key: str, upload_id: str, parts: List[Tuple[int, str]],
                            etag_required: bool) -> Optional[ObjectInfo]:
        """The object, when a HEAD finds the one these parts make (see the module's docstring): the ETag made of
        theirs when it can be computed, and their size when this store sent them; `etag_required`: only the ETag
        will do. None otherwise (no object, another one, or nothing that tells)."""
        try:
            found = self.head(bucket, key)
        except NotFound:
            return None
        size = self._sent_size(upload_id, parts)
        expected = multipart_etag(etag for _number, etag in sorted(parts))
        # An ETag of either form S3 and OBS give can be compared: a single PUT's MD5 is never the parts' ETag.
        if expected and (_MULTIPART_ETAG.match(found.etag or "") or _MD5_HEX.match(found.etag or "")):
            is_theirs = found.etag.lower() == expected and size in (None, found.size)
        else:
            is_theirs = not etag_required and size == found.size
        if not is_theirs:
            return None
        with self._lock:
            self._part_sizes.pop(upload_id, None)
        return found

    def _call(self, action: str, bucket: str, key: str, method: Callable[..., Any], *args, **kwargs) -> Any:
        """Runs one SDK request; raises the mapped StorageError for a raised exception or a status >= 300."""
        try:
            resp = method(*args, **kwargs)
        except Exception as exc:
            raise self._failure_of_exception(exc, action, bucket, key) from exc
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
        except Exception as exc:
            raise self._failure_of_exception(exc, action, bucket, key) from exc
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
        """The object a PUT's 2xx answer confirms (see the module's docstring); TransientError otherwise."""
        where = f"{action} {object_url(bucket, key)}"
        etag = unquote_etag(response.getheader("ETag"))
        if _encrypted_with_a_key(response.getheader):
            md5_hex = None
        error = signed.error_document(self._drain(response, action, bucket, key))
        if error:
            raise TransientError(self._masked(f"{where}: HTTP {response.status} with an error document ({error}): "
                                              "not stored"))
        return confirmed(where, ObjectInfo(key, size, etag), md5_hex=md5_hex)

    def _list_page(self, bucket: str, prefix: str, marker: Optional[str]) -> "Listing":
        query = {"max-keys": str(PAGE_SIZE), "encoding-type": "url"}
        if prefix:
            query["prefix"] = prefix
        if marker:
            query["marker"] = marker
        response = self._request("listing", bucket, prefix, query=query, listing=True)
        body = self._drain(response, "listing", bucket, prefix)
        try:
            return parse_listing(body)
        except ValueError as exc:  # not XML, not a listing, or a Size that is not a number
            # What a body cut short in transit looks like: worth another try.
            raise TransientError(f"listing {object_url(bucket, prefix)}: unreadable answer ({exc})") from exc

    def _uploads_page(self, bucket: str, prefix: str,
                      markers: Tuple[Optional[str], Optional[str]]) -> "UploadListing":
        action = "listing the multipart uploads under"
        query: Dict[str, Optional[str]] = {"uploads": None, "max-uploads": str(PAGE_SIZE), "encoding-type": "url"}
        if prefix:
            query["prefix"] = prefix
        key_marker, upload_id_marker = markers
        if key_marker:
            query["key-marker"] = key_marker
        if upload_id_marker:
            query["upload-id-marker"] = upload_id_marker
        response = self._request(action, bucket, prefix, query=query, listing=True)
        body = self._drain(response, action, bucket, prefix)
        try:
            return parse_uploads(body)
        except ValueError as exc:  # what a body cut short in transit looks like
            raise TransientError(f"{action} {object_url(bucket, prefix)}: unreadable answer ({exc})") from exc

    def _failure_of_exception(self, exc: BaseException, action: str, bucket: str, key: str) -> StorageError:
        where = f"{action} {object_url(bucket, key)}"
        if isinstance(exc, ssl.SSLCertVerificationError):
            # Retrying does not fix a certificate; say how to turn verification off.
            return StorageError(self._masked(f"{where}: certificate not trusted ({_one_line(exc)})"),
                                hint="install the CA certificate, or set S3_VERIFY_SSL=0")
        if is_network_error(exc):
            return TransientError(self._masked(f"{where}: {type(exc).__name__}: {_one_line(exc)}"))
        return StorageError(self._masked(f"{where}: {type(exc).__name__}: {_one_line(exc)}"))

    def _failure_of_status(self, status: int, code: Optional[str], message: Optional[str], action: str, bucket: str,
                           key: str, one_object: bool = True) -> StorageError:
        """The error for an HTTP error answer; `one_object`: the request was about one object (not a listing), so
        a 4xx may be its refusal (see the module's docstring)."""
        answer = " ".join(str(part) for part in (f"HTTP {status}", code, message) if part)
        where = f"{action} {object_url(bucket, key)}"
        if status >= 500 or status in RETRYABLE_STATUSES or code in RETRYABLE_CODES:
            return TransientError(self._masked(f"{where}: {answer}"))
        refusal = one_object and is_refusal(status, code)
        failure = self._client_failure(status, code, where, answer, bucket, refusal)
        return refused(failure) if refusal else failure

    def _client_failure(self, status: int, code: Optional[str], where: str, answer: str, bucket: str,
                        refusal: bool) -> StorageError:
        if status == 403:
            return AccessDenied(
                self._masked(f"{where}: access denied to bucket {bucket!r} ({answer}) with the credentials from "
                             f"{self._credential_source}"),
                hint=f"check that the credentials in {self._credential_source} may use bucket {bucket!r}",
            )
        if code == "NoSuchUpload":
            return UploadGone(self._masked(f"{where}: the multipart upload is gone, completed or abandoned "
                                           f"({answer})"))
        if status == 404:
            missing = f"bucket {bucket!r} does not exist" if code == "NoSuchBucket" else "not found"
            return NotFound(self._masked(f"{where}: {missing} ({answer})"))
        if status == 412:  # only reads send a precondition: If-Match, the ETag listed
            return ObjectChanged(self._masked(f"{where}: the object changed after it was listed ({answer})"))
        if code == "BadDigest":  # see the module's docstring: not retried
            return CorruptTransfer(self._masked(f"{where}: the server received bytes whose MD5 is not the "
                                                f"Content-MD5 sent ({answer})"))
        return (ObjectRefused if refusal else StorageError)(self._masked(f"{where}: {answer}"))

    def _body_of(self, resp: Any, action: str, bucket: str, key: str) -> Any:
        # The SDK logs and swallows a parse error of a 2xx answer, leaving the body None. That is
        # what a body cut short in transit looks like, so it is worth another try.
        if resp.body is None:
            raise TransientError(f"{action} {object_url(bucket, key)}: unreadable answer (HTTP {resp.status})")
        return resp.body

    @staticmethod
    def _next_marker(page: "Listing", marker: Optional[str], bucket: str, prefix: str) -> str:
        # S3 sends NextMarker only with a delimiter; without one the last key is the marker.
        next_marker = page.next_marker or (page.objects[-1].key if page.objects else None)
        if not next_marker or next_marker == marker:
            raise StorageError(f"listing {object_url(bucket, prefix)}: the server said 'truncated' but gave "
                               "no next marker")
        return next_marker

    @staticmethod
    def _next_upload_markers(page: "UploadListing", markers: Tuple[Optional[str], Optional[str]], bucket: str,
                             prefix: str) -> Tuple[Optional[str], Optional[str]]:
        # A page ends with its markers; a server that leaves them out ends it with its last upload.
        last = page.uploads[-1] if page.uploads else None
        following = (page.next_key_marker or (last.key if last else None),
                     page.next_upload_id_marker or (last.upload_id if last else None))
        if not following[0] or following == markers:
            raise StorageError(f"listing the multipart uploads under {object_url(bucket, prefix)}: the server said "
                               "'truncated' but gave no next marker")
        return following

    def _copy_body(self, response: Any, length: int, fd: int, offset: int, url: str) -> int:
        """Reads the body into this thread's buffer and writes it at `offset` of `fd`, CHUNK at a time."""
        buffer = self._requests.buffer(CHUNK)
        done = 0
        while done < length:
            try:
                count = response.readinto(buffer[:min(CHUNK, length - done)])
            except Exception as exc:  # IncompleteRead, a reset, a timeout
                raise TransientError(f"reading {url}: body cut short after {done} of {length} bytes "
                                     f"({type(exc).__name__}: {_one_line(exc)})") from exc
            if not count:
                raise TransientError(f"reading {url}: body cut short after {done} of {length} bytes")
            _pwrite_all(fd, buffer[:count], offset + done)
            done += count
        return done

    def _masked(self, message: str) -> str:
        return signed.without_signatures(self._masker.text(message))


class Listing(NamedTuple):
    """One page of a bucket listing."""

    objects: List[ObjectInfo]
    truncated: bool
    next_marker: Optional[str]


def parse_listing(body: bytes) -> Listing:
    """A ListBucketResult (S3's or OBS's namespace). Keys are URL-decoded when the answer says
    EncodingType=url, as the SDK does; raises ValueError for a document that is not one."""
    fields, entries, decode = _listing_document(body, "ListBucketResult", "Contents")
    objects = [ObjectInfo(decode(entry.get("Key", "")), int(entry.get("Size") or 0), unquote_etag(entry.get("ETag")))
               for entry in entries]
    next_marker = fields.get("NextMarker")
    return Listing(objects, fields.get("IsTruncated", "").lower() == "true",
                   decode(next_marker) if next_marker else None)


def _listing_document(body: bytes, root_name: str, entry_name: str
                      ) -> Tuple[Dict[str, str], List[Dict[str, str]], Callable[[str], str]]:
    """A listing answer's top-level fields, its entries (each a dict of its children's texts), and how its keys
    are decoded (URL-decoded when it says EncodingType=url, as the SDK does). ValueError for another document."""
    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError as exc:  # a SyntaxError, not a ValueError
        raise ValueError(f"not XML: {exc}") from None
    if _local_name(root.tag) != root_name:
        raise ValueError(f"expected {root_name}, got {_local_name(root.tag)}")
    fields: Dict[str, str] = {}
    entries: List[Dict[str, str]] = []
    for element in root:
        name = _local_name(element.tag)
        if name == entry_name:
            entries.append({_local_name(child.tag): child.text or "" for child in element})
        else:
            fields[name] = element.text or ""
    decode = unquote_plus if fields.get("EncodingType", "").lower() == "url" else str
    return fields, entries, decode


class UploadListing(NamedTuple):
    """One page of a listing of unfinished multipart uploads."""

    uploads: List[Upload]
    truncated: bool
    next_key_marker: Optional[str]
    next_upload_id_marker: Optional[str]


def parse_uploads(body: bytes) -> UploadListing:
    """A ListMultipartUploadsResult (S3's or OBS's namespace); keys URL-decoded when the answer says
    EncodingType=url. Raises ValueError for a document that is not one."""
    fields, entries, decode = _listing_document(body, "ListMultipartUploadsResult", "Upload")
    uploads = [Upload(decode(entry.get("Key", "")), entry.get("UploadId", ""), _epoch_seconds(entry.get("Initiated")))
               for entry in entries]
    if any(not upload.upload_id for upload in uploads):
        raise ValueError("an Upload without an UploadId")
    next_key = fields.get("NextKeyMarker")
    return UploadListing(uploads, fields.get("IsTruncated", "").lower() == "true",
                         decode(next_key) if next_key else None, fields.get("NextUploadIdMarker") or None)


def _epoch_seconds(text: Optional[str]) -> Optional[float]:
    """`2024-05-01T12:00:00.000Z` (with or without the fraction) as epoch seconds; None for anything else."""
    if not text:
        return None
    whole, _, fraction = text.strip().rstrip("Z").partition(".")
    try:
        seconds = calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S"))
        return seconds + (float(f"0.{fraction}") if fraction.isdigit() else 0.0)
    except ValueError:
        return None


def _local_name(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]  # "{namespace}Name" -> "Name"


def endpoint_url(configured: Optional[str], use_https: bool) -> str:
    endpoint = (configured or "").strip().rstrip("/")
    if not endpoint:
        raise StorageError("no OBS endpoint: set MA_S3_ENDPOINT or storage.endpoint in the job file")
    if _has_control_character(endpoint):
        raise ConfigError(f"MA_S3_ENDPOINT {ascii(endpoint)[:120]} contains a control character (a newline, tab "
                          "or NUL)", hint="write the endpoint on one line", stage="stage-in")
    if "://" not in endpoint:
        endpoint = ("https://" if use_https else "http://") + endpoint
    return endpoint


def share_crc_tables() -> None:
    """Builds the SDK's CRC-64 tables once instead of once per response.

    Every answer the SDK parses gets a `ResponseWrapper` whose `util.Crc64()` builds a
    256-entry CRC table and a combine function in pure Python: ~0.3 ms of CPU per GET,
    a fifth of a small object's cost here (benchmarks/storage.py), for a checksum our
    read path never consults. Each instance gets a copy of a prebuilt table instead.
    """
    from obs import util

    if getattr(util.Crc64, "shared_by_ma_runtime", False):
        return
    original = util.Crc64
    templates: Dict[int, Any] = {}

    class SharedCrc64(original):
        shared_by_ma_runtime = True

        def __init__(self, init_crc: int = 0):
            template = templates.get(init_crc)
            if template is None:
                template = templates[init_crc] = original(init_crc)
            self.crc64 = template.crc64.copy()
            self.crc64_combineFun = template.crc64_combineFun

    util.Crc64 = SharedCrc64


def socket_timeout(retry_seconds: float) -> float:
    """The timeout of each socket operation: the SDK's 60 s, but never past the retry budget."""
    return max(MIN_TIMEOUT_SECONDS, min(float(TIMEOUT_SECONDS), retry_seconds))


def new_client(spec, endpoint: str, access_key: str, secret_key: str, token: Optional[str],
               masker: Masker, timeout: float = TIMEOUT_SECONDS) -> ObsClient:
    share_crc_tables()
    host = urlsplit(endpoint).hostname or ""
    try:
        with warnings.catch_warnings():
            # The SDK builds its SSLContext with the deprecated PROTOCOL_SSLv23 name; nothing to act on.
            warnings.simplefilter("ignore", DeprecationWarning)
            client = ObsClient(
                access_key_id=access_key,
                secret_access_key=secret_key,
                security_token=token,
                server=endpoint,
                signature=spec.storage_signature,
                region=signing_region(spec.storage_region, host),
                path_style=uses_path_style(spec.storage_path_style, host),
                ssl_verify=spec.storage_verify_ssl,
                max_retry_count=0,  # the transfer engine retries, with its own deadline
                timeout=timeout,
                is_signature_negotiation=False,  # the configured signature, not an unauthenticated probe's
            )
    except Exception as exc:  # the SDK raises bare Exception for a malformed server
        raise StorageError(masker.text(f"OBS endpoint {endpoint}: {_one_line(exc)}")) from None
    if spec.storage_verify_ssl:
        _verify_certificates(client)
    return client


def read_credentials(environ: Mapping[str, str]) -> Tuple[str, str, Optional[str]]:
    """(access key, secret key, token or None); raises StorageError naming the missing variables only, and
    ConfigError naming a variable whose value holds a control character (never the value)."""
    missing = [name for name in (ACCESS_KEY_VARIABLE, SECRET_KEY_VARIABLE) if not environ.get(name)]
    if missing:
        raise StorageError(f"no OBS credentials: {' and '.join(missing)} not set",
                           hint=f"set {ACCESS_KEY_VARIABLE} and {SECRET_KEY_VARIABLE} (and {TOKEN_VARIABLE} for "
                                "temporary credentials)")
    for name in (ACCESS_KEY_VARIABLE, SECRET_KEY_VARIABLE, TOKEN_VARIABLE):
        if _has_control_character(environ.get(name) or ""):
            raise ConfigError(f"{name} contains a control character (a newline, carriage return, tab or NUL)",
                              hint=f"set {name} to the credential alone, on one line", stage="stage-in")
    return environ[ACCESS_KEY_VARIABLE], environ[SECRET_KEY_VARIABLE], environ.get(TOKEN_VARIABLE) or None


def _has_control_character(value: str) -> bool:
    return any(unicodedata.category(char) == "Cc" for char in value)


def signing_region(configured: str, host: str) -> str:
    if configured:
        return configured
    labels = host.lower().split(".")
    # obs.<region>.<domain>.<tld>; fewer labels (obs.example.com) name no region.
    if len(labels) >= 4 and labels[0] == "obs" and not _is_ip(host):
        return labels[1]
    return DEFAULT_REGION


def uses_path_style(setting: str, host: str) -> bool:
    if setting in ("on", "off"):
        return setting == "on"
    host = host.lower()
    is_huawei = any(host == domain or host.endswith("." + domain) for domain in HUAWEI_DOMAINS)
    # Virtual-host style needs DNS for bucket.<host>: Huawei's endpoints have it, IPs and others may not.
    return _is_ip(host) or not is_huawei


def is_network_error(exc: BaseException) -> bool:
    """True for failures worth retrying: refused/reset connections, DNS, timeouts, broken HTTP streams."""
    if isinstance(exc, LOCAL_FILE_ERRORS):
        return False
    # requests' and socket's errors, TimeoutError and ssl.SSLError are OSErrors; http.client's are not.
    return isinstance(exc, (OSError, http.client.HTTPException, Urllib3Error))


def object_url(bucket: str, key: str) -> str:
    return f"obs://{bucket}/{key}"


def unquote_etag(etag: Optional[str]) -> Optional[str]:
    return etag.strip().strip('"') if etag else None


def is_refusal(status: int, code: Optional[str]) -> bool:
    """True when an error answer to a request about one object refuses that object (see the module's docstring)."""
    return 400 <= status < 500 and status not in NOT_REFUSAL_STATUSES and code not in NOT_ABOUT_THE_OBJECT


def multipart_etag(part_etags: Iterable[str]) -> Optional[str]:
    """The ETag S3 and OBS give an object completed from parts with these ETags (in part order), when each is an
    MD5: the MD5 of their digests, then "-<count>". None otherwise (an encrypted object's parts, say)."""
    etags = [unquote_etag(etag) or "" for etag in part_etags]
    if not etags or not all(_MD5_HEX.match(etag) for etag in etags):
        return None
    digests = b"".join(bytes.fromhex(etag) for etag in etags)
    return f"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{len(etags)}"


def _encrypted_with_a_key(header: Callable[[str], Optional[str]]) -> bool:
    """True when a PUT's answer says the object is encrypted with a KMS or customer-provided key."""
    if any(header(name) for name in KEY_ENCRYPTION_HEADERS):
        return True
    return any("kms" in (header(name) or "").lower() for name in KMS_ENCRYPTION_HEADERS)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _verify_certificates(client: ObsClient) -> None:
    # The SDK builds its own SSLContext with CERT_REQUIRED but loads no trust store (unless
    # ssl_verify is a CA file path) and turns hostname checking off: give it both.
    context = getattr(client, "context", None)
    if context is not None:
        context.load_default_certs()
        context.check_hostname = True


def _require_key(action: str, bucket: str, key: str) -> None:
    # Without a key a request addresses the bucket: a PUT would create it, a DELETE remove it.
    if not key:
        raise StorageError(f"{action} obs://{bucket}/: an object key is required")


def _content_type(key: str) -> Dict[str, str]:
    """The Content-Type header the SDK gives an object by its key's extension (putFile, initiateMultipartUpload
    do), so that an object looks the same whichever way it went up; none for an extension it does not know."""
    name = key.rsplit("/", 1)[-1]
    content_type = MIME_TYPES.get(name.rsplit(".", 1)[-1].lower()) if "." in name else None
    return {"Content-Type": content_type} if content_type else {}


def _open_regular(path: str, action: str, bucket: str, key: str) -> IO[bytes]:
    """`path` opened for reading, when it is a regular file (O_NONBLOCK: a FIFO put there is refused, not waited
    on); StorageError naming it otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise StorageError(f"{action} {path} to {object_url(bucket, key)}: {_one_line(exc)}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StorageError(f"{action} {path} to {object_url(bucket, key)}: not a regular file")
    return os.fdopen(fd, "rb", buffering=0)


def _pwrite_all(fd: int, data: bytes, position: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        view = view[written:]
        position += written


def _one_line(value: object) -> str:
    return " ".join(str(value).split()) or type(value).__name__
