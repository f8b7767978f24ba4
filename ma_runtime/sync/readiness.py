"""Which of a cycle's changed files go up now: the whole ones, and the stop rule.

A file is whole when its writer closed it (no process holds it open for writing, writers.py; a file renamed
into place is complete the moment it appears), or when it has the same identity as at the previous look and
that cannot be told. A file rewritten in place over an object we uploaded needs the two looks even when
closed: a writer that died mid-write left it closed and torn. Logs are append-only: every changed log goes up
as a snapshot of its current length. At a final sync every writer is gone and every file is as whole as it
will ever be.

The stop rule: once the workers are being stopped (a SIGTERM, a hang, another rank's failure), a file that
would replace an object goes up only if a look before the stop found it whole and it has not changed since; a
checkpoint rewritten in place when the stop came never replaces the good one in the store.

`Readiness` keeps what the looks found (one per channel, across its cycles).
"""

import collections
from typing import Callable, Deque, Dict, List, Optional, Set, Tuple

from ma_runtime.sync import births, writers
from ma_runtime.sync.manifest import Manifest
from ma_runtime.sync.targets import Target
from ma_runtime.sync.tree import Entry


class Readiness:
    def __init__(self, target: Target, manifest: Manifest, replaces: Callable[[str], bool], log):
        self.target = target
        self.manifest = manifest
        self.replaces = replaces  # relative -> whether uploading it would replace an object in the store
        self.log = log
        self.seen: Dict[str, tuple] = {}  # the identity of each changed file at the last look
        self.whole: Dict[str, tuple] = {}  # the identity at the last look that found the file whole
        self.before_stop: Optional[tuple] = None  # (whole, seen) as the last look before the stop left them
        self.looks: Deque[tuple] = collections.deque(maxlen=2)  # (started, whole, seen) of the last looks

    def ready(self, entries: Dict[str, Entry], final: bool, stop: Optional[float],
              look: float) -> Tuple[List[str], List[str]]:
        """(the changed files to upload now, those held because they were being written when the workers were
        stopped). `stop`: when the workers began to be stopped (time.time()), None when they were not; `look`:
        when this look began (time.time())."""
        if self.target.is_log:
            return list(entries), []
        if stop is None:
            self.before_stop = None
        elif self.before_stop is None:  # what the looks that began before the stop found, and nothing later
            self.before_stop = next(((whole, seen) for started, whole, seen in reversed(self.looks)
                                     if started < stop), ({}, {}))
        # At a final sync every writer is gone: a file is as whole as it will ever be.
        ready = list(entries) if final else self._whole_now(entries, look)
        if stop is None:
            return ready, []
        return self._not_replacing_after(stop, entries, ready, warn=final)

    def _whole_now(self, entries: Dict[str, Entry], look: float) -> List[str]:
        """The changed files whole at this look: closed by their writer, or the same at two looks. A file
        rewritten in place over an object we uploaded (same inode) needs the two looks even when closed: a
        writer that died mid-write left it closed and torn; one with a new inode was renamed into place."""
        changed = list(entries)
        unsettled = [relative for relative in changed if self.seen.get(relative) != entries[relative].identity]
        closed = self._closed(entries, [relative for relative in unsettled
                                        if not self._rewritten_in_place(relative, entries[relative])])
        ready = [relative for relative in changed if self.seen.get(relative) == entries[relative].identity
                 or relative in closed]
        self.seen = {relative: entries[relative].identity for relative in changed}
        self.whole = {relative: identity for relative, identity in self.whole.items() if relative in entries}
        self.whole.update((relative, entries[relative].identity) for relative in ready)
        self.looks.append((look, self.whole, self.seen))
        return ready

    def _rewritten_in_place(self, relative: str, entry: Entry) -> bool:
        """The inode uploaded, written again. The same number born at another time is a new file: ext4 gives a
        freed number to the next file created, so a file renamed into place every step comes back with it
        (births.py). When a birth cannot be told, the same number is taken as the same file: the careful rule."""
        record = self.manifest.get(relative)
        if record is None or record.identity[2] != entry.ino:
            return False
        born = births.born(entry.path, entry.ino) if record.born is not None else None
        return born is None or born == record.born

    def _closed(self, entries: Dict[str, Entry], relatives: List[str]) -> Set[str]:
        """Those of `relatives` no process holds open for writing (none, when that cannot be told)."""
        if not relatives:
            return set()
        writing = writers.open_for_writing([str(self.target.root)], {entries[r].ino for r in relatives})
        if writing is None:
            return set()
        return {relative for relative in relatives if entries[relative].ino not in writing}

    def _not_replacing_after(self, stop: float, entries: Dict[str, Entry], ready: List[str],
                             warn: bool) -> Tuple[List[str], List[str]]:
        """Once the workers are being stopped (since `stop`, time.time()): a file that would replace an object
        goes up only if a look before the stop found it whole and it has not changed since; a new file replaces
        nothing and goes as usual."""
        whole, seen = self.before_stop
        stop_ns = int(stop * 1e9)
        kept, at_stop = [], []
        for relative in ready:
            entry = entries[relative]
            settled = entry.identity in (whole.get(relative), seen.get(relative)) and entry.mtime_ns < stop_ns
            (kept if not self.replaces(relative) or settled else at_stop).append(relative)
        if at_stop and warn:
            self.log.warning("files being written when the workers were stopped are not synced: the store keeps "
                             "their last whole version", name=self.target.name, files=len(at_stop),
                             first=", ".join(sorted(at_stop)[:3]))
        return kept, at_stop
