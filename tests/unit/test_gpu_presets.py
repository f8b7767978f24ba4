"""The PyTorch-GPU and TensorFlow-GPU presets' plans, field by field against the platform's forms.

Documented forms (docs/platform.md, "PyTorch-GPU preset", "TensorFlow-GPU preset"):
- pytorch-gpu, one node: `<command> --init_method "tcp://<ip>:<port>"`;
- pytorch-gpu, several: `<command> --init_method "tcp://<ip>:<port>" --rank <node index> --world_size <node count>`;
- tensorflow-gpu, several: `<command> --task_index <VC_TASK_INDEX> --ps_hosts <TF_PS_HOSTS>
  --worker_hosts <TF_WORKER_HOSTS> --job_name <MA_TASK_NAME>`, the ps wrapped in the watcher of peers.py.

No DNS, no torch, no TensorFlow: the plan is a pure function (`which`/`resolve` fakes through plan.Context).
"""

import json
import subprocess
import sys

import pytest

from ma_runtime.errors import ConfigError
from ma_runtime.launch import peers, registry
from ma_runtime.launch.args import build_argv
from ma_runtime.process.table import Proc
from tests.conftest import MA_RUNTIME
from tests.unit import test_plan as plans
from tests.unit.test_launchers import TORCHRUN_SUMMARY
from tests.unit.test_plan import HOSTS, VJ, build, job_variables

job = plans.job  # the same fixture: job(**variables) -> (JobSpec, environ) under tmp_path

COMMON_ENV = {"MA_PROC_START_CNT": "1", "MA_SCHEDULE_CNT": "1"}
PS_HOSTS = ["j-ps-0.j:5000", "j-ps-1.j:5001"]
WORKER_HOSTS = ["j-worker-0.j:6000", "j-worker-1.j:6001"]
# As the platform writes them: an "array" in brackets.
TF_HOSTS = {"TF_PS_HOSTS": f"[{','.join(PS_HOSTS)}]", "TF_WORKER_HOSTS": f"[{','.join(WORKER_HOSTS)}]"}
WATCHER = [sys.executable, "-m", "ma_runtime.launch.peers", "--until-gone", *WORKER_HOSTS]


def tf_flags(index, role):
    return ["--task_index", str(index), "--ps_hosts", ",".join(PS_HOSTS), "--worker_hosts", ",".join(WORKER_HOSTS),
            "--job_name", role]


def config_error(job, **variables) -> ConfigError:
    job_spec, environ = job(**variables)
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ)
    assert caught.value.exit_code == 78
    return caught.value


# --------------------------------------------------------------------------- both: the launcher interface


@pytest.mark.parametrize("name", ["pytorch-gpu", "tensorflow-gpu"])
def test_each_preset_is_a_launcher_module_with_the_whole_interface(name):
    module = registry.launcher(name)
    assert type(module).__module__ == f"ma_runtime.launch.{name.replace('-', '_')}" and name == module.NAME
    # The command once per node, its exit code its own, nothing between the supervisor and its process group.
    assert (module.TAKES_NPROC_PER_NODE, module.OWN_CODE_AFTER_STOP) == (False, True)
    table = {100: Proc("S", 1, 100, 0), 200: Proc("S", 100, 200, 1), 201: Proc("S", 200, 200, 2)}
    assert module.forwards_to(200, table) == set()
    assert module.root_cause(TORCHRUN_SUMMARY) is None  # a boot file's own mp.spawn prints no such summary
    assert module.rank_logs(None) is None


@pytest.mark.parametrize("method", ["pytorch-gpu", "tensorflow-gpu"])
def test_a_preset_refuses_a_process_count_it_would_not_start(job, method):
    error = config_error(job, MA_RUN_METHOD=method, MA_RUNTIME_NPROC_PER_NODE=4)
    assert "MA_RUNTIME_NPROC_PER_NODE=4" in error.reason and "once per node" in error.reason
    assert "unset MA_RUNTIME_NPROC_PER_NODE" in error.hint


# --------------------------------------------------------------------------- pytorch-gpu


