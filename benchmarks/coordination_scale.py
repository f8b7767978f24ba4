"""The coordination store at scale (issue 26): 256 and 1 024 simulated nodes against worker-0's embedded store, on
loopback; how the barrier, the failure's fan-out, the store's CPU and memory and the heartbeat traffic grow.

The store is the runtime's own `EmbeddedStoreServer` (ma_runtime/coordination/embedded), alone in a child process
(its CPU seconds and RSS read with psutil; its RLIMIT_NOFILE soft limit raised to the hard one, or set with
--server-nofile). The nodes are simulated by --processes child processes, each holding a slice of the nodes, and
every node makes the calls a node's runtime makes (ma_runtime/coordinator.py), through
`ma_runtime.coordination.job.JobState` over the runtime's `EmbeddedStoreClient`, with a node's three connections:
  beacon   `beat(stage, ttl=NODE_LOST)` every NODE_LOST / 5 s (the default MA_RUNTIME_NODE_LOST_SECONDS=30: every
           6 s), the nodes' phases spread evenly over the interval; one thread per process beats its nodes in
           turn; the failing node's failure goes out on it (`report`), as the runtime's beacon thread sends it;
  main     the barrier: `gathering`, `first_attempt`, `join`, then `released` (a wait on the release key);
  watch    during the attempt, as `Watch._watch`: `over(attempt, ...)` again and again, then `origin` once it is
           over; node 0 (worker-0's runtime) renews it every LOOK_SECONDS (1 s) and looks for lost nodes each time
           (`lost`), the others every half MA_RUNTIME_NODE_LOST_SECONDS (15 s).
One thread per node for main and watch (they block, as the runtime's do).

One cycle (a row's sample), on a fresh store: connect every node's three clients; start the heartbeats; every
node but the last joins attempt 1 and waits; then the last node joins:
  barrier    the last node's join called -> every node released (the issue's goal: within 1 s)
then the attempt runs --steady-seconds (heartbeats and watches only), over which are measured:
  the store's CPU, % of one core;  bytes per node per minute, split: heartbeats (beacon connections) and the
  watch's renewed waits, payload bytes counted at each client's socket (frame headers included, TCP/IP not);
  and, when run as root, every byte on the loopback of a network namespace of its own (/proc/net/dev: TCP/IP
  headers and ACKs included), per node per minute;
then node N/2 reports a failure:
  told       the failure's report called -> every other node's watch has the origin in hand
and the store's RSS at the end (and its growth from the empty store).

Rows, round-robin (benchmarks/_harness.py): 256 nodes, 1 024 nodes (--sizes). Then, for each figure, 1 024 / 256
per round and of the medians, against what linear growth gives (4x for a total, 1x per node): a figure that grows
faster is flagged SUPERLINEAR.

    .venv/bin/python benchmarks/coordination_scale.py [--rounds 5] [--warmup 1] [--sizes 256,1024]
        [--processes 4] [--steady-seconds 12] [--server-nofile N] [--json FILE]

Everything runs on this machine's cores: the simulated nodes' Python costs CPU the store shares (the store's
own CPU is its process's alone). Without root the loopback figure is left out.
"""

import argparse
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402  (beside this script, not a package)

from ma_runtime.coordination.embedded import EmbeddedStoreClient, EmbeddedStoreServer  # noqa: E402
from ma_runtime.coordination.job import FAILED, Failure, JobState  # noqa: E402

NODE_LOST_SECONDS = 30.0  # MA_RUNTIME_NODE_LOST_SECONDS's default
BEATS_PER_LOST = 5  # together.BEATS_PER_LOST
LOOK_SECONDS = 1.0  # together.LOOK_SECONDS: worker-0's watch renews its wait this often, to look for lost nodes
OTHERS_LOOK_SECONDS = NODE_LOST_SECONDS / 2  # together.Watch: the other nodes' wait, half MA_RUNTIME_NODE_LOST_SECONDS
ATTEMPT = 1
INSIDE = "MA_BENCH_SCALE_NETNS"  # set once this script runs in its own network namespace
ROLES = ("beacon", "main", "watch")

