"""`ma-runtime run`: the flow of docs/architecture.md, read top to bottom like tini's main().

One signal regime from the first line to the exit: the `SignalQueue` the CLI installs before anything
else turns every signal into a number this thread reads. Before the command starts, the stages run in a
thread of their own while this one waits on the queue (`_Context.wait_for`): a SIGTERM or SIGINT ends the
run at once with 128+N, whatever the stage is blocked in (a stalled socket read, the rank-table wait).
While workers run, the supervisor reads the queue (forward once, grace, kill). Between attempts the
device wait and the backoff are waited for the same way. Once the verdict is decided, signals are still
only numbers in a pipe that nobody reads: a late SIGTERM, SIGINT or SIGHUP changes nothing, and the
termination message is written.
"""

import dataclasses
import functools
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from ma_runtime import attempt as attempt_module
from ma_runtime import children, ending, logs, termination
from ma_runtime import spec as spec_module
from ma_runtime import verdict as verdict_module
from ma_runtime.errors import (
    Category,
    ConfigError,
    ExitCode,
    PreflightFailed,
    RuntimeFailure,
)
from ma_runtime.launch import peers, registry
from ma_runtime.launch import plan as plan_module
from ma_runtime.launch.args import build_argv
from ma_runtime.output import Sink
from ma_runtime.process.lifecycle import sweep
from ma_runtime.process.table import descendants, processes
from ma_runtime.redact import Masker
from ma_runtime.stagein import Staged, code_dir, stage_in
from ma_runtime.supervise import attempt_processes
from ma_runtime.supervise import guard as guard_module
from ma_runtime.supervise.pid1 import become_subreaper, is_pid1
from ma_runtime.supervise.signals import STOPPING, SignalQueue
from ma_runtime.supervise.supervisor import State
from ma_runtime.supervise.worker import SIGNAL_NAMES

# How long a wait on the signal queue lasts at most (a wake-up lost would cost no more).
_TICK = 1.0
# How long the processes a stopped stage left behind get to die of SIGKILL.
_STRAGGLER_KILL_SECONDS = 2.0


def run(flags: Mapping[str, str], config_file: Optional[str], command: Sequence[str], print_config: bool,
        signals: Optional[SignalQueue] = None) -> int:
    signals = signals or SignalQueue()  # the CLI installs it first thing; a caller in Python may not have
    masker = Masker.from_environ()
    logs.configure(early_log_format(), masker=masker)
    log = logs.get_logger()
    context = _Context(masker, signals)
    context.sources = (dict(flags), config_file)
    try:
        spec = spec_module.load(flags, os.environ, config_file)
        if print_config:
            _print_config(spec, command, masker)
            return ExitCode.OK
        if not command:
            raise ConfigError("no command given", hint="usage: ma-run [OPTIONS] [--] CMD...")
        logs.configure(spec.log_format, spec.log_level, masker)
        if spec.syncs:  # a local copy inside a synced folder: 78 now, before anything is checked or fetched
            from ma_runtime.sync import targets

            targets.of(spec)
        context.spec = spec
        context.open_task_log()
        for note in spec.notes:
            log.info(note)
        context.start_guard()  # before any thread: the guard is a fork of this process
        first = attempt_module.first(spec, context.run_id, log)
        prepared = context.wait_for(functools.partial(_prepare, spec, first, log, command, context),
                                    "before the command started")
        return _attempts(spec, command, context, prepared, first)
    except RuntimeFailure as failure:
        return context.fail(failure)
    except Exception as exc:  # a bug of ours: still one line, a code, and a message
        return context.fail(
            RuntimeFailure(
                f"internal error: {type(exc).__name__}: {exc}",
                hint="please report this with the task log; the command's own exit code was not available",
            )
        )
    finally:
        context.close()


@dataclasses.dataclass
class _Prepared:
    """What the stages before the command give every attempt."""

    staged: Staged
    # The environment the plan and the workers start from: the runtime's, with what the hooks (pip, CANN's
    # set_env.sh, ma-pre-start) set and unset; the runtime's own stays as it was.
    environ: Mapping[str, str]
    rank_table: Any = None  # a ranktable.Prepared, when the job has one


