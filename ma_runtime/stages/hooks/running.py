"""Running one step of the hooks stage (a worker's way: its own session, its output prefixed, the hook timeout),
sourcing a file between two dumps of the environment, and the records of what was done in this pod."""

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ma_runtime.errors import TOO_LARGE_HINT, RuntimeFailure, exceeds_exec_limits, too_large_for_exec
from ma_runtime.process import lifecycle
from ma_runtime.spec import JobSpec
from ma_runtime.stages.hooks.env import ENV_FILE_LIMIT, ENV_FILE_VAR, Env, diff, parse_env_file
from ma_runtime.util import records
from ma_runtime.util.files import RECORD_LIMIT, read_regular, write_atomically
from ma_runtime.util.output import Sink

# Each step's output on the console and in the task log behind its own prefix.
_PREFIXES = {"pip": b"[pip] ", "cann": b"[set_env.sh] ", "pre-start": b"[ma-pre-start] "}
# The dump both sides of a sourced file: the whole environment as JSON, with the file's status.
_DUMP = ("import json,os,sys\n"
         "with open(sys.argv[1], 'w') as f: json.dump({'status': int(sys.argv[2]), 'environ': dict(os.environ)}, f)")
# When the second dump cannot run (the file exported more than exec takes: E2BIG), bash writes the exported
# variables with builtins alone, `NAME=value` NUL-separated, to `<after>.raw`, for the runtime to say which is too
# large. `${!n-}`: a file's `set -u` must not end the shell here.
_RAW_DUMP = r"""for __ma_rt_n in $(compgen -e); do printf '%s=%s\0' "$__ma_rt_n" "${!__ma_rt_n-}"; done \
> "$__ma_rt_after.raw" 2>/dev/null"""
# `bash -c` this, with $1.. = python, dump code, before, after, the file, the raw dump. The names are the shell's
# own variables (not exported, so in neither dump); `set --` keeps our arguments from the sourced file's $1.
# The second dump is taken when the file returns; the EXIT trap takes it for a file that ends with `exit`. A file
# may replace that trap with its own (a cleanup): it still runs, when the shell exits after the dump. The raw dump
# is bash's alone (`${!n}` is no sh syntax): evaluated only under bash.
_SOURCE = r"""__ma_rt_py=$1 __ma_rt_dump=$2 __ma_rt_after=$4 __ma_rt_file=$5 __ma_rt_raw=$6 __ma_rt_done=
"$__ma_rt_py" -I -S -c "$__ma_rt_dump" "$3" 0 || exit 125
trap '__ma_rt_status=$?; trap - EXIT
[ -n "$__ma_rt_done" ] || "$__ma_rt_py" -I -S -c "$__ma_rt_dump" "$__ma_rt_after" "$__ma_rt_status" ||
{ [ -z "${BASH_VERSION-}" ] || eval "$__ma_rt_raw"; }
exit "$__ma_rt_status"' EXIT
set --
. "$__ma_rt_file"
__ma_rt_status=$? __ma_rt_done=1
"$__ma_rt_py" -I -S -c "$__ma_rt_dump" "$__ma_rt_after" "$__ma_rt_status" ||
{ [ -z "${BASH_VERSION-}" ] || eval "$__ma_rt_raw"; }
exit "$__ma_rt_status"
"""


@dataclasses.dataclass
class HookStage:
    """Where and how the hooks stage runs."""

    spec: JobSpec
    environ: Mapping[str, str]  # the runtime's, once stage-in is done
    command: Sequence[str]
    task_log: Optional[Sink]
    log: object
    reuse: bool  # a later runtime in the same pod: what a record says was done is not done again
    exclude: Sequence[int] = ()  # our children that are not the hooks' (the guard)

    @property
    def code_dir(self) -> Path:
        """The downloaded code directory, else where the command runs."""
        if self.spec.code_url:
            from ma_runtime.stages.stagein import code_dir

            return code_dir(self.spec)
        return Path.cwd()


