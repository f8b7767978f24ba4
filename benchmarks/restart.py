"""Restart latency: a worker's death to the relaunched worker's first line, ma-run against torchrun.

One script runs under every launcher. On its first attempt each worker waits until every rank of
its attempt is up, runs --run-seconds more (so the launcher is in its steady loop), then takes
the clock (time.time_ns: CLOCK_REALTIME, one clock for every process) and dies with os._exit(1).
On its second attempt it takes the clock as the first thing it does and prints it. The figure:
the earliest first line of attempt 2 minus the latest death of attempt 1; the interpreter start
of the relaunched worker is in it, for every row alike. No accelerator, so no device wait.

Rows, round-robin (benchmarks/_harness.py), like with like: each ma-run row has a torchrun row with
the same number of processes as its anchor.

  torchrun (1 rank)            torchrun --standalone --nproc-per-node=1 --max-restarts=1 SCRIPT,
                               its default monitor interval (read from torchrun and printed):
                               the rank dies, torchrun restarts its worker group
  torchrun (2 ranks)           the same with --nproc-per-node=2: both ranks die
  ma-run (plain, 1 process)    ma-run python SCRIPT, MA_RUNTIME_MAX_RESTARTS=1: ma-run relaunches
                               the command
  ma-run (torchrun, 2 ranks)   MA_RUN_METHOD=torchrun, 2 ranks: ma-run restarts the torchrun job in place
                               (the default: one torchrun agent for the run, its ranks let go by each
                               attempt's gate; docs/torchrun-in-place.md)
  ma-run (torchrun whole)      the same with MA_RUNTIME_TORCHRUN_IN_PLACE=off: a new torchrun per attempt
                               (torchrun's own --max-restarts=0), as before issue 29; reported, not judged

With --two-nodes (root: two network namespaces of ma_runtime/local/nodes.py, each node's command in its own,
as tests/e2e/test_job_launchers.py runs them), three rows more, one rank per node, the platform's static
rendezvous at node 0 (a port of their own for each run), every rank dying:

  torchrun c10d (2 nodes)      on each node torchrun --nnodes=2 --rdzv_backend=c10d --rdzv_endpoint=<node 0>:PORT
                               --max-restarts=1 (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): each agent restarts its
                               group through a new rendezvous round of both nodes: torchrun's own restart of a
                               multi-node job (the judged anchor)
  torchrun static (2 nodes)    the same on the platform's static rendezvous (--node_rank=I --master_addr=<node 0>
                               --rdzv_backend=static): each agent restarts its group alone, with no round (the
                               static rendezvous has none). Only this benchmark's job restarts so: a healthy
                               node's agent never restarts (its num_nodes_waiting is always 0) and a restart's
                               ranks would read the last attempt's addresses in the one store (gloo: Connection
                               refused); reported beside, not judged
  ma-run (torchrun, 2 nodes)   ma-run on each node, MA_RUN_METHOD=torchrun: restarted in place, the job-wide
                               restart (the nodes' coordination: first failure, stop, barrier) in it
  ma-run (whole, 2 nodes)      the same with MA_RUNTIME_TORCHRUN_IN_PLACE=off; reported, not judged

The device wait is the default (MA_RUNTIME_DEVICE_RELEASE_SECONDS unset, 60 s): with no accelerator
the runtime checks once and goes on, and torchrun checks nothing, so both sides pay what they pay
on a node with nothing to wait for. Setting it to 0 would still check once: it is not set.

Which attempt a worker is on: MA_PROC_START_CNT when the runtime exports it (1, 2, ...), else
torchrun's TORCHELASTIC_RESTART_COUNT + 1. Each run gets a clean environment (no MA_*, PET_* or
TORCHELASTIC_* variables of the caller) and a scratch MA_HOME. A run that does not relaunch (the
launcher exits after attempt 1) is a failed sample with the reason beside its row, never a crash.

Goals, each judged on the ratio of the medians in the same run (per round beside it):
  - the design's budget: worker death to relaunched worker (no device-release wait) <= 300 ms and <= 0.5x
    torchrun: ma-run (plain, 1 process) / torchrun (1 rank), and its median <= 300 ms;
  - issue 29: a torchrun job restarted <= 1.5x torchrun's own --max-restarts restart:
    ma-run (torchrun, 2 ranks) / torchrun (2 ranks), and with --two-nodes the same on two nodes:
    ma-run (torchrun, 2 nodes) / torchrun c10d (2 nodes).
Reported, never enforced: the script exits 0 unless it cannot run at all.

    .venv/bin/python benchmarks/restart.py [--rounds 5] [--warmup 1] [--run-seconds 0.3] [--ma-run PATH]
        [--python PATH] [--two-nodes] [--json FILE]
"""