# --------------------------------------------------------------------------- the store's process


def serve(nofile: Optional[int]) -> int:
    """--serve: the store on loopback, its port on stdout, until stdin closes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(nofile, hard) if nofile else hard, hard))
    server = EmbeddedStoreServer("127.0.0.1", 0).start()
    print(json.dumps({"port": server.port, "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                      "nofile_before": soft}), flush=True)
    sys.stdin.read()
    server.close()
    return 0


# --------------------------------------------------------------------------- the simulated nodes' processes


class _Counted:
    """A client's socket that counts the bytes it sends and receives (the frames, headers included)."""

    def __init__(self, sock: socket.socket, counter: List[int]):
        self._sock = sock
        self._counter = counter

    def sendall(self, data: bytes) -> None:
        self._counter[0] += len(data)
        self._sock.sendall(data)

    def recv(self, size: int) -> bytes:
        data = self._sock.recv(size)
        self._counter[1] += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class CountingClient(EmbeddedStoreClient):
    def __init__(self, counter: List[int], *args, **kwargs):
        self.counter = counter
        super().__init__(*args, **kwargs)

    def _connection(self):
        if self._sock is None:
            super()._connection()
            self._sock = _Counted(self._sock, self.counter)
        return self._sock


class SimNode:
    def __init__(self, index: int, hosts: int, port: int, counters: Dict[str, List[int]]):
        self.index = index
        host = f"job-worker-{index}.job"
        # As the runtime connects (coordinator._embedded_connect): half the lost time to reconnect and to reply.
        half = NODE_LOST_SECONDS / 2
        self.states = {role: JobState(CountingClient(counters[role], "127.0.0.1", port, reconnect_seconds=half,
                                                     reply_seconds=half, connect_seconds=60.0),
                                      index, host, hosts) for role in ROLES}
        self.joined_at = self.released_at = self.woke_at = self.told_at = None  # time.time()
        self.error = ""

    def barrier_and_watch(self, stop: threading.Event, look_seconds: float) -> None:
        try:
            main = self.states["main"]
            number = main.gathering(ATTEMPT)
            main.first_attempt(ATTEMPT)
            main.join(number, {"starting": 0.1, "waiting for the other nodes": 0.0})
            self.joined_at = time.time()
            ended = main.released(number, 600)  # "": every node joined; None: timed out; else why it ended
            if ended != "":
                raise RuntimeError(f"the barrier did not release: {ended or 'timed out'}")
            self.released_at = time.time()
            watch = self.states["watch"]
            # Worker-0 renews its wait every LOOK_SECONDS to look for lost nodes; the others every --look-seconds
            # (the runtime's: half MA_RUNTIME_NODE_LOST_SECONDS).
            look = LOOK_SECONDS if self.index == 0 else look_seconds
            while not stop.is_set():
                if watch.over(number, look):
                    self.woke_at = time.time()
                    watch.origin(number)
                    self.told_at = time.time()
                    return
                if self.index == 0:  # worker-0's runtime looks for lost nodes as it watches
                    watch.lost(number)
        except Exception as exc:  # noqa: BLE001  (any failure is this sample's error, said in one line)
            self.error = f"node {self.index}: {type(exc).__name__}: {exc}"

    def close(self) -> None:
        for state in self.states.values():
            state.store.close()


