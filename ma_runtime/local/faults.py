"""`--inject FAULT` of `ma-runtime local`: what each fault means, how it is read, and how it is done to a node.

    kill@NODE[:rank=R][:after=T]          SIGKILL to rank R's process on node NODE (a rank that crashed)
    hang@NODE[:rank=R][:after=T]          SIGSTOP to it (a rank stuck: the hang detector's case)
    exit@NODE[:code=C][:rank=R][:after=T] the rank exits with code C (default 1), see `request_exit`
    netdrop@NODE[:after=T]                the node's eth0 down (a node cut off: its peers and the store lose it)
    preempt[:after=T]                     SIGTERM to every node's runtime, as the platform stops a job

R is the job's rank (RANK, RANK_ID, ...: node1's are 8-15 with 8 per node); without it, the node's first rank, so
`exit@1` hits node 1 under any launcher. T (`20s`, `1.5m`, `90`: seconds unless a unit s, m or h follows) defaults
to 0, counted from the start of the nodes' commands. A rank is a topmost job process of the node's runtime
(ma_runtime/supervise/ranks.py): the one whose environment names rank R, or, when no rank names itself (a plain
command), the only one, as rank 0 and as the node's first. Each fault happens once; one whose rank is not there
yet is tried again until it is, or the node has ended, or (`pick`) the node's ranks run and R is not among them.

`exit@` cannot make another process call exit: the node's Python processes import this package's sitecustomize
(ma_runtime/local/site, after the runtime's own, which chains to it), which waits for a file `<pid>.exit` in
MA_LOCAL_FAULTS_DIR (each node's own) and exits with the code it holds; `<pid>` as the process sees it
(`own_pid`: in a container, its namespace's). A rank that is not Python ignores it (the runner says so).
"""

import dataclasses
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Dict, Optional, Tuple

FAULTS_DIR_ENV = "MA_LOCAL_FAULTS_DIR"
SITE_DIR = Path(__file__).resolve().parent / "site"
# What each kind takes besides `after`, and whether it names a node.
_KEYS = {"kill": ("rank",), "hang": ("rank",), "exit": ("rank", "code"), "netdrop": (), "preempt": ()}
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_SYNTAX = ("kill@NODE[:rank=R][:after=T], hang@NODE[:rank=R][:after=T], exit@NODE[:code=C][:rank=R][:after=T], "
           "netdrop@NODE[:after=T] or preempt[:after=T]")


class BadFault(ValueError):
    """An --inject value that cannot be read: the message says what was wrong and the syntax."""


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str  # kill, hang, exit, netdrop, preempt
    node: Optional[int]  # None for preempt: every node
    after: float  # seconds from the start of the nodes' commands
    rank: Optional[int] = None  # None: the node's first rank
    code: int = 1

    def __str__(self) -> str:
        where = "every node" if self.node is None else f"node{self.node}"
        rank = "its first rank" if self.rank is None else f"rank {self.rank}"
        what = {"kill": f"SIGKILL to {rank}", "hang": f"SIGSTOP to {rank}",
                "exit": f"{rank} exits {self.code}", "netdrop": "eth0 down", "preempt": "SIGTERM"}
        return f"{self.kind} on {where} ({what[self.kind]}) at {self.after:g}s"


def parse(text: str, nodes: int) -> Fault:
    """One --inject value for a job of `nodes` nodes; BadFault says what is wrong."""
    head, *items = text.strip().split(":")
    kind, _, node_text = head.partition("@")
    if kind not in _KEYS:
        raise BadFault(f"--inject {text!r}: unknown fault {kind!r}; one of {_SYNTAX}")
    node = _node(text, kind, node_text, nodes, "@" in head)
    values: Dict[str, str] = {}
    for item in items:
        key, equals, value = item.partition("=")
        if not equals or key not in (*_KEYS[kind], "after"):
            allowed = ", ".join(f"{name}=" for name in (*_KEYS[kind], "after"))
            raise BadFault(f"--inject {text!r}: {item!r} is not a setting of {kind} (it takes {allowed})")
        values[key] = value
    return Fault(kind, node, _seconds(text, values.get("after", "0")),
                 rank=_integer(text, "rank", values["rank"], 0, 1 << 20) if "rank" in values else None,
                 code=_integer(text, "code", values.get("code", "1"), 1, 255))


