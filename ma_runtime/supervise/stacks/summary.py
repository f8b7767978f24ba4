"""A faulthandler dump parsed, and the stacks of an attempt summed up: where each rank's main thread is, and the odd
ones out (the ranks not where most ranks are, usually the cause of a hung collective)."""

import collections
import dataclasses
import os
import re
from pathlib import Path
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

INNERMOST = 3
# Where a rank's main thread waits for its peers: a collective, a barrier, a point-to-point receive (any frame of its
# main thread in one of these). A rank that is not there while others are is the one they wait for.
COLLECTIVES = ("/torch/distributed/", "/torch_npu/distributed/", "/mindspore/communication/", "/horovod/",
               "/deepspeed/comm/", "/mpi4py/")
# Odd ones out named in `describe`: the termination message's reason is one line.
NAMED_ODD = 8
_HEADER = re.compile(r"(?:(?:Current thread|Thread) 0x[0-9a-fA-F]+.*|Stack|Traceback)(?: \(most recent call first\))?:")
_FRAME = re.compile(r'\s+File "(.*)", line (\S+) in (.*)')


class Frame(NamedTuple):
    path: str
    line: str  # "???" where faulthandler knew none
    function: str

    def short(self) -> str:
        return f"{os.path.basename(self.path) or self.path}:{self.line} in {self.function}"


class Thread(NamedTuple):
    header: str
    frames: List[Frame]  # innermost first; empty: `<no Python frame>`
    truncated: bool  # over 100 frames: the outermost are missing


def parse(text: str) -> List[Thread]:
    """The thread blocks of a faulthandler dump, in its order; lines it does not know are skipped."""
    threads: List[Thread] = []
    for line in text.splitlines():
        if _HEADER.fullmatch(line.rstrip()):
            threads.append(Thread(line.rstrip(), [], False))
            continue
        if not threads:
            continue
        frame = _FRAME.fullmatch(line)
        if frame:
            threads[-1].frames.append(Frame(*frame.groups()))
        elif line.strip() == "..." and line.startswith(" "):
            threads[-1] = threads[-1]._replace(truncated=True)
    return threads


def main_thread(threads: Sequence[Thread]) -> Optional[Thread]:
    """The last block: CPython lists the newest thread first and the main thread is the oldest."""
    return threads[-1] if threads else None


@dataclasses.dataclass
class Stacks:
    folder: Optional[Path]  # where the dumps were written; None when nothing was
    where: Dict[str, List[str]]  # label ("rank 3", "pid 812 (torchrun)") -> innermost frames, innermost first
    odd: List[str]  # the labels not where most ranks are
    usual: Optional[str]  # where most ranks are (their innermost frame), when one place has the most
    missing: List[str]  # one line each: a worker without a Python stack, a process that did not answer
    usual_count: int = 0  # how many are there

    def describe(self) -> str:
        """One short sentence for the termination message's reason."""
        folder = f"; stacks in {self.folder}" if self.folder is not None else ""
        if not self.where:
            why = "; ".join(self.missing[:2]) or "no Python process registered"
            return f"no Python stack could be taken ({why})" + folder
        if self.odd:
            return self._odd_sentence() + folder
        if self.usual is not None:
            return self._together_sentence() + folder
        places = collections.Counter(_innermost(frames) for frames in self._subjects().values())
        listed = ", ".join(f"{place} ({count})" for place, count in places.most_common(3))
        return f"the {self._noun()} are in {len(places)} different places: {listed}" + folder

    def _odd_sentence(self) -> str:
        named = self.odd[:NAMED_ODD] if len(self.odd) <= NAMED_ODD else self.odd[:NAMED_ODD - 1]
        names = ", ".join(named) + (f" and {len(self.odd) - len(named)} more" if len(named) < len(self.odd) else "")
        places = sorted({_innermost(self.where[label]) for label in self.odd})
        if len(places) == 1:
            at = places[0]
        else:
            at = "; ".join(f"{label}: {_innermost(self.where[label])}" for label in named)
        verb = "is" if len(self.odd) == 1 else "are"
        others = "the other waits" if self.usual_count == 1 else f"the other {self.usual_count} wait"
        return f"{names} {verb} elsewhere ({at}) while {others} in {self.usual}"

    def _together_sentence(self) -> str:
        subjects = self._subjects()
        if len(subjects) == 1:
            return f"{next(iter(subjects))} is in {self.usual}"
        return f"every {'rank' if self._noun() == 'ranks' else 'process'} is in {self.usual}"

    def _subjects(self) -> Dict[str, List[str]]:
        return _subjects(self.where)

    def _noun(self) -> str:
        return "ranks" if any(_is_rank(label) for label in self.where) else "processes"


