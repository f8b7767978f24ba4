"""`ma-runtime run`: the flow of docs/architecture.md, read top to bottom like tini's main()."""

import functools
import json
import os
import signal
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from ma_runtime import __version__, logs, termination
from ma_runtime import spec as spec_module
from ma_runtime.errors import (
    Category,
    ConfigError,
    ExitCode,
    LaunchTimedOut,
    PreflightFailed,
    RuntimeFailure,
    exit_code_of_status,
)
from ma_runtime.launch import failures
from ma_runtime.launch import plan as plan_module
from ma_runtime.launch.args import build_argv
from ma_runtime.output import Sink, tail_of
from ma_runtime.redact import Masker
from ma_runtime.stagein import Staged, code_dir, stage_in
from ma_runtime.supervise import guard as guard_module
from ma_runtime.supervise.pid1 import SignalQueue, become_subreaper, is_pid1
from ma_runtime.supervise.supervisor import Outcome, Supervisor
from ma_runtime.supervise.worker import SIGNAL_NAMES, Worker, spawn

TAIL_LINES = 20
# The resolved settings that have a platform name are exported to the command
# under that name, so it sees the same job the runtime saw.
_EXPORTED = ("ma_home", "mount_path", "job_dir", "log_dir", "task_name", "task_index", "num_hosts", "num_gpus",
             "proc_start_cnt", "schedule_cnt", "vj_name")


def run(flags: Mapping[str, str], config_file: Optional[str], command: Sequence[str], print_config: bool) -> int:
    masker = Masker.from_environ()
    logs.configure(early_log_format(), masker=masker)
    log = logs.get_logger()
    context = _Context(masker)
    _stop_on_signals()
    try:
        spec = spec_module.load(flags, os.environ, config_file)
        if print_config:
            _print_config(spec, command, masker)
            return ExitCode.OK
        if not command:
            raise ConfigError("no command given", hint="usage: ma-run [OPTIONS] [--] CMD...")
        logs.configure(spec.log_format, spec.log_level, masker)
        context.spec = spec
        context.open_task_log()
        for note in spec.notes:
            log.info(note)
        _preflight(spec, log)
        staged = stage_in(spec, os.environ, log)
        rank_table = None
        if spec.waits_for_rank_table:  # imported only then: most jobs have no rank table (start-up budget)
            from ma_runtime import ranktable

            rank_table = ranktable.prepare(spec, os.environ, log)
            staged.env.update(rank_table.env)
        return _run_command(spec, command, context, staged, rank_table)
    except RuntimeFailure as failure:
        return context.fail(failure)
    except _Stopped as stopped:
        return context.fail(stopped.failure())
    except Exception as exc:  # a bug of ours: still one line, a code, and a message
        return context.fail(
            RuntimeFailure(
                f"internal error: {type(exc).__name__}: {exc}",
                hint="please report this with the task log; the command's own exit code was not available",
            )
        )
    finally:
        context.close()


class _Stopped(Exception):
    """SIGTERM/SIGINT before the command started (preflight, stage-in, the rank-table wait)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    def failure(self) -> RuntimeFailure:
        failure = RuntimeFailure(f"stopped by {SIGNAL_NAMES.get(self.signum, self.signum)} before the command started",
                                 stage="startup")
        failure.exit_code = 128 + self.signum  # as if the command had been stopped by it
        return failure


def _raise_stopped(signum: int, _frame) -> None:
    raise _Stopped(signum)


def _stop_on_signals() -> None:
    """Until the supervisor takes the signals over: a stop ends the run at once with 128+N. As PID 1, a
    signal without a handler is ignored, so a long wait (stage-in, the rank table) would sit out the
    platform's grace period instead."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _raise_stopped)


