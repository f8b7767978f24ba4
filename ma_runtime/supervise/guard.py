"""The guard: kills the run's processes if the runtime itself is SIGKILLed.

Nothing in the kernel ends a process tree when its parent is SIGKILLed
(PR_SET_PDEATHSIG reaches one direct child, and costs the vfork spawn): the
command, the python under `sh -c`, torchrun's workers and msrun's setsid'd ranks
would live on, re-parented to init. So, when the runtime is not PID 1 (as PID 1,
the kernel kills the whole namespace with it), it forks this small process
before any worker. The guard holds the read end of a pipe whose only write end is the
runtime's: EOF without the stand-down message means the runtime died, and the
guard kills the run's processes (the kill sweep of process/lifecycle.py: stop them all,
then SIGKILL, until none is left).

Once the runtime is dead its orphans belong to init, so the guard tells the
run's processes apart by marks, none of which alone is enough:

- the run id in MA_RUNTIME_LINEAGE, which every worker descendant inherits
  (Jenkins' ProcessTreeKiller uses BUILD_ID the same way); `env -i` drops it;
- descriptors a descendant inherits without knowing: the write ends of the
  workers' stdout and stderr pipes, and a mark of its own (the read end of a
  pipe nobody writes to, passed to every worker); /proc/<pid>/fd shows them as
  `pipe:[inode]`; a redirection drops the former, closing every descriptor both;
- the ancestry the supervisor records while the runtime lives: the runtime is a
  subreaper, so every process of the run is its descendant until it dies. The
  supervisor sends (pid, start time) of each new descendant about once a second;
  the start time keeps a reused pid from ever being taken for a recorded one;
- and, at the sweep, every descendant of a process found by the others.

The cgroup would be a mark nobody can drop, but containers mount cgroupfs
read-only, so the guard does without it.

The guard is forked, not started (no interpreter start on the start-up path),
and blocks in read() until the runtime writes or dies: it costs nothing while
it waits. It names itself `ma-guard`, command line included, so that
`pkill ma-run`, `pkill -f ma-run`, `pkill -f ma-runtime` and `killall ma-run`
spare it: killing the runtime by name is exactly when the guard is needed.
"""

import os
import signal
from typing import Dict, Iterable, Mapping, Optional, Tuple

from ma_runtime.process.lifecycle import sweep
from ma_runtime.process.table import Proc, environ, family, holds_pipe, processes
from ma_runtime.process.worker import LINEAGE_ENV
from ma_runtime.supervise.pid1 import set_command_line, set_process_name

NAME = "ma-guard"
_STAND_DOWN = b"done"
# Long enough for processes leaving uninterruptible sleep; the guard has nobody to report to after.
_SWEEP_SECONDS = 10.0
# Records the guard has not read yet (it was stopped, say): past this, new ones are dropped, not queued.
_PENDING_LIMIT = 1 << 20
_READ = 1 << 16


class Guard:
    """The runtime's end: records for the guard, the mark for the workers, the stand-down."""

    def __init__(self, pid: int, write_fd: int, mark_fd: int):
        self.pid = pid
        # For spawn(pass_fds=...): every worker holds the mark, and so do its descendants.
        self.pass_fds: Tuple[int, ...] = (mark_fd,)
        self._write_fd: Optional[int] = write_fd
        self._mark_fd = mark_fd
        self._known: Dict[int, int] = {}
        self._pending = bytearray()

    def watch_pipes(self, inodes: Iterable[int]) -> None:
        """The workers' output pipes: a process holding one is the run's."""
        self._send(b"".join(b"i%d\n" % inode for inode in inodes))

    def record(self, tree: Mapping[int, int]) -> None:
        """The runtime's descendants now, {pid: start time}; only the changes travel."""
        born = [(pid, start) for pid, start in tree.items() if self._known.get(pid) != start]
        gone = [pid for pid in self._known if pid not in tree]
        if not born and not gone:
            return
        self._known = dict(tree)
        self._send(b"".join(b"+%d %d\n" % record for record in born) + b"".join(b"-%d\n" % pid for pid in gone))

    def stand_down(self) -> None:
        """Normal exit: the runtime has already stopped its workers itself."""
        if self._write_fd is None:
            return
        self._send(_STAND_DOWN + b"\n")
        self._close()

    def _send(self, data: bytes) -> None:
        # Never blocks: the write end is non-blocking, and what the pipe cannot
        # take now waits here for the next call. A guard that is gone (EPIPE) ends it.
        if self._write_fd is None:
            return
        if len(self._pending) + len(data) <= _PENDING_LIMIT:
            self._pending += data
        try:
            while self._pending:
                del self._pending[: os.write(self._write_fd, self._pending)]
        except BlockingIOError:
            pass
        except OSError:
            self._close()

    def _close(self) -> None:
        if self._write_fd is not None:
            os.close(self._write_fd)
            os.close(self._mark_fd)
            self._write_fd = None