def _is_rank(label: str) -> bool:
    return label.startswith("rank ")


def _subjects(where: Mapping[str, List[str]]) -> Dict[str, List[str]]:
    """Whose places are compared: the ranks, or every process where none is a rank."""
    ranks = {label: frames for label, frames in where.items() if _is_rank(label)}
    return ranks or dict(where)


def _innermost(frames: Sequence[str]) -> str:
    return frames[0] if frames else "no Python frame"


def summarise(procs: Sequence, folder: Optional[Path], missing: List[str]) -> Stacks:
    keys: Dict[str, Optional[Frame]] = {}
    where: Dict[str, List[str]] = {}
    waiting: Dict[str, bool] = {}
    for proc in sorted(procs, key=_order):
        main = main_thread(proc.threads)
        frames = main.frames if main is not None else []
        keys[proc.label] = frames[0] if frames else None
        where[proc.label] = [frame.short() for frame in frames[:INNERMOST]]
        waiting[proc.label] = any(part in frame.path for frame in frames for part in COLLECTIVES)
    subjects = {label: keys[label] for label in _subjects(where)}
    odd, usual, count = _odd_ones_out(subjects)
    if not odd:
        odd, usual, count = _not_waiting(subjects, waiting, (odd, usual, count))
    usual_text = (usual.short() if usual is not None else "no Python frame") if count else None
    return Stacks(folder, where, odd, usual_text, missing, count)


def _order(proc) -> Tuple[int, int]:
    match = re.fullmatch(r"rank (\d+)", proc.label)
    return (0, int(match[1])) if match else (1, proc.pid)


def _odd_ones_out(keys: Mapping[str, Optional[Frame]]) -> Tuple[List[str], Optional[Frame], int]:
    """(the labels outside the strictly largest group, that group's frame, its size); no odd ones and a size
    of 0 where no group is strictly the largest."""
    groups = collections.Counter(keys.values()).most_common()
    if not groups:
        return [], None, 0
    if len(groups) > 1 and groups[0][1] == groups[1][1]:
        return [], None, 0
    usual, count = groups[0]
    return [label for label, key in keys.items() if key != usual], usual, count


def _not_waiting(keys: Mapping[str, Optional[Frame]], waiting: Mapping[str, bool], otherwise):
    """Where the places tie (two ranks, two places), the ranks outside any collective are the odd ones out while
    the others wait in one: the ranks waiting, not where most of them are, tell who is stuck."""
    inside = [label for label in keys if waiting[label]]
    outside = [label for label in keys if not waiting[label]]
    if not inside or not outside or not all(_is_rank(label) for label in keys):
        return otherwise
    places = collections.Counter(keys[label] for label in inside).most_common()
    if len(places) > 1 and places[0][1] == places[1][1]:
        return otherwise
    return outside, places[0][0], len(inside)


def log_summary(stacks: Stacks, procs: Sequence, log) -> None:
    for proc in sorted(procs, key=_order):
        if proc.label in stacks.where:
            log.warning("stack of a hung process", process=proc.label, pid=proc.pid,
                        at=" <- ".join(stacks.where[proc.label]) or "no Python frame", threads=len(proc.threads))
    if stacks.odd:
        log.warning("odd ones out: not where the others are", odd=", ".join(stacks.odd),
                    at="; ".join(f"{label}: {_innermost(stacks.where[label])}" for label in stacks.odd),
                    others=stacks.usual, count=stacks.usual_count)
