"""The hang rule (supervise/hang.py) on samples given by the test, a clock the test moves, and the real psutil
sampling of a real process tree; the whole path with real workers is tests/e2e/test_hang.py."""

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from ma_runtime.supervise import hang
from ma_runtime.supervise.hang import Config, Monitor
from ma_runtime.supervise.hang_measures import JobTree, Reading, activity, flat
from ma_runtime.supervise.ranks import Unit

WINDOW = 10.0


def config(**changes):
    values = dict(window=WINDOW, startup=2 * WINDOW, period=2.0, restarts=3, stacks=False, tool="nvidia-smi")
    values.update(changes)
    return Config(**values)


class Devices:
    """What the accelerator tool says at each call: a utilisation for every device, or a failure."""

    def __init__(self, value=0.0):
        self.value = value
        self.failure = None
        self.unhealthy = []

    def __call__(self):
        return SimpleNamespace(tool="nvidia-smi", devices={"GPU 0": self.value, "GPU 1": self.value},
                               unhealthy=list(self.unhealthy), failure=self.failure)


QUIET = {(1, 0.0): Reading((5, 5, 50, 50), 1.0, 1)}


def quiet():
    return QUIET


class Writing:
    """A tree whose one process writes at each sample while `calls` < `until`, then stops."""

    def __init__(self, until=10 ** 6):
        self.calls, self.until = 0, until

    def __call__(self):
        self.calls += 1
        writes = min(self.calls, self.until)
        return {(1, 0.0): Reading((5, writes, 50, 50 + writes), 1.0, 1)}


def moved():
    return {(1, 0.0): Reading((6, 5, 60, 50), 1.0, 1)}


def run(monitor, until, step=2.0, sample=quiet, start=0.0, devices=None, values=()):
    """Ticks every `step` s from `start` to `until`; `values` (time -> utilisation) change the devices on the way.
    Returns (time, hang) of the first hang, or None."""
    now = start
    before = sample()
    while now < until:
        now += step
        for at, value in values:
            if now >= at:
                devices.value = value
        after = sample()
        found = monitor.tick(before, after, step, now)
        before = after
        if found is not None:
            return now, found
    return None


def monitor_at(cfg, devices, clock=0.0):
    return Monitor(cfg, devices, log=None, clock=lambda: clock)


def test_quiet_tree_and_flat_devices_after_the_first_progress_is_a_hang_after_the_window():
    devices = Devices(60.0)
    monitor = monitor_at(config(), devices)
    # Busy and changing for 6 s (the first progress), then flat at 0 from t=6.
    when, found = run(monitor, 60, devices=devices, values=[(2, 80.0), (4, 40.0), (6, 0.0)])
    assert WINDOW <= when <= 6 + WINDOW + 2.0
    assert found.evidence.startswith("no IO for 10 s, and pid 1 idle throughout (at most 0.00 CPU cores); "
                                     "accelerators idle: median 0 %")
    assert found.device_fault is None and not found.progressed


def test_changing_devices_are_not_a_hang_however_quiet_the_tree():
    devices = Devices(30.0)
    monitor = monitor_at(config(), devices)
    values = [(t, 30.0 + 20 * (t % 4)) for t in range(0, 60, 2)]
    assert run(monitor, 60, devices=devices, values=values) is None


def test_busy_but_unchanging_devices_are_flat_too():
    devices = Devices(100.0)
    monitor = monitor_at(config(), devices)
    when, found = run(monitor, 60, devices=devices)
    assert "busy but unchanging" in found.evidence and "median 100 %" in found.evidence


def test_io_resets_the_clock():
    monitor = monitor_at(config(), Devices(50.0))
    ticks = iter(range(1000))
    # IO every 8 s (ticks of 2 s): never quiet for a 10 s window.
    assert run(monitor, 80, sample=lambda: moved() if next(ticks) % 4 == 0 else QUIET) is None
    # The control: the same tree without the IO is a hang.
    assert run(monitor_at(config(), Devices(50.0)), 80) is not None


