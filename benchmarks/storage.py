"""Download throughput of ma_runtime's transfer engine, side by side with boto3, the OBS SDK and the endpoint.

Everything runs in one process against local S3 servers started here, on this machine: client and
server share its CPUs (say 2 cores: a faster client leaves less CPU to the server, and the other
way round). Every figure is measured round-robin with the anchors (benchmarks/_harness.py):
min/median/max over the rounds, the 1-minute load average beside each row, and the ratios per
round as well as of the medians.

Scenario 1, many small objects (default 2000 x 4 KB under one prefix), on moto
(`moto_server`, a Python/werkzeug server) AND on s3rver 3.7.1 (node):
  (a) ma_runtime `transfer.download()` of the prefix (listing included; the
      listing's share is shown, measured inside the same run),
  (b) boto3 `get_object` in a ThreadPool(16), each body written to a file,
  (c) the endpoint's ceiling: raw concurrent GETs with `http.client` over
      presigned URLs (boto3 `generate_presigned_url`) in 16 threads, one
      keep-alive connection per thread, bodies read and discarded,
  (c+) the ceiling for the whole job (a) does: the prefix listed page by page
      over presigned URLs with `http.client`, then the GETs of (c),
  (c') the GETs of (c) with a new connection per GET (what a client without
      connection reuse can reach),
  (c-w) the GETs of (c), each body written to its file (open, write, close): the
      raw loop that writes the files, THE ANCHOR of the goal (issue 29, item 3),
  (c-w+) the prefix listed as in (c+), then (c-w): the same job as (a), by hand,
  and, unless --no-diagnostics:
  (d1) ma_runtime's ObsStore.read_range in a ThreadPool(16), without the engine.
  Objects/s. GOAL (the design's budget as issue 29 item 3 states it): ma_runtime
  >= 0.9x the raw loop that writes the files (c-w), ratio of the medians; the
  same-job ratio (a) / (c-w+) and the share of (c) are printed beside it.
  (b), (c), (c'), (c-w), (d1) get the key list for free; (a), (c+) and (c-w+) list the prefix.

Scenario 2, one large object (default 512 MiB of random bytes, written once), on
s3rver (moto reads the whole object for every ranged GET, so it is no place for
part-parallel downloads). MB/s (decimal); each file's sha256 is checked (untimed).
  (a) ma_runtime download() with its defaults (16 workers x 32 MiB parts, ranged
      from 64 MiB up): THE HEADLINE. s3rver answers a plain content MD5 as the
      ETag, so this row MD5-checks the file (hashing the parts in order as they
      land), as ma_runtime does for any object whose ETag is an MD5;
      and with other settings (--ma-large-variants, default 8 x 16 MiB: boto3's),
  (a-mp) the defaults with the ETag rewritten by this benchmark to the one S3/OBS
      give the object's multipart upload (`<md5 of the 16 MiB parts' MD5s>-<parts>`,
      computed from the bytes seeded), which s3rver does not: ma_runtime then checks
      the download part by part as the bytes arrive (its second HEADLINE line: the
      object as OBS presents it; boto3 and downloadFile check nothing),
  (b) boto3 `download_file` with TransferConfig(multipart_chunksize, max_concurrency)
      at 8 x 16 MiB (the goal's reference), at the threads and part size each
      ma_runtime row really uses (matched concurrency: 16 x 32 MiB for the
      defaults on 512 MiB; a smaller object gets smaller parts), and with
      TransferConfig's defaults,
  (c) the SDK's `ObsClient.downloadFile(taskNum=8, partSize=32 MiB)`,
  (r) the endpoint's raw ranged-GET ceiling, for every ma_runtime setting with the
      same N and part size: the object as ranged GETs over one presigned URL with
      `http.client` in N threads (keep-alive), bodies discarded; and again written
      with pwrite into a preallocated file (posix_fallocate, as ma_runtime does),
  (p) the physical limits, in the same rounds: the disk's write rate (`dd` of the
      same size with conv=fdatasync into the scratch folder) and MD5 on one core
      (hashlib over the same number of bytes in memory).
  GOAL (the design's budget, with verification on as issue 29 item 2 states it): the
  download ma_runtime checks >= 1.2x boto3 (8 x 16 MiB), ratio of the medians, judged
  on (a-mp), the object as OBS presents a multipart upload (checked part by part); the
  (a) row (a single PUT's plain MD5, followed in order) is printed beside it. The verdict lines also
  give the matched-concurrency ratios, each ma_runtime row as a share of its raw
  ceiling, and the limit the headline is held against: the lower of the raw pwrite
  ceiling at the defaults' shape and, for an MD5-checked download, MD5's rate on one core.

Rounds: --rounds timed rounds (default 5) after --warmup untimed ones (default 1),
round-robin over the methods (each round starting one method later); tables give
min/median/max, the load, and the CPU used meanwhile by the client (this process,
all threads) and by the server process (/proc/PID/stat), medians in % of one
core. Clients (boto3 client, ObsClient, ObsStore, presigned URLs) are built before
the clock starts.

Seeding uses boto3 (parallel puts). s3rver comes from `npm install s3rver@3.7.1`
into the scratch folder; without npm (or network) the s3rver parts are skipped
with a message, and the script still exits 0. Scratch data lives under /tmp
(--workdir) and is deleted at the end, servers are stopped by PID.

    .venv/bin/python benchmarks/storage.py [--small-count 2000] [--small-kb 4] [--large-mb 512]
        [--rounds 5] [--warmup 1] [--endpoints moto,s3rver] [--scenarios small,large] [--json FILE]
    quick: .venv/bin/python benchmarks/storage.py --small-count 200 --large-mb 64 --rounds 2 --warmup 0
"""

import argparse
import dataclasses
import hashlib
import http.client
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402  (beside this script, not a package)

MiB = 1 << 20
MB = 10**6
BUCKET = "ma-bench"
SMALL_PREFIX = "small/"
LARGE_KEY = "large/blob.bin"
S3RVER_VERSION = "3.7.1"
GOAL_SMALL_SHARE = 0.90
GOAL_LARGE_RATIO = 1.2
SMALL_GOAL = harness.Goal("download, small files", "many small objects at >= 90 % of what the endpoint can serve: "
                          ">= 0.9x the raw loop that writes the files", "the design's budgets; the anchor as issue 29 "
                          "item 3 states it", GOAL_SMALL_SHARE, "x", at_most=False)
LARGE_GOAL = harness.Goal("download, large file", "large objects at >= 1.2x boto3's transfer manager on the same "
                          "endpoint, with verification on", "the design's budgets; verification as issue 29 item 2 "
                          "states it", GOAL_LARGE_RATIO, "x", at_most=False)