import argparse
import itertools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402  (beside this script, not a package)

from ma_runtime.local import nodes as local_nodes  # noqa: E402  (standard library only: no runtime start-up)

GOAL_MS = 300.0
PLAIN_GOAL = harness.Goal("restart, plain command", "worker death to relaunched worker (no device-release wait): "
                          "<= 300 ms and <= 0.5x torchrun", "the design's budgets", 0.5, "x")
TORCHRUN_GOAL = harness.Goal("restart, torchrun job", "a torchrun job restarted in place <= 1.5x torchrun's own "
                             "--max-restarts restart", "issue 29 (the design's restart budget names no launcher)",
                             1.5, "x")
NODES_GOAL = harness.Goal("restart, torchrun job on two nodes", "a torchrun job restarted in place <= 1.5x "
                          "torchrun's own --max-restarts restart (two nodes, the job-wide restart in it)",
                          "issue 29 (the design's restart budget names no launcher)", 1.5, "x")
TORCHRUN_ONE = "torchrun (1 rank)"
TORCHRUN_TWO = "torchrun (2 ranks)"
MA_RUN_PLAIN = "ma-run (plain, 1 process)"
MA_RUN_TORCHRUN = "ma-run (torchrun, 2 ranks)"
MA_RUN_WHOLE = "ma-run (torchrun whole)"
TORCHRUN_NODES = "torchrun c10d (2 nodes)"
TORCHRUN_STATIC = "torchrun static (2 nodes)"
MA_RUN_NODES = "ma-run (torchrun, 2 nodes)"
MA_RUN_NODES_WHOLE = "ma-run (whole, 2 nodes)"
ROWS = (TORCHRUN_ONE, TORCHRUN_TWO, MA_RUN_PLAIN, MA_RUN_TORCHRUN, MA_RUN_WHOLE)
NODE_ROWS = (TORCHRUN_NODES, TORCHRUN_STATIC, MA_RUN_NODES, MA_RUN_NODES_WHOLE)  # --two-nodes
# The same number of processes; the whole restart is compared too, and judged by no goal.
ANCHOR_OF = {MA_RUN_PLAIN: TORCHRUN_ONE, MA_RUN_TORCHRUN: TORCHRUN_TWO, MA_RUN_WHOLE: TORCHRUN_TWO,
             MA_RUN_NODES: TORCHRUN_NODES, MA_RUN_NODES_WHOLE: TORCHRUN_NODES}
# Reported beside the judged ratio: the static rendezvous' restart that works for this benchmark's job only.
BESIDE = {MA_RUN_NODES: TORCHRUN_STATIC}
# The per-round tables' columns.
SHORT = {TORCHRUN_ONE: "torchrun 1", TORCHRUN_TWO: "torchrun 2", MA_RUN_PLAIN: "ma-run plain",
         MA_RUN_TORCHRUN: "ma-run torchrun", MA_RUN_WHOLE: "torchrun whole", TORCHRUN_NODES: "c10d 2n",
         TORCHRUN_STATIC: "static 2n", MA_RUN_NODES: "ma-run 2n", MA_RUN_NODES_WHOLE: "whole 2n"}
OURS = (MA_RUN_PLAIN, MA_RUN_TORCHRUN, MA_RUN_WHOLE)
NODES_JOB = "ma-bench-restart"  # MA_VJ_NAME of the two nodes
NODES_PORTS = itertools.count(20000, 2)  # each two-node run's static rendezvous port (and the ranks' store, +1)
# The caller's job settings would change what ma-run and torchrun do (a platform restart count, torchrun flags).
FOREIGN_PREFIXES = ("MA_", "PET_", "TORCHELASTIC_", "VC_", "RANK_TABLE")
MARK_LINE = re.compile(r"^(died|first) attempt=(\d+) rank=(\d+) ns=(\d+)$")

