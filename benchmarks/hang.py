"""Hang detection (issues 13, 24): the detector's own CPU per period, and a hang's start to the stack summary.

Two parts, each round-robin (benchmarks/_harness.py): min/median/max over the rounds, the 1-minute load
average beside each row, ratios per round and of the medians.

cost        One row group per --ranks count (default 8 and 64), each its own round-robin with its own job alone
            (of ours) on the machine. The job is torchrun-shaped, children of this script: an agent (`python -c`
            that names its main thread pt_elastic, as torch elastic's agent does) and below it N ranks with RANK
            set, each a `python -c` that starts --threads - 1 threads and blocks all --threads (default 4) on an
            Event: no IO, no CPU once started (each checked to show its threads first). Why this shape: it is
            the common GPU launcher, 64 ranks on a node only come from a launcher (torchrun --nproc-per-node,
            mpirun -np; RTF starts one worker per NPU, 8 or 16), and it makes the finder tell machinery (the
            agent, by its name) from ranks, as issue 24 requires. The monitor is the runtime's, run as the
            runtime runs it: `hang.configure` on a spec with the defaults (window 30 min, period 60 s) and the
            fake nvidia-smi of ma_runtime/local/fakes (8 GPUs) first on PATH; its members are the supervisor's `_job`:
            one `ranks.Finder()` kept across periods, `find({"torchrun": agent}, children.services(),
            processes(), NotTheCommand(..., services=True))` (a /proc/*/stat scan of the machine, the walk, each
            new process's cmdline and environment read once); each period is `Monitor._run`'s:
            `JobTree.sample(monitor._not_busy())` (psutil IO and CPU times per rank process, and, for the ranks
            not busy the period before, every thread's /proc/<pid>/task/*/schedstat), then `Monitor.tick(...,
            tree.labels)`, which calls `devices.utilisation`, which runs the fake. The ranks are blocked, so the
            demand path is taken for every rank every period (checked each period: the worst case; a busy rank
            skips it). One sample = --ticks periods back to back. The monitor's clock is simulated, one period
            per tick, and before the rounds it is fed as many periods as it keeps (62 at the defaults), so
            every timed tick judges a full window with queues as long as a long job's. The fake's utilisation
            alternates 40/80 % (written untimed before each tick), so `flat()` runs over every device's samples
            of the window each period and finds them changing: the most a period costs short of declaring a
            hang. Rows, CPU per period:
              detector                  `JobTree.sample` + `Monitor.tick` in this process (time.process_time),
                                        the utilisation call's own CPU taken out; split into finding (the
                                        members call: Finder.find over processes()), reading (the rest of
                                        `JobTree.sample`: psutil, schedstat) and judging (`Monitor.tick`);
              utilisation, our side     `devices.utilisation` in this process: spawn, wait, parse;
              the fake nvidia-smi       the tool's CPU (rusage of the reaped children). The fake is a
                                        Python script (an interpreter's start-up, mostly): the real tool's
                                        cost is not this, so it is a row of its own and not in the goal's
                                        figure (a line with it included is printed beside it);
            and the anchors, what a naive monitor does for less information (the tree, IO, CPU; no threads):
              psutil.process_iter       `psutil.process_iter(["pid", "ppid", "io_counters", "cpu_times"])`
                                        over every process of the machine, then the tree filtered out by
                                        ppid: the usual psutil way, and what our walk replaces;
              ps -e -o pid,ppid,time    a child, as a shell watchdog does: its CPU from wait4's rusage plus
                                        our spawn and parse (process_time). It gives LESS than we need (no
                                        IO counters, CPU time in whole seconds), so it flatters the anchor.
            The anchors only collect, while the detector also tells ranks from machinery, reads every rank
            thread's schedstat and judges. All rows scale with the processes on the machine (printed per row;
            this machine is shared). Figures: ms of CPU per period, and per hour at the default period (60 s)
            as % of one core; with two or more counts, what one more rank adds per period (the largest count's
            medians less the smallest's). Goal, per count: the runtime's own CPU (detector + our side of the
            utilisation call) <= 0.5 % of one core at the default period.

latency     A real `ma-run` (the one beside this python) running tests/e2e/jobs/hang_job.py in mode `block`:
            the worker computes for --compute-seconds (the fake's utilisation moving, a core busy: long
            enough for two samples, so the attempt has made progress and the window, not the start-up
            allowance, applies), then blocks in a lock, writing the wall-clock time when it does to
            MARKS/blocked-<attempt>-<rank>. MA_RUNTIME_HANG_DETECT_SECONDS=10 (so the period is 2 s),
            MA_RUNTIME_HANG_RESTARTS=0, MA_RUNTIME_LOG_FORMAT=json, MA_RUNTIME_PREFLIGHT=0. Rows:
              1 rank, fake nvidia-smi (8 GPUs);
              RTF 8 ranks, fake npu-smi (8 NPUs), rank 3 blocked in another function, as the e2e test builds
                it (rank table template 2, MA_VJ_NAME, fake device nodes): the hang starts when the LAST
                rank blocks (until then the others spin a core), so the figure starts there.
            Figures, from the task log's timestamps (CLOCK_REALTIME, as the worker's): blocked -> the `job
            suspected hung` line, blocked -> the last line of the stack summary (`stacks.dump` logs it), and
            blocked -> `ma-run` exited (the stop included), in seconds. Goal: the summary
            within window + one period + 5 s (17 s). No anchor exists: NVRx's and torch's FileTimer's hang
            detection take no stacks, so only the goal stands beside it. The header says where that ma-run
            imports ma_runtime from (PYTHONPATH reaches it: set it to measure a checkout).

Scratch data goes under /tmp (--workdir); the cost part's agent stops its ranks (SIGTERM), then its session is
killed; everything is removed at the end.

    .venv/bin/python benchmarks/hang.py [--rounds 5] [--warmup 1] [--parts cost,latency] [--ranks 8,64] [--threads 4]
        [--ticks 20] [--json FILE]
"""

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ma_runtime.local.devices import FAKES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402  (beside this script, not a package)

