"""Worker output: every line, intact and in order, on the console and in the task log."""

import subprocess
import sys

from tests.conftest import MA_RUN, run_ma, task_log

LONG_LINES = """
import sys
for i in range(8):
    stream = sys.stdout if i % 2 == 0 else sys.stderr
    stream.write(f"{i}:" + chr(ord("a") + i) * (1 << 20) + "\\n")
    stream.flush()
"""

MANY_LINES = """
import sys
out = sys.stdout
for start in range(0, 1_000_000, 10_000):
    out.write("".join(f"line {i:07d}\\n" for i in range(start, start + 10_000)))
print("err line", file=sys.stderr)
"""


def expected_long_line(i):
    return f"{i}:" + chr(ord("a") + i) * (1 << 20)


def test_one_mebibyte_lines_are_never_split(job_env):
    result = run_ma([sys.executable, "-c", LONG_LINES], job_env, timeout=120)
    assert result.returncode == 0
    assert result.stdout.splitlines() == [expected_long_line(i) for i in (0, 2, 4, 6)]
    stderr_worker = [line for line in result.stderr.splitlines() if "Component=ma-runtime" not in line]
    assert stderr_worker == [expected_long_line(i) for i in (1, 3, 5, 7)]
    logged = [line for line in task_log(job_env).read_text().splitlines() if "Component=ma-runtime" not in line]
    assert sorted(logged) == [expected_long_line(i) for i in range(8)]


def test_a_million_short_lines_arrive_complete_and_in_order(job_env):
    result = run_ma([sys.executable, "-c", MANY_LINES], job_env, timeout=300)
    assert result.returncode == 0
    expected = [f"line {i:07d}" for i in range(1_000_000)]
    assert result.stdout.splitlines() == expected
    logged = [line for line in task_log(job_env).read_text().splitlines() if line.startswith("line ")]
    assert logged == expected


def test_last_unterminated_line_is_kept_as_a_line(job_env):
    result = run_ma(["sh", "-c", "printf 'no newline'; printf 'err tail' >&2"], job_env)
    assert result.stdout == "no newline\n"
    assert "err tail\n" in result.stderr
    lines = task_log(job_env).read_text().splitlines()
    assert "no newline" in lines and "err tail" in lines


def test_progress_bar_carriage_returns_pass_through_unchanged(job_env):
    command = [MA_RUN, "sh", "-c", r"printf '10%%\r50%%\r100%%\n'"]
    result = subprocess.run(command, env=job_env, capture_output=True, timeout=60)
    assert result.stdout == b"10%\r50%\r100%\n"


def test_closed_console_does_not_stop_the_command_or_the_log(job_env):
    # `ma-run ... | head -1`: the console goes away, the command and the task log carry on.
    pipeline = f"{MA_RUN} {sys.executable} -c 'for i in range(100000): print(i)' | head -1"
    result = subprocess.run(["bash", "-o", "pipefail", "-c", pipeline], env=job_env, capture_output=True, text=True)
    assert result.stdout == "0\n"
    assert result.returncode == 0, result.stderr
    logged = [line for line in task_log(job_env).read_text().splitlines() if line.isdigit()]
    assert logged == [str(i) for i in range(100000)]
