"""Between attempts: wait until the accelerator tool lists no process on this container's devices.

A killed rank can keep its device for a while: the driver frees device memory only once
every handle is closed, and a process stuck in the driver (uninterruptible sleep) keeps
it for good. Relaunching onto such a device fails again, with an out-of-memory error
that blames the job, so the runtime checks first, and a device that stays held ends the
job with exit 84 (the node needs attention) instead of relaunching onto it.

Which tool asks is the preflight's decision (`util/accelerators.choose`): NPU asks
`npu-smi info` and reads its process table; GPU asks
`nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_bus_id`. Both list only
the devices mounted into this container. A CPU job, MA_RUNTIME_PREFLIGHT_ACCELERATOR=none,
or no tool on PATH leaves nothing to ask: the wait returns at once.

A tool that fails (non-zero exit, output that is not the table we know, no answer within
MA_RUNTIME_PREFLIGHT_TOOL_TIMEOUT_SECONDS) has not said the devices are free: the wait
keeps asking, and if the tool never answers well it is the tool's failure that the
error reports. Nothing is read as "released" that the tool did not say.

nvidia-smi reports host pids, and in a container with its own pid namespace the process
name reads `[Not Found]`: the pid in a message is then the host's, which is what the
node's operator needs. The default `nvidia-smi` table hides such processes; the query
does not.

The same tools give the hang detector its accelerator metric (`utilisation`): npu-smi's
NPU table (AICore(%) of each chip, Health of each NPU; the one `npu-smi info` call the wait
makes) and `nvidia-smi --query-gpu=index,pci.bus_id,utilization.gpu`. Devices are named as
the wait names them, so a message about one device reads alike from both. A partial answer
is still an answer: nvidia-smi prints `Unable to determine the device handle for ...` for a
GPU fallen off the bus and exits 15, but the other GPUs' rows are read, and the lost one is
reported unhealthy. Only an answer with no device in it is a failure. Health follows the
preflight (`preflight.npu`): OK and Warning are healthy.
"""

import os
import re
import shutil
import time
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

from ma_runtime.errors import DeviceNotReleased
from ma_runtime.process.lifecycle import ToolError, run_tool
from ma_runtime.util import accelerators, npu_smi
from ma_runtime.util.accelerators import GPU, first_line
from ma_runtime.util.npu_smi import BUS_ID, NO_READING, Unparsable, memory_mb, reading

# npu-smi takes a good part of a second per call and walks every card's driver; asking more often
# would load the driver the ranks are leaving without ending the wait any sooner.
POLL_SECONDS = 0.5
# Holders named in the error; a node with 16 chips x several processes would make an unreadable line.
NAMED_HOLDERS = 8
_LOST_GPU = re.compile(r"Unable to determine the device handle for (.*)", re.IGNORECASE)

# pause(seconds) sleeps up to `seconds` and says whether a stop was requested meanwhile.
Pause = Callable[[float], bool]


class Holder(NamedTuple):
    """A process the tool lists on one of the devices."""

    device: str  # as messages name it: "NPU 3", "NPU 0 chip 1", "GPU 00000000:47:00.0"
    pid: int  # as the tool reports it (nvidia-smi: the host's)
    name: str  # "" when the tool shows none
    memory_mb: Optional[int]  # None when the tool shows none

    def describe(self) -> str:
        return f"{self.device} pid {self.pid}" + (f" ({self.name})" if self.name else "")


class Listing(NamedTuple):
    """What one call of the tool said."""

    tool: str  # the command line, as messages quote it
    holders: List[Holder]
    failure: Optional[str] = None  # why the tool said nothing usable: "npu-smi info exited 255: ..."

    @property
    def released(self) -> bool:
        return self.failure is None and not self.holders


class Utilisation(NamedTuple):
    """What one call of the tool said about the devices' load and health (the hang detector's metric)."""

    tool: str  # the command, as messages quote it: "npu-smi info", "nvidia-smi"
    devices: Dict[str, Optional[float]]  # device (named as Holder.device) -> percent; None: the tool shows none
    unhealthy: List[str]  # one phrase per device the tool reports lost or not healthy: "NPU 3: Critical"
    failure: Optional[str] = None  # why the tool said nothing usable: "npu-smi info exited 255: ..."


# (devices, unhealthy) read from the tool's (stdout, stderr).
Readings = Tuple[Dict[str, Optional[float]], List[str]]


