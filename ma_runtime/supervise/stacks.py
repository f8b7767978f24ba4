"""Where a hung attempt is stuck: the Python stack of every rank, taken from outside before the attempt is stopped.

Registration at interpreter start. Every worker starts with `worker_env`: the folder `site/` first on its
PYTHONPATH, holding nothing but a `sitecustomize.py`, plus MA_RUNTIME_STACKS_DIR (this attempt's registry)
and MA_RUNTIME_STACKS_SIGNAL. In every Python process of the job (ranks, torchrun's agent, msrun's
scheduler, any python subprocess) that sitecustomize opens `<registry>/<pid>`, keeps it open, registers
faulthandler for the signal on it (chaining a handler installed before it), then runs the image's own
sitecustomize. Why so:
- faulthandler is C: it dumps every thread even while the interpreter is deadlocked (a thread stuck in a
  collective holding the GIL), which nothing that needs the training code's cooperation can do;
- the file is opened at start because a signal handler may open nothing; one file per pid is how the
  runtime knows which processes can answer, and which cannot (not Python; Python started with -E, -I or
  -S, which skip PYTHONPATH or sitecustomize): those get one line saying so, not a wait;
- the signal is SIGRTMIN+4, passed as a number so the worker's libc cannot read the name differently:
  training code uses realtime signals almost never, unlike SIGUSR1/2, and its default action (end the
  process) is why only a process that registered is ever sent it.

A pid's file proves little by itself: the pid may have been reused, or the process may have exec'd
something else (the file is close-on-exec). Only a process that still holds its own file open is
signalled; where /proc does not tell (another user's process, without CAP_SYS_PTRACE), it is signalled
anyway, since every process here is about to be stopped with the hung attempt.

Each step is time-boxed: the dumps within `timeout` (a dump is written synchronously by the C handler, so
a file that grew and then stopped growing is complete), py-spy within `py_spy_timeout` (its group is
killed at the end), /proc reads that never wait. A process that vanished, a file that cannot be read, a
dump that does not parse: a line or nothing, never an exception.

The summary in the task log: per process its innermost frames of the main thread (the last thread block
faulthandler prints: CPython lists the newest thread first; over 100 threads the dump stops before it and
the last one shown stands in) and its thread count; then the odd ones out, the ranks that are not where
most ranks are, which are usually the cause of a hung collective.
"""

import collections
import dataclasses
import os
import re
import shutil
import signal
import stat
import threading
import time
from pathlib import Path
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ma_runtime import files
from ma_runtime.process import table as proc_table
from ma_runtime.process.lifecycle import ToolError, run_tool
from ma_runtime.supervise import ranks

SITE_DIR = Path(__file__).resolve().parent / "site"
DIR_ENV = "MA_RUNTIME_STACKS_DIR"
SIGNAL_ENV = "MA_RUNTIME_STACKS_SIGNAL"
# A file grown and unchanged over one poll is a complete dump: the C handler writes it in one go.
POLL_SECONDS = 0.02
# A registry nobody has added to for this long and whose processes are all gone was left by a runtime that
# was killed; a younger one may belong to a run whose workers have not started Python yet.
ABANDONED_SECONDS = 3600
# 100 threads x 100 frames of 500-character names bound a dump; more is not one.
DUMP_LIMIT = 16 << 20
INNERMOST = 3
# Where a rank's main thread waits for its peers: a collective, a barrier, a point-to-point receive (any frame of its
# main thread in one of these). A rank that is not there while others are is the one they wait for.
COLLECTIVES = ("/torch/distributed/", "/torch_npu/distributed/", "/mindspore/communication/", "/horovod/",
               "/deepspeed/comm/", "/mpi4py/")
# Odd ones out named in `describe`: the termination message's reason is one line.
NAMED_ODD = 8
_PTRACE = re.compile(r"permission denied|operation not permitted|ptrace", re.IGNORECASE)
_HEADER = re.compile(r"(?:(?:Current thread|Thread) 0x[0-9a-fA-F]+.*|Stack|Traceback)(?: \(most recent call first\))?:")
_FRAME = re.compile(r'\s+File "(.*)", line (\S+) in (.*)')
_STATES = {
    "T": "it is stopped (SIGSTOP)",
    "t": "it is held by a debugger",
    "D": "it is in uninterruptible sleep in the kernel (a driver or file-system call)",
}


def stack_signal() -> int:
    return int(signal.SIGRTMIN) + 4


