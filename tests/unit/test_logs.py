"""The runtime's own lines: platform logfmt or JSON, on stderr and in the task log, masked."""

import json
import os
import re
import subprocess
import sys

import pytest

from ma_runtime.util.redact import MASK, Masker
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
    "text, secret, kept",
    [
        ("--password=abc123 --lr=1", "abc123", "--lr=1"),
        ("--api-token xyz789 --epochs 3", "xyz789", "--epochs 3"),
        ("AK=ABCDEFGHIJ1234567890", "ABCDEFGHIJ1234567890", "AK="),
        ("secret_key: 'a b c'", "a b c", "secret_key: "),
    ],
)
def test_masker_by_name_and_shape(text, secret, kept):
    masked = Masker().text(text)
    assert secret not in masked
    assert MASK in masked and kept in masked


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


# --- issue 10, items 5-7 and 9: the next word, escaped forms, names kept, linear time ------------------------


@pytest.mark.parametrize("option", ["--password", "-password", "--db-password", "--api_token", "--secret", "--sk"])
def test_an_option_named_like_a_secret_masks_the_next_word(option):
    words = ["python", "train.py", option, "hunter2", "--lr", "0.1"]
    assert Masker().data(words) == ["python", "train.py", option, MASK, "--lr", "0.1"]


def test_the_word_after_an_ordinary_option_or_an_assignment_is_kept():
    words = ["python", "t.py", "--task", "mnist", "--password=x1y2z3", "plain", "--token", "--lr", "1"]
    assert Masker().data(words) == ["python", "t.py", "--task", "mnist", f"--password={MASK}", "plain", "--token",
                                    "--lr", "1"]


def test_argv_with_a_secret_option_is_masked_in_the_starting_line(job_env):
    result = run_ma(["sh", "-c", "true", "sh", "--password", "hunter2", "--api-key", "k3y-v4lue"], job_env)
    assert result.returncode == 0
    logged = result.stderr + task_log(job_env).read_text()
    assert "starting command" in logged
    assert "hunter2" not in logged and "k3y-v4lue" not in logged


WRAPPED = "FQoGZXIvYXdzEJr\nAAAAfakeSessionTokenPart2xyz=="


@pytest.mark.parametrize(
    "form",
    [
        WRAPPED,  # as it is
        repr(WRAPPED),  # inside an exception's repr: the newline escaped
        repr(ValueError(f"Invalid header value {WRAPPED.encode()!r}")),
        json.dumps({"token": WRAPPED}),  # JSON-escaped
        "x-amz-security-token=" + __import__("urllib.parse").parse.quote(WRAPPED, safe=""),  # URL-encoded
        "token part: AAAAfakeSessionTokenPart2xyz==",  # one line of the wrapped value
    ],
)
def test_a_secret_value_is_masked_in_every_quoted_form(form):
    masked = Masker.from_environ({"OBS_SECURITY_TOKEN": WRAPPED}).text(form)
    assert "FQoGZXIvYXdzEJr" not in masked and "AAAAfakeSessionTokenPart2xyz" not in masked
    assert MASK in masked


@pytest.mark.parametrize(
    "message",
    [
        "no OBS credentials: OBS_ACCESS_KEY_ID and OBS_SECRET_ACCESS_KEY not set",
        "no OBS credentials: OBS_SECRET_ACCESS_KEY not set",
        "bad token: OBS_SECURITY_TOKEN contains a line break",
        "credentials from OBS_ACCESS_KEY_ID/OBS_SECRET_ACCESS_KEY/OBS_SECURITY_TOKEN",
        "secret: MY_APP_SECRET is empty",
    ],
)
def test_variable_names_in_the_runtimes_messages_are_never_masked(message):
    masker = Masker.from_environ({"MY_APP_SECRET": "", "OBS_SECRET_ACCESS_KEY": "real-secret-value-1"})
    assert masker.text(message) == message


def test_a_value_is_still_masked_when_it_is_not_a_variable_name():
    assert Masker().text("credentials: sk-live-123456") == f"credentials: {MASK}"


ADVERSARIAL = {"dashes": "-" * 200_000, "letters": "a" * 200_000, "secret words": "password" * 25_000,
               "open quotes": 'token="' * 30_000, "options": "--password " * 20_000, "assignments": "x=" * 100_000,
               "key shapes": "A1" * 100_000, "colons": "token: " * 30_000, "long key": "_" * 100_000 + "password"}