def test_activity_is_per_rank_the_cores_used_or_demanded_whichever_is_more():
    before = {(1, 0.0): Reading((1, 1, 1, 1), 0.0, 1, 0.0), (2, 0.0): Reading((1, 1, 1, 1), 0.0, 1),
              (3, 0.0): Reading((1, 1, 1, 1), 0.0, 3, 0.0)}
    # Rank 1 (pids 1 and 2) used 1.1 + 0.9 cores over 1 s; rank 3 got 0.05 of a core but asked for 0.95.
    after = {(1, 0.0): Reading((1, 1, 1, 1), 1.1, 1, 1.2), (2, 0.0): Reading((1, 1, 1, 1), 0.9, 1),
             (3, 0.0): Reading((1, 1, 1, 1), 0.05, 3, 0.95)}
    found = activity(before, after, 1.0)
    assert not found.io
    assert found.cores == {1: pytest.approx(2.0), 3: pytest.approx(0.95)}
    # A process that came or went is activity, whatever the counters.
    assert activity(before, {key: before[key] for key in list(before)[:2]}, 1.0).io
    # The same pid with another start time is another process.
    assert activity(before, {(1, 5.0): before[1, 0.0], (2, 0.0): before[2, 0.0], (3, 0.0): before[3, 0.0]}, 1.0).io
    # A counter that moved is IO.
    assert activity(before, {**before, (3, 0.0): Reading((1, 2, 1, 9), 0.0, 3, 0.0)}, 1.0).io


def ranks(*cores, io=False, demand=None):
    """A look at one process per rank (pids 1, 2, ...) after `cores` CPU seconds each since `ranks()`."""
    return {(pid, 0.0): Reading((5, 5 + int(io), 50, 50), used, pid, demand) for pid, used in enumerate(cores, 1)}


def test_one_rank_idle_throughout_while_another_busy_polls_is_a_hang_naming_it():
    """mpirun: rank 0 spins in MPI_Barrier (a core, no IO), rank 1 is blocked: found, and rank 1 is the suspect."""
    monitor = monitor_at(config(tool=None), None)
    monitor._labels = {1: "rank 0", 2: "rank 1"}
    found = None
    for step in range(1, 20):
        found = monitor.tick(ranks(0, 0), ranks(2.0, 0.0), 2.0, 2.0 * step)
        if found:
            break
    # Rank 0 busy from the first period is the CPU job's first progress: the window, not the start-up allowance.
    assert found is not None and 2.0 * step <= WINDOW + 2.0
    assert found.evidence.startswith("no IO for 10 s, and rank 1 idle throughout (at most 0.00 CPU cores); "
                                     "rank 0 busy without IO (up to 1.00 cores")
    assert found.suspects == ["rank 1"] and found.rank == 1


@pytest.mark.parametrize("tool, used, demanded, hung", [
    (None, 0.4, None, False),  # a CPU job's busy loop getting 0.2 of a core on a loaded node: working
    (None, 0.02, 1.9, False),  # getting 0.01 of a core but asking for 0.95: working, whatever the contention
    (None, 0.02, 0.03, True),  # a blocked rank's background threads: 0.01 of a core
    ("nvidia-smi", 1.4, None, True),  # with accelerators, the platform's rule: under a core is idle
    ("nvidia-smi", 0.2, 2.4, False),  # unless it asked for more than a core
])
def test_a_rank_is_busy_by_the_cpu_it_used_or_asked_for(tool, used, demanded, hung):
    devices = Devices(0.0) if tool else None
    monitor = monitor_at(config(tool=tool, startup=WINDOW), devices)
    found = run(monitor, 40, sample=Growing(used, demanded), devices=devices)
    assert (found is not None) == hung


class Growing:
    """One rank that uses `used` CPU seconds (and asks for `demanded`) between two looks 2 s apart."""

    def __init__(self, used, demanded):
        self.used, self.demanded, self.calls = used, demanded, 0

    def __call__(self):
        self.calls += 1
        demand = None if self.demanded is None else self.calls * self.demanded
        return {(1, 0.0): Reading((5, 5, 50, 50), self.calls * self.used, 1, demand)}


