"""No process of a run is left alive: ma-run SIGKILLed, killed by name, or stopping a tree that keeps forking.

Every process a test starts carries a marker (a `sleep` length no other
process uses, which also appears in the command lines of the shells that start
them), so the test finds what is left through /proc, and kills it in a
`finally` whatever the outcome. Tests that kill by name (`pkill`, `killall`)
run in a PID namespace of their own: on the host, `pkill -f ma-run` would hit
every other ma-run of the machine. The namespace's init is this file run as
a driver, whose command line names no ma-run.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import MA_RUN, MA_RUNTIME, ROOT, marked, namespace_init, needs_pid_namespace, wait_for_file

SLEEP = shutil.which("sleep") or "/bin/sleep"
# Each generation starts a `sleep` that ignores SIGTERM too, waits 20 ms, starts
# the next generation (a new pid) and exits: a snapshot of the tree is stale
# within milliseconds, yet it forks at a rate the machine can bear.
CHAIN = ('trap "" TERM; while :; do {sleep} {marker} </dev/null >/dev/null 2>&1 & sleep 0.02; '
         'sh -c "$0" "$0" & exit 0; done')
# One shell that forks a `sleep` ignoring SIGTERM every few milliseconds, for ever.
LOOP = 'trap "" TERM; while :; do {sleep} {marker} </dev/null >/dev/null 2>&1 & sleep 0.005; done'


def forkers(marker):
    """Shell words that start two loops and a chain, each in a session of its own (out of the
    worker's process group, whose killpg would take them all at once)."""
    loop, chain = LOOP.format(sleep=SLEEP, marker=marker), CHAIN.format(sleep=SLEEP, marker=marker)
    return f"setsid -f sh -c '{loop}'; setsid -f sh -c '{loop}'; setsid -f sh -c '{chain}' '{chain}';"


@pytest.fixture
def marker():
    """A `sleep` length unique to the test; everything carrying it is killed at the end."""
    text = f"3000.{random.randrange(10**8):08d}"
    yield text
    kill_marked(text)


def sleepers(marker):
    """The marker's `sleep` processes themselves (not the shells that started them)."""
    count = 0
    for pid in marked(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")[:-1]
        except OSError:
            continue
        if argv and argv[0].endswith(b"sleep") and argv[-1] == marker.encode():
            count += 1
    return count


def kill_marked(marker, seconds=10.0):
    """Stops, then kills, whatever carries the marker, until nothing does (a chain re-forks)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = marked(marker)
        if not found:
            return
        for signum in (signal.SIGSTOP, signal.SIGKILL):
            for pid in found:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
        time.sleep(0.02)


def wait_until_none(marker, seconds=15.0):
    deadline = time.monotonic() + seconds
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return marked(marker)


def wait_until(condition, seconds=30.0, what="condition"):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {seconds} s")
        time.sleep(0.02)


class MaRun:
    """ma-run on the host (not PID 1, so with its guard), killed in the end whatever happens."""

    def __init__(self, script, env):
        self.proc = subprocess.Popen([MA_RUN, "--", "sh", "-c", script], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)

    def finish(self, timeout):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stderr(self):
        self.kill()
        return self.proc.stderr.read().decode(errors="replace")[-3000:]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def ma_run(job_env):
    runs = []

    def starter(script, grace="1"):
        job_env["MA_RUNTIME_STOP_GRACE_SECONDS"] = grace
        run = MaRun(script, job_env)
        runs.append(run)
        return run

    yield starter
    for run in runs:
        run.kill()


def test_sigkilled_runtime_leaves_no_descendant_that_dropped_its_marks(ma_run, marker, tmp_path):
    """Each child drops some of what tells the run's processes apart; together, nothing escapes.

    - env -i: no MA_RUNTIME_LINEAGE, but the worker's output pipes and the runtime's mark descriptor;
    - env -i, output to /dev/null: the mark descriptor only;
    - output to /dev/null: the lineage only;
    - env -i, output to /dev/null, every descriptor closed, started 3 s before the kill: only the
      ancestry the runtime recorded while it lived.
    """
    ready = tmp_path / "ready"
    closer = (f"{sys.executable} -I -c 'import os; os.closerange(3, 65536); "
              f"os.execv(\"{SLEEP}\", [\"sleep\", \"{marker}\"])'")
    script = (
        f"env -i setsid -f {closer} </dev/null >/dev/null 2>&1; sleep 3; "
        f"env -i setsid -f {SLEEP} {marker}; "
        f"env -i setsid -f {SLEEP} {marker} </dev/null >/dev/null 2>&1; "
        f"setsid -f {SLEEP} {marker} </dev/null >/dev/null 2>&1; "
        f"touch {ready}; exec {SLEEP} {marker}"
    )
    run = ma_run(script)
    try:
        wait_for_file(ready, timeout=60)
    except AssertionError:
        raise AssertionError(run.stderr()) from None
    wait_until(lambda: sleepers(marker) == 5, what="5 sleeping processes")
    run.proc.send_signal(signal.SIGKILL)
    survivors = wait_until_none(marker)
    assert not survivors, f"{len(survivors)} processes outlived the SIGKILLed runtime: {survivors}"


def test_sigkilled_runtime_leaves_no_forking_chain(ma_run, marker, tmp_path):
    ready = tmp_path / "ready"
    chain = CHAIN.format(sleep=SLEEP, marker=marker)
    run = ma_run(f"sh -c '{chain}' '{chain}' & touch {ready}; exec {SLEEP} {marker}")
    wait_for_file(ready, timeout=60)
    wait_until(lambda: sleepers(marker) >= 10, what="10 sleeping processes")
    run.proc.send_signal(signal.SIGKILL)
    survivors = wait_until_none(marker)
    assert not survivors, f"{len(survivors)} processes outlived the SIGKILLed runtime"


def test_leftover_that_ignores_sigterm_and_keeps_forking_is_gone_when_ma_run_exits(ma_run, marker):
    run = ma_run(f"{forkers(marker)} sleep 0.5; exit 0")
    code = run.finish(120)
    survivors = marked(marker)
    assert code == 0 and not survivors, f"exit {code}, {len(survivors)} processes left running; stderr:\n{run.stderr()}"


def test_command_that_ignores_sigterm_and_forks_is_killed_whole_after_the_grace(ma_run, marker, tmp_path):
    ready = tmp_path / "ready"
    run = ma_run(f"trap '' TERM; {forkers(marker)} touch {ready}; while :; do {SLEEP} 0.05; done")
    wait_for_file(ready, timeout=60)
    run.proc.send_signal(signal.SIGTERM)
    code = run.finish(120)
    survivors = marked(marker)
    stderr = run.stderr()
    assert code == 128 + signal.SIGTERM and not survivors, (
        f"exit {code}, {len(survivors)} processes left running; stderr:\n{stderr}"
    )
    # The grace-over kill took the whole tree: nothing was left for a second grace period.
    assert "left processes running" not in stderr, stderr


# The killer, and how the runtime was started (`ma-runtime run` for the pattern that names it).
KILLERS = {
    "pkill-f": (["pkill", "-9", "-f", "ma-run"], [MA_RUN]),
    "pkill": (["pkill", "-9", "ma-run"], [MA_RUN]),
    "pkill-f-runtime": (["pkill", "-9", "-f", "ma-runtime"], [MA_RUNTIME, "run"]),
    "killall": (["killall", "-9", "ma-run"], [MA_RUN]),
}


@needs_pid_namespace
@pytest.mark.parametrize("killer", list(KILLERS))
def test_killing_ma_run_by_name_spares_the_guard_which_kills_the_rest(killer, marker, tmp_path, job_env):
    command, launcher = KILLERS[killer]
    if shutil.which(command[0]) is None:
        pytest.skip(f"{command[0]} is not installed")
    workdir = tmp_path / "run"
    workdir.mkdir()
    ready = workdir / "ready"
    script = (
        f"{SLEEP} {marker} & setsid -f {SLEEP} {marker}; env -i setsid -f {SLEEP} {marker}; "
        f"touch {ready}; wait"
    )
    plan = {"argv": [*launcher, "--", "sh", "-c", script], "killer": command, "dir": str(workdir)}
    env = {**job_env, "LEFTOVERS_PLAN": json.dumps(plan), "PYTHONPATH": str(ROOT)}
    # The driver is the namespace's init: its command line must not match the killer's pattern.
    driver = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, __file__],
                              env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        namespace_init(driver.pid)
        killed = wait_for_file(workdir / "killed", timeout=60)
        assert killed.read_text() != "", "the killer matched nothing"
        survivors = wait_until_none(marker)
        assert not survivors, f"{len(survivors)} processes outlived `{' '.join(command)}`"
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # unshare and the namespace's init: the kernel ends the rest
        driver.wait(10)


def _driver() -> None:
    """PID 1 of the namespace: starts ma-run, kills it by name once its command is ready, then reaps."""
    plan = json.loads(os.environ["LEFTOVERS_PLAN"])
    workdir = plan["dir"]
    ma_run = subprocess.Popen(plan["argv"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(workdir, "ready")) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # the setsid'd children: started before `ready`, running by now
    killer = subprocess.run(plan["killer"], capture_output=True)
    ma_run.wait(30)
    with open(os.path.join(workdir, "killed.tmp"), "w") as f:
        f.write(f"{killer.returncode} {ma_run.returncode}" if killer.returncode == 0 else "")
    os.replace(os.path.join(workdir, "killed.tmp"), os.path.join(workdir, "killed"))
    while True:  # as init: reap the orphans the guard kills, until the test ends the namespace
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.1)


if __name__ == "__main__":
    _driver()
