"""Output sync end to end against a bad endpoint (issue 12): slow (the final sync's deadline), denying
(403), unreachable, and a runtime SIGKILLed in the middle of a multipart upload.

The faults come from test_transfer_faults' proxy between the real SDK and moto (tests/e2e/test_sync.py's
CountingProxy also counts the requests it forwards, so "only the missing parts were sent" is a count of
part PUTs, not the runtime's word). moto checks no signatures, so the 403 of a wrong secret key is the
proxy's answer.
"""

import sys
import time

import pytest

from tests.conftest import alive, log_dir, task_log
from tests.e2e.test_sync import (
    TERMINATION,
    WAIT_FOR_FINISH,
    Run,
    control,
    counting_proxy,
    events,
    job_file,
    listing,
    local_files,
    output_dir,
    read_object,
    reaping,
    run_job,
    sha,
    sync_env,
    termination,
    uploader_pids,
    wait_until_gone,
)
from tests.storage_env import refusing_endpoint

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _reap(job_env):
    with reaping(job_env):
        yield


@pytest.fixture
def proxy(obs_endpoint):
    with counting_proxy(obs_endpoint) as running:
        yield running

# --------------------------------------------------------------------------- 3: the final sync's deadline

MANY_FILES = ('i=0; while [ $i -lt 100 ]; do echo "file $i" > "$slow_out/f-$i.txt"; i=$((i+1)); done; '
              'echo trained; exit {code}')


@pytest.mark.parametrize("command_code, expected", [(0, 80), (3, 3)], ids=["succeeded", "failed"])
def test_a_final_sync_past_its_deadline_stops_and_names_what_is_missing(obs_endpoint, job_env, tmp_path, proxy,
                                                                       command_code, expected):
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint, MA_S3_ENDPOINT=proxy.url, MA_RUNTIME_FINAL_SYNC_SECONDS=3,
                   MA_RUNTIME_STORAGE_WORKERS=2)
    proxy.arm("delay", methods=("PUT",), delay=1.0)  # 100 files: 50 s at least, the deadline is 3 s
    job = job_file(tmp_path, [("slow_out", f"obs://{bucket}/slow/", {"mode": "env"})], log_url=f"obs://{bucket}/logs/")
    started = time.monotonic()

    code, run = run_job(["--config", job, "sh", "-c", MANY_FILES.format(code=command_code)], env, tmp_path)

    assert code == expected, run.stderr[-3000:]
    # A bound at the wrong wait, not a speed budget: the 100 delayed PUTs take 50 s at least past the deadline.
    assert time.monotonic() - started < 50, "the final sync did not stop at its deadline"
    assert "trained" in run.stdout and "Traceback" not in run.stderr
    assert events(run.stderr, "final sync incomplete")
    not_synced = events(run.stderr, "not synced")
    assert not_synced and all("f-" in " ".join(event.values()) for event in not_synced), not_synced
    message = termination(env)
    assert message["exit_code"] == expected
    local = set(local_files(output_dir(env, "slow_out")))
    unsynced = [entry[len("slow_out: "):] for entry in message["unsynced"] if entry.startswith("slow_out: ")]
    assert unsynced and set(unsynced) <= local, message["unsynced"]  # the logs' own entries may follow
    logs = listing(obs_endpoint.s3, bucket, "logs/")  # the logs go first: the outputs cannot crowd them out
    assert "modelarts-job-local-worker-0.log" in logs, sorted(logs)
    if expected == 80:
        assert message["stage"] == "sync" and "not synced" in message["reason"]
        assert "MA_RUNTIME_FINAL_SYNC_SECONDS=3" in message["reason"]  # what to change
    else:
        assert message["stage"] == "supervise" and message["reason"] == "the command exited with code 3"
        assert TERMINATION in logs, sorted(logs)  # written when the command failed, so uploaded first
    wait_until_gone(env)


# --------------------------------------------------------------------------- 4: SIGKILL mid-multipart

WRITE_BIG = """
import os, time
base = os.urandom(1 << 20)
with open(os.path.join(os.environ["big_out"], "big.bin"), "wb") as f:
    for i in range(200):
        f.write(i.to_bytes(8, "big") + base[8:])
os.write(1, b"written\\n")
time.sleep(300)
"""
PARTS = 25  # 200 MiB in 8 MiB parts


