"""Several workers under one Supervisor: the first failure stops the rest and decides the exit code.

Each test runs a small driver in a subprocess (the Supervisor owns signal
handlers and `waitpid(-1)`, which must not touch pytest's own children). The
driver spawns the workers, writes `ready`, supervises, writes `outcome.json`
and exits with the outcome's code, as `ma-run` does.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

from tests.conftest import marked, wait_for_file

DRIVER = r"""
import dataclasses, json, os, sys
from ma_runtime.util import logs
from ma_runtime.util.output import Sink
from ma_runtime.supervise.pid1 import become_subreaper
from ma_runtime.supervise.signals import SignalQueue
from ma_runtime.supervise.supervisor import Supervisor
from ma_runtime.process.worker import spawn

spec = json.loads(sys.argv[1])
workdir = spec["dir"]
logs.configure()
signals = SignalQueue()
become_subreaper()
console = Sink(1, "<stdout>")  # one Sink, one lock, shared by every worker
workers = []
for rank, argv in enumerate(spec["workers"]):
    raw = Sink.open_append(os.path.join(workdir, f"rank-{rank}.log"))
    prefix = f"[rank {rank}] ".encode() if spec["prefix"] else None
    workers.append(spawn(argv, os.environ, None, [console, raw], [logs.stderr_sink(), raw], f"rank-{rank}",
                         console_prefix=prefix))
with open(os.path.join(workdir, "ready.tmp"), "w") as f:
    json.dump([w.pid for w in workers], f)
os.replace(os.path.join(workdir, "ready.tmp"), os.path.join(workdir, "ready"))
supervised = workers[0] if spec["single"] else workers
outcome = Supervisor(supervised, signals, spec["grace"], logs.get_logger()).run()
result = dataclasses.asdict(dataclasses.replace(outcome, worker=None))
result["worker"] = outcome.worker.name
with open(os.path.join(workdir, "outcome.json"), "w") as f:
    json.dump(result, f)
sys.exit(outcome.exit_code)
"""


class Job:
    """One driver process supervising `workers` (argv lists)."""

    def __init__(self, tmp_path, workers, grace=5.0, prefix=False, single=False):
        self.dir = tmp_path
        spec = {"dir": str(tmp_path), "workers": workers, "grace": grace, "prefix": prefix, "single": single}
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER, json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def ready(self):
        wait_for_file(self.dir / "ready")
        return self

    def signal(self, signum):
        os.kill(self.proc.pid, signum)

    def finish(self, timeout=60):
        """(exit status, outcome, stdout, stderr, wall seconds)."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, err = self.proc.communicate()
            raise AssertionError(f"the driver did not finish in {timeout} s; stderr:\n{err.decode()[-3000:]}") from None
        wall = time.monotonic() - self.started
        path = self.dir / "outcome.json"
        assert path.exists(), f"no outcome (exit {self.proc.returncode}); stderr:\n{err.decode()[-3000:]}"
        return self.proc.returncode, json.loads(path.read_text()), out.decode(), err.decode(), wall


# How long the workers that should be stopped sleep. Their durations are bounded by it: a bound at the wrong wait
# (a supervisor that waited for them), not a speed budget, which a loaded machine could exceed.
SLEEP_S = 30


def tag():
    """A unique sleep length: the processes of one test, findable in /proc."""
    return f"{SLEEP_S}.{random.randrange(10**8):08d}"


def sleeper(seconds):
    # `; true` keeps sh around, so that sleep is a grandchild of the supervisor.
    return ["sh", "-c", f"sleep {seconds}; true"]


def test_first_failure_stops_the_others_and_decides_the_exit_code(tmp_path):
    seconds = tag()
    job = Job(tmp_path, [sleeper(seconds)] * 3 + [["sh", "-c", "sleep 0.2; exit 3"]])
    status, outcome, _, err, wall = job.finish()
    assert status == 3
    assert outcome["exit_code"] == 3 and outcome["returncode"] == 3
    assert outcome["failed_worker"] == "rank-3" and outcome["worker"] == "rank-3"
    assert outcome["workers_stopped"] == 3
    assert outcome["stop_signal"] is None and not outcome["forced"]
    assert outcome["duration"] < SLEEP_S and wall < SLEEP_S
    assert "a worker failed: stopping the others" in err and "worker=rank-3" in err and "others=3" in err
    assert marked(seconds) == []


def test_a_worker_killed_by_sigkill_is_137(tmp_path):
    seconds = tag()
    job = Job(tmp_path, [sleeper(seconds)] * 2 + [["sh", "-c", "sleep 0.2; kill -KILL $$"]])
    status, outcome, _, _, wall = job.finish()
    assert status == 137
    assert outcome["exit_code"] == 137 and outcome["returncode"] == -signal.SIGKILL
    assert outcome["failed_worker"] == "rank-2" and outcome["workers_stopped"] == 2
    assert wall < SLEEP_S
    assert marked(seconds) == []


