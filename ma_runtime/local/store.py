"""The object store of `ma-runtime local`: moto's S3 server, run for the job in the nodes' switch namespace.

The nodes reach it at nodes.SERVICE_ADDRESS (their own network, nothing on the machine's); the runner, which is
outside that network, talks to this module's process through its standard streams:

    python -m ma_runtime.local.store ADDRESS PORT SPEC.json   (run inside the switch namespace)
      SPEC: {"buckets": [names], "fill": [[bucket, key prefix, local path], ...]}
      stdout: `ready` once the buckets are made and filled (or `error <why>`, then it exits 1)
      stdin:  a line `drain <folder>`: every object goes to <folder>/<bucket>/<key>; stdout: one JSON line,
              [[bucket, key, size], ...]; then it stops. End of stdin (the runner died) stops it too.

moto is the optional extra `ma-runtime[local]` (moto[server], which brings boto3); the runtime never imports this.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import List, Sequence, Tuple

ACCESS_KEY = "local-access-key"
SECRET_KEY = "local-secret-key"  # moto accepts any key: this one only has to be the same on both sides
REGION = "us-east-1"
PORT = 9000  # the switch namespace is the run's own: no other listener there
EXTRA = "pip install 'ma-runtime[local]'"
# What `moto.server` and the store's S3 client import: moto, and what its [server] extra adds that the store needs.
_NEEDED = ("moto", "werkzeug", "flask", "flask_cors", "boto3")


def missing() -> str:
    """'' when moto's server is installed, else the line saying what is missing and how to get it.

    Found, not imported: importing moto takes 0.6-0.7 s (it loads botocore), which the runner paid before making
    the nodes for an import the store's own process does again (benchmarks/local_startup.py). A broken install
    still says so: the store's process answers `error ...` and the run stops with that line."""
    lacking = [name for name in _NEEDED if _absent(name)]
    return f"the local object store needs moto's server ({', '.join(lacking)} not installed): {EXTRA}" if lacking \
        else ""


def _absent(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None  # a top-level name: located, nothing executed
    except (ImportError, ValueError):
        return True


def node_environment(url: str) -> dict:
    """The variables that point a node's runtime at the store (README, "Settings": storage)."""
    return {"MA_S3_ENDPOINT": url, "OBS_ACCESS_KEY_ID": ACCESS_KEY, "OBS_SECRET_ACCESS_KEY": SECRET_KEY,
            "MA_RUNTIME_STORAGE_SIGNATURE": "v4", "MA_RUNTIME_STORAGE_REGION": REGION}


def _client(url: str):
    import boto3

    return boto3.client("s3", endpoint_url=url, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                        region_name=REGION)


def fill_keys(prefix: str, source: Path) -> List[Tuple[Path, str]]:
    """(local file, key) for --data's PREFIX=SOURCE: a folder's files under the prefix as a folder, a file at the
    prefix itself (or under it when it ends with /)."""
    if source.is_file():
        return [(source, prefix + source.name if (prefix.endswith("/") or not prefix) else prefix)]
    base = prefix if (prefix.endswith("/") or not prefix) else prefix + "/"
    return [(path, base + path.relative_to(source).as_posix()) for path in sorted(source.rglob("*")) if path.is_file()]


def _fill(s3, bucket: str, prefix: str, source: Path) -> None:
    for path, key in fill_keys(prefix, source):
        s3.upload_file(str(path), bucket, key)


def _drain(s3, folder: Path) -> List[Tuple[str, str, int]]:
    found = []
    for bucket in sorted(entry["Name"] for entry in s3.list_buckets().get("Buckets", [])):
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for entry in page.get("Contents", []):
                key = entry["Key"]
                target = folder / bucket / key
                if key.endswith("/") or ".." in Path(key).parts:
                    continue  # a folder marker, or a key that would land outside the folder
                target.parent.mkdir(parents=True, exist_ok=True)
                s3.download_file(bucket, key, str(target))
                found.append((bucket, key, int(entry["Size"])))
    return found


def serve(address: str, port: int, spec: dict) -> int:
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:  # installed but broken: one line for the runner, which ends the run with it
        print(f"error {type(exc).__name__}: {exc} ({EXTRA})", flush=True)
        return 1

    os.environ.setdefault("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    server = ThreadedMotoServer(ip_address=address, port=port, verbose=False)
    server.start()
    url = f"http://{address}:{port}"
    try:
        try:
            _make(url, spec)
        except Exception as exc:  # one line for the runner, which ends the run with it
            print(f"error {type(exc).__name__}: {exc}", flush=True)
            return 1
        print("ready", flush=True)
        for line in sys.stdin:
            command, _, argument = line.strip().partition(" ")
            if command == "drain":
                print(json.dumps(_drain(_client(url), Path(argument))), flush=True)
                return 0
        return 0
    finally:
        server.stop()


def _make(url: str, spec: dict) -> None:
    """The buckets and the fill. The S3 client only when there is something to make: building it loads botocore's
    S3 model (0.1 s), which a run naming no bucket would wait for before its nodes start."""
    buckets, fill = spec.get("buckets", []), spec.get("fill", [])
    if not buckets and not fill:
        return
    s3 = _client(url)
    for bucket in buckets:
        s3.create_bucket(Bucket=bucket)
    for bucket, prefix, source in fill:
        _fill(s3, bucket, prefix, Path(source))


def main(argv: Sequence[str]) -> int:
    address, port, spec_file = argv
    return serve(address, int(port), json.loads(Path(spec_file).read_text()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