SEED_PART = 16 * MiB  # the large object's multipart upload part size
BOTO3_REFERENCE = (8, 16 * MiB)  # threads x part of the boto3 row the large-object goal is set against
REGION = "us-east-1"
READ_CHUNK = MiB  # what the raw ceiling reads a body in


# --------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small-count", type=int, default=2000, help="small objects (default 2000)")
    parser.add_argument("--small-kb", type=float, default=4, help="size of each small object, KiB (default 4)")
    parser.add_argument("--large-mb", type=int, default=512, help="size of the large object, MiB (default 512)")
    harness.add_round_arguments(parser, rounds=5, warmup=1, aliases=("--repeat",))
    parser.add_argument("--threads", type=int, default=16,
                        help="threads of the boto3 / http.client / read_range pools in scenario 1 (default 16)")
    parser.add_argument("--endpoints", default="moto,s3rver", help="servers for scenario 1 (default moto,s3rver)")
    parser.add_argument("--large-endpoints", default="s3rver",
                        help="servers for scenario 2 (default s3rver; moto's ranged GETs cost O(object))")
    parser.add_argument("--scenarios", default="small,large", help="small, large or both (default both)")
    parser.add_argument("--ma-large-variants", default="default,8x16",
                        help="ma_runtime settings tried in scenario 2, comma-separated: 'default' or "
                             "WORKERSxPART_MB (default: default,8x16)")
    parser.add_argument("--large-seed", choices=("multipart", "single"), default="multipart",
                        help="upload the large object as a multipart upload (ETag not an MD5: ma_runtime checks "
                             "the size only) or one PUT (MD5 ETag: ma_runtime also hashes the file) (default "
                             "multipart)")
    parser.add_argument("--no-diagnostics", action="store_true", help="skip row d1 of scenario 1")
    parser.add_argument("--s3rver", metavar="PATH", help="an s3rver executable to use instead of npm-installing one")
    parser.add_argument("--workdir", metavar="DIR", help="scratch parent folder (default: a new folder in /tmp)")
    parser.add_argument("--pin", action="store_true",
                        help="client on CPU 0, the servers on the other CPUs (taskset), so neither steals the "
                             "other's core; needs 2 CPUs or more")
    parser.add_argument("--json", metavar="FILE", help="also write the results (and every sample) as JSON to FILE")
    args = parser.parse_args(argv)
    args.endpoints = _names(args.endpoints, ("moto", "s3rver"), "--endpoints")
    args.large_endpoints = _names(args.large_endpoints, ("moto", "s3rver"), "--large-endpoints")
    args.scenarios = _names(args.scenarios, ("small", "large"), "--scenarios")
    args.ma_large_variants = [_variant(text) for text in args.ma_large_variants.split(",") if text.strip()]
    if args.rounds < 1 or args.warmup < 0 or args.threads < 1 or args.small_count < 1 or args.large_mb < 1:
        parser.error("counts must be positive")
    return args


