"""Upload throughput of ma_runtime's store writes, side by side with boto3, the OBS SDK and the endpoint.

What the output sync sends, measured against what others send, in one process against a local S3 server
started here (s3rver 3.7.1 by default, moto on request): client and server share this machine's CPUs, so
a client that spends less CPU leaves more to the server. Every figure is measured round-robin with the
anchors (benchmarks/_harness.py): min/median/max over the rounds, the 1-minute load average beside each
row, the client's and the server's CPU (medians, % of one core), and ratios per round and of the medians.
Clients, presigned URLs and the source files are made before the clock starts; each run is checked
afterwards (untimed): every object there, with the source's size and, where the ETag is an MD5, its MD5.

Scenario 1, many small files (default 2000 x 4 KiB, files on local disk), objects/s:
  (b)  boto3 `put_object` in a ThreadPool(16), each file read whole,
  (b') boto3 `upload_file` (transfer manager, TransferConfig defaults) per file in a ThreadPool(16),
  (c)  the SDK's `putFile` per file in a ThreadPool(16),
  (c') the SDK's `uploadFile` (taskNum 1, no checkpoint) per file in a ThreadPool(16),
  (r)  the endpoint's ceiling: raw presigned PUTs (boto3 `generate_presigned_url`, made before the clock)
       with `http.client` in 16 threads, one kept-alive connection each, bodies already in memory,
  (s)  ma_runtime's sync engine: one final cycle (`ChannelSync.cycle(final=True)`: walk, read, MD5, PUT) of a
       folder of those files: what the runtime runs. THE HEADLINE.
  (a)  diagnostic: each file read, its MD5 taken, `ObsStore.put_bytes` (Content-MD5), in a ThreadPool(16):
       the storage primitive the engine calls, by a hand-written loop.
  Rows (b') and (c') cost a TransferManager or a checkpointed task per file and would take minutes for 2000
  files: they run on a subset (--subset, default 200) and their objects/s are that subset's; the tables say so.
  Goal (benchmarks/README.md: the design's small-download budget applied to uploads): (s) >= 0.9x (r).

Scenario 2, one large file (default 512 MiB, on local disk), MB/s (10^6 B/s):
  (b)  boto3 `upload_file`, TransferConfig defaults, and with max_concurrency=16,
  (c)  the SDK's `putFile` (one PUT) and `uploadFile` (partSize 32 MiB, taskNum 16, no checkpoint),
  (s)  ma_runtime's sync engine, one final cycle of a folder holding the file: what the runtime runs,
       whichever way the engine sends it. THE HEADLINE.
  (r)  the endpoint's ceiling for one stream: one raw presigned PUT, the body sent with sendfile,
  diagnostics, the engine's parts by hand:
  (e)  `transfer.Multipart` with its defaults (the resumable multipart upload the engine sends a large file
       with), called directly,
  (a)  ma_runtime's primitives: `create_multipart`, parts of --part-mb (32 MiB) as parallel `upload_part`s
       (sendfile straight from the file) in --part-threads threads (default 8 and 16), `complete_multipart`,
  (a') and `put_file`: one PUT, sendfile straight from the file.
  Goal (the design's budget): (s) >= 1.2x the best of boto3 and the SDK (the anchor row with the best median), ratio of
  the medians. Note for s3rver: its CompleteMultipartUpload reads every part back and writes (and MD5s) the
  object again, so any multipart upload costs it about twice a single PUT's work; where the server's CPU is
  the limit (2 shared cores), one PUT is faster than parts however they are sent.

The sync engine's own row: `ma_runtime_sync_row` (None while `ma_runtime.sync.engine` cannot be imported).

    .venv/bin/python benchmarks/upload.py [--small-count 2000] [--small-kb 4] [--large-mb 512] [--rounds 5]
        [--warmup 1] [--endpoints s3rver] [--scenarios small,large] [--json FILE]
    quick: .venv/bin/python benchmarks/upload.py --small-count 200 --large-mb 64 --rounds 2 --warmup 0
"""

