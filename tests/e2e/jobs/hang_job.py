"""A worker for the hang-detection tests; HANG_MODE says how it behaves.

The accelerators are the fakes of ma_runtime/local/fakes: FAKE_SMI_UTIL=@UTIL_FILE, which this worker rewrites to
say how busy "its device" is (a device computing moves; a stuck one is flat). MARKS gets one file per start
(`start-<attempt>-<rank>`), and `blocked-<attempt>-<rank>` with the wall-clock time when it stops making
progress, so a test can tell how long detection took.

Modes:
- block: computes (busy device, CPU) for COMPUTE_SECONDS, then blocks forever in a lock (no IO, no CPU)
  in `wait_for_peer`; with ODD_RANK, that rank blocks in `load_batch` instead. IGNORE_TERM=1 ignores SIGTERM.
- naps: NAPS times: a moment of compute, then a sleep of NAP_SECONDS (shorter than the window); exits 0.
- slow_start: a quiet first step of FIRST_SECONDS (no IO, flat device), then one step and exit 0.
- busy_cpu: two processes spin for BUSY_SECONDS with no IO and a flat device; exits 0.
- touch: touches MA_RUNTIME_PROGRESS_FILE every TOUCH_SECONDS for RUN_SECONDS, device flat, no output; exits 0.
- pattern: prints `step <n>` every TOUCH_SECONDS for RUN_SECONDS with a flat device, exits 0; with
  STOP_PRINTING=1 it then keeps its device busy and changing, silent, forever.
"""

import multiprocessing
import os
import signal
import sys
import threading
import time

MARKS = os.environ["MARKS"]
ATTEMPT = int(os.environ.get("MA_PROC_START_CNT", "1"))
RANK = int(os.environ.get("RANK_ID", os.environ.get("RANK", "0")))
UTIL_FILE = os.environ.get("UTIL_FILE")


def mark(name: str, text: str = "") -> None:
    with open(os.path.join(MARKS, f"{name}-{ATTEMPT}-{RANK}"), "w") as handle:
        handle.write(text)


def device(percent: int) -> None:
    """What the fake tools report for every device from now on (rank 0 speaks for the node)."""
    if UTIL_FILE and RANK == 0:
        temporary = f"{UTIL_FILE}.{os.getpid()}"
        with open(temporary, "w") as handle:
            handle.write(str(percent))
        os.replace(temporary, UTIL_FILE)


def compute(seconds: float) -> None:
    """Busy device (moving utilisation) and a busy core."""
    end = time.monotonic() + seconds
    level = 0
    while time.monotonic() < end:
        level += 1
        device(40 + 40 * (level % 2))
        spin_until = time.monotonic() + 0.25
        while time.monotonic() < spin_until:
            pass


def wait_for_peer() -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # never returns: a collective whose peer never comes


def load_batch() -> None:
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # the odd rank: stuck somewhere else


def block() -> None:
    if os.environ.get("IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    compute(float(os.environ.get("COMPUTE_SECONDS", "1.5")))
    device(0)
    mark("blocked", repr(time.time()))
    if os.environ.get("ODD_RANK") == str(RANK):
        load_batch()
    wait_for_peer()


def naps() -> None:
    for _ in range(int(os.environ["NAPS"])):
        compute(0.5)
        device(0)
        os.write(1, b"nap\n")
        time.sleep(float(os.environ["NAP_SECONDS"]))
    mark("done")


def slow_start() -> None:
    time.sleep(float(os.environ["FIRST_SECONDS"]))
    compute(1.0)
    mark("done")


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def busy_cpu() -> None:
    seconds = float(os.environ["BUSY_SECONDS"])
    helper = multiprocessing.get_context("fork").Process(target=_spin, args=(seconds,))
    helper.start()
    _spin(seconds)
    helper.join()
    mark("done")


def touch() -> None:
    path = os.environ["MA_RUNTIME_PROGRESS_FILE"]
    end = time.monotonic() + float(os.environ["RUN_SECONDS"])
    while time.monotonic() < end:
        with open(path, "a"):
            os.utime(path)
        time.sleep(float(os.environ["TOUCH_SECONDS"]))
    mark("done")


def pattern() -> None:
    end = time.monotonic() + float(os.environ["RUN_SECONDS"])
    step = 0
    while time.monotonic() < end:
        step += 1
        os.write(1, f"step {step}\n".encode())
        time.sleep(float(os.environ["TOUCH_SECONDS"]))
    if os.environ.get("STOP_PRINTING") != "1":
        mark("done")
        return
    mark("blocked", repr(time.time()))
    while True:
        compute(1.0)


if __name__ == "__main__":
    mark("start")
    {"block": block, "naps": naps, "slow_start": slow_start, "busy_cpu": busy_cpu, "touch": touch,
     "pattern": pattern}[os.environ["HANG_MODE"]]()
    sys.exit(0)
