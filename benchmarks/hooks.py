"""The hooks stage (issue 14): what a pre-start hook and CANN's set_env.sh add to `ma-run`'s start, against what
users do today, a shell entrypoint that sources the same file before it execs the command.

ma_runtime is installed from a wheel into a scratch venv (benchmarks/_harness.py), as an image installs it;
`--venv DIR` measures an existing venv instead. Every ma-run gets MA_RUNTIME_PREFLIGHT=off, a scratch MA_HOME of
its row, a clean environment (no MA_*, ASCEND_*, VC_*, ... of the caller) and the command `true`; the job's
python (`--job-python`, default the system's python3, not a pyenv shim) is `python3` first on PATH for every row,
so the runtime's `.py` hook runs on the interpreter the anchor runs. Each sample is the median of
`--per-sample` runs of its row back to back (wall time, Popen to exit, with a blocking wait: Popen.wait(timeout)
polls with sleeps of up to 50 ms and would round every figure up to its next poll); rows go round-robin
(benchmarks/_harness.py), min/median/max over the rounds with the 1-minute load beside each.

sourced     The sourcing machinery: bash sources the file between two JSON dumps of the environment made by
            the runtime's python with `-I -S` (ma_runtime/stages/hooks/running.py). Rows:
              ma-run true with no hook (the baseline), with a no-op ma-pre-start.sh in the working directory,
              with one that exports 5 variables (one of them multi-line) and prepends PATH, and with a fake
              CANN toolkit's set_env.sh (ascend-toolkit/latest, 9 variables as the real one exports them,
              its `$(cd ...; pwd)` and `$(arch)` included) named by MA_RUNTIME_CANN_SET_ENV;
              the anchors: `bash -c 'exec true'` (their baseline) and `bash -c '. <file>; exec true'` for
              the same three files;
              diagnostics: the runtime's sourcing script itself (hooks/running._SOURCE, the two dumps, the
              exporting hook) run by bash outside ma-run; one dump alone (`python -I -S -c` of hooks._DUMP);
              bash sourcing the same hook between two `env -0` (the cheap way to read an environment whole).
            Figures, per round: the hook's added cost, ours (with the hook - no hook) and the anchor's
            (sourcing entrypoint - bare bash); ours - the anchor's and ours / the anchor's, per round and of
            the medians. Goal, for each of the three files: the sourcing machinery adds at most 40 ms over
            the entrypoint doing the same sourcing (ours - the anchor's, of the medians). Where ours goes:
            the two dumps (the sourcing script less bash sourcing the hook), ma-run's own timing of the step
            (the `elapsed_s` it logs) less the sourcing script alone (spawning and waiting), and the added
            cost less that step (finding the hook, its hash, the record, the debug copy).
            Before the rounds, each file's variables are checked to reach ma-run's command with the values
            the entrypoint gives its command.

python      ma-run true with ma-pre-start.py writing 5 NAME=value lines to MA_HOOK_ENV_FILE, against the
            baseline; the anchor: `python3 ma-pre-start.py` alone, what running the hook costs anyway.
            Figures: the added cost, its difference to the anchor and the ratio (no goal: a report); ma-run's
            `elapsed_s` of the step, and that less the hook alone.

Every ma-run's log is checked after its run (untimed): the hook ran (`pre-start script finished`, `CANN
environment applied`), or, in the baseline, neither. A run that fails a check is a failed sample, named below
the tables. Scratch data goes under /tmp (--workdir) and is removed at the end.

    .venv/bin/python benchmarks/hooks.py [--rounds 7] [--warmup 1] [--per-sample 3] [--parts sourced,python]
                                         [--venv DIR] [--job-python PATH] [--json FILE]
"""

import argparse
import dataclasses
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402  (beside this script, not a package)

