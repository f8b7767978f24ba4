"""Checkpoints reach OBS whole, or the job says so (issue 23), end to end: ma-run, the real OBS SDK, moto behind
the fault proxy of tests/e2e/test_sync.py, real signals and a real full disk. The mechanisms one by one are in
tests/unit/test_sync_whole.py.
"""

import hashlib
import sys
import time

import pytest

from tests.e2e.test_sync import (
    CountingProxy,
    Run,
    control,
    counting_proxy,
    events,
    job_file,
    listing,
    output_dir,
    read_object,
    reaping,
    sync_env,
    termination,
    wait_until_gone,
)

MiB = 1 << 20
KEY_TOO_LONG = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>KeyTooLongError</Code><Message>Your key is "
                b"too long</Message><RequestId>proxy</RequestId></Error>")


@pytest.fixture(autouse=True)
def _reap(job_env):
    with reaping(job_env):
        yield


class RefusingProxy(CountingProxy):
    """Answers 400 KeyTooLongError to every PUT whose path holds `refused` (as OBS does for a key over 1024
    bytes); forwards the rest."""

    refused = "bad-name"

    def _take_fault(self, method, path):
        fault = super()._take_fault(method, path)
        return "refuse" if method == "PUT" and self.refused in path else fault

    def _forward(self, client, head, body, fault):
        if fault != "refuse":
            return super()._forward(client, head, body, fault)
        client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n"
                       b"Connection: close\r\n\r\n%s" % (len(KEY_TOO_LONG), KEY_TOO_LONG))
        return False


def run_until_exit(args, env, tmp_path, timeout=90):
    run = Run(args, env, tmp_path)
    return run.wait(timeout), run


# --------------------------------------------------------------------------- 1: a store that answers 200 and failed


WRITES_TWO = """
import os
out = os.environ["out"]
open(os.path.join(out, "model.pt"), "wb").write(os.urandom(6 << 20))
open(os.path.join(out, "config.json"), "w").write("{}")
"""


@pytest.mark.parametrize("fault, methods, marker, unless", [
    ("error-200", ("POST",), "uploadId=", None),  # CompleteMultipartUpload: 200 with <Error> inside
    ("no-etag", ("PUT",), "", "uploadId="),  # a whole-object PUT: 200 without an ETag, not stored
], ids=["complete answered 200 with an error", "put answered 200 without an etag"])
def test_an_upload_the_store_did_not_confirm_is_sent_again_and_never_recorded(obs_endpoint, job_env, tmp_path,
                                                                             fault, methods, marker, unless):
    bucket = obs_endpoint.new_bucket()
    with counting_proxy(obs_endpoint) as proxy:
        proxy.arm(fault, 1, methods, marker=marker, unless=unless)
        # A 4 MiB threshold: the 6 MiB model goes in parts (its complete is what the first case spoils).
        env = sync_env(job_env, tmp_path, obs_endpoint, MA_S3_ENDPOINT=proxy.url, MA_RUNTIME_STORAGE_LARGE_MB=4)
        job = job_file(tmp_path, [("out", f"obs://{bucket}/run/", {"mode": "env"})])

        code, run = run_until_exit(["--config", job, sys.executable, "-c", WRITES_TWO], env, tmp_path)

        assert proxy.spoiled == 1
    assert code == 0, run.stderr[-3000:]
    local = output_dir(env, "out")
    for name in ("model.pt", "config.json"):
        assert read_object(obs_endpoint.s3, bucket, f"run/{name}") == (local / name).read_bytes(), name
    assert not events(run.stderr, "final sync incomplete")
    wait_until_gone(env)


# --------------------------------------------------------------------------- 4: one refused name


WRITES_A_REFUSED_NAME = """
import os
out = os.environ["out"]
os.makedirs(os.path.join(out, "ckpt"))
open(os.path.join(out, "bad-name.bin"), "wb").write(b"x")
open(os.path.join(out, "ckpt", "model.pt"), "wb").write(os.urandom(5 << 20))
open(os.path.join(out, "ckpt", "x.done"), "w").write("done")
"""


