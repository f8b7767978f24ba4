"""Job-wide restart (issue 26): the first failure on one node to every node's workers stopped, and to every node's
first line of the next attempt, 3 nodes; ma-run's coordinator against the same job without it and against
torchrun's own job-wide restart (c10d rendezvous).

Three nodes of ma_runtime/local/nodes.py (network namespaces, host names and a hosts file as a Volcano job's
pods have them), as tests/e2e/test_job_as_one.py uses them. One plain Python script on every node and in every
row (no torch in it, no device): it counts its own starts per node (a file created exclusively per start, so
every launcher's attempt is told alike), writes each start's wall-clock time (time.time_ns: CLOCK_REALTIME, one
clock for every process of the machine) as its first statement, and on its first start waits until every node's
first start is up. Then node 1 runs --run-seconds more, writes the time and exits 3; the others sleep, and a
SIGTERM makes them write the time and exit 143. A later start writes its time and exits 0.

Rows, round-robin (benchmarks/_harness.py):

  ma-run (coordinator)    `ma-run python SCRIPT` on every node, MA_RUNTIME_MAX_RESTARTS=1,
                          MA_RUNTIME_NODE_LOST_SECONDS=5, MA_RUNTIME_DEVICE_RELEASE_SECONDS=0 (no device here),
                          MA_RUNTIME_PREFLIGHT=off; worker-0's runtime hosts the store. Every node must exit 0.
  ma-run (coordinator off)  the same with MA_RUNTIME_COORDINATOR=off (the behaviour before issue 26): node 1
                          restarts alone; the others are never told. A run ends --off-wait seconds after the
                          failure; the survivors still running then are "not stopped within N s".
  torchrun c10d           `torchrun --nnodes=3 --nproc-per-node=1 --max-restarts=1 --rdzv-backend=c10d
                          --rdzv-endpoint=<worker-0>:29400` on every node, without ma-run: torchrun's elastic agent
                          on node 1 restarts its worker through a new rendezvous, and the other agents, seeing a
                          node waiting, stop their workers and join it (torchrun's own job-wide restart). Every
                          node must exit 0.

Figures, from the scripts' own time marks (failure = node 1's mark just before its exit):
  stopped     the failure to the latest SIGTERM mark of nodes 0 and 2 (goal: <= 3 s)
  relaunched  the failure to the latest first mark of the second start, every node (goal: <= 5 s, no device wait)
  node 1 again  the failure to node 1's own second start (it is the only one the "off" row relaunches)
and per round the ratio ma-run / torchrun c10d of each (goal: faster, < 1).

    .venv/bin/python benchmarks/job_restart.py [--rounds 5] [--warmup 1] [--run-seconds 0.5] [--off-wait 10]
        [--ma-run PATH] [--timeout 90] [--json FILE]

Needs root (network namespaces) and torchrun beside this interpreter (the torchrun row is left out without it).
Every namespace, /etc/netns entry, veth and process it made is removed at the end, whatever happens.
"""

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402  (beside this script, not a package)

from ma_runtime.local import nodes as local_nodes  # noqa: E402
from ma_runtime.local.nodes import Nodes  # noqa: E402

JOB = "ma-bench-jr"
NODES = 3
FAILING = 1  # the node whose first start fails
FAIL_CODE = 3
RDZV_PORT = 29400
GOAL_STOPPED_S, GOAL_RELAUNCHED_S = 3.0, 5.0
OURS, OFF, TORCHRUN = "ma-run (coordinator)", "ma-run (coordinator off)", "torchrun c10d --max-restarts=1"
FOREIGN_PREFIXES = ("MA_", "VC_", "VK_", "MY_", "PET_", "TORCHELASTIC_", "RANK_TABLE")