def _names(text: str, allowed: Tuple[str, ...], flag: str) -> List[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise SystemExit(f"{flag}: unknown {', '.join(unknown)} (choose from {', '.join(allowed)})")
    return names


def _variant(text: str) -> Optional[Tuple[int, int]]:
    text = text.strip().lower()
    if text == "default":
        return None
    try:
        workers, part = text.split("x")
        return int(workers), int(part)
    except ValueError:
        raise SystemExit(f"--ma-large-variants: {text!r} is neither 'default' nor WORKERSxPART_MB") from None


# --------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class Server:
    name: str  # "moto" or "s3rver"
    label: str  # with its version, for the tables
    access_key: str
    secret_key: str
    proc: subprocess.Popen
    port: int

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_seconds(self) -> float:
        return harness.process_cpu_seconds(self.proc.pid) or 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def client_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def wait_ready(proc: subprocess.Popen, port: int, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it answered")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/")
            conn.getresponse().read()
            conn.close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not answer on port {port} within {timeout:.0f} s")


def start_moto(scratch: Path) -> Tuple[Optional[Server], str]:
    try:
        from importlib.metadata import version

        moto_version = version("moto")
        import moto.server  # noqa: F401  (is the server part installed?)
    except Exception as exc:  # noqa: BLE001 - any import problem means: no moto here
        return None, f"moto[server] is not importable ({type(exc).__name__}: {exc}); install moto[server]"
    port = free_port()
    with open(scratch / "moto.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    server = Server("moto", f"moto {moto_version} (moto_server, werkzeug)", "testak", "testsk", proc, port)
    try:
        wait_ready(proc, port, "moto_server")
    except RuntimeError as exc:
        server.stop()
        return None, str(exc)
    return server, ""


def install_s3rver(scratch: Path) -> Tuple[Optional[str], str]:
    npm = shutil.which("npm")
    if not npm or not shutil.which("node"):
        return None, "npm/node not found: cannot install s3rver"
    prefix = scratch / "s3rver-npm"
    prefix.mkdir()
    command = [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--no-save", "--loglevel=error",
               f"s3rver@{S3RVER_VERSION}"]
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"`npm install s3rver@{S3RVER_VERSION}` failed: {exc}"
    binary = prefix / "node_modules" / ".bin" / "s3rver"
    if done.returncode != 0 or not binary.exists():
        tail = done.stdout.decode(errors="replace").strip().splitlines()[-3:]
        return None, f"`npm install s3rver@{S3RVER_VERSION}` failed (rc {done.returncode}): {' | '.join(tail)}"
    return str(binary), ""


def start_s3rver(scratch: Path, binary: Optional[str]) -> Tuple[Optional[Server], str]:
    if binary is None:
        binary, problem = install_s3rver(scratch)
        if binary is None:
            return None, problem
    data = scratch / "s3rver-data"
    data.mkdir(exist_ok=True)
    port = free_port()
    with open(scratch / "s3rver.log", "wb") as log:
        proc = subprocess.Popen([binary, "-d", str(data), "-a", "127.0.0.1", "-p", str(port), "--silent"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    node = subprocess.run(["node", "--version"], stdout=subprocess.PIPE, text=True).stdout.strip()
    server = Server("s3rver", f"s3rver {S3RVER_VERSION} (node {node})", "S3RVER", "S3RVER", proc, port)
    try:
        wait_ready(proc, port, "s3rver")
    except RuntimeError as exc:
        server.stop()
        return None, str(exc)
    return server, ""


# --------------------------------------------------------------------------- clients


def boto3_client(server: Server, pool: int):
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=server.endpoint, region_name=REGION,
        aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key,
        config=Config(signature_version="s3v4", s3={"addressing_style": "path"},
                      max_pool_connections=max(pool, 10), retries={"max_attempts": 3, "mode": "standard"}),
    )


def obs_client(server: Server):
    from obs import ObsClient

    return ObsClient(access_key_id=server.access_key, secret_access_key=server.secret_key, server=server.endpoint,
                     signature="v4", region=REGION, path_style=True, is_signature_negotiation=False,
)


class QuietLog:
    """The logger the engine gets: drops info lines, keeps warnings and errors (retries show up there)."""

    def __init__(self) -> None:
        self.warnings: List[str] = []
        self._lock = threading.Lock()

    def info(self, *_args, **_kwargs) -> None:
        pass

    debug = info

    def warning(self, event, **fields) -> None:
        with self._lock:
            self.warnings.append(f"{event} {fields}")

    error = warning


class ListTimer:
    """Wraps a store; adds up the time spent in `list` (the engine drains it in one go)."""

    def __init__(self, store) -> None:
        self._store = store
        self.list_seconds = 0.0

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def list(self, bucket: str, prefix: str):
        started = time.perf_counter()
        try:
            yield from self._store.list(bucket, prefix)
        finally:
            self.list_seconds += time.perf_counter() - started


class MultipartEtagStore:
    """Wraps a store; `head` gives the ETag S3 and OBS give the multipart upload the object was seeded with
    (`<md5 of the part MD5s>-<parts>`, computed from the bytes uploaded), which s3rver does not (it answers a
    plain content MD5). The engine then checks the download part by part against it, as on OBS."""

    def __init__(self, store, composite: str) -> None:
        self._store = store
        self._composite = composite
        self._served: Dict[str, str] = {}

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def head(self, bucket: str, key: str):
        info = self._store.head(bucket, key)
        self._served[key] = info.etag
        return dataclasses.replace(info, etag=self._composite)

    def read_range(self, bucket: str, key: str, *args, **kwargs):
        # The version check (If-Match) must see the server's own ETag again.
        if kwargs.get("etag") == self._composite:
            kwargs["etag"] = self._served.get(key)
        return self._store.read_range(bucket, key, *args, **kwargs)


class MaRuntime:
    """ma_runtime's spec, store and options for one server, built the way the CLI builds them."""

    def __init__(self, server: Server, scratch: Path, workers: Optional[int] = None, part_mb: Optional[int] = None):
        from ma_runtime import spec as spec_module
        from ma_runtime.storage import stores, transfer, url

        home = scratch / "ma-home"
        home.mkdir(exist_ok=True)
        self.environ = {
            "MA_HOME": str(home), "MA_S3_ENDPOINT": server.endpoint,
            "OBS_ACCESS_KEY_ID": server.access_key, "OBS_SECRET_ACCESS_KEY": server.secret_key,
            "MA_RUNTIME_STORAGE_SIGNATURE": "v4", "MA_RUNTIME_STORAGE_REGION": REGION,
        }
        if workers is not None:
            self.environ["MA_RUNTIME_STORAGE_WORKERS"] = str(workers)
        if part_mb is not None:
            self.environ["MA_RUNTIME_STORAGE_PART_MB"] = str(part_mb)
        self.spec = spec_module.load({}, self.environ)
        self.transfer = transfer
        self.url = url
        location = url.parse(f"s3://{BUCKET}/{SMALL_PREFIX}")
        self.store = stores.open_store(location, self.spec, self.environ)
        self.options = transfer.TransferOptions.from_spec(self.spec, scratch / "unused-state")

    def describe(self) -> str:
        o = self.options
        return (f"{o.workers} workers, {o.part_size // MiB} MiB parts, ranged from {o.large_threshold // MiB} MiB up, "
                f"progress lines every {o.progress_seconds:g} s")

    def download(self, url_text: str, dest: Path, state_dir: Path) -> Dict[str, Any]:
        log = QuietLog()
        store = ListTimer(self.store)
        options = dataclasses.replace(self.options, state_dir=state_dir)
        summary = self.transfer.download(store, self.url.parse(url_text), dest, options, log)
        return {"list_seconds": store.list_seconds, "files": summary.files,
                "bytes": summary.bytes, "refused": len(summary.refused), "engine_warnings": log.warnings[:5],
                "engine_warning_count": len(log.warnings)}


# --------------------------------------------------------------------------- measuring


@dataclasses.dataclass
class Method:
    key: str
    label: str
    run: Callable[[Path], Optional[Dict[str, Any]]]  # does the work into a fresh folder; returns extra facts
    verify: Callable[[Path], None]  # raises AssertionError on a wrong result (untimed)
    note: str = ""


def measure(method: Method, server: Server, scratch: Path) -> Dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"{method.key}-", dir=scratch))
    try:
        os.sync()  # the previous run's dirty pages are not this run's cost
        cpu_before, server_before = client_cpu_seconds(), server.cpu_seconds()
        started = time.perf_counter()
        try:
            extra = method.run(out) or {}
        except Exception as exc:  # noqa: BLE001 - a failing method is reported, the others still run
            return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        seconds = time.perf_counter() - started
        cpu = client_cpu_seconds() - cpu_before
        server_cpu = server.cpu_seconds() - server_before
        try:
            method.verify(out)
        except AssertionError as exc:
            return {"error": f"wrong result: {exc}", "seconds": seconds}
        return {"seconds": seconds, "client_cpu_pct": 100 * cpu / seconds,
                "server_cpu_pct": 100 * server_cpu / seconds, **extra}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run_rounds(methods: List[Method], server: Server, scratch: Path, rounds: int, warmup: int,
               what: str) -> Dict[str, List[harness.Sample]]:
    """Round-robin over the methods (benchmarks/_harness.py), each sample's progress on stderr."""

    def task(method: Method) -> Callable[[], Dict[str, Any]]:
        return lambda: measure(method, server, scratch)

    def progress(key: str, label: str, sample: Dict[str, Any]) -> None:
        status = f"{sample['seconds']:.2f} s" if "seconds" in sample else ""
        if "error" in sample:
            status += f" FAILED: {sample['error']}"
        print(f"  [{what} {label}] {key:<14} {status}", file=sys.stderr, flush=True)

    return harness.round_robin({m.key: task(m) for m in methods}, rounds, warmup, progress)


def rate_of(amount: float) -> Callable[[Dict[str, Any]], Optional[float]]:
    """amount per second of a good sample; None for a failed one."""

    def rate(result: Dict[str, Any]) -> Optional[float]:
        return None if "error" in result else amount / result["seconds"]

    return rate


def summarize(samples: List[harness.Sample], amount: float) -> Dict[str, Any]:
    """Rate min/median/max (amount per second) over the good samples; CPU medians; failures."""
    results = [s.result for s in samples]
    good = [r for r in results if "error" not in r]
    summary: Dict[str, Any] = {"ok": len(good) == len(results), "rate": harness.summarize(samples, rate_of(amount)),
                               "errors": [r["error"] for r in results if "error" in r]}
    if not good:
        return summary
    summary.update(seconds=statistics.median(r["seconds"] for r in good),
                   client_cpu_pct=statistics.median(r["client_cpu_pct"] for r in good),
                   server_cpu_pct=statistics.median(r["server_cpu_pct"] for r in good))
    if all("list_seconds" in r for r in good):
        summary["list_seconds"] = statistics.median(r["list_seconds"] for r in good)
        summary["rate_without_listing"] = harness.summarize(
            samples, lambda r: None if "error" in r else amount / max(r["seconds"] - r["list_seconds"], 1e-9))
    warnings = sum(r.get("engine_warning_count", 0) for r in good)
    if warnings:
        summary["engine_warnings"] = warnings
    return summary


def compare(samples: Dict[str, List[harness.Sample]], ours: str, anchor: str, amount: float) -> harness.Comparison:
    """ours / anchor in rate, per round and of the medians."""
    return harness.compare(samples[ours], samples[anchor], harness.ratio, rate_of(amount))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(8 * MiB)
            if not chunk:
                return digest.hexdigest()
            digest.update(chunk)


# --------------------------------------------------------------------------- scenario 1: small objects


def seed_small(server: Server, count: int, size: int, threads: int) -> Dict[str, str]:
    """Puts `count` random objects under SMALL_PREFIX; returns key -> sha256."""
    s3 = boto3_client(server, threads)
    s3.create_bucket(Bucket=BUCKET)
    keys = [f"{SMALL_PREFIX}obj-{i:06d}.bin" for i in range(count)]

    def put(key: str) -> Tuple[str, str]:
        body = os.urandom(size)
        s3.put_object(Bucket=BUCKET, Key=key, Body=body)
        return key, hashlib.sha256(body).hexdigest()

    with ThreadPoolExecutor(threads) as pool:
        return dict(pool.map(put, keys))


def small_methods(server: Server, scratch: Path, expected: Dict[str, str], size: int, threads: int,
                  diagnostics: bool) -> Tuple[List[Method], Dict[str, str]]:
    keys = sorted(expected)
    names = {key: key[len(SMALL_PREFIX):] for key in keys}

    def verify_files(out: Path) -> None:
        dest = out / "dest"
        present = sorted(p.name for p in dest.iterdir())  # a leftover partial file counts too
        assert len(present) == len(keys), f"{len(present)} files, expected {len(keys)}"
        for key in keys:
            assert sha256_of(dest / names[key]) == expected[key], f"{names[key]}: content differs"

    def verify_nothing(_dest: Path) -> None:
        pass

    ma = MaRuntime(server, scratch)

    def run_ma(out: Path, runtime: MaRuntime = ma) -> Dict[str, Any]:
        facts = runtime.download(f"s3://{BUCKET}/{SMALL_PREFIX}", out / "dest", out / "state")
        assert facts["files"] == len(keys) and not facts["refused"], facts
        return facts

    s3 = boto3_client(server, threads)

    def run_boto3(out: Path) -> None:
        dest = out / "dest"
        dest.mkdir()

        def get(key: str) -> None:
            body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
            with open(dest / names[key], "wb") as handle:
                handle.write(body)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(get, keys))

    paths = []
    for key in keys:
        parts = urlsplit(s3.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": key},
                                                   ExpiresIn=24 * 3600))
        paths.append(f"{parts.path}?{parts.query}")
    path_keys = dict(zip(paths, keys))

    list_query = {"Bucket": BUCKET, "Prefix": SMALL_PREFIX, "MaxKeys": 1000}

    def list_raw(conn: http.client.HTTPConnection) -> int:
        """Lists the prefix page by page, as (a) must; returns the key count."""
        count, marker = 0, ""
        while True:
            params = {**list_query, **({"Marker": marker} if marker else {})}
            parts = urlsplit(s3.generate_presigned_url("list_objects", Params=params, ExpiresIn=3600))
            conn.request("GET", f"{parts.path}?{parts.query}")
            resp = conn.getresponse()
            body = resp.read()
            assert resp.status == 200, f"listing: HTTP {resp.status}"
            keys = re.findall(rb"<Key>([^<]*)</Key>", body)
            count += len(keys)
            if b"<IsTruncated>true</IsTruncated>" not in body or not keys:
                return count
            marker = keys[-1].decode()

    def run_raw(keep_alive: bool, listing: bool = False, write: bool = False) -> Callable[[Path], Dict[str, Any]]:
        def run(out: Path) -> Dict[str, Any]:
            failures: List[str] = []
            dest = out / "dest"
            if write:
                dest.mkdir()
            if listing:
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
                try:
                    assert list_raw(conn) == len(keys), "the listing is short"
                finally:
                    conn.close()

            def worker(mine: List[str]) -> None:
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
                try:
                    for path in mine:
                        if not keep_alive:
                            conn.close()
                        conn.request("GET", path)
                        resp = conn.getresponse()
                        body = resp.read()
                        if resp.status != 200 or len(body) != size:
                            failures.append(f"HTTP {resp.status}, {len(body)} bytes")
                        elif write:
                            with open(dest / names[path_keys[path]], "wb") as handle:
                                handle.write(body)
                finally:
                    conn.close()

            workers = [threading.Thread(target=worker, args=(paths[i::threads],)) for i in range(threads)]
            for thread in workers:
                thread.start()
            for thread in workers:
                thread.join()
            assert not failures, f"{len(failures)} bad answers, first: {failures[0]}"
            return {}
        return run

    methods = [
        Method("ma", f"(a) ma_runtime download() [{ma.options.workers} workers, listing incl.]", run_ma, verify_files),
        Method("boto3", f"(b) boto3 get_object, ThreadPool({threads}), files", run_boto3, verify_files),
        Method("ceiling", f"(c) CEILING http.client presigned GET, {threads} thr, keep-alive", run_raw(True),
               verify_nothing),
        Method("ceiling-list", "(c+) CEILING incl. listing: list pages, then (c)", run_raw(True, listing=True),
               verify_nothing),
        Method("raw-new", f"(c') http.client presigned GET, {threads} thr, new conn/GET", run_raw(False),
               verify_nothing),
        Method("ceiling-write", "(c-w) ANCHOR: (c), each body written to its file", run_raw(True, write=True),
               verify_files),
        Method("ceiling-write-list", "(c-w+) list pages, then (c-w): the same job as (a)",
               run_raw(True, listing=True, write=True), verify_files),
    ]
    if diagnostics:
        def run_read_range(out: Path) -> None:
            dest = out / "dest"
            dest.mkdir()

            def get(key: str) -> None:
                fd = os.open(dest / names[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    ma.store.read_range(BUCKET, key, 0, size, fd, 0)
                finally:
                    os.close(fd)

            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(get, keys))

        methods.append(Method("d1-store", f"(d1) ObsStore.read_range only, ThreadPool({threads}), no engine",
                              run_read_range, verify_files))
    return methods, {"ma_runtime_settings": ma.describe()}


# --------------------------------------------------------------------------- scenario 2: one large object


def seed_large(server: Server, scratch: Path, size_mib: int, how: str) -> Tuple[str, str, str]:
    """Writes SIZE MiB of random bytes once, uploads them; returns (sha256, ETag, the composite ETag S3 and OBS
    give the same bytes uploaded in SEED_PART parts)."""
    from boto3.s3.transfer import TransferConfig

    source = scratch / "large-source.bin"
    digest = hashlib.sha256()
    part_digests = []
    with open(source, "wb") as handle:
        for index in range(size_mib):
            chunk = os.urandom(MiB)
            digest.update(chunk)
            if index % (SEED_PART // MiB) == 0:
                part_digests.append(hashlib.md5(usedforsecurity=False))
            part_digests[-1].update(chunk)
            handle.write(chunk)
    joined = b"".join(part.digest() for part in part_digests)
    composite = f"{hashlib.md5(joined, usedforsecurity=False).hexdigest()}-{len(part_digests)}"
    s3 = boto3_client(server, 16)
    try:
        s3.create_bucket(Bucket=BUCKET)
    except s3.exceptions.ClientError:
        pass  # already there (scenario 1 made it)
    except Exception as exc:  # noqa: BLE001 - BucketAlreadyOwnedByYou and friends
        if "Bucket" not in type(exc).__name__:
            raise
    if how == "multipart":
        s3.upload_file(str(source), BUCKET, LARGE_KEY,
                       Config=TransferConfig(multipart_threshold=SEED_PART, multipart_chunksize=SEED_PART,
                                             max_concurrency=8))
    else:
        with open(source, "rb") as handle:
            s3.put_object(Bucket=BUCKET, Key=LARGE_KEY, Body=handle)
    source.unlink()
    etag = s3.head_object(Bucket=BUCKET, Key=LARGE_KEY)["ETag"].strip('"')
    return digest.hexdigest(), etag, composite


def shape_text(threads: int, part: int) -> str:
    return f"{threads}x{part / MiB:g}"


def effective_part_size(runtime: "MaRuntime", size: int) -> int:
    """The part size ma_runtime really uses for this object (smaller than the setting for objects that
    would leave workers idle), so that the matched rows match what it does, not what it was told."""
    try:
        from ma_runtime.storage.transfer import parts

        return parts._part_size(runtime.options, size)
    except (ImportError, AttributeError):  # an engine without that rule
        return runtime.options.part_size


def ranged_ceiling(server: Server, presigned_path: str, size: int, threads: int, part: int,
                   dest: Optional[Path]) -> None:
    """The object as ranged GETs in `threads` keep-alive connections, parts handed out in order; bodies
    discarded (dest None) or written with pwrite into a preallocated file."""
    parts = iter(range(-(-size // part)))
    lock = threading.Lock()
    failures: List[str] = []
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if dest else None
    try:
        if fd is not None:
            os.posix_fallocate(fd, 0, size)

        def worker() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
            buffer = memoryview(bytearray(READ_CHUNK))
            try:
                while not failures:
                    with lock:
                        index = next(parts, None)
                    if index is None:
                        return
                    start, end = index * part, min(size, (index + 1) * part) - 1
                    conn.request("GET", presigned_path, headers={"Range": f"bytes={start}-{end}"})
                    resp = conn.getresponse()
                    if resp.status != 206:
                        failures.append(f"HTTP {resp.status} for bytes {start}-{end}")
                        return
                    offset = start
                    while True:
                        count = resp.readinto(buffer)
                        if not count:
                            break
                        if fd is not None:
                            os.pwrite(fd, buffer[:count], offset)
                        offset += count
                    if offset != end + 1:
                        failures.append(f"bytes {start}-{end}: got {offset - start}")
            except Exception as exc:  # noqa: BLE001 - reported as the row's failure
                failures.append(f"{type(exc).__name__}: {exc}")
            finally:
                conn.close()

        workers = [threading.Thread(target=worker) for _ in range(threads)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
    finally:
        if fd is not None:
            os.close(fd)
    assert not failures, f"{len(failures)} bad parts, first: {failures[0]}"


def physical_methods(scratch: Path, size: int) -> List[Method]:
    """The disk's write rate and MD5 on one core, over the same number of bytes."""
    block = os.urandom(64 * MiB)

    def run_dd(out: Path) -> None:
        subprocess.run(["dd", "if=/dev/zero", f"of={out / 'dd.bin'}", f"bs={MiB}", f"count={-(-size // MiB)}",
                        "conv=fdatasync", "status=none"], check=True)

    def run_md5(_out: Path) -> None:
        digest = hashlib.md5(usedforsecurity=False)
        view = memoryview(block)
        for start in range(0, size, len(block)):
            digest.update(view[: min(len(block), size - start)])

    def verify_nothing(_out: Path) -> None:
        pass

    return [Method("disk-dd", "(p) disk write: dd conv=fdatasync, same size", run_dd, verify_nothing),
            Method("md5-1core", "(p) MD5 on one core (hashlib, in memory), same size", run_md5, verify_nothing)]


def large_methods(server: Server, scratch: Path, expected_sha: str, size: int,
                  variants: List[Optional[Tuple[int, int]]], md5_etag: bool,
                  diagnostics: bool, composite: str = "") -> Tuple[List[Method], Dict[str, Any]]:
    from boto3.s3.transfer import TransferConfig

    def verify(out: Path) -> None:
        target = out / "blob.bin"
        assert target.is_file(), "no file"
        assert target.stat().st_size == size, f"{target.stat().st_size} bytes, expected {size}"
        assert sha256_of(target) == expected_sha, "sha256 differs from the source"

    def verify_nothing(_out: Path) -> None:
        pass

    methods: List[Method] = []
    settings: Dict[str, Any] = {"ma_runtime": {}, "shapes": {}}
    s3 = boto3_client(server, 16)
    parts = urlsplit(s3.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": LARGE_KEY},
                                               ExpiresIn=24 * 3600))
    presigned_path = f"{parts.path}?{parts.query}"
    shapes = []
    for variant in variants:
        workers, part_mb = variant if variant else (None, None)
        runtime = MaRuntime(server, scratch, workers=workers, part_mb=part_mb)
        key = "ma" if variant is None else f"ma-{workers}x{part_mb}"
        part = effective_part_size(runtime, size)
        shape = (runtime.options.workers, part)
        label = ("(a) ma_runtime download() DEFAULTS" if variant is None else "(a) ma_runtime download()")
        label += f" [{shape[0]} x {part / MiB:g} MiB]" + (", MD5 checked" if md5_etag else "")

        def run_ma(out: Path, runtime: MaRuntime = runtime) -> Dict[str, Any]:
            facts = runtime.download(f"s3://{BUCKET}/{LARGE_KEY}", out / "blob.bin", out / "state")
            assert facts["files"] == 1, facts
            return facts

        methods.append(Method(key, label, run_ma, verify))
        settings["ma_runtime"][key] = runtime.describe()
        settings["shapes"][key] = shape
        if shape not in shapes:
            shapes.append(shape)

    if md5_etag:
        runtime = MaRuntime(server, scratch)
        runtime.store = MultipartEtagStore(runtime.store, composite)

        def run_ma_multipart(out: Path) -> Dict[str, Any]:
            return runtime.download(f"s3://{BUCKET}/{LARGE_KEY}", out / "blob.bin", out / "state")

        methods.append(Method("ma-mp", "(a-mp) ma_runtime DEFAULTS, multipart ETag as OBS gives it: checked part "
                                       "by part", run_ma_multipart, verify))

    # The goal's reference, then each ma_runtime row's own shape (matched concurrency).
    for threads, chunk in dict.fromkeys([BOTO3_REFERENCE, *shapes]):
        config = TransferConfig(multipart_chunksize=chunk, max_concurrency=threads)
        key = f"boto3-{shape_text(threads, chunk)}"

        def run_boto3(out: Path, config=config) -> None:
            s3.download_file(BUCKET, LARGE_KEY, str(out / "blob.bin"), Config=config)

        methods.append(Method(key, f"(b) boto3 download_file [{threads} x {chunk / MiB:g} MiB]", run_boto3, verify))
        settings["shapes"][key] = (threads, chunk)
    defaults = TransferConfig()

    def run_boto3_defaults(out: Path) -> None:
        s3.download_file(BUCKET, LARGE_KEY, str(out / "blob.bin"), Config=defaults)

    methods.append(Method("boto3-def", f"(b') boto3 download_file, TransferConfig defaults "
                                       f"[{defaults.max_request_concurrency} x {defaults.multipart_chunksize // MiB} "
                                       "MiB]", run_boto3_defaults, verify))
    client = obs_client(server)

    def run_obs(out: Path) -> None:
        resp = client.downloadFile(BUCKET, LARGE_KEY, downloadFile=str(out / "blob.bin"), partSize=32 * MiB,
                                   taskNum=8, enableCheckpoint=False)
        assert resp.status < 300, f"HTTP {resp.status} {resp.errorCode} {resp.errorMessage}"

    methods.append(Method("obs-sdk", "(c) ObsClient.downloadFile [taskNum 8 x 32 MiB]", run_obs, verify))
    for threads, part in shapes:
        name = shape_text(threads, part)

        def run_discard(_out: Path, threads=threads, part=part) -> None:
            ranged_ceiling(server, presigned_path, size, threads, part, None)

        def run_pwrite(out: Path, threads=threads, part=part) -> None:
            ranged_ceiling(server, presigned_path, size, threads, part, out / "blob.bin")

        methods.append(Method(f"raw-{name}", f"(r) CEILING ranged GETs [{threads} x {part / MiB:g} MiB], "
                                             "bodies discarded", run_discard, verify_nothing))
        methods.append(Method(f"raw-pw-{name}", f"(r) CEILING ranged GETs [{threads} x {part / MiB:g} MiB], "
                                                "pwrite to a file", run_pwrite, verify))
    methods += physical_methods(scratch, size)
    return methods, settings


# --------------------------------------------------------------------------- output


def print_table(title: str, rows: List[Tuple[str, str, Dict[str, Any]]], unit: str) -> None:
    """min/median/max of the rate over the rounds, the load beside them, CPU medians, failures."""
    width = max([len(label) for _, label, _ in rows] + [20])
    print(f"\n{title}")
    header = (f"  {'endpoint':<8} {'method':<{width}} {'min':>9} {'median':>9} {'max':>9} {unit:<6} "
              f"{'load 1-min':<18} {'client CPU':>10} {'server CPU':>10}")
    print(header)
    print("  " + "-" * (len(header) - 2))
    for endpoint, label, row in rows:
        rate: Optional[harness.Summary] = row.get("rate")
        if rate is None:
            print(f"  {endpoint:<8} {label:<{width}} {'FAILED':>9}  {'; '.join(row.get('errors', []))[:120]}")
            continue
        flag = "" if row["ok"] else f"  ({len(row['errors'])} runs FAILED: {row['errors'][0][:80]})"
        if row.get("engine_warnings"):
            flag += f"  ({row['engine_warnings']} engine retries)"
        print(f"  {endpoint:<8} {label:<{width}} {harness.number(rate.min):>9} {harness.number(rate.median):>9} "
              f"{harness.number(rate.max):>9} {unit:<6} {harness.load_text(rate):<18} "
              f"{row['client_cpu_pct']:>9.0f}% {row['server_cpu_pct']:>9.0f}%{flag}")


def pin_server(server: Server) -> None:
    """Every thread of the server process onto CPUs 1..N-1 (node's and werkzeug's threads included)."""
    cpus = os.cpu_count() or 1
    if cpus < 2:
        raise SystemExit("--pin needs at least 2 CPUs")
    subprocess.run(["taskset", "-apc", f"1-{cpus - 1}", str(server.proc.pid)], check=True, capture_output=True)


def environment(args: argparse.Namespace, servers: Dict[str, Server]) -> Dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("ma-runtime", "boto3", "botocore", "s3transfer", "esdk-obs-python", "moto"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return {
        "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
        "versions": versions, "servers": {name: s.label for name, s in servers.items()},
        "arguments": {k: v for k, v in vars(args).items() if k != "json"},
    }


# --------------------------------------------------------------------------- main


def scenario_small(args, servers: Dict[str, Server], scratch: Path, results: Dict[str, Any]) -> None:
    size = int(args.small_kb * 1024)
    rows: List[Tuple[str, str, Dict[str, Any]]] = []
    verdicts = []
    for name in args.endpoints:
        server = servers.get(name)
        if server is None:
            continue
        print(f"seeding {args.small_count} x {size} B objects on {server.label} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        expected = seed_small(server, args.small_count, size, args.threads)
        seed_seconds = time.perf_counter() - started
        methods, settings = small_methods(server, scratch, expected, size, args.threads, not args.no_diagnostics)
        samples = run_rounds(methods, server, scratch, args.rounds, args.warmup, f"small/{name}")
        summary = {m.key: summarize(samples[m.key], args.small_count) for m in methods}
        rows += [(name, m.label, summary[m.key]) for m in methods]
        verdict = small_verdict(samples, summary, server, args.small_count)
        verdicts.append(verdict)
        results.setdefault("small", {})[name] = {
            "server": server.label, "seed_seconds": seed_seconds, "settings": settings, "summary": summary,
            "samples": samples, "verdict": verdict,
        }
    if not rows:
        return
    print_table(f"Scenario 1: {args.small_count} x {args.small_kb:g} KiB objects under one prefix, objects/s "
                f"({args.rounds} rounds, round-robin; endpoint = the server that answered)", rows, "obj/s")
    for name in args.endpoints:
        if name in servers:
            print(f"  {name}: {servers[name].label} at {servers[name].endpoint}; ma_runtime settings: "
                  f"{results['small'][name]['settings']['ma_runtime_settings']}")
    for verdict in verdicts:
        print_small_verdict(verdict)


def small_verdict(samples: Dict[str, List[harness.Sample]], summary: Dict[str, Dict[str, Any]], server: Server,
                  count: int) -> Dict[str, Any]:
    """The goal judged on ma_runtime / the raw loop that writes the files (c-w); beside it, the same job with the
    listing (c-w+), what the listing alone costs the raw loop, and the shares of the ceilings that discard."""
    goal = compare(samples, "ma", "ceiling-write", count)
    verdict: Dict[str, Any] = {
        "endpoint": server.name, "vs_raw_write": goal,
        "same_job": compare(samples, "ma", "ceiling-write-list", count),
        "listing_cost": compare(samples, "ceiling-write-list", "ceiling-write", count),
        "share": compare(samples, "ma", "ceiling", count),
        "share_of_ceiling_with_listing": compare(samples, "ma", "ceiling-list", count),
    }
    ma = summary["ma"]
    if ma.get("list_seconds") is not None:
        verdict["list_seconds"] = ma["list_seconds"]
    note = (f"beside it, the same job listing included, (a) / (c-w+): "
            f"{_ratio_text(verdict['same_job'])}; the raw loop's own listing, (c-w+) / (c-w): "
            f"{_ratio_text(verdict['listing_cost'])}")
    verdict["goal"] = harness.judge(on_endpoint(SMALL_GOAL, server), goal.of_medians,
                                    f"on {server.label}, ma_runtime download() (a) / the raw loop writing the files "
                                    "(c-w), objects/s, ratio of the medians", goal.per_round, note=note)
    return verdict


def print_small_verdict(verdict: Dict[str, Any]) -> None:
    name = verdict["endpoint"]
    for key, what in (("same_job", "the same job by hand, listing included (c-w+)"),
                      ("listing_cost", "what listing costs the raw loop: (c-w+) / (c-w)"),
                      ("share", "the ceiling that discards the bodies (c)"),
                      ("share_of_ceiling_with_listing", "the ceiling that discards, listing included (c+)")):
        prefix = "" if key == "listing_cost" else "ma_runtime / "
        print(f"  {name}: {prefix}{what}: {harness.comparison_text(verdict[key])}")
    if verdict.get("list_seconds") is not None:
        print(f"  {name}: ma_runtime's listing took {verdict['list_seconds']:.2f} s (median)")


def _ratio_text(comparison: harness.Comparison) -> str:
    return "-" if comparison.of_medians is None else f"{comparison.of_medians:.2f}x"


def on_endpoint(goal: harness.Goal, server: Server) -> harness.Goal:
    """The goal's row for one endpoint: figures of two servers are not one figure."""
    return dataclasses.replace(goal, key=f"{goal.key} ({server.name})")


def scenario_large(args, servers: Dict[str, Server], scratch: Path, results: Dict[str, Any]) -> None:
    size = args.large_mb * MiB
    for name in args.large_endpoints:
        server = servers.get(name)
        if server is None:
            continue
        print(f"seeding one {args.large_mb} MiB object on {server.label} ({args.large_seed}) ...", file=sys.stderr,
              flush=True)
        sha, etag, composite = seed_large(server, scratch, args.large_mb, args.large_seed)
        md5_etag = len(etag) == 32 and all(c in "0123456789abcdef" for c in etag.lower())
        methods, settings = large_methods(server, scratch, sha, size, args.ma_large_variants, md5_etag,
                                          not args.no_diagnostics, composite)
        samples = run_rounds(methods, server, scratch, args.rounds, args.warmup, f"large/{name}")
        summary = {m.key: summarize(samples[m.key], size / MB) for m in methods}
        print_table(f"Scenario 2: one {args.large_mb} MiB object of random bytes on {name}, MB/s (10^6 B/s; "
                    f"{args.rounds} rounds, round-robin; sha256 checked every run)",
                    [(name, m.label, summary[m.key]) for m in methods], "MB/s")
        verdict = large_verdict(samples, summary, settings, size, md5_etag)
        verdict["etag"] = etag
        verdict["goal"] = judge_large(verdict, server)
        print_large_verdict(name, servers[name], args, verdict, settings, md5_etag)
        results.setdefault("large", {})[name] = {
            "server": server.label, "sha256": sha, "etag": etag, "settings": settings, "summary": summary,
            "samples": samples, "verdict": verdict,
        }


def large_verdict(samples: Dict[str, List[harness.Sample]], summary: Dict[str, Dict[str, Any]],
                  settings: Dict[str, Any], size: int, md5_etag: bool) -> Dict[str, Any]:
    """The headline (defaults vs boto3 8 x 16 MiB), matched-concurrency ratios, shares of the raw ceiling,
    and the limit the headline is held against."""
    amount = size / MB
    shapes = settings["shapes"]
    reference = f"boto3-{shape_text(*BOTO3_REFERENCE)}"
    verdict: Dict[str, Any] = {"headline": compare(samples, "ma", reference, amount), "matched": {},
                               "of_ceiling": {}}
    if "ma-mp" in samples:  # the object as OBS presents a multipart upload: checked part by part
        verdict["multipart"] = compare(samples, "ma-mp", reference, amount)
    for key in settings["ma_runtime"]:
        shape = shape_text(*shapes[key])
        verdict["matched"][f"{key} / boto3-{shape}"] = compare(samples, key, f"boto3-{shape}", amount)
        for raw in (f"raw-pw-{shape}", f"raw-{shape}"):
            verdict["of_ceiling"][f"{key} / {raw}"] = compare(samples, key, raw, amount)
    rates = {key: row["rate"].median for key, row in summary.items() if row.get("rate")}
    ceiling_key = f"raw-pw-{shape_text(*shapes['ma'])}"
    limits = {"raw pwrite ceiling at the same N and part size": rates.get(ceiling_key)}
    if md5_etag:
        limits["MD5 on one core"] = rates.get("md5-1core")
    known = {what: rate for what, rate in limits.items() if rate}
    if known and "ma" in rates:
        binding = min(known, key=known.get)
        verdict["limit"] = {"what": binding, "MB/s": known[binding], "share": rates["ma"] / known[binding]}
    verdict["disk_write_MBps"] = rates.get("disk-dd")
    return verdict


def judge_large(verdict: Dict[str, Any], server: Server) -> Dict[str, Any]:
    """The goal judged on the row ma_runtime verifies as OBS presents the object: (a-mp), checked part by part
    against the multipart upload's composite ETag, where the server gives a plain MD5 (s3rver); else (a), which
    then checks whatever the ETag allows. The (a) row's ratio (a plain MD5, followed in order) goes beside it."""
    threads, part = BOTO3_REFERENCE
    if verdict.get("multipart") is not None:
        judged, row = verdict["multipart"], "(a-mp) checked part by part against the composite ETag"
        note = f"beside it, (a) with the single PUT's plain MD5, followed in order: {_ratio_text(verdict['headline'])}"
    else:
        judged, row, note = verdict["headline"], "(a) defaults", ""
    return harness.judge(on_endpoint(LARGE_GOAL, server), judged.of_medians,
                         f"on {server.label}, ma_runtime download() {row} / boto3 download_file [{threads} x "
                         f"{part // MiB} MiB], MB/s, ratio of the medians", judged.per_round, note=note)


def print_large_verdict(name: str, server: Server, args, verdict: Dict[str, Any], settings: Dict[str, Any],
                        md5_etag: bool) -> None:
    etag_kind = ("s3rver's ETag is a plain MD5 (it gives one even for a multipart upload), so the ma_runtime rows "
                 "MD5-check the file; boto3 and downloadFile check nothing" if md5_etag
                 else "multipart ETag: ma_runtime checks the size only")
    print(f"  {name}: {server.label} at {server.endpoint}; object seeded as {args.large_seed}; {etag_kind}")
    for key, text in settings["ma_runtime"].items():
        print(f"  {name}: ma_runtime settings of row '{key}': {text}")
    if verdict["headline"].of_medians is None:
        print(f"  {name}: no ratio (a method failed)")
        return
    threads, part = BOTO3_REFERENCE
    print(f"  {name}: (a) ma_runtime DEFAULTS, plain MD5 followed in order / boto3 [{threads} x {part // MiB} MiB]: "
          f"{harness.comparison_text(verdict['headline'])}")
    if verdict.get("multipart"):
        print(f"  {name}: (a-mp) ma_runtime DEFAULTS, multipart ETag checked part by part / boto3 [{threads} x "
              f"{part // MiB} MiB]: {harness.comparison_text(verdict['multipart'])} (the goal's row)")
    for what, comparison in verdict["matched"].items():
        print(f"  {name}: matched concurrency (same threads and part size), {what}: "
              f"{harness.comparison_text(comparison)}")
    for what, comparison in verdict["of_ceiling"].items():
        print(f"  {name}: share of the raw ceiling, {what}: {harness.comparison_text(comparison)}")
    limit = verdict.get("limit")
    if limit:
        print(f"  {name}: the headline is held against {limit['what']}, {limit['MB/s']:.0f} MB/s (median, this run): "
              f"it reaches {100 * limit['share']:.0f} % of it")
    if verdict.get("disk_write_MBps"):
        background = dirty_background_bytes()
        fits = (f"{args.large_mb} MiB is below the kernel's background write-back threshold (about "
                f"{background / MiB:,.0f} MiB), so the disk binds only a larger download" if background and
                args.large_mb * MiB < background else "the download exceeds the background write-back threshold, "
                "so the disk's rate can bind")
        print(f"  {name}: the disk writes {verdict['disk_write_MBps']:.0f} MB/s with fdatasync (median); no row "
              f"syncs, and {fits}")


def dirty_background_bytes() -> Optional[int]:
    """Roughly where the kernel starts writing dirty pages back: vm.dirty_background_bytes, or its ratio of
    the available memory; None where /proc does not tell."""
    try:
        fixed = int(Path("/proc/sys/vm/dirty_background_bytes").read_text())
        if fixed:
            return fixed
        ratio = int(Path("/proc/sys/vm/dirty_background_ratio").read_text())
        meminfo = Path("/proc/meminfo").read_text()
        available_kb = int(re.search(r"^MemAvailable:\s+(\d+)", meminfo, re.M).group(1))
    except (OSError, ValueError, AttributeError):
        return None
    return available_kb * 1024 * ratio // 100


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the servers and scratch data still go
    scratch = Path(tempfile.mkdtemp(prefix="ma-bench-storage-", dir=args.workdir or "/tmp"))
    servers: Dict[str, Server] = {}
    results: Dict[str, Any] = {}
    try:
        wanted = set()
        if "small" in args.scenarios:
            wanted.update(args.endpoints)
        if "large" in args.scenarios:
            wanted.update(args.large_endpoints)
        problems = {}
        for name in ("moto", "s3rver"):
            if name not in wanted:
                continue
            print(f"starting {name} ...", file=sys.stderr, flush=True)
            folder = scratch / name
            folder.mkdir()
            server, problem = start_moto(folder) if name == "moto" else start_s3rver(folder, args.s3rver)
            if server is None:
                problems[name] = problem
                print(f"NOTE: {name} is not available, its measurements are skipped: {problem}", flush=True)
            else:
                servers[name] = server
                if args.pin:
                    pin_server(server)
        if args.pin:
            os.sched_setaffinity(0, {0})  # this process and the threads it starts from now on
        if not servers:
            print("No local S3 server could be started; nothing measured.")
            return 0
        cpus = os.cpu_count()
        harness.print_header("storage downloads", args.rounds, args.warmup)
        for goal in (SMALL_GOAL, LARGE_GOAL):
            harness.print_goal(goal)
        machine = f"Machine: {cpus} CPUs ({platform.machine()}), Python {platform.python_version()}."
        if args.pin:
            print(f"{machine} Pinned: the client (this process, all its threads) on CPU 0, the servers on CPUs "
                  f"1-{cpus - 1}; still one box, not a network measurement.")
        else:
            print(f"{machine} Client (this process, all its threads) and server run on the SAME {cpus} cores: every "
                  "figure is client+server on one box, not a network measurement.")
        if "small" in args.scenarios:
            scenario_small(args, servers, scratch, results)
        if "large" in args.scenarios:
            if not any(name in servers for name in args.large_endpoints):
                print(f"\nScenario 2 skipped: {', '.join(args.large_endpoints)} not available "
                      f"({'; '.join(problems.values())}).")
            else:
                scenario_large(args, servers, scratch, results)
        verdicts = [outcome["verdict"]["goal"] for which in ("small", "large")
                    for outcome in results.get(which, {}).values() if "goal" in outcome["verdict"]]
        if args.json:
            payload = {"environment": environment(args, servers), "unavailable": problems, **results,
                       "run": harness.run_record(verdicts)}
            with open(args.json, "w") as handle:
                json.dump(payload, handle, indent=2, default=harness.to_json)
        return 0
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