class Simulator:
    """--simulate FIRST COUNT HOSTS PORT: nodes FIRST..FIRST+COUNT-1, driven by JSON lines on stdin."""

    def __init__(self, first: int, count: int, hosts: int, port: int, look_seconds: float):
        self.first, self.count, self.hosts, self.port = first, count, hosts, port
        self.look_seconds = look_seconds
        self.counters = {role: [0, 0] for role in ROLES}
        self.nodes: Dict[int, SimNode] = {}
        self.threads: Dict[int, threading.Thread] = {}
        self.stop = threading.Event()

    def run(self) -> int:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # three connections per node
        threading.stack_size(256 << 10)  # a node's thread needs little; hundreds of them share the process
        for line in sys.stdin:
            request = json.loads(line)
            reply = getattr(self, f"do_{request.pop('cmd')}")(**request)
            print(json.dumps(reply), flush=True)
            if reply.get("bye"):
                break
        return 0

    def do_connect(self) -> Dict[str, Any]:
        start = time.time()
        for index in range(self.first, self.first + self.count):
            self.nodes[index] = SimNode(index, self.hosts, self.port, self.counters)
        return {"seconds": time.time() - start}

    def do_beat(self) -> Dict[str, Any]:
        threading.Thread(target=self._beat, daemon=True).start()
        return {}

    def _beat(self) -> None:
        interval = NODE_LOST_SECONDS / BEATS_PER_LOST
        # Node i beats at i/hosts of the interval: every process's nodes together spread over it evenly.
        due = {index: time.monotonic() + interval * index / self.hosts for index in self.nodes}
        while not self.stop.is_set():
            index = min(due, key=due.get)
            pause = due[index] - time.monotonic()
            if pause > 0 and self.stop.wait(pause):
                return
            try:
                self.nodes[index].states["beacon"].beat("running", ttl=NODE_LOST_SECONDS)
            except Exception:  # noqa: BLE001  (the store closed under us at the end)
                return
            due[index] += interval

    def do_join(self, skip: Optional[int]) -> Dict[str, Any]:
        for index in self.nodes:
            if index != skip:
                self._start(index)
        while any(self.nodes[i].joined_at is None and not self.nodes[i].error for i in self.threads):
            time.sleep(0.01)
        return {"errors": self._errors()}

    def do_last(self, node: int) -> Dict[str, Any]:
        called = time.time()
        self._start(node)
        return {"called": called}

    def _start(self, index: int) -> None:
        thread = threading.Thread(target=self.nodes[index].barrier_and_watch, args=(self.stop, self.look_seconds),
                                  daemon=True)
        self.threads[index] = thread
        thread.start()

    def do_released(self) -> Dict[str, Any]:
        return self._all("released_at", ())

    def do_fail(self, node: int) -> Dict[str, Any]:
        state = self.nodes[node].states["beacon"]
        called = time.time()
        state.report(Failure(FAILED, node, state.host, ATTEMPT, "the command exited with code 3", rank=0,
                             exit_code=3, last_line="Traceback (most recent call last):"))
        return {"called": called}

    def do_told(self, exclude: int) -> Dict[str, Any]:
        told = self._all("told_at", (exclude,))
        woke = [node.woke_at for index, node in self.nodes.items() if index != exclude and node.woke_at]
        return {**told, "woke": max(woke) if woke else None}

    def _all(self, field: str, exclude: Sequence[int]) -> Dict[str, Any]:
        deadline = time.monotonic() + 120
        wanted = [node for index, node in self.nodes.items() if index not in exclude]
        while any(getattr(node, field) is None and not node.error for node in wanted) and time.monotonic() < deadline:
            time.sleep(0.005)
        times = [getattr(node, field) for node in wanted]
        done = [value for value in times if value is not None]
        return {"max": max(done) if done else None, "missing": len(times) - len(done), "errors": self._errors()}

    def _errors(self) -> List[str]:
        return [node.error for node in self.nodes.values() if node.error][:3]

    def do_counters(self) -> Dict[str, Any]:
        return {"counters": self.counters}

    def do_stop(self) -> Dict[str, Any]:
        self.stop.set()
        for node in self.nodes.values():
            node.close()
        return {"bye": True}


# --------------------------------------------------------------------------- one cycle, driven from here


class Child:
    """A child of this script speaking JSON lines."""

    def __init__(self, argv: List[str]):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def read(self) -> Dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a child exited ({self.proc.wait()}) before it answered")
        return json.loads(line)

    def send(self, **request) -> None:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def ask(self, **request) -> Dict[str, Any]:
        self.send(**request)
        return self.read()

    def end(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def loopback_bytes() -> Optional[int]:
    """Bytes through this network namespace's loopback (received: every packet once), when it is ours alone."""
    if os.environ.get(INSIDE) != "1":
        return None
    with open("/proc/net/dev") as handle:
        for line in handle:
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[0])
    return None


