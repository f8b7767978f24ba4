"""The reaping loop takes the orphans' statuses, never the status of a tool the runtime waits for itself
(issue 11, item 6): `waitpid(-1)` in the supervisor would make `Popen` see ECHILD and report 0."""

import os
import subprocess
import threading
import time

from ma_runtime.process.lifecycle import run_tool
from ma_runtime.supervise.pid1 import reap


def test_a_tool_run_while_the_loop_reaps_gets_its_own_status():
    statuses = []

    def tools():
        for _ in range(40):
            statuses.append(run_tool(["sh", "-c", "exit 3"], timeout=10)[0])

    thread = threading.Thread(target=tools)
    thread.start()
    while thread.is_alive():  # the supervisor's loop, as busy as it gets
        reap({})
    thread.join()
    assert statuses == [3] * 40


def test_tracked_workers_and_orphans_are_still_reaped():
    worker = subprocess.Popen(["sh", "-c", "exit 4"])
    orphan_parent = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    found = {}
    while worker.pid not in found:
        found.update(reap({worker.pid: None}))
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert found == {worker.pid: 4}
    while True:  # the untracked child's zombie is gone too
        try:
            os.waitpid(orphan_parent.pid, os.WNOHANG)
        except ChildProcessError:
            break
        reap({})
        assert time.monotonic() < deadline
    worker.returncode = orphan_parent.returncode = 0  # reaped by us: Popen must not wait for them


def test_a_tool_the_runtime_runs_itself_is_not_the_commands_process():
    """The hang monitor runs nvidia-smi while the workers run: the tree walk (stops, sweeps, the monitor's own
    activity count) must not take the tool for one of the command's processes, nor the processes it starts."""
    from ma_runtime.process import children
    from ma_runtime.process.table import descendants

    done = threading.Event()
    thread = threading.Thread(target=lambda: (run_tool(["sh", "-c", "sleep 1 & sleep 1; wait"], 10), done.set()))
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while not descendants(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert descendants(os.getpid()), "the tool did not start"
        # Under the lock `owned` starts tools with: a tool seen now has been registered.
        with children.LOCK:
            assert descendants(os.getpid(), children.NotTheCommand()) == []
    finally:
        thread.join(10)
    assert done.is_set()
