"""Start-up overhead of `ma-run`, from a wheel install, against `tini` and a bare interpreter.

ma_runtime is built as a wheel and installed into a scratch venv (benchmarks/_harness.py), as an
image installs it: an editable install's import hook (a `.pth` file that every interpreter of that
venv runs) would add 13-19 ms to the `python -c pass` anchor and so flatter ma-run's difference
to it. `--venv DIR` measures an existing venv instead (its bin/python and bin/ma-run).

Seven rows, round-robin (one of each per round, each round starting one row later):

1. Wall time of a trivial supervised command: `ma-run true` against the anchors `python -c pass`
   (the same interpreter, so the difference is ma-run's own cost) and `tini -- true` (a C init).
   Goal (issue 29, which states it precisely): `ma-run true` at most 100 ms over `python -c pass`
   (difference of the medians; per round beside it).
   Beside them, the floor under that goal: the interpreter importing structlog (as the runtime imports it) and the
   standard library modules a supervisor's duties use, and nothing of ma_runtime (FLOOR_CODE). The verdict's note
   splits the difference into the floor's share and ma-run's own (its modules' imports and its work).
2. Launch to the worker's exec: time.time() just before Popen, against the clock the worker prints
   first (`date +%s%N`), for `ma-run date`, `tini -- date` and `date` started directly.
   Goal (the design's budget): runtime overhead from exec to the first worker's exec, without downloads,
   at most 150 ms median: launch to exec through ma-run less `date` started directly (medians).

Where ma-run's start-up goes: the `ma-run date` rows also split launch-to-exec into phases, from
the microsecond timestamps of ma-run's own log lines ("preflight passed" with its duration_ms,
"starting command"); and after the rounds, `python -X importtime` runs of `ma-run true` are
summed by top-level package, and by what ma_runtime imports first (with all it pulls in).

Every run gets MA_HOME set to a scratch folder (the task log goes there) and the default log format.
The goals are reported, never enforced: the script exits 0 unless a command fails.

    .venv/bin/python benchmarks/startup.py [--rounds 30] [--warmup 3] [--profile-runs 5] [--venv DIR] [--json FILE]
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402  (beside this script, not a package)

OVER_PYTHON_GOAL = harness.Goal("start-up", "ma-run start-up <= 100 ms over `python -c pass`",
                                "issue 29 (the design's budget: <= 150 ms from exec to the first worker's exec)",
                                100.0, "ms")
EXEC_GOAL = harness.Goal("exec to the worker's exec", "runtime overhead from exec to the first worker's exec, "
                         "without downloads: <= 150 ms median", "the design's budgets", 150.0, "ms")
DATE_NS = ["date", "+%s%N"]
# The floor under the goal: the same interpreter importing only what no supervisor built on this design can skip,
# and none of ma_runtime: structlog (a chosen runtime dependency, imported as util/logs.py imports it: asyncio
# deferred, which an empty stand-in models here; it brings typing, dataclasses, inspect, logging, datetime with it)
# and the standard library modules the supervisor's own duties use (children, signals, the pipes' threads and
# selector, JSON records, paths, the ulimit check's resource, prctl's ctypes). What ma-run takes above the floor is
# its own code's imports and its work.
FLOOR_CODE = ("import sys, types; sys.modules['asyncio'] = types.ModuleType('asyncio'); "
              "import structlog, subprocess, signal, threading, selectors, json, pathlib, resource, ctypes")
FLOOR_ROW = "floor: structlog + the stdlib it needs"
WALL_ROWS = ("ma-run true", "python -c pass", "tini -- true", FLOOR_ROW)
LAUNCH_ROWS = ("ma-run date", "date (direct)", "tini -- date")
LOG_LINE = re.compile(r'^time="([^"]+)" level=\w+ msg="([^"]*)"(.*)$')
IMPORT_LINE = re.compile(r"^import time:\s*(\d+)\s*\|\s*(\d+)\s*\| (\s*)(\S+)\s*$")
PHASES = (
    ("launch to preflight start", "interpreter, imports, settings, task log"),
    ("preflight checks", "their own duration_ms"),
    ("preflight end to 'starting command'", "stage-in, plan, signals, guard fork"),
    ("'starting command' to exec", "spawning the worker"),
    ("launch to exec", "the whole"),
)
TOP_ROWS = 15


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_round_arguments(parser, rounds=30, warmup=3, aliases=("--runs",))
    parser.add_argument("--profile-runs", type=int, default=5,
                        help="`python -X importtime` runs of `ma-run true` for the profile (default 5; 0: none)")
    parser.add_argument("--venv", metavar="DIR", help="measure this venv's bin/ma-run and bin/python instead of "
                                                      "a fresh wheel install (e.g. .venv, the editable install)")
    parser.add_argument("--tini", default=shutil.which("tini") or "/usr/bin/tini", help="tini executable")
    parser.add_argument("--json", metavar="FILE", help="also write the results (and raw samples) as JSON to FILE")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- one run


def wall_seconds(cmd: List[str], env: Dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{cmd!r} exited {proc.returncode}")
    return elapsed


def launch_to_exec(cmd: List[str], env: Dict[str, str]) -> Dict[str, Any]:
    """Seconds from just before Popen until the worker printed its clock; and ma-run's phases, if it logged."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"{cmd!r} exited {proc.returncode}: {err.decode(errors='replace').strip()[-500:]}")
    exec_at = int(out.decode().splitlines()[0]) / 1e9
    return {"seconds": exec_at - t0, "phases": phases(t0, exec_at, err.decode(errors="replace"))}


