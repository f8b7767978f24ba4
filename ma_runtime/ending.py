"""The end of an attempt and of the run: the attempt's verdict and its `command exited` line; the job's verdict as the
termination message's fields (the last attempt's, or 82 when restarts did not help), or a failure of the runtime's
own; the termination message; the final sync, and what an incomplete one makes of the verdict (a success becomes
80). The run's state (spec, uploader, task log, the Kubernetes message taken before the command) is the
`RunContext`'s; the functions that take one write files and run the sync, the others are pure but for log lines.
"""

import time
from typing import Any, Dict, List, Optional

from ma_runtime import termination
from ma_runtime import verdict as verdict_module
from ma_runtime.errors import Category, ConfigError, ExitCode, RuntimeFailure
from ma_runtime.launch import plan as plan_module
from ma_runtime.launch import registry
from ma_runtime.process.worker import SIGNAL_NAMES
from ma_runtime.supervise.supervisor import Outcome
from ma_runtime.util import logs

# The files a final sync missed, one log line each, up to this many (the termination message lists them too).
MAX_UNSYNCED_LINES = 50


def attempt_verdict(outcome: Outcome, plan: plan_module.Plan, attempt) -> verdict_module.Verdict:
    """The attempt's verdict, and its `command exited` line."""
    log = logs.get_logger()
    launcher = registry.launcher(plan.method)
    verdict = verdict_module.of(outcome, plan, launcher.root_cause, launcher.OWN_CODE_AFTER_STOP)
    worker = outcome.worker
    log.info(
        "command exited",
        exit_code=verdict.exit_code,
        returncode=outcome.returncode,
        signal=SIGNAL_NAMES.get(-verdict.returncode) if verdict.returncode < 0 else None,
        pid=worker.pid,
        rank=verdict.rank,
        duration_s=round(outcome.duration, 3),
        leftovers=outcome.leftovers,
        attempt=attempt.number,
    )
    split = sum(pump.lines_split for pump in worker.pumps)  # the deciding worker's; the others' are rare
    if split:
        log.warning("lines over the length limit were cut to bound memory", count=split)
    return verdict


def job_fields(verdict: verdict_module.Verdict, decision, history: List[verdict_module.Verdict],
               attempt) -> Dict[str, Any]:
    """The job's verdict from the last attempt's and the decision (82 when the runtime gave up restarting), as the
    termination message's fields; only `exit_code` and `attempt` for a success."""
    final = verdict_module.gave_up(verdict, decision.why) if decision.gave_up else verdict
    if decision.gave_up:
        logs.get_logger().error(f"error,exiting: {final.reason}", hint=final.hint, stage="supervise",
                                exit_code=final.exit_code, attempts=len(history))
    elif decision.why and verdict.exit_code != 0:
        logs.get_logger().info("not restarting", reason=decision.why)
    fields: Dict[str, Any] = dict(exit_code=0, attempt=attempt.number)
    if final.exit_code != 0:
        numbers = range(attempt.number - len(history) + 1, attempt.number + 1)
        fields = dict(
            stage="supervise",
            category=final.category,
            exit_code=final.exit_code,
            signal=final.signal,
            rank=final.rank,
            reason=final.reason,
            hint=final.hint,
            tail=list(final.tail),
            attempt=attempt.number,
            command_exit_code=verdict.exit_code if decision.gave_up else None,
            attempts=[v.summary(n) for v, n in zip(history, numbers)] if len(history) > 1 or decision.gave_up
            else None,
        )
    return fields


