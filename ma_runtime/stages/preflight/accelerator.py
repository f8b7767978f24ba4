"""What the gpu and npu checks share: which of them applies, device nodes, the verdict.

Which check applies (`choose`):
- MA_RUNTIME_PREFLIGHT_ACCELERATOR=gpu or npu forces that check; none turns both off;
- auto looks at the device nodes under preflight_dev_dir: davinci<N> or davinci_manager
  means NPU, nvidia<N> means GPU (NPU first: an Ascend node has no nvidia<N> nodes, so
  both at once is a test rig, and the NPU nodes are the rarer, deliberate mount);
- no nodes and MA_NUM_GPUS > 0: nvidia-smi on PATH means GPU, npu-smi means NPU (a
  runtime may put the nodes elsewhere); neither means the gpu item fails gpu.missing;
- no nodes and MA_NUM_GPUS = 0: a CPU job, both skip.
The check that does not apply returns one skipped() result saying why.

The verdict (`verdict`) compares the healthy cards with max(MA_NUM_GPUS, 1) and gives
one Result: too-few (fewer cards visible than needed), unhealthy (fail when the healthy
ones are too few, warn when there are spares), health-warning (warn: NPU "Warning"), ok.

`foreseen` tells, without running a tool, the failure that is already certain from the
device nodes and PATH alone: no accelerator at all (missing), davinci nodes without
davinci_manager (manager-missing), nodes but no tool (tool-missing), fewer nodes than
MA_NUM_GPUS (too-few). `ma-runtime plan` warns with it.
Where it can, it builds its Result with the functions the checks use; a test holds the
two to the same item and code over every kind of node.
"""

import dataclasses
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional

from ma_runtime.process.lifecycle import ToolError
from ma_runtime.stages.preflight.model import Result, Status, passed, skipped

GPU = "gpu"
NPU = "npu"
NPU_MANAGER = "davinci_manager"


@dataclasses.dataclass(frozen=True)
class Kind:
    """How hints name one accelerator family."""

    item: str  # the Result item: gpu or npu
    label: str  # GPU or NPU
    tool: str  # the command line the check runs, as hints quote it
    nodes: str  # the device nodes, as hints name them
    node_pattern: "re.Pattern[str]"  # a device node's file name
    mount_hint: str  # how the tool gets into a container
    fault_hint: str  # what to do about a bad card


GPU_KIND = Kind(
    GPU, "GPU", "nvidia-smi", "nvidia<N>", re.compile(r"nvidia(\d+)"),
    "mount the NVIDIA driver utilities (nvidia-container-toolkit) or put nvidia-smi on PATH",
    "drain this node and reschedule the job; report the card to the node's operator",
)
NPU_KIND = Kind(
    NPU, "NPU", "npu-smi info", "davinci<N>", re.compile(r"davinci(\d+)"),
    "mount /usr/local/sbin/npu-smi, /usr/local/dcmi and /usr/local/Ascend/driver into the container",
    "drain this node and reschedule the job; report the card to the node's operator",
)


# (name, PATH) -> full path or None; the caller's, so that `ma-runtime plan` can look up with its own.
Which = Callable[[str, Optional[str]], Optional[str]]


def _which(name: str, path: Optional[str]) -> Optional[str]:
    return shutil.which(name, path=path)


class Choice(NamedTuple):
    flavour: Optional[str]  # gpu, npu, or None: neither check applies
    why: str  # how it was chosen, for the skip reason and the logs
    missing: bool = False  # the job wants cards but nothing here looks like one


def required(spec: Any) -> int:
    """Cards a pass needs: MA_NUM_GPUS, and at least one once a check applies."""
    return max(spec.num_gpus, 1)


def node_names(dev_dir: Path) -> List[str]:
    try:
        return os.listdir(dev_dir)
    except OSError:
        # An unreadable or absent dev dir has no device nodes; the checks report what that means.
        return []


def count_nodes(kind: Kind, names: List[str]) -> int:
    return sum(1 for name in names if kind.node_pattern.fullmatch(name))


