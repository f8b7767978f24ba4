"""All preflight checks on a healthy single node: wall time, against the shell it replaces.

The node is this machine, plus 8 fake GPUs: /dev-style nodes in a temporary
directory and tests/fakes/nvidia-smi on PATH, which prints the real tool's CSV.
DNS has names to resolve (localhost, from a Volcano-style .host file) but no
waits. Measured, round-robin, median of --runs:
- `checks`: the runner's own time for all checks (the report's duration_ms),
  which is what `ma-runtime run` adds before the command;
- `ma-preflight --json`: the whole command, interpreter start-up included;
- anchor `shell`: the bash an image runs today for the same facts (getent, df,
  ulimit, ls /dev/nvidia*, nvidia-smi --query-gpu).
Budget: checks <= 200 ms excluding DNS waits.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAKES = ROOT / "tests" / "fakes"
BUDGET_MS = 200.0
QUERY = "index,pci.bus_id,name,uuid,ecc.errors.uncorrected.volatile.total,retired_pages.pending"
SHELL = f"""
getent hosts localhost >/dev/null
df -B1 / /dev/shm >/dev/null
ulimit -l; ulimit -n; ulimit -s; ulimit -u
ls "$DEVDIR"/nvidia* >/dev/null
nvidia-smi --query-gpu={QUERY} --format=csv,noheader,nounits >/dev/null
"""


def healthy_node(scratch: Path) -> dict:
    devdir, volcano = scratch / "dev", scratch / "volcano"
    devdir.mkdir()
    volcano.mkdir()
    for name in [f"nvidia{i}" for i in range(8)] + ["nvidiactl"]:
        (devdir / name).touch()
    (volcano / "worker.host").write_text("localhost\n")
    return dict(
        os.environ,
        MA_HOME=str(scratch / "home"),
        PATH=f"{FAKES}:{os.environ['PATH']}",
        DEVDIR=str(devdir),
        MA_NUM_GPUS="8",
        MA_RUNTIME_PREFLIGHT_DEV_DIR=str(devdir),
        MA_RUNTIME_PREFLIGHT_VOLCANO_DIR=str(volcano),
        MA_RUNTIME_PREFLIGHT_ULIMIT="always",
        MA_RUNTIME_PREFLIGHT_MEMLOCK_MIN_KB="0",
        MA_RUNTIME_PREFLIGHT_NOFILE_MIN="0",
        MA_RUNTIME_PREFLIGHT_STACK_MIN_KB="0",
        MA_RUNTIME_PREFLIGHT_NPROC_MIN="0",
    )


def time_preflight(env: dict) -> tuple:
    """(wall ms of ma-preflight --json, the report's own duration ms, {item: ms})."""
    started = time.perf_counter()
    done = subprocess.run([str(Path(sys.executable).parent / "ma-preflight"), "--json"], env=env,
                          capture_output=True, text=True, check=False)
    wall = (time.perf_counter() - started) * 1000
    report = json.loads(done.stdout)
    if not report["ok"]:
        sys.exit(f"the benchmark node is not healthy: {report['failed']}")
    per_item = {c["item"]: c["duration_ms"] for c in report["checks"]}
    return wall, report["duration_ms"], per_item


def time_shell(env: dict) -> float:
    started = time.perf_counter()
    subprocess.run(["bash", "-c", SHELL], env=env, capture_output=True, check=True)
    return (time.perf_counter() - started) * 1000


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ma-bench-preflight-") as scratch:
        env = healthy_node(Path(scratch))
        time_preflight(env)  # warm-up
        samples = {"checks": [], "ma-preflight": [], "shell": []}
        per_item = {}
        for _ in range(args.runs):
            wall, checks, items = time_preflight(env)
            samples["ma-preflight"].append(wall)
            samples["checks"].append(checks)
            for item, ms in items.items():
                per_item.setdefault(item, []).append(ms)
            samples["shell"].append(time_shell(env))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    print(f"preflight on a healthy node (8 fake GPUs), median of {args.runs}, round-robin, {os.cpu_count()} CPUs")
    for name, value in medians.items():
        print(f"  {name:<14} {value:8.1f} ms")
    print("  per check (dns runs in parallel with the others):")
    for item, values in per_item.items():
        print(f"    {item:<12} {statistics.median(values):8.1f} ms")
    status = "within" if medians["checks"] <= BUDGET_MS else "OVER"
    print(f"  checks: {medians['checks']:.1f} ms ({status} budget of {BUDGET_MS:.0f} ms)")
    print(f"  ma-preflight / shell: {medians['ma-preflight'] / medians['shell']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"median_ms": medians, "samples_ms": samples}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
