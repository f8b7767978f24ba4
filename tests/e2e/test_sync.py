"""Output and log sync end to end (issue 12): a real trainer under `ma-run`, the real uploader process,
the real OBS SDK against moto, checked from outside with boto3.

What a checkpoint looks like in the bucket is checked by its content, not by trusting the runtime's
events: every file tests/e2e/jobs/sync_trainer.py writes ends with the sha256 of what comes before it,
and every completion marker lists the sha256 of each file of its folder. So a torn upload, or a marker
that reached the bucket before its folder, shows in the bucket itself, also in the samples the test takes
while the job runs.

The fault cases (a slow, refusing or denying endpoint, a runtime SIGKILLed mid-multipart) are in
test_sync_faults.py.
"""

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import MA_RUN, ROOT, alive, child_pids, log_dir, task_log
from tests.e2e.test_launchers import WRITERS, npu_job
from tests.e2e.test_transfer_faults import FaultProxy

JOBS = ROOT / "tests" / "e2e" / "jobs"
TRAINER = str(JOBS / "sync_trainer.py")
HOSTILE = str(JOBS / "sync_hostile.py")
TERMINATION = "modelarts-job-local-worker-0-termination.json"
MARKER_ROOT = "latest_checkpointed_iteration.txt"
UPLOADER = b"ma_runtime.sync.uploader"
DIED = "output and log upload process exited; files will no longer be synced"


# --------------------------------------------------------------------------- the job and its processes


def sync_env(job_env, tmp_path, endpoint=None, **settings):
    """A job environment with fast sync cycles, the control dir the trainer watches, and the endpoint's settings."""
    control = tmp_path / "control"
    control.mkdir(exist_ok=True)
    env = {**job_env, "MA_RUNTIME_PREFLIGHT": "off", "MA_RUNTIME_SYNC_INTERVAL_SECONDS": "0.3",
           "MA_RUNTIME_LOG_SYNC_INTERVAL_SECONDS": "0.5", "MA_RUNTIME_STORAGE_RETRY_SECONDS": "5",
           "SYNC_CONTROL": str(control)}
    if endpoint is not None:
        env.update(endpoint.env("v4"))
    env.update({name: str(value) for name, value in settings.items()})
    return env


def job_file(tmp_path, outputs=(), log_url=None, name="job.yaml"):
    """outputs: (name, url, {extra keys}) triples."""
    job = {"outputs": [{"name": channel, "url": url, **extra} for channel, url, extra in outputs]}
    if log_url is not None:
        job["log_url"] = log_url
    path = tmp_path / name
    path.write_text(json.dumps(job))
    return str(path)


def output_dir(env, name="train_url", index=0) -> Path:
    """The channel's local dir; `index`: its place in the job file's `outputs`."""
    return Path(env["MA_HOME"]) / "modelarts" / "outputs" / f"{name}_{index}"


def control(env, name) -> Path:
    return Path(env["SYNC_CONTROL"]) / name


class Run:
    """`ma-run ARGS` as a real process, its output in files (a pipe nobody reads would stall it)."""

    def __init__(self, args, env, tmp_path, name="run", prefix=()):
        self.stdout_path, self.stderr_path = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen([*prefix, MA_RUN, *args], env=env, stdout=out, stderr=err)
        self.started = time.monotonic()

    @property
    def pid(self):
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout=90) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"ma-run still ran after {timeout} s; stderr:\n{self.stderr[-3000:]}") from None

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def wait_for_text(run, text, timeout=30.0):
    deadline = time.monotonic() + timeout
    while text not in run.stderr:
        assert run.running() and time.monotonic() < deadline, f"no {text} in:\n{run.stderr[-3000:]}"
        time.sleep(0.05)


def run_job(args, env, tmp_path, timeout=90, **kwargs):
    """Runs `ma-run ARGS` to its end: (exit code, the Run)."""
    run = Run(args, env, tmp_path, **kwargs)
    return run.wait(timeout), run


