"""All preflight checks on a healthy single node: wall time, against the shell it replaces.

The node is this machine, plus 8 fake GPUs: /dev-style nodes in a temporary
directory and ma_runtime/local/fakes/nvidia-smi on PATH, which prints the real tool's CSV.
DNS has names to resolve (localhost, from a Volcano-style .host file) but no
waits. ma_runtime runs from a wheel installed into a scratch venv
(benchmarks/_harness.py; `--venv DIR` for another), so no editable-install hook
inflates the command's start-up. Measured round-robin (min/median/max over the
rounds, the load average beside each row):
- `checks`: the runner's own time for all checks (the report's duration_ms),
  which is what `ma-runtime run` adds before the command;
- `ma-preflight --json`: the whole command, interpreter start-up included;
- anchor `shell`: the bash an image runs today for the same facts (getent, df,
  ulimit, ls /dev/nvidia*, nvidia-smi --query-gpu).
Budget: checks <= 200 ms (median) excluding DNS waits.

    .venv/bin/python benchmarks/preflight.py [--rounds 20] [--warmup 1] [--venv DIR] [--json FILE]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402  (beside this script, not a package)

from ma_runtime.local.devices import FAKES

ROOT = Path(__file__).resolve().parent.parent

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
    env = dict(
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
    env.pop("PYTHONPYCACHEPREFIX", None)  # it would make the interpreter ignore the installed .pyc files
    return env


def time_preflight(ma_preflight: str, env: dict) -> Dict[str, Any]:
    """Wall ms of ma-preflight --json, the report's own duration ms, and ms per check."""
    started = time.perf_counter()
    done = subprocess.run([ma_preflight, "--json"], env=env, capture_output=True, text=True, check=False)
    wall = (time.perf_counter() - started) * 1000
    report = json.loads(done.stdout)
    if not report["ok"]:
        sys.exit(f"the benchmark node is not healthy: {report['failed']}")
    return {"wall_ms": wall, "checks_ms": report["duration_ms"],
            "items_ms": {c["item"]: c["duration_ms"] for c in report["checks"]}}


def time_shell(env: dict) -> Dict[str, float]:
    started = time.perf_counter()
    subprocess.run(["bash", "-c", SHELL], env=env, capture_output=True, check=True)
    return {"wall_ms": (time.perf_counter() - started) * 1000}


def field(name: str):
    return lambda result: result[name]


def item(name: str):
    return lambda result: result["items_ms"].get(name)


def report(samples: Dict[str, list]) -> Dict[str, Any]:
    ours, shell = samples["ma-preflight"], samples["shell"]
    rows = {"checks (duration_ms)": harness.summarize(ours, field("checks_ms")),
            "ma-preflight --json": harness.summarize(ours, field("wall_ms")),
            "shell (anchor)": harness.summarize(shell, field("wall_ms"))}
    harness.print_table("preflight on a healthy node (8 fake GPUs), ms", list(rows.items()), "ms")
    names = list(dict.fromkeys(name for sample in ours for name in sample.result["items_ms"]))
    items = {name: harness.summarize(ours, item(name)) for name in names}
    harness.print_table("per check (dns runs in parallel with the others)", list(items.items()), "ms")
    comparison = harness.compare(ours, shell, harness.ratio, field("wall_ms"))
    checks = rows["checks (duration_ms)"].median
    print(f"\n  ma-preflight / shell: {harness.comparison_text(comparison)}")
    print(f"  checks: {checks:.1f} ms (median), budget <= {BUDGET_MS:.0f} ms: {harness.verdict(checks <= BUDGET_MS)}")
    return {"rows_ms": {k: v.as_dict() for k, v in rows.items()},
            "items_ms": {k: v.as_dict() for k, v in items.items() if v},
            "ma_preflight_over_shell": comparison.as_dict(), "budget_ms": BUDGET_MS, "met": checks <= BUDGET_MS}


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_round_arguments(parser, rounds=20, warmup=1, aliases=("--runs",))
    parser.add_argument("--venv", metavar="DIR", help="use this venv's bin/ma-preflight instead of a fresh wheel "
                                                      "install (e.g. .venv)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ma-bench-preflight-") as scratch_dir:
        scratch = Path(scratch_dir)
        if args.venv:
            venv = Path(args.venv).resolve()
        else:
            print("building ma_runtime's wheel and installing it into a scratch venv ...", file=sys.stderr)
            venv = harness.install_wheel(scratch)
        ma_preflight = str(venv / "bin" / "ma-preflight")
        node = scratch / "node"
        node.mkdir()
        env = healthy_node(node)
        harness.print_header(f"preflight, {ma_preflight}", args.rounds, args.warmup)
        tasks = {"ma-preflight": lambda: time_preflight(ma_preflight, env), "shell": lambda: time_shell(env)}
        samples = harness.round_robin(tasks, args.rounds, args.warmup)
    results = report(samples)
    if args.json:
        payload = {**results, "samples": {name: [vars(s) for s in rows] for name, rows in samples.items()}}
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
