"""The plan of a torchrun job restarted in place (launch/torchrun.py, docs/torchrun-in-place.md): torchrun's agent
as the run's service with a budget of its own that never runs out, each attempt's worker the gate with the
attempt's program; and the jobs whose torchrun is restarted whole instead. The real torchrun runs in
tests/e2e/test_restart_launchers.py and test_job_launchers.py."""

import json
import os
import subprocess
import sys
import time

import pytest

from ma_runtime.errors import ConfigError
from ma_runtime.launch import torchrun, torchrun_gate
from ma_runtime.spec import load
from tests.conftest import alive
from tests.unit.test_plan import PATH, build, which_from

SEVERAL = {"MA_NUM_HOSTS": 2, "VC_TASK_INDEX": 1, "VC_WORKER_HOSTS": "a.job,b.job", "MA_VJ_NAME": "ma-job-x"}


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
    {**SEVERAL, "MA_RUNTIME_TORCHRUN_IN_PLACE": "off"},
    # Several nodes on another rendezvous than static: c10d's agents re-join each other's rounds (its node ranks
    # are no longer --node_rank either: docs/torchrun-in-place.md, "Several nodes").
    {**SEVERAL, "MA_EXTRA_TORCHRUN_PARAMS": "--rdzv_backend=c10d --rdzv_endpoint=a.job:29400"},
    {**SEVERAL, "MA_EXTRA_TORCHRUN_PARAMS": "--rdzv-backend c10d"},
    {**SEVERAL, "MA_EXTRA_TORCHRUN_PARAMS": "--rdzv-endpoint=a.job:29400"},
])
def test_these_jobs_torchrun_is_restarted_whole(job, variables):
    job_spec, environ = job(**variables)
    result = build(job_spec, environ, ["python", "train.py"], which=which_from("torchrun"))
    (worker,) = result.workers
    assert (worker.name, worker.argv[0], worker.argv[-1], result.services) == (
        "torchrun", "/opt/bin/torchrun", "train.py", ())


@pytest.mark.parametrize("variables, agents, ranks", [
    ({}, 18888, 18889),
    ({"MA_TORCHRUN_MASTER_PORT": 29500}, 29500, 29501),
    ({"MA_EXTRA_TORCHRUN_PARAMS": "--master-port 65535"}, 65535, 65534),
    ({"MA_EXTRA_TORCHRUN_PARAMS": "--rdzv_backend=static"}, 18888, 18889),  # naming the preset's own: in place
])
def test_several_nodes_restart_in_place_on_the_static_rendezvous_with_a_store_for_each_attempts_ranks(
        job, variables, agents, ranks):
    job_spec, environ = job(**SEVERAL, **variables)
    result = build(job_spec, environ, ["python", "train.py"], which=which_from("torchrun"))
    (agent,), (gate,) = result.services, result.workers
    # The platform's command (its node rank, its master) with the agent's budget: the agents' store is --master_port.
    assert {"--nnodes=2", "--nproc_per_node=2", "--node_rank=1", "--master_addr=a.job",
            "--rdzv_backend=static"} <= set(agent.argv)
    assert torchrun._flag_value(agent.argv, "master_port") == agents
    assert agent.argv[-3:] == (f"--max-restarts={torchrun.AGENT_RESTARTS}", torchrun_gate.__file__, "shim")
    # Each attempt's ranks: a store of their own, hosted by global rank 0 on the next port (torch's static
    # rendezvous keeps the agents' one store for the whole run).
    assert gate.argv[gate.argv.index("--store-port") + 1] == str(ranks)
    assert gate.env["MASTER_PORT"] == str(ranks) and gate.env["NODE_RANK"] == "1"


@pytest.mark.parametrize("port", ["abc", "0", "70000"])
def test_several_nodes_with_a_master_port_that_is_no_port_is_one_line_and_78(job, port):
    job_spec, environ = job(**SEVERAL, MA_EXTRA_TORCHRUN_PARAMS=f"--master_port={port}")
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ, ["python", "train.py"], which=which_from("torchrun"))
    assert caught.value.exit_code == 78
    assert caught.value.reason == f"MA_EXTRA_TORCHRUN_PARAMS gives --master_port={port}: not a port"


def test_the_gate_kills_the_ranks_inside_the_runtimes_grace():
    assert [torchrun._kill_after(grace) for grace in (15.0, 3.0, 1.0)] == [13.0, 1.5, 0.5]


# --------------------------------------------------------------------------- the gate and the shim, as processes


