"""Stage-in: the code directory, the inputs and the pre-downloaded outputs, before the command starts.

Local paths follow the platform (docs/platform.md, "Stage-in" and decision D10):
- code `obs://b/path/demo-code` -> `${MA_JOB_DIR}/demo-code` (the last path part kept);
- input `data_url` (first in the list) -> `${MA_MOUNT_PATH}/inputs/data_url_0`;
- output `train_url` -> `${MA_MOUNT_PATH}/outputs/train_url_0` (created even without pre-download).
A prefix's local path is that directory; a single object lands inside it and the
command is given the file's path. The command hears of each channel as
`--<name>=<local path>` (mode argument) or as the variable `<name>` (mode env).

An output's pre-download takes whole checkpoints only (`_CompleteUnits`): a folder the markers call
incomplete (a save cut short: `checkpoint-20/` without its `trainer_state.json`) stays in the store, with
one warning naming it, and so do writers' scratch files (`.tmp*`, MA_RUNTIME_SYNC_EXCLUDE). The markers it
fetched are given one modification time, so that resume.py's choice among them goes by name.

What was staged is recorded in `${MA_MOUNT_PATH}/.ma-runtime/staged.json` (written
atomically; one that is not an object of strings is set aside, records.py); a restart in the
same pod (MA_PROC_START_CNT > 1) does not fetch it again. The platform's size
limits (docs/platform.md, D13) are warnings, not errors.

Every URL was validated when the job was loaded (storage/url.py): no last part
that is empty, `.` or `..`, so the code directory is one name strictly inside
MA_JOB_DIR. A failure is one line naming what failed, the URL once, and the
store's endpoint (storage/transfer/ adds it); the local side (a folder that cannot be
made, a record that cannot be written) fails as storage too, with the path.
"""

import dataclasses
import functools
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from ma_runtime.errors import ConfigError
from ma_runtime.spec import JobSpec
from ma_runtime.spec.jobfile import Channel
from ma_runtime.sync import units as units_module
from ma_runtime.util import records
from ma_runtime.util.files import write_atomically

# The storage layer is imported by the jobs that stage something in, when they do: most start with nothing to fetch.
if TYPE_CHECKING:
    from ma_runtime.storage.base import ObjectInfo

# (total bytes, files, single file bytes) the platform's console allows (docs/platform.md, "Stage-in").
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
    """`obs://b/path/demo-code` -> `${MA_JOB_DIR}/demo-code`: the last path part is kept (docs/platform.md)."""
    from ma_runtime.storage import url as storage_url

    name = storage_url.parse(spec.code_url, "code URL").last_part
    # parse() refuses these already; the rule is restated where the path is made, as the promise it is.
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise ConfigError(f"code URL {spec.code_url!r}: {name!r} is not a folder name inside MA_JOB_DIR")
    return spec.job_dir / name


def planned(spec: JobSpec) -> Staged:
    """What stage-in will tell the command, without fetching anything (for `ma-runtime plan`).

    An input URL without a trailing slash that names one object is given as the file in its
    folder once fetched; the plan shows the folder."""
    staged = Staged()
    for channel in (*spec.inputs, *spec.outputs):
        _tell(staged, channel, channel.local_dir(spec.mount_path))
    return staged


def stage_in(spec: JobSpec, environ, log, attempt: Optional[int] = None) -> Staged:
    """`attempt`: the first start of the command this runtime makes (the platform's MA_PROC_START_CNT, or
    the next after a runtime that died): from the second on, what was staged is reused."""
    check_sync_store(spec, environ)
    if not (spec.code_url or spec.inputs or spec.outputs):
        return Staged()
    try:
        return _stage_all(spec, environ, log, spec.proc_start_cnt if attempt is None else attempt)
    except OSError as exc:  # the local side: a folder that cannot be made, a record that cannot be written
        from ma_runtime.storage.base import StorageError

        where = f": {exc.filename}" if exc.filename else ""
        raise StorageError(f"stage-in failed{where}: {exc.strerror or exc}", stage="stage-in") from None


def check_sync_store(spec: JobSpec, environ) -> None:
    """The store the outputs and logs will be synced to can be used (credentials, endpoint), before the command
    runs: what it writes would be lost otherwise, and the uploader would fail on it at every start. Nothing is
    sent. A failure is recorded in storage/reach.py, so that the final sync does not try that endpoint again."""
    if not spec.syncs:
        return  # before any import: a job that syncs nothing does not load the sync's or the storage's modules
    from ma_runtime.sync import targets

    remote = targets.remote(targets.of(spec))
    if not remote:
        return
    from ma_runtime.storage import reach
    from ma_runtime.storage import url as storage_url
    from ma_runtime.storage.base import StorageError
    from ma_runtime.storage.stores import endpoint_of, open_store

    try:
        open_store(storage_url.parse(remote[0].url, remote[0].name), spec, environ)
    except StorageError as exc:
        reach.found_dead(endpoint_of(spec), exc.reason)
        names = ", ".join(target.name for target in remote)
        raise type(exc)(f"{exc.reason} (needed to sync {names})", hint=exc.hint, stage="stage-in") from None