def test_a_name_the_store_refuses_does_not_keep_the_checkpoint_out(obs_endpoint, job_env, tmp_path):
    from urllib.parse import urlsplit

    bucket = obs_endpoint.new_bucket()
    parts = urlsplit(obs_endpoint.url)
    proxy = RefusingProxy((parts.hostname, parts.port))
    try:
        env = sync_env(job_env, tmp_path, obs_endpoint, MA_S3_ENDPOINT=proxy.url)
        job = job_file(tmp_path, [("out", f"obs://{bucket}/run/", {"mode": "env"})])

        code, run = run_until_exit(["--config", job, sys.executable, "-c", WRITES_A_REFUSED_NAME], env, tmp_path)
    finally:
        proxy.close()

    assert code == 80, run.stderr[-3000:]  # one file is not in the store: the job does not say success
    found = listing(obs_endpoint.s3, bucket, "run/")
    assert {"ckpt/model.pt", "ckpt/x.done"} <= set(found), sorted(found)
    assert len(events(run.stderr, "the store refused a file: set aside until it changes")) == 1
    assert termination(env)["unsynced"] == ["out: bad-name.bin (refused by the store)"]
    wait_until_gone(env)


# --------------------------------------------------------------------------- 5: a reused marker name


REUSES_ITS_MARKER = """
import os, sys, time
ckpt = os.path.join(os.environ["out"], "ckpt")
control = os.environ["SYNC_CONTROL"]
os.makedirs(ckpt)
def shard(index, step, slow=False):
    with open(os.path.join(ckpt, f"shard{index}"), "wb") as f:
        for piece in range(4 if slow else 1):
            f.write(f"step{step} ".encode() + os.urandom(100_000))
            f.flush()
            time.sleep(0.5 if slow else 0)
def marker(step):
    with open(os.path.join(ckpt, "ckpt.done"), "w") as f:
        f.write(str(step))
shard(0, 1); shard(1, 1); marker(1)
while not os.path.exists(os.path.join(control, "step1-seen")):
    time.sleep(0.05)
os.unlink(os.path.join(ckpt, "ckpt.done"))
shard(0, 2)
time.sleep(2)
shard(1, 2, slow=True)
marker(2)
time.sleep(2)
"""


def test_a_reader_that_waits_for_a_reused_marker_never_sees_half_a_checkpoint(obs_endpoint, job_env, tmp_path):
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint)
    job = job_file(tmp_path, [("out", f"obs://{bucket}/run/", {"mode": "env"})])
    run = Run(["--config", job, sys.executable, "-c", REUSES_ITS_MARKER], env, tmp_path)
    judged = []
    deadline = time.monotonic() + 60
    while run.running():
        assert time.monotonic() < deadline, run.stderr[-3000:]
        seen = judge_marker(obs_endpoint.s3, bucket)
        if seen is not None:
            judged.append(seen)
            if seen == 1:
                control(env, "step1-seen").touch()
        time.sleep(0.02)

    assert run.wait() == 0, run.stderr[-3000:]
    assert judged.count(1) and judged.count(2), judged  # the reader saw both steps, each whole
    assert events(run.stderr, "marker withdrawn while its checkpoint changes")
    wait_until_gone(env)


def judge_marker(s3, bucket):
    """The step the marker names, after checking that every shard in the bucket is of that step; None when
    there is no marker (or it changed while read: nothing to judge)."""
    before = listing(s3, bucket, "run/ckpt/").get("ckpt.done")
    if before is None:
        return None
    step = read_object(s3, bucket, "run/ckpt/ckpt.done")
    shards = [read_object(s3, bucket, f"run/ckpt/shard{index}") for index in (0, 1)]
    after = listing(s3, bucket, "run/ckpt/").get("ckpt.done")
    if step is None or after is None or after["ETag"] != before["ETag"]:
        return None
    for index, shard in enumerate(shards):
        assert shard is not None and shard.startswith(b"step" + step + b" "), \
            f"the marker says step {step!r} but shard{index} is {shard[:6] if shard else None!r}"
    return int(step)


# --------------------------------------------------------------------------- 3: SIGTERM during a rewrite


