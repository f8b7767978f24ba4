"""Checkpoints reach the store whole, or the sync says so (issue 23): the engine's side, one mechanism at a time.

Real files and the LocalStore (it behaves as a server does); faults from small store wrappers. A file "still being
written" is one held open for writing, as a writer holds it: that is what the sync looks for (writers.py).
The end-to-end cases (the runtime, moto behind a fault proxy, SIGTERM) are in tests/e2e/test_sync_whole.py.
"""

import os
import threading
import time

import pytest

from ma_runtime.storage.base import AccessDenied, ObjectRefused, TransientError
from ma_runtime.storage.local import LocalStore
from ma_runtime.sync import reading, tree, units
from ma_runtime.sync.units import Units
from tests.recording import Log
from tests.unit.test_sync import Channel, MiB, Recording, random_bytes, write

LARGE = reading.SMALL_LIMIT + MiB


class Refusing(Recording):
    """Refuses (as a 4xx for one key) every write of the keys whose name contains `word`."""

    def __init__(self, store, word="bad", error=ObjectRefused):
        super().__init__(store)
        self.word = word
        self.error = error
        self.refused = []

    def _check(self, key):
        if self.word in key:
            with self.lock:
                self.refused.append(key)
            raise self.error(f"uploading to {key}: HTTP 400 KeyTooLongError")

    def put_bytes(self, bucket, key, data, md5_hex):
        self._check(key)
        return super().put_bytes(bucket, key, data, md5_hex)

    def create_multipart(self, bucket, key):
        self._check(key)
        return self.inner.create_multipart(bucket, key)


def save(path, data, mtime_ns=10**18 + 10**9):
    """An atomic writer's save: a temporary name, then a rename over the old file (another inode)."""
    temporary = path.with_name(path.name + ".tmp")
    write(temporary, data, mtime_ns)
    os.replace(temporary, path)


def hf_checkpoint(root, step, state=True):
    folder = root / f"checkpoint-{step}"
    write(folder / "model.safetensors", b"model %d" % step)
    write(folder / "optimizer.pt", b"optimizer %d" % step)
    if state:
        write(folder / "trainer_state.json", b'{"global_step": %d}' % step)
    return folder


# --------------------------------------------------------------------------- 4: a refused object


def test_one_refused_object_is_set_aside_with_one_warning_and_the_others_go_up(tmp_path):
    store = Refusing(LocalStore())
    channel = Channel(tmp_path, store)
    write(channel.root / "bad-name.txt", b"x")  # small files go first: it must not shadow the checkpoint
    write(channel.root / "ckpt" / "model.pt", random_bytes(LARGE))
    write(channel.root / "ckpt" / "x.done", b"done")

    first = channel.cycle()
    second = channel.cycle()
    final = channel.cycle(final=True)

    assert first.error is None and first.files == 2
    assert set(channel.uploaded()) == {"ckpt/model.pt", "ckpt/x.done"}
    assert store.refused == [str(channel.dest / "bad-name.txt")]  # set aside: not asked again while unchanged
    warnings = channel.log.fields("the store refused a file: set aside until it changes")
    assert len(warnings) == 1 and warnings[0]["path"] == "bad-name.txt" and "KeyTooLong" in warnings[0]["error"]
    assert second.files == 0 and final.missing == ["bad-name.txt (refused by the store)"]


def test_a_refused_file_holds_its_units_marker_and_is_tried_again_once_it_changes(tmp_path):
    store = Refusing(LocalStore())
    channel = Channel(tmp_path, store)
    write(channel.root / "ckpt" / "bad.bin", b"1")
    write(channel.root / "ckpt" / "good.bin", b"2")
    write(channel.root / "ckpt" / "x.done", b"done")

    channel.cycle()

    assert set(channel.uploaded()) == {"ckpt/good.bin"}  # no marker beside a unit that is not all there
    write(channel.root / "ckpt" / "bad.bin", b"changed", mtime_ns=10**18 + 10**9)
    channel.cycle()
    assert len(store.refused) == 2


