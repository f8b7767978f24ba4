"""Stage-in: the code directory, the inputs and the pre-downloaded outputs, before the command starts.

Local paths follow the platform (001:815-824, 001:1568-1573, 001:6827):
- code `obs://b/path/demo-code` -> `${MA_JOB_DIR}/demo-code` (the last path part kept);
- input `data_url` (first in the list) -> `${MA_MOUNT_PATH}/inputs/data_url_0`;
- output `train_url` -> `${MA_MOUNT_PATH}/outputs/train_url_0` (created even without pre-download).
A prefix's local path is that directory; a single object lands inside it and the
command is given the file's path. The command hears of each channel as
`--<name>=<local path>` (mode argument) or as the variable `<name>` (mode env).

What was staged is recorded in `${MA_MOUNT_PATH}/.ma-runtime/staged.json`; a
restart in the same pod (MA_PROC_START_CNT > 1) does not fetch it again. The
platform's size limits (§5.1-5.3) are warnings, not errors.
"""

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ma_runtime.spec import Channel, JobSpec
from ma_runtime.storage import url as storage_url
from ma_runtime.storage.base import NotFound, StorageError

# (total bytes, files, single file bytes) the platform's console allows (001:1467, 1555, 1606).
LIMITS = {
    "code": (5 << 30, 1000, None),
    "inputs": (10 << 30, 1000, 1 << 30),
    "outputs": (1 << 30, 128, 128 << 20),
}


@dataclasses.dataclass
class Staged:
    """What the command is told: arguments appended before the hyperparameters, and variables."""

    arguments: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    env: Dict[str, str] = dataclasses.field(default_factory=dict)


def code_dir(spec: JobSpec) -> Path:
    """`obs://b/path/demo-code` -> `${MA_JOB_DIR}/demo-code`: the last path part is kept (001:821-824)."""
    return spec.job_dir / storage_url.parse(spec.code_url).last_part


def planned(spec: JobSpec) -> Staged:
    """What stage-in will tell the command, without fetching anything (for `ma-runtime plan`).

    An input URL without a trailing slash that names one object is given as the file in its
    folder once fetched; the plan shows the folder."""
    staged = Staged()
    for channel in (*spec.inputs, *spec.outputs):
        _tell(staged, channel, channel.local_dir(spec.mount_path))
    return staged


def stage_in(spec: JobSpec, environ, log) -> Staged:
    staged = Staged()
    if not (spec.code_url or spec.inputs or spec.outputs):
        return staged
    record = _Record(spec.state_dir / "staged.json", reuse=spec.proc_start_cnt > 1)
    if spec.code_url:
        _fetch(spec, environ, log, record, "code", storage_url.parse(spec.code_url), code_dir(spec))
    for channel in spec.inputs:
        target = _fetch(spec, environ, log, record, "inputs", storage_url.parse(channel.url),
                        channel.local_dir(spec.mount_path), channel)
        _tell(staged, channel, target)
    for channel in spec.outputs:
        target = channel.local_dir(spec.mount_path)
        target.mkdir(parents=True, exist_ok=True)
        if channel.predownload:
            _fetch(spec, environ, log, record, "outputs", _as_prefix(channel.url), target, channel)
        _tell(staged, channel, target)
    return staged


def _fetch(spec, environ, log, record, kind: str, location, target: Path, channel: Optional[Channel] = None) -> Path:
    """Downloads one location; returns the path the command should be given."""
    what = _event_name(kind, channel)
    previous = record.get(location.text, target)
    if previous:
        log.info(f"{what} already staged; not fetched again", url=location.text, path=previous)
        return Path(previous)
    from ma_runtime.storage import transfer
    from ma_runtime.storage.stores import open_store

    started = time.monotonic()
    try:
        store = open_store(location, spec, environ)
        dest = target if location.is_prefix else _single_target(store, location, target)
        summary = transfer.download(store, location, dest, transfer.TransferOptions.from_spec(spec, spec.state_dir),
                                    log)
    except StorageError as exc:
        # One line that names what failed and where; the engine's message says why.
        raise type(exc)(f"{what} failed: {location.text}: {exc.reason}", hint=exc.hint, stage="stage-in") from None
    elapsed = round(time.monotonic() - started, 3)
    log.info(f"{what} completed", url=location.text, path=str(dest), files=summary.files, bytes=summary.bytes,
             skipped=summary.skipped, refused=len(summary.refused), elapsed_s=elapsed)
    _warn_over_limits(log, kind, what, dest)
    record.add(location.text, target, dest)
    return dest


def _single_target(store, location, target: Path) -> Path:
    """A prefix written without its trailing slash is still a directory; an object lands inside `target`."""
    try:
        store.head(location.bucket, location.key)
    except NotFound:
        return target  # the engine decides between a prefix and a missing URL
    return target / location.key.rstrip("/").rsplit("/", 1)[-1]


def _as_prefix(url: str):
    location = storage_url.parse(url)
    return location if location.is_prefix else storage_url.parse(url.rstrip("/") + "/")


def _event_name(kind: str, channel: Optional[Channel]) -> str:
    """The platform's event wording (001:9969-9979), in English."""
    if kind == "code":
        return "code download"
    if kind == "inputs":
        return f"input ({channel.name}) download"
    return f"output ({channel.name}) predownload"


def _tell(staged: Staged, channel: Channel, path: Path) -> None:
    if channel.mode == "env":
        staged.env[channel.name] = str(path)
    else:
        staged.arguments.append((channel.name, str(path)))


def _warn_over_limits(log, kind: str, what: str, dest: Path) -> None:
    total_limit, files_limit, file_limit = LIMITS[kind]
    sizes = [dest.stat().st_size] if dest.is_file() else [
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(dest) for f in files
    ]
    over = []
    if sum(sizes) > total_limit:
        over.append(f"total {sum(sizes)} bytes > {total_limit}")
    if len(sizes) > files_limit:
        over.append(f"{len(sizes)} files > {files_limit}")
    if file_limit and sizes and max(sizes) > file_limit:
        over.append(f"a file of {max(sizes)} bytes > {file_limit}")
    if over:
        log.warning(f"{what} is over the platform's console limits (a warning, not an error)", over="; ".join(over))


class _Record:
    """staged.json: URL and target -> the path given to the command, written after each success."""

    def __init__(self, path: Path, reuse: bool):
        self.path = path
        self.entries: Dict[str, str] = {}
        if reuse:
            try:
                self.entries = json.loads(path.read_text())
            except (OSError, ValueError):
                self.entries = {}

    def get(self, url: str, target: Path) -> Optional[str]:
        found = self.entries.get(f"{url} -> {target}")
        return found if found and os.path.exists(found) else None

    def add(self, url: str, target: Path, dest: Path) -> None:
        self.entries[f"{url} -> {target}"] = str(dest)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.entries, indent=1))
        os.replace(tmp, self.path)
