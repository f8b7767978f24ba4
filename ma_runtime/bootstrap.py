"""`ma-runtime run`: the flow of docs/architecture.md, read top to bottom like tini's main().

One signal regime from the first line to the exit: the `SignalQueue` the CLI installs before anything
else turns every signal into a number this thread reads. Before the command starts, the stages run in a
thread of their own while this one waits on the queue (`RunContext.wait_for`): a SIGTERM or SIGINT ends the
run at once with 128+N, whatever the stage is blocked in (a stalled socket read, the rank-table wait).
While workers run, the supervisor reads the queue (forward once, grace, kill). Between attempts the
device wait and the backoff are waited for the same way. Once the verdict is decided, signals are still
only numbers in a pipe that nobody reads: a late SIGTERM, SIGINT or SIGHUP changes nothing, and the
termination message is written.

Where each part lives: the stages around the attempts in stages/flow.py, one attempt's processes in
supervise/attempt_processes.py, the restart policy in attempt.py, the job-wide decision in coordinator.py, the
verdicts, the termination message and the final sync in ending.py, the shared state in run_context.py.
"""

import dataclasses
import functools
import os
from typing import List, Mapping, Optional, Sequence

from ma_runtime import attempt as attempt_module
from ma_runtime import coordinator, ending
from ma_runtime import spec as spec_module
from ma_runtime import verdict as verdict_module
from ma_runtime.errors import ConfigError, ExitCode, RuntimeFailure
from ma_runtime.run_context import RunContext
from ma_runtime.stages import flow
from ma_runtime.supervise import attempt_processes
from ma_runtime.supervise.signals import SignalQueue
from ma_runtime.supervise.supervisor import State
from ma_runtime.util import logs
from ma_runtime.util.redact import Masker


def run(flags: Mapping[str, str], config_file: Optional[str], command: Sequence[str], print_config: bool,
        signals: Optional[SignalQueue] = None) -> int:
    signals = signals or SignalQueue()  # the CLI installs it first thing; a caller in Python may not have
    masker = Masker.from_environ()
    logs.configure(spec_module.early_log_format(os.environ), masker=masker)
    log = logs.get_logger()
    context = RunContext(masker, signals)
    try:
        spec = spec_module.load(flags, os.environ, config_file)
        if print_config:
            from ma_runtime import commands

            commands.print_config(spec, command, masker)
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
        spec_module.warn_unknown_variables(log, os.environ)
        context.start_guard()  # before any thread: the guard is a fork of this process
        context.job = coordinator.for_job(spec, log)  # worker-0's store is up before its stages: others report
        first = attempt_module.first(spec, context.run_id, log)
        prepared = context.wait_for(functools.partial(flow.before_the_command, spec, first, command, context),
                                    "before the command started")
        return _attempts(spec, command, context, prepared, first)
    except RuntimeFailure as failure:
        return ending.fail(context, failure)
    except Exception as exc:  # a bug of ours: still one line, a code, and a message
        return ending.fail(context, RuntimeFailure(
            f"internal error: {type(exc).__name__}: {exc}",
            hint="please report this with the task log; the command's own exit code was not available",
        ))
    finally:
        context.close()


def _attempts(spec: spec_module.JobSpec, command: Sequence[str], context: RunContext, prepared: flow.Prepared,
              attempt: attempt_module.Attempt) -> int:
    """The attempt loop (torch elastic's `_invoke_run`): plan, launch and supervise attempt N, get its verdict,
    then decide, with the job (coordinator.py): done, or restart (after the devices are released and the
    backoff), or give up (82)."""
    log = logs.get_logger()
    policy = attempt_module.Policy.of(spec)
    job = context.job
    history: List[verdict_module.Verdict] = []
    when = "before the command started"
    hangs = flow.hang_config(spec)
    while True:
        # Every node ready before any starts (a replacement pod takes the job's attempt number here).
        attempt = context.wait_for(functools.partial(job.barrier, attempt), when)
        # In the stage thread: the resume checkpoint is a walk of the output folders, and msrun's plan may wait
        # for worker-0's name to resolve.
        current = context.wait_for(functools.partial(flow.for_attempt, spec, prepared, attempt), when)
        plan = context.wait_for(functools.partial(flow.plan_attempt, spec, command, current, attempt), when)
        context.attempt = attempt
        context.record_attempt()
        context.start_uploader()
        watch = job.watch(attempt, plan, context.signals.wake)
        try:
            outcome = attempt_processes.run_attempt(spec, plan, attempt, context, current.environ,
                                                    current.staged.env, hangs, watch)
        finally:
            if watch is not None:
                watch.close()
        verdict = ending.attempt_verdict(outcome, plan, attempt)
        history.append(verdict)
        decision = policy.decide(attempt, verdict, history, outcome.stop_requested_at is not None)
        agreed = context.wait_for(functools.partial(job.agree, attempt, verdict, decision),
                                  f"after attempt {attempt.number}")
        verdict, decision = agreed.verdict, agreed.decision
        history[-1] = verdict
        if not decision.restart:
            job.leave(attempt, stopped=outcome.stop_requested_at is not None)
            return ending.finish(context, verdict, decision, history, attempt, outcome, agreed.fields())
        log.info("restarting command", attempt=attempt.number + 1, reason=verdict.reason,
                 **{"hang_restarts_left" if verdict.state is State.HUNG else "restarts_left": decision.left},
                 backoff_s=decision.delay)
        when = f"between attempts {attempt.number} and {attempt.number + 1}"
        context.wait_for(functools.partial(flow.between_attempts, spec, decision.delay), when)
        prepared = context.wait_for(functools.partial(flow.refresh, spec, prepared), when)
        attempt = dataclasses.replace(attempt, number=attempt.number + 1)
