"""CI's promise that it cannot pass by skipping (tests/suite_plugin.py, MA_RUNTIME_TESTS_STRICT): a real pytest run
of a small test file, with the plugin as the suite loads it."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SKIPPING = '''
import pytest

def test_needs_a_tool():
    pytest.skip("mpirun is not installed")

def test_a_fact_of_this_machine():
    pytest.skip("root reads every folder, so the unreadable case cannot be made")

def test_runs():
    assert True
'''


def _pytest(tmp_path: Path, strict: bool):
    (tmp_path / "test_sample.py").write_text(SKIPPING)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MA_RUNTIME_TESTS_STRICT", None)
    if strict:
        env["MA_RUNTIME_TESTS_STRICT"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.suite_plugin", "-p", "no:cacheprovider",
                           "test_sample.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_skip_for_a_missing_tool_fails_the_run_in_strict_mode(tmp_path):
    result = _pytest(tmp_path, strict=True)
    assert result.returncode == 1, result.stdout
    assert "1 failed" in result.stdout and "1 passed" in result.stdout and "1 skipped" in result.stdout
    assert "skipped in strict mode (MA_RUNTIME_TESTS_STRICT=1)" in result.stdout
    assert "mpirun is not installed" in result.stdout


def test_without_strict_mode_skips_are_counted_per_reason(tmp_path):
    result = _pytest(tmp_path, strict=False)
    assert result.returncode == 0, result.stdout
    assert "skips per reason" in result.stdout and "time per test file" in result.stdout
    assert "1  mpirun is not installed" in result.stdout
    assert "1  root reads every folder, so the unreadable case cannot be made  (expected here)" in result.stdout
