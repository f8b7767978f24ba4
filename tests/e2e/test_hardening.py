"""What a hostile environment found (issue 10): failing sinks, closed standard streams, undecodable bytes,
stale and unwritable termination messages. Each test reproduced its finding before the fix."""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import MA_RUN, MA_RUNTIME, log_dir, run_ma, task_log, wait_for_file

TERMINATION = "modelarts-job-local-worker-0-termination.json"
LINE = re.compile(r"^line \d{6} x{40}$")


def lines_of(path: Path):
    return path.read_bytes().decode("utf-8", "replace").splitlines()


# --- item 8: a task log that cannot be written never stops the command or the other outputs -----------------


def test_a_task_log_over_the_file_size_limit_is_set_aside_and_the_command_finishes(job_env):
    # RLIMIT_FSIZE makes writes past 300 kB fail with EFBIG: the pump used to die, the pipe filled, the worker hung.
    script = "for i in range(40000): print(f'line {i:06d} ' + 'x' * 40)"
    result = subprocess.run(["prlimit", "--fsize=300000", MA_RUN, sys.executable, "-c", script], env=job_env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("\n") == 40000  # the console got everything
    warnings = [line for line in result.stderr.splitlines() if "cannot write" in line]
    assert len(warnings) == 1 and "set aside" in warnings[0] and "File too large" in warnings[0], result.stderr
    assert task_log(job_env).stat().st_size <= 300000


WRITER = """
import os, sys, time
folder = sys.argv[1]
count = 0
def emit(n):
    global count
    for _ in range(n):
        print(f"line {count:06d} " + "x" * 40, flush=True)
        count += 1
emit(2000)  # about 100 kB: far more than the full disk has room for
open(os.path.join(folder, "full"), "w").close()
while not os.path.exists(os.path.join(folder, "go")):
    time.sleep(0.01)
started = time.time()
while time.time() - started < 2.5:  # longer than the sink's retry interval
    emit(10)
    time.sleep(0.05)
print("last line", flush=True)
"""


def test_a_full_disk_sets_the_task_log_aside_and_it_resumes_saying_what_was_lost(job_env, tmpfs, tmp_path):
    logs = tmpfs("logs", "256k")
    filler = logs / "filler"
    filler.write_bytes(b"\0" * (256 * 1024 - 24 * 1024))
    job_env["MA_LOG_DIR"] = str(logs)
    markers = tmp_path / "markers"
    markers.mkdir()
    proc = subprocess.Popen([MA_RUN, sys.executable, "-c", WRITER, str(markers)], env=job_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr_lines = queue.Queue()
    threading.Thread(target=lambda: [stderr_lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        wait_for_file(markers / "full", timeout=60)
        seen = [stderr_lines.get(timeout=60)]
        while "cannot write" not in seen[-1]:  # the runtime found the disk full (the pump may lag the worker)
            seen.append(stderr_lines.get(timeout=60))
        filler.unlink()  # space comes back
        (markers / "go").touch()
        stdout = proc.stdout.read()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    time.sleep(0.1)
    stderr = "".join(seen) + "".join(stderr_lines.queue)
    assert proc.returncode == 0, stderr
    assert stdout.splitlines()[-1] == "last line" and stdout.count("\n") > 2000
    log = lines_of(logs / "modelarts-job-local-worker-0.log")
    notes = [i for i, line in enumerate(log) if "bytes of output were lost while" in line]
    assert len(notes) == 1, log[:5]
    assert "level=warning" in log[notes[0]] and "No space left on device" in log[notes[0]]
    assert "last line" in log[notes[0]:]
    # Nothing torn but the one line the full disk cut, and that one ends before the note, not inside it.
    torn = [i for i, line in enumerate(log) if line.startswith("line ") and not LINE.match(line)]
    assert torn in ([], [notes[0] - 1])
    assert len([line for line in stderr.splitlines() if "cannot write" in line]) == 1


# --- item 14: closed standard streams -----------------------------------------------------------------------


@pytest.mark.parametrize("closed", ["2>&-", ">&-", "<&-", "<&- >&- 2>&-"])
def test_closed_standard_streams_are_reopened_and_the_command_runs(job_env, closed):
    command = f'"$MA_RUN" -- sh -c "echo OUT; echo ERR >&2; exit 4" {closed}'
    result = subprocess.run(["sh", "-c", command], env={**job_env, "MA_RUN": MA_RUN}, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 4, result.stderr
    assert "Traceback" not in result.stderr
    logged = task_log(job_env).read_text().splitlines()
    assert logged.count("OUT") == 1 and logged.count("ERR") == 1  # once each: the log never took fd 1 or 2
    if ">&-" not in closed:
        assert result.stdout == "OUT\n"


def test_with_every_standard_stream_closed_the_forwarded_output_is_never_read_as_signals(job_env):
    # The signal queue's pipe was made before the closed descriptors were reopened, so it took fd 1: the
    # forwarded "OUT" went into it and came back as signal 79 (killpg failed: exit 70). The sleep lets the
    # loop read it before the command ends.
    command = '"$MA_RUN" -- sh -c "echo OUT; sleep 0.5; exit 4" <&- >&- 2>&-'
    result = subprocess.run(["sh", "-c", command], env={**job_env, "MA_RUN": MA_RUN}, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 4
    assert task_log(job_env).read_text().splitlines().count("OUT") == 1


# --- item 15: bytes that are not UTF-8, in the command, a path, a variable ---------------------------------


def termination(env):
    return json.loads((log_dir(env) / TERMINATION).read_text(encoding="utf-8"))


def test_an_undecodable_command_gives_127_and_an_escaped_message(job_env):
    result = subprocess.run([MA_RUN.encode(), b"/tmp/no-such-\xff-program"], env=job_env, capture_output=True,
                            timeout=60)
    assert result.returncode == 127
    assert b"Traceback" not in result.stderr
    assert "no-such-\\xff-program" in termination(job_env)["reason"]
    assert b"no-such-\\\\xff-program" in result.stderr or b"no-such-\\xff-program" in result.stderr


@pytest.mark.parametrize(
    "variables, code",
    [
        ({b"RANK_TABLE_FILE": b"/nonexistent/\xff/", b"MA_RUNTIME_RANKTABLE_TIMEOUT": b"0"}, 81),
        ({b"VC_WORKER_HOSTS": b"host-\xff.invalid", b"MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS": b"0"}, 79),
        ({b"MA_LOG_DIR": None}, 0),  # set below: a log directory whose name is not UTF-8
    ],
)
def test_undecodable_paths_and_variables_keep_the_documented_exit_code(job_env, tmp_path, variables, code):
    env = {key.encode(): value.encode() for key, value in job_env.items()}
    env.update({key: value for key, value in variables.items() if value is not None})
    if variables.get(b"MA_LOG_DIR", b"") is None:
        env[b"MA_LOG_DIR"] = os.fsencode(tmp_path) + b"/logs-\xff"
    result = subprocess.run([MA_RUN.encode(), b"true"], env=env, capture_output=True, timeout=60)
    assert result.returncode == code, result.stderr.decode(errors="replace")
    assert b"Traceback" not in result.stderr and b"internal error" not in result.stderr
    if code:
        logs = Path(os.fsdecode(env.get(b"MA_LOG_DIR") or os.fsencode(log_dir(job_env))))
        message = json.loads((logs / TERMINATION).read_text(encoding="utf-8"))
        assert message["exit_code"] == code and "\\xff" in message["reason"] + message["hint"]


def test_plan_and_print_config_print_undecodable_bytes_escaped(job_env):
    env = {**{k.encode(): v.encode() for k, v in job_env.items()}, b"MA_RUNTIME_CODE_URL": b"/srv/code-\xff/"}
    plan = subprocess.run([MA_RUNTIME.encode(), b"plan", b"--json", b"--", b"python", b"t\xff.py"], env=env,
                          capture_output=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["workers"][0]["argv"] == ["python", "t\\xff.py"]
    printed = subprocess.run([MA_RUN.encode(), b"--print-config", b"python", b"t\xff.py"], env=env,
                             capture_output=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert json.loads(printed.stdout)["code"]["url"] == "/srv/code-\\xff/"


# --- item 20: a termination message belongs to its run -------------------------------------------------------


def test_the_message_names_its_run_and_a_later_run_removes_it(job_env):
    failed = run_ma(["sh", "-c", "exit 3"], job_env)
    assert failed.returncode == 3
    run_id = re.search(r"run_id=(\w+)", failed.stderr).group(1)
    assert termination(job_env)["run_id"] == run_id
    succeeded = run_ma(["true"], job_env)
    assert succeeded.returncode == 0
    assert not (log_dir(job_env) / TERMINATION).exists()
    assert "removed an earlier run's termination message" in succeeded.stderr


# --- item 4: nothing but a regular file is ever replaced ---------------------------------------------------


def test_something_other_than_a_file_at_the_messages_path_is_left_alone(job_env):
    blocker = log_dir(job_env) / TERMINATION
    blocker.mkdir(parents=True)
    result = run_ma(["sh", "-c", "exit 5"], job_env)
    assert result.returncode == 5
    assert blocker.is_dir()
    assert "could not write the termination message" in result.stderr and "a directory is in the way" in result.stderr


@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_a_kubernetes_path_that_is_a_fifo_or_a_device_neither_blocks_nor_is_replaced(job_env, tmp_path, special):
    path = tmp_path / "termination-log" if special == "fifo" else Path(special)
    if special == "fifo":
        os.mkfifo(path)
    job_env["MA_RUNTIME_TERMINATION_LOG"] = str(path)
    result = run_ma(["sh", "-c", "exit 6"], job_env, timeout=60)  # a blocked open of the fifo fails here
    assert result.returncode == 6
    assert path.is_fifo() if special == "fifo" else path.is_char_device()
    assert termination(job_env)["exit_code"] == 6


def test_a_task_log_path_that_is_a_fifo_is_refused_with_78(job_env):
    log_dir(job_env).mkdir(parents=True)
    os.mkfifo(task_log(job_env))
    result = run_ma(["true"], job_env, timeout=60)
    assert result.returncode == 78
    assert "cannot write the task log" in result.stderr and "a FIFO is in the way" in result.stderr
    assert task_log(job_env).is_fifo()


# --- item 9: the exit path never waits on the masker ----------------------------------------------------------


def test_a_last_line_of_16_kib_of_dashes_does_not_delay_the_exit(job_env):
    script = "import sys; sys.stderr.write('-' * 16384 + '\\n'); sys.exit(1)"
    result = run_ma([sys.executable, "-c", script], job_env, timeout=60)  # it took 104 s: that fails here
    assert result.returncode == 1
    assert termination(job_env)["tail"][-1].startswith("----")


# --- Ctrl-C in the operator commands: one line and 130, never a traceback ---------------------------------------


@pytest.mark.parametrize(
    "argv, env",
    [
        (["preflight", "--only", "dns"], {"VC_WORKER_HOSTS": "never-there.invalid",
                                          "MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS": "60"}),
        (["ranktable", "wait", "--timeout", "60"], {"RANK_TABLE_FILE": "/nonexistent/jobstart_hccl.json"}),
    ],
)
def test_ctrl_c_in_an_operator_command_is_one_line_and_130(job_env, argv, env):
    proc = subprocess.Popen([MA_RUNTIME, *argv], env={**job_env, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)  # well into the wait
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert stderr.strip().splitlines()[-1] == "ma-runtime: interrupted by SIGINT"
