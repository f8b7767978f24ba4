"""Taking the stacks of a hung attempt's registered processes (see the package's docstring): the signal, the wait for
each dump, py-spy beside it; the files written and the summary logged."""

import dataclasses
import os
import re
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ma_runtime.process import table as proc_table
from ma_runtime.process.lifecycle import ToolError, run_tool
from ma_runtime.supervise import ranks
from ma_runtime.supervise.stacks.registry import DIR_ENV, stack_signal
from ma_runtime.supervise.stacks.summary import Stacks, Thread, log_summary, parse, summarise
from ma_runtime.util import files

# A file grown and unchanged over one poll is a complete dump: the C handler writes it in one go.
POLL_SECONDS = 0.02
# 100 threads x 100 frames of 500-character names bound a dump; more is not one.
DUMP_LIMIT = 16 << 20
_PTRACE = re.compile(r"permission denied|operation not permitted|ptrace", re.IGNORECASE)
_STATES = {
    "T": "it is stopped (SIGSTOP)",
    "t": "it is held by a debugger",
    "D": "it is in uninterruptible sleep in the kernel (a driver or file-system call)",
}


@dataclasses.dataclass
class _Proc:
    """A registered process of the attempt."""

    pid: int
    worker: str
    leader: bool
    path: Path  # its file in the registry
    before: int = 0  # the file's size before the signal
    label: str = ""
    text: Optional[str] = None  # its dump, once it answered
    threads: List[Thread] = dataclasses.field(default_factory=list)


def dump(registry: Path, out_dir: Path, trees: Dict[str, List[int]], log, timeout: float = 2.0,
         py_spy_timeout: float = 5.0) -> Stacks:
    """The stacks of every registered process of `trees` ({worker name: [leader, its living descendants]}),
    written to `out_dir` (`<label>.txt`, `<label>.py-spy.txt`) and summed up in the task log."""
    registry, out_dir = Path(registry), Path(out_dir)
    table = proc_table.processes()
    procs = _registered(registry, trees)
    missing = [_no_python(name, pids) for name, pids in trees.items()
               if not any(proc.worker == name for proc in procs)]
    for line in missing:
        log.warning(line)
    _label(procs, trees, table)
    signalled = _signal(procs)
    _await(signalled, timeout)
    silent = [_silent(proc, timeout) for proc in signalled if proc.text is None]
    for line in silent:
        log.warning(line)
    folder = _write_dumps(signalled, out_dir, log)
    folder = _py_spy(signalled, out_dir, log, py_spy_timeout) or folder
    stacks = summarise([proc for proc in signalled if proc.text is not None], folder, missing + silent)
    log_summary(stacks, signalled, log)
    return stacks


def _registered(registry: Path, trees: Mapping[str, Sequence[int]]) -> List[_Proc]:
    try:
        names = set(os.listdir(registry))
    except OSError:
        return []
    procs = []
    for name, pids in trees.items():
        for index, pid in enumerate(pids):
            path = registry / str(pid)
            if str(pid) in names and _holds(pid, path):
                procs.append(_Proc(pid, name, index == 0, path))
    return procs


def _holds(pid: int, path: Path) -> bool:
    """Whether `pid` is the process that registered `path`: it holds the file open (see the module's
    docstring). True where /proc does not tell."""
    try:
        wanted = os.stat(path)
        if not stat.S_ISREG(wanted.st_mode):
            return False
        fds = proc_table.descriptors(pid)
    except PermissionError:
        return True
    except OSError:
        return False
    for fd in fds:
        try:
            held = os.stat(fd)
        except OSError:
            continue
        if (held.st_dev, held.st_ino) == (wanted.st_dev, wanted.st_ino):
            return True
    return False


def _no_python(name: str, pids: Sequence[int]) -> str:
    if not pids:
        return f"worker {name} has no Python stack: it has no living process"
    comm = proc_table.comm(pids[0])
    if not comm:
        return f"worker {name} (pid {pids[0]}) has no Python stack: it has exited"
    leader = f"pid {pids[0]}, {comm}"
    if any(_is_python(pid) for pid in pids):
        why = (f"its Python did not register: started with -E, -I or -S, or without {DIR_ENV} in its "
               "environment, or unable to write there")
    else:
        why = "no Python process in it"
    return f"worker {name} ({leader}) has no Python stack: {why}"


def _is_python(pid: int) -> bool:
    program = proc_table.program(pid) or proc_table.comm(pid)
    return re.match(r"python", program) is not None


def _label(procs: List[_Proc], trees: Mapping[str, Sequence[int]], table: Mapping[int, proc_table.Proc]) -> None:
    """`rank <r>` for a rank, `pid <p> (<comm>)` for any other process: unique, in tree order."""
    found = {proc.pid: _rank_of(proc) for proc in procs}
    taken = set()
    for proc in procs:
        rank = found[proc.pid]
        # A rank's python subprocess (a spawned DataLoader worker) inherits its variables: the rank is the topmost
        # registered one (not the topmost process: `bash run.sh` may start the rank with the same variables).
        if any(found.get(ancestor) == rank for ancestor in _ancestors(proc.pid, table)):
            rank = None
        label = f"rank {rank}" if rank is not None else ""
        if not label or label in taken:
            label = f"pid {proc.pid} ({proc_table.comm(proc.pid) or '?'})"
        taken.add(label)
        proc.label = label


def _ancestors(pid: int, table: Mapping[int, proc_table.Proc]) -> List[int]:
    found: List[int] = []
    parent = table[pid].ppid if pid in table else 0
    while parent in table and parent not in found:
        found.append(parent)
        parent = table[parent].ppid
    return found


