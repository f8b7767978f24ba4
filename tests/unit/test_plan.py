"""The launch plan: each method x single/multi node x CPU/NPU job, field by field against the platform's forms.

Documented forms (docs/platform.md, "Launch methods"):
- torchrun, one node: `torchrun --standalone --nnodes=N --nproc_per_node=G ${MA_EXTRA_TORCHRUN_PARAMS} script args`;
- torchrun, several: `torchrun --nnodes --nproc_per_node --node_rank --master_addr=<worker-0 name>
  --master_port=${MA_TORCHRUN_MASTER_PORT:-18888} --rdzv_id=<job id> --rdzv_backend=static ${EXTRA} script args`;
- msrun: `msrun --worker_num --local_worker_num --master_addr=<worker-0 IP> --node_rank --master_port --log_dir
  --join=True --cluster_time_out [--rank_table_file] script args`;
- RTF: one process per local device with RANK_TABLE_FILE, RANK_ID, RANK_SIZE, ASCEND_DEVICE_ID, DEVICE_ID, JOB_ID.

Nothing here needs torchrun, msrun or DNS: `which` and `resolve` are fakes given through `plan.Context`.
"""

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ma_runtime import spec
from ma_runtime.errors import ConfigError, ExitCode
from ma_runtime.launch import plan, role
from ma_runtime.launch.args import build_argv
from ma_runtime.stages import ranktable, stagein
from ma_runtime.stages.ranktable import convert as table_convert
from ma_runtime.stages.ranktable import model as table_model
from ma_runtime.stages.ranktable import node as table_node
from tests.conftest import MA_RUNTIME

UUID = "0f8e2c1a-5b6d-4e7f-8a9b-0c1d2e3f4a5b"
VJ = f"ma-job-{UUID}"
HOSTS = [f"{VJ}-worker-{index}.{VJ}" for index in range(4)]
PATH = "/usr/local/bin:/usr/bin:/bin"

# Variables of the machine running the tests that would change the plan.
_PLAN_VARIABLES = (
    "MA_RUN_METHOD", "RANK_TABLE_FILE", "VC_WORKER_HOSTS", "MA_TORCHRUN_MASTER_PORT", "MA_EXTRA_TORCHRUN_PARAMS",
    "MS_RANKTABLE_ENABLE", "MSRUN_CLUSTER_TIME_OUT", "MA_RUNTIME_MSRUN_MASTER_PORT", "MA_RUNTIME_RANKTABLE",
    "MA_CURRENT_INSTANCE_NAME", "MA_CURRENT_IP", "MA_TASK_INDEX", "VK_TASK_INDEX", "MA_RUNTIME_PREFLIGHT_DEV_DIR",
)


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def job(tmp_path):
    """job(**variables) -> (JobSpec, environ): a job under tmp_path, with an empty device directory."""
    dev = tmp_path / "dev"
    dev.mkdir()

    def make(**variables):
        # torchrun's flags and program are asserted on the torchrun of an attempt (restarted whole); the plan of a
        # job restarted in place, its agent as a service and its gate, has tests of its own (test_torchrun_gate.py).
        environ = {"MA_HOME": str(tmp_path / "home"), "MA_RUNTIME_PREFLIGHT_DEV_DIR": str(dev), "PATH": PATH,
                   "MA_RUNTIME_TORCHRUN_IN_PLACE": "off"}
        environ.update({name: str(value) for name, value in variables.items()})
        return spec.load({}, environ), environ

    return make


def which_from(*installed, beside=None):
    """A fake `shutil.which`: `/opt/bin/<name>` for the installed names when a whole PATH is searched; a lookup in
    one folder (no `:`, as beside the command's Python) finds only what `beside[folder]` lists. Records every call."""
    calls = []
    beside = beside or {}

    def which(name, path=None):
        calls.append((name, path))
        if path is not None and os.pathsep not in path:
            return f"{path}/{name}" if name in beside.get(path, ()) else None
        return f"/opt/bin/{name}" if name in installed else None

    which.calls = calls
    return which


def which_in(folders):
    """A fake `shutil.which` over {folder: names}, searching the given PATH in order, as the real one does."""

    def which(name, path=None):
        for folder in (path or "").split(os.pathsep):
            if name in folders.get(folder, ()):
                return f"{folder}/{name}"
        return None

    return which


def resolver(table):
    """A fake resolver: host -> IP from `table`; any other host fails the test."""

    def resolve(host):
        assert host in table, f"unexpected lookup of {host}"
        return table[host]

    return resolve


def no_lookup(host):
    raise AssertionError(f"the plan must not resolve {host}")


def build(job_spec, environ, argv=("python", "train.py"), rank_table=None, which=None, resolve=no_lookup, attempt=1):
    which = which or which_from("torchrun", "msrun", "python")
    return plan.build(job_spec, plan.Context(list(argv), environ, rank_table, resolve, which, attempt))


def template_two(pods):
    """A template-two document; pods: [(pod_name, server_id, [physical device ids])]."""
    instances = [
        {"pod_name": pod_name, "server_id": server_id,
         "devices": [{"device_id": str(device), "device_ip": f"192.98.{index}.{10 + device}"} for device in devices]}
        for index, (pod_name, server_id, devices) in enumerate(pods)
    ]
    return {
        "group_count": "1",
        "group_list": [{"group_name": "job-worker", "instance_count": str(len(pods)),
                        "device_count": str(sum(len(devices) for _, _, devices in pods)),
                        "instance_list": instances}],
        "status": "completed",
    }


def prepared(tmp_path, job_spec, environ, pods):
    """The rank table as `ranktable.wait_and_convert` hands it over, without waiting or writing template one."""
    source = tmp_path / "config" / table_model.FILE_NAME
    source.parent.mkdir(exist_ok=True)
    text = json.dumps(template_two(pods))
    source.write_text(text)
    ranked = table_convert.read_any(text, str(source))
    return ranktable.Prepared(source, ranktable.converted_path(job_spec), ranked, table_node.node_view(ranked, environ))


TWO_BY_EIGHT = [(f"{VJ}-worker-{pod}", f"172.16.0.{10 + pod}", list(range(8))) for pod in range(2)]
# Two 4-card pods on one 8-card host: the second pod sees physical devices 4..7.
SHARED_HOST = [(f"{VJ}-worker-0", "172.16.0.10", [0, 1, 2, 3]), (f"{VJ}-worker-1", "172.16.0.10", [4, 5, 6, 7])]


# --------------------------------------------------------------------------- choosing the method


@pytest.mark.parametrize("method", plan.METHODS)
def test_ma_run_method_names_the_method(job, method):
    job_spec, environ = job(MA_RUN_METHOD=method)
    assert plan.choose(job_spec) == (method, f"MA_RUN_METHOD={method}")


def test_ma_run_method_is_case_insensitive(job):
    job_spec, environ = job(MA_RUN_METHOD=" TorchRun ")
    assert plan.choose(job_spec)[0] == "torchrun"


def test_ma_run_method_wins_over_npu_signs(job, tmp_path):
    (tmp_path / "dev" / "davinci0").touch()
    job_spec, environ = job(MA_RUN_METHOD="plain", RANK_TABLE_FILE="/user/config")
    assert plan.choose(job_spec)[0] == "plain"


def test_unset_method_with_rank_table_file_is_rtf(job):
    job_spec, environ = job(RANK_TABLE_FILE="/user/config")
    method, why = plan.choose(job_spec)
    assert method == "rtf" and "RANK_TABLE_FILE" in why


def test_unset_method_with_davinci_device_node_is_rtf(job, tmp_path):
    for name in ("davinci0", "davinci_manager", "hisi_hdc"):
        (tmp_path / "dev" / name).touch()
    job_spec, environ = job()
    method, why = plan.choose(job_spec)
    assert method == "rtf" and "davinci" in why and str(tmp_path / "dev") in why


