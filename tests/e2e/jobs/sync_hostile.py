"""Fills its output dir with what an uploader must not trip on, beside files it must upload.

Run as `python sync_hostile.py --train_url=<dir>`. HOSTILE_OUTSIDE names a file outside the output
dir. Creates, under the output dir:

- `good/a.bin`, `good/b.bin`: plain files (uploaded);
- `inside-link`: a symlink to `good/a.bin` (uploaded with a.bin's content);
- `outside-link`: a symlink to HOSTILE_OUTSIDE (skipped: it leads out of the channel);
- `folder-link`: a symlink to `good` (skipped: a folder reached twice, or a loop, is not followed);
- `fifo`: a named pipe, `sock`: a unix socket (skipped: not files; opening the pipe would block);
- `locked.bin`: mode 000 (skipped when the runtime runs without CAP_DAC_OVERRIDE, as the test runs it);
- `bad-name-\\xff.bin`: a name that is not UTF-8 (skipped: no object key can name it).

Then it stays HOSTILE_SECONDS (default 1.5) so periodic cycles see the tree too, and exits 0.
"""

import argparse
import os
import socket
import time


def say(text):
    os.write(1, (text + "\n").encode())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_url", required=True)
    args, _ = parser.parse_known_args()
    os.chdir(args.train_url)  # relative names: a unix socket's path must stay under 108 bytes
    os.makedirs("good", exist_ok=True)
    with open("good/a.bin", "wb") as handle:
        handle.write(b"a" * 1000)
    with open("good/b.bin", "wb") as handle:
        handle.write(b"b" * 2000)
    os.symlink("good/a.bin", "inside-link")
    os.symlink(os.environ["HOSTILE_OUTSIDE"], "outside-link")
    os.symlink("good", "folder-link")
    os.mkfifo("fifo")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind("sock")
    listener.close()  # the socket file stays
    with open("locked.bin", "wb") as handle:
        handle.write(b"locked")
    os.chmod("locked.bin", 0)
    with open(b"bad-name-\xff.bin", "wb") as handle:
        handle.write(b"bad name")
    say("hostile tree ready")
    time.sleep(float(os.environ.get("HOSTILE_SECONDS", "1.5")))


if __name__ == "__main__":
    main()
