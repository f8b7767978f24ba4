"""Start-up overhead of `ma-run`, measured against `tini` and a bare interpreter.

Two measurements, each taken round-robin (one run of every command per round)
so that machine noise falls on all commands alike:

1. Wall time of a trivial supervised command: `ma-run true` against the anchors
   `tini -- true` (a C init, the floor for "a supervisor at all") and
   `python -c pass` (the same interpreter ma-run runs on, so the difference is
   ma-run's own cost). Budget: `ma-run true` at most 150 ms over `python -c pass`.
2. Launch to the worker's exec: time.time() just before Popen, against the
   timestamp the worker itself prints first (`date +%s%N`). Anchors: `date`
   started directly and under `tini --`.

Timing is pure Python (time.perf_counter around subprocess.run), so nothing but
the standard library is needed. Every run gets MA_HOME set to a scratch
directory, so the task log lands there.

    .venv/bin/python benchmarks/startup.py [--runs 40] [--warmup 3] [--json FILE]
"""

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence

BUDGET_OVER_PYTHON_MS = 150.0
DATE_NS = ["date", "+%s%N"]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="timed runs per command (default 40)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs per command first (default 3)")
    parser.add_argument("--ma-run", default=default_ma_run(), help="ma-run executable (default: next to this python)")
    parser.add_argument("--tini", default=shutil.which("tini") or "/usr/bin/tini", help="tini executable")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    return parser.parse_args(argv)


def default_ma_run() -> str:
    beside_python = os.path.join(os.path.dirname(sys.executable), "ma-run")
    return beside_python if os.path.exists(beside_python) else (shutil.which("ma-run") or "ma-run")


def wall_commands(ma_run: str, tini: str) -> Dict[str, List[str]]:
    return {
        "ma-run true": [ma_run, "--", "true"],
        "tini -- true": [tini, "--", "true"],
        "python -c pass": [sys.executable, "-c", "pass"],
    }


def launch_commands(ma_run: str, tini: str) -> Dict[str, List[str]]:
    return {
        "ma-run date": [ma_run, "--", *DATE_NS],
        "tini -- date": [tini, "--", *DATE_NS],
        "date (direct)": list(DATE_NS),
    }


def wall_seconds(cmd: List[str], env: Dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{cmd!r} exited {proc.returncode}")
    return elapsed


def launch_to_exec_seconds(cmd: List[str], env: Dict[str, str]) -> float:
    """Seconds from just before Popen until the worker printed its clock."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    out, _ = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"{cmd!r} exited {proc.returncode}")
    first_line = out.decode().splitlines()[0]
    return int(first_line) / 1e9 - t0


def round_robin(commands: Dict[str, List[str]], measure, runs: int, warmup: int, env) -> Dict[str, List[float]]:
    samples: Dict[str, List[float]] = {name: [] for name in commands}
    for round_index in range(warmup + runs):
        for name, cmd in commands.items():
            value = measure(cmd, env)
            if round_index >= warmup:
                samples[name].append(value)
    return samples


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def summary_ms(values: Sequence[float]) -> Dict[str, float]:
    return {
        "median_ms": statistics.median(values) * 1e3,
        "p90_ms": percentile(values, 0.9) * 1e3,
        "min_ms": min(values) * 1e3,
        "max_ms": max(values) * 1e3,
    }


def print_table(title: str, stats: Dict[str, Dict[str, float]]) -> None:
    print(f"\n{title}")
    print(f"  {'command':<18} {'median ms':>10} {'p90 ms':>10} {'min ms':>10}")
    for name, row in stats.items():
        print(f"  {name:<18} {row['median_ms']:>10.1f} {row['p90_ms']:>10.1f} {row['min_ms']:>10.1f}")


def wall_verdict(stats: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    ma_run = stats["ma-run true"]["median_ms"]
    return {
        "ma_run_minus_python_ms": ma_run - stats["python -c pass"]["median_ms"],
        "ma_run_over_tini_ratio": ma_run / stats["tini -- true"]["median_ms"],
        "budget_over_python_ms": BUDGET_OVER_PYTHON_MS,
    }


def launch_verdict(stats: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    ma_run = stats["ma-run date"]["median_ms"]
    return {
        "ma_run_minus_direct_ms": ma_run - stats["date (direct)"]["median_ms"],
        "ma_run_minus_tini_ms": ma_run - stats["tini -- date"]["median_ms"],
    }


def print_verdicts(wall: Dict[str, float], launch: Dict[str, float]) -> None:
    over = wall["ma_run_minus_python_ms"]
    status = "within" if over <= BUDGET_OVER_PYTHON_MS else "OVER"
    print(f"\n  ma-run true - python -c pass: {over:.1f} ms ({status} budget of {BUDGET_OVER_PYTHON_MS:.0f} ms)")
    print(f"  ma-run true / tini -- true:   {wall['ma_run_over_tini_ratio']:.1f}x")
    print(f"  launch to worker exec, ma-run - direct: {launch['ma_run_minus_direct_ms']:.1f} ms")
    print(f"  launch to worker exec, ma-run - tini:   {launch['ma_run_minus_tini_ms']:.1f} ms")


def compile_bytecode() -> None:
    """Writes ma_runtime's .pyc files, as `pip install` does for a regular install.

    An editable install under PYTHONDONTWRITEBYTECODE (set on these machines)
    would otherwise recompile every module on every start, ~15-20 ms that no
    installed image pays.
    """
    import compileall

    import ma_runtime

    compileall.compile_dir(os.path.dirname(ma_runtime.__file__), quiet=1)


def environment_info(args: argparse.Namespace) -> Dict[str, object]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "runs": args.runs,
        "warmup": args.warmup,
        "ma_run": args.ma_run,
        "tini": args.tini,
        "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE"),
        "PYTHONPYCACHEPREFIX": os.environ.get("PYTHONPYCACHEPREFIX"),
    }


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    compile_bytecode()
    with tempfile.TemporaryDirectory(prefix="ma-bench-startup-") as ma_home:
        env = dict(os.environ, MA_HOME=ma_home)
        wall = round_robin(wall_commands(args.ma_run, args.tini), wall_seconds, args.runs, args.warmup, env)
        launch = round_robin(
            launch_commands(args.ma_run, args.tini), launch_to_exec_seconds, args.runs, args.warmup, env
        )
    wall_stats = {name: summary_ms(values) for name, values in wall.items()}
    launch_stats = {name: summary_ms(values) for name, values in launch.items()}
    print(f"start-up, {args.runs} runs each after {args.warmup} warm-up, round-robin, {os.cpu_count()} CPUs")
    print_table("wall time of a trivial command", wall_stats)
    print_table("launch (before Popen) to worker exec (date +%s%N)", launch_stats)
    verdicts = {"wall": wall_verdict(wall_stats), "launch_to_exec": launch_verdict(launch_stats)}
    print_verdicts(verdicts["wall"], verdicts["launch_to_exec"])
    if args.json:
        result = {
            "environment": environment_info(args),
            "wall": wall_stats,
            "launch_to_exec": launch_stats,
            "verdicts": verdicts,
            "samples_s": {"wall": wall, "launch_to_exec": launch},
        }
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
