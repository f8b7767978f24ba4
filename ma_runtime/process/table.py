"""The process table: every read of /proc the runtime makes about other processes, in one place.

psutil (a declared dependency) is the model where it does the job: the hang monitor reads each rank's IO and CPU
counters with it (supervise/hang.py), and loads it only when hang detection is on. Everything here reads /proc
directly, each for a reason given where it is read:
- the table itself (`processes`): the supervisor scans it at every exit and once a second, the guard at the end.
  A scan of /proc/*/stat here costs 2.3 ms for 130 processes against psutil.process_iter's 10.1 ms (measured at
  load 0.5), psutil's import costs 34 ms of every start (a job without hang detection never pays it), and psutil
  has no process group, which every stop needs;
- a process's environment and command line: bounded reads (an environment may be megabytes; psutil reads it
  whole), on the same no-psutil paths (the guard, the rank finder);
- its descriptors: psutil lists regular files only, and the guard looks for pipes; their open flags (fdinfo),
  for the few files the sync asks about rather than every file of every process;
- its threads' run-queue wait (schedstat) and our own argument area: psutil gives neither.

Reads never raise for a process that vanished or cannot be examined: they answer "nothing" (an empty list, None),
as each function says; `pids` and `descriptors` alone raise OSError, for callers that tell "gone" from "not
allowed" (the sync's "cannot tell").
"""

import os
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

_CMDLINE_LIMIT = 1 << 16
_ENVIRON_LIMIT = 1 << 20


class Proc(NamedTuple):
    """One line of the process table."""

    state: str  # R, S, D, T, ... (zombies never appear)
    ppid: int
    pgid: int  # its process group: who a killpg reaches
    start: int  # clock ticks after boot: with the pid, names one process for good (pids are reused)
    comm: str = ""  # its name (/proc/<pid>/comm): what an exec or a thread-name change makes of it


def processes() -> Dict[int, Proc]:
    """Every living (non-zombie) process, read from /proc (not psutil: see the module's docstring)."""
    table: Dict[int, Proc] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        proc = _stat(entry)
        if proc is not None and proc.state not in ("Z", "X"):
            table[int(entry)] = proc
    return table


def descendants(root: int, exclude: Sequence[int] = (), table: Optional[Dict[int, Proc]] = None) -> List[int]:
    """Living descendants of `root`; the `exclude`d and theirs are left out."""
    return family([root], exclude, processes() if table is None else table)


def family(roots: Iterable[int], exclude: Sequence[int], table: Dict[int, Proc]) -> List[int]:
    """Descendants of every root (not the roots themselves), each once."""
    children: Dict[int, List[int]] = {}
    for pid, proc in table.items():
        children.setdefault(proc.ppid, []).append(pid)
    found: List[int] = []
    seen = set(roots)
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in exclude and child not in seen:
                seen.add(child)
                found.append(child)
                todo.append(child)
    return found


def _stat(pid: str) -> Optional[Proc]:
    """The process's line of the table, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm may contain spaces and parentheses: the fields start after the last ')'
    # (field 3, state); then ppid and pgrp; field 22, the start time, is the 20th.
    end = data.rfind(b")")
    fields = data[end + 2 :].split()
    try:
        return Proc(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19]),
                    data[data.find(b"(") + 1 : end].decode("utf-8", "replace"))
    except (IndexError, ValueError):
        return None


def cmdline(pid: int) -> List[str]:
    """The process's command line; empty where it cannot be read (gone, a kernel thread, another user's)."""
    data = _read(f"/proc/{pid}/cmdline", _CMDLINE_LIMIT)
    return [word.decode("utf-8", "replace") for word in data.split(b"\0")[:-1]] if data else []


def environ(pid: int) -> Dict[str, str]:
    """The process's initial environment (its first MiB); empty where it cannot be read."""
    data = _read(f"/proc/{pid}/environ", _ENVIRON_LIMIT)
    pairs = (entry.split(b"=", 1) for entry in data.split(b"\0") if b"=" in entry)
    return {key.decode("utf-8", "replace"): value.decode("utf-8", "replace") for key, value in pairs}


def comm(pid: int) -> str:
    """The process's name; "" once it is gone."""
    return _read(f"/proc/{pid}/comm", 64).decode("utf-8", "replace").strip()


def program(pid: int) -> Optional[str]:
    """The name of the file the process runs (its exe link); None where /proc does not say (another user's)."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return None


def descriptors(pid: int) -> List[str]:
    """The paths of the process's open descriptors (/proc/<pid>/fd/<n>), for a readlink or a stat. Raises
    OSError (PermissionError: another user's, without CAP_SYS_PTRACE) where they cannot be listed."""
    folder = f"/proc/{pid}/fd"
    return [f"{folder}/{name}" for name in os.listdir(folder)]


def pids() -> List[int]:
    """Every pid /proc lists, zombies too. Raises OSError where /proc cannot be listed."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def owner(pid: int) -> Optional[int]:
    """The uid the process runs as; None once it is gone."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def descriptor_flags(descriptor: str) -> Optional[int]:
    """The open flags (O_WRONLY, O_RDWR, ...) of a `descriptors` path, from its fdinfo; None where it cannot be read
    (gone meanwhile). Not psutil's open_files, which stats and reads the fdinfo of every regular file of every
    process: the sync (sync/writers.py) asks about the few under its folder that changed; its whole look took
    5.7 ms of CPU for 528 descriptors, psutil's 9.6 ms (load 4.4)."""
    folder, _, fd = descriptor.rpartition("/fd/")
    try:
        with open(f"{folder}/fdinfo/{fd}", "rb") as info:
            lines = info.read().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(b"flags:"):
            try:
                return int(line.split(b":", 1)[1].strip(), 8)
            except ValueError:
                return None
    return None


def holds_pipe(pid: int, inodes) -> bool:
    """Whether any descriptor of the process is one of the pipes `inodes` (psutil lists regular files only)."""
    try:
        paths = descriptors(pid)
    except OSError:
        return False
    for path in paths:
        try:
            link = os.readlink(path)
        except OSError:
            continue
        if link.startswith("pipe:[") and int(link[6:-1]) in inodes:
            return True
    return False


def cpu_demand(pid: int) -> Optional[float]:
    """Seconds every thread of `pid` has run and waited on a run queue (/proc/<pid>/task/*/schedstat: psutil has no
    run-queue wait): what it asked of the CPUs, which contention does not shrink as it shrinks what it gets. None
    where the kernel does not say."""
    total = 0
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/schedstat", "rb") as f:
                ran, waited = f.read().split()[:2]
            total += int(ran) + int(waited)
        except (OSError, ValueError):
            continue  # a thread that ended since the listing
    return total / 1e9


def argument_area() -> Optional[Tuple[int, int]]:
    """Where our own command line lies in our memory (start, end: /proc/self/stat fields 48 and 49, which psutil
    does not give); None where it cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[45]), int(fields[46])
    except (OSError, IndexError, ValueError):
        return None


def _read(path: str, limit: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return b""
