"""Listing answers parsed: a bucket's keys and its unfinished multipart uploads, page by page."""

import calendar
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple
from urllib.parse import unquote_plus
from xml.etree import ElementTree

from ma_runtime.storage.base import (
    ObjectInfo,
    Upload,
)

try:  # requests (an SDK dependency) brings urllib3, whose errors are not all OSErrors
    from urllib3.exceptions import HTTPError as Urllib3Error
except ImportError:  # pragma: no cover - urllib3 comes with the SDK
    Urllib3Error = OSError


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


def unquote_etag(etag: Optional[str]) -> Optional[str]:
    return etag.strip().strip('"') if etag else None
