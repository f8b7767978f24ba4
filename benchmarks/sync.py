"""Output sync (issue 12): a no-change cycle's CPU, console forwarding while the uploader cycles, the final sync.

Three parts, each round-robin with its anchors (benchmarks/_harness.py): min/median/max over the rounds,
the 1-minute load average beside each row, ratios per round and of the medians.

cycle       A tree of 100 folders x 100 files of 4 KiB, already uploaded by a `ChannelSync` to a local
            folder (LocalStore), so its manifest knows every file. Rows, in this process:
              ChannelSync.cycle()        one periodic cycle that finds nothing to do;
              os.walk + os.lstat         the floor: the same syscalls, nothing else (one scandir
                                         per folder, one lstat per file), no identity kept;
              find -printf (C walk)      `find TREE -printf '%s %T@ %i\\n' > /dev/null`, a child,
                                         its CPU from wait4's rusage (startup included).
            Figure: CPU (time.process_time, or the child's rusage) per walk; wall time beside it.
            Budget: the cycle's CPU <= 50 ms (median). `--profile-cycles N` then runs N cycles under
            cProfile and prints where the time goes.

forwarding  `ma-run -- python writer` printing N lines as fast as it can, with an output channel whose
            local folder holds that tree (job file `outputs: [{name: train_url, url: <local folder>}]`,
            MA_RUNTIME_SYNC_INTERVAL_SECONDS=0.5 (--interval), the tree uploaded once beforehand so every
            cycle is a no-change one) against the same ma-run without the job file. The writer waits --settle
            seconds first (the uploader is up and cycling by then), then times its own printing: lines/s
            = N / (last write returned - first write started). A pipe holds 64 KiB, so the writer can
            only be that far ahead of ma-run. The writer also reads the uploader's CPU from /proc at
            both ends of that window (found by the run's marker in its environment), which shows it
            was cycling and what it took. Every run's stdout and task log are checked: all N lines,
            once, in order. Two writers, as in forwarding.py: batched (10 000 lines per write()) and
            per-line (one os.write() per line). Goal: < 5 % fewer lines/s with the sync (of the medians;
            the per-round ratios beside it, and a note when they spread wider than the goal).

final       A command that, after --settle seconds, copies 64 x 1 MiB + one 256 MiB file (random bytes,
            made once) into its output folder, writes time.time() to a stamp file and exits; the
            channel's URL is an s3:// folder on s3rver (npm-installed as storage.py does; moto when
            s3rver cannot be had, and the tables say so). Figure: the stamp to the `final sync
            completed` line's timestamp (both CLOCK_REALTIME), split into the stamp to `command
            exited` and the uploader's own `elapsed_s`. Periodic cycles are off for this part
            (MA_RUNTIME_SYNC_INTERVAL_SECONDS=3600): the final sync moves every byte, which is
            checked (its `bytes=` and a listing of the bucket, sizes and MD5 ETags). Anchor, in the same
            rounds: boto3 uploading the same files, freshly copied just before (untimed) as the
            command's are: the files under 4 MiB read and `put_object` in a 16-thread pool, then each
            larger one by `upload_file` in parts of the size ma_runtime uses, 16 threads; nothing
            hashed (no checksums, no payload SHA256): a floor. Diagnostic rows: the engine alone,
            `ChannelSync.cycle(final=True)` in this process on a fresh copy with a new store, which is
            wrapped to time its small-file PUTs and its multipart calls (the anchor's two phases beside
            them), so that the engine's share and the process machinery's share (ma-run / engine) show
            apart; and the same at nice 10, the uploader's niceness (root only: it sets it back), which
            shows what the niceness costs on a machine with other work. Goal: ma-run <= 1.1 x the
            anchor (medians).

Scratch data goes under /tmp (--workdir), servers are stopped by PID, everything is removed at the end.

    .venv/bin/python benchmarks/sync.py [--rounds 5] [--warmup 1] [--parts cycle,forwarding,final] [--json FILE]
"""

import argparse
import cProfile
import datetime
import hashlib
import io
import json
import os
import platform
import pstats
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402  (beside this script, not a package)
import forwarding  # noqa: E402  (its line checks)
import storage  # noqa: E402  (its local S3 servers)

KiB, MiB = 1 << 10, 1 << 20
PARTS = ("cycle", "forwarding", "final")
CYCLE_BUDGET_MS = 50.0
FORWARDING_LOSS_GOAL = 0.05
FINAL_RATIO_GOAL = 1.1
CHANNEL = "train_url"
BUCKET = "ma-bench-sync"
TASK_LOG = "modelarts-job-local-worker-0.log"
# The caller's job settings and credentials must not reach the runs (restart.py does the same).
FOREIGN_PREFIXES = ("MA_", "PET_", "TORCHELASTIC_", "VC_", "RANK_TABLE", "OBS_", "S3_", "AWS_")
RUN_TIMEOUT_S = 300
NOT_WRITER_LINES = re.compile(rb"(?m)^(?!line ).*\n")  # ma-run's own lines in the task log
CYCLE, FLOOR, FIND = "ChannelSync.cycle()", "os.walk + os.lstat (floor)", "find -printf (C walk)"
WITH_SYNC, WITHOUT_SYNC = "ma-run, output channel syncing", "ma-run, no outputs"
MA_FINAL, RAW_UPLOAD = "ma-run: command exit -> final sync completed", "boto3 upload of the same files (anchor)"
ENGINE = "ChannelSync.cycle(final=True) in-process"
ENGINE_NICED = "the same at nice 10, as the uploader runs"