def log_times(stderr: str) -> Dict[str, Tuple[float, str]]:
    """msg -> (epoch seconds, the rest of the line), first occurrence, from ma-run's logfmt lines."""
    times: Dict[str, Tuple[float, str]] = {}
    for line in stderr.splitlines():
        match = LOG_LINE.match(line)
        if match and match.group(2) not in times:
            stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%dT%H:%M:%S.%fZ")
            times[match.group(2)] = (stamp.replace(tzinfo=datetime.timezone.utc).timestamp(), match.group(3))
    return times


def phases(t0: float, exec_at: float, stderr: str) -> Dict[str, Optional[float]]:
    """Seconds per phase of launch-to-exec; None where ma-run did not log what the phase needs."""
    times = log_times(stderr)
    starting = times.get("starting command", (None, ""))[0]
    passed, rest = times.get("preflight passed", (None, ""))
    duration = re.search(r"\bduration_ms=([0-9.]+)", rest)
    preflight_start = passed - float(duration.group(1)) / 1e3 if passed and duration else None
    names = [name for name, _ in PHASES]
    values = [
        preflight_start - t0 if preflight_start else None,
        passed - preflight_start if preflight_start else None,
        starting - passed if starting and passed else None,
        exec_at - starting if starting else None,
        exec_at - t0,
    ]
    return dict(zip(names, values))


# --------------------------------------------------------------------------- the rounds


def commands(python: str, ma_run: str, tini: str) -> Dict[str, Tuple[str, List[str]]]:
    """row -> (kind of measurement, argv)."""
    return {
        "ma-run true": ("wall", [ma_run, "--", "true"]),
        "python -c pass": ("wall", [python, "-c", "pass"]),
        "tini -- true": ("wall", [tini, "--", "true"]),
        FLOOR_ROW: ("wall", [python, "-c", FLOOR_CODE]),
        "ma-run date": ("launch", [ma_run, "--", *DATE_NS]),
        "date (direct)": ("launch", list(DATE_NS)),
        "tini -- date": ("launch", [tini, "--", *DATE_NS]),
    }


def tasks(rows: Dict[str, Tuple[str, List[str]]], env: Dict[str, str]):
    def task(kind: str, cmd: List[str]):
        if kind == "wall":
            return lambda: wall_seconds(cmd, env)
        return lambda: launch_to_exec(cmd, env)

    return {name: task(kind, cmd) for name, (kind, cmd) in rows.items()}


def seconds_of(result: Any) -> float:
    return result["seconds"] if isinstance(result, dict) else result


def phase_of(name: str):
    def value(result: Any) -> Optional[float]:
        return result["phases"].get(name)

    return value


# --------------------------------------------------------------------------- the import profile


def importtime_tree(stderr: str) -> List[Dict[str, Any]]:
    """Every import of a `-X importtime` run: name, self/cumulative µs, the module that imported it.

    The lines come in post-order (a module after everything it imported, those one level deeper),
    so the children of a line are the deeper lines pending since its previous sibling.
    """
    pending: Dict[int, List[Dict[str, Any]]] = {}
    nodes = []
    for line in stderr.splitlines():
        match = IMPORT_LINE.match(line)
        if not match:
            continue
        depth = len(match.group(3)) // 2
        node = {"name": match.group(4), "self_us": int(match.group(1)), "cumulative_us": int(match.group(2)),
                "importer": None}
        for child in pending.pop(depth + 1, []):
            child["importer"] = node["name"]
        pending.setdefault(depth, []).append(node)
        nodes.append(node)
    return nodes


def top_level(module: str) -> str:
    return module.split(".")[0]


