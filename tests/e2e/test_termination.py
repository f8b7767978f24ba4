"""The termination message: written on failure, to the log dir always and to k8s' file if mounted."""

import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import ACTOR, MA_RUN, log_dir, run_ma, wait_for_file

TERMINATION = "modelarts-job-local-worker-0-termination.json"
FIELDS = {"time", "run_id", "stage", "category", "exit_code", "signal", "rank", "reason", "hint", "tail"}


def message(env):
    return json.loads((log_dir(env) / TERMINATION).read_text())


def test_failure_writes_the_message_with_the_last_lines(job_env):
    script = "import sys\nfor i in range(50): print(f'out {i}')\nprint('Traceback: boom', file=sys.stderr)\nsys.exit(3)"
    assert run_ma([sys.executable, "-c", script], job_env).returncode == 3
    written = message(job_env)
    assert set(written) == FIELDS | {"attempt"}  # once the command started: which start it was
    assert written["attempt"] == 1
    assert written["exit_code"] == 3 and written["stage"] == "supervise" and written["category"] == "user"
    assert "code 3" in written["reason"]
    assert written["tail"] == ["Traceback: boom"]


def test_signal_death_names_the_signal(job_env):
    assert run_ma(["sh", "-c", "kill -SEGV $$"], job_env).returncode == 139
    written = message(job_env)
    assert written["signal"] == "SIGSEGV" and written["exit_code"] == 139


def test_success_writes_no_message(job_env):
    assert run_ma(["true"], job_env).returncode == 0
    assert not (log_dir(job_env) / TERMINATION).exists()


def test_runtime_failure_writes_its_stage_and_code(job_env):
    assert run_ma(["no-such-program-xyz"], job_env).returncode == 127
    written = message(job_env)
    assert written["stage"] == "launch" and written["exit_code"] == 127 and "not found" in written["reason"]


def test_kubernetes_file_is_written_when_present_and_never_created(tmp_path, job_env):
    k8s = tmp_path / "termination-log"
    job_env["MA_RUNTIME_TERMINATION_LOG"] = str(k8s)
    run_ma(["false"], job_env)
    assert not k8s.exists(), "the runtime must not create the termination-log file"
    k8s.write_text("")
    run_ma(["false"], job_env)
    assert json.loads(k8s.read_text())["exit_code"] == 1


def test_a_reason_the_command_wrote_first_is_kept(tmp_path, job_env):
    k8s = tmp_path / "termination-log"
    k8s.write_text("")
    job_env["MA_RUNTIME_TERMINATION_LOG"] = str(k8s)
    assert run_ma(["sh", "-c", f"echo 'CUDA out of memory' > {k8s}; exit 2"], job_env).returncode == 2
    assert k8s.read_text() == "CUDA out of memory\n"
    assert message(job_env)["exit_code"] == 2


def test_message_fits_the_kubernetes_limit(tmp_path, job_env):
    k8s = tmp_path / "termination-log"
    k8s.write_text("")
    job_env["MA_RUNTIME_TERMINATION_LOG"] = str(k8s)
    script = "import sys\nfor i in range(100): print('x' * 3000, file=sys.stderr)\nsys.exit(1)"
    run_ma([sys.executable, "-c", script], job_env)
    assert len(k8s.read_bytes()) <= 4096
    assert json.loads(k8s.read_text())["exit_code"] == 1


def start_actor(tmp_path, env, scenario):
    workdir = tmp_path / "actor"
    workdir.mkdir()
    proc = subprocess.Popen([MA_RUN, sys.executable, ACTOR, scenario, str(workdir)], env=env)
    wait_for_file(workdir / "ready")
    return proc


def test_sigterm_stop_is_recorded(tmp_path, job_env):
    job_env["MA_RUNTIME_STOP_GRACE_SECONDS"] = "0.5"
    proc = start_actor(tmp_path, job_env, "ignore-term")
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(15) == 143
    written = message(job_env)
    assert written["signal"] == "SIGTERM" and written["category"] == "platform"
    assert "grace period" in written["reason"]


def test_second_sigint_kills_at_once(tmp_path, job_env):
    job_env["MA_RUNTIME_STOP_GRACE_SECONDS"] = "60"
    proc = start_actor(tmp_path, job_env, "ignore-stop")
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.3)
    assert proc.poll() is None, "one SIGINT must wait out the grace period"
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(15) == 128 + signal.SIGINT  # long before the 60 s grace


def test_config_error_reaches_an_existing_kubernetes_file(tmp_path, job_env):
    k8s = tmp_path / "termination-log"
    k8s.write_text("")
    job_env["MA_RUNTIME_TERMINATION_LOG"] = str(k8s)
    job_env["MA_NUM_GPUS"] = "many"
    assert run_ma(["true"], job_env).returncode == 78
    written = json.loads(k8s.read_text())
    assert written["exit_code"] == 78 and written["stage"] == "spec" and "MA_NUM_GPUS" in written["reason"]