WORKER_SOURCE = """\
import time

STARTED_NS = time.time_ns()  # first: on a relaunch this is the node's first line of the new attempt
import os
import signal
import sys

MARKS = os.environ["JOB_RESTART_DIR"]
NODE = os.environ["JOB_RESTART_NODE"]


def start_number():
    # Created exclusively, one file per start of this node: every launcher's attempts counted alike (torchrun
    # does not count a restart it did not fail itself).
    number = 1
    while True:
        try:
            os.close(os.open(os.path.join(MARKS, f"start-{NODE}-{number}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return number
        except FileExistsError:
            number += 1


def mark(kind, ns):
    line = f"{kind} node={NODE} start={number} ns={ns}\\n"
    fd = os.open(os.path.join(MARKS, "marks"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, line.encode())  # one write: lines of several nodes never interleave
    os.close(fd)


def stopped(_signum, _frame):
    mark("sigterm", time.time_ns())
    os._exit(143)


number = start_number()
mark("first", STARTED_NS)
print(f"node {NODE} start {number}", flush=True)
if number >= 2:
    sys.exit(0)
signal.signal(signal.SIGTERM, stopped)
open(os.path.join(MARKS, f"up-{NODE}"), "w").close()
deadline = time.monotonic() + 120
while sum(name.startswith("up-") for name in os.listdir(MARKS)) < int(sys.argv[1]):
    if time.monotonic() > deadline:
        sys.exit(f"node {NODE}: the other nodes' first starts did not come up")
    time.sleep(0.005)
if NODE == sys.argv[2]:
    time.sleep(float(sys.argv[3]))
    mark("failed", time.time_ns())
    os._exit(int(sys.argv[4]))
while True:
    time.sleep(3600)
"""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_round_arguments(parser, rounds=5, warmup=1)
    parser.add_argument("--run-seconds", type=float, default=0.5,
                        help="how long node 1's first start runs once every node is up (default 0.5)")
    parser.add_argument("--off-wait", type=float, default=10.0,
                        help="seconds after the failure the 'off' row's survivors get before it is ended (default 10)")
    parser.add_argument("--ma-run", default=os.path.join(os.path.dirname(sys.executable), "ma-run"),
                        help="ma-run executable (default: next to this python)")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds before one run counts as hung")
    parser.add_argument("--json", metavar="FILE", help="also write the results (and raw samples) as JSON to FILE")
    return parser.parse_args(argv)


def torchrun_path() -> Optional[str]:
    path = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return path if os.access(path, os.X_OK) else None


# --------------------------------------------------------------------------- one run


def base_env(nodes: Nodes, node: int, marks: Path) -> Dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith(FOREIGN_PREFIXES)}
    bin_dir = os.path.dirname(sys.executable)
    return {**env, **nodes.environment(node), "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', os.defpath)}",
            "JOB_RESTART_DIR": str(marks), "JOB_RESTART_NODE": str(node)}


def ma_run_env(nodes: Nodes, node: int, marks: Path, run: Path, coordinator: str) -> Dict[str, str]:
    home = run / f"home-{node}"
    return {**base_env(nodes, node, marks), "MA_HOME": str(home),
            "MA_RUNTIME_TERMINATION_LOG": str(home / "termination-log"), "MA_RUNTIME_COORDINATOR": coordinator,
            "MA_RUNTIME_MAX_RESTARTS": "1", "MA_RUNTIME_NODE_LOST_SECONDS": "5",
            "MA_RUNTIME_DEVICE_RELEASE_SECONDS": "0", "MA_RUNTIME_PREFLIGHT": "off",
            "MA_RUNTIME_STOP_GRACE_SECONDS": "5", "MA_RUNTIME_BARRIER_SECONDS": "60"}


def worker_args(script: Path, args: argparse.Namespace) -> List[str]:
    return [str(script), str(NODES), str(FAILING), str(args.run_seconds), str(FAIL_CODE)]


def one_run(nodes: Nodes, scratch: Path, row: str, args: argparse.Namespace) -> Dict[str, Any]:
    run = Path(tempfile.mkdtemp(prefix="run-", dir=scratch))
    marks = run / "marks-dir"
    marks.mkdir()
    script = scratch / "worker.py"
    procs = []
    for node in range(NODES):
        argv, env = command(nodes, node, marks, run, row, script, args)
        log = run / f"node-{node}.log"
        procs.append(nodes.start(node, argv, env, stdout=log, stderr=subprocess.STDOUT))
    codes = wait(procs, marks, row, args)
    nodes.sweep()  # the "off" row's survivors, and anything a failed run left
    texts = [(run / f"node-{node}.log").read_text(errors="replace") for node in range(NODES)]
    result = figures(read_marks(marks), row, args)
    result["codes"] = codes
    result["error"] = run_error(row, codes, result, texts)
    shutil.rmtree(run, ignore_errors=True)
    return result


