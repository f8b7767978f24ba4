"""Start-up of `ma-runtime local` (issue 27): from the command to every node's command running, against starting the
same namespaces, object store and runtimes by hand.

One command on every node and in every row, `python -c MARK`: its first statement takes the wall clock
(time.time_ns: CLOCK_REALTIME, one clock for every process of the machine) and writes it to a file named after the
node (VC_TASK_INDEX), then it exits 0. The figure is the launch (time.time() just before the first thing a row does)
to the latest of those marks: every node's command running.

Rows, round-robin (benchmarks/_harness.py):

  ma-runtime local   `ma-runtime local --nodes N --out DIR -- python -c MARK`, as a user runs it: default settings
                     (the coordinator on: the nodes meet at a barrier; the default preflight), no job file, no
                     --data. What it does before the marks: its own interpreter and imports, the nodes' namespaces
                     (ma_runtime/local/nodes.py), the object store (moto's server, python -m ma_runtime.local.store,
                     in the switch namespace) answering, then every node's `ma-run` (interpreter, preflight, the
                     coordination store on worker-0, the barrier) and the command's own interpreter.
  by hand            the same from this already-running process, as a person types it: the same `ip` commands
                     (Nodes of ma_runtime/local/nodes.py: a switch namespace with a bridge, a namespace, a veth and
                     an address per node, the hosts files under /etc/netns, the bridge's service address), moto's
                     own `moto_server -H 10.200.0.254 -p 9000` in the switch namespace until it prints "Running
                     on", then `ma-run python -c MARK` in each namespace under the node's host name with the
                     platform's variables (Nodes.environment), the store's (store.node_environment), MA_HOME,
                     MA_LOG_DIR, the termination log and MA_NUM_GPUS=0: the same settings ma-runtime local gives,
                     without its fault hook (the sitecustomize it puts on the nodes' PYTHONPATH) and without a
                     console in between (each node's output goes to a file).
  diagnostic: store  `python -m ma_runtime.local.store` alone, in a one-node group's switch namespace, from its start
                     to its `ready` (no buckets, as above): against the by-hand row's moto_server, what the store
                     module adds to moto's own start.

Also per row: the phases (ma-runtime local: the launch to its `[local] N node(s) ...; object store ...` line, which
it prints once the namespaces and the store are up; to the last node's `every node joined`; to the last mark. By
hand: the namespaces made; the store answering; the same two), and the launch to the end of everything (the
command's exit; by hand: every ma-run's exit, the store stopped and the namespaces deleted), and per round the ratio
ma-runtime local / by hand and the difference.

    .venv/bin/python benchmarks/local_startup.py [--nodes 2] [--rounds 5] [--warmup 1] [--timeout 120]
        [--ma-runtime PATH] [--json FILE]

Both rows run the ma_runtime of this checkout (PYTHONPATH is its root, as the tests run it) through the executables
beside this interpreter (`ma-runtime`, `ma-run`, `moto_server`); every node's command is this interpreter. Needs
root (network namespaces) and moto's server (`pip install 'ma-runtime[local]'`); without them it says so and exits
0. Every namespace, /etc/netns entry and process a run made is removed at the end whatever happens (SIGTERM
included): each run's processes carry a token in their environment, and after every run any still alive is
listed as a failure and killed by its pid.
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402  (beside this script, not a package)

from ma_runtime.local import nodes as local_nodes  # noqa: E402
from ma_runtime.local import store as local_store  # noqa: E402
from ma_runtime.local.nodes import Nodes  # noqa: E402

OURS, HAND, STORE = "ma-runtime local", "by hand", "diagnostic: the store module's start"
JOB = "ma-job-local"  # the job name ma-runtime local gives: the same host names, the same hosts files
HAND_PREFIX = "ma-bench-ls"
LOCAL_PREFIX = "ma-local"  # ma-runtime local's namespaces: ma-local-<its pid>-...
TOKEN = "LOCAL_STARTUP_RUN"  # in every process a run starts: what is left after it is found by it
MARKS = "LOCAL_STARTUP_MARKS"
FOREIGN_PREFIXES = ("MA_", "VC_", "VK_", "MY_", "PET_", "TORCHELASTIC_", "RANK_TABLE", "OBS_", "AWS_", "PYTHONPATH")
STOP_GRACE = 5.0  # what ma-runtime local gives its nodes' runtimes in Nodes.close once their commands have ended
MARK = ("import time; at = time.time_ns(); import os; "
        f"open(os.path.join(os.environ['{MARKS}'], os.environ['VC_TASK_INDEX']), 'w').write(str(at))")
LOG_LINE = re.compile(r'^(?:\[node(\d+)\] )?time="([^"]+)" level=\w+ msg="([^"]*)"')
READY_LINE = re.compile(r"^\[local\] \d+ node\(s\) .*; object store ")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_round_arguments(parser, rounds=5, warmup=1)
    parser.add_argument("--nodes", type=int, default=2, help="nodes of the job (default 2)")
    parser.add_argument("--ma-runtime", default=os.path.join(os.path.dirname(sys.executable), "ma-runtime"),
                        help="ma-runtime executable (default: next to this python); ma-run and moto_server are "
                             "taken from beside it")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before one run counts as hung")
    parser.add_argument("--json", metavar="FILE", help="also write the results (and raw samples) as JSON to FILE")
    return parser.parse_args(argv)


def missing(args: argparse.Namespace) -> List[str]:
    lacking = local_nodes.missing()
    if local_store.missing():
        lacking.append("moto's server (pip install 'ma-runtime[local]')")
    for tool in ("ma-run", "moto_server"):
        if not os.access(beside(args, tool), os.X_OK):
            lacking.append(beside(args, tool))
    return lacking


def beside(args: argparse.Namespace, name: str) -> str:
    return os.path.join(os.path.dirname(args.ma_runtime), name)


# --------------------------------------------------------------------------- what every row shares


def base_env(marks: Path, token: str) -> Dict[str, str]:
    """This process's environment without the platform's variables of the caller; the checkout first."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(FOREIGN_PREFIXES)}
    return {**env, "PYTHONPATH": str(harness.PROJECT), MARKS: str(marks), TOKEN: token}