def family(env):
    """Living processes started for this job (their environment holds its MA_HOME), runtime included."""
    wanted = b"\0MA_HOME=" + env["MA_HOME"].encode() + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = b"\0" + Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if wanted in environ and alive(int(entry)):
            found.append(int(entry))
    return found


def wait_until_gone(env, timeout=10.0):
    deadline = time.monotonic() + timeout
    while family(env):
        if time.monotonic() > deadline:
            raise AssertionError(f"processes of the job outlived the runtime: {_commands(family(env))}")
        time.sleep(0.05)


def _commands(pids):
    return [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            for pid in pids if os.path.exists(f"/proc/{pid}")]


def descendants(pid):
    found = []
    for child in child_pids(pid):
        found += [child, *descendants(child)]
    return found


def uploader_pids(runtime_pid):
    """The living processes under the runtime that run `python -m ma_runtime.sync.uploader`."""
    found = []
    for pid in descendants(runtime_pid):
        try:
            if UPLOADER in Path(f"/proc/{pid}/cmdline").read_bytes() and alive(pid):
                found.append(pid)
        except OSError:
            continue
    return found


def niceness(pid):
    data = Path(f"/proc/{pid}/stat").read_bytes()
    return int(data[data.rfind(b")") + 2:].split()[16])  # field 19 of proc(5), counted after the name


@contextlib.contextmanager
def reaping(env):
    """Whatever a failed test leaves of its job is killed by pid, and the rank-table writers are stopped."""
    try:
        yield
    finally:
        for pid in family(env):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while WRITERS:
            writer = WRITERS.pop()
            if writer.poll() is None:
                writer.kill()
            writer.wait()


@pytest.fixture(autouse=True)
def _reap(job_env):
    with reaping(job_env):
        yield


class CountingProxy(FaultProxy):
    """test_transfer_faults' proxy, keeping every request it saw as (method, path), and able to answer 403
    as OBS answers a wrong secret key (moto checks no signatures)."""

    DENIED = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SignatureDoesNotMatch</Code><Message>The "
              b"request signature we calculated does not match the signature you provided.</Message><RequestId>"
              b"proxy</RequestId></Error>")

    def __init__(self, upstream):
        self.seen = []
        super().__init__(upstream)

    def _take_fault(self, method, path):
        with self.lock:
            self.seen.append((method, path))
        return super()._take_fault(method, path)

    def _forward(self, client, head, body, fault):
        if fault != "403":
            return super()._forward(client, head, body, fault)
        client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n"
                       b"Connection: close\r\n\r\n%s" % (len(self.DENIED), self.DENIED))
        return False

    def puts(self, prefix):
        """Paths of the PUT requests for objects under `/<bucket>/<prefix>` (parts included)."""
        with self.lock:
            return [path for method, path in self.seen if method == "PUT" and path.startswith(prefix)]

    def part_puts(self, prefix):
        return [path for path in self.puts(prefix) if "partNumber=" in path]


@contextlib.contextmanager
def counting_proxy(endpoint):
    parts = urlsplit(endpoint.url)
    running = CountingProxy((parts.hostname, parts.port))
    try:
        yield running
    finally:
        running.close()


@pytest.fixture
def proxy(obs_endpoint):
    with counting_proxy(obs_endpoint) as running:
        yield running


# --------------------------------------------------------------------------- reading the runtime's lines

_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')


def events(text, msg):
    """The logfmt lines with msg="<msg>", each as {field: value}."""
    found = []
    for line in text.splitlines():
        if f'msg="{msg}"' in line:
            found.append({key: _unquoted(value) for key, value in _FIELD.findall(line)})
    return found


def _unquoted(value):
    if not value.startswith('"'):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value[1:-1]


def termination(env):
    return json.loads((log_dir(env) / TERMINATION).read_text())


# --------------------------------------------------------------------------- the bucket and the local tree