def _rank_of(proc: _Proc) -> Optional[str]:
    rank = _rank(proc.pid, proc.worker)
    if rank is None and proc.leader:
        match = re.fullmatch(r"rank-(\d+)", proc.worker)
        rank = match[1] if match else None
    return rank


def _rank(pid: int, worker_name: str) -> Optional[str]:
    """The rank a process's initial environment gives it (ranks.rank_of). The trees hold the ranks and theirs, no
    launcher (supervise/ranks.py); a launcher's helper (msrun's scheduler, which runs the user's script with
    RANK_ID=0) is no rank."""
    environ = proc_table.environ(pid)
    if ranks.is_helper(environ):
        return None
    rank = ranks.rank_of(environ, worker_name)
    return None if rank is None else str(rank)


def _signal(procs: List[_Proc]) -> List[_Proc]:
    """The processes that were sent the signal (a process that is gone is skipped)."""
    signum = stack_signal()
    sent = []
    for proc in procs:
        proc.before = _size(proc.path)
        try:
            os.kill(proc.pid, signum)
        except OSError:
            continue
        sent.append(proc)
    return sent


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def _await(procs: List[_Proc], timeout: float) -> None:
    """Until every file has grown and kept its size over one poll, at most `timeout` s; reads the dumps."""
    deadline = time.monotonic() + timeout
    last = {proc.pid: proc.before for proc in procs}
    pending = list(procs)
    while pending:
        time.sleep(POLL_SECONDS)
        for proc in list(pending):
            size = _size(proc.path)
            if proc.before < size == last[proc.pid]:
                proc.text = _read_dump(proc)
                pending.remove(proc)
            last[proc.pid] = size
        if time.monotonic() >= deadline:
            break
    for proc in pending:
        if _size(proc.path) > proc.before:  # a dump still being written at the deadline: what there is
            proc.text = _read_dump(proc)


def _read_dump(proc: _Proc) -> Optional[str]:
    try:
        fd = os.open(proc.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as source:
            source.seek(max(proc.before, 0))
            text = source.read(DUMP_LIMIT).decode("utf-8", "replace")
    except OSError:
        return None
    proc.threads = parse(text)
    return text


def _silent(proc: _Proc, timeout: float) -> str:
    state = proc_table.processes().get(proc.pid)
    if state is None:
        why = "it has exited"
    else:
        why = _STATES.get(state.state, "its handler was replaced, or the signal is blocked or ignored")
    return f"{proc.label} (pid {proc.pid}) did not answer the stack signal within {timeout:g} s: {why}"


def _file_name(label: str) -> str:
    """`rank 3` -> `rank-3`, `pid 812 (torchrun)` -> `pid-812-torchrun`."""
    return re.sub(r"[^A-Za-z0-9._]+", "-", label).strip("-.") or "process"


def _write_dumps(procs: List[_Proc], out_dir: Path, log) -> Optional[Path]:
    written = [proc for proc in procs if proc.text is not None]
    for proc in written:
        if not _write(out_dir, f"{_file_name(proc.label)}.txt", proc.text, log):
            return None
    return out_dir if written else None


def _write(out_dir: Path, name: str, text: str, log) -> bool:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        files.write_atomically(out_dir / name, text)
    except OSError as exc:
        log.warning("could not write the stacks", path=str(out_dir / name), error=exc.strerror or str(exc))
        return False
    return True


# ---------------------------------------------------------------------------------------------- py-spy


def _py_spy(procs: List[_Proc], out_dir: Path, log, timeout: float) -> Optional[Path]:
    """`py-spy dump` of every process, in parallel, when it is installed; its failures in one line each, the
    lack of ptrace permission in one line for all. Returns out_dir when a dump was written."""
    if shutil.which("py-spy") is None:
        log.debug("py-spy is not installed: no py-spy dumps")
        return None
    if not procs:
        return None
    results: Dict[int, Tuple[int, str, str]] = {}
    threads = [threading.Thread(target=_spy, args=(proc.pid, timeout, results), daemon=True)
               for proc in procs]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout + 1.0  # run_tool kills the tool at `timeout`
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    return _py_spy_results(procs, dict(results), out_dir, log)


def _spy(pid: int, timeout: float, results: Dict[int, Tuple[int, str, str]]) -> None:
    try:
        results[pid] = run_tool(["py-spy", "dump", "--pid", str(pid)], timeout)
    except ToolError as exc:
        results[pid] = (-1, "", exc.message)


def _py_spy_results(procs: List[_Proc], results: Dict[int, Tuple[int, str, str]], out_dir: Path,
                    log) -> Optional[Path]:
    denied = []
    written = False
    for proc in procs:
        code, out, err = results.get(proc.pid, (-1, "", "py-spy did not finish"))
        if code == 0:
            written = _write(out_dir, f"{_file_name(proc.label)}.py-spy.txt", out, log) or written
            continue
        lines = [line.strip() for line in (err + "\n" + out).splitlines() if line.strip()]
        permission = next((line for line in lines if _PTRACE.search(line)), None)
        if permission is not None:
            denied.append((proc.label, permission))
        else:
            first = lines[0] if lines else f"exit code {code}"
            log.warning("py-spy dump failed", process=proc.label, error=first)
    if denied:
        log.warning("py-spy needs ptrace: give the container the SYS_PTRACE capability to get its dumps",
                    processes=len(denied), error=re.sub(r"^\d+: ", "", denied[0][1]))
    return out_dir if written else None
