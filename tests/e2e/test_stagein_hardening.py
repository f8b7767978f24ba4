"""Stage-in against hostile input, end to end: `ma-run` as a real process, the real SDK against moto.

The findings of issue 10 as a user meets them: a code URL ending in `..`, a line-wrapped
security token, a dead endpoint with a small retry budget, a missing object, a bucket
holding keys shaped to hurt (the engine's own names, a 300-byte name), and something
other than a file at the stage-in record. Each ends in one line, the documented exit
code, no traceback, no secret, and nothing overwritten.
"""

import json
import os
import stat
import time
from pathlib import Path

import pytest

from tests.conftest import log_dir, run_ma, task_log
from tests.storage_env import refusing_endpoint

pytest.importorskip("ma_runtime.storage.obs")

TOKEN = "Tok-Secret-Line-One\nTok-Secret-Line-Two"


def mount(env) -> Path:
    return Path(env["MA_HOME"]) / "modelarts"


def error_lines(result):
    return [line for line in result.stderr.splitlines() if "error,exiting" in line]


def termination(env):
    return json.loads((log_dir(env) / "modelarts-job-local-worker-0-termination.json").read_text())


def snapshot(root: Path):
    return {str(path.relative_to(root)): path.read_bytes() for path in root.rglob("*") if path.is_file()}


def _seed_mount(env):
    """What an earlier attempt left in MA_MOUNT_PATH: an input and a task log."""
    (mount(env) / "inputs" / "data_url_0").mkdir(parents=True)
    (mount(env) / "inputs" / "data_url_0" / "x.txt").write_bytes(b"the input")
    task_log(env).parent.mkdir(parents=True)
    task_log(env).write_bytes(b"the earlier log\n")


@pytest.mark.parametrize("kind", ["obs", "local"])
def test_a_code_url_ending_in_dot_dot_is_bad_configuration_and_touches_nothing(tmp_path, job_env, obs_endpoint,
                                                                               kind):
    if kind == "obs":
        bucket = obs_endpoint.new_bucket()
        for key in ("tra/../inputs/data_url_0/x.txt", "tra/../log/modelarts-job-local-worker-0.log", "tra/x.py"):
            obs_endpoint.put(bucket, key, b"overwritten")
        job_env.update(obs_endpoint.env("v4"))
        job_env["MA_RUNTIME_CODE_URL"] = f"obs://{bucket}/tra/.."
    else:
        source = tmp_path / "src" / "tra"
        (source.parent / "inputs" / "data_url_0").mkdir(parents=True)
        (source.parent / "inputs" / "data_url_0" / "x.txt").write_bytes(b"overwritten")
        source.mkdir()
        job_env["MA_RUNTIME_CODE_URL"] = f"file://{source}/.."
    _seed_mount(job_env)
    before = snapshot(mount(job_env))

    result = run_ma(["true"], job_env, timeout=60)

    assert result.returncode == 78 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "MA_RUNTIME_CODE_URL" in result.stderr
    assert snapshot(mount(job_env)) == before


def test_a_line_wrapped_security_token_is_bad_configuration_and_never_shown(tmp_path, job_env, obs_endpoint):
    bucket = obs_endpoint.new_bucket()
    obs_endpoint.put(bucket, "code/train.py", b"print('hi')\n")
    job_env.update(obs_endpoint.env("v2"))  # v2 sends the token as a header, where a newline fails
    job_env.update(OBS_SECURITY_TOKEN=TOKEN, MA_RUNTIME_CODE_URL=f"obs://{bucket}/code/")

    result = run_ma(["true"], job_env, timeout=60)

    assert result.returncode == 78 and "Traceback" not in result.stderr
    (line,) = error_lines(result)
    assert "OBS_SECURITY_TOKEN" in line and "control character" in line
    message = termination(job_env)
    assert (message["exit_code"], message["stage"]) == (78, "stage-in")
    for text in (result.stderr, task_log(job_env).read_text(), json.dumps(message)):
        assert "Tok-Secret" not in text and "Line-Two" not in text


