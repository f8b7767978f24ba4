"""The runtime's side of the uploader process: start it, watch it, start it again once, ask for the final sync.

The uploader is a helper child (children.start_helper): the reaping loop leaves its status to the watcher
thread here, and the supervisor's stops and sweeps never count it as part of the command. It gets the same
environment as the runtime (credentials reach it the way they reach the SDK: never on a command line), and
its own session, so a terminal's Ctrl-C does not reach it.

Its death while the command runs is the platform's event ("output and log upload process exited; files will
no longer be synced"); it is started again once. The final sync always runs: in a fresh process when
there is none, because the outputs are lost otherwise.
"""

import dataclasses
import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import List, Mapping, Optional, Tuple

from ma_runtime import children

DIED_EVENT = "output and log upload process exited; files will no longer be synced"
RESTARTS = 1
# After the deadline: how long the answer may still take (the uploader stops its waits at the deadline).
ANSWER_GRACE_SECONDS = 2.0
EXIT_WAIT_SECONDS = 2.0


@dataclasses.dataclass
class FinalResult:
    files: int = 0
    bytes: int = 0
    missing: List[str] = dataclasses.field(default_factory=list)
    error: Optional[str] = None
    seconds: float = 0.0
    answered: bool = True  # False: the uploader did not answer in time; `missing` is then unknown

    @property
    def complete(self) -> bool:
        return self.answered and not self.missing


class Uploader:
    def __init__(self, flags: Mapping[str, str], config_file: Optional[str], log):
        self.config = json.dumps({"flags": dict(flags), "config_file": config_file}) + "\n"
        self.log = log
        self.proc: Optional[subprocess.Popen] = None
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
        # Isolated as the runtime is when the image's entrypoint runs it with -I: the job's PYTHONPATH must not
        # reach the runtime's own packages.
        isolated = ["-I"] if sys.flags.isolated else []
        proc = children.start_helper(lambda: subprocess.Popen(
            [sys.executable, *isolated, "-m", "ma_runtime.sync.uploader"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, close_fds=True, start_new_session=True))
        self.proc = proc
        threading.Thread(target=self._watch, args=(proc,), name="uploader-watch", daemon=True).start()
        try:
            proc.stdin.write(self.config.encode())
            proc.stdin.flush()
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

    def final(self, deadline: float, scope: str = "all") -> FinalResult:
        """The final sync (`deadline`: time.monotonic()); in a fresh process when none is running."""
        with self.lock:
            self.ending = True
            try:
                if self.proc is None or self.proc.poll() is not None:
                    self._spawn()
            except OSError as exc:
                return FinalResult(answered=False, error=f"the upload process could not be started: {exc}")
            proc = self.proc
        # CLOCK_MONOTONIC is one clock for every process of the machine: the uploader keeps the same deadline,
        # however long it took to read the command.
        command = {"final": deadline, "scope": scope}
        try:
            proc.stdin.write((json.dumps(command) + "\n").encode())
            proc.stdin.flush()
        except OSError:
            return FinalResult(answered=False, error="the upload process was gone")
        answer, why = _read_line(proc.stdout, deadline + ANSWER_GRACE_SECONDS)
        if answer is None:
            return FinalResult(answered=False, error=f"the upload process {why}")
        document = json.loads(answer)
        return FinalResult(document["files"], document["bytes"], list(document["missing"]), document["error"],
                           document["seconds"])

    def close(self) -> None:
        """Closes its stdin (it exits at once), and kills it if it has not within EXIT_WAIT_SECONDS."""
        with self.lock:
            self.ending = True
            proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(EXIT_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _read_line(stream, deadline: float) -> Tuple[Optional[str], str]:
    """(one line from the uploader's stdout by `deadline` (monotonic), "") or (None, why not)."""
    fd = stream.fileno()
    buffered = b""
    while b"\n" not in buffered:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None, "did not answer before the deadline"
        chunk = os.read(fd, 65536)
        if not chunk:
            return None, "exited before it answered"
        buffered += chunk
    return buffered.split(b"\n", 1)[0].decode("utf-8", "replace"), ""
