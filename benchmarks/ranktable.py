"""Rank table conversion: a 4096-server x 16-device template two to template one, wall time and peak memory.

The script writes a template-two document (`group_list`, as the platform writes
`jobstart_hccl.json`) with N instances x D devices (default 4096 x 16): one group,
pod names `modelarts-job-<uuid>-worker-<i>` listed in a shuffled order (fixed
seed), distinct IPv4 `server_id`s and `device_ip`s, every value a string, and
group_count/instance_count/device_count that agree. Then it times, each in a
fresh interpreter (this script with --child) so that peak memory is that
process's own, round-robin (benchmarks/_harness.py), --rounds times after --warmup untimed rounds:

  ma_runtime  ranktable.wait.read_table (bounded read), ranktable.convert.read_any (parse,
              validate, convert), ranktable.convert.template_one_text(), .write_atomically()
              -- the path `ma-runtime run` takes (ranktable.wait_and_convert)
  json floor  read the file text, json.loads, a template-one document built by
              a plain comprehension (no validation, no pod-name order), and
              json.dumps (the C encoder; json.dump would take the Python one) to a temporary file
              renamed into place: the
              same I/O with nothing but the JSON round trip
  baseline    import ma_runtime.stages.ranktable and read the file text, nothing else

Wall time is time.perf_counter around the section inside the child. Memory:
the tracemalloc peak of the section (one extra run per path, since tracemalloc
slows Python down) and the child's peak RSS minus the baseline child's
(medians). The peak RSS is VmHWM from /proc/self/status: on Linux, ru_maxrss
survives fork and exec, so a child's ru_maxrss is at least this script's own
RSS when it started the child (ru_maxrss only where there is no /proc). The
output of ma_runtime is checked once (ranks 0..N*D-1, servers in pod-index
order). Goal (issue 29, the rank-table goal stated precisely): ma_runtime at most 1.2x the bare
JSON round trip (the json floor), wall time, ratio of the medians, measured in the same run; the
verdict is taken on that ratio, the per-round ratios beside it.

    .venv/bin/python benchmarks/ranktable.py [--instances 4096] [--devices 16] [--rounds 5] [--warmup 1] [--json FILE]
"""

import argparse
import ipaddress
import itertools
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402  (beside this script, not a package)

GOAL = harness.Goal(
    "ranktable", "rank table 4096 x 16: read, validate, convert and write template one <= 1.2x a bare JSON load + "
    "dump of the same file", "issue 29 (the design's budgets set none)", 1.2, "x")
