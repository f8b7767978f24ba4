"""Every path the runtime puts into a launcher's words survives an MA_HOME with spaces, quotes, `$`, `;`, `%`, a
backslash and a newline (issue 24 item 7): each launcher's `ma-runtime plan --json`, black box, with such a home;
the words checked where a consumer splits them again (the shell of a one-word command, Open MPI's plm_rsh_args),
and the config files sshd and ssh read (launch/sshd_files.py) for the real sshd and ssh.

Each path must reach its consumer whole: in argv, env, logs and files, a word that holds part of the home holds
all of it; a word that is split again (plm_rsh_args) holds no character the splitter would take apart.
"""

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest

from ma_runtime import spec
from ma_runtime.errors import ConfigError
from ma_runtime.launch import registry, sshd, sshd_files
from ma_runtime.process import children
from ma_runtime.stages.ranktable import model as table_model
from tests.conftest import MA_RUNTIME, alive, free_port
from tests.recording import Log
from tests.unit.test_mpirun import _SBIN_PATH, login, needs_sshd, trust
from tests.unit.test_plan import TWO_BY_EIGHT, VJ, template_two

# What a shell, Open MPI and OpenSSH's config files each take apart (see launch/sshd_files.py).
HOSTILE = "my home $(touch pwned);\"q'\\b %d ${HOME}\nline two"
HOSTS = f"{VJ}-worker-0.{VJ},{VJ}-worker-1.{VJ}"
TWO_NODES = {"MA_NUM_HOSTS": "2", "MA_VJ_NAME": VJ, "VC_WORKER_HOSTS": HOSTS}
JOB_FILE = "inputs:\n  - {name: data_url, url: 'obs://bucket/data/'}\nhyperparameters:\n  note: a b\n"


@pytest.fixture
def hostile(job_env, tmp_path):
    """(base folder, environment): MA_HOME, the fake launchers and `python`, and the job file all under a folder
    named HOSTILE; a job with one input, so that a path is appended to the command."""
    base = tmp_path / HOSTILE
    folder = base / "bin"
    folder.mkdir(parents=True)
    for name in ("torchrun", "msrun", "mpirun", "ray", "python"):
        (folder / name).write_text("#!/bin/sh\nexit 0\n")
        (folder / name).chmod(0o755)
    (base / "job.yaml").write_text(JOB_FILE)
    (base / "dev").mkdir()
    env = {name: value for name, value in job_env.items() if not name.startswith(("MA_", "VC_", "RANK_", "TF_"))}
    env.update(MA_HOME=str(base / "home"), PATH=f"{folder}{os.pathsep}/usr/bin:/bin", MA_RUNTIME_CONFIG=str(base /
               "job.yaml"), MA_RUNTIME_PREFLIGHT_DEV_DIR=str(base / "dev"), MA_RUNTIME_PREFLIGHT_ACCELERATOR="none")
    return base, env


def rank_table(base: Path) -> dict:
    config = base / "config"
    config.mkdir()
    (config / table_model.FILE_NAME).write_text(json.dumps(template_two(TWO_BY_EIGHT)))
    return {"RANK_TABLE_FILE": str(config), **TWO_NODES, "MA_NUM_GPUS": "8", "VC_TASK_INDEX": "1",
            "MA_CURRENT_INSTANCE_NAME": f"{VJ}-worker-1"}


# Each launcher with the settings that bring paths into its words.
LAUNCHES = {
    "plain": lambda base: {},
    "torchrun": lambda base: {"MA_NUM_GPUS": "2"},
    "msrun": lambda base: {**rank_table(base), "MS_RANKTABLE_ENABLE": "True"},
    "rtf": lambda base: rank_table(base),
    "mpirun-worker-0": lambda base: {**TWO_NODES, "VC_TASK_INDEX": "0"},
    "mpirun-worker-1": lambda base: {**TWO_NODES, "VC_TASK_INDEX": "1"},
    "mpirun-one-node": lambda base: {},
    "pytorch-gpu": lambda base: TWO_NODES,
    "ray-worker-0": lambda base: {**TWO_NODES, "VC_TASK_INDEX": "0"},
    "ray-worker-1": lambda base: {**TWO_NODES, "VC_TASK_INDEX": "1"},
    "tensorflow-gpu": lambda base: {**TWO_NODES, "MA_TASK_NAME": "ps", "VC_TASK_INDEX": "0",
                                    "TF_PS_HOSTS": "[ps-0.job:5000,ps-1.job:5000]",
                                    "TF_WORKER_HOSTS": "[w-0.job:5001,w-1.job:5001]"},
}


