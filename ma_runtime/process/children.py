"""Children the runtime starts and waits for itself, so that the reaping loop leaves their status alone.

The supervisor reaps with `waitpid(-1)` (supervise/pid1.reap): it has to, for the orphans that come to a
subreaper or PID 1. A tool the runtime runs meanwhile (`npu-smi` between attempts, later hooks and
uploaders) is waited for by its own `Popen`; if the loop reaped it first, `Popen` would see ECHILD and
report the tool's status as 0. So such a child is started through `start`, under the lock the reaping loop
also holds, and its pid stays in `_OWNED` until its owner has waited for it: the loop never takes a pid
it finds there.
"""

import contextlib
import errno
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Set, TypeVar

import ma_runtime
from ma_runtime.errors import TooLargeForExec

LOCK = threading.Lock()
_OWNED: Set[int] = set()
# Long-lived helpers of the runtime (the uploader): children of ours, but never the command's processes.
_HELPERS: Set[int] = set()
# What the pre-start hook left running (an sshd): the job's services, never the command's processes, and, unlike
# a helper, not waited for by anyone of ours: the reaping loop may reap them.
_SERVICES: Set[int] = set()
# Those of the services that stop themselves gracefully (Ray's node, which stops Ray's processes in its order): at
# the run's end each gets SIGTERM, to its own process alone, before the sweep. {pid: its Worker or Popen}.
_GRACEFUL: Dict[int, Any] = {}
T = TypeVar("T")


@contextlib.contextmanager
def owned(start: Callable[[], T]) -> Iterator[T]:
    """`with owned(lambda: Popen(...)) as proc:` the reaping loop leaves `proc` to us until the block ends.

    Started under the lock: a child that exits at once is still registered before the loop can look."""
    with LOCK:
        proc = start()
        _OWNED.add(proc.pid)
    try:
        yield proc
    finally:
        with LOCK:
            _OWNED.discard(proc.pid)


def is_owned(pid: int) -> bool:
    """Call with LOCK held."""
    return pid in _OWNED


def start_helper(start: Callable[[], T]) -> T:
    """A child that lives beside the command (the uploader): owned, as above, until `end_helper`, and left out
    of the command's tree (`NotTheCommand`), so no stop, sweep or guard ever signals it."""
    with LOCK:
        proc = start()
        _OWNED.add(proc.pid)
        _HELPERS.add(proc.pid)
    return proc


# Run by `python -I -c`: argv is [-c, <the folder holding ma_runtime>, --channel, <fd>]. That folder goes first
# unless the isolated path has it already (a wheel's site-packages must not move ahead of the standard library).
_BOOT = ("import os, sys; home = sys.argv.pop(1); "
         "sys.path[:0] = [] if os.path.realpath(home) in map(os.path.realpath, sys.path) else [home]; "
         "from {module} import main; sys.exit(main(sys.argv[1:]))")
_HOME = os.path.dirname(os.path.dirname(os.path.abspath(ma_runtime.__file__)))


def start_module(module: str, channel: int) -> subprocess.Popen:
    """A helper (`start_helper`) that runs `module.main(["--channel", str(channel)])` on the runtime's own Python,
    isolated (`-I`: nothing of the job's environment loads into it), in a session of its own, with the one
    descriptor `channel` (its end of a socket pair). An exec refused for size is TooLargeForExec (the sizes)."""
    argv = [sys.executable, "-I", "-c", _BOOT.format(module=module), _HOME, "--channel", str(channel)]
    try:
        return start_helper(lambda: subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=(channel,),
                                                     close_fds=True, start_new_session=True))
    except OSError as exc:
        if exc.errno == errno.E2BIG:  # the caller's warning gives the sizes, not "Argument list too long"
            raise TooLargeForExec(argv, os.environ) from None
        raise


def end_helper(pid: int) -> None:
    """After its owner has waited for it."""
    with LOCK:
        _OWNED.discard(pid)
        _HELPERS.discard(pid)


def start_service(start: Callable[[], T], graceful: bool = False) -> T:
    """A child the runtime starts as the job's service (mpirun's sshd): registered before the reaping loop can
    look, never the command's (no stop, sweep or hang check of an attempt touches it), alive across attempts,
    and swept with everything else when the run ends; `graceful`: first given the grace of `stop_services`."""
    with LOCK:
        proc = start()
        _SERVICES.add(proc.pid)
        if graceful:
            _GRACEFUL[proc.pid] = proc
    return proc


def stop_services(grace: float) -> None:
    """The run's end, before its sweep: each graceful service gets SIGTERM, its own process alone (it stops its
    children itself, so each hears one signal), then up to `grace` seconds in all to end."""
    import signal
    import time

    from ma_runtime.process import lifecycle

    with LOCK:
        graceful = list(_GRACEFUL.values())
        _GRACEFUL.clear()
    for proc in graceful:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for proc in graceful:
        lifecycle.wait(getattr(proc, "popen", proc), max(0.0, deadline - time.monotonic()))


def services() -> List[int]:
    """The job's services now (an sshd): in their trees, the hang monitor finds the ranks an MPI daemon started."""
    with LOCK:
        return sorted(_SERVICES)


def adopt_services(exclude: Iterable[int] = ()) -> List[int]:
    """Every descendant of ours now (but `exclude`, helpers and owned tools) becomes a service: called when the
    pre-start hook has exited and before any command runs, so what is left is what the hook started."""
    from ma_runtime.process.table import descendants

    found = descendants(os.getpid(), NotTheCommand(exclude))
    with LOCK:
        _SERVICES.update(found)
    return found


class NotTheCommand:
    """The `exclude` of a process-tree walk: the given pids (the guard), every helper, including one started
    after the walk's owner was built (a restarted uploader), and every tool the runtime runs and waits for
    itself (the hang monitor's nvidia-smi, py-spy): none is the command's, none may be stopped as if it were,
    and a tool coming and going is no activity of the command's. The pre-start hook's services neither, unless
    `services` (the run's end: they are stopped with everything else)."""

    def __init__(self, pids: Iterable[int] = (), services: bool = False):
        self.pids = frozenset(pids)
        self.services = services

    def __contains__(self, pid: object) -> bool:
        return (pid in self.pids or pid in _HELPERS or pid in _OWNED
                or (not self.services and pid in _SERVICES))


def wait_started(service: Any, ready: Callable[[], bool], seconds: float, too_late: str,
                 stopped: threading.Event, poll: float = 0.25) -> str:
    """'' once `ready()` says a service just started (a spawned Worker: mpirun's sshd, Ray's keeper) is up, or once
    the run stops (its caller has seen the signal); else why not: the service's last line of output, or its exit
    code, when it ended first; `too_late` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not stopped.is_set():
        code = service.popen.poll()
        if code is not None:
            service.join_output(1.0)
            return last_line(service) or f"it exited with code {code}"
        if ready():
            return ""
        if time.monotonic() >= deadline:
            return too_late
        stopped.wait(poll)
    return ""


def last_line(service: Any) -> str:
    """The last non-blank line a spawned Worker wrote (its stderr first): what a tool says when it fails to start."""
    from ma_runtime.util.output import tail_of

    lines = [line.strip() for line in tail_of(service.pumps, 5, prefer=service.stderr_pump) if line.strip()]
    return lines[-1] if lines else ""