def test_pytorch_gpu_single_node_appends_only_init_method_on_the_loopback(job):
    job_spec, environ = job(MA_RUN_METHOD="pytorch-gpu", MA_NUM_GPUS=8, MA_VJ_NAME=VJ)
    result = build(job_spec, environ, ["python", "train.py", "--epochs", "3"])
    assert (result.method, result.why, result.nodes, result.processes_per_node) == (
        "pytorch-gpu", "MA_RUN_METHOD=pytorch-gpu", 1, 1)  # 8 GPUs: still once, the boot file spawns
    (worker,) = result.workers
    assert worker.name == "command" and worker.cwd is None and worker.rank is None
    assert worker.argv == ("python", "train.py", "--epochs", "3", "--init_method", "tcp://127.0.0.1:29500")
    # The job's variables agree with --init_method; per node, the processes the boot file spawns (one per GPU).
    assert worker.env == {**COMMON_ENV, **job_variables("127.0.0.1", 29500, 1, 0, 8)}
    assert worker.logs == {"task": str(job_spec.task_log_path)}


def test_pytorch_gpu_multi_node_gives_the_node_index_and_the_node_count(job):
    job_spec, environ = job(MA_RUN_METHOD="pytorch-gpu", MA_NUM_HOSTS=4, MA_NUM_GPUS=8, VC_TASK_INDEX=2,
                            MA_VJ_NAME=VJ, VC_WORKER_HOSTS=",".join(HOSTS))
    result = build(job_spec, environ, ["python", "train.py"])
    assert (result.nodes, result.processes_per_node) == (4, 1)
    # world_size is the NODE count (4), not the process count (32): the platform's sample multiplies it.
    assert result.workers[0].argv == ("python", "train.py", "--init_method", f"tcp://{HOSTS[0]}:29500",
                                      "--rank", "2", "--world_size", "4")


def test_pytorch_gpu_worker_zero_falls_back_to_the_volcano_name(job):
    job_spec, environ = job(MA_RUN_METHOD="pytorch-gpu", MA_NUM_HOSTS=2, VC_TASK_INDEX=0, MA_VJ_NAME=VJ)
    assert build(job_spec, environ).workers[0].argv[2:4] == ("--init_method", f"tcp://{VJ}-worker-0.{VJ}:29500")


@pytest.mark.parametrize("hosts", [1, 2])
def test_pytorch_gpu_port_comes_from_ma_runtime_init_method_port(job, hosts):
    job_spec, environ = job(MA_RUN_METHOD="pytorch-gpu", MA_NUM_HOSTS=hosts, VC_WORKER_HOSTS=",".join(HOSTS[:hosts]),
                            MA_RUNTIME_INIT_METHOD_PORT=23456)
    assert build(job_spec, environ).workers[0].argv[3].endswith(":23456")


def test_pytorch_gpu_flags_come_after_the_inputs_and_hyperparameters(job):
    job_spec, environ = job(MA_RUN_METHOD="pytorch-gpu")
    argv = build_argv(["python", "train.py"], [("data_url", "/in"), ("lr", "0.1")])
    assert build(job_spec, environ, argv).workers[0].argv == (
        "python", "train.py", "--data_url=/in", "--lr=0.1", "--init_method", "tcp://127.0.0.1:29500")


def test_pytorch_gpu_shell_form_gets_the_flags_on_its_last_simple_command(job):
    job_spec, environ = job(MA_RUN_METHOD="pytorch-gpu", MA_NUM_HOSTS=2, VC_TASK_INDEX=1,
                            VC_WORKER_HOSTS=",".join(HOSTS[:2]))
    argv = build_argv(["cd /code && python train.py  # the run"], [("lr", "0.1")])
    assert build(job_spec, environ, argv).workers[0].argv == (
        "/bin/sh", "-c", f"cd /code && python train.py --lr=0.1 --init_method tcp://{HOSTS[0]}:29500 --rank 1 "
                         "--world_size 2  # the run")


def test_pytorch_gpu_multi_node_without_worker_zero_is_a_configuration_error(job):
    error = config_error(job, MA_RUN_METHOD="pytorch-gpu", MA_NUM_HOSTS=2)
    assert "VC_WORKER_HOSTS and MA_VJ_NAME are unset" in error.reason