PARTS = ("sourced", "python")
GOAL_OVER_ENTRYPOINT_MS = 40.0
RUN_TIMEOUT_S = 60
# An added cost below this is within the noise of a bash start: a ratio to it means nothing.
NOISE_MS = 1.0
# The caller's job settings, credentials and a CANN environment must not reach the runs (hang.py does the same;
# ASCEND_* also because an applied CANN environment makes the runtime skip set_env.sh).
FOREIGN_PREFIXES = ("MA_", "PET_", "TORCHELASTIC_", "VC_", "RANK_TABLE", "OBS_", "S3_", "AWS_", "ASCEND_", "FAKE_")
# PYTHONPYCACHEPREFIX would make every interpreter ignore the installed .pyc files (startup.py); the others are
# what set_env.sh prepends to, so the caller's values would lengthen what it sets.
FOREIGN_NAMES = ("PYTHONPYCACHEPREFIX", "PYTHONPATH", "LD_LIBRARY_PATH", "TOOLCHAIN_HOME")
# What bash changes in any environment it runs: not what the sourced file did.
SHELL_NOISE = ("_", "PWD", "OLDPWD", "SHLVL")

NOOP_HOOK = "# a hook with nothing to do\n:\n"
EXPORT_HOOK = """\
export NCCL_DEBUG=WARN
export JOB_TAG="bench-$USER"
export DATA_ROOT="$PWD/data"
export RUN_NOTE='line one
line two with = and "quotes"
line three'
export PATH="$PWD/bin:$PATH"
"""
PY_HOOK = """\
import os
with open(os.environ["MA_HOOK_ENV_FILE"], "a") as env_file:
    env_file.write("NCCL_DEBUG=WARN\\nJOB_TAG=bench\\nDATA_ROOT=/data\\nRESUME_STEP=1200\\nRUN_NOTE=from python\\n")
"""
PY_HOOK_SETS = {"NCCL_DEBUG": "WARN", "JOB_TAG": "bench", "DATA_ROOT": "/data", "RESUME_STEP": "1200",
                "RUN_NOTE": "from python"}
# As CANN's ascend-toolkit/set_env.sh does it: the toolkit found from the script's own path, command substitutions
# (a subshell, arch), its eight variables, and ASCEND_TOOLKIT_LIB: nine.
SET_ENV = """\
path="${BASH_SOURCE[0]}"
toolkit_path=$(cd "$(dirname "$path")"; pwd)
export ASCEND_TOOLKIT_HOME=${toolkit_path}/latest
export LD_LIBRARY_PATH=${ASCEND_TOOLKIT_HOME}/lib64:${ASCEND_TOOLKIT_HOME}/lib64/plugin/opskernel:\
${ASCEND_TOOLKIT_HOME}/lib64/plugin/nnengine:\
${ASCEND_TOOLKIT_HOME}/opp/built-in/op_impl/ai_core/tbe/op_tiling/lib/linux/$(arch):$LD_LIBRARY_PATH
export LD_LIBRARY_PATH=${ASCEND_TOOLKIT_HOME}/tools/aml/lib64:${ASCEND_TOOLKIT_HOME}/tools/aml/lib64/plugin:\
$LD_LIBRARY_PATH
export PYTHONPATH=${ASCEND_TOOLKIT_HOME}/python/site-packages:\
${ASCEND_TOOLKIT_HOME}/opp/built-in/op_impl/ai_core/tbe:$PYTHONPATH
export PATH=${ASCEND_TOOLKIT_HOME}/bin:${ASCEND_TOOLKIT_HOME}/compiler/ccec_compiler/bin:\
${ASCEND_TOOLKIT_HOME}/tools/ccec_compiler/bin:$PATH
export ASCEND_AICPU_PATH=${ASCEND_TOOLKIT_HOME}
export ASCEND_OPP_PATH=${ASCEND_TOOLKIT_HOME}/opp
export TOOLCHAIN_HOME=${ASCEND_TOOLKIT_HOME}/toolkit
export ASCEND_HOME_PATH=${ASCEND_TOOLKIT_HOME}
export ASCEND_TOOLKIT_LIB=${ASCEND_TOOLKIT_HOME}/lib64
"""
TOOLKIT_FOLDERS = ("lib64/plugin/opskernel", "bin", "opp", "python/site-packages", "toolkit")
# The job's view of its environment, printed by the command of the check runs.
SHOW_ENV = "import json, os, sys; sys.stdout.write('\\n' + json.dumps(dict(os.environ)) + '\\n')"

