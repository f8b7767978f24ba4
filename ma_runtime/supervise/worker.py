"""A worker: one command started in its own session, its output pumped to sinks."""

import errno
import os
import signal
import subprocess
import time
from typing import Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence

from ma_runtime.errors import TOO_LARGE_HINT, CommandNotExecutable, CommandNotFound, too_large_for_exec
from ma_runtime.output import LinePump, Sink, SinkSpec

# States of a process that cannot run: stopped by a signal, or by a tracer.
_STOPPED = ("T", "t")
_FREEZE_PAUSE = 0.002
_SWEEP_PAUSE = 0.01


class Worker:
    def __init__(self, popen: subprocess.Popen, pumps: List[LinePump], name: str, pipe_inodes: Sequence[int] = ()):
        self.popen = popen
        self.pid = popen.pid
        self.pumps = pumps
        self.name = name
        # Its stdout and stderr pipes: every descendant that did not redirect its
        # output holds their write ends, which is how the guard knows it.
        self.pipe_inodes = tuple(pipe_inodes)
        self.returncode: Optional[int] = None

    def exited(self, returncode: int) -> None:
        self.returncode = returncode
        # Tell Popen too, so that it never calls waitpid on a pid we reaped.
        self.popen.returncode = returncode

    def signal_group(self, signum: int) -> None:
        # setsid made the worker the leader of its own process group.
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def join_output(self, timeout: float) -> None:
        for pump in self.pumps:
            pump.join(timeout)

    @property
    def stderr_pump(self) -> LinePump:
        return self.pumps[1]


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: Optional[str],
    stdout_sinks: Sequence[Sink],
    stderr_sinks: Sequence[Sink],
    name: str = "worker",
    *,
    console_prefix: Optional[bytes] = None,
    pass_fds: Sequence[int] = (),
) -> Worker:
    """Starts `argv` as the leader of a new session; raises CommandNotFound/NotExecutable (E2BIG too: the sizes).

    With `console_prefix` (e.g. b"[rank 3] "), every line sent to a console sink
    (`Sink.console`) starts with it; the other sinks (a log file) get raw lines.
    `pass_fds` stay open in the command (the guard's mark, `Guard.pass_fds`).
    """
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pipe_inodes = (os.fstat(out_r).st_ino, os.fstat(err_r).st_ino)
    env = dict(env)
    try:
        popen = subprocess.Popen(
            list(argv),
            env=env,
            cwd=cwd,
            stdout=out_w,
            stderr=err_w,
            # A session of its own: one killpg reaches the whole job, and a
            # worker reading the terminal is not stopped by job control.
            start_new_session=True,
            # No preexec_fn (it was PR_SET_PDEATHSIG): without one Python spawns with vfork, 0.3 ms
            # instead of 4 ms per worker. A SIGKILLed runtime's workers are the guard's to kill (as
            # PID 1, the kernel's): it covers the whole tree, where PDEATHSIG reached this child only.
            pass_fds=tuple(pass_fds),
        )
    except OSError as exc:
        for fd in (out_r, err_r):
            os.close(fd)
        raise _exec_failure(argv, cwd, exc, env) from None
    finally:
        os.close(out_w)
        os.close(err_w)
    pumps = [
        LinePump(out_r, _with_prefix(stdout_sinks, console_prefix), f"{name}-stdout"),
        LinePump(err_r, _with_prefix(stderr_sinks, console_prefix), f"{name}-stderr"),
    ]
    for pump in pumps:
        pump.start()
    return Worker(popen, pumps, name, pipe_inodes)


def _with_prefix(sinks: Sequence[Sink], prefix: Optional[bytes]) -> List[SinkSpec]:
    # Without a prefix the pump gets plain sinks: its whole-chunk fast path.
    if not prefix:
        return list(sinks)
    return [(sink, prefix) if sink.console else sink for sink in sinks]


def _exec_failure(argv: Sequence[str], cwd: Optional[str], exc: OSError, env: Mapping[str, str]):
    program = argv[0]
    if exc.errno == errno.E2BIG:  # one line with the sizes: "Argument list too long" names neither
        return CommandNotExecutable(f"cannot execute {program}: {too_large_for_exec(argv, env)}", hint=TOO_LARGE_HINT)
    if exc.errno == errno.ENOENT and cwd and exc.filename == cwd:
        return CommandNotFound(f"working directory {cwd} does not exist", hint="create it or start elsewhere")
    if exc.errno == errno.ENOENT:
        return CommandNotFound(
            f"command not found: {program}",
            hint="check the spelling, PATH, or give the program's full path",
        )
    return CommandNotExecutable(
        f"cannot execute {program}: {os.strerror(exc.errno or errno.EACCES)}",
        hint="make it executable (chmod +x) or run it through its interpreter, e.g. `bash script.sh`",
    )


class Proc(NamedTuple):
    """One line of the process table."""

    state: str  # R, S, D, T, ... (zombies never appear)
    ppid: int
    pgid: int  # its process group: who a killpg reaches
    start: int  # clock ticks after boot: with the pid, names one process for good (pids are reused)
    comm: str = ""  # its name (/proc/<pid>/comm): what an exec or a thread-name change makes of it


def processes() -> Dict[int, Proc]:
    """Every living (non-zombie) process, read from /proc.

    A scan of /proc/*/stat costs a millisecond or two, less than importing
    psutil (~30 ms), and this runs at every exit and once a second meanwhile.
    """
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


def kill_all(pids: Iterable[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def sweep(members: Callable[[], Dict[int, Proc]], seconds: float,
          between: Callable[[], object] = lambda: None) -> Dict[int, Proc]:
    """Stops every member, then SIGKILLs them all, again until none is left or `seconds` pass.

    SIGKILL sent to a snapshot misses what the members fork meanwhile, and a
    tree that forks faster than it is killed outlives any number of passes. A
    stopped process cannot fork, so the tree is frozen first (SIGSTOP, and scan
    again until every member is stopped and none is new), then killed at once.
    `between` runs after each pass (the supervisor reaps there). Returns the
    members still there at the deadline: processes in uninterruptible sleep (a
    hung device or NFS mount) that even SIGKILL cannot end yet.
    """
    deadline = time.monotonic() + seconds
    while True:
        found = _freeze(members, deadline)
        if not found:
            return found
        kill_all(found, signal.SIGKILL)
        between()
        if time.monotonic() >= deadline:
            return members()
        time.sleep(_SWEEP_PAUSE)  # the killed leave the table; a pass over them again would be wasted


def _freeze(members: Callable[[], Dict[int, Proc]], deadline: float) -> Dict[int, Proc]:
    """The members, once none of them can fork any more (or at the deadline)."""
    found: Dict[int, Proc] = {}
    while True:
        previous, found = found, members()
        # A process becomes T only after it has finished a fork under way; one
        # in D (uninterruptible) that was sent SIGSTOP a scan ago stops as soon
        # as it leaves D, and what it forked on the way is caught by the next pass.
        running = [pid for pid, proc in found.items()
                   if proc.state not in _STOPPED and not (proc.state == "D" and pid in previous)]
        if (not running and found.keys() <= previous.keys()) or time.monotonic() >= deadline:
            return found
        kill_all(running, signal.SIGSTOP)
        time.sleep(_FREEZE_PAUSE)  # let them reach the stop before looking again


SIGNAL_NAMES = {int(s): s.name for s in signal.Signals}