import argparse
import dataclasses
import hashlib
import http.client
import json
import os
import platform
import shutil
import signal
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
import storage  # noqa: E402  (the servers, clients and measuring of the download benchmark)

MiB = 1 << 20
MB = 10**6
BUCKET = "ma-bench-upload"
SMALL_GOAL = harness.Goal("upload, small files", "many small files uploaded at >= 90 % of what the endpoint can "
                          "take", "benchmarks/README.md (the design's 90 % is for small downloads)", 0.9, "x",
                          at_most=False)
LARGE_GOAL = harness.Goal("upload, large file", "large uploads >= 1.2x the best of boto3 and the OBS SDK",
                          "the design's budgets", 1.2, "x", at_most=False)
HEADLINE = "ma-sync"  # the sync engine's row: what the runtime runs; the primitive rows are diagnostics
LARGE_ANCHORS = ("boto3-def", "boto3-16", "sdk-putfile", "sdk-uploadfile")
RANDOM_BLOCK = 64 * MiB  # the large file is this much random data, repeated
MAX_PUT_MB = 5120  # the (s') row's large threshold: every file one PUT may carry (5 GiB) goes in one


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small-count", type=int, default=2000, help="small files (default 2000)")
    parser.add_argument("--small-kb", type=float, default=4, help="size of each small file, KiB (default 4)")
    parser.add_argument("--subset", type=int, default=200,
                        help="files the per-file transfer-manager rows (b') and (c') upload (default 200)")
    parser.add_argument("--large-mb", type=int, default=512, help="size of the large file, MiB (default 512)")
    parser.add_argument("--part-mb", type=int, default=32, help="part size of the ma_runtime rows, MiB (default 32)")
    parser.add_argument("--part-threads", default="8,16", help="threads of the ma_runtime part rows (default 8,16)")
    harness.add_round_arguments(parser, rounds=5, warmup=1)
    parser.add_argument("--threads", type=int, default=16, help="threads of the small-file pools (default 16)")
    parser.add_argument("--endpoints", default="s3rver", help="servers: s3rver, moto or both (default s3rver)")
    parser.add_argument("--scenarios", default="small,large", help="small, large or both (default both)")
    parser.add_argument("--s3rver", metavar="PATH", help="an s3rver executable to use instead of npm-installing one")
    parser.add_argument("--workdir", metavar="DIR", help="scratch parent folder (default: a new folder in /tmp)")
    parser.add_argument("--json", metavar="FILE", help="also write the results (and every sample) as JSON to FILE")
    args = parser.parse_args(argv)
    args.endpoints = storage._names(args.endpoints, ("moto", "s3rver"), "--endpoints")
    args.scenarios = storage._names(args.scenarios, ("small", "large"), "--scenarios")
    args.part_threads = [int(text) for text in args.part_threads.split(",") if text.strip()]
    if min([args.rounds, args.threads, args.small_count, args.large_mb, args.part_mb, args.subset,
            *args.part_threads]) < 1 or args.warmup < 0:
        parser.error("counts must be positive")
    return args


# --------------------------------------------------------------------------- the sync engine's row