def test_pytorch_gpu_node_index_beyond_the_nodes_is_a_configuration_error(job):
    error = config_error(job, MA_RUN_METHOD="pytorch-gpu", MA_NUM_HOSTS=2, VC_TASK_INDEX=2,
                         VC_WORKER_HOSTS=",".join(HOSTS[:2]))
    assert "VC_TASK_INDEX=2 is not below MA_NUM_HOSTS=2" in error.reason


@pytest.mark.parametrize("port", ["0", "65536", "http"])
def test_a_bad_init_method_port_is_a_configuration_error(job, port):
    with pytest.raises(ConfigError) as caught:
        job(MA_RUN_METHOD="pytorch-gpu", MA_RUNTIME_INIT_METHOD_PORT=port)
    assert caught.value.exit_code == 78 and "MA_RUNTIME_INIT_METHOD_PORT" in str(caught.value)


# --------------------------------------------------------------------------- tensorflow-gpu


def test_tensorflow_gpu_single_node_runs_the_command_as_given(job):
    job_spec, environ = job(MA_RUN_METHOD="tensorflow-gpu", MA_NUM_GPUS=4, **TF_HOSTS)
    argv = build_argv(["python", "train.py"], [("lr", "0.1")])
    result = build(job_spec, environ, argv)
    assert (result.method, result.nodes, result.processes_per_node) == ("tensorflow-gpu", 1, 1)
    (worker,) = result.workers
    assert (worker.name, worker.argv, worker.env) == ("command", ("python", "train.py", "--lr=0.1"), COMMON_ENV)
    assert worker.logs == {"task": str(job_spec.task_log_path)}


def test_tensorflow_gpu_single_node_needs_no_cluster_variables(job):
    job_spec, environ = job(MA_RUN_METHOD="tensorflow-gpu", MA_TASK_NAME="ps")
    assert build(job_spec, environ).workers[0].argv == ("python", "train.py")


def test_tensorflow_gpu_worker_gets_the_platforms_four_flags(job):
    job_spec, environ = job(MA_RUN_METHOD="tensorflow-gpu", MA_NUM_HOSTS=2, MA_TASK_NAME="worker", VC_TASK_INDEX=1,
                            MA_VJ_NAME=VJ, **TF_HOSTS)
    result = build(job_spec, environ, build_argv(["python", "train.py"], [("lr", "0.1")]))
    assert (result.nodes, result.processes_per_node) == (2, 1)
    (worker,) = result.workers
    assert worker.argv == ("python", "train.py", "--lr=0.1", *tf_flags(1, "worker"))
    assert worker.env == COMMON_ENV
    assert worker.logs["task"].endswith("-worker-1.log")


def test_tensorflow_gpu_ps_runs_under_the_watcher_of_every_worker(job):
    job_spec, environ = job(MA_RUN_METHOD="tensorflow-gpu", MA_NUM_HOSTS=2, MA_TASK_NAME="ps", VC_TASK_INDEX=0,
                            **TF_HOSTS)
    (worker,) = build(job_spec, environ, ["python", "train.py"]).workers
    assert list(worker.argv) == [*WATCHER, "--appear-seconds", "600", "--gone-seconds", "60", "--",
                                 "python", "train.py", *tf_flags(0, "ps")]
    assert worker.name == "command" and worker.env == COMMON_ENV
    assert worker.logs["task"].endswith("-ps-0.log")


def test_tensorflow_gpu_ps_waits_for_the_workers_as_long_as_ma_runtime_peer_wait_seconds(job):
    job_spec, environ = job(MA_RUN_METHOD="tensorflow-gpu", MA_NUM_HOSTS=2, MA_TASK_NAME="ps",
                            MA_RUNTIME_PEER_WAIT_SECONDS=45.5, **TF_HOSTS)
    argv = list(build(job_spec, environ).workers[0].argv)
    assert argv[argv.index("--appear-seconds") + 1] == "45.5"


