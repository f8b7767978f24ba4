"""What every stage of a run shares (`RunContext`), and how the main thread waits on a stage while it reads the
signals. The run's flow is bootstrap's; the end of the run (termination message, final sync) is ending's.
"""

import os
import signal
import threading
from typing import Any, Callable, Dict, Optional

from ma_runtime import attempt as attempt_module
from ma_runtime import spec as spec_module
from ma_runtime import termination
from ma_runtime.errors import Category, ConfigError, RuntimeFailure
from ma_runtime.process import children
from ma_runtime.process.lifecycle import sweep
from ma_runtime.process.table import descendants, processes
from ma_runtime.process.worker import SIGNAL_NAMES
from ma_runtime.supervise import guard as guard_module
from ma_runtime.supervise.pid1 import become_subreaper, is_pid1
from ma_runtime.supervise.signals import STOPPING, SignalQueue
from ma_runtime.util import logs
from ma_runtime.util.output import Sink
from ma_runtime.util.redact import Masker

# How long a wait on the signal queue lasts at most (a wake-up lost would cost no more).
_TICK = 1.0
# How long the processes a stopped stage left behind get to die of SIGKILL.
_STRAGGLER_KILL_SECONDS = 2.0


class Stopped(RuntimeFailure):
    """SIGTERM/SIGINT while no command runs: before the first start, or between two attempts."""

    category = Category.PLATFORM

    def __init__(self, signum: int, when: str, stage: str):
        super().__init__(f"stopped by {SIGNAL_NAMES.get(signum, signum)} {when}", stage=stage)
        self.exit_code = 128 + signum  # as if the command had been stopped by it


class RunContext:
    """What every stage of the run shares, and what the finishing steps need whichever stage it reached."""

    def __init__(self, masker: Masker, signals: SignalQueue):
        self.masker = masker
        self.signals = signals
        # The one name of this run: in its log lines, its workers' lineage, its termination message.
        self.run_id = os.urandom(6).hex()
        self.spec: Optional[spec_module.JobSpec] = None
        self.task_log: Optional[Sink] = None
        self.guard = None
        self.attempt: Optional[attempt_module.Attempt] = None  # the last one started
        self.uploader = None  # sync.control.Uploader, once the command is about to start
        self.synced = False  # the final sync ran
        self.job: Any = None  # coordinator.Alone or Together, once the spec is known
        self.k8s_path = termination.kubernetes_path(os.environ)
        # Taken before the command runs, so that its own message can be told apart.
        self.k8s_before = termination.snapshot(self.k8s_path)

    def open_task_log(self) -> None:
        path = self.spec.task_log_path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.task_log = Sink.open_append(str(path))
        except OSError as exc:
            raise ConfigError(
                f"cannot write the task log {path}: {exc.strerror}",
                hint="set MA_LOG_DIR (or --log-dir) to a writable directory",
            ) from None
        logs.add_sink(self.task_log)
        # An earlier run's verdict would read as this run's: the task log (appended) keeps the history.
        if termination.remove_stale(self.spec.termination_path):
            logs.get_logger().info("removed an earlier run's termination message",
                                   path=str(self.spec.termination_path))

    def start_guard(self) -> None:
        """The guard (outside a PID namespace), and orphans of our tree kept under us."""
        if is_pid1():
            return  # the kernel kills the namespace with us, and orphans come to us anyway
        self.guard = guard_module.start(self.run_id)
        if not become_subreaper():
            logs.get_logger().warning("could not become a child subreaper; orphans will go to init")

    def wait_for(self, work: Callable[[threading.Event], Any], when: str) -> Any:
        """`work(stopped)` in a thread of its own while this thread reads the signals. A SIGTERM or SIGINT
        sets `stopped` and raises Stopped at once, whatever `work` is blocked in (the process ends soon after,
        and the thread with it); other signals have no command to go to and are logged."""
        stopped, done = threading.Event(), threading.Event()
        result: Dict[str, Any] = {}

        def target() -> None:
            try:
                result["value"] = work(stopped)
            except BaseException as exc:  # noqa: BLE001 - handed over to this thread whole
                result["error"] = exc
            finally:
                done.set()  # before the wake-up: the loop below must see it when it wakes
                self.signals.wake()

        threading.Thread(target=target, name="stage", daemon=True).start()
        while not done.is_set():
            for signum in self.signals.wait(_TICK):
                if signum in STOPPING:
                    stopped.set()
                    raise Stopped(signum, when, "startup" if self.attempt is None else "restart")
                if signum != signal.SIGCHLD:
                    logs.get_logger().info("no command is running: signal ignored",
                                           signal=SIGNAL_NAMES.get(signum, signum))
        if "error" in result:
            raise result["error"]
        return result.get("value")

    def start_uploader(self) -> None:
        """The uploader process, right before the first attempt's command (outputs and logs, while it runs)."""
        if self.uploader is None and self.spec.syncs:
            from ma_runtime.sync import control

            self.uploader = control.Uploader(self.spec, logs.get_logger())
            self.uploader.start()

    def stage(self, name: str) -> None:
        """The stage this node is in, for the other nodes (a barrier that times out names it)."""
        if self.job is not None:
            self.job.stage(name)

    def record_attempt(self, finished: bool = False) -> None:
        """The pod's attempt record (attempt.py), for the next runtime in this pod."""
        try:
            attempt_module.record(self.spec, self.attempt, finished)
        except OSError as exc:  # a read-only state folder costs the count across runtimes, not the job
            logs.get_logger().warning("could not record the attempt",
                                      path=str(attempt_module.record_path(self.spec)), error=str(exc))

    def close(self) -> None:
        """The exit steps: nothing of ours left running, the attempt record closed, the guard stood down."""
        if self.uploader is not None:
            self.uploader.close()
        self._end_stragglers()
        if self.attempt is not None:
            self.record_attempt(finished=True)  # the next runtime in this pod starts afresh
        if self.guard is not None:
            self.guard.stand_down()
        if self.job is not None:
            self.job.close()
        if self.task_log is not None:
            logs.remove_sink(self.task_log)
            self.task_log.close()

    def _end_stragglers(self) -> None:
        """What a stage stopped midway left running (a preflight tool): the supervisor cleans up after the
        command, but nothing else does."""
        # The services that stop themselves (Ray's node) first, within the grace; then the pre-start hook's services
        # (an sshd) with the rest: the run is over.
        children.stop_services(self.spec.stop_grace_seconds if self.spec is not None else 0.0)
        exclude = children.NotTheCommand((self.guard.pid,) if self.guard is not None else (), services=True)
        me = os.getpid()

        def members() -> Dict[int, Any]:
            table = processes()
            return {pid: table[pid] for pid in descendants(me, exclude, table)}

        if members():
            sweep(members, _STRAGGLER_KILL_SECONDS)