WORKER_SOURCE = """\
import time

STARTED_NS = time.time_ns()  # first: on a relaunch this is the worker's first line
import os
import sys

MARKS = os.environ["RESTART_BENCH_DIR"]
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def attempt():
    # The runtime names the attempt; torchrun alone counts its restarts from 0.
    if "MA_PROC_START_CNT" in os.environ:
        return int(os.environ["MA_PROC_START_CNT"])
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + 1


def mark(kind, number, ns):
    line = f"{kind} attempt={number} rank={RANK} ns={ns}\\n"
    fd = os.open(os.path.join(MARKS, "marks"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, line.encode())  # one write: lines of several ranks never interleave
    os.close(fd)
    print(line, end="", flush=True)


def wait_for_every_rank(number):
    open(os.path.join(MARKS, f"up-{number}-{RANK}"), "w").close()
    deadline = time.monotonic() + 60
    while sum(name.startswith(f"up-{number}-") for name in os.listdir(MARKS)) < WORLD:
        if time.monotonic() > deadline:
            sys.exit(f"rank {RANK}: the other ranks of attempt {number} did not start")
        time.sleep(0.001)


number = attempt()
if number >= 2:
    mark("first", number, STARTED_NS)
    sys.exit(0)
wait_for_every_rank(number)  # so that every rank dies, not one killed by the launcher after another's death
time.sleep(float(sys.argv[1]))
mark("died", number, time.time_ns())
os._exit(1)
"""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_round_arguments(parser, rounds=5, warmup=1)
    parser.add_argument("--run-seconds", type=float, default=0.3,
                        help="how long attempt 1 runs once every rank is up, before dying (default 0.3)")
    parser.add_argument("--ma-run", default=beside_python("ma-run"), help="ma-run executable (default: next to "
                                                                           "this python)")
    parser.add_argument("--python", default=sys.executable,
                        help="the workers' interpreter; torchrun is the one beside it (default: this python)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds before one run counts as hung")
    parser.add_argument("--two-nodes", action="store_true",
                        help="also the two-node rows (root: network namespaces, ma_runtime/local/nodes.py)")
    parser.add_argument("--json", metavar="FILE", help="also write the results (and raw samples) as JSON to FILE")
    return parser.parse_args(argv)


def beside_python(name: str) -> str:
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else (shutil.which(name) or name)


# --------------------------------------------------------------------------- one run


def commands(python: str, ma_run: str, worker: str, run_seconds: float) -> Dict[str, Tuple[List[str], Dict[str, str]]]:
    """row -> (argv, the environment it adds)."""
    torchrun = os.path.join(os.path.dirname(python), "torchrun")
    script = [worker, repr(run_seconds)]
    group = [torchrun, "--standalone", "--max-restarts=1"]
    restarts = {"MA_RUNTIME_MAX_RESTARTS": "1"}  # the device wait stays the default: see the docstring
    torchrun_job = {**restarts, "MA_RUN_METHOD": "torchrun", "MA_NUM_GPUS": "0", "MA_RUNTIME_NPROC_PER_NODE": "2"}
    return {
        TORCHRUN_ONE: ([*group, "--nproc-per-node=1", *script], {}),
        TORCHRUN_TWO: ([*group, "--nproc-per-node=2", *script], {}),
        MA_RUN_PLAIN: ([ma_run, python, *script], {**restarts, "MA_RUN_METHOD": "plain"}),
        MA_RUN_TORCHRUN: ([ma_run, python, *script], torchrun_job),
        MA_RUN_WHOLE: ([ma_run, python, *script], {**torchrun_job, "MA_RUNTIME_TORCHRUN_IN_PLACE": "off",
                                                   "MA_EXTRA_TORCHRUN_PARAMS": "--max-restarts=0"}),
    }


