"""The runtime's side of the uploader process: start it, watch it, start it again once, ask for the final sync.

The uploader is a helper child (children.start_helper): the reaping loop leaves its status to the watcher
thread here, and the supervisor's stops and sweeps never count it as part of the command. It gets the same
environment as the runtime (credentials reach it the way they reach the SDK: never on a command line), and
its own session, so a terminal's Ctrl-C does not reach it.

Isolated from the job's Python: it runs `python -I` (no PYTHONPATH, no user site-packages, no current folder:
a job's `sitecustomize.py` or `yaml.py` never loads in it), and is given the folder that holds the runtime's
own `ma_runtime` explicitly (a source checkout or an editable install is importable as a wheel is). It talks to
the runtime over a socket pair of its own (its fd number on its command line): stdout and stderr stay the
runtime's, for log lines, so nothing the job's environment prints can garble an answer.

Its death while the command runs is the platform's event ("output and log upload process exited; files will
no longer be synced"); it is started again once. The final sync always runs: in a fresh process when
there is none, because the outputs are lost otherwise, and again in a fresh one (FINAL_RESTARTS times at most,
while its deadline allows) when the uploader dies before it answered: the multipart uploads it had under way
are resumed from their records.
"""

import base64
import dataclasses
import json
import pickle
import select
import socket
import subprocess
import threading
import time
from typing import Dict, List, Optional, Tuple

from ma_runtime.process import children, lifecycle

DIED_EVENT = "output and log upload process exited; files will no longer be synced"
RESTARTS = 1
# Fresh uploaders for one final sync whose uploader died before it answered: enough for an OOM kill or two, few
# enough that a process that dies at every start cannot spin until the deadline.
FINAL_RESTARTS = 3
# After the deadline: how long the answer may still take (the uploader stops its waits at the deadline).
ANSWER_GRACE_SECONDS = 2.0
EXIT_WAIT_SECONDS = 2.0
_EXITED = "exited before it answered"  # its channel ended before an answer: it died (a fresh one may be started)


@dataclasses.dataclass
class FinalResult:
    files: int = 0
    bytes: int = 0
    missing: List[str] = dataclasses.field(default_factory=list)
    error: Optional[str] = None
    seconds: float = 0.0  # how long the final sync took, as the runtime saw it (fresh uploaders included)
    answered: bool = True  # False: the uploader did not answer in time; `missing` is then unknown
    # Endpoints the run found dead (storage/reach.py), and why: the uploader did not try them again.
    dead: Dict[str, str] = dataclasses.field(default_factory=dict)
    skipped: Dict[str, str] = dataclasses.field(default_factory=dict)  # channel -> its dead endpoint, not tried
    unsent: List[str] = dataclasses.field(default_factory=list)  # the files of those channels, `<channel>: <path>`

    @property
    def complete(self) -> bool:
        return self.answered and not self.missing and not self.skipped