def profile_of_run(nodes: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """ms: self time by top-level package and by ma_runtime module; what ma_runtime imports first, cumulative."""
    by_package: Dict[str, float] = {}
    own_modules: Dict[str, float] = {}
    pulled_in: Dict[str, float] = {}
    seen_ma_runtime = False
    for node in nodes:
        package, importer = top_level(node["name"]), node["importer"]
        add(by_package, package, node["self_us"] / 1e3)
        if package == "ma_runtime":
            add(own_modules, node["name"], node["self_us"] / 1e3)
        elif importer is None or top_level(importer) == "ma_runtime":
            # A top-level line is the interpreter's start-up or the script until ma_runtime.cli is in;
            # after that, it is an import inside a function (a lazy one), run when that is called.
            importer = importer or ("(lazy, at run time)" if seen_ma_runtime else "(start-up, the ma-run script)")
            add(pulled_in, f"{package} <- {importer}", node["cumulative_us"] / 1e3)
        seen_ma_runtime = seen_ma_runtime or (package == "ma_runtime" and node["importer"] is None)
    total = sum(node["self_us"] for node in nodes) / 1e3
    return {"by_package": by_package, "own_modules": own_modules, "pulled_in": pulled_in,
            "total": {"all imports": total, "modules": float(len(nodes))}}


def add(table: Dict[str, float], key: str, value: float) -> None:
    table[key] = table.get(key, 0.0) + value


def importtime_profile(python: str, ma_run: str, env: Dict[str, str], runs: int) -> Dict[str, Dict[str, float]]:
    """Medians over `runs` runs of `python -X importtime ma-run -- true` (a key missing from a run counts 0)."""
    per_run = []
    for _ in range(runs):
        done = subprocess.run([python, "-X", "importtime", ma_run, "--", "true"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            sys.exit(f"ma-run under -X importtime exited {done.returncode}")
        per_run.append(profile_of_run(importtime_tree(done.stderr)))
    merged: Dict[str, Dict[str, float]] = {}
    for part in ("by_package", "own_modules", "pulled_in", "total"):
        keys = {key for run in per_run for key in run[part]}
        merged[part] = {key: statistics.median(run[part].get(key, 0.0) for run in per_run) for key in keys}
    return merged


def print_profile(profile: Dict[str, Dict[str, float]], runs: int) -> None:
    total = profile["total"]
    print(f"\nwhere the imports go: python -X importtime of `ma-run true`, median of {runs} runs "
          "(importtime itself slows imports a little)")
    print(f"  all imports: {total['all imports']:.1f} ms over {total['modules']:.0f} modules; "
          f"ma_runtime's own modules: {profile['by_package'].get('ma_runtime', 0.0):.1f} ms (self)")
    print(f"  self time by top-level package (top {TOP_ROWS}):")
    for name, ms in sorted(profile["by_package"].items(), key=lambda item: -item[1])[:TOP_ROWS]:
        print(f"    {name:<28} {ms:7.1f} ms")
    print(f"  ma_runtime's modules by self time (top {TOP_ROWS}):")
    for name, ms in sorted(profile["own_modules"].items(), key=lambda item: -item[1])[:TOP_ROWS]:
        print(f"    {name:<40} {ms:7.1f} ms")
    print(f"  imported by ma_runtime (or at start-up), with everything each pulls in (top {TOP_ROWS}):")
    for name, ms in sorted(profile["pulled_in"].items(), key=lambda item: -item[1])[:TOP_ROWS]:
        print(f"    {name:<60} {ms:7.1f} ms")


# --------------------------------------------------------------------------- report


def report(samples: Dict[str, List[harness.Sample]]) -> Dict[str, Any]:
    wall = {name: harness.summarize(samples[name], seconds_of).scaled(1e3) for name in WALL_ROWS}
    launch = {name: harness.summarize(samples[name], seconds_of).scaled(1e3) for name in LAUNCH_ROWS}
    harness.print_table("wall time of a trivial command", list(wall.items()), "ms")
    over_python = harness.compare(samples["ma-run true"], samples["python -c pass"], harness.difference, seconds_of)
    over_tini = harness.compare(samples["ma-run true"], samples["tini -- true"], harness.ratio, seconds_of)
    floor_over_python = harness.compare(samples[FLOOR_ROW], samples["python -c pass"], harness.difference, seconds_of)
    over_floor = harness.compare(samples["ma-run true"], samples[FLOOR_ROW], harness.difference, seconds_of)
    harness.print_table("launch (just before Popen) to the worker's exec (date +%s%N)", list(launch.items()), "ms")
    exec_over_direct = harness.compare(samples["ma-run date"], samples["date (direct)"], harness.difference,
                                       seconds_of)
    phase_rows = []
    for name, what in PHASES:
        summary = harness.summarize(samples["ma-run date"], phase_of(name))
        phase_rows.append((f"{name} ({what})", summary.scaled(1e3) if summary else None))
    harness.print_table("ma-run date, launch to exec by phase (from its log lines' timestamps)", phase_rows, "ms")
    print()
    print(f"  ma-run true - python -c pass: {harness.comparison_text(over_python.scaled(1e3), ' ms', 1)}")
    print(f"  ma-run true / tini -- true:   {harness.comparison_text(over_tini)}")
    print(f"  the floor - python -c pass:   {harness.comparison_text(floor_over_python.scaled(1e3), ' ms', 1)}")
    print(f"  ma-run true - the floor:      {harness.comparison_text(over_floor.scaled(1e3), ' ms', 1)}")
    print(f"  launch to exec, ma-run - direct: {harness.comparison_text(exec_over_direct.scaled(1e3), ' ms', 1)}")
    over, overhead = over_python.scaled(1e3), exec_over_direct.scaled(1e3)
    goals = [
        harness.judge(OVER_PYTHON_GOAL, over.of_medians, "ma-run true - python -c pass, difference of the medians",
                      over.per_round, f"the floor (structlog + the stdlib it needs, no ma_runtime) is itself "
                      f"{floor_over_python.scaled(1e3).of_medians:.0f} ms over python -c pass; ma-run is "
                      f"{over_floor.scaled(1e3).of_medians:.0f} ms over the floor"),
        harness.judge(EXEC_GOAL, overhead.of_medians, "launch to the worker's exec, ma-run date - date started "
                      "directly, difference of the medians", overhead.per_round,
                      f"ma-run date {launch['ma-run date'].median:.1f} ms (median)"),
    ]
    return {
        "wall_ms": {k: v.as_dict() for k, v in wall.items()},
        "launch_to_exec_ms": {k: v.as_dict() for k, v in launch.items()},
        "phases_ms": {label: row.as_dict() if row else None for label, row in phase_rows},
        "comparisons": {"ma_run_minus_python_s": over_python.as_dict(), "ma_run_over_tini": over_tini.as_dict(),
                        "exec_ma_run_minus_direct_s": exec_over_direct.as_dict(),
                        "floor_minus_python_s": floor_over_python.as_dict(),
                        "ma_run_minus_floor_s": over_floor.as_dict()},
        "goals": goals,
    }


def environment_info(args: argparse.Namespace, python: str, ma_run: str, installed: str) -> Dict[str, Any]:
    return {
        "python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
        "rounds": args.rounds, "warmup": args.warmup, "profile_runs": args.profile_runs,
        "measured_python": python, "ma_run": ma_run, "installed": installed, "tini": args.tini,
    }


def run_environment(ma_home: Path) -> Dict[str, str]:
    env = dict(os.environ, MA_HOME=str(ma_home))
    # The phases are read from the default (logfmt) lines; a pycache prefix would make the
    # interpreter ignore the installed .pyc files and compile every module on every start.
    for name in ("MA_RUNTIME_LOG_FORMAT", "PYTHONPYCACHEPREFIX"):
        env.pop(name, None)
    return env


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ma-bench-startup-") as scratch_dir:
        scratch = Path(scratch_dir)
        if args.venv:
            venv, installed = Path(args.venv).resolve(), f"the given venv {args.venv}"
        else:
            print("building ma_runtime's wheel and installing it into a scratch venv ...", file=sys.stderr)
            venv, installed = harness.install_wheel(scratch), "a wheel install in a scratch venv"
        python, ma_run = str(venv / "bin" / "python"), str(venv / "bin" / "ma-run")
        (scratch / "home").mkdir()
        env = run_environment(scratch / "home")
        harness.print_header(f"start-up of ma-run from {installed} ({python})", args.rounds, args.warmup)
        for goal in (OVER_PYTHON_GOAL, EXEC_GOAL):
            harness.print_goal(goal)
        samples = harness.round_robin(tasks(commands(python, ma_run, args.tini), env), args.rounds, args.warmup)
        results = report(samples)
        profile = importtime_profile(python, ma_run, env, args.profile_runs) if args.profile_runs > 0 else None
        if profile:
            print_profile(profile, args.profile_runs)
        if args.json:
            payload = {"environment": environment_info(args, python, ma_run, installed), **results,
                       "run": harness.run_record(results["goals"]),
                       "import_profile_ms": profile,
                       "samples": {name: [vars(s) for s in rows] for name, rows in samples.items()}}
            with open(args.json, "w") as handle:
                json.dump(payload, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
