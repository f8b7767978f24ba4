"""`ma-runtime local --image`: each node a podman container of the CPU image built by tests/e2e/test_image.py.

The job comes as a user's would: its code and data through --data into the bucket, the job file's code_url and
inputs staged in by the runtime in the image, which is each container's PID 1 as uid 1000. What is asserted is
what the user gets (the exit code, the summary, --out, the bucket) and that nothing is left: no container, no
namespace, no job process, nothing in --out still owned by the job's uid (the store's end is test_local.py's: it is
the same with or without --image).
"""

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from ma_runtime.local import nodes as local_nodes
from tests.conftest import MA_RUNTIME, marked
from tests.e2e.test_image import RUNTIME_VENV, built_image, podman

_MISSING = local_nodes.missing()
pytestmark = [pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)} (ma_runtime/local/nodes.py)"),
              pytest.mark.root]
pytest.importorskip("moto.server")
GUARD = 240
SCRIPT = f"train_{uuid.uuid4().hex[:12]}.py"  # a name no other process on the machine has
CODE = "/home/ma-user/modelarts/user-job-dir/code"  # where the runtime stages the job file's code_url in

# Says what it runs under, reads its input, writes a checkpoint on worker-0, works WORK seconds on attempt 1.
TRAIN = r"""
import argparse, os, time
parser = argparse.ArgumentParser()
parser.add_argument("--data_url"); parser.add_argument("--train_url")
args, _ = parser.parse_known_args()
node, attempt = os.environ["VC_TASK_INDEX"], os.environ["MA_PROC_START_CNT"]
pid1 = open("/proc/1/cmdline").read().replace("\0", " ").strip()
print("node", node, "attempt", attempt, "uid", os.getuid(), "pid1", pid1, flush=True)
print("node", node, "read", open(os.path.join(args.data_url, "part-0.txt")).read().strip(), flush=True)
if node == "0":
    os.makedirs(os.path.join(args.train_url, "ckpt"), exist_ok=True)
    with open(os.path.join(args.train_url, "ckpt", "model.bin"), "w") as f:
        f.write(f"weights of attempt {attempt}")
    print("checkpoint written", flush=True)
time.sleep(float(os.environ.get("WORK", "0")) if attempt == "1" else 0.2)
"""

JOB = """\
code_url: obs://local-bkt/code/
inputs:
  - name: data_url
    url: obs://local-bkt/datasets/demo/
outputs:
  - name: train_url
    url: obs://local-bkt/jobs/run-1/output/
"""
CHECKPOINT = Path("bucket", "local-bkt", "jobs", "run-1", "output", "ckpt", "model.bin")


@pytest.fixture(scope="module")
def image():
    """The CPU image of test_image.py (built once per checkout: the suite's second run reuses it)."""
    return built_image()


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "part-0.txt").write_text("rows 1-100\n")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / SCRIPT).write_text(TRAIN)
    (tmp_path / "job.yaml").write_text(JOB)
    return tmp_path


def argv(workdir: Path, image_tag: str, *args: str):
    return [MA_RUNTIME, "local", "--nodes", "2", "--image", image_tag, "--config", "job.yaml",
            "--data", "obs://local-bkt/code=./code", "--data", "obs://local-bkt/datasets/demo=./data",
            "--out", str(workdir / "out"), *args, "--", "python", f"{CODE}/{SCRIPT}"]


def environment(**env) -> dict:
    environ = {name: value for name, value in os.environ.items() if not name.startswith(("MA_", "VC_"))}
    return {**environ, "MA_RUNTIME_PREFLIGHT": "off", **{name: str(value) for name, value in env.items()}}


