"""The measuring rules every benchmark here shares, so that no script can flatter on its own.

- Round-robin: each round runs every measured thing once, the anchors included, and each round
  starts one thing later than the one before (a rotation). Machine drift, and "who runs right after
  the expensive one", then fall on every row alike instead of on one.
- The load beside each figure: `os.getloadavg()` (1-minute) is taken right after every sample, and
  every row prints the range its samples saw. These benchmarks run on 2 shared cores; a busy
  machine must show in the row, not hide in it.
- Min, median and max over the rounds, at least MIN_ROUNDS of them for a figure worth quoting; never
  a best run alone.
- Ratios to the anchor both per round (ours / anchor within one round, then min/median/max of those)
  and of the medians. The ratio of the medians can pair samples taken minutes apart; the per-round
  ratio pairs neighbours, so the two together show how much of a ratio is the machine.

Also here, because two scripts need it: ma_runtime installed from a wheel into a scratch venv (as an
image installs it), so that start-up figures carry no editable-install import hook.

Standard library only.
"""

import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

MIN_ROUNDS = 5
PROJECT = Path(__file__).resolve().parent.parent
# What a wheel is built from: the package and the files pyproject.toml names (readme, license).
_PROJECT_FILES = ("pyproject.toml", "README.md", "LICENSE", "NOTICE")


# --------------------------------------------------------------------------- arguments


def add_round_arguments(parser, rounds: int, warmup: int, aliases: Sequence[str] = ()) -> None:
    """--rounds (with the script's old name as an alias) and --warmup."""
    parser.add_argument("--rounds", *aliases, dest="rounds", type=int, default=rounds,
                        help=f"timed rounds, round-robin over everything measured (default {rounds}; "
                             f"at least {MIN_ROUNDS} for a figure worth quoting)")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed rounds first (default {warmup})")


# --------------------------------------------------------------------------- measuring


def load_1min() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return math.nan


@dataclasses.dataclass
class Sample:
    round: int  # 0-based timed round; rows of one round were measured side by side
    load: float  # 1-minute load average right after the measurement
    result: Any  # what the measured callable returned (a number, or a dict of facts)


def rotated(names: Sequence[str], index: int) -> List[str]:
    shift = index % len(names)
    return list(names[shift:]) + list(names[:shift])


def round_robin(tasks: Mapping[str, Callable[[], Any]], rounds: int, warmup: int = 0,
                progress: Optional[Callable[[str, str, Any], None]] = None) -> Dict[str, List[Sample]]:
    """Runs every task once per round, warm-up rounds first (not kept); samples per task name."""
    names = list(tasks)
    samples: Dict[str, List[Sample]] = {name: [] for name in names}
    for index in range(-warmup, rounds):
        label = "warm-up" if index < 0 else f"round {index + 1}/{rounds}"
        for name in rotated(names, index):
            result = tasks[name]()
            sample = Sample(index, load_1min(), result)
            if progress is not None:
                progress(name, label, result)
            if index >= 0:
                samples[name].append(sample)
    return samples


# --------------------------------------------------------------------------- summaries


@dataclasses.dataclass
class Summary:
    n: int
    min: float
    median: float
    max: float
    load_min: float
    load_median: float
    load_max: float

    def as_dict(self) -> Dict[str, float]:
        return dataclasses.asdict(self)

    def scaled(self, factor: float) -> "Summary":
        """The same figures in another unit (the loads stay); a negative factor swaps min and max."""
        low, high = sorted((self.min * factor, self.max * factor))
        return dataclasses.replace(self, min=low, median=self.median * factor, max=high)


def _number(result: Any) -> Optional[float]:
    return None if result is None else float(result)


def summarize(samples: Sequence[Sample], value: Callable[[Any], Optional[float]] = _number) -> Optional[Summary]:
    """Min/median/max of value(result) over the samples, and of the loads beside them; None if none had one."""
    pairs = [(value(s.result), s.load) for s in samples]
    values = sorted(v for v, _ in pairs if v is not None)
    loads = sorted(load for v, load in pairs if v is not None)
    if not values:
        return None
    return Summary(len(values), values[0], statistics.median(values), values[-1],
                   loads[0], statistics.median(loads), loads[-1])


def per_round(ours: Sequence[Sample], anchor: Sequence[Sample], combine: Callable[[float, float], float],
              value: Callable[[Any], Optional[float]] = _number) -> Optional[Summary]:
    """combine(ours, anchor) within each round both have, summarized; the load is the higher of the two."""
    anchor_by_round = {s.round: s for s in anchor}
    paired = []
    for sample in ours:
        partner = anchor_by_round.get(sample.round)
        if partner is None:
            continue
        mine, theirs = value(sample.result), value(partner.result)
        if mine is None or theirs is None:
            continue
        paired.append(Sample(sample.round, max(sample.load, partner.load), combine(mine, theirs)))
    return summarize(paired)