def _node(text: str, kind: str, node_text: str, nodes: int, has_at: bool) -> Optional[int]:
    if kind == "preempt":
        if has_at:
            raise BadFault(f"--inject {text!r}: preempt stops every node; write preempt[:after=T], without @NODE")
        return None
    if not node_text.isdigit() or int(node_text) >= nodes:
        raise BadFault(f"--inject {text!r}: {kind} needs @NODE, a node index from 0 to {nodes - 1} "
                       f"(--nodes {nodes})")
    return int(node_text)


def _seconds(text: str, value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", value.strip())
    if not match:
        raise BadFault(f"--inject {text!r}: after={value!r} is not a duration (20s, 1.5m, 1h, or seconds)")
    return float(match.group(1)) * _UNITS.get(match.group(2) or "s", 1.0)


def _integer(text: str, key: str, value: str, low: int, high: int) -> int:
    if not value.isdigit() or not low <= int(value) <= high:
        raise BadFault(f"--inject {text!r}: {key}={value!r} must be a whole number from {low} to {high}")
    return int(value)


# --------------------------------------------------------------------------------------------- doing them


def job_ranks(runtime_pid: int) -> Dict[int, str]:
    """pid -> label ("rank 3", or "pid 812 (python)" for one that names no rank) of the topmost job processes
    under the runtime `runtime_pid`; empty while there are none (staging in, between attempts)."""
    from ma_runtime.process.table import processes
    from ma_runtime.supervise.ranks import Finder

    units = Finder().find({"command": runtime_pid}, (), processes())
    return {unit.root: unit.label for unit in units.values()}


class NotHere(LookupError):
    """The node's ranks run and the one asked for is not among them: the message names those it has."""


def pick(ranks: Dict[int, str], rank: Optional[int]) -> Optional[Tuple[int, str]]:
    """(pid, label) of rank `rank` (None: the lowest) among `ranks` (job_ranks), None while it is not there yet;
    NotHere when the node's ranks name themselves and `rank` is not one of them."""
    named = {int(label.split()[1]): pid for pid, label in ranks.items() if label.startswith("rank ")}
    if rank is None and named:
        return named[min(named)], f"rank {min(named)}"
    if rank is not None and rank in named:
        return named[rank], f"rank {rank}"
    if rank in (None, 0) and len(ranks) == 1 and not named:  # a plain command: its only process
        return next(iter(ranks.items()))
    if rank is not None and named:
        raise NotHere(f"rank {rank} is not on this node (its ranks: {', '.join(map(str, sorted(named)))})")
    return None


def own_pid(pid: int) -> int:
    """Process `pid`'s pid as it sees it (`os.getpid()` in its own pid namespace: a container's), which names its
    exit-fault file; the last of /proc/<pid>/status's NSpid (Linux 4.1+), `pid` itself where there is none."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return pid


def request_exit(faults_dir: Path, pid: int, code: int) -> None:
    """Asks process `pid` to exit with `code` (the sitecustomize in ma_runtime/local/site does it)."""
    partial = faults_dir / f".{pid}.exit"
    partial.write_text(str(code))
    os.replace(partial, faults_dir / f"{pid}.exit")  # whole or absent for the reader


def signal_process(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False
    return True


def link_down(namespace: str, interface: str) -> str:
    """The node's link down; '' when done, else what `ip` said."""
    done = subprocess.run(["ip", "-n", namespace, "link", "set", interface, "down"], capture_output=True, text=True)
    return "" if done.returncode == 0 else done.stderr.strip() or f"exit {done.returncode}"


SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}
