"""A worker: one command started in its own session, its output pumped to sinks."""

import errno
import functools
import os
import signal
import subprocess
from typing import Dict, List, Mapping, Optional, Sequence

from ma_runtime.errors import CommandNotExecutable, CommandNotFound
from ma_runtime.output import LinePump, Sink, SinkSpec
from ma_runtime.supervise.pid1 import die_with_parent


class Worker:
    def __init__(self, popen: subprocess.Popen, pumps: List[LinePump], name: str):
        self.popen = popen
        self.pid = popen.pid
        self.pumps = pumps
        self.name = name
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
) -> Worker:
    """Starts `argv` as the leader of a new session; raises CommandNotFound/NotExecutable.

    With `console_prefix` (e.g. b"[rank 3] "), every line sent to a console sink
    (`Sink.console`) starts with it; the other sinks (a log file) get raw lines.
    """
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        popen = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdout=out_w,
            stderr=err_w,
            # A session of its own: one killpg reaches the whole job, and a
            # worker reading the terminal is not stopped by job control.
            start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )
    except OSError as exc:
        for fd in (out_r, err_r):
            os.close(fd)
        raise _exec_failure(argv, cwd, exc) from None
    finally:
        os.close(out_w)
        os.close(err_w)
    pumps = [
        LinePump(out_r, _with_prefix(stdout_sinks, console_prefix), f"{name}-stdout"),
        LinePump(err_r, _with_prefix(stderr_sinks, console_prefix), f"{name}-stderr"),
    ]
    for pump in pumps:
        pump.start()
    return Worker(popen, pumps, name)


def _with_prefix(sinks: Sequence[Sink], prefix: Optional[bytes]) -> List[SinkSpec]:
    # Without a prefix the pump gets plain sinks: its whole-chunk fast path.
    if not prefix:
        return list(sinks)
    return [(sink, prefix) if sink.console else sink for sink in sinks]


def _exec_failure(argv: Sequence[str], cwd: Optional[str], exc: OSError):
    program = argv[0]
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


def descendants(root: int, exclude: Sequence[int] = ()) -> List[int]:
    """Living (non-zombie) descendants of `root`, read from /proc.

    A scan of /proc/*/stat costs a millisecond or two, less than importing
    psutil (~30 ms), and this runs at every exit.
    """
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _stat(entry)
        if stat is None or stat[0] == "Z":
            continue
        children.setdefault(stat[1], []).append(int(entry))
    found: List[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in exclude:
                found.append(child)
                todo.append(child)
    return found


def _stat(pid: str):
    """(state, ppid) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm may contain spaces and parentheses: the fields start after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1])


def kill_all(pids: Sequence[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


SIGNAL_NAMES = {int(s): s.name for s in signal.Signals}