def ma_runtime_sync_row(server: storage.Server, scratch: Path, scenario: str, sources: List[Path],
                        large_mb: Optional[int] = None) -> Optional[storage.Method]:
    """The sync engine's own row: one final-sync cycle (`ChannelSync.cycle(final=True)`, what the uploader runs
    after the command) of a folder holding copies of `sources` to BUCKET, with a fresh manifest each run, so
    every file goes up: scan, read, MD5 and PUT for small files; one PUT below the large threshold, parts at or
    above it (transfer.upload_file). `large_mb`: the threshold as MA_RUNTIME_STORAGE_LARGE_MB would set it
    (None: the default). Copies, made once before the clock: the engine does not follow a hard link to a file
    outside its folder (tree.py)."""
    try:
        from ma_runtime.storage.transfer.upload import goes_in_parts
        from ma_runtime.sync.engine import ChannelSync, Target
    except ImportError:
        return None
    ma = storage.MaRuntime(server, scratch)
    options = ma.options if large_mb is None else dataclasses.replace(ma.options, large_threshold=large_mb * MiB)
    s3 = storage.boto3_client(server, 16)
    folder = Path(tempfile.mkdtemp(prefix=f"sync-{scenario}-", dir=scratch))
    expected: Dict[str, Tuple[int, str]] = {}
    for source in sources:
        shutil.copyfile(source, folder / source.name)
    prefix = f"{scenario}/sync{large_mb or ''}/"
    if scenario == "large":
        amount = sum(source.stat().st_size for source in sources) / MB
    else:
        amount = len(sources)

    def run(_out: Path) -> Dict[str, Any]:
        state = Path(tempfile.mkdtemp(prefix="sync-state-", dir=scratch))
        try:
            sync = ChannelSync(Target("bench", folder, f"s3://{BUCKET}/{prefix}"), ma.store, options,
                               ma.spec.sync_markers, storage.QuietLog(), state)
            result = sync.cycle(final=True)
            assert result.error is None and not result.missing, result.error or result.missing[:3]
            assert result.files == len(sources), f"{result.files} files uploaded of {len(sources)}"
        finally:
            shutil.rmtree(state, ignore_errors=True)
        return {"amount": amount}

    def verify(_out: Path) -> None:
        if not expected:
            for source in sources:
                data = source.read_bytes()
                expected[prefix + source.name] = (len(data), hashlib.md5(data).hexdigest())
        verify_objects(s3, prefix, expected)
        empty_prefix(s3, prefix)

    if scenario != "large":
        how = "]"
    elif any(goes_in_parts(source.stat().st_size, options) for source in sources):
        how = f", parts of {options.part_size // MiB} MiB from {options.large_threshold // MiB} MiB]"
    else:
        how = f", one PUT below {options.large_threshold // MiB} MiB]"
    if large_mb is None:
        return storage.Method(HEADLINE, f"(s) ma_runtime sync engine, final cycle, defaults [{options.workers} threads"
                              + how, run, verify)
    return storage.Method(f"ma-sync-{large_mb}", f"(s') ma_runtime sync engine, final cycle, "
                          f"MA_RUNTIME_STORAGE_LARGE_MB={large_mb} [{options.workers} threads" + how, run, verify)


# --------------------------------------------------------------------------- helpers


def amount_rate(result: Dict[str, Any]) -> Optional[float]:
    """What a run moved per second (objects, or MB): its `amount` over its seconds; None for a failed run."""
    return None if "error" in result else result["amount"] / result["seconds"]


def summarize(samples: List[harness.Sample]) -> Dict[str, Any]:
    """The row storage.print_table prints: the rate over the rounds, the CPU medians, the failures."""
    results = [sample.result for sample in samples]
    good = [result for result in results if "error" not in result]
    row: Dict[str, Any] = {"ok": len(good) == len(results), "rate": harness.summarize(samples, amount_rate),
                           "errors": [result["error"] for result in results if "error" in result]}
    if good:
        row.update(client_cpu_pct=_median(r["client_cpu_pct"] for r in good),
                   server_cpu_pct=_median(r["server_cpu_pct"] for r in good))
    return row


def _median(values) -> float:
    import statistics

    return statistics.median(list(values))


def compare(samples: Dict[str, List[harness.Sample]], ours: str, anchor: str) -> harness.Comparison:
    return harness.compare(samples[ours], samples[anchor], harness.ratio, amount_rate)


def in_threads(threads: int, function: Callable[[Any], Any], items: Sequence[Any]) -> None:
    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(function, items):
            pass


