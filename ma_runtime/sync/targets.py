"""What a job syncs: each output channel not marked `sync: false`, and the log folder when a log URL is set."""

import dataclasses
import os
from pathlib import Path
from typing import List

from ma_runtime.errors import ConfigError
from ma_runtime.storage import url as url_module

LOG_CHANNEL = "log"


@dataclasses.dataclass(frozen=True)
class Target:
    """What one channel syncs: `root` (a local folder) to `url` (a folder in a store, or a local one)."""

    name: str
    root: Path
    url: str
    is_log: bool = False
    delete: bool = False


def of(spec) -> List[Target]:
    """Raises ConfigError (78, before the command starts) for a local target inside its own folder."""
    targets = [Target(channel.name, channel.local_dir(spec.mount_path), channel.url, delete=channel.delete)
               for channel in spec.outputs if channel.sync]
    if spec.log_url:
        targets.append(Target(LOG_CHANNEL, Path(spec.log_dir), spec.log_url, is_log=True))
    for target in targets:
        _refuse_loop(target, targets)
    return targets


def remote(targets: List[Target]) -> List[Target]:
    """The targets in an object store (they all use the job's one endpoint); the others are local folders."""
    return [target for target in targets if url_module.parse(target.url, target.name).remote]


def _refuse_loop(target: Target, targets: List[Target]) -> None:
    """A local copy inside a synced folder (its own, or another channel's) would be copied again, cycle after
    cycle, each copy holding the last."""
    location = url_module.parse(target.url, target.name)
    if location.remote:
        return
    copy = os.path.realpath(location.key)
    for synced in targets:
        source = os.path.realpath(synced.root)
        if os.path.commonpath([source, copy]) == source:
            what = "MA_RUNTIME_LOG_URL (or log_url)" if target.is_log else f"output '{target.name}'"
            folder = "the folder it syncs" if synced is target else f"the folder synced as '{synced.name}'"
            raise ConfigError(f"{what}: the URL {target.url} is inside {folder} ({synced.root})",
                              hint="give a folder outside every synced folder, or an obs:// URL")


def is_priority_log(relative: str) -> bool:
    """What a final sync sends first: the termination message and the logs at the top of the log folder."""
    return "/" not in relative and (relative.endswith(".log") or relative.endswith("-termination.json"))