def plan_json(env, command):
    done = subprocess.run([MA_RUNTIME, "plan", "--json", "--", *command], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def words_of(document):
    """(where, text) for every word, value and path of the plan's workers."""
    for worker in [*document["workers"], *document["services"]]:  # Ray's node is a service
        yield from ((f"{worker['name']} argv", word) for word in worker["argv"])
        yield from ((f"{worker['name']} env {name}", value) for name, value in worker["env"].items())
        yield from ((f"{worker['name']} log {kind}", path) for kind, path in worker["logs"].items())
        yield from ((f"{worker['name']} file", path) for path in worker["files"])
        if worker["cwd"]:
            yield f"{worker['name']} cwd", worker["cwd"]


def method_of(launch: str) -> str:
    return launch.split("-worker")[0].replace("-one-node", "")


def test_every_registered_launcher_has_its_case_here():
    assert {method_of(launch) for launch in LAUNCHES} == set(registry.METHODS)


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_every_path_in_each_launchers_plan_is_whole_with_a_hostile_home(hostile, launch):
    base, env = hostile
    env.update(MA_RUN_METHOD=method_of(launch), **LAUNCHES[launch](base))

    document = plan_json(env, ["python", "train.py"])
    # The names supervise/ranks.py knows its workers by (launch/base.py Launcher.WORKERS).
    assert all(registry.launcher(method_of(launch)).WORKERS.match(worker["name"]) for worker in document["workers"])

    found = 0
    for where, text in words_of(document):
        if "my home" in text or "line two" in text:  # a part of the home...
            assert str(base) in text, f"{where}: {text!r}"  # ...comes with all of it
            found += 1
    assert found, document  # the home's paths are there to check
    mpirun = next((w for w in document["workers"] if w["name"] == "mpirun"), None)
    if mpirun is not None and "plm_rsh_args" in mpirun["argv"]:
        # Open MPI splits it at every space, then puts it in double quotes in orted's remote shell command.
        words = mpirun["argv"][mpirun["argv"].index("plm_rsh_args") + 1].split(" ")
        assert words[:3] == ["-p", "36666", "-F"] and len(words) == 4, words
        assert sshd_files.is_plain(words[3]) and words[3].endswith("/ssh_config"), words


@pytest.mark.parametrize("launch", ["plain", "pytorch-gpu"])
def test_a_one_word_command_gets_the_hostile_paths_as_whole_arguments_from_a_real_shell(hostile, launch):
    base, env = hostile
    env.update(MA_RUN_METHOD=launch, **LAUNCHES[launch](base))

    (worker,) = plan_json(env, ["printf '[%s]\\n' first"])["workers"]
    shown = subprocess.run(worker["argv"], capture_output=True, text=True, timeout=10)

    data = f"--data_url={base}/home/modelarts/inputs/data_url_0"
    assert worker["argv"][:2] == ["/bin/sh", "-c"]
    assert f"[first]\n[{data}]\n[--note=a b]\n" in shown.stdout, shown
    assert not list(base.parent.rglob("pwned")) and not (Path.cwd() / "pwned").exists()


# --------------------------------------------------------------------------- sshd's and ssh's config files


@pytest.fixture
def hostile_node(tmp_path):
    """node(index) -> (JobSpec, environ) of an mpirun node whose MA_HOME is under a HOSTILE folder; every sshd and
    link made is removed afterwards."""
    started, links = [], []

    def make(index=0, **variables):
        environ = {"MA_HOME": str(tmp_path / HOSTILE / f"home-{index}"), "PATH": _SBIN_PATH, "MA_RUN_METHOD": "mpirun",
                   "MA_NUM_HOSTS": "2", "VC_TASK_INDEX": str(index), "VC_WORKER_HOSTS": "localhost,localhost",
                   "MY_SSHD_PORT": str(free_port())}
        environ.update({name: str(value) for name, value in variables.items()})
        job_spec = spec.load({}, environ)
        links.append(sshd_files.named_folder(job_spec))
        return job_spec, environ

    yield make, started
    for pid in started:
        if alive(pid):
            os.kill(pid, 9)
        children._SERVICES.discard(pid)
    for link in links:
        if link.is_symlink():
            link.unlink()


def start(job_spec, environ, started, log=None, client=True):
    before = set(children._SERVICES)
    try:
        sshd.start(job_spec, environ, log or Log(), threading.Event(), [], client=client, worker_0="localhost")
    finally:
        started.extend(set(children._SERVICES) - before)


@needs_sshd
def test_sshd_and_ssh_read_their_configs_whole_when_the_home_is_hostile(hostile_node):
    make, started = hostile_node
    job_spec, environ = make(0)
    home = Path(environ["MA_HOME"])
    trust(home, "id_ed25519", "id_ed25519.pub", "authorized_keys", "config")
    image = home / "etc" / "ssh" / "sshd_config"
    image.parent.mkdir(parents=True)
    image.write_text("ClientAliveInterval 60\n")

    start(job_spec, environ, started)

    named, real = sshd_files.named_folder(job_spec), sshd_files.folder(job_spec)
    assert named != real and sshd_files.is_plain(str(named)) and named.resolve() == real.resolve()
    for config in (real / "sshd_config", real / "ssh_config"):
        text = config.read_text()
        assert "my home" not in text and "line two" not in text, text  # only the plain name, comments included
    assert f"IdentityFile {named / 'ssh' / 'id_ed25519'}" in (real / "ssh_config").read_text()
    done = login(sshd_files.client_config(job_spec), job_spec.sshd_port)  # the word plm_rsh_args gives ssh
    assert done.stdout.strip() == "logged-in", done.stderr


@needs_sshd
def test_the_link_is_reused_by_the_next_run_and_a_foreign_one_is_78(hostile_node, tmp_path):
    make, started = hostile_node
    job_spec, environ = make(0)
    trust(Path(environ["MA_HOME"]), "id_ed25519", "authorized_keys")
    start(job_spec, environ, started)
    for pid in started:  # the first run's sshd is gone; the next run of the same job finds its own link
        os.kill(pid, 9)
        children._SERVICES.discard(pid)
    started.clear()
    start(job_spec, environ, started)
    assert started and sshd_files.named_folder(job_spec).is_symlink()

    named = sshd_files.named_folder(job_spec)
    named.unlink()
    named.symlink_to(tmp_path)  # another folder under the name: someone else's
    with pytest.raises(ConfigError) as raised:
        start(job_spec, environ, started)
    assert str(named) in str(raised.value) and "not this runtime's link" in str(raised.value)
    assert "remove" in raised.value.hint


def test_a_trust_file_whose_name_ssh_config_cannot_hold_is_left_out_with_a_warning():
    log = Log()
    kept = sshd_files.named_keys(["id_rsa", "id_my key", "authorized_keys"], log)
    assert kept == ["id_rsa", "authorized_keys"]
    (warned,) = log.fields("trust file not named in ssh_config: its name has characters ssh_config would take apart",
                           "warning")
    assert warned["name"] == "id_my key"


def test_a_plain_home_is_named_as_it_is():
    job_spec = spec.load({}, {"MA_HOME": "/home/ma-user", "MA_RUN_METHOD": "mpirun"})
    assert sshd_files.named_folder(job_spec) == sshd_files.folder(job_spec)