REWRITES_IN_PLACE = """
import os, subprocess, sys, time
# A second process that ignores SIGTERM for a while: the stop's grace lasts, and the periodic cycles go on.
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "time.sleep(4)"])
path = os.path.join(os.environ["out"], "model.pt")
with open(path, "wb") as f:
    f.write(os.urandom(1 << 20))
os.write(1, b"saved\\n")
while not os.path.exists(os.path.join(os.environ["SYNC_CONTROL"], "uploaded")):
    time.sleep(0.05)
with open(path, "r+b") as f:  # the next save, in place and slowly
    for _ in range(300):
        f.write(os.urandom(1900))
        f.flush()
        time.sleep(0.05)
"""


def test_sigterm_during_an_in_place_rewrite_keeps_the_good_checkpoint_in_the_store(obs_endpoint, job_env, tmp_path):
    import signal

    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint)
    job = job_file(tmp_path, [("out", f"obs://{bucket}/run/", {"mode": "env"})])
    run = Run(["--config", job, sys.executable, "-c", REWRITES_IN_PLACE], env, tmp_path)
    deadline = time.monotonic() + 30
    good = None
    while good is None or len(good) != MiB:
        assert run.running() and time.monotonic() < deadline, run.stderr[-3000:]
        good = read_object(obs_endpoint.s3, bucket, "run/model.pt")
        time.sleep(0.05)
    control(env, "uploaded").touch()
    time.sleep(1.5)  # the rewrite is under way

    run.proc.send_signal(signal.SIGTERM)

    assert run.wait() == 143, run.stderr[-3000:]
    stored = read_object(obs_endpoint.s3, bucket, "run/model.pt")
    assert hashlib.sha256(stored).digest() == hashlib.sha256(good).digest(), "the good checkpoint was replaced"
    message = termination(env)
    assert message["exit_code"] == 143
    assert message["unsynced"] == ["out: model.pt (being written at the stop)"]
    wait_until_gone(env)


# --------------------------------------------------------------------------- 2: a full state folder


FILLS_THE_DISK = """
import os
home = os.environ["MA_HOME"]
open(os.path.join(os.environ["out"], "model.pt"), "wb").write(os.urandom(5 << 20))
try:
    with open(os.path.join(home, "filler"), "wb") as filler:
        while True:
            filler.write(b"\\0" * 65536)
            filler.flush()
except OSError:
    pass
os.write(1, b"disk full\\n")
"""


def test_a_full_state_folder_still_syncs_a_large_checkpoint_and_says_why_records_are_missing(
        obs_endpoint, job_env, tmp_path, tmpfs):
    home = tmpfs("home", "8m")
    bucket = obs_endpoint.new_bucket()
    env = sync_env({**job_env, "MA_HOME": str(home)}, tmp_path, obs_endpoint,
                   MA_RUNTIME_SYNC_INTERVAL_SECONDS=3600)  # only the final sync: the disk is full by then
    job = job_file(tmp_path, [("out", f"obs://{bucket}/run/", {"mode": "env"})])

    code, run = run_until_exit(["--config", job, sys.executable, "-c", FILLS_THE_DISK], env, tmp_path)

    assert "disk full" in run.stdout
    assert code == 0, run.stderr[-3000:]
    stored = read_object(obs_endpoint.s3, bucket, "run/model.pt")
    assert stored == (home / "modelarts" / "outputs" / "out_0" / "model.pt").read_bytes()
    said = [line for line in run.stderr.splitlines() if "cannot be written: kept in memory" in line]
    assert said and all("No space left on device" in line for line in said), run.stderr[-3000:]


# --------------------------------------------------------------------------- 7: Lightning's last.ckpt


LIGHTNING_TRAINER = """
import os, time, torch
import lightning as L
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint

class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
    def training_step(self, batch, _index):
        time.sleep(0.1)  # a step that takes a while: a save every 0.1 s, far faster than the sync's cycle
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
checkpoints = ModelCheckpoint(dirpath=os.environ["out"], save_last=True, every_n_train_steps=1, save_top_k=1)
trainer = L.Trainer(max_steps=int(os.environ["STEPS"]), accelerator="cpu", logger=False, enable_progress_bar=False,
                    enable_model_summary=False, callbacks=[checkpoints],
                    plugins=[LightningEnvironment()])  # no cluster detection: it would load mpi4py
trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=1))
print("trained", flush=True)
"""


