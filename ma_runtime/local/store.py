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


def missing() -> str:
    """'' when moto's server can be imported, else the line saying how to get it."""
    try:
        import moto.server  # noqa: F401
    except ImportError:
        return f"the local object store needs moto's server: {EXTRA}"
    return ""


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
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    server = ThreadedMotoServer(ip_address=address, port=port, verbose=False)
    server.start()
    try:
        s3 = _client(f"http://{address}:{port}")
        try:
            for bucket in spec.get("buckets", []):
                s3.create_bucket(Bucket=bucket)
            for bucket, prefix, source in spec.get("fill", []):
                _fill(s3, bucket, prefix, Path(source))
        except Exception as exc:  # one line for the runner, which ends the run with it
            print(f"error {type(exc).__name__}: {exc}", flush=True)
            return 1
        print("ready", flush=True)
        for line in sys.stdin:
            command, _, argument = line.strip().partition(" ")
            if command == "drain":
                print(json.dumps(_drain(s3, Path(argument))), flush=True)
                return 0
        return 0
    finally:
        server.stop()


def main(argv: Sequence[str]) -> int:
    address, port, spec_file = argv
    return serve(address, int(port), json.loads(Path(spec_file).read_text()))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