@pytest.mark.parametrize("outage", [TransientError, AccessDenied])
def test_an_outage_still_ends_the_cycle(tmp_path, outage):
    store = Refusing(LocalStore(), word="a-", error=outage)
    channel = Channel(tmp_path, store, workers=1)
    for index in range(5):
        write(channel.root / f"a-{index}.txt", b"x")

    result = channel.cycle()

    assert result.error and len(set(store.refused)) == 1  # the first failure ends the cycle (after its retries)
    assert channel.log.fields("the store refused a file: set aside until it changes") == []


# --------------------------------------------------------------------------- 5: a reused marker name


def test_a_reused_marker_is_withdrawn_before_its_unit_changes_and_published_after(tmp_path):
    channel = Channel(tmp_path)
    ckpt = channel.root / "ckpt"
    write(ckpt / "shard0", b"step1-0")
    write(ckpt / "shard1", b"step1-1")
    write(ckpt / "ckpt.done", b"1")
    channel.cycle()
    assert channel.uploaded() == {"ckpt/shard0": b"step1-0", "ckpt/shard1": b"step1-1", "ckpt/ckpt.done": b"1"}

    (ckpt / "ckpt.done").unlink()  # step 2: the job withdraws its marker, then rewrites the shards one by one
    save(ckpt / "shard0", b"step2-0")
    with open(ckpt / "shard1", "wb") as writer:
        writer.write(b"step2-")
        writer.flush()
        channel.cycle()
        seen = channel.uploaded()
        assert seen["ckpt/shard0"] == b"step2-0"
        assert "ckpt/ckpt.done" not in seen  # never a marker beside step 2's shard0 and step 1's shard1
        writer.write(b"1")
    write(ckpt / "ckpt.done", b"2", mtime_ns=10**18 + 2 * 10**9)
    channel.cycle()  # shard1 was rewritten in place over its object: closed is not enough, it needs two looks
    assert "ckpt/ckpt.done" not in channel.uploaded()
    channel.cycle()

    assert channel.uploaded() == {"ckpt/shard0": b"step2-0", "ckpt/shard1": b"step2-1", "ckpt/ckpt.done": b"2"}
    assert channel.store.written[-1] == str(channel.dest / "ckpt" / "ckpt.done")
    assert channel.log.fields("marker withdrawn while its checkpoint changes")[0]["path"] == "ckpt/ckpt.done"


def test_a_marker_left_in_place_is_withdrawn_too_while_its_files_change_then_published_again(tmp_path):
    channel = Channel(tmp_path)
    write(channel.root / "ckpt" / "shard0", b"one")
    write(channel.root / "ckpt" / "x.done", b"done")
    channel.cycle()
    channel.store.deleted.clear()

    save(channel.root / "ckpt" / "shard0", b"two")
    channel.cycle()

    assert channel.store.deleted == [str(channel.dest / "ckpt" / "x.done")]
    assert channel.uploaded() == {"ckpt/shard0": b"two", "ckpt/x.done": b"done"}  # published again after it


def test_a_marker_is_withdrawn_even_with_delete_false_and_nothing_else_is_deleted(tmp_path):
    channel = Channel(tmp_path)
    write(channel.root / "ckpt" / "shard0", b"one")
    write(channel.root / "ckpt" / "x.done", b"done")
    write(channel.root / "other" / "kept.bin", b"kept")
    channel.cycle()
    (channel.root / "other" / "kept.bin").unlink()
    save(channel.root / "ckpt" / "shard0", b"two")

    channel.cycle()

    assert channel.store.deleted == [str(channel.dest / "ckpt" / "x.done")]
    assert "other/kept.bin" in channel.uploaded()


def test_a_closed_file_rewritten_in_place_over_its_object_waits_for_two_looks(tmp_path):
    """A writer that died mid-write left the file closed and torn: closed is not enough over an object we
    uploaded, when the inode is the same (a rename into place gives another)."""
    channel = Channel(tmp_path)
    path = write(channel.root / "model.pt", b"good")
    channel.cycle()
    with open(path, "r+b") as writer:
        writer.write(b"TO")  # torn, then closed
    os.utime(path, ns=(10**18 + 10**9, 10**18 + 10**9))

    assert channel.cycle().files == 0
    assert channel.uploaded() == {"model.pt": b"good"}
    assert channel.cycle().files == 1  # two looks agree