# Row names. The three sourced files, each with our row and the anchor's.
BASELINE, SH_BASELINE = "ma-run true, no hook (baseline)", "bash -c 'exec true' (anchors' baseline)"
KINDS = ("no-op hook", "exporting hook", "CANN set_env.sh")
OURS = {"no-op hook": "ma-run true, no-op ma-pre-start.sh",
        "exporting hook": "ma-run true, ma-pre-start.sh exporting 5",
        "CANN set_env.sh": "ma-run true, CANN set_env.sh"}
ANCHORS = {"no-op hook": "bash -c '. ./ma-pre-start.sh; exec true' (no-op)",
           "exporting hook": "bash -c '. ./ma-pre-start.sh; exec true' (exporting)",
           "CANN set_env.sh": "bash -c '. set_env.sh; exec true'"}
DIAG_SCRIPT = "diag: hooks._SOURCE, the exporting hook, outside ma-run"
DIAG_DUMP = "diag: one dump, python -I -S -c hooks._DUMP"
DIAG_ENV0 = "diag: bash sourcing the exporting hook between two `env -0`"
# The other way to read an environment whole: NUL-separated, so newlines and `=` in values survive too.
ENV0_SOURCE = 'env -0 > "$1" && . ./ma-pre-start.sh && env -0 > "$2"'
PY_OURS, PY_ANCHOR = "ma-run true, ma-pre-start.py writing 5 lines", "python3 ma-pre-start.py alone"
# What the runtime logs when each file ran.
HOOK_DONE, CANN_DONE, HOOK_START = "pre-start script finished", "CANN environment applied", \
    "running the pre-start script"


# --------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_round_arguments(parser, rounds=7, warmup=1)
    parser.add_argument("--per-sample", type=int, default=3,
                        help="runs of a row back to back per sample, their median kept (default 3)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts to run (default {','.join(PARTS)})")
    parser.add_argument("--venv", metavar="DIR", help="measure this venv's bin/ma-run instead of a fresh wheel "
                                                      "install (e.g. .venv, the editable install)")
    parser.add_argument("--job-python", default=_system_python(),
                        help="the job's python3, first on every row's PATH (default: the system's python3)")
    parser.add_argument("--workdir", metavar="DIR", help="scratch parent folder (default /tmp)")
    parser.add_argument("--json", metavar="FILE", help="also write the results (and every sample) as JSON to FILE")
    args = parser.parse_args(argv)
    args.parts = [name.strip() for name in args.parts.split(",") if name.strip()]
    unknown = [name for name in args.parts if name not in PARTS]
    if unknown or not args.parts:
        parser.error(f"--parts: {', '.join(unknown) or 'nothing'} is not one of {', '.join(PARTS)}")
    if args.rounds < 1 or args.warmup < 0 or args.per_sample < 1:
        parser.error("--rounds and --per-sample must be positive, --warmup not negative")
    return args


def _system_python() -> str:
    # Not the first python3 on PATH: a pyenv shim is a bash script that costs tens of ms per start.
    found = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    return os.path.realpath(found) if found else os.path.realpath(sys.executable)


# --------------------------------------------------------------------------- the scratch job


@dataclasses.dataclass
class Job:
    """The folders, files and programs every row uses."""

    scratch: Path
    ma_run: str
    runtime_python: str  # the runtime's interpreter: the one its dumps run on
    job_python: str  # `python3` on every row's PATH
    bash: str
    environ: Dict[str, str]  # every row's, before its own settings

    def folder(self, name: str) -> Path:
        return self.scratch / "jobs" / name

    @property
    def set_env(self) -> Path:
        return self.scratch / "Ascend" / "ascend-toolkit" / "set_env.sh"


