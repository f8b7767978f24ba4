"""The hooks stage (issue 14): the pre-start hook (`.sh` sourced, `.py` through MA_HOOK_ENV_FILE), CANN's
set_env.sh and pip requirements, with real bash, real pip and real processes; what reaches the workers of every
attempt, failures (85), the timeout, a stop during a hook, once per pod."""

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.conftest import MA_RUN, alive, log_dir, run_ma, task_log, wait_for_file

# Each attempt writes what it sees of the hooks' variables to <SEEN>/attempt-<N>.json; attempt 1 fails with 5.
SHOW = ("import json, os, sys\n"
        "names = ['MULTI', 'GONE', 'FROM_PY', 'ASCEND_TOOLKIT_HOME', 'LD_LIBRARY_PATH', 'ORDER']\n"
        "seen = {n: os.environ.get(n) for n in names}\n"
        "seen['PATH0'] = os.environ['PATH'].split(':')[0]\n"
        "attempt = os.environ['MA_PROC_START_CNT']\n"
        "open(os.path.join(os.environ['SEEN'], 'attempt-' + attempt + '.json'), 'w').write(json.dumps(seen))\n"
        "sys.exit(5 if attempt == '1' and os.environ.get('FAIL_FIRST') else 0)\n")
MULTI = "first line\nsecond = line with 'quotes' and $dollar\n\n"


def hook_env(job_env, tmp_path, **settings):
    seen = tmp_path / "seen"
    seen.mkdir(exist_ok=True)
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "show.py").write_text(SHOW)
    return {**job_env, "SEEN": str(seen), "MA_RUNTIME_PREFLIGHT": "off", "MA_RUNTIME_RESTART_BACKOFF_SECONDS": "0",
            "GONE": "present before the hook", **{k: str(v) for k, v in settings.items()}}


def show(tmp_path):
    return [sys.executable, str(tmp_path / "code" / "show.py")]


def seen(env, attempt):
    return json.loads((Path(env["SEEN"]) / f"attempt-{attempt}.json").read_text())


def termination(env):
    return json.loads(next(log_dir(env).glob("*-termination.json")).read_text())


