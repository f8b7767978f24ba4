"""What the gpu and npu checks share: the Results they give, the verdict.

Which check applies, and the failures certain from the device nodes and PATH alone, are decided below the stages
(util/accelerators.py: `choose`, `foreseen`), where `ma-runtime plan` and supervision read them too; this module
turns those facts into the checks' Results. The check that does not apply returns one skipped() result saying why.

The verdict (`verdict`) compares the healthy cards with max(MA_NUM_GPUS, 1) and gives
one Result: too-few (fewer cards visible than needed), unhealthy (fail when the healthy
ones are too few, warn when there are spares), health-warning (warn: NPU "Warning"), ok.
A test holds `accelerators.foreseen` and the checks to the same item, code and hint over every kind of node.
"""

import dataclasses
from typing import Any, Dict, List

from ma_runtime.process.lifecycle import ToolError
from ma_runtime.stages.preflight.model import Result, Status, passed, skipped
from ma_runtime.util import accelerators
from ma_runtime.util.accelerators import Certain, Choice, Kind, first_line, required


def not_applicable(kind: Kind, choice: Choice) -> Result:
    if choice.flavour is None:
        return skipped(kind.item, choice.why)
    if choice.missing:
        return skipped(kind.item, f"no accelerator found; the gpu item reports it ({choice.why})")
    return skipped(kind.item, f"{choice.flavour} check chosen instead: {choice.why}")


def missing(spec: Any, choice: Choice) -> Result:
    return certain(spec, accelerators.no_accelerator(spec, choice))


def manager_missing(spec: Any, nodes: int) -> Result:
    return certain(spec, accelerators.no_manager(spec, nodes))


def certain(spec: Any, failure: Certain) -> Result:
    """The check's Result for a failure the device nodes and PATH made certain (what `ma-runtime plan` foresees)."""
    # What the item counted: no card at all, or the nodes that are too few; None where counting never began.
    value = {"missing": 0, "too-few": failure.nodes}.get(failure.reason)
    extra = {"detail": {"device_nodes": failure.nodes}} if failure.reason == "manager-missing" else {}
    return _failed(failure.kind, failure.reason, spec, failure.hint, value=value, **extra)


def tool_error(kind: Kind, error: ToolError, nodes: int, spec: Any) -> Result:
    """A tool that is missing, hung or broken, as a fail Result (never an exception)."""
    if error.code == "missing":
        return certain(spec, accelerators.no_tool(kind, nodes, spec))
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
