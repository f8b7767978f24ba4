"""The OBS backend: Huawei's esdk-obs-python `ObsClient` behind the ObjectStore contract.

Settings (spec/) and the decisions made from them:
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
as `resp.status` / `resp.errorCode`. `ObsWire._call` and `ObsWire._request` are the
places they go through, and failures.py the one mapping.

The parts: client.py (the SDK client as the settings make it, the credentials), store.py (ObsStore: the
operations and the confirmation of a completion), wire.py (ObsWire: one request, its failure mapped and masked,
its body read, a PUT confirmed), failures.py (the failure mapping), listing.py (listing answers parsed).
"""

from ma_runtime.storage.obs.store import ObsStore

__all__ = ["ObsStore"]
