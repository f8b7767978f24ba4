"""Which files some process still holds open for writing: a file its writer has closed is whole at this look.

Why: a sync that waits for two looks one cycle apart never catches a file replaced more often than the cycle
(Lightning's `last.ckpt` every 2.5 s, a Megatron marker every 1.3 s), and a rename-into-place writer's file is
complete the moment it appears. The kernel knows who writes what: `/proc/<pid>/fd` links to each open file, and
`/proc/<pid>/fdinfo/<fd>` gives its open flags. A changed file that no process holds open with O_WRONLY or
O_RDWR was closed by its writer, so it is taken at its first look (and checked unchanged after it is read, as
every file is).

Limits, in the README too: only this container's processes are seen (a file on a folder shared with other
nodes, written there, is not: use a completion marker); a file written through a memory map whose descriptor
was closed looks closed; and when a process of this user cannot be examined (it exited mid-look is fine; a
/proc mounted with hidepid is not), the answer is "cannot tell" and the sync falls back to two looks. Processes
of other users are not ours: they cannot write the job's folders.

Cost: one listing of /proc, one of each process's fd folder, one readlink per descriptor and a stat for those
under the folder: 21 ms of CPU for 105 processes holding 2 400 descriptors (about 9 µs a descriptor, 2 shared
cores at load 3.5), only in cycles that have a changed file two looks have not settled: at the 5 s interval,
under 0.5 % of a core.
"""

import os
from typing import Iterable, List, Optional, Set

from ma_runtime.process import table

_WRITE_MODES = (os.O_WRONLY, os.O_RDWR)


def open_for_writing(roots: Iterable[str], inodes: Set[int]) -> Optional[Set[int]]:
    """The inodes among `inodes` (files under the folders `roots`) that some process holds open for writing;
    None when that cannot be told."""
    prefixes = tuple(os.path.join(os.path.realpath(root), "") for root in roots)
    uid = os.getuid()
    writing: Set[int] = set()
    try:
        pids = table.pids()
    except OSError:
        return None
    for pid in pids:
        descriptors = _descriptors(pid, uid)
        if descriptors is None:
            return None
        for descriptor in descriptors:
            inode = _written_inode(descriptor, prefixes, inodes)
            if inode is not None:
                writing.add(inode)
    return writing


def _descriptors(pid: int, uid: int) -> Optional[List[str]]:
    """The descriptors of `pid`; [] for a process gone or not ours; None for one of ours we may not examine."""
    try:
        return table.descriptors(pid)
    except (FileNotFoundError, ProcessLookupError):
        return []
    except PermissionError:
        owner = table.owner(pid)
        return None if owner is not None and owner == uid and uid != 0 else []
    except OSError:
        return []


def _written_inode(descriptor: str, prefixes, inodes: Set[int]) -> Optional[int]:
    try:
        target = os.readlink(descriptor)
        if not target.startswith(prefixes):  # sockets, pipes, devices, other folders
            return None
        inode = os.stat(descriptor).st_ino
    except OSError:  # the process or the descriptor went meanwhile
        return None
    if inode not in inodes:
        return None
    flags = table.descriptor_flags(descriptor)
    return inode if flags is not None and flags & os.O_ACCMODE in _WRITE_MODES else None