class KeptAlive:
    """One http.client connection per thread to the server, all closed at the end."""

    def __init__(self, port: int):
        self.port = port
        self.local = threading.local()
        self.all: List[http.client.HTTPConnection] = []
        self.lock = threading.Lock()

    def get(self) -> http.client.HTTPConnection:
        connection = getattr(self.local, "connection", None)
        if connection is None:
            connection = self.local.connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            with self.lock:
                self.all.append(connection)
        return connection

    def close(self) -> None:
        for connection in self.all:
            connection.close()


def presigned_put_path(s3, key: str) -> str:
    parts = urlsplit(s3.generate_presigned_url("put_object", Params={"Bucket": BUCKET, "Key": key},
                                               ExpiresIn=24 * 3600))
    return f"{parts.path}?{parts.query}"


def check_answer(response: http.client.HTTPResponse, what: str) -> None:
    body = response.read()
    assert response.status < 300, f"{what}: HTTP {response.status} {body[:200]!r}"


def verify_objects(s3, prefix: str, expected: Dict[str, Tuple[int, str]]) -> None:
    """Every key under `prefix` there, with its size and, where the ETag is an MD5, its MD5."""
    found: Dict[str, Tuple[int, str]] = {}
    for page in s3.get_paginator("list_objects").paginate(Bucket=BUCKET, Prefix=prefix):
        for item in page.get("Contents", []):
            found[item["Key"]] = (item["Size"], item["ETag"].strip('"'))
    missing = sorted(set(expected) - set(found))
    assert not missing, f"{len(missing)} objects missing under {prefix}, first {missing[0]}"
    for key, (size, md5) in expected.items():
        got_size, etag = found[key]
        assert got_size == size, f"{key}: {got_size} bytes, expected {size}"
        assert "-" in etag or etag == md5, f"{key}: ETag {etag}, expected the MD5 {md5}"


def empty_prefix(s3, prefix: str) -> None:
    """Untimed, between runs: each run writes new objects, not overwrites (a server may do those otherwise)."""
    for page in s3.get_paginator("list_objects").paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})


# --------------------------------------------------------------------------- scenario 1: small files


def make_small_files(folder: Path, count: int, size: int) -> Tuple[List[Path], Dict[str, Tuple[int, str]]]:
    folder.mkdir(parents=True)
    files, facts = [], {}
    for index in range(count):
        data = os.urandom(size)
        path = folder / f"obj-{index:06d}.bin"
        path.write_bytes(data)
        files.append(path)
        facts[path.name] = (size, hashlib.md5(data).hexdigest())
    return files, facts


def small_methods(server: storage.Server, scratch: Path, files: List[Path], facts: Dict[str, Tuple[int, str]],
                  threads: int, subset: int) -> List[storage.Method]:
    from boto3.s3.transfer import TransferConfig

    s3 = storage.boto3_client(server, threads)
    client = storage.obs_client(server)
    ma = storage.MaRuntime(server, scratch)
    some = files[:subset]
    methods: List[storage.Method] = []

    def row(key: str, label: str, chosen: List[Path], send: Callable[[str, Path], None]) -> None:
        prefix = f"small/{key}/"

        def run(_out: Path) -> Dict[str, Any]:
            in_threads(threads, lambda path: send(prefix + path.name, path), chosen)
            return {"amount": len(chosen)}

        def verify(_out: Path) -> None:
            verify_objects(s3, prefix, {prefix + path.name: facts[path.name] for path in chosen})
            empty_prefix(s3, prefix)

        methods.append(storage.Method(key, label, run, verify))

    def boto3_put(key: str, path: Path) -> None:
        s3.put_object(Bucket=BUCKET, Key=key, Body=path.read_bytes())

    def boto3_upload_file(key: str, path: Path) -> None:
        s3.upload_file(str(path), BUCKET, key, Config=TransferConfig())

    def sdk_put_file(key: str, path: Path) -> None:
        resp = client.putFile(BUCKET, key, str(path))
        assert resp.status < 300, f"putFile: HTTP {resp.status} {resp.errorCode}"

    def sdk_upload_file(key: str, path: Path) -> None:
        resp = client.uploadFile(BUCKET, key, str(path), partSize=5 * MiB, taskNum=1, enableCheckpoint=False)
        assert resp.status < 300, f"uploadFile: HTTP {resp.status} {resp.errorCode}"

    def ma_put_bytes(key: str, path: Path) -> None:
        data = path.read_bytes()
        ma.store.put_bytes(BUCKET, key, data, hashlib.md5(data).hexdigest())

    subset_note = f", {len(some)}-file subset"
    row("boto3-put", f"(b) boto3 put_object, {threads} threads", files, boto3_put)
    row("boto3-upfile", f"(b') boto3 upload_file, defaults, {threads} threads{subset_note}", some, boto3_upload_file)
    row("sdk-putfile", f"(c) SDK putFile, {threads} threads", files, sdk_put_file)
    row("sdk-uploadfile", f"(c') SDK uploadFile, {threads} threads{subset_note}", some, sdk_upload_file)
    methods.append(raw_small_ceiling(server, s3, files, facts, threads))
    row("ma", f"(a) ma_runtime read + MD5 + put_bytes, {threads} threads", files, ma_put_bytes)
    sync = ma_runtime_sync_row(server, scratch, "small", files)
    if sync is not None:
        methods.append(sync)
    return methods