WORKER_SOURCE = """\
import json
import os
import shutil
import sys
import time


def uploader_pid(run_id):
    # The uploader of THIS run: other jobs on the machine may have one too.
    marker = ("SYNC_BENCH_RUN=" + run_id).encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/" + name + "/cmdline", "rb") as f:
                if b"ma_runtime.sync.uploader" not in f.read():
                    continue
            with open("/proc/" + name + "/environ", "rb") as f:
                if marker in f.read().split(b"\\0"):
                    return int(name)
        except OSError:
            continue
    return None


def cpu_ticks(pid):
    if pid is None:
        return None
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except OSError:
        return None


def batched(count, width, batch=10_000):
    write = sys.stdout.write
    for start in range(1, count + 1, batch):
        stop = min(start + batch, count + 1)
        write("".join(f"line {i:0{width}d}\\n" for i in range(start, stop)))
    sys.stdout.flush()


def per_line(count, width):
    write = os.write
    for i in range(1, count + 1):
        write(1, b"line %0*d\\n" % (width, i))


def forward(case, count, width, settle, marks):
    time.sleep(settle)
    pid = uploader_pid(os.environ["SYNC_BENCH_RUN"])
    before = cpu_ticks(pid)
    start = time.perf_counter()
    {"batched": batched, "per-line": per_line}[case](count, width)
    seconds = time.perf_counter() - start
    after = cpu_ticks(pid)
    ticks = None if before is None or after is None else after - before
    with open(marks, "w") as f:
        json.dump({"seconds": seconds, "uploader_pid": pid, "uploader_ticks": ticks,
                   "ticks_per_s": os.sysconf("SC_CLK_TCK")}, f)


def final(source, dest, stamp, settle):
    time.sleep(settle)
    os.makedirs(dest, exist_ok=True)
    for name in sorted(os.listdir(source)):
        shutil.copyfile(os.path.join(source, name), os.path.join(dest, name))
    now = time.time()
    with open(stamp + ".tmp", "w") as f:
        f.write(repr(now))
    os.rename(stamp + ".tmp", stamp)


# ma-run appends --train_url=... to the command line: only the leading arguments count.
if sys.argv[1] == "forward":
    forward(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6])
else:
    final(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
"""


# --------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_round_arguments(parser, rounds=5, warmup=1)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts to run (default {','.join(PARTS)})")
    parser.add_argument("--folders", type=int, default=100, help="folders of the tree (default 100)")
    parser.add_argument("--files", type=int, default=100, help="files per folder (default 100)")
    parser.add_argument("--file-kb", type=int, default=4, help="size of each tree file, KiB (default 4)")
    parser.add_argument("--profile-cycles", type=int, default=10,
                        help="no-change cycles run under cProfile after the cycle rounds (default 10; 0: none)")
    parser.add_argument("--lines", type=int, default=6_000_000, help="lines of the batched writer (default 6 000 000)")
    parser.add_argument("--per-line-lines", type=int, default=3_000_000,
                        help="lines of the one-write-per-line writer (default 3 000 000)")
    parser.add_argument("--forward-cases", default="batched,per-line",
                        help="writers of the forwarding part (default batched,per-line)")
    parser.add_argument("--interval", type=float, default=0.5,
                        help="MA_RUNTIME_SYNC_INTERVAL_SECONDS of the forwarding part (default 0.5; the runtime's "
                             "default is 5)")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds a command waits before it prints or writes (default 2: the uploader is up)")
    parser.add_argument("--small-count", type=int, default=64, help="small files of the final sync (default 64)")
    parser.add_argument("--small-mb", type=float, default=1, help="size of each small file, MiB (default 1)")
    parser.add_argument("--large-mb", type=int, default=256, help="size of the large file, MiB (default 256; 0: none)")
    parser.add_argument("--threads", type=int, default=16, help="threads of the boto3 anchor (default 16)")
    parser.add_argument("--endpoint", choices=("s3rver", "moto"), default="s3rver",
                        help="server of the final sync (default s3rver; moto when s3rver cannot be had)")
    parser.add_argument("--s3rver", metavar="PATH", help="an s3rver executable to use instead of npm-installing one")
    parser.add_argument("--ma-run", default=forwarding.default_ma_run(), help="ma-run (default: next to this python)")
    parser.add_argument("--workdir", metavar="DIR", help="scratch parent folder (default /tmp)")
    parser.add_argument("--json", metavar="FILE", help="also write the results (and every sample) as JSON to FILE")
    args = parser.parse_args(argv)
    args.parts = storage._names(args.parts, PARTS, "--parts")
    args.forward_cases = storage._names(args.forward_cases, ("batched", "per-line"), "--forward-cases")
    if min(args.rounds, args.folders, args.files, args.file_kb, args.lines, args.per_line_lines) < 1 or \
            args.warmup < 0 or args.small_count < 0 or args.large_mb < 0 or args.threads < 1:
        parser.error("counts must be positive")
    return args