def test_lightnings_last_checkpoint_saved_faster_than_the_cycle_reaches_the_store_while_it_trains(
        obs_endpoint, job_env, tmp_path):
    pytest.importorskip("lightning", reason="PyTorch Lightning is installed by scripts/test.sh")
    import io

    import torch

    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint, MA_RUNTIME_SYNC_INTERVAL_SECONDS=1, STEPS=40)
    job = job_file(tmp_path, [("out", f"obs://{bucket}/run/", {"mode": "env"})])
    run = Run(["--config", job, sys.executable, "-c", LIGHTNING_TRAINER], env, tmp_path)
    steps_seen, etags = set(), set()
    deadline = time.monotonic() + 120
    while run.running():
        assert time.monotonic() < deadline, run.stderr[-3000:]
        found = listing(obs_endpoint.s3, bucket, "run/").get("last.ckpt")
        if found is not None and found["ETag"] not in etags and "trained" not in run.stdout:
            data = read_object(obs_endpoint.s3, bucket, "run/last.ckpt")
            if data is not None:
                etags.add(found["ETag"])
                steps_seen.add(torch.load(io.BytesIO(data), weights_only=False)["global_step"])  # whole
        time.sleep(0.1)

    assert run.wait() == 0, run.stderr[-3000:]
    assert len(steps_seen) >= 2, f"versions of last.ckpt seen while training: {sorted(steps_seen)}"
    final = torch.load(io.BytesIO(read_object(obs_endpoint.s3, bucket, "run/last.ckpt")), weights_only=False)
    assert final["global_step"] == 40
    assert not [key for key in listing(obs_endpoint.s3, bucket, "run/") if ".tmp" in key]
    wait_until_gone(env)


# --------------------------------------------------------------------------- 6: Hugging Face checkpoint folders


HF_TRAINER = """
import os, time, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

class Tokens(torch.utils.data.Dataset):
    ids = torch.randint(0, 64, (48, 16), generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}

class Slow(TrainerCallback):  # steps that take a while, so the sync's cycles see the folders as they are saved
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.3)

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32))
arguments = TrainingArguments(output_dir=os.environ["out"], max_steps=12, save_steps=1, per_device_train_batch_size=4,
                              use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=100)
Trainer(model=model, args=arguments, train_dataset=Tokens(), callbacks=[Slow()]).train()
print("trained", flush=True)
"""


def test_a_hugging_face_checkpoint_folder_is_never_in_the_bucket_with_its_state_but_not_all_its_files(
        obs_endpoint, job_env, tmp_path):
    pytest.importorskip("transformers", reason="the Trainer is installed by scripts/test.sh")
    pytest.importorskip("accelerate", reason="the Trainer is installed by scripts/test.sh")
    bucket = obs_endpoint.new_bucket()
    env = sync_env(job_env, tmp_path, obs_endpoint, MA_RUNTIME_SYNC_INTERVAL_SECONDS=0.3)
    job = job_file(tmp_path, [("out", f"obs://{bucket}/run/", {"mode": "env"})])
    run = Run(["--config", job, sys.executable, "-c", HF_TRAINER], env, tmp_path)
    complete_while_training = set()
    deadline = time.monotonic() + 120
    while run.running():
        assert time.monotonic() < deadline, run.stderr[-3000:]
        found = listing(obs_endpoint.s3, bucket, "run/")
        for key in [key for key in found if key.endswith("/trainer_state.json")]:
            folder = key.rpartition("/")[0]
            files = {name.rpartition("/")[2] for name in found if name.startswith(folder + "/")}
            assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "config.json"} <= files, (folder, files)
            complete_while_training.add(folder)
        time.sleep(0.05)

    assert run.wait() == 0, run.stderr[-3000:]
    assert complete_while_training, "no checkpoint folder was complete in the bucket while the Trainer ran"
    local = output_dir(env, "out")
    found = listing(obs_endpoint.s3, bucket, "run/")
    for folder in sorted(path for path in local.iterdir() if path.name.startswith("checkpoint-")):
        assert {f"{folder.name}/{file.name}" for file in folder.iterdir()} <= set(found), folder.name
    assert not [key for key in found if ".tmp" in key]
    wait_until_gone(env)