def _stage_all(spec: JobSpec, environ, log, attempt: int) -> Staged:
    from ma_runtime.storage import url as storage_url

    staged = Staged()
    record = _Record(spec.state_dir / "staged.json", reuse=attempt > 1, log=log)
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
    from ma_runtime.storage.base import StorageError
    from ma_runtime.storage.stores import open_store

    started = time.monotonic()
    try:
        store = open_store(location, spec, environ)
        options = transfer.TransferOptions.from_spec(spec, spec.state_dir)
        whole = _CompleteUnits(spec, store, location, options, log, what) if kind == "outputs" else None
        # A URL without a trailing slash is an object (landing inside `target`) or a prefix: the engine asks.
        summary = transfer.download(store, location, target, options, log, into_folder=not location.is_prefix,
                                    select=whole)
    except StorageError as exc:
        # One line that names what failed, the URL once (the engine's message often names it already) and why.
        reason = exc.reason if _names(exc.reason, location) else f"{location.text}: {exc.reason}"
        raise type(exc)(f"{what} failed: {reason}", hint=exc.hint, stage="stage-in") from None
    dest = summary.path
    if whole is not None:
        whole.date_markers(dest)
    elapsed = round(time.monotonic() - started, 3)
    log.info(f"{what} completed", url=location.text, path=str(dest), files=summary.files, bytes=summary.bytes,
             skipped=summary.skipped, refused=len(summary.refused), elapsed_s=elapsed)
    _warn_over_limits(log, kind, what, dest)
    record.add(location.text, target, dest)
    return dest


def _names(reason: str, location) -> bool:
    """Whether `reason` names the location already, as written or as the store spells it (obs://)."""
    return location.text in reason or (location.remote and f"obs://{location.bucket}/{location.key}" in reason)


def _as_prefix(url: str):
    from ma_runtime.storage import url as storage_url

    location = storage_url.parse(url)
    return location if location.is_prefix else storage_url.parse(url.rstrip("/") + "/")


def _event_name(kind: str, channel: Optional[Channel]) -> str:
    """The platform's event wording (docs/platform.md, "Stage-in"), in English."""
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


class _CompleteUnits:
    """An output's pre-download filter (transfer.download's `select`): the listing without the checkpoints that
    no marker completes (units.incomplete_unit_folders) and without writers' scratch files. A torn save must not
    come back: transformers' get_last_checkpoint, for one, picks `checkpoint-20/` by its number alone, and a
    resume from it fails. A pointer marker's content is read from the store (a few bytes)."""

    def __init__(self, spec: JobSpec, store, location, options, log, what: str):
        from ma_runtime.storage import transfer

        self.units = units_module.Units(spec.sync_markers, spec.sync_exclude)
        self.store, self.location, self.log, self.what = store, location, log, what
        self.calls = transfer.Calls(options, log)
        self.markers: List[str] = []  # the relative paths of the markers kept

    def __call__(self, listed: "List[ObjectInfo]", prefix: str) -> "List[ObjectInfo]":
        files = {info.key[len(prefix):]: info for info in listed if not info.key.endswith("/")}
        torn = units_module.incomplete_unit_folders(files, self.units, lambda relative: self._read(files[relative]))
        outermost = [folder for folder in torn if not any(units_module.under(folder, other) for other in torn
                                                          if other != folder)]
        for folder in outermost:
            inside = sum(1 for relative in files if units_module.under(relative, folder))
            self.log.warning(f"{self.what} left out an incomplete checkpoint", url=self.location.text,
                             folder=folder, missing=torn[folder], files=inside)
        kept, scratch = [], 0
        for info in listed:
            relative = info.key[len(prefix):]
            if any(units_module.under(relative, folder) for folder in outermost):
                continue
            if self.units.excluded(relative):
                scratch += 1
                continue
            kept.append(info)
            if relative in files and self.units.is_marker(relative):
                self.markers.append(relative)
        if scratch:
            self.log.info(f"{self.what} left out writers' temporary files", url=self.location.text, files=scratch)
        return kept

    def _read(self, info: "ObjectInfo") -> bytes:
        length = min(info.size, units_module.POINTER_LIMIT)
        if not length:
            return b""
        read = functools.partial(self.store.read_range, etag=info.etag, whole=length == info.size)
        import tempfile  # (and random, hashlib's sha512): only for a part read back, not at every start-up

        with tempfile.TemporaryFile() as sink:
            self.calls(read, self.location.bucket, info.key, 0, length, sink.fileno(), 0)
            sink.seek(0)
            return sink.read()

    def date_markers(self, dest: Path) -> None:
        """One time for every marker fetched: their download's order is not their saves' (resume.py then goes by
        name among them), and any save of the command comes later."""
        now = time.time_ns()
        for relative in self.markers:
            try:
                os.utime(dest / relative, ns=(now, now), follow_symlinks=False)
            except OSError:
                pass  # refused by the engine (an unsafe key), or gone: nothing to date


class _Record:
    """staged.json: URL and target -> the path given to the command, written after each success."""

    def __init__(self, path: Path, reuse: bool, log):
        self.path = path
        self.entries: Dict[str, str] = {}
        if reuse:  # a record that is not an object of strings is set aside: what it listed is fetched again
            self.entries = records.load(path, functools.partial(records.strings, where="the record"), log,
                                        "the stage-in record", then="what it listed is fetched again") or {}
        else:  # not read, but written: a FIFO or a folder in its place must not fail the stage
            records.make_way(path, log, "the stage-in record")

    def get(self, url: str, target: Path) -> Optional[str]:
        found = self.entries.get(f"{url} -> {target}")
        return found if isinstance(found, str) and os.path.exists(found) else None

    def add(self, url: str, target: Path, dest: Path) -> None:
        self.entries[f"{url} -> {target}"] = str(dest)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, json.dumps(self.entries, indent=1))