# --------------------------------------------------------------------------- shared pieces


def clean_environment() -> Dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith(FOREIGN_PREFIXES)}


def build_tree(root: Path, folders: int, files: int, size: int) -> int:
    """folders x files files of `size` random bytes under root; their count."""
    for folder in range(folders):
        path = root / f"step-{folder:04d}"
        path.mkdir(parents=True)
        for index in range(files):
            (path / f"shard-{index:04d}.bin").write_bytes(os.urandom(size))
    return folders * files


def run_bounded(argv: List[str], env: Dict[str, str], stdout_path: Path, stderr_path: Path) -> Optional[int]:
    """Runs argv to its end (None: killed after RUN_TIMEOUT_S, with its whole session)."""
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=True)
        try:
            return proc.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def log_events(path: Path) -> Dict[str, Dict[str, str]]:
    """The last line of each msg in a logfmt task log: msg -> its fields (values unquoted)."""
    events: Dict[str, Dict[str, str]] = {}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return events
    for line in text.splitlines():
        fields = dict((key, value.strip('"')) for key, value in re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line))
        if "msg" in fields and "time" in fields:
            events[fields["msg"]] = fields
    return events


def epoch_of(stamp: str) -> float:
    """A log line's time ("2026-01-02T03:04:05.123456Z") as seconds since the epoch."""
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


# --------------------------------------------------------------------------- part 1: a no-change cycle


def channel_sync(tree: Path, copy: Path, state: Path, log) -> Any:
    from ma_runtime import spec as spec_module
    from ma_runtime.storage.local import LocalStore
    from ma_runtime.storage.transfer import TransferOptions
    from ma_runtime.sync.engine import ChannelSync, Target

    markers = spec_module.load({}, {"MA_HOME": str(state / "home")}).sync_markers
    return ChannelSync(Target(CHANNEL, tree, str(copy)), LocalStore(), TransferOptions(state_dir=state), markers,
                       log, state)


def upload_once(sync, expected: int) -> None:
    """The first, uploading cycle (untimed): afterwards the manifest knows every file."""
    sync.start()
    result = sync.cycle(final=True)
    if result.files != expected or result.error:
        raise RuntimeError(f"the initial upload sent {result.files} of {expected} files ({result.error})")


def timed_cycle(sync) -> Dict[str, Any]:
    cpu, wall = time.process_time(), time.perf_counter()
    result = sync.cycle()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    error = f"the no-change cycle uploaded {result.files} files" if result.files or result.error else None
    return {"cpu_ms": cpu * 1e3, "wall_ms": wall * 1e3, "error": error or result.error}


def timed_walk(tree: Path, expected: int) -> Dict[str, Any]:
    cpu, wall = time.process_time(), time.perf_counter()
    count = 0
    for folder, _, names in os.walk(tree):
        for name in names:
            os.lstat(os.path.join(folder, name))
            count += 1
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"cpu_ms": cpu * 1e3, "wall_ms": wall * 1e3, "error": None if count == expected else f"{count} files"}