def _ignore_stops() -> None:
    """After the command: the exit code is decided, and a late stop must not replace it."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)


class _Context:
    """What the finishing steps need, whichever stage the run reached."""

    def __init__(self, masker: Masker):
        self.masker = masker
        # The one name of this run: in its log lines, its workers' lineage, its termination message.
        self.run_id = os.urandom(6).hex()
        self.spec: Optional[spec_module.JobSpec] = None
        self.task_log: Optional[Sink] = None
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

    def fail(self, failure: RuntimeFailure) -> int:
        logs.get_logger().error(
            f"error,exiting: {failure.reason}",
            hint=failure.hint or None,
            stage=failure.stage,
            exit_code=int(failure.exit_code),
        )
        self.write_termination(
            stage=failure.stage,
            category=failure.category.value,
            exit_code=int(failure.exit_code),
            reason=failure.reason,
            hint=failure.hint,
        )
        return int(failure.exit_code)

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
        if self.task_log is not None:
            logs.remove_sink(self.task_log)
            self.task_log.close()


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
















def _run_command(spec: spec_module.JobSpec, command: Sequence[str], context: _Context, staged: Staged,
                 rank_table=None) -> int:  # rank_table: a ranktable.Prepared, when the job has one
    log = logs.get_logger()
    run_id = context.run_id
    # Inputs and outputs first, then hyperparameters: the platform's order is unspecified (docs/platform.md, D9).
    argv = build_argv(command, [*staged.arguments, *spec.hyperparameters])
    resolve = functools.partial(resolve_until, seconds=spec.master_resolve_seconds)
    plan = plan_module.build(spec, plan_module.Context(argv, os.environ, rank_table, resolve))
    for warning in plan.warnings:
        log.warning(warning)
    pid1 = is_pid1()
    follower = None
    # First, so that a SIGTERM from now on is queued for the command, not lost
    # (PID 1 ignores signals it has no handler for).
    signals = SignalQueue()
    # Before any thread or worker exists: the guard is a fork of this process.
    guard = None if pid1 else guard_module.start(run_id)
    if not pid1 and not become_subreaper():
        log.warning("could not become a child subreaper; orphans will go to init")
    try:
        # Logged before the spawn, so that it precedes the command's output everywhere.
        log.info(
            "starting command",
            version=__version__,
            argv=list(plan.workers[0].argv),
            method=plan.method,
            processes=len(plan.workers),
            pid1=pid1,
            run_id=run_id,
            attempt=spec.proc_start_cnt,
            task_log=str(spec.task_log_path),
        )
        base_env = {**_worker_env(spec, run_id), **staged.env}
        follower = _follow_rank_logs(plan, context)
        workers = _spawn_all(plan, base_env, context, guard)
        outcome = Supervisor(workers if len(workers) > 1 else workers[0], signals, spec.stop_grace_seconds, log,
                             guard=guard).run()
    finally:
        signals.close()
        _ignore_stops()
        if follower is not None:
            follower.stop()
    # Only a normal end stands the guard down: if anything above raised, the
    # guard sees our pipe close at exit and kills whatever is still running.
    if guard:
        guard.stand_down()
    return _finish(outcome, outcome.worker or workers[0], context, plan)


def _spawn_all(plan, base_env: Mapping[str, str], context: _Context, guard=None) -> List[Worker]:
    """One process per planned worker; several get a rank prefix on the console and in the task log, and a
    proc log of their own with their raw lines. Each holds the guard's mark (`guard.pass_fds`)."""
    several = len(plan.workers) > 1
    # One Sink object per destination, shared by every worker: its lock keeps lines whole across ranks.
    stdout, stderr = Sink(1, "<stdout>"), logs.stderr_sink()
    task_log = context.task_log.as_console() if several else context.task_log
    workers: List[Worker] = []
    try:
        for planned in plan.workers:
            proc_log = _proc_log(planned)
            extra = [proc_log] if proc_log else []
            workers.append(spawn(
                planned.argv,
                {**base_env, **planned.env},
                cwd=planned.cwd,
                stdout_sinks=[stdout, task_log, *extra],
                stderr_sinks=[stderr, task_log, *extra],
                name=planned.name,
                console_prefix=f"[{planned.name}] ".encode() if several else None,
                pass_fds=guard.pass_fds if guard else (),
            ))
    except BaseException:
        for worker in workers:  # a later spawn failed: the ranks already started must not run alone
            worker.signal_group(signal.SIGKILL)
        raise
    return workers


def _follow_rank_logs(plan, context: _Context):
    """msrun writes each rank's output to a file only: follow those onto the console and the task log."""
    folder = plan.workers[0].logs.get("msrun") if plan.method == plan_module.MSRUN else None
    if not folder:
        return None
    from ma_runtime.supervise.follow import LogFollower

    follower = LogFollower(Path(folder), [Sink(1, "<stdout>"), context.task_log])
    follower.start()
    return follower


def _proc_log(planned) -> Optional[Sink]:
    path = planned.logs.get("proc")
    if not path:
        return None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return Sink.open_append(path)  # appended: a restart never overwrites the last attempt's lines
    except OSError as exc:
        raise ConfigError(f"cannot write the proc log {path}: {exc.strerror}") from None


