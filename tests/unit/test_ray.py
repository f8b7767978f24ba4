"""MA_RUN_METHOD=ray (launch/ray.py, launch/ray_node.py): the plan on worker-0 and on the other nodes, the node's
`ray start` service, `ray` found beside the command's Python or missing (127), what the rank finder sees of Ray's
process tree, and the keeper's start-up failure and stop with a stand-in `ray start`. The real `ray` across two
nodes is tests/e2e/test_ray.py."""

import json
import signal
import subprocess
import sys
import time

import pytest

from ma_runtime.errors import CommandNotFound, ExitCode
from ma_runtime.launch import ray as ray_launcher
from ma_runtime.launch import ray_node
from tests.conftest import MA_RUN
from tests.unit import test_plan as plans
from tests.unit.test_plan import HOSTS, build, multi_node, plan_cli, which_from
from tests.unit.test_ranks import PY, Table

job, cli_env = plans.job, plans.cli_env  # the fixtures: a job under tmp_path; `ma-runtime plan`'s environment

RAY = "/opt/bin/ray"


def ray_job(job, **variables):
    return multi_node(job, **{"MA_RUN_METHOD": "ray", "MA_NUM_GPUS": 0, **variables})


def ray_plan(job_spec, environ, argv=("python", "drive.py")):
    return build(job_spec, environ, argv, which=which_from("ray", "python"))


