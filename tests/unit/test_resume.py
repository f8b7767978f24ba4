"""MA_RESUME_CHECKPOINT (resume.py) and the checkpoint rules it stands on (sync/units.py): which folders are
complete checkpoints, which are torn saves, and which one an attempt resumes from.

The layouts are the frameworks' own: Hugging Face Trainer's `checkpoint-N/` completed by `trainer_state.json`,
Megatron's `iter_NNNNNNN/` named by `latest_checkpointed_iteration.txt`, DeepSpeed's `global_stepN/` named by
`latest`. Times are set explicitly (os.utime), never left to the clock.
"""

import json
import os
from pathlib import Path

import pytest

from ma_runtime import spec as spec_module
from ma_runtime.stages import resume
from ma_runtime.sync import units
from tests.recording import Log

T0 = 1_700_000_000 * 10**9  # ns


def write(path: Path, data=b"x", at=None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    if at is not None:
        os.utime(path, ns=(T0 + at * 10**9, T0 + at * 10**9))
    return path


def hf_checkpoint(root: Path, step: int, at: int, complete=True) -> Path:
    """What Trainer._save_checkpoint writes: the model, the optimizer, the RNG state, trainer_state.json last."""
    folder = root / f"checkpoint-{step}"
    write(folder / "config.json", "{}", at - 1)
    write(folder / "model.safetensors", b"weights", at - 1)
    write(folder / "rng_state.pth", b"rng", at - 1)
    if complete:
        write(folder / "trainer_state.json", json.dumps({"global_step": step}), at)
    return folder


def megatron_iteration(root: Path, iteration: int, at: int) -> Path:
    folder = root / f"iter_{iteration:07d}"
    write(folder / "mp_rank_00" / "model_optim_rng.pt", b"weights", at)
    return folder


def job_spec(tmp_path, outputs=("train_url",), **settings) -> spec_module.JobSpec:
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"outputs": [{"name": name, "url": str(tmp_path / "bucket" / name) + "/"}
                                           for name in outputs]}))
    environ = {"MA_HOME": str(tmp_path / "home"), **settings}
    return spec_module.load({}, environ, str(job))


def output(spec, index=0) -> Path:
    return spec.outputs[index].local_dir(spec.mount_path)


def chosen(spec, environ=None, attempt=1):
    log = Log()
    env = resume.environ_for(spec, environ or {}, attempt, log)
    return env.get(resume.NAME), env, log


# --------------------------------------------------------------------------- units: complete and torn


def test_complete_units_are_the_folders_whose_marker_is_there(tmp_path):
    hf_checkpoint(tmp_path, 10, at=10)
    hf_checkpoint(tmp_path, 20, at=20, complete=False)
    files = [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()]
    found = units.complete_units(str(tmp_path), units.Units(), files)
    assert [(unit.folder, unit.marker) for unit in found] == [("checkpoint-10", "checkpoint-10/trainer_state.json")]


def test_a_trainer_folder_without_trainer_state_json_is_torn_and_writers_scratch_is_not_judged():
    listing = ["checkpoint-10/config.json", "checkpoint-10/trainer_state.json",
               "checkpoint-20/config.json", "checkpoint-20/rng_state_1.pth", "checkpoint-20/.tmpQeIoOo",
               "tmp-checkpoint-30/config.json", "logs/run.txt"]
    torn = units.incomplete_unit_folders(listing, units.Units(), lambda relative: None)
    assert torn == {"checkpoint-20": "no trainer_state.json"}


@pytest.mark.parametrize("pointer, expected", [
    (b"20\n", {"iter_0000030": "latest_checkpointed_iteration.txt says 20, an earlier save"}),
    (None, {name: "no latest_checkpointed_iteration.txt beside it"
            for name in ("iter_0000010", "iter_0000020", "iter_0000030")}),
    (b"release", {}),  # cannot be compared: the folders beside it are left alone
])
def test_megatron_folders_past_the_pointer_or_without_one_are_torn(pointer, expected):
    listing = [f"iter_{n:07d}/mp_rank_00/model_optim_rng.pt" for n in (10, 20, 30)]
    if pointer is not None:
        listing.append("latest_checkpointed_iteration.txt")
    torn = units.incomplete_unit_folders(listing, units.Units(), lambda relative: pointer)
    assert torn == expected


