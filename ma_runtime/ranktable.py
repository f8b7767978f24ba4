"""The HCCL rank table: both templates, waiting for it, converting it, and this node's view of it.

On Ascend the platform writes template two (`group_list`) into the container after
it starts, as `jobstart_hccl.json`, first with `status: "initializing"`, and the
workers must not read it before `status == "completed"` (docs/platform.md, "Rank table").
MindSpore's rank-table launch and many scripts want template one (`server_list`
with `rank_id`). Decisions (README, "Rank table"):

- Location: `RANK_TABLE_FILE` may name the file or the directory that holds
  `jobstart_hccl.json` (the platform documents both; docs/platform.md, D1). An existing
  directory, or a missing path not ending in `.json`, is a directory; anything
  else that exists is the table itself.
- Waiting: poll every POLL_SECONDS until `completed` or the deadline; a missing,
  empty or half-written file is "not yet", never an error, until the deadline.
- Reading: one function, `read_table`, for the wait loop, `peek` and `convert`. What
  no writer can turn into a table fails at once instead of at the deadline: anything
  but a regular file (opened O_NONBLOCK, so a FIFO never blocks the reader), more
  than MAX_TABLE_BYTES, text that is not UTF-8 (a UTF-8 byte-order mark is
  tolerated: editors write one), and JSON no rank table holds (NaN, Infinity,
  numbers longer than MAX_NUMBER_CHARS, nesting deep enough to exhaust the
  recursion limit). Python 3.11 refuses ints over 4300 digits by itself, 3.9 would
  spend quadratic time on them: the bound is ours. A file that ends inside a UTF-8
  character is half-written, like truncated JSON: "not yet".
- Ranks: groups in file order; in a group, instances in the order of the integer
  that ends their `pod_name` (`...-worker-10` after `...-worker-2`), or in file
  order when some pod name carries no index; rank = devices of the instances
  before + position in the instance, which is hccl-controller's
  `podIndex * devicesPerPod + position` whenever pods have equal device counts.
- Output: template one, every value a string, `"version": "1.0"`; instances
  that share a `server_id` (two pods on one host) become one server entry.
- This node: the instance whose `pod_name` is this pod's name, else whose
  `server_id` is `MA_CURRENT_IP`, else the one at position `VC_TASK_INDEX`.
  Its devices' logical ids (`ASCEND_DEVICE_ID`) number them in ascending
  physical id order (`device_id`), as the container sees its visible devices.
"""

import codecs
import dataclasses
import json
import math
import os
import re
import socket
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ma_runtime import files
from ma_runtime.errors import Category, ExitCode, RuntimeFailure

FILE_NAME = "jobstart_hccl.json"
COMPLETED = "completed"
POLL_SECONDS = 0.5
PROGRESS_SECONDS = 10.0
# The largest realistic table, 4096 servers x 16 devices, is 11 MB; a bigger file is no rank table, and reading
# and parsing one (100 MB: a minute, 1.8 GB) must not be what a job spends its start on.
MAX_TABLE_BYTES = 32 << 20
# Ids and counts have a few digits; 32 characters take any 64-bit integer and any float's repr.
MAX_NUMBER_CHARS = 32
_POD_INDEX = re.compile(r"([0-9]+)$")
_NUMBER = re.compile(r"[0-9]+\Z")  # ASCII digits only: str.isdigit() also takes "²", which int() refuses


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


# --------------------------------------------------------------------------- models


@dataclasses.dataclass(frozen=True)
class Device:
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
    matched_by: str  # "pod name", "MA_CURRENT_IP", "VC_TASK_INDEX" or "the only pod"
    devices: Tuple[LocalDevice, ...]  # in rank order
    rank_size: int


# --------------------------------------------------------------------------- parsing and validation