def timed_find(tree: Path) -> Dict[str, Any]:
    wall = time.perf_counter()
    proc = subprocess.Popen(["find", str(tree), "-printf", "%s %T@ %i\\n"], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - wall
    return {"cpu_ms": (usage.ru_utime + usage.ru_stime) * 1e3, "wall_ms": wall * 1e3,
            "error": None if proc.returncode == 0 else f"find exited {proc.returncode}"}


def part_cycle(args, tree: Path, count: int, scratch: Path) -> Dict[str, Any]:
    log = storage.QuietLog()  # warnings kept (and reported), info lines dropped
    sync = channel_sync(tree, scratch / "cycle-copy", scratch / "cycle-state", log)
    upload_once(sync, count)
    harness.print_header(f"cycle: a periodic ChannelSync.cycle() over {count:,} unchanged files "
                         f"({args.folders} folders x {args.files} x {args.file_kb} KiB), LocalStore target",
                         args.rounds, args.warmup)
    tasks = {CYCLE: lambda: timed_cycle(sync), FLOOR: lambda: timed_walk(tree, count), FIND: lambda: timed_find(tree)}
    samples = harness.round_robin(tasks, args.rounds, args.warmup)
    cpu = harness.table("CPU per walk of the tree", samples, [(name, (name, "cpu_ms")) for name in tasks], "ms CPU", 2)
    harness.table("wall time per walk", samples, [(name, (name, "wall_ms")) for name in tasks], "ms", 2)
    results = {"cpu_ms": cpu, "failed": harness.failures(samples), "engine_warnings": log.warnings}
    results.update(cycle_verdict(samples, cpu, count))
    if args.profile_cycles:
        results["profile"] = profile_cycles(sync, args.profile_cycles)
    return {"results": results, "samples": samples}


def cycle_verdict(samples, cpu, count: int) -> Dict[str, Any]:
    over_floor = harness.compare(samples[CYCLE], samples[FLOOR], harness.ratio, harness.value_of("cpu_ms"))
    over_find = harness.compare(samples[CYCLE], samples[FIND], harness.ratio, harness.value_of("cpu_ms"))
    print(f"\n  cycle / floor (CPU): {harness.comparison_text(over_floor)}")
    print(f"  cycle / find (CPU):  {harness.comparison_text(over_find)}")
    median = cpu[CYCLE].median if cpu[CYCLE] else None
    met = median is not None and median <= CYCLE_BUDGET_MS
    per_file = "-" if median is None else f"{median * 1e3 / count:.2f} µs per file"
    print(f"  no-change cycle: {harness.number(median, 2)} ms CPU (median; {per_file}), budget <= "
          f"{CYCLE_BUDGET_MS:g} ms: {harness.verdict(met)}")
    return {"cycle_over_floor": over_floor, "cycle_over_find": over_find, "budget_ms": CYCLE_BUDGET_MS, "met": met}


def profile_cycles(sync, cycles: int) -> str:
    """cProfile over `cycles` no-change cycles: the top functions by own time, printed and returned."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(cycles):
        sync.cycle()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("tottime")
    stats.print_stats(12)
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    print(f"\n  where a no-change cycle's time goes: cProfile over {cycles} cycles (slower than unprofiled), "
          "top 12 by own time:")
    for line in lines[lines.index(next(x for x in lines if "ncalls" in x)):]:
        print(f"    {line}")
    return text.getvalue()


# --------------------------------------------------------------------------- part 2: forwarding while syncing


class Forwarding:
    """One MA_HOME whose output folder holds the tree, already uploaded: every cycle of a run finds nothing new."""

    def __init__(self, args, scratch: Path, home: Path):
        self.args = args
        self.scratch = scratch
        self.home = home
        self.job = scratch / "forwarding-job.json"
        self.job.write_text(json.dumps({"outputs": [{"name": CHANNEL, "url": str(scratch / "forwarding-copy")}]}))
        self.worker = scratch / "worker.py"
        self.counts = {"batched": args.lines, "per-line": args.per_line_lines}
        self.expected = {case: forwarding.expected_output(count) for case, count in self.counts.items()}

    def env(self, run_dir: Path) -> Dict[str, str]:
        return {**clean_environment(), "MA_HOME": str(self.home), "MA_LOG_DIR": str(run_dir / "log"),
                "MA_RUNTIME_PREFLIGHT": "off", "MA_RUNTIME_SYNC_INTERVAL_SECONDS": repr(self.args.interval),
                "SYNC_BENCH_RUN": uuid.uuid4().hex}

    def upload_tree(self, count: int) -> None:
        """One untimed run: its final sync uploads the tree and leaves the manifest the timed runs start from."""
        run_dir = Path(tempfile.mkdtemp(prefix="presync-", dir=self.scratch))
        argv = [self.args.ma_run, "--config", str(self.job), "--", "true"]
        code = run_bounded(argv, self.env(run_dir), run_dir / "stdout", run_dir / "stderr")
        done = log_events(run_dir / "log" / TASK_LOG).get("final sync completed", {})
        if code != 0 or done.get("files") != str(count):
            raise RuntimeError(f"uploading the tree for the forwarding part failed (exit {code}, final sync "
                               f"{done or 'not logged'}): {tail(run_dir / 'stderr')}")
        shutil.rmtree(run_dir)

    def run(self, case: str, with_sync: bool) -> Dict[str, Any]:
        run_dir = Path(tempfile.mkdtemp(prefix=f"{case}-", dir=self.scratch))
        try:
            return self._run(case, with_sync, run_dir)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    def _run(self, case: str, with_sync: bool, run_dir: Path) -> Dict[str, Any]:
        count, marks = self.counts[case], run_dir / "marks.json"
        writer = [sys.executable, str(self.worker), "forward", case, str(count),
                  str(forwarding.number_width(count)), repr(self.args.settle), str(marks)]
        argv = [self.args.ma_run, *(["--config", str(self.job)] if with_sync else []), "--", *writer]
        code = run_bounded(argv, self.env(run_dir), run_dir / "stdout", run_dir / "stderr")
        if code != 0:
            return {"error": f"ma-run exited {code}: {tail(run_dir / 'stderr')}"}
        checks = {where: check_lines(forwarding.read_bytes(str(run_dir / path)), count, self.expected[case])
                  for where, path in (("stdout", "stdout"), ("task_log", f"log/{TASK_LOG}"))}
        return {**self._marks(marks, count, with_sync), "checks": checks,
                "error": next((f"{where}: {json.dumps(check)}" for where, check in checks.items()
                               if not check["exact"]), None)}

    @staticmethod
    def _marks(path: Path, count: int, with_sync: bool) -> Dict[str, Any]:
        marks = json.loads(path.read_text())
        ticks = marks["uploader_ticks"]
        uploader = None if ticks is None else 100.0 * ticks / marks["ticks_per_s"] / marks["seconds"]
        missing = with_sync and marks["uploader_pid"] is None
        return {"lines_per_s": count / marks["seconds"], "seconds": marks["seconds"], "uploader_core_pct": uploader,
                "uploader_found": marks["uploader_pid"] is not None,
                "error": "no uploader process was running while the writer printed" if missing else None}


def check_lines(data: Optional[bytes], count: int, expected: bytes) -> Dict[str, Any]:
    """forwarding.py's check, with a fast path: its split into lines costs seconds and GBs at these sizes."""
    if data is not None and (data == expected or NOT_WRITER_LINES.sub(b"", data) == expected):
        return {"exact": True, "lost": 0}
    return forwarding.check_lines(data, count, expected)


def part_forwarding(args, scratch: Path, home: Path, count: int) -> Dict[str, Any]:
    bench = Forwarding(args, scratch, home)
    bench.upload_tree(count)
    harness.print_header(f"forwarding: ma-run printing as fast as it can, with an output channel over {count:,} "
                         f"files cycling every {args.interval:g} s, and without", args.rounds, args.warmup)
    tasks = {f"{case}, {label}": (lambda case=case, on=on: bench.run(case, on))
             for case in args.forward_cases for label, on in ((WITH_SYNC, True), (WITHOUT_SYNC, False))}
    samples = harness.round_robin(tasks, args.rounds, args.warmup)
    results: Dict[str, Any] = {"failed": harness.failures(samples)}
    for case in args.forward_cases:
        results[case] = forwarding_case(case, bench.counts[case], samples)
    return {"results": results, "samples": samples}


def forwarding_case(case: str, count: int, samples) -> Dict[str, Any]:
    ours, anchor = f"{case}, {WITH_SYNC}", f"{case}, {WITHOUT_SYNC}"
    how = "10 000 lines per write()" if case == "batched" else "one write() per line"
    rates = harness.table(f"{case}: {count:,} lines ({how}), lines/s over the writer's printing", samples,
                          [(WITH_SYNC, (ours, "lines_per_s")), (WITHOUT_SYNC, (anchor, "lines_per_s"))], "lines/s", 0)
    uploader = harness.table(f"{case}: the uploader's CPU while the writer printed, % of one core", samples,
                             [(WITH_SYNC, (ours, "uploader_core_pct"))], "%", 1)
    kept = harness.compare(samples[ours], samples[anchor], harness.ratio, harness.value_of("lines_per_s"))
    loss = None if kept.of_medians is None else 1.0 - kept.of_medians
    print(f"\n  {case}: with sync / without, lines/s: {harness.comparison_text(kept)}")
    met = loss is not None and loss < FORWARDING_LOSS_GOAL
    print(f"  {case}: loss {harness.number(None if loss is None else 100 * loss, 1)} % (of the medians), goal < "
          f"{100 * FORWARDING_LOSS_GOAL:g} %: {harness.verdict(met)}")
    spread = kept.per_round
    if spread is not None and spread.max - spread.min > 2 * FORWARDING_LOSS_GOAL:
        print(f"  {case}: NOTE the per-round ratios span {spread.min:.2f}-{spread.max:.2f}: the machine moved more "
              f"than the goal is wide, so this verdict cannot be trusted; more rounds, or a quieter machine")
    return {"lines": count, "lines_per_s": rates, "uploader_core_pct": uploader, "with_over_without": kept,
            "loss": loss, "goal": FORWARDING_LOSS_GOAL, "met": met}


# --------------------------------------------------------------------------- part 3: the final sync


class PhaseTimer:
    """Wraps a store: the span of its small-file PUTs and the span of its multipart calls, from the first
    call's start to the last one's end (the engine sends the small files first, then the large ones)."""

    CALLS = {"put_bytes": "small", "create_multipart": "large", "upload_part": "large", "complete_multipart": "large"}

    def __init__(self, store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self.spans: Dict[str, List[float]] = {}

    def __getattr__(self, name: str):
        function = getattr(self._store, name)
        phase = self.CALLS.get(name)
        if phase is None:
            return function

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._note(phase, started, time.perf_counter())

        return timed

    def _note(self, phase: str, started: float, ended: float) -> None:
        with self._lock:
            low, high = self.spans.get(phase, (started, ended))
            self.spans[phase] = [min(low, started), max(high, ended)]

    def seconds(self) -> Dict[str, float]:
        return {f"{phase}_s": high - low for phase, (low, high) in self.spans.items()}


class FinalSync:
    """The files a command writes right before it exits, and the ways they reach the bucket."""

    def __init__(self, args, scratch: Path, server: storage.Server):
        from ma_runtime.storage.transfer.upload import _upload_part_size
        from ma_runtime.sync.reading import SMALL_LIMIT

        self.args, self.scratch, self.server = args, scratch, server
        self.source = scratch / "final-source"
        self.sizes = make_sources(self.source, args.small_count, int(args.small_mb * MiB), args.large_mb * MiB)
        self.md5 = {name: md5_of(self.source / name) for name in self.sizes}
        self.small_limit = SMALL_LIMIT
        options = storage.MaRuntime(server, scratch).options  # as the CLI builds them
        self.part_size = {name: _upload_part_size(options.part_size, size) for name, size in self.sizes.items()}
        self.s3 = anchor_client(server, args.threads)
        self.s3.create_bucket(Bucket=BUCKET)
        self.worker = scratch / "worker.py"
        self.runs = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())

    def prefix(self, what: str) -> str:
        self.runs += 1
        return f"{what}-{self.runs:03d}/"

    # ---------------------------------------------------------------- ma-run

    def env(self, home: Path) -> Dict[str, str]:
        return {**clean_environment(), "MA_HOME": str(home), "MA_RUNTIME_PREFLIGHT": "off",
                "MA_RUNTIME_SYNC_INTERVAL_SECONDS": "3600", "MA_RUNTIME_FINAL_SYNC_SECONDS": str(RUN_TIMEOUT_S // 2),
                "MA_S3_ENDPOINT": self.server.endpoint, "OBS_ACCESS_KEY_ID": self.server.access_key,
                "OBS_SECRET_ACCESS_KEY": self.server.secret_key, "MA_RUNTIME_STORAGE_SIGNATURE": "v4",
                "MA_RUNTIME_STORAGE_REGION": storage.REGION}

    def ma_run(self) -> Dict[str, Any]:
        run_dir, prefix = Path(tempfile.mkdtemp(prefix="final-", dir=self.scratch)), self.prefix("ma-run")
        try:
            return self._ma_run(run_dir, prefix)
        finally:
            self.delete(prefix)
            shutil.rmtree(run_dir, ignore_errors=True)

    def _ma_run(self, run_dir: Path, prefix: str) -> Dict[str, Any]:
        home, stamp, job = run_dir / "home", run_dir / "stamp", run_dir / "job.json"
        job.write_text(json.dumps({"outputs": [{"name": CHANNEL, "url": f"s3://{BUCKET}/{prefix}"}]}))
        dest = home / "modelarts" / "outputs" / f"{CHANNEL}_0"
        argv = [self.args.ma_run, "--config", str(job), "--", sys.executable, str(self.worker), "final",
                str(self.source), str(dest), str(stamp), repr(self.args.settle)]
        code = run_bounded(argv, self.env(home), run_dir / "stdout", run_dir / "stderr")
        events = log_events(home / "modelarts" / "log" / TASK_LOG)
        done, exited = events.get("final sync completed"), events.get("command exited")
        if code != 0 or done is None or exited is None or not stamp.exists():
            return {"error": f"ma-run exited {code}, final sync {done or 'not completed'}: "
                             f"{tail(run_dir / 'stderr')}"}
        written = float(stamp.read_text())
        problem = self.check(prefix) or (None if done.get("bytes") == str(self.total_bytes) else
                                         f"the final sync sent {done.get('bytes')} of {self.total_bytes} bytes")
        return {"seconds": epoch_of(done["time"]) - written, "to_exited": epoch_of(exited["time"]) - written,
                "uploader_s": float(done["elapsed_s"]), "error": problem}

    # ---------------------------------------------------------------- the engine alone

    def engine(self) -> Dict[str, Any]:
        """The uploader's final cycle in this process: no runtime, no uploader process, no command. A new store
        each time, as each uploader process has (no connection kept from the round before)."""
        from ma_runtime.sync.engine import ChannelSync, Target

        prefix, state = self.prefix("engine"), Path(tempfile.mkdtemp(prefix="engine-", dir=self.scratch))
        runtime = storage.MaRuntime(self.server, self.scratch)
        store, log, folder = PhaseTimer(runtime.store), storage.QuietLog(), self.fresh_copy()
        sync = ChannelSync(Target(CHANNEL, folder, f"s3://{BUCKET}/{prefix}"), store, runtime.options,
                           runtime.spec.sync_markers, log, state)
        try:
            started = time.perf_counter()
            result = sync.cycle(final=True, deadline=time.monotonic() + RUN_TIMEOUT_S)
            seconds = time.perf_counter() - started
            problem = result.error or (f"missing {result.missing[:3]}" if result.missing else None) or \
                self.check(prefix)
            return {"seconds": seconds, **store.seconds(), "error": problem, "warnings": log.warnings}
        finally:
            self.delete(prefix)
            shutil.rmtree(state, ignore_errors=True)
            shutil.rmtree(folder, ignore_errors=True)

    def engine_niced(self) -> Dict[str, Any]:
        """The engine at the uploader's niceness: how much of ma-run's difference to the engine is that.
        nice(2) changes the calling thread, and the upload threads it starts inherit it; only root can undo it."""
        from ma_runtime.sync.uploader import NICENESS

        os.nice(NICENESS)
        try:
            return self.engine()
        finally:
            os.nice(-NICENESS)

    def fresh_copy(self) -> Path:
        """The files written just now, as the command writes them (their pages still dirty in the page cache)."""
        folder = Path(tempfile.mkdtemp(prefix="written-", dir=self.scratch))
        for name in self.sizes:
            shutil.copyfile(self.source / name, folder / name)
        return folder

    # ---------------------------------------------------------------- the anchor

    def raw_upload(self) -> Dict[str, Any]:
        from boto3.s3.transfer import TransferConfig

        prefix, folder = self.prefix("boto3"), self.fresh_copy()
        small = [name for name, size in self.sizes.items() if size < self.small_limit]
        large = [name for name, size in self.sizes.items() if size >= self.small_limit]

        def put(name: str) -> None:
            with open(folder / name, "rb") as handle:
                self.s3.put_object(Bucket=BUCKET, Key=prefix + name, Body=handle.read())

        try:
            started = time.perf_counter()
            with ThreadPoolExecutor(self.args.threads) as pool:
                list(pool.map(put, small))
            small_done = time.perf_counter()
            for name in large:
                part = self.part_size[name]
                self.s3.upload_file(str(folder / name), BUCKET, prefix + name, Config=TransferConfig(
                    multipart_threshold=self.small_limit, multipart_chunksize=part, max_concurrency=self.args.threads))
            ended = time.perf_counter()
            phases = {"small_s": small_done - started if small else None, "large_s": ended - small_done if large
                      else None}
            return {"seconds": ended - started, **phases, "error": self.check(prefix)}
        finally:
            self.delete(prefix)
            shutil.rmtree(folder, ignore_errors=True)

    # ---------------------------------------------------------------- the bucket

    def listing(self, prefix: str) -> Dict[str, Tuple[int, str]]:
        found = {}
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            for item in page.get("Contents", []):
                found[item["Key"][len(prefix):]] = (item["Size"], item["ETag"].strip('"'))
        return found

    def check(self, prefix: str) -> Optional[str]:
        """What is wrong with the uploaded copy: a file missing, another size, or an MD5 ETag that differs."""
        listed = self.listing(prefix)
        for name, size in self.sizes.items():
            if name not in listed:
                return f"{prefix}{name} is not in the bucket"
            got, etag = listed[name]
            if got != size or ("-" not in etag and etag != self.md5[name]):
                return f"{prefix}{name}: {got} bytes, ETag {etag} (expected {size} bytes, MD5 {self.md5[name]})"
        return None

    def delete(self, prefix: str) -> None:
        """Untimed, so that the server's disk does not fill up over the rounds."""
        keys = list(self.listing(prefix))
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda key: self.s3.delete_object(Bucket=BUCKET, Key=prefix + key), keys))


