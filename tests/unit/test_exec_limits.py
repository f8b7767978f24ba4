"""E2BIG at every exec the runtime makes (issue 24, item 8): the one helper's line and its model of Linux's limits,
checked against real execs; the worker spawn, the uploader, the accelerator tools and ssh-keygen each report it."""

import os
import re
import subprocess
import time

import pytest

from ma_runtime import errors
from ma_runtime import spec as spec_module
from ma_runtime.errors import CommandNotExecutable, exceeds_exec_limits, exec_total_limit, too_large_for_exec
from ma_runtime.launch import sshd_files
from ma_runtime.process.lifecycle import ToolError, run_tool
from ma_runtime.process.worker import spawn
from ma_runtime.sync import control
from tests.recording import Log

LINE = re.compile(r"the environment \(or the arguments\) is too large for exec: (\d+) bytes; largest: (.+?) "
                  r"\((\d+) bytes\)")
BASE = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def refused(argv, env) -> bool:
    """Whether Linux refuses this exec with E2BIG: the truth the model is checked against."""
    try:
        subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    except OSError as exc:
        assert exc.errno == 7
        return True
    return False


@pytest.mark.parametrize("length", [errors.MAX_ARG_STRLEN - 10, errors.MAX_ARG_STRLEN - 6, errors.MAX_ARG_STRLEN - 5,
                                    errors.MAX_ARG_STRLEN, 3_000_000])
def test_one_string_over_max_arg_strlen_is_what_linux_refuses(length):
    env = {**BASE, "BIG": "x" * length}  # BIG=...\0 is length + 5 bytes
    assert exceeds_exec_limits(["/bin/true"], env) == refused(["/bin/true"], env) == (length + 5 > 131072)


@pytest.mark.parametrize("share", [0.9, 0.99, 1.01, 1.2])
def test_the_total_is_what_linux_refuses(share):
    count = int(exec_total_limit() * share) // 100_000
    env = {**BASE, **{f"V{index:03d}": "x" * (100_000 - 6) for index in range(count)}}
    remainder = int(exec_total_limit() * share) - sum(len(k) + len(v) + 2 for k, v in env.items())
    if remainder > 10:
        env["REST"] = "y" * (remainder - 6)
    assert exceeds_exec_limits(["/bin/true"], env) == refused(["/bin/true"], env)


def test_the_line_names_the_largest_and_the_limit_it_is_past():
    line = too_large_for_exec(["prog", "a" * 10], {"SMALL": "1", "BIG": "x" * 200_000})
    found = LINE.fullmatch(line.split(", over")[0])
    assert found and found.group(2) == "BIG" and int(found.group(3)) == 200_005
    assert int(found.group(1)) == 5 + 11 + len("SMALL=1") + 1 + 200_005
    assert line.endswith("over Linux's 128 KiB limit on one string (MAX_ARG_STRLEN)")
    assert "largest: argument 1 (200001 bytes)" in too_large_for_exec(["prog", "a" * 200_000], {})
    many = {f"V{index}": "x" * 100_000 for index in range(30)}
    assert too_large_for_exec([], many).endswith(f"over the {exec_total_limit()} bytes Linux takes for all of them "
                                                 "(a quarter of `ulimit -s`)")


def test_a_worker_whose_environment_is_too_large_is_126_with_the_line():
    with pytest.raises(CommandNotExecutable) as caught:
        spawn(["true"], {**BASE, "BIG": "x" * 200_000}, None, [], [])
    assert caught.value.exit_code == 126
    assert LINE.search(caught.value.reason) and "largest: BIG (200005 bytes)" in caught.value.reason
    assert caught.value.reason.startswith("cannot execute true: ")
    assert "pass large data in a file" in caught.value.hint


@pytest.fixture
def huge_environment(monkeypatch):
    """The runtime's own environment past what exec takes: every helper started from it meets E2BIG."""
    monkeypatch.setenv("MA_TEST_HUGE", "x" * 200_000)


def test_the_uploader_that_cannot_start_says_why_in_one_line(huge_environment):
    log = Log()
    uploader = control.Uploader(spec_module.load({}, os.environ, None), log)
    uploader.start()
    (warning,) = log.fields("the upload process could not be started; files will be synced at the end")
    assert LINE.match(warning["error"]) and "largest: MA_TEST_HUGE (200014 bytes)" in warning["error"]
    result = uploader.final(time.monotonic() + 5)
    assert not result.answered and LINE.search(result.error)


def test_an_accelerator_tool_that_cannot_start_says_why(huge_environment):
    with pytest.raises(ToolError) as caught:
        run_tool(["true"], 5)
    assert caught.value.code == "failed" and LINE.search(caught.value.message)


def test_ssh_keygen_that_cannot_start_is_one_line(huge_environment, tmp_path):
    with pytest.raises(errors.ConfigError) as caught:
        sshd_files.keygen(tmp_path / "key", "ssh-keygen", "sshd's host key")
    assert LINE.search(caught.value.reason) and "cannot run ssh-keygen" in caught.value.reason
