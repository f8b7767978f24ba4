"""The images' ENTRYPOINT shim (entrypoints/ma-runtime-entrypoint), run on the host.

A fake venv stands in for the runtime's: its `bin/python` is a sh script that prints its pid, its arguments
and the variables the shim decides. Each rule of the shim has a test here that fails when the rule is taken
out. The HOME and USER rules depend on the uid and on /home/ma-user: those tests run the shim as another uid
(setpriv) in a mount namespace with a tmpfs on /home, so they need root.
"""

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import _JOB_VARIABLES

SHIM = Path(__file__).resolve().parents[2] / "entrypoints" / "ma-runtime-entrypoint"
NO_ENTRY_UID = 4242  # a uid without a passwd entry, as the platform's custom uids and runAsUser give
SHOWN = ("HOME", "USER", "LOGNAME", "PATH", "PYTHONPATH", "PYTHONHOME")
FAKE_PYTHON = """#!/bin/sh
printf 'pid=%s\\n' "$$"
for arg; do printf 'arg=%s\\n' "$arg"; done
for name in {names}; do
    eval "value=\\${{$name-<unset>}}"
    printf '%s=%s\\n' "$name" "$value"
done
if [ -w "$HOME" ]; then echo home_writable=yes; fi
printf 'home_mode=%s\\n' "$(stat -c '%a %u' "$HOME" 2>/dev/null)"
""".format(names=" ".join(SHOWN))


class Shown:
    """What the fake python printed: its pid, its arguments, the variables (None: unset)."""

    def __init__(self, stdout: str):
        self.args = []
        self.values = {}
        for line in stdout.splitlines():
            key, _, value = line.partition("=")
            if key == "arg":
                self.args.append(value)
            else:
                self.values[key] = None if value == "<unset>" else value

    def __getitem__(self, name):
        return self.values[name]


@pytest.fixture
def fake_venv():
    """A venv whose python prints what it got; in a folder any uid may read (pytest's tmp_path is root's)."""
    folder = Path(tempfile.mkdtemp(prefix="ma-entrypoint-", dir="/tmp"))
    try:
        os.chmod(folder, 0o755)
        python = folder / "venv" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(FAKE_PYTHON)
        python.chmod(0o755)
        yield folder / "venv"
    finally:
        shutil.rmtree(folder)


def host_env(venv, **changes):
    """The shim's environment: HOME and TMPDIR in the fake venv's folder (removed after the test), so that no
    private home lands in the machine's /tmp; a change to None unsets the variable."""
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES and k not in SHOWN}
    folder = str(Path(venv).parent)
    env.update(PATH="/usr/local/bin:/usr/bin:/bin", MA_RUNTIME_VENV=str(venv), HOME=folder, TMPDIR=folder)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_shim(argv, env, timeout=30):
    proc = subprocess.Popen([str(SHIM), *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=timeout)
    return proc, out, err


def test_the_command_reaches_the_runtime_isolated_and_unchanged(fake_venv):
    argv = ["python", "train.py", "--lr", "0.1", "two words", "", "--", "-x", "$HOME"]
    proc, out, err = run_shim(argv, host_env(fake_venv))
    assert proc.returncode == 0, err
    assert Shown(out).args == ["-I", "-m", "ma_runtime", "run", "--", *argv]


def test_the_runtime_replaces_the_shim(fake_venv):
    """exec: the runtime is the process the platform started (PID 1 in a container), not a child of sh."""
    proc, out, err = run_shim(["true"], host_env(fake_venv))
    assert Shown(out)["pid"] == str(proc.pid)


def test_the_runtime_venv_stays_off_path_and_the_jobs_python_variables_pass_on(fake_venv):
    env = host_env(fake_venv, PYTHONPATH="/job/lib", PYTHONHOME="/opt/conda")
    proc, out, err = run_shim(["true"], env)
    shown = Shown(out)
    assert shown["PATH"] == env["PATH"]
    assert str(fake_venv) not in shown["PATH"]
    # The job needs them: -I keeps them from the runtime's interpreter only.
    assert (shown["PYTHONPATH"], shown["PYTHONHOME"]) == ("/job/lib", "/opt/conda")


@pytest.mark.parametrize("venv", ["/nonexistent/venv", "empty"])
def test_a_missing_runtime_is_one_line_and_127(fake_venv, venv):
    if venv == "empty":
        venv = str(fake_venv.parent / "empty")
        os.mkdir(venv)
    proc, out, err = run_shim(["true"], host_env(fake_venv, MA_RUNTIME_VENV=venv))
    assert proc.returncode == 127
    assert out == ""
    assert err.count("\n") == 1, err
    assert f"no ma-runtime at {venv}/bin/python" in err and "MA_RUNTIME_VENV" in err


def test_the_real_runtime_starts_with_a_hostile_pythonpath(tmp_path):
    """-I with `-m ma_runtime`, on the real runtime: a yaml.py and a sitecustomize.py on the job's PYTHONPATH,
    which would end any interpreter that read them, reach the command and not the runtime."""
    poison = tmp_path / "poison"
    poison.mkdir()
    for name in ("structlog.py", "yaml.py", "sitecustomize.py"):
        (poison / name).write_text("raise SystemExit(99)\n")
    venv = Path(sys.executable).parent.parent
    env = host_env(venv, PYTHONPATH=str(poison), HOME=str(tmp_path), TMPDIR=str(tmp_path),
                   MA_HOME=str(tmp_path / "home"), MA_RUNTIME_TERMINATION_LOG=str(tmp_path / "absent"),
                   MA_RUNTIME_PREFLIGHT="off")
    proc, out, err = run_shim(["sh", "-c", 'echo "job sees $PYTHONPATH"; exit 7'], env, timeout=60)
    assert proc.returncode == 7, err
    assert f"job sees {poison}" in out


# -- HOME and USER: another uid, and a /home/ma-user of the test's making ----------------------------------


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")),
    reason="needs root, unshare and setpriv (another uid, a tmpfs on /home)")