def test_deepspeed_folders_past_latest_are_torn_and_a_tag_of_the_jobs_own_is_not_judged():
    listing = ["latest", "global_step10/mp_rank_00_model_states.pt", "global_step20/mp_rank_00_model_states.pt"]
    assert units.incomplete_unit_folders(listing, units.Units(), lambda relative: b"global_step10") == {
        "global_step20": "latest says global_step10, an earlier save"}
    assert units.incomplete_unit_folders(listing, units.Units(), lambda relative: b"my-tag") == {}


def test_mindformers_iteration_folders_past_its_tracker_are_torn():
    listing = ["latest_checkpointed_iteration.txt", "iteration_00000010/model.safetensors",
               "iteration_00000020/model.safetensors"]
    assert units.incomplete_unit_folders(listing, units.Units(), lambda relative: b"10") == {
        "iteration_00000020": "latest_checkpointed_iteration.txt says 10, an earlier save"}


def test_a_lightning_ckpt_folder_needs_meta_pt_or_latest_and_a_ckpt_file_is_never_judged():
    listing = ["last.ckpt", "epoch=0-step=10.ckpt/.metadata", "epoch=0-step=10.ckpt/__0_0.distcp",
               "epoch=0-step=10.ckpt/meta.pt", "epoch=0-step=20.ckpt/.metadata", "epoch=0-step=20.ckpt/__0_0.distcp",
               "deepspeed.ckpt/latest", "deepspeed.ckpt/checkpoint/mp_rank_00_model_states.pt"]
    assert units.incomplete_unit_folders(listing, units.Units(), lambda relative: b"checkpoint") == {
        "epoch=0-step=20.ckpt": "no meta.pt or latest"}


def test_only_the_markers_configured_judge_folders():
    listing = ["iter_0000010/model.pt", "checkpoint-5/model.pt"]
    assert units.incomplete_unit_folders(listing, units.Units(markers=("*.done",)), lambda relative: None) == {}


# --------------------------------------------------------------------------- resume: the choice


def test_the_newest_complete_trainer_checkpoint_is_chosen_not_a_newer_torn_one(tmp_path):
    spec = job_spec(tmp_path)
    root = output(spec)
    hf_checkpoint(root, 10, at=10)
    newest = hf_checkpoint(root, 20, at=20)
    hf_checkpoint(root, 30, at=30, complete=False)
    write(root / "checkpoint-999" / "config.json", "{}", at=99)
    path, _, log = chosen(spec, attempt=2)
    assert path == str(newest) and os.path.isabs(path)
    assert log.fields("resume checkpoint") == [{"path": str(newest), "attempt": 2}]


def test_megatron_pointer_20_names_iter_0000020(tmp_path):
    spec = job_spec(tmp_path)
    root = output(spec)
    megatron_iteration(root, 10, at=10)
    megatron_iteration(root, 20, at=20)
    write(root / "latest_checkpointed_iteration.txt", "20", at=21)
    megatron_iteration(root, 30, at=30)  # being written when the job died: the pointer never moved
    assert chosen(spec)[0] == str(root / "iter_0000020")


def test_deepspeed_latest_names_its_global_step_folder(tmp_path):
    spec = job_spec(tmp_path)
    root = output(spec)
    write(root / "global_step10" / "mp_rank_00_model_states.pt", at=10)
    write(root / "global_step20" / "mp_rank_00_model_states.pt", at=20)
    write(root / "latest", "global_step20", at=21)
    assert chosen(spec)[0] == str(root / "global_step20")


def test_a_deepspeed_unit_inside_a_torn_trainer_checkpoint_is_never_chosen(tmp_path):
    # Trainer + DeepSpeed: DeepSpeed's `latest` and global_step30/ are complete before trainer_state.json is written.
    spec = job_spec(tmp_path)
    root = output(spec)
    complete = hf_checkpoint(root, 20, at=20)
    torn = hf_checkpoint(root, 30, at=30, complete=False)
    write(torn / "global_step30" / "mp_rank_00_model_states.pt", at=30)
    write(torn / "latest", "global_step30", at=31)
    assert chosen(spec)[0] == str(complete)