def local(workdir: Path, image_tag: str, *args: str, **env) -> subprocess.CompletedProcess:
    """The run, its pid as `args` (the runner names its namespaces and containers after it)."""
    runner = subprocess.Popen(argv(workdir, image_tag, *args), cwd=workdir, env=environment(**env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = runner.communicate(timeout=GUARD)
    return subprocess.CompletedProcess(runner.pid, runner.returncode, out, err)


def summary_of(stdout: str) -> str:
    return stdout[stdout.index("ma-runtime local: summary"):]


def assert_nothing_left(out: Path, runner_pid: int) -> None:
    made = f"ma-local-{runner_pid}-"  # this run's: the tests of other files may run beside it
    names = podman("ps", "--all", "--format", "{{.Names}}").stdout.split()
    assert not [name for name in names if name.startswith(made)], names
    assert made not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not marked(SCRIPT), "a node's command outlived the run"
    # What the containers wrote (logs, the termination log) is the runner's user's again.
    owned_by_job = [path for path in [out, *out.rglob("*")] if path.lstat().st_uid != os.getuid()]
    assert not owned_by_job, owned_by_job[:5]


def test_two_nodes_run_the_image_s_runtime_as_pid_1_and_the_checkpoint_comes_back_into_out(workdir, image):
    result = local(workdir, image)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    out = workdir / "out"
    pid1 = f"{RUNTIME_VENV}/bin/python -I -m ma_runtime run -- python {CODE}/{SCRIPT}"
    for node in (0, 1):
        assert f"[node{node}] node {node} attempt 1 uid 1000 pid1 {pid1}" in result.stdout, result.stdout[-4000:]
        assert f"[node{node}] node {node} read rows 1-100" in result.stdout
        started = [line for line in result.stdout.splitlines()
                   if line.startswith(f"[node{node}] ") and 'msg="starting command"' in line]
        assert len(started) == 1 and "pid1=true" in started[0], started
        # The task log, written by the runtime in the container into the platform's log folder, is in --out.
        assert "starting command" in (out / f"node{node}" / "log" /
                                      f"modelarts-job-local-worker-{node}.log").read_text()
    assert (out / CHECKPOINT).read_text() == "weights of attempt 1"
    summary = summary_of(result.stdout)
    assert "node0: exit 0, attempts 1, final sync completed" in summary
    assert "node1: exit 0, attempts 1, final sync completed" in summary
    assert "verdict: succeeded" in summary and summary.rstrip().endswith("exit code: 0")
    assert_nothing_left(out, result.args)


def test_an_exit_fault_in_a_container_restarts_every_node_together(workdir, image):
    """The exit fault names the rank by the pid it has in its container, and each node has its own faults folder:
    both nodes' ranks can have the same pid there."""
    result = local(workdir, image, "--inject", "exit@1:code=3:after=1s", WORK=60, MA_RUNTIME_MAX_RESTARTS=1)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    assert "[node1] ma-runtime local: exit fault: exiting with code 3" in result.stdout
    for node in (0, 1):
        assert f"[node{node}] node {node} attempt 2 uid 1000" in result.stdout
    summary = summary_of(result.stdout)
    assert "node0: exit 0, attempts 2" in summary and "node1: exit 0, attempts 2" in summary
    assert "fault: exit on node1 (its first rank exits 3) at 1s: done" in summary
    assert (workdir / "out" / CHECKPOINT).read_text() == "weights of attempt 2"
    assert_nothing_left(workdir / "out", result.args)


def test_sigterm_to_the_runner_stops_every_container_after_its_final_sync_and_leaves_nothing(workdir, image):
    runner = subprocess.Popen(argv(workdir, image), cwd=workdir, env=environment(WORK=120), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    waiting = {"[node0] checkpoint written", "[node1] node 1 read rows"}  # both commands running
    for line in runner.stdout:
        waiting = {text for text in waiting if text not in line}
        if not waiting:
            break
    runner.terminate()
    out, err = runner.communicate(timeout=GUARD)
    assert runner.returncode == 143, out[-3000:] + err
    for node in (0, 1):
        assert f"node{node}: exit 143, attempts 1, final sync completed" in out, out[-3000:]
        # The runtime in the container wrote its termination message through the bound /dev/termination-log.
        assert "SIGTERM" in (workdir / "out" / f"node{node}" / "termination-log").read_text()
    assert (workdir / "out" / CHECKPOINT).exists()
    assert_nothing_left(workdir / "out", runner.pid)


def test_an_image_that_is_not_here_is_one_line_and_78(workdir, image):
    missing = f"localhost/ma-runtime-test:absent-{uuid.uuid4().hex[:8]}"
    result = local(workdir, missing)
    assert result.returncode == 78, result.stdout + result.stderr
    assert result.stderr == (f"ma-runtime local: error: --image {missing}: no such image here: build it "
                             f"(docker/build.sh cpu) or pull it (podman pull {missing})\n")
    assert not (workdir / "out").exists()
