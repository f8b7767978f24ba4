"""Checkpoint units: which files complete a checkpoint (markers), which folder each completes, which files are a
writer's scratch and never synced, and the newest complete unit of a folder (what a restart resumes from).

One place for what the runtime knows of the frameworks' checkpoint layouts; the sync (engine.py), the
pre-download of outputs (stagein.py) and the resume variable (resume.py) all ask here.

A marker is a file a framework writes after every other file of a checkpoint. Its pattern is a glob over the
last components of a relative path (`checkpoint-*/trainer_state.json` matches `run/checkpoint-20/trainer_state.json`,
`*.done` any file ending in .done). A plain marker completes the folder holding it. A pointer marker (Megatron's
`latest_checkpointed_iteration.txt`, DeepSpeed's `latest`) names, in its content, the folder it completes, beside
it: `1000` -> `iter_0001000/`, `release` -> `release/`, `global_step1000` -> `global_step1000/`; when the content
names no folder that exists, it completes its own folder, as a plain marker does.

What each framework writes last (see the README's table):
- Hugging Face Trainer: `checkpoint-N/trainer_state.json` (after the model, optimizer, scheduler, RNG states);
- Megatron-LM / MindSpeed-LLM / AscendSpeed / ModelLink: `latest_checkpointed_iteration.txt` at the save root,
  after every rank's `iter_NNNNNNN/mp_rank_XX/...` (a barrier before it);
- DeepSpeed: `latest` at the save root (rank 0, after every rank's `global_stepN/` files);
- torch.distributed.checkpoint (Megatron's torch_dist format too): `.metadata`, written last by the coordinator;
- MindFormers' per-iteration format: `latest_checkpointed_iteration.txt` (rank 0, after a barrier) beside
  `iteration_NNNNNNNN/`; its legacy format and MindSpore's ModelCheckpoint write single files, renamed from `.tmp`;
- PyTorch Lightning: a `.ckpt` file (complete by its rename); its sharded saves, a `.ckpt` folder completed by
  `meta.pt` (FSDP) or `latest` (DeepSpeed);
- anything else: `*.done`, written by the job itself after its files.

A save cut short leaves a folder the markers describe without its marker (incomplete_unit_folders): the
pre-download leaves it in the store and a resume never starts from it.
"""

import fnmatch
import os
import re
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

DEFAULT_MARKERS: Tuple[str, ...] = (
    "checkpoint-*/trainer_state.json",
    "latest_checkpointed_iteration.txt",
    "latest",
    ".metadata",
    # Lightning's sharded saves, a `.ckpt` folder: the FSDP strategy's rank 0 writes meta.pt after the
    # torch.distributed.checkpoint files, the DeepSpeed strategy's `latest` names its tag `checkpoint`.
    "*.ckpt/meta.pt",
    "*.ckpt/latest",
    "*.done",
)
# Markers whose content names the folder they complete, and how.
POINTERS = {
    "latest_checkpointed_iteration.txt": "megatron",
    "latest": "deepspeed",
}
# Writers' temporary files: complete under another name a moment later, torn if the writer dies. Matched against
# the file's name and the name of every folder above it.
DEFAULT_EXCLUDES: Tuple[str, ...] = (
    ".tmp*",  # Rust's tempfile crate: .tmpQeIoOo (safetensors' save_file writes there, then renames)
    "*.tmp",  # MindSpore's save_checkpoint: net-1_32.tmp renamed net-1_32.ckpt; torch.distributed's .metadata.tmp
    "*.partial",
    "tmp-checkpoint-*",  # transformers 4.36-4.38 staged checkpoint-N/ under this name, then renamed it
    "*.ma-partial",  # our own downloads' partial files
)
POINTER_LIMIT = 4096  # bytes of a pointer marker read: a number or a tag, never more
_ITERATION = re.compile(r"\s*(\d+)\s*\Z")
# The names of the folders a pointer marker completes, with their number: Megatron's `iter_{:07d}`,
# DeepSpeed's default tag `global_step{N}` (a tag of the job's own choosing is not recognised, so never judged).
POINTED_NAMES = {
    "megatron": re.compile(r"iter(?:ation)?_(\d{7,})\Z"),  # MindFormers' own: iteration_{:08d}
    "deepspeed": re.compile(r"global_step(\d+)\Z"),
}