MB = 1e6
PATHS = ("ma_runtime", "json floor")
CHILD_MODES = {"ma_runtime": "ma_runtime", "json floor": "json", "baseline": "baseline"}
SERVER_BASE = int(ipaddress.IPv4Address("172.16.0.1"))
DEVICE_BASE = int(ipaddress.IPv4Address("10.0.0.1"))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=4096, help="servers (pods) in the table (default 4096)")
    parser.add_argument("--devices", type=int, default=16, help="devices per server (default 16)")
    harness.add_round_arguments(parser, rounds=5, warmup=1, aliases=("--runs",))
    parser.add_argument("--seed", type=int, default=20240607, help="seed of the pod order and job uuid")
    parser.add_argument("--json", metavar="FILE", help="also write the results (and raw samples) as JSON to FILE")
    # Internal: one measured run in a fresh interpreter.
    parser.add_argument("--child", choices=sorted(CHILD_MODES.values()), help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- the input


def pod_name(job: str, index: int) -> str:
    return f"modelarts-job-{job}-worker-{index}"


def template_two(instances: int, devices: int, seed: int) -> Dict[str, Any]:
    rng = random.Random(seed)
    job = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    order = list(range(instances))
    rng.shuffle(order)
    instance_list = [
        {
            "devices": [
                {"device_id": str(d), "device_ip": str(ipaddress.IPv4Address(DEVICE_BASE + i * devices + d))}
                for d in range(devices)
            ],
            "pod_name": pod_name(job, i),
            "server_id": str(ipaddress.IPv4Address(SERVER_BASE + i)),
        }
        for i in order
    ]
    group = {
        "device_count": str(instances * devices),
        "group_name": f"job-{job[:8]}",
        "instance_count": str(instances),
        "instance_list": instance_list,
    }
    return {"group_count": "1", "group_list": [group], "status": "completed"}


def check_output(path: Path, instances: int, devices: int) -> None:
    """ma_runtime's template one: one server per pod in pod-index order, ranks 0..N*D-1 in order."""
    document = json.loads(path.read_text(encoding="utf-8"))
    servers = document["server_list"]
    problems = []
    if document["server_count"] != str(instances) or len(servers) != instances:
        problems.append(f"server_count {document['server_count']}, {len(servers)} servers")
    ranks = [device["rank_id"] for server in servers for device in server["device"]]
    if ranks != [str(rank) for rank in range(instances * devices)]:
        problems.append("ranks are not 0..N-1 in order")
    expected = [str(ipaddress.IPv4Address(SERVER_BASE + i)) for i in range(instances)]
    if [server["server_id"] for server in servers] != expected:
        problems.append("servers are not in pod-index order")
    if problems:
        sys.exit(f"ma_runtime's output {path} is wrong: {'; '.join(problems)}")


# --------------------------------------------------------------------------- the child (one measured run)


def floor_template_one(document: Dict[str, Any]) -> Dict[str, Any]:
    """Template one straight from the parsed JSON: what a script without validation would write."""
    ranks = itertools.count()
    servers = [
        {
            "device": [
                {"device_id": device["device_id"], "device_ip": device["device_ip"], "rank_id": str(next(ranks))}
                for device in instance["devices"]
            ],
            "server_id": instance["server_id"],
        }
        for group in document["group_list"]
        for instance in group["instance_list"]
    ]
    return {"server_count": str(len(servers)), "server_list": servers, "status": document["status"], "version": "1.0"}


def write_plain(path: Path, document: Dict[str, Any]) -> None:
    """The same file writing as table_convert.write_atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        # json.dumps, not json.dump: dump always takes the pure-Python encoder (3x slower here), which made this
        # floor 2x too high until issue 29 (the ratio read 1.5x where it was 3x).
        handle.write(json.dumps(document) + "\n")
    os.replace(tmp, path)


def peak_rss_kb() -> int:
    """This process's own peak RSS: VmHWM of its address space (ru_maxrss counts the parent's from before exec)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child(mode: str, source: str, out: str, trace: bool) -> int:
    import gc
    import tracemalloc

    from ma_runtime.stages.ranktable import convert as table_convert
    from ma_runtime.stages.ranktable import wait as table_wait

    source_path, out_path = Path(source), Path(out)
    gc.collect()
    if trace:
        tracemalloc.start()
    started = time.perf_counter()
    # ma_runtime reads with its own bounded reader, as ranktable.wait_and_convert reads the platform's file.
    text = table_wait.read_table(source_path) if mode == "ma_runtime" else source_path.read_text(encoding="utf-8")
    if mode == "ma_runtime":
        table_convert.write_atomically(out_path, table_convert.template_one_text(table_convert.read_any(text, source)))
    elif mode == "json":
        write_plain(out_path, floor_template_one(json.loads(text)))
    elapsed = time.perf_counter() - started
    traced_peak = tracemalloc.get_traced_memory()[1] if trace else None
    if trace:
        tracemalloc.stop()
    result = {
        "ms": elapsed * 1e3,
        "peak_rss_kb": peak_rss_kb(),
        "ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "traced_peak_bytes": traced_peak,
        "input_chars": len(text),
    }
    print(json.dumps(result))
    return 0


def run_child(mode: str, source: Path, out: Path, trace: bool = False) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--source", str(source), "--out", str(out)]
    if trace:
        cmd.append("--trace")
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"child {mode!r} exited {done.returncode}:\n{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the parent


def output_path(scratch: Path, name: str) -> Path:
    return scratch / CHILD_MODES[name] / "jobstart_hccl.json"


def measure(source: Path, scratch: Path, rounds: int, warmup: int) -> Dict[str, Any]:
    """Samples per path (and the baseline), round-robin: each a child's ms and peak RSS; then one traced
    peak and the output size per path."""
    names = (*PATHS, "baseline")
    outs = {name: output_path(scratch, name) for name in names}

    def task(name: str):
        return lambda: run_child(CHILD_MODES[name], source, outs[name])

    samples = harness.round_robin({name: task(name) for name in names}, rounds, warmup)
    extras = {name: {"traced_peak_bytes": run_child(CHILD_MODES[name], source, outs[name], trace=True)[
        "traced_peak_bytes"], "output_bytes": outs[name].stat().st_size} for name in PATHS}
    return {"samples": samples, "extras": extras}