def node_commands(python: str, ma_run: str, worker: str, run_seconds: float, hosts: Sequence[str]):
    """row -> a function of the run's port giving each node's (argv, the environment it adds)."""
    torchrun = os.path.join(os.path.dirname(python), "torchrun")
    script = [worker, repr(run_seconds)]
    job = {"MA_RUNTIME_MAX_RESTARTS": "1", "MA_RUN_METHOD": "torchrun", "MA_NUM_GPUS": "0",
           "MA_RUNTIME_NPROC_PER_NODE": "1"}

    def static(port: int):
        return [([torchrun, "--nnodes=2", "--nproc-per-node=1", f"--node_rank={node}", f"--master_addr={hosts[0]}",
                  f"--master_port={port}", "--rdzv_id=bench", "--rdzv_backend=static", "--max-restarts=1", *script],
                 {}) for node in (0, 1)]

    def c10d(port: int):
        return [([torchrun, "--nnodes=2", "--nproc-per-node=1", f"--rdzv_endpoint={hosts[0]}:{port}",
                  "--rdzv_id=bench", "--rdzv_backend=c10d", "--max-restarts=1", *script],
                 {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}) for _ in (0, 1)]

    def ours(extra: Dict[str, str]):
        return lambda port: [([ma_run, python, *script], {**job, **extra, "MA_TORCHRUN_MASTER_PORT": str(port)})
                             for _ in (0, 1)]

    return {TORCHRUN_NODES: c10d, TORCHRUN_STATIC: static, MA_RUN_NODES: ours({}),
            MA_RUN_NODES_WHOLE: ours({"MA_RUNTIME_TORCHRUN_IN_PLACE": "off",
                                      "MA_EXTRA_TORCHRUN_PARAMS": "--max-restarts=0"})}


def nodes_run(nodes, per_node, scratch: str, timeout: float, ma_run: str) -> Dict[str, Any]:
    """One run on the two nodes (each node's command in its namespace, the marks on the shared file system)."""
    run_dir = tempfile.mkdtemp(prefix="run-", dir=scratch)
    try:
        processes = []
        for node, (argv, extra) in enumerate(per_node(next(NODES_PORTS))):
            home = os.path.join(run_dir, f"home-{node}")
            os.mkdir(home)
            env = {**clean_environment(), **nodes.environment(node), **extra, "MA_HOME": home,
                   "RESTART_BENCH_DIR": run_dir}
            log = Path(run_dir, f"node-{node}.err")
            processes.append(nodes.start(node, argv, env, stdout=subprocess.DEVNULL, stderr=log))
        codes = wait_all(processes, timeout)
        nodes.sweep()  # what a hung run left
        tails = "\n".join(Path(run_dir, f"node-{node}.err").read_text(errors="replace") for node in (0, 1))
        code = None if None in codes else next((c for c in codes if c != 0), 0)
        ours = per_node(0)[0][0][0] == ma_run
        hint = " (an ma-run without MA_RUNTIME_MAX_RESTARTS, issue 11, does that)" if ours else ""
        return figure(read_marks(os.path.join(run_dir, "marks")), code, tails, hint)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def wait_all(processes: Sequence[subprocess.Popen], timeout: float) -> List[Optional[int]]:
    """Each process' exit code; those running at the deadline are killed (their whole session) and give None."""
    deadline = time.monotonic() + timeout
    codes: List[Optional[int]] = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            codes.append(None)
    return codes


def clean_environment() -> Dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith(FOREIGN_PREFIXES)}


def restart_run(argv: List[str], extra: Dict[str, str], scratch: str, timeout: float, ma_run: str) -> Dict[str, Any]:
    """One run: {"seconds": death to relaunched first line, or None, "exit_code", "why" when None}."""
    run_dir = tempfile.mkdtemp(prefix="run-", dir=scratch)
    try:
        os.mkdir(os.path.join(run_dir, "home"))
        env = {**clean_environment(), **extra, "MA_HOME": os.path.join(run_dir, "home"), "RESTART_BENCH_DIR": run_dir}
        code, tail = run_bounded(argv, env, timeout)
        hint = " (an ma-run without MA_RUNTIME_MAX_RESTARTS, issue 11, does that)" if argv[0] == ma_run else ""
        return figure(read_marks(os.path.join(run_dir, "marks")), code, tail, hint)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def run_bounded(argv: List[str], env: Dict[str, str], timeout: float) -> Tuple[Optional[int], str]:
    """(exit code, or None if it hung and was killed; the last lines of its stderr)."""
    # A session of its own, so that a hung run's whole tree can be killed by its group.
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return None, err