def test_a_file_renamed_into_place_is_whole_at_its_first_look_when_it_reuses_the_uploaded_files_inode_number(
        tmp_path):
    """ext4 gives a freed inode's number to the next file it creates: Lightning's `last.ckpt`, renamed over every
    step, comes back with the number of the version uploaded every second save. It is a new file (born after the
    uploaded one), not one rewritten in place: closed, it goes up at its first look, or a checkpoint replaced
    faster than the cycle would never reach the store while the job trains."""
    channel = Channel(tmp_path)
    path = write(channel.root / "last.ckpt", b"step 0")
    channel.cycle()
    uploaded = path.stat().st_ino
    time.sleep(0.01)  # the next births fall in a later tick of the filesystem's clock (1-10 ms), as a step's do
    for step in range(1, 9):  # a filesystem that never reuses a number (tmpfs) gives a new one: the usual case
        save(path, b"step %d" % step, mtime_ns=10**18 + step * 10**9)
        if path.stat().st_ino == uploaded:
            break

    assert channel.cycle().files == 1
    assert channel.uploaded() == {"last.ckpt": b"step %d" % step}


def test_during_a_stop_the_periodic_cycles_replace_nothing_with_what_the_workers_were_writing(tmp_path):
    channel = Channel(tmp_path)
    path = write(channel.root / "model.pt", b"good")
    channel.cycle()
    channel.sync.stopping_at = time.time()  # the runtime said the workers are being stopped
    save(path, b"torn by the stop", mtime_ns=time.time_ns())
    write(channel.root / "emergency.pt", b"new")

    channel.cycle()
    channel.cycle()

    assert channel.uploaded() == {"model.pt": b"good", "emergency.pt": b"new"}
    channel.sync.stopping_at = None  # a new attempt
    channel.cycle()
    assert channel.uploaded()["model.pt"] == b"torn by the stop"  # the new attempt's files are its own


# --------------------------------------------------------------------------- 6: the frameworks' layouts


def test_a_hugging_face_checkpoint_folder_is_published_by_its_trainer_state_last(tmp_path):
    channel = Channel(tmp_path, markers=Units())
    folder = hf_checkpoint(channel.root, 10)
    with open(folder / "rng_state_1.pth", "wb") as writer:  # still being saved
        writer.write(b"rng")
        writer.flush()
        channel.cycle()
        assert "checkpoint-10/trainer_state.json" not in channel.uploaded()
    channel.cycle()

    assert set(channel.uploaded()) == {f"checkpoint-10/{name}" for name in
                                       ("model.safetensors", "optimizer.pt", "rng_state_1.pth", "trainer_state.json")}
    assert channel.store.written[-1].endswith("checkpoint-10/trainer_state.json")


def test_a_megatron_pointer_marker_waits_for_the_iteration_it_names_only(tmp_path):
    channel = Channel(tmp_path, markers=Units())
    write(channel.root / "iter_0000020" / "mp_rank_00" / "model_optim_rng.pt", b"20")
    write(channel.root / "latest_checkpointed_iteration.txt", b"20")
    with open(channel.root / "metrics.jsonl", "ab") as metrics:  # appended all the time, beside the marker
        metrics.write(b"{}\n")
        metrics.flush()

        channel.cycle()

        assert set(channel.uploaded()) == {"iter_0000020/mp_rank_00/model_optim_rng.pt",
                                           "latest_checkpointed_iteration.txt"}


def test_writers_temporary_files_are_never_uploaded(tmp_path):
    channel = Channel(tmp_path, markers=Units(excludes=(*units.DEFAULT_EXCLUDES, "*.bak")))
    for name in ("checkpoint-20/.tmpQeIoOo", "model.pt.tmp", "x.partial", "tmp-checkpoint-5/model.safetensors",
                 "old.bak", "kept.pt"):
        write(channel.root / name, b"x")

    channel.cycle(final=True)

    assert set(channel.uploaded()) == {"kept.pt"}


