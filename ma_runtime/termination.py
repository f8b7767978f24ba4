"""The termination message: why the run ended, as one JSON document.

Written on every non-zero exit to the log directory, and to Kubernetes'
termination-message file when that file already exists and is writable (the
kubelet mounts it; we never create it). A reason the command wrote there first
is kept: the training code knows its failure better than we do.
"""

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

# Kubernetes truncates a container's termination message at 4096 bytes.
MAX_BYTES = 4096
DEFAULT_PATH = "/dev/termination-log"
PATH_ENV = "MA_RUNTIME_TERMINATION_LOG"


def kubernetes_path(environ) -> Path:
    # Pods may move it with terminationMessagePath; the variable follows them.
    return Path(environ.get(PATH_ENV) or DEFAULT_PATH)


def snapshot(path: Path) -> Optional[bytes]:
    """What the file holds before the command runs (None when it is not there)."""
    try:
        return path.read_bytes()
    except OSError:
        return None


def build(
    *,
    stage: str,
    category: str,
    exit_code: int,
    reason: str,
    hint: str = "",
    signal: Optional[str] = None,
    rank: Optional[int] = None,
    tail: Optional[List[str]] = None,
    masker=None,
) -> Dict[str, Any]:
    message = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "stage": stage,
        "category": category,
        "exit_code": exit_code,
        "signal": signal,
        "rank": rank,
        "reason": reason,
        "hint": hint,
        "tail": list(tail or []),
    }
    return masker.data(message) if masker else message


def render(message: Dict[str, Any]) -> bytes:
    """JSON within MAX_BYTES: the oldest tail lines go first, then long lines are cut."""
    message = dict(message, tail=list(message.get("tail") or []))
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
    return json.dumps(message, ensure_ascii=False).encode("utf-8")


def write(message: Dict[str, Any], log_path: Optional[Path], k8s_path: Path, k8s_before: Optional[bytes]) -> bool:
    """Writes both copies; returns False when the command's own k8s message was kept."""
    data = render(message)
    if log_path is not None:
        _write_atomically(log_path, data)
    if k8s_before is None or not os.access(k8s_path, os.W_OK):
        return True
    current = snapshot(k8s_path)
    if current and current != k8s_before:
        return False
    # Overwrite in place: the kubelet watches this very inode, a rename would hide it.
    with open(k8s_path, "wb") as f:
        f.write(data)
    return True


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
