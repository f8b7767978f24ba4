"""Every exit code and the common signal deaths pass through ma-run unchanged."""

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import run_ma


def test_every_exit_code_0_to_255_passes_through(job_env):
    def exit_with(code):
        return run_ma(["sh", "-c", f"exit {code}"], job_env).returncode

    with ThreadPoolExecutor(4) as pool:
        observed = list(pool.map(exit_with, range(256)))
    assert observed == list(range(256))


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSEGV, signal.SIGTERM, signal.SIGABRT, signal.SIGINT])
def test_death_by_signal_n_gives_128_plus_n(job_env, signum):
    assert run_ma(["sh", "-c", f"kill -{int(signum)} $$"], job_env).returncode == 128 + signum


def test_command_not_found_and_not_executable(tmp_path, job_env):
    missing = run_ma(["no-such-program-xyz"], job_env)
    assert missing.returncode == 127
    assert "command not found: no-such-program-xyz" in missing.stderr and "Traceback" not in missing.stderr
    script = tmp_path / "script.sh"
    script.write_text("echo hi\n")
    denied = run_ma([str(script)], job_env)
    assert denied.returncode == 126
    assert "cannot execute" in denied.stderr and "Traceback" not in denied.stderr