@pytest.mark.parametrize("nodes", [["nvidia0", "nvidiactl", "nvidia-uvm"], [], ["davinci_manager", "davinci"]])
def test_unset_method_without_npu_device_nodes_is_plain(job, tmp_path, nodes):
    for name in nodes:
        (tmp_path / "dev" / name).touch()
    job_spec, environ = job()
    method, why = plan.choose(job_spec)
    assert method == "plain" and "MA_RUN_METHOD is unset" in why


def test_unset_method_with_missing_device_directory_is_plain(job, tmp_path):
    job_spec, environ = job(MA_RUNTIME_PREFLIGHT_DEV_DIR=tmp_path / "no-such-dev")
    assert plan.choose(job_spec)[0] == "plain"


def test_empty_ma_run_method_counts_as_unset(job):
    job_spec, environ = job(MA_RUN_METHOD="")
    assert plan.choose(job_spec)[0] == "plain"


def test_unknown_method_is_a_configuration_error_naming_the_accepted_values(job):
    with pytest.raises(ConfigError) as caught:
        job(MA_RUN_METHOD="horovod")
    assert caught.value.exit_code == ExitCode.BAD_CONFIGURATION == 78
    assert "MA_RUN_METHOD" in caught.value.reason and "horovod" in caught.value.reason
    assert ", ".join(plan.METHODS) in caught.value.reason


# --------------------------------------------------------------------------- plain


def test_plain_runs_the_command_once_as_given(job):
    job_spec, environ = job(MA_VJ_NAME=VJ, MA_NUM_GPUS=8)
    argv = build_argv(["bash", "run.sh", "--x"], [("lr", "0.1")])
    result = build(job_spec, environ, argv)
    assert (result.method, result.nodes, result.processes_per_node) == ("plain", 1, 1)
    (worker,) = result.workers
    assert worker.name == "command"
    assert worker.argv == ("bash", "run.sh", "--x", "--lr=0.1")
    assert worker.env == {"MA_PROC_START_CNT": "1", "MA_SCHEDULE_CNT": "1",
                          **job_variables("localhost", 18888, 1, 0, 8)}
    assert worker.cwd is None and worker.rank is None
    assert worker.logs == {"task": str(job_spec.task_log_path)}
    assert worker.logs["task"].endswith(f"modelarts-job-{UUID}-worker-0.log")


# --------------------------------------------------------------------------- torchrun


def test_torchrun_single_node_is_the_documented_command(job):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_NUM_GPUS=8, MA_VJ_NAME=VJ)
    which = which_from("torchrun")
    result = build(job_spec, environ, ["python", "train.py", "--epochs", "3"], which=which)
    assert (result.method, result.why, result.nodes, result.processes_per_node) == (
        "torchrun", "MA_RUN_METHOD=torchrun", 1, 8)
    (worker,) = result.workers
    assert worker.name == "torchrun"
    assert worker.argv == ("/opt/bin/torchrun", "--standalone", "--nnodes=1", "--nproc_per_node=8",
                           "train.py", "--epochs", "3")
    assert worker.env == {"MA_PROC_START_CNT": "1", "MA_SCHEDULE_CNT": "1",
                          **job_variables("localhost", 18888, 1, 0, 8)}
    assert worker.logs == {"task": str(job_spec.task_log_path)}
    # Looked up on the job's PATH (after the folder of the job's `python`, which is not on it here).
    assert [call for call in which.calls if call[0] in ("python", "torchrun")] == [("python", PATH), ("torchrun", PATH)]


def test_torchrun_without_accelerators_starts_one_process(job):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_NUM_GPUS=0)
    result = build(job_spec, environ)
    assert result.workers[0].argv == ("/opt/bin/torchrun", "--standalone", "--nnodes=1", "--nproc_per_node=1",
                                      "train.py")
    assert result.processes_per_node == 1


def multi_node(job, **variables):
    base = {"MA_RUN_METHOD": "torchrun", "MA_NUM_HOSTS": 2, "MA_NUM_GPUS": 8, "VC_TASK_INDEX": 1, "MA_VJ_NAME": VJ,
            "VC_WORKER_HOSTS": ",".join(HOSTS[:2])}
    base.update(variables)
    return job(**{name: value for name, value in base.items() if value is not None})


def test_torchrun_multi_node_is_the_documented_command(job):
    job_spec, environ = multi_node(job)
    result = build(job_spec, environ, ["python", "train.py", "--epochs", "3"])
    assert (result.nodes, result.processes_per_node) == (2, 8)
    assert result.workers[0].argv == (
        "/opt/bin/torchrun", "--nnodes=2", "--nproc_per_node=8", "--node_rank=1", f"--master_addr={HOSTS[0]}",
        "--master_port=18888", f"--rdzv_id={UUID}", "--rdzv_backend=static", "train.py", "--epochs", "3",
    )


def test_torchrun_master_port_comes_from_ma_torchrun_master_port(job):
    job_spec, environ = multi_node(job, MA_TORCHRUN_MASTER_PORT=29500)
    argv = build(job_spec, environ).workers[0].argv
    assert "--master_port=29500" in argv and "--master_port=18888" not in argv


def test_torchrun_master_is_the_first_worker_host_stripped(job):
    job_spec, environ = multi_node(job, VC_WORKER_HOSTS=f" {HOSTS[0]} , {HOSTS[1]} ,")
    assert f"--master_addr={HOSTS[0]}" in build(job_spec, environ).workers[0].argv


def test_torchrun_master_falls_back_to_the_volcano_name_of_worker_zero(job):
    job_spec, environ = multi_node(job, VC_WORKER_HOSTS=None, MA_TASK_NAME="worker")
    assert role.role(job_spec).master == f"{VJ}-worker-0.{VJ}"
    assert f"--master_addr={VJ}-worker-0.{VJ}" in build(job_spec, environ).workers[0].argv


def test_master_fallback_uses_the_task_name(job):
    job_spec, environ = multi_node(job, VC_WORKER_HOSTS="", MA_TASK_NAME="learner")
    assert role.role(job_spec).master == f"{VJ}-learner-0.{VJ}"


def test_torchrun_multi_node_without_any_master_address_is_a_configuration_error(job):
    job_spec, environ = multi_node(job, VC_WORKER_HOSTS=None, MA_VJ_NAME=None)
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ)
    assert caught.value.exit_code == 78
    assert "VC_WORKER_HOSTS" in caught.value.reason and "MA_VJ_NAME" in caught.value.reason


def test_extra_params_replace_the_preset_master_port(job):
    job_spec, environ = multi_node(job, MA_EXTRA_TORCHRUN_PARAMS="--master_port=29999 --rdzv_conf=timeout=7200")
    argv = build(job_spec, environ).workers[0].argv
    assert argv == (
        "/opt/bin/torchrun", "--nnodes=2", "--nproc_per_node=8", "--node_rank=1", f"--master_addr={HOSTS[0]}",
        f"--rdzv_id={UUID}", "--rdzv_backend=static", "--master_port=29999", "--rdzv_conf=timeout=7200", "train.py",
    )
    assert [token for token in argv if token.startswith("--master_port")] == ["--master_port=29999"]


def test_extra_params_in_dash_form_replace_the_underscore_preset(job):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_NUM_GPUS=8, MA_EXTRA_TORCHRUN_PARAMS="--nproc-per-node=4")
    argv = build(job_spec, environ).workers[0].argv
    assert argv == ("/opt/bin/torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=4", "train.py")


