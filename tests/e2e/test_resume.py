"""Resume end to end with the real Hugging Face Trainer: attempt 1 saves checkpoints, leaves a newer save cut
short and crashes; the in-place restart (attempt 2) gets MA_RESUME_CHECKPOINT, the newest complete checkpoint,
and the Trainer goes on from its step. No hub: a one-layer GPT-2 built from a config, random tokens."""

import importlib.util
import sys
import textwrap

import pytest

from tests.conftest import task_log
from tests.e2e.test_sync import job_file, output_dir, run_job

# Looked up, not imported: the job imports them, twice, and that is most of the test's time already.
pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in ("transformers", "accelerate", "torch")),
    reason="the Trainer test needs transformers, accelerate and torch (scripts/test.sh installs them)")

# Saves every 2 steps; attempt 1 makes checkpoint-999/ (config.json, no trainer_state.json: a save a SIGKILL cut)
# and crashes at the end of step 5, after checkpoint-2 and checkpoint-4.
TRAIN = textwrap.dedent(
    """
    import argparse, os
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    parser = argparse.ArgumentParser()
    parser.add_argument("--train_url")
    output = parser.parse_known_args()[0].train_url
    attempt = os.environ["MA_PROC_START_CNT"]
    resume = os.environ.get("MA_RESUME_CHECKPOINT")
    print(f"attempt {attempt} resume_from={resume}", flush=True)


    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(0, 64, (48, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, index):
            return {"input_ids": self.ids[index], "labels": self.ids[index]}


    class CrashOnce(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            print(f"attempt {attempt} starts at global_step={state.global_step}", flush=True)

        def on_step_end(self, args, state, control, **kwargs):
            if attempt == "1" and state.global_step == 5:
                os.makedirs(os.path.join(output, "checkpoint-999"))
                with open(os.path.join(output, "checkpoint-999", "config.json"), "w") as torn:
                    torn.write("{}")
                raise RuntimeError("crash at step 5")

        def on_train_end(self, args, state, control, **kwargs):
            print(f"attempt {attempt} ends at global_step={state.global_step}", flush=True)


    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32))
    arguments = TrainingArguments(output_dir=output, max_steps=8, save_steps=2, per_device_train_batch_size=4,
                                  use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=100)
    Trainer(model=model, args=arguments, train_dataset=Tokens(), callbacks=[CrashOnce()]).train(
        resume_from_checkpoint=resume)
    """
)


def test_an_in_place_restart_resumes_the_trainer_from_the_newest_complete_checkpoint(job_env, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    job = job_file(tmp_path, outputs=[("train_url", str(tmp_path / "bucket") + "/", {"sync": False})])
    env = {**job_env, "MA_RUNTIME_PREFLIGHT": "off", "MA_RUNTIME_MAX_RESTARTS": "1",
           "MA_RUNTIME_RESTART_BACKOFF_SECONDS": "0", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    code, run = run_job(["--config", job, sys.executable, str(script)], env, tmp_path, timeout=120)
    assert code == 0, run.stderr[-3000:]
    newest = output_dir(env) / "checkpoint-4"
    lines = run.stdout.splitlines()
    assert "attempt 1 resume_from=None" in lines and "attempt 1 starts at global_step=0" in lines
    assert f"attempt 2 resume_from={newest}" in lines
    assert "attempt 2 starts at global_step=4" in lines and "attempt 2 ends at global_step=8" in lines
    said = [line for line in task_log(env).read_text().splitlines()
            if 'msg="resume checkpoint' in line or 'msg="no complete checkpoint' in line]
    assert len(said) == 2, said  # one line per attempt
    assert 'msg="no complete checkpoint to resume from"' in said[0] and " attempt=1 " in said[0]
    assert 'msg="resume checkpoint"' in said[1] and said[1].endswith(f"path={newest} attempt=2")