def matches(relative: str, pattern: str) -> bool:
    """Whether the last components of `relative` ('/'-separated) match `pattern`, component by component."""
    wanted = pattern.strip("/").split("/")
    parts = relative.split("/")
    if len(parts) < len(wanted):
        return False
    return all(fnmatch.fnmatchcase(part, glob) for part, glob in zip(parts[-len(wanted):], wanted))


def _any_of(globs: Iterable[str]) -> "re.Pattern[str]":
    """One pattern that matches a name any of `globs` matches (fnmatchcase's rules)."""
    translated = [fnmatch.translate(glob) for glob in globs]
    return re.compile("|".join(f"(?:{pattern})" for pattern in translated) if translated else r"(?!)")


def folder_of(relative: str) -> str:
    """'' for the top of the channel."""
    return relative.rpartition("/")[0]


def under(relative: str, folder: str) -> bool:
    return not folder or relative.startswith(folder + "/")


class Units:
    def __init__(self, markers: Sequence[str] = DEFAULT_MARKERS, excludes: Sequence[str] = DEFAULT_EXCLUDES):
        self.markers = tuple(markers)
        self.excludes = tuple(excludes)
        # Every changed file of a cycle is asked about: one compiled pattern, not a glob at a time.
        self._marker_names = _any_of(pattern.rstrip("/").rpartition("/")[2] for pattern in self.markers)
        self._excluded_name = _any_of(self.excludes)

    def is_marker(self, relative: str) -> bool:
        name = relative.rpartition("/")[2]
        if not self._marker_names.match(name):  # no pattern's last part: not a marker (most files)
            return False
        return any(matches(relative, pattern) for pattern in self.markers)

    def excluded(self, relative: str) -> bool:
        """A writer's scratch file, or a file under a scratch folder."""
        return any(self._excluded_name.match(part) for part in relative.split("/"))

    def pointer_kind(self, relative: str) -> Optional[str]:
        name = relative.rpartition("/")[2]
        return POINTERS.get(name) if self.is_marker(relative) else None

    def unit_of(self, marker: str, read: Callable[[str], Optional[bytes]],
                exists: Callable[[str], bool]) -> str:
        """The folder (relative, '' for the top) that `marker` completes. `read(relative)`: the marker's bytes
        (None when unreadable); `exists(relative)`: whether that folder exists."""
        own = folder_of(marker)
        kind = self.pointer_kind(marker)
        if kind is None:
            return own
        named = pointed_folder(kind, read(marker))
        if named is None:
            return own
        candidate = f"{own}/{named}" if own else named
        return candidate if exists(candidate) else own

    def unit_in(self, root: str, marker: str) -> str:
        """unit_of for a marker in the local folder `root`, by its content there."""
        return self.unit_of(marker, lambda relative: read_marker(root, relative),
                            lambda relative: os.path.isdir(os.path.join(root, relative)))


def read_marker(root: str, relative: str) -> Optional[bytes]:
    """The first POINTER_LIMIT bytes of the file `relative` under `root` (a pointer's content); None when it cannot
    be read."""
    try:
        with open(os.path.join(root, relative), "rb") as source:
            return source.read(POINTER_LIMIT)
    except OSError:
        return None


def pointed_folder(kind: str, content: Optional[bytes]) -> Optional[str]:
    """The folder name a pointer marker's content names, or None."""
    if not content:
        return None
    lines = content[:POINTER_LIMIT].decode("utf-8", "replace").strip().splitlines()
    text = lines[0].strip() if lines else ""  # the first line: a job may list the unit's files after it
    if not text or "/" in text or text in (".", ".."):
        return None
    if kind == "megatron":
        number = _ITERATION.match(text)
        if number:
            return f"iter_{int(number.group(1)):07d}"
        return "release" if text == "release" else None
    return text  # deepspeed: the tag is the folder's name


class Unit(NamedTuple):
    folder: str  # relative to the channel's root; '' for the root itself
    marker: str  # the marker's relative path
    mtime_ns: int  # the marker's