def _prepare(spec: spec_module.JobSpec, first, log, command: Sequence[str], context: "_Context",
             stopped: threading.Event) -> _Prepared:
    """Preflight, stage-in, the hooks, the rank table, the launcher's services: once per run, in the stage
    thread."""
    from ma_runtime.hooks import stage as hooks

    _preflight(spec, log)
    staged = stage_in(spec, os.environ, log, first.number)  # a later attempt reuses what was staged
    # The hooks see what the command will see (MA_LOG_DIR, VC_TASK_INDEX, the staged channels resolved); a later
    # runtime in this pod (first.number > 1) reuses what the first one installed and its hook exported.
    seen_by_hooks = {**attempt_processes.worker_env(spec, context.run_id, first.number, os.environ), **staged.env}
    changes = hooks.prepare(spec, seen_by_hooks, command, context.task_log, log, reuse=first.number > 1,
                            exclude=(context.guard.pid,) if context.guard is not None else ())
    rank_table = None
    if spec.waits_for_rank_table:  # imported only then: most jobs have no rank table (start-up budget)
        from ma_runtime import ranktable

        rank_table = ranktable.prepare(spec, os.environ, log)
        staged.env.update(rank_table.env)
    environ = changes.apply(os.environ)
    services_env = attempt_processes.worker_env(spec, context.run_id, first.number, environ)
    _start_services(spec, services_env, log, context, stopped)
    return _Prepared(staged, environ, rank_table)


def _start_services(spec: spec_module.JobSpec, environ: Mapping[str, str], log, context: "_Context",
                    stopped: threading.Event) -> None:
    """What the launcher keeps running for the whole run (mpirun's sshd), after the hooks, whose PATH applies;
    its output on the console and in the task log, like a hook's."""
    from ma_runtime.launch.base import start_services

    sinks = [logs.stderr_sink(), *([context.task_log.as_console()] if context.task_log is not None else [])]
    start_services(registry.launcher(plan_module.choose(spec)[0]), spec, environ, log, stopped, sinks)


class _Stopped(RuntimeFailure):
    """SIGTERM/SIGINT while no command runs: before the first start, or between two attempts."""

    category = Category.PLATFORM

    def __init__(self, signum: int, when: str, stage: str):
        super().__init__(f"stopped by {SIGNAL_NAMES.get(signum, signum)} {when}", stage=stage)
        self.exit_code = 128 + signum  # as if the command had been stopped by it


