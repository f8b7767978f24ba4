"""The process layer: wait for a child, stop it with a grace period, read its status as an exit code, run a
short-lived tool. Every part of the runtime that ends a process of its own goes through here: the hooks (their
timeout), the uploader and the progress matcher (their close), the peers watcher's command, mpirun's sshd, the
supervisor (its signals, its sweeps, its exit codes) and every accelerator tool (`run_tool`).

Starting is children.py's (which child is whose, so that the reaping loop leaves a status to its owner) and
worker.py's spawn (a command with its output pumped to sinks); what the table of processes holds is
process/table.py's.

A status here is Popen's: the exit status, or -N for death by signal N. `exit_code` turns it into what a shell
reports (128+N): the one place that does.
"""

import errno
import os
import select
import signal
import subprocess
import time
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

from ma_runtime.errors import too_large_for_exec
from ma_runtime.process import children
from ma_runtime.process.table import Proc

# States of a process that cannot run: stopped by a signal, or by a tracer.
_STOPPED = ("T", "t")
_FREEZE_PAUSE = 0.002
_SWEEP_PAUSE = 0.01


def exit_code(returncode: int) -> int:
    """Popen-style status (negative = killed by signal N) to a shell exit code (128+N)."""
    return 128 - returncode if returncode < 0 else returncode


def signal_group(pgid: int, signum: int) -> None:
    """`signum` to the process group `pgid`; one that is gone (or not ours) is no error."""
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def kill_all(pids: Iterable[int], signum: int) -> None:
    """`signum` to each pid; one that is gone (or not ours) is skipped."""
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def wait(popen: subprocess.Popen, seconds: Optional[float]) -> Optional[int]:
    """Its status, or None after `seconds` (None: no limit). Blocks on a pidfd: Popen.wait(timeout) looks with
    sleeps of up to 50 ms between, which every end would wait out (a 30 ms hook took 67 ms)."""
    if seconds is None or popen.returncode is not None:
        return popen.wait()
    try:
        pidfd = os.pidfd_open(popen.pid)
    except (AttributeError, OSError):  # Linux before 5.3 (Python 3.9 has the call), or no such process any more
        try:
            return popen.wait(seconds)
        except subprocess.TimeoutExpired:
            return None
    try:
        # Readable once the process has exited (PEP 475: EINTR retried with the time left).
        ready, _, _ = select.select([pidfd], [], [], max(0.0, seconds))
    finally:
        os.close(pidfd)
    return popen.wait() if ready else None


def wait_or_kill(popen: subprocess.Popen, seconds: float, group: bool = False) -> int:
    """Its status once it has ended by itself within `seconds`, else after a SIGKILL (to its group: `group`)."""
    code = wait(popen, seconds)
    if code is None:
        _send(popen, signal.SIGKILL, group)
        code = popen.wait()
    return code


def stop(popen: subprocess.Popen, grace: float, group: bool = False) -> int:
    """SIGTERM (to its process group: `group`, for a child started in a session of its own), up to `grace`
    seconds for it to end, then SIGKILL; its status. One that has ended already is not signalled."""
    if popen.poll() is not None:
        return popen.returncode
    _send(popen, signal.SIGTERM, group)
    return wait_or_kill(popen, grace, group)


def _send(popen: subprocess.Popen, signum: int, group: bool) -> None:
    if group:
        signal_group(popen.pid, signum)  # setsid made it the leader of its own group
    elif popen.returncode is None:  # Popen's own send_signal: never a pid it has reaped (and that may be reused)
        popen.send_signal(signum)


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


class ToolError(Exception):
    """An external tool (nvidia-smi, npu-smi, py-spy) that is missing, hangs, or fails."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code  # "missing", "timeout" or "failed"
        self.message = message


def run_tool(argv: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None) -> Tuple[int, str, str]:
    """(returncode, stdout, stderr) of a short-lived tool; its whole group is killed after `timeout` s."""
    def start() -> subprocess.Popen:
        return subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace", env=env,
            start_new_session=True,
        )

    try:
        # Owned: the supervisor's reaping loop, if it runs meanwhile, must not take the tool's status.
        with children.owned(start) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                # The group, not just the tool: a helper it forked would hold the pipes open.
                signal_group(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise ToolError("timeout", f"{argv[0]} did not answer within {timeout:g} s") from None
    except FileNotFoundError:
        raise ToolError("missing", f"{argv[0]} not found on PATH") from None
    except OSError as exc:
        why = too_large_for_exec(argv, os.environ if env is None else env) if exc.errno == errno.E2BIG else exc.strerror
        raise ToolError("failed", f"{argv[0]} could not run: {why}") from None
    return proc.returncode, out, err