@dataclasses.dataclass
class Result:
    code: int  # the exit status (128+N: killed by signal N)
    env: Optional[Env]  # what it did to the environment; None when that could not be read
    tail: List[str]
    why: str = ""
    hint: str = ""  # what to do, when it is not the step's usual (E2BIG)


def source(run: HookStage, script: Path, environ: Mapping[str, str], name: str, step: str) -> Result:
    """`script` sourced by bash in the code directory; the environment's difference."""
    bash = shutil.which("bash", path=environ.get("PATH", os.defpath)) or "/bin/sh"

    def source(env: Dict[str, str]) -> Result:
        with _scratch("before") as before, _scratch("after") as after:
            argv = [bash, "-c", _SOURCE, name, sys.executable, _DUMP, str(before), str(after), str(script), _RAW_DUMP]
            result = supervised(run, argv, env, name, step)
            dumps = [_read_dump(before), _read_dump(after)]
            raw = _read_raw_dump(Path(f"{after}.raw")) if dumps[1] is None else None
        if result.code != 0:
            return result
        if None in dumps:
            result.code, result.why, result.hint = 125, *_unread_why(raw, str(after))
            return result
        result.env = diff(dumps[0], dumps[1])
        return result

    return with_env_file(run, source, environ)


def _unread_why(raw: Optional[Dict[str, str]], after: str) -> Tuple[str, str]:
    """(why, hint) the environment after a sourced file could not be read: more than exec takes (the raw dump shows
    it), else the file ended its shell before the dump (the step's own hint)."""
    dump_argv = [sys.executable, "-I", "-S", "-c", _DUMP, after, "0"]
    if raw is not None and exceeds_exec_limits(dump_argv, raw):
        return too_large_for_exec(dump_argv, raw), TOO_LARGE_HINT
    return ("its environment could not be read: a sourced script must not exec, nor end with exit after setting an "
            "EXIT trap of its own"), ""


def _fits_exec(result: "Result", environ: Mapping[str, str]) -> "Result":
    """`result`, without an environment (a failure, its own status kept) when the environment it leaves is more
    than exec takes: every later start (the command's) would fail with E2BIG, so the step that did it is named
    now."""
    if result.code == 0 and result.env is not None:
        after = result.env.apply(environ)
        if exceeds_exec_limits([], after):
            return Result(result.code, None, result.tail, why=too_large_for_exec([], after), hint=TOO_LARGE_HINT)
    return result


def _read_raw_dump(path: Path) -> Optional[Dict[str, str]]:
    """`NAME=value` strings, NUL-separated (bash's builtins' dump); None when there is none."""
    try:
        data = read_regular(path, RECORD_LIMIT)
    except OSError:
        return None
    if data is None:
        return None
    pairs = (item.split(b"=", 1) for item in data.split(b"\0") if b"=" in item)
    return {os.fsdecode(name): os.fsdecode(value) for name, value in pairs}


def with_env_file(run: HookStage, start, environ: Mapping[str, str]) -> Result:
    """`start(env)` with MA_HOOK_ENV_FILE naming a fresh file; its NAME=value lines are applied on top."""
    with _scratch("env", create=True) as env_file:
        result = start({**environ, ENV_FILE_VAR: str(env_file)})
        if result.code != 0:
            return result
        try:
            data = read_regular(env_file, ENV_FILE_LIMIT) or b""
            written = parse_env_file(data.decode("utf-8", "surrogateescape"))
        except (OSError, ValueError) as exc:  # replaced by a FIFO, grown past the limit, a bad line
            return Result(1, None, result.tail, why=f"{ENV_FILE_VAR}: {exc}")
    result.env = (result.env or Env()).then(Env(written))
    return _fits_exec(result, environ)


