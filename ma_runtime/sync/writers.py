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
from typing import Iterable, Optional, Set

_PROC = "/proc"
_WRITE_MODES = (os.O_WRONLY, os.O_RDWR)


def open_for_writing(roots: Iterable[str], inodes: Set[int]) -> Optional[Set[int]]:
    """The inodes among `inodes` (files under the folders `roots`) that some process holds open for writing;
    None when that cannot be told."""
    prefixes = tuple(os.path.join(os.path.realpath(root), "") for root in roots)
    uid = os.getuid()
    writing: Set[int] = set()
    try:
        pids = [name for name in os.listdir(_PROC) if name.isdigit()]
    except OSError:
        return None
    for pid in pids:
        fds = _descriptors(pid, uid)
        if fds is None:
            return None
        for fd in fds:
            inode = _written_inode(pid, fd, prefixes, inodes)
            if inode is not None:
                writing.add(inode)
    return writing


def _descriptors(pid: str, uid: int) -> Optional[list]:
    """The fd numbers of `pid`; [] for a process gone or not ours; None for one of ours we may not examine."""
    folder = f"{_PROC}/{pid}/fd"
    try:
        return os.listdir(folder)
    except (FileNotFoundError, ProcessLookupError):
        return []
    except PermissionError:
        try:
            owner = os.stat(f"{_PROC}/{pid}").st_uid
        except OSError:
            return []
        return None if owner == uid and uid != 0 else []
    except OSError:
        return []


def _written_inode(pid: str, fd: str, prefixes, inodes: Set[int]) -> Optional[int]:
    link = f"{_PROC}/{pid}/fd/{fd}"
    try:
        target = os.readlink(link)
        if not target.startswith(prefixes):  # sockets, pipes, devices, other folders
            return None
        inode = os.stat(link).st_ino
        if inode not in inodes:
            return None
        with open(f"{_PROC}/{pid}/fdinfo/{fd}", "rb") as info:
            flags = _flags(info.read())
    except OSError:  # the process or the descriptor went meanwhile
        return None
    return inode if flags is not None and flags & os.O_ACCMODE in _WRITE_MODES else None


def _flags(fdinfo: bytes) -> Optional[int]:
    for line in fdinfo.splitlines():
        if line.startswith(b"flags:"):
            try:
                return int(line.split(b":", 1)[1].strip(), 8)
            except ValueError:
                return None
    return None
