"""`ma-runtime local`'s object store (ma_runtime/local/store.py): what its start costs the run, and the line that says
what is missing. The store itself, against real `ma-run`s, is tested in tests/e2e/test_local.py."""

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ma_runtime.local import store

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, *, isolated_path=None) -> str:
    """CODE in a fresh interpreter; with isolated_path, site-packages left out and only those folders (and the
    checkout) importable, as on a machine without the extra."""
    prelude = ""
    if isolated_path is not None:
        prelude = f"import sys; sys.path[:] = {[str(ROOT), *map(str, isolated_path)]!r} + " \
                  "[p for p in sys.path if 'site-packages' not in p and p]\n"
    done = subprocess.run([sys.executable, "-S", "-c", prelude + textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=ROOT, check=True)
    return done.stdout.strip()


def test_checking_for_the_store_imports_neither_moto_nor_boto3():
    # `ma-runtime local` checked for moto's server by importing it: 0.6-0.7 s of its start-up, before the nodes
    # were made, for an import the store's own process does again (benchmarks/local_startup.py).
    pytest.importorskip("moto")
    found = _python("""
        import site, sys
        site.main()
        from ma_runtime.local import store
        print(repr(store.missing()), sorted(name for name in ('moto', 'boto3', 'botocore', 'flask')
                                            if name in sys.modules))
    """)
    assert found == "'' []"


@pytest.mark.parametrize("present, lacking", [
    ((), "moto, werkzeug, flask, flask_cors, boto3"),  # nothing of the extra
    (("moto", "boto3"), "werkzeug, flask, flask_cors"),  # `pip install moto`, without [server]
])
def test_a_missing_store_is_one_line_naming_what_is_missing_and_the_extra(tmp_path, present, lacking):
    for name in present:  # stand-ins, found but never imported
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise SystemExit('imported')\n")
    said = _python("from ma_runtime.local import store; print(store.missing())", isolated_path=[tmp_path])
    assert said == f"the local object store needs moto's server ({lacking} not installed): {store.EXTRA}"


def test_with_no_bucket_to_make_the_store_is_ready_and_still_drains_what_the_job_wrote(tmp_path):
    # Its S3 client is made when first needed: a run that names no bucket does not wait for botocore's models.
    pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    spec = tmp_path / "store.json"
    spec.write_text(json.dumps({"buckets": [], "fill": []}))
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "ma_runtime.local.store", "127.0.0.1", str(port), str(spec)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert process.stdout.readline().strip() == "ready"
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id=store.ACCESS_KEY,
                          aws_secret_access_key=store.SECRET_KEY, region_name=store.REGION)
        s3.create_bucket(Bucket="job-bucket")
        s3.put_object(Bucket="job-bucket", Key="out/ckpt.pt", Body=b"weights")
        process.stdin.write(f"drain {tmp_path / 'bucket'}\n")
        process.stdin.flush()
        assert json.loads(process.stdout.readline()) == [["job-bucket", "out/ckpt.pt", 7]]
        assert process.wait(30) == 0
    finally:
        process.kill()
        process.wait()
    assert (tmp_path / "bucket" / "job-bucket" / "out" / "ckpt.pt").read_bytes() == b"weights"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