@pytest.mark.parametrize("kind", ["hanging", "refusing"])
def test_a_dead_endpoint_ends_the_run_within_its_budget_naming_endpoint_and_url_once(tmp_path, job_env, request,
                                                                                     kind):
    endpoint = request.getfixturevalue("hanging_endpoint") if kind == "hanging" else refusing_endpoint()
    job_env.update(MA_S3_ENDPOINT=endpoint, OBS_ACCESS_KEY_ID="ak", OBS_SECRET_ACCESS_KEY="sk-secret-value",
                   MA_RUNTIME_STORAGE_RETRY_SECONDS="3", MA_RUNTIME_CODE_URL="obs://bucket/code/")
    started = time.monotonic()

    result = run_ma(["true"], job_env, timeout=120)

    # The budget (3 s), one socket timeout (3 s, never more than the budget), and start-up and slack.
    assert time.monotonic() - started < 3 + 3 + 10
    assert result.returncode == 80 and "Traceback" not in result.stderr
    (line,) = error_lines(result)
    assert endpoint in line and line.count("obs://bucket/code/") == 1
    assert "sk-secret-value" not in result.stderr


def test_a_missing_object_names_its_url_once_and_the_endpoint(tmp_path, job_env, obs_endpoint):
    bucket = obs_endpoint.new_bucket()
    job_env.update(obs_endpoint.env("v4"))
    job_env["MA_RUNTIME_CODE_URL"] = f"obs://{bucket}/nothing"

    result = run_ma(["true"], job_env, timeout=60)

    assert result.returncode == 80
    (line,) = error_lines(result)
    assert line.count(f"obs://{bucket}/nothing") == 1 and obs_endpoint.url in line
    assert termination(job_env)["reason"].count(f"obs://{bucket}/nothing") == 1


HOSTILE_KEYS = {
    "data/c/b.txt": b"bbbb",
    "data/c/.b.txt.ma-partial": b"victim2",  # the old partial name of c/b.txt: now just a file
    "data/" + "x" * 300: b"a 300-byte name",  # refused, named, and the rest goes on
    "data/.ma-runtime-partial/p.ma-partial": b"the staging folder's name",  # refused
    "data/ok.txt": b"fine",
}


def test_a_bucket_of_hostile_keys_stages_the_rest_and_names_what_it_refused(tmp_path, job_env, obs_endpoint):
    bucket = obs_endpoint.new_bucket()
    for key, data in HOSTILE_KEYS.items():
        obs_endpoint.put(bucket, key, data)
    job_env.update(obs_endpoint.env("v4"))
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"inputs": [{"name": "data_url", "url": f"obs://{bucket}/data/"}]}))

    result = run_ma(["--config", str(job), "true"], job_env, timeout=120)

    assert result.returncode == 0, result.stderr
    staged = mount(job_env) / "inputs" / "data_url_0"
    assert snapshot(staged) == {"c/b.txt": b"bbbb", "c/.b.txt.ma-partial": b"victim2", "ok.txt": b"fine"}
    refusals = [line for line in result.stderr.splitlines() if "download refused a key" in line]
    assert len(refusals) == 2 and any("x" * 300 in line and "300 bytes long" in line for line in refusals)
    assert "refused=2" in result.stderr


@pytest.mark.parametrize("start", ["1", "2"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_something_else_at_the_stage_in_record_is_set_aside_and_kept(tmp_path, job_env, kind, start):
    """Issue 24: a record that is not one (read on a restart, written on a first start) is set aside, kept under
    another name, with one warning; the code is fetched and the run goes on."""
    source = tmp_path / "code"
    source.mkdir()
    (source / "train.py").write_bytes(b"print('hi')\n")
    record = mount(job_env) / ".ma-runtime" / "staged.json"
    record.parent.mkdir(parents=True)
    os.mkfifo(record) if kind == "fifo" else record.mkdir()
    job_env.update(MA_RUNTIME_CODE_URL=f"{source}/", MA_PROC_START_CNT=start)  # 2: a restart reads the record first

    result = run_ma(["true"], job_env, timeout=60)

    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if 'msg="record set aside"' in line]
    assert f"path={record}" in line and ("a FIFO" if kind == "fifo" else "a directory") in line
    (kept,) = record.parent.glob("staged.json.set-aside-*")
    assert stat.S_ISFIFO(os.lstat(kept).st_mode) if kind == "fifo" else kept.is_dir()
    assert json.loads(record.read_text())  # the record of this run's stage-in