def make_sources(folder: Path, small_count: int, small_size: int, large_size: int) -> Dict[str, int]:
    """Random files (no compression, no dedup can help anyone), written once; name -> size."""
    folder.mkdir()
    sizes = {f"shard-{index:03d}.bin": small_size for index in range(small_count)}
    if large_size:
        sizes["model.bin"] = large_size
    for name, size in sizes.items():
        with open(folder / name, "wb") as handle:
            for start in range(0, size, 8 * MiB):
                handle.write(os.urandom(min(8 * MiB, size - start)))
    return sizes


def md5_of(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(MiB), b""):
            digest.update(chunk)
    return digest.hexdigest()


def anchor_client(server: storage.Server, threads: int):
    """boto3 as storage.py builds it, but computing no checksum it is not made to (botocore >= 1.36 would
    add a CRC32 to every request): the anchor is the bare upload."""
    import boto3
    from botocore.config import Config

    # payload_signing_enabled: over plain HTTP botocore would otherwise SHA256 every body.
    settings = dict(signature_version="s3v4", s3={"addressing_style": "path", "payload_signing_enabled": False},
                    max_pool_connections=max(threads, 10),
                    retries={"max_attempts": 3, "mode": "standard"})
    try:
        config = Config(**settings, request_checksum_calculation="when_required",
                        response_checksum_validation="when_required")
    except TypeError:  # an older botocore computes none anyway
        config = Config(**settings)
    return boto3.session.Session().client("s3", endpoint_url=server.endpoint, region_name=storage.REGION,
                                          aws_access_key_id=server.access_key,
                                          aws_secret_access_key=server.secret_key, config=config)