def test_extra_params_with_a_separate_value_replace_the_preset(job):
    job_spec, environ = multi_node(job, MA_EXTRA_TORCHRUN_PARAMS="--master-port 29999")
    argv = build(job_spec, environ).workers[0].argv
    assert "--master_port=18888" not in argv
    assert argv[-3:] == ("--master-port", "29999", "train.py")


def test_extra_params_that_name_no_preset_are_appended_after_it(job):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_NUM_GPUS=2,
                            MA_EXTRA_TORCHRUN_PARAMS="--rdzv_conf=timeout=7200")
    argv = build(job_spec, environ).workers[0].argv
    assert argv == ("/opt/bin/torchrun", "--standalone", "--nnodes=1", "--nproc_per_node=2",
                    "--rdzv_conf=timeout=7200", "train.py")


def test_extra_params_are_split_like_a_shell(job):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_EXTRA_TORCHRUN_PARAMS="--rdzv_conf=\"a b\" --tee 'x y'")
    argv = build(job_spec, environ).workers[0].argv
    assert argv[4:] == ("--rdzv_conf=a b", "--tee", "x y", "train.py")


def test_extra_params_are_never_evaluated(job, tmp_path):
    marker = tmp_path / "pwned"
    extra = f"--rdzv_conf=$(touch {marker}) --log_dir=$HOME/`touch {marker}`"
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_EXTRA_TORCHRUN_PARAMS=extra)
    argv = build(job_spec, environ).workers[0].argv
    assert argv[4:] == ("--rdzv_conf=$(touch", f"{marker})", "--log_dir=$HOME/`touch", f"{marker}`", "train.py")
    assert not marker.exists()


@pytest.mark.parametrize("extra", ["--rdzv_conf=\"a b", "--rdzv_conf='a b", "--x=\\"])
def test_extra_params_with_unbalanced_quotes_are_a_configuration_error(job, extra):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_EXTRA_TORCHRUN_PARAMS=extra)
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ)
    assert caught.value.exit_code == 78
    assert "MA_EXTRA_TORCHRUN_PARAMS" in caught.value.reason and "quote" in caught.value.hint


@pytest.mark.parametrize(
    "command, program",
    [
        (["python", "train.py"], ["train.py"]),
        (["python3", "train.py", "--x", "1"], ["train.py", "--x", "1"]),
        # An interpreter named by its path is the job's choice: it runs the script, not torchrun's Python.
        (["/usr/bin/python3.10", "/code/train.py"], ["--no-python", "/usr/bin/python3.10", "/code/train.py"]),
        (["bash", "run.sh"], ["--no-python", "bash", "run.sh"]),
        (["./train.sh", "--x"], ["--no-python", "./train.sh", "--x"]),
        (["python", "-u", "train.py"], ["--no-python", "python", "-u", "train.py"]),
        (["python", "-m", "pkg.train"], ["--no-python", "python", "-m", "pkg.train"]),
        (["python"], ["--no-python", "python"]),
        (["pythonic", "train.py"], ["--no-python", "pythonic", "train.py"]),
        (["sh", "-c", "python train.py"], ["--no-python", "sh", "-c", "python train.py"]),
    ],
)
def test_torchrun_runs_python_scripts_itself_and_anything_else_with_no_python(job, command, program):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_NUM_GPUS=1)
    argv = build(job_spec, environ, command).workers[0].argv
    assert list(argv) == ["/opt/bin/torchrun", "--standalone", "--nnodes=1", "--nproc_per_node=1", *program]


def test_torchrun_runs_the_shell_form_with_no_python(job):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_NUM_GPUS=1)
    argv = build_argv(["cd /code && python train.py"], [("lr", "0.1")])
    assert build(job_spec, environ, argv).workers[0].argv[4:] == (
        "--no-python", "/bin/sh", "-c", "cd /code && python train.py --lr=0.1")


def test_torchrun_not_installed_names_the_package(job):
    job_spec, environ = job(MA_RUN_METHOD="torchrun")
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ, which=which_from("msrun", "python"))
    assert caught.value.exit_code == 78
    assert "torchrun" in caught.value.reason and "not installed" in caught.value.reason
    assert "torch" in caught.value.hint and "pip install torch" in caught.value.hint


# --------------------------------------------------------------------------- appended arguments


def test_appended_arguments_come_after_the_scripts_own_for_every_method(job, tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        "inputs:\n  - {name: data_url, url: 'obs://bucket/data/'}\n"
        "outputs:\n  - {name: train_url, url: 'obs://bucket/out/'}\n"
        "hyperparameters:\n  lr: 0.1\n  amp: true\n"
    )
    mount = tmp_path / "home" / "modelarts"
    appended = (f"--data_url={mount}/inputs/data_url_0", f"--train_url={mount}/outputs/train_url_0", "--lr=0.1",
                "--amp=True")
    for method in ("plain", "torchrun", "msrun", "rtf"):
        job_spec, environ = job(MA_RUN_METHOD=method, MA_RUNTIME_CONFIG=job_file, MA_NUM_GPUS=2)
        staged = stagein.planned(job_spec)
        argv = build_argv(["python", "train.py", "--epochs", "3"], [*staged.arguments, *job_spec.hyperparameters])
        table = prepared(tmp_path, job_spec, environ, [("pod-0", "172.16.0.10", [0, 1])])
        result = build(job_spec, environ, argv, rank_table=table)
        for worker in result.workers:
            assert worker.argv[-7:] == ("train.py", "--epochs", "3", *appended), method


# --------------------------------------------------------------------------- msrun


def test_msrun_single_node_is_the_documented_command(job, tmp_path):
    job_spec, environ = job(MA_RUN_METHOD="msrun", MA_NUM_GPUS=8, MA_LOG_DIR=tmp_path / "logs")
    which = which_from("msrun", "python")
    result = build(job_spec, environ, ["/opt/venv/bin/python", "train.py", "--epochs", "3"], which=which, attempt=2)
    assert (result.method, result.nodes, result.processes_per_node) == ("msrun", 1, 8)
    (worker,) = result.workers
    log_dir = tmp_path / "logs" / "msrun" / "attempt-2"
    assert worker.name == "msrun"
    assert worker.argv == (
        "/opt/bin/msrun", "--worker_num=8", "--local_worker_num=8", "--master_addr=127.0.0.1", "--node_rank=0",
        "--master_port=8118", f"--log_dir={log_dir}", "--join=True", "--cluster_time_out=600", "--tail_worker_log=-2",
        "train.py", "--epochs", "3",
    )
    assert worker.logs == {"task": str(job_spec.task_log_path), "msrun": str(log_dir)}
    assert worker.env == {"MA_PROC_START_CNT": "2", "MA_SCHEDULE_CNT": "1", "PATH": f"/opt/venv/bin:{PATH}",
                          **job_variables("127.0.0.1", 8118, 1, 0, 8)}
    assert [call for call in which.calls if call[0] == "msrun"] == [("msrun", "/opt/venv/bin"), ("msrun", PATH)]


def test_msrun_ports_and_time_out_come_from_their_variables(job):
    job_spec, environ = job(MA_RUN_METHOD="msrun", MSRUN_CLUSTER_TIME_OUT=1200, MA_RUNTIME_MSRUN_MASTER_PORT=9123)
    argv = build(job_spec, environ).workers[0].argv
    assert "--cluster_time_out=1200" in argv and "--master_port=9123" in argv


def test_msrun_without_accelerators_starts_one_process_per_node(job):
    job_spec, environ = multi_node(job, MA_RUN_METHOD="msrun", MA_NUM_GPUS=0)
    result = build(job_spec, environ, resolve=resolver({HOSTS[0]: "172.16.0.10"}))
    assert result.workers[0].argv[1:3] == ("--worker_num=2", "--local_worker_num=1")
    assert result.processes_per_node == 1


