"""A worker: one command started in its own session, its output pumped to sinks.

The process layer's starter for every command the runtime runs with its output followed: the attempt's workers
(supervise/), the hooks' steps (stages/hooks) and mpirun's sshd (launch/sshd).
"""

import errno
import os
import signal
import subprocess
from typing import Any, List, Mapping, Optional, Sequence

from ma_runtime.errors import TOO_LARGE_HINT, CommandNotExecutable, CommandNotFound, too_large_for_exec
from ma_runtime.process import lifecycle
from ma_runtime.util.output import LinePump, Sink, SinkSpec, tail_of

# Comma-separated run ids of every ma-runtime above a process: a nested ma-run adds its own, so the outer guard
# (supervise/guard.py) still finds the inner run's workers. Here, below every starter, which passes it on.
LINEAGE_ENV = "MA_RUNTIME_LINEAGE"
# The lines of a worker's output that a verdict or a failed hook quotes.
TAIL_LINES = 20


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
        lifecycle.signal_group(self.pid, signum)

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


def tail(worker: Any, lines: int = TAIL_LINES) -> List[str]:
    """The last lines of a worker's output (a Worker, or anything with its pumps and stderr_pump): stderr first."""
    return tail_of(worker.pumps, lines, prefer=worker.stderr_pump)


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


SIGNAL_NAMES = {int(s): s.name for s in signal.Signals}
