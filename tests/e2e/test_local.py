"""`ma-runtime local` end to end: real `ma-run`s in network namespaces, moto's store in the switch namespace.

What is asserted is what the user gets (the exit code, the summary, the files under --out, the bucket) and that
nothing is left: no namespace of the run, no process of it. No timed assertion; GUARD only ends a broken run.
"""

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ma_runtime.local import nodes as local_nodes
from tests.conftest import MA_RUNTIME, marked

_MISSING = local_nodes.missing()
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)} (ma_runtime/local/nodes.py)")
pytest.importorskip("moto.server")
GUARD = 180
SCRIPT = f"train_{uuid.uuid4().hex[:12]}.py"  # a name no other process on the machine has

# Reads its input (staged in from the bucket), writes a checkpoint on worker-0, then works WORK seconds on the
# first attempt (long enough to be stopped or failed) and a moment on the others.
TRAIN = r"""
import argparse, os, sys, time
parser = argparse.ArgumentParser()
parser.add_argument("--data_url"); parser.add_argument("--train_url")
args, _ = parser.parse_known_args()
node, attempt = os.environ["VC_TASK_INDEX"], os.environ["MA_PROC_START_CNT"]
print("node", node, "attempt", attempt, "read", open(os.path.join(args.data_url, "part-0.txt")).read().strip(),
      flush=True)
if node == "0":
    os.makedirs(os.path.join(args.train_url, "ckpt"), exist_ok=True)
    with open(os.path.join(args.train_url, "ckpt", "model.bin"), "w") as f:
        f.write(f"weights of attempt {attempt}")
    print("checkpoint written", flush=True)
time.sleep(float(os.environ.get("WORK", "0")) if attempt == "1" else 0.2)
"""

# Says a step every half second for STEPS steps: the progress the hang detector follows (MA_RUNTIME_PROGRESS_PATTERN).
STEPS = r"""
import os, time
for step in range(int(os.environ.get("STEPS", "60"))):
    print("node", os.environ["VC_TASK_INDEX"], "step", step, flush=True)
    time.sleep(0.5)
"""

JOB = """\
inputs:
  - name: data_url
    url: obs://local-bkt/datasets/demo/
outputs:
  - name: train_url
    url: obs://local-bkt/jobs/run-1/output/
"""


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "part-0.txt").write_text("rows 1-100\n")
    (tmp_path / SCRIPT).write_text(TRAIN)
    (tmp_path / f"steps_{SCRIPT}").write_text(STEPS)
    (tmp_path / "job.yaml").write_text(JOB)
    return tmp_path


def local(workdir: Path, *args: str, **env) -> subprocess.CompletedProcess:
    environ = {name: value for name, value in os.environ.items() if not name.startswith(("MA_", "VC_"))}
    environ.update({"MA_RUNTIME_PREFLIGHT": "off", **{name: str(value) for name, value in env.items()}})
    return subprocess.run([MA_RUNTIME, "local", "--nodes", "2", "--config", "job.yaml",
                           "--data", "obs://local-bkt/datasets/demo=./data", "--out", str(workdir / "out"), *args,
                           "--", sys.executable, SCRIPT],
                          cwd=workdir, env=environ, capture_output=True, text=True, timeout=GUARD)


def local_command(workdir: Path, args, command, **env) -> subprocess.CompletedProcess:
    """`ma-runtime local ARGS -- COMMAND` without the job file and data of `local`."""
    environ = {name: value for name, value in os.environ.items() if not name.startswith(("MA_", "VC_"))}
    environ.update({name: str(value) for name, value in env.items()})
    return subprocess.run([MA_RUNTIME, "local", "--out", str(workdir / "out"), *args, "--", *command],
                          cwd=workdir, env=environ, capture_output=True, text=True, timeout=GUARD)


def assert_nothing_left(_result) -> None:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "ma-local-" not in listed, listed
    assert not list(Path("/etc/netns").glob("ma-local-*")) if Path("/etc/netns").exists() else True
    assert not marked("ma_runtime.local.store"), "the store outlived the run"
    assert not marked(SCRIPT), "a node's command outlived the run"