# --------------------------------------------------------------------------- 3: a final sync after a stop


def stopped_now():
    return time.time()


def test_after_a_stop_a_file_rewritten_in_place_does_not_replace_the_good_object(tmp_path):
    channel = Channel(tmp_path)
    good = b"good" * 1000
    path = write(channel.root / "model.pt", good)
    channel.cycle()
    assert channel.uploaded() == {"model.pt": good}
    with open(path, "r+b") as writer:  # rewritten in place, slowly: the stop comes in the middle
        writer.write(b"torn")
    stop = stopped_now()
    write(channel.root / "emergency" / "save.bin", b"saved on SIGTERM")

    result = channel.cycle(final=True, stopped_at=stop)

    assert channel.uploaded() == {"model.pt": good, "emergency/save.bin": b"saved on SIGTERM"}
    assert result.missing == ["model.pt (being written at the stop)"]
    assert channel.log.fields("files being written when the workers were stopped are not synced: the store keeps "
                              "their last whole version")


def test_after_a_stop_a_file_found_whole_before_it_still_goes_up(tmp_path, monkeypatch):
    failing = Refusing(LocalStore(), word="model", error=TransientError)
    channel = Channel(tmp_path, failing)
    write(channel.root / "model.pt", b"version 1")
    channel.cycle()  # the store was down: found whole, not uploaded
    write(channel.root / "model.pt", b"version 2", mtime_ns=10**18 + 10**9)
    channel.cycle()
    failing.word = "never"

    result = channel.cycle(final=True, stopped_at=stopped_now())

    assert result.missing == [] and channel.uploaded() == {"model.pt": b"version 2"}


def test_a_final_sync_of_a_command_that_ended_by_itself_takes_every_file(tmp_path):
    channel = Channel(tmp_path)
    write(channel.root / "model.pt", b"good")
    channel.cycle()
    write(channel.root / "model.pt", b"final", mtime_ns=10**18 + 10**9)

    assert channel.cycle(final=True).missing == []
    assert channel.uploaded() == {"model.pt": b"final"}


# --------------------------------------------------------------------------- 2: records that cannot be written


def test_an_unwritable_state_folder_keeps_the_records_in_memory_and_says_so_once(tmp_path):
    channel = Channel(tmp_path)
    channel.state.write_bytes(b"a file where the state folder should be")  # every record write fails
    write(channel.root / "big.bin", random_bytes(LARGE))
    write(channel.root / "small.txt", b"small")

    first = channel.cycle()
    write(channel.root / "later.txt", b"later")
    second = channel.cycle()

    assert (first.files, first.error, second.files) == (2, None, 1)
    assert set(channel.uploaded()) == {"big.bin", "small.txt", "later.txt"}
    assert len(channel.log.fields("the sync manifest cannot be written: kept in memory (a later runtime uploads "
                                  "these files again)")) == 1
    records = channel.log.fields("the upload's record cannot be written: kept in memory (a runtime started again "
                                 "sends the whole file)")
    assert len(records) == 1 and "big.bin" in records[0]["url"]
    assert channel.cycle().files == 0  # remembered in memory: not sent again


def test_any_error_in_an_upload_thread_is_logged_once_with_its_file(tmp_path, monkeypatch):
    channel = Channel(tmp_path)
    write(channel.root / "a.txt", b"a")

    def broken(*args):
        raise RuntimeError("something no one expected")

    monkeypatch.setattr(channel.store, "put_bytes", broken)
    first = channel.cycle(final=True)
    second = channel.cycle(final=True)

    assert first.missing == second.missing == ["a.txt"]
    logged = channel.log.fields("sync failed for a file")
    assert len(logged) == 1 and logged[0]["path"] == "a.txt" and "something no one expected" in logged[0]["error"]


# --------------------------------------------------------------------------- 10, 12: the start and the events


class SlowListing(Recording):
    def __init__(self, store, seconds):
        super().__init__(store)
        self.seconds = seconds

    def list(self, bucket, prefix):
        time.sleep(self.seconds)
        return self.inner.list(bucket, prefix)