def test_worker_0_runs_the_head_as_its_service_and_the_driver_behind_the_wait_for_every_node(job):
    job_spec, environ = ray_job(job, VC_TASK_INDEX=0, MA_CURRENT_IP="10.0.0.1")
    result = ray_plan(job_spec, environ, ("python", "drive.py", "--lr=1"))

    (service,) = result.services
    assert list(service.argv) == [RAY, "start", "--block", "--head", "--port=6379", "--include-dashboard=false",
                                  "--node-ip-address=10.0.0.1"]
    assert service.env == {"RAY_USAGE_STATS_ENABLED": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    (driver,) = result.workers
    assert driver.name == "driver" and driver.env["RAY_ADDRESS"] == f"{HOSTS[0]}:6379"
    words = list(driver.argv)
    assert words[1:4] == ["-m", "ma_runtime.launch.ray_node", "await"]
    assert f"--node={HOSTS[0]}" in words and f"--node={HOSTS[1]}" in words
    assert words[words.index("--") + 1:] == ["python", "drive.py", "--lr=1"]
    assert (result.method, result.nodes, result.processes_per_node) == ("ray", 2, 1)


def test_another_node_joins_the_head_and_runs_the_watcher_of_its_port(job):
    job_spec, environ = ray_job(job, VC_TASK_INDEX=1, MA_RUNTIME_RAY_PORT=7000, MA_RUNTIME_PEER_GONE_SECONDS=9,
                                MA_RUNTIME_EXTRA_RAY_PARAMS="--num-cpus=1 --temp-dir='/tmp/r a'")
    result = ray_plan(job_spec, environ)

    (service,) = result.services
    assert list(service.argv) == [RAY, "start", "--block", f"--address={HOSTS[0]}:7000", "--num-cpus=1",
                                  "--temp-dir=/tmp/r a"]
    (watcher,) = result.workers
    assert watcher.name == "watcher" and "RAY_ADDRESS" not in watcher.env
    assert list(watcher.argv[1:]) == ["-m", "ma_runtime.launch.peers", "--until-gone", f"{HOSTS[0]}:7000",
                                      "--appear-seconds", "600", "--gone-seconds", "9"]


def test_an_npu_job_offers_its_npus_a_gpu_or_cpu_job_leaves_the_count_to_ray(job, tmp_path):
    dev = tmp_path / "npu-dev"
    dev.mkdir()
    for name in ("davinci0", "davinci1", "davinci_manager"):
        (dev / name).touch()
    job_spec, environ = ray_job(job, VC_TASK_INDEX=0, MA_NUM_GPUS=2, MA_RUNTIME_PREFLIGHT_DEV_DIR=dev)
    assert '--resources={"NPU":2}' in ray_plan(job_spec, environ).services[0].argv
    job_spec, environ = ray_job(job, VC_TASK_INDEX=0, MA_NUM_GPUS=2, MA_RUNTIME_PREFLIGHT_ACCELERATOR="gpu")
    assert not [word for word in ray_plan(job_spec, environ).services[0].argv if word.startswith("--resources")]


def test_one_node_the_dashboard_on_request_and_the_jobs_own_ray_variables_win(job):
    job_spec, environ = job(MA_RUN_METHOD="ray", MA_RUNTIME_RAY_DASHBOARD="on", RAY_USAGE_STATS_ENABLED="1")
    result = ray_plan(job_spec, environ)
    assert "--include-dashboard=true" in result.services[0].argv
    assert result.services[0].env == {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    assert result.workers[0].env["RAY_ADDRESS"] == "127.0.0.1:6379"
    assert "--node=127.0.0.1" in result.workers[0].argv


def test_ray_is_found_beside_the_commands_python_first():
    which = which_from("ray", beside={"/venv/bin": ("ray", "python")})
    assert ray_launcher.find_ray(["/venv/bin/python", "x.py"], {"PATH": "/usr/bin:/bin"}, which) == "/venv/bin/ray"
    assert ray_launcher.find_ray(["bash", "run.sh"], {"PATH": "/usr/bin:/bin"}, which) == RAY


def test_a_missing_ray_is_127_in_one_line(job, cli_env):
    with pytest.raises(CommandNotFound) as raised:
        ray_launcher.find_ray(["python3", "x.py"], {"PATH": "/nowhere:/not"}, which_from())
    assert raised.value.exit_code == ExitCode.COMMAND_NOT_FOUND == 127
    cli_env.update(MA_RUN_METHOD="ray", PATH="/usr/bin:/bin", MA_RUNTIME_PREFLIGHT="off")
    # The run stops there, in one line; the plan, which starts nothing, shows itself with the same as a warning.
    result = subprocess.run([MA_RUN, "--", "/usr/bin/python3", "x.py"], env=cli_env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 127, result.stderr
    assert "ray is not installed" in result.stderr and "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if "error,exiting" in line]) == 1
    planned = plan_cli(["--", "/usr/bin/python3", "x.py"], cli_env)
    assert planned.returncode == 0, planned.stderr
    assert "warning: MA_RUN_METHOD=ray, but ray is not installed" in planned.stdout
    assert "exit 127" in planned.stdout


def test_cli_plan_json_shows_the_head_and_the_joining_node(cli_env, tmp_path):
    fake = tmp_path / "fake-bin" / "ray"
    fake.write_text("#!/bin/sh\nexit 9\n")
    fake.chmod(0o755)
    cli_env.update(MA_RUN_METHOD="ray", MA_NUM_HOSTS="2", VC_WORKER_HOSTS="w0.j,w1.j")
    for index, expected in ((0, ["--head", "--port=6379"]), (1, ["--address=w0.j:6379"])):
        cli_env["VC_TASK_INDEX"] = str(index)
        result = plan_cli(["--json", "--", "python", "drive.py"], cli_env)
        assert result.returncode == 0, result.stderr
        (service,) = json.loads(result.stdout)["services"]
        assert service["argv"][:3] == [str(fake), "start", "--block"] and set(expected) <= set(service["argv"])


def test_the_rank_finder_sees_rays_task_workers_not_its_daemons_or_agents():
    t = Table()
    t.add(50, 1, "python", [PY, "-m", "ma_runtime.launch.ray_node", "keep", "--", "/venv/bin/ray", "start"])
    t.add(51, 50, "ray", [PY, "/venv/bin/ray", "start", "--head", "--block"])
    t.add(52, 51, "gcs_server", ["/venv/lib/ray/core/src/ray/gcs/gcs_server"])
    t.add(53, 51, "python", [PY, "-u", "/venv/lib/ray/_private/log_monitor.py"])
    t.add(54, 51, "raylet", ["/venv/lib/ray/core/src/ray/raylet/raylet"])
    t.add(60, 54, "ray::DashboardA", ["ray::DashboardAgent"])
    t.add(61, 54, "ray::RuntimeEnv", ["ray::RuntimeEnvAgent"])
    t.add(62, 54, "ray::IDLE", ["ray::IDLE"])
    t.add(63, 54, "ray::host", ["ray::host"])
    t.add(64, 63, "sh", ["sh", "-c", "true"])  # what a task runs is its unit
    t.add(100, 1, "python", [PY, "drive.py"])  # worker-0's driver, once the wait has become it

    assert t.find({"driver": 100}, services=[50]) == {100: (100, "pid 100 (python)"), 62: (62, "pid 62 (ray::IDLE)"),
                                                     63: (63, "pid 63 (ray::host)"), 64: (63, "pid 63 (ray::host)")}
    t.add(101, 1, "python", [PY, "-m", "ma_runtime.launch.ray_node", "await", "--", "python", "drive.py"])
    assert t.find({"driver": 101}) == {}  # the wait before the driver is the runtime's


def test_the_nodes_query_lines_and_the_missing_nodes():
    assert ray_node._nodes('["10.0.0.1", "10.0.0.2"]\n') == ["10.0.0.1", "10.0.0.2"]
    assert ray_node._nodes("2026 INFO worker.py -- Connecting\n") is None
    assert ray_node.missing(["localhost", "no-such-node.invalid"], ["127.0.0.1"]) == ["no-such-node.invalid"]


STAND_IN = """import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], "a").write("TERM\\n"), sys.exit(0)))
open(sys.argv[1], "a").write("up\\n")
time.sleep(int(sys.argv[2]))
sys.exit(5)
"""


def test_the_keeper_ends_with_the_code_of_a_ray_start_that_failed_at_once(tmp_path):
    marks = tmp_path / "marks"
    done = subprocess.run([sys.executable, "-m", ray_node.__name__, "keep", "--", sys.executable, "-c", STAND_IN,
                           str(marks), "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 5, done.stderr
    assert "`ray start` ended with code 5 before its node was up" in done.stderr


def test_the_keeper_passes_one_sigterm_to_ray_start_and_waits_for_it(tmp_path):
    marks = tmp_path / "marks"
    keeper = subprocess.Popen([sys.executable, "-m", ray_node.__name__, "keep", "--", sys.executable, "-c", STAND_IN,
                               str(marks), "600"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (marks.exists() and "up" in marks.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    keeper.send_signal(signal.SIGTERM)
    assert keeper.wait(30) == 0
    assert marks.read_text() == "up\nTERM\n"  # one SIGTERM, and the stand-in's end waited for