def test_all_workers_succeed_is_0(tmp_path):
    job = Job(tmp_path, [["sh", "-c", f"sleep 0.{rank}; exit 0"] for rank in range(1, 4)])
    status, outcome, _, err, _ = job.finish()
    assert status == 0 and outcome["exit_code"] == 0
    assert outcome["failed_worker"] is None and outcome["workers_stopped"] == 0
    assert outcome["worker"] in {"rank-0", "rank-1", "rank-2"}
    assert "a worker failed" not in err


def test_one_worker_passed_alone_still_works(tmp_path):
    status, outcome, _, _, _ = Job(tmp_path, [["sh", "-c", "exit 4"]], single=True).finish()
    assert status == 4
    assert outcome["failed_worker"] == "rank-0" and outcome["workers_stopped"] == 0


def test_sigterm_to_the_supervisor_stops_every_worker_as_a_stop_not_a_failure(tmp_path):
    seconds = tag()
    job = Job(tmp_path, [sleeper(seconds)] * 3).ready()
    job.signal(signal.SIGTERM)
    status, outcome, _, err, wall = job.finish()
    # Each worker dies of the SIGTERM (-15 -> 143); none of them "failed".
    assert status == 143 and outcome["exit_code"] == 143
    assert outcome["stop_signal"] == signal.SIGTERM and not outcome["forced"]
    assert outcome["failed_worker"] is None and outcome["workers_stopped"] == 0
    assert "a worker failed" not in err
    assert wall < SLEEP_S
    assert marked(seconds) == []


def ignoring_term(directory, seconds):
    # sh ignores TERM and so does its sleep (an ignored signal stays ignored across exec).
    return ["sh", "-c", f"trap '' TERM; touch {directory}/ignoring; sleep {seconds}; true"]


def test_a_worker_ignoring_sigterm_is_killed_after_the_grace(tmp_path):
    seconds = tag()
    fail_when_ready = f"while [ ! -e {tmp_path}/ignoring ]; do sleep 0.05; done; exit 2"
    job = Job(tmp_path, [ignoring_term(tmp_path, seconds), ["sh", "-c", fail_when_ready]], grace=1.0)
    status, outcome, _, err, wall = job.finish()
    # Killed by us after the grace, the failing worker's code is still the job's.
    assert status == 2 and outcome["exit_code"] == 2
    assert outcome["forced"] and outcome["failed_worker"] == "rank-1" and outcome["workers_stopped"] == 1
    assert 1.0 <= outcome["duration"] < SLEEP_S
    assert "grace period over" in err
    assert marked(seconds) == []


def test_sigterm_with_a_worker_ignoring_it_is_forced_and_143(tmp_path):
    seconds = tag()
    job = Job(tmp_path, [ignoring_term(tmp_path, seconds), sleeper(seconds)], grace=1.0).ready()
    wait_for_file(tmp_path / "ignoring")
    job.signal(signal.SIGTERM)
    status, outcome, _, _, wall = job.finish()
    assert status == 143 and outcome["exit_code"] == 143
    assert outcome["forced"] and outcome["stop_signal"] == signal.SIGTERM and outcome["failed_worker"] is None
    assert wall < SLEEP_S
    assert marked(seconds) == []


def test_sighup_reaches_every_worker(tmp_path):
    seconds = tag()
    workers = [
        ["sh", "-c", f"trap 'exit 0' HUP; touch {tmp_path}/hup-{rank}; sleep {seconds} & wait"] for rank in range(3)
    ]
    job = Job(tmp_path, workers).ready()
    for rank in range(3):
        wait_for_file(tmp_path / f"hup-{rank}")
    job.signal(signal.SIGHUP)
    status, outcome, _, _, wall = job.finish()
    # Every worker's trap ran (exit 0); one missed would sleep on and keep the job alive.
    assert status == 0 and outcome["stop_signal"] is None
    assert wall < SLEEP_S
    assert marked(seconds) == []


PRINTER = """
import sys
rank = sys.argv[1]
for i in range(1000):
    sys.stdout.write(f"rank {rank} line {i:04d}\\n")
    if i % 7 == 0:
        sys.stdout.flush()
"""


def test_console_lines_carry_their_rank_and_the_rank_log_is_raw(tmp_path):
    job = Job(tmp_path, [[sys.executable, "-c", PRINTER, str(rank)] for rank in range(2)], prefix=True)
    status, _, out, _, _ = job.finish()
    assert status == 0
    lines = out.splitlines()
    assert len(lines) == 2000
    for rank in range(2):
        mine = [line for line in lines if line.startswith(f"[rank {rank}] ")]
        # Every line of this rank, whole, in order: none lost, none mixed with the other rank's.
        assert mine == [f"[rank {rank}] rank {rank} line {i:04d}" for i in range(1000)]
        raw = (tmp_path / f"rank-{rank}.log").read_text().splitlines()
        assert raw == [f"rank {rank} line {i:04d}" for i in range(1000)]
