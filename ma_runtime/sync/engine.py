"""One channel's sync: a local folder to a store URL, cycle after cycle, crash-consistent and incremental.

A cycle (`ChannelSync.cycle`):
1. scans the folder (tree.py) and keeps the files whose identity differs from what the manifest says was
   uploaded, less the writers' temporary files (units.py: `.tmp*`, `*.tmp`, `*.partial`, ...);
2. of those, takes the whole ones: closed by their writer (no process holds the file open for writing,
   writers.py: a file renamed into place is complete the moment it appears), or the same identity as at the
   previous cycle's look when that cannot be told. A file still being written is taken next cycle. Logs are
   append-only, so a growing log is taken as a snapshot of its current length (a prefix of what it will be,
   never a torn mix). At a final sync after the command ended by itself every file is final; after the
   workers were stopped (a SIGTERM, a hang, a failure of another rank), a file that would replace an object is
   taken only if a look before the stop found it whole and it has not changed since: a checkpoint rewritten in
   place when the stop came never replaces the good one in the store (it is listed "being written at the stop");
3. uploads them: small ones (< SMALL_LIMIT) read into memory once, checked unchanged after the read, and sent
   from those bytes with their MD5 (the object is exactly the bytes checked, whatever the file does next);
   larger ones from a descriptor opened once (a file renamed over meanwhile still sends the version it started
   with): in one PUT below the large threshold, else as a resumable multipart upload (transfer.upload_file
   decides), either way stored only when that file is unchanged once every byte was read (a PUT's last bytes
   wait for the check, a multipart upload's completion does). An upload counts only when the store confirmed
   it (the storage layer's rule);
4. uploads completion markers last (units.py: which files are markers, which folder each completes): a marker
   goes up only after every changed file of its unit did, deepest marker first. A unit with a file not yet
   whole, refused, or failed keeps its marker back. Before the first changed file of a unit whose marker is
   in the store goes up, that marker is withdrawn (deleted, whatever `delete` says: it is ours), and published
   again once the unit is whole: a reader that waits for the marker never sees half a checkpoint, even when
   the names are reused.
Order within a cycle: small files, the markers that are ready, larger files, the markers ready then.

A failure that is an outage (unreachable, 5xx after the retries, access denied, a missing bucket) ends a cycle:
trying the 9 999 other files would only take longer; the next cycle tries again. A refusal of one object (a key
the store will not take) sets that file aside with one warning until it changes, and the cycle goes on. Any
other error is logged once with the file and its cause. With a deadline (the final sync), every wait ends by
it, and what was not confirmed uploaded is returned as missing.

Deletes are not propagated unless the channel says `delete: true`, and then only for files this sync
uploaded: an output folder's objects may be a pre-downloaded earlier run's checkpoints that the job rotated
away locally to save disk, and a sync must not turn a full local disk into lost checkpoints.

The records (the manifest, the multipart uploads') are an optimisation: when the state folder cannot take
them (full, read-only) the sync goes on with them in memory, and says so once.

This module owns the channel (`ChannelSync`): its state, the start-up listing, a cycle from scan to report, the
upload of one file (small or multipart), the markers withdrawn from the store, the deletes, and the events.
Step 2 (what is whole, the stop rule) is readiness.py; reading a file as the scan saw it is reading.py; the
uploads of one cycle in their order, with the checkpoint-unit rule for markers, are upload_cycle.py.
"""

import dataclasses
import functools
import os
import stat
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set, Tuple

from ma_runtime.storage import url as url_module
from ma_runtime.storage.base import FileChanged, StorageError
from ma_runtime.storage.transfer import EitherStop, TransferOptions, name_digest, settle_uploads, upload_file
from ma_runtime.storage.transfer.hashing import new_md5
from ma_runtime.storage.transfer.utils import object_url
from ma_runtime.sync import births, reading
from ma_runtime.sync.manifest import Manifest, Record
from ma_runtime.sync.readiness import Readiness
from ma_runtime.sync.reading import SMALL_LIMIT, Later, Unreadable
from ma_runtime.sync.targets import Target
from ma_runtime.sync.tree import Entry, Skipped, scan
from ma_runtime.sync.units import Units, folder_of, under
from ma_runtime.sync.upload_cycle import AT_THE_STOP, REFUSED, Result, UploadCycle