def raw_small_ceiling(server: storage.Server, s3, files: List[Path], facts: Dict[str, Tuple[int, str]],
                      threads: int) -> storage.Method:
    prefix = "small/ceiling/"
    targets = {path.name: presigned_put_path(s3, prefix + path.name) for path in files}
    bodies = {path.name: path.read_bytes() for path in files}

    def run(_out: Path) -> Dict[str, Any]:
        connections = KeptAlive(server.port)

        def put(name: str) -> None:
            connection = connections.get()
            connection.request("PUT", targets[name], body=bodies[name])
            check_answer(connection.getresponse(), name)

        try:
            in_threads(threads, put, list(targets))
        finally:
            connections.close()
        return {"amount": len(targets)}

    def verify(_out: Path) -> None:
        verify_objects(s3, prefix, {prefix + name: facts[name] for name in targets})
        empty_prefix(s3, prefix)

    return storage.Method("ceiling", f"(r) CEILING raw presigned PUT, http.client, {threads} threads, keep-alive",
                          run, verify)


# --------------------------------------------------------------------------- scenario 2: one large file


def make_large_file(path: Path, size: int) -> str:
    """Random bytes (a random block repeated); returns the file's MD5."""
    block = os.urandom(min(RANDOM_BLOCK, size))
    digest = hashlib.md5()
    with open(path, "wb") as sink:
        written = 0
        while written < size:
            piece = block[: min(len(block), size - written)]
            sink.write(piece)
            digest.update(piece)
            written += len(piece)
    return digest.hexdigest()