def ratio(ours: float, anchor: float) -> float:
    return ours / anchor if anchor else math.nan


def difference(ours: float, anchor: float) -> float:
    return ours - anchor


@dataclasses.dataclass
class Comparison:
    """ours against an anchor: per round and of the medians."""

    per_round: Optional[Summary]
    of_medians: Optional[float]

    def as_dict(self) -> Dict[str, Any]:
        return {"per_round": self.per_round.as_dict() if self.per_round else None, "of_medians": self.of_medians}

    def scaled(self, factor: float) -> "Comparison":
        """The same comparison in another unit (a difference of seconds, in ms)."""
        return Comparison(self.per_round.scaled(factor) if self.per_round else None,
                          None if self.of_medians is None else self.of_medians * factor)


def compare(ours: Sequence[Sample], anchor: Sequence[Sample], combine: Callable[[float, float], float] = ratio,
            value: Callable[[Any], Optional[float]] = _number) -> Comparison:
    mine, theirs = summarize(ours, value), summarize(anchor, value)
    of_medians = combine(mine.median, theirs.median) if mine and theirs else None
    return Comparison(per_round(ours, anchor, combine, value), of_medians)


# --------------------------------------------------------------------------- printing


def machine_line() -> str:
    try:
        one, five, fifteen = os.getloadavg()
        load = f"load average now {one:.2f} {five:.2f} {fifteen:.2f} (1/5/15 min)"
    except OSError:
        load = "no load average on this platform"
    return f"{os.cpu_count()} CPUs, {load}"


def print_header(what: str, rounds: int, warmup: int) -> None:
    print(f"{what}\n{rounds} rounds after {warmup} warm-up, round-robin (each round starts one row later); "
          f"{machine_line()}")
    if rounds < MIN_ROUNDS:
        print(f"NOTE: fewer than {MIN_ROUNDS} rounds: a quick check, not a figure to quote")


def number(value: Optional[float], digits: int = 1) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


def load_text(summary: Summary) -> str:
    return f"{summary.load_median:.2f} [{summary.load_min:.2f}-{summary.load_max:.2f}]"


def print_table(title: str, rows: Sequence[Tuple[str, Optional[Summary]]], unit: str, digits: int = 1,
                notes: Optional[Mapping[str, str]] = None) -> None:
    """One row per figure: min, median, max, and the load its samples saw (median [min-max])."""
    width = max([len(label) for label, _ in rows] + [6])
    print(f"\n{title}")
    print(f"  {'':<{width}} {'min':>11} {'median':>11} {'max':>11}  {'unit':<8} {'load 1-min':<20} n")
    for label, summary in rows:
        note = f"  {notes[label]}" if notes and label in notes else ""
        if summary is None:
            print(f"  {label:<{width}} {'FAILED':>11}{note}")
            continue
        print(f"  {label:<{width}} {number(summary.min, digits):>11} {number(summary.median, digits):>11} "
              f"{number(summary.max, digits):>11}  {unit:<8} {load_text(summary):<20} {summary.n}{note}")


def comparison_text(comparison: Comparison, unit: str = "x", digits: int = 2) -> str:
    """'1.23x of the medians; per round 1.10 / 1.20 / 1.31x (load ...)'."""
    if comparison.per_round is None or comparison.of_medians is None:
        return "no figure (a row failed)"
    each = comparison.per_round
    return (f"{number(comparison.of_medians, digits)}{unit} of the medians; per round min/median/max "
            f"{number(each.min, digits)} / {number(each.median, digits)} / {number(each.max, digits)}{unit} "
            f"(load {load_text(each)})")


def verdict(met: bool) -> str:
    return "MET" if met else "MISSED"


# --------------------------------------------------------------------------- goals and verdicts


@dataclasses.dataclass(frozen=True)
class Goal:
    """A goal as written where it was set, and the limit its verdict holds the measured figure to.

    `source` says where the text is written; where the issue that made it precise states it otherwise
    than the design's budgets, the issue's wording is the goal and `source` says so. The verdict is taken on the
    figure the goal names (a ratio to its anchor, CPU per line), never on a kinder stand-in for it.
    """

    key: str  # the row of the README's table, stable across runs
    text: str  # the goal, as written
    source: str
    limit: float
    unit: str  # of the limit and the figure: "x", "ms", "µs/line"
    at_most: bool = True  # met when the figure is <= the limit; False: >= the limit

    def met(self, figure: float) -> bool:
        return figure <= self.limit if self.at_most else figure >= self.limit


def print_goal(goal: Goal) -> None:
    print(f"GOAL {goal.key}: {goal.text} [{goal.source}]")


