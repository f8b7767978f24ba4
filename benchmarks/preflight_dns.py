"""Wall time of the `dns` preflight check for N host names, against a sequential getaddrinfo loop.

A temporary network namespace gets its own /etc/hosts (`ip netns exec`
bind-mounts /etc/netns/<ns>/hosts over it) holding N job host names
(`10.211.x.y <job>-worker-<i>.<job> <job>-worker-<i>`, default N = 1000), and a
Volcano directory gets a `worker.host` file listing them. Inside the namespace,
two ways are timed, round-robin (benchmarks/_harness.py), K rounds (default 5)
after one warm-up round:

  check       ma_runtime.stages.preflight.dns.run(spec, environ): reads worker.host and
              resolves every name on its pool of threads (the whole check)
  sequential  for name in names: socket.getaddrinfo(name, None, type=SOCK_STREAM)

The table reports min/median/max wall time of each with the load average beside
it, and sequential / check per round and of the medians. Every run must resolve
all N names. Needs root (`ip netns`); without it the script says so and exits 0.

With `--resolver-delay-ms MS` the names are not in /etc/hosts: a stub DNS
server in the namespace (127.0.0.1:53, this script with --serve) answers each
query after MS ms, as a cluster DNS server a network hop away would. That is
the case the check's concurrency is for; from a hosts file, lookups are CPU
work and gain at most the number of CPUs.

    .venv/bin/python benchmarks/preflight_dns.py [--names N] [--rounds K] [--resolver-delay-ms MS] [--json FILE]
"""

import argparse
import heapq
import json
import os
import platform
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402  (beside this script, not a package)

JOB = f"bench-{os.getpid()}"
MODES = ("check", "sequential")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", type=int, default=1000, help="host names to resolve (default 1000)")
    harness.add_round_arguments(parser, rounds=5, warmup=1, aliases=("--repeat",))
    parser.add_argument(
        "--resolver-delay-ms", type=float, default=None,
        help="serve the names from a stub DNS server answering after this delay, not from /etc/hosts",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    # Internal: the halves of the script that run inside the namespace.
    parser.add_argument("--inside", metavar="VOLCANO_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--serve", metavar="HOSTS_FILE", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def job_hosts(count: int, job: str = JOB) -> List[str]:
    return [f"10.211.{i // 250}.{i % 250 + 1} {job}-worker-{i}.{job} {job}-worker-{i}" for i in range(count)]


# --- the stub DNS server (inside the namespace, --serve) ------------------------------------------


def serve(hosts_file: str, delay: float) -> None:
    """Answers A queries for the names in hosts_file after `delay` s; AAAA gets an empty answer."""
    addresses = {}
    with open(hosts_file) as handle:
        for line in handle:
            address, *names = line.split()
            addresses.update((name.lower(), address) for name in names)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 53))
    print("ready", flush=True)
    # One thread, replies held in a heap until due: many queries wait out their delay at once.
    due: List[Tuple[float, int, bytes, tuple]] = []
    sequence = 0
    while True:
        sock.settimeout(max(0.0, due[0][0] - time.monotonic()) if due else None)
        try:
            query, peer = sock.recvfrom(512)
            reply = dns_reply(query, addresses)
            if reply is not None:
                sequence += 1
                heapq.heappush(due, (time.monotonic() + delay, sequence, reply, peer))
        except socket.timeout:
            pass
        while due and due[0][0] <= time.monotonic():
            _, _, reply, peer = heapq.heappop(due)
            sock.sendto(reply, peer)


def dns_reply(query: bytes, addresses: Dict[str, str]) -> Optional[bytes]:
    """The answer to a one-question query; None for anything this stub cannot parse."""
    labels, offset = [], 12
    while offset < len(query) and query[offset]:
        length = query[offset]
        labels.append(query[offset + 1 : offset + 1 + length].decode("ascii", "replace"))
        offset += 1 + length
    if len(query) < offset + 5:
        return None
    qtype = struct.unpack("!H", query[offset + 1 : offset + 3])[0]
    question = query[12 : offset + 5]
    address = addresses.get(".".join(labels).lower())
    rcode = 0 if address else 3  # NXDOMAIN for names it does not know
    answer = b""
    if address and qtype == 1:
        answer = struct.pack("!HHHIH", 0xC00C, 1, 1, 0, 4) + socket.inet_aton(address)
    flags = 0x8180 | rcode  # a response, recursion desired and available
    header = struct.pack("!HHHHHH", struct.unpack("!H", query[:2])[0], flags, 1, 1 if answer else 0, 0, 0)
    return header + question + answer


# --- inside the namespace -------------------------------------------------------------------------


def time_check(volcano_dir: str) -> Dict[str, object]:
    from ma_runtime import spec
    from ma_runtime.stages.preflight import dns

    environ = {"MA_HOME": tempfile.mkdtemp(prefix="ma-home-"), "MA_RUNTIME_PREFLIGHT_VOLCANO_DIR": volcano_dir}
    job_spec = spec.load({}, environ)
    start = time.perf_counter()
    (result,) = dns.run(job_spec, environ)
    seconds = time.perf_counter() - start
    shutil.rmtree(environ["MA_HOME"])
    return {"seconds": seconds, "resolved": result.value, "status": result.status.value}


def time_sequential(volcano_dir: str) -> Dict[str, object]:
    start = time.perf_counter()
    # Reading the file is part of the check's time too.
    with open(os.path.join(volcano_dir, "worker.host")) as handle:
        names = handle.read().split()
    resolved = 0
    for name in names:
        try:
            socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            resolved += 1
        except OSError:
            pass
    return {"seconds": time.perf_counter() - start, "resolved": resolved}