def field(name: str):
    return lambda result: result[name]


def summarize(measured: Dict[str, Any]) -> Dict[str, Any]:
    samples, extras = measured["samples"], measured["extras"]
    baseline_kb = harness.summarize(samples["baseline"], field("peak_rss_kb")).median
    stats: Dict[str, Any] = {}
    for name in PATHS:
        stats[name] = {
            "ms": harness.summarize(samples[name], field("ms")),
            "traced_peak_mb": extras[name]["traced_peak_bytes"] / MB,
            "rss_over_baseline_mb": (harness.summarize(samples[name], field("peak_rss_kb")).median - baseline_kb)
            * 1024 / MB,
            "output_mb": extras[name]["output_bytes"] / MB,
        }
    stats["baseline"] = {"peak_rss_mb": baseline_kb * 1024 / MB, "ms": harness.summarize(samples["baseline"],
                                                                                         field("ms"))}
    stats["ratio"] = harness.compare(samples["ma_runtime"], samples["json floor"], harness.ratio, field("ms"))
    return stats


def ratio(ours: float, floor: float) -> str:
    return f"{ours / floor:.2f}x" if floor > 0 else "-"


def print_table(stats: Dict[str, Any]) -> None:
    harness.print_table("wall time of the section, ms", [(name, stats[name]["ms"]) for name in PATHS], "ms")
    print(f"\n  {'path':<12} {'tracemalloc MB':>15} {'RSS +MB':>9}")
    for name in PATHS:
        row = stats[name]
        print(f"  {name:<12} {row['traced_peak_mb']:>15.1f} {row['rss_over_baseline_mb']:>9.1f}")
    ours, floor = stats["ma_runtime"], stats["json floor"]
    print(f"  {'ratio':<12} {ratio(ours['traced_peak_mb'], floor['traced_peak_mb']):>15} "
          f"{ratio(ours['rss_over_baseline_mb'], floor['rss_over_baseline_mb']):>9}")
    print(f"  baseline child (import ma_runtime.stages.ranktable, read the file): peak RSS "
          f"{stats['baseline']['peak_rss_mb']:.1f} MB")
    print(f"\n  ma_runtime / json floor, wall time: {harness.comparison_text(stats['ratio'])}")


def verdict(stats: Dict[str, Any], instances: int, devices: int) -> Dict[str, Any]:
    ours, comparison = stats["ma_runtime"], stats["ratio"]
    measured = f"{instances} x {devices}, ma_runtime / json floor, wall time, ratio of the medians"
    memory = (f"peak Python memory {ours['traced_peak_mb']:.1f} MB (tracemalloc), "
              f"RSS +{ours['rss_over_baseline_mb']:.1f} MB; ma_runtime median {ours['ms'].median:.0f} ms")
    return harness.judge(GOAL, comparison.of_medians, measured, comparison.per_round, memory)


def environment_info(args: argparse.Namespace) -> Dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "instances": args.instances,
        "devices": args.devices,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "seed": args.seed,
    }


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args.child, args.source, args.out, args.trace)
    with tempfile.TemporaryDirectory(prefix="ma-bench-ranktable-") as scratch_dir:
        scratch = Path(scratch_dir)
        source = scratch / "jobstart_hccl.json"
        source.write_text(json.dumps(template_two(args.instances, args.devices, args.seed), indent=4) + "\n",
                          encoding="utf-8")
        input_bytes = source.stat().st_size
        print(f"rank table {args.instances} x {args.devices} ({args.instances * args.devices} devices), "
              f"template two {input_bytes / MB:.1f} MB at {source}")
        harness.print_header("read + parse/validate/convert + template one + write, fresh interpreter per run",
                             args.rounds, args.warmup)
        harness.print_goal(GOAL)
        measured = measure(source, scratch, args.rounds, args.warmup)
        check_output(output_path(scratch, "ma_runtime"), args.instances, args.devices)
    stats = summarize(measured)
    print(f"template one {stats['ma_runtime']['output_mb']:.1f} MB (json floor {stats['json floor']['output_mb']:.1f} "
          "MB)")
    print_table(stats)
    result = verdict(stats, args.instances, args.devices)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"environment": environment_info(args), "input_bytes": input_bytes, "results": stats,
                       "verdict": result, "run": harness.run_record([result]), "samples": measured["samples"],
                       "extras": measured["extras"]},
                      handle, indent=2, default=harness.to_json)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
