"""Hang detection: find a stuck attempt from outside, without the training code's help.

The platform's rule (docs/platform.md, D31): no process IO change for several periods, then accelerator
utilisation flat over a window, judged by its median and variance, over `MA_HANG_DETECT_TIME` minutes; and
every instance using less than one CPU core. Here, one `Monitor` per attempt samples, in a thread of its own
at a fixed period (a fifth of the window, at most a minute):

- the job's ranks, re-discovered each period (supervise/ranks.py: the processes that run the training code and
  what they start, never launcher machinery: torchrun's agent, msrun and its scheduler, mpirun, orted, the
  runtime's own helpers and services), with psutil: each process's read/write syscalls and characters
  (/proc/<pid>/io: pipes and sockets count, so a gloo collective or a log line is IO) and its CPU time. A
  period has IO when a rank's counter moved or a process came or went. A rank is *busy* over a period when
  it used or asked for `BUSY_CORES` of the CPUs (a CPU-only job: `BUSY_CORES_CPU_ONLY`), asked being the time
  its threads ran plus the time they waited on a run queue (/proc/<pid>/task/*/schedstat, read only for a rank
  that used less than that the period before): on a loaded node a working rank gets a fraction of a core but
  asks for a whole one, where a blocked rank asks for nothing;
- the accelerators of this container (`devices.utilisation`: npu-smi's AICore %, nvidia-smi's GPU util %).
  They are *flat* over the window when every device's samples spread by at most `FLAT_STDDEV` points.

Hang = no IO from any rank for the window and a rank idle (not busy) throughout it, and the accelerators flat
over it (a CPU job forced on with MA_RUNTIME_HANG_DETECT=on has only the first half). One idle rank is enough:
the others may busy-poll for it (Open MPI spins a core in MPI_Barrier, NCCL its proxy thread), and a rank that
neither computes nor communicates for a window is no part of a step. That rank is the suspect the hang names,
when the others were busy. With a progress signal (MA_RUNTIME_PROGRESS_FILE's mtime, a line matching
MA_RUNTIME_PROGRESS_PATTERN), once it has beaten the signal alone decides: progress resets the clock whatever
the metrics say, and none for the window is a hang even while busy-polling collectives keep the devices and a
core busy (NCCL's busy-polling is why utilisation alone misses a hung collective). Before its first beat the
metrics decide, so that the CPU a second attempt spends importing torch is not taken for a hang.

Fewer false alarms than the anchors: before an attempt's first progress (the signal's first beat, or,
without one, the first sample where an accelerator is busy, above `IDLE_PERCENT`; a CPU-only job: the first
period in which a rank was busy) the window is MA_RUNTIME_HANG_STARTUP_SECONDS (default twice the window):
warm-up, compilation and data loading are not hangs. Every attempt has its own monitor, so its own start-up
allowance. The check that would declare a hang runs at its deadline, not on the next period's grid, so a hang
is found within the window plus one period.

The thread only reads /proc and runs the accelerator tool (through `run_tool`, owned: the reaping loop
leaves it alone, and the tree walk leaves it out); finding a hang, it wakes the supervision loop, which
takes the stacks of the ranks (`show_where`) and stops the attempt as in a failure. What one period measures
(the ranks' IO and CPU, the devices' flatness) is hang_measures.py; this module holds the rule over time.
"""

import collections
import dataclasses
import os
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from ma_runtime.supervise.hang_measures import IDLE_PERCENT, Interval, JobTree, Sample, activity, flat, flat_words
from ma_runtime.util import accelerators

if TYPE_CHECKING:  # the pattern's matcher process (sockets): imported when a pattern is set
    from ma_runtime.supervise.progress import ProgressSink

PERIODS_PER_WINDOW = 5
PERIOD_CAP = 60.0
# Checks closer together than this cost CPU without finding anything sooner.
MIN_WAIT = 0.2
# A rank that demands this much of a core (time run plus time waiting to run) over a period is working. A job with
# accelerators: the platform's rule ("< 1 CPU core" is idle), its devices telling the rest. A CPU-only job, where
# the CPU is all there is: a tenth of a core, far from both a blocked rank (0.00-0.01 measured, torch's gloo
# barrier, MindSpore's and Open MPI's waits) and a working one (a busy loop demands 1.0 whatever the load; one
# that computes 70 ms and sleeps 30 ms, 0.7).
BUSY_CORES = 1.0
BUSY_CORES_CPU_ONLY = 0.1
# Ranks named in the evidence: the termination message's reason is one line.
NAMED = 8


@dataclasses.dataclass(frozen=True)
class Config:
    """The run's hang settings, decided once (`configure`)."""

    window: float
    startup: float
    period: float
    restarts: int
    stacks: bool
    tool: Optional[str]  # the accelerator tool asked ("npu-smi info", "nvidia-smi"), None: the IO/CPU rule alone
    progress_file: Optional[Path] = None
    progress_pattern: Optional[str] = None

    @property
    def signalled(self) -> bool:
        """Whether a progress signal, not the metrics, decides."""
        return self.progress_file is not None or self.progress_pattern is not None