def test_msrun_multi_node_uses_the_resolved_ip_of_worker_zero(job):
    job_spec, environ = multi_node(job, MA_RUN_METHOD="msrun", MA_NUM_HOSTS=4, VC_TASK_INDEX=3,
                                   VC_WORKER_HOSTS=",".join(HOSTS))
    result = build(job_spec, environ, resolve=resolver({HOSTS[0]: "172.16.0.10"}))
    argv = result.workers[0].argv
    assert argv[:6] == ("/opt/bin/msrun", "--worker_num=32", "--local_worker_num=8", "--master_addr=172.16.0.10",
                        "--node_rank=3", "--master_port=8118")
    assert (result.nodes, result.processes_per_node) == (4, 8)


def test_msrun_multi_node_resolves_the_fallback_master_name(job):
    job_spec, environ = multi_node(job, MA_RUN_METHOD="msrun", VC_WORKER_HOSTS=None)
    argv = build(job_spec, environ, resolve=resolver({f"{VJ}-worker-0.{VJ}": "10.0.0.7"})).workers[0].argv
    assert "--master_addr=10.0.0.7" in argv


def test_msrun_with_ms_ranktable_enable_gets_the_converted_table(job, tmp_path):
    job_spec, environ = job(MA_RUN_METHOD="msrun", MA_NUM_GPUS=8, MS_RANKTABLE_ENABLE="True",
                            RANK_TABLE_FILE=tmp_path / "config")
    table = prepared(tmp_path, job_spec, environ, TWO_BY_EIGHT[:1])
    argv = build(job_spec, environ, ["python", "train.py", "--x"], rank_table=table).workers[0].argv
    assert argv[-5:] == ("--cluster_time_out=600", "--tail_worker_log=-2", f"--rank_table_file={table.path}",
                         "train.py", "--x")
    assert str(table.path) == str(job_spec.state_dir / "rank_table" / "jobstart_hccl.json")  # not the source


@pytest.mark.parametrize("enable", ["False", "0", None])
def test_msrun_without_ms_ranktable_enable_has_no_rank_table_flag(job, tmp_path, enable):
    variables = {"MS_RANKTABLE_ENABLE": enable} if enable else {}
    job_spec, environ = job(MA_RUN_METHOD="msrun", MA_NUM_GPUS=8, RANK_TABLE_FILE=tmp_path / "config", **variables)
    table = prepared(tmp_path, job_spec, environ, TWO_BY_EIGHT[:1])
    argv = build(job_spec, environ, rank_table=table).workers[0].argv
    assert not [token for token in argv if token.startswith("--rank_table_file")]


def test_msrun_ranktable_enable_without_a_rank_table_is_a_config_error(job):
    job_spec, environ = job(MA_RUN_METHOD="msrun", MS_RANKTABLE_ENABLE="True")
    with pytest.raises(ConfigError, match="MS_RANKTABLE_ENABLE=True, but there is no rank table"):
        build(job_spec, environ)


@pytest.mark.parametrize(
    "python, environ_path, expected",
    [
        ("/opt/venv/bin/python", PATH, f"/opt/venv/bin:{PATH}"),
        ("/opt/venv/bin/python3", "/usr/bin:/opt/venv/bin:/bin", "/opt/venv/bin:/usr/bin:/bin"),  # moved, once
        ("python", PATH, f"/opt/bin:{PATH}"),  # found by `which` on the job's PATH
    ],
)
def test_msrun_path_starts_with_the_folder_of_the_commands_python(job, python, environ_path, expected):
    job_spec, environ = job(MA_RUN_METHOD="msrun", PATH=environ_path)
    worker = build(job_spec, environ, [python, "train.py"]).workers[0]
    assert worker.env["PATH"] == expected


def test_msrun_python_not_on_path_is_a_configuration_error(job):
    job_spec, environ = job(MA_RUN_METHOD="msrun")
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ, ["python3", "train.py"], which=which_from("msrun"))
    assert caught.value.exit_code == 78 and "python3" in caught.value.reason


@pytest.mark.parametrize(
    "command",
    [["bash", "run.sh"], build_argv(["python train.py"], []), ["python", "-m", "pkg.train"], ["python", "train"],
     ["python"], ["./train.py"]],
)
def test_msrun_needs_a_python_script(job, command):
    job_spec, environ = job(MA_RUN_METHOD="msrun")
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ, command)
    assert caught.value.exit_code == 78
    assert "msrun runs a Python script" in caught.value.reason and "python SCRIPT.py" in caught.value.hint


def test_msrun_not_installed_names_the_package(job):
    job_spec, environ = job(MA_RUN_METHOD="msrun")
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ, which=which_from("torchrun", "python"))
    assert "msrun" in caught.value.reason and "not installed" in caught.value.reason
    assert "mindspore" in caught.value.hint


# --------------------------------------------------------------------------- RTF


def job_variables(master, port, nodes, rank, per_node):
    """What every command of the job is given (launch/role.py JobVariables) unless the job sets it."""
    return {"MASTER_ADDR": master, "MASTER_PORT": str(port), "NNODES": str(nodes), "NODE_RANK": str(rank),
            **{name: str(per_node) for name in ("NPUS_PER_NODE", "GPUS_PER_NODE", "NPROC_PER_NODE")}}


