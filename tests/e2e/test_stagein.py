"""Stage-in end to end: `ma-run --config job.yaml python train.py` finds its code, data and checkpoint."""

import json
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import log_dir, run_ma

TRAIN = textwrap.dedent(
    """
    import argparse, os, sys
    parser = argparse.ArgumentParser()
    parser.add_argument("--data_url"); parser.add_argument("--train_url"); parser.add_argument("--lr")
    args = parser.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    assert os.path.isfile(os.path.join(here, "pkg", "util.py")), "nested code missing"
    images = sorted(os.listdir(os.path.join(args.data_url, "images")))
    labels = open(os.environ["labels"]).read().split()
    checkpoint = open(os.path.join(args.train_url, "ckpt", "last.txt")).read()
    print(f"OK images={len(images)} labels={len(labels)} ckpt={checkpoint} lr={args.lr} data={args.data_url}")
    """
)


def seed_tree(put):
    """The job's objects, written through `put(key, bytes)`: code, a dataset, labels, a checkpoint."""
    put("jobs/demo-code/train.py", TRAIN.encode())
    put("jobs/demo-code/pkg/util.py", b"X = 1\n")
    for i in range(20):
        put(f"datasets/mnist/images/{i:03d}.bin", bytes([i]) * 100)
    put("datasets/labels.txt", b"0 1 2 3 4 5 6 7 8 9\n")
    put("runs/run-1/output/ckpt/last.txt", b"epoch-7")


def job_file(tmp_path, base, predownload=True):
    job = {
        "code": {"url": f"{base}/jobs/demo-code"},
        "inputs": [
            {"name": "data_url", "url": f"{base}/datasets/mnist/"},
            {"name": "labels", "url": f"{base}/datasets/labels.txt", "mode": "env"},
        ],
        "outputs": [{"name": "train_url", "url": f"{base}/runs/run-1/output/", "predownload": predownload}],
        "hyperparameters": {"lr": 0.1},
    }
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job))
    return str(path)


COMMAND = [sys.executable + " $MA_JOB_DIR/demo-code/train.py"]


def assert_staged(result, env):
    assert result.returncode == 0, result.stderr
    assert "OK images=20 labels=10 ckpt=epoch-7 lr=0.1" in result.stdout
    assert "modelarts/inputs/data_url_0" in result.stdout
    for event in ("code download completed", "input (data_url) download completed",
                  "output (train_url) predownload completed"):
        assert f'msg="{event}"' in result.stderr and "elapsed_s=" in result.stderr


def local_bucket(tmp_path):
    """A directory seeded like the bucket: local paths work wherever a URL does."""
    source = tmp_path / "bucket"

    def put(key, data):
        (source / key).parent.mkdir(parents=True, exist_ok=True)
        (source / key).write_bytes(data)

    seed_tree(put)
    return str(source)


def test_local_paths_stage_like_the_platform(tmp_path, job_env):
    result = run_ma(["--config", job_file(tmp_path, local_bucket(tmp_path)), *COMMAND], job_env)
    assert_staged(result, job_env)


@pytest.mark.parametrize("scheme", ["obs", "s3"])
def test_obs_endpoint_stages_with_the_real_sdk(tmp_path, job_env, obs_endpoint, scheme):
    pytest.importorskip("ma_runtime.storage.obs")
    bucket = obs_endpoint.new_bucket()
    seed_tree(lambda key, data: obs_endpoint.put(bucket, key, data))
    job_env.update(obs_endpoint.env("v4"))
    result = run_ma(["--config", job_file(tmp_path, f"{scheme}://{bucket}"), *COMMAND], job_env, timeout=120)
    assert_staged(result, job_env)
    assert "testsk-secret-value" not in result.stderr


def test_a_restart_in_the_same_pod_does_not_fetch_again(tmp_path, job_env):
    job = job_file(tmp_path, local_bucket(tmp_path))
    assert run_ma(["--config", job, *COMMAND], job_env).returncode == 0
    job_env["MA_PROC_START_CNT"] = "2"
    again = run_ma(["--config", job, *COMMAND], job_env)
    assert again.returncode == 0 and "OK images=20" in again.stdout
    assert "code download already staged; not fetched again" in again.stderr


def test_missing_url_stops_with_storage_failed_naming_it(tmp_path, job_env):
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"inputs": [{"name": "data_url", "url": str(tmp_path / "nothing-here/")}]}))
    result = run_ma(["--config", str(job), "true"], job_env)
    assert result.returncode == 80 and "Traceback" not in result.stderr
    error = [line for line in result.stderr.splitlines() if "error,exiting" in line]
    assert len(error) == 1 and "nothing-here" in error[0]
    message = json.loads((log_dir(job_env) / "modelarts-job-local-worker-0-termination.json").read_text())
    assert message["stage"] == "stage-in" and message["exit_code"] == 80 and "nothing-here" in message["reason"]