def test_two_nodes_stage_in_from_the_bucket_and_the_checkpoint_comes_back_into_out(workdir):
    result = local(workdir)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    out = workdir / "out"
    for node in (0, 1):
        assert f"[node{node}] node {node} attempt 1 read rows 1-100" in result.stdout
        assert f"[node{node}] " in result.stdout and "input (data_url) download completed" in result.stdout
        assert (out / f"node{node}" / "log" / f"modelarts-job-local-worker-{node}.log").exists()
        assert (out / f"node{node}" / "console.log").read_text().count("attempt 1 read") == 1
    checkpoint = out / "bucket" / "local-bkt" / "jobs" / "run-1" / "output" / "ckpt" / "model.bin"
    assert checkpoint.read_text() == "weights of attempt 1"
    summary = result.stdout[result.stdout.index("ma-runtime local: summary"):]
    assert "node0: exit 0, attempts 1, final sync completed" in summary
    assert "verdict: succeeded" in summary
    assert "volcano: no policy fires (every pod exited 0: the job completes)" in summary
    assert "1 object(s) written by the job, 2 in all" in summary  # the input is not the job's
    assert "obs://local-bkt/jobs/run-1/output/ckpt/model.bin (20 bytes)" in summary
    assert summary.rstrip().endswith("exit code: 0")
    assert not (out / "node0" / "home").exists()  # no --keep
    assert_nothing_left(result)


def test_an_exit_fault_restarts_every_node_together(workdir):
    result = local(workdir, "--inject", "exit@1:code=3:after=1s", WORK=60, MA_RUNTIME_MAX_RESTARTS=1)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    assert "[node1] ma-runtime local: exit fault: exiting with code 3" in result.stdout
    for node in (0, 1):
        assert f"[node{node}] node {node} attempt 2 read rows 1-100" in result.stdout
    summary = result.stdout[result.stdout.index("ma-runtime local: summary"):]
    assert "node0: exit 0, attempts 2" in summary and "node1: exit 0, attempts 2" in summary
    assert "fault: exit on node1 (its first rank exits 3) at 1s: done" in summary
    assert_nothing_left(result)


def test_preempt_stops_every_node_with_143_after_the_final_sync(workdir):
    result = local(workdir, "--inject", "preempt:after=5s", WORK=60)
    assert result.returncode == 143, result.stdout[-4000:] + result.stderr
    summary = result.stdout[result.stdout.index("ma-runtime local: summary"):]
    assert "node0: exit 143, attempts 1, final sync completed" in summary
    assert "node1: exit 143, attempts 1, final sync completed" in summary
    checkpoint = workdir / "out" / "bucket" / "local-bkt" / "jobs" / "run-1" / "output" / "ckpt" / "model.bin"
    assert checkpoint.exists(), summary
    assert_nothing_left(result)


@pytest.mark.parametrize("args, said", [
    (["--inject", "kill@5"], "--inject 'kill@5': kill needs @NODE, a node index from 0 to 1 (--nodes 2)"),
    (["--inject", "boom"], "unknown fault 'boom'"),
    (["--data", "obs://b/x=./nowhere"], "./nowhere does not exist"),
])
def test_bad_usage_is_one_line_and_78(workdir, args, said):
    result = local(workdir, *args)
    assert result.returncode == 78, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and said in result.stderr, result.stderr
    assert result.stderr.startswith("ma-runtime local: error: ")
    assert not (workdir / "out").exists()


