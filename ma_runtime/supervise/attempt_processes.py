"""One attempt's processes, as torch elastic's `PContext` beside its agent: the plan's workers spawned with their
output's destinations (the console, the task log, their proc logs, the progress pattern), the files they read
first, the hang watch, msrun's rank logs followed; then the supervisor, until every process is gone: the
attempt's `Outcome`. The attempt loop (bootstrap) decides what comes before and after; this runs one attempt.
"""

import functools
import os
import signal
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from ma_runtime import __version__
from ma_runtime import spec as spec_module
from ma_runtime.errors import ConfigError
from ma_runtime.launch import plan as plan_module
from ma_runtime.launch import registry
from ma_runtime.launch.base import common_env
from ma_runtime.process.worker import LINEAGE_ENV, Worker, spawn
from ma_runtime.spec.table import EXPORTED
from ma_runtime.supervise import guard as guard_module
from ma_runtime.supervise.pid1 import is_pid1
from ma_runtime.supervise.supervisor import Outcome, Supervisor
from ma_runtime.util import logs
from ma_runtime.util.output import Sink


class _HangWatch:
    """One attempt's hang monitor, and what the workers need for it: the stack-dump registration in their
    environment, the progress pattern among their output's destinations."""

    def __init__(self, spec: spec_module.JobSpec, config, attempt, log):
        from ma_runtime.supervise import devices, hang
        from ma_runtime.supervise.stacks import dumps, registry

        self.stack_registration = registry  # the module: the workers' registration, and its clean-up
        self.registry: Optional[Path] = None  # this attempt's registration folder, when stacks are taken
        if config.stacks:
            try:
                self.registry = registry.registry_dir(spec.state_dir, attempt.run_id, attempt.number)
            except OSError as exc:  # a read-only state folder costs the stacks, not the job
                log.warning("no stacks for a hung attempt: cannot create the stack-dump folder",
                            path=str(spec.state_dir / "stacks"), error=exc.strerror or str(exc))
        out_dir = spec.log_dir / f"{spec.log_stem}-stacks" / f"attempt-{attempt.number}"
        where = functools.partial(dumps.dump, self.registry, out_dir, log=log) if self.registry else None
        self.monitor = hang.Monitor(config, functools.partial(devices.utilisation, spec, os.environ), log, where)
        sink = self.monitor.sink()
        self.sinks = [sink] if sink is not None else []

    def env(self, base: Mapping[str, str]) -> Dict[str, str]:
        return self.stack_registration.worker_env(self.registry, base) if self.registry is not None else {}

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()  # the progress pattern's matcher process ends with its attempt
        if self.registry is not None:
            self.stack_registration.clean(self.registry)


def run_attempt(spec: spec_module.JobSpec, plan: plan_module.Plan, attempt, context, environ: Mapping[str, str],
                staged_env: Mapping[str, str], hangs=None, job=None) -> Outcome:
    """One attempt: spawn every planned worker and supervise them until all have exited and nothing is left.
    `context` is the run's (bootstrap's): its run id, signal queue, guard, task log and uploader. `environ` is
    what the stages made of the runtime's environment, `staged_env` stage-in's variables (they win). `job`: the
    job across nodes for the supervisor (together.Watch), None when this node is alone."""
    log = logs.get_logger()
    launcher = registry.launcher(plan.method)
    follower = None
    opened: List[Sink] = []  # the attempt's proc logs
    watch = _HangWatch(spec, hangs, attempt, log) if hangs is not None else None
    try:
        # Logged before the spawn, so that it precedes the command's output everywhere.
        log.info(
            "starting command",
            version=__version__,
            argv=list(plan.workers[0].argv),
            method=plan.method,
            processes=len(plan.workers),
            pid1=is_pid1(),
            run_id=context.run_id,
            attempt=attempt.number,
            task_log=str(spec.task_log_path),
        )
        base_env = {**worker_env(spec, context.run_id, attempt.number, environ), **staged_env}
        extra = watch.sinks if watch is not None else []
        if watch is not None:
            base_env.update(watch.env(base_env))
        follower = _follow_rank_logs(launcher.rank_logs(plan), context, extra)
        if context.uploader is not None and attempt.number > 1:
            context.uploader.stopping(None)  # the last attempt's stop is over: this one's files are its own
        workers = _spawn_all(plan, base_env, context, attempt, opened, extra)
        return Supervisor(workers if len(workers) > 1 else workers[0], context.signals, spec.stop_grace_seconds,
                          log, guard=context.guard, forwards=launcher.forwards_to,
                          hangs=watch.monitor if watch is not None else None,
                          on_stop=context.uploader.stopping if context.uploader is not None else None,
                          job=job).run()
    finally:
        if watch is not None:
            watch.close()
        if follower is not None:
            follower.stop()
        for sink in opened:
            sink.close()


