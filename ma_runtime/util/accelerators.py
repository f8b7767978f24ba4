"""Which accelerator this node has, from its device nodes and PATH alone (no tool runs): for the preflight's gpu
and npu checks (`stages/preflight`), the plan (`launch/plan`) and supervision (`supervise/devices`, `hang`).

Which check applies (`choose`):
- MA_RUNTIME_PREFLIGHT_ACCELERATOR=gpu or npu forces that check; none turns both off;
- auto looks at the device nodes under preflight_dev_dir: davinci<N> or davinci_manager
  means NPU, nvidia<N> means GPU (NPU first: an Ascend node has no nvidia<N> nodes, so
  both at once is a test rig, and the NPU nodes are the rarer, deliberate mount);
- no nodes and MA_NUM_GPUS > 0: nvidia-smi on PATH means GPU, npu-smi means NPU (a
  runtime may put the nodes elsewhere); neither means the gpu item fails gpu.missing;
- no nodes and MA_NUM_GPUS = 0: a CPU job, both skip.

`foreseen` tells, without running a tool, the failure of the applicable check that is already certain from the
device nodes and PATH: no accelerator at all (missing), davinci nodes without davinci_manager (manager-missing),
nodes but no tool (tool-missing), fewer nodes than MA_NUM_GPUS (too-few). It is a plain fact (`Certain`: the
check's item, code and hint); `ma-runtime plan` warns with it, and the checks build their failing Result from
the same functions (stages/preflight/accelerator.py), so that the two give the same code and words.
"""

import dataclasses
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, List, Mapping, NamedTuple, Optional

GPU = "gpu"
NPU = "npu"
NPU_MANAGER = "davinci_manager"


@dataclasses.dataclass(frozen=True)
class Kind:
    """How hints name one accelerator family."""

    item: str  # the preflight item: gpu or npu
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


class Certain(NamedTuple):
    """A failure of the accelerator check that the device nodes and PATH make certain, whatever a tool says."""

    kind: Kind  # the check that fails
    reason: str  # missing, manager-missing, tool-missing, too-few
    hint: str  # what is wrong and how to fix it, as the check words it
    nodes: int  # the kind's device nodes under the dev dir

    @property
    def item(self) -> str:
        return self.kind.item

    @property
    def code(self) -> str:
        return f"{self.kind.item}.{self.reason}"


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


def flavour(spec: Any, environ: Mapping[str, str]) -> Optional[str]:
    """The check that applies: "gpu", "npu", or None for neither."""
    return choose(spec, environ).flavour


def foreseen(spec: Any, environ: Mapping[str, str], which: Which = _which) -> Optional[Certain]:
    """The failure the applicable check will give whatever its tool says, or None when it could pass."""
    choice = choose(spec, environ, which)
    if choice.flavour is None:
        return None
    if choice.missing:
        return no_accelerator(spec, choice)
    kind = GPU_KIND if choice.flavour == GPU else NPU_KIND
    names = node_names(spec.preflight_dev_dir)
    nodes = count_nodes(kind, names)
    if kind is NPU_KIND and nodes and NPU_MANAGER not in names:
        return no_manager(spec, nodes)
    if not _tool_on_path(kind, environ, which):
        return no_tool(kind, nodes, spec)
    need = required(spec)
    # Visible cards are at most the nodes, whatever the tool lists (see Census.visible in the preflight).
    if not nodes or nodes >= need:
        return None
    hint = (f"only {nodes} {kind.nodes} device nodes under {spec.preflight_dev_dir}, MA_NUM_GPUS needs {need};"
            " check the container's device mounts and MA_NUM_GPUS")
    return Certain(kind, "too-few", hint, nodes)


def no_accelerator(spec: Any, choice: Choice) -> Certain:
    """The job wants cards and nothing here looks like one (`choice.missing`): the gpu item reports it."""
    hint = f"{choice.why}: the container started without its accelerators; check the resource flavor and device mounts"
    return Certain(GPU_KIND, "missing", hint, 0)


def no_manager(spec: Any, nodes: int) -> Certain:
    hint = (
        f"{nodes} davinci<N> nodes but no {NPU_MANAGER} under {spec.preflight_dev_dir}: start the container with"
        f" --device=/dev/{NPU_MANAGER} --device=/dev/devmm_svm --device=/dev/hisi_hdc"
    )
    return Certain(NPU_KIND, "manager-missing", hint, nodes)


def no_tool(kind: Kind, nodes: int, spec: Any) -> Certain:
    """The kind's tool is not on PATH: missing without device nodes, tool-missing with them."""
    tool = kind.tool.split()[0]
    if not nodes:
        hint = f"no {kind.nodes} nodes under {spec.preflight_dev_dir} and {tool} is not on PATH: {kind.mount_hint}"
        return Certain(kind, "missing", hint, nodes)
    hint = f"{tool} is not on PATH although {nodes} {kind.nodes} device nodes exist: {kind.mount_hint}"
    return Certain(kind, "tool-missing", hint, nodes)


def first_line(text: str) -> str:
    """The first line of a tool's output that says something."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
