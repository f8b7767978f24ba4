"""JobSpec: precedence, defaults, and every bad input as one line with exit code 78."""

import json
from pathlib import Path

import pytest

from ma_runtime import spec
from ma_runtime.errors import ConfigError
from tests.conftest import run_ma


def write_job(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


def test_precedence_is_flags_then_env_then_file_then_defaults(tmp_path):
    job = write_job(tmp_path, "num_gpus: 2\nnum_hosts: 3\ntask_name: learner\n")
    env = {"MA_HOME": str(tmp_path), "MA_NUM_GPUS": "4", "MA_NUM_HOSTS": "5"}
    resolved = spec.load({"num_gpus": "8"}, env, job)
    assert (resolved.num_gpus, resolved.sources["num_gpus"]) == (8, "flag")
    assert (resolved.num_hosts, resolved.sources["num_hosts"]) == (5, "env")
    assert (resolved.task_name, resolved.sources["task_name"]) == ("learner", "file")
    assert (resolved.task_index, resolved.sources["task_index"]) == (0, "default")


def test_paths_derive_from_ma_home_unless_set(tmp_path):
    resolved = spec.load({}, {"MA_HOME": str(tmp_path), "MA_LOG_DIR": str(tmp_path / "logs")})
    assert resolved.mount_path == tmp_path / "modelarts"
    assert resolved.job_dir == tmp_path / "modelarts" / "user-job-dir"
    assert resolved.log_dir == tmp_path / "logs"


def test_laptop_fallback_when_platform_home_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(spec, "PLATFORM_HOME", tmp_path / "no-such-home")
    monkeypatch.setenv("HOME", str(tmp_path))
    resolved = spec.load({}, {})
    assert resolved.ma_home == tmp_path / ".ma-runtime"
    assert any("using" in note and ".ma-runtime" in note for note in resolved.notes)


def test_empty_variable_counts_as_unset(tmp_path):
    assert spec.load({}, {"MA_HOME": str(tmp_path), "MA_NUM_GPUS": ""}).num_gpus == 0


@pytest.mark.parametrize(
    "vj_name, stem",
    [
        ("ma-job-95f6", "modelarts-job-95f6-worker-0"),
        ("modelarts-job-95f6", "modelarts-job-95f6-worker-0"),
        (None, "modelarts-job-local-worker-0"),
        ("custom", "modelarts-job-custom-worker-0"),
    ],
)
def test_task_log_name_follows_the_platform(tmp_path, vj_name, stem):
    env = {"MA_HOME": str(tmp_path)}
    if vj_name:
        env["MA_VJ_NAME"] = vj_name
    assert spec.load({}, env).task_log_path == tmp_path / "modelarts" / "log" / f"{stem}.log"


def test_task_log_name_uses_task_name_and_index(tmp_path):
    env = {"MA_HOME": str(tmp_path), "MA_VJ_NAME": "ma-job-1", "MA_TASK_NAME": "learner", "VC_TASK_INDEX": "3"}
    assert spec.load({}, env).task_log_path.name == "modelarts-job-1-learner-3.log"


def test_hyperparameters_keep_order_and_render_booleans(tmp_path):
    job = write_job(tmp_path, "hyperparameters:\n  lr: 0.01\n  use_amp: true\n  name: a b\n")
    resolved = spec.load({}, {"MA_HOME": str(tmp_path)}, job)
    assert resolved.hyperparameters == (("lr", "0.01"), ("use_amp", "True"), ("name", "a b"))


@pytest.mark.parametrize(
    "env, text, expected",
    [
        ({"MA_NUM_GPUS": "abc"}, None, "MA_NUM_GPUS='abc' is not a whole number"),
        ({"VC_TASK_INDEX": "-1"}, None, "VC_TASK_INDEX='-1' must be >= 0"),
        ({"MA_NUM_HOSTS": "0"}, None, "MA_NUM_HOSTS='0' must be >= 1"),
        ({"MA_RUNTIME_STOP_GRACE_SECONDS": "soon"}, None, "MA_RUNTIME_STOP_GRACE_SECONDS='soon' is not a number"),
        ({"MA_RUNTIME_LOG_FORMAT": "xml"}, None, "MA_RUNTIME_LOG_FORMAT='xml' must be one of logfmt, json"),
        ({"MA_VJ_NAME": "a/b"}, None, "MA_VJ_NAME='a/b' is not a valid Volcano job name"),
        ({}, "num_gpus: [1, 2\n", "YAML syntax error at line 2"),
        ({}, "num_gpu: 1\n", "unknown key 'num_gpu'"),
        ({}, "- a\n- b\n", "the top level must be a mapping"),
        ({}, "num_gpus: abc\n", "job file key 'num_gpus'='abc' is not a whole number"),
        ({}, "num_gpus: {a: 1}\n", "job file key 'num_gpus': expected a single number or string"),
        ({}, "hyperparameters: [1]\n", "'hyperparameters' must be a mapping"),
        ({}, "hyperparameters: {'bad name': 1}\n", "hyperparameters.bad name"),
        ({}, "hyperparameters: {lr: null}\n", "hyperparameters.lr"),
    ],
)
def test_bad_input_is_one_clear_line_with_exit_code_78(tmp_path, job_env, env, text, expected):
    job_env.update(env)
    args = ["--config", write_job(tmp_path, text)] if text is not None else []
    result = run_ma([*args, "true"], job_env)
    assert result.returncode == 78
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "error,exiting" in lines[0]
    assert "Traceback" not in result.stderr


def test_missing_job_file_and_unwritable_log_dir(tmp_path, job_env):
    missing = run_ma(["--config", str(tmp_path / "nope.yaml"), "true"], job_env)
    assert missing.returncode == 78 and "no such job file" in missing.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    job_env["MA_LOG_DIR"] = str(blocker / "log")
    unwritable = run_ma(["true"], job_env)
    assert unwritable.returncode == 78 and "cannot write the task log" in unwritable.stderr
    assert "Traceback" not in unwritable.stderr


def test_config_file_from_environment(tmp_path, job_env):
    job_env["MA_RUNTIME_CONFIG"] = write_job(tmp_path, "num_gpus: 6\n")
    printed = json.loads(run_ma(["--print-config"], job_env).stdout)
    assert printed["settings"]["num_gpus"] == 6 and printed["sources"]["num_gpus"] == "file"


def test_print_config_shows_resolved_values_with_sources(tmp_path, job_env):
    job_env["MA_NUM_GPUS"] = "4"
    result = run_ma(["--print-config", "--task-index", "2", "python", "train.py"], job_env)
    assert result.returncode == 0
    printed = json.loads(result.stdout)
    assert printed["settings"]["num_gpus"] == 4 and printed["sources"]["num_gpus"] == "env"
    assert printed["settings"]["task_index"] == 2 and printed["sources"]["task_index"] == "flag"
    assert printed["argv"] == ["python", "train.py"]
    assert printed["task_log"].endswith("modelarts-job-local-worker-2.log")
    assert not Path(printed["task_log"]).exists(), "--print-config must not start anything"


def test_print_config_masks_secrets(tmp_path, job_env):
    job_env["OBS_SECRET_ACCESS_KEY"] = "s3cr3t-value-from-env"
    job = write_job(tmp_path, "hyperparameters:\n  db_password: hunter2hunter2\n  lr: 0.1\n")
    result = run_ma(
        ["--config", job, "--print-config", "--", "python", "t.py", "--api-token=tok-123456", "s3cr3t-value-from-env"],
        job_env,
    )
    assert result.returncode == 0
    for secret in ("hunter2hunter2", "tok-123456", "s3cr3t-value-from-env"):
        assert secret not in result.stdout
    printed = json.loads(result.stdout)
    assert printed["hyperparameters"] == {"db_password": "******", "lr": "0.1"}


def test_load_raises_config_error_not_exit(tmp_path):
    with pytest.raises(ConfigError) as caught:
        spec.load({"num_gpus": "x"}, {"MA_HOME": str(tmp_path)})
    assert "--num-gpus='x'" in caught.value.reason