class _Reader:
    """Typed access to a JSON document; every problem names its JSON path."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, problem: str) -> RankTableError:
        return RankTableError(f"{self.source}: {path}: {problem}",
                              hint="the rank table is written by the platform; check the job's NPU resources")

    def field(self, obj: Any, name: str, path: str) -> Any:
        if not isinstance(obj, dict):
            raise self.fail(path or "$", f"expected an object, got {_kind(obj)}")
        if name not in obj:
            raise self.fail(_join(path, name), "missing")
        return obj[name]

    def text(self, obj: Any, name: str, path: str) -> str:
        """A string field; an integer is accepted (some tools write `rank_id` as an int)."""
        value = self.field(obj, name, path)
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise self.fail(_join(path, name), f"expected a string, got {_kind(value)}")
        return str(value)

    def count(self, obj: Any, name: str, path: str, optional: bool = False) -> Optional[int]:
        if optional and isinstance(obj, dict) and name not in obj:
            return None
        value = self.text(obj, name, path)
        if not _NUMBER.match(value):
            raise self.fail(_join(path, name), f"expected a non-negative integer, got {value!r}")
        return int(value)

    def items(self, obj: Any, name: str, path: str) -> List[Any]:
        value = self.field(obj, name, path)
        if not isinstance(value, list):
            raise self.fail(_join(path, name), f"expected a list, got {_kind(value)}")
        return value

    def ip(self, obj: Any, name: str, path: str) -> str:
        value = self.text(obj, name, path)
        try:
            socket.inet_pton(socket.AF_INET, value)  # 10x faster than ipaddress on 65 536 devices
        except (OSError, ValueError):
            import ipaddress  # here: `ma-run` without a rank table never pays for it

            try:
                ipaddress.ip_address(value)  # IPv6, and the slow path's exact rules
            except ValueError:
                raise self.fail(_join(path, name), f"{value!r} is not an IP address") from None
        return value

    def agree(self, declared: Optional[int], actual: int, path: str, what: str) -> None:
        if declared is not None and declared != actual:
            raise self.fail(path, f"says {declared}, but there are {actual} {what}")


class _Refused(Exception):
    """Raised by the JSON hooks; not a ValueError, so no caller takes it for JSON that is merely incomplete."""


def _number(text: str, convert: Callable[[str], Any]) -> Any:
    if len(text) > MAX_NUMBER_CHARS:
        raise _Refused(f"a number {len(text)} characters long ({text[:16]}...); a rank table's numbers are ids "
                       f"and counts of a few digits")
    return convert(text)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text} is out of range; a rank table's numbers are ids and counts")
    return value


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not a number a rank table holds (and not JSON)")


def parse_json(text: str, source: str) -> Any:
    """json.loads with what no rank table holds refused as RankTableError; ValueError for text that does not parse
    (yet). Hooks are called for numbers only: a table's values are strings, so the common path pays nothing."""
    try:
        return json.loads(text, parse_int=lambda digits: _number(digits, int),
                          parse_float=lambda digits: _number(digits, _finite), parse_constant=_constant)
    except _Refused as refused:
        raise RankTableError(f"{source}: {refused}") from None
    except RecursionError:  # template two nests 7 levels: document, group_list, group, ..., devices, device
        raise RankTableError(f"{source}: nested too deeply to read; a rank table nests 7 levels") from None


