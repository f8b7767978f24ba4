"""Which processes of an attempt run the training code (its ranks), and which are launcher machinery.

The hang monitor judges activity on the ranks alone, and the stacks of a hung attempt are the ranks': a launcher
keeps working while its ranks are stuck (torch elastic's agent reads and writes every few seconds as it polls its
ranks and its store; msrun's scheduler logs the cluster's state every 5 s), and counting it hid every hang under
torchrun.

Machinery is recognised wherever it is in a worker's tree, since a plain `bash run.sh` may start torchrun itself:
- each launcher's, by the words its `MACHINERY` declares (launch/base.py `Machinery`, read through the registry):
  torch elastic's agent (`torchrun`, `python -m torch.distributed.run` or `.launch`, or the name torch gives its
  main thread, `pt_elastic`); msrun and the scheduler it starts, which runs the user's script with MS_ROLE=MS_SCHED
  in its environment; MPI's launchers and daemons by name (mpirun, mpiexec, orted, prted, Hydra's proxies), and
  the ssh or rsh they start to reach the other nodes;
- the runtime's own programs: a nested ma-run or ma-runtime with its guard and uploader, and the peers watcher
  (`python -m ma_runtime.launch.peers`: TensorFlow's ps watcher, mpirun's watcher on the nodes but worker-0).
The runtime's helpers (the guard, the uploader, the tools it runs) and its services (sshd, the key server) are not
in the command's tree at all (children.NotTheCommand). In a service's tree the job is what an MPI daemon started:
on the nodes mpirun reaches through ssh, the ranks are orted's children under the runtime's sshd.

A *rank* is a topmost process of the job: not machinery, with no job process above it in its tree. Its *unit* is
itself and the job processes below it (data-loader and compile workers, what its shell runs). Its label is
`rank N` where its environment names one, else `pid P (name)`.

What a process is follows from its name and command line, which an exec changes: the verdict is kept per pid,
start time and name, so each process's /proc/<pid>/cmdline is read once, not once per look.
"""

import functools
import os
import re
from typing import Dict, FrozenSet, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ma_runtime.launch import registry
from ma_runtime.launch.base import RANK_VARIABLES, Helper
from ma_runtime.process.table import Proc, cmdline, environ
from ma_runtime.supervise.guard import NAME as GUARD_NAME

# The runtime's own programs (no launcher's): a nested runtime, and the peers watcher.
_OWN_SCRIPTS = {"ma-run": "ma-runtime", "ma-runtime": "ma-runtime"}
_OWN_MODULES = {"ma_runtime": "ma-runtime", "ma_runtime.launch.peers": "the runtime's peers watcher"}
# Python's options that take the next word as their value.
_OPTIONS_WITH_VALUE = frozenset({"-X", "-W", "--check-hash-based-pycs"})
_PYTHON = re.compile(r"python[0-9.]*\Z")

_Key = Tuple[int, int, str]  # pid, start time, name


class _Words(NamedTuple):
    """Every launcher's machinery words (launch/base.py `Machinery`), and the runtime's own, by what they match;
    each maps a word to the label of what it finds."""

    scripts: Mapping[str, str]  # program file name -> label
    modules: Mapping[str, str]  # `python -m` module -> label
    processes: FrozenSet[str]  # process names (comm), each its own label
    daemons: FrozenSet[str]  # below these, the job, even in a service's tree
    remote_shells: Mapping[str, FrozenSet[str]]  # a starter's label -> the remote shells it starts
    helpers: Mapping[str, Helper]  # a launcher's label -> how its helper that runs the user's script is told


@functools.cache
def _words() -> _Words:
    """Read once, when first needed: the registry imports every launcher module for it."""
    scripts, modules, helpers = dict(_OWN_SCRIPTS), dict(_OWN_MODULES), {}
    processes, daemons, remote_shells = set(), set(), {}
    for launcher in registry.launchers():
        machinery = launcher.MACHINERY
        scripts.update(dict.fromkeys(machinery.scripts, launcher.NAME))
        modules.update(dict.fromkeys(machinery.modules, launcher.NAME))
        processes |= machinery.processes
        daemons |= machinery.daemons
        remote_shells.update(dict.fromkeys(machinery.processes, machinery.remote_shells))
        if machinery.helper is not None:
            helpers[launcher.NAME] = machinery.helper
    return _Words(scripts, modules, frozenset(processes), frozenset(daemons), remote_shells, helpers)


class Unit(NamedTuple):
    root: int  # the rank's pid
    worker: str  # the worker whose tree it is in ("torchrun", "rank-3", "command"), or "services"
    label: str  # "rank 1", or "pid 812 (python)"