def listing(s3, bucket, prefix):
    """{key below prefix: the object's summary} of every object under prefix."""
    found = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            found[item["Key"][len(prefix):]] = item
    return found


def read_object(s3, bucket, key):
    try:
        return s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except s3.exceptions.NoSuchKey:
        return None


def local_files(root: Path):
    """{path relative to root: bytes} of every regular file under root."""
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_whole(data: bytes) -> bool:
    """A trainer file proves itself whole: it ends with the sha256 (hex) of what comes before."""
    return len(data) >= 64 and sha(data[:-64]).encode() == data[-64:]


def is_marker(relative: str) -> bool:
    return os.path.basename(relative) == MARKER_ROOT or relative.endswith(".done")


def marker_entries(data: bytes):
    """[(path relative to the marker's folder, sha256)] that a trainer's marker lists."""
    return [tuple(line.rsplit(" ", 1)) for line in data.decode().splitlines() if " " in line]


def assert_bucket_mirrors(s3, bucket, prefix, local: dict):
    """The bucket holds exactly the local files, byte for byte: nothing missing, nothing extra."""
    found = listing(s3, bucket, prefix)
    assert sorted(found) == sorted(local), "the bucket's keys are not the local files"
    for relative, data in local.items():
        assert sha(read_object(s3, bucket, prefix + relative)) == sha(data), f"{relative} differs in the bucket"


class BucketWatcher:
    """Samples the channel's objects while the job runs and checks each new one as it appears:
    a data object must be whole; a marker's listed files must already be in the bucket with the listed
    sha256 (markers are uploaded last)."""

    def __init__(self, s3, bucket, prefix):
        self.s3, self.bucket, self.prefix = s3, bucket, prefix
        self.checked = set()
        self.objects_seen = 0
        self.markers_checked = []

    def sample(self):
        for relative, item in listing(self.s3, self.bucket, self.prefix).items():
            version = (relative, item["ETag"])
            if version in self.checked:
                continue
            data = read_object(self.s3, self.bucket, self.prefix + relative)
            if data is None:
                continue  # deleted between the listing and the read: nothing to judge
            if is_marker(relative):
                self._check_marker(relative, data)
            else:
                assert is_whole(data), f"{relative} reached the bucket torn ({len(data)} bytes)"
            self.checked.add(version)
        self.objects_seen = len({relative for relative, _ in self.checked})

    def _check_marker(self, relative, data):
        folder = os.path.dirname(relative)
        for path, _digest in marker_entries(data):
            shard_key = self.prefix + (f"{folder}/{path}" if folder else path)
            shard = read_object(self.s3, self.bucket, shard_key)
            assert shard is not None, f"marker {relative} is in the bucket but {shard_key} is not"
            assert sha(shard) == _digest, f"marker {relative} is in the bucket but {shard_key} is another version"
        self.markers_checked.append(relative)


def assert_markers_came_last(s3, bucket, prefix):
    """In the final state, each marker object is no older than the objects it lists (S3 times: seconds)."""
    found = listing(s3, bucket, prefix)
    for relative in (key for key in found if is_marker(key)):
        folder = os.path.dirname(relative)
        for path, _digest in marker_entries(read_object(s3, bucket, prefix + relative)):
            listed = found[f"{folder}/{path}" if folder else path]
            assert found[relative]["LastModified"] >= listed["LastModified"], f"{relative} predates {path}"


# --------------------------------------------------------------------------- 1, 2: a trainer's checkpoints


def trainer_job(tmp_path, obs_endpoint, job_env, **settings):
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint, **settings)
    job = job_file(tmp_path, [("train_url", f"obs://{bucket}/run/out", {})])
    return bucket, env, ["--config", job, sys.executable, TRAINER]


