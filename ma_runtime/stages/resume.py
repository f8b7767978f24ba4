"""MA_RESUME_CHECKPOINT: the newest complete checkpoint under the output folders, for every attempt.

Made again right before each attempt's plan, so an in-place restart resumes from what the attempt before it
saved, and so does a runtime started again in the same pod and a rescheduled pod after its pre-download (the
hooks run once per pod: a value a hook computed would be the first attempt's for ever).

The rule (units.py knows the markers):
- a checkpoint is a complete unit of an output channel's local folder: a folder whose marker is there, for a
  pointer marker the folder it names (Megatron's `latest_checkpointed_iteration.txt` holding `20`:
  `iter_0000020/`). A unit inside a folder the markers call incomplete (`checkpoint-30/` without its
  `trainer_state.json`, holding DeepSpeed's complete `global_step30/`) is part of a torn save and never chosen;
  writers' scratch files and folders (`MA_RUNTIME_SYNC_EXCLUDE`) are not looked into;
- the newest is the one whose marker was written last (its mtime); equal times go to the shallower folder, then
  the greater name, numbers compared as numbers (`checkpoint-100` after `checkpoint-20`). Stage-in gives the
  markers it pre-downloads one time, since a download's order says nothing of the saves';
- a non-empty value in the job's environment (set for the job, or exported by its pre-start hook) is the job's
  choice: kept and logged. An empty one counts as unset (a Trainer given "" fails): the runtime's value replaces
  it, or it is removed when there is no checkpoint;
- `MA_RUNTIME_RESUME=off`: the environment is left as it is. A job without output channels looks nowhere and
  hears nothing of it.
Each attempt logs one line: `resume checkpoint`, `resume checkpoint set by the job; kept` or
`no complete checkpoint to resume from`, with the attempt's number.
"""

import errno
import os
import re
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ma_runtime.sync import units as units_module

NAME = "MA_RESUME_CHECKPOINT"
_DIGITS = re.compile(r"(\d+)")


def environ_for(spec, environ: Mapping[str, str], attempt: int, log) -> Dict[str, str]:
    """`environ` as attempt `attempt` starts from: with the runtime's MA_RESUME_CHECKPOINT, or without any."""
    env = dict(environ)
    if spec.resume == "off" or not spec.outputs:
        return env
    if env.get(NAME):
        log.info("resume checkpoint set by the job; kept", path=env[NAME], attempt=attempt)
        return env
    env.pop(NAME, None)
    folders = output_folders(spec)
    found = newest(folders, units_of(spec), log)
    if found is None:
        log.info("no complete checkpoint to resume from", attempt=attempt, looked_in=[str(f) for f in folders])
    else:
        env[NAME] = str(found)
        log.info("resume checkpoint", path=str(found), attempt=attempt)
    return env


def units_of(spec) -> units_module.Units:
    return units_module.Units(spec.sync_markers, spec.sync_exclude)


def output_folders(spec) -> List[Path]:
    return [Path(os.path.abspath(channel.local_dir(spec.mount_path))) for channel in spec.outputs]


def newest(folders: Sequence[Path], units: units_module.Units, log=None) -> Optional[Path]:
    """The absolute path of the newest complete unit under `folders`, or None."""
    best: Optional[Tuple[tuple, Path]] = None
    for order, root in enumerate(folders):
        for unit in complete(root, units, log):
            rank = (unit.mtime_ns, -_depth(unit.folder), _natural(unit.folder), -order)
            if best is None or rank > best[0]:
                best = (rank, root / unit.folder if unit.folder else root)
    return best[1] if best else None


def complete(root: Path, units: units_module.Units, log=None) -> List[units_module.Unit]:
    """The complete units of `root` that no torn save holds, oldest marker first."""
    files = _files(root, units, log)
    torn = units_module.incomplete_unit_folders(files, units,
                                                lambda relative: units_module.read_marker(str(root), relative))
    return [unit for unit in units_module.complete_units(str(root), units, files)
            if not any(unit.folder == folder or units_module.under(unit.folder, folder) for folder in torn)]


def _files(root: Path, units: units_module.Units, log=None) -> List[str]:
    """The files under `root` ('/'-separated relative paths), not looking into writers' scratch folders."""
    found: List[str] = []

    def unreadable(error: OSError) -> None:
        if log is not None and not (error.errno == errno.ENOENT and error.filename == str(root)):  # none: empty
            log.warning("cannot read a folder while looking for a checkpoint to resume from",
                        path=error.filename, error=error.strerror or str(error))

    for folder, names, files in os.walk(root, onerror=unreadable):
        relative = os.path.relpath(folder, root)
        prefix = "" if relative == "." else relative.replace(os.sep, "/") + "/"
        names[:] = [name for name in names if not units.excluded(name)]
        found.extend(prefix + name for name in files)
    return found


def _depth(folder: str) -> int:
    return folder.count("/") + 1 if folder else 0


def _natural(folder: str) -> List[object]:
    """`checkpoint-100` after `checkpoint-20`: digits compare as numbers (str and int alternate, so they align)."""
    return [int(part) if index % 2 else part for index, part in enumerate(_DIGITS.split(folder))]