def make_job(scratch: Path, venv: Path, job_python: str) -> Job:
    bin_dir = scratch / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(job_python)
    environ = {name: value for name, value in os.environ.items()
               if not name.startswith(FOREIGN_PREFIXES) and name not in FOREIGN_NAMES}
    environ.update({"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
                    "MA_RUNTIME_PREFLIGHT": "off"})
    bash = shutil.which("bash", path=environ["PATH"]) or "/bin/bash"  # the one the runtime finds
    job = Job(scratch, str(venv / "bin" / "ma-run"), str(venv / "bin" / "python"), str(bin_dir / "python3"),
              bash, environ)
    for name, hook, source in (("bare", None, ""), ("noop", "ma-pre-start.sh", NOOP_HOOK),
                               ("export", "ma-pre-start.sh", EXPORT_HOOK), ("python", "ma-pre-start.py", PY_HOOK)):
        job.folder(name).mkdir(parents=True)
        if hook:
            (job.folder(name) / hook).write_text(source)
    latest = job.set_env.parent / "latest"
    for folder in TOOLKIT_FOLDERS:
        (latest / folder).mkdir(parents=True)
    job.set_env.write_text(SET_ENV)
    return job


# --------------------------------------------------------------------------- one row


@dataclasses.dataclass
class Row:
    """One thing measured: argv in a folder, its stderr in a file, and what ma-run's log must (not) say."""

    argv: List[str]
    cwd: Path
    env: Dict[str, str]
    log: Path
    expect: Sequence[str] = ()
    refuse: Sequence[str] = ()
    step: Optional[str] = None  # the log line whose elapsed_s is ma-run's own timing of the hook's step

    def check(self, code: Optional[int]) -> Tuple[Optional[str], Optional[float]]:
        """Why the run does not count (None: it does), and the step's elapsed_s in ms."""
        text = self.log.read_text(errors="replace")
        if code != 0:
            return (f"exited {code}: {tail(text)}" if code is not None else f"killed after {RUN_TIMEOUT_S} s"), None
        missing = [msg for msg in self.expect if f'msg="{msg}' not in text]
        present = [msg for msg in self.refuse if f'msg="{msg}' in text]
        if missing or present:
            return f"the log lacks {missing} or holds {present}: {tail(text)}", None
        found = re.search(rf'msg="{re.escape(self.step)}".*?\belapsed_s=([0-9.]+)', text) if self.step else None
        return None, float(found.group(1)) * 1e3 if found else None


