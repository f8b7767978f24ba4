"""The process layer (process/lifecycle.py) and the process table (process/table.py), on real processes."""

import os
import signal
import subprocess
import sys
import time

import pytest

from ma_runtime.process import lifecycle, table

# Prints "ready" once its SIGTERM disposition is set, then sleeps: what a stop meets.
IGNORES_TERM = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
               "time.sleep(60)"
DIES_OF_TERM = "import sys, time; print('ready', flush=True); time.sleep(60)"


def started(code: str, **kwargs) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, **kwargs)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize("returncode, expected", [(0, 0), (3, 3), (255, 255), (-signal.SIGKILL, 137),
                                                  (-signal.SIGTERM, 143), (-signal.SIGINT, 130)])
def test_a_status_is_the_exit_code_a_shell_reports(returncode, expected):
    assert lifecycle.exit_code(returncode) == expected


def test_a_child_that_ignores_sigterm_is_killed_when_the_grace_ends():
    proc = started(IGNORES_TERM)
    assert lifecycle.stop(proc, 0.2) == -signal.SIGKILL
    assert lifecycle.exit_code(proc.returncode) == 128 + signal.SIGKILL


def test_a_child_that_ends_on_sigterm_dies_of_it_and_is_not_killed():
    proc = started(DIES_OF_TERM)
    assert lifecycle.stop(proc, 30) == -signal.SIGTERM
    assert lifecycle.exit_code(proc.returncode) == 128 + signal.SIGTERM


def test_a_child_that_cleans_up_within_the_grace_keeps_its_own_code():
    proc = started("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(7)); "
                   "print('ready', flush=True); time.sleep(60)")
    assert lifecycle.stop(proc, 30) == 7


def test_a_child_that_has_ended_is_not_signalled():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    assert lifecycle.stop(proc, 0.1) == 3


def test_a_group_stop_reaches_what_the_leader_started(tmp_path):
    pid_file = tmp_path / "pid"
    proc = subprocess.Popen(["sh", "-c", f"trap '' TERM; sleep 60 & echo $! > {pid_file}; echo ready; wait"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    grandchild = int(pid_file.read_text())
    assert lifecycle.stop(proc, 0.2, group=True) == -signal.SIGKILL
    # It ignored SIGTERM as its shell did (an ignored signal is inherited): the group's SIGKILL ended it too.
    deadline = time.monotonic() + 10
    while grandchild in table.processes() and time.monotonic() < deadline:
        time.sleep(0.01)  # reaped by init, on its own time
    assert grandchild not in table.processes()


def test_wait_answers_none_while_it_runs_and_the_status_once_it_has_ended():
    proc = started(DIES_OF_TERM)
    assert lifecycle.wait(proc, 0.05) is None
    proc.terminate()
    assert lifecycle.wait(proc, 30) == -signal.SIGTERM
    assert lifecycle.wait(proc, 0) == -signal.SIGTERM  # asked again: the same status


def test_wait_or_kill_leaves_a_child_that_ends_by_itself_its_code_and_kills_one_that_does_not():
    assert lifecycle.wait_or_kill(subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"]), 30) == 5
    assert lifecycle.wait_or_kill(started(IGNORES_TERM), 0.05) == -signal.SIGKILL


def test_a_tool_past_its_timeout_is_killed_with_its_group():
    with pytest.raises(lifecycle.ToolError) as caught:
        lifecycle.run_tool(["sh", "-c", "sleep 60 & sleep 60"], 0.2)
    assert caught.value.code == "timeout"
    assert lifecycle.run_tool(["sh", "-c", "echo out; echo err >&2; exit 4"], 10) == (4, "out\n", "err\n")


def test_a_missing_tool_is_a_tool_error():
    with pytest.raises(lifecycle.ToolError) as caught:
        lifecycle.run_tool(["no-such-tool-here"], 1)
    assert caught.value.code == "missing"


def test_the_table_reads_a_childs_line_environment_command_line_and_descriptors():
    read_end, write_end = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", DIES_OF_TERM, "an-argument"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "MA_TEST_MARK": "a=b,c"}, pass_fds=(write_end,))
    try:
        assert proc.stdout.readline().strip() == "ready"
        line = table.processes()[proc.pid]
        assert line.ppid == os.getpid() and line.comm.startswith("python")
        assert proc.pid in table.descendants(os.getpid())
        assert table.environ(proc.pid)["MA_TEST_MARK"] == "a=b,c"
        assert table.cmdline(proc.pid)[-1] == "an-argument"
        assert table.holds_pipe(proc.pid, {os.fstat(read_end).st_ino})
        assert not table.holds_pipe(proc.pid, {0})
        assert table.cpu_demand(proc.pid) > 0
    finally:
        os.close(read_end)
        os.close(write_end)
        lifecycle.stop(proc, 10)
    # Gone: every read answers "nothing", none raises.
    assert proc.pid not in table.processes()
    assert table.environ(proc.pid) == {} and table.cmdline(proc.pid) == [] and table.comm(proc.pid) == ""
    assert table.cpu_demand(proc.pid) is None and not table.holds_pipe(proc.pid, {1})


def test_our_own_argument_area_is_read():
    start, end = table.argument_area()
    assert 0 < start < end


def test_the_table_tells_who_holds_a_file_open_for_writing(tmp_path):
    path = tmp_path / "written.bin"
    writer = "import sys, time; f = open(sys.argv[1], 'wb'); print('ready', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", writer, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert proc.pid in table.pids() and table.owner(proc.pid) == os.getuid()
        held = [fd for fd in table.descriptors(proc.pid) if os.path.realpath(fd) == str(path.resolve())]
        assert len(held) == 1
        assert table.descriptor_flags(held[0]) & os.O_ACCMODE == os.O_WRONLY
    finally:
        lifecycle.stop(proc, 10)
    assert table.owner(proc.pid) is None and table.descriptor_flags(held[0]) is None
    with pytest.raises(OSError):
        table.descriptors(proc.pid)
