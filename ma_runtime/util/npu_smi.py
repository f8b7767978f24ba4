"""The one reader of `npu-smi info`'s output, for the preflight (`preflight/npu`: how many NPUs, their health) and
for supervision (`supervise/devices`: who holds a device between attempts, each chip's AICore for the hang
detector). ma_runtime/local/fakes/npu-smi prints the real formats of each version.

Two tables: the NPU table, two rows per NPU (`| <npu> <name> | <Health> | ...` then its chips, `| <chip> [<phy id>] |
<Bus-Id> | <AICore(%)> <memory> ... |`), then the process table (`| <npu> <chip> | <pid> | <name> | <memory> |`).
Devices are named "NPU 3", or "NPU 3 chip 1" for a chip other than 0, alike in every message.

Health: OK is healthy; Warning is a minor alarm (the card still trains: healthy, with a warning); Alarm, Critical
and anything else are not.

`npus` is lenient (the preflight counts what it can read); `processes` and `utilisation` raise Unparsable, quoting
the line, for output that is not the table we know: a wait must not read "released" into what it did not
understand.
"""

import re
from typing import Dict, List, NamedTuple, Optional, Tuple

ARGV = ("npu-smi", "info")
HEALTHY = "OK"
MINOR = "Warning"
BUS_ID = re.compile(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]")
_NO_PROCESS = "No running processes found"
# A cell that holds no value: npu-smi prints NA, nvidia-smi [N/A] or [Not Supported].
NO_VALUE = frozenset({"", "NA", "N/A", "[N/A]", "[Not Supported]"})
# npu-smi also prints "-" for a value a chip does not report (the second chip's power on an Atlas A3).
NO_READING = NO_VALUE | {"-"}
_PERCENT = re.compile(r"(\d+(?:\.\d+)?)\s*%?")


class Unparsable(ValueError):
    """Tool output that is not the table we know; the message quotes the line."""


class Npu(NamedTuple):
    index: str
    health: str
    bus_id: Optional[str] = None

    def describe(self) -> str:
        return f"NPU {self.index} ({self.bus_id or 'bus id unknown'}): {self.health}"


class Process(NamedTuple):
    """A row of the process table."""

    device: str  # "NPU 3", "NPU 0 chip 1"
    pid: int  # as npu-smi reports it
    name: str  # "" when it shows none
    memory_mb: Optional[int]  # None when it shows none


def healthy(health: str) -> bool:
    return health in (HEALTHY, MINOR)


def row_cells(line: str) -> List[str]:
    """The cells of one `| a | b |` row of npu-smi's tables; [] for a border or any other line."""
    line = line.strip()
    if not line.startswith("|"):
        return []
    return [cell.strip() for cell in line.strip("|").split("|")]


def npus(out: str) -> List[Npu]:
    """NPU rows of the first table; the process table below it has rows of the same shape."""
    found: List[Npu] = []
    for line in out.splitlines():
        if "Process id" in line:
            break
        cells = row_cells(line)
        if len(cells) < 3:
            continue
        head = cells[0].split()
        # First row of an NPU: "<index> <name>" then an alphabetic Health; a chip row has a Bus-Id there.
        if len(head) >= 2 and head[0].isdigit() and cells[1].isalpha():
            found.append(Npu(head[0], cells[1]))
        elif found and found[-1].bus_id is None and BUS_ID.fullmatch(cells[1]):
            found[-1] = found[-1]._replace(bus_id=cells[1])
    return found


def processes(out: str) -> List[Process]:
    """The process table after the NPU table of `npu-smi info`.

    Rows: `| <npu> <chip> | <pid> | <name> | <memory> |` (npu-smi 25 adds `| <pid in
    container> |`; Ascend 950 has one `NPU ID` cell instead of NPU and chip). Several
    processes on one NPU are consecutive rows; an idle NPU has one row
    `No running processes found in NPU <n>`. Columns are found by their header, so the
    versions' different layouts read alike.
    """
    lines = out.splitlines()
    start = next((i for i, line in enumerate(lines) if "Process id" in row_cells(line)), None)
    if start is None:
        raise Unparsable(f"no process table: {_first_line(out) or 'no output'}")
    header = row_cells(lines[start])
    pid_at, name_at = header.index("Process id"), _column(header, "Process name")
    memory_at = _column(header, "Process memory")
    rows = []
    for line in lines[start + 1:]:
        cells = row_cells(line)
        # Ascend 950 prints a row of NA for an idle NPU.
        if not cells or cells[0].startswith(_NO_PROCESS) or (len(cells) > 1 and set(cells[1:]) <= NO_VALUE):
            continue
        if len(cells) < len(header):
            raise Unparsable(f"an unexpected process row: {line.strip()}")
        rows.append(Process(_npu_device(cells[0], line), _pid(cells[pid_at], line),
                            cells[name_at] if name_at is not None else "",
                            memory_mb(cells[memory_at]) if memory_at is not None else None))
    return rows