@pytest.fixture
def as_uid(fake_venv):
    """as_uid(uid, env, ma_user_home=...) runs the shim as `uid` with /home/ma-user 'owned' by that uid,
    'root' (read-only for the uid) or 'absent'."""

    def run(uid, env, ma_user_home="owned"):
        setup = ["mount -t tmpfs -o mode=0755 tmpfs /home"]
        if ma_user_home != "absent":
            setup.append("mkdir /home/ma-user")
            setup.append(f"chown {uid if ma_user_home == 'owned' else 0} /home/ma-user")
        script = " && ".join(setup) + f' && exec setpriv --reuid={uid} --regid={uid} --clear-groups "$@"'
        proc = subprocess.run(["unshare", "--mount", "sh", "-c", script, "sh", str(SHIM), "true"], env=env,
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return Shown(proc.stdout)

    assert subprocess.run(["getent", "passwd", str(NO_ENTRY_UID)], capture_output=True).returncode != 0, \
        f"uid {NO_ENTRY_UID} has a passwd entry on this machine; the tests need one without"
    return run


@pytest.fixture
def private_tmp():
    """TMPDIR for the shim's private homes, so that the test can look at them and remove them."""
    folder = tempfile.mkdtemp(prefix="ma-entrypoint-tmp-", dir="/tmp")
    os.chmod(folder, 0o1777)
    yield folder
    shutil.rmtree(folder)


@needs_root
@pytest.mark.root
@pytest.mark.parametrize("home", [None, "", "/", "/nonexistent", "/root"])
def test_an_unusable_home_becomes_ma_user_home(as_uid, fake_venv, home):
    shown = as_uid(NO_ENTRY_UID, host_env(fake_venv, HOME=home))
    assert shown["HOME"] == "/home/ma-user"
    assert shown["home_writable"] == "yes"


@needs_root
@pytest.mark.root
def test_root_with_home_slash_gets_ma_user_home(as_uid, fake_venv):
    """/ is writable for root, and still no home: files would land at the top of the image."""
    shown = as_uid(0, host_env(fake_venv, HOME="/"))
    assert shown["HOME"] == "/home/ma-user"


@needs_root
@pytest.mark.root
def test_a_writable_home_is_kept(as_uid, fake_venv, private_tmp):
    own = Path(private_tmp) / "own-home"
    own.mkdir()
    os.chown(own, NO_ENTRY_UID, NO_ENTRY_UID)
    shown = as_uid(NO_ENTRY_UID, host_env(fake_venv, HOME=str(own)))
    assert shown["HOME"] == str(own)


@needs_root
@pytest.mark.root
@pytest.mark.parametrize("ma_user_home", ["root", "absent"])
def test_without_a_writable_ma_user_home_the_home_is_private(as_uid, fake_venv, private_tmp, ma_user_home):
    shown = as_uid(NO_ENTRY_UID, host_env(fake_venv, HOME="/", TMPDIR=private_tmp), ma_user_home=ma_user_home)
    home = Path(shown["HOME"])
    assert home.parent == Path(private_tmp) and home.name.startswith("ma-home.")
    # Only this uid may write there: nobody else can plant a .bashrc or a pip config in it.
    assert shown["home_mode"] == f"700 {NO_ENTRY_UID}"
    assert stat.S_IMODE(home.stat().st_mode) == 0o700


@needs_root
@pytest.mark.root
def test_a_uid_without_a_passwd_entry_gets_user_and_logname(as_uid, fake_venv):
    shown = as_uid(NO_ENTRY_UID, host_env(fake_venv))
    assert (shown["USER"], shown["LOGNAME"]) == (str(NO_ENTRY_UID), str(NO_ENTRY_UID))


@needs_root
@pytest.mark.root
def test_a_name_the_platform_gave_is_kept(as_uid, fake_venv):
    shown = as_uid(NO_ENTRY_UID, host_env(fake_venv, USER="ma-user"))
    assert (shown["USER"], shown["LOGNAME"]) == ("ma-user", str(NO_ENTRY_UID))


@needs_root
@pytest.mark.root
def test_a_uid_with_a_passwd_entry_is_left_to_it(as_uid, fake_venv):
    nobody = int(subprocess.run(["id", "-u", "nobody"], capture_output=True, text=True, check=True).stdout)
    shown = as_uid(nobody, host_env(fake_venv))
    assert (shown["USER"], shown["LOGNAME"]) == (None, None)
