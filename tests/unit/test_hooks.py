"""The hooks stage's pure parts: the environment's difference, the env file, the boot file, the job's python."""

import os
import sys
from pathlib import Path

import pytest

from ma_runtime import spec
from ma_runtime.process import lifecycle
from ma_runtime.stages.hooks import pip
from ma_runtime.stages.hooks.env import Env, diff, job_python, parse_env_file
from ma_runtime.stages.hooks.pre_start import boot_file


def test_the_difference_is_what_changed_and_what_went_but_not_the_shells_own():
    before = {"A": "1", "B": "2", "GONE": "x", "SHLVL": "1", "_": "/bin/a", "PWD": "/a"}
    after = {"A": "1", "B": "3", "NEW": "line\nline", "SHLVL": "2", "_": "/bin/b", "PWD": "/b", "OLDPWD": "/a"}
    assert diff(before, after) == Env({"B": "3", "NEW": "line\nline"}, frozenset({"GONE"}))


def test_env_applies_and_composes():
    cann = Env({"LD_LIBRARY_PATH": "/cann/lib", "X": "1"}, frozenset({"Y"}))
    hook = Env({"Y": "again"}, frozenset({"X"}))
    total = cann.then(hook)
    assert total == Env({"LD_LIBRARY_PATH": "/cann/lib", "Y": "again"}, frozenset({"X"}))
    assert total.apply({"X": "0", "Y": "0", "Z": "kept"}) == {"Y": "again", "Z": "kept", "LD_LIBRARY_PATH": "/cann/lib"}
    assert not Env() and Env.from_json(total.to_json()) == total


def test_env_file_lines():
    text = "A=1\n\n# comment\nB= spaced = value \nMULTI<<END\nx=1\n\nEND\nC=\n"
    assert parse_env_file(text) == {"A": "1", "B": " spaced = value ", "MULTI": "x=1\n", "C": ""}


@pytest.mark.parametrize("text, error", [
    ("just words\n", "line 1 is not NAME=value"),
    ("1BAD=x\n", "line 1: what comes before `=` or `<<` is not a variable name"),
    ("TOKEN s3cret<<END\nx\nEND\n", "line 1: what comes before `=` or `<<` is not a variable name"),
    ("A<<END\nno end\n", "line 1: no closing 'END'"),
    ("A<<\n", "line 1: `NAME<<` needs a delimiter"),
])
def test_bad_env_file_lines_say_which(text, error):
    with pytest.raises(ValueError, match=error.replace("(", r"\(")):
        parse_env_file(text)


def test_the_boot_file_is_the_first_argument_naming_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("train.py", "run.sh", "8"):
        (tmp_path / name).write_text("")
    os.mkdir(tmp_path / "folder")
    assert boot_file(["python", "-u", "folder", "train.py"]) == tmp_path / "train.py"
    assert boot_file(["torchrun", "--nproc_per_node", "8", "train.py"]) == tmp_path / "train.py"  # `8` is an option's
    assert boot_file([f"{sys.executable}", "-c", "pass"]) == Path(sys.executable)
    assert boot_file(["./run.sh"]) == tmp_path / "run.sh"
    assert boot_file(["OMP_NUM_THREADS=1 python train.py | tee log"]) is None  # `tee log`: log is no file here
    assert boot_file(["cd /; OMP_NUM_THREADS=1 python " + str(tmp_path / "train.py")]) == tmp_path / "train.py"
    assert boot_file(["python", "-m", "pkg.train"]) is None


def test_the_jobs_python(tmp_path):
    conda = tmp_path / "conda" / "envs" / "py39" / "bin"
    conda.mkdir(parents=True)
    (conda / "python").write_text("#!/bin/sh\n")
    (conda / "python").chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python3", "python3.9"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    path = {"PATH": str(bin_dir)}
    assert job_python({**path, "ANACONDA_DIR": str(tmp_path / "conda"), "DEFAULT_CONDA_ENV_NAME": "py39"},
                      ["python", "x.py"]) == str(conda / "python")
    assert job_python(path, ["python3.9", "x.py"]) == str(bin_dir / "python3.9")
    assert job_python(path, ["bash", "run.sh"]) == str(bin_dir / "python3")
    assert job_python({"PATH": str(tmp_path / "none")}, ["bash"]) is None


def _index_options(environ, tmp_path, config_file=None):
    return pip._index_options(spec.load({}, {"MA_HOME": str(tmp_path), **environ}, config_file), environ)


def test_the_index_is_the_platforms_unless_the_job_chose_one(tmp_path):
    assert _index_options({"MA_PIP_URL": "http://repo/simple/", "MA_PIP_HOST": "repo"}, tmp_path) == [
        "--index-url", "http://repo/simple/", "--trusted-host", "repo"]
    assert _index_options({"MA_PIP_URL": "http://repo/simple/", "PIP_INDEX_URL": "https://mine/"}, tmp_path) == []
    assert _index_options({}, tmp_path) == []


def test_the_platforms_index_is_a_setting_a_job_file_may_give(tmp_path):
    # MA_PIP_URL was read raw from the environment: a job file's hooks.pip_url was an unknown key.
    job = tmp_path / "job.yaml"
    job.write_text("hooks:\n  pip_url: http://file-repo/simple/\n  pip_host: file-repo\n")
    assert _index_options({}, tmp_path, str(job)) == ["--index-url", "http://file-repo/simple/",
                                                       "--trusted-host", "file-repo"]
    assert _index_options({"MA_PIP_URL": "http://env-repo/"}, tmp_path, str(job))[:2] == ["--index-url",
                                                                                          "http://env-repo/"]


def test_a_bad_line_is_not_repeated_since_it_may_hold_a_secret():
    with pytest.raises(ValueError) as caught:
        parse_env_file("API_TOKEN s3cretvalue\n")
    assert str(caught.value) == "line 1 is not NAME=value (no `=`)"


def test_a_nul_in_a_value_is_refused_by_line():
    with pytest.raises(ValueError, match="line 2: the value of B holds a NUL byte"):
        parse_env_file("A=1\nB=x\0y\n")


def test_a_hooks_end_is_waited_for_without_polling(monkeypatch):
    # Popen.wait(timeout) sleeps up to 50 ms between looks: every hook's end would wait that out.
    import subprocess
    import time

    proc = subprocess.Popen(["sleep", "0.05"])

    def no_sleeping(_seconds):
        raise AssertionError("polled")

    monkeypatch.setattr(time, "sleep", no_sleeping)
    assert lifecycle.wait(proc, 30) == 0


def test_waiting_for_a_hook_gives_up_at_the_timeout():
    import subprocess

    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert lifecycle.wait(proc, 0.1) is None
    finally:
        proc.kill()
        proc.wait()