# Short ids: pytest puts the test's id in PYTEST_CURRENT_TEST, and 200 KB there overflows a child's exec.
@pytest.mark.parametrize("text", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_the_masker_is_linear_in_its_input(text):
    # A hang guard, not a speed test: the old patterns took 35 s for 16 000 dashes and grow with the
    # square of the length; 200 KB would take hours. Run in a child so a regression fails, not hangs.
    code = "import sys; from ma_runtime.util.redact import Masker; Masker(['a-secret-value']).text(sys.stdin.read())"
    done = subprocess.run([sys.executable, "-c", code], input=text, text=True, timeout=30)
    assert done.returncode == 0


def test_undecodable_bytes_are_written_escaped():
    assert Masker().text("/tmp/\udcff/x") == "/tmp/\\xff/x"
    assert Masker().data({"argv": ["/tmp/\udcff"]}) == {"argv": ["/tmp/\\xff"]}


def test_asyncio_is_imported_only_when_used():
    # structlog imports asyncio for methods the runtime never calls: a fifth of the start-up, deferred.
    code = (
        "import sys, ma_runtime.util.logs as logs\n"
        "assert 'asyncio.events' not in sys.modules, 'imported at start-up'\n"
        "logs.configure(); logs.get_logger().info('hello')\n"
        "assert 'asyncio.events' not in sys.modules, 'imported by a log line'\n"
        "import asyncio\n"
        "async def three(): return 3\n"
        "assert asyncio.run(three()) == 3\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "hello" in done.stderr



OPTIONAL_FOR_STRUCTLOG = ("rich", "better_exceptions", "colorama", "twisted", "greenlet")


@pytest.fixture
def optional_packages(tmp_path):
    """Stand-ins for the optional packages structlog probes for, each announcing its own import on stderr."""
    for name in OPTIONAL_FOR_STRUCTLOG:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"import sys\nprint('imported {name}', file=sys.stderr)\n")
    return tmp_path


def test_optional_packages_an_image_has_are_not_imported_for_structlog(optional_packages):
    # rich alone was ~130 ms of every start in an image that had it (structlog.dev imports it to style tracebacks).
    code = (
        "import sys, ma_runtime.util.logs as logs\n"
        "logs.configure(); logs.get_logger().info('hello')\n"
        f"assert not [n for n in {OPTIONAL_FOR_STRUCTLOG!r} if n in sys.modules], 'left in sys.modules'\n"
        # The job's own code in this process (the tests, a tool) still imports them: nothing was left hidden.
        "import rich, greenlet\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(optional_packages), *sys.path[1:]])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert "hello" in done.stderr
    assert done.stderr.count("imported ") == 2 and "imported rich" in done.stderr, done.stderr


# --- issue 29, item 9: a command line of many words is masked in one pass, word for word as `text` does ----------

TRICKY_WORDS = [
    "--password=hunter2x", "--api-token", "tok3n-value", "password: x1y2z3", "AKIA1234567890ABCDEF",
    "A1B2C3D4E5F6G7H8I9J0A1B2C3D4E5F6G7H8I9J0", "AbCdEfGhIj0123456789", "prefix-a-secret-value-suffix",
    "ſecret=folded-by-case", "PRIVATE_KEY='quoted value'", 'token="unclosed', "--lr=0.1", "", "-", "--",
    "/tmp/\udcff/x", "é-password=é", "capital", "rapid=1", "x" * 19, "y" * 40, "credentials: OBS_ACCESS_KEY_ID",
]


@pytest.mark.parametrize("rotation", range(0, len(TRICKY_WORDS), 3))
def test_words_are_masked_each_as_text_masks_it_alone(rotation):
    masker = Masker(["a-secret-value"], names=["OBS_ACCESS_KEY_ID"])
    words = TRICKY_WORDS[rotation:] + TRICKY_WORDS[:rotation]
    expected = [masker.text(word) for word in words]
    after_option = [i + 1 for i, word in enumerate(words[:-1]) if word == "--api-token"]
    for index in after_option:
        expected[index] = MASK  # the word after an option named like a secret, masked whole
    assert masker.words(words) == expected
    assert "hunter2x" not in str(masker.words(words)) and "a-secret-value" not in str(masker.words(words))


def test_many_hyperparameters_are_masked_in_one_pass():
    # 40 000 `--name=value` words, two of them secrets: the one-pass path finds exactly those.
    words = [f"--hp_{i}={i / 2}" for i in range(40_000)]
    words[123], words[39_999] = "--db_password=s3cr3t-value", "--x=AKIA1234567890ABCDEF"
    masked = Masker().words(["python", "train.py", *words])
    assert masked[2 + 123] == f"--db_password={MASK}" and masked[2 + 39_999] == f"--x={MASK}"
    assert masked[2:2 + 123] == words[:123]