def worker_env(registry: Path, environ: Mapping[str, str]) -> Dict[str, str]:
    """What a worker's environment gets (added or changed) so that its Python processes register."""
    existing = environ.get("PYTHONPATH")
    # An empty entry means the current directory: none is added where there was no PYTHONPATH (or an empty one).
    path = f"{SITE_DIR}{os.pathsep}{existing}" if existing else str(SITE_DIR)
    return {"PYTHONPATH": path, DIR_ENV: str(registry), SIGNAL_ENV: str(stack_signal())}


def registry_dir(state_dir: Path, run_id: str, attempt: int) -> Path:
    """`<state_dir>/stacks/<run_id>-<attempt>`, created empty (the default umask: the workers may run as another
    user in some images). Registries abandoned by a killed runtime are removed. Raises OSError."""
    root = Path(state_dir) / "stacks"
    registry = root / f"{run_id}-{attempt}"
    _remove_abandoned(root, keep=registry.name)
    shutil.rmtree(registry, ignore_errors=True)
    registry.mkdir(parents=True)
    return registry


def clean(registry: Path) -> None:
    """At the attempt's end."""
    shutil.rmtree(registry, ignore_errors=True)


def _remove_abandoned(root: Path, keep: str) -> None:
    try:
        entries = [entry for entry in root.iterdir() if entry.name != keep]
    except OSError:
        return
    for entry in entries:
        if _abandoned(entry):
            shutil.rmtree(entry, ignore_errors=True)


def _abandoned(registry: Path) -> bool:
    try:
        if registry.is_symlink() or not registry.is_dir():
            return False
        if time.time() - registry.stat().st_mtime < ABANDONED_SECONDS:
            return False
        return not any(name.isdigit() and _alive(int(name)) for name in os.listdir(registry))
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


# ---------------------------------------------------------------------------------------------- parsing


class Frame(NamedTuple):
    path: str
    line: str  # "???" where faulthandler knew none
    function: str

    def short(self) -> str:
        return f"{os.path.basename(self.path) or self.path}:{self.line} in {self.function}"


class Thread(NamedTuple):
    header: str
    frames: List[Frame]  # innermost first; empty: `<no Python frame>`
    truncated: bool  # over 100 frames: the outermost are missing


def parse(text: str) -> List[Thread]:
    """The thread blocks of a faulthandler dump, in its order; lines it does not know are skipped."""
    threads: List[Thread] = []
    for line in text.splitlines():
        if _HEADER.fullmatch(line.rstrip()):
            threads.append(Thread(line.rstrip(), [], False))
            continue
        if not threads:
            continue
        frame = _FRAME.fullmatch(line)
        if frame:
            threads[-1].frames.append(Frame(*frame.groups()))
        elif line.strip() == "..." and line.startswith(" "):
            threads[-1] = threads[-1]._replace(truncated=True)
    return threads


def main_thread(threads: Sequence[Thread]) -> Optional[Thread]:
    """The last block: CPython lists the newest thread first and the main thread is the oldest."""
    return threads[-1] if threads else None


# ---------------------------------------------------------------------------------------------- the result


@dataclasses.dataclass
class Stacks:
    folder: Optional[Path]  # where the dumps were written; None when nothing was
    where: Dict[str, List[str]]  # label ("rank 3", "pid 812 (torchrun)") -> innermost frames, innermost first
    odd: List[str]  # the labels not where most ranks are
    usual: Optional[str]  # where most ranks are (their innermost frame), when one place has the most
    missing: List[str]  # one line each: a worker without a Python stack, a process that did not answer
    usual_count: int = 0  # how many are there

    def describe(self) -> str:
        """One short sentence for the termination message's reason."""
        folder = f"; stacks in {self.folder}" if self.folder is not None else ""
        if not self.where:
            why = "; ".join(self.missing[:2]) or "no Python process registered"
            return f"no Python stack could be taken ({why})" + folder
        if self.odd:
            return self._odd_sentence() + folder
        if self.usual is not None:
            return self._together_sentence() + folder
        places = collections.Counter(_innermost(frames) for frames in self._subjects().values())
        listed = ", ".join(f"{place} ({count})" for place, count in places.most_common(3))
        return f"the {self._noun()} are in {len(places)} different places: {listed}" + folder

    def _odd_sentence(self) -> str:
        named = self.odd[:NAMED_ODD] if len(self.odd) <= NAMED_ODD else self.odd[:NAMED_ODD - 1]
        names = ", ".join(named) + (f" and {len(self.odd) - len(named)} more" if len(named) < len(self.odd) else "")
        places = sorted({_innermost(self.where[label]) for label in self.odd})
        if len(places) == 1:
            at = places[0]
        else:
            at = "; ".join(f"{label}: {_innermost(self.where[label])}" for label in named)
        verb = "is" if len(self.odd) == 1 else "are"
        others = "the other waits" if self.usual_count == 1 else f"the other {self.usual_count} wait"
        return f"{names} {verb} elsewhere ({at}) while {others} in {self.usual}"

    def _together_sentence(self) -> str:
        subjects = self._subjects()
        if len(subjects) == 1:
            return f"{next(iter(subjects))} is in {self.usual}"
        return f"every {'rank' if self._noun() == 'ranks' else 'process'} is in {self.usual}"

    def _subjects(self) -> Dict[str, List[str]]:
        return _subjects(self.where)

    def _noun(self) -> str:
        return "ranks" if any(_is_rank(label) for label in self.where) else "processes"


