"""Console forwarding throughput of `ma-run`, measured against a direct write.

A writer script prints N short lines (`line 0000001` ... , default N = 10**6)
as fast as Python can, in large buffered batches. It runs three ways, each
with its stdout going to a file:

  direct   python writer.py > file             (the anchor: no supervisor)
  tini     tini -- python writer.py > file      (a C init, nothing copied)
  ma-run   ma-run -- python writer.py > file    (pumped line-wise to stdout
                                                 AND appended to the task log)

Lines/s is N over the whole wall time of the run (interpreter and supervisor
start-up included), timed with time.perf_counter around subprocess.run. The
modes run round-robin, K times each (default 3); the table reports the MEDIAN
of the K runs (the best is kept too). Budget: at least 200 000 lines/s through
ma-run.

Every run is also checked: the output file, and for ma-run the task log at
$MA_HOME/modelarts/log/modelarts-job-local-worker-0.log (fresh MA_HOME each
run), must hold all N writer lines, exactly once, in order. The task log also
carries ma-run's own log lines; those are counted separately, not as errors.

    .venv/bin/python benchmarks/forwarding.py [--lines N] [--repeat K] [--json FILE]
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

BUDGET_LINES_PER_S = 200_000
TASK_LOG = os.path.join("modelarts", "log", "modelarts-job-local-worker-0.log")
LINE_PREFIX = b"line "

WRITER_SOURCE = """\
import sys

def main(count, width, batch=10_000):
    write = sys.stdout.write
    for start in range(1, count + 1, batch):
        stop = min(start + batch, count + 1)
        write("".join(f"line {i:0{width}d}\\n" for i in range(start, stop)))
    sys.stdout.flush()