def start_server(args, scratch: Path) -> Tuple[Optional[storage.Server], List[str]]:
    """s3rver, else moto; the notes on what could not be had."""
    notes: List[str] = []
    order = ("s3rver", "moto") if args.endpoint == "s3rver" else ("moto",)
    for name in order:
        folder = scratch / name
        folder.mkdir()
        print(f"starting {name} ...", file=sys.stderr, flush=True)
        server, problem = storage.start_s3rver(folder, args.s3rver) if name == "s3rver" else storage.start_moto(folder)
        if server is not None:
            return server, notes
        notes.append(f"{name} is not available: {problem}")
        print(f"NOTE: {notes[-1]}", flush=True)
    return None, notes


def part_final(args, scratch: Path) -> Dict[str, Any]:
    server, notes = start_server(args, scratch)
    if server is None:
        print("\nfinal: no local S3 server could be started; nothing measured.")
        return {"results": {"skipped": notes}, "samples": {}}
    try:
        bench = FinalSync(args, scratch, server)
        size = f"{args.small_count} x {args.small_mb:g} MiB" + (f" + {args.large_mb} MiB" if args.large_mb else "")
        harness.print_header(f"final: the sync of {size} ({bench.total_bytes / 1e6:,.1f} MB) written right before "
                             f"the command exits, to {server.label}", args.rounds, args.warmup)
        for note in notes:
            print(f"NOTE: {note}; moto is used instead: its figures are moto's, not s3rver's")
        rows = {MA_FINAL: bench.ma_run, ENGINE: bench.engine, ENGINE_NICED: bench.engine_niced,
                RAW_UPLOAD: bench.raw_upload}
        if os.geteuid() != 0:  # the row could not set this process's niceness back
            del rows[ENGINE_NICED]
            print(f"NOTE: not root: row '{ENGINE_NICED}' is left out")
        samples = harness.round_robin(rows, args.rounds, args.warmup)
        results = final_report(samples, bench.total_bytes)
        results.update({"endpoint": server.label, "notes": notes, "failed": harness.failures(samples)})
        return {"results": results, "samples": samples}
    finally:
        server.stop()