def test_with_a_progress_signal_cpu_use_before_its_first_beat_is_activity():
    """A second attempt importing torch for longer than the start-up allowance, before the first matching line."""
    monitor = monitor_at(config(tool=None, progress_pattern="step"), None)
    busy = Growing(2.0, None)
    assert run(monitor, 60, sample=busy) is None  # 3 allowances of busy CPU: not hung
    monitor.clock = lambda: 60.0
    monitor.progress()  # the first beat: from now on the signal alone decides, busy or not
    found = run(monitor, 100, sample=busy, start=60.0)
    assert found is not None and found[0] == 60.0 + WINDOW
    # Without any beat, a quiet start is a hang after the start-up allowance, and says which signal never came.
    found = run(monitor_at(config(tool=None, progress_pattern="step"), None), 100)
    assert found[0] == 2 * WINDOW
    assert found[1].evidence.startswith("no progress signal (output pattern) since the start, and no IO for 20 s")


def test_flatness_is_the_spread_of_each_device():
    assert flat([{"a": 0.0, "b": 90.0}] * 5) == (45.0, 0.0)
    assert flat([{"a": v} for v in (10, 11, 12, 11, 10)]) is not None
    assert flat([{"a": v} for v in (10, 30, 10, 30, 10)]) is None
    # Too few samples, or no value (N/A), say nothing: flat.
    assert flat([{"a": 0.0}, {"a": 100.0}]) == (0.0, 0.0)
    assert flat([{"a": None}] * 5) == (0.0, 0.0)


def test_before_the_first_progress_the_start_up_allowance_applies():
    devices = Devices(0.0)  # never busy: no first progress
    monitor = monitor_at(config(startup=30.0), devices)
    when, found = run(monitor, 100, devices=devices)
    assert 30.0 <= when <= 32.0
    assert "for 30 s" in found.evidence


def test_a_progress_signal_decides_alone():
    # Busy, changing devices and a moving tree, but no progress line for the window: a hang.
    devices = Devices(10.0)
    monitor = monitor_at(config(progress_pattern="step"), devices)
    monitor.clock = lambda: 0.0
    monitor.progress()  # the first beat at t=0
    values = [(t, 10.0 + 30 * (t % 4)) for t in range(0, 60, 2)]
    when, found = run(monitor, 60, sample=Writing(), devices=devices, values=values)
    assert when == WINDOW
    assert found.evidence.startswith("no progress signal (output pattern) for 10 s")


def test_progress_resets_the_clock_whatever_the_metrics():
    clock = {"now": 0.0}
    monitor = Monitor(config(progress_pattern="step"), Devices(0.0), log=None, clock=lambda: clock["now"])
    for now in range(2, 60, 2):
        clock["now"] = float(now)
        if now % 8 == 0:
            monitor.progress()
        assert monitor.tick(QUIET, QUIET, 2.0, float(now)) is None


def test_the_progress_file_mtime_is_progress(tmp_path):
    path = tmp_path / "progress"
    path.write_text("")
    os.utime(path, (1, 1))  # left by an earlier attempt: not progress by itself
    monitor = Monitor(config(progress_file=path), Devices(0.0), log=None, clock=lambda: 0.0)
    assert monitor.tick(QUIET, QUIET, 2.0, 2.0) is None
    assert monitor._progress_at is None
    os.utime(path, (5, 5))
    monitor.clock = lambda: 4.0
    monitor.tick(QUIET, QUIET, 2.0, 4.0)
    assert monitor._progress_at == 4.0


def test_a_device_fault_is_reported():
    devices = Devices(0.0)
    devices.unhealthy = ["GPU 00000000:47:00.0: fallen off the bus"]
    monitor = monitor_at(config(startup=WINDOW), devices)
    _, found = run(monitor, 60, devices=devices)
    assert found.device_fault == "nvidia-smi: GPU 00000000:47:00.0: fallen off the bus"