class ChannelSync:
    def __init__(self, target: Target, store, options: TransferOptions, markers, log, state_dir: Path):
        self.target = target
        self.store = store
        self.log = log
        # `markers`: a Units, or marker globs (with the default excludes).
        self.units = markers if isinstance(markers, Units) else Units(tuple(markers))
        self.location = url_module.parse(target.url, f"output {target.name}")
        key = self.location.key
        self.prefix = key if (not key or key.endswith("/")) else key + "/"
        self.url_prefix = object_url(self.location, self.prefix)
        self.options = dataclasses.replace(options, state_dir=Path(state_dir) / "parts")
        self.manifest = Manifest.load(Path(state_dir) / f"{name_digest(target.url, target.root)}.manifest.json",
                                      target.url, log)
        self.refused: Dict[str, tuple] = {}  # set aside: the store refused this version of the file
        self.published: Dict[str, str] = {}  # a marker in the store -> the folder it was published for
        self.listed: Set[str] = set()  # the keys the start-up listing found
        # When the workers began to be stopped (time.time()), told by the runtime: the periodic cycles of the
        # stop's grace then keep what they were writing from replacing the store's whole versions too.
        self.stopping_at: Optional[float] = None
        self.readiness = Readiness(target, self.manifest, self._replaces, log)
        self.listing: Optional[tuple] = None  # (done, answer) of the start-up listing, until it is applied
        # The markers the manifest records (in the store), found once: a cycle with changes asks for them, and a
        # walk of a 100 000-file manifest through the marker patterns would cost it most of a second.
        self._recorded_markers: Optional[Set[str]] = None
        self.walk_cpu = 0.0  # CPU seconds of the last cycle's walk of the folder
        self.skipped = Skipped(log.warning)
        self.warned: Set[Tuple[str, str]] = set()  # (event, path): warnings already given
        self.lock = threading.Lock()  # the manifest, from the upload threads

    # ------------------------------------------------------------------ start

    def start(self, stop: Optional[threading.Event] = None) -> None:
        """Once per uploader: forget what the store lost, adopt what it has already, and settle the multipart
        uploads a crash left; all from one listing of the store. `stop` (the final sync asked for) ends the wait
        for that listing: the final sync then waits for it a while itself (`_listed_by`), and goes on without
        it when it takes too long, with the manifest as it is."""
        done, answer = threading.Event(), {}

        def run() -> None:
            try:
                answer["value"] = {info.key: info for info in self.store.list(self.location.bucket, self.prefix)}
            except BaseException as exc:  # noqa: BLE001 - handed to the thread that applies it
                answer["error"] = exc
            finally:
                done.set()

        threading.Thread(target=run, name="sync-listing", daemon=True).start()
        self.listing = (done, answer)
        while not done.wait(0.05):
            if stop is not None and stop.is_set():
                return
        self._apply_listing(stop)

    def _listed_by(self, deadline: Optional[float]) -> None:
        """A final sync's wait for the start-up listing still under way: a third of the time left at most."""
        if self.listing is None:
            return
        done, _answer = self.listing
        left = None if deadline is None else max(0.0, (deadline - time.monotonic()) / 3)
        if done.wait(left):
            self._apply_listing(None)
        else:
            self.log.info("the store's listing is not back: the final sync goes on with the manifest",
                          name=self.target.name)
            self.listing = None  # once: its answer, if it ever comes, is dropped

    def _apply_listing(self, stop: Optional[threading.Event]) -> None:
        (_done, answer), self.listing = self.listing, None
        try:
            if "error" in answer:
                raise answer["error"]
            listed = answer["value"]
            self.listed = set(listed)
            forgotten = self.manifest.keep_listed({key: info.etag for key, info in listed.items()}, self.key_of)
            self._recorded_markers = None
            if forgotten:
                self.log.info("objects missing or replaced in the store will be uploaded again", name=self.target.name,
                              files=forgotten)
            self._adopt(listed, stop)
            unchanged = functools.partial(reading.still_same, is_log=self.target.is_log)  # resumed, not aborted
            aborted = settle_uploads(self.store, self.options.state_dir, self.url_prefix, unchanged, self.log)
            if aborted:
                self.log.info("aborted unfinished uploads of files that changed", name=self.target.name,
                              uploads=aborted)
        except StorageError as exc:  # the first cycle will say it again; the manifest is trusted meanwhile
            self.log.warning(f"{self._kind} upload failed", name=self.target.name, url=self.target.url,
                             error=str(exc))

    def _adopt(self, listed, stop: Optional[threading.Event]) -> None:
        """Files already in the store byte for byte (a pre-downloaded output) are recorded, not uploaded again.
        Only an object whose ETag is its MD5 can be compared so; a multipart one is uploaded once more."""
        for relative, entry in scan(str(self.target.root), self.skipped).items():
            if stop is not None and stop.is_set():
                break
            info = listed.get(self.key_of(relative))
            if self.manifest.get(relative) or info is None or info.size != entry.size or not info.md5:
                continue
            try:
                md5 = reading.md5_of_file(entry)
            except OSError:
                continue
            if md5 == info.md5:
                self.manifest.put(relative, Record(entry.identity, md5, info.etag, births.born(entry.path, entry.ino)))
        self._recorded_markers = None
        self._save_manifest()

    def key_of(self, relative: str) -> str:
        return self.prefix + relative

    # ------------------------------------------------------------------ a cycle

    def cycle(self, final: bool = False, deadline: Optional[float] = None, only: Optional[Callable[[str], bool]] = None,
              stop: Optional[threading.Event] = None, stopped_at: Optional[float] = None) -> Result:
        """`stopped_at` (a final sync only): the time (time.time()) the workers were asked to stop, when they
        were; None when the command ended by itself."""
        started, look = time.monotonic(), time.time()
        if final:
            self._listed_by(deadline)
        # The cycle's own stop (a failure ends this cycle), which the caller's (the final sync asked for) also sets.
        stop = EitherStop(stop) if stop is not None else threading.Event()
        present: Optional[Set[str]] = set() if self.target.delete and only is None else None
        walk_started = time.thread_time()
        entries = scan(str(self.target.root), self.skipped, self.manifest.files, present)  # changed files only
        self.walk_cpu = time.thread_time() - walk_started
        entries = {relative: entry for relative, entry in entries.items()
                   if (only is None or only(relative)) and not self.units.excluded(relative)}
        ready, at_stop = self.readiness.ready(entries, final, stopped_at if final else self.stopping_at, look)
        set_aside = {relative for relative in ready if self.refused.get(relative) == entries[relative].identity}
        result = Result()
        run = UploadCycle(self, entries, result, deadline, stop, final)
        run.held.update(set(entries) - set(ready))
        run.refused.update(set_aside)
        run.why.update({relative: AT_THE_STOP for relative in at_stop})
        run.why.update({relative: REFUSED for relative in set_aside})
        ready = [relative for relative in ready if relative not in set_aside]
        if ready:
            run.all(ready)
        if present is not None:
            self._delete_vanished(present.union(entries), run)
        with self.lock:
            self._save_manifest()
        result.seconds = time.monotonic() - started
        with run.lock:  # after a deadline, upload threads may still be finishing
            result.missing = self._missing(run) if final else []
        self._report(result, final, whole=only is None)
        return result

    def _replaces(self, relative: str) -> bool:
        """Uploading it would replace an object in the store (one we uploaded, or the start-up listing found)."""
        return self.manifest.get(relative) is not None or self.key_of(relative) in self.listed

    def _missing(self, run: UploadCycle) -> List[str]:
        """What a final sync did not upload, each with why when that is known. A log with an earlier copy in the
        store is not missing: a log only grows, so the store has all of it but the last lines (the next sync of
        the same folder sends them)."""
        relatives = run.held | run.pending | run.refused
        if self.target.is_log:
            relatives = {relative for relative in relatives if self.manifest.get(relative) is None}
        return [f"{relative} ({run.why[relative]})" if relative in run.why else relative
                for relative in sorted(relatives)]

    def is_marker(self, relative: str) -> bool:
        return self.units.is_marker(relative)

    def unit_of(self, marker: str) -> str:
        """The folder `marker` completes, by its content now (a pointer's) or its place."""
        return self.units.unit_in(str(self.target.root), marker)

    def warn_once(self, event: str, path: str, **fields) -> None:
        if (event, path) not in self.warned:
            self.warned.add((event, path))
            self.log.warning(event, name=self.target.name, path=path, **fields)

    # ------------------------------------------------------------------ markers in the store

    def withdraw_markers(self, relatives: List[str], run: UploadCycle) -> Optional[List[str]]:
        """Deletes from the store each marker we published whose unit holds one of `relatives` (about to go up),
        before they do; returns those withdrawn, or None when the store failed (the cycle ends: nothing of those
        units goes up)."""
        withdrawn = []
        if self._recorded_markers is None:
            self._recorded_markers = {relative for relative in self.manifest.relatives() if self.is_marker(relative)}
        for marker in sorted(self._recorded_markers):
            unit = self.published.get(marker)
            if unit is None:
                present = os.path.lexists(os.path.join(self.target.root, marker))
                unit = self.unit_of(marker) if present else folder_of(marker)
            if not any(relative != marker and under(relative, unit) for relative in relatives):
                continue
            try:
                run.calls(self.store.delete, self.location.bucket, self.key_of(marker))
            except StorageError as exc:
                run.fail(marker, exc)
                return None
            with self.lock:
                self.manifest.drop(marker)
                self._recorded_markers.discard(marker)
                self.published.pop(marker, None)
            withdrawn.append(marker)
            self.log.info("marker withdrawn while its checkpoint changes", name=self.target.name, path=marker)
        return withdrawn

    def entry_of(self, relative: str) -> Optional[Entry]:
        """The file's entry now, as a scan would give it (a marker withdrawn after the scan); None if gone."""
        path = os.path.join(self.target.root, relative)
        try:
            stats = os.stat(path)
        except OSError:
            return None
        return Entry(stats.st_size, stats.st_mtime_ns, stats.st_ino, path) if stat.S_ISREG(stats.st_mode) else None

    # ------------------------------------------------------------------ one file

    def upload(self, relative: str, entry: Entry, calls, stop: threading.Event) -> Optional[int]:
        """Uploads one file; returns the bytes sent, None when the store had them already (only the file's
        times changed). Raises Later, Unreadable or StorageError."""
        if entry.size < SMALL_LIMIT:
            return self._put_small(relative, entry, calls)
        return self._put_large(relative, entry, stop)

    def _put_small(self, relative: str, entry: Entry, calls) -> Optional[int]:
        data, born = reading.read(entry, self.target.is_log)
        digest = new_md5()  # usedforsecurity=False: an integrity check, allowed on FIPS hosts
        digest.update(data)
        md5 = digest.hexdigest()
        record = self.manifest.get(relative)
        if record is not None and record.md5 == md5 and record.etag:
            self._record(relative, Record(entry.identity, md5, record.etag, born))  # touched, not changed
            return None
        info = calls(self.store.put_bytes, self.location.bucket, self.key_of(relative), data, md5)
        self._record(relative, Record(entry.identity, md5, info.etag, born))
        return len(data)

    def _put_large(self, relative: str, entry: Entry, stop: threading.Event) -> int:
        fd = reading.open_as_scanned(entry, self.target.is_log)
        try:
            stats = os.fstat(fd)
            # The parts are read through this descriptor: a file renamed over meanwhile (the next `last.ckpt`)
            # still sends the version this upload started with, whole.
            source = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else entry.path
            url = object_url(self.location, self.key_of(relative))
            info = upload_file(self.store, self.location.bucket, self.key_of(relative), url, Path(entry.path), stats,
                               self.options, self.log, size=entry.size, stop=stop, quiet=True, source=source,
                               unchanged=lambda: reading.same(entry, os.fstat(fd), self.target.is_log))
            born = births.born_of_descriptor(fd, entry.ino)
        except FileChanged:
            raise Later() from None
        except PermissionError:
            raise Unreadable("permission denied") from None
        finally:
            os.close(fd)
        self._record(relative, Record(entry.identity, None, info.etag, born))
        return entry.size

    def _record(self, relative: str, record: Record) -> None:
        with self.lock:
            self.manifest.put(relative, record)
            if self._recorded_markers is not None and self.is_marker(relative):
                self._recorded_markers.add(relative)
            self._save_manifest(force=False)

    def _save_manifest(self, force: bool = True) -> None:
        try:
            self.manifest.save(force)
        except OSError as exc:  # costs re-uploads after a restart, not the job: kept in memory meanwhile
            self.warn_once("the sync manifest cannot be written: kept in memory (a later runtime uploads these "
                           "files again)", str(self.manifest.path), error=str(exc))

    # ------------------------------------------------------------------ deletes and events

    def _delete_vanished(self, present: Set[str], run: UploadCycle) -> None:
        calls = run.calls
        for relative in self.manifest.relatives():
            if run.out_of_time():
                return
            if relative in present or not _vanished(os.path.join(self.target.root, relative)):
                continue  # present (perhaps skipped, or in a folder we may not list): never deleted for that
            try:
                calls(self.store.delete, self.location.bucket, self.key_of(relative))
            except StorageError as exc:
                run.fail(relative, exc)
                return
            with self.lock:
                self.manifest.drop(relative)
                if self._recorded_markers is not None:
                    self._recorded_markers.discard(relative)
            self.log.info("deleted from the store: removed locally", name=self.target.name, path=relative)

    @property
    def _kind(self) -> str:
        return "log" if self.target.is_log else "output"

    def _report(self, result: Result, final: bool, whole: bool) -> None:
        """The platform's event for each cycle that uploaded something, and at the end of a final sync: completed
        (whatever it uploaded, the channel is then complete in the store), or incomplete, with how many files
        it left out."""
        fields = dict(name=self.target.name, elapsed_s=round(result.seconds, 3), files=result.files,
                      bytes=result.bytes)
        if final and whole and (result.missing or result.error):
            self.log.warning(f"{self._kind} upload incomplete", **fields, missing=len(result.missing), final=True)
        elif result.files or (final and whole):
            self.log.info(f"{self._kind} upload completed", **fields, final=True if final else None)
        if result.error:
            self.log.warning(f"{self._kind} upload failed", name=self.target.name, url=self.target.url,
                             error=result.error, next=None if final else "retried next cycle")


def _vanished(path: str) -> bool:
    """Only a file certainly gone: a folder we may not search (EACCES) hides a file, it does not remove it."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return False