def rtf_env(job_spec, table, rank, logical, start="1", schedule="1"):
    nodes = job_spec.num_hosts
    return {
        **job_variables(f"{VJ}-worker-0.{VJ}" if nodes > 1 else "localhost", 18888, nodes,
                        rank // len(table.node.devices), len(table.node.devices)),
        "MA_PROC_START_CNT": start,
        "MA_SCHEDULE_CNT": schedule,
        "RANK_TABLE_FILE": str(table.path),
        "RANK_ID": str(rank),
        "RANK_SIZE": str(table.ranked.rank_size),
        "ASCEND_DEVICE_ID": str(logical),
        "DEVICE_ID": str(logical),
        "JOB_ID": UUID,
        "ASCEND_PROCESS_LOG_PATH": str(job_spec.log_dir / f"modelarts-job-{job_spec.job_id}" / "ascend" / "process_log"
                                       / f"rank_{rank}"),
    }


def proc_log(job_spec, rank, logical):
    return {"proc": str(job_spec.log_dir / f"modelarts-job-{UUID}-proc-rank-{rank}-device-{logical}.txt")}


def test_rtf_starts_one_process_per_local_device_of_the_second_pod(job, tmp_path):
    job_spec, environ = job(MA_NUM_HOSTS=2, MA_NUM_GPUS=8, VC_TASK_INDEX=1, MA_VJ_NAME=VJ, MA_SCHEDULE_CNT=2,
                            RANK_TABLE_FILE=tmp_path / "config")
    table = prepared(tmp_path, job_spec, environ, TWO_BY_EIGHT)
    argv = build_argv(["python", "train.py"], [("lr", "0.1")])
    result = build(job_spec, environ, argv, rank_table=table, which=which_from(), attempt=3)
    assert (result.method, result.nodes, result.processes_per_node) == ("rtf", 2, 8)
    assert "RANK_TABLE_FILE" in result.why
    assert [worker.rank for worker in result.workers] == list(range(8, 16))
    for logical, worker in enumerate(result.workers):
        rank = 8 + logical
        assert worker.name == f"rank-{rank}"
        assert worker.argv == ("python", "train.py", "--lr=0.1")
        assert worker.env == rtf_env(job_spec, table, rank, logical, "3", "2")
        assert worker.logs == proc_log(job_spec, rank, logical)
        assert worker.cwd is None
    assert len({worker.env["ASCEND_PROCESS_LOG_PATH"] for worker in result.workers}) == 8


def test_rtf_first_pod_has_ranks_zero_to_seven(job, tmp_path):
    job_spec, environ = job(MA_RUN_METHOD="rtf", MA_NUM_HOSTS=2, MA_NUM_GPUS=8, VC_TASK_INDEX=0, MA_VJ_NAME=VJ)
    table = prepared(tmp_path, job_spec, environ, TWO_BY_EIGHT)
    result = build(job_spec, environ, rank_table=table)
    assert [(w.env["RANK_ID"], w.env["ASCEND_DEVICE_ID"]) for w in result.workers] == [
        (str(rank), str(rank)) for rank in range(8)]
    assert {w.env["RANK_SIZE"] for w in result.workers} == {"16"}


def test_rtf_ids_are_logical_on_a_pod_with_physical_devices_four_to_seven(job, tmp_path):
    job_spec, environ = job(MA_NUM_HOSTS=2, MA_NUM_GPUS=4, VC_TASK_INDEX=1, MA_VJ_NAME=VJ,
                            RANK_TABLE_FILE=tmp_path / "config")
    table = prepared(tmp_path, job_spec, environ, SHARED_HOST)
    assert [device.device_id for device in table.node.devices] == ["4", "5", "6", "7"]
    result = build(job_spec, environ, rank_table=table)
    assert result.processes_per_node == 4
    for logical, worker in enumerate(result.workers):
        rank = 4 + logical
        assert worker.env == rtf_env(job_spec, table, rank, logical)
        assert worker.env["RANK_SIZE"] == "8"
        assert worker.logs == proc_log(job_spec, rank, logical)


def test_rtf_logical_ids_follow_physical_order_not_rank_order(job, tmp_path):
    job_spec, environ = job(MA_RUN_METHOD="rtf", MA_NUM_GPUS=4, MA_VJ_NAME=VJ)
    table = prepared(tmp_path, job_spec, environ, [("pod-0", "172.16.0.10", [5, 4, 7, 6])])
    result = build(job_spec, environ, rank_table=table)
    assert [(w.rank, w.env["ASCEND_DEVICE_ID"], w.env["DEVICE_ID"]) for w in result.workers] == [
        (0, "1", "1"), (1, "0", "0"), (2, "3", "3"), (3, "2", "2")]
    assert result.workers[0].logs == proc_log(job_spec, 0, 1)


def test_rtf_without_a_rank_table_is_a_configuration_error(job):
    job_spec, environ = job(MA_RUN_METHOD="rtf")
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ)
    assert caught.value.exit_code == 78 and "rank table" in caught.value.reason
    assert "RANK_TABLE_FILE" in caught.value.hint


def test_rtf_chosen_for_davinci_nodes_still_needs_a_rank_table(job, tmp_path):
    (tmp_path / "dev" / "davinci0").touch()
    job_spec, environ = job()
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ)
    assert "RANK_TABLE_FILE" in caught.value.hint and "MA_RUN_METHOD" in caught.value.hint


def test_rtf_on_a_node_without_devices_is_a_configuration_error(job, tmp_path):
    job_spec, environ = job(MA_RUN_METHOD="rtf", MA_NUM_HOSTS=2, VC_TASK_INDEX=1)
    pods = [("pod-0", "172.16.0.10", [0, 1]), ("pod-1", "172.16.0.11", [])]
    table = prepared(tmp_path, job_spec, environ, pods)
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ, rank_table=table)
    assert "172.16.0.11" in caught.value.reason and "no devices" in caught.value.reason


# --------------------------------------------------------------------------- every plan


def every_method(job, tmp_path, attempt=1, **variables):
    """(method, Plan) for each method, multi node, with the same job counters and attempt."""
    for method in ("plain", "torchrun", "msrun", "rtf"):
        job_spec, environ = multi_node(job, MA_RUN_METHOD=method, RANK_TABLE_FILE=tmp_path / "config", **variables)
        table = prepared(tmp_path, job_spec, environ, TWO_BY_EIGHT)
        yield method, build(job_spec, environ, ["python", "train.py", "--note=a b"], rank_table=table,
                            resolve=resolver({HOSTS[0]: "172.16.0.10"}), attempt=attempt)


def test_every_worker_env_has_the_start_and_schedule_counters(job, tmp_path):
    for method, result in every_method(job, tmp_path, attempt=4, MA_SCHEDULE_CNT=2):
        assert result.workers, method
        for worker in result.workers:
            assert worker.env["MA_PROC_START_CNT"] == "4" and worker.env["MA_SCHEDULE_CNT"] == "2", method
            assert all(isinstance(value, str) for value in worker.env.values()), method


@pytest.mark.parametrize("attempt", [1, 2, 7])
def test_the_attempt_not_the_jobs_start_count_numbers_every_worker_and_msruns_log_folder(job, tmp_path, attempt):
    # MA_PROC_START_CNT as the platform set it when the runtime started is only the first attempt's number:
    # each relaunch builds its plan with the next attempt, and that is what the workers must see.
    for method, result in every_method(job, tmp_path, attempt=attempt, MA_PROC_START_CNT=5, MA_LOG_DIR=tmp_path / "l"):
        for worker in result.workers:
            assert worker.env["MA_PROC_START_CNT"] == str(attempt), method
        if method == "msrun":
            log_dir = str(tmp_path / "l" / "msrun" / f"attempt-{attempt}")
            assert result.workers[0].logs["msrun"] == log_dir
            assert f"--log_dir={log_dir}" in result.workers[0].argv


def test_a_context_without_an_attempt_is_the_first(job, tmp_path):
    job_spec, environ = job(MA_RUN_METHOD="msrun", MA_PROC_START_CNT=5, MA_LOG_DIR=tmp_path / "l")
    result = plan.build(job_spec, plan.Context(["python", "train.py"], environ, which=which_from("msrun", "python")))
    assert result.workers[0].env["MA_PROC_START_CNT"] == "1"
    assert result.workers[0].logs["msrun"] == str(tmp_path / "l" / "msrun" / "attempt-1")


def test_plan_to_dict_has_the_documented_shape(job, tmp_path):
    for method, result in every_method(job, tmp_path):
        document = json.loads(json.dumps(result.to_dict()))  # JSON-ready as it is
        assert document["method"] == method
        assert set(document) == {"method", "why", "nodes", "processes_per_node", "warnings", "node", "workers",
                                 "services"}
        assert document["node"] == (result.node.to_dict() if method != "tensorflow-gpu" else None)
        assert document["services"] == []  # only Ray's plan shows one (tests/unit/test_ray.py)
        assert document["warnings"] == list(result.warnings)
        assert (document["nodes"], document["processes_per_node"]) == (result.nodes, result.processes_per_node)
        assert len(document["workers"]) == len(result.workers)
        for entry, worker in zip(document["workers"], result.workers):
            assert set(entry) == {"name", "argv", "env", "cwd", "logs", "rank", "files"}
            assert entry["argv"] == list(worker.argv) and entry["env"] == dict(worker.env)
            assert entry["files"] == dict(worker.files)
            assert entry["cwd"] is None and entry["logs"] == dict(worker.logs) and entry["rank"] == worker.rank


def test_render_names_the_method_and_each_workers_command_line(job, tmp_path):
    for method, result in every_method(job, tmp_path):
        text = plan.render(result.to_dict())
        assert text.startswith(f"method: {method} (MA_RUN_METHOD={method})\n")
        assert f"nodes: 2, processes per node: {result.processes_per_node}" in text
        for worker in result.workers:
            assert f"[{worker.name}] {shlex.join(worker.argv)}\n" in text
            assert "'--note=a b'" in text  # quoted as a shell would need it
            for kind, path in worker.logs.items():
                assert f"  log  {kind}: {path}" in text