def _is_rank(label: str) -> bool:
    return label.startswith("rank ")


def _subjects(where: Mapping[str, List[str]]) -> Dict[str, List[str]]:
    """Whose places are compared: the ranks, or every process where none is a rank."""
    ranks = {label: frames for label, frames in where.items() if _is_rank(label)}
    return ranks or dict(where)


def _innermost(frames: Sequence[str]) -> str:
    return frames[0] if frames else "no Python frame"


# ---------------------------------------------------------------------------------------------- taking them


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
    stacks = _summarise([proc for proc in signalled if proc.text is not None], folder, missing + silent)
    _log_summary(stacks, signalled, log)
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
    launcher (supervise/ranks.py); msrun's scheduler, which runs the user's script with RANK_ID=0, is no rank."""
    environ = proc_table.environ(pid)
    if environ.get("MS_ROLE") == "MS_SCHED":
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


# ---------------------------------------------------------------------------------------------- summary


def _summarise(procs: List[_Proc], folder: Optional[Path], missing: List[str]) -> Stacks:
    keys: Dict[str, Optional[Frame]] = {}
    where: Dict[str, List[str]] = {}
    waiting: Dict[str, bool] = {}
    for proc in sorted(procs, key=_order):
        main = main_thread(proc.threads)
        frames = main.frames if main is not None else []
        keys[proc.label] = frames[0] if frames else None
        where[proc.label] = [frame.short() for frame in frames[:INNERMOST]]
        waiting[proc.label] = any(part in frame.path for frame in frames for part in COLLECTIVES)
    subjects = {label: keys[label] for label in _subjects(where)}
    odd, usual, count = _odd_ones_out(subjects)
    if not odd:
        odd, usual, count = _not_waiting(subjects, waiting, (odd, usual, count))
    usual_text = (usual.short() if usual is not None else "no Python frame") if count else None
    return Stacks(folder, where, odd, usual_text, missing, count)


def _order(proc: _Proc) -> Tuple[int, int]:
    match = re.fullmatch(r"rank (\d+)", proc.label)
    return (0, int(match[1])) if match else (1, proc.pid)


def _odd_ones_out(keys: Mapping[str, Optional[Frame]]) -> Tuple[List[str], Optional[Frame], int]:
    """(the labels outside the strictly largest group, that group's frame, its size); no odd ones and a size
    of 0 where no group is strictly the largest."""
    groups = collections.Counter(keys.values()).most_common()
    if not groups:
        return [], None, 0
    if len(groups) > 1 and groups[0][1] == groups[1][1]:
        return [], None, 0
    usual, count = groups[0]
    return [label for label, key in keys.items() if key != usual], usual, count


def _not_waiting(keys: Mapping[str, Optional[Frame]], waiting: Mapping[str, bool], otherwise):
    """Where the places tie (two ranks, two places), the ranks outside any collective are the odd ones out while
    the others wait in one: the ranks waiting, not where most of them are, tell who is stuck."""
    inside = [label for label in keys if waiting[label]]
    outside = [label for label in keys if not waiting[label]]
    if not inside or not outside or not all(_is_rank(label) for label in keys):
        return otherwise
    places = collections.Counter(keys[label] for label in inside).most_common()
    if len(places) > 1 and places[0][1] == places[1][1]:
        return otherwise
    return outside, places[0][0], len(inside)


def _log_summary(stacks: Stacks, procs: List[_Proc], log) -> None:
    for proc in sorted(procs, key=_order):
        if proc.label in stacks.where:
            log.warning("stack of a hung process", process=proc.label, pid=proc.pid,
                        at=" <- ".join(stacks.where[proc.label]) or "no Python frame", threads=len(proc.threads))
    if stacks.odd:
        log.warning("odd ones out: not where the others are", odd=", ".join(stacks.odd),
                    at="; ".join(f"{label}: {_innermost(stacks.where[label])}" for label in stacks.odd),
                    others=stacks.usual, count=stacks.usual_count)
