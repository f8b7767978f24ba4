"""The runtime's own lines: platform logfmt or JSON, on stderr and in the task log, masked."""

import json
import re

import pytest

from ma_runtime.redact import MASK, Masker
from tests.conftest import run_ma, task_log

LOGFMT_LINE = re.compile(r'^time="[0-9T:.\-]+Z" level=(info|warning|error|debug) msg="[^"]*" Component=ma-runtime( |$)')


def runtime_lines(text):
    return [line for line in text.splitlines() if "Component" in line]


def test_logfmt_lines_in_the_platform_style(job_env):
    result = run_ma(["true"], job_env)
    lines = runtime_lines(result.stderr)
    assert lines and all(LOGFMT_LINE.match(line) for line in lines), lines
    assert any('msg="starting command"' in line for line in lines)
    assert runtime_lines(task_log(job_env).read_text()) == lines


def test_json_lines_on_request(job_env):
    job_env["MA_RUNTIME_LOG_FORMAT"] = "json"
    result = run_ma(["true"], job_env)
    records = [json.loads(line) for line in result.stderr.splitlines()]
    assert records and all(r["Component"] == "ma-runtime" and r["level"] and r["time"] for r in records)
    assert any(r["msg"] == "command exited" and r["exit_code"] == 0 for r in records)


def test_runtime_lines_on_stderr_worker_streams_kept(job_env):
    result = run_ma(["sh", "-c", "echo to-out; echo to-err >&2"], job_env)
    assert result.stdout == "to-out\n"
    assert "to-err\n" in result.stderr and "Component=ma-runtime" in result.stderr
    assert "Component" not in result.stdout


def test_secrets_never_reach_the_runtime_log(tmp_path, job_env):
    job_env["OBS_SECRET_ACCESS_KEY"] = "env-secret-value-123"
    job = tmp_path / "job.yaml"
    job.write_text("hyperparameters:\n  password: hunter2hunter2\n")
    result = run_ma(["--config", str(job), "true", "--token=tok-abcdef", "env-secret-value-123"], job_env)
    assert result.returncode == 0
    logged = result.stderr + task_log(job_env).read_text()
    for secret in ("hunter2hunter2", "tok-abcdef", "env-secret-value-123"):
        assert secret not in logged
    assert MASK in logged


@pytest.mark.parametrize(
    "text, kept",
    [
        ("--password=abc --lr=1", "--lr=1"),
        ("--api-token xyz --epochs 3", "--epochs 3"),
        ("AK=ABCDEFGHIJ1234567890", "AK="),
        ("secret_key: 'a b c'", "secret_key: "),
    ],
)
def test_masker_by_name_and_shape(text, kept):
    masked = Masker().text(text)
    assert MASK in masked and kept in masked
    assert "abc" not in masked.replace("ABC", "") or "abc" not in text


def test_masker_leaves_ordinary_text_alone():
    text = "waiting for token refresh; WORKERWORKERWORKERWO step=1234"
    assert Masker().text(text) == text


def test_masker_masks_known_values_inside_strings_and_by_key():
    masker = Masker(["the-secret-value"])
    assert masker.text("url=https://x/the-secret-value/y") == f"url=https://x/{MASK}/y"
    assert masker.data({"nested": {"OBS_ACCESS_KEY_ID": "AKVALUE", "ok": 1}}) == {
        "nested": {"OBS_ACCESS_KEY_ID": MASK, "ok": 1}
    }


def test_log_level_filters_runtime_lines(job_env):
    job_env["MA_RUNTIME_LOG_LEVEL"] = "warning"
    result = run_ma(["sh", "-c", "echo worker-line >&2"], job_env)
    assert result.stderr == "worker-line\n"


def test_task_log_is_named_after_the_volcano_job(job_env):
    job_env.update(MA_VJ_NAME="ma-job-95f661bd", MA_TASK_NAME="worker", VC_TASK_INDEX="1")
    run_ma(["echo", "hello"], job_env)
    assert "hello" in task_log(job_env, "modelarts-job-95f661bd-worker-1").read_text().splitlines()


def test_workers_carry_the_lineage_of_every_runtime_above_them(job_env):
    job_env["MA_RUNTIME_LINEAGE"] = "outer"
    result = run_ma(["sh", "-c", "echo $MA_RUNTIME_LINEAGE"], job_env)
    run_id = re.search(r"run_id=(\w+)", result.stderr).group(1)
    assert result.stdout == f"outer,{run_id}\n"
