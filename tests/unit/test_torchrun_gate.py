"""The plan of a torchrun job restarted in place (launch/torchrun.py, docs/torchrun-in-place.md): torchrun's agent
as the run's service with a budget of its own that never runs out, each attempt's worker the gate with the
attempt's program; and the jobs whose torchrun is restarted whole instead. The real torchrun runs in
tests/e2e/test_restart_launchers.py and test_job_launchers.py."""

import sys

import pytest

from ma_runtime.launch import torchrun, torchrun_gate
from ma_runtime.spec import load
from tests.unit.test_plan import PATH, build, which_from


@pytest.fixture
def job(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()

    def make(**variables):
        environ = {"MA_HOME": str(tmp_path / "home"), "MA_RUNTIME_PREFLIGHT_DEV_DIR": str(dev), "PATH": PATH,
                   "MA_RUN_METHOD": "torchrun", "MA_NUM_GPUS": "0", "MA_RUNTIME_NPROC_PER_NODE": "2"}
        environ.update({name: str(value) for name, value in variables.items()})
        return load({}, environ), environ

    return make


def test_in_place_the_agent_is_the_service_and_the_gate_lets_the_attempts_program_go(job):
    job_spec, environ = job(MA_RUNTIME_STOP_GRACE_SECONDS=20)
    result = build(job_spec, environ, ["python", "train.py", "--epochs", "3"], which=which_from("torchrun"),
                   attempt=4)
    (agent,), (gate,) = result.services, result.workers
    assert agent.argv == ("/opt/bin/torchrun", "--standalone", "--nnodes=1", "--nproc_per_node=2",
                          f"--max-restarts={torchrun.AGENT_RESTARTS}", torchrun_gate.__file__, "shim")
    assert gate.name == torchrun.GATE and gate.argv == (
        sys.executable, "-I", torchrun_gate.__file__, "gate", "--agent", str(torchrun.agent_file(job_spec)),
        "--nproc", "2", "--kill-after", "18", "--", "--python", "train.py", "--epochs", "3")
    assert gate.env["MA_PROC_START_CNT"] == "4"  # each rank gets it with its go
    assert agent.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # a new store for each restart's ranks
    assert (result.nodes, result.processes_per_node) == (1, 2)


def test_in_place_a_program_that_is_not_a_python_script_runs_as_given(job):
    job_spec, environ = job()
    result = build(job_spec, environ, ["bash", "run.sh"], which=which_from("torchrun"))
    assert result.workers[0].argv[-3:] == ("--program", "bash", "run.sh")


@pytest.mark.parametrize("variables", [
    {"MA_EXTRA_TORCHRUN_PARAMS": "--max-restarts=3"},  # the job asks for torchrun's own restarts in an attempt
    {"MA_EXTRA_TORCHRUN_PARAMS": "--max_restarts 3"},
    {"MA_EXTRA_TORCHRUN_PARAMS": "--no-python"},  # the program would not be the shim
    {"MA_EXTRA_TORCHRUN_PARAMS": "--module"},
    {"MA_EXTRA_TORCHRUN_PARAMS": "-m"},
    {"MA_EXTRA_TORCHRUN_PARAMS": "--nproc-per-node=auto"},  # how many ranks wait at the gate is torchrun's
    {"MA_RUNTIME_TORCHRUN_IN_PLACE": "off"},
    # Several nodes: their static rendezvous keeps one store for every restart (launch/torchrun.py _FRESH_STORE).
    {"MA_NUM_HOSTS": 2, "VC_TASK_INDEX": 0, "VC_WORKER_HOSTS": "a.job,b.job"},
])
def test_these_jobs_torchrun_is_restarted_whole(job, variables):
    job_spec, environ = job(**variables)
    result = build(job_spec, environ, ["python", "train.py"], which=which_from("torchrun"))
    (worker,) = result.workers
    assert (worker.name, worker.argv[0], worker.argv[-1], result.services) == (
        "torchrun", "/opt/bin/torchrun", "train.py", ())


def test_the_gate_kills_the_ranks_inside_the_runtimes_grace():
    assert [torchrun._kill_after(grace) for grace in (15.0, 3.0, 1.0)] == [13.0, 1.5, 0.5]
