"""The `npu` check: enough healthy Ascend NPUs for MA_NUM_GPUS.

Visible NPUs are the dev dir's davinci<N> nodes (davinci_manager must be there too)
and the NPUs `npu-smi info` lists: two table rows per NPU, the first with the NPU
index, name and Health, the second with the chip and Bus-Id.

Health: OK is healthy; Alarm, Critical and anything else unknown are unhealthy.
Warning is a minor alarm: the card still trains, and rescheduling a job over it
would cost more than it saves, so a Warning NPU counts as healthy and the result is
a warn (npu.health-warning) naming it, never a fail.

When another container holds the devices, npu-smi prints "dcmi model initialized
failed, because the device is used. ret is -8020" and exits non-zero: npu.in-use.
Any other non-zero exit without a table is npu.tool-failed with the first error line.

Codes: ok; npu.missing, npu.manager-missing, npu.in-use, npu.too-few, npu.unhealthy
(fail; warn when the healthy NPUs still cover MA_NUM_GPUS), npu.health-warning (warn),
npu.tool-missing, npu.tool-timeout, npu.tool-failed; npu.not-applicable (skip).
"""

import re
from typing import Any, List, Mapping, NamedTuple, Optional

from ma_runtime.preflight import accelerator
from ma_runtime.preflight.accelerator import NPU, NPU_KIND, NPU_MANAGER, Census
from ma_runtime.preflight.model import Result, Status
from ma_runtime.process.lifecycle import ToolError, run_tool

ARGV = ("npu-smi", "info")
_IN_USE = re.compile(r"device is used|ret is -8020", re.IGNORECASE)
_BUS_ID = re.compile(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]")
HEALTHY = "OK"
MINOR = "Warning"


class Npu(NamedTuple):
    index: str
    health: str
    bus_id: Optional[str] = None

    def describe(self) -> str:
        return f"NPU {self.index} ({self.bus_id or 'bus id unknown'}): {self.health}"


def run(spec: Any, environ: Mapping[str, str]) -> List[Result]:
    choice = accelerator.choose(spec, environ)
    if choice.flavour != NPU:
        return [accelerator.not_applicable(NPU_KIND, choice)]
    names = accelerator.node_names(spec.preflight_dev_dir)
    nodes = accelerator.count_nodes(NPU_KIND, names)
    if nodes and NPU_MANAGER not in names:
        return [accelerator.manager_missing(spec, nodes)]
    try:
        returncode, out, err = run_tool(ARGV, spec.preflight_tool_timeout_seconds, env=dict(environ))
    except ToolError as error:
        return [accelerator.tool_error(NPU_KIND, error, nodes, spec)]
    return [judge(spec, nodes, returncode, out, err)]


def judge(spec: Any, nodes: int, returncode: int, out: str, err: str) -> Result:
    output = err + "\n" + out
    held = next((line.strip() for line in output.splitlines() if _IN_USE.search(line)), None)
    # Checked before the table: a held device makes npu-smi fail as a whole, whatever else it printed.
    if held:
        return in_use(spec, held)
    npus = parse_table(out)
    if returncode != 0 and not npus:
        return accelerator.tool_failed(NPU_KIND, spec, returncode, output)
    healthy = [n for n in npus if n.health in (HEALTHY, MINOR)]
    census = Census(
        nodes, len(npus), len(healthy),
        unhealthy=[n.describe() for n in npus if n.health not in (HEALTHY, MINOR)],
        warned=[n.describe() for n in npus if n.health == MINOR],
    )
    return accelerator.verdict(NPU_KIND, census, spec)


def in_use(spec: Any, line: str) -> Result:
    hint = (
        f"npu-smi: {line}: the NPUs are held by another container (or process); free them or reschedule the job"
        " on another node"
    )
    return Result(NPU, Status.FAIL, "npu.in-use", None, accelerator.required(spec), hint=hint, unit="count",
                  detail={"output": line})


def parse_table(out: str) -> List[Npu]:
    """NPU rows of the first table; the process table below it has rows of the same shape."""
    npus: List[Npu] = []
    for line in out.splitlines():
        if "Process id" in line:
            break
        cells = row_cells(line)
        if len(cells) < 3:
            continue
        head = cells[0].split()
        # First row of an NPU: "<index> <name>" then an alphabetic Health; a chip row has a Bus-Id there.
        if len(head) >= 2 and head[0].isdigit() and cells[1].isalpha():
            npus.append(Npu(head[0], cells[1]))
        elif npus and npus[-1].bus_id is None and _BUS_ID.fullmatch(cells[1]):
            npus[-1] = npus[-1]._replace(bus_id=cells[1])
    return npus


def row_cells(line: str) -> List[str]:
    """The cells of one `| a | b |` row of npu-smi's tables; [] for a border or any other line."""
    line = line.strip()
    if not line.startswith("|"):
        return []
    return [cell.strip() for cell in line.strip("|").split("|")]
