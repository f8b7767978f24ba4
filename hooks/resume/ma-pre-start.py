"""Example pre-start hook: tell the workers which checkpoint to resume from.

Copy this file next to the boot file (or to the top of the code directory) as
`ma-pre-start.py`. ma_runtime runs it once per pod with the job's interpreter, after
stage-in, so the checkpoints a pre-downloaded output channel brought back are already
there. It looks in `MA_RESUME_DIR`, or else in the first output channel's folder
(`${MA_MOUNT_PATH}/outputs/*_0`), picks the newest checkpoint and appends
`MA_RESUME_CHECKPOINT=<absolute path>` to the file named by `MA_HOOK_ENV_FILE`, which
every worker of every attempt then sees. Finding none is not an error: a first run has
nothing to resume.

Decisions:
- A checkpoint is a file or a folder at the top of that directory whose name looks like
  one (`*.pt`, `*.pth`, `*.ckpt`, `*.safetensors`, `checkpoint*`, `iter_*`,
  `global_step*`): the layouts of PyTorch, MindSpore, LLaMA-Factory, MindSpeed-LLM and
  VeRL. Anything that looks half-written is skipped (a leading dot, `.tmp`, `.temp`,
  `.partial`, `.part`, `.incomplete`, `.lock`, a trailing `~`), and so are an empty file
  and a folder holding no non-empty file of another name: a save that died early leaves
  those.
- Newest by modification time, not by name: names sort badly (`ckpt_9` after `ckpt_10`)
  and frameworks name them differently. A folder's time is its newest file's, because a
  folder's own time changes only when entries are added or removed, and copies and
  downloads do not keep it. Equal times go to the greater name.
- A missing directory means a first run (exit 0); one that exists but cannot be read, or
  an env file that cannot be written, stops the job (exit 1), since starting from
  scratch would overwrite the checkpoints it failed to see.
- The path goes into the env file as bytes, exactly as the file system holds it; a value
  with a line break uses the `NAME<<DELIMITER` form.
- A value the job set itself for `MA_RESUME_CHECKPOINT` is kept.
- Standard library only, and Python 3.6 or later, because the hook runs with the job's
  interpreter (preset images ship 3.7 and 3.9).
"""

import fnmatch
import os
import re
import sys

CHECKPOINT_NAMES = ("*.pt", "*.pth", "*.ckpt", "*.safetensors", "checkpoint*", "iter_*", "global_step*")
PARTIAL_NAMES = (".*", "*.tmp", "*.temp", "*.partial", "*.part", "*.incomplete", "*.lock", "*~")
RESULT = "MA_RESUME_CHECKPOINT"


class HookFailed(Exception):
    """Stops the job: the line says what was wrong."""


def main():
    if os.environ.get(RESULT):
        say(f"{RESULT} is already set by the job ({shown(os.environ[RESULT])}); kept")
        return 0
    try:
        folder = resume_dir()
        if folder is None:
            expected = shown(os.path.join(mount_path(), "outputs", "*_0"))
            say(f"no checkpoint to resume from: no output folder {expected} (set MA_RESUME_DIR)")
            return 0
        newest = newest_checkpoint(folder)
        if newest is None:
            say(f"no checkpoint to resume from in {shown(folder)}")
            return 0
        say(f"resume from {shown(newest)}")
        pass_to_workers(RESULT, newest)
    except HookFailed as failure:
        say(str(failure))
        return 1
    return 0


def mount_path():
    home = os.environ.get("MA_HOME") or "/home/ma-user"
    return os.environ.get("MA_MOUNT_PATH") or os.path.join(home, "modelarts")


def resume_dir():
    """The folder to look in, absolute (the workers may run elsewhere), or None when there is none yet."""
    chosen = os.environ.get("MA_RESUME_DIR") or first_output_channel()
    if chosen is None or not os.path.lexists(chosen):
        return None
    return os.path.abspath(chosen)


def first_output_channel():
    """`outputs/<name>_0`: the job's first output channel (listed, not globbed: the mount path may hold `[`)."""
    outputs = os.path.join(mount_path(), "outputs")
    try:
        names = sorted(os.listdir(outputs))
    except OSError:
        return None  # no output channel at all
    channels = [name for name in names if name.endswith("_0") and os.path.isdir(os.path.join(outputs, name))]
    return os.path.join(outputs, channels[0]) if channels else None


def newest_checkpoint(folder):
    try:
        with os.scandir(folder) as entries:
            names = [entry.name for entry in entries]
    except OSError as error:
        raise HookFailed(f"cannot read the resume folder {shown(folder)}: {error.strerror or error}; "
                         "fix it or point MA_RESUME_DIR elsewhere") from None
    timed = []
    for name in names:
        if is_candidate(name):
            when = saved_at(os.path.join(folder, name))
            if when is not None:
                timed.append((when, os.fsencode(name), name))
    return os.path.join(folder, max(timed)[2]) if timed else None


def is_candidate(name):
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in CHECKPOINT_NAMES) and not is_partial(name)


def is_partial(name):
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in PARTIAL_NAMES)


def saved_at(path):
    """The modification time of a non-empty file, or of the newest such file in a folder; None for neither."""
    try:
        stats = os.stat(path)
    except OSError:
        return None  # gone since the listing, or a dangling link
    if os.path.isdir(path):
        return newest_file_in(path)
    return stats.st_mtime_ns if stats.st_size > 0 and os.path.isfile(path) else None


def newest_file_in(folder):
    newest = None
    for root, _dirs, names in os.walk(folder):
        for name in names:
            if is_partial(name):
                continue
            try:
                stats = os.stat(os.path.join(root, name))
            except OSError:
                continue
            if stats.st_size > 0 and (newest is None or stats.st_mtime_ns > newest):
                newest = stats.st_mtime_ns
    return newest


def pass_to_workers(name, value):
    target = os.environ.get("MA_HOOK_ENV_FILE")
    if not target:
        say(f"MA_HOOK_ENV_FILE is not set (not run by ma_runtime?): {name} reaches no worker")
        return
    try:
        with open(target, "ab") as sink:
            sink.write(env_entry(name, os.fsencode(value)))
    except OSError as error:
        raise HookFailed(f"cannot append to MA_HOOK_ENV_FILE {shown(target)}: {error.strerror or error}") from None


def env_entry(name, value):
    """`NAME=value`, or the here-document form when a line break would split the value."""
    name = name.encode()
    if b"\n" not in value and b"\r" not in value:
        return name + b"=" + value + b"\n"
    delimiter = b"EOF"
    while delimiter in value.splitlines():
        delimiter = f"EOF_{os.urandom(8).hex()}".encode()
    return name + b"<<" + delimiter + b"\n" + value + b"\n" + delimiter + b"\n"


def shown(text):
    """Text safe for one log line: bytes that are not UTF-8 and control characters escaped."""
    readable = os.fsencode(text).decode("utf-8", "backslashreplace")
    return re.sub(r"[\x00-\x1f\x7f]", lambda found: f"\\x{ord(found.group()):02x}", readable)


def say(line):
    # Bytes, not print(): a stdout without UTF-8 must not turn an odd file name into a traceback.
    sys.stdout.buffer.write(f"[resume] {line}\n".encode("utf-8", "backslashreplace"))
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