def test_checkpoints_reach_the_bucket_while_training_whole_and_markers_after_their_folders(
        obs_endpoint, job_env, tmp_path):
    bucket, env, args = trainer_job(tmp_path, obs_endpoint, job_env, SYNC_SECONDS=5)
    run = Run(args, env, tmp_path)
    watcher = BucketWatcher(obs_endpoint.s3, bucket, "run/out/")
    deadline = time.monotonic() + 60
    while run.running():
        watcher.sample()
        done_training = "trained:" in run.stdout
        if done_training and (watcher.markers_checked or time.monotonic() > deadline):
            control(env, "finish").touch()  # the trainer waits for this after its 5 s
        time.sleep(0.1)
    seen_while_running, markers_while_running = watcher.objects_seen, list(watcher.markers_checked)

    assert run.wait() == 0, run.stderr[-3000:]
    assert seen_while_running > 0, "nothing reached the bucket while the trainer ran"
    assert markers_while_running, "no folder's marker reached the bucket while the trainer ran"
    local = local_files(output_dir(env))
    assert not [name for name in local if name.endswith(".tmp")]
    assert all(is_whole(data) for name, data in local.items() if not is_marker(name))  # the trainer's own check
    assert_bucket_mirrors(obs_endpoint.s3, bucket, "run/out/", local)
    watcher.sample()  # the final state passes the same checks: every object whole, every marker's files there
    assert_markers_came_last(obs_endpoint.s3, bucket, "run/out/")
    completed = events(run.stderr, "output upload completed")
    assert completed and all(event["name"] == "train_url" for event in completed)
    assert [event for event in completed if event.get("final") == "true"]
    assert sum(int(event["files"]) for event in completed) >= len(local)
    assert events(run.stderr, "final sync completed")
    wait_until_gone(env)


def test_sigterm_mid_checkpoint_the_trainers_last_save_is_uploaded_and_the_job_is_143(
        obs_endpoint, job_env, tmp_path):
    bucket, env, args = trainer_job(tmp_path, obs_endpoint, job_env, SYNC_SECONDS=120,
                                    MA_RUNTIME_STOP_GRACE_SECONDS=15, MA_RUNTIME_FINAL_SYNC_SECONDS=20)
    run = Run(args, env, tmp_path)
    watcher = BucketWatcher(obs_endpoint.s3, bucket, "run/out/")
    deadline = time.monotonic() + 40
    while not (watcher.objects_seen and control(env, "busy").exists()):
        assert run.running() and time.monotonic() < deadline, run.stderr[-3000:]
        watcher.sample()
        time.sleep(0.01)
    run.proc.send_signal(signal.SIGTERM)  # the trainer is writing a checkpoint now

    assert run.wait() == 143, run.stderr[-3000:]
    assert "saved on SIGTERM" in run.stdout
    local = local_files(output_dir(env))
    assert "emergency/save.done" in local
    assert_bucket_mirrors(obs_endpoint.s3, bucket, "run/out/", local)
    watcher.sample()
    assert 'msg="final sync incomplete"' not in run.stderr
    message = termination(env)
    assert message["exit_code"] == 143 and "unsynced" not in message
    wait_until_gone(env)


# --------------------------------------------------------------------------- 5: an unchanged tree


WAIT_FOR_COPIES = """
import os, re, sys, time
target, wanted, cycles_after = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
name = re.compile(r"f\\d{5}\\.txt")
deadline = time.monotonic() + 60
def copied():
    return sum(1 for _, _, files in os.walk(target) for f in files if name.fullmatch(f))
while copied() < wanted:
    if time.monotonic() > deadline:
        sys.exit(9)
    time.sleep(0.2)
os.write(1, b"all copied\\n")
time.sleep(cycles_after)
"""


