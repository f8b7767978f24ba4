"""Stacks of a hung attempt: real Python children registered through the real sitecustomize, real signals,
real faulthandler dumps; py-spy is a script on PATH (the real tool needs ptrace and is not a dependency)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ma_runtime.process import table as proc_table
from ma_runtime.supervise.stacks import dumps
from ma_runtime.supervise.stacks import registry as stacks_registry
from ma_runtime.supervise.stacks import summary as stacks_summary
from tests.conftest import alive
from tests.recording import Log

# A dump must end long before this, even one that waits out its timeouts.
GENEROUS_S = 15

# What every child runs: block in a named function (a lock acquired twice: no IO, no CPU), and say so with a
# file in READY_DIR; an "agent" first starts the children its arguments name (role:NAME=value,...).
JOB = """\
import gc, os, signal, subprocess, sys, threading, time

def ready():
    open(os.path.join(os.environ["READY_DIR"], str(os.getpid())), "w").close()

def wait_forever():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()

def load_batch():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()

def side_thread():
    # Ready once the main thread is at its blocking line: a dump taken from then on shows it there.
    main = threading.main_thread().ident
    while True:
        frame = sys._current_frames().get(main)
        if frame is not None and frame.f_code.co_name in ("wait_forever", "load_batch") \\
                and frame.f_lineno == frame.f_code.co_firstlineno + 3:
            break
        time.sleep(0.005)
    ready()
    time.sleep(3600)

role = sys.argv[1]
if role == "agent":
    for spec in sys.argv[2:]:
        child, variables = spec.split(":")
        extra = dict(pair.split("=") for pair in variables.split(","))
        subprocess.Popen([sys.executable, __file__, child], env={**os.environ, **extra})
    role = "wait"
if role == "helper":
    subprocess.Popen([sys.executable, __file__, "wait"])
    role = "wait"
if role == "own-handler":
    signal.signal(int(os.environ["MA_RUNTIME_STACKS_SIGNAL"]), lambda *args: None)
    role = "wait"
if role == "fork-exit":
    child = os.fork()
    if child == 0:
        sys.exit(0)  # a normal exit: atexit handlers run in the forked child too
    os.waitpid(child, 0)
    role = "wait"
if role == "exec":
    ready()
    os.execv("/bin/sleep", ["sleep", "3600"])