def test_unreachable_endpoint_fails_within_the_retry_budget(tmp_path, job_env):
    pytest.importorskip("ma_runtime.storage.obs")
    job_env.update(MA_S3_ENDPOINT="http://127.0.0.1:9", OBS_ACCESS_KEY_ID="ak", OBS_SECRET_ACCESS_KEY="sk-secret",
                   MA_RUNTIME_STORAGE_RETRY_SECONDS="1")
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"code": {"url": "obs://bucket/code/"}}))
    result = run_ma(["--config", str(job), "true"], job_env, timeout=60)
    assert result.returncode == 80 and "obs://bucket/code/" in result.stderr
    assert "sk-secret" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "job, expected",
    [
        ({"code": {"url": "ftp://host/code"}}, "unsupported scheme 'ftp'"),
        ({"code": {"url": "obs:///no-bucket"}}, "has no bucket"),
        ({"inputs": [{"name": "data url", "url": "/x"}]}, "inputs[0]': name 'data url'"),
        ({"inputs": [{"name": "d", "url": "/x", "mode": "magic"}]}, "mode must be argument or env"),
        ({"outputs": [{"name": "o", "url": "/x", "predownload": "yes"}]}, "predownload must be true or false"),
        ({"inputs": {"name": "d"}}, "'inputs' must be a list"),
    ],
)
def test_bad_urls_and_channels_are_bad_configuration(tmp_path, job_env, job, expected):
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job))
    result = run_ma(["--config", str(path), "true"], job_env)
    assert result.returncode == 78 and expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_runtime_continuing_after_one_that_died_does_not_fetch_again(tmp_path, job_env):
    job = job_file(tmp_path, local_bucket(tmp_path))
    assert run_ma(["--config", job, *COMMAND], job_env).returncode == 0
    # What a runtime SIGKILLed during attempt 1 leaves: its record, not finished.
    record = next((Path(job_env["MA_HOME"]) / "modelarts" / ".ma-runtime").glob("attempt-*.json"))
    record.write_text(record.read_text().replace('"finished": true', '"finished": false'))
    again = run_ma(["--config", job, *COMMAND], job_env)
    assert again.returncode == 0 and "OK images=20" in again.stdout
    assert "continuing after a runtime that did not finish" in again.stderr
    assert "code download already staged; not fetched again" in again.stderr


def test_predownload_takes_whole_checkpoints_only_and_resumes_from_the_newest(tmp_path, job_env, obs_endpoint):
    # The store as a job killed mid-save left it: Trainer's checkpoint-120/ without trainer_state.json (with
    # safetensors' scratch file), Megatron's iter_0000030/ that the tracker never named, and scratch files.
    pytest.importorskip("ma_runtime.storage.obs")
    bucket = obs_endpoint.new_bucket()
    objects = {
        **{f"checkpoint-{step}/{name}": f"{name} {step}".encode() for step in (20, 100)
           for name in ("config.json", "model.safetensors", "trainer_state.json")},
        "checkpoint-120/config.json": b"{}", "checkpoint-120/rng_state_1.pth": b"rng",
        "checkpoint-120/.tmpQeIoOo": b"w",
        "megatron/latest_checkpointed_iteration.txt": b"20",
        "megatron/iter_0000020/mp_rank_00/model_optim_rng.pt": b"weights 20",
        "megatron/iter_0000030/mp_rank_00/model_optim_rng.pt": b"weights 30",
        ".tmpAbCdEf": b"scratch", "logs/metrics.jsonl.tmp": b"scratch", "logs/metrics.jsonl": b"{}\n",
    }
    for key, data in objects.items():
        obs_endpoint.put(bucket, f"runs/run-1/output/{key}", data)
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"outputs": [{"name": "train_url", "url": f"obs://{bucket}/runs/run-1/output/",
                                            "predownload": True, "sync": False}]}))
    job_env.update(obs_endpoint.env("v4"))
    result = run_ma(["--config", str(job), "sh", "-c", 'echo "resume=$MA_RESUME_CHECKPOINT"'], job_env, timeout=120)
    assert result.returncode == 0, result.stderr
    local = Path(job_env["MA_HOME"]) / "modelarts" / "outputs" / "train_url_0"
    fetched = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    assert fetched == sorted(key for key in objects if not key.startswith(("checkpoint-120/", "megatron/iter_0000030/"))
                             and not key.endswith(".tmp") and not key.startswith(".tmp"))
    warnings = [line for line in result.stderr.splitlines() if "left out an incomplete checkpoint" in line]
    assert len(warnings) == 2, result.stderr
    assert "folder=checkpoint-120" in warnings[0] and 'missing="no trainer_state.json"' in warnings[0]
    assert "folder=megatron/iter_0000030" in warnings[1] and "iteration.txt says 20, an earlier save" in warnings[1]
    # Every marker fetched carries one time (their download's order is not their saves'): the name decides,
    # numbers as numbers (100 after 20).
    markers = ("checkpoint-20/trainer_state.json", "checkpoint-100/trainer_state.json",
               "megatron/latest_checkpointed_iteration.txt")
    assert len({(local / marker).stat().st_mtime_ns for marker in markers}) == 1
    assert f"resume={local / 'checkpoint-100'}" in result.stdout