def test_render_shows_env_and_cwd():
    worker = plan.WorkerPlan("command", ("python", "train.py"), {"A": "1"}, cwd="/code", logs={"task": "/l/t.log"})
    text = plan.render(plan.Plan("plain", "why", (worker,), 1, 1).to_dict())
    assert text == ("method: plain (why)\nnodes: 1, processes per node: 1\n\n[command] python train.py\n"
                    "  env  A=1\n  cwd  /code\n  log  task: /l/t.log\n")


def test_build_is_pure(job, tmp_path):
    """Same inputs, same plan; nothing written (the converted table, the msrun log folder)."""
    before = sorted(str(path) for path in tmp_path.rglob("*"))
    first = [result for _, result in every_method(job, tmp_path)]
    second = [result for _, result in every_method(job, tmp_path)]
    assert first == second
    created = sorted(set(str(path) for path in tmp_path.rglob("*")) - set(before))
    assert created == [str(tmp_path / "config"), str(tmp_path / "config" / table_model.FILE_NAME)]  # the test's


# --------------------------------------------------------------------------- the default `which`


@pytest.mark.parametrize("launcher", ["torchrun", "msrun"])
def test_default_which_finds_the_launcher_on_the_jobs_path(job, tmp_path, launcher):
    folder = tmp_path / "bin"
    folder.mkdir()
    fake = folder / launcher
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    job_spec, environ = job(MA_RUN_METHOD=launcher, PATH=f"{folder}:{PATH}")
    result = plan.build(job_spec, plan.Context(["/opt/venv/bin/python", "train.py"], environ))
    assert result.workers[0].argv[0] == str(fake)


# --------------------------------------------------------------------------- `ma-runtime plan`, black box


@pytest.fixture
def cli_env(job_env, tmp_path):
    """job_env, with nothing of this machine's that would change the plan, and a PATH with fake launchers."""
    env = {name: value for name, value in job_env.items() if name not in _PLAN_VARIABLES}
    (tmp_path / "cli-dev").mkdir()
    env["MA_RUNTIME_PREFLIGHT_DEV_DIR"] = str(tmp_path / "cli-dev")
    folder = tmp_path / "fake-bin"
    folder.mkdir()
    for name in ("torchrun", "msrun"):
        fake = folder / name
        fake.write_text(f"#!/bin/sh\ntouch {tmp_path / 'launcher-ran'}\n")
        fake.chmod(0o755)
    env["PATH"] = f"{folder}:{job_env.get('PATH', os.defpath)}"
    return env


def plan_cli(args, env):
    return subprocess.run([MA_RUNTIME, "plan", *args], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("method", ["torchrun", "msrun"])
def test_cli_plan_json_starts_nothing(cli_env, tmp_path, method):
    cli_env.update(MA_RUN_METHOD=method, MA_NUM_GPUS="2")
    result = plan_cli(["--json", "--", "/opt/venv/bin/python", "train.py", "--x"], cli_env)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["method"] == method
    (worker,) = document["workers"]
    if method == "torchrun":  # restarted in place: the agent is the run's service, each attempt's worker its gate
        (agent,) = document["services"]
        assert agent["argv"][0] == str(tmp_path / "fake-bin" / method)
        assert agent["argv"][1:4] == ["--standalone", "--nnodes=1", "--nproc_per_node=2"]
        # An interpreter named by its path runs the script itself (torchrun's --no-python, as restarted whole).
        assert worker["argv"][-4:] == ["--program", "/opt/venv/bin/python", "train.py", "--x"]
    else:
        assert worker["argv"][0] == str(tmp_path / "fake-bin" / method)
        assert worker["argv"][-2:] == ["train.py", "--x"]
    assert not (tmp_path / "launcher-ran").exists()


def test_cli_plan_numbers_the_attempt_from_the_jobs_start_count(cli_env, tmp_path):
    cli_env.update(MA_RUN_METHOD="msrun", MA_PROC_START_CNT="3", MA_LOG_DIR=str(tmp_path / "l"))
    result = plan_cli(["--json", "--", "python", "train.py"], cli_env)
    assert result.returncode == 0, result.stderr
    (worker,) = json.loads(result.stdout)["workers"]
    assert worker["env"]["MA_PROC_START_CNT"] == "3"
    assert worker["logs"]["msrun"] == str(tmp_path / "l" / "msrun" / "attempt-3")


def test_cli_plan_masks_a_secret_in_extra_torchrun_params(cli_env, tmp_path):
    secret = "Qv7secretValueForPlanTests"
    cli_env.update(MA_RUN_METHOD="torchrun", OBS_SECRET_ACCESS_KEY=secret,
                   MA_EXTRA_TORCHRUN_PARAMS=f"--rdzv_conf=store_key={secret}")
    result = plan_cli(["--json", "--", "python", "train.py"], cli_env)
    assert result.returncode == 0, result.stderr
    assert secret not in result.stdout and secret not in result.stderr
    assert "--rdzv_conf=store_key=******" in json.loads(result.stdout)["services"][0]["argv"]


def test_cli_plan_plain_masks_secret_values_and_starts_nothing(cli_env, tmp_path):
    secret = "Qv7secretValueForPlanTests"
    marker = tmp_path / "command-ran"
    job_file = tmp_path / "job.yaml"
    job_file.write_text(f"hyperparameters:\n  run_tag: tag-{secret}\n")
    cli_env["OBS_SECRET_ACCESS_KEY"] = secret
    result = plan_cli(["--json", "--config", str(job_file), "--", "sh", "-c", f"touch {marker}"], cli_env)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["method"] == "plain"
    assert document["workers"][0]["argv"] == ["sh", "-c", f"touch {marker}", "--run_tag=tag-******"]
    assert secret not in result.stdout
    assert not marker.exists()


def test_cli_plan_rtf_from_the_platforms_rank_table(cli_env, tmp_path):
    config = tmp_path / "config"
    config.mkdir()
    (config / table_model.FILE_NAME).write_text(json.dumps(template_two(TWO_BY_EIGHT)))
    cli_env.update(RANK_TABLE_FILE=str(config), MA_VJ_NAME=VJ, MA_NUM_HOSTS="2", MA_NUM_GPUS="8", VC_TASK_INDEX="1",
                   MA_CURRENT_INSTANCE_NAME=f"{VJ}-worker-1")
    result = plan_cli(["--json", "--", "python", "train.py"], cli_env)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["method"] == "rtf" and document["processes_per_node"] == 8
    converted = Path(cli_env["MA_HOME"]) / "modelarts" / ".ma-runtime" / "rank_table" / table_model.FILE_NAME
    assert [w["env"]["RANK_ID"] for w in document["workers"]] == [str(rank) for rank in range(8, 16)]
    assert {w["env"]["RANK_TABLE_FILE"] for w in document["workers"]} == {str(converted)}
    assert all(w["argv"] == ["python", "train.py"] for w in document["workers"])
    assert not converted.exists()  # a plan writes nothing


def test_cli_plan_text_form_renders_the_plan(cli_env):
    result = plan_cli(["--", "python", "train.py", "a b"], cli_env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("method: plain (")
    assert "[command] python train.py 'a b'\n" in result.stdout


def test_cli_plan_unknown_method_exits_78_with_one_error_line(cli_env, tmp_path):
    cli_env["MA_RUN_METHOD"] = "horovod"
    result = plan_cli(["--json", "--", "python", "train.py"], cli_env)
    assert result.returncode == 78
    assert result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if "error,exiting" in line]
    assert len(errors) == 1 and "MA_RUN_METHOD" in errors[0] and "horovod" in errors[0]
    assert ", ".join(plan.METHODS) in errors[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "launcher-ran").exists()


# --- the job's nodes must agree ----------------------------------------------------------------------


@pytest.mark.parametrize("method", ["torchrun", "msrun"])
def test_a_task_index_not_below_the_node_count_is_a_config_error(job, method):
    job_spec, environ = job(MA_RUN_METHOD=method, MA_NUM_HOSTS=2, VC_TASK_INDEX=2, VC_WORKER_HOSTS="a.job,b.job")
    with pytest.raises(ConfigError, match=r"VC_TASK_INDEX=2 is not below MA_NUM_HOSTS=2"):
        build(job_spec, environ)


@pytest.mark.parametrize("hosts, problem", [(" , b.job", "an empty entry"), ("a.job,,b.job", "an empty entry"),
                                            ("a.job,b.job,c.job", "names 3 node"), ("a.job", "names 1 node")])
def test_worker_hosts_with_holes_or_another_count_are_config_errors(job, hosts, problem):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_NUM_HOSTS=2, VC_WORKER_HOSTS=hosts)
    with pytest.raises(ConfigError, match=problem):
        build(job_spec, environ)


