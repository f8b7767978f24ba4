"""Commands and options: ma-runtime, ma-run, where our options end and the command starts."""

import json
import subprocess
import sys

import pytest

from ma_runtime import __version__
from tests.conftest import MA_RUN, MA_RUNTIME, run_ma


def run(argv, env):
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def test_version(job_env):
    assert run([MA_RUNTIME, "version"], job_env).stdout == f"ma-runtime {__version__}\n"
    assert run([MA_RUNTIME, "--version"], job_env).stdout == f"ma-runtime {__version__}\n"


@pytest.mark.parametrize(
    "argv",
    [
        [MA_RUNTIME, "--help"],
        [MA_RUNTIME, "run", "--help"],
        [MA_RUN, "--help"],
        [MA_RUNTIME, "version", "--help"],
        [MA_RUNTIME, "preflight", "--help"],
        [MA_RUNTIME.replace("ma-runtime", "ma-preflight"), "--help"],
    ],
)
def test_help_on_each_command(job_env, argv):
    result = run(argv, job_env)
    assert result.returncode == 0 and "usage:" in result.stdout


def test_ma_run_help_documents_variables_and_exit_codes(job_env):
    text = run([MA_RUN, "--help"], job_env).stdout
    for name in ("MA_NUM_GPUS", "VC_TASK_INDEX", "MA_RUNTIME_STOP_GRACE_SECONDS", "MA_RUNTIME_CONFIG",
                 "--run-method MA_RUN_METHOD", "MA_RUNTIME_CODE_URL", "docs/reference/settings.md"):
        assert name in text
    for code in ("78  bad configuration", "79  preflight failed", "127  command not found"):
        assert code in text


def test_first_non_option_word_starts_the_command(job_env):
    script = "import json, sys; print(json.dumps(sys.argv[1:]))"
    result = run_ma(["--num-gpus", "2", sys.executable, "-c", script, "--lr", "1", "--num-gpus", "9"], job_env)
    assert result.returncode == 0
    assert json.loads(result.stdout) == ["--lr", "1", "--num-gpus", "9"]


def test_double_dash_separates_options_from_command(tmp_path, job_env):
    job = tmp_path / "job.yaml"
    job.write_text("num_gpus: 3\n")
    script = "import os; print(os.environ['MA_NUM_GPUS'])"
    result = run_ma(["--config", str(job), "--", sys.executable, "-c", script], job_env)
    assert result.stdout == "3\n"


def test_ma_runtime_run_is_ma_run(job_env):
    result = run([MA_RUNTIME, "run", "--num-gpus=5", "--", "sh", "-c", "echo $MA_NUM_GPUS"], job_env)
    assert result.stdout == "5\n"


def test_command_sees_the_resolved_job_and_the_counters(job_env):
    job_env["MA_PROC_START_CNT"] = "3"
    names = ("MA_PROC_START_CNT", "MA_SCHEDULE_CNT", "MA_LOG_DIR")
    script = f"import os; print(*(os.environ[n] for n in {names!r}))"
    result = run_ma([sys.executable, "-c", script], job_env)
    count, schedule, log_dir = result.stdout.split()
    assert (count, schedule) == ("3", "1") and log_dir.endswith("/modelarts/log")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--bogus", "python"], "unknown option --bogus"),
        (["--max-restart", "2", "python"], "unknown option --max-restart (did you mean --max-restarts?)"),
        (["--max-restarts=2", "--log-levle=debug", "python"], "unknown option --log-levle (did you mean --log-level?)"),
        (["--num-gpus"], "expected one argument"),
        ([], "no command given"),
    ],
)
def test_usage_errors_are_one_line_with_exit_code_78(job_env, argv, expected):
    result = run_ma(argv, job_env)
    assert result.returncode == 78
    assert len(result.stderr.strip().splitlines()) == 1 and expected in result.stderr
    assert "Traceback" not in result.stderr


def test_print_config_is_json_even_without_command(job_env):
    assert json.loads(run_ma(["--print-config"], job_env).stdout)["command"] == []


@pytest.mark.parametrize("argv", [[""], [" ", "x"], ["--"]])
def test_an_empty_or_blank_argument_to_a_tool_is_one_line_and_78(job_env, argv):
    result = run([MA_RUNTIME, "preflight", *argv], job_env)
    assert result.returncode == 78 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_an_unknown_option_of_a_tool_names_the_one_it_misspells(job_env):
    # argparse's own "unrecognized arguments" (the operators' tools) gets the suggestion too.
    result = run([MA_RUNTIME, "preflight", "--onyl", "dns"], job_env)
    assert result.returncode == 78
    assert "unrecognized arguments: --onyl dns (did you mean --only?)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("variable, hint", [
    ("MA_RUNTIME_MAX_RESTART", "did you mean MA_RUNTIME_MAX_RESTARTS?"),
    ("MA_RUNTIME_ZQXJ", "no setting reads it"),
])
def test_a_variable_with_the_runtime_s_prefix_that_nothing_reads_is_one_warning(job_env, variable, hint):
    result = run_ma(["true"], {**job_env, variable: "2"})
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if 'msg="unknown variable"' in line]
    assert len(warnings) == 1 and "level=warning" in warnings[0]
    assert f"variable={variable}" in warnings[0] and hint in warnings[0]
    plan = run([MA_RUNTIME, "plan", "--", "true"], {**job_env, variable: "2"})
    assert plan.returncode == 0 and f"variable={variable}" in plan.stderr  # what plan and the tools load, too


def test_the_runtime_s_own_variables_are_no_warning(job_env):
    result = run_ma(["true"], {**job_env, "MA_RUNTIME_MAX_RESTARTS": "2", "MA_RUNTIME_TESTS_STRICT": "1"})
    assert result.returncode == 0 and "unknown variable" not in result.stderr


def test_plan_shows_the_plan_when_the_launcher_is_not_installed(job_env):
    # plan starts nothing: a launcher missing where the run would look is a warning, and the plan is still shown.
    env = {**job_env, "MA_RUN_METHOD": "msrun", "PATH": "/usr/bin:/bin"}
    result = run([MA_RUNTIME, "plan", "--", "python3", "train.py"], env)
    assert result.returncode == 0, result.stderr
    assert "warning: MA_RUN_METHOD=msrun, but msrun is not installed" in result.stdout
    assert "the run would stop here with exit 78" in result.stdout
    assert "[" in result.stdout and "msrun" in result.stdout.split("warning:", 1)[1]  # the worker's line follows
    assert run_ma(["python3", "train.py"], env).returncode == 78  # the run itself still refuses
