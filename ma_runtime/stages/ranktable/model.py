"""The rank table's model: both templates as data (`TemplateTwo` as the platform writes it, `Ranked` with every
device's rank, as template one), this node's view of it (`NodeView`), and the errors of the stage."""

import dataclasses
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from ma_runtime.errors import Category, ExitCode, RuntimeFailure

FILE_NAME = "jobstart_hccl.json"
COMPLETED = "completed"


class RankTableError(RuntimeFailure):
    """A rank table that cannot be used: malformed, inconsistent, or without this node."""

    exit_code = ExitCode.BAD_CONFIGURATION
    category = Category.PLATFORM
    stage = "ranktable"


class NotYet(RankTableError):
    """A file a writer may still complete: missing, unreadable for now, or ending inside a character. The wait
    loop sees `state`; a reader that does not wait gets the one-line error."""

    def __init__(self, state: str, reason: str):
        super().__init__(reason)
        self.state = state


class RankTableTimeout(RuntimeFailure):
    exit_code = ExitCode.TIMED_OUT
    category = Category.PLATFORM
    stage = "ranktable"


class Device(NamedTuple):
    """A named tuple, not a frozen dataclass: 65 536 of them are made per conversion, and a frozen dataclass's
    __init__ costs ~1.5 us each (a tuple ~0.1 us, made in bulk by convert's fast path)."""

    device_id: str  # physical
    device_ip: str
    rank_id: Optional[str] = None  # template one only


@dataclasses.dataclass(frozen=True)
class Instance:
    """One pod of template two (a server of template one has no pod name)."""

    server_id: str
    devices: Tuple[Device, ...]
    pod_name: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Group:
    name: str
    instances: Tuple[Instance, ...]


@dataclasses.dataclass(frozen=True)
class TemplateTwo:
    status: str
    groups: Tuple[Group, ...]


@dataclasses.dataclass(frozen=True)
class Ranked:
    """A rank table with ranks: template one, plus the pods it came from (for this node's view)."""

    instances: Tuple[Instance, ...]  # in rank order, every device with its rank_id
    status: str = COMPLETED

    @property
    def rank_size(self) -> int:
        return sum(len(instance.devices) for instance in self.instances)

    def template_one(self) -> Dict[str, Any]:
        """The JSON document: instances sharing a server_id merged into one server entry."""
        servers: Dict[str, List[Dict[str, str]]] = {}
        for instance in self.instances:
            if not instance.devices:
                continue  # a pod without devices (a group with device_count 0) is no HCCL server
            devices = servers.setdefault(instance.server_id, [])
            devices.extend({"device_id": d.device_id, "device_ip": d.device_ip, "rank_id": d.rank_id or ""}
                           for d in instance.devices)
        return {
            "server_count": str(len(servers)),
            "server_list": [{"device": devices, "server_id": server_id} for server_id, devices in servers.items()],
            "status": self.status,
            "version": "1.0",
        }


@dataclasses.dataclass(frozen=True)
class LocalDevice:
    logical_id: int  # ASCEND_DEVICE_ID
    device_id: str  # physical, as in the table (DEVICE_ID)
    rank_id: int  # RANK_ID
    device_ip: str


@dataclasses.dataclass(frozen=True)
class NodeView:
    """What the rank-table launcher hands each worker on this node."""

    server_id: str
    pod_name: Optional[str]
    matched_by: str  # "pod name", "MA_CURRENT_IP", "VC_TASK_INDEX", "RANK_AFTER_ACC" or "the only pod"
    devices: Tuple[LocalDevice, ...]  # in rank order
    rank_size: int
