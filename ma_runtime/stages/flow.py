"""The stages around the attempts, in the order the run takes them: once per run before the first command
(preflight, stage-in, the hooks, the rank table, the launcher's services), before each attempt (the resume
checkpoint, the plan), and between two attempts (the devices released, the backoff, the rank table again).

Each runs in the stage thread (`RunContext.wait_for`), so a SIGTERM ends the run whatever it is blocked in; each
takes the `stopped` event as its last argument.
"""

import dataclasses
import os
import threading
from typing import Any, Mapping, Sequence

from ma_runtime import spec as spec_module
from ma_runtime.errors import PreflightFailed
from ma_runtime.launch import plan as plan_module
from ma_runtime.launch import registry
from ma_runtime.launch.args import build_argv
from ma_runtime.stages.stagein import Staged, stage_in
from ma_runtime.supervise import attempt_processes
from ma_runtime.util import logs


@dataclasses.dataclass
class Prepared:
    """What the stages before the command give every attempt."""

    staged: Staged
    # The environment the plan and the workers start from: the runtime's, with what the hooks (pip, CANN's
    # set_env.sh, ma-pre-start) set and unset; the runtime's own stays as it was.
    environ: Mapping[str, str]
    rank_table: Any = None  # a ranktable.Prepared, when the job has one


def before_the_command(spec: spec_module.JobSpec, first, command: Sequence[str], context,
                       stopped: threading.Event) -> Prepared:
    """Preflight, stage-in, the hooks, the rank table, the launcher's services: once per run."""
    from ma_runtime.stages.hooks import stage as hooks

    log = logs.get_logger()
    context.stage("preflight")
    _preflight(spec, log)
    context.stage("stage-in")
    staged = stage_in(spec, os.environ, log, first.number)  # a later attempt reuses what was staged
    # The hooks see what the command will see (MA_LOG_DIR, VC_TASK_INDEX, the staged channels resolved); a later
    # runtime in this pod (first.number > 1) reuses what the first one installed and its hook exported.
    seen_by_hooks = {**attempt_processes.worker_env(spec, context.run_id, first.number, os.environ), **staged.env}
    context.stage("hooks")
    changes = hooks.run_hooks(spec, seen_by_hooks, command, context.task_log, log, reuse=first.number > 1,
                            exclude=(context.guard.pid,) if context.guard is not None else ())
    rank_table = None
    if spec.waits_for_rank_table:  # imported only then: most jobs have no rank table (start-up budget)
        from ma_runtime.stages import ranktable

        context.stage("rank table")
        rank_table = ranktable.wait_and_convert(spec, os.environ, log)
        staged.env.update(rank_table.env)
    environ = changes.apply(os.environ)
    context.stage("services")
    services_env = attempt_processes.worker_env(spec, context.run_id, first.number, environ)
    _start_services(spec, services_env, log, context, command, stopped)
    return Prepared(staged, environ, rank_table)


def _preflight(spec: spec_module.JobSpec, log) -> None:
    """The node checks, before anything is downloaded or started; a bad node stops here."""
    if not spec.preflight_enabled:
        switch = "MA_SKIP_IMAGE_DETECT=0" if spec.skip_image_detect == "0" else "MA_RUNTIME_PREFLIGHT=off"
        log.info("preflight skipped", reason=switch)
        return
    from ma_runtime.stages.preflight import runner

    report = runner.run(spec, os.environ, runner.select(spec.preflight_checks), log)
    if not report.ok:
        items = report.failed_items()
        raise PreflightFailed(
            f"preflight failed: {', '.join(items)}: {report.failures[0].hint}",
            hint=f"this node cannot run the job; to run anyway set MA_RUNTIME_PREFLIGHT_WARN_ONLY="
            f"{','.join(dict.fromkeys(r.item for r in report.failures))} or MA_RUNTIME_PREFLIGHT=off",
        )