def choose(spec: Any, environ: Mapping[str, str], which: Which = _which) -> Choice:
    setting = spec.preflight_accelerator
    if setting == "none":
        return Choice(None, "accelerator checks are off (MA_RUNTIME_PREFLIGHT_ACCELERATOR=none)")
    if setting in (GPU, NPU):
        return Choice(setting, f"MA_RUNTIME_PREFLIGHT_ACCELERATOR={setting}")
    dev_dir = spec.preflight_dev_dir
    names = node_names(dev_dir)
    if count_nodes(NPU_KIND, names) or NPU_MANAGER in names:
        return Choice(NPU, f"NPU device nodes (davinci) under {dev_dir}")
    if count_nodes(GPU_KIND, names):
        return Choice(GPU, f"GPU device nodes (nvidia<N>) under {dev_dir}")
    if spec.num_gpus == 0:
        return Choice(None, "CPU job: no accelerator device nodes and MA_NUM_GPUS=0")
    return _by_tool(spec, environ, which)


def _by_tool(spec: Any, environ: Mapping[str, str], which: Which) -> Choice:
    for kind in (GPU_KIND, NPU_KIND):
        if _tool_on_path(kind, environ, which):
            tool = kind.tool.split()[0]
            return Choice(kind.item, f"no device nodes under {spec.preflight_dev_dir}, but {tool} is on PATH")
    why = (
        f"MA_NUM_GPUS={spec.num_gpus} but no GPU or NPU device nodes were found under {spec.preflight_dev_dir}"
        " and neither nvidia-smi nor npu-smi is on PATH"
    )
    return Choice(GPU, why, missing=True)


def _tool_on_path(kind: Kind, environ: Mapping[str, str], which: Which) -> bool:
    # The same PATH the tool will run with: subprocess looks it up there, or in os.defpath.
    return bool(which(kind.tool.split()[0], environ.get("PATH", os.defpath)))


def foreseen(spec: Any, environ: Mapping[str, str], which: Which = _which) -> Optional[Result]:
    """The fail Result the applicable check will give whatever its tool says, or None when it could pass."""
    choice = choose(spec, environ, which)
    if choice.flavour is None:
        return None
    if choice.missing:
        return missing(spec, choice)
    kind = GPU_KIND if choice.flavour == GPU else NPU_KIND
    names = node_names(spec.preflight_dev_dir)
    nodes = count_nodes(kind, names)
    if kind is NPU_KIND and nodes and NPU_MANAGER not in names:
        return manager_missing(spec, nodes)
    if not _tool_on_path(kind, environ, which):
        tool = kind.tool.split()[0]
        return tool_error(kind, ToolError("missing", f"{tool} not found on PATH"), nodes, spec)
    need = required(spec)
    # Visible cards are at most the nodes, whatever the tool lists (see Census.visible).
    if not nodes or nodes >= need:
        return None
    hint = (f"only {nodes} {kind.nodes} device nodes under {spec.preflight_dev_dir}, MA_NUM_GPUS needs {need};"
            " check the container's device mounts and MA_NUM_GPUS")
    return Result(kind.item, Status.FAIL, f"{kind.item}.too-few", nodes, need, hint=hint, unit="count")


def flavour(spec: Any, environ: Mapping[str, str]) -> Optional[str]:
    """The check that applies: "gpu", "npu", or None for neither."""
    return choose(spec, environ).flavour


def not_applicable(kind: Kind, choice: Choice) -> Result:
    if choice.flavour is None:
        return skipped(kind.item, choice.why)
    if choice.missing:
        return skipped(kind.item, f"no accelerator found; the gpu item reports it ({choice.why})")
    return skipped(kind.item, f"{choice.flavour} check chosen instead: {choice.why}")


def missing(spec: Any, choice: Choice) -> Result:
    hint = f"{choice.why}: the container started without its accelerators; check the resource flavor and device mounts"
    return _failed(GPU_KIND, "missing", spec, hint, value=0)


def manager_missing(spec: Any, nodes: int) -> Result:
    hint = (
        f"{nodes} davinci<N> nodes but no {NPU_MANAGER} under {spec.preflight_dev_dir}: start the container with"
        f" --device=/dev/{NPU_MANAGER} --device=/dev/devmm_svm --device=/dev/hisi_hdc"
    )
    return Result(NPU, Status.FAIL, "npu.manager-missing", None, required(spec), hint=hint, unit="count",
                  detail={"device_nodes": nodes})