def configure(spec: Any, environ: Mapping[str, str], log) -> Optional[Config]:
    """The run's hang detection, or None when it is off; says which in one line."""
    window = spec.hang_window_seconds
    if spec.hang_detect == "off":
        log.info("hang detection off", reason="MA_RUNTIME_HANG_DETECT=off")
        return None
    # A CPU job (the common case on a laptop) is decided without loading the device tools' readers.
    cpu_job = accelerators.choose(spec, environ).flavour is None
    tool = None
    if not cpu_job:
        from ma_runtime.supervise import devices

        tool = devices.tool_for(spec, environ)
    if tool is None and spec.hang_detect == "auto":
        log.info("hang detection off", reason="no accelerator: the platform detects hangs of GPU and NPU jobs only; "
                                              "MA_RUNTIME_HANG_DETECT=on checks a CPU job's IO and CPU")
        return None
    config = Config(
        window=window,
        startup=max(window, spec.hang_startup_seconds if spec.hang_startup_seconds is not None else 2 * window),
        period=min(PERIOD_CAP, window / PERIODS_PER_WINDOW),
        restarts=spec.hang_restarts,
        stacks=spec.hang_stacks,
        tool=tool,
        progress_file=spec.hang_progress_file,
        progress_pattern=spec.hang_progress_pattern,
    )
    log.info("hang detection on", window_s=window, period_s=round(config.period, 3), startup_s=config.startup,
             accelerators=tool or "none", progress=_progress_source(config), restarts=config.restarts)
    return config


def _progress_source(config: Config) -> str:
    if config.progress_file is not None:
        return f"file {config.progress_file}"
    if config.progress_pattern is not None:
        return "output pattern"
    return "metrics"


@dataclasses.dataclass
class Hang:
    """What the monitor found."""

    evidence: str  # why it is a hang, one clause: "no IO and 0.01 CPU cores for 600 s; accelerators flat (...)"
    device_fault: Optional[str]  # the accelerator tool reported a device lost or unhealthy, or could not read any
    progressed: bool  # the attempt made progress for at least a window before it hung: the hang count starts over
    found_at: float  # time.monotonic()
    stacks: Any = None  # a stacks.Stacks, once taken
    suspects: List[str] = dataclasses.field(default_factory=list)  # ranks idle throughout while others were busy

    @property
    def rank(self) -> Optional[int]:
        """The one rank in a different place from the others, when the stacks found exactly one; else the one rank
        that was idle throughout while the others were busy."""
        odd = getattr(self.stacks, "odd", None) or []
        named = odd if odd else self.suspects
        match = re.fullmatch(r"rank (\d+)", named[0]) if len(named) == 1 else None
        return int(match[1]) if match else None

    def describe(self) -> str:
        where = self.stacks.describe() if self.stacks is not None else ""
        return f"job suspected hung: {self.evidence}" + (f"; {where}" if where else "")