PARTS = ("cost", "latency")
PROJECT = harness.PROJECT

HANG_JOB = PROJECT / "tests" / "e2e" / "jobs" / "hang_job.py"
RANK_TABLE = PROJECT / "tests" / "data" / "ranktable" / "one_server_8.template2.json"
RANK_COUNTS, THREADS = ("8", "64"), 4  # ranks per row; threads per rank
AGENT_WORKER = "torchrun"  # the worker's name under the runtime's torchrun launcher (launch/torchrun.NAME)
DEVICES = 8
GOAL_CORE_PCT = 0.5
WINDOW_S, PERIOD_S = 10.0, 2.0  # the latency part's window, and the period the runtime derives from it
LATENCY_GOAL_S = WINDOW_S + PERIOD_S + 5.0
RUN_TIMEOUT_S = 120
START_TIMEOUT_S = 120  # 64 interpreters starting on 2 loaded cores
# The caller's job settings and credentials must not reach the runs (restart.py does the same).
FOREIGN_PREFIXES = ("MA_", "PET_", "TORCHELASTIC_", "VC_", "RANK_TABLE", "OBS_", "S3_", "AWS_", "FAKE_")
DETECTOR, OUR_SIDE, FAKE_TOOL = "detector: JobTree.sample + Monitor.tick", "utilisation call, our side", \
    "the fake nvidia-smi (a Python script)"
FINDING, READING, JUDGING = "  finding: Finder.find over processes()", "  reading: psutil IO+CPU, schedstat", \
    "  judging: Monitor.tick, tool out"
SPLIT = (DETECTOR, FINDING, READING, JUDGING)
PSUTIL_ANCHOR, PS_ANCHOR = "psutil.process_iter, every process", "ps -e -o pid,ppid,time (child)"
PERIOD_ROW = "hang monitor, one period"
ONE_RANK, EIGHT_RANKS = "1 rank, fake nvidia-smi", "RTF 8 ranks, fake npu-smi"
# The log lines the latency part reads: the supervisor's, and the stack summary's (stacks._log_summary).
HUNG_MSG = "job suspected hung"
STACK_MSG, ODD_MSG = "stack of a hung process", "odd ones out: not where the others are"

RANK_SOURCE = """\
import sys, threading
blocked = threading.Event()
for _ in range(int(sys.argv[1]) - 1):
    threading.Thread(target=blocked.wait, daemon=True).start()
blocked.wait()
"""
# torch elastic's agent, as the ranks finder sees one: its main thread named pt_elastic (torch/distributed/run.py),
# the ranks its children with RANK set. It stops them on SIGTERM, so that none is left to whoever adopts orphans.
AGENT_SOURCE = """\
import os, signal, subprocess, sys
with open("/proc/self/comm", "w") as comm:
    comm.write("pt_elastic")
count, threads, source = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ranks = [subprocess.Popen([sys.executable, "-c", source, threads], env={**os.environ, "RANK": str(rank)},
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
         for rank in range(count)]
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # after the spawns: the ranks keep the usual mask
signal.sigwait({signal.SIGTERM})
for rank in ranks:
    rank.kill()
for rank in ranks:
    rank.wait()
"""