threading.Thread(target=side_thread, daemon=True).start()
gc.collect()  # the registration's file must outlive a collection
load_batch() if role == "load" else wait_forever()
"""


class Job:
    """Children started as the runtime starts workers (worker_env merged into their environment)."""

    def __init__(self, tmp_path: Path, base_env=None):
        self.tmp = tmp_path
        self.registry = stacks_registry.registry_dir(tmp_path / "state", "run1", 1)
        self.out = tmp_path / "log" / "stacks"
        self.script = tmp_path / "train.py"
        self.script.write_text(JOB)
        self.ready_dir = tmp_path / "ready"
        self.ready_dir.mkdir()
        base = dict(os.environ if base_env is None else base_env)
        base.pop("RANK", None)
        base.pop("RANK_ID", None)
        self.env = {**base, **stacks_registry.worker_env(self.registry, base), "READY_DIR": str(self.ready_dir)}
        self.procs = []

    def start(self, *args, argv=None, **env) -> int:
        command = argv or [sys.executable, str(self.script), *args]
        proc = subprocess.Popen(command, env={**self.env, **env})
        self.procs.append(proc)
        return proc.pid

    def wait_ready(self, count: int) -> None:
        deadline = time.monotonic() + GENEROUS_S
        while len(os.listdir(self.ready_dir)) < count:
            assert time.monotonic() < deadline, f"{len(os.listdir(self.ready_dir))} of {count} children ready"
            time.sleep(0.01)

    def tree(self, leader: int):
        return [leader, *proc_table.descendants(leader)]

    def dump(self, trees, **kwargs):
        log = Log()
        began = time.monotonic()
        result = dumps.dump(self.registry, self.out, trees, log, **kwargs)
        return result, log, time.monotonic() - began

    def stop(self):
        for proc in self.procs:
            for pid in [*proc_table.descendants(proc.pid), proc.pid]:
                for signum in (signal.SIGKILL, signal.SIGCONT):
                    try:
                        os.kill(pid, signum)
                    except ProcessLookupError:
                        pass
            proc.wait(timeout=GENEROUS_S)


@pytest.fixture
def job(tmp_path):
    job = Job(tmp_path)
    yield job
    job.stop()


def test_a_blocked_rank_is_found_in_its_blocking_function(job):
    pid = job.start("wait")
    job.wait_ready(1)

    found, log, seconds = job.dump({"rank-0": [pid]})

    assert found.where["rank 0"][0] == "train.py:9 in wait_forever"
    assert found.where["rank 0"][1].endswith(" in <module>")
    assert found.folder == job.out and found.missing == [] and found.odd == []
    dump = (job.out / "rank-0.txt").read_text()
    assert "wait_forever" in dump and "side_thread" in dump
    assert log.fields("stack of a hung process") == [
        {"process": "rank 0", "pid": pid, "at": " <- ".join(found.where["rank 0"]), "threads": 2}]
    assert found.describe() == f"rank 0 is in train.py:9 in wait_forever; stacks in {job.out}"
    assert alive(pid)  # the signal dumps, it does not end the process


def test_the_rank_in_a_different_place_is_named_the_odd_one_out(job):
    pids = [job.start("load" if rank == 2 else "wait", RANK_ID=str(rank)) for rank in range(4)]
    job.wait_ready(4)

    found, log, _ = job.dump({f"rank-{rank}": [pid] for rank, pid in enumerate(pids)})

    assert found.odd == ["rank 2"]
    assert found.usual == "train.py:9 in wait_forever" and found.usual_count == 3
    assert found.where["rank 2"][0] == "train.py:14 in load_batch"
    assert found.describe() == ("rank 2 is elsewhere (train.py:14 in load_batch) while the other 3 wait in "
                                f"train.py:9 in wait_forever; stacks in {job.out}")
    [odd] = log.fields("odd ones out: not where the others are")
    assert odd["odd"] == "rank 2" and odd["others"] == "train.py:9 in wait_forever" and odd["count"] == 3
    assert sorted(os.listdir(job.out)) == ["rank-0.txt", "rank-1.txt", "rank-2.txt", "rank-3.txt"]


def test_a_ranks_helper_inherits_its_rank_variable_but_is_not_a_rank(job):
    # A torchrun-like tree: the agent (whose pod exported RANK=0, as Volcano's pytorch plugin does) starts
    # ranks 0 and 1; rank 1 starts a python helper that inherits RANK=1. The supervisor gives the ranks and
    # theirs, never the agent (supervise/ranks.py, tests/unit/test_ranks.py).
    agent = job.start("agent", "wait:RANK=0", "helper:RANK=1", RANK="0")
    job.wait_ready(4)
    tree = job.tree(agent)
    assert len(tree) == 4

    # The tree's order says nothing: helpers first.
    found, _, _ = job.dump({"torchrun": [*reversed(tree[1:])]})

    [helper_label] = set(found.where) - {"rank 0", "rank 1"}
    assert set(found.where) == {helper_label, "rank 0", "rank 1"}
    helper = int(helper_label.split()[1])
    assert helper_label == f"pid {helper} ({proc_table.comm(helper)})"
    assert proc_table.processes()[helper].ppid != agent  # the rank's helper, not a rank the agent started
    # Only the ranks are compared: the helper waits where it does without being odd.
    assert found.odd == [] and found.describe().startswith("every rank is in train.py:9 in wait_forever")
    assert "rank-0.txt" in sorted(os.listdir(job.out))


def test_msrun_s_scheduler_is_not_rank_0_and_its_ranks_come_from_rank_id(job):
    # msrun starts the user's script as its scheduler with RANK_ID=0 beside the workers; the pod exported
    # RANK=5 to every process.
    agent = job.start("agent", "wait:MS_ROLE=MS_SCHED,RANK_ID=0", "wait:MS_ROLE=MS_WORKER,RANK_ID=0",
                      "wait:MS_ROLE=MS_WORKER,RANK_ID=1", "load:MS_ROLE=MS_WORKER,RANK_ID=2", RANK="5")
    job.wait_ready(5)

    # Whatever is given: the scheduler that slipped into the trees is still no rank.
    found, log, _ = job.dump({"msrun": job.tree(agent)[1:]})

    ranks = sorted(label for label in found.where if label.startswith("rank "))
    assert ranks == ["rank 0", "rank 1", "rank 2"] and len(found.where) == 4
    assert found.odd == ["rank 2"] and found.usual_count == 2
    [rank_0] = [f["pid"] for f in log.fields("stack of a hung process") if f["process"] == "rank 0"]
    assert proc_table.environ(rank_0)["MS_ROLE"] == "MS_WORKER"


def test_a_rank_started_by_a_shell_wrapper_with_the_same_variables_is_still_the_rank(job):
    # RTF runs the command once per rank: `sh -c "python train.py"` gives sh and python the same RANK_ID.
    leader = job.start(argv=["sh", "-c", f"{sys.executable} {job.script} wait; exit 0"], RANK_ID="3")
    job.wait_ready(1)

    found, _, _ = job.dump({"rank-3": job.tree(leader)})

    assert list(found.where) == ["rank 3"]


def test_a_worker_that_is_not_python_gets_one_line_and_the_others_are_dumped(job):
    python = job.start("wait")
    sleeper = job.start(argv=["sleep", "3600"])
    job.wait_ready(1)

    found, log, _ = job.dump({"rank-0": [python], "rank-1": [sleeper]})

    line = f"worker rank-1 (pid {sleeper}, sleep) has no Python stack: no Python process in it"
    assert found.missing == [line] and line in log.events("warning")
    assert list(found.where) == ["rank 0"] and (job.out / "rank-0.txt").exists()
    assert alive(sleeper)


def test_a_python_that_skips_the_site_folder_is_said_to_have_not_registered(job):
    pid = job.start(argv=[sys.executable, "-E", str(job.script), "wait"])
    job.wait_ready(1)

    found, _, _ = job.dump({"command": [pid]})

    assert len(found.missing) == 1 and found.missing[0].startswith(f"worker command (pid {pid}, python")
    assert found.missing[0].endswith("has no Python stack: its Python did not register: started with -E, -I or -S, "
                                     "or without MA_RUNTIME_STACKS_DIR in its environment, or unable to write there")
    assert found.where == {} and found.folder is None and not job.out.exists()
    assert found.describe() == f"no Python stack could be taken ({found.missing[0]})"


def test_a_process_that_exec_d_another_program_is_not_signalled(job):
    # It registered as Python, then became `sleep`: its file is there, but the realtime signal would kill it.
    pid = job.start("exec")
    job.wait_ready(1)
    deadline = time.monotonic() + GENEROUS_S
    while proc_table.comm(pid) != "sleep":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert (job.registry / str(pid)).exists()

    found, _, _ = job.dump({"rank-0": [pid]})

    time.sleep(0.2)
    assert alive(pid)
    assert found.missing == [f"worker rank-0 (pid {pid}, sleep) has no Python stack: no Python process in it"]


def test_a_python_process_that_ends_takes_its_file_with_it_but_a_forked_child_does_not(job):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], env=job.env,
                          capture_output=True, text=True, timeout=GENEROUS_S)
    assert done.returncode == 0 and done.stdout.strip().isdigit()
    assert os.listdir(job.registry) == []
    pid = job.start("fork-exit")
    job.wait_ready(1)

    assert os.listdir(job.registry) == [str(pid)]
    found, _, _ = job.dump({"rank-0": [pid]})

    assert found.where["rank 0"][0] == "train.py:9 in wait_forever"


def test_the_image_s_own_sitecustomize_still_runs(tmp_path):
    image_site = tmp_path / "image-site"
    image_site.mkdir()
    (image_site / "sitecustomize.py").write_text(
        "import os\nMARK = 'image'\nopen(os.path.join(os.environ['READY_DIR'], 'image-' + str(os.getpid())), 'w')\n")
    job = Job(tmp_path, {**os.environ, "PYTHONPATH": str(image_site)})
    try:
        probe = subprocess.run(
            [sys.executable, "-c", "import sitecustomize, sys; print(sitecustomize.MARK, sys.path[1])"],
            env=job.env, capture_output=True, text=True, timeout=GENEROUS_S)
        assert probe.returncode == 0, probe.stderr
        assert probe.stdout.split() == ["image", str(stacks_registry.SITE_DIR)]
        pid = job.start("wait")
        job.wait_ready(3)  # the probe's mark, the child's mark, the child's ready file
        assert (job.ready_dir / f"image-{pid}").exists()

        found, _, _ = job.dump({"rank-0": [pid]})

        assert found.where["rank 0"][0] == "train.py:9 in wait_forever"
    finally:
        job.stop()


def test_a_process_that_replaced_the_handler_gives_one_line_after_the_timeout(job):
    pid = job.start("own-handler")
    job.wait_ready(1)

    found, log, seconds = job.dump({"rank-0": [pid]}, timeout=1.0)

    line = (f"rank 0 (pid {pid}) did not answer the stack signal within 1 s: its handler was replaced, "
            "or the signal is blocked or ignored")
    assert found.missing == [line] and line in log.events("warning")
    assert found.where == {} and found.describe() == f"no Python stack could be taken ({line})"
    assert seconds >= 1.0  # it waited the whole timeout for the answer
    assert alive(pid)


def test_a_stopped_process_is_said_to_be_stopped_and_the_others_are_dumped(job):
    stopped = job.start("wait")
    running = job.start("wait")
    job.wait_ready(2)
    os.kill(stopped, signal.SIGSTOP)

    found, _, seconds = job.dump({"rank-0": [stopped], "rank-1": [running]}, timeout=0.5)

    assert found.missing == [f"rank 0 (pid {stopped}) did not answer the stack signal within 0.5 s: "
                             "it is stopped (SIGSTOP)"]
    assert list(found.where) == ["rank 1"]


def test_a_vanished_process_and_an_unreadable_registry_raise_nothing(job, tmp_path):
    pid = job.start("wait")
    job.wait_ready(1)
    gone = subprocess.Popen(["true"])
    gone.wait()

    found, _, _ = job.dump({"rank-0": [pid], "rank-1": [gone.pid], "rank-2": []})

    assert list(found.where) == ["rank 0"]
    assert found.missing[-1] == "worker rank-2 has no Python stack: it has no living process"
    empty = dumps.dump(tmp_path / "no-registry", tmp_path / "out", {"rank-0": [pid]}, Log())
    assert empty.where == {} and empty.folder is None


# ---------------------------------------------------------------------------------------------- environment


@pytest.mark.parametrize("existing, expected", [
    (None, "{site}"),
    ("", "{site}"),  # Python reads an empty PYTHONPATH as unset: no empty entry (the current directory) added
    ("/opt/code", "{site}:/opt/code"),
    (":/opt/code", "{site}::/opt/code"),  # the job's own empty entry is kept
])
def test_worker_env_puts_the_site_folder_first_on_pythonpath(tmp_path, existing, expected):
    environ = {} if existing is None else {"PYTHONPATH": existing}

    added = stacks_registry.worker_env(tmp_path / "registry", environ)

    assert added == {"PYTHONPATH": expected.format(site=stacks_registry.SITE_DIR),
                     "MA_RUNTIME_STACKS_DIR": str(tmp_path / "registry"),
                     "MA_RUNTIME_STACKS_SIGNAL": str(signal.SIGRTMIN + 4)}
    # Nothing there that could shadow a module of the job's (bytecode aside).
    assert set(os.listdir(stacks_registry.SITE_DIR)) - {"__pycache__"} == {"sitecustomize.py"}


def test_the_registry_is_created_empty_and_abandoned_ones_are_removed(tmp_path):
    root = tmp_path / "stacks"
    dead = subprocess.Popen(["true"])
    dead.wait()
    old = time.time() - 2 * stacks_registry.ABANDONED_SECONDS
    for name, pid in (("abandoned-1", dead.pid), ("living-1", os.getpid()), ("young-1", dead.pid)):
        (root / name).mkdir(parents=True)
        (root / name / str(pid)).touch()
        if name != "young-1":
            os.utime(root / name, (old, old))
    (root / "run-2").mkdir()
    (root / "run-2" / "12345").touch()  # a leftover of the same name

    registry = stacks_registry.registry_dir(tmp_path, "run", 2)

    assert registry == root / "run-2" and os.listdir(registry) == []
    assert sorted(os.listdir(root)) == ["living-1", "run-2", "young-1"]
    stacks_registry.clean(registry)
    assert not registry.exists()
    stacks_registry.clean(registry)  # twice: nothing to do


# ---------------------------------------------------------------------------------------------- parsing

# Python 3.11 on Linux, four threads: a worker thread with thread names (3.14 prints them), one in C only,
# one over 100 frames deep, then the main thread; the GC marker of bpo-44466.
SAMPLE = """\
Thread 0x00007f3a1b7fe6c0 [pt_data_worker] (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/opt/code/data.py", line 88 in fetch
  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner

Thread 0x00007f3a1bfff6c0 (most recent call first):
  <no Python frame>

Thread 0x00007f3a20a006c0 (most recent call first):
  File "/opt/code/deep.py", line 5 in recurse
  File "/opt/code/deep.py", line 5 in recurse
  ...

Current thread 0x00007f3a2b0f5b80 (most recent call first):
  Garbage-collecting
  File "/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py", line 2050 in all_reduce
  File "/opt/code/train.py", line 42 in step
  File "/opt/code/train.py", line 80 in main
  File "/opt/code/train.py", line 99 in <module>
"""


def test_parse_reads_every_thread_block():
    threads = stacks_summary.parse(SAMPLE)

    assert [len(t.frames) for t in threads] == [3, 0, 2, 4]
    assert [t.truncated for t in threads] == [False, False, True, False]
    assert threads[0].frames[1] == stacks_summary.Frame("/opt/code/data.py", "88", "fetch")
    main = stacks_summary.main_thread(threads)
    assert main.header.startswith("Current thread 0x00007f3a2b0f5b80")
    assert [f.short() for f in main.frames[:3]] == [
        "distributed_c10d.py:2050 in all_reduce", "train.py:42 in step", "train.py:80 in main"]


@pytest.mark.parametrize("text, frames", [
    ("", None),
    ("garbage\nmore garbage\n", None),
    # all_threads=False, and the oldest CPython header form
    ('Stack (most recent call first):\n  File "a.py", line 3 in f\n', ["a.py:3 in f"]),
    ('Current thread 0x00007f:\n  File "a.py", line ??? in ???\n', ["a.py:??? in ???"]),
    # a dump cut off mid-line (read while still being written): the whole lines count
    ('Thread 0x01 (most recent call first):\n  File "b.py", line 1 in g\n  File "b.py", li', ["b.py:1 in g"]),
    # over 100 threads: the list ends with `...` and the main thread is not in it; the last shown stands in
    ('Thread 0x02 (most recent call first):\n  File "c.py", line 9 in h\n\n...\n', ["c.py:9 in h"]),
])
def test_parse_takes_any_text_without_raising(text, frames):
    main = stacks_summary.main_thread(stacks_summary.parse(text))

    assert (None if main is None else [f.short() for f in main.frames]) == frames


# ---------------------------------------------------------------------------------------------- summary


def summary(where, odd=(), usual=None, count=0, missing=(), folder=Path("/logs/stacks")):
    return stacks_summary.Stacks(folder, where, list(odd), usual, list(missing), count)


@pytest.mark.parametrize("found, sentence", [
    (summary({f"rank {r}": ["train.py:42 in all_reduce"] for r in range(8)}, usual="train.py:42 in all_reduce",
             count=8), "every rank is in train.py:42 in all_reduce; stacks in /logs/stacks"),
    (summary({"rank 0": ["a.py:1 in f"], "rank 1": ["b.py:2 in g"], "rank 2": ["c.py:3 in h"],
              "rank 3": ["a.py:1 in f"], "rank 4": ["a.py:1 in f"]}, odd=["rank 1", "rank 2"],
             usual="a.py:1 in f", count=3),
     "rank 1, rank 2 are elsewhere (rank 1: b.py:2 in g; rank 2: c.py:3 in h) while the other 3 wait in "
     "a.py:1 in f; stacks in /logs/stacks"),
    (summary({"rank 0": ["a.py:1 in f"], "rank 1": ["b.py:2 in g"]}),
     "the ranks are in 2 different places: a.py:1 in f (1), b.py:2 in g (1); stacks in /logs/stacks"),
    (summary({"pid 7 (python)": ["a.py:1 in f"], "pid 9 (python)": ["a.py:1 in f"]}, usual="a.py:1 in f", count=2),
     "every process is in a.py:1 in f; stacks in /logs/stacks"),
    (summary({"pid 7 (python)": []}, usual="no Python frame", count=1),
     "pid 7 (python) is in no Python frame; stacks in /logs/stacks"),
    (summary({}, missing=["worker command (pid 5, bash) has no Python stack: no Python process in it"],
             folder=None),
     "no Python stack could be taken (worker command (pid 5, bash) has no Python stack: no Python process in it)"),
])
def test_describe_is_one_sentence(found, sentence):
    assert found.describe() == sentence


def test_many_odd_ones_are_counted_not_all_named():
    where = {f"rank {r}": ["b.py:2 in g" if r >= 20 else "a.py:1 in f"] for r in range(32)}
    odd = [f"rank {r}" for r in range(20, 32)]

    sentence = summary(where, odd=odd, usual="a.py:1 in f", count=20).describe()

    assert sentence.startswith("rank 20, rank 21, rank 22, rank 23, rank 24, rank 25, rank 26 and 5 more are "
                               "elsewhere (b.py:2 in g) while the other 20 wait in a.py:1 in f")


def test_no_odd_ones_without_a_strictly_largest_group():
    a, b = stacks_summary.Frame("a.py", "1", "f"), stacks_summary.Frame("b.py", "2", "g")

    assert stacks_summary._odd_ones_out({"rank 0": a, "rank 1": b, "rank 2": a, "rank 3": b}) == ([], None, 0)
    assert stacks_summary._odd_ones_out({"rank 0": a, "rank 1": b, "rank 2": a}) == (["rank 1"], a, 2)
    assert stacks_summary._odd_ones_out({"rank 0": a, "rank 1": a}) == ([], a, 2)


# ---------------------------------------------------------------------------------------------- py-spy

PY_SPY_DENIED = {
    # as a user other than the target's
    "other user": "Permission Denied: Try running again with elevated permissions by going "
                  "'sudo env \"PATH=$PATH\" !!'\n",
    # as root without CAP_SYS_PTRACE (a container's default)
    "no capability": "Error: Failed to get process executable name. Check that the process is running.\n\n"
                     "Caused by:\n    0: Permission denied (os error 13)\n    1: Permission denied (os error 13)\n",
}


def fake_py_spy(folder: Path, body: str) -> Path:
    folder.mkdir(exist_ok=True)
    tool = folder / "py-spy"
    tool.write_text("#!/bin/sh\n" + body)
    tool.chmod(0o755)
    return folder


@pytest.fixture
def two_ranks(job):
    pids = [job.start("wait"), job.start("wait")]
    job.wait_ready(2)
    return {"rank-0": [pids[0]], "rank-1": [pids[1]]}


def test_without_py_spy_there_is_one_debug_line_and_nothing_else(job, two_ranks, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))

    found, log, _ = job.dump(two_ranks)

    assert log.events("debug") == ["py-spy is not installed: no py-spy dumps"]
    assert sorted(os.listdir(job.out)) == ["rank-0.txt", "rank-1.txt"]
    assert not [e for e in log.events("warning") if "py-spy" in e]


@pytest.mark.parametrize("case", sorted(PY_SPY_DENIED))
def test_py_spy_without_ptrace_permission_is_one_line(job, two_ranks, monkeypatch, tmp_path, case):
    message = PY_SPY_DENIED[case].replace("'", "'\\''")
    bin_dir = fake_py_spy(tmp_path / "bin", f"printf '%s' '{message}' >&2\nexit 1\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    found, log, _ = job.dump(two_ranks)

    [denied] = [(e, f) for lvl, e, f in log.records if "py-spy" in e]
    assert denied[0] == "py-spy needs ptrace: give the container the SYS_PTRACE capability to get its dumps"
    assert denied[1]["processes"] == 2
    assert denied[1]["error"] == {"other user": PY_SPY_DENIED["other user"].strip(),
                                  "no capability": "Permission denied (os error 13)"}[case]
    assert sorted(os.listdir(job.out)) == ["rank-0.txt", "rank-1.txt"]
    assert found.where.keys() == {"rank 0", "rank 1"}


def test_py_spy_dumps_are_written_and_its_other_failures_named(job, two_ranks, monkeypatch, tmp_path):
    # Rank 0's dump works; rank 1's Python is too new for it.
    failing = two_ranks["rank-1"][0]
    bin_dir = fake_py_spy(tmp_path / "bin", f"""\
if [ "$3" = "{failing}" ]; then echo "Error: Unsupported version of Python: 3.99.0" >&2; exit 1; fi
echo "Process $3: python train.py"
echo "Thread $3 (idle): \\"MainThread\\""
echo "    wait_forever (train.py:9)"
""")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    _, log, _ = job.dump(two_ranks)

    assert "wait_forever (train.py:9)" in (job.out / "rank-0.py-spy.txt").read_text()
    assert not (job.out / "rank-1.py-spy.txt").exists()
    assert log.fields("py-spy dump failed") == [
        {"process": "rank 1", "error": "Error: Unsupported version of Python: 3.99.0"}]


def test_a_py_spy_that_hangs_is_killed_at_its_timeout(job, two_ranks, monkeypatch, tmp_path):
    bin_dir = fake_py_spy(tmp_path / "bin", "exec sleep 3600\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    found, log, seconds = job.dump(two_ranks, py_spy_timeout=1.0)  # returns: the 3600 s py-spy was killed

    failures = log.fields("py-spy dump failed")
    assert [f["process"] for f in failures] == ["rank 0", "rank 1"]
    assert {f["error"] for f in failures} == {"py-spy did not answer within 1 s"}
    assert found.where.keys() == {"rank 0", "rank 1"}