def start_runner(workdir: Path) -> subprocess.Popen:
    """The runner in a session of its own (as in a terminal, its nodes in its process group), once both nodes'
    commands run."""
    environ = {name: value for name, value in os.environ.items() if not name.startswith(("MA_", "VC_"))}
    runner = subprocess.Popen([MA_RUNTIME, "local", "--nodes", "2", "--config", "job.yaml", "--data",
                               "obs://local-bkt/datasets/demo=./data", "--out", str(workdir / "out"), "--",
                               sys.executable, SCRIPT], cwd=workdir, env={**environ, "WORK": "120"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    waiting = {"[node0] checkpoint written", "[node1] node 1 attempt 1 read"}  # both commands running
    for line in runner.stdout:
        waiting = {text for text in waiting if text not in line}
        if not waiting:
            break
    return runner


def test_sigterm_to_the_runner_stops_the_job_and_leaves_nothing(workdir):
    runner = start_runner(workdir)
    runner.terminate()
    out, err = runner.communicate(timeout=GUARD)
    assert runner.returncode == 143, out[-3000:] + err
    assert "node0: exit 143, attempts 1, final sync completed" in out
    assert (workdir / "out" / "bucket" / "local-bkt" / "jobs" / "run-1" / "output" / "ckpt" / "model.bin").exists()
    assert_nothing_left(runner)


@pytest.mark.parametrize("to_group", [False, True], ids=["to the runner", "to its process group, as a terminal"])
def test_ctrl_c_stops_the_job_as_sigterm_does_and_leaves_nothing(workdir, to_group):
    runner = start_runner(workdir)
    if to_group:
        os.killpg(runner.pid, signal.SIGINT)
    else:
        runner.send_signal(signal.SIGINT)
    out, err = runner.communicate(timeout=GUARD)
    assert runner.returncode == 130, out[-3000:] + err
    assert "Traceback" not in out + err, out[-3000:] + err
    for node in (0, 1):
        assert f"node{node}: exit 143, attempts 1, final sync completed" in out, out[-3000:]
    assert (workdir / "out" / "bucket" / "local-bkt" / "jobs" / "run-1" / "output" / "ckpt" / "model.bin").exists()
    assert_nothing_left(runner)


def test_npu_two_nodes_of_eight_devices_start_sixteen_ranks_from_the_rank_table_the_box_wrote(workdir):
    # No MA_RUN_METHOD: an NPU job (RANK_TABLE_FILE set) gets rtf, as on the platform.
    show = f"import os; print('{SCRIPT}', 'node', os.environ['VC_TASK_INDEX'], 'rank_id', os.environ['RANK_ID'], " \
           "'of', os.environ['RANK_SIZE'], 'device', os.environ['DEVICE_ID'])"
    result = local_command(workdir, ["--nodes", "2", "--accelerator", "npu", "--devices", "8"],
                           [sys.executable, "-c", show])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    lines = result.stdout.splitlines()
    for node in (0, 1):
        started = [line for line in lines if line.startswith(f"[node{node}] ") and 'msg="starting command"' in line]
        assert len(started) == 1 and "method=rtf processes=8" in started[0], started
        # The box wrote the table initializing, then completed: the runtime waited, then read both servers.
        waited = [line for line in lines if line.startswith(f"[node{node}] ") and 'msg="rank table wait' in line]
        ready = [line for line in lines if line.startswith(f"[node{node}] ") and 'msg="rank table ready"' in line]
        assert len(waited) == 1 and len(ready) == 1 and "servers=2 rank_size=16" in ready[0], waited + ready
    found = re.compile(rf"\[node(\d)\] \[rank-(\d+)\] {SCRIPT} node (\d) rank_id (\d+) of 16 device (\d+)$")
    printed = sorted(tuple(map(int, match.groups())) for match in map(found.match, lines) if match)
    # One line per rank, rank ids in node order (node0 0-7, node1 8-15), each on its node's device rank % 8.
    assert printed == [(rank // 8, rank, rank // 8, rank, rank % 8) for rank in range(16)], printed
    assert "node0: exit 0, attempts 1" in result.stdout and "node1: exit 0, attempts 1" in result.stdout
    assert_nothing_left(result)


def test_npu_with_a_template_one_rank_table_the_runtime_reads_it_as_written(workdir):
    show = f"import os; print('{SCRIPT}', 'node', os.environ['VC_TASK_INDEX'], 'rank_id', os.environ['RANK_ID'])"
    result = local_command(workdir, ["--nodes", "2", "--accelerator", "npu", "--devices", "2", "--ranktable", "one"],
                           [sys.executable, "-c", show], MA_RUNTIME_PREFLIGHT="off")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    ready = [line for line in result.stdout.splitlines() if 'msg="rank table ready"' in line]
    assert len(ready) == 2 and all("servers=2 rank_size=4" in line for line in ready), ready
    found = re.compile(rf"\[node(\d)\] \[rank-(\d+)\] {SCRIPT} node (\d) rank_id (\d+)$")
    printed = sorted(tuple(map(int, match.groups())) for match in map(found.match, result.stdout.splitlines())
                     if match)
    assert printed == [(rank // 2, rank, rank // 2, rank) for rank in range(4)], printed
    assert_nothing_left(result)


def summary_of(result) -> str:
    return result.stdout[result.stdout.index("ma-runtime local: summary"):]


def test_a_kill_fault_is_a_crash_of_that_node_s_rank_and_the_job_fails_with_its_code(workdir):
    result = local(workdir, "--inject", "kill@1:after=1s", WORK=60, MA_RUNTIME_MAX_RESTARTS=0)
    assert result.returncode == 137, result.stdout[-4000:] + result.stderr
    summary = summary_of(result)
    assert "node0: exit 86, attempts 1" in summary and "node1: exit 137, attempts 1" in summary
    assert "verdict: node1 failed first (" in summary and "exit 137, attempt 1)" in summary
    assert "fault: kill on node1 (SIGKILL to its first rank) at 1s: done (pid " in summary
    assert "volcano: no policy for node0's exit 86, node1's exit 137: the job fails" in summary
    assert_nothing_left(result)


def test_a_hang_fault_stops_the_rank_and_the_hang_detector_ends_the_job_with_83(workdir):
    result = local_command(workdir, ["--nodes", "2", "--inject", "hang@1:after=2s"],
                           [sys.executable, f"steps_{SCRIPT}"], MA_RUNTIME_PREFLIGHT="off",
                           MA_RUNTIME_HANG_DETECT="on", MA_RUNTIME_HANG_DETECT_SECONDS=5,
                           MA_RUNTIME_PROGRESS_PATTERN=r"step \d+", MA_RUNTIME_HANG_RESTARTS=0,
                           MA_RUNTIME_MAX_RESTARTS=0, MA_RUNTIME_STOP_GRACE_SECONDS=2)
    assert result.returncode == 83, result.stdout[-4000:] + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("[node1] ") and 'msg="job suspected hung"' in line for line in lines)
    assert any(line.startswith("[node1] ") and "it is stopped (SIGSTOP)" in line for line in lines)
    summary = summary_of(result)
    assert "node0: exit 86, attempts 1" in summary and "node1: exit 83, attempts 1" in summary
    assert "fault: hang on node1 (SIGSTOP to its first rank) at 2s: done (pid " in summary
    assert "volcano: RestartJob for node1's exit 83 (hang detected" in summary
    # node0 stopped for node1's hang took its rank's stack (node1's rank, stopped, could not answer), under --out.
    stacks = workdir / "out" / "node0" / "log" / "modelarts-job-local-worker-0-stacks" / "attempt-1"
    dumps = list(stacks.glob("pid-*.txt"))
    assert len(dumps) == 1 and f"steps_{SCRIPT}" in dumps[0].read_text(), dumps
    assert f"stacks: node0 attempt 1: 1 file(s) in {stacks}" in summary
    assert_nothing_left(result)


def test_a_netdrop_fault_cuts_the_node_off_and_its_peers_find_it_lost(workdir):
    result = local_command(workdir, ["--nodes", "2", "--inject", "netdrop@1:after=2s"],
                           [sys.executable, f"steps_{SCRIPT}"], MA_RUNTIME_PREFLIGHT="off",
                           MA_RUNTIME_NODE_LOST_SECONDS=5, MA_RUNTIME_MAX_RESTARTS=0)
    # Every node stops for the job: node0 finds node1 lost, node1 its coordinator (on node0) unreachable.
    assert result.returncode == 86, result.stdout[-4000:] + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("[node0] ") and "(task 1) was lost: no heartbeat" in line for line in lines)
    assert any(line.startswith("[node1] ") and "Network is unreachable" in line for line in lines)
    summary = summary_of(result)
    assert "node0: exit 86, attempts 1" in summary and "node1: exit 86, attempts 1" in summary
    assert "verdict: node1 failed first (lost, attempt 1)" in summary
    assert "fault: netdrop on node1 (eth0 down) at 2s: done" in summary
    assert "volcano: RestartJob if node1's pod is evicted from its lost node (PodEvicted)" in summary
    assert_nothing_left(result)