class Finder:
    """The job's processes of an attempt, looked up again at each look; what it learnt of a process is kept."""

    def __init__(self, read_cmdline=None, read_environ=None):
        self._cmdline = read_cmdline or cmdline
        self._environ = read_environ or environ
        self._machinery: Dict[_Key, Optional[str]] = {}
        self._labels: Dict[_Key, Optional[str]] = {}

    def find(self, workers: Mapping[str, int], services: Iterable[int], table: Mapping[int, Proc],
             exclude=frozenset()) -> Dict[int, Unit]:
        """{pid: its rank's unit} for every job process under `workers` ({name: leader pid}) and, started by an MPI
        daemon, under `services`; `exclude`d pids (and theirs) are never looked at."""
        children = _children(table, exclude)
        found: Dict[int, Unit] = {}
        for name, leader in workers.items():
            if leader in table and leader not in exclude:
                self._walk(leader, name, children, table, found, job_here=True)
        for service in services:
            if service in table and service not in exclude:
                self._walk(service, "services", children, table, found, job_here=False)
        self._forget(table)
        return found

    def machinery(self, pid: int, table: Mapping[int, Proc]) -> Optional[str]:
        """What launcher machinery `pid` is ("torchrun", "msrun's scheduler", "orted", ...), or None."""
        proc = table.get(pid)
        if proc is None:
            return None
        key = (pid, proc.start, proc.comm)
        if key not in self._machinery:
            self._machinery[key] = self._recognise(pid, proc, table)
        return self._machinery[key]

    def label(self, pid: int, worker: str, table: Mapping[int, Proc]) -> str:
        proc = table.get(pid)
        key = (pid, proc.start if proc else 0, proc.comm if proc else "")
        if key not in self._labels:
            self._labels[key] = rank_of(self._environ(pid), worker)
        rank = self._labels[key]
        return f"rank {rank}" if rank is not None else f"pid {pid} ({(proc.comm if proc else '') or '?'})"

    # ------------------------------------------------------------------------------------------ the walk

    def _walk(self, top: int, worker: str, children, table, found, job_here: bool) -> None:
        """Adds the job processes of `top`'s tree to `found`. A launcher and every process with one below it (the
        shell that runs torchrun) is no rank; below a launcher, each topmost other process is one."""
        order: List[Tuple[int, Optional[int], bool]] = []  # (pid, parent, whether the job can be there), parents first
        todo: List[Tuple[int, Optional[int], bool]] = [(top, None, job_here)]
        while todo:
            pid, parent, here = todo.pop()
            order.append((pid, parent, here))
            # Below an MPI daemon is the job, even in a service's tree (sshd's); elsewhere, as above.
            below = here or self.machinery(pid, table) in _words().daemons
            todo.extend((child, pid, below) for child in children.get(pid, ()))
        launching = set()
        for pid, parent, _ in reversed(order):
            if pid in launching or self.machinery(pid, table) is not None:
                launching.add(pid)
                if parent is not None:
                    launching.add(parent)
        units: Dict[int, Unit] = {}
        for pid, parent, here in order:
            if pid in launching or not here:
                continue
            unit = units.get(parent) if parent is not None else None
            units[pid] = found[pid] = unit or Unit(pid, worker, self.label(pid, worker, table))

    def _recognise(self, pid: int, proc: Proc, table: Mapping[int, Proc]) -> Optional[str]:
        words = _words()
        if proc.comm in words.processes:
            return proc.comm
        if proc.comm == GUARD_NAME:
            return "ma-runtime"
        parent = self.machinery(proc.ppid, table) if proc.ppid in table else None
        if proc.comm in words.remote_shells.get(parent, ()):
            return f"{proc.comm} started by {parent}"
        what = program(self._cmdline(pid))
        if what is not None:
            return what
        helper = words.helpers.get(parent)
        if helper is not None and self._environ(pid).get(helper.variable) == helper.value:
            return helper.label
        return None

    def _forget(self, table: Mapping[int, Proc]) -> None:
        """What is known of processes that are gone, so that the cache does not grow with the pids a job used."""
        for cache in (self._machinery, self._labels):
            for key in [key for key in cache if key[0] not in table or table[key[0]].start != key[1]]:
                del cache[key]


def _children(table: Mapping[int, Proc], exclude) -> Dict[int, List[int]]:
    children: Dict[int, List[int]] = {}
    for pid, proc in table.items():
        if pid not in exclude:
            children.setdefault(proc.ppid, []).append(pid)
    return children


def program(argv: Sequence[str]) -> Optional[str]:
    """The launcher a command line runs ("torchrun", "msrun", "ma-runtime", ...), or None for anything else."""
    if not argv:
        return None
    name, known = os.path.basename(argv[0]), _words()
    if not _PYTHON.match(name):
        return known.scripts.get(name)
    words = iter(argv[1:])
    for word in words:
        if word == "-m":
            return known.modules.get(next(words, ""))
        if word in _OPTIONS_WITH_VALUE:
            next(words, None)
        elif word == "-c":  # the runtime's uploader runs as `python -I -c <its boot code>`
            return "ma-runtime" if "from ma_runtime." in next(words, "") else None
        elif word == "-":
            return None
        elif not word.startswith("-"):
            return known.scripts.get(os.path.basename(word))
    return None


def rank_of(variables: Mapping[str, str], worker: str) -> Optional[int]:
    """The rank a process's environment names, asked in the order of the launcher whose plan names `worker`
    (launch/base.py `Launcher.RANK_VARIABLES`), or None."""
    for name in _rank_variables(worker):
        value = variables.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


@functools.lru_cache(maxsize=64)
def _rank_variables(worker: str) -> Tuple[str, ...]:
    """The first launcher's whose plans name a worker so; launchers that share a worker name ("command") ask in
    the same order."""
    for launcher in registry.launchers():
        if launcher.WORKERS.match(worker):
            return launcher.RANK_VARIABLES
    return RANK_VARIABLES


def is_helper(variables: Mapping[str, str]) -> bool:
    """Whether a process's environment marks a launcher's helper that runs the user's script too (msrun's
    scheduler, which gets RANK_ID=0), which is no rank."""
    return any(variables.get(variable) == value for variable, value, _ in _words().helpers.values())