def test_tensorflow_gpu_ps_watcher_program_reads_back_its_endpoints_and_command(job):
    job_spec, environ = job(MA_RUN_METHOD="tensorflow-gpu", MA_NUM_HOSTS=2, MA_TASK_NAME="ps", **TF_HOSTS)
    argv = build(job_spec, environ).workers[0].argv
    assert argv[:3] == (sys.executable, "-m", peers.__name__)
    assert list(argv) == peers.watcher_argv([("j-worker-0.j", 6000), ("j-worker-1.j", 6001)], 600.0,
                                            ["python", "train.py", *tf_flags(0, "ps")], gone_seconds=60.0)


def test_tensorflow_gpu_shell_form_gets_the_flags_inside_the_watched_script(job):
    job_spec, environ = job(MA_RUN_METHOD="tensorflow-gpu", MA_NUM_HOSTS=2, MA_TASK_NAME="ps", VC_TASK_INDEX=1,
                            **TF_HOSTS)
    argv = build_argv(["cd /code; python train.py"], [])
    script = "cd /code; python train.py " + " ".join(tf_flags(1, "ps"))
    assert list(build(job_spec, environ, argv).workers[0].argv) == [
        *WATCHER, "--appear-seconds", "600", "--gone-seconds", "60", "--", "/bin/sh", "-c", script]


@pytest.mark.parametrize("ps_hosts, worker_hosts", [
    (",".join(PS_HOSTS), ",".join(WORKER_HOSTS)),  # without brackets
    (f" [ {PS_HOSTS[0]} , {PS_HOSTS[1]} ] ", f"[{WORKER_HOSTS[0]},{WORKER_HOSTS[1]},]"),  # blanks, a trailing comma
])
def test_tensorflow_gpu_host_lists_are_given_as_host_port_comma_separated(job, ps_hosts, worker_hosts):
    job_spec, environ = job(MA_RUN_METHOD="tensorflow-gpu", MA_NUM_HOSTS=2, MA_TASK_NAME="worker",
                            TF_PS_HOSTS=ps_hosts, TF_WORKER_HOSTS=worker_hosts)
    assert build(job_spec, environ).workers[0].argv[2:] == tuple(tf_flags(0, "worker"))


@pytest.mark.parametrize("role", ["chief", "evaluator", "learner"])
def test_tensorflow_gpu_multi_node_role_other_than_ps_or_worker_is_a_configuration_error(job, role):
    error = config_error(job, MA_RUN_METHOD="tensorflow-gpu", MA_NUM_HOSTS=2, MA_TASK_NAME=role, **TF_HOSTS)
    assert f"MA_TASK_NAME={role}" in error.reason and "ps or worker" in error.reason
    assert "MA_RUN_METHOD=plain" in error.hint


@pytest.mark.parametrize("missing", ["TF_PS_HOSTS", "TF_WORKER_HOSTS"])
def test_tensorflow_gpu_multi_node_without_a_host_list_is_a_configuration_error(job, missing):
    hosts = {name: value for name, value in TF_HOSTS.items() if name != missing}
    error = config_error(job, MA_RUN_METHOD="tensorflow-gpu", MA_NUM_HOSTS=2, **hosts)
    assert error.reason == f"{missing} is unset, and a multi-node TensorFlow job needs it"
    assert "host:port" in error.hint


@pytest.mark.parametrize("value, bad", [
    ("[]", None),
    ("[ , ]", None),
    ("[j-worker-0.j,j-worker-1.j:6001]", "j-worker-0.j"),  # no port
    ("[j-worker-0.j:6000,,j-worker-1.j:6001]", ""),  # a hole would shift the indexes after it
    ("[j-worker-0.j:http]", "j-worker-0.j:http"),
    ("[j-worker-0.j:0]", "j-worker-0.j:0"),
    ("[j-worker-0.j:65536]", "j-worker-0.j:65536"),
    ("[:6000]", ":6000"),
    ("[[j-worker-0.j:6000]]", "[j-worker-0.j:6000]"),
    ("j-worker-0.j:6000 j-worker-1.j:6001", "j-worker-0.j:6000 j-worker-1.j:6001"),
])
def test_tensorflow_gpu_malformed_host_list_is_one_configuration_error(job, value, bad):
    error = config_error(job, MA_RUN_METHOD="tensorflow-gpu", MA_NUM_HOSTS=2, TF_PS_HOSTS=TF_HOSTS["TF_PS_HOSTS"],
                         TF_WORKER_HOSTS=value)
    if bad is None:
        assert error.reason == "TF_WORKER_HOSTS is empty, and a multi-node TensorFlow job needs it"
    else:
        assert error.reason.startswith(f"TF_WORKER_HOSTS has an entry that is not host:port ({bad!r})")
    assert "host:port" in error.hint