def judge(goal: Goal, figure: Optional[float], measured: str, spread: Optional[Summary] = None,
          note: str = "", broken: bool = False) -> Dict[str, Any]:
    """The verdict of one goal, printed, as the record the README's table is generated from.

    `figure` is what the goal names (the ratio of the medians, a median); `measured` says what it is;
    `spread`, where there is one, the same figure per round (min/median/max) with the loads its samples
    saw. A goal without a figure (a row failed) is neither met nor missed: "no figure". `broken`: a
    condition the goal also names failed (lines lost), so it is missed whatever the figure; `note` says which.
    """
    met = None if figure is None or math.isnan(figure) else goal.met(figure) and not broken
    record = {
        "key": goal.key, "benchmark": Path(sys.argv[0]).name, "goal": goal.text, "source": goal.source,
        "limit": goal.limit, "unit": goal.unit, "at_most": goal.at_most, "measured": measured,
        "figure": figure, "per_round": spread.as_dict() if spread else None, "broken": broken, "met": met,
        "note": note,
    }
    record["line"] = verdict_line(record)
    print(f"VERDICT {record['line']}")
    return record


def verdict_line(record: Mapping[str, Any]) -> str:
    """'ranktable: 1.54x (per round 1.14 / 1.54 / 1.83x, load 1.10 [0.9-1.3]) against <= 1.2x: MISSED'."""
    unit = record["unit"]
    digits = 1 if unit == "ms" else 2
    spread = record.get("per_round")
    text = f"{record['key']}: {record['measured']} {figure_text(record['figure'], unit, digits)}"
    if spread:
        text += (f" (per round {number(spread['min'], digits)} / {number(spread['median'], digits)} / "
                 f"{number(spread['max'], digits)}{unit_suffix(unit)}, load {spread['load_median']:.2f} "
                 f"[{spread['load_min']:.2f}-{spread['load_max']:.2f}])")
    limit = figure_text(record["limit"], unit, digits)
    outcome = "no figure (a row failed)" if record["met"] is None else verdict(record["met"])
    text += f" against {'<=' if record['at_most'] else '>='} {limit}: {outcome}"
    return text + (f"; {record['note']}" if record.get("note") else "")


def unit_suffix(unit: str) -> str:
    return unit if unit == "x" else f" {unit}"


def figure_text(value: Optional[float], unit: str, digits: int = 2) -> str:
    return "-" if value is None else f"{number(value, digits)}{unit_suffix(unit)}"