def large_methods(server: storage.Server, scratch: Path, source: Path, md5: str, part_mb: int,
                  part_threads: List[int]) -> List[storage.Method]:
    from boto3.s3.transfer import TransferConfig

    size = source.stat().st_size
    s3 = storage.boto3_client(server, 16)
    client = storage.obs_client(server)
    ma = storage.MaRuntime(server, scratch)
    methods: List[storage.Method] = []

    def row(key: str, label: str, send: Callable[[str], Optional[Dict[str, Any]]]) -> None:
        target = f"large/{key}.bin"

        def run(_out: Path) -> Dict[str, Any]:
            more = send(target)  # a row's own figures (the seconds of its complete), when it returns a dict
            return {"amount": size / MB, **(more if isinstance(more, dict) else {})}

        def verify(_out: Path) -> None:
            verify_objects(s3, target, {target: (size, md5)})
            empty_prefix(s3, target)

        methods.append(storage.Method(key, label, run, verify))

    defaults = TransferConfig()
    row("boto3-def", f"(b) boto3 upload_file, TransferConfig defaults [{defaults.max_request_concurrency} x "
                     f"{defaults.multipart_chunksize // MiB} MiB]",
        lambda key: s3.upload_file(str(source), BUCKET, key, Config=defaults))
    sixteen = TransferConfig(max_concurrency=16)
    row("boto3-16", f"(b) boto3 upload_file, max_concurrency=16 [16 x {sixteen.multipart_chunksize // MiB} MiB]",
        lambda key: s3.upload_file(str(source), BUCKET, key, Config=sixteen))

    def sdk_put_file(key: str) -> None:
        resp = client.putFile(BUCKET, key, str(source))
        assert resp.status < 300, f"putFile: HTTP {resp.status} {resp.errorCode}"

    def sdk_upload_file(key: str) -> None:
        resp = client.uploadFile(BUCKET, key, str(source), partSize=32 * MiB, taskNum=16, enableCheckpoint=False)
        assert resp.status < 300, f"uploadFile: HTTP {resp.status} {resp.errorCode}"

    row("sdk-putfile", "(c) SDK putFile, one PUT", sdk_put_file)
    row("sdk-uploadfile", "(c) SDK uploadFile [taskNum 16 x 32 MiB]", sdk_upload_file)

    def engine(key: str) -> None:
        from ma_runtime.storage.transfer.utils import object_url

        location = ma.url.parse(f"s3://{BUCKET}/{key}")
        state = Path(tempfile.mkdtemp(prefix="state-", dir=scratch))
        try:
            options = dataclasses.replace(ma.options, state_dir=state)
            # What the sync engine does with a large file (sync/engine.py `_put_large`).
            url = object_url(location, location.key)
            ma.transfer.Multipart(ma.store, location.bucket, location.key, url, source, source.stat(), options,
                                  storage.QuietLog()).run()
        finally:
            shutil.rmtree(state, ignore_errors=True)

    row("engine", f"(e) ma_runtime transfer.Multipart, defaults [{ma.options.workers} x "
                  f"{ma.options.part_size // MiB} MiB]", engine)
    row("ceiling", "(r) CEILING one raw presigned PUT, sendfile", lambda key: raw_large_put(server, s3, source, key))
    for threads in part_threads:
        row(f"ma-{threads}", f"(a) ma_runtime upload_part [{threads} threads x {part_mb} MiB]",
            lambda key, threads=threads: parallel_parts(ma.store, source, key, part_mb * MiB, threads))
    row("ma-put", "(a') ma_runtime put_file, one PUT (sendfile)",
        lambda key: ma.store.put_file(BUCKET, key, str(source)))
    for large_mb in (None, MAX_PUT_MB):
        sync = ma_runtime_sync_row(server, scratch, "large", [source], large_mb)
        if sync is not None:
            methods.append(sync)
    return methods


def raw_large_put(server: storage.Server, s3, source: Path, key: str) -> None:
    size = source.stat().st_size
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    try:
        connection.putrequest("PUT", presigned_put_path(s3, key))
        connection.putheader("Content-Length", str(size))
        connection.endheaders()
        with open(source, "rb") as body:
            sent = connection.sock.sendfile(body, 0, size)
        assert sent == size, f"sent {sent} of {size} bytes"
        check_answer(connection.getresponse(), key)
    finally:
        connection.close()


def parallel_parts(store, source: Path, key: str, part_size: int, threads: int) -> Dict[str, Any]:
    """The parts by hand; returns the seconds of the complete alone (`complete_seconds`): what a server that
    assembles the object on complete (s3rver reads every part back and writes the object again) costs beyond
    the parts, and what OBS, which completes without copying, would not charge."""
    size = source.stat().st_size
    upload_id = store.create_multipart(BUCKET, key)
    offsets = list(range(0, size, part_size))

    def send(number: int) -> Tuple[int, str]:
        offset = offsets[number - 1]
        return number, store.upload_part(BUCKET, key, upload_id, number, str(source), offset,
                                         min(part_size, size - offset))

    with ThreadPoolExecutor(threads) as pool:
        parts = list(pool.map(send, range(1, len(offsets) + 1)))
    started = time.perf_counter()
    store.complete_multipart(BUCKET, key, upload_id, parts)
    return {"complete_seconds": time.perf_counter() - started}