class Uploader:
    def __init__(self, spec, log):
        # The runtime's own JobSpec, whole: loading it again in the uploader could give other outputs (a job file
        # edited since the start). Pickled: it holds paths, tuples and channels, which JSON would flatten; it
        # travels from this process to its own child over their private socket pair, so it is trusted.
        self.config = json.dumps({"spec": base64.b64encode(pickle.dumps(spec)).decode("ascii")}) + "\n"
        self.log = log
        self.proc: Optional[subprocess.Popen] = None
        self.channel: Optional[socket.socket] = None  # the runtime's end of self.proc's socket pair
        self.restarts_left = RESTARTS
        self.ending = False  # the final sync or the exit is under way: a death is no longer an event
        self.lock = threading.Lock()

    def start(self) -> None:
        """A process that cannot be started (no memory, no pids) is a warning: the command still runs, and the
        final sync tries again."""
        with self.lock:
            try:
                self._spawn()
            except OSError as exc:
                self.log.warning("the upload process could not be started; files will be synced at the end",
                                 error=str(exc))

    def _spawn(self) -> None:
        """Under self.lock. A new process, its channel, its watcher; the previous channel, if any, closed."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)  # neither inheritable (PEP 446)
        try:
            proc = children.start_module("ma_runtime.sync.uploader", theirs.fileno())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the child's copy only: its death is then the end of our end's stream
        if self.channel is not None:
            self.channel.close()
        self.proc, self.channel = proc, ours
        threading.Thread(target=self._watch, args=(proc,), name="uploader-watch", daemon=True).start()
        try:
            ours.sendall(self.config.encode(), socket.MSG_NOSIGNAL)
        except OSError:
            pass  # it died at once: the watcher reports it

    def _watch(self, proc: subprocess.Popen) -> None:
        code = proc.wait()
        children.end_helper(proc.pid)
        with self.lock:
            if self.ending or proc is not self.proc:
                return
            self.log.warning(DIED_EVENT, exit_code=code, pid=proc.pid)
            self.proc = None
            if self.restarts_left > 0:
                self.restarts_left -= 1
                try:
                    self._spawn()
                except OSError as exc:
                    self.log.warning("upload process could not be restarted", error=str(exc))
                    return
                self.log.info("upload process restarted", pid=self.proc.pid)

    def final(self, deadline: float, scope: str = "all", stopped_at: Optional[float] = None) -> FinalResult:
        """The final sync (`deadline`: time.monotonic()); in a fresh process when none is running, and in a fresh
        one again when the uploader dies before it answered (FINAL_RESTARTS at most, before the deadline).
        `stopped_at`: when the workers were asked to stop (time.time()), if they were: a file being written then
        must not replace what the store has."""
        from ma_runtime.storage import reach

        started = time.monotonic()
        with self.lock:
            self.ending = True
        restarts = 0
        while True:
            # What this process found dead (stage-in's check, or its transfers) goes with the command: a fresh
            # uploader would try it again otherwise.
            command = {"final": deadline, "scope": scope, "stopped_at": stopped_at, "dead": reach.dead()}
            result, died = self._ask(command, deadline, restart=restarts > 0)
            if died is None or restarts >= FINAL_RESTARTS or time.monotonic() >= deadline:
                break
            self.log.warning("upload process exited during the final sync; starting a fresh one",
                             exit_code=_exit_code(died), pid=died.pid)
            with self.lock:
                self.proc = None
            restarts += 1
        result.seconds = round(time.monotonic() - started, 3)
        return result

    def _ask(self, command: dict, deadline: float, restart: bool) -> Tuple[FinalResult, Optional[subprocess.Popen]]:
        """(the answer, None), or (why none came, the process) when it died before it answered. `restart`: the
        previous one died during this final sync."""
        with self.lock:
            fresh = self.proc is None or self.proc.poll() is not None
            try:
                if fresh:
                    self._spawn()
            except OSError as exc:
                return FinalResult(answered=False, error=f"the upload process could not be started: {exc}"), None
            proc, channel = self.proc, self.channel
        if fresh and restart:
            self.log.info("upload process restarted", pid=proc.pid, during="final sync")
        # CLOCK_MONOTONIC is one clock for every process of the machine: the uploader keeps the same deadline,
        # however long it took to read the command.
        try:
            channel.sendall((json.dumps(command) + "\n").encode(), socket.MSG_NOSIGNAL)
        except OSError:
            return FinalResult(answered=False, error=f"the upload process {_EXITED}"), proc
        answer, why = _read_line(channel, deadline + ANSWER_GRACE_SECONDS)
        if answer is None:
            return FinalResult(answered=False, error=f"the upload process {why}"), (proc if why == _EXITED else None)
        try:
            document = json.loads(answer)
            return FinalResult(document["files"], document["bytes"], list(document["missing"]), document["error"],
                               document["seconds"], dead=dict(document.get("dead") or {}),
                               skipped=dict(document.get("skipped") or {}),
                               unsent=list(document.get("unsent") or [])), None
        except (ValueError, KeyError, TypeError):
            return FinalResult(answered=False, error=f"the upload process answered {answer[:200]!r}"), None

    def stopping(self, since: Optional[float]) -> None:
        """Tells the uploader that the workers are being stopped (since `since`, time.time()): from now on a file
        they were writing must not replace what the store has; None: a new attempt's workers start. Best
        effort: a dead uploader is told nothing, and the final sync carries the same time."""
        with self.lock:
            channel = self.channel
        if channel is None:
            return
        try:
            channel.sendall((json.dumps({"stopping": since}) + "\n").encode(), socket.MSG_NOSIGNAL)
        except OSError:
            pass

    def close(self) -> None:
        """Closes its channel (it exits at once), and kills it if it has not within EXIT_WAIT_SECONDS."""
        with self.lock:
            self.ending = True
            proc, self.proc = self.proc, None
            channel, self.channel = self.channel, None
        if channel is not None:
            channel.close()
        if proc is not None:
            lifecycle.wait_or_kill(proc, EXIT_WAIT_SECONDS)


def _exit_code(proc: subprocess.Popen) -> Optional[int]:
    """Its exit status; one that closed its channel but lives on is killed (a fresh one takes over)."""
    return lifecycle.wait_or_kill(proc, EXIT_WAIT_SECONDS)


def _read_line(channel: socket.socket, deadline: float) -> Tuple[Optional[str], str]:
    """(one line from the uploader's channel by `deadline` (monotonic), "") or (None, why not)."""
    buffered = b""
    while b"\n" not in buffered:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([channel], [], [], left)[0]:
            return None, "did not answer before the deadline"
        try:
            chunk = channel.recv(65536)
        except OSError:  # ECONNRESET: it died with our command unread
            chunk = b""
        if not chunk:
            return None, _EXITED
        buffered += chunk
    return buffered.split(b"\n", 1)[0].decode("utf-8", "replace"), ""