def read_marks(path: str) -> List[Tuple[str, int, int, int]]:
    """(kind, attempt, rank, ns) per line the workers wrote."""
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        found = [MARK_LINE.match(line.strip()) for line in handle]
    return [(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))) for m in found if m]


def figure(marks: List[Tuple[str, int, int, int]], code: Optional[int], stderr: str,
           no_relaunch_hint: str = "") -> Dict[str, Any]:
    deaths = [ns for kind, number, _, ns in marks if kind == "died" and number == 1]
    firsts = [ns for kind, number, _, ns in marks if kind == "first" and number == 2]
    why = None
    if code is None:
        why = "hung: killed after --timeout"
    elif not deaths:
        why = f"attempt 1 never died as planned (exit {code}): {last_line(stderr)}"
    elif not firsts:
        why = f"no relaunch: the launcher exited {code} after attempt 1{no_relaunch_hint}"
    elif code != 0:
        why = f"attempt 2 ran but the launcher exited {code}: {last_line(stderr)}"
    seconds = None if why else (min(firsts) - max(deaths)) / 1e9
    return {"seconds": seconds, "exit_code": code, "why": why, "deaths": len(deaths), "relaunched": len(firsts)}


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "(nothing on stderr)"


def tasks(rows: Dict[str, Tuple[List[str], Dict[str, str]]], scratch: str, timeout: float, ma_run: str,
          nodes=None, node_rows=None):
    def task(argv: List[str], extra: Dict[str, str]):
        return lambda: restart_run(argv, extra, scratch, timeout, ma_run)

    def node_task(per_node):
        return lambda: nodes_run(nodes, per_node, scratch, timeout, ma_run)

    found = {name: task(argv, extra) for name, (argv, extra) in rows.items()}
    found.update((name, node_task(per_node)) for name, per_node in (node_rows or {}).items())
    return found


def progress(name: str, label: str, result: Dict[str, Any]) -> None:
    figure_text = f"{result['seconds'] * 1e3:.0f} ms" if result["seconds"] is not None else f"FAILED: {result['why']}"
    print(f"  {label}: {name}: {figure_text}", file=sys.stderr)


# --------------------------------------------------------------------------- report


def seconds_of(result: Dict[str, Any]) -> Optional[float]:
    return result["seconds"]


def failure_notes(samples: Dict[str, List[harness.Sample]]) -> Dict[str, str]:
    """row -> 'k of n runs failed: <the first reason>', for rows with a failed run."""
    notes = {}
    for name, rows in samples.items():
        failed = [s.result["why"] for s in rows if s.result["seconds"] is None]
        if failed:
            notes[name] = f"{len(failed)} of {len(rows)} runs failed: {failed[0]}"
    return notes


def print_rounds(samples: Dict[str, List[harness.Sample]]) -> None:
    """Each round's figures side by side, and each ma-run row / its torchrun anchor within it."""
    if TORCHRUN_NODES in samples:
        print_node_rounds(samples)
    print("\nper round (ms), and each ma-run row / the torchrun row of as many processes within the round")
    header = "".join(f" {SHORT[name]:>15}" for name in ROWS)
    print(f"  {'round':<6}{header} {'plain/torchrun 1':>17} {'ma-run torchrun/torchrun 2':>27} "
          f"{'whole/torchrun 2':>17}")
    by_round: Dict[int, Dict[str, Optional[float]]] = {}
    for name in ROWS:
        for sample in samples[name]:
            by_round.setdefault(sample.round, {})[name] = sample.result["seconds"]
    for index in sorted(by_round):
        figures = by_round[index]
        cells = "".join(f" {scaled_text(figures.get(name)):>15}" for name in ROWS)
        ratios = [round_ratio(figures.get(ours), figures.get(ANCHOR_OF[ours])) for ours in OURS]
        print(f"  {index + 1:<6}{cells} {ratios[0]:>17} {ratios[1]:>27} {ratios[2]:>17}")