def command(nodes: Nodes, node: int, marks: Path, run: Path, row: str, script: Path, args: argparse.Namespace):
    if row == TORCHRUN:
        argv = [torchrun_path(), f"--nnodes={NODES}", "--nproc-per-node=1", "--max-restarts=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={nodes.hosts[0]}:{RDZV_PORT}", "--rdzv-id=job-restart",
                *worker_args(script, args)]
        return argv, base_env(nodes, node, marks)
    coordinator = "off" if row == OFF else "auto"
    return [args.ma_run, sys.executable, *worker_args(script, args)], \
        ma_run_env(nodes, node, marks, run, coordinator)


def wait(procs: Sequence[subprocess.Popen], marks: Path, row: str, args: argparse.Namespace) -> List[Optional[int]]:
    """Each node's exit code (None: still running when the run ended). The "off" row ends --off-wait seconds
    after the failure: its survivors never learn of it."""
    deadline = time.monotonic() + args.timeout
    failed_at: Optional[float] = None
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        if row == OFF and failed_at is None and "failed " in _text(marks / "marks"):
            failed_at = time.monotonic()
            deadline = min(deadline, failed_at + args.off_wait)
        time.sleep(0.05)
    return [proc.poll() for proc in procs]


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def read_marks(marks: Path) -> List[Dict[str, Any]]:
    found = []
    for line in _text(marks / "marks").splitlines():
        kind, *fields = line.split()
        values = dict(field.split("=", 1) for field in fields)
        found.append({"kind": kind, "node": int(values["node"]), "start": int(values["start"]),
                      "s": int(values["ns"]) / 1e9})
    return found


def figures(marks: List[Dict[str, Any]], row: str, args: argparse.Namespace) -> Dict[str, Any]:
    failed = [m["s"] for m in marks if m["kind"] == "failed"]
    if not failed:
        return {"failed": False}
    origin = failed[0]
    survivors = [node for node in range(NODES) if node != FAILING]
    stops = {node: next((m["s"] - origin for m in marks if m["kind"] == "sigterm" and m["node"] == node), None)
             for node in survivors}
    again = {node: next((m["s"] - origin for m in marks if m["kind"] == "first" and m["node"] == node
                         and m["start"] == 2), None) for node in range(NODES)}
    result: Dict[str, Any] = {"failed": True, "stops": stops, "again": again,
                              "stopped": None if None in stops.values() else max(stops.values()),
                              "relaunched": None if None in again.values() else max(again.values()),
                              "node_1_again": again[FAILING]}
    result["not_stopped"] = [node for node, at in stops.items() if at is None]
    return result


def run_error(row: str, codes: Sequence[Optional[int]], result: Dict[str, Any], texts: Sequence[str]) -> str:
    """Why a run is no sample ("" when it is one)."""
    if not result.get("failed"):
        return f"node {FAILING} never failed; exit codes {list(codes)}: {last_line(texts[FAILING])}"
    if row == OFF:
        return "" if result["node_1_again"] is not None else f"node {FAILING} did not restart: {list(codes)}"
    if any(code != 0 for code in codes):
        worst = next(index for index, code in enumerate(codes) if code != 0)
        return f"exit codes {list(codes)}: node {worst}: {last_line(texts[worst])}"
    if result["stopped"] is None or result["relaunched"] is None:
        return f"not every node was stopped and relaunched: {result['stops']} {result['again']}"
    return ""


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "(no output)"