def test_an_unchanged_tree_of_10000_files_is_copied_once(job_env, tmp_path):
    """A local target: moto would take a minute for 10 000 PUTs; the manifest logic is the same for every store
    (the moto case with request counts is test_an_unchanged_tree_is_not_uploaded_again_even_after_a_restart)."""
    target = tmp_path / "target"
    env = sync_env(job_env, tmp_path, MA_RUNTIME_SYNC_INTERVAL_SECONDS=0.5)
    out = output_dir(env)
    for i in range(10_000):
        folder = out / f"d{i % 50:02d}"
        if i < 50:
            folder.mkdir(parents=True)
        (folder / f"f{i:05d}.txt").write_bytes(str(i).encode() * (1 + i % 7))
    job = job_file(tmp_path, [("train_url", str(target), {})])

    code, run = run_job(["--config", job, sys.executable, "-c", WAIT_FOR_COPIES, str(target), "10000", "2.5"],
                        env, tmp_path, timeout=120)

    assert code == 0, run.stderr[-3000:]
    assert "all copied" in run.stdout
    completed = events(run.stderr, "output upload completed")
    assert sum(int(event["files"]) for event in completed) == 10_000, [event["files"] for event in completed]
    copies = local_files(target)
    assert copies == local_files(out)


def test_an_unchanged_tree_is_not_uploaded_again_even_after_a_restart(obs_endpoint, job_env, tmp_path, proxy):
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint, MA_S3_ENDPOINT=proxy.url)
    out = output_dir(env)
    out.mkdir(parents=True)
    for i in range(300):
        (out / f"f{i:03d}.bin").write_bytes(os.urandom(100 + i))
    job = job_file(tmp_path, [("train_url", f"obs://{bucket}/many/", {})])
    command = ["--config", job, "sh", "-c", "sleep 2"]

    code, first = run_job(command, env, tmp_path, name="first")
    assert code == 0, first.stderr[-3000:]
    assert len(proxy.puts(f"/{bucket}/many/")) == 300
    assert_bucket_mirrors(obs_endpoint.s3, bucket, "many/", local_files(out))
    env["MA_PROC_START_CNT"] = "2"  # the same pod, the next start: the manifest is still there

    code, second = run_job(command, env, tmp_path, name="second")

    assert code == 0, second.stderr[-3000:]
    assert len(proxy.puts(f"/{bucket}/many/")) == 300, "unchanged files were uploaded again"


# --------------------------------------------------------------------------- 6: logs


WAIT_FOR_FINISH = 'i=0; while [ ! -e "$SYNC_CONTROL/finish" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done'


def test_the_task_log_goes_to_log_url_while_the_job_runs(obs_endpoint, job_env, tmp_path):
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint)
    job = job_file(tmp_path, log_url=f"obs://{bucket}/logs/")
    run = Run(["--config", job, "sh", "-c", f"echo hello from the job; {WAIT_FOR_FINISH}"], env, tmp_path)
    key = "logs/modelarts-job-local-worker-0.log"
    deadline = time.monotonic() + 30
    while b"hello from the job" not in (read_object(obs_endpoint.s3, bucket, key) or b""):
        assert run.running() and time.monotonic() < deadline, "the task log never reached log_url while running"
        time.sleep(0.1)
    control(env, "finish").touch()

    assert run.wait() == 0, run.stderr[-3000:]
    uploaded = read_object(obs_endpoint.s3, bucket, key)
    local = task_log(env).read_bytes()
    assert local.startswith(uploaded) and b"hello from the job" in uploaded  # a snapshot of the growing log
    assert b'msg="final sync completed"' in uploaded  # sent once more after the final sync, with its lines
    assert events(run.stderr, "log upload completed")


def test_ma_runtime_log_url_works_as_the_key_does_and_takes_the_termination_message(
        obs_endpoint, job_env, tmp_path):
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint, MA_RUNTIME_LOG_URL=f"s3://{bucket}/env-logs")

    code, run = run_job(["sh", "-c", "echo failing now; exit 3"], env, tmp_path)

    assert code == 3, run.stderr[-3000:]
    found = listing(obs_endpoint.s3, bucket, "env-logs/")
    assert {"modelarts-job-local-worker-0.log", TERMINATION} <= set(found)
    message = json.loads(read_object(obs_endpoint.s3, bucket, f"env-logs/{TERMINATION}"))
    assert message["exit_code"] == 3
    assert b"failing now" in read_object(obs_endpoint.s3, bucket, "env-logs/modelarts-job-local-worker-0.log")