def load_document(text: str, source: str) -> Dict[str, Any]:
    try:
        document = parse_json(text, source)
    except ValueError as exc:
        raise RankTableError(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(document, dict):
        raise RankTableError(f"{source}: $: expected an object, got {_kind(document)}")
    return document


def is_template_two(document: Mapping[str, Any]) -> bool:
    return "group_list" in document


def parse_template_two(document: Mapping[str, Any], source: str) -> TemplateTwo:
    read = _Reader(source)
    status = read.text(document, "status", "")
    group_list = read.items(document, "group_list", "")
    read.agree(read.count(document, "group_count", "", optional=True), len(group_list), "group_count", "groups")
    groups = tuple(_parse_group(read, group, f"group_list[{index}]") for index, group in enumerate(group_list))
    return TemplateTwo(status, groups)


def _parse_group(read: _Reader, group: Any, path: str) -> Group:
    name = read.text(group, "group_name", path) if isinstance(group, dict) and "group_name" in group else ""
    instance_list = read.items(group, "instance_list", path)
    read.agree(read.count(group, "instance_count", path, optional=True), len(instance_list),
               _join(path, "instance_count"), "instances")
    instances = tuple(_parse_instance(read, instance, f"{path}.instance_list[{index}]")
                      for index, instance in enumerate(instance_list))
    read.agree(read.count(group, "device_count", path, optional=True), sum(len(i.devices) for i in instances),
               _join(path, "device_count"), "devices")
    return Group(name, instances)


def _parse_instance(read: _Reader, instance: Any, path: str) -> Instance:
    server_id = read.ip(instance, "server_id", path)
    pod_name = read.text(instance, "pod_name", path)
    devices = tuple(_parse_device(read, device, f"{path}.devices[{index}]", with_rank=False)
                    for index, device in enumerate(read.items(instance, "devices", path)))
    _unique_devices(read, devices, path, "devices")
    return Instance(server_id, devices, pod_name)


def _parse_device(read: _Reader, device: Any, path: str, with_rank: bool) -> Device:
    device_id = read.text(device, "device_id", path)
    if not _NUMBER.match(device_id):
        raise read.fail(_join(path, "device_id"), f"expected a non-negative integer, got {device_id!r}")
    rank_id = read.text(device, "rank_id", path) if with_rank else None
    return Device(device_id, read.ip(device, "device_ip", path), rank_id)


def _unique_devices(read: _Reader, devices: Tuple[Device, ...], path: str, key: str) -> None:
    seen: Dict[int, int] = {}
    for index, device in enumerate(devices):
        physical = int(device.device_id)
        if physical in seen:
            raise read.fail(f"{path}.{key}[{index}].device_id",
                            f"device {device.device_id} is listed twice (also at {key}[{seen[physical]}])")
        seen[physical] = index


def parse_template_one(document: Mapping[str, Any], source: str) -> Ranked:
    """A template-one table, validated: counts agree, device ids unique per server, ranks 0..N-1 once each."""
    read = _Reader(source)
    status = read.text(document, "status", "")
    server_list = read.items(document, "server_list", "")
    read.agree(read.count(document, "server_count", "", optional=True), len(server_list), "server_count",
               "servers")
    instances = []
    for index, server in enumerate(server_list):
        path = f"server_list[{index}]"
        devices = tuple(_parse_device(read, device, f"{path}.device[{position}]", with_rank=True)
                        for position, device in enumerate(read.items(server, "device", path)))
        _unique_devices(read, devices, path, "device")
        instances.append(Instance(read.ip(server, "server_id", path), devices))
    _check_ranks(read, instances)
    ranked = [Instance(i.server_id, tuple(sorted(i.devices, key=lambda d: int(d.rank_id or 0))), i.pod_name)
              for i in instances]
    ranked.sort(key=lambda instance: int(instance.devices[0].rank_id or 0) if instance.devices else 0)
    return Ranked(tuple(ranked), status)


def _check_ranks(read: _Reader, instances: List[Instance]) -> None:
    where: Dict[int, str] = {}
    for index, instance in enumerate(instances):
        for position, device in enumerate(instance.devices):
            path = f"server_list[{index}].device[{position}].rank_id"
            if not _NUMBER.match(device.rank_id or ""):
                raise read.fail(path, f"expected a non-negative integer, got {device.rank_id!r}")
            rank = int(device.rank_id or 0)
            if rank in where:
                raise read.fail(path, f"rank {rank} is given twice (also at {where[rank]})")
            where[rank] = path
    size = len(where)
    missing = sorted(set(range(size)) - set(where))
    if missing:
        raise read.fail("server_list", f"ranks must be 0..{size - 1}, but {missing[0]} is missing")


# --------------------------------------------------------------------------- conversion


def convert(table: TemplateTwo, source: str = "rank table") -> Ranked:
    """Template two -> ranks (see the module's docstring for the order). Pods without devices are
    kept (a node may be one), but template one leaves them out."""
    instances: List[Instance] = []
    next_rank = 0
    for group in table.groups:
        for instance in _in_pod_order(group.instances):
            devices = tuple(Device(device.device_id, device.device_ip, str(next_rank + position))
                            for position, device in enumerate(instance.devices))
            next_rank += len(devices)
            instances.append(Instance(instance.server_id, devices, instance.pod_name))
    _unique_per_server(instances, source)
    return Ranked(tuple(instances), table.status)


def _unique_per_server(instances: List[Instance], source: str) -> None:
    """Pods on one server (one host) become one server entry: their device ids must not collide."""
    owner: Dict[Tuple[str, int], str] = {}
    for instance in instances:
        for device in instance.devices:
            slot = (instance.server_id, int(device.device_id))
            if slot in owner and owner[slot] != instance.pod_name:
                raise RankTableError(f"{source}: pods {owner[slot]} and {instance.pod_name} both list device "
                                     f"{device.device_id} of server {instance.server_id}")
            owner[slot] = instance.pod_name or ""


def pod_index(pod_name: Optional[str]) -> Optional[int]:
    """The integer that ends a pod name (`job-...-worker-12` -> 12), or None."""
    found = _POD_INDEX.search(pod_name or "")
    return int(found.group(1)) if found else None


def _in_pod_order(instances: Tuple[Instance, ...]) -> List[Instance]:
    indexes = [pod_index(instance.pod_name) for instance in instances]
    if any(index is None for index in indexes):
        return list(instances)  # no order to go by but the producer's
    return [instance for _, _, instance in sorted(zip(indexes, range(len(instances)), instances))]


def read_any(text: str, source: str) -> Ranked:
    """Either template, as ranks; template two is converted, template one validated and kept."""
    document = load_document(text, source)
    if is_template_two(document):
        return convert(parse_template_two(document, source), source)
    if "server_list" in document:
        return parse_template_one(document, source)
    raise RankTableError(f"{source}: $: neither template: no group_list (template two) or server_list (template one)")


def layout(document: Mapping[str, Any]) -> str:
    """JSON with one server per line: readable, and written by the C encoder (any `indent` makes
    json use its pure-Python one: 4x slower on 4096 servers)."""
    parts = []
    for key, value in document.items():
        if key == "server_list" and isinstance(value, list):
            servers = ",\n".join(f"    {json.dumps(server)}" for server in value)
            parts.append(f'  "server_list": [\n{servers}\n  ]' if value else '  "server_list": []')
        else:
            parts.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_atomically(path: Path, document: Mapping[str, Any]) -> None:
    """Template one to `path` through files.write_atomically: readers see the old file or the new one, and only
    a regular file (or nothing) is ever replaced. RankTableError, one line, when it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        files.write_atomically(path, layout(document))
    except OSError as exc:
        raise RankTableError(f"cannot write {path}: {exc.strerror or exc}") from None


# --------------------------------------------------------------------------- locating and waiting


def locate(configured: str) -> Path:
    """`RANK_TABLE_FILE` as a file path: a directory (existing, or a missing path not ending in .json) gets
    FILE_NAME. Anything else that exists is the table itself: a device or FIFO is refused by `read_table`,
    not waited on as a folder it can never be."""
    path = Path(configured)
    if os.path.isdir(path) or (path.suffix.lower() != ".json" and not os.path.exists(path)):
        return path / FILE_NAME
    return path


@dataclasses.dataclass
class Seen:
    """What the last look at the file found: a state for the progress and timeout lines."""

    state: str  # "missing", "unreadable (<error>)", "empty", "incomplete JSON", "status=<value>", "completed"
    text: str = ""


def read_table(path: Path) -> str:
    """The file's text, for every reader of a rank table. NotYet for what a writer may still change;
    RankTableError for what it never will (see the module's docstring)."""
    try:
        data = files.read_regular(path, MAX_TABLE_BYTES)  # non-blocking: a FIFO is refused, not waited on
    except files.NotAFile as exc:  # a device or FIFO never becomes a table: no waiting for it
        raise RankTableError(f"{path} is {exc.kind}, not a rank table (expected a JSON file)",
                             hint="a rank table is the platform's jobstart_hccl.json (RANK_TABLE_FILE names it or "
                                  "its folder)") from None
    except files.TooLarge as exc:
        raise RankTableError(f"{path} is {exc.size} bytes, over the {MAX_TABLE_BYTES >> 20} MiB a rank table may "
                             "have (4096 servers of 16 devices take 11 MB)") from None
    except OSError as exc:
        raise NotYet(f"unreadable ({exc.__class__.__name__})",
                     f"cannot read the rank table {path}: {exc.strerror or exc}") from None
    if data is None:
        raise NotYet("missing", f"cannot read the rank table {path}: No such file or directory")
    return _decode(data, path)


def _decode(data: bytes, path: Path) -> str:
    # No JSON text holds a raw NUL; UTF-16 and UTF-32 text of ASCII JSON always does, or starts with a BOM.
    if data[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE) or b"\0" in data:
        raise RankTableError(f"{path}: UTF-16 or UTF-32 text (a byte-order mark or NUL bytes); a rank table is "
                             f"UTF-8 JSON", hint="write the table as UTF-8")
    codec = "utf-8-sig" if data[:3] == codecs.BOM_UTF8 else "utf-8"
    try:
        return data.decode(codec)
    except UnicodeDecodeError as exc:
        if _cut_at_the_end(data, codec):
            raise NotYet("incomplete JSON", f"{path}: ends inside a UTF-8 character (byte {exc.start}): "
                                            f"half-written") from None
        raise RankTableError(f"{path}: not UTF-8 (byte {exc.start}); a rank table is UTF-8 JSON",
                             hint="write the table as UTF-8") from None


def _cut_at_the_end(data: bytes, codec: str) -> bool:
    """True when `data` is valid up to an incomplete character at its very end (a writer mid-character)."""
    decoder = codecs.getincrementaldecoder(codec)()
    try:
        decoder.decode(data, final=False)
    except UnicodeDecodeError:
        return False
    return bool(decoder.getstate()[0])


def look(path: Path) -> Seen:
    """What the file holds now; RankTableError (not a Seen) when it can never become a completed table."""
    try:
        text = read_table(path)
    except NotYet as pending:
        return Seen(pending.state)
    if not text or text.isspace():
        return Seen("empty")
    try:
        document = parse_json(text, str(path))
    except ValueError:
        return Seen("incomplete JSON", text)  # half-written: the next look may find it whole
    status = document.get("status") if isinstance(document, dict) else None
    if status == COMPLETED:
        return Seen(COMPLETED, text)
    return Seen(f"status={status!r}" if status is not None else "no status", text)


def wait(path: Path, timeout: float, log, poll: float = POLL_SECONDS, progress: float = PROGRESS_SECONDS,
         clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> str:
    """Polls until the file says `status: completed`; returns its text. Raises RankTableTimeout at the deadline,
    RankTableError at once for a file that can never become a table."""
    started = clock()
    next_line = started + progress
    seen = look(path)
    while seen.state != COMPLETED:
        now = clock()
        if now - started >= timeout:
            raise RankTableTimeout(
                f"rank table {path} not completed after {timeout:g} s; last seen: {seen.state}",
                hint="the platform writes it once every pod of the job is scheduled; raise "
                     "MA_RUNTIME_RANKTABLE_TIMEOUT if scheduling is slow",
            )
        if now >= next_line:
            log.info("rank table waiting", path=str(path), seen=seen.state, elapsed_s=round(now - started, 1),
                     remaining_s=round(timeout - (now - started), 1))
            next_line += progress
        sleep(min(poll, max(0.0, timeout - (now - started))))
        seen = look(path)
    return seen.text


# --------------------------------------------------------------------------- this node


def node_view(ranked: Ranked, environ: Mapping[str, str], hostname: str = "") -> NodeView:
    """This node's instance and devices; RankTableError when it is not in the table or has too few devices."""
    instance, matched_by = _find_node(ranked, environ, hostname)
    by_physical = sorted(instance.devices, key=lambda d: int(d.device_id))
    logical = {device.device_id: position for position, device in enumerate(by_physical)}
    devices = tuple(LocalDevice(logical[d.device_id], d.device_id, int(d.rank_id or 0), d.device_ip)
                    for d in instance.devices)
    wanted = _int(environ.get("MA_NUM_GPUS"))
    if wanted and wanted > len(devices):
        raise RankTableError(f"MA_NUM_GPUS={wanted}, but the rank table gives this node ({instance.server_id}) "
                             f"{len(devices)} device(s)",
                             hint="the job's flavour and its rank table disagree; check the NPU resources")
    return NodeView(instance.server_id, instance.pod_name, matched_by, devices, ranked.rank_size)


def _find_node(ranked: Ranked, environ: Mapping[str, str], hostname: str) -> Tuple[Instance, str]:
    pod_name = environ.get("MA_CURRENT_INSTANCE_NAME") or environ.get("HOSTNAME") or hostname
    for instance in ranked.instances:
        if pod_name and instance.pod_name == pod_name:
            return instance, "pod name"
    current_ip = environ.get("MA_CURRENT_IP", "")
    matches = [instance for instance in ranked.instances if current_ip and instance.server_id == current_ip]
    if len(matches) == 1:
        return matches[0], "MA_CURRENT_IP"
    index = _int(environ.get("VC_TASK_INDEX") or environ.get("MA_TASK_INDEX") or environ.get("VK_TASK_INDEX"))
    if index is not None and 0 <= index < len(ranked.instances):
        return ranked.instances[index], "VC_TASK_INDEX"
    if index is None and len(ranked.instances) == 1:
        return ranked.instances[0], "the only pod"  # a local run: no task index, one pod
    raise RankTableError(
        f"this node is not in the rank table: no pod named {pod_name or '(unknown)'}, no server "
        f"{current_ip or '(MA_CURRENT_IP unset)'}, and VC_TASK_INDEX={index if index is not None else '(unset)'} "
        f"is not below its {len(ranked.instances)} pod(s)",
        hint="the rank table is for another job, or this pod's environment is incomplete",
    )


def _int(value: Optional[str]) -> Optional[int]:
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


# --------------------------------------------------------------------------- the stage in `ma-runtime run`


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The rank table as the workers get it."""

    source: Path  # what the platform wrote
    path: Path  # template one, for the workers' RANK_TABLE_FILE
    ranked: Ranked
    node: NodeView
    text: str = dataclasses.field(default="", repr=False)  # the source as read: was it rewritten since?

    @property
    def env(self) -> Dict[str, str]:
        return {"RANK_TABLE_FILE": str(self.path), "RANK_SIZE": str(self.ranked.rank_size)}


def converted_path(spec) -> Path:
    # Not next to the source: the platform's /user/config is a read-only ConfigMap mount.
    return spec.state_dir / "rank_table" / FILE_NAME


def wait_and_convert(spec, environ: Mapping[str, str], log) -> Optional[Prepared]:
    """Waits for the platform's rank table, converts it, writes template one; None when there is none to wait for.

    Called before every start of the command: a reschedule may have rewritten the table.
    """
    if not spec.waits_for_rank_table:
        return None
    source = locate(str(spec.ranktable_file))
    started = time.monotonic()
    log.info("rank table wait started", path=str(source), timeout_s=spec.ranktable_timeout)
    text = wait(source, spec.ranktable_timeout, log)
    ranked = read_any(text, str(source))
    view = node_view(ranked, _resolved(spec, environ), _hostname())
    target = converted_path(spec)
    document = ranked.template_one()
    write_atomically(target, document)
    log.info("rank table ready", path=str(target), source=str(source), elapsed_s=round(time.monotonic() - started, 2),
             servers=document["server_count"], rank_size=ranked.rank_size, server_id=view.server_id,
             matched_by=view.matched_by, ranks=",".join(str(device.rank_id) for device in view.devices),
             devices=",".join(device.device_id for device in view.devices))
    return Prepared(source, target, ranked, view, text)


def unchanged(prepared: Prepared) -> bool:
    """Whether the platform's table still says what `prepared` was made from (no wait, no conversion)."""
    try:
        seen = look(prepared.source)
    except RuntimeFailure:
        return False  # broken now: `wait_and_convert` says how
    return seen.state == COMPLETED and seen.text == prepared.text


def peek(spec, environ: Mapping[str, str]) -> Optional[Prepared]:
    """The rank table as `wait_and_convert` would give it, without waiting or writing (for `ma-runtime plan`)."""
    if not spec.waits_for_rank_table:
        return None
    source = locate(str(spec.ranktable_file))
    seen = look(source)
    if seen.state != COMPLETED:
        raise RankTableError(f"rank table {source} is not completed yet (seen: {seen.state}); the plan needs it",
                             hint="run `ma-runtime ranktable wait` first, or plan on the node once the job started")
    ranked = read_any(seen.text, str(source))
    return Prepared(source, converted_path(spec), ranked, node_view(ranked, _resolved(spec, environ), _hostname()))


def _resolved(spec, environ: Mapping[str, str]) -> Dict[str, str]:
    """The environment `node_view` reads, with the job's resolved task index and card count: a value
    given by flag or job file counts as much as the variable (flags > env > file > defaults)."""
    view = dict(environ)
    for name, variable in (("task_index", "VC_TASK_INDEX"), ("num_gpus", "MA_NUM_GPUS")):
        if spec.sources.get(name, "default") != "default":
            view[variable] = str(getattr(spec, name))
    return view


def _hostname() -> str:
    import socket

    return socket.gethostname()