@pytest.mark.parametrize("role", ["ps", "worker"])
def test_tensorflow_gpu_task_index_beyond_its_roles_list_is_a_configuration_error(job, role):
    error = config_error(job, MA_RUN_METHOD="tensorflow-gpu", MA_NUM_HOSTS=3, MA_TASK_NAME=role, VC_TASK_INDEX=2,
                         **TF_HOSTS)
    assert error.reason == f"VC_TASK_INDEX=2, but TF_{role.upper()}_HOSTS names 2 {role} task(s)"


# --------------------------------------------------------------------------- `ma-runtime plan`, black box


def plan_cli(env, *command):
    return subprocess.run([MA_RUNTIME, "plan", "--json", "--", *command], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def cli_env(job_env):
    env = {name: value for name, value in job_env.items() if name not in (*plans._PLAN_VARIABLES, *TF_HOSTS,
                                                                           "MA_RUNTIME_INIT_METHOD_PORT")}
    env["MA_RUNTIME_PREFLIGHT"] = "0"
    return env


def test_cli_plan_shows_the_pytorch_gpu_flags(cli_env):
    cli_env.update(MA_RUN_METHOD="pytorch-gpu", MA_NUM_HOSTS="2", VC_TASK_INDEX="1",
                   VC_WORKER_HOSTS=",".join(HOSTS[:2]))
    result = plan_cli(cli_env, "python", "train.py")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert (document["method"], document["nodes"], document["processes_per_node"]) == ("pytorch-gpu", 2, 1)
    assert document["workers"][0]["argv"] == ["python", "train.py", "--init_method", f"tcp://{HOSTS[0]}:29500",
                                              "--rank", "1", "--world_size", "2"]


def test_cli_plan_shows_the_tensorflow_gpu_ps_under_its_watcher(cli_env, tmp_path):
    marker = tmp_path / "ps-ran"
    cli_env.update(MA_RUN_METHOD="tensorflow-gpu", MA_NUM_HOSTS="2", MA_TASK_NAME="ps", VC_TASK_INDEX="1", **TF_HOSTS)
    result = plan_cli(cli_env, "sh", "-c", f"touch {marker}")
    assert result.returncode == 0, result.stderr
    (worker,) = json.loads(result.stdout)["workers"]
    assert worker["argv"][1:5] == ["-m", "ma_runtime.launch.peers", "--until-gone", WORKER_HOSTS[0]]
    assert worker["argv"][-11:] == ["sh", "-c", f"touch {marker}", *tf_flags(1, "ps")]
    assert not marker.exists()


def test_cli_plan_bad_tensorflow_hosts_is_one_line_with_a_hint(cli_env):
    cli_env.update(MA_RUN_METHOD="tensorflow-gpu", MA_NUM_HOSTS="2", TF_PS_HOSTS="[a:1,b]", TF_WORKER_HOSTS="[c:2]")
    result = plan_cli(cli_env, "python", "train.py")
    assert result.returncode == 78 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert "TF_PS_HOSTS has an entry that is not host:port ('b')" in line and "hint=" in line
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command, code, says", [
    (["no-such-program-here"], 127, "cannot start no-such-program-here: No such file or directory"),
    (["/etc/hostname"], 126, "cannot start /etc/hostname: "),  # not a program (as root: Exec format error)
])
def test_the_ps_watcher_that_cannot_start_its_command_says_why_in_one_line(command, code, says):
    """The watcher runs the ps task itself: a command it cannot exec is one line and the shell's code, no traceback
    (issue 24 item 8: every exec the runtime makes)."""
    done = subprocess.run([sys.executable, "-m", "ma_runtime.launch.peers", "--until-gone", "127.0.0.1:9",
                           "--appear-seconds", "5", "--", *command], capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