def test_a_runtime_killed_mid_multipart_upload_resumes_sending_only_the_missing_parts(
        obs_endpoint, job_env, tmp_path, proxy):
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint, MA_S3_ENDPOINT=proxy.url, MA_RUNTIME_STORAGE_PART_MB=8,
                   MA_RUNTIME_STORAGE_LARGE_MB=8,
                   MA_RUNTIME_STORAGE_WORKERS=2, MA_RUNTIME_FINAL_SYNC_SECONDS=60)
    proxy.arm("delay", methods=("PUT",), delay=0.5)
    job = job_file(tmp_path, [("big_out", f"obs://{bucket}/model/", {"mode": "env"})])
    parts = f"/{bucket}/model/big.bin?"
    run = Run(["--config", job, sys.executable, "-c", WRITE_BIG], env, tmp_path, name="killed")
    deadline = time.monotonic() + 60
    while len(proxy.part_puts(parts)) < 6:
        assert run.running() and time.monotonic() < deadline, run.stderr[-3000:]
        time.sleep(0.05)
    uploaders = uploader_pids(run.pid)
    assert uploaders, "no process runs ma_runtime.sync.uploader"

    run.proc.kill()  # the OOM killer's way: no exit steps at all
    run.proc.wait()
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in uploaders):
        assert time.monotonic() < deadline, "the uploader outlived the SIGKILLed runtime"
        time.sleep(0.05)
    wait_until_gone(env)
    proxy.disarm()
    sent_before = len(proxy.part_puts(parts))
    assert sent_before < PARTS

    code, again = run_job(["--config", job, "true"], env, tmp_path, name="again", timeout=120)

    assert code == 0, again.stderr[-3000:]
    sent_again = len(proxy.part_puts(parts)) - sent_before
    assert 0 < sent_again < PARTS, f"{sent_again} parts sent again of {PARTS}"
    # At the kill, at most one part per worker was in flight (sent, its answer never read): sent twice.
    assert sent_before + sent_again <= PARTS + 2, (sent_before, sent_again)
    local = (output_dir(env, "big_out") / "big.bin").read_bytes()
    assert sha(read_object(obs_endpoint.s3, bucket, "model/big.bin")) == sha(local)
    assert obs_endpoint.s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_an_unfinished_multipart_upload_of_a_file_changed_since_is_aborted(obs_endpoint, job_env, tmp_path, proxy):
    """The other way a restarted runtime settles a crash's upload: the file is not what it was uploading."""
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint, MA_S3_ENDPOINT=proxy.url, MA_RUNTIME_STORAGE_PART_MB=8,
                   MA_RUNTIME_STORAGE_LARGE_MB=8,
                   MA_RUNTIME_STORAGE_WORKERS=1, MA_RUNTIME_FINAL_SYNC_SECONDS=60)
    proxy.arm("delay", methods=("PUT",), delay=1.0)
    job = job_file(tmp_path, [("big_out", f"obs://{bucket}/model/", {"mode": "env"})])
    run = Run(["--config", job, sys.executable, "-c", WRITE_BIG.replace("range(200)", "range(40)")], env, tmp_path,
              name="killed")
    deadline = time.monotonic() + 60
    while not proxy.part_puts(f"/{bucket}/model/big.bin?"):
        assert run.running() and time.monotonic() < deadline, run.stderr[-3000:]
        time.sleep(0.05)
    run.proc.kill()
    run.proc.wait()
    wait_until_gone(env)
    proxy.disarm()
    assert obs_endpoint.s3.list_multipart_uploads(Bucket=bucket).get("Uploads")  # what the crash left
    big = output_dir(env, "big_out") / "big.bin"
    big.write_bytes(b"new content " * 1000)  # the trainer saved again before the restart

    code, again = run_job(["--config", job, "true"], env, tmp_path, name="again")

    assert code == 0, again.stderr[-3000:]
    assert read_object(obs_endpoint.s3, bucket, "model/big.bin") == big.read_bytes()
    assert obs_endpoint.s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_a_small_file_is_one_put_with_content_md5_and_a_large_one_goes_in_parts(obs_endpoint, job_env, tmp_path,
                                                                                 proxy):
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint, MA_S3_ENDPOINT=proxy.url, MA_RUNTIME_STORAGE_PART_MB=8,
                   MA_RUNTIME_STORAGE_LARGE_MB=8)
    job = job_file(tmp_path, [("out", f"obs://{bucket}/out/", {"mode": "env"})])
    write = ('head -c 4194303 /dev/urandom > "$out/small.bin"; '  # 4 MiB - 1: the largest small file
             'head -c 9437184 /dev/urandom > "$out/large.bin"')  # 9 MiB: two parts of 8

    code, run = run_job(["--config", job, "sh", "-c", write], env, tmp_path)

    assert code == 0, run.stderr[-3000:]
    small = [path for method, path in proxy.seen if path.startswith(f"/{bucket}/out/small.bin")]
    assert len(small) == 1 and "partNumber=" not in small[0], small
    assert "content-md5" in small[0].lower(), "the PUT does not sign a Content-MD5"  # v4 query: SignedHeaders
    large = [(method, path) for method, path in proxy.seen if path.startswith(f"/{bucket}/out/large.bin")]
    assert len(proxy.part_puts(f"/{bucket}/out/large.bin?")) == 2, large
    assert local_files(output_dir(env, "out")) == {
        name: read_object(obs_endpoint.s3, bucket, f"out/{name}") for name in ("small.bin", "large.bin")}