def after_incomplete_sync(fields: Dict[str, Any], unsynced: List[str], result, deadline_s: float,
                           log) -> Dict[str, Any]:
    """Logs what the final sync missed (`elapsed_s`: how long it took; `deadline_s`: MA_RUNTIME_FINAL_SYNC_SECONDS);
    a job that had succeeded becomes exit 80 (its outputs would be lost), any other keeps its own verdict. Returns
    the termination message's fields."""
    log.warning("final sync incomplete", missing=len(result.missing) if result.answered else "unknown",
                error=result.error, elapsed_s=result.seconds, deadline_s=deadline_s)
    for entry in unsynced[:MAX_UNSYNCED_LINES]:
        log.warning("not synced", file=entry)
    if fields["exit_code"] != 0:
        return fields
    fields = dict(
        stage="sync", category=Category.INFRASTRUCTURE.value, exit_code=int(ExitCode.STORAGE_FAILED),
        reason=unsynced_reason(unsynced, result, deadline_s),
        hint="the command succeeded but its outputs are not all in the store: check the endpoint and the "
             "credentials, or give the final sync more time (MA_RUNTIME_FINAL_SYNC_SECONDS)",
        attempt=fields.get("attempt"))
    log.error(f"error,exiting: {fields['reason']}", stage="sync", exit_code=fields["exit_code"])
    return fields


def unsynced_reason(unsynced: List[str], result, deadline_s: float) -> str:
    """`outputs not synced: 3 file(s) did not reach the store within ...: train_url: a.pt, ...`."""
    from ma_runtime.sync.targets import LOG_CHANNEL

    what = "logs" if all(entry.startswith(f"{LOG_CHANNEL}: ") for entry in unsynced) else "outputs"
    if not result.answered:
        reason = f"{what} not synced: the final sync did not finish"
    else:
        shown = ", ".join(unsynced[:3]) + (f", and {len(unsynced) - 3} more" if len(unsynced) > 3 else "")
        # Not the deadline's fault when the endpoint never answered (storage/reach.py): the error says so.
        within = "" if result.dead else f" within MA_RUNTIME_FINAL_SYNC_SECONDS={deadline_s:g}"
        reason = f"{what} not synced: {len(unsynced)} file(s) did not reach the store{within}: {shown}"
    return reason + (f" ({result.error})" if result.error else "")


def fail(context, failure: RuntimeFailure) -> int:
    """The run ends on a failure of its own (bad input, a stage that failed, a stop before the command ran): one
    line, the termination message, the final sync of what there is. Returns the exit code."""
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
        attempt=context.attempt.number if context.attempt else None,
        tail=getattr(failure, "tail", None),  # a hook's last lines
        hook_exit_code=getattr(failure, "hook_exit_code", None),
    )
    write_termination(context, **fields)
    if isinstance(failure, ConfigError) and context.uploader is None:
        return int(failure.exit_code)  # a bad job file or setting: nothing ran, and the sync's settings may be bad
    return sync_at_end(context, fields, None)


def finish(context, verdict: verdict_module.Verdict, decision, history: List[verdict_module.Verdict], attempt,
           outcome: Outcome, job: Optional[Dict[str, Any]] = None) -> int:
    """The job's exit code and termination message, from the last attempt's verdict and the decision; then the
    final sync, which can turn a success into 80. `job`: the termination message's `origin` and `secondary` of a
    multi-node job whose attempt failed somewhere (coordinator.Agreement.fields)."""
    fields = job_fields(verdict, decision, history, attempt)
    if fields["exit_code"] != 0 and job:
        fields.update(job)
    if fields["exit_code"] != 0:
        write_termination(context, **fields)
    return sync_at_end(context, fields, outcome.stop_requested_at, outcome.workers_stopped_at)


