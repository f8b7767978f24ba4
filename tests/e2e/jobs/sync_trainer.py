"""A trainer that checkpoints into its output dir the ways real ones do, for the output sync tests.

Run as `python sync_trainer.py --train_url=<dir>` (the runtime appends the argument). Every
SYNC_EVERY seconds (default 0.3) for SYNC_SECONDS (default 5) it saves one checkpoint, turn by turn:

- `ckpt-<n>.bin`: written to a temporary name beside it, then renamed (torch.save to a temp file);
- `slow-<n>.bin`: written in place in several writes with SYNC_PAUSE (default 0.1) seconds between;
- `iter_<n>/mp_rank_0<k>/model.bin` shards (the second over 8 MiB: a multipart upload), then
  `iter_<n>/commit.done` listing each shard's sha256, then
  the root `latest_checkpointed_iteration.txt` (the iteration, then the same list with paths from
  the root): Megatron's layout, where a marker written last says the folder is complete.

Every data file ends with the sha256 (hex) of what comes before it, so any copy of it proves by itself
whether it is whole: a torn upload cannot pass for a checkpoint (tests/e2e/test_sync.py checks it).

SYNC_CONTROL=<dir> (outside the output dir) lets the test steer: the trainer keeps `<dir>/busy` while
it writes a checkpoint; after its SYNC_SECONDS it waits (up to 60 s, then exits 4) for `<dir>/finish`,
writing `late.bin` once `<dir>/late` appears. On SIGTERM it completes the checkpoint under way, saves
`emergency/` (shards and `emergency/save.done`), and dies of SIGTERM as an unhandled one would.
"""

import argparse
import hashlib
import os
import signal
import sys
import time

# A small shard and one past the 8 MiB multipart threshold: the marker must wait for the slow one too.
SHARD_SIZES = (60_000, 9 * 1024 * 1024)
# The pause between the writes of a file written in place; the sync's two looks must see it change.
PAUSE = float(os.environ.get("SYNC_PAUSE", "0.1"))
MARKER_ROOT = "latest_checkpointed_iteration.txt"


def say(text):
    """One line in one write(): the runtime's lines and ours never interleave mid-line."""
    os.write(1, (text + "\n").encode())


def whole_content(size):
    payload = os.urandom(size)
    return payload + hashlib.sha256(payload).hexdigest().encode()


class Trainer:
    def __init__(self, out, control):
        self.out, self.control = out, control
        self.stop_requested = False

    def flag(self, name):
        return bool(self.control) and os.path.exists(os.path.join(self.control, name))

    def set_busy(self, busy):
        if not self.control:
            return
        path = os.path.join(self.control, "busy")
        if busy:
            open(path, "w").close()
        elif os.path.exists(path):
            os.unlink(path)

    def write_slowly(self, path, data, pieces, pause):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        step = -(-len(data) // pieces)
        with open(path, "wb") as handle:
            for start in range(0, len(data), step):
                handle.write(data[start:start + step])
                handle.flush()
                time.sleep(pause)
        return hashlib.sha256(data).hexdigest()

    def save_renamed(self, n):
        final = os.path.join(self.out, f"ckpt-{n}.bin")
        temporary = os.path.join(self.out, f".ckpt-{n}.bin.tmp")
        self.write_slowly(temporary, whole_content(200_000), 2, 0.05)
        os.replace(temporary, final)

    def save_in_place(self, n):
        self.write_slowly(os.path.join(self.out, f"slow-{n}.bin"), whole_content(150_000), 5, PAUSE)

    def save_folder(self, name, marker, root_marker_iteration=None):
        entries = []
        for k, size in enumerate(SHARD_SIZES):
            shard = f"mp_rank_0{k}/model.bin"
            digest = self.write_slowly(os.path.join(self.out, name, shard), whole_content(size), 2, PAUSE / 2)
            entries.append((shard, digest))
        listing = "".join(f"{path} {digest}\n" for path, digest in entries)
        with open(os.path.join(self.out, name, marker), "w") as handle:
            handle.write(listing)
        if root_marker_iteration is not None:
            rooted = "".join(f"{name}/{path} {digest}\n" for path, digest in entries)
            with open(os.path.join(self.out, MARKER_ROOT), "w") as handle:
                handle.write(f"{root_marker_iteration}\n{rooted}")

    def checkpoint(self, n):
        self.set_busy(True)
        kind = n % 3
        if kind == 0:
            self.save_renamed(n)
        elif kind == 1:
            self.save_in_place(n)
        else:
            self.save_folder(f"iter_{n:07d}", "commit.done", root_marker_iteration=n)
        self.set_busy(False)

    def on_sigterm(self, signum, frame):
        self.stop_requested = True  # the checkpoint under way completes first, as a careful trainer does

    def emergency_save_and_die(self):
        self.save_folder("emergency", "save.done")
        say("saved on SIGTERM")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)

    def train(self, seconds, every):
        started, n = time.monotonic(), 0
        while time.monotonic() - started < seconds:
            self.checkpoint(n)
            n += 1
            if self.stop_requested:
                self.emergency_save_and_die()
            time.sleep(every)
        say(f"trained: {n} checkpoints")

    def wait_for_finish(self):
        deadline = time.monotonic() + 60
        late_written = False
        while self.control and not self.flag("finish"):
            if self.stop_requested:
                self.emergency_save_and_die()
            if self.flag("late") and not late_written:
                self.write_slowly(os.path.join(self.out, "late.bin"), whole_content(10_000), 1, 0)
                late_written = True
                say("late.bin written")
            if time.monotonic() > deadline:
                say("never told to finish")
                sys.exit(4)
            time.sleep(0.05)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_url", required=True)
    args, _ = parser.parse_known_args()
    trainer = Trainer(args.train_url, os.environ.get("SYNC_CONTROL", ""))
    signal.signal(signal.SIGTERM, trainer.on_sigterm)
    trainer.train(float(os.environ.get("SYNC_SECONDS", "5")), float(os.environ.get("SYNC_EVERY", "0.3")))
    trainer.wait_for_finish()
    say("done")


if __name__ == "__main__":
    main()