def resolve_until(host: str, seconds: float) -> str:
    """Worker-0's IP (msrun wants one): retried, since a node's DNS record can lag the pod's start."""
    import socket
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise LaunchTimedOut(
                    f"worker-0's address {host} did not resolve within {seconds:g} s ({exc})",
                    hint="check VC_WORKER_HOSTS and the cluster DNS; MA_RUNTIME_MASTER_RESOLVE_SECONDS sets the wait",
                ) from None
            time.sleep(1.0)


def _worker_env(spec: spec_module.JobSpec, run_id: str) -> Dict[str, str]:
    env = dict(os.environ)
    for name in _EXPORTED:
        value = getattr(spec, name)
        if value is not None:
            env[spec_module.SETTINGS_BY_NAME[name].env] = str(value)
    env[guard_module.LINEAGE_ENV] = guard_module.lineage(os.environ, run_id)
    return env


def _finish(outcome: Outcome, worker: Worker, context: _Context, plan=None) -> int:
    log = logs.get_logger()
    rank, returncode, exit_code = _failed_rank(outcome, worker, plan)
    # The status that explains the exit: the failing rank's when the launcher named one (torchrun's own is 1).
    signal_name = SIGNAL_NAMES.get(-returncode) if returncode < 0 else None
    log.info(
        "command exited",
        exit_code=exit_code,
        returncode=outcome.returncode,
        signal=signal_name,
        pid=worker.pid,
        rank=rank,
        duration_s=round(outcome.duration, 3),
        leftovers=outcome.leftovers,
    )
    split = sum(pump.lines_split for pump in worker.pumps)  # the deciding worker's; the others' are rare
    if split:
        log.warning("lines over the length limit were cut to bound memory", count=split)
    if exit_code != 0:
        reason, category, hint = _explain(outcome, signal_name, exit_code)
        if rank is not None and outcome.stop_signal is None:
            reason = f"rank {rank} failed first: {reason}"
        context.write_termination(
            stage="supervise",
            category=category,
            exit_code=exit_code,
            # The signal that explains the exit code: the stop request, if there was one.
            signal=_stop_name(outcome) or signal_name,
            rank=rank,
            reason=reason,
            hint=hint,
            tail=_tail(worker),
        )
    return exit_code


def _failed_rank(outcome: Outcome, worker: Worker, plan) -> tuple:
    """(rank that failed first or None, its Popen-style status, the job's exit code).

    RTF: the worker that failed first. torchrun: the root cause its summary names, whose status
    replaces torchrun's own 1 (a stop request keeps 128+N)."""
    if outcome.exit_code == 0 or plan is None:
        return None, outcome.returncode, outcome.exit_code
    if plan.method == plan_module.TORCHRUN and outcome.stop_signal is None:
        cause = failures.torchrun_root_cause(_tail(worker, 60))
        if cause is not None and cause.returncode != 0:
            return cause.rank, cause.returncode, exit_code_of_status(cause.returncode)
    failed = getattr(outcome, "failed_worker", None)
    ranks = {planned.name: planned.rank for planned in plan.workers}
    return ranks.get(failed), outcome.returncode, outcome.exit_code


def _stop_name(outcome: Outcome) -> Optional[str]:
    return SIGNAL_NAMES.get(outcome.stop_signal) if outcome.stop_signal else None


def _explain(outcome: Outcome, signal_name: Optional[str], exit_code: int):
    """(reason, category, hint) for a non-zero exit."""
    if outcome.stop_signal is not None:
        stop = SIGNAL_NAMES[outcome.stop_signal]
        if outcome.forced:
            return (
                f"stopped by {stop}; the command did not exit within the grace period and was killed",
                Category.PLATFORM.value,
                "handle SIGTERM in the training code (save and exit), or raise MA_RUNTIME_STOP_GRACE_SECONDS",
            )
        return f"stopped by {stop}", Category.PLATFORM.value, ""
    if signal_name == "SIGKILL":
        return (
            "the command was killed by SIGKILL",
            Category.INFRASTRUCTURE.value,
            "SIGKILL from nobody we know of is often the out-of-memory killer: check memory use",
        )
    if signal_name:
        return f"the command died of {signal_name}", Category.USER.value, "see the last lines of its output"
    return f"the command exited with code {exit_code}", Category.USER.value, "see the last lines of its output"


def _tail(worker: Worker, lines: int = TAIL_LINES) -> List[str]:
    return tail_of(worker.pumps, lines, prefer=worker.stderr_pump)


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