class Marks:
    """What tells the run's processes apart, as the guard knows it."""

    def __init__(self, run_id: str, inodes: Iterable[int] = ()):
        self.run_id = run_id
        self.inodes = set(inodes)  # pipes whose ends mark a process
        self.recorded: Dict[int, int] = {}  # pid -> start time, from the supervisor

    def take(self, message: bytes) -> None:
        """One line of the runtime's pipe."""
        kind, rest = message[:1], message[1:]
        try:
            if kind == b"+":
                pid, start = rest.split()
                self.recorded[int(pid)] = int(start)
            elif kind == b"-":
                self.recorded.pop(int(rest), None)
            elif kind == b"i":
                self.inodes.add(int(rest))
        except ValueError:
            pass  # one bad line costs its own record only


class Finder:
    """The run's processes now: those with a mark, and all their descendants."""

    def __init__(self, marks: Marks):
        self.marks = marks
        self._me = os.getpid()
        # (pid, start time) -> marked: a process gains no mark after it starts, so each is read once.
        self._verdicts: Dict[Tuple[int, int], bool] = {}

    def __call__(self) -> Dict[int, Proc]:
        table = processes()
        table.pop(self._me, None)
        marked = [pid for pid, proc in table.items() if self._marked(pid, proc)]
        found = marked + family(marked, (), table)
        for pid in found:
            # A member stays one: stopped, then orphaned by a parent killed meanwhile, it must not be
            # left stopped for good because init is its parent now.
            self._verdicts[(pid, table[pid].start)] = True
        return {pid: table[pid] for pid in found}

    def _marked(self, pid: int, proc: Proc) -> bool:
        key = (pid, proc.start)
        verdict = self._verdicts.get(key)
        if verdict is None:
            # Cheapest first: the record, then one file, then a link per descriptor.
            verdict = self._verdicts[key] = (
                self.marks.recorded.get(pid) == proc.start
                or carries_lineage(pid, self.marks.run_id)
                or holds_pipe(pid, self.marks.inodes)
            )
        return verdict


def start(run_id: str) -> Guard:
    """Forks the guard; call before any thread or worker exists."""
    read_fd, write_fd = os.pipe()  # both close-on-exec: workers never hold them
    mark_fd, mark_write_fd = os.pipe()
    os.close(mark_write_fd)  # a mark only: nothing is ever read from it
    marks = Marks(run_id, [os.fstat(mark_fd).st_ino])
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the forked guard, checked by e2e tests
        os.close(write_fd)
        os.close(mark_fd)
        _guard_main(read_fd, marks)
    os.close(read_fd)
    os.set_blocking(write_fd, False)
    return Guard(pid, write_fd, mark_fd)


def _guard_main(read_fd: int, marks: Marks) -> None:  # pragma: no cover - see start()
    status = 0
    try:
        _detach(marks.run_id)
        if not _listen(read_fd, marks):
            sweep(Finder(marks), _SWEEP_SECONDS)
    except BaseException:
        status = 1
    finally:
        os._exit(status)


def _listen(read_fd: int, marks: Marks) -> bool:
    """Takes the runtime's messages until its pipe closes; True if the last one stood us down."""
    unfinished = b""
    stood_down = False
    while True:
        data = os.read(read_fd, _READ)
        if not data:
            return stood_down
        lines = (unfinished + data).split(b"\n")
        unfinished = lines.pop()
        for line in lines:
            stood_down = line == _STAND_DOWN
            marks.take(line)


def _detach(run_id: str) -> None:
    set_process_name(NAME)
    set_command_line([NAME, run_id])
    # Out of the terminal's process group, deaf to the signals meant for the job.
    os.setpgid(0, 0)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)


def lineage(environ, run_id: str) -> str:
    """The MA_RUNTIME_LINEAGE value for this run's workers."""
    inherited = environ.get(LINEAGE_ENV, "")
    return f"{inherited},{run_id}" if inherited else run_id


def carries_lineage(pid: int, run_id: str) -> bool:
    """Whether the process's MA_RUNTIME_LINEAGE names `run_id`."""
    return run_id in environ(pid).get(LINEAGE_ENV, "").split(",")