RANK_LOGS = ('echo "rank $RANK_ID says hi"; mkdir -p "$ASCEND_PROCESS_LOG_PATH"; '
             'echo "plog of $RANK_ID at $ASCEND_PROCESS_LOG_PATH" > "$ASCEND_PROCESS_LOG_PATH/plog-1.log"')


def test_rtf_proc_logs_and_process_logs_go_to_log_url(obs_endpoint, job_env, tmp_path):
    bucket = obs_endpoint.new_bucket()
    env = npu_job(job_env, tmp_path, devices=2, **obs_endpoint.env("v4"),
                  MA_RUNTIME_LOG_URL=f"obs://{bucket}/logs/", MA_RUNTIME_SYNC_INTERVAL_SECONDS=0.3)

    code, run = run_job(["sh", "-c", RANK_LOGS], env, tmp_path)

    assert code == 0, run.stderr[-3000:]
    found = listing(obs_endpoint.s3, bucket, "logs/")
    assert "modelarts-job-0a1b-worker-0.log" in found, sorted(found)
    local_logs = log_dir(env)
    for rank in (0, 1):
        proc_log = f"modelarts-job-0a1b-proc-rank-{rank}-device-{rank}.txt"
        assert f"rank {rank} says hi".encode() in read_object(obs_endpoint.s3, bucket, f"logs/{proc_log}")
        plog = f"modelarts-job-0a1b/ascend/process_log/rank_{rank}/plog-1.log"
        expected = f"plog of {rank} at {local_logs / os.path.dirname(plog)}\n".encode()
        assert read_object(obs_endpoint.s3, bucket, f"logs/{plog}") == expected, sorted(found)


# --------------------------------------------------------------------------- 7: hostile trees


def test_hostile_entries_are_skipped_with_one_warning_each_and_the_rest_synced(obs_endpoint, job_env, tmp_path):
    if os.geteuid() == 0:
        # Root reads a mode-000 file (CAP_DAC_OVERRIDE); without that capability and CAP_DAC_READ_SEARCH,
        # the runtime meets an unreadable file as a non-root pod would.
        if not Path("/usr/bin/setpriv").exists():
            pytest.skip("needs setpriv (util-linux) to drop CAP_DAC_OVERRIDE for the unreadable-file case")
        prefix = ["/usr/bin/setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    else:
        prefix = []
    outside = tmp_path / "outside-secret.txt"
    outside.write_text("not part of the output")
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint, HOSTILE_OUTSIDE=outside)
    job = job_file(tmp_path, [("train_url", f"obs://{bucket}/out/", {})])

    code, run = run_job(["--config", job, sys.executable, HOSTILE], env, tmp_path, prefix=prefix)

    assert code == 0, run.stderr[-3000:]
    assert "hostile tree ready" in run.stdout and "Traceback" not in run.stderr
    skipped = events(run.stderr, "sync skipped a file")
    names = sorted(os.path.basename(event.get("path", "")) for event in skipped)
    assert len(skipped) == 6 and all(event.get("reason") for event in skipped), run.stderr[-3000:]
    for expected in ("fifo", "folder-link", "locked.bin", "outside-link", "sock"):
        assert expected in names, names
    assert [name for name in names if name.startswith("bad-name-")], names
    found = listing(obs_endpoint.s3, bucket, "out/")
    assert sorted(found) == ["good/a.bin", "good/b.bin", "inside-link"]
    assert read_object(obs_endpoint.s3, bucket, "out/inside-link") == b"a" * 1000
    assert "not part of the output" not in run.stderr


# --------------------------------------------------------------------------- 9: sync false, delete true