def write_hook(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


SH_HOOK = """echo "hook ran in $(pwd) with logs in $MA_LOG_DIR"
echo run >> "$COUNT"
export MULTI=$'first line\\nsecond = line with \\'quotes\\' and $dollar\\n\\n'
export PATH="/opt/from-the-hook/bin:$PATH"
unset GONE
export HOOK_API_TOKEN=hunter2-secret-value
exit 0
"""


def test_a_sourced_hook_reaches_every_attempt_exactly(job_env, tmp_path):
    env = hook_env(job_env, tmp_path, MA_RUNTIME_MAX_RESTARTS=1, FAIL_FIRST=1, COUNT=tmp_path / "count")
    write_hook(tmp_path / "code", "ma-pre-start.sh", SH_HOOK)
    done = run_ma(show(tmp_path), env)
    assert done.returncode == 0, done.stderr
    for attempt in (1, 2):
        view = seen(env, attempt)
        assert view["MULTI"] == MULTI  # a multi-line value with `=`, quotes and `$` survives whole
        assert view["PATH0"] == "/opt/from-the-hook/bin"
        assert view["GONE"] is None
    assert (tmp_path / "count").read_text() == "run\n"  # once for both attempts
    log = task_log(env).read_text()
    # Its output in the task log, prefixed; it sees the job's resolved settings, as the command does.
    assert f"[ma-pre-start] hook ran in {Path.cwd()} with logs in {log_dir(env)}" in log
    assert 'msg="pre-start script finished"' in log and "elapsed_s=" in log
    assert "hunter2-secret-value" not in log + done.stderr + done.stdout
    debug = json.loads(next(log_dir(env).glob("*-hook-env.json")).read_text())
    assert debug["pre_start"]["set"]["MULTI"] == MULTI and debug["pre_start"]["unset"] == ["GONE"]
    assert debug["pre_start"]["set"]["HOOK_API_TOKEN"] == "******"


def test_a_python_hook_passes_variables_through_the_env_file(job_env, tmp_path):
    env = hook_env(job_env, tmp_path)
    write_hook(tmp_path / "code", "ma-pre-start.py",
               "import os\n"
               "with open(os.environ['MA_HOOK_ENV_FILE'], 'a') as f:\n"
               "    f.write('FROM_PY=plain value = kept\\n# a comment\\n\\nMULTI<<EOF\\nline 1\\nline 2\\nEOF\\n')\n"
               "print('python hook ran')\n")
    done = run_ma(show(tmp_path), env)
    assert done.returncode == 0, done.stderr
    view = seen(env, 1)
    assert (view["FROM_PY"], view["MULTI"]) == ("plain value = kept", "line 1\nline 2")
    assert "[ma-pre-start] python hook ran" in done.stdout


def test_a_bad_env_file_line_stops_the_job_with_85(job_env, tmp_path):
    env = hook_env(job_env, tmp_path)
    write_hook(tmp_path / "code", "ma-pre-start.py",
               "import os\nopen(os.environ['MA_HOOK_ENV_FILE'], 'w').write('no equals sign here\\n')\n")
    done = run_ma(show(tmp_path), env)
    assert done.returncode == 85, done.stderr
    assert "MA_HOOK_ENV_FILE: line 1 is not NAME=value" in termination(env)["reason"]
    assert not (Path(env["SEEN"]) / "attempt-1.json").exists()


@pytest.mark.parametrize("write, error", [
    ("f = open(os.environ['MA_HOOK_ENV_FILE'], 'w'); f.write('A=' + 'x' * (2 << 20)); f.close()",
     "MA_HOOK_ENV_FILE: [Errno 27]"),
    ("p = os.environ['MA_HOOK_ENV_FILE']; os.unlink(p); os.mkfifo(p)", "MA_HOOK_ENV_FILE: "),
])
def test_an_env_file_too_big_or_replaced_by_a_fifo_is_refused(job_env, tmp_path, write, error):
    env = hook_env(job_env, tmp_path)
    write_hook(tmp_path / "code", "ma-pre-start.py", f"import os\n{write}\n")
    done = run_ma(show(tmp_path), env, timeout=30)
    assert done.returncode == 85, done.stderr
    assert error in termination(env)["reason"]


def test_a_failing_hook_stops_the_job_with_85_naming_it(job_env, tmp_path):
    env = hook_env(job_env, tmp_path)
    hook = write_hook(tmp_path / "code", "ma-pre-start.sh", "echo 'cannot update the RUN package' >&2\nreturn 3\n")
    done = run_ma(show(tmp_path), env)
    assert done.returncode == 85, done.stderr
    message = termination(env)
    assert (message["stage"], message["category"], message["hook_exit_code"]) == ("pre-start", "user", 3)
    assert message["reason"] == f"pre-start script {hook} failed: exit code 3"
    assert message["tail"] == ["cannot update the RUN package"]
    assert f"error,exiting: pre-start script {hook} failed: exit code 3" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (Path(env["SEEN"]) / "attempt-1.json").exists()  # the command never started


def test_a_hook_that_execs_cannot_hand_over_its_environment(job_env, tmp_path):
    env = hook_env(job_env, tmp_path)
    write_hook(tmp_path / "code", "ma-pre-start.sh", "exec true\n")
    done = run_ma(show(tmp_path), env)
    assert done.returncode == 85, done.stderr
    assert "must not exec" in termination(env)["reason"]


def test_a_hook_that_hangs_is_stopped_at_the_timeout(job_env, tmp_path):
    env = hook_env(job_env, tmp_path, MA_RUNTIME_HOOK_TIMEOUT_SECONDS=2, MA_RUNTIME_STOP_GRACE_SECONDS=1)
    pid_file = tmp_path / "hook.pid"
    write_hook(tmp_path / "code", "ma-pre-start.sh", f"echo $$ > {pid_file}\ntrap '' TERM\nsleep 300\n")
    started = time.monotonic()
    done = run_ma(show(tmp_path), env, timeout=60)
    assert done.returncode == 85, done.stderr
    assert time.monotonic() - started < 30
    assert "timed out after 2 s (MA_RUNTIME_HOOK_TIMEOUT_SECONDS)" in termination(env)["reason"]
    assert not alive(int(pid_file.read_text()))


def test_sigterm_during_the_hook_ends_the_run_at_once(job_env, tmp_path):
    env = hook_env(job_env, tmp_path)
    pid_file = tmp_path / "hook.pid"
    write_hook(tmp_path / "code", "ma-pre-start.sh", f"echo $$ > {pid_file}\nsleep 300\n")
    proc = subprocess.Popen([MA_RUN, *show(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    hook_pid = int(wait_for_file(pid_file).read_text() or wait_for_file(pid_file).read_text())
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM before the command started" in err
    assert not alive(hook_pid)


def test_one_hook_runs_next_to_the_boot_file_first_and_sh_before_py(job_env, tmp_path):
    env = hook_env(job_env, tmp_path)
    top = tmp_path / "top"  # the code directory (here: where the runtime starts)
    top.mkdir()
    write_hook(tmp_path / "code", "ma-pre-start.sh", 'export ORDER="sh next to the boot file, in $(pwd)"\n')
    write_hook(tmp_path / "code", "ma-pre-start.py", "raise SystemExit('must not run')\n")
    write_hook(top, "ma-pre-start.sh", "echo must not run; return 1\n")
    done = run_ma(show(tmp_path), env, cwd=top)
    assert done.returncode == 0, done.stderr
    assert seen(env, 1)["ORDER"] == f"sh next to the boot file, in {top}"  # run in the code directory
    ignored = [line for line in done.stderr.splitlines() if 'msg="pre-start hook not run: only one runs"' in line]
    assert [line.split(" path=")[1].split()[0] for line in ignored] == [
        f"{tmp_path}/code/ma-pre-start.py", f"{top}/ma-pre-start.sh"]


def test_without_a_boot_file_the_code_directorys_hook_runs(job_env, tmp_path):
    env = hook_env(job_env, tmp_path)
    top = tmp_path / "top"
    top.mkdir()
    write_hook(top, "ma-pre-start.py",
               "import os\nopen(os.environ['MA_HOOK_ENV_FILE'], 'w').write('ORDER=py at the top\\n')\n")
    run_show = f"import runpy; runpy.run_path('{tmp_path}/code/show.py')"
    done = run_ma(["sh", "-c", f'cd /; {sys.executable} -c "{run_show}"'], env, cwd=top)
    assert done.returncode == 0, done.stderr
    assert seen(env, 1)["ORDER"] == "py at the top"


def test_the_hook_runs_once_per_pod_and_a_later_runtime_applies_its_environment(job_env, tmp_path):
    env = hook_env(job_env, tmp_path, COUNT=tmp_path / "count")
    write_hook(tmp_path / "code", "ma-pre-start.sh", SH_HOOK)
    assert run_ma(show(tmp_path), env).returncode == 0
    again = run_ma(show(tmp_path), {**env, "MA_PROC_START_CNT": "2"})
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "count").read_text() == "run\n"
    assert seen(env, 2)["MULTI"] == MULTI and seen(env, 2)["GONE"] is None
    assert "pre-start script already ran in this pod" in again.stderr


@pytest.mark.parametrize("damage", [
    lambda kept: {**kept, "env": "not an environment"},
    lambda kept: {**kept, "env": {"set": {"MULTI": 1}, "unset": []}},
    lambda kept: {**kept, "env": {"set": {}}},
    lambda kept: [1, 2],
    lambda kept: "{not json",
])
def test_a_damaged_record_runs_the_hook_again(job_env, tmp_path, damage):
    env = hook_env(job_env, tmp_path, COUNT=tmp_path / "count")
    hook = write_hook(tmp_path / "code", "ma-pre-start.sh", SH_HOOK)
    assert run_ma(show(tmp_path), env).returncode == 0
    path = Path(env["MA_HOME"]) / "modelarts" / ".ma-runtime" / "pre-start.json"
    kept = json.loads(path.read_text())
    assert kept["file"] == str(hook) and oct(path.stat().st_mode & 0o777) == "0o600"
    damaged = damage(kept)
    path.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    again = run_ma(show(tmp_path), {**env, "MA_PROC_START_CNT": "2"})
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "count").read_text() == "run\nrun\n"
    assert seen(env, 2)["MULTI"] == MULTI


def test_what_the_hook_leaves_running_is_kept_through_the_attempts_and_ended_with_the_run(job_env, tmp_path):
    env = hook_env(job_env, tmp_path, MA_RUNTIME_MAX_RESTARTS=1, FAIL_FIRST=1)
    daemon_pid = tmp_path / "daemon.pid"
    # A daemon as sshd starts one: detached, output closed.
    write_hook(tmp_path / "code", "ma-pre-start.sh",
               f"setsid sh -c 'echo $$ > {daemon_pid}; exec sleep 300' </dev/null >/dev/null 2>&1 &\n"
               f"while [ ! -s {daemon_pid} ]; do sleep 0.05; done\n")
    done = run_ma(show(tmp_path), env)
    assert done.returncode == 0, done.stderr
    assert "the command left processes running" not in done.stderr  # not stopped as attempt 1's leftover
    assert "kept as the job's services" in done.stderr
    assert (Path(env["SEEN"]) / "attempt-2.json").exists()
    first_daemon = int(daemon_pid.read_text())
    assert not alive(first_daemon)  # ended with the run
    # A later runtime in the pod runs such a hook again: the service it started ended with the first runtime.
    daemon_pid.unlink()
    again = run_ma(show(tmp_path), {**env, "MA_PROC_START_CNT": "3"})
    assert again.returncode == 0, again.stderr
    assert "kept as the job's services" in again.stderr and int(daemon_pid.read_text()) != first_daemon


# -- CANN -----------------------------------------------------------------------------------------------------


def fake_toolkit(root: Path) -> Path:
    """A CANN install as its set_env.sh sees it: ascend-toolkit/latest, and the variables it exports."""
    latest = root / "Ascend" / "ascend-toolkit" / "latest"
    (latest / "lib64").mkdir(parents=True)
    script = root / "Ascend" / "ascend-toolkit" / "set_env.sh"
    script.write_text(
        'toolkit="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/latest"\n'
        'export ASCEND_TOOLKIT_HOME="$toolkit"\n'
        'export ASCEND_HOME_PATH="$toolkit"\n'
        'export LD_LIBRARY_PATH="$toolkit/lib64:${LD_LIBRARY_PATH}"\n'
        'export PATH="$toolkit/bin:$PATH"\n'
        'export ASCEND_OPP_PATH="$toolkit/opp"\n')
    return script


def test_cann_set_env_is_sourced_before_the_hook(job_env, tmp_path):
    script = fake_toolkit(tmp_path)
    env = hook_env(job_env, tmp_path, MA_RUNTIME_CANN_SET_ENV=script, LD_LIBRARY_PATH="/usr/lib/x")
    write_hook(tmp_path / "code", "ma-pre-start.sh", 'export ORDER="hook saw $ASCEND_TOOLKIT_HOME"\n')
    done = run_ma(show(tmp_path), env)
    assert done.returncode == 0, done.stderr
    latest = str(script.parent / "latest")
    view = seen(env, 1)
    assert (view["ASCEND_TOOLKIT_HOME"], view["LD_LIBRARY_PATH"]) == (latest, f"{latest}/lib64:/usr/lib/x")
    assert view["ORDER"] == f"hook saw {latest}"
    assert 'msg="CANN environment applied"' in done.stderr


def test_cann_is_found_in_the_usual_place_and_not_applied_twice(job_env, tmp_path):
    home = tmp_path / "user-home"
    script = fake_toolkit(home)
    latest = str(script.parent / "latest")
    env = hook_env(job_env, tmp_path, HOME=home, LD_LIBRARY_PATH="/usr/lib/x")
    assert run_ma(show(tmp_path), env).returncode == 0
    assert seen(env, 1)["LD_LIBRARY_PATH"] == f"{latest}/lib64:/usr/lib/x"  # ~/Ascend/ascend-toolkit (auto)
    applied = {**env, "ASCEND_TOOLKIT_HOME": latest, "LD_LIBRARY_PATH": f"{latest}/lib64:/usr/lib/x",
               "MA_PROC_START_CNT": "2"}
    done = run_ma(show(tmp_path), applied)
    assert done.returncode == 0, done.stderr
    assert seen(env, 2)["LD_LIBRARY_PATH"] == f"{latest}/lib64:/usr/lib/x"  # not prepended twice
    assert "CANN environment already applied; set_env.sh not sourced again" in done.stderr


def test_cann_off_and_a_missing_file(job_env, tmp_path):
    home = tmp_path / "user-home"
    fake_toolkit(home)
    env = hook_env(job_env, tmp_path, HOME=home, MA_RUNTIME_CANN_SET_ENV="off")
    assert run_ma(show(tmp_path), env).returncode == 0
    assert seen(env, 1)["ASCEND_TOOLKIT_HOME"] is None
    missing = run_ma(show(tmp_path), {**env, "MA_RUNTIME_CANN_SET_ENV": str(tmp_path / "nope.sh")})
    assert missing.returncode == 78
    assert f"MA_RUNTIME_CANN_SET_ENV={tmp_path}/nope.sh: no such file" in missing.stderr


def test_a_failing_set_env_stops_the_job(job_env, tmp_path):
    script = tmp_path / "set_env.sh"
    script.write_text("echo 'broken toolkit' >&2\nexit 4\n")
    env = hook_env(job_env, tmp_path, MA_RUNTIME_CANN_SET_ENV=script)
    done = run_ma(show(tmp_path), env)
    assert done.returncode == 85, done.stderr
    message = termination(env)
    assert (message["stage"], message["hook_exit_code"], message["tail"]) == ("cann", 4, ["broken toolkit"])


# -- pip ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def job_venv(tmp_path_factory):
    """The job's own interpreter, apart from the runtime's (with pip: ensurepip, offline)."""
    venv = tmp_path_factory.mktemp("job-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    return venv


def tiny_wheel(folder: Path, name: str) -> Path:
    """A pure-Python wheel made by hand: no build tools, no network."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    files = {f"{name}/__init__.py": "VALUE = 'installed from the local wheel'\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in files.items():
            wheel.writestr(member, text)
        wheel.writestr(f"{info}/RECORD", "".join(f"{member},,\n" for member in [*files, f"{info}/RECORD"]))
    return path


def test_requirements_are_installed_into_the_jobs_interpreter_once(job_env, tmp_path, job_venv):
    package = f"matiny{os.getpid()}"
    wheel = tiny_wheel(tmp_path, package)
    code = tmp_path / "code"
    code.mkdir()
    (code / "requirements.txt").write_text(f"--no-index\n{wheel}\n")
    python = str(job_venv / "bin" / "python")
    command = [python, "-c", f"import {package}; print({package}.VALUE)"]
    env = {**job_env, "MA_RUNTIME_PREFLIGHT": "off", "PIP_NO_INDEX": "1"}
    done = run_ma(command, env, timeout=180, cwd=code)
    assert done.returncode == 0, done.stderr
    assert "installed from the local wheel" in done.stdout
    assert f"[pip] Successfully installed {package}-1.0" in task_log(env).read_text()
    assert 'msg="pip requirements installed"' in done.stderr
    again = run_ma(command, {**env, "MA_PROC_START_CNT": "2"}, timeout=180, cwd=code)
    assert again.returncode == 0, again.stderr
    assert "pip requirements already installed in this pod; not installed again" in again.stderr
    assert subprocess.run([sys.executable, "-c", f"import {package}"], capture_output=True).returncode != 0


def test_a_bad_requirement_stops_the_job_and_off_skips_the_install(job_env, tmp_path, job_venv):
    code = tmp_path / "code"
    code.mkdir()
    (code / "pip-requirement.txt").write_text(f"--no-index\n{tmp_path}/missing-1.0-py3-none-any.whl\n")
    (code / "requirements.txt").write_text("must-not-be-read-when-pip-requirement-exists\n")
    command = [str(job_venv / "bin" / "python"), "-c", "print('ran')"]
    env = {**job_env, "MA_RUNTIME_PREFLIGHT": "off"}
    done = run_ma(command, env, timeout=180, cwd=code)
    assert done.returncode == 85, done.stderr
    message = termination(env)
    assert message["reason"] == "pip install -r pip-requirement.txt failed with exit code 1"
    assert message["stage"] == "pip" and message["tail"]
    assert "ran" not in done.stdout
    off = run_ma(command, {**env, "MA_RUNTIME_PIP_INSTALL": "off"}, timeout=60, cwd=code)
    assert off.returncode == 0 and off.stdout == "ran\n", off.stderr


@pytest.mark.parametrize("name, value", [
    ("MA_RUNTIME_HOOK_TIMEOUT_SECONDS", "0"), ("MA_RUNTIME_HOOK_TIMEOUT_SECONDS", "soon"),
    ("MA_RUNTIME_PIP_INSTALL", "maybe"), ("MA_RUNTIME_PRE_START", "sometimes"), ("MA_RUNTIME_CANN_SET_ENV", " "),
])
def test_bad_settings_are_one_line_and_78(job_env, tmp_path, name, value):
    done = run_ma(["true"], {**job_env, name: value})
    assert done.returncode == 78, done.stderr
    assert name in done.stderr and "Traceback" not in done.stderr
    assert len([line for line in done.stderr.splitlines() if "level=error" in line]) == 1


def test_an_unusable_state_folder_costs_the_record_not_the_job(job_env, tmp_path):
    env = hook_env(job_env, tmp_path, COUNT=tmp_path / "count")
    write_hook(tmp_path / "code", "ma-pre-start.sh", SH_HOOK)
    state = Path(env["MA_HOME"]) / "modelarts" / ".ma-runtime"
    state.parent.mkdir(parents=True)
    state.write_text("a file where the runtime keeps its records")
    done = run_ma(show(tmp_path), env)
    assert done.returncode == 0, done.stderr
    assert seen(env, 1)["MULTI"] == MULTI
    assert 'msg="could not record the pre-start script' in done.stderr


def test_a_hook_with_an_exit_trap_of_its_own_still_hands_over_its_environment(job_env, tmp_path):
    # A hook that cleans up after itself (`trap 'rm ...' EXIT`) replaces the runtime's trap: its exports must
    # still reach the command, and its own trap must still run when its shell ends.
    env = hook_env(job_env, tmp_path)
    scratch = tmp_path / "scratch"
    write_hook(tmp_path / "code", "ma-pre-start.sh",
               f"touch {scratch}\ntrap 'rm -f {scratch}' EXIT\nexport ORDER=trapped\n")
    done = run_ma(show(tmp_path), env)
    assert done.returncode == 0, done.stderr
    assert seen(env, 1)["ORDER"] == "trapped"
    assert not scratch.exists()


def test_a_hook_that_exits_after_replacing_the_exit_trap_is_told_why(job_env, tmp_path):
    env = hook_env(job_env, tmp_path)
    write_hook(tmp_path / "code", "ma-pre-start.sh", "trap 'echo bye' EXIT\nexport ORDER=x\nexit 0\n")
    done = run_ma(show(tmp_path), env)
    assert done.returncode == 85, done.stderr
    assert "EXIT trap of its own" in termination(env)["reason"]