def cycle(hosts: int, args: argparse.Namespace) -> Dict[str, Any]:
    try:
        return _cycle(hosts, args)
    except (OSError, RuntimeError, ValueError, KeyError) as exc:  # one failed sample, said in one line
        return {"error": f"{type(exc).__name__}: {exc}"}


def _cycle(hosts: int, args: argparse.Namespace) -> Dict[str, Any]:
    import psutil

    server = Child(["--serve"] + ([f"--server-nofile={args.server_nofile}"] if args.server_nofile else []))
    sims: List[Child] = []
    try:
        limits = server.read()
        store = psutil.Process(server.proc.pid)
        rss_empty = store.memory_info().rss
        per = -(-hosts // args.processes)
        slices = [(first, min(per, hosts - first)) for first in range(0, hosts, per)]
        sims = [Child(["--simulate", str(first), str(count), str(hosts), str(limits["port"]), str(args.look_seconds)])
                for first, count in slices]
        cpu_0 = sum(store.cpu_times()[:2])
        for sim in sims:
            sim.send(cmd="connect")
        connect_s = max(sim.read()["seconds"] for sim in sims)
        for sim in sims:
            sim.ask(cmd="beat")
        last = hosts - 1
        for sim in sims:
            sim.send(cmd="join", skip=last)
        errors = [error for sim in sims for error in sim.read()["errors"]]
        time.sleep(0.3)  # every waiting node's `released` parked at the store
        called = sims[-1].ask(cmd="last", node=last)["called"]
        released = [sim.ask(cmd="released") for sim in sims]
        errors += [error for answer in released for error in answer["errors"]]
        barrier_s = max(answer["max"] for answer in released if answer["max"]) - called
        cpu_1 = sum(store.cpu_times()[:2])
        # The attempt runs: heartbeats and watches only.
        counters_0 = _counters(sims)
        wire_0, steady_0, cpu_2 = loopback_bytes(), time.monotonic(), sum(store.cpu_times()[:2])
        time.sleep(args.steady_seconds)
        counters_1, wire_1 = _counters(sims), loopback_bytes()
        steady_cpu, steady_s = sum(store.cpu_times()[:2]) - cpu_2, time.monotonic() - steady_0
        failing = hosts // 2
        owner = next(sim for sim, (first, count) in zip(sims, slices) if first <= failing < first + count)
        cpu_3 = sum(store.cpu_times()[:2])
        failed = owner.ask(cmd="fail", node=failing)["called"]
        told = [sim.ask(cmd="told", exclude=failing) for sim in sims]
        cpu_told = sum(store.cpu_times()[:2]) - cpu_3
        errors += [error for answer in told for error in answer["errors"]]
        missing = sum(answer["missing"] for answer in told) + sum(answer["missing"] for answer in released)
        rss_end = store.memory_info().rss
        cpu_end = sum(store.cpu_times()[:2])
    finally:
        for sim in sims:
            try:
                sim.ask(cmd="stop")
            except (OSError, RuntimeError, ValueError):
                pass
            sim.end()
        server.end()
    if errors or missing:
        return {"error": f"{missing} node(s) never released or told; {'; '.join(errors[:3])}"}
    minutes = steady_s / 60
    per_node_minute = {role: (counters_1[role] - counters_0[role]) / hosts / minutes for role in ROLES}
    return {"error": "", "nodes": hosts, "connect_s": connect_s, "barrier_s": barrier_s,
            "told_s": max(answer["max"] for answer in told) - failed,
            "woke_s": max(answer["woke"] for answer in told) - failed, "cpu_told_s": cpu_told,
            "cpu_connect_barrier_s": cpu_1 - cpu_0, "cpu_steady_pct": 100 * steady_cpu / steady_s,
            "cpu_steady_per_node_us_s": 1e6 * steady_cpu / steady_s / hosts, "cpu_total_s": cpu_end - cpu_0,
            "rss_mb": rss_end / 1e6, "rss_growth_mb": (rss_end - rss_empty) / 1e6,
            "rss_per_node_kb": (rss_end - rss_empty) / hosts / 1e3,
            "heartbeat_b_node_min": per_node_minute["beacon"], "watch_b_node_min": per_node_minute["watch"],
            "wire_b_node_min": None if wire_0 is None else (wire_1 - wire_0) / hosts / minutes,
            "nofile": limits["nofile"], "nofile_before": limits["nofile_before"]}


def _counters(sims: Sequence[Child]) -> Dict[str, int]:
    totals = {role: 0 for role in ROLES}
    for sim in sims:
        for role, (sent, received) in sim.ask(cmd="counters")["counters"].items():
            totals[role] += sent + received
    return totals


# --------------------------------------------------------------------------- report

FIGURES = (  # key, label, unit, digits, linear growth per node count (1: a total; 0: per node)
    ("barrier_s", "barrier: last join called -> every node released", "s", 3, 1),
    ("told_s", "failure reported -> every other node has the origin", "s", 3, 1),
    ("woke_s", "  of which: failure reported -> every other node's watch woke", "s", 3, 1),
    ("cpu_told_s", "store CPU: failure reported -> every node told", "s", 3, 1),
    ("connect_s", "connecting every node's 3 clients (slowest process)", "s", 3, 1),
    ("cpu_connect_barrier_s", "store CPU: connections + barrier", "s", 3, 1),
    ("cpu_steady_pct", "store CPU while the attempt runs", "% core", 2, 1),
    ("cpu_steady_per_node_us_s", "  the same per node", "us/s", 2, 0),
    ("rss_mb", "store RSS at the end", "MB", 1, None),
    ("rss_growth_mb", "store RSS growth over the empty store", "MB", 2, 1),
    ("heartbeat_b_node_min", "heartbeats (beacon frames), per node per minute", "B", 0, 0),
    ("watch_b_node_min", "watch's renewed waits (frames), per node per minute", "B", 0, 0),
    ("wire_b_node_min", "everything on the loopback (TCP/IP too), per node per minute", "B", 0, 0),
)
SUPERLINEAR_MARGIN = 1.5  # grows more than 1.5x what linear gives: flagged (2 shared cores are noisy)


def report(samples: Dict[str, List[harness.Sample]], sizes: Sequence[int]) -> Dict[str, Any]:
    names = list(samples)
    good = {name: [s for s in rows if not s.result.get("error")] for name, rows in samples.items()}
    results: Dict[str, Any] = {"figures": {}, "growth": {}, "superlinear": []}
    for key, label, unit, digits, _ in FIGURES:
        rows = [(f"{name}: {label}", harness.summarize(good[name], harness.value_of(key))) for name in names]
        if all(summary is None for _, summary in rows):
            continue
        harness.print_table(label, rows, unit, digits)
        results["figures"][key] = {label: summary.as_dict() if summary else None for label, summary in rows}
    small, large = names[0], names[-1]
    scale = sizes[-1] / sizes[0]
    print(f"\ngrowth {large} / {small} (linear: {scale:g}x for a total, 1x per node; flagged when more than "
          f"{SUPERLINEAR_MARGIN:g}x that)")
    for key, label, _unit, _digits, linear in FIGURES:
        if linear is None:
            continue
        comparison = harness.compare(good[large], good[small], harness.ratio, harness.value_of(key))
        if comparison.of_medians is None:
            continue
        expected = scale if linear else 1.0
        flag = comparison.of_medians > SUPERLINEAR_MARGIN * expected
        print(f"  {label}: {harness.comparison_text(comparison)}{'  SUPERLINEAR' if flag else ''}")
        results["growth"][key] = comparison.as_dict()
        if flag:
            results["superlinear"].append(key)
    barrier = harness.summarize(good[large], harness.value_of("barrier_s"))
    if barrier is not None:
        print(f"\n  release within 1 s of the last arrival at {sizes[-1]} nodes: every round "
              f"{harness.verdict(barrier.max <= 1.0)} (max {barrier.max:.3f} s)")
    limits = next((s.result for rows in good.values() for s in rows), None)
    if limits:
        print(f"  the store's RLIMIT_NOFILE soft limit: {limits['nofile_before']} as started, {limits['nofile']} "
              f"while serving ({max(sizes) * 3} client connections at {max(sizes)} nodes)")
    results["failures"] = harness.failures(samples)
    return results


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_round_arguments(parser, rounds=5, warmup=1)
    parser.add_argument("--sizes", default="256,1024", help="simulated node counts, smallest first (default "
                                                            "256,1024)")
    parser.add_argument("--processes", type=int, default=4, help="processes the nodes are spread over (default 4)")
    parser.add_argument("--steady-seconds", type=float, default=12.0,
                        help="how long the attempt runs with heartbeats and watches only (default 12: two beats)")
    parser.add_argument("--server-nofile", type=int, default=0,
                        help="the store's RLIMIT_NOFILE soft limit (default: raised to the hard limit)")
    parser.add_argument("--look-seconds", type=float, default=OTHERS_LOOK_SECONDS,
                        help="the watch's wait on every node but worker-0 (default: the runtime's, "
                             f"{OTHERS_LOOK_SECONDS:g} s; worker-0's is {LOOK_SECONDS:g} s)")
    parser.add_argument("--no-netns", action="store_true", help="do not run in a network namespace of its own")
    parser.add_argument("--json", metavar="FILE", help="also write the results (and raw samples) as JSON to FILE")
    return parser.parse_args(argv)


def in_own_namespace(argv: Sequence[str], args: argparse.Namespace) -> None:
    """Runs this script again in a network namespace of its own (root only), so that its loopback carries only
    this benchmark's bytes; returns only where that is not done."""
    if os.environ.get(INSIDE) or args.no_netns or os.geteuid() != 0:
        return
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True)
    if probe.returncode != 0:
        return
    os.environ[INSIDE] = "1"
    script = 'ip link set lo up && exec "$0" "$@"'
    os.execvp("unshare", ["unshare", "--net", "sh", "-c", script, sys.executable, os.path.abspath(__file__),
                          *argv])


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["--serve"]:
        nofile = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--server-nofile=")), None)
        return serve(nofile)
    if argv[:1] == ["--simulate"]:
        first, count, hosts, port = map(int, argv[1:5])
        return Simulator(first, count, hosts, port, float(argv[5])).run()
    args = parse_args(argv)
    in_own_namespace(argv, args)
    sizes = [int(size) for size in args.sizes.split(",")]
    harness.print_header(f"coordination store at scale: {', '.join(map(str, sizes))} simulated nodes over "
                         f"{args.processes} processes, the embedded store in a process of its own"
                         + ("" if loopback_bytes() is not None else " (loopback bytes left out: not in a network "
                                                                    "namespace of its own)"),
                         args.rounds, args.warmup)
    tasks = {f"{size} nodes": (lambda size=size: cycle(size, args)) for size in sizes}

    def progress(name: str, label: str, result: Dict[str, Any]) -> None:
        text = (f"FAILED: {result['error']}" if result.get("error") else
                f"barrier {result['barrier_s']:.3f} s, told {result['told_s']:.3f} s, store CPU "
                f"{result['cpu_steady_pct']:.1f} % steady, RSS {result['rss_mb']:.1f} MB")
        print(f"  {label}: {name}: {text}", file=sys.stderr, flush=True)

    samples = harness.round_robin(tasks, args.rounds, args.warmup, progress)
    results = report(samples, sizes)
    if args.json:
        info = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
                "rounds": args.rounds, "warmup": args.warmup, "sizes": sizes, "processes": args.processes,
                "steady_seconds": args.steady_seconds, "own_netns": loopback_bytes() is not None}
        with open(args.json, "w") as handle:
            json.dump({"environment": info, **results, "samples": samples}, handle, indent=2,
                      default=harness.to_json)
    failed = [name for name, runs in samples.items() if any(run.result.get("error") for run in runs)]
    if failed:  # a figure from some rounds only would not be worth quoting
        print(f"FAILED rounds in: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