def test_a_slow_start_up_listing_yields_to_the_final_sync(tmp_path):
    channel = Channel(tmp_path, SlowListing(LocalStore(), 30))
    write(channel.root / "a.txt", b"a")
    final_asked = threading.Event()
    threading.Timer(0.2, final_asked.set).start()
    started = time.monotonic()

    channel.sync.start(stop=final_asked)
    result = channel.cycle(final=True, deadline=time.monotonic() + 10)

    assert time.monotonic() - started < 30  # a bound at the wrong wait: the listing's 30 s, not a speed budget
    assert result.missing == [] and channel.uploaded() == {"a.txt": b"a"}
    assert channel.log.fields("the store's listing is not back: the final sync goes on with the manifest")


def test_a_start_up_listing_that_comes_back_in_time_is_used_by_the_final_sync(tmp_path):
    """A pre-downloaded file already in the store is adopted, not uploaded again, even when the final sync was
    asked for before the listing came back."""
    channel = Channel(tmp_path, SlowListing(LocalStore(), 0.5))
    write(channel.root / "a.txt", b"a")
    channel.cycle(final=True)
    channel.sync = channel.restarted()
    (channel.state / f"{next(p.name for p in channel.state.glob('*.manifest.json'))}").unlink()  # a new pod
    channel.store.written.clear()
    final_asked = threading.Event()
    final_asked.set()

    channel.sync.start(stop=final_asked)
    result = channel.cycle(final=True, deadline=time.monotonic() + 10)

    assert (result.files, result.missing, channel.store.written) == (0, [], [])


def test_a_final_sync_that_left_files_out_says_incomplete_not_completed(tmp_path):
    store = Refusing(LocalStore(), word="b-")
    channel = Channel(tmp_path, store)
    write(channel.root / "a.txt", b"a")
    write(channel.root / "b-1.txt", b"b")

    result = channel.cycle(final=True)

    assert result.files == 1 and result.missing == ["b-1.txt (refused by the store)"]
    assert channel.log.fields("output upload completed") == []
    incomplete = channel.log.fields("output upload incomplete")
    assert incomplete and incomplete[0]["missing"] == 1 and incomplete[0]["final"] is True


# --------------------------------------------------------------------------- 13: links out of the folder


def test_a_hard_link_to_a_file_outside_the_folder_is_refused_like_a_symbolic_link(tmp_path):
    root, outside = tmp_path / "out", tmp_path / "secret"
    root.mkdir()
    outside.write_bytes(b"root only")
    os.chmod(outside, 0o600)
    os.link(outside, root / "hard.bin")
    os.symlink(outside, root / "soft.bin")
    (root / "inside.bin").write_bytes(b"mine")
    os.link(root / "inside.bin", root / "inside-again.bin")  # every name inside: taken
    log = Log()

    found = tree.scan(str(root), tree.Skipped(log.warning))

    assert set(found) == {"inside.bin", "inside-again.bin"}
    reasons = {field["path"]: field["reason"] for field in log.fields("sync skipped a file")}
    assert reasons == {str(root / "hard.bin"): "a hard link to a file outside the folder is not followed",
                       str(root / "soft.bin"): "a symbolic link to outside the folder is not followed"}


def test_a_read_only_state_folder_keeps_the_records_in_memory_too(tmp_path, tmpfs):
    import subprocess

    state = tmpfs("state", "1m")
    remounted = subprocess.run(["mount", "-o", "remount,ro", str(state)], capture_output=True)
    if remounted.returncode != 0:
        pytest.skip(f"cannot remount read-only: {remounted.stderr.decode().strip()}")
    channel = Channel(tmp_path)
    channel.state = state
    channel.sync = channel.restarted()
    write(channel.root / "big.bin", random_bytes(LARGE))
    write(channel.root / "small.txt", b"small")

    result = channel.cycle()

    assert (result.files, result.error) == (2, None)
    assert set(channel.uploaded()) == {"big.bin", "small.txt"}
    said = channel.log.fields("the sync manifest cannot be written: kept in memory (a later runtime uploads these "
                              "files again)")
    assert len(said) == 1 and "Read-only file system" in said[0]["error"]