def test_a_trailing_comma_in_worker_hosts_is_tolerated(job):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_NUM_HOSTS=2, VC_WORKER_HOSTS="a.job,b.job,")
    assert "--master_addr=a.job" in build(job_spec, environ).workers[0].argv


# --- processes per node: MA_RUNTIME_NPROC_PER_NODE and the summary ----------------------------------


@pytest.mark.parametrize("method", ["torchrun", "msrun"])
def test_nproc_per_node_starts_cpu_processes_without_accelerators(job, method):
    job_spec, environ = job(MA_RUN_METHOD=method, MA_NUM_GPUS=0, MA_RUNTIME_NPROC_PER_NODE=2)
    result = build(job_spec, environ)
    argv = result.workers[0].argv
    assert (result.nodes, result.processes_per_node, result.warnings) == (1, 2, ())
    if method == "torchrun":
        assert argv[1:4] == ("--standalone", "--nnodes=1", "--nproc_per_node=2")
    else:
        assert argv[1:3] == ("--worker_num=2", "--local_worker_num=2")


@pytest.mark.parametrize("method", ["torchrun", "msrun"])
def test_nproc_per_node_wins_over_ma_num_gpus(job, method):
    job_spec, environ = multi_node(job, MA_RUN_METHOD=method, MA_NUM_GPUS=8, MA_RUNTIME_NPROC_PER_NODE=4)
    result = build(job_spec, environ, resolve=resolver({HOSTS[0]: "172.16.0.10"}))
    argv = result.workers[0].argv
    assert (result.nodes, result.processes_per_node) == (2, 4)
    expected = ("--nproc_per_node=4",) if method == "torchrun" else ("--worker_num=8", "--local_worker_num=4")
    assert all(flag in argv for flag in expected), argv


def test_extra_torchrun_params_win_over_nproc_per_node(job):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_RUNTIME_NPROC_PER_NODE=2,
                            MA_EXTRA_TORCHRUN_PARAMS="--nproc-per-node=4")
    result = build(job_spec, environ)
    assert result.workers[0].argv[1:4] == ("--standalone", "--nnodes=1", "--nproc-per-node=4")
    assert result.processes_per_node == 4


@pytest.mark.parametrize(
    "extra, nodes, per_node",
    [
        ("--nproc-per-node=2", 1, 2),
        ("--nproc_per_node=2", 1, 2),
        ("--nproc-per-node 2", 1, 2),
        ("--nproc_per_node 2", 1, 2),
        ("--nproc-per-node=auto", 1, "auto"),  # torchrun's own choices are shown as given
        ("--nproc_per_node cpu", 1, "cpu"),
        ("--nnodes=1:2 --nproc-per-node=gpu", "1:2", "gpu"),
        ("--nnodes 3 --nproc_per_node=2 --nproc-per-node=5", 3, 5),  # the last one wins, as in torchrun
    ],
)
def test_the_summary_follows_the_torchrun_flags_that_run(job, extra, nodes, per_node):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_NUM_GPUS=0, MA_EXTRA_TORCHRUN_PARAMS=extra)
    result = build(job_spec, environ)
    assert (result.nodes, result.processes_per_node) == (nodes, per_node)
    assert f"nodes: {nodes}, processes per node: {per_node}\n" in plan.render(result.to_dict())


def test_the_summary_ignores_the_scripts_own_flags(job):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_NUM_GPUS=0)
    result = build(job_spec, environ, ["python", "train.py", "--nproc_per_node=5", "--nnodes", "3"])
    assert (result.nodes, result.processes_per_node) == (1, 1)


@pytest.mark.parametrize("extra", ["--nproc_per_node", "--nproc-per-node=", "--nnodes --tee 3"])
def test_a_torchrun_size_flag_without_its_value_is_a_configuration_error(job, extra):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_EXTRA_TORCHRUN_PARAMS=extra)
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ)
    assert caught.value.exit_code == 78
    assert "MA_EXTRA_TORCHRUN_PARAMS" in caught.value.reason and extra.split()[0].rstrip("=") in caught.value.reason


def test_nproc_per_node_with_plain_is_a_configuration_error(job):
    job_spec, environ = job(MA_RUNTIME_NPROC_PER_NODE=2)
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ)
    assert caught.value.exit_code == 78
    assert "MA_RUNTIME_NPROC_PER_NODE=2" in caught.value.reason and "plain launch starts one" in caught.value.reason
    assert "MA_RUN_METHOD=torchrun" in caught.value.hint


def test_nproc_per_node_one_with_plain_is_what_plain_does(job):
    job_spec, environ = job(MA_RUNTIME_NPROC_PER_NODE=1)
    assert build(job_spec, environ).processes_per_node == 1


def test_nproc_per_node_other_than_the_rank_tables_count_is_a_configuration_error(job, tmp_path):
    job_spec, environ = job(MA_RUN_METHOD="rtf", MA_NUM_GPUS=2, MA_RUNTIME_NPROC_PER_NODE=4)
    table = prepared(tmp_path, job_spec, environ, [("pod-0", "172.16.0.10", [0, 1])])
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ, rank_table=table)
    assert caught.value.exit_code == 78
    assert "MA_RUNTIME_NPROC_PER_NODE=4" in caught.value.reason and "2 device(s)" in caught.value.reason


def test_nproc_per_node_equal_to_the_rank_tables_count_is_accepted(job, tmp_path):
    job_spec, environ = job(MA_RUN_METHOD="rtf", MA_NUM_GPUS=2, MA_RUNTIME_NPROC_PER_NODE=2)
    table = prepared(tmp_path, job_spec, environ, [("pod-0", "172.16.0.10", [0, 1])])
    assert build(job_spec, environ, rank_table=table).processes_per_node == 2


# --- warnings: a plan that preflight will reject -----------------------------------------------------


def test_a_gpu_plan_on_a_machine_without_accelerators_warns_how_to_ask_for_cpus(job):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_NUM_GPUS=2)
    (warning,) = build(job_spec, environ).warnings
    assert "preflight will fail" in warning and "gpu.missing" in warning
    assert "MA_NUM_GPUS=2" in warning  # why: the check's own words
    assert "MA_NUM_GPUS=0 MA_RUNTIME_NPROC_PER_NODE=2" in warning


def test_a_plain_gpu_plan_on_a_machine_without_accelerators_warns_too(job):
    job_spec, environ = job(MA_NUM_GPUS=1)
    (warning,) = build(job_spec, environ).warnings
    assert "gpu.missing" in warning and "MA_NUM_GPUS=0" in warning and "NPROC" not in warning