def sync_at_end(context, fields: Dict[str, Any], stop_requested_at: Optional[float],
                workers_stopped_at: Optional[float] = None) -> int:
    """The final sync (its deadline counted from the stop request, when there was one), after the termination
    message was written (so that it goes up first). What did not make it turns a success into 80, and is
    listed in the message either way. `workers_stopped_at` (time.time()): the workers were stopped then, so
    what they were writing must not replace what the store has. Returns the exit code."""
    spec = context.spec
    if spec is None or context.synced:
        return fields["exit_code"]
    context.synced = True
    if context.uploader is None and not spec.syncs:
        return fields["exit_code"]
    from ma_runtime.sync import control, targets

    try:
        targets.of(spec)
    except ConfigError:
        return fields["exit_code"]  # the failure being reported is that one
    log = logs.get_logger()
    deadline = (stop_requested_at or time.monotonic()) + spec.sync_final_seconds
    result = _skipped_without_uploader(spec)
    if result is None:
        if context.uploader is None:
            context.uploader = control.Uploader(spec, log)
        result = context.uploader.final(deadline, stopped_at=workers_stopped_at)
    if result.complete:
        log.info("final sync completed", elapsed_s=result.seconds, files=result.files, bytes=result.bytes)
        _sync_logs_again(context, deadline)
        return fields["exit_code"]
    # The skipped channels' files when the uploader could list them, else the channels (the command never ran).
    unsynced = result.unsent or [f"{name}: (every file: its endpoint never answered)" for name in result.skipped]
    if result.skipped:
        fields = after_skipped_sync(fields, result, log)
    if result.missing or not result.answered:
        unsynced += result.missing or [f"(unknown: {result.error})"]
        fields = after_incomplete_sync(fields, unsynced, result, spec.sync_final_seconds, log)
    write_termination(context, **fields, unsynced=unsynced)
    if context.uploader is not None:
        _sync_logs_again(context, deadline)
    return fields["exit_code"]


def _skipped_without_uploader(spec):
    """The final sync's result when every channel goes to an endpoint the run found dead (storage/reach.py):
    nothing to try, so no uploader is started; None otherwise."""
    from ma_runtime.storage import reach
    from ma_runtime.sync import control, targets

    dead = reach.dead()
    if not dead:
        return None
    from ma_runtime.storage.stores import endpoint_of

    every, remote = targets.of(spec), targets.remote(targets.of(spec))
    endpoint = endpoint_of(spec)
    if len(remote) < len(every) or endpoint not in dead:
        return None
    return control.FinalResult(dead=dead, skipped={target.name: endpoint for target in remote})


def after_skipped_sync(fields: Dict[str, Any], result, log) -> Dict[str, Any]:
    """One line: the channels the final sync did not try, their endpoint and why the run found it dead. A job that
    had succeeded becomes exit 80, the reason naming the endpoint and the cause; a failed one keeps its verdict (its
    own error line already said what failed: this line is then for information)."""
    endpoints = sorted(set(result.skipped.values()))
    causes = "; ".join(f"{endpoint}: {result.dead.get(endpoint, 'never answered')}" for endpoint in endpoints)
    names = ", ".join(result.skipped)
    failed = fields["exit_code"] != 0
    (log.info if failed else log.warning)("final sync skipped: the endpoint cannot be used in this run", channels=names,
                                          files=len(result.unsent) if result.unsent else None,
                                          endpoint=", ".join(endpoints), error=causes)
    if failed:
        return fields
    from ma_runtime.storage.base import dead_hint

    fields = dict(
        stage="sync", category=Category.INFRASTRUCTURE.value, exit_code=int(ExitCode.STORAGE_FAILED),
        reason=f"outputs not synced ({names}): the endpoint never answered in this run ({causes})",
        hint=dead_hint(endpoints[0]), attempt=fields.get("attempt"))
    log.error(f"error,exiting: {fields['reason']}", hint=fields["hint"], stage="sync", exit_code=fields["exit_code"])
    return fields


def _sync_logs_again(context, deadline: float) -> None:
    """The log lines since, and the termination message as it now is, if time is left."""
    if time.monotonic() < deadline and context.spec.log_url:
        context.uploader.final(deadline, scope="logs")


def write_termination(context, **fields) -> None:
    # Without a usable log directory (bad configuration), only Kubernetes' copy.
    log_copy = context.spec.termination_path if context.spec and context.task_log else None
    message = termination.build(masker=context.masker, run_id=context.run_id, **fields)
    try:
        kept = not termination.write(message, log_copy, context.k8s_path, context.k8s_before)
    except OSError as exc:
        logs.get_logger().warning("could not write the termination message", error=str(exc))
        return
    if kept:
        logs.get_logger().info("kept the termination message the command wrote", path=str(context.k8s_path))