def _column(header: List[str], title: str) -> Optional[int]:
    return next((i for i, cell in enumerate(header) if cell.startswith(title)), None)


def _npu_device(cell: str, line: str) -> str:
    ids = cell.split()
    if not ids or not all(part.isdigit() for part in ids):
        raise Unparsable(f"an unexpected process row: {line.strip()}")
    # Chip 0 is the only chip of most NPUs (910B); others (310P, 910 pro) have several.
    chip = ids[1] if len(ids) > 1 else "0"
    return f"NPU {ids[0]}" + (f" chip {chip}" if chip != "0" else "")


def _pid(cell: str, line: str) -> int:
    if not cell.isdigit():
        raise Unparsable(f"an unexpected process row: {line.strip()}")
    return int(cell)


def memory_mb(cell: str) -> Optional[int]:
    """The leading number of a memory cell (MB); None where it has none (NA, [N/A]): for nvidia-smi's too."""
    match = re.match(r"\d+", cell)
    return int(match[0]) if match else None


def utilisation(out: str, err: str = "") -> Tuple[Dict[str, Optional[float]], List[str]]:
    """(AICore(%) of each chip, None where npu-smi shows none; a phrase per unhealthy NPU), from the NPU table.

    An NPU is a row `| <npu> <name> | <Health> | ...` and the chip rows under it,
    `| <chip> [<phy id>] | <Bus-Id> | <AICore(%)> <memory> ... |`: one chip on a 910B, several
    under one NPU row on a 310P card, each chip under its own repeated NPU row on an Atlas A3.
    Health and Bus-Id are found by their header cells; AICore(%) shares a cell with the memory
    columns, so its value is the word under its title in the header.
    """
    lines = out.splitlines()
    top = next((i for i, line in enumerate(lines) if "Health" in row_cells(line)), len(lines))
    below = next((i for i in range(top + 1, len(lines)) if "Bus-Id" in row_cells(lines[i])), None)
    if below is None:
        raise Unparsable(f"no NPU table: {_first_line(out) or 'no output'}")
    health_at, bus_at = row_cells(lines[top]).index("Health"), row_cells(lines[below]).index("Bus-Id")
    title_at = lines[below].find("AICore(%)")
    if title_at < 0:
        raise Unparsable(f"no AICore(%) column: {lines[below].strip()}")
    title = (title_at, title_at + len("AICore(%)"))
    npus: List[Tuple[str, str, List[str]]] = []  # (index, health, its chips' device names)
    found: Dict[str, Optional[float]] = {}
    for line in lines[below + 1:]:
        cells = row_cells(line)
        if "Process id" in cells:
            break
        if not cells:
            continue
        ids = cells[0].split()
        if len(cells) <= max(health_at, bus_at) or not ids or not ids[0].isdigit():
            raise Unparsable(f"an unexpected NPU row: {line.strip()}")
        if BUS_ID.fullmatch(cells[bus_at]):
            if not npus:
                raise Unparsable(f"a chip row before any NPU row: {line.strip()}")
            device = f"NPU {npus[-1][0]}" + (f" chip {ids[0]}" if ids[0] != "0" else "")
            found[device] = reading(_word_under(title, line), line)
            npus[-1][2].append(device)
        elif len(ids) >= 2 and cells[health_at]:
            npus.append((ids[0], cells[health_at], []))
        else:
            raise Unparsable(f"an unexpected NPU row: {line.strip()}")
    return found, [_unwell(index, health, chips) for index, health, chips in npus if not healthy(health)]


def _word_under(span: Tuple[int, int], line: str) -> str:
    """The word of `line` that stands (at least in part) under the header title at `span`."""
    word = next((m for m in re.finditer(r"[^\s|]+", line) if m.start() < span[1] and m.end() > span[0]), None)
    if word is None:
        raise Unparsable(f"no AICore(%) value in: {line.strip()}")
    return word[0]


def reading(value: str, line: str) -> Optional[float]:
    """A utilisation cell as a percent; None where the tool shows none: nvidia-smi's cells read alike."""
    if value in NO_READING:
        return None
    match = _PERCENT.fullmatch(value)
    if not match:
        raise Unparsable(f"an unexpected utilisation {value!r} in: {line.strip()}")
    return float(match[1])


def _unwell(index: str, health: str, chips: List[str]) -> str:
    # An NPU row over a single chip (910B, each A3 chip) is that chip's health; over several (310P), the card's.
    device = chips[0] if len(chips) == 1 else f"NPU {index}"
    return f"{device}: {health}"


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