def print_node_rounds(samples: Dict[str, List[harness.Sample]]) -> None:
    print("\nper round (ms), two nodes, and each ma-run row / torchrun's own restart within the round")
    print(f"  {'round':<6}" + "".join(f" {SHORT[name]:>15}" for name in NODE_ROWS)
          + f" {'in place/c10d':>14} {'whole/c10d':>11} {'in place/static':>16}")
    by_round: Dict[int, Dict[str, Optional[float]]] = {}
    for name in NODE_ROWS:
        for sample in samples[name]:
            by_round.setdefault(sample.round, {})[name] = sample.result["seconds"]
    for index in sorted(by_round):
        figures = by_round[index]
        ratios = [round_ratio(figures.get(ours), figures.get(anchor)) for ours, anchor in (
            (MA_RUN_NODES, TORCHRUN_NODES), (MA_RUN_NODES_WHOLE, TORCHRUN_NODES), (MA_RUN_NODES, TORCHRUN_STATIC))]
        print(f"  {index + 1:<6}" + "".join(f" {scaled_text(figures.get(name)):>15}" for name in NODE_ROWS)
              + f" {ratios[0]:>14} {ratios[1]:>11} {ratios[2]:>16}")


def scaled_text(seconds: Optional[float]) -> str:
    return "FAILED" if seconds is None else harness.number(seconds * 1e3, 0)


def round_ratio(ours: Optional[float], anchor: Optional[float]) -> str:
    return "-" if ours is None or anchor is None else harness.number(harness.ratio(ours, anchor), 2)


def report(samples: Dict[str, List[harness.Sample]]) -> Dict[str, Any]:
    summaries = {}
    for name in (*ROWS, *NODE_ROWS):
        if name in samples:
            summary = harness.summarize(samples[name], seconds_of)
            summaries[name] = summary.scaled(1e3) if summary else None
    harness.print_table("a worker's death to the relaunched worker's first line (no device wait)",
                        list(summaries.items()), "ms", 0, failure_notes(samples))
    print_rounds(samples)
    comparisons = {f"{ours} / {anchor}": harness.compare(samples[ours], samples[anchor], harness.ratio, seconds_of)
                   for ours, anchor in (*ANCHOR_OF.items(), *BESIDE.items()) if ours in samples}
    print()
    for label, comparison in comparisons.items():
        print(f"  {label}: {harness.comparison_text(comparison)}")
    goals = goal_verdicts(summaries, comparisons)
    return {
        "ms": {name: summary.as_dict() if summary else None for name, summary in summaries.items()},
        "comparisons": {label: comparison.as_dict() for label, comparison in comparisons.items()},
        "failures": failure_notes(samples),
        "goals": goals,
    }


def goal_verdicts(summaries: Dict[str, Optional[harness.Summary]],
                  comparisons: Dict[str, harness.Comparison]) -> List[Dict[str, Any]]:
    """Each goal judged on its ratio of the medians to the torchrun row of as many processes."""
    plain = comparisons[f"{MA_RUN_PLAIN} / {TORCHRUN_ONE}"]
    plain_ms = summaries[MA_RUN_PLAIN].median if summaries[MA_RUN_PLAIN] else None
    slow = plain_ms is not None and plain_ms > GOAL_MS
    ms_text = "no figure" if plain_ms is None else f"{plain_ms:.0f} ms"
    plain_note = f"median {ms_text} against <= {GOAL_MS:.0f} ms" + (": MISSED" if slow else "")
    torchrun = comparisons[f"{MA_RUN_TORCHRUN} / {TORCHRUN_TWO}"]
    torchrun_ms = summaries[MA_RUN_TORCHRUN].median if summaries[MA_RUN_TORCHRUN] else None
    anchor_ms = summaries[TORCHRUN_TWO].median if summaries[TORCHRUN_TWO] else None
    verdicts = [
        harness.judge(PLAIN_GOAL, plain.of_medians, f"{MA_RUN_PLAIN} / {TORCHRUN_ONE}, ratio of the medians",
                      plain.per_round, plain_note, broken=slow),
        harness.judge(TORCHRUN_GOAL, torchrun.of_medians, f"{MA_RUN_TORCHRUN} / {TORCHRUN_TWO}, ratio of the "
                      "medians", torchrun.per_round, f"{harness.figure_text(torchrun_ms, 'ms', 0)} against "
                      f"{harness.figure_text(anchor_ms, 'ms', 0)}"),
    ]
    nodes = comparisons.get(f"{MA_RUN_NODES} / {TORCHRUN_NODES}")
    if nodes is not None:  # --two-nodes
        ours_ms, theirs_ms = (summaries[name].median if summaries[name] else None
                              for name in (MA_RUN_NODES, TORCHRUN_NODES))
        static = comparisons[f"{MA_RUN_NODES} / {TORCHRUN_STATIC}"].of_medians
        verdicts.append(harness.judge(NODES_GOAL, nodes.of_medians, f"{MA_RUN_NODES} / {TORCHRUN_NODES}, ratio of "
                                      "the medians", nodes.per_round, f"{harness.figure_text(ours_ms, 'ms', 0)} "
                                      f"against {harness.figure_text(theirs_ms, 'ms', 0)}; beside, {TORCHRUN_STATIC} "
                                      f"(no round, works for this job only): {harness.figure_text(static, 'x', 2)}"))
    return verdicts