def tail(text: str, lines: int = 2) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def run_once(row: Row) -> Tuple[float, Optional[int]]:
    """Wall seconds from Popen to exit; the exit status (None: killed by the hang guard, with its session)."""
    with open(row.log, "wb") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(row.argv, cwd=row.cwd, env=row.env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        # Not proc.wait(timeout): that polls with sleeps of up to 50 ms, which would round every figure up to
        # its next poll. A blocking wait, and a timer that kills the run's session if it hangs.
        guard = HangGuard(proc.pid)
        try:
            code = proc.wait()
        except BaseException:  # this script stopped (SIGTERM, ^C): the run, in a session of its own, goes too
            guard.kill()
            proc.wait()
            raise
        finally:
            guard.cancel()
        return time.perf_counter() - start, None if guard.fired else code


class HangGuard:
    """Kills a run's session after RUN_TIMEOUT_S, from a timer thread."""

    def __init__(self, pid: int):
        self.pid, self.fired = pid, False
        self.timer = threading.Timer(RUN_TIMEOUT_S, self._expired)
        self.timer.daemon = True
        self.timer.start()

    def _expired(self) -> None:
        self.fired = True
        self.kill()

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it ended meanwhile

    def cancel(self) -> None:
        self.timer.cancel()


def sample(row: Row, runs: int) -> Dict[str, Any]:
    """The median of `runs` runs back to back, in ms, and of the step's elapsed_s where ma-run logs one; a run
    that fails its check fails the sample."""
    seconds, steps = [], []
    for _ in range(runs):
        elapsed, code = run_once(row)
        problem, step_ms = row.check(code)
        if problem:
            return {"ms": None, "step_ms": None, "error": problem}
        seconds.append(elapsed)
        steps.append(step_ms)
    step = statistics.median(steps) if None not in steps else None
    return {"ms": statistics.median(seconds) * 1e3, "step_ms": step, "error": None}


def ma_run_row(job: Job, name: str, folder: str, expect: Sequence[str] = (), refuse: Sequence[str] = (),
               step: Optional[str] = None, **settings: str) -> Row:
    home = job.scratch / "homes" / name
    home.mkdir(parents=True)
    env = {**job.environ, "MA_HOME": str(home), **settings}
    return Row([job.ma_run, "--", "true"], job.folder(folder), env, home / "stderr", expect, refuse, step)


def plain_row(job: Job, name: str, argv: List[str], folder: str = "bare", **settings: str) -> Row:
    """A row that is not ma-run: an anchor or a diagnostic."""
    logs = job.scratch / "logs"
    logs.mkdir(exist_ok=True)
    return Row(argv, job.folder(folder), {**job.environ, **settings}, logs / name)


def bash_row(job: Job, name: str, script: str, folder: str = "bare") -> Row:
    return plain_row(job, name, [job.bash, "-c", script], folder)


# --------------------------------------------------------------------------- per-round figures


def paired(ours: Sequence[harness.Sample], anchor: Sequence[harness.Sample],
           combine: Callable[[float, float], float]) -> List[harness.Sample]:
    """combine(ours, anchor) in each round both have a figure for, as samples (the load: the higher)."""
    anchor_by_round = {s.round: s for s in anchor if ms_of(s.result) is not None}
    return [harness.Sample(s.round, max(s.load, anchor_by_round[s.round].load),
                           combine(ms_of(s.result), ms_of(anchor_by_round[s.round].result)))
            for s in ours if ms_of(s.result) is not None and s.round in anchor_by_round]


def ms_of(result: Any) -> Optional[float]:
    """A sample's ms: a run's (a dict) or a derived figure's (a number)."""
    return result.get("ms") if isinstance(result, dict) else result


def wall_table(title: str, samples: Dict[str, List[harness.Sample]]) -> None:
    harness.table(title, samples, [(name, (name, "ms")) for name in samples], "ms")


def median_of(summary: Optional[harness.Summary]) -> Optional[float]:
    return summary.median if summary else None


# --------------------------------------------------------------------------- checks before the rounds


def environment_of(argv: List[str], cwd: Path, env: Dict[str, str]) -> Dict[str, str]:
    """The environment a command sees: the last line it prints (SHOW_ENV)."""
    done = subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:3]} exited {done.returncode}: {tail(done.stderr)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_same_variables(job: Job, row: Row, source: str) -> Dict[str, Any]:
    """What sourcing `source` gives the entrypoint's command reaches ma-run's command with the same values."""
    show = [job.job_python, "-c", SHOW_ENV]
    quoted = shlex.join(show)
    bare = environment_of([job.bash, "-c", f"exec {quoted}"], row.cwd, row.env)
    sourced = environment_of([job.bash, "-c", f". {source}; exec {quoted}"], row.cwd, row.env)
    theirs = {name: value for name, value in sourced.items() if bare.get(name) != value and name not in SHELL_NOISE}
    ours = environment_of([job.ma_run, "--", *show], row.cwd, row.env)
    differ = sorted(name for name, value in theirs.items() if ours.get(name) != value)
    return {"names": sorted(theirs), "differ": differ}


def print_check(kind: str, check: Dict[str, Any], reference: str = "the entrypoint's command sees") -> None:
    if check["differ"]:
        print(f"  CHECK FAILED, {kind}: ma-run's command sees other values than {reference} for "
              f"{', '.join(check['differ'])}")
    else:
        print(f"  checked, {kind}: ma-run's command sees the {len(check['names'])} variables as {reference} "
              f"({', '.join(check['names']) or 'none'})")


# --------------------------------------------------------------------------- part 1: sourced files


def sourced_rows(job: Job) -> Dict[str, Row]:
    from ma_runtime.stages.hooks import (
        running as hooks,  # the runtime's own sourcing script and dump, run here outside ma-run
    )

    dumps = job.scratch / "dumps"
    dumps.mkdir(exist_ok=True)
    hook_logs = (HOOK_START, HOOK_DONE)
    return {
        BASELINE: ma_run_row(job, "sourced-baseline", "bare", refuse=(HOOK_START, CANN_DONE)),
        OURS["no-op hook"]: ma_run_row(job, "noop", "noop", expect=hook_logs, step=HOOK_DONE),
        OURS["exporting hook"]: ma_run_row(job, "export", "export", expect=hook_logs, step=HOOK_DONE),
        OURS["CANN set_env.sh"]: ma_run_row(job, "cann", "bare", expect=(CANN_DONE,), step=CANN_DONE,
                                            MA_RUNTIME_CANN_SET_ENV=str(job.set_env)),
        SH_BASELINE: bash_row(job, "bash-bare", "exec true"),
        ANCHORS["no-op hook"]: bash_row(job, "bash-noop", ". ./ma-pre-start.sh; exec true", "noop"),
        ANCHORS["exporting hook"]: bash_row(job, "bash-export", ". ./ma-pre-start.sh; exec true", "export"),
        ANCHORS["CANN set_env.sh"]: bash_row(job, "bash-cann", f". {shlex.quote(str(job.set_env))}; exec true"),
        DIAG_SCRIPT: plain_row(job, "diag-script", [job.bash, "-c", hooks._SOURCE, "ma-pre-start.sh",
                                                    job.runtime_python, hooks._DUMP, str(dumps / "before"),
                                                    str(dumps / "after"), "./ma-pre-start.sh"], "export"),
        DIAG_ENV0: plain_row(job, "diag-env0", [job.bash, "-c", ENV0_SOURCE, "bash", str(dumps / "env0-before"),
                                                str(dumps / "env0-after")], "export"),
        DIAG_DUMP: plain_row(job, "diag-dump", [job.runtime_python, "-I", "-S", "-c", hooks._DUMP, str(dumps / "one"),
                                                "0"]),
    }


def part_sourced(args, job: Job) -> Dict[str, Any]:
    rows = sourced_rows(job)
    harness.print_header(f"sourced: ma-run ({job.ma_run}) with a sourced ma-pre-start.sh or CANN's set_env.sh "
                         f"against a bash entrypoint sourcing the same; median of {args.per_sample} runs per "
                         "sample", args.rounds, args.warmup)
    checks = {"exporting hook": check_same_variables(job, rows[OURS["exporting hook"]], "./ma-pre-start.sh"),
              "CANN set_env.sh": check_same_variables(job, rows[OURS["CANN set_env.sh"]], f"'{job.set_env}'")}
    for kind, check in checks.items():
        print_check(kind, check)
    tasks = {name: (lambda row=row: sample(row, args.per_sample)) for name, row in rows.items()}
    samples = harness.round_robin(tasks, args.rounds, args.warmup)
    wall_table("wall time, Popen to exit", samples)
    results = sourced_report(samples)
    results.update({"checks": checks, "failed": harness.failures(samples)})
    return {"results": results, "samples": samples}


def sourced_report(samples: Dict[str, List[harness.Sample]]) -> Dict[str, Any]:
    added = {}
    for kind in KINDS:
        added[f"ours, {kind}"] = paired(samples[OURS[kind]], samples[BASELINE], harness.difference)
        added[f"entrypoint, {kind}"] = paired(samples[ANCHORS[kind]], samples[SH_BASELINE], harness.difference)
    harness.print_table("added by the file, per round (ours: with it - ma-run's baseline; entrypoint: sourcing "
                        "- bare bash)", [(label, harness.summarize(rows)) for label, rows in added.items()], "ms")
    print()
    verdicts = {kind: sourced_verdict(kind, added[f"ours, {kind}"], added[f"entrypoint, {kind}"]) for kind in KINDS}
    met = all(v["met"] for v in verdicts.values())
    print(f"  goal, for every sourced file: the sourcing machinery adds <= {GOAL_OVER_ENTRYPOINT_MS:g} ms over the "
          f"entrypoint doing the same sourcing: {harness.verdict(met)}")
    return {"added_ms": {label: harness.summarize(rows) for label, rows in added.items()}, "verdicts": verdicts,
            "goal_ms": GOAL_OVER_ENTRYPOINT_MS, "met": met, "diagnostics": diagnostics(samples, added)}


def sourced_verdict(kind: str, ours: List[harness.Sample], theirs: List[harness.Sample]) -> Dict[str, Any]:
    over = harness.compare(ours, theirs, harness.difference)
    times = harness.compare(ours, theirs, harness.ratio)
    met = over.of_medians is not None and over.of_medians <= GOAL_OVER_ENTRYPOINT_MS
    print(f"  {kind}: ours - entrypoint's: {harness.comparison_text(over, ' ms', 1)}")
    entrypoint = harness.summarize(theirs)
    if entrypoint is not None and abs(entrypoint.median) < NOISE_MS:
        print(f"  {kind}: ours / entrypoint's: no ratio, the entrypoint's sourcing adds "
              f"{harness.number(entrypoint.median, 2)} ms (median), within the noise of a bash start")
    else:
        print(f"  {kind}: ours / entrypoint's: {harness.comparison_text(times)}")
    print(f"  {kind}: {harness.number(over.of_medians)} ms over the entrypoint (of the medians), goal <= "
          f"{GOAL_OVER_ENTRYPOINT_MS:g} ms: {harness.verdict(met)}")
    return {"over_entrypoint_ms": over, "ratio": times, "met": met}


def diagnostics(samples: Dict[str, List[harness.Sample]], added: Dict[str, List[harness.Sample]]) -> Dict[str, Any]:
    """Where ours goes: the two dumps (the sourcing script less bash sourcing the same hook); ma-run's own timing of
    the step (its elapsed_s) less the sourcing script run alone (the spawn, the output threads, the wait); and the
    added cost less the step (finding the hook, its hash, the record, the debug copy)."""
    dumps = paired(samples[DIAG_SCRIPT], samples[ANCHORS["exporting hook"]], harness.difference)
    step = {kind: figure(samples[OURS[kind]], "step_ms") for kind in KINDS}
    env0 = paired(samples[DIAG_ENV0], samples[ANCHORS["exporting hook"]], harness.difference)
    rows = [("one dump (python -I -S -c hooks._DUMP)", harness.summarize(figure(samples[DIAG_DUMP], "ms"))),
            ("the sourcing script alone (exporting hook)", harness.summarize(figure(samples[DIAG_SCRIPT], "ms"))),
            ("  - bash sourcing the hook: the two dumps", harness.summarize(dumps)),
            ("  the same with two `env -0` instead: the two dumps", harness.summarize(env0))]
    for kind in KINDS:
        rows.append((f"ma-run's elapsed_s of the step, {kind}", harness.summarize(step[kind])))
    rows += [("  exporting hook - the sourcing script alone (spawn, wait)",
              harness.summarize(paired(step["exporting hook"], samples[DIAG_SCRIPT], harness.difference))),
             ("ours added, exporting hook - its elapsed_s (the rest)",
              harness.summarize(paired(added["ours, exporting hook"], step["exporting hook"], harness.difference)))]
    harness.print_table("diagnostics: where ma-run's added cost goes (per round; elapsed_s is logged in whole ms)",
                        rows, "ms")
    return dict(rows)


def figure(samples: Sequence[harness.Sample], key: str) -> List[harness.Sample]:
    """One figure of each sample's result, as samples of their own (those that have it)."""
    return [harness.Sample(s.round, s.load, s.result[key]) for s in samples if s.result.get(key) is not None]


# --------------------------------------------------------------------------- part 2: the .py hook


def part_python(args, job: Job) -> Dict[str, Any]:
    env_file = job.scratch / "anchor-env"
    rows = {BASELINE: ma_run_row(job, "python-baseline", "bare", refuse=(HOOK_START, CANN_DONE)),
            PY_OURS: ma_run_row(job, "python", "python", expect=(HOOK_START, HOOK_DONE), step=HOOK_DONE),
            PY_ANCHOR: plain_row(job, "python-alone", [job.job_python, "ma-pre-start.py"], "python",
                                 MA_HOOK_ENV_FILE=str(env_file))}
    harness.print_header(f"python: ma-run with ma-pre-start.py (on {job.job_python}) against running the hook "
                         f"alone; median of {args.per_sample} runs per sample", args.rounds, args.warmup)
    check = check_python_hook(job, rows[PY_OURS])
    print_check("ma-pre-start.py", check, "the hook wrote them")
    tasks = {name: (lambda row=row: sample(row, args.per_sample)) for name, row in rows.items()}
    samples = harness.round_robin(tasks, args.rounds, args.warmup)
    wall_table("wall time, Popen to exit", samples)
    ours = paired(samples[PY_OURS], samples[BASELINE], harness.difference)
    alone, step = figure(samples[PY_ANCHOR], "ms"), figure(samples[PY_OURS], "step_ms")
    harness.print_table("the .py hook's cost", [
        ("ours: added to ma-run (with it - baseline)", harness.summarize(ours)),
        ("the hook run alone", harness.summarize(alone)),
        ("diag: ma-run's elapsed_s of the step", harness.summarize(step)),
        ("diag: elapsed_s - the hook alone (spawn, wait, env file)",
         harness.summarize(paired(step, alone, harness.difference)))], "ms")
    over = harness.compare(ours, alone, harness.difference)
    times = harness.compare(ours, alone, harness.ratio)
    print(f"\n  ours - the hook alone: {harness.comparison_text(over, ' ms', 1)}")
    print(f"  ours / the hook alone: {harness.comparison_text(times)}")
    results = {"added_ms": harness.summarize(ours), "alone_ms": harness.summarize(alone), "over_alone_ms": over,
               "ratio": times, "check": check, "failed": harness.failures(samples)}
    return {"results": results, "samples": samples}


def check_python_hook(job: Job, row: Row) -> Dict[str, Any]:
    ours = environment_of([job.ma_run, "--", job.job_python, "-c", SHOW_ENV], row.cwd, row.env)
    differ = sorted(name for name, value in PY_HOOK_SETS.items() if ours.get(name) != value)
    return {"names": sorted(PY_HOOK_SETS), "differ": differ}


# --------------------------------------------------------------------------- main


def environment_info(args, job: Job, installed: str) -> Dict[str, Any]:
    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
            "rounds": args.rounds, "warmup": args.warmup, "per_sample": args.per_sample, "parts": args.parts,
            "ma_run": job.ma_run, "installed": installed, "job_python": args.job_python, "bash": job.bash}


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the scratch data still goes
    scratch = Path(tempfile.mkdtemp(prefix="ma-bench-hooks-", dir=args.workdir or "/tmp"))
    try:
        if args.venv:
            venv, installed = Path(args.venv).resolve(), f"the given venv {args.venv}"
        else:
            print("building ma_runtime's wheel and installing it into a scratch venv ...", file=sys.stderr)
            venv, installed = harness.install_wheel(scratch / "install"), "a wheel install in a scratch venv"
        job = make_job(scratch, venv, args.job_python)
        steps = {"sourced": lambda: part_sourced(args, job), "python": lambda: part_python(args, job)}
        harness.run_parts(steps, args.parts, args.json, environment_info(args, job, installed))
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