def final_report(samples, total_bytes: int) -> Dict[str, Any]:
    seconds = harness.table("seconds to the bucket", samples, [(name, (name, "seconds")) for name in samples], "s", 3)
    parts = harness.table("ma-run's share: the command's exit to `command exited`, and the uploader's own elapsed_s",
                          samples, [("exit -> `command exited`", (MA_FINAL, "to_exited")),
                            ("uploader elapsed_s (final sync)", (MA_FINAL, "uploader_s"))], "s", 3)
    rate = {label: None if summary is None else megabytes_per_s(summary, total_bytes)
            for label, summary in seconds.items()}
    harness.print_table("the same as throughput", list(rate.items()), "MB/s", 0)
    phases = harness.table("where the time goes: the small files' PUTs, then the large files' multipart uploads "
                           "(first call's start to last call's end)", samples,
                           [(f"{short}: {phase} files", (name, f"{phase}_s")) for phase in ("small", "large")
                            for short, name in (("engine", ENGINE), ("boto3", RAW_UPLOAD))], "s", 3)
    versus = harness.compare(samples[MA_FINAL], samples[RAW_UPLOAD], harness.ratio, harness.value_of("seconds"))
    engine = harness.compare(samples[ENGINE], samples[RAW_UPLOAD], harness.ratio, harness.value_of("seconds"))
    machinery = harness.compare(samples[MA_FINAL], samples[ENGINE], harness.ratio, harness.value_of("seconds"))
    print(f"\n  engine in-process / raw upload:  {harness.comparison_text(engine)}")
    print(f"  ma-run / engine in-process:      {harness.comparison_text(machinery)}")
    niced = None
    if ENGINE_NICED in samples:
        niced = harness.compare(samples[ENGINE_NICED], samples[ENGINE], harness.ratio, harness.value_of("seconds"))
        print(f"  engine at nice 10 / at nice 0:   {harness.comparison_text(niced)}")
    print(f"  final sync / raw upload, seconds: {harness.comparison_text(versus)}")
    met = versus.of_medians is not None and versus.of_medians <= FINAL_RATIO_GOAL
    print(f"  goal <= {FINAL_RATIO_GOAL:g}x (of the medians): {harness.verdict(met)}")
    return {"seconds": seconds, "parts": parts, "phases": phases, "mb_per_s": rate, "over_anchor": versus,
            "engine_over_anchor": engine, "ma_run_over_engine": machinery, "niced_over_engine": niced,
            "goal": FINAL_RATIO_GOAL, "met": met,
            "bytes": total_bytes}