@pytest.mark.parametrize(
    "variables",
    [
        {"MA_RUNTIME_PREFLIGHT": "off"},
        {"MA_SKIP_IMAGE_DETECT": "0"},
        {"MA_RUNTIME_PREFLIGHT_WARN_ONLY": "gpu"},
        {"MA_RUNTIME_PREFLIGHT_CHECKS": "dns,disk-size"},
        {"MA_RUNTIME_PREFLIGHT_ACCELERATOR": "none"},
        {"MA_NUM_GPUS": "0"},
    ],
)
def test_no_warning_when_preflight_will_not_reject_it(job, variables):
    job_spec, environ = job(**{"MA_RUN_METHOD": "torchrun", "MA_NUM_GPUS": 2, **variables})
    assert build(job_spec, environ).warnings == ()


@pytest.mark.parametrize("tool", ["nvidia-smi", "npu-smi"])
def test_no_warning_when_an_accelerator_tool_is_on_path(job, tool):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_NUM_GPUS=2)
    assert build(job_spec, environ, which=which_from("torchrun", tool)).warnings == ()


def test_a_forced_check_without_its_devices_warns_to_let_auto_choose(job):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_NUM_GPUS=0, MA_RUNTIME_PREFLIGHT_ACCELERATOR="npu")
    (warning,) = build(job_spec, environ).warnings
    assert "npu.missing" in warning and "MA_RUNTIME_PREFLIGHT_ACCELERATOR=auto" in warning


def test_fewer_device_nodes_than_ma_num_gpus_warns_too_few(job, tmp_path):
    (tmp_path / "dev" / "nvidia0").touch()
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_NUM_GPUS=2)
    (warning,) = build(job_spec, environ, which=which_from("torchrun", "nvidia-smi")).warnings
    assert "gpu.too-few" in warning


def test_no_warning_when_the_device_nodes_are_enough(job, tmp_path):
    for index in range(2):
        (tmp_path / "dev" / f"nvidia{index}").touch()
    job_spec, environ = job(MA_RUN_METHOD="torchrun", MA_NUM_GPUS=2)
    assert build(job_spec, environ, which=which_from("torchrun", "nvidia-smi")).warnings == ()


def test_render_prints_the_warnings_after_the_summary():
    worker = plan.WorkerPlan("command", ("python", "train.py"), {})
    text = plan.render(plan.Plan("plain", "why", (worker,), 1, 1, ("first", "second")).to_dict())
    assert text.startswith("method: plain (why)\nnodes: 1, processes per node: 1\n"
                           "warning: first\nwarning: second\n\n[command] python train.py\n")


# --- the launcher beside the command's Python ---------------------------------------------------------


@pytest.mark.parametrize("launcher", ["torchrun", "msrun"])
def test_the_launcher_beside_the_commands_python_comes_before_path(job, launcher):
    job_spec, environ = job(MA_RUN_METHOD=launcher)
    which = which_from("torchrun", "msrun", "python", beside={"/opt/venv/bin": ("python", "torchrun", "msrun")})
    result = build(job_spec, environ, ["/opt/venv/bin/python", "train.py"], which=which)
    assert result.workers[0].argv[0] == f"/opt/venv/bin/{launcher}"


@pytest.mark.parametrize("launcher", ["torchrun", "msrun"])
def test_the_launcher_beside_the_python_that_path_finds(job, launcher):
    # PATH finds an older launcher first, and the job's `python` later: the one beside that python runs.
    job_spec, environ = job(MA_RUN_METHOD=launcher, PATH="/usr/bin:/opt/venv/bin")
    which = which_in({"/usr/bin": ("torchrun", "msrun"), "/opt/venv/bin": ("python", "torchrun", "msrun")})
    assert build(job_spec, environ, which=which).workers[0].argv[0] == f"/opt/venv/bin/{launcher}"


def test_a_command_that_is_not_python_finds_the_launcher_on_path(job):
    job_spec, environ = job(MA_RUN_METHOD="torchrun", PATH="/usr/bin:/opt/venv/bin")
    which = which_in({"/usr/bin": ("torchrun", "bash"), "/opt/venv/bin": ("torchrun",)})
    assert build(job_spec, environ, ["bash", "run.sh"], which=which).workers[0].argv[0] == "/usr/bin/torchrun"


@pytest.mark.parametrize("launcher", ["torchrun", "msrun"])
def test_a_launcher_found_nowhere_names_both_places(job, launcher):
    job_spec, environ = job(MA_RUN_METHOD=launcher)
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ, ["/opt/venv/bin/python", "train.py"], which=which_in({}))
    assert caught.value.exit_code == 78
    assert f"{launcher} is not installed" in caught.value.reason
    assert "/opt/venv/bin" in caught.value.reason and "PATH" in caught.value.reason


@pytest.mark.parametrize("launcher, variables, code", [
    ("torchrun", {}, 78), ("msrun", {}, 78), ("mpirun", {"MA_NUM_HOSTS": 2, "VC_WORKER_HOSTS": "a.job,b.job"}, 78),
    ("ray", {}, 127),
])
def test_a_plan_shows_a_launcher_found_nowhere_as_a_warning(job, launcher, variables, code):
    # `ma-runtime plan` starts nothing: the plan is made, with the run's error as a warning and the bare name.
    job_spec, environ = job(MA_RUN_METHOD=launcher, **variables)
    context = plan.Context(["/opt/venv/bin/python", "train.py"], environ, None, no_lookup, which_in({}),
                           planning=True)
    made = plan.build(job_spec, context)
    assert [w for w in made.warnings if f"{launcher} is not installed" in w and f"exit {code}" in w], made.warnings
    argvs = [word for worker in made.workers for word in worker.argv] + \
            [word for service in made.services for word in service.argv]
    assert launcher in argvs


@pytest.mark.parametrize("launcher", ["torchrun", "msrun"])
def test_default_which_finds_the_launcher_beside_an_interpreter_off_path(job, tmp_path, launcher):
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    fake = venv / launcher
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    job_spec, environ = job(MA_RUN_METHOD=launcher, PATH="/usr/bin:/bin")
    result = plan.build(job_spec, plan.Context([str(venv / "python"), "train.py"], environ))
    assert result.workers[0].argv[0] == str(fake)


# --- `ma-runtime plan`: warnings and the summary, black box ----------------------------------------------


def test_cli_plan_warns_about_a_plan_preflight_will_reject(cli_env, tmp_path):
    cli_env.pop("MA_RUNTIME_PREFLIGHT_ACCELERATOR", None)  # the machine's own view: auto
    cli_env.update(MA_RUN_METHOD="torchrun", MA_NUM_GPUS="2", PATH=str(tmp_path / "fake-bin"))
    text = plan_cli(["--", "python", "train.py"], cli_env)
    assert text.returncode == 0, text.stderr
    assert "\nwarning: preflight will fail gpu.missing" in text.stdout
    assert "MA_NUM_GPUS=0 MA_RUNTIME_NPROC_PER_NODE=2" in text.stdout
    document = json.loads(plan_cli(["--json", "--", "python", "train.py"], cli_env).stdout)
    assert len(document["warnings"]) == 1 and "gpu.missing" in document["warnings"][0]


def test_cli_plan_summary_follows_extra_torchrun_params(cli_env):
    cli_env.update(MA_RUN_METHOD="torchrun", MA_EXTRA_TORCHRUN_PARAMS="--nproc-per-node=2")
    result = plan_cli(["--", "python", "train.py"], cli_env)
    assert result.returncode == 0, result.stderr
    assert "nodes: 1, processes per node: 2\n" in result.stdout
    assert "--nproc-per-node=2" in result.stdout and "--nproc_per_node" not in result.stdout