# --------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_round_arguments(parser, rounds=5, warmup=1)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts to run (default {','.join(PARTS)})")
    parser.add_argument("--ranks", default=",".join(RANK_COUNTS),
                        help=f"the cost part's rows: ranks of the job (default {','.join(RANK_COUNTS)})")
    parser.add_argument("--threads", type=int, default=THREADS, help=f"threads per rank (default {THREADS})")
    parser.add_argument("--ticks", type=int, default=20, help="periods per sample of the cost part (default 20)")
    parser.add_argument("--compute-seconds", type=float, default=5.0,
                        help="how long the latency part's worker computes before it blocks (default 5: two "
                             "periods of 2 s see its device busy)")
    parser.add_argument("--latency-rows", default="1,8",
                        help="the latency part's rows: 1 (one rank, GPU), 8 (RTF, 8 ranks, NPU) (default 1,8)")
    parser.add_argument("--ma-run", default=str(Path(sys.executable).parent / "ma-run"),
                        help="ma-run (default: next to this python)")
    parser.add_argument("--workdir", metavar="DIR", help="scratch parent folder (default /tmp)")
    parser.add_argument("--json", metavar="FILE", help="also write the results (and every sample) as JSON to FILE")
    args = parser.parse_args(argv)
    args.parts = _names(parser, args.parts, PARTS, "--parts")
    args.latency_rows = _names(parser, args.latency_rows, ("1", "8"), "--latency-rows")
    args.ranks = _counts(parser, args.ranks)
    if args.rounds < 1 or args.warmup < 0 or args.ticks < 1 or args.threads < 1 or \
            args.compute_seconds < 2 * PERIOD_S:
        parser.error(f"--rounds, --ticks and --threads must be positive, --warmup not negative, --compute-seconds at "
                     f"least {2 * PERIOD_S:g} (two periods)")
    return args


def _counts(parser, text: str) -> List[str]:
    counts = [word.strip() for word in text.split(",") if word.strip()]
    if not counts or not all(word.isdigit() and int(word) > 0 for word in counts):
        parser.error(f"--ranks: {text!r} is not a list of positive numbers (8,64)")
    return list(dict.fromkeys(str(int(word)) for word in counts))


def _names(parser, text: str, known: Sequence[str], option: str) -> List[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        parser.error(f"{option}: {', '.join(unknown) or 'nothing'} is not one of {', '.join(known)}")
    return names


# --------------------------------------------------------------------------- shared pieces


def clean_environment() -> Dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith(FOREIGN_PREFIXES)}


def process_count() -> int:
    return sum(name.isdigit() for name in os.listdir("/proc"))


class QuietLog:
    """The logger hang.configure and the Monitor get: the lines are not the measurement; warnings are kept."""

    def __init__(self) -> None:
        self.warnings: List[str] = []

    def info(self, *_args, **_kwargs) -> None:
        pass

    debug = info

    def warning(self, event, **fields) -> None:
        self.warnings.append(f"{event} {fields}")

    error = warning


# --------------------------------------------------------------------------- part 1: the detector's cost