# --------------------------------------------------------------------------- verdicts and main


def small_verdict(samples: Dict[str, List[harness.Sample]], server: storage.Server) -> Dict[str, Any]:
    """The goal judged on the sync engine's row against the endpoint's ceiling; the primitives beside it."""
    verdict: Dict[str, Any] = {"vs": {}}
    for ours in (HEADLINE, "ma"):
        if ours in samples:
            verdict["vs"][ours] = {anchor: compare(samples, ours, anchor)
                                   for anchor in ("ceiling", "boto3-put", "sdk-putfile")}
    share = verdict["vs"].get(HEADLINE, {}).get("ceiling", harness.Comparison(None, None))
    verdict["goal"] = harness.judge(on_endpoint(SMALL_GOAL, server), share.of_medians, f"on {server.label}, the "
                                    "sync engine (s) / the ceiling (r), objects/s, ratio of the medians",
                                    share.per_round)
    return verdict


def large_verdict(samples: Dict[str, List[harness.Sample]], summary: Dict[str, Dict[str, Any]],
                  labels: Dict[str, str], server: storage.Server) -> Dict[str, Any]:
    """The goal judged on the sync engine's row against the best anchor (by median); the diagnostics beside it."""
    medians = {key: summary[key]["rate"].median for key in LARGE_ANCHORS if summary[key].get("rate")}
    best = max(medians, key=medians.get) if medians else None
    verdict: Dict[str, Any] = {"best_anchor": best, "vs": {}}
    for ours in (HEADLINE, "engine", *[key for key in samples if key.startswith("ma-")]):
        if ours in samples:
            verdict["vs"][ours] = {key: compare(samples, ours, key) for key in [*LARGE_ANCHORS, "ceiling"]}
    headline = verdict["vs"].get(HEADLINE, {}).get(best, harness.Comparison(None, None))
    anchor = labels.get(best, "no anchor")
    verdict["goal"] = harness.judge(on_endpoint(LARGE_GOAL, server), headline.of_medians, f"on {server.label}, the "
                                    f"sync engine (s) / the best anchor, {anchor}, MB/s, ratio of the medians",
                                    headline.per_round)
    return verdict


def complete_share(samples: Dict[str, List[harness.Sample]], summary: Dict[str, Dict[str, Any]],
                   labels: Dict[str, str], best: Optional[str]) -> Dict[str, Any]:
    """Of the rows that time their complete (the parts by hand): its seconds, its share of the row's, and the
    row's rate without it (what a server that completes without copying, as OBS does, would give, the rest of
    the work the same) against the best anchor's median. Medians over the rounds."""
    found: Dict[str, Any] = {}
    anchor = summary.get(best, {}).get("rate") if best else None
    for key, rows in samples.items():
        good = [sample.result for sample in rows if "complete_seconds" in sample.result]
        if not good:
            continue
        complete = _median(result["complete_seconds"] for result in good)
        seconds = _median(result["seconds"] for result in good)
        amount = good[0]["amount"]
        without = amount / max(1e-9, seconds - complete)
        found[key] = {"complete_seconds": complete, "row_seconds": seconds, "rate_without_complete": without,
                      "vs_best_anchor": without / anchor.median if anchor else None}
        versus = f", {without / anchor.median:.2f}x the best anchor's median" if anchor else ""
        print(f"  complete alone, {labels.get(key, key)}: {complete:.2f} s of the row's {seconds:.2f} s (medians, "
              f"{100 * complete / seconds:.0f} %); without it {without:.0f} MB/s{versus}")
    return found