def inside(volcano_dir: str, rounds: int, warmup: int) -> None:
    """Round-robin timings (warm-up: imports, page cache, thread start-up), one JSON object on stdout."""
    tasks = {"check": lambda: time_check(volcano_dir), "sequential": lambda: time_sequential(volcano_dir)}
    samples = harness.round_robin(tasks, rounds, warmup)
    print(json.dumps({mode: [vars(sample) for sample in rows] for mode, rows in samples.items()}))


# --- outside: set up the namespace, report ------------------------------------------------------------


def run_in_netns(count: int, rounds: int, warmup: int, delay_ms: Optional[float],
                 scratch: str) -> Dict[str, List[harness.Sample]]:
    ns = f"ma-dns-bench-{os.getpid()}"
    etc = os.path.join("/etc/netns", ns)
    lines = job_hosts(count)
    volcano_dir = write_volcano_dir(scratch, lines)
    subprocess.run(["ip", "netns", "add", ns], check=True)
    server = None
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        write_netns_etc(etc, lines, served=delay_ms is not None)
        if delay_ms is not None:
            server = start_server(ns, lines, delay_ms, scratch)
        argv = [*netns_python(ns), "--inside", volcano_dir, "--rounds", str(rounds), "--warmup", str(warmup)]
        done = subprocess.run(argv, capture_output=True, text=True)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "netns", "del", ns])
        shutil.rmtree(etc, ignore_errors=True)
    if done.returncode != 0:
        sys.exit(f"the run inside the namespace failed (rc {done.returncode}):\n{done.stderr}")
    return {mode: [harness.Sample(**row) for row in rows] for mode, rows in json.loads(done.stdout).items()}


def netns_python(ns: str) -> List[str]:
    return ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__)]


def write_volcano_dir(scratch: str, lines: List[str]) -> str:
    volcano_dir = os.path.join(scratch, "volcano")
    os.makedirs(volcano_dir)
    with open(os.path.join(volcano_dir, "worker.host"), "w") as handle:
        handle.write("".join(line.split()[1] + "\n" for line in lines))
    return volcano_dir


def write_netns_etc(etc: str, lines: List[str], served: bool) -> None:
    """The namespace's /etc/hosts (and, when a stub server answers, its resolv.conf)."""
    os.makedirs(etc)
    hosts = ["127.0.0.1 localhost"] + ([] if served else lines)
    with open(os.path.join(etc, "hosts"), "w") as handle:
        handle.write("".join(line + "\n" for line in hosts))
    if served:
        with open(os.path.join(etc, "resolv.conf"), "w") as handle:
            handle.write("nameserver 127.0.0.1\noptions timeout:2 attempts:2\n")


def start_server(ns: str, lines: List[str], delay_ms: float, scratch: str) -> subprocess.Popen:
    hosts_file = os.path.join(scratch, "served-hosts")
    with open(hosts_file, "w") as handle:
        handle.write("".join(line + "\n" for line in lines))
    argv = [*netns_python(ns), "--serve", hosts_file, "--resolver-delay-ms", str(delay_ms)]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    if server.stdout.readline().strip() != "ready":
        server.kill()
        sys.exit("the stub DNS server did not start")
    return server


def seconds(result: dict) -> float:
    return result["seconds"]


def report(runs: Dict[str, List[harness.Sample]], count: int, delay_ms: Optional[float]) -> Dict[str, object]:
    source = "a hosts file" if delay_ms is None else f"a stub DNS server answering after {delay_ms:g} ms"
    rows = {mode: harness.summarize(runs[mode], seconds).scaled(1e3) for mode in MODES}
    harness.print_table(f"dns check, {count} names from {source}, in a netns, wall time", list(rows.items()), "ms")
    resolved = {mode: all(s.result["resolved"] == count for s in runs[mode]) for mode in MODES}
    print("\n  all names resolved in every run: " + ", ".join(f"{mode} {'yes' if ok else 'NO'}"
                                                         for mode, ok in resolved.items()))
    speedup = harness.compare(runs["sequential"], runs["check"], harness.ratio, seconds)
    print(f"  sequential / check: {harness.comparison_text(speedup)}")
    return {"ms": {mode: row.as_dict() for mode, row in rows.items()}, "all_resolved": resolved,
            "sequential_over_check": speedup.as_dict()}


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    if args.serve:
        serve(args.serve, (args.resolver_delay_ms or 0) / 1000)
        return 0
    if args.inside:
        inside(args.inside, args.rounds, args.warmup)
        return 0
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("preflight_dns: needs root and `ip` (iproute2) for a network namespace; nothing measured")
        return 0
    harness.print_header(f"dns preflight check, {args.names} names", args.rounds, args.warmup)
    scratch = tempfile.mkdtemp(prefix="ma-dns-bench-")
    try:
        runs = run_in_netns(args.names, args.rounds, args.warmup, args.resolver_delay_ms, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results = report(runs, args.names, args.resolver_delay_ms)
    if args.json:
        payload = {
            "names": args.names, "rounds": args.rounds, "warmup": args.warmup,
            "resolver_delay_ms": args.resolver_delay_ms, "cpus": os.cpu_count(), "python": platform.python_version(),
            **results, "runs": {mode: [vars(s) for s in rows] for mode, rows in runs.items()},
        }
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