class Job:
    """A torchrun-like job, children of this script: the agent, and below it `count` blocked ranks of `threads`
    threads each (no IO, no CPU once started), ready once every rank shows all its threads."""

    def __init__(self, count: int, threads: int):
        from ma_runtime.process.table import processes

        self.count, self.threads = count, threads
        self.agent = subprocess.Popen([sys.executable, "-c", AGENT_SOURCE, str(count), str(threads), RANK_SOURCE],
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            self.ranks = [pid for pid, proc in processes().items() if proc.ppid == self.agent.pid]
            if len(self.ranks) == count and all(threads_of(pid) == threads for pid in self.ranks):
                return
            if time.monotonic() > deadline or self.agent.poll() is not None:
                self.stop()
                raise RuntimeError(f"the agent's {count} ranks did not all reach {threads} threads within "
                                   f"{START_TIMEOUT_S} s")
            time.sleep(0.1)

    def stop(self) -> None:
        """The agent stops its ranks (SIGTERM); what is left of its session is killed."""
        if self.agent.poll() is None:
            self.agent.terminate()
            try:
                self.agent.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.agent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.agent.wait()


def threads_of(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status") as handle:
            return next(int(line.split()[1]) for line in handle if line.startswith("Threads:"))
    except (OSError, StopIteration, ValueError):
        return None


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Periods:
    """The runtime's monitor over a Job, as the supervisor runs it, with a clock that moves one period per tick."""

    def __init__(self, scratch: Path, job: Job):
        from ma_runtime import spec as spec_module
        from ma_runtime.process import children
        from ma_runtime.process.table import processes
        from ma_runtime.supervise import devices, hang, hang_measures, ranks

        self.util_file = scratch / "util"
        self.util_file.write_text("0")
        self.environ = {**clean_environment(), "PATH": f"{FAKES}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
                        "MA_HOME": str(scratch / "home"), "MA_RUNTIME_PREFLIGHT_ACCELERATOR": "gpu",
                        "FAKE_GPU_COUNT": str(DEVICES), "FAKE_SMI_UTIL": f"@{self.util_file}"}
        spec = spec_module.load({}, self.environ)
        self.log = QuietLog()
        self.config = hang.configure(spec, self.environ, self.log)
        if self.config is None or self.config.tool is None:
            raise RuntimeError(f"hang detection is not on with the fake nvidia-smi: {self.config}")
        self.job = job
        self.now = 0.0
        self.level = 40
        self.tool_cpu = 0.0  # the utilisation call's own CPU, this tick
        self.find_cpu = 0.0  # Finder.find's, this tick
        self.answers: List[Any] = []
        finder = ranks.Finder()

        def members():  # supervisor._job, the partial the supervisor hands the monitor, with this job's worker
            exclude = children.NotTheCommand((), services=True)
            return finder.find({AGENT_WORKER: job.agent.pid}, children.services(), processes(), exclude)

        self.members = members
        self.tree = hang_measures.JobTree(self._timed_members)
        self.utilisation = lambda: devices.utilisation(spec, self.environ)
        self.monitor = hang.Monitor(self.config, self._timed_utilisation, self.log, clock=lambda: self.now)
        self.before = self.tree.sample(None)  # Monitor._run's first look
        expected = {f"rank {rank}" for rank in range(job.count)}
        if set(self.tree.labels.values()) != expected or len(self.before) != job.count:
            raise RuntimeError(f"the ranks finder found {len(self.before)} processes labelled "
                               f"{sorted(set(self.tree.labels.values()))}, not the agent's {job.count} ranks")

    def _timed_members(self):
        started = time.process_time()
        try:
            return self.members()
        finally:
            self.find_cpu = time.process_time() - started

    def _timed_utilisation(self):
        started = time.process_time()
        try:
            answer = self.utilisation()
        finally:
            self.tool_cpu = time.process_time() - started
        self.answers.append(answer)
        return answer

    def tick(self) -> Dict[str, float]:
        """One period as Monitor._run makes it, its CPU split (seconds); the device level moves first, untimed."""
        self.level = 120 - self.level  # 40, 80, 40, ...: changing, so never flat, never a hang
        self.util_file.write_text(str(self.level))
        self.now += self.config.period
        cpu, reaped, wall = time.process_time(), children_cpu(), time.perf_counter()
        after = self.tree.sample(self.monitor._not_busy())
        looked = time.process_time()
        found = self.monitor.tick(self.before, after, self.config.period, self.now, self.tree.labels)
        ended = time.process_time()
        reaped, wall = children_cpu() - reaped, time.perf_counter() - wall
        self.before = after
        if found is not None:
            raise RuntimeError(f"the monitor found a hang in a job whose devices move: {found.describe()}")
        # Every rank idle, so the demand of each (schedstat of every thread) is read each period: the worst case.
        demanded = sum(reading.demand is not None for reading in after.values())
        if len(after) != self.job.count or demanded != self.job.count:
            raise RuntimeError(f"the look holds {len(after)} processes, {demanded} with their demand read, not the "
                               f"{self.job.count} ranks")
        return {"detector": ended - cpu - self.tool_cpu, "finding": self.find_cpu,
                "reading": looked - cpu - self.find_cpu, "judging": ended - looked - self.tool_cpu,
                "our_side": self.tool_cpu, "tool": reaped, "wall": wall}

    def fill(self, ticks: int) -> None:
        """Untimed periods, so that the timed ones judge a full window, as in a long job."""
        for _ in range(ticks):
            self.tick()

    def sample(self, ticks: int) -> Dict[str, Any]:
        self.answers.clear()
        totals: Dict[str, float] = {}
        try:
            for _ in range(ticks):
                for key, value in self.tick().items():
                    totals[key] = totals.get(key, 0.0) + value
        except RuntimeError as exc:
            return {"error": str(exc)}
        per = {f"{key}_ms": value * 1e3 / ticks for key, value in totals.items()}
        per["runtime_ms"] = per["detector_ms"] + per["our_side_ms"]
        per["with_tool_ms"] = per["runtime_ms"] + per["tool_ms"]
        return {**per, "processes": process_count(), "error": self._tool_problem()}

    def _tool_problem(self) -> Optional[str]:
        """The fake must have answered with DEVICES devices each time, or the row measured an error path."""
        for answer in self.answers:
            if answer is None or answer.failure or len(answer.devices) != DEVICES:
                return f"devices.utilisation answered {answer}"
        return None


def naive_psutil(expected: int) -> Dict[str, Any]:
    import psutil

    cpu = time.process_time()
    table_of = {proc.info["pid"]: proc.info for proc in psutil.process_iter(["pid", "ppid", "io_counters",
                                                                            "cpu_times"])}
    tree = _descendants_by_ppid({pid: info["ppid"] for pid, info in table_of.items()}, os.getpid())
    cpu = time.process_time() - cpu
    unread = [pid for pid in tree if table_of[pid]["io_counters"] is None]
    problem = None if len(tree) == expected and not unread else \
        f"found {len(tree)} of the {expected} workers, {len(unread)} without IO counters"
    return {"cpu_ms": cpu * 1e3, "processes": len(table_of), "error": problem}


def naive_ps(expected: int) -> Dict[str, Any]:
    cpu = time.process_time()
    proc = subprocess.Popen(["ps", "-e", "-o", "pid=,ppid=,time="], stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    proc.stdout.close()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    rows = [line.split() for line in out.splitlines() if line.strip()]
    parents = {int(pid): int(ppid) for pid, ppid, _ in rows}
    tree = _descendants_by_ppid(parents, os.getpid())
    cpu = time.process_time() - cpu
    # ps itself is a child of this process: it is in the tree it lists.
    problem = None if proc.returncode == 0 and len(tree) == expected + 1 else \
        f"ps exited {proc.returncode}, {len(tree) - 1} of the {expected} workers found"
    return {"cpu_ms": (cpu + usage.ru_utime + usage.ru_stime) * 1e3, "child_ms": (usage.ru_utime + usage.ru_stime)
            * 1e3, "processes": len(rows), "error": problem}


def _descendants_by_ppid(parents: Dict[int, int], root: int) -> List[int]:
    children: Dict[int, List[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def core_pct(ms_per_period: harness.Summary, period_s: float) -> harness.Summary:
    """CPU ms per period -> % of one core at that period (the loads stay)."""
    return ms_per_period.scaled(100.0 / (period_s * 1e3))


def part_cost(args, scratch: Path) -> Dict[str, Any]:
    """One round-robin per rank count, each with its own job alone (of ours) on the machine."""
    results: Dict[str, Any] = {}
    samples: Dict[str, Any] = {}
    for count in args.ranks:
        results[count], samples[count] = cost_of(args, scratch, int(count))
    if len(args.ranks) > 1:
        results["per_rank_ms"] = per_rank(results, args.ranks)
    results["met"] = all(results[count]["met"] for count in args.ranks)
    return {"results": results, "samples": samples}


def cost_of(args, scratch: Path, count: int):
    job = Job(count, args.threads)
    try:
        periods = Periods(scratch, job)
        # As many as the monitor keeps (its longest window and a period): its queues are as long as a long job's.
        window_ticks = int((max(periods.config.window, periods.config.startup) + periods.config.period)
                           / periods.config.period) + 1
        periods.fill(window_ticks)
        harness.print_header(f"cost, {count} ranks: the hang monitor over a torchrun-like job (the agent, named "
                             f"pt_elastic, and {count} blocked ranks of {args.threads} threads: {count + 1} "
                             f"processes, {count * args.threads} rank threads), the fake nvidia-smi with {DEVICES} "
                             f"GPUs; defaults: window {periods.config.window:g} s, period {periods.config.period:g} s "
                             f"({window_ticks} periods filled first); {args.ticks} periods per sample; "
                             f"{process_count()} processes on the machine", args.rounds, args.warmup)
        # The anchors' tree from this script: the agent and its ranks.
        tasks = {PERIOD_ROW: lambda: periods.sample(args.ticks), PSUTIL_ANCHOR: lambda: naive_psutil(count + 1),
                 PS_ANCHOR: lambda: naive_ps(count + 1)}
        samples = harness.round_robin(tasks, args.rounds, args.warmup)
        return cost_report(samples, periods.config.period, periods.log.warnings, count, args.threads), samples
    finally:
        job.stop()


def per_rank(results: Dict[str, Any], counts: Sequence[str]) -> Dict[str, Optional[float]]:
    """What one more rank costs per period: the largest row's medians less the smallest's, over the ranks between."""
    low, high = min(counts, key=int), max(counts, key=int)
    added = int(high) - int(low)
    slopes = {}
    for label in SPLIT:
        a, b = results[low]["cpu_ms"].get(label), results[high]["cpu_ms"].get(label)
        slopes[label] = None if a is None or b is None else (b.median - a.median) / added
    print(f"\nper added rank ({high} ranks' medians less {low} ranks', over {added}), ms CPU per period: " +
          "; ".join(f"{label.strip()} {harness.number(value, 4)}" for label, value in slopes.items()))
    return slopes


def cost_report(samples, period_s: float, warnings: List[str], count: int, threads: int) -> Dict[str, Any]:
    rows = [(DETECTOR, (PERIOD_ROW, "detector_ms")), (FINDING, (PERIOD_ROW, "finding_ms")),
            (READING, (PERIOD_ROW, "reading_ms")), (JUDGING, (PERIOD_ROW, "judging_ms")),
            (OUR_SIDE, (PERIOD_ROW, "our_side_ms")), (FAKE_TOOL, (PERIOD_ROW, "tool_ms")),
            (PSUTIL_ANCHOR, (PSUTIL_ANCHOR, "cpu_ms")), (PS_ANCHOR, (PS_ANCHOR, "cpu_ms"))]
    cpu = harness.table(f"{count} ranks ({count + 1} processes, {count * threads} rank threads): CPU per period "
                        "(this process's process_time; a child's from its rusage)", samples, rows, "ms CPU", 2)
    harness.table("of which ps itself (rusage)", samples, [("ps -e, the child alone", (PS_ANCHOR, "child_ms"))],
                  "ms CPU", 2)
    harness.table("processes on the machine while measuring", samples,
                  [(name, (name, "processes")) for name in samples], "procs", 0)
    totals = harness.table("the runtime's own CPU per period, and with the fake tool's", samples,
                           [("detector + our side", (PERIOD_ROW, "runtime_ms")),
                            ("detector + our side + the fake tool", (PERIOD_ROW, "with_tool_ms"))], "ms CPU", 2)
    hourly = {label: None if summary is None else core_pct(summary, period_s) for label, summary in
              {DETECTOR: cpu[DETECTOR], **totals}.items()}
    harness.print_table(f"per hour at the default period ({period_s:g} s): % of one core", list(hourly.items()),
                        "% core", 4)
    over_psutil = harness.compare(samples[PERIOD_ROW], samples[PSUTIL_ANCHOR], harness.ratio, _detector_or_cpu)
    over_ps = harness.compare(samples[PERIOD_ROW], samples[PS_ANCHOR], harness.ratio, _detector_or_cpu)
    print(f"\n  detector / psutil.process_iter (CPU): {harness.comparison_text(over_psutil)}")
    print(f"  detector / ps -e (CPU):               {harness.comparison_text(over_ps)}")
    own = hourly["detector + our side"]
    with_tool = hourly["detector + our side + the fake tool"]
    met = own is not None and own.median <= GOAL_CORE_PCT
    print(f"  {count} ranks: the runtime's own CPU at the default period: "
          f"{harness.number(own.median if own else None, 4)} % of "
          f"one core (median), goal <= {GOAL_CORE_PCT:g} %: {harness.verdict(met)}; with the fake tool's CPU too: "
          f"{harness.number(with_tool.median if with_tool else None, 4)} % (the real tool's is not this)")
    for warning in warnings:
        print(f"  WARNING from the monitor: {warning}")
    return {"cpu_ms": cpu, "totals_ms": totals, "core_pct_per_hour": hourly, "detector_over_psutil": over_psutil,
            "detector_over_ps": over_ps, "goal_core_pct": GOAL_CORE_PCT, "met": met, "period_s": period_s,
            "failed": harness.failures(samples), "monitor_warnings": warnings}


def _detector_or_cpu(result: Dict[str, Any]) -> Optional[float]:
    return result.get("detector_ms", result.get("cpu_ms"))


# --------------------------------------------------------------------------- part 2: hang -> stack summary


class Latency:
    """Runs of a real ma-run whose worker blocks; the seconds from the block to the log lines that follow."""

    def __init__(self, args, scratch: Path):
        self.args = args
        self.scratch = scratch

    def run(self, ranks: int) -> Dict[str, Any]:
        run_dir = Path(tempfile.mkdtemp(prefix=f"ranks-{ranks}-", dir=self.scratch))
        try:
            return self._run(ranks, run_dir)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    def env(self, run_dir: Path, ranks: int) -> Dict[str, str]:
        marks, util = run_dir / "marks", run_dir / "util"
        marks.mkdir()
        env = {**clean_environment(), "PATH": f"{FAKES}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
               "MA_HOME": str(run_dir / "home"), "MA_RUNTIME_TERMINATION_LOG": str(run_dir / "termination-log"),
               "MA_RUNTIME_PREFLIGHT": "0", "MA_RUNTIME_HANG_DETECT_SECONDS": repr(WINDOW_S),
               "MA_RUNTIME_HANG_RESTARTS": "0", "MA_RUNTIME_LOG_FORMAT": "json", "MA_RUNTIME_STOP_GRACE_SECONDS": "3",
               "FAKE_SMI_UTIL": f"@{util}", "UTIL_FILE": str(util), "MARKS": str(marks), "HANG_MODE": "block",
               "COMPUTE_SECONDS": repr(self.args.compute_seconds)}
        if ranks == 1:
            env.update({"MA_RUNTIME_PREFLIGHT_ACCELERATOR": "gpu", "FAKE_GPU_COUNT": str(DEVICES)})
        else:
            env.update(rtf_env(run_dir))
        return env

    def _run(self, ranks: int, run_dir: Path) -> Dict[str, Any]:
        env = self.env(run_dir, ranks)
        argv = [self.args.ma_run, "--", sys.executable, str(HANG_JOB)]
        code = run_bounded(argv, env, run_dir / "stdout", run_dir / "stderr")
        exited = time.time()
        stem = "modelarts-job-local-worker-0" if ranks == 1 else "modelarts-job-0a1b-worker-0"
        events = read_events(Path(env["MA_HOME"]) / "modelarts" / "log" / f"{stem}.log")
        blocked = [float(path.read_text()) for path in Path(env["MARKS"]).glob("blocked-1-*")]
        hung = [event for event in events if event.get("msg") == HUNG_MSG]
        stacks = [event for event in events if event.get("msg") == STACK_MSG]
        odd = [event for event in events if event.get("msg") == ODD_MSG]
        problem = self._problem(code, ranks, blocked, hung, stacks, odd, run_dir)
        if problem:
            return {"error": problem}
        start = max(blocked)  # the hang starts when the last rank stops working
        last = max(epoch_of(event["time"]) for event in stacks + odd)
        return {"to_hung_s": epoch_of(hung[0]["time"]) - start, "to_summary_s": last - start,
                "to_exit_s": exited - start, "summary_lines": len(stacks) + len(odd), "error": None}

    @staticmethod
    def _problem(code, ranks, blocked, hung, stacks, odd, run_dir: Path) -> Optional[str]:
        """What makes the run no sample: another exit, a rank that never blocked, a summary that is not whole."""
        if code != 83:
            return f"ma-run exited {code} (83 expected): {tail(run_dir / 'stderr')}"
        if len(blocked) != ranks:
            return f"{len(blocked)} of {ranks} ranks marked their block"
        if len(hung) != 1 or len(stacks) != ranks:
            return f"{len(hung)} `{HUNG_MSG}` lines and {len(stacks)} `{STACK_MSG}` lines (of {ranks}) in the task log"
        # The 8-rank job's rank 3 blocks elsewhere: the summary must say so, or it is not the summary measured.
        if ranks > 1 and not any("rank 3" in str(event.get("odd")) for event in odd):
            return f"the summary does not name rank 3 the odd one out: {odd}"
        return None


def rtf_env(run_dir: Path) -> Dict[str, str]:
    """An 8-NPU pod whose rank table is complete from the start (tests/e2e/test_restart_launchers.npu_job); rank 3
    blocks in another function than the other 7."""
    config, dev = run_dir / "user-config", run_dir / "dev"
    config.mkdir()
    dev.mkdir()
    for name in [f"davinci{device}" for device in range(DEVICES)] + ["davinci_manager"]:
        (dev / name).touch()
    shutil.copyfile(RANK_TABLE, config / "jobstart_hccl.json")
    return {"RANK_TABLE_FILE": str(config), "VC_TASK_INDEX": "0", "MA_NUM_GPUS": str(DEVICES),
            "MA_VJ_NAME": "ma-job-0a1b", "MA_RUNTIME_PREFLIGHT_DEV_DIR": str(dev),
            "MA_RUNTIME_PREFLIGHT_ACCELERATOR": "npu", "ODD_RANK": "3"}


def run_bounded(argv: List[str], env: Dict[str, str], stdout_path: Path, stderr_path: Path) -> Optional[int]:
    """Runs argv to its end (None: killed after RUN_TIMEOUT_S, with its whole session, as it is when this script
    is stopped meanwhile)."""
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=True)
        try:
            return proc.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def read_events(path: Path) -> List[Dict[str, Any]]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue  # a worker's line that looks like JSON but is not ours
    return [event for event in events if isinstance(event, dict) and "time" in event]


def tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def epoch_of(stamp: str) -> float:
    """A log line's time ("2026-01-02T03:04:05.123456Z") as seconds since the epoch."""
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def runtime_of(ma_run: str) -> str:
    """Where `ma_run` imports ma_runtime from, in the environment the runs get (PYTHONPATH included): its interpreter
    (the script's #! line) asked."""
    try:
        with open(ma_run) as script:
            shebang = script.readline()
        python = shebang[2:].split() if shebang.startswith("#!") else [sys.executable]
        done = subprocess.run([*python, "-c", "import ma_runtime; print(ma_runtime.__file__)"], env=clean_environment(),
                              capture_output=True, text=True, timeout=60, cwd="/")
    except (OSError, IndexError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    return str(Path(done.stdout.strip()).parent.parent) if done.returncode == 0 else f"unknown ({done.stderr[-200:]})"


def part_latency(args, scratch: Path) -> Dict[str, Any]:
    bench = Latency(args, scratch)
    harness.print_header(f"latency: a worker computes {args.compute_seconds:g} s, then blocks in a lock; ma-run with "
                         f"a {WINDOW_S:g} s window (period {PERIOD_S:g} s), no hang restarts; its ma_runtime: "
                         f"{runtime_of(args.ma_run)}", args.rounds, args.warmup)
    rows = {"1": (ONE_RANK, 1), "8": (EIGHT_RANKS, 8)}
    tasks = {rows[key][0]: (lambda ranks=rows[key][1]: bench.run(ranks)) for key in args.latency_rows}
    samples = harness.round_robin(tasks, args.rounds, args.warmup)
    results: Dict[str, Any] = {"failed": harness.failures(samples), "goal_s": LATENCY_GOAL_S}
    for name in tasks:
        figures = harness.table(f"{name}: seconds from the (last) block", samples,
                                [("-> `job suspected hung`", (name, "to_hung_s")),
                                 ("-> the stack summary's last line", (name, "to_summary_s")),
                                 ("-> ma-run exited (the stop included)", (name, "to_exit_s"))], "s", 2)
        summary = figures["-> the stack summary's last line"]
        met = summary is not None and summary.median <= LATENCY_GOAL_S
        print(f"\n  {name}: the stack summary {harness.number(summary.median if summary else None, 2)} s after the "
              f"block (median; max {harness.number(summary.max if summary else None, 2)}), goal <= "
              f"{LATENCY_GOAL_S:g} s (window + one period + 5 s): {harness.verdict(met)}; no anchor (NVRx and "
              f"torch's FileTimer take no stacks)")
        results[name] = {"seconds": figures, "met": met}
    return {"results": results, "samples": samples}


# --------------------------------------------------------------------------- main


def environment_info(args) -> Dict[str, Any]:
    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
            "rounds": args.rounds, "warmup": args.warmup, "ticks": args.ticks, "parts": args.parts,
            "ranks": args.ranks, "threads": args.threads,
            "ma_run": args.ma_run, "compute_seconds": args.compute_seconds}


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the workers and scratch data still go
    scratch = Path(tempfile.mkdtemp(prefix="ma-bench-hang-", dir=args.workdir or "/tmp"))
    try:
        steps = {"cost": lambda: part_cost(args, scratch), "latency": lambda: part_latency(args, scratch)}
        harness.run_parts(steps, args.parts, args.json, environment_info(args))
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
