"""Which way the sync sends a file that is not small (transfer.upload_file, issue 29): in one PUT below the
large threshold, in parts at or above it or when an unfinished multipart upload of it is recorded; and a PUT
as safe as parts: what the store keeps is a version of the file whole, never one torn by a change mid-send.

Moto through the real OBS SDK, so the store's side is what is checked: the object's ETag (a single PUT's is the
MD5 of the bytes; parts give `<hex>-<count>`) and the multipart uploads the server lists; LocalStore beside it
where the local backend keeps the same rule.
"""

import hashlib
import os

import pytest

from ma_runtime.storage.base import TransientError
from ma_runtime.storage.local import LocalStore
from ma_runtime.sync import reading
from tests.unit.test_sync import PAST_NS, Channel, MiB, ObsChannel, Recording, random_bytes, write

THRESHOLD = 16 * MiB  # the large threshold of these channels
BIG = 12 * MiB  # ObsChannel's big.bin: above SMALL_LIMIT (where parts began before issue 29), below THRESHOLD


class ChangedWhileSent(Recording):
    """Runs `action` once during the next PUT from a file: after every byte but the last ones was read (and
    most sent), right before the check that lets the last ones go."""

    def __init__(self, store, action=None):
        super().__init__(store)
        self.action = action

    def put_file(self, bucket, key, path, *, size=None, unchanged=None):
        def check():
            action, self.action = self.action, None
            if action is not None:
                action()
            return unchanged()

        return super().put_file(bucket, key, path, size=size, unchanged=check)


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def etag(obs: ObsChannel, key: str) -> str:
    return obs.endpoint.s3.head_object(Bucket=obs.bucket, Key=key)["ETag"].strip('"')


def truncate(path):
    os.truncate(path, 6 * MiB)


def append(path, data: bytes) -> None:
    with open(path, "ab") as handle:
        handle.write(data)


IN_PLACE = {"rewritten in place": lambda path: path.write_bytes(random_bytes(BIG, seed=7)) and None,
            "appended to": lambda path: append(path, b"more"), "truncated": truncate}


def test_a_file_below_the_large_threshold_goes_up_in_one_put(obs_endpoint, tmp_path):
    obs = ObsChannel(obs_endpoint, tmp_path, large_threshold=THRESHOLD)
    assert reading.SMALL_LIMIT < BIG < THRESHOLD

    result = obs.channel.cycle(final=True)

    assert (result.files, result.bytes, result.missing, result.error) == (1, BIG, [], None)
    data = obs.big.read_bytes()
    assert obs.object("out/big.bin") == data
    assert etag(obs, "out/big.bin") == md5(data)  # one PUT: its ETag is the MD5, parts would end in "-3"
    assert (obs.store.whole_puts, obs.store.parts, obs.unfinished()) == (["out/big.bin"], [], [])
    assert obs.channel.parts_records() == []


def test_a_file_at_the_large_threshold_goes_up_in_parts(obs_endpoint, tmp_path):
    obs = ObsChannel(obs_endpoint, tmp_path, large_threshold=BIG)

    result = obs.channel.cycle(final=True)

    assert (result.files, result.missing, result.error) == (1, [], None)
    assert obs.object("out/big.bin") == obs.big.read_bytes()
    assert etag(obs, "out/big.bin").endswith("-3")  # 12 MiB in 5 MiB parts
    assert (obs.store.whole_puts, sorted(obs.store.parts)) == ([], [1, 2, 3])


def test_an_interrupted_multipart_upload_of_a_file_below_the_threshold_is_resumed_in_parts(obs_endpoint, tmp_path):
    """The record of an unfinished upload wins over the size rule: the parts sent are not sent again, and the
    server is left with no unfinished upload."""
    obs = ObsChannel(obs_endpoint, tmp_path, large_threshold=THRESHOLD)
    with pytest.raises(TransientError, match="interrupted"):
        obs.multipart().run()  # part 1 sent, then stopped
    obs.store.parts.clear()
    obs.channel.sync.start()

    result = obs.channel.cycle(final=True)

    assert (result.files, result.missing, result.error) == (1, [], None)
    assert (sorted(obs.store.parts), obs.store.whole_puts) == ([2, 3], [])
    assert obs.object("out/big.bin") == obs.big.read_bytes()
    assert (obs.channel.parts_records(), obs.unfinished()) == ([], [])


@pytest.mark.parametrize("change", list(IN_PLACE), ids=list(IN_PLACE))
def test_a_file_changed_in_place_during_its_put_leaves_the_stored_version_whole(obs_endpoint, tmp_path, change):
    """The PUT's last bytes wait for the check: a change mid-send leaves the request unfinished, so the server
    keeps the version before (a PUT is atomic); the file goes up next cycle, whole."""
    obs = ObsChannel(obs_endpoint, tmp_path, large_threshold=THRESHOLD, store=ChangedWhileSent)
    assert obs.channel.cycle(final=True).files == 1
    first = obs.big.read_bytes()
    write(obs.big, random_bytes(BIG, seed=2), mtime_ns=PAST_NS + 10**9)  # a new version, changed while sent
    obs.store.action = lambda: IN_PLACE[change](obs.big)

    held = obs.channel.cycle(final=True)

    assert (held.files, held.missing, held.error) == (0, ["big.bin"], None)
    assert obs.object("out/big.bin") == first
    assert obs.unfinished() == []
    taken = obs.channel.cycle(final=True)
    assert (taken.files, taken.missing) == (1, [])
    assert obs.object("out/big.bin") == obs.big.read_bytes()


@pytest.mark.parametrize("change", list(IN_PLACE), ids=list(IN_PLACE))
def test_a_local_target_keeps_the_same_rule(tmp_path, change):
    store = ChangedWhileSent(LocalStore())
    channel = Channel(tmp_path, store, large_threshold=THRESHOLD)
    path = write(channel.root / "big.bin", random_bytes(BIG))
    store.action = lambda: IN_PLACE[change](path)

    held = channel.cycle(final=True)

    assert (held.missing, channel.uploaded()) == (["big.bin"], {})
    taken = channel.cycle(final=True)
    assert (taken.missing, store.whole_puts, store.parts) == ([], [str(channel.dest / "big.bin")], [])
    assert channel.uploaded() == {"big.bin": path.read_bytes()}


def test_a_log_growing_during_its_put_goes_up_as_the_snapshot_the_scan_saw(obs_endpoint, tmp_path):
    obs = ObsChannel(obs_endpoint, tmp_path, large_threshold=THRESHOLD, store=ChangedWhileSent)
    (tmp_path / "logs").mkdir()
    log_channel = Channel(tmp_path / "logs", obs.store, url=f"obs://{obs.bucket}/logs/", is_log=True,
                          large_threshold=THRESHOLD)
    snapshot = random_bytes(6 * MiB)
    path = write(log_channel.root / "train.log", snapshot)
    obs.store.action = lambda: append(path, b"a line written during the upload\n")

    result = log_channel.cycle()

    assert (result.files, result.bytes, result.error) == (1, len(snapshot), None)
    assert obs.object("logs/train.log") == snapshot  # the first bytes, exactly: a prefix, never a torn mix
    assert obs.store.whole_puts == ["logs/train.log"]