def _spawn_all(plan, base_env: Mapping[str, str], context, attempt, opened: List[Sink],
               extra_sinks: Sequence[Sink] = ()) -> List[Worker]:
    """One process per planned worker; several get a rank prefix on the console and in the task log, and a
    proc log of their own with their raw lines (`opened`, for the caller to close). Each holds the guard's
    mark (`guard.pass_fds`). `extra_sinks` get every worker's raw output too (the progress pattern)."""
    guard = context.guard
    several = len(plan.workers) > 1
    # One Sink object per destination, shared by every worker: its lock keeps lines whole across ranks.
    stdout, stderr = Sink(1, "<stdout>"), logs.stderr_sink()
    task_log = context.task_log.as_console() if several else context.task_log
    workers: List[Worker] = []
    _write_files(plan)
    try:
        for planned in plan.workers:
            proc_log = _proc_log(planned, attempt)
            own = [proc_log] if proc_log else []
            opened.extend(own)
            extra = [*own, *extra_sinks]
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


def _follow_rank_logs(folder: Optional[str], context, extra_sinks: Sequence[Sink] = ()):
    """A launcher that writes each rank's output to a file only (msrun): follow those onto the console and
    the task log (and `extra_sinks`: the progress pattern)."""
    if not folder:
        return None
    from ma_runtime.supervise.follow import LogFollower

    follower = LogFollower(Path(folder), [Sink(1, "<stdout>"), context.task_log, *extra_sinks])
    follower.start()
    return follower


def _write_files(plan) -> None:
    """The files the plan's processes read (mpirun's hostfile), whole before any starts."""
    from ma_runtime.util.files import write_atomically

    for planned in plan.workers:
        for path, text in planned.files.items():
            try:
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                write_atomically(path, text)
            except OSError as exc:
                raise ConfigError(f"cannot write {path}: {exc.strerror or exc}",
                                  hint="the runtime's state folder in MA_MOUNT_PATH must be writable") from None


def _proc_log(planned, attempt) -> Optional[Sink]:
    path = planned.logs.get("proc")
    if not path:
        return None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        sink = Sink.open_append(path)  # appended: a restart never overwrites the last attempt's lines
    except OSError as exc:
        raise ConfigError(f"cannot write the proc log {path}: {exc.strerror}") from None
    # One line where each attempt starts, so that a reader of the appended file can tell them apart.
    sink.write(f"==== ma-runtime: attempt {attempt.number} (run {attempt.run_id}) ====\n".encode())
    return sink


def worker_env(spec: spec_module.JobSpec, run_id: str, attempt: int, environ: Mapping[str, str]) -> Dict[str, str]:
    """What every process of attempt `attempt` gets (the hooks see it too): `environ`, the exported settings
    resolved under their variables' names (the table's `exported` rows: the command sees the job the runtime saw),
    the attempt's own variables as every launcher's plan gives them (MA_PROC_START_CNT: launch/base.common_env)
    and the runtime's lineage."""
    env = dict(environ)
    for setting in EXPORTED:
        value = getattr(spec, setting.name)
        if value is not None:
            env[setting.env] = str(value)
    env.update(common_env(spec, attempt))
    env[LINEAGE_ENV] = guard_module.lineage(os.environ, run_id)
    return env