class Tool(NamedTuple):
    """An accelerator tool: how to run it and read what it lists (NPU_TOOL, GPU_TOOL at the end)."""

    label: str  # the command, as messages quote it
    argv: Tuple[str, ...]
    parse: Callable[[str], List[Holder]]
    utilisation_argv: Tuple[str, ...]
    parse_utilisation: Callable[[str, str], Readings]


def busy(spec: Any, environ: Mapping[str, str]) -> Optional[Listing]:
    """What the tool lists on this container's devices now; None when there is no tool to ask."""
    tool = _tool(spec, environ)
    if tool is None:
        return None
    try:
        returncode, out, err = run_tool(tool.argv, spec.preflight_tool_timeout_seconds, env=dict(environ))
    except ToolError as error:
        return Listing(tool.label, [], error.message)
    if returncode != 0:
        said = first_line(err + "\n" + out) or "no output"
        return Listing(tool.label, [], f"{tool.label} exited {returncode}: {said}")
    try:
        return Listing(tool.label, tool.parse(out))
    except Unparsable as error:
        return Listing(tool.label, [], f"{tool.label} printed {error}")


def utilisation(spec: Any, environ: Mapping[str, str]) -> Optional[Utilisation]:
    """Each device's utilisation now and the devices the tool calls unhealthy; None when there is no tool to ask.

    Never raises for what the tool does: a timeout, a failure or output that is not the
    table we know is the `failure`, with the tool's words.
    """
    tool = _tool(spec, environ)
    if tool is None:
        return None
    try:
        returncode, out, err = run_tool(tool.utilisation_argv, spec.preflight_tool_timeout_seconds,
                                        env=dict(environ))
    except ToolError as error:
        return Utilisation(tool.label, {}, [], error.message)
    try:
        found, unhealthy = tool.parse_utilisation(out, err)
    except Unparsable as error:
        said = f"printed {error}"
    else:
        # Whatever the exit status: nvidia-smi exits 15 when a GPU is lost, after the rows of the others.
        if found or unhealthy:
            return Utilisation(tool.label, found, unhealthy)
        said = "listed no device"
    if returncode != 0:
        said = f"exited {returncode}: " + (first_line(err + "\n" + out) or "no output")
    return Utilisation(tool.label, {}, [], f"{tool.label} {said}")


def tool_for(spec: Any, environ: Mapping[str, str]) -> Optional[str]:
    """The tool `busy` and `utilisation` ask, as messages quote it; None when there is none to ask."""
    tool = _tool(spec, environ)
    return tool.label if tool is not None else None


def _tool(spec: Any, environ: Mapping[str, str]) -> Optional[Tool]:
    choice = accelerators.choose(spec, environ)
    if choice.flavour is None or choice.missing:
        return None
    tool = GPU_TOOL if choice.flavour == GPU else NPU_TOOL
    # The PATH the tool will run with; without the tool there is nothing to ask.
    if not shutil.which(tool.argv[0], path=environ.get("PATH", os.defpath)):
        return None
    return tool


def wait_released(spec: Any, environ: Mapping[str, str], seconds: float, pause: Pause, log: Any) -> bool:
    """Poll `busy` until the devices are free: True once they are, False when `pause` reported a stop.

    The first check is at once (after a clean exit the devices are usually free already);
    `seconds` = 0 checks once. Raises DeviceNotReleased when the deadline passes with the
    devices still listed or the tool still failing. A stop ends the wait at once, but a
    tool call in progress runs to its end (at most its timeout) first.
    """
    started = time.monotonic()
    listing = busy(spec, environ)
    if listing is None or listing.released:
        return True
    log.info("waiting for the accelerators to be released", tool=listing.tool, timeout_s=seconds,
             **_state(listing))
    while True:
        left = started + seconds - time.monotonic()
        if left <= 0:
            raise not_released(listing, seconds)
        if pause(min(POLL_SECONDS, left)):
            return False
        listing = busy(spec, environ)
        if listing is None or listing.released:
            log.info("accelerators released", waited_s=round(time.monotonic() - started, 2))
            return True


def _state(listing: Listing) -> dict:
    if listing.failure:
        return {"tool_error": listing.failure}
    return {"holders": [holder.describe() for holder in listing.holders]}


def not_released(listing: Listing, seconds: float) -> DeviceNotReleased:
    if listing.failure:
        reason = f"could not check that the accelerators were released within {seconds:g} s: {listing.failure}"
    else:
        reason = f"the accelerators were not released within {seconds:g} s: {listing.tool} still lists " \
                 + _named(listing.holders)
    hint = (
        "the node needs attention (a process stuck in the driver, another container, or a hung driver): the job"
        " is not relaunched onto a device that is still held; drain the node and reschedule the job"
        f" (MA_RUNTIME_DEVICE_RELEASE_SECONDS sets the wait, now {seconds:g})"
    )
    return DeviceNotReleased(reason, hint)