def progress(name: str, label: str, result: Dict[str, Any]) -> None:
    if result.get("error"):
        text = f"FAILED: {result['error']}"
    elif name == OFF:
        text = (f"node 1 again {result['node_1_again']:.2f} s; not stopped within the wait: nodes "
                f"{result['not_stopped']}")
    else:
        text = f"stopped {result['stopped']:.2f} s, relaunched {result['relaunched']:.2f} s"
    print(f"  {label}: {name}: {text}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- report


def report(samples: Dict[str, List[harness.Sample]], args: argparse.Namespace) -> Dict[str, Any]:
    good = {name: [s for s in rows if not s.result.get("error")] for name, rows in samples.items()}
    rows = []
    for name in samples:
        for label, key in (("first failure -> every node's workers stopped", "stopped"),
                           ("first failure -> every node's first line of the next attempt", "relaunched"),
                           ("first failure -> node 1's first line of the next attempt", "node_1_again")):
            if name == OFF and key != "node_1_again":
                continue  # never, in every run: the line below the table says so
            rows.append((f"{name}: {label}", harness.summarize(good[name], harness.value_of(key))))
    harness.print_table(f"{NODES} nodes (network namespaces), node {FAILING} fails once", rows, "s", 3)
    off = good.get(OFF, [])
    never = sum(1 for s in off if s.result["not_stopped"])
    if OFF in samples:
        print(f"\n  {OFF}: nodes 0 and 2 not stopped within {args.off_wait:g} s of the failure in {never} of "
              f"{len(off)} runs (their workers never learn of it; with gloo they would die of a reset, with NCCL "
              "or HCCL wait out the collective timeout)")
    results: Dict[str, Any] = {"seconds": {label: s.as_dict() if s else None for label, s in rows},
                               "off_not_stopped_runs": never}
    if TORCHRUN in samples:
        for key, goal in (("stopped", GOAL_STOPPED_S), ("relaunched", GOAL_RELAUNCHED_S)):
            comparison = harness.compare(good[OURS], good[TORCHRUN], harness.ratio, harness.value_of(key))
            ours = harness.summarize(good[OURS], harness.value_of(key))
            met = ours is not None and ours.max <= goal
            faster = comparison.of_medians is not None and comparison.of_medians < 1
            print(f"  {key}: ma-run / torchrun c10d: {harness.comparison_text(comparison)}; "
                  f"goal <= {goal:g} s in every round {harness.verdict(met)}, faster than torchrun "
                  f"{harness.verdict(faster)}")
            results[f"{key}_ours_over_torchrun"] = comparison.as_dict()
    results["failures"] = harness.failures(samples)
    return results


def environment_info(args: argparse.Namespace) -> Dict[str, Any]:
    torchrun = torchrun_path()
    version = None
    if torchrun:
        version = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                                 capture_output=True, text=True).stdout.strip()
    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
            "rounds": args.rounds, "warmup": args.warmup, "ma_run": args.ma_run, "torch": version,
            "run_seconds": args.run_seconds, "off_wait": args.off_wait}


def stop_on_signal(signum, _frame) -> None:
    raise SystemExit(f"stopped by signal {signum}: cleaning up")  # the finally below removes everything


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    lacking = local_nodes.missing()
    if lacking:
        print(f"job_restart.py needs {', '.join(lacking)}: nothing measured")
        return 0
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop_on_signal)
    info = environment_info(args)
    rows = [OURS, OFF] + ([TORCHRUN] if torchrun_path() else [])
    if not torchrun_path():
        print("NOTE: no torchrun beside this python: the torchrun row is left out")
    scratch = Path(tempfile.mkdtemp(prefix="ma-bench-job-restart-"))
    (scratch / "worker.py").write_text(WORKER_SOURCE)
    nodes = Nodes(NODES, job=JOB, prefix="ma-bench-jr")
    try:
        nodes.create()
        harness.print_header(f"job-wide restart, {NODES} nodes: ma-run ({args.ma_run}) against coordinator off "
                             f"and torchrun {info['torch']} c10d", args.rounds, args.warmup)
        tasks = {row: (lambda row=row: one_run(nodes, scratch, row, args)) for row in rows}
        samples = harness.round_robin(tasks, args.rounds, args.warmup, progress)
    finally:
        nodes.close(grace=0)
        shutil.rmtree(scratch, ignore_errors=True)
    results = report(samples, args)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"environment": info, **results, "samples": samples}, handle, indent=2,
                      default=harness.to_json)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