def torchrun_facts(python: str) -> Dict[str, Any]:
    """torch's version and torchrun's default monitor interval, from the workers' interpreter."""
    code = ("import torch, torch.distributed.run as run; "
            "print(torch.__version__); print(run.get_args_parser().get_default('monitor_interval'))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, env=clean_environment())
    if done.returncode != 0:
        sys.exit(f"{python} cannot import torch (the torchrun rows need it): {last_line(done.stderr)}")
    version, interval = done.stdout.split()
    return {"torch": version, "torchrun_default_monitor_interval_s": float(interval)}


def environment_info(args: argparse.Namespace, facts: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
        "rounds": args.rounds, "warmup": args.warmup, "run_seconds": args.run_seconds, "two_nodes": args.two_nodes,
        "ma_run": args.ma_run, "workers_python": args.python, **facts,
    }


def stop_on_signal(signum, _frame) -> None:
    raise SystemExit(f"stopped by signal {signum}: cleaning up")  # the nodes' finally removes the namespaces


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    facts = torchrun_facts(args.python)
    lacking = local_nodes.missing() if args.two_nodes else []
    if lacking:
        sys.exit(f"--two-nodes needs {', '.join(lacking)} (network namespaces): run as root, or without it")
    nodes = local_nodes.Nodes(2, job=NODES_JOB, prefix="ma-bench-rs") if args.two_nodes else None
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop_on_signal)
    with tempfile.TemporaryDirectory(prefix="ma-bench-restart-") as scratch:
        worker = os.path.join(scratch, "worker.py")
        with open(worker, "w") as handle:
            handle.write(WORKER_SOURCE)
        harness.print_header(f"restart latency: ma-run ({args.ma_run}) against torchrun {facts['torch']} "
                             f"(default monitor interval {facts['torchrun_default_monitor_interval_s']:g} s)",
                             args.rounds, args.warmup)
        for goal in (PLAIN_GOAL, TORCHRUN_GOAL, *((NODES_GOAL,) if nodes else ())):
            harness.print_goal(goal)
        rows = commands(args.python, args.ma_run, worker, args.run_seconds)
        try:
            node_rows = None
            if nodes is not None:
                nodes.create()
                node_rows = node_commands(args.python, args.ma_run, worker, args.run_seconds, nodes.hosts)
            samples = harness.round_robin(tasks(rows, scratch, args.timeout, args.ma_run, nodes, node_rows),
                                          args.rounds, args.warmup, progress)
        finally:
            if nodes is not None:
                nodes.close(grace=0)  # each run swept what it left: the rest is killed at once
    results = report(samples)
    if args.json:
        payload = {"environment": environment_info(args, facts), **results, "run": harness.run_record(results["goals"]),
                   "samples": {name: [vars(s) for s in rows] for name, rows in samples.items()}}
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2, default=harness.to_json)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