def test_an_unreadable_tool_leaves_the_io_cpu_rule_and_says_so():
    devices = Devices(0.0)
    devices.failure = "nvidia-smi exited 9: NVIDIA-SMI has failed"
    monitor = monitor_at(config(startup=WINDOW), devices)
    _, found = run(monitor, 60, devices=devices)
    assert "the accelerators could not be read (nvidia-smi exited 9" in found.evidence
    assert found.device_fault.startswith("nvidia-smi exited 9")


def test_an_attempt_that_progressed_for_a_window_before_it_hung_says_so():
    devices = Devices(50.0)
    monitor = monitor_at(config(), devices)
    values = [(t, 50.0 + 20 * (t % 4)) for t in range(0, 30, 2)] + [(30, 0.0)]
    # Busy and moving until t=30, quiet after: progress from t=2 to t=30, more than the window.
    found = run(monitor, 100, devices=devices, values=values, sample=Writing(until=16))
    assert found is not None and found[1].progressed
    # The same hang 4 s after the first progress: not progressed.
    devices = Devices(50.0)
    found = run(monitor_at(config(), devices), 100, devices=devices, values=[(2, 70.0), (4, 0.0)],
                sample=Writing(until=3))
    assert found is not None and not found[1].progressed


def test_the_period_follows_the_window():
    spec = SimpleNamespace(hang_detect="on", hang_window_seconds=10.0, hang_startup_seconds=None, hang_restarts=3,
                           hang_stacks=True, hang_progress_file=None, hang_progress_pattern=None,
                           preflight_accelerator="none")  # a CPU job, forced on
    log = SimpleNamespace(info=lambda *a, **k: None)
    assert hang.configure(spec, {}, log).period == 2.0
    assert hang.configure(spec, {}, log).startup == 20.0
    spec.hang_window_seconds = 1800.0
    assert hang.configure(spec, {}, log).period == 60.0
    spec.hang_startup_seconds = 5.0
    assert hang.configure(spec, {}, log).startup == 1800.0  # never shorter than the window


def test_the_tree_sample_reads_a_real_process(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nfor _ in range(3):\n"
                              "    sys.stdout.write('x'); sys.stdout.flush(); time.sleep(0.3)\ntime.sleep(30)"],
                             stdout=subprocess.DEVNULL)
    try:
        tree = JobTree(lambda: {child.pid: Unit(child.pid, "command", "rank 0")})
        first = tree.sample(None)
        time.sleep(1.2)
        second = tree.sample(None)
        assert activity(first, second, 1.2).io  # it wrote
        assert tree.labels == {child.pid: "rank 0"}
        time.sleep(0.3)
        third = tree.sample(None)
        time.sleep(0.5)
        fourth = tree.sample(None)
        assert third[next(iter(third))].demand is not None  # schedstat read
        quiet = activity(third, fourth, 0.5)
        assert not quiet.io and quiet.cores[child.pid] == pytest.approx(0.0, abs=0.1)  # asleep: no IO, no CPU
    finally:
        child.kill()
        child.wait()
    assert JobTree(lambda: {child.pid: Unit(child.pid, "command", "x")}).sample() == {}  # gone: nothing, no error


def test_a_pattern_whose_matcher_is_gone_leaves_the_metrics_to_decide():
    """progress.py turns the pattern off for the attempt (its matcher restarted too often): no more beats can come,
    so a busy attempt is not taken for hung, and a quiet one is judged by its IO and CPU."""
    monitor = monitor_at(config(tool=None, progress_pattern="step"), None)
    monitor.progress()  # it had beaten
    monitor._pattern_lost()
    assert run(monitor, 60, sample=Growing(2.0, None)) is None
    quiet = monitor_at(config(tool=None, progress_pattern="step"), None)
    quiet.progress()
    quiet._pattern_lost()
    found = run(quiet, 60)
    assert found is not None and found[1].evidence.startswith("no IO for 10 s"), found
