"""`ma-runtime local --inject FAULT`: the parser, every kind and every way a value can be wrong."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ma_runtime.local import faults
from ma_runtime.local.faults import BadFault, Fault, parse
from ma_runtime.supervise.stacks import registry as stacks_registry


@pytest.mark.parametrize("text, fault", [
    ("kill@1:rank=3:after=20s", Fault("kill", 1, 20.0, rank=3)),
    ("hang@1:rank=0:after=30s", Fault("hang", 1, 30.0, rank=0)),
    ("exit@0:code=3:after=10s", Fault("exit", 0, 10.0, code=3)),
    ("exit@1", Fault("exit", 1, 0.0, code=1)),
    ("netdrop@2:after=15s", Fault("netdrop", 2, 15.0)),
    ("preempt:after=60s", Fault("preempt", None, 60.0)),
    ("preempt", Fault("preempt", None, 0.0)),
    ("kill@0:after=1.5m", Fault("kill", 0, 90.0)),
    ("hang@0:after=2", Fault("hang", 0, 2.0)),
    ("kill@0:after=1h:rank=2", Fault("kill", 0, 3600.0, rank=2)),
])
def test_each_kind_reads_as_documented(text, fault):
    assert parse(text, nodes=3) == fault


RTF_NODE1 = {4100 + rank: f"rank {rank}" for rank in range(8, 16)}  # node1 of 2x8 under rtf: RANK_ID 8-15


@pytest.mark.parametrize("ranks, rank, found", [
    (RTF_NODE1, None, (4108, "rank 8")),  # no rank=: the node's first, under any launcher
    (RTF_NODE1, 11, (4111, "rank 11")),  # rank= is the job's rank
    ({812: "pid 812 (python)"}, None, (812, "pid 812 (python)")),  # a plain command: its only process
    ({812: "pid 812 (python)"}, 0, (812, "pid 812 (python)")),
    ({812: "pid 812 (python)"}, 3, None),  # may name itself later: wait
    ({}, None, None),  # nothing runs yet: wait
])
def test_the_rank_a_fault_hits(ranks, rank, found):
    assert faults.pick(ranks, rank) == found


def test_a_rank_the_node_does_not_run_is_said_not_waited_for():
    # torchrun with one rank per node: node1's only rank is 1, so exit@1:rank=0 can never happen there.
    with pytest.raises(faults.NotHere, match=r"^rank 0 is not on this node \(its ranks: 8, 9, 10, 11, 12, 13, 14, "
                                             r"15\)$"):
        faults.pick(RTF_NODE1, 0)


def test_a_fault_without_rank_says_it_hits_the_node_s_first():
    assert str(parse("exit@1:code=3:after=1s", nodes=2)) == "exit on node1 (its first rank exits 3) at 1s"
    assert str(parse("kill@1:rank=9", nodes=2)) == "kill on node1 (SIGKILL to rank 9) at 0s"


@pytest.mark.parametrize("text, said", [
    ("crash@1", "unknown fault 'crash'"),
    ("kill", "kill needs @NODE, a node index from 0 to 2"),
    ("kill@3", "from 0 to 2 (--nodes 3)"),
    ("kill@-1", "needs @NODE"),
    ("kill@x", "needs @NODE"),
    ("preempt@0", "preempt stops every node"),
    ("kill@1:code=3", "'code=3' is not a setting of kill (it takes rank=, after=)"),
    ("netdrop@1:rank=0", "not a setting of netdrop (it takes after=)"),
    ("kill@1:rank", "'rank' is not a setting of kill"),
    ("kill@1:after=soon", "after='soon' is not a duration"),
    ("kill@1:after=-1s", "is not a duration"),
    ("exit@1:code=0", "code='0' must be a whole number from 1 to 255"),
    ("exit@1:code=256", "from 1 to 255"),
    ("kill@1:rank=1.5", "rank='1.5' must be a whole number"),
])
def test_a_bad_fault_says_what_is_wrong(text, said):
    with pytest.raises(BadFault) as raised:
        parse(text, nodes=3)
    message = str(raised.value)
    assert said in message and "\n" not in message
    assert message.startswith(f"--inject {text!r}")


@pytest.mark.parametrize("order", ["as the runtime starts a rank", "the other way round"])
def test_the_exit_fault_s_sitecustomize_chains_once_with_the_runtime_s_and_the_image_s(tmp_path, order):
    # Two sitecustomizes that each skipped only their own folder ran each other in turn until Python's recursion
    # limit: 98 exit-fault threads and 49 stack registrations in every rank of a local run.
    image_site = tmp_path / "image-site"
    image_site.mkdir()
    (image_site / "sitecustomize.py").write_text(
        "import os\nwith open(os.environ['IMAGE_MARKS'], 'a') as f:\n    f.write('ran\\n')\n")
    folders = [str(stacks_registry.SITE_DIR), str(faults.SITE_DIR)]
    if order == "the other way round":
        folders.reverse()
    marks = tmp_path / "marks"
    (tmp_path / "stacks").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*folders, str(image_site)]), "IMAGE_MARKS": str(marks),
           faults.FAULTS_DIR_ENV: str(tmp_path), "MA_PROC_START_CNT": "1",
           "MA_RUNTIME_STACKS_DIR": str(tmp_path / "stacks"), "MA_RUNTIME_STACKS_SIGNAL": str(signal.SIGRTMIN + 4)}
    probe = subprocess.run(
        [sys.executable, "-c", "import threading; print(sum(thread.name == 'ma-local-exit-fault' "
                               "for thread in threading.enumerate()), threading.active_count())"],
        env=env, capture_output=True, text=True, timeout=30)
    assert probe.returncode == 0 and probe.stderr == "", probe.stderr
    assert probe.stdout.split() == ["1", "2"]  # the exit fault's watcher, once, and the main thread
    assert marks.read_text() == "ran\n"  # the image's own, once


def test_own_pid_is_the_pid_a_process_has_in_its_own_pid_namespace():
    """The exit fault's file is named by the pid the rank sees (os.getpid()): in a container, not this machine's."""
    assert faults.own_pid(os.getpid()) == os.getpid()
    if os.geteuid() != 0:
        pytest.skip("a pid namespace of its own needs root here")
    # `unshare --pid --fork` makes a pid namespace whose first process, sleep, is pid 1 there.
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sleep", "30"])
    try:
        inner = None
        for _ in range(100):
            children = Path(f"/proc/{outer.pid}/task/{outer.pid}/children").read_text().split()
            if children:
                inner = int(children[0])
                break
            time.sleep(0.05)
        assert inner is not None and inner != 1
        assert faults.own_pid(inner) == 1
    finally:
        outer.kill()
        outer.wait()