class _Context:
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
        self.sources: Any = ({}, None)  # the flags and job file the spec came from: the uploader loads the same
        self.uploader = None  # sync.control.Uploader, once the command is about to start
        self.synced = False  # the final sync ran
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
        sets `stopped` and raises _Stopped at once, whatever `work` is blocked in (the process ends soon after,
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
                    raise _Stopped(signum, when, "startup" if self.attempt is None else "restart")
                if signum != signal.SIGCHLD:
                    logs.get_logger().info("no command is running: signal ignored",
                                           signal=SIGNAL_NAMES.get(signum, signum))
        if "error" in result:
            raise result["error"]
        return result.get("value")

    def fail(self, failure: RuntimeFailure) -> int:
        logs.get_logger().error(
            f"error,exiting: {failure.reason}",
            hint=failure.hint or None,
            stage=failure.stage,
            exit_code=int(failure.exit_code),
        )
        fields = dict(
            stage=failure.stage,
            category=failure.category.value,
            exit_code=int(failure.exit_code),
            reason=failure.reason,
            hint=failure.hint,
            attempt=self.attempt.number if self.attempt else None,
            tail=getattr(failure, "tail", None),  # a hook's last lines
            hook_exit_code=getattr(failure, "hook_exit_code", None),
        )
        self.write_termination(**fields)
        if isinstance(failure, ConfigError) and self.uploader is None:
            return int(failure.exit_code)  # a bad job file or setting: nothing ran, and the sync's settings may be bad
        return self.sync_at_end(fields, None)

    def start_uploader(self) -> None:
        """The uploader process, right before the first attempt's command (outputs and logs, while it runs)."""
        if self.uploader is None and self.spec.syncs:
            from ma_runtime.sync import control

            self.uploader = control.Uploader(*self.sources, logs.get_logger())
            self.uploader.start()

    def sync_at_end(self, fields: Dict[str, Any], stop_requested_at: Optional[float],
                    workers_stopped_at: Optional[float] = None) -> int:
        """The final sync (its deadline counted from the stop request, when there was one), after the termination
        message was written (so that it goes up first). What did not make it turns a success into 80, and is
        listed in the message either way. `workers_stopped_at` (time.time()): the workers were stopped then, so
        what they were writing must not replace what the store has. Returns the exit code."""
        if self.spec is None or self.synced:
            return fields["exit_code"]
        self.synced = True
        if self.uploader is None and not self.spec.syncs:
            return fields["exit_code"]
        from ma_runtime.sync import control, targets

        try:
            targets.of(self.spec)
        except ConfigError:
            return fields["exit_code"]  # the failure being reported is that one
        log = logs.get_logger()
        deadline = (stop_requested_at or time.monotonic()) + self.spec.sync_final_seconds
        if self.uploader is None:
            self.uploader = control.Uploader(*self.sources, log)
        result = self.uploader.final(deadline, stopped_at=workers_stopped_at)
        if result.complete:
            log.info("final sync completed", elapsed_s=result.seconds, files=result.files, bytes=result.bytes)
            self._sync_logs_again(deadline)
            return fields["exit_code"]
        unsynced = result.missing or [f"(unknown: {result.error})"]
        fields = ending.after_incomplete_sync(fields, unsynced, result, self.spec.sync_final_seconds, log)
        self.write_termination(**fields, unsynced=unsynced)
        self._sync_logs_again(deadline)
        return fields["exit_code"]

    def _sync_logs_again(self, deadline: float) -> None:
        """The log lines since, and the termination message as it now is, if time is left."""
        if time.monotonic() < deadline and self.spec.log_url:
            self.uploader.final(deadline, scope="logs")

    def write_termination(self, **fields) -> None:
        # Without a usable log directory (bad configuration), only Kubernetes' copy.
        log_copy = self.spec.termination_path if self.spec and self.task_log else None
        message = termination.build(masker=self.masker, run_id=self.run_id, **fields)
        try:
            kept = not termination.write(message, log_copy, self.k8s_path, self.k8s_before)
        except OSError as exc:
            logs.get_logger().warning("could not write the termination message", error=str(exc))
            return
        if kept:
            logs.get_logger().info("kept the termination message the command wrote", path=str(self.k8s_path))

    def close(self) -> None:
        """The exit steps: nothing of ours left running, the attempt record closed, the guard stood down."""
        if self.uploader is not None:
            self.uploader.close()
        self._end_stragglers()
        if self.attempt is not None:
            _record_quietly(self.spec, self.attempt, finished=True)  # the next runtime in this pod starts afresh
        if self.guard is not None:
            self.guard.stand_down()
        if self.task_log is not None:
            logs.remove_sink(self.task_log)
            self.task_log.close()

    def _end_stragglers(self) -> None:
        """What a stage stopped midway left running (a preflight tool): the supervisor cleans up after the
        command, but nothing else does."""
        # The pre-start hook's services (an sshd) too: the run is over.
        exclude = children.NotTheCommand((self.guard.pid,) if self.guard is not None else (), services=True)
        me = os.getpid()

        def members() -> Dict[int, Any]:
            table = processes()
            return {pid: table[pid] for pid in descendants(me, exclude, table)}

        if members():
            sweep(members, _STRAGGLER_KILL_SECONDS)


def _record_quietly(spec, attempt, finished: bool = False) -> None:
    try:
        attempt_module.record(spec, attempt, finished)
    except OSError as exc:  # a read-only state folder costs the count across runtimes, not the job
        logs.get_logger().warning("could not record the attempt", path=str(attempt_module.record_path(spec)),
                                  error=str(exc))


def _attempts(spec: spec_module.JobSpec, command: Sequence[str], context: _Context, prepared: _Prepared,
              attempt: attempt_module.Attempt) -> int:
    """The attempt loop (torch elastic's `_invoke_run`): plan, launch and supervise attempt N, get its verdict,
    then decide: done, or restart (after the devices are released and the backoff), or give up (82)."""
    log = logs.get_logger()
    policy = attempt_module.Policy.of(spec)
    history: List[verdict_module.Verdict] = []
    when = "before the command started"
    hangs = _hang_config(spec, log)
    while True:
        # In the stage thread: the resume checkpoint is a walk of the output folders, and msrun's plan may wait
        # for worker-0's name to resolve.
        current = context.wait_for(functools.partial(_for_attempt, spec, prepared, attempt, log), when)
        plan = context.wait_for(functools.partial(_plan, spec, command, current, attempt), when)
        context.attempt = attempt
        _record_quietly(spec, attempt)
        context.start_uploader()
        outcome = attempt_processes.run_attempt(spec, plan, attempt, context, current.environ, current.staged.env,
                                                hangs)
        verdict = ending.attempt_verdict(outcome, plan, attempt)
        history.append(verdict)
        decision = policy.decide(attempt, verdict, history, outcome.stop_requested_at is not None)
        if not decision.restart:
            return _finish(verdict, decision, history, attempt, context, outcome)
        log.info("restarting command", attempt=attempt.number + 1, reason=verdict.reason,
                 **{"hang_restarts_left" if verdict.state is State.HUNG else "restarts_left": decision.left},
                 backoff_s=decision.delay)
        when = f"between attempts {attempt.number} and {attempt.number + 1}"
        context.wait_for(functools.partial(_between_attempts, spec, decision.delay, log), when)
        prepared = context.wait_for(functools.partial(_refresh, spec, prepared, log), when)
        attempt = dataclasses.replace(attempt, number=attempt.number + 1)


def _for_attempt(spec: spec_module.JobSpec, prepared: _Prepared, attempt, log, _stopped: threading.Event) -> _Prepared:
    """What attempt N's plan and workers start from: MA_RESUME_CHECKPOINT looked for again (resume.py), since
    the attempt before may have saved a newer checkpoint; `prepared` itself stays as the stages left it."""
    from ma_runtime import resume

    return dataclasses.replace(prepared, environ=resume.environ_for(spec, prepared.environ, attempt.number, log))


def _plan(spec: spec_module.JobSpec, command: Sequence[str], prepared: _Prepared, attempt,
          stopped: threading.Event) -> plan_module.Plan:
    # Inputs and outputs first, then hyperparameters: the platform's order is unspecified (docs/platform.md, D9).
    argv = build_argv(command, [*prepared.staged.arguments, *spec.hyperparameters])
    resolve = functools.partial(peers.resolve_until, seconds=spec.master_resolve_seconds)
    log = logs.get_logger()

    def reach(endpoints):  # mpirun's worker-0 waits for every node's sshd (launch/peers.py)
        return peers.reach_all(endpoints, spec.peer_wait_seconds, log, stopped)

    # What the stages set or changed for the workers: the hooks' exports, stage-in's variables.
    exported = {*prepared.staged.env, *(name for name, value in prepared.environ.items()
                                        if os.environ.get(name) != value)}
    plan = plan_module.build(spec, plan_module.Context(argv, prepared.environ, prepared.rank_table, resolve,
                                                       attempt=attempt.number, reach=reach,
                                                       exported=tuple(sorted(exported))))
    for warning in plan.warnings:
        logs.get_logger().warning(warning)
    return plan


def _between_attempts(spec: spec_module.JobSpec, delay: float, log, stopped: threading.Event) -> None:
    """Every process of the last attempt is gone; now the accelerators must be free, then the backoff."""
    from ma_runtime.supervise import devices

    if not devices.wait_released(spec, os.environ, spec.device_release_seconds, stopped.wait, log):
        return  # stopped: the caller has seen the signal
    stopped.wait(delay)


def _refresh(spec: spec_module.JobSpec, prepared: _Prepared, log, _stopped: threading.Event) -> _Prepared:
    """The rank table again, converted again only if the platform rewrote it; stage-in is not repeated."""
    if prepared.rank_table is None:
        return prepared
    from ma_runtime import ranktable

    if ranktable.unchanged(prepared.rank_table):
        return prepared
    log.info("the rank table changed since the last attempt: converting it again")
    rank_table = ranktable.prepare(spec, os.environ, log)
    return dataclasses.replace(prepared, staged=dataclasses.replace(
        prepared.staged, env={**prepared.staged.env, **rank_table.env}), rank_table=rank_table)


def _hang_config(spec: spec_module.JobSpec, log):
    """The run's hang detection (None: off)."""
    from ma_runtime.supervise import hang

    return hang.configure(spec, os.environ, log)


def _finish(verdict: verdict_module.Verdict, decision, history: List[verdict_module.Verdict], attempt,
            context: _Context, outcome) -> int:
    """The job's exit code and termination message, from the last attempt's verdict and the decision; then the
    final sync, which can turn a success into 80."""
    fields = ending.job_fields(verdict, decision, history, attempt)
    if fields["exit_code"] != 0:
        context.write_termination(**fields)
    return context.sync_at_end(fields, outcome.stop_requested_at, outcome.workers_stopped_at)


def _preflight(spec: spec_module.JobSpec, log) -> None:
    """The node checks, before anything is downloaded or started; a bad node stops here."""
    if not spec.preflight_enabled:
        switch = "MA_SKIP_IMAGE_DETECT=0" if spec.skip_image_detect == "0" else "MA_RUNTIME_PREFLIGHT=off"
        log.info("preflight skipped", reason=switch)
        return
    from ma_runtime.preflight import runner

    report = runner.run(spec, os.environ, runner.select(spec.preflight_checks), log)
    if not report.ok:
        items = report.failed_items()
        raise PreflightFailed(
            f"preflight failed: {', '.join(items)}: {report.failures[0].hint}",
            hint=f"this node cannot run the job; to run anyway set MA_RUNTIME_PREFLIGHT_WARN_ONLY="
            f"{','.join(dict.fromkeys(r.item for r in report.failures))} or MA_RUNTIME_PREFLIGHT=off",
        )
















def early_log_format() -> str:
    # Before the spec is valid, a bad MA_RUNTIME_LOG_FORMAT must not hide the error.
    fmt = (os.environ.get("MA_RUNTIME_LOG_FORMAT") or "logfmt").strip().lower()
    return fmt if fmt in spec_module.LOG_FORMATS else "logfmt"


def _print_config(spec: spec_module.JobSpec, command: Sequence[str], masker: Masker) -> None:
    document = {
        "settings": spec.settings(),
        "sources": dict(spec.sources),
        "config_file": str(spec.config_file) if spec.config_file else None,
        "hyperparameters": dict(spec.hyperparameters),
        "code": {"url": spec.code_url, "path": str(code_dir(spec))}
        if spec.code_url
        else None,
        "channels": [
            {"kind": c.kind, "name": c.name, "url": c.url, "mode": c.mode, "predownload": c.predownload,
             **({"sync": c.sync, "delete": c.delete} if c.kind == "outputs" else {}),
             "path": str(c.local_dir(spec.mount_path))}
            for c in (*spec.inputs, *spec.outputs)
        ],
        "task_log": str(spec.task_log_path),
        "termination_message": str(spec.termination_path),
        "command": list(command),
        "argv": build_argv(command, spec.hyperparameters) if command else [],
        "notes": list(spec.notes),
    }
    sys.stdout.write(json.dumps(masker.data(document), indent=2) + "\n")
    sys.stdout.flush()