def _named(holders: List[Holder]) -> str:
    named = ", ".join(holder.describe() for holder in holders[:NAMED_HOLDERS])
    more = len(holders) - NAMED_HOLDERS
    return named + (f" and {more} more" if more > 0 else "")


def parse_npu(out: str) -> List[Holder]:
    """The processes on this container's NPUs, from the process table of `npu-smi info` (npu_smi.processes)."""
    return [Holder(*row) for row in npu_smi.processes(out)]


def parse_gpu(out: str) -> List[Holder]:
    """`nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_bus_id` rows, no header.

    `<pid>, <name>, <MiB>, <bus id>`, one line per process and GPU; nothing at all when no
    process runs. A name can hold ", ", so the fixed fields are read from both ends.
    Memory reads `[N/A]` where the driver cannot tell (MIG, some containers).
    """
    holders = []
    for line in out.splitlines():
        if not line.strip():
            continue
        fields = [field.strip() for field in line.split(", ")]
        if len(fields) < 4 or not fields[0].isdigit() or not BUS_ID.fullmatch(fields[-1]):
            raise Unparsable(f"an unexpected line: {line.strip()}")
        name = ", ".join(fields[1:-2])
        holders.append(Holder(f"GPU {fields[-1]}", int(fields[0]), name, memory_mb(fields[-2])))
    return holders


def parse_gpu_utilisation(out: str, err: str = "") -> Readings:
    """`nvidia-smi --query-gpu=index,pci.bus_id,utilization.gpu --format=csv,noheader,nounits` rows.

    `<index>, <bus id>, <percent>` per GPU; `[N/A]` or `[Not Supported]` where the card has
    no value (MIG), another bracketed word (`[Unknown Error]`, `[GPU requires reset]`) where
    it is in trouble. A GPU the driver lost prints `Unable to determine the device handle for
    <GPU, bus id or both>: <reason>` instead of its row (on stdout or stderr, by driver).
    """
    found: Dict[str, Optional[float]] = {}
    unhealthy = [_lost_gpu(line) for line in err.splitlines() if _LOST_GPU.search(line)]
    for line in out.splitlines():
        if not line.strip():
            continue
        if _LOST_GPU.search(line):
            unhealthy.append(_lost_gpu(line))
            continue
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 3 or not fields[0].isdigit() or not BUS_ID.fullmatch(fields[1]):
            raise Unparsable(f"an unexpected line: {line.strip()}")
        device, value = f"GPU {fields[1]}", fields[2]
        if value.startswith("[") and value not in NO_READING:
            unhealthy.append(f"{device}: {value.strip('[]')}")
            value = ""
        found[device] = reading(value, line)
    return found, list(dict.fromkeys(unhealthy))


def _lost_gpu(line: str) -> str:
    """A phrase naming the GPU of `Unable to determine the device handle for GPU3: 0000:04:00.0: Unknown Error`.

    Drivers word it `GPU0000:04:00.0`, `GPU 0000:04:00.0`, `GPU3: 0000:04:00.0` or `GPU3` alone.
    """
    rest = _LOST_GPU.search(line)[1]
    bus = BUS_ID.search(rest)
    index = re.match(r"GPU\s*(\d+)", rest, re.IGNORECASE)
    if bus:
        # Named as its row would be (pci.bus_id has an 8-digit domain), so messages agree.
        domain, place = bus[0].split(":", 1)
        device, reason = f"GPU {domain.zfill(8)}:{place}".upper(), rest[bus.end():]
    elif index:
        device, reason = f"GPU {index[1]}", rest[index.end():]
    else:
        device, reason = "a GPU", rest
    reason = reason.strip(" :.")
    return f"{device}: Unable to determine the device handle" + (f" ({reason})" if reason else "")


NPU_TOOL = Tool("npu-smi info", npu_smi.ARGV, parse_npu, npu_smi.ARGV, npu_smi.utilisation)
GPU_TOOL = Tool("nvidia-smi", ("nvidia-smi", "--query-compute-apps=pid,process_name,used_memory,gpu_bus_id",
                               "--format=csv,noheader,nounits"), parse_gpu,
                ("nvidia-smi", "--query-gpu=index,pci.bus_id,utilization.gpu", "--format=csv,noheader,nounits"),
                parse_gpu_utilisation)