main(int(sys.argv[1]), int(sys.argv[2]))
"""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=10**6, help="lines the writer prints (default 10**6)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per mode; median reported (default 3)")
    parser.add_argument("--ma-run", default=default_ma_run(), help="ma-run executable (default: next to this python)")
    parser.add_argument("--tini", default=shutil.which("tini") or "/usr/bin/tini", help="tini executable")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    return parser.parse_args(argv)


def default_ma_run() -> str:
    beside_python = os.path.join(os.path.dirname(sys.executable), "ma-run")
    return beside_python if os.path.exists(beside_python) else (shutil.which("ma-run") or "ma-run")


def number_width(count: int) -> int:
    return max(6, len(str(count)))


def expected_output(count: int) -> bytes:
    width = number_width(count)
    return "".join(f"line {i:0{width}d}\n" for i in range(1, count + 1)).encode()


def mode_commands(writer_cmd: List[str], ma_run: str, tini: str) -> Dict[str, List[str]]:
    return {
        "direct": writer_cmd,
        "tini": [tini, "--", *writer_cmd],
        "ma-run": [ma_run, "--", *writer_cmd],
    }


def run_to_file(cmd: List[str], run_dir: str) -> Dict[str, object]:
    """Runs cmd with stdout to run_dir/stdout and MA_HOME=run_dir; times it."""
    env = dict(os.environ, MA_HOME=run_dir)
    stdout_path = os.path.join(run_dir, "stdout")
    stderr_path = os.path.join(run_dir, "stderr")
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        start = time.perf_counter()
        proc = subprocess.run(cmd, stdout=out, stderr=err, env=env)
        elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        with open(stderr_path, "rb") as err:
            sys.stderr.write(err.read().decode(errors="replace"))
        sys.exit(f"{cmd!r} exited {proc.returncode}")
    return {"seconds": elapsed, "stdout": stdout_path, "task_log": os.path.join(run_dir, TASK_LOG)}


def read_bytes(path: str) -> Optional[bytes]:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def check_lines(data: Optional[bytes], count: int, expected: bytes) -> Dict[str, object]:
    """Counts writer lines lost, duplicated, malformed or out of order in data."""
    if data is None:
        return {"present": False, "writer_lines": 0, "lost": count, "other_lines": 0, "exact": False}
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    writer_lines = [line for line in lines if line.startswith(LINE_PREFIX)]
    other_lines = len(lines) - len(writer_lines)
    if b"\n".join(writer_lines) + b"\n" == expected:
        return {"present": True, "writer_lines": count, "lost": 0, "other_lines": other_lines, "exact": True}
    return dict(present=True, other_lines=other_lines, exact=False, **damage_report(writer_lines, count))


def damage_report(writer_lines: List[bytes], count: int) -> Dict[str, object]:
    width = number_width(count)
    numbers = [parse_number(line, width) for line in writer_lines]
    valid = [n for n in numbers if n is not None and 1 <= n <= count]
    distinct = set(valid)
    return {
        "writer_lines": len(writer_lines),
        "lost": count - len(distinct),
        "duplicated": len(valid) - len(distinct),
        "malformed": len(numbers) - len(valid),
        "out_of_order": sum(1 for a, b in zip(valid, valid[1:]) if b <= a),
        "first": writer_lines[0].decode(errors="replace") if writer_lines else None,
        "last": writer_lines[-1].decode(errors="replace") if writer_lines else None,
    }


def parse_number(line: bytes, width: int) -> Optional[int]:
    digits = line[len(LINE_PREFIX) :]
    return int(digits) if len(digits) == width and digits.isdigit() else None


def check_run(mode: str, run: Dict[str, object], count: int, expected: bytes) -> Dict[str, object]:
    checks = {"stdout": check_lines(read_bytes(run["stdout"]), count, expected)}
    if mode == "ma-run":
        checks["task_log"] = check_lines(read_bytes(run["task_log"]), count, expected)
    return checks


def writer_command(writer: str, count: int) -> List[str]:
    return [sys.executable, writer, str(count), str(number_width(count))]


def warm_up(commands: Dict[str, List[str]], scratch: str) -> None:
    """One small untimed run per mode: page cache, imports, first-run costs."""
    for cmd in commands.values():
        run_dir = tempfile.mkdtemp(prefix="warmup-", dir=scratch)
        run_to_file(cmd, run_dir)
        shutil.rmtree(run_dir)


def run_rounds(commands: Dict[str, List[str]], count: int, repeat: int, scratch: str) -> Dict[str, List[dict]]:
    """Round-robin over the modes, repeat rounds, each run checked line by line."""
    expected = expected_output(count)
    runs: Dict[str, List[dict]] = {mode: [] for mode in commands}
    for _ in range(repeat):
        for mode, cmd in commands.items():
            run_dir = tempfile.mkdtemp(prefix=f"{mode}-", dir=scratch)
            run = run_to_file(cmd, run_dir)
            runs[mode].append({"seconds": run["seconds"], "checks": check_run(mode, run, count, expected)})
            shutil.rmtree(run_dir)
    return runs


def mode_summary(mode_runs: List[dict], count: int) -> Dict[str, object]:
    seconds = [run["seconds"] for run in mode_runs]
    lost = {dest: max(run["checks"][dest]["lost"] for run in mode_runs) for dest in mode_runs[0]["checks"]}
    return {
        "median_s": statistics.median(seconds),
        "median_lines_per_s": count / statistics.median(seconds),
        "best_lines_per_s": count / min(seconds),
        "worst_lost": lost,
        "all_exact": all(check["exact"] for run in mode_runs for check in run["checks"].values()),
    }


def print_table(summaries: Dict[str, Dict[str, object]], count: int, repeat: int) -> None:
    print(f"forwarding {count} lines, median of {repeat} runs per mode, round-robin, {os.cpu_count()} CPUs\n")
    print(f"  {'mode':<8} {'median s':>9} {'lines/s (median)':>17} {'lines/s (best)':>15}  in order")
    for mode, row in summaries.items():
        exact = "yes" if row["all_exact"] else "NO"
        print(
            f"  {mode:<8} {row['median_s']:>9.3f} {row['median_lines_per_s']:>17,.0f}"
            f" {row['best_lines_per_s']:>15,.0f}  {exact}"
        )


def print_verdict(summaries: Dict[str, Dict[str, object]], runs: Dict[str, List[dict]]) -> Dict[str, object]:
    ma_run = summaries["ma-run"]
    ratio = ma_run["median_lines_per_s"] / summaries["direct"]["median_lines_per_s"]
    status = "meets" if ma_run["median_lines_per_s"] >= BUDGET_LINES_PER_S else "BELOW"
    print(f"\n  ma-run / direct: {ratio:.2f}x")
    print(f"  ma-run: {ma_run['median_lines_per_s']:,.0f} lines/s ({status} budget of {BUDGET_LINES_PER_S:,} lines/s)")
    for mode, row in summaries.items():
        for dest, lost in row["worst_lost"].items():
            print(f"  {mode} {dest}: lines lost: {lost}")
    other = [run["checks"]["task_log"]["other_lines"] for run in runs["ma-run"]]
    print(f"  ma-run task log: {max(other)} non-writer lines (ma-run's own log) at most per run")
    return {"ma_run_over_direct": ratio, "budget_lines_per_s": BUDGET_LINES_PER_S, "meets_budget": status == "meets"}


def print_damage(runs: Dict[str, List[dict]]) -> None:
    for mode, mode_runs in runs.items():
        for index, run in enumerate(mode_runs):
            for dest, check in run["checks"].items():
                if not check["exact"]:
                    print(f"  DAMAGE {mode} run {index + 1} {dest}: {json.dumps(check)}")


def environment_info(args: argparse.Namespace) -> Dict[str, object]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "lines": args.lines,
        "repeat": args.repeat,
        "statistic": "median of repeat runs (best also given)",
        "ma_run": args.ma_run,
        "tini": args.tini,
    }


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ma-bench-forwarding-") as scratch:
        writer = os.path.join(scratch, "writer.py")
        with open(writer, "w") as handle:
            handle.write(WRITER_SOURCE)
        warm_up(mode_commands(writer_command(writer, 1000), args.ma_run, args.tini), scratch)
        commands = mode_commands(writer_command(writer, args.lines), args.ma_run, args.tini)
        runs = run_rounds(commands, args.lines, args.repeat, scratch)
    summaries = {mode: mode_summary(mode_runs, args.lines) for mode, mode_runs in runs.items()}
    print_table(summaries, args.lines, args.repeat)
    verdict = print_verdict(summaries, runs)
    print_damage(runs)
    if args.json:
        result = {"environment": environment_info(args), "modes": summaries, "verdict": verdict, "runs": runs}
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