def command() -> List[str]:
    return [sys.executable, "-c", MARK]


def read_marks(marks: Path, count: int) -> List[Optional[float]]:
    found: List[Optional[float]] = []
    for node in range(count):
        try:
            found.append(int((marks / str(node)).read_text()) / 1e9)
        except (OSError, ValueError):
            found.append(None)
    return found


def joined_at(lines: Sequence[Tuple[Optional[int], str]], count: int) -> Optional[float]:
    """Epoch seconds of the last node's `every node joined` (the barrier released); None without one per node."""
    stamps: Dict[int, float] = {}
    for node, line in lines:
        match = LOG_LINE.match(line)
        if not match or match.group(3) != "every node joined":
            continue
        index = int(match.group(1)) if match.group(1) is not None else node
        stamp = datetime.datetime.strptime(match.group(2), "%Y-%m-%dT%H:%M:%S.%fZ")
        stamps.setdefault(index, stamp.replace(tzinfo=datetime.timezone.utc).timestamp())
    return max(stamps.values()) if len(stamps) == count else None


def leftovers(token: str) -> List[int]:
    """Processes still carrying this run's token in their environment (by pid), killed."""
    needle = f"{TOKEN}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    for pid in found:
        _kill(pid, signal.SIGKILL)
    return found


def stale_namespaces(prefix: str) -> List[str]:
    """Namespaces (and /etc/netns folders) named PREFIX..., removed; their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    names = sorted({word for word in listed if word.startswith(prefix)}
                   | {path.name for path in local_nodes.ETC_NETNS.glob(f"{prefix}*")})
    for name in names:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            _kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(local_nodes.ETC_NETNS / name, ignore_errors=True)
    return names


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def run_error(codes: Sequence[Optional[int]], marks: Sequence[Optional[float]], left: Sequence[Any],
              output: str) -> str:
    """Why a run is no sample ("" when it is one)."""
    if any(code is None for code in codes):
        return f"hung: still running after --timeout; {last_line(output)}"
    if any(code != 0 for code in codes):
        return f"exit codes {list(codes)}: {last_line(output)}"
    if any(mark is None for mark in marks):
        return f"marks missing: {list(marks)}"
    if left:
        return f"left behind (killed and removed): {list(left)}"
    return ""


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "(no output)"


def figures(launched: float, marks: Sequence[Optional[float]], joined: Optional[float],
            setup: Optional[float]) -> Dict[str, Optional[float]]:
    """Seconds from the launch: to the last mark, the first, the barrier; setup's end to the last mark."""
    if None in marks:
        return {}
    last = max(marks)  # type: ignore[type-var]
    return {"marks": last - launched, "first_mark": min(marks) - launched,  # type: ignore[type-var]
            "joined": None if joined is None else joined - launched,
            "runtimes": None if setup is None else last - launched - setup}


