"""The transfer engine: parallel, resumable, verified, atomic downloads and uploads over any ObjectStore.

Downloads run on one bounded pool. Small objects go whole; large ones go as
ranged parts written with `pwrite` into ONE preallocated partial file, renamed
into place when complete, so there is no second copy at the end (the OBS SDK's
downloadFile copies its .tmp file over).

Partial files live where no key can reach them: `<state_dir>/partial/`, outside
the target tree, when that is on the destination's filesystem and mount (the
rename must not cross either); otherwise `<destination root>/.ma-runtime-partial/`,
a name every key is refused from producing (safety.py), removed once empty. A partial file is
named by a digest of its target path: a fixed length, whatever the key, and no
key's file can ever be another key's partial file. Before the rename, the file
is checked by its descriptor: the path about to be renamed must still be that
very file (same inode), and its size, and its MD5 when the ETag is one, are
read back from it, not taken from the bytes as they were sent: what is renamed
into place is what was verified. Every read names the version listed (its ETag):
an object replaced mid-download fails with ObjectChanged instead of giving a
file made of two versions.

State lives in `options.state_dir`, outside the target tree:
- `<id>.download.json` per large object: the parts already on disk, so a rerun
  fetches only the missing ones (a large object that failed before its first part
  leaves neither record nor partial file);
- `<id>.journal` per download: the ETag each finished file came from, so a
  rerun skips files already there unless the object changed;
- `<id>.upload.json` per multipart upload: its upload id and finished parts.
Every one is written through files.py: atomically, and never over something that
is not a regular file.

Every store call is retried on TransientError for `retry_seconds` (tenacity,
imported only when a transfer starts: its ~30 ms belong to jobs that transfer).
The budget is a deadline: no backoff wait runs past it. Failures name the store
(its endpoint) once, at the engine's edge.

The parts, as s3transfer splits its own:
- options.py   TransferOptions: workers, part sizes, the retry budget, the state folder;
- retry.py     Calls: every store call retried within the deadline;
- download.py  download(): find, plan (refusals, folders), skip what is in place, fetch small files whole;
- parts.py     a large object as ranged parts into one preallocated partial file, resumable by its record;
- partial.py   where partial files live (the staging folder), how one is opened and checked before its rename;
- hashing.py   MD5s: of a file, and followed part by part as a download's parts land;
- upload.py    upload_file() (one PUT or parts), Multipart (resumable by its record), settle_uploads();
- journal.py   the download's ETag journal, and the checks of the download and upload records read back;
- utils.py     object URLs, state-file digests, the failure naming the store, the runtime's own files.
"""

from ma_runtime.storage.transfer.download import Summary, download
from ma_runtime.storage.transfer.options import TransferOptions
from ma_runtime.storage.transfer.partial import PARTIAL_SUFFIX, STAGING_NAME
from ma_runtime.storage.transfer.retry import Calls
from ma_runtime.storage.transfer.upload import EitherStop, Multipart, settle_uploads, upload_file
from ma_runtime.storage.transfer.utils import name_digest

# The engine's surface for the stages (stage-in, the sync) and its state files' names; the rest is its own.
__all__ = ["PARTIAL_SUFFIX", "STAGING_NAME", "Calls", "EitherStop", "Multipart", "Summary", "TransferOptions",
           "download", "name_digest", "settle_uploads", "upload_file"]
