"""The uploader process itself (issue 23): what the job's environment can do to it, its death during the final
sync, and what the final sync's events say. A real `ma-run`, the real uploader, the real OBS SDK against moto
(through test_sync's counting proxy where requests are slowed or counted).
"""

import os
import signal
import sys
import textwrap
import time

import pytest

from ma_runtime import spec as spec_module
from ma_runtime.process import children
from ma_runtime.sync import control
from tests.e2e.test_sync import (
    Run,
    counting_proxy,
    events,
    job_file,
    listing,
    output_dir,
    read_object,
    reaping,
    run_job,
    sha,
    sync_env,
    uploader_pids,
    wait_until_gone,
)
from tests.recording import Log

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _reap(job_env):
    with reaping(job_env):
        yield


@pytest.fixture
def proxy(obs_endpoint):
    with counting_proxy(obs_endpoint) as running:
        yield running


# --------------------------------------------------------------------------- 9: the job's Python path

NOISY_SITECUSTOMIZE = 'print("hello from the job\'s sitecustomize", flush=True)\n'
# Raises in every process but the runtime (a child of this test), which loads the real PyYAML: the runtime of the
# test venv runs without -I (the image's runs with it), and parses the job file before it starts any uploader.
SHADOWING_YAML = textwrap.dedent("""
    import os, sys
    if os.getppid() != int(os.environ["SPARE_CHILDREN_OF"]):
        raise ImportError("the job's own yaml.py, not PyYAML")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != here]
    del sys.modules[__name__]
    import yaml
    sys.modules[__name__] = yaml
""")
WRITE_ONE = 'echo checkpoint > "$out/ckpt.txt"; echo trained'


@pytest.mark.parametrize("module", ["sitecustomize", "yaml"])
def test_a_jobs_python_path_does_not_reach_the_uploader(obs_endpoint, job_env, tmp_path, module):
    job_path = tmp_path / "job-python-path"
    job_path.mkdir()
    (job_path / f"{module}.py").write_text(NOISY_SITECUSTOMIZE if module == "sitecustomize" else SHADOWING_YAML)
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint, PYTHONPATH=str(job_path), SPARE_CHILDREN_OF=os.getpid())
    job = job_file(tmp_path, [("out", f"obs://{bucket}/out/", {"mode": "env"})], log_url=f"obs://{bucket}/logs/")

    code, run = run_job(["--config", job, "sh", "-c", WRITE_ONE], env, tmp_path)

    assert code == 0, run.stderr[-3000:]
    assert "trained" in run.stdout
    assert read_object(obs_endpoint.s3, bucket, "out/ckpt.txt") == b"checkpoint\n"
    assert "modelarts-job-local-worker-0.log" in listing(obs_endpoint.s3, bucket, "logs/")
    assert events(run.stderr, "final sync completed")
    assert not events(run.stderr, "upload process failed")
    wait_until_gone(env)


# --------------------------------------------------------------------------- 11: killed during the final sync

WRITE_BIG_AND_END = """
import os
base = os.urandom(1 << 20)
with open(os.path.join(os.environ["big_out"], "big.bin"), "wb") as f:
    for i in range(40):
        f.write(i.to_bytes(8, "big") + base[8:])
print("written", flush=True)
"""
PARTS = 5  # 40 MiB in 8 MiB parts


def test_the_uploader_killed_during_the_final_sync_is_started_again_and_resumes(obs_endpoint, job_env, tmp_path,
                                                                                 proxy):
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint, MA_S3_ENDPOINT=proxy.url, MA_RUNTIME_STORAGE_PART_MB=8,
                   MA_RUNTIME_STORAGE_LARGE_MB=8,
                   MA_RUNTIME_STORAGE_WORKERS=2, MA_RUNTIME_FINAL_SYNC_SECONDS=60)
    proxy.arm("delay", methods=("PUT",), delay=0.7)
    job = job_file(tmp_path, [("big_out", f"obs://{bucket}/model/", {"mode": "env"})])
    parts = f"/{bucket}/model/big.bin?"
    run = Run(["--config", job, sys.executable, "-c", WRITE_BIG_AND_END], env, tmp_path)
    deadline = time.monotonic() + 30
    while len(proxy.part_puts(parts)) < 3:  # two parts answered (2 workers, one part each at a time)
        assert run.running() and time.monotonic() < deadline, run.stderr[-3000:]
        time.sleep(0.02)
    assert "written" in run.stdout, "the command still ran: this is not the final sync"
    (uploader,) = uploader_pids(run.pid)
    os.kill(uploader, signal.SIGKILL)

    assert run.wait(90) == 0, run.stderr[-3000:]
    assert events(run.stderr, "upload process restarted"), run.stderr[-3000:]
    assert events(run.stderr, "final sync completed")
    local = (output_dir(env, "big_out") / "big.bin").read_bytes()
    assert sha(read_object(obs_endpoint.s3, bucket, "model/big.bin")) == sha(local)
    assert obs_endpoint.s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    # Resumed, not started over: at most the parts in flight at the kill (one per worker) were sent twice.
    assert len(proxy.part_puts(parts)) <= PARTS + 2, proxy.part_puts(parts)
    wait_until_gone(env)


def test_an_uploader_that_dies_at_every_start_ends_the_final_sync_after_a_few_fresh_ones(monkeypatch):
    monkeypatch.setattr(children, "_BOOT", "import os; os._exit(3)")  # a crash loop: no answer will ever come
    log = Log()
    uploader = control.Uploader(spec_module.load({}, os.environ, None), log)
    started = time.monotonic()
    try:
        result = uploader.final(started + 60)
    finally:
        uploader.close()

    assert (result.answered, result.error) == (False, "the upload process exited before it answered")
    assert len(log.fields("upload process restarted")) == control.FINAL_RESTARTS
    assert time.monotonic() - started < 30  # not until the deadline: a guard against a spin, not a timing


# --------------------------------------------------------------------------- 12: what the events say


def test_final_sync_incomplete_gives_the_time_taken_and_the_deadline_apart(obs_endpoint, job_env, tmp_path, proxy):
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint, MA_S3_ENDPOINT=proxy.url, MA_RUNTIME_STORAGE_RETRY_SECONDS=1,
                   MA_RUNTIME_FINAL_SYNC_SECONDS=60)
    proxy.arm("403", methods=("PUT",))  # every upload refused at once: the final sync ends long before its deadline
    job = job_file(tmp_path, [("out", f"obs://{bucket}/out/", {"mode": "env"})])

    code, run = run_job(["--config", job, "sh", "-c", WRITE_ONE], env, tmp_path)

    assert code == 80, run.stderr[-3000:]
    (incomplete,) = events(run.stderr, "final sync incomplete")
    assert float(incomplete["deadline_s"]) == 60, incomplete
    assert 0 < float(incomplete["elapsed_s"]) < 60, incomplete  # before the deadline: a bound at the wrong wait
    assert "seconds" not in incomplete, incomplete
    wait_until_gone(env)