def test_a_channel_with_sync_false_uploads_nothing(obs_endpoint, job_env, tmp_path):
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint)
    job = job_file(tmp_path, [("kept", f"obs://{bucket}/kept/", {"sync": False, "mode": "env"}),
                              ("synced", f"obs://{bucket}/synced/", {"mode": "env"})])

    code, run = run_job(["--config", job, "sh", "-c", 'echo 1 > "$kept/one.txt"; echo 2 > "$synced/two.txt"; '
                         "sleep 1"], env, tmp_path)

    assert code == 0, run.stderr[-3000:]
    assert (output_dir(env, "kept") / "one.txt").exists()
    assert sorted(listing(obs_endpoint.s3, bucket, "")) == ["synced/two.txt"]


REMOVE_WHEN_TOLD = ('for d in "$deleting" "$keeping"; do echo gone > "$d/gone.txt"; echo stay > "$d/stay.txt"; done; '
                    'i=0; while [ ! -e "$SYNC_CONTROL/remove" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; '
                    'rm "$deleting/gone.txt" "$keeping/gone.txt"; sleep 1')


def test_delete_true_removes_the_object_of_a_removed_file_and_the_default_keeps_it(obs_endpoint, job_env, tmp_path):
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint)
    job = job_file(tmp_path, [("deleting", f"obs://{bucket}/del/", {"delete": True, "mode": "env"}),
                              ("keeping", f"obs://{bucket}/keep/", {"mode": "env"})])
    run = Run(["--config", job, "sh", "-c", REMOVE_WHEN_TOLD], env, tmp_path)
    deadline = time.monotonic() + 30
    while not {"del/gone.txt", "keep/gone.txt"} <= set(listing(obs_endpoint.s3, bucket, "")):
        assert run.running() and time.monotonic() < deadline, run.stderr[-3000:]
        time.sleep(0.1)
    control(env, "remove").touch()

    assert run.wait() == 0, run.stderr[-3000:]
    assert sorted(listing(obs_endpoint.s3, bucket, "")) == ["del/stay.txt", "keep/gone.txt", "keep/stay.txt"]


# --------------------------------------------------------------------------- 10: local targets


WRITE_TREE = """
import os, sys
for name in ("plain", "url"):
    out = os.environ[name]
    os.makedirs(os.path.join(out, "a", "b"))
    open(os.path.join(out, "empty.txt"), "wb").close()
    with open(os.path.join(out, "a", "b", "deep.bin"), "wb") as f:
        f.write(os.urandom(5000))
    with open(os.path.join(out, "a", "large.bin"), "wb") as f:
        f.write(os.urandom(9 * 1024 * 1024 + 3))
"""


def test_local_targets_a_path_and_a_file_url_get_identical_copies(job_env, tmp_path):
    plain, url = tmp_path / "plain-target", tmp_path / "url-target"
    env = sync_env(job_env, tmp_path)
    job = job_file(tmp_path, [("plain", str(plain), {"mode": "env"}),
                              ("url", f"file://{url}/", {"mode": "env"})])

    code, run = run_job(["--config", job, sys.executable, "-c", WRITE_TREE], env, tmp_path)

    assert code == 0, run.stderr[-3000:]
    for index, (name, target) in enumerate((("plain", plain), ("url", url))):
        written = local_files(output_dir(env, name, index))
        assert sorted(written) == ["a/b/deep.bin", "a/large.bin", "empty.txt"]
        assert local_files(target) == written


# --------------------------------------------------------------------------- 11: the uploader dies