def gate_run(tmp_path, agent_pid, program, attempt="2", nproc=1, options=()):
    """The gate of attempt `attempt` for the agent `agent_pid` (any process: the gate reads its environment)."""
    agent = tmp_path / "agent.json"
    agent.write_text(json.dumps({"pid": agent_pid, "prefix": f"test-{os.getpid()}-{tmp_path.name}"}))
    env = {**os.environ, "MA_PROC_START_CNT": attempt, "ONLY_THE_ATTEMPT_SETS": "this"}
    argv = [sys.executable, "-I", torchrun_gate.__file__, "gate", "--agent", str(agent), "--nproc", str(nproc),
            "--kill-after", "5", *options, "--", *program]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def shim(tmp_path, local_rank, rank):
    """A rank's shim as torchrun starts it: its own group, torchrun's per-rank variables (the static rendezvous'
    store: the agents')."""
    prefix = f"test-{os.getpid()}-{tmp_path.name}"
    env = {**os.environ, torchrun_gate.PREFIX_ENV: prefix, "LOCAL_RANK": str(local_rank), "RANK": str(rank),
           "MA_PROC_START_CNT": "1", "MASTER_PORT": "18888", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    return subprocess.Popen([sys.executable, "-u", torchrun_gate.__file__, "shim"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
def shims():
    """Shims started by a test; any still waiting at its end is killed (a test that failed leaves none behind)."""
    started = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_gate_lets_each_rank_run_with_the_attempts_number_and_ends_as_the_first_failing_rank(tmp_path, shims):
    with subprocess.Popen(["sleep", "60"]) as agent:
        shims += [shim(tmp_path, local_rank, 10 + local_rank) for local_rank in (0, 1)]
        program = ["--program", "sh", "-c", 'echo "rank $RANK attempt $MA_PROC_START_CNT $ONLY_THE_ATTEMPT_SETS"; '
                                            'exit $((RANK - 8))']
        gate = gate_run(tmp_path, agent.pid, program, nproc=2)
        out, err = gate.communicate(timeout=60)
        agent.kill()
    # Each rank's lines on the gate's own stdout; MA_PROC_START_CNT is the attempt's, RANK torchrun's.
    assert sorted(out.splitlines()) == ["rank 10 attempt 2 this", "rank 11 attempt 2 this"]
    # The first rank to fail is the attempt's (rank 10 exits 2, rank 11 exits 3: either may be first), as
    # torchrun's own summary names it; each shim exits as its rank did.
    assert gate.returncode in (2, 3) and "Root Cause (first observed failure):" in err, err
    assert err.rstrip().endswith("=" * 60)
    assert sorted(process.wait(timeout=30) for process in shims) == [2, 3]


def test_several_nodes_ranks_use_the_store_their_gate_names_not_the_agents(tmp_path, shims):
    with subprocess.Popen(["sleep", "60"]) as agent:
        shims.append(shim(tmp_path, 0, 2))
        program = ["--program", "sh", "-c", 'echo "$RANK $MASTER_PORT $TORCHELASTIC_USE_AGENT_STORE"']
        out, err = gate_run(tmp_path, agent.pid, program, options=("--store-port", "18889")).communicate(timeout=60)
        agent.kill()
    assert out.splitlines() == ["2 18889 False"], err


def test_the_gate_of_an_agent_that_is_gone_says_so_and_exits_1(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    gate = gate_run(tmp_path, gone.pid, ["--python", "train.py"])
    _, err = gate.communicate(timeout=60)
    assert gate.returncode == 1
    assert f"torchrun's agent (pid {gone.pid}) is gone" in err and "Traceback" not in err


def test_a_waiting_shim_whose_agent_is_gone_exits(tmp_path):
    # The shim's parent is its agent: killed (not stopped, so it could not end its ranks), no gate comes any more.
    prefix = f"test-{os.getpid()}-{tmp_path.name}"
    env = {**os.environ, torchrun_gate.PREFIX_ENV: prefix, "LOCAL_RANK": "0", "RANK": "4"}
    # The stand-in agent leaves once its shim waits at the gate (its socket bound), so the shim saw it as its parent.
    script = (f"import subprocess, sys, time\n"
              f"shim = subprocess.Popen([sys.executable, '-u', {torchrun_gate.__file__!r}, 'shim'], "
              f"stderr=open({str(tmp_path / 'err')!r}, 'w'))\n"
              f"guard = time.monotonic() + 20\n"
              f"while '@{prefix}-rank-0' not in open('/proc/net/unix').read() and time.monotonic() < guard:\n"
              f"    time.sleep(0.02)\n"
              f"print(shim.pid, flush=True)\n")
    agent = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30)
    pid = int(agent.stdout)  # the agent has exited: its shim is an orphan now
    guard = time.monotonic() + 30
    while alive(pid) and time.monotonic() < guard:
        time.sleep(0.05)
    assert not alive(pid)
    assert "torchrun's rank 4: its agent" in (tmp_path / "err").read_text()


def test_the_launcher_names_the_gate_as_the_gate_names_itself():
    # launch/torchrun.py does not import the gate (every run imports the launcher for its settings): the same names.
    assert (torchrun_gate.__file__, torchrun_gate.PREFIX_ENV) == (torchrun.GATE_SCRIPT, torchrun.GATE_PREFIX_ENV)