def megabytes_per_s(seconds: harness.Summary, total_bytes: int) -> harness.Summary:
    """MB/s from seconds: the fastest run is the max."""
    megabytes = total_bytes / 1e6
    return harness.Summary(seconds.n, megabytes / seconds.max, megabytes / seconds.median, megabytes / seconds.min,
                           seconds.load_min, seconds.load_median, seconds.load_max)


# --------------------------------------------------------------------------- main


def environment_info(args) -> Dict[str, Any]:
    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
            "rounds": args.rounds, "warmup": args.warmup, "ma_run": args.ma_run, "settle_s": args.settle,
            "tree": [args.folders, args.files, args.file_kb], "parts": args.parts}


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the servers and scratch data still go
    scratch = Path(tempfile.mkdtemp(prefix="ma-bench-sync-", dir=args.workdir or "/tmp"))
    try:
        (scratch / "worker.py").write_text(WORKER_SOURCE)
        home = scratch / "home"
        tree = home / "modelarts" / "outputs" / f"{CHANNEL}_0"
        count = build_tree(tree, args.folders, args.files, args.file_kb * KiB) \
            if {"cycle", "forwarding"} & set(args.parts) else 0
        steps = {"cycle": lambda: part_cycle(args, tree, count, scratch),
                 "forwarding": lambda: part_forwarding(args, scratch, home, count),
                 "final": lambda: part_final(args, scratch)}
        harness.run_parts(steps, args.parts, args.json, environment_info(args))
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
