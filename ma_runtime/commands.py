"""The operator commands: `ma-preflight`, `ma-runtime plan`, `ma-runtime ranktable wait|convert`, and
`ma-run --print-config`.

Each reads the same settings as `run` and prints its answer on stdout; none starts the command."""

import json
import os
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ma_runtime import spec as spec_module
from ma_runtime.errors import ConfigError, ExitCode, LaunchTimedOut, RuntimeFailure
from ma_runtime.launch import plan as plan_module
from ma_runtime.launch.args import build_argv
from ma_runtime.launch.peers import resolve_until
from ma_runtime.stages import stagein
from ma_runtime.util import logs
from ma_runtime.util.redact import Masker


def preflight_command(config_file: Optional[str], only: Sequence[str], skip: Sequence[str], as_json: bool,
                      log_results: bool = False) -> int:
    """`ma-preflight`: the checks alone, for operators; the report on stdout. Each result is also a log line on
    stderr, for log collectors, unless stdout is a terminal (a person reads the report there, once) and
    `--log-results` was not given."""
    from ma_runtime.stages.preflight import runner

    masker = Masker.from_environ()
    logs.configure(spec_module.early_log_format(os.environ), masker=masker)
    log = logs.get_logger()
    try:
        spec = spec_module.load({}, os.environ, config_file)
    except ConfigError as failure:
        return _tool_failure(log, failure)
    logs.configure(spec.log_format, spec.log_level, masker)
    spec_module.warn_unknown_variables(log, os.environ)
    if spec.skip_image_detect == "0":
        log.info("MA_SKIP_IMAGE_DETECT=0 turns preflight off in ma-runtime run; running it because it was asked for")
    log_results = log_results or not _is_terminal(sys.stdout)
    report = runner.run(spec, os.environ, runner.select(spec.preflight_checks, only, skip), log, log_results)
    if as_json:
        sys.stdout.write(json.dumps(masker.data(report.to_dict()), indent=2, default=str) + "\n")
    else:
        sys.stdout.write(runner.table(report))
    if not report.ok:
        log.error(f"error,exiting: preflight failed: {', '.join(report.failed_items())}")
    return ExitCode.OK if report.ok else ExitCode.PREFLIGHT_FAILED

def plan_command(flags: Mapping[str, str], config_file: Optional[str], command: Sequence[str], as_json: bool) -> int:
    """`ma-runtime plan`: what `run` would start, on stdout; nothing is started or downloaded."""
    from ma_runtime.stages import ranktable

    masker = Masker.from_environ()
    logs.configure(spec_module.early_log_format(os.environ), masker=masker)
    log = logs.get_logger()
    try:
        spec = spec_module.load(flags, os.environ, config_file)
        if not command:
            raise ConfigError("no command given", hint="usage: ma-runtime plan [--json] [OPTIONS] [--] CMD...")
        logs.configure(spec.log_format, spec.log_level, masker)
        staged = stagein.planned(spec)
        argv = build_argv(command, [*staged.arguments, *spec.hyperparameters])
        context = plan_module.Context(argv, os.environ, ranktable.peek(spec, os.environ), _resolve_once,
                                      attempt=spec.proc_start_cnt, planning=True)
        plan = plan_module.build(spec, context)
    except RuntimeFailure as failure:
        return _tool_failure(log, failure)
    except Exception as exc:  # a bug of ours: still one line and a code
        return _tool_failure(log, RuntimeFailure(f"internal error: {type(exc).__name__}: {exc}"))
    spec_module.warn_unknown_variables(log, os.environ)
    for warning in plan.warnings:  # on stderr too: `--json` readers see the document, people see this
        log.warning(warning)
    document = masker.data(plan.to_dict())
    sys.stdout.write(json.dumps(document, indent=2) + "\n" if as_json else plan_module.render(document))
    return ExitCode.OK

def _resolve_once(host: str) -> str:
    """One lookup, no waiting: a plan shows the host name when it does not resolve yet."""
    try:
        return resolve_until(host, seconds=0)
    except LaunchTimedOut:
        return host

def ranktable_wait_command(path: Optional[str], timeout: Optional[float]) -> int:
    """`ma-runtime ranktable wait`: the table's path on stdout once it says completed."""
    from ma_runtime.stages.ranktable import convert as table_convert
    from ma_runtime.stages.ranktable import wait as table_wait

    log, spec = _tool_setup()
    if spec is None:
        return ExitCode.BAD_CONFIGURATION
    configured = path or (str(spec.ranktable_file) if spec.ranktable_file else "")
    if not configured:
        return _tool_failure(log, ConfigError("no rank table to wait for",
                                              hint="give PATH, or set RANK_TABLE_FILE"))
    source = table_wait.locate(configured)
    try:
        text = table_wait.wait(source, spec.ranktable_timeout if timeout is None else timeout, log)
        table_convert.read_any(text, str(source))  # completed, and usable
    except RuntimeFailure as failure:
        return _tool_failure(log, failure)
    sys.stdout.write(f"{source}\n")
    return ExitCode.OK

def ranktable_convert_command(source_text: str, output: Optional[str]) -> int:
    """`ma-runtime ranktable convert IN [OUT]`: template one to OUT (atomically) or stdout."""
    from ma_runtime.stages.ranktable import convert as table_convert
    from ma_runtime.stages.ranktable import wait as table_wait

    log, spec = _tool_setup()
    if spec is None:
        return ExitCode.BAD_CONFIGURATION
    source = table_wait.locate(source_text)
    try:
        # read_table: bounded, a FIFO or device refused; write_atomically: never over what is not a file.
        document = table_convert.read_any(table_wait.read_table(source), str(source)).template_one()
        if output:
            table_convert.write_atomically(Path(output), document)
        else:
            sys.stdout.write(table_convert.layout(document))
    except RuntimeFailure as failure:
        return _tool_failure(log, failure)
    return ExitCode.OK

def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or replaced by something that is no file
        return False


def _tool_setup():
    """Logging and the job settings for an operator's tool; (log, None) after a bad-configuration line."""
    masker = Masker.from_environ()
    logs.configure(spec_module.early_log_format(os.environ), masker=masker)
    log = logs.get_logger()
    try:
        spec = spec_module.load({}, os.environ)
    except ConfigError as failure:
        _tool_failure(log, failure)
        return log, None
    logs.configure(spec.log_format, spec.log_level, masker)
    spec_module.warn_unknown_variables(log, os.environ)
    return log, spec

def _tool_failure(log, failure: RuntimeFailure) -> int:
    log.error(f"error,exiting: {failure.reason}", hint=failure.hint or None, exit_code=int(failure.exit_code))
    return int(failure.exit_code)


def print_config(spec: spec_module.JobSpec, command: Sequence[str], masker: Masker) -> None:
    """`ma-run --print-config`: the resolved settings with their sources, the channels and the argv, as JSON."""
    document = {
        "settings": spec.settings(),
        "sources": dict(spec.sources),
        "config_file": str(spec.config_file) if spec.config_file else None,
        "hyperparameters": dict(spec.hyperparameters),
        "code": {"url": spec.code_url, "path": str(stagein.code_dir(spec))}
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