def test_writers_scratch_names_are_never_chosen(tmp_path):
    spec = job_spec(tmp_path, MA_RUNTIME_SYNC_EXCLUDE="staging-*")
    root = output(spec)
    complete = hf_checkpoint(root, 10, at=10)
    hf_checkpoint(root / "tmp-checkpoint-20", 20, at=20)  # transformers 4.36-4.38's staging folder
    hf_checkpoint(root / ".tmpQeIoOo", 30, at=30)
    hf_checkpoint(root / "staging-40", 40, at=40)  # the job's own scratch, MA_RUNTIME_SYNC_EXCLUDE
    assert chosen(spec)[0] == str(complete)


def test_equal_times_go_to_the_greater_number_then_the_shallower_folder(tmp_path):
    # What stage-in leaves after a pre-download: every marker dated alike.
    spec = job_spec(tmp_path)
    root = output(spec)
    for step in (20, 100, 9):
        hf_checkpoint(root, step, at=50)
    write(root / "checkpoint-100" / "global_step100" / "mp_rank_00_model_states.pt", at=50)
    write(root / "checkpoint-100" / "latest", "global_step100", at=50)
    assert chosen(spec)[0] == str(root / "checkpoint-100")


def test_the_newest_across_every_output_channel(tmp_path):
    spec = job_spec(tmp_path, outputs=("train_url", "ckpt_url"))
    hf_checkpoint(output(spec, 0), 10, at=10)
    newest = hf_checkpoint(output(spec, 1), 5, at=20)
    assert chosen(spec)[0] == str(newest)


def test_a_later_attempt_sees_what_the_attempt_before_saved(tmp_path):
    spec = job_spec(tmp_path)
    root = output(spec)
    assert chosen(spec, attempt=1)[0] is None
    saved = hf_checkpoint(root, 10, at=10)
    assert chosen(spec, attempt=2)[0] == str(saved)


# --------------------------------------------------------------------------- resume: the environment


def test_none_found_leaves_it_unset_and_removes_an_empty_value(tmp_path):
    spec = job_spec(tmp_path)
    output(spec).mkdir(parents=True)
    path, env, log = chosen(spec, {"MA_RESUME_CHECKPOINT": "", "OTHER": "1"}, attempt=3)
    assert path is None and env == {"OTHER": "1"}
    assert log.fields("no complete checkpoint to resume from") == [
        {"attempt": 3, "looked_in": [str(output(spec))]}]


def test_a_value_the_job_set_wins_and_is_logged(tmp_path):
    spec = job_spec(tmp_path)
    hf_checkpoint(output(spec), 10, at=10)
    path, _, log = chosen(spec, {"MA_RESUME_CHECKPOINT": "/sfs/mine"}, attempt=2)
    assert path == "/sfs/mine"
    assert log.fields("resume checkpoint set by the job; kept") == [{"path": "/sfs/mine", "attempt": 2}]


def test_off_never_sets_it(tmp_path):
    spec = job_spec(tmp_path, MA_RUNTIME_RESUME="off")
    hf_checkpoint(output(spec), 10, at=10)
    path, env, log = chosen(spec, {"OTHER": "1"})
    assert path is None and env == {"OTHER": "1"} and log.records == []


def test_a_job_without_output_channels_looks_nowhere_and_logs_nothing(tmp_path):
    spec = job_spec(tmp_path, outputs=())
    path, env, log = chosen(spec, {"OTHER": "1"})
    assert path is None and env == {"OTHER": "1"} and log.records == []


def test_a_folder_that_cannot_be_read_is_named_once_and_the_rest_still_counts(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads every folder")
    spec = job_spec(tmp_path)
    root = output(spec)
    saved = hf_checkpoint(root, 10, at=10)
    locked = root / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        path, _, log = chosen(spec)
    finally:
        locked.chmod(0o755)
    assert path == str(saved)
    assert [f["path"] for f in log.fields("cannot read a folder while looking for a checkpoint to resume from")] == [
        str(locked)]
