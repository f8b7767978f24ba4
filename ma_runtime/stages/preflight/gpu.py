"""The `gpu` check: enough healthy NVIDIA GPUs for MA_NUM_GPUS.

Visible GPUs are the dev dir's nvidia<N> nodes and what
`nvidia-smi --query-gpu=... --format=csv,noheader,nounits` lists (one line per GPU,
fields separated by ", "). A GPU is unhealthy when it has uncorrected volatile ECC
errors, retired pages pending, or nvidia-smi cannot get its handle ("Unable to
determine the device handle for GPU0000:3B:00.0: Unknown Error", a GPU fallen off the
bus; nvidia-smi then exits non-zero and may still list the others). Fields a card
does not support ("[N/A]", "N/A", "[Not Supported]") count as healthy.

Codes: ok; gpu.missing, gpu.too-few, gpu.unhealthy (fail; warn when the healthy
GPUs still cover MA_NUM_GPUS), gpu.tool-missing, gpu.tool-timeout, gpu.tool-failed;
gpu.not-applicable (skip). See util/accelerators.py for which check applies.
"""

import re
from typing import Any, List, Mapping, NamedTuple, Optional

from ma_runtime.process.lifecycle import ToolError, run_tool
from ma_runtime.stages.preflight import accelerator
from ma_runtime.stages.preflight.accelerator import Census
from ma_runtime.stages.preflight.model import Result
from ma_runtime.util import accelerators
from ma_runtime.util.accelerators import GPU, GPU_KIND

QUERY = (
    "index", "pci.bus_id", "name", "uuid", "ecc.errors.uncorrected.volatile.total", "retired_pages.pending",
)
ARGV = ("nvidia-smi", f"--query-gpu={','.join(QUERY)}", "--format=csv,noheader,nounits")
# Printed for a GPU NVML cannot reach; "GPU0000:3B:00.0" or "gpu 0000:3B:00.0" depending on the version.
_LOST = re.compile(
    r"Unable to determine the device handle for gpu\s*([0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f])\s*:?\s*(.*)",
    re.IGNORECASE,
)


class Gpu(NamedTuple):
    index: str
    bus_id: str
    problem: Optional[str]  # None when healthy


def run(spec: Any, environ: Mapping[str, str]) -> List[Result]:
    choice = accelerators.choose(spec, environ)
    if choice.flavour != GPU:
        return [accelerator.not_applicable(GPU_KIND, choice)]
    if choice.missing:
        return [accelerator.missing(spec, choice)]
    nodes = accelerators.count_nodes(GPU_KIND, accelerators.node_names(spec.preflight_dev_dir))
    try:
        returncode, out, err = run_tool(ARGV, spec.preflight_tool_timeout_seconds, env=dict(environ))
    except ToolError as error:
        return [accelerator.tool_error(GPU_KIND, error, nodes, spec)]
    return [judge(spec, nodes, returncode, out, err)]


def judge(spec: Any, nodes: int, returncode: int, out: str, err: str) -> Result:
    gpus = parse_rows(out)
    lost = parse_lost(out + "\n" + err)
    if returncode != 0 and not gpus and not lost:
        return accelerator.tool_failed(GPU_KIND, spec, returncode, err + "\n" + out)
    unhealthy = [f"GPU {g.index} ({g.bus_id}): {g.problem}" for g in gpus if g.problem] + lost
    healthy = sum(1 for g in gpus if not g.problem)
    return accelerator.verdict(GPU_KIND, Census(nodes, len(gpus) + len(lost), healthy, unhealthy), spec)


def parse_rows(out: str) -> List[Gpu]:
    """The CSV rows; anything else (error lines, blank lines) is not a GPU."""
    gpus = []
    for line in out.splitlines():
        fields = [field.strip() for field in line.split(", ")]
        # A name could hold ", ": the fixed fields are read from both ends.
        if len(fields) < len(QUERY) or not fields[0].isdigit():
            continue
        gpus.append(Gpu(fields[0], fields[1], problem(fields[-2], fields[-1])))
    return gpus


def problem(ecc: str, pending: str) -> Optional[str]:
    found = []
    # Unsupported fields read [N/A] or [Not Supported]: only a number > 0 counts.
    if ecc.isdigit() and int(ecc) > 0:
        found.append(f"{ecc} uncorrected ECC errors")
    if pending.lower() == "yes":
        found.append("retired pages pending (reset the GPU)")
    return " and ".join(found) or None


def parse_lost(text: str) -> List[str]:
    """One description per GPU nvidia-smi could not get a handle for."""
    return [f"GPU {m[1]}: {m[2].strip() or 'no handle'} (fallen off the bus?)" for m in _LOST.finditer(text)]