def supervised(run: HookStage, argv: Sequence[str], env: Mapping[str, str], name: str, step: str) -> Result:
    """Runs like a worker, output prefixed on the console and in the task log, within the hook timeout."""
    from ma_runtime.process.worker import spawn, tail
    from ma_runtime.util import logs

    sinks = [Sink(1, "<stdout>"), *([run.task_log.as_console()] if run.task_log else [])]
    try:
        worker = spawn(argv, env, str(run.code_dir), sinks, [logs.stderr_sink(), *sinks[1:]], name=name,
                       console_prefix=_PREFIXES[step])
    except RuntimeFailure as failure:  # not started (E2BIG: what an earlier step exported): the step's failure
        return Result(int(failure.exit_code), None, [], why=failure.reason, hint=failure.hint)
    seconds = run.spec.hooks_timeout_seconds
    code = lifecycle.wait(worker.popen, seconds)
    if code is None:
        run.log.warning(f"{name} timed out: stopping it", timeout_s=seconds, pid=worker.pid)
        code = lifecycle.exit_code(lifecycle.stop(worker.popen, run.spec.stop_grace_seconds, group=True))
        worker.join_output(1.0)
        return Result(code or 1, None, tail(worker), why=f"timed out after {seconds:g} s "
                       "(MA_RUNTIME_HOOK_TIMEOUT_SECONDS)")
    worker.join_output(1.0)
    why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    return Result(lifecycle.exit_code(code), None, tail(worker), why=why)


class Record:
    """A JSON record in the state folder: what was done in this pod (read only by a later runtime there). One that
    does not validate is set aside (records.py), and what it recorded is done again."""

    def __init__(self, path: Path, reuse: bool, validate, what: str, then: str, log, private: bool = False):
        self.path, self.private = path, private
        self.previous = records.load(path, validate, log, what, then=then) if reuse else None

    def matches(self, key: Mapping[str, str]) -> Optional[dict]:
        previous = self.previous
        ok = isinstance(previous, dict) and all(previous.get(name) == value for name, value in key.items())
        return previous if ok else None

    def write(self, document: dict, log, what: str) -> None:
        """Best effort: an unusable state folder costs a later runtime in this pod a second run, not the job."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # The hook's raw environment may hold a secret: readable by the job's user alone, and never logged.
            write_atomically(self.path, json.dumps(document), mode=0o600 if self.private else 0o644)
        except OSError as exc:
            log.warning(f"could not record the {what}: a later runtime in this pod will run it again",
                        path=str(self.path), error=exc.strerror or str(exc))


class _scratch:
    """A file of one hook run in a private folder of its own (mode 0700, under TMPDIR), removed after it: the
    state folder may be unusable (a read-only mount), which costs the records, not the hooks."""

    def __init__(self, kind: str, create: bool = False):
        self.kind, self.create = kind, create
        self.folder: Optional[str] = None

    def __enter__(self) -> Path:
        import tempfile

        self.folder = tempfile.mkdtemp(prefix="ma-hook-")
        path = Path(self.folder) / self.kind
        if self.create:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        return path

    def __exit__(self, *_exc) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _read_dump(path: Path) -> Optional[Dict[str, str]]:
    """The environment a dump holds; None when there is none, or none that can be used (a scratch file of this run:
    nothing to set aside)."""
    try:
        return records.read(path, _valid_dump, RECORD_LIMIT)
    except records.Invalid:
        return None


def _valid_dump(document) -> Dict[str, str]:
    records.mapping(document, "the dump")
    records.integer(records.field(document, "status"), "`status`")
    return records.strings(records.field(document, "environ"), "`environ`")


def first_file(folder: Path, names: Sequence[str]) -> Optional[Path]:
    for name in names:
        if (folder / name).is_file():
            return folder / name
    return None


def sha256(path: Path) -> str:
    """The file's content hash, "" when it cannot be read (what runs it then says why, in its own words)."""
    import hashlib  # only when there is a file to record: loading OpenSSL costs 4 ms of every start

    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return ""