def tool_error(kind: Kind, error: ToolError, nodes: int, spec: Any) -> Result:
    """A tool that is missing, hung or broken, as a fail Result (never an exception)."""
    tool = kind.tool.split()[0]
    if error.code == "missing" and not nodes:
        hint = f"no {kind.nodes} nodes under {spec.preflight_dev_dir} and {tool} is not on PATH: {kind.mount_hint}"
        return _failed(kind, "missing", spec, hint, value=0)
    if error.code == "missing":
        hint = f"{tool} is not on PATH although {nodes} {kind.nodes} device nodes exist: {kind.mount_hint}"
        return _failed(kind, "tool-missing", spec, hint)
    if error.code == "timeout":
        hint = (
            f"{error.message}: the driver or a card may be hung; {kind.fault_hint}"
            " (or raise MA_RUNTIME_PREFLIGHT_TOOL_TIMEOUT_SECONDS)"
        )
        return _failed(kind, "tool-timeout", spec, hint)
    return _failed(kind, "tool-failed", spec, f"{error.message}; check the driver installation on this node")


def tool_failed(kind: Kind, spec: Any, returncode: int, output: str) -> Result:
    """The tool ran but said nothing usable: its first line says why."""
    line = first_line(output) or "no output"
    hint = f"{kind.tool} exited {returncode}: {line}; check the driver installation on this node"
    return _failed(kind, "tool-failed", spec, hint, detail={"returncode": returncode, "output": line})


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _failed(kind: Kind, reason: str, spec: Any, hint: str, value: Any = None, **extra: Any) -> Result:
    return Result(kind.item, Status.FAIL, f"{kind.item}.{reason}", value, required(spec), hint=hint, unit="count",
                  **extra)


@dataclasses.dataclass
class Census:
    """What a check counted; `unhealthy` and `warned` hold one description per card."""

    nodes: int  # device nodes under the dev dir
    listed: int  # cards the tool listed or named, bad ones included
    healthy: int  # listed cards with nothing wrong (NPU "Warning" counts as healthy)
    unhealthy: List[str] = dataclasses.field(default_factory=list)
    warned: List[str] = dataclasses.field(default_factory=list)

    @property
    def visible(self) -> int:
        # A card needs both a node (to be opened) and a listing (to be alive); a runtime with
        # no nodes under the dev dir at all leaves the tool's word.
        return min(self.nodes, self.listed) if self.nodes else self.listed

    def detail(self) -> Dict[str, Any]:
        return {"device_nodes": self.nodes, "listed": self.listed, "visible": self.visible,
                "unhealthy": self.unhealthy, "warning": self.warned}


def verdict(kind: Kind, census: Census, spec: Any) -> Result:
    need = required(spec)
    healthy = min(census.healthy, census.visible)
    common: Dict[str, Any] = {"unit": "count", "detail": census.detail()}
    if census.visible < need:
        hint = (
            f"only {census.visible} {kind.label}s visible, MA_NUM_GPUS needs {need} ({census.nodes} {kind.nodes}"
            f" nodes, {census.listed} listed by {kind.tool}){_also_bad(census)}; check the container's device"
            " mounts and MA_NUM_GPUS"
        )
        return Result(kind.item, Status.FAIL, f"{kind.item}.too-few", healthy, need, hint=hint, **common)
    if healthy < need:
        hint = f"{healthy} healthy {kind.label}s < {need} needed; unhealthy: {'; '.join(census.unhealthy)}; "
        return Result(kind.item, Status.FAIL, f"{kind.item}.unhealthy", healthy, need, hint=hint + kind.fault_hint,
                      **common)
    if census.unhealthy:
        # Spare cards: the job can run on the healthy ones, but one that uses every visible card would not.
        bad = "; ".join(census.unhealthy)
        hint = f"unhealthy {kind.label}s besides the {need} needed: {bad}; keep the job off them"
        return Result(kind.item, Status.WARN, f"{kind.item}.unhealthy", healthy, need, hint=hint, **common)
    if census.warned:
        hint = (f"minor alarm on {'; '.join(census.warned)}; the job goes on, see `npu-smi info -t health -i <id>`"
                " if it recurs")
        return Result(kind.item, Status.WARN, f"{kind.item}.health-warning", healthy, need, hint=hint, **common)
    return passed(kind.item, healthy, need, **common)


def _also_bad(census: Census) -> str:
    return f"; unhealthy: {'; '.join(census.unhealthy)}" if census.unhealthy else ""