class Monitor:
    """One attempt's hang detection: `start`, then the supervision loop asks `found()` each turn."""

    def __init__(self, config: Config, utilisation: Callable[[], Any], log, where: Optional[Callable] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.utilisation = utilisation  # () -> devices.Utilisation or None
        self.where = where  # {worker name: its pids} -> stacks.Stacks: takes the stacks (None: stacks off)
        self.log = log
        self.clock = clock
        self.started = clock()
        self._progress_at: Optional[float] = None  # the last progress signal
        self._first_progress: Optional[float] = None
        self._file_mtime: Optional[float] = self._mtime()  # a file left by an earlier attempt is not progress
        self._io_at = self.started  # the end of the last period in which a rank did IO
        self._busy_at: Dict[int, float] = {}  # {rank: the end of its last busy period, or when it was first seen}
        self._labels: Dict[int, str] = {}  # {rank: "rank 3"}
        self._busy = BUSY_CORES if config.tool is not None else BUSY_CORES_CPU_ONLY
        self._cores: Deque[Tuple[float, Dict[int, float]]] = collections.deque()  # (time, {rank: cores}) per period
        self._devices: Deque[Tuple[float, Dict[str, Optional[float]]]] = collections.deque()
        self._faults: Deque[Tuple[float, str]] = collections.deque()  # (time, what the tool said was wrong)
        self._pattern_off = False
        self._found: Optional[Hang] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ the supervision loop's side

    def start(self, members: Callable[[], Mapping[int, Any]], wake: Callable[[], None]) -> None:
        """`members`: () -> {pid: its rank's ranks.Unit}, the job's processes (supervise/ranks.py)."""
        tree = JobTree(members)
        self._thread = threading.Thread(target=self._run, args=(tree, wake), name="hang-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            # A tool call in progress ends within its timeout; nothing waits on this thread's result.
            self._thread.join(timeout=0.5)

    def found(self) -> Optional[Hang]:
        return self._found

    def show_where(self, hang: Hang, trees: Dict[str, List[int]]) -> None:
        """The stacks of every rank, into `hang`, before the attempt is stopped (time-boxed by the dumper)."""
        if self.where is None:
            return
        try:
            hang.stacks = self.where(trees)
        except Exception as exc:  # the stop must happen whatever went wrong here
            self.log.warning("could not take the stacks of the hung attempt", error=f"{type(exc).__name__}: {exc}")

    def progress(self) -> None:
        """A progress signal (a matching output line): the hang clock starts again."""
        now = self.clock()
        self._progress_at = now
        if self._first_progress is None:
            self._first_progress = now

    def sink(self) -> "Optional[ProgressSink]":
        """The workers' output goes here too when a progress pattern is set."""
        if self.config.progress_pattern is None:
            return None
        from ma_runtime.supervise.progress import ProgressSink

        return ProgressSink(self.config.progress_pattern, self.progress, self._pattern_lost)

    def _pattern_lost(self) -> None:
        """The pattern's matcher is gone for the attempt (progress.py): the metrics decide, unless a file signals."""
        self._pattern_off = True

    # ------------------------------------------------------------------ the thread

    def _run(self, tree: JobTree, wake: Callable[[], None]) -> None:
        try:
            previous, previous_at = tree.sample(None), self.clock()
            while not self._stop.wait(self._wait()):
                current, now = tree.sample(self._not_busy()), self.clock()
                self._found = self.tick(previous, current, now - previous_at, now, tree.labels)
                previous, previous_at = current, now
                if self._found is not None:
                    wake()
                    return
        except Exception as exc:  # a bug of ours must not end the job: the attempt runs on, unwatched
            self.log.warning("hang detection stopped by an error; the attempt runs on without it",
                             error=f"{type(exc).__name__}: {exc}")

    def tick(self, before: Sample, after: Sample, seconds: float, now: float,
             labels: Optional[Mapping[int, str]] = None) -> Optional[Hang]:
        """One period: two looks at the job `seconds` apart, the devices and the progress file now; the hang, if this
        is one. `labels`: {rank pid: "rank 3"}, for the evidence."""
        if labels is not None:
            self._labels.update(labels)
        self._observe(activity(before, after, seconds), now, now - seconds)
        return self._judge(now)

    def _not_busy(self) -> Optional[Collection[int]]:
        """The ranks whose demand the next look reads: those that used less than a busy rank over the last period
        (the CPU time they got may be short of what they asked, on a loaded node). A busy one needs no more."""
        last = self._cores[-1][1] if self._cores else None
        return None if last is None else {unit for unit, cores in last.items() if cores < self._busy}

    @property
    def _signalled(self) -> bool:
        """Whether a progress signal decides, once it has beaten: a progress file, or a pattern still matched."""
        return self.config.progress_file is not None or (self.config.progress_pattern is not None
                                                          and not self._pattern_off)

    def _wait(self) -> float:
        """Until the next period, or sooner when that is when a hang would be declared."""
        now = self.clock()
        due = min(now + self.config.period, self._deadline())
        return max(MIN_WAIT, due - now)

    def _deadline(self) -> float:
        since, allowance = self._clock()
        return float("inf") if since is None else since + allowance

    def _clock(self) -> Tuple[Optional[float], float]:
        """(when the hang clock started, or None while nothing can be judged; how long it may run). The clock: the
        last progress signal, once there was one; else since when no rank did IO and one rank was idle. The
        window, or the start-up allowance before the attempt's first progress."""
        allowance = self.config.window if self._first_progress is not None else self.config.startup
        if self._signalled and self._progress_at is not None:
            return self._progress_at, allowance
        # Before a signal's first beat the metrics decide: CPU use while torch is imported is not a hang.
        if not self._busy_at:
            return None, allowance  # no rank to judge (yet): a node whose ranks mpirun has not started
        return max(self.started, self._io_at, min(self._busy_at.values())), allowance

    def _observe(self, interval: Interval, now: float, looked_before: float) -> None:
        if interval.io:
            self._io_at = now
        for unit, cores in interval.cores.items():
            if cores >= self._busy:
                self._busy_at[unit] = now
            elif unit not in self._busy_at:
                self._busy_at[unit] = looked_before  # a rank's clock starts at the first look that could see it
        for gone in set(self._busy_at) - interval.cores.keys():
            del self._busy_at[gone]
        self._keep(self._cores, (now, interval.cores))
        if self.config.tool is None and any(cores >= self._busy for cores in interval.cores.values()):
            self._progressed(now)  # a CPU-only job's first progress: a rank busy
        self._sample_devices(now)
        mtime = self._mtime()
        if mtime is not None and mtime != self._file_mtime:
            self._file_mtime = mtime
            self.progress()

    def _sample_devices(self, now: float) -> None:
        if self.config.tool is None:
            return
        found = self.utilisation()
        if found is None:
            return
        if found.failure:
            self._keep(self._faults, (now, found.failure))
            return
        for fault in found.unhealthy:
            self._keep(self._faults, (now, f"{found.tool}: {fault}"))
        self._keep(self._devices, (now, dict(found.devices)))
        if any(value is not None and value > IDLE_PERCENT for value in found.devices.values()):
            self._progressed(now)

    def _progressed(self, now: float) -> None:
        if self._first_progress is None and not self._signalled:
            self._first_progress = now

    def _keep(self, queue: Deque, item) -> None:
        """Appends, and drops what is older than the longest window that can be judged."""
        queue.append(item)
        horizon = item[0] - max(self.config.window, self.config.startup) - self.config.period
        while queue and queue[0][0] < horizon:
            queue.popleft()

    def _mtime(self) -> Optional[float]:
        if self.config.progress_file is None:
            return None
        try:
            return os.stat(self.config.progress_file).st_mtime
        except OSError:
            return None

    def _judge(self, now: float) -> Optional[Hang]:
        since, allowance = self._clock()
        if since is None or now - since < allowance:
            return None
        start = now - allowance
        faults = [fault for t, fault in self._faults if t >= start]
        if self._signalled and self._progress_at is not None:
            evidence = f"no progress signal ({_progress_source(self.config)}) for {allowance:g} s"
            return self._hang(now, f"{evidence}; {self._metrics(start)}", faults)
        devices = [sample for t, sample in self._devices if t >= start]
        level = flat(devices) if self.config.tool is not None and devices else (0.0, 0.0)
        if level is None:
            return None  # the devices are still changing: not hung (yet)
        evidence, suspects = self._quiet(start, allowance)
        if self.config.tool is not None:
            evidence += "; " + (flat_words(level, len(devices)) if devices else
                                f"the accelerators could not be read ({faults[-1] if faults else 'no answer'})")
        if self._signalled:
            evidence = f"no progress signal ({_progress_source(self.config)}) since the start, and {evidence}"
        return self._hang(now, evidence, faults, suspects)

    def _quiet(self, start: float, allowance: float) -> Tuple[str, List[str]]:
        """Why the metrics say hung, in words, and the ranks idle throughout when others were not (the suspects)."""
        peaks: Dict[int, float] = dict.fromkeys(self._busy_at, 0.0)
        for t, cores in self._cores:
            if t > start:
                for unit in peaks.keys() & cores.keys():
                    peaks[unit] = max(peaks[unit], cores[unit])
        idle = [unit for unit, at in self._busy_at.items() if at <= start]
        others = [unit for unit in self._busy_at if unit not in idle]
        who = "every rank" if len(idle) > 1 and not others else self._names(idle)
        text = (f"no IO for {allowance:g} s, and {who} idle throughout (at most "
                f"{max(peaks[unit] for unit in idle):.2f} CPU cores)")
        if others:
            text += (f"; {self._names(others)} busy without IO (up to {max(peaks[unit] for unit in others):.2f} "
                     "cores: busy-polling?)")
        return text, ([self._labels.get(unit, f"pid {unit}") for unit in idle] if others else [])

    def _names(self, units: Sequence[int]) -> str:
        labels = sorted((self._labels.get(unit, f"pid {unit}") for unit in units), key=_rank_order)
        shown = labels[:NAMED] if len(labels) <= NAMED else labels[:NAMED - 1]
        more = f" and {len(labels) - len(shown)} more" if len(shown) < len(labels) else ""
        return ", ".join(shown) + more

    def _metrics(self, start: float) -> str:
        busiest = max((sum(cores.values()) for t, cores in self._cores if t > start), default=0.0)
        devices = [sample for t, sample in self._devices if t >= start]
        level = flat(devices) if devices else None
        used = f"at most {busiest:.2f} CPU cores"
        if level is not None and devices:
            return f"{used}, {flat_words(level, len(devices))}"
        return used + (", the accelerators busy and changing" if devices else "")

    def _hang(self, now: float, evidence: str, faults: List[str], suspects: Sequence[str] = ()) -> Hang:
        since, _ = self._clock()
        progressed = (self._first_progress is not None and since is not None
                      and since - self._first_progress >= self.config.window)
        return Hang(evidence, faults[-1] if faults else None, progressed, now, suspects=list(suspects))


def _rank_order(label: str) -> Tuple[int, int, str]:
    match = re.fullmatch(r"rank (\d+)", label)
    return (0, int(match[1]), "") if match else (1, 0, label)


