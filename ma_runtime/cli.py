"""Argument parsing only: `ma-runtime`, and `ma-run` (= `ma-runtime run`).

`ma-run [OPTIONS] [--] CMD...`: the first word that is not one of our options
starts the command, so `ma-run python train.py --lr 1` never mistakes `--lr`
for ours. Usage errors print one line and exit with "bad configuration".
"""

import os
import sys


def _reopen_closed_descriptors() -> None:
    """A closed standard descriptor (`ma-run ... 2>&-`) is reopened on /dev/null before anything else opens a
    file: the next descriptor made would take its number, and the signal queue's pipe as fd 1 got the command's
    forwarded output, read back as signal numbers (`O`, 79: killpg failed, exit 70)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself, once lower ones exist
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


_reopen_closed_descriptors()


def _runs_a_command(argv: list) -> bool:
    """`ma-run ...`, `ma-runtime run ...` or `python -m ma_runtime run ...`: not an operator command."""
    return os.path.basename(argv[0]) == "ma-run" or argv[1:2] == ["run"]


# ma-run's signal regime starts here, before the imports below (tens of milliseconds): as PID 1 the
# kernel drops a signal that has no handler, and a SIGTERM in that window would be lost.
if _runs_a_command(sys.argv):
    from ma_runtime.supervise.signals import SignalQueue

    _SIGNALS: "Optional[SignalQueue]" = SignalQueue()
else:
    _SIGNALS = None

import signal  # noqa: E402 - after the signal queue, on purpose
from typing import TYPE_CHECKING, Any, List, NoReturn, Optional, Sequence, Tuple  # noqa: E402

from ma_runtime import __version__  # noqa: E402
from ma_runtime.errors import ExitCode  # noqa: E402
from ma_runtime.setting import BadValue, shown  # noqa: E402
from ma_runtime.spec.jobfile import CONFIG_ENV  # noqa: E402
from ma_runtime.spec.table import SETTINGS, parse_check_names, parse_seconds  # noqa: E402

if TYPE_CHECKING:
    import argparse

_EXIT_CODES = "\n".join(
    f"  {int(code):>3}  {code.name.lower().replace('_', ' ')}" for code in ExitCode if code != ExitCode.OK
)
_RUN_EPILOG = f"""\
the command's own exit code passes through; death by signal N gives 128+N.
exit codes of the runtime itself:
{_EXIT_CODES}

every option can also be set by its environment variable (shown as the
metavar) or by the same key in the job file; flags > env > file > defaults.
the options above are the common ones: every setting (OBS stage-in and
sync: MA_RUNTIME_CODE_URL, MA_RUNTIME_LOG_URL, the job file's inputs and
outputs, the credentials; hang detection, hooks, each launcher's own) is in
docs/reference/settings.md; `ma-runtime plan -- CMD` shows what a run
would start.
"""


def new_parser(**settings: Any) -> "argparse.ArgumentParser":
    """An argparse parser with one-line errors and the "bad configuration" exit code.

    argparse (and the gettext it imports) is imported here, not with this module: a run with no option of ours
    before its command (`ma-run CMD`, `ma-runtime run -- CMD`) builds no parser at all (run_main)."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:
            # The first unknown word, if any has letters (an empty argument is unknown too, and has none).
            words = message.split(": ", 1)[1].split() if message.startswith("unrecognized arguments: ") else []
            if words and words[0].startswith("--"):
                message += _did_you_mean(self, words[0].split("=", 1)[0])
            sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
            sys.exit(ExitCode.BAD_CONFIGURATION)

    return Parser(**settings)


def _did_you_mean(parser: "argparse.ArgumentParser", option: str) -> str:
    """` (did you mean --max-restarts?)` for an option that misspells one of the parser's, else nothing."""
    from ma_runtime.setting import closest

    close = closest(option, (known for known in parser._option_string_actions if known.startswith("--")))
    return f" (did you mean {close}?)" if close else ""


def _run_parser(prog: str) -> "argparse.ArgumentParser":
    import argparse

    parser = new_parser(
        prog=prog,
        usage=f"{prog} [OPTIONS] [--] CMD...",
        description="Run CMD as a supervised training command (PID-1 duties, logs, exit codes).",
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="FILE", help=f"YAML job file (env {CONFIG_ENV})")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved job settings as JSON (secrets masked) and exit"
    )
    for setting in SETTINGS:
        if setting.cli:
            parser.add_argument(setting.flag, dest=setting.name, metavar=setting.env, help=setting.help)
    return parser


