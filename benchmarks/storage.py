"""Download throughput of ma_runtime's transfer engine, side by side with boto3, the OBS SDK and the endpoint.

Everything runs in one process against local S3 servers started here, on this
machine: client and server share its CPUs (say 2 cores: a faster client leaves
less CPU to the server, and the other way round).

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
  and, unless --no-diagnostics:
  (d1) ma_runtime's ObsStore.read_range in a ThreadPool(16), without the engine.
  Objects/s; goal: ma_runtime >= 90 % of the ceiling (c).
  (b), (c), (c'), (d1) get the key list for free; (a) and (c+) list the prefix.

Scenario 2, one large object (default 512 MB of random bytes, written once), on
s3rver (moto reads the whole object for every ranged GET, so it is no place for
part-parallel downloads):
  (a) ma_runtime download() with its defaults (16 workers, 32 MB parts, ranged
      from 64 MB up), and with other settings (--ma-large-variants),
  (a-mp) ma_runtime's defaults seeing the ETag S3/OBS give a multipart upload
      (`<hash>-<parts>`): s3rver answers a plain content MD5 even for one, so
      (a) MD5-checks 512 MB, which no multipart-uploaded object on OBS allows;
      (a-mp) checks the size only, as boto3 and downloadFile (which check nothing),
  (b) boto3 `download_file`, TransferConfig(multipart_chunksize=16 MB,
      max_concurrency=8), and with TransferConfig's defaults,
  (c) the SDK's `ObsClient.downloadFile(taskNum=8, partSize=32 MB)`.
  MB/s (decimal); each result's sha256 is checked against the source (untimed).
  Goal: ma_runtime (defaults) >= 1.2 x boto3 (16 MB x 8).

Every measurement runs --repeat times (default 3), round-robin over the methods
(each round starting one method later), after --warmup untimed rounds (default 1);
tables show the median, every sample (in round order),
and the CPU used meanwhile by the client (this process, all threads) and by the
server process (/proc/PID/stat), in % of one core. Clients (boto3 client,
ObsClient, ObsStore, presigned URLs) are built before the clock starts.

Seeding uses boto3 (parallel puts). s3rver comes from `npm install s3rver@3.7.1`
into the scratch folder; without npm (or network) the s3rver parts are skipped
with a message, and the script still exits 0. Scratch data lives under /tmp
(--workdir) and is deleted at the end, servers are stopped by PID.

    .venv/bin/python benchmarks/storage.py [--small-count 2000] [--small-kb 4] [--large-mb 512]
        [--repeat 3] [--warmup 1] [--endpoints moto,s3rver] [--scenarios small,large] [--json FILE]
    quick: .venv/bin/python benchmarks/storage.py --small-count 200 --large-mb 64 --repeat 1 --warmup 0
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

MiB = 1 << 20
MB = 10**6
BUCKET = "ma-bench"
SMALL_PREFIX = "small/"
LARGE_KEY = "large/blob.bin"
S3RVER_VERSION = "3.7.1"
GOAL_SMALL_SHARE = 0.90
GOAL_LARGE_RATIO = 1.2
SEED_PART = 16 * MiB  # the large object's multipart upload part size
REGION = "us-east-1"


# --------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small-count", type=int, default=2000, help="small objects (default 2000)")
    parser.add_argument("--small-kb", type=float, default=4, help="size of each small object, KiB (default 4)")
    parser.add_argument("--large-mb", type=int, default=512, help="size of the large object, MiB (default 512)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per method, round-robin (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before the timed ones (default 1)")
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
    if args.repeat < 1 or args.warmup < 0 or args.threads < 1 or args.small_count < 1 or args.large_mb < 1:
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
        return process_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc; 0.0 where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


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
    """Wraps a store; `head` gives the ETag S3 and OBS give a multipart upload (`<hash>-<parts>`), which
    s3rver does not (it answers a plain content MD5). No MD5 can be checked against such an ETag, so
    the engine checks the size only, as it does on OBS for any multipart-uploaded object."""

    def __init__(self, store, parts: int) -> None:
        self._store = store
        self._parts = parts

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def head(self, bucket: str, key: str):
        info = self._store.head(bucket, key)
        return dataclasses.replace(info, etag=f"{info.etag}-{self._parts}")


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


def round_robin(methods: List[Method], server: Server, scratch: Path, repeat: int, warmup: int,
                what: str) -> Dict[str, List[Dict[str, Any]]]:
    samples: Dict[str, List[Dict[str, Any]]] = {m.key: [] for m in methods}
    for round_number in range(-warmup, repeat):
        kind = "warm-up" if round_number < 0 else f"round {round_number + 1}/{repeat}"
        # Each round starts one method later: no method is always the one right after the slowest
        # (or the one that follows a big file's deletion), and a drifting machine hits them all alike.
        shift = round_number % len(methods)
        for method in methods[shift:] + methods[:shift]:
            sample = measure(method, server, scratch)
            status = f"{sample['seconds']:.2f} s" if "seconds" in sample else ""
            if "error" in sample:
                status += f" FAILED: {sample['error']}"
            print(f"  [{what} {kind}] {method.key:<10} {status}", file=sys.stderr, flush=True)
            if round_number >= 0:
                samples[method.key].append(sample)
    return samples


def summarize(samples: List[Dict[str, Any]], amount: float) -> Dict[str, Any]:
    """Median rate (amount per second) over the good samples; every rate kept."""
    good = [s for s in samples if "error" not in s]
    if not good:
        return {"ok": False, "errors": [s.get("error") for s in samples]}
    rates = [amount / s["seconds"] for s in good]
    result = {
        "ok": len(good) == len(samples), "rate": statistics.median(rates), "rates": rates,
        "seconds": statistics.median(s["seconds"] for s in good),
        "client_cpu_pct": statistics.median(s["client_cpu_pct"] for s in good),
        "server_cpu_pct": statistics.median(s["server_cpu_pct"] for s in good),
        "errors": [s["error"] for s in samples if "error" in s],
    }
    if all("list_seconds" in s for s in good):
        result["list_seconds"] = statistics.median(s["list_seconds"] for s in good)
        result["rate_without_listing"] = statistics.median(
            amount / max(s["seconds"] - s["list_seconds"], 1e-9) for s in good)
    warnings = sum(s.get("engine_warning_count", 0) for s in good)
    if warnings:
        result["engine_warnings"] = warnings
    return result


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

    def run_raw(keep_alive: bool, listing: bool = False) -> Callable[[Path], Dict[str, Any]]:
        def run(_out: Path) -> Dict[str, Any]:
            failures: List[str] = []
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


def seed_large(server: Server, scratch: Path, size_mib: int, how: str) -> Tuple[str, str]:
    """Writes SIZE MiB of random bytes once, uploads them; returns (sha256, ETag)."""
    from boto3.s3.transfer import TransferConfig

    source = scratch / "large-source.bin"
    digest = hashlib.sha256()
    with open(source, "wb") as handle:
        for _ in range(size_mib):
            chunk = os.urandom(MiB)
            digest.update(chunk)
            handle.write(chunk)
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
    return digest.hexdigest(), etag


def large_methods(server: Server, scratch: Path, expected_sha: str, size: int,
                  variants: List[Optional[Tuple[int, int]]], md5_etag: bool,
                  diagnostics: bool) -> Tuple[List[Method], Dict[str, str]]:
    from boto3.s3.transfer import TransferConfig

    def verify(out: Path) -> None:
        target = out / "blob.bin"
        assert target.is_file(), "no file"
        assert target.stat().st_size == size, f"{target.stat().st_size} bytes, expected {size}"
        assert sha256_of(target) == expected_sha, "sha256 differs from the source"

    methods: List[Method] = []
    settings: Dict[str, str] = {}
    for variant in variants:
        workers, part_mb = variant if variant else (None, None)
        runtime = MaRuntime(server, scratch, workers=workers, part_mb=part_mb)
        key = "ma" if variant is None else f"ma-{workers}x{part_mb}"
        label = ("(a) ma_runtime download() defaults" if variant is None
                 else f"(a) ma_runtime download() {workers} workers")
        label += f" [{runtime.options.workers} x {runtime.options.part_size // MiB} MiB parts]"

        def run_ma(out: Path, runtime: MaRuntime = runtime) -> Dict[str, Any]:
            facts = runtime.download(f"s3://{BUCKET}/{LARGE_KEY}", out / "blob.bin", out / "state")
            assert facts["files"] == 1, facts
            return facts

        methods.append(Method(key, label, run_ma, verify))
        settings[key] = runtime.describe()

    if md5_etag:
        runtime = MaRuntime(server, scratch)
        runtime.store = MultipartEtagStore(runtime.store, parts=-(-size // SEED_PART))

        def run_ma_multipart(out: Path) -> Dict[str, Any]:
            return runtime.download(f"s3://{BUCKET}/{LARGE_KEY}", out / "blob.bin", out / "state")

        methods.append(Method("ma-mp", "(a-mp) ma_runtime defaults, multipart ETag as S3/OBS give it (size check)",
                              run_ma_multipart, verify))

    s3 = boto3_client(server, 16)
    configs = [("boto3", "(b) boto3 download_file [8 thr x 16 MiB chunks]",
                TransferConfig(multipart_chunksize=16 * MiB, max_concurrency=8)),
               ("boto3-def", "(b') boto3 download_file, TransferConfig defaults", TransferConfig())]
    for key, label, config in configs:
        label += f" [{config.max_request_concurrency} thr x {config.multipart_chunksize // MiB} MiB]" \
            if key == "boto3-def" else ""

        def run_boto3(out: Path, config=config) -> None:
            s3.download_file(BUCKET, LARGE_KEY, str(out / "blob.bin"), Config=config)

        methods.append(Method(key, label, run_boto3, verify))
    client = obs_client(server)

    def run_obs(out: Path) -> None:
        resp = client.downloadFile(BUCKET, LARGE_KEY, downloadFile=str(out / "blob.bin"), partSize=32 * MiB,
                                   taskNum=8, enableCheckpoint=False)
        assert resp.status < 300, f"HTTP {resp.status} {resp.errorCode} {resp.errorMessage}"

    methods.append(Method("obs-sdk", "(c) ObsClient.downloadFile [taskNum 8 x 32 MiB parts]", run_obs, verify))
    return methods, settings


# --------------------------------------------------------------------------- output


def print_table(title: str, rows: List[Tuple[str, str, Dict[str, Any]]], unit: str, repeat: int) -> None:
    print(f"\n{title}")
    header = (f"  {'endpoint':<8} {'method':<66} {'median ' + unit:>13} {'samples':<26} {'median s':>8} "
              f"{'client CPU':>10} {'server CPU':>10}")
    print(header)
    print("  " + "-" * (len(header) - 2))
    for endpoint, label, row in rows:
        if not row.get("rate"):
            print(f"  {endpoint:<8} {label:<66} {'FAILED':>13}  {'; '.join(row.get('errors', []))[:120]}")
            continue
        samples = "/".join(f"{rate:.0f}" for rate in row["rates"])
        flag = "" if row["ok"] else f"  ({len(row['errors'])} of {repeat} runs FAILED: {row['errors'][0][:80]})"
        if row.get("engine_warnings"):
            flag += f"  ({row['engine_warnings']} engine retries in {repeat} runs)"
        print(f"  {endpoint:<8} {label:<66} {row['rate']:>13.1f} {samples:<26} {row['seconds']:>8.2f} "
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
        samples = round_robin(methods, server, scratch, args.repeat, args.warmup, f"small/{name}")
        summary = {m.key: summarize(samples[m.key], args.small_count) for m in methods}
        rows += [(name, m.label, summary[m.key]) for m in methods]
        ma, ceiling = summary["ma"], summary["ceiling"]
        verdict: Dict[str, Any] = {"endpoint": name}
        if ma.get("rate") and ceiling.get("rate"):
            verdict.update(share=ma["rate"] / ceiling["rate"],
                           share_without_listing=ma["rate_without_listing"] / ceiling["rate"],
                           list_seconds=ma["list_seconds"], met=ma["rate"] / ceiling["rate"] >= GOAL_SMALL_SHARE)
            if summary.get("ceiling-list", {}).get("rate"):
                verdict["share_of_ceiling_with_listing"] = ma["rate"] / summary["ceiling-list"]["rate"]
        verdicts.append(verdict)
        results.setdefault("small", {})[name] = {
            "server": server.label, "seed_seconds": seed_seconds, "settings": settings, "summary": summary,
            "samples": samples, "verdict": verdict,
        }
    if not rows:
        return
    print_table(f"Scenario 1: {args.small_count} x {args.small_kb:g} KiB objects under one prefix, objects/s "
                f"(median of {args.repeat}, round-robin; endpoint = the server that answered)", rows, "obj/s",
                args.repeat)
    for name in args.endpoints:
        if name in servers:
            print(f"  {name}: {servers[name].label} at {servers[name].endpoint}; ma_runtime settings: "
                  f"{results['small'][name]['settings']['ma_runtime_settings']}")
    for verdict in verdicts:
        if "share" not in verdict:
            print(f"  {verdict['endpoint']}: no verdict (a method failed)")
            continue
        line = (f"  {verdict['endpoint']}: ma_runtime = {100 * verdict['share']:.1f} % of the endpoint's ceiling "
                f"(goal >= {100 * GOAL_SMALL_SHARE:.0f} %): {'MET' if verdict['met'] else 'MISSED'}; listing took "
                f"{verdict['list_seconds']:.2f} s, without it {100 * verdict['share_without_listing']:.1f} %")
        if "share_of_ceiling_with_listing" in verdict:
            line += (f"; of the ceiling for the same job, listing included (c+): "
                     f"{100 * verdict['share_of_ceiling_with_listing']:.1f} %")
        print(line)


def scenario_large(args, servers: Dict[str, Server], scratch: Path, results: Dict[str, Any]) -> None:
    size = args.large_mb * MiB
    rows: List[Tuple[str, str, Dict[str, Any]]] = []
    verdicts = []
    for name in args.large_endpoints:
        server = servers.get(name)
        if server is None:
            continue
        print(f"seeding one {args.large_mb} MiB object on {server.label} ({args.large_seed}) ...", file=sys.stderr,
              flush=True)
        sha, etag = seed_large(server, scratch, args.large_mb, args.large_seed)
        md5_etag = len(etag) == 32 and all(c in "0123456789abcdef" for c in etag.lower())
        methods, settings = large_methods(server, scratch, sha, size, args.ma_large_variants, md5_etag,
                                          not args.no_diagnostics)
        samples = round_robin(methods, server, scratch, args.repeat, args.warmup, f"large/{name}")
        summary = {m.key: summarize(samples[m.key], size / MB) for m in methods}
        rows += [(name, m.label, summary[m.key]) for m in methods]
        verdict: Dict[str, Any] = {"endpoint": name, "etag": etag}
        if summary["ma"].get("rate") and summary["boto3"].get("rate"):
            ratio = summary["ma"]["rate"] / summary["boto3"]["rate"]
            verdict.update(ratio=ratio, met=ratio >= GOAL_LARGE_RATIO)
            if summary.get("boto3-def", {}).get("rate"):
                verdict["ratio_vs_boto3_defaults"] = summary["ma"]["rate"] / summary["boto3-def"]["rate"]
            if summary.get("obs-sdk", {}).get("rate"):
                verdict["ratio_vs_obs_sdk"] = summary["ma"]["rate"] / summary["obs-sdk"]["rate"]
            if summary.get("ma-mp", {}).get("rate"):
                ratio_mp = summary["ma-mp"]["rate"] / summary["boto3"]["rate"]
                verdict.update(ratio_multipart_etag=ratio_mp, met_multipart_etag=ratio_mp >= GOAL_LARGE_RATIO)
        verdicts.append(verdict)
        results.setdefault("large", {})[name] = {
            "server": server.label, "sha256": sha, "etag": etag, "settings": settings, "summary": summary,
            "samples": samples, "verdict": verdict,
        }
    if not rows:
        return
    print_table(f"Scenario 2: one {args.large_mb} MiB object of random bytes, MB/s (10^6 B/s; median of "
                f"{args.repeat}, round-robin; endpoint = the server that answered; sha256 checked every run)",
                rows, "MB/s", args.repeat)
    for verdict in verdicts:
        name = verdict["endpoint"]
        plain_md5 = len(verdict["etag"]) == 32 and "-" not in verdict["etag"]
        etag_kind = ("ETag is 32 hex digits, so ma_runtime MD5-checks the file, hashing the parts in order as "
                     "they land; s3rver gives a content MD5 even for multipart uploads" if plain_md5
                     else "multipart ETag: ma_runtime checks the size only")
        print(f"  {name}: {servers[name].label} at {servers[name].endpoint}; object seeded as {args.large_seed} "
              f"({etag_kind})")
        for key, text in results["large"][name]["settings"].items():
            print(f"  {name}: ma_runtime settings of row '{key}': {text}")
        if "ratio" not in verdict:
            print(f"  {name}: no verdict (a method failed)")
            continue
        extra = "".join(f"; vs {what} {verdict[k]:.2f}x" for k, what in
                        (("ratio_vs_boto3_defaults", "boto3 defaults"), ("ratio_vs_obs_sdk", "ObsClient.downloadFile"))
                        if k in verdict)
        print(f"  {name}: ma_runtime (defaults) / boto3 (8 x 16 MiB) = {verdict['ratio']:.2f}x "
              f"(goal >= {GOAL_LARGE_RATIO}x): {'MET' if verdict['met'] else 'MISSED'}{extra}")
        if "ratio_multipart_etag" in verdict:
            print(f"  {name}: with the multipart ETag S3/OBS give (a-mp: no MD5, like boto3): "
                  f"{verdict['ratio_multipart_etag']:.2f}x boto3 (goal >= {GOAL_LARGE_RATIO}x): "
                  f"{'MET' if verdict['met_multipart_etag'] else 'MISSED'}")


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
        if args.json:
            payload = {"environment": environment(args, servers), "unavailable": problems, **results}
            with open(args.json, "w") as handle:
                json.dump(payload, handle, indent=2, default=str)
        return 0
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