def on_endpoint(goal: harness.Goal, server: storage.Server) -> harness.Goal:
    """The goal's row for one endpoint: figures of two servers are not one figure."""
    return dataclasses.replace(goal, key=f"{goal.key} ({server.name})")


def print_comparisons(name: str, which: str, verdict: Dict[str, Any], labels: Dict[str, str]) -> None:
    """Every row of ma_runtime's against every anchor: the headline's and the diagnostics'."""
    for ours, comparisons in verdict["vs"].items():
        for key, comparison in comparisons.items():
            print(f"  {name}: {which}, {labels.get(ours, ours)} / {labels.get(key, key)}: "
                  f"{harness.comparison_text(comparison)}")


def scenario(args, server: storage.Server, scratch: Path, which: str) -> Dict[str, Any]:
    if which == "small":
        size = int(args.small_kb * 1024)
        files, facts = make_small_files(scratch / "small-src", args.small_count, size)
        methods = small_methods(server, scratch, files, facts, args.threads, min(args.subset, len(files)))
        unit, title = "obj/s", f"Scenario 1: {args.small_count} x {args.small_kb:g} KiB files, objects/s"
    else:
        source = scratch / "large-src.bin"
        md5 = make_large_file(source, args.large_mb * MiB)
        methods = large_methods(server, scratch, source, md5, args.part_mb, args.part_threads)
        unit, title = "MB/s", f"Scenario 2: one {args.large_mb} MiB file, MB/s (10^6 B/s)"
    samples = storage.run_rounds(methods, server, scratch, args.rounds, args.warmup, f"{which}/{server.name}")
    summary = {method.key: summarize(samples[method.key]) for method in methods}
    storage.print_table(f"{title} ({args.rounds} rounds, round-robin; on {server.label})",
                        [(server.name, method.label, summary[method.key]) for method in methods], unit)
    labels = {method.key: method.label for method in methods}
    verdict = (small_verdict(samples, server) if which == "small"
               else large_verdict(samples, summary, labels, server))
    print_comparisons(server.name, which, verdict, labels)
    if which == "large":
        verdict["complete"] = complete_share(samples, summary, labels, verdict.get("best_anchor"))
    return {"server": server.label, "labels": labels, "summary": summary, "samples": samples, "verdict": verdict}


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the servers and scratch data still go
    scratch = Path(tempfile.mkdtemp(prefix="ma-bench-upload-", dir=args.workdir or "/tmp"))
    servers: Dict[str, storage.Server] = {}
    results: Dict[str, Any] = {}
    problems: Dict[str, str] = {}
    try:
        for name in args.endpoints:
            print(f"starting {name} ...", file=sys.stderr, flush=True)
            folder = scratch / name
            folder.mkdir()
            server, problem = (storage.start_moto(folder) if name == "moto"
                               else storage.start_s3rver(folder, args.s3rver))
            if server is None:
                problems[name] = problem
                print(f"NOTE: {name} is not available, its measurements are skipped: {problem}", flush=True)
                continue
            servers[name] = server
            storage.boto3_client(server, 4).create_bucket(Bucket=BUCKET)
        if not servers:
            print("No local S3 server could be started; nothing measured.")
            return 0
        harness.print_header("storage uploads", args.rounds, args.warmup)
        for goal in (SMALL_GOAL, LARGE_GOAL):
            harness.print_goal(goal)
        print(f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), Python {platform.python_version()}. Client "
              "(this process, all its threads) and server share those cores: not a network measurement.")
        for name, server in servers.items():
            for which in args.scenarios:
                folder = scratch / f"{which}-{name}"
                folder.mkdir()
                results.setdefault(which, {})[name] = scenario(args, server, folder, which)
        if args.json:
            verdicts = [outcome["verdict"]["goal"] for by_server in results.values() for outcome in by_server.values()]
            payload = {"environment": storage.environment(args, servers), "unavailable": problems, **results,
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