def plan_main(argv: Sequence[str]) -> int:
    parser = _run_parser("ma-runtime plan")
    parser.usage = "ma-runtime plan [--json] [OPTIONS] [--] CMD..."
    parser.description = ("Print the processes `ma-runtime run` would start for CMD (launcher, argv, environment "
                          "added, working directory, log files), secrets masked; nothing is started or downloaded.")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    ours, command = split_command(parser, argv)
    options = parser.parse_args(ours)
    flags = {s.name: getattr(options, s.name) for s in SETTINGS if getattr(options, s.name, None) is not None}
    from ma_runtime import commands

    return commands.plan_command(flags, options.config, command, options.json)


def split_command(parser: "argparse.ArgumentParser", argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(our options, the command): the command starts at `--` or at the first non-option."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if not word.startswith("-") or word == "-":
            return list(argv[:i]), list(argv[i:])
        option = word.split("=", 1)[0]
        action = parser._option_string_actions.get(option)
        if action is None:
            parser.error(f"unknown option {option}{_did_you_mean(parser, option)}; put the command after -- if it is "
                         "the command's")
        takes_value = action.nargs != 0 and "=" not in word
        i += 2 if takes_value else 1
    return list(argv), []


def run_main(argv: Sequence[str], prog: str) -> int:
    # The one signal regime: a SIGTERM from the queue's start to the exit is a number in a queue, never
    # lost (PID 1 drops a signal it has no handler for) and never an exception in the middle of a stage.
    from ma_runtime.supervise.signals import SignalQueue

    signals = _SIGNALS or SignalQueue()
    if argv and argv[0].startswith("-") and argv[0] not in ("-", "--"):
        parser = _run_parser(prog)
        ours, command = split_command(parser, argv)
        options = parser.parse_args(ours)
        flags = {s.name: getattr(options, s.name) for s in SETTINGS if getattr(options, s.name, None) is not None}
        config, print_config = options.config, options.print_config
    else:
        # No option of ours before the command (split_command's first word): what parsing nothing gives, without
        # importing argparse or building the parser (milliseconds of every container's start).
        command = list(argv[1:] if argv[:1] == ["--"] else argv)
        flags, config, print_config = {}, None, False
    # Imported here: `ma-runtime version` and `--help` should not pay for structlog and the run's modules.
    from ma_runtime import bootstrap

    return bootstrap.run(flags, config, command, print_config, signals)


def _top_parser() -> "argparse.ArgumentParser":
    parser = new_parser(
        prog="ma-runtime",
        description="The first program in a ModelArts-style training container.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"ma-runtime {__version__}")
    commands = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
    commands.add_parser("run", help="run a command under supervision (same as ma-run)", add_help=False)
    commands.add_parser("version", help="print the version and exit")
    commands.add_parser("preflight", help="run the node checks alone (same as ma-preflight)", add_help=False)
    commands.add_parser("ranktable", help="wait for the HCCL rank table, or convert it to template one",
                        add_help=False)
    commands.add_parser("plan", help="print the processes `run` would start for CMD, without starting them",
                        add_help=False)
    commands.add_parser("manifest", help="print the Volcano Job for CMD (manifest volcano)", add_help=False)
    commands.add_parser("local", help="rehearse a multi-node job on this machine (namespaces, a local object "
                        "store, faults)", add_help=False)
    return parser


def _ranktable_parser() -> "argparse.ArgumentParser":
    parser = new_parser(
        prog="ma-runtime ranktable",
        description="The HCCL rank table (jobstart_hccl.json): wait for status=completed, or convert template two "
        "to template one.",
        epilog="exit 0 on success, 78 for a malformed or inconsistent table, 81 when the wait timed out.",
        allow_abbrev=False,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    wait = actions.add_parser(
        "wait", help="wait until the table says status=completed; print its path",
        description="Wait until the rank table says status=completed, then print its path. PATH is the file or "
        "the directory holding jobstart_hccl.json (default: $RANK_TABLE_FILE). A missing, empty or half-written "
        "file is waited on until the timeout.",
    )
    wait.add_argument("path", nargs="?", metavar="PATH", help="file or directory (default: $RANK_TABLE_FILE)")
    wait.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                      help="how long to wait (default: $MA_RUNTIME_RANKTABLE_TIMEOUT, else 1800)")
    convert = actions.add_parser(
        "convert", help="template two -> template one (a template-one input is validated and printed)",
        description="Convert a template-two rank table to template one, validating it; a template-one input is "
        "validated and written as it is. OUT is written atomically; without it the table goes to stdout.",
    )
    convert.add_argument("input", metavar="IN", help="the rank table (file or directory holding jobstart_hccl.json)")
    convert.add_argument("output", nargs="?", metavar="OUT", help="where to write template one (default: stdout)")
    return parser


def _seconds(text: str) -> float:
    # The settings' own parser: finite, 0 to a week (nan would make the wait spin forever).
    try:
        return parse_seconds(text)
    except BadValue as exc:
        import argparse  # loaded already: argparse is what calls this

        raise argparse.ArgumentTypeError(f"{shown(text)} {exc}") from None


def ranktable_main(argv: Sequence[str]) -> int:
    options = _ranktable_parser().parse_args(list(argv))
    from ma_runtime import commands

    if options.action == "wait":
        return commands.ranktable_wait_command(options.path, options.timeout)
    return commands.ranktable_convert_command(options.input, options.output)


def _preflight_parser(prog: str) -> "argparse.ArgumentParser":
    parser = new_parser(
        prog=prog,
        description="Run the platform's node checks (dns, disk-size, ulimit, gpu, npu) and report.",
        epilog="exit 0 when no fatal check failed, 79 when one did, 78 on bad configuration. "
        "Thresholds and the set of checks come from MA_RUNTIME_PREFLIGHT_* and the job file's preflight section.",
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="FILE", help=f"YAML job file (env {CONFIG_ENV})")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    parser.add_argument("--only", metavar="CHECKS", type=_check_names, default=(), help="comma list: run only these")
    parser.add_argument("--skip", metavar="CHECKS", type=_check_names, default=(), help="comma list: skip these")
    parser.add_argument("--log-results", action="store_true",
                        help="also log each result as a line on stderr when stdout is a terminal (it is logged "
                             "whenever stdout is not one)")
    return parser


def _check_names(text: str):
    try:
        return parse_check_names(text)
    except BadValue as exc:
        import argparse  # loaded already: argparse is what calls this

        raise argparse.ArgumentTypeError(str(exc)) from None


def preflight_main(argv: Sequence[str], prog: str) -> int:
    options = _preflight_parser(prog).parse_args(list(argv))
    from ma_runtime import commands

    return commands.preflight_command(options.config, options.only, options.skip, options.json,
                                      options.log_results)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        # `run` parses its own options: the command after them is not ours to parse.
        return run_main(argv[1:], "ma-runtime run")
    if argv and argv[0] == "preflight":
        return preflight_main(argv[1:], "ma-runtime preflight")
    if argv and argv[0] == "ranktable":
        return ranktable_main(argv[1:])
    if argv and argv[0] == "plan":
        return plan_main(argv[1:])
    if argv and argv[0] == "manifest":
        from ma_runtime import manifest  # its own parser: the command after -- is not ours to parse

        return manifest.main(argv[1:])
    if argv and argv[0] == "local":
        from ma_runtime.local import runner

        return runner.main(argv[1:])
    options = _top_parser().parse_args(argv)
    if options.subcommand == "version":
        print(f"ma-runtime {__version__}")
        return 0
    _top_parser().print_help()
    return 0 if not argv else ExitCode.BAD_CONFIGURATION


def ma_run(argv: Optional[Sequence[str]] = None) -> int:
    return run_main(list(sys.argv[1:] if argv is None else argv), "ma-run")


def _standard_streams() -> None:
    """First thing at every entry: the closed standard descriptors are reopened (again: a caller in Python
    may have closed one since the import), or the next file the runtime opens would take its number (the
    task log as fd 1 gets the command's output twice) and Python's sys.stderr would be None. The text
    streams then write undecodable bytes escaped (`\\xff`) instead of failing on them."""
    _reopen_closed_descriptors()
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115 - lives as long as the process
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(errors="backslashreplace")


def _interruptible(function, prog: str) -> int:
    """Ctrl-C where Python's default handler still runs (the operator commands, or `run` before its own
    handlers are in place) ends with one line and 130, not a KeyboardInterrupt traceback."""
    try:
        return function()
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted by SIGINT\n")
        return 128 + signal.SIGINT


def _exit(code: int) -> NoReturn:
    # Skip the interpreter's teardown (~10 ms with the run's modules loaded): every file
    # the runtime wrote is closed by now, and only the std streams need a flush.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def ma_preflight(argv: Optional[Sequence[str]] = None) -> int:
    return preflight_main(list(sys.argv[1:] if argv is None else argv), "ma-preflight")


def entry_ma_preflight() -> NoReturn:
    _standard_streams()
    _exit(_interruptible(ma_preflight, "ma-preflight"))


def entry_main() -> NoReturn:
    _standard_streams()
    _exit(_interruptible(main, "ma-runtime"))


def entry_ma_run() -> NoReturn:
    _standard_streams()
    _exit(_interruptible(ma_run, "ma-run"))
