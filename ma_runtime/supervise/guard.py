"""The guard: kills the workers if the runtime itself is SIGKILLed.

PR_SET_PDEATHSIG reaches only the runtime's direct child; a grandchild (the
python under `sh -c`, torchrun's workers, msrun's setsid'd ranks) would live on,
re-parented to init. So, when the runtime is not PID 1 (as PID 1, the kernel
kills the whole namespace with it), it forks this small process before any
worker. The guard holds the read end of a pipe whose only write end is the
runtime's: EOF without the stand-down byte means the runtime died, and the
guard kills every process that carries the run's id in its MA_RUNTIME_LINEAGE variable
(Jenkins' ProcessTreeKiller does the same with BUILD_ID), which every worker
descendant inherits.
"""

import os
import signal
import time
from typing import Iterator, Optional

from ma_runtime.supervise.pid1 import set_process_name

# Comma-separated run ids of every ma-runtime above a process: a nested ma-run
# adds its own, so the outer guard still finds the inner run's workers.
LINEAGE_ENV = "MA_RUNTIME_LINEAGE"
_STAND_DOWN = b"done"
_SWEEP_ROUNDS = 20


class Guard:
    def __init__(self, pid: int, write_fd: int):
        self.pid = pid
        self._write_fd: Optional[int] = write_fd

    def stand_down(self) -> None:
        """Normal exit: the runtime has already stopped its workers itself."""
        if self._write_fd is None:
            return
        try:
            os.write(self._write_fd, _STAND_DOWN)
        finally:
            os.close(self._write_fd)
            self._write_fd = None


def start(run_id: str) -> Guard:
    """Forks the guard; call before any thread or worker exists."""
    read_fd, write_fd = os.pipe()  # both close-on-exec: workers never hold them
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the forked guard, checked by e2e tests
        os.close(write_fd)
        _guard_main(read_fd, run_id)
    os.close(read_fd)
    return Guard(pid, write_fd)


def _guard_main(read_fd: int, run_id: str) -> None:  # pragma: no cover - see start()
    status = 0
    try:
        _detach()
        received = b""
        while True:
            data = os.read(read_fd, 64)
            if not data:
                break
            received += data
        if received != _STAND_DOWN:
            sweep(run_id)
    except BaseException:
        status = 1
    finally:
        os._exit(status)


def _detach() -> None:
    set_process_name("ma-runtime-grd")
    # Out of the terminal's process group, deaf to the signals meant for the job.
    os.setpgid(0, 0)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)


def sweep(run_id: str) -> int:
    """SIGKILLs every process carrying the run_id until none is left; returns how many."""
    killed = 0
    for _ in range(_SWEEP_ROUNDS):
        pids = list(carriers(run_id))
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.01)  # let the killed ones go before looking again
    return killed


def lineage(environ, run_id: str) -> str:
    """The MA_RUNTIME_LINEAGE value for this run's workers."""
    inherited = environ.get(LINEAGE_ENV, "")
    return f"{inherited},{run_id}" if inherited else run_id


def carriers(run_id: str) -> Iterator[int]:
    """Pids (other than our own) whose MA_RUNTIME_LINEAGE names `run_id`."""
    prefix = f"{LINEAGE_ENV}=".encode()
    wanted = run_id.encode()
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        for variable in environ.split(b"\0"):
            if variable.startswith(prefix) and wanted in variable[len(prefix) :].split(b","):
                yield int(entry)
                break