def complete_units(root: str, units: Units, relatives: Iterable[str]) -> List[Unit]:
    """The complete units among `relatives` (the files of the folder `root`), oldest marker first."""
    found: List[Unit] = []
    for relative in relatives:
        if not units.is_marker(relative) or units.excluded(relative):
            continue
        try:
            mtime_ns = os.stat(os.path.join(root, relative)).st_mtime_ns
        except OSError:
            continue
        found.append(Unit(units.unit_in(root, relative), relative, mtime_ns))
    return sorted(found, key=lambda unit: (unit.mtime_ns, unit.folder))


def incomplete_unit_folders(relatives: Iterable[str], units: Units,
                            read: Callable[[str], Optional[bytes]]) -> Dict[str, str]:
    """The folders among those of `relatives` (the files of a listing, relative paths) that are checkpoints no
    marker completes (a save cut short), each with what is missing; `read(relative)`: a pointer marker's bytes
    (None when unreadable).

    Only a folder the markers describe is judged:
    - one matching a marker pattern's folder part (`checkpoint-*` of `checkpoint-*/trainer_state.json`) is complete
      when a file right in it matches the whole pattern;
    - one named as a pointer marker's kind names its folders (`iter_0000020`, `global_step20`) is complete when a
      pointer of that kind beside it names it or a later one: the pointer moves only after a whole save, and a
      folder numbered past it was being written. A pointer whose content cannot be compared (a tag, unreadable)
      leaves the folders beside it alone.
    A writer's scratch folder is not judged: everything under it is excluded anyway."""
    by_folder: Dict[str, List[str]] = {}
    for relative in relatives:
        if not units.excluded(relative):
            by_folder.setdefault(folder_of(relative), []).append(relative)
    folders = {parent for folder in by_folder for parent in [folder, *_ancestors(folder)] if parent}
    kinds = sorted({kind for name, kind in POINTERS.items() if units.is_marker(name)})
    incomplete: Dict[str, str] = {}
    for folder in sorted(folders):
        missing = _missing_marker(folder, by_folder.get(folder, ()), units) or _not_pointed_at(
            folder, by_folder.get(folder_of(folder), ()), kinds, units, read)
        if missing:
            incomplete[folder] = missing
    return incomplete


def _ancestors(folder: str) -> List[str]:
    parts = folder.split("/")
    return ["/".join(parts[:end]) for end in range(1, len(parts))]


def _missing_marker(folder: str, inside: Sequence[str], units: Units) -> Optional[str]:
    """What a folder that a marker pattern's folder part describes lacks (`inside`: the files right in it), or
    None: complete, or not such a folder."""
    wanted = [pattern for pattern in units.markers
              if "/" in pattern.strip("/") and matches(folder, pattern.strip("/").rpartition("/")[0])]
    if not wanted or any(matches(relative, pattern) for relative in inside for pattern in wanted):
        return None
    return "no " + " or ".join(pattern.strip("/").rpartition("/")[2] for pattern in wanted)


def _not_pointed_at(folder: str, beside: Sequence[str], kinds: Iterable[str], units: Units,
                    read: Callable[[str], Optional[bytes]]) -> Optional[str]:
    """Why no pointer among `beside` (the files beside a folder named as pointers of `kinds` name theirs) vouches
    for it, or None."""
    name = folder.rpartition("/")[2]
    for kind in kinds:
        pattern = POINTED_NAMES[kind]
        number = pattern.match(name)
        if number is None:
            continue
        pointers = [relative for relative in beside if units.pointer_kind(relative) == kind]
        if not pointers:
            return "no " + " or ".join(marker for marker, of in POINTERS.items() if of == kind) + " beside it"
        contents = [read(pointer) for pointer in pointers]
        numbers = [pattern.match(pointed_folder(kind, content) or "") for content in contents]
        if all(found is not None and int(found.group(1)) < int(number.group(1)) for found in numbers):
            said = (contents[0] or b"")[:POINTER_LIMIT].decode("utf-8", "replace").strip().partition("\n")[0]
            return f"{pointers[0]} says {said}, an earlier save"
    return None
