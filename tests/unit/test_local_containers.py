"""`ma-runtime local --image`: what each node's container is given (the podman command line, its variables)."""

import shutil

import pytest

from ma_runtime.local import containers, runner
from ma_runtime.local.nodes import Nodes


@pytest.fixture
def local_run(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("HOME", "/root")
    monkeypatch.setenv("PYTHONPATH", "/here/src")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    monkeypatch.setenv("MA_RUNTIME_MAX_RESTARTS", "1")
    monkeypatch.setenv("WORK", "30")
    options = runner.Options(["--nodes", "2", "--image", "my-train:1", "--accelerator", "npu", "--devices", "2",
                              "--", "python", "train.py"])
    run = runner.LocalRun(options, runner.Console())
    yield run
    shutil.rmtree(run.scratch, ignore_errors=True)


def test_a_container_gets_your_variables_but_those_of_this_machine(local_run):
    env = local_run.image_environment(1, "http://10.200.0.254:9000", "/opt/job-venv/bin:/usr/bin:/bin")
    assert env["WORK"] == "30" and env["MA_RUNTIME_MAX_RESTARTS"] == "1"
    for name in ("HOME", "LC_ALL"):
        assert name not in env
    # The box's paths as the container sees them: the fake tools before the image's PATH, not this machine's.
    assert env["PATH"] == "/opt/ma-local/fakes:/opt/job-venv/bin:/usr/bin:/bin"
    assert env["PYTHONPATH"] == "/opt/ma-local/site" and env["MA_LOCAL_FAULTS_DIR"] == "/opt/ma-local/faults"
    assert env["RANK_TABLE_FILE"] == "/user/config" and env["MA_RUNTIME_PREFLIGHT_DEV_DIR"] == "/opt/ma-local/dev"
    assert env["VC_TASK_INDEX"] == "1" and env["MA_S3_ENDPOINT"] == "http://10.200.0.254:9000"


def test_the_podman_command_line_holds_no_value_of_any_variable(local_run):
    env = local_run.image_environment(0, "http://10.200.0.254:9000", "/usr/bin:/bin")
    argv = containers.Containers("my-train:1", Nodes(2, prefix="ma-unit")).argv(
        0, env, [containers.Mount(local_run.scratch, "/home/ma-user/modelarts")], ["python", "train.py"])
    passed = [argv[at + 1] for at, word in enumerate(argv) if word == "--env"]
    # PATH alone by value (podman needs this machine's PATH in its own environment), the rest by name.
    assert f"PATH={env['PATH']}" in passed
    names = [name for name in passed if not name.startswith("PATH=")]
    assert sorted(names) == sorted(set(env) - {"PATH"}) and all("=" not in name for name in names)
    assert env["OBS_SECRET_ACCESS_KEY"] not in " ".join(argv)
    # The image's entrypoint runs the command: the command comes last, after the image, as its arguments.
    assert argv[-3:] == ["my-train:1", "python", "train.py"]
    assert argv[argv.index("--user") + 1] == "1000:100"
    assert argv[argv.index("--network") + 1].startswith("ns:/run/netns/ma-unit-")


@pytest.mark.parametrize("image", ["--privileged", "-v/:/host", "my train:1", "", "a\nb"])
def test_an_image_podman_would_read_as_an_option_is_refused(image):
    with pytest.raises(runner.UsageError, match=r"^--image .*: not an image name \(write NAME\[:TAG\]"):
        runner.Options([f"--image={image}", "--", "true"])


def test_image_references_as_registries_write_them_are_taken():
    for image in ("my-train:1", "localhost/ma-runtime-test:86ecb818", "swr.cn-north-4.myhuaweicloud.com/ns/img:v1",
                  "img@sha256:" + "a" * 64):
        assert runner.Options(["--image", image, "--", "true"]).image == image