def _start_services(spec: spec_module.JobSpec, environ: Mapping[str, str], log, context, command: Sequence[str],
                    stopped: threading.Event) -> None:
    """What the launcher keeps running for the whole run (mpirun's sshd), after the hooks, whose PATH applies;
    its output on the console and in the task log, like a hook's."""
    sinks = [logs.stderr_sink(), *([context.task_log.as_console()] if context.task_log is not None else [])]
    launcher = registry.launcher(plan_module.choose(spec)[0])
    launcher.start_services(spec, environ, log, stopped, sinks, command=command)


def for_attempt(spec: spec_module.JobSpec, prepared: Prepared, attempt, _stopped: threading.Event) -> Prepared:
    """What attempt N's plan and workers start from: MA_RESUME_CHECKPOINT looked for again (resume.py), since
    the attempt before may have saved a newer checkpoint; `prepared` itself stays as the stages left it."""
    from ma_runtime.stages import resume

    environ = resume.environ_for(spec, prepared.environ, attempt.number, logs.get_logger())
    return dataclasses.replace(prepared, environ=environ)


def plan_attempt(spec: spec_module.JobSpec, command: Sequence[str], prepared: Prepared, attempt,
                 stopped: threading.Event) -> plan_module.Plan:
    """The processes attempt N starts (launch/plan.py); msrun's and mpirun's may wait for peers' names."""
    # Inputs and outputs first, then hyperparameters: the platform's order is unspecified (docs/platform.md, D9).
    argv = build_argv(command, [*prepared.staged.arguments, *spec.hyperparameters])
    log = logs.get_logger()

    # launch/peers.py (sockets, processes) is imported by the launchers that wait for peers, when they do.
    def resolve(*args: Any, **kwargs: Any):
        from ma_runtime.launch import peers

        return peers.resolve_until(*args, seconds=spec.master_resolve_seconds, **kwargs)

    def reach(endpoints):  # mpirun's worker-0 waits for every node's sshd (launch/peers.py)
        from ma_runtime.launch import peers

        return peers.reach_all(endpoints, spec.peer_wait_seconds, log, stopped)

    # What the stages set or changed for the workers: the hooks' exports, stage-in's variables (the runtime's own
    # environment is the baseline they changed, not a setting read).
    exported = {*prepared.staged.env, *(name for name, value in prepared.environ.items()
                                        if os.environ.get(name) != value)}
    plan = plan_module.build(spec, plan_module.Context(argv, prepared.environ, prepared.rank_table, resolve,
                                                       attempt=attempt.number, reach=reach,
                                                       exported=tuple(sorted(exported))))
    for warning in plan.warnings:
        log.warning(warning)
    if attempt.number == attempt.first:  # once per run: every attempt's environment is the same
        for name in plan_module.kept_variables(prepared.environ):
            log.info("the job sets this variable itself: the runtime does not give its own", name=name,
                     value=prepared.environ[name])
    return plan


def between_attempts(spec: spec_module.JobSpec, delay: float, stopped: threading.Event) -> None:
    """Every process of the last attempt is gone; now the accelerators must be free, then the backoff."""
    from ma_runtime.supervise import devices

    if not devices.wait_released(spec, os.environ, spec.device_release_seconds, stopped.wait, logs.get_logger()):
        return  # stopped: the caller has seen the signal
    stopped.wait(delay)


def refresh(spec: spec_module.JobSpec, prepared: Prepared, _stopped: threading.Event) -> Prepared:
    """The rank table again, converted again only if the platform rewrote it; stage-in is not repeated."""
    if prepared.rank_table is None:
        return prepared
    from ma_runtime.stages import ranktable

    if ranktable.unchanged(prepared.rank_table):
        return prepared
    logs.get_logger().info("the rank table changed since the last attempt: converting it again")
    rank_table = ranktable.wait_and_convert(spec, os.environ, logs.get_logger())
    return dataclasses.replace(prepared, staged=dataclasses.replace(
        prepared.staged, env={**prepared.staged.env, **rank_table.env}), rank_table=rank_table)


def hang_config(spec: spec_module.JobSpec):
    """The run's hang detection (None: off)."""
    from ma_runtime.supervise import hang

    return hang.configure(spec, os.environ, logs.get_logger())