def run_record(verdicts: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """What the JSON output says about the run the verdicts come from: the command, when, on what load."""
    argv = list(sys.argv[1:])
    if "--json" in argv:  # where the file went is no part of what was measured
        index = argv.index("--json")
        del argv[index:index + 2]
    return {
        "command": " ".join(["benchmarks/" + Path(sys.argv[0]).name, *argv]),
        "taken_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "cpus": os.cpu_count(), "load_at_end": machine_line(), "verdicts": list(verdicts),
    }


# --------------------------------------------------------------------------- processes


def process_cpu_seconds(pid: int, children: bool = False) -> Optional[float]:
    """utime + stime of a process (all its threads) from /proc; with children=True, those of the children
    it has reaped instead. None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    first = 13 if children else 11  # cutime/cstime, or utime/stime (fields 16/17 or 14/15 of proc(5))
    return (int(fields[first]) + int(fields[first + 1])) / os.sysconf("SC_CLK_TCK")


def process_syscalls(pid: int) -> Optional[Dict[str, int]]:
    """The read and write system calls a process (all its threads) has made: syscr/syscw of /proc/PID/io;
    None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/io") as handle:
            fields = dict(line.split(": ") for line in handle.read().splitlines())
    except (OSError, ValueError):
        return None
    return {"reads": int(fields["syscr"]), "writes": int(fields["syscw"])}


def wait_with_cpu(proc: subprocess.Popen) -> Tuple[int, Optional[float], Optional[float], Optional[Dict[str, int]]]:
    """Waits for proc; (returncode, its own CPU seconds, its reaped children's CPU seconds, its own read and
    write system calls).

    Read while it is a zombie (waitid with WNOWAIT), so the figures are final: nothing it did
    before exiting is missed, and nothing of ours is counted.
    """
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    own, reaped = process_cpu_seconds(proc.pid), process_cpu_seconds(proc.pid, children=True)
    syscalls = process_syscalls(proc.pid)
    return proc.wait(), own, reaped, syscalls


# --------------------------------------------------------------------------- ma_runtime from a wheel


def install_wheel(scratch: Path, project: Path = PROJECT) -> Path:
    """A venv under scratch with ma_runtime installed from a wheel, as an image installs it; its path.

    The wheel is built from a copy of the sources (pip builds in the source folder, and the checkout
    may be in use); where the build backend cannot be fetched, this interpreter's setuptools builds
    it. The venv has no pip or setuptools, so no `.pth` hook of theirs runs at start-up either; pip
    compiles the `.pyc` files as it installs, as it does for any image. The dependencies come from
    the configured index (pip's cache makes that work offline here); where that fails, the wheel
    goes in without them and a `.pth` file points at this interpreter's site-packages for them
    (`.pth` files are not read from there, so no editable hook comes along).
    """
    source, wheels, venv = scratch / "src", scratch / "wheel", scratch / "venv"
    _copy_sources(project, source)
    build = ["wheel", "--no-deps", "--quiet", "--wheel-dir", str(wheels), str(source)]
    try:
        _pip(build, "building the wheel")
    except RuntimeError as exc:  # no index for the build backend: this interpreter's setuptools may do
        print(f"NOTE: {exc}; building with this interpreter's setuptools instead", file=sys.stderr)
        _pip([*build, "--no-build-isolation"], "building the wheel")
    (wheel,) = wheels.glob("*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    try:
        _pip(["--python", python, "install", "--quiet", str(wheel)], "installing the wheel")
    except RuntimeError as exc:
        print(f"NOTE: {exc}; installing it without dependencies, which come from {sys.executable}'s "
              "site-packages instead", file=sys.stderr)
        _pip(["--python", python, "install", "--quiet", "--no-deps", str(wheel)], "installing the wheel")
        _borrow_site_packages(python)
    _check_installed(python, venv)
    return venv


def _copy_sources(project: Path, source: Path) -> None:
    source.mkdir(parents=True)
    for name in _PROJECT_FILES:
        if (project / name).exists():
            shutil.copy2(project / name, source / name)
    shutil.copytree(project / "ma_runtime", source / "ma_runtime",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def _pip(arguments: List[str], what: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *arguments], stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stdout.splitlines() if line.strip() and "is ignored" not in line]
        raise RuntimeError(f"{what} failed (pip exited {done.returncode}): {' | '.join(lines[-3:])}")


def _borrow_site_packages(python: str) -> None:
    paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    target = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            check=True, capture_output=True, text=True).stdout.strip()
    Path(target, "zz-borrowed-dependencies.pth").write_text("".join(f"{path}\n" for path in paths))


def _check_installed(python: str, venv: Path) -> None:
    """The venv imports ma_runtime from its own site-packages, not from the checkout."""
    # From the venv's folder: `python -c` puts the working directory first on sys.path.
    where = subprocess.run([python, "-c", "import ma_runtime; print(ma_runtime.__file__)"], check=True,
                           capture_output=True, text=True, cwd=venv).stdout.strip()
    if not Path(where).resolve().is_relative_to(venv.resolve()):
        raise RuntimeError(f"the scratch venv imports ma_runtime from {where}, not from its wheel install")


def to_json(value: Any) -> Any:
    """`json.dump(..., default=to_json)`: the harness's figures as plain data, anything else as text."""
    if isinstance(value, (Summary, Comparison)):
        return value.as_dict()
    if isinstance(value, Sample):
        return vars(value)
    return str(value)


def run_parts(steps: Mapping[str, Callable[[], Dict[str, Any]]], parts: Sequence[str], json_path: Optional[str],
              environment: Mapping[str, Any]) -> None:
    """Runs the chosen parts in order (each returns {"results": ..., "samples": ...}) and writes them to
    `json_path` as one document, when one is given."""
    results: Dict[str, Any] = {}
    samples: Dict[str, Any] = {}
    for part in parts:
        print(flush=True)
        outcome = steps[part]()
        results[part], samples[part] = outcome["results"], outcome["samples"]
    if json_path:
        payload = {"environment": dict(environment), **results, "samples": samples}
        with open(json_path, "w") as handle:
            json.dump(payload, handle, indent=2, default=to_json)


def value_of(key: str) -> Callable[[Dict[str, Any]], Optional[float]]:
    """A sample's figure: the value under `key` in its result (a dict)."""
    return lambda result: result.get(key)


def table(title: str, samples: Mapping[str, Sequence[Sample]], rows: Sequence[Tuple[str, Tuple[str, str]]],
          unit: str, digits: int = 1) -> Dict[str, Optional[Summary]]:
    """Prints the rows (label, (task, key of its result)); returns their summaries by label."""
    summaries = {label: summarize(samples[name], value_of(key)) for label, (name, key) in rows}
    print_table(title, list(summaries.items()), unit, digits)
    return summaries


def failures(samples: Mapping[str, Sequence[Sample]]) -> List[str]:
    """One line per failed sample (its result's `error`), printed."""
    lines = [f"{name}, round {s.round + 1}: {s.result['error']}" for name, rows in samples.items() for s in rows
             if s.result.get("error")]
    for line in lines:
        print(f"  FAILED {line}")
    return lines