# --------------------------------------------------------------------------- 8: denied, unreachable


def test_a_failed_periodic_upload_is_retried_next_cycle_while_the_job_runs(obs_endpoint, job_env, tmp_path, proxy):
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint, MA_S3_ENDPOINT=proxy.url)
    proxy.arm("403", count=2, methods=("PUT",))  # the first two cycles that try fail; the third succeeds
    job = job_file(tmp_path, [("out", f"obs://{bucket}/out/", {"mode": "env"})])
    run = Run(["--config", job, "sh", "-c", f'echo one > "$out/one.txt"; {WAIT_FOR_FINISH}'], env, tmp_path)
    deadline = time.monotonic() + 15  # cycles every 0.3 s: the third try comes within a second or two
    while "one.txt" not in listing(obs_endpoint.s3, bucket, "out/"):
        assert run.running() and time.monotonic() < deadline, "one.txt never reached the bucket while the job ran"
        time.sleep(0.1)
    control(env, "finish").touch()

    assert run.wait() == 0, run.stderr[-3000:]
    assert proxy.spoiled == 2  # both refusals met: it tried again after each
    failed = events(run.stderr, "output upload failed")
    assert failed and failed[0]["next"] == "retried next cycle" and failed[0]["url"] == f"obs://{bucket}/out/", failed


TRAIN_BRIEFLY = 'echo checkpoint > "$out/ckpt.txt"; sleep 3; echo training finished'
WRONG_SECRET = "wrong-secret-7Hq2vXk"


@pytest.mark.parametrize("fault", ["403", "unreachable"])
def test_a_denying_or_unreachable_endpoint_warns_while_training_goes_on_then_exits_80(
        obs_endpoint, job_env, tmp_path, proxy, fault):
    if fault == "403":
        proxy.arm("403", methods=("GET", "HEAD", "PUT", "POST", "DELETE"), objects_only=False)
        endpoint = proxy.url
    else:
        endpoint = refusing_endpoint()
    env = sync_env(job_env, tmp_path, obs_endpoint, MA_S3_ENDPOINT=endpoint, OBS_SECRET_ACCESS_KEY=WRONG_SECRET,
                   MA_RUNTIME_STORAGE_RETRY_SECONDS=1, MA_RUNTIME_FINAL_SYNC_SECONDS=4)
    url = "obs://bkt-nowhere/out/"
    job = job_file(tmp_path, [("out", url, {"mode": "env"})], log_url="obs://bkt-nowhere/logs/")

    code, run = run_job(["--config", job, "sh", "-c", TRAIN_BRIEFLY], env, tmp_path)

    assert code == 80, run.stderr[-3000:]
    assert "training finished" in run.stdout and "Traceback" not in run.stderr
    failed = events(run.stderr, "output upload failed")
    assert failed and all(event["name"] == "out" and event["url"].startswith(url.rstrip("/")) and event["error"]
                          for event in failed), failed
    message = termination(env)
    assert message["exit_code"] == 80 and "out: ckpt.txt" in message["unsynced"]
    for text in (run.stderr, run.stdout, task_log(env).read_text(), (log_dir(env) / TERMINATION).read_text()):
        assert WRONG_SECRET not in text
    wait_until_gone(env)