def test_a_killed_uploader_is_restarted_once_and_later_files_still_arrive(obs_endpoint, job_env, tmp_path):
    bucket, env, args = trainer_job(tmp_path, obs_endpoint, job_env, SYNC_SECONDS=1)
    run = Run(args, env, tmp_path)
    deadline = time.monotonic() + 30
    while not listing(obs_endpoint.s3, bucket, "run/out/"):
        assert run.running() and time.monotonic() < deadline, run.stderr[-3000:]
        time.sleep(0.1)
    (first,) = uploader_pids(run.pid)
    assert niceness(first) > niceness(run.pid), "the uploader does not run niced"
    os.kill(first, signal.SIGKILL)
    wait_for_text(run, 'msg="upload process restarted"')
    control(env, "late").touch()  # the trainer writes late.bin now, after the restart
    deadline = time.monotonic() + 30
    while "late.bin" not in listing(obs_endpoint.s3, bucket, "run/out/"):
        assert run.running() and time.monotonic() < deadline, "late.bin never reached the bucket mid-run"
        time.sleep(0.1)
    assert uploader_pids(run.pid) and first not in uploader_pids(run.pid)
    control(env, "finish").touch()

    assert run.wait() == 0, run.stderr[-3000:]
    (died,) = events(run.stderr, DIED)
    assert "exit_code" in died, died
    assert len(events(run.stderr, "upload process restarted")) == 1
    assert_bucket_mirrors(obs_endpoint.s3, bucket, "run/out/", local_files(output_dir(env)))
    wait_until_gone(env)


def test_after_a_second_death_the_uploader_is_not_restarted_but_the_final_sync_still_runs(
        obs_endpoint, job_env, tmp_path):
    bucket, env, args = trainer_job(tmp_path, obs_endpoint, job_env, SYNC_SECONDS=1)
    run = Run(args, env, tmp_path)
    deadline = time.monotonic() + 30
    while not listing(obs_endpoint.s3, bucket, "run/out/"):
        assert run.running() and time.monotonic() < deadline, run.stderr[-3000:]
        time.sleep(0.1)
    killed = []
    for _death in range(2):
        wait_for(lambda: set(uploader_pids(run.pid)) - set(killed), "no uploader ran")
        (uploader,) = set(uploader_pids(run.pid)) - set(killed)
        os.kill(uploader, signal.SIGKILL)
        killed.append(uploader)
    wait_for(lambda: len(events(run.stderr, DIED)) == 2, "the second death was not reported")
    time.sleep(1.0)  # a restart would have come by now
    assert uploader_pids(run.pid) == [], "the uploader was started a third time"
    control(env, "late").touch()
    wait_for(lambda: (output_dir(env) / "late.bin").exists(), "the trainer did not write late.bin")
    time.sleep(1.0)  # a dozen cycles, had there been an uploader
    assert "late.bin" not in listing(obs_endpoint.s3, bucket, "run/out/")
    control(env, "finish").touch()

    assert run.wait() == 0, run.stderr[-3000:]
    assert len(events(run.stderr, DIED)) == 2
    assert len(events(run.stderr, "upload process restarted")) == 1
    assert_bucket_mirrors(obs_endpoint.s3, bucket, "run/out/", local_files(output_dir(env)))  # the final sync
    wait_until_gone(env)


def wait_for(condition, failure, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.05)


ATTEMPTS = ('echo "attempt $MA_PROC_START_CNT" > "$out/attempt-$MA_PROC_START_CNT.txt"; sleep 1.5; '
            '[ "$MA_PROC_START_CNT" -ge 2 ] || exit 5')


def test_one_uploader_serves_every_attempt_and_the_final_sync_runs_once(obs_endpoint, job_env, tmp_path):
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint, MA_RUNTIME_MAX_RESTARTS=2, MA_RUNTIME_RESTART_BACKOFF_SECONDS=0)
    job = job_file(tmp_path, [("out", f"obs://{bucket}/out/", {"mode": "env"})])
    run = Run(["--config", job, "sh", "-c", ATTEMPTS], env, tmp_path)
    uploaders = set()
    while run.running():
        uploaders.update(uploader_pids(run.pid))
        time.sleep(0.05)

    assert run.wait() == 0, run.stderr[-3000:]
    assert 'msg="restarting command"' in run.stderr
    assert len(uploaders) == 1, f"uploaders {sorted(uploaders)}: one per attempt?"
    assert len(events(run.stderr, "final sync completed")) == 1
    assert sorted(listing(obs_endpoint.s3, bucket, "out/")) == ["attempt-1.txt", "attempt-2.txt"]