# --------------------------------------------------------------------------- ma-runtime local


class Reader:
    """A child's stdout, each line stamped with the wall clock as it arrives (the runner flushes every line)."""

    def __init__(self, stream):
        self.lines: List[Tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            self.lines.append((time.time(), raw.decode(errors="replace").rstrip("\n")))

    def first(self, pattern: re.Pattern) -> Optional[float]:
        return next((at for at, line in self.lines if pattern.search(line)), None)


def ours(scratch: Path, args: argparse.Namespace) -> Dict[str, Any]:
    run = Path(tempfile.mkdtemp(prefix="local-", dir=scratch))
    marks, token = run / "marks", uuid.uuid4().hex
    marks.mkdir()
    argv = [args.ma_runtime, "local", "--nodes", str(args.nodes), "--out", str(run / "out"), "--", *command()]
    launched = time.time()
    proc = subprocess.Popen(argv, env=base_env(marks, token), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=run)
    reader = Reader(proc.stdout)
    try:
        code = wait_or_stop(proc, args.timeout)
        ended = time.time()
        reader.thread.join(10)
    finally:
        stop(proc)
        left = leftovers(token) + stale_namespaces(f"{LOCAL_PREFIX}-{proc.pid}-")
    output = "\n".join(line for _, line in reader.lines)
    found = read_marks(marks, args.nodes)
    ready = reader.first(READY_LINE)
    setup = None if ready is None else ready - launched
    joined = joined_at([(None, line) for _, line in reader.lines], args.nodes)
    result: Dict[str, Any] = {"code": code, "error": run_error([code], found, left, output), "setup": setup,
                              "exit": ended - launched, **figures(launched, found, joined, setup)}
    shutil.rmtree(run, ignore_errors=True)
    return result


def wait_or_stop(proc: subprocess.Popen, timeout: float) -> Optional[int]:
    """Its exit code; None when it ran past the timeout (then stop() ends it)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (ma-runtime local then stops its nodes and removes what it made), its stop time, then SIGKILL."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- by hand


def by_hand(scratch: Path, args: argparse.Namespace) -> Dict[str, Any]:
    run = Path(tempfile.mkdtemp(prefix="hand-", dir=scratch))
    marks, token = run / "marks", uuid.uuid4().hex
    marks.mkdir()
    env = base_env(marks, token)
    nodes = Nodes(args.nodes, job=JOB, prefix=HAND_PREFIX)
    try:
        launched = time.time()
        nodes.create()
        made = time.time()
        url, store = start_moto(nodes, env, args)
        answering = time.time()
        procs = [start_node(nodes, index, run, env, url, args) for index in range(args.nodes)]
        codes = [wait_or_stop(proc, args.timeout) for proc in procs]
        store.terminate()
        store.wait()
        nodes.close(grace=STOP_GRACE)
        ended = time.time()
    except Exception as exc:  # a failed sample, not a failed benchmark
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        nodes.close(grace=0)
        left = leftovers(token) + stale_namespaces(f"{HAND_PREFIX}-{os.getpid()}-")
        texts = [_text(run / f"node{index}.log") for index in range(args.nodes)]
        found = read_marks(marks, args.nodes)
        shutil.rmtree(run, ignore_errors=True)
    lines = [(index, line) for index, text in enumerate(texts) for line in text.splitlines()]
    setup = answering - launched
    return {"codes": codes, "error": run_error(codes, found, left, "\n".join(texts)), "namespaces": made - launched,
            "store": answering - made, "setup": setup, "exit": ended - launched,
            **figures(launched, found, joined_at(lines, args.nodes), setup)}


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def start_moto(nodes: Nodes, env: Dict[str, str], args: argparse.Namespace) -> Tuple[str, subprocess.Popen]:
    """moto's own server in the switch namespace, once it says it listens (werkzeug prints "Running on" after
    the bind); its URL and process."""
    address = nodes.add_service_address()
    store = nodes.start_on_switch([beside(args, "moto_server"), "-H", address, "-p", str(local_store.PORT)],
                                  env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE)
    said = []
    for raw in iter(store.stderr.readline, b""):
        said.append(raw.decode(errors="replace"))
        if "Running on" in said[-1]:
            break
    else:
        raise RuntimeError(f"moto_server did not start: {''.join(said)[-300:]}")
    # Its later lines (one per request) must not fill the pipe and stall it.
    threading.Thread(target=store.stderr.read, daemon=True).start()
    return f"http://{address}:{local_store.PORT}", store


def start_node(nodes: Nodes, index: int, run: Path, base: Dict[str, str], url: str,
               args: argparse.Namespace) -> subprocess.Popen:
    """`ma-run python -c MARK` as node INDEX, with what ma-runtime local's runner gives a node."""
    folder = run / f"node{index}"
    folder.mkdir()
    (folder / "termination-log").touch()  # the runtime writes only into an existing one, as the kubelet's
    env = {**base, **nodes.environment(index), **local_store.node_environment(url),
           "MA_HOME": str(folder / "home"), "MA_LOG_DIR": str(folder / "log"),
           "MA_RUNTIME_TERMINATION_LOG": str(folder / "termination-log"), "MA_NUM_GPUS": "0"}
    return nodes.start(index, [beside(args, "ma-run"), *command()], env, stdout=run / f"node{index}.log",
                       stderr=subprocess.STDOUT)


