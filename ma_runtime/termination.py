"""The termination message: why the run ended, as one JSON document.

Written on every non-zero exit to the log directory, and to Kubernetes'
termination-message file when that file already exists and is writable (the
kubelet mounts it; we never create it). A reason the command wrote there first
is kept: the training code knows its failure better than we do.
"""

import json
import os
import stat
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from ma_runtime.util import files

# Kubernetes truncates a container's termination message at 4096 bytes.
MAX_BYTES = 4096
# A tail line longer than this is cut: one 16 KiB line must not push every other line out.
TAIL_LINE_CHARS = 1024
DEFAULT_PATH = "/dev/termination-log"
# Attempts kept when the message must shrink: the last ones say whether the failures were the same.
KEPT_ATTEMPTS = 8
# Files kept in `unsynced` when the message must shrink; a last entry says how many more there were.
KEPT_UNSYNCED = 10
PATH_ENV = "MA_RUNTIME_TERMINATION_LOG"


def kubernetes_path(environ) -> Path:
    # Pods may move it with terminationMessagePath; the variable follows them. Read raw, not as a setting: the
    # message must be written even when the settings fail to load (that failure is what it reports).
    return Path(environ.get(PATH_ENV) or DEFAULT_PATH)


def snapshot(path: Path) -> Optional[bytes]:
    """What the file holds before the command runs (None when it is not there, or not a regular file:
    a FIFO or /dev/zero at the path must neither block nor fill memory). Read up to a bound: the
    kubelet reads no more than MAX_BYTES of it anyway."""
    if not _is_regular(path):
        return None
    try:
        with open(path, "rb") as f:
            return f.read(MAX_BYTES * 4)
    except OSError:
        return None


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def build(
    *,
    stage: str,
    run_id: Optional[str] = None,
    category: str,
    exit_code: int,
    reason: str,
    hint: str = "",
    signal: Optional[str] = None,
    rank: Optional[int] = None,
    tail: Optional[List[str]] = None,
    attempt: Optional[int] = None,
    attempts: Optional[List[Dict[str, Any]]] = None,
    command_exit_code: Optional[int] = None,
    unsynced: Optional[List[str]] = None,
    hook_exit_code: Optional[int] = None,
    origin: Optional[Dict[str, Any]] = None,
    secondary: Optional[List[Dict[str, Any]]] = None,
    masker=None,
) -> Dict[str, Any]:
    message = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "run_id": run_id,  # the run_id of the run's log lines: which run this verdict belongs to
        "stage": stage,
        "category": category,
        "exit_code": exit_code,
        "signal": signal,
        "rank": rank,
        "reason": reason,
        "hint": hint,
        "tail": list(tail or []),
    }
    # Only where there were attempts: the message of a run that never started the command stays as it was.
    if attempt is not None:
        message["attempt"] = attempt  # the last start of the command (its MA_PROC_START_CNT)
    if command_exit_code is not None:
        message["command_exit_code"] = command_exit_code  # the last attempt's own code, under an exit 82
    if hook_exit_code is not None:
        message["hook_exit_code"] = hook_exit_code  # pip's, set_env.sh's or the pre-start script's own status
    if attempts:
        message["attempts"] = list(attempts)  # one entry per start of the command, oldest first
    if unsynced:
        message["unsynced"] = list(unsynced)  # `<channel>: <path>` the final sync did not upload
    if origin:
        message["origin"] = dict(origin)  # a multi-node job: the first failure of the attempt by the store's clock
    if secondary:
        message["secondary"] = list(secondary)  # the failures after it, never the cause
    return masker.data(message) if masker else message


def render(message: Dict[str, Any]) -> bytes:
    """JSON within MAX_BYTES: tail lines cut to TAIL_LINE_CHARS, then the oldest go, then long texts are cut.
    The last line is the likeliest to explain the failure, so it is the last to go."""
    tail = [line if len(line) <= TAIL_LINE_CHARS else line[:TAIL_LINE_CHARS] + "..." for line in message.get("tail")
            or []]
    message = dict(message, tail=tail)
    data = _dump(message)
    # Of a long list of attempts, the oldest go first (down to the last KEPT_ATTEMPTS), then the tail's lines.
    while len(data) > MAX_BYTES and len(message.get("attempts") or ()) > KEPT_ATTEMPTS:
        message["attempts"] = message["attempts"][1:]
        data = _dump(message)
    unsynced = message.get("unsynced") or []
    if len(data) > MAX_BYTES and len(unsynced) > KEPT_UNSYNCED:
        message["unsynced"] = [*unsynced[:KEPT_UNSYNCED],
                               f"... and {len(unsynced) - KEPT_UNSYNCED} more (the task log lists them)"]
        data = _dump(message)
    while len(data) > MAX_BYTES and message["tail"]:
        message["tail"].pop(0)
        data = _dump(message)
    if len(data) > MAX_BYTES:
        for key in ("hint", "reason"):
            message[key] = message[key][:512]
        data = _dump(message)
    return data


def _dump(message: Dict[str, Any]) -> bytes:
    # backslashreplace: a path or argument with bytes that are not UTF-8 is written escaped, never a crash.
    return json.dumps(message, ensure_ascii=False).encode("utf-8", "backslashreplace")


def write(message: Dict[str, Any], log_path: Optional[Path], k8s_path: Path, k8s_before: Optional[bytes]) -> bool:
    """Writes both copies; returns False when the command's own k8s message was kept. Raises OSError
    (files.NotAFile when something other than a file sits at the log directory's path)."""
    data = render(message)
    if log_path is not None:
        files.write_atomically(log_path, data)
    if k8s_before is None or not _writable_file(k8s_path):
        return True
    current = snapshot(k8s_path)
    if current and current != k8s_before:
        return False
    # Overwrite in place: the kubelet watches this very inode, a rename would hide it.
    with open(k8s_path, "wb") as f:
        f.write(data)
    return True


def _writable_file(path: Path) -> bool:
    # A regular file only: opening a FIFO someone put there would block the exit.
    return _is_regular(path) and os.access(path, os.W_OK)


def remove_stale(log_path: Path) -> bool:
    """Removes the message an earlier run left in the log directory (it would look like this run's);
    True when there was one. Only a regular file is removed."""
    try:
        if not stat.S_ISREG(os.lstat(log_path).st_mode):
            return False
        os.unlink(log_path)
    except OSError:
        return False
    return True
