"""ObsStore: the ObjectStore contract over the SDK and signed.py's requests, every failure mapped by failures.py,
every write confirmed (obs/__init__.py).

This module holds the operations (list, head, read a range, put, the multipart upload and the check of a
completion whose answer was lost, delete, list uploads) and the listing pages; sending one request and reading
its answer is wire.py's `ObsWire`, which ObsStore stands on.
"""

import base64
import hashlib
import os
import re
import stat
import threading
import time
from typing import IO, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple
from urllib.parse import urlsplit

from obs import CompleteMultipartUploadRequest, CompletePart, ObsClient
from obs.const import MIME_TYPES

from ma_runtime.storage import signed
from ma_runtime.storage.base import (
    NotFound,
    ObjectChanged,
    ObjectInfo,
    StorageError,
    TransientError,
    Upload,
    check_part_bounds,
    confirmed,
)
from ma_runtime.storage.obs.client import (
    CREDENTIAL_SOURCE,
    TIMEOUT_SECONDS,
    TOKEN_VARIABLE,
    endpoint_url,
    new_client,
    one_line,
    read_credentials,
    signing_region,
    socket_timeout,
    uses_path_style,
)
from ma_runtime.storage.obs.failures import UploadGone
from ma_runtime.storage.obs.listing import Listing, UploadListing, parse_listing, parse_uploads, unquote_etag
from ma_runtime.storage.obs.wire import ObsWire, encrypted_with_a_key, object_url
from ma_runtime.util.redact import Masker

# After a complete, its size is read from the store when this store did not send every part: a transient failure of
# that read is tried again after these waits (seconds), since the complete cannot be (its upload is gone).
SIZE_READ_WAITS = (0.2, 0.5, 1.0)

PAGE_SIZE = 1000  # keys (or multipart uploads) per listing request, the server's maximum
_MD5_HEX = re.compile(r"[0-9a-fA-F]{32}\Z")
_MULTIPART_ETAG = re.compile(r"[0-9a-fA-F]{32}-[0-9]+\Z")


class ObsStore(ObsWire):
    def __init__(self, client: ObsClient, endpoint: str, masker: Masker, credential_source: str = CREDENTIAL_SOURCE,
                 presigner: Optional[signed.V4Presigner] = None, timeout: float = TIMEOUT_SECONDS):
        super().__init__(client, signed.SignedRequests(client, timeout, presigner), masker, credential_source,
                         endpoint)
        self._endpoint = endpoint
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
                   etag: Optional[str] = None, whole: bool = False, tap: Optional[Callable[[bytes], None]] = None,
                   keyed: Optional[Callable[[], None]] = None) -> int:
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
            if keyed is not None and encrypted_with_a_key(response.getheader):
                keyed()
            return self._copy_body(response, length, fd, offset, url, tap)
        finally:
            self._requests.release(response)

    # --- writing -----------------------------------------------------------------------------------

    def put_file(self, bucket: str, key: str, path: str, *, size: Optional[int] = None,
                 unchanged: Optional[Callable[[], bool]] = None) -> ObjectInfo:
        action = "uploading to"
        _require_key(action, bucket, key)
        with _open_regular(path, action, bucket, key) as source:
            if size is None:
                size = os.fstat(source.fileno()).st_size
            response = self._request(action, bucket, key, "PUT", headers=_content_type(key),
                                     body=signed.FileRange(source, 0, size, unchanged), path=path)
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
            # What the SDK makes of an <Error> document in a 200 (see obs/__init__.py).
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
        for wait in (*SIZE_READ_WAITS, None):
            try:
                return self.head(bucket, key).size
            except TransientError as exc:  # the object is whole: a read that failed on the way is read again
                failure: StorageError = exc
                if wait is not None:
                    time.sleep(wait)
            except StorageError as exc:
                failure = exc
                break
        # Not a TransientError: retrying the complete itself would now fail with NoSuchUpload.
        raise StorageError(f"completed {object_url(bucket, key)}, but reading its size failed: {failure}") from failure

    def _sent_size(self, upload_id: str, parts: List[Tuple[int, str]]) -> Optional[int]:
        """The size of the object these parts make, when this store sent them all; else None."""
        with self._lock:
            sizes = dict(self._part_sizes.get(upload_id, {}))
        if all(number in sizes for number, _etag in parts):
            return sum(sizes[number] for number, _etag in parts)
        return None

    def _completed_as_found(self, bucket: str, key: str, upload_id: str, parts: List[Tuple[int, str]],
                            etag_required: bool) -> Optional[ObjectInfo]:
        """The object, when a HEAD finds the one these parts make (see obs/__init__.py): the ETag made of
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


def multipart_etag(part_etags: Iterable[str]) -> Optional[str]:
    """The ETag S3 and OBS give an object completed from parts with these ETags (in part order), when each is an
    MD5: the MD5 of their digests, then "-<count>". None otherwise (an encrypted object's parts, say)."""
    etags = [unquote_etag(etag) or "" for etag in part_etags]
    if not etags or not all(_MD5_HEX.match(etag) for etag in etags):
        return None
    digests = b"".join(bytes.fromhex(etag) for etag in etags)
    return f"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{len(etags)}"


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
        raise StorageError(f"{action} {path} to {object_url(bucket, key)}: {one_line(exc)}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StorageError(f"{action} {path} to {object_url(bucket, key)}: not a regular file")
    return os.fdopen(fd, "rb", buffering=0)