# --------------------------------------------------------------------------- diagnostic: the store module


def store_start(scratch: Path, args: argparse.Namespace) -> Dict[str, Any]:
    """`python -m ma_runtime.local.store` from its start to `ready`, no buckets, then ended as the runner ends it."""
    run = Path(tempfile.mkdtemp(prefix="store-", dir=scratch))
    token = uuid.uuid4().hex
    spec = run / "store.json"
    spec.write_text(json.dumps({"buckets": [], "fill": []}))
    nodes = Nodes(1, job=JOB, prefix=HAND_PREFIX)
    answer, seconds = "", None
    try:
        nodes.create()
        address = nodes.add_service_address()
        started = time.time()
        store = nodes.start_on_switch(
            [sys.executable, "-m", "ma_runtime.local.store", address, str(local_store.PORT), str(spec)],
            env=base_env(run, token), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        answer = store.stdout.readline().decode(errors="replace").strip()
        seconds = time.time() - started
        store.stdin.close()  # end of stdin: it stops
        store.wait(30)
    except Exception as exc:  # a failed sample, not a failed benchmark
        answer = f"{type(exc).__name__}: {exc}"
    finally:
        nodes.close(grace=0)
        left = leftovers(token) + stale_namespaces(f"{HAND_PREFIX}-{os.getpid()}-")
    error = "" if answer == "ready" else f"answered {answer!r}"
    if left and not error:
        error = f"left behind (killed and removed): {left}"
    shutil.rmtree(run, ignore_errors=True)
    return {"error": error, "store_module": seconds if not error else None}


# --------------------------------------------------------------------------- report


def progress(name: str, label: str, result: Dict[str, Any]) -> None:
    if result.get("error"):
        text = f"FAILED: {result['error']}"
    elif name == STORE:
        text = f"ready after {result['store_module']:.3f} s"
    else:
        text = f"every node's command running after {result['marks']:.3f} s, all ended {result['exit']:.3f} s"
    print(f"  {label}: {name}: {text}", file=sys.stderr, flush=True)


PHASES = (
    (OURS, "launch -> its `[local] ... object store` line (its start, namespaces, store)", "setup"),
    (HAND, "launch -> namespaces made (Nodes.create)", "namespaces"),
    (HAND, "namespaces -> moto_server says `Running on`", "store"),
    (HAND, "launch -> the store answering", "setup"),
    (STORE, "`python -m ma_runtime.local.store` start -> `ready` (no buckets)", "store_module"),
    (OURS, "launch -> the last node's `every node joined` (barrier released)", "joined"),
    (HAND, "launch -> the last node's `every node joined` (barrier released)", "joined"),
    (OURS, "store up -> the last mark (the runtimes, the barrier, the command's start)", "runtimes"),
    (HAND, "store up -> the last mark (the runtimes, the barrier, the command's start)", "runtimes"),
    (OURS, "launch -> the first node's mark", "first_mark"),
    (HAND, "launch -> the first node's mark", "first_mark"),
    (OURS, "launch -> the command's exit (teardown, summary)", "exit"),
    (HAND, "launch -> every ma-run exited, store stopped, namespaces gone", "exit"),
)


def report(samples: Dict[str, List[harness.Sample]], args: argparse.Namespace) -> Dict[str, Any]:
    good = {name: [s for s in rows if not s.result.get("error")] for name, rows in samples.items()}
    headline = harness.table(f"launch -> every node's command running, {args.nodes} nodes",
                             {name: good[name] for name in (OURS, HAND)},
                             [(OURS, (OURS, "marks")), (HAND, (HAND, "marks"))], "s", 3)
    barrier = args.nodes > 1  # one node meets no one: its runtime logs no `every node joined`
    phases = harness.table("where the time goes", good, [(f"{name}: {label}", (name, key))
                                                          for name, label, key in PHASES
                                                          if barrier or key != "joined"], "s", 3)
    ratio = harness.compare(good[OURS], good[HAND], harness.ratio, harness.value_of("marks"))
    extra = harness.compare(good[OURS], good[HAND], harness.difference, harness.value_of("marks")).scaled(1000)
    setup_extra = harness.compare(good[OURS], good[HAND], harness.difference,
                                  harness.value_of("setup")).scaled(1000)
    print(f"\n  {OURS} / {HAND}: {harness.comparison_text(ratio)}")
    print(f"  {OURS} - {HAND}: {harness.comparison_text(extra, ' ms', 0)}")
    print(f"  of which before the nodes start (setup): {harness.comparison_text(setup_extra, ' ms', 0)}")
    print_rounds(good)
    return {"seconds": {**headline, **phases}, "ratio": ratio.as_dict(), "difference_ms": extra.as_dict(),
            "setup_difference_ms": setup_extra.as_dict(), "failures": harness.failures(samples)}


def print_rounds(good: Dict[str, List[harness.Sample]]) -> None:
    hand = {s.round: s for s in good[HAND]}
    print("\n  each round, launch -> every node's command running (load):")
    for sample in good[OURS]:
        partner = hand.get(sample.round)
        if partner is None:
            continue
        mine, theirs = sample.result["marks"], partner.result["marks"]
        print(f"    round {sample.round + 1}: {OURS} {mine:.3f} s ({sample.load:.2f}), {HAND} {theirs:.3f} s "
              f"({partner.load:.2f}): {mine / theirs:.2f}x, {1000 * (mine - theirs):+.0f} ms")


def environment_info(args: argparse.Namespace) -> Dict[str, Any]:
    import moto

    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
            "rounds": args.rounds, "warmup": args.warmup, "nodes": args.nodes, "ma_runtime": args.ma_runtime,
            "moto": moto.__version__, "checkout": str(harness.PROJECT)}


def stop_on_signal(signum, _frame) -> None:
    raise SystemExit(f"stopped by signal {signum}: cleaning up")  # every row's finally removes what it made


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    lacking = missing(args)
    if lacking:
        print(f"local_startup.py needs {', '.join(lacking)}: nothing measured")
        return 0
    if not 1 <= args.nodes <= local_nodes.MAX_NODES:
        print(f"--nodes {args.nodes}: from 1 to {local_nodes.MAX_NODES}")
        return 2
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop_on_signal)
    info = environment_info(args)
    scratch = Path(tempfile.mkdtemp(prefix="ma-bench-local-startup-"))
    try:
        harness.print_header(f"ma-runtime local start-up, {args.nodes} nodes: {args.ma_runtime} against the same "
                             f"by hand (moto {info['moto']})", args.rounds, args.warmup)
        tasks = {OURS: lambda: ours(scratch, args), HAND: lambda: by_hand(scratch, args),
                 STORE: lambda: store_start(scratch, args)}
        samples = harness.round_robin(tasks, args.rounds, args.warmup, progress)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results = report(samples, args)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"environment": info, **results, "samples": samples}, handle, indent=2,
                      default=harness.to_json)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
