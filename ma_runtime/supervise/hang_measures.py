"""What one period of hang detection measures: each rank's IO and CPU between two looks, and the devices' flatness.

`JobTree` looks at the job's processes with psutil (each one's read/write syscalls and characters, its CPU
time, and for the ranks asked, the time its threads ran or waited to run: process/table.py `cpu_demand`),
`activity` turns two looks into an `Interval` (IO or not, the cores each rank used or demanded), and `flat`
says whether the accelerators' utilisation stayed flat over the window. Pure but for `JobTree.sample`; the
rule that judges these over time is hang.py's `Monitor`.
"""

from typing import Any, Callable, Collection, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

from ma_runtime.process.table import cpu_demand

# Accelerator utilisation that spreads by no more than this (standard deviation, percentage points) over the
# window is flat; a device above IDLE_PERCENT is busy (its first busy sample is the attempt's first progress).
FLAT_STDDEV = 2.0
IDLE_PERCENT = 10.0
# Fewer samples than this over the window say nothing about flatness (the first period of a short window).
MIN_SAMPLES = 3

_Counters = Tuple[int, int, int, int]  # read and write syscalls, read and write characters


class Reading(NamedTuple):
    """One process at one look."""

    counters: _Counters
    cpu: float  # CPU seconds used, every thread
    unit: int  # the pid of its rank (supervise/ranks.py)
    demand: Optional[float] = None  # seconds run plus waited to run, every thread (schedstat), where it was read


Sample = Dict[Tuple[int, float], Reading]  # {(pid, start time): reading}


class Interval(NamedTuple):
    """What the job did between two looks."""

    io: bool  # a rank's process read or wrote, came or went
    cores: Dict[int, float]  # {rank: the cores it used or demanded, whichever is more}


class JobTree:
    """The job's processes at each look: their counters, by rank."""

    def __init__(self, members: Callable[[], Mapping[int, Any]]):
        import psutil  # only a job with hang detection on pays its import

        self._psutil = psutil
        self.members = members  # () -> {pid: its rank's ranks.Unit}
        self._known: Dict[int, Any] = {}  # pid -> psutil.Process: its start time tells a reused pid apart
        self.labels: Dict[int, str] = {}  # rank pid -> "rank 3"

    def sample(self, demand_of: Optional[Collection[int]] = None) -> Sample:
        """A look; the demand of the processes of the ranks in `demand_of` too (None: every rank's)."""
        sample: Sample = {}
        known: Dict[int, Any] = {}
        labels: Dict[int, str] = {}
        for pid, unit in self.members().items():
            try:
                proc = self._process(pid)
                io, cpu = proc.io_counters(), proc.cpu_times()
            except self._psutil.Error:
                continue  # gone (or a zombie) since the walk: the next sample sees the tree without it
            known[pid] = proc
            labels[unit.root] = unit.label
            demand = cpu_demand(pid) if demand_of is None or unit.root in demand_of else None
            sample[pid, proc.create_time()] = Reading((io.read_count, io.write_count, io.read_chars, io.write_chars),
                                                      cpu.user + cpu.system, unit.root, demand)
        self._known, self.labels = known, labels
        return sample

    def _process(self, pid: int):
        proc = self._known.get(pid)
        if proc is None or not proc.is_running():  # is_running compares the start time: a reused pid is new
            proc = self._psutil.Process(pid)
        return proc


def activity(before: Sample, after: Sample, seconds: float) -> Interval:
    """What the job did between two looks `seconds` apart."""
    common = before.keys() & after.keys()
    moved = before.keys() != after.keys() or any(before[key].counters != after[key].counters for key in common)
    used: Dict[int, float] = {reading.unit: 0.0 for reading in after.values()}
    asked: Dict[int, float] = dict(used)
    for key in common:
        unit = after[key].unit
        used[unit] += max(0.0, after[key].cpu - before[key].cpu)
        if before[key].demand is not None and after[key].demand is not None:
            asked[unit] += max(0.0, after[key].demand - before[key].demand)
    span = max(seconds, 1e-6)
    return Interval(moved, {unit: max(used[unit], asked[unit]) / span for unit in used})


def flat(samples: Sequence[Mapping[str, Optional[float]]]) -> Optional[Tuple[float, float]]:
    """(median, largest spread) of the devices' utilisation when every device is flat over `samples`, else None.
    A device with no value in any sample (N/A) has nothing to say."""
    import statistics  # a few milliseconds of import that a job without hang detection does not pay

    medians, spreads = [], []
    for device in set().union(*samples) if samples else ():
        values = [s[device] for s in samples if s.get(device) is not None]
        if len(values) < MIN_SAMPLES:
            continue
        spread = statistics.pstdev(values)
        if spread > FLAT_STDDEV:
            return None
        medians.append(statistics.median(values))
        spreads.append(spread)
    if not medians:
        return 0.0, 0.0
    return statistics.median(medians), max(spreads)


def flat_words(level: Tuple[float, float], samples: int) -> str:
    median, spread = level
    state = "idle" if median <= IDLE_PERCENT else "busy but unchanging (busy-polling?)"
    return f"accelerators {state}: median {median:.0f} %, spread {spread:.1f} points over {samples} samples"
