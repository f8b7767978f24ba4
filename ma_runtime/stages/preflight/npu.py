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
from typing import Any, List, Mapping

from ma_runtime.process.lifecycle import ToolError, run_tool
from ma_runtime.stages.preflight import accelerator
from ma_runtime.stages.preflight.accelerator import Census
from ma_runtime.stages.preflight.model import Result, Status
from ma_runtime.util import accelerators
from ma_runtime.util.accelerators import NPU, NPU_KIND, NPU_MANAGER
from ma_runtime.util.npu_smi import ARGV, HEALTHY, MINOR
from ma_runtime.util.npu_smi import npus as read_npus

_IN_USE = re.compile(r"device is used|ret is -8020", re.IGNORECASE)


def run(spec: Any, environ: Mapping[str, str]) -> List[Result]:
    choice = accelerators.choose(spec, environ)
    if choice.flavour != NPU:
        return [accelerator.not_applicable(NPU_KIND, choice)]
    names = accelerators.node_names(spec.preflight_dev_dir)
    nodes = accelerators.count_nodes(NPU_KIND, names)
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
    npus = read_npus(out)
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
    return Result(NPU, Status.FAIL, "npu.in-use", None, accelerators.required(spec), hint=hint, unit="count",
                  detail={"output": line})
