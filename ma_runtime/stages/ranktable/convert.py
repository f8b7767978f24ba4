"""Reading a rank table's text (either template, validated field by field, every problem naming its JSON path),
converting template two to template one (ranks in pod order), and writing template one atomically."""

import collections
import contextlib
import functools
import gc
import itertools
import json
import math
import operator
import re
import socket
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from ma_runtime.stages.ranktable.model import Device, Group, Instance, Ranked, RankTableError, TemplateTwo
from ma_runtime.util import files

# Ids and counts have a few digits; 32 characters take any 64-bit integer and any float's repr.
MAX_NUMBER_CHARS = 32
_ASCII_DIGITS = "0123456789"  # str.isdigit() also takes "²", which int() refuses
_NUMBER = re.compile(r"[0-9]+\Z")  # ASCII digits only: str.isdigit() also takes "²", which int() refuses
# Device ids with no leading zero, one a line: as strings they are unique exactly when they are as integers.
_CANONICAL_IDS = re.compile(r"(?:(?:0|[1-9][0-9]*)\n)*\Z")


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

def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


# --- conversion------------------------------------------------------------------------------------------


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
    """The integer that ends a pod name (`job-...-worker-12` -> 12), or None. (As `re.search("([0-9]+)$")` would
    find, a final line end allowed, without it: the regular expression tried a match at every character of the
    name, a fifth of a 4096-pod table's conversion.)"""
    name = pod_name or ""
    if name.endswith("\n"):
        name = name[:-1]
    digits = name[len(name.rstrip(_ASCII_DIGITS)):]
    return int(digits) if digits else None


def _in_pod_order(instances: Tuple[Instance, ...]) -> List[Instance]:
    indexes = [pod_index(instance.pod_name) for instance in instances]
    if any(index is None for index in indexes):
        return list(instances)  # no order to go by but the producer's
    return [instance for _, _, instance in sorted(zip(indexes, range(len(instances)), instances))]


@contextlib.contextmanager
def _without_cycle_collection():
    """The cyclic garbage collector paused (and restored as it was): a table of 65 536 devices makes hundreds of
    thousands of dicts, lists and tuples that can hold no cycle, and each collection the allocations set off walks
    them all again (a third of a 4096 x 16 conversion). Reference counting still frees everything."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def read_any(text: str, source: str) -> Ranked:
    """Either template, as ranks; template two is converted, template one validated and kept."""
    with _without_cycle_collection():
        return _read_any(text, source)


def _read_any(text: str, source: str) -> Ranked:
    document = load_document(text, source)
    if is_template_two(document):
        return _converted_at_once(document) or convert(parse_template_two(document, source), source)
    if "server_list" in document:
        return parse_template_one(document, source)
    raise RankTableError(f"{source}: $: neither template: no group_list (template two) or server_list (template one)")


# --- template two as the platform writes it, in bulk --------------------------------------------------------
# Field by field, 4096 x 16 devices cost 3x the JSON round trip: a call per field, and every device made twice
# (parsed, then ranked; a frozen dataclass's __init__ is ~1.5 us). A table as the platform writes it (every value
# a string, IPv4 addresses, device ids without leading zeros, no server shared by two pods) is checked in bulk
# instead, and each device is made once, with its rank. Anything else, valid or not, returns None and takes the
# field-by-field way: it gives the same table or names the problem, so this path never answers differently.


class _Unusual(Exception):
    """The table is not the common shape: the field-by-field reading decides."""


def _converted_at_once(document: Mapping[str, Any]) -> Optional[Ranked]:
    try:
        status = _string(document["status"])
        group_list = _list(document["group_list"])
        _agrees(document, "group_count", len(group_list))
        pods = [pod for group in group_list for pod in _group_pods(group)]
        return Ranked(_ranked(pods), status)
    except (_Unusual, KeyError, TypeError, ValueError, OSError):
        return None


# (server_id, pod_name, devices as the JSON holds them)
_Pod = Tuple[str, str, List[Any]]


def _group_pods(group: Any) -> List[_Pod]:
    """One group's pods, in pod order, their names and counts checked (their devices by _ranked)."""
    if not isinstance(group, dict) or not isinstance(group.get("group_name", ""), str):
        raise _Unusual
    instance_list = _list(group["instance_list"])
    _agrees(group, "instance_count", len(instance_list))
    pods = [(_string(pod["server_id"]), _string(pod["pod_name"]), _list(pod["devices"])) for pod in instance_list]
    _agrees(group, "device_count", sum(len(devices) for _, _, devices in pods))
    indexes = [pod_index(pod_name) for _, pod_name, _ in pods]
    if any(index is None for index in indexes):
        return pods
    return [pod for _, _, pod in sorted(zip(indexes, range(len(pods)), pods))]


def _ranked(pods: List[_Pod]) -> Tuple[Instance, ...]:
    """Every pod's devices checked at once, over flat lists, and made with their ranks."""
    every_device = list(itertools.chain.from_iterable(devices for _, _, devices in pods))
    # KeyError or TypeError for a device that is no object or lacks a field.
    ids = list(map(operator.itemgetter("device_id"), every_device))
    ips = list(map(operator.itemgetter("device_ip"), every_device))
    lines = "\n".join(ids)  # TypeError for an id that is no string; a line end inside one adds a line, counted
    if ids and (not _CANONICAL_IDS.match(lines + "\n") or lines.count("\n") != len(ids) - 1):
        raise _Unusual
    # inet_pton, as _Reader.ip tries first: OSError (or ValueError, TypeError) for anything else, IPv6 included.
    pton = functools.partial(socket.inet_pton, socket.AF_INET)
    collections.deque(map(pton, ips), maxlen=0)
    collections.deque(map(pton, (server_id for server_id, _, _ in pods)), maxlen=0)
    servers = [server_id for server_id, _, devices in pods if devices]
    if len(set(servers)) != len(servers):
        raise _Unusual  # two pods on one host: _unique_per_server checks their devices
    # Device is a named tuple: tuple.__new__ makes each at C speed, as Device(...) would, fields in order.
    devices = list(map(tuple.__new__, itertools.repeat(Device), zip(ids, ips, map(str, range(len(ids))))))
    instances = []
    start = 0
    for server_id, pod_name, listed in pods:
        end = start + len(listed)
        if len(set(ids[start:end])) != end - start:
            raise _Unusual  # a device listed twice: the field-by-field reading names it
        instances.append(Instance(server_id, tuple(devices[start:end]), pod_name))
        start = end
    return tuple(instances)


def _string(value: Any) -> str:
    if type(value) is not str:
        raise _Unusual
    return value


def _list(value: Any) -> List[Any]:
    if type(value) is not list:
        raise _Unusual
    return value


def _agrees(obj: Mapping[str, Any], name: str, actual: int) -> None:
    """An optional count: absent, or a string of canonical digits that equals `actual`."""
    if name in obj and obj[name] != str(actual):
        raise _Unusual


def layout(document: Mapping[str, Any]) -> str:
    """JSON with one server per line: readable, and written by the C encoder (any `indent` makes
    json use its pure-Python one: 4x slower on 4096 servers)."""
    value = document.get("server_list")
    servers = [json.dumps(server) for server in value] if isinstance(value, list) else None
    return _assembled(document, servers)


def _assembled(document: Mapping[str, Any], servers: Optional[List[str]]) -> str:
    """The document's text, its server_list written as the given lines (None: as a plain value)."""
    parts = []
    for key, value in document.items():
        if key == "server_list" and servers is not None:
            rows = ",\n".join(f"    {server}" for server in servers)
            parts.append(f'  "server_list": [\n{rows}\n  ]' if servers else '  "server_list": []')
        else:
            parts.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


# What json.dumps escapes besides `"`, `\` and non-ASCII.
_CONTROL = bytes(range(0x20))
_DEVICE = '{"device_id": "%s", "device_ip": "%s", "rank_id": "%s"}'


def template_one_text(ranked: Ranked) -> str:
    """`layout(ranked.template_one())`, byte for byte. Each device is formatted straight from its tuple, not made
    into a dict and encoded (the encoding was a third of the conversion), where that gives what json.dumps would:
    every id and address plain text (always, for a table that took the fast path: digits and IPv4)."""
    with _without_cycle_collection():
        return _template_one_text(ranked)


def _template_one_text(ranked: Ranked) -> str:
    servers: Dict[str, List[Device]] = {}
    for instance in ranked.instances:
        if instance.devices:  # as template_one: a pod without devices is no HCCL server
            servers.setdefault(instance.server_id, []).extend(instance.devices)
    lines = []
    for server_id, devices in servers.items():
        values = (*itertools.chain.from_iterable(devices), server_id)
        try:
            "".join(values)  # json.dumps writes a number bare and None as null; template_one writes rank None as ""
        except TypeError:
            return layout(ranked.template_one())
        lines.append(_server_format(len(devices)) % values)
    if not _plain_rows(lines, servers):
        return layout(ranked.template_one())
    head = {"server_count": str(len(servers)), "server_list": None, "status": ranked.status, "version": "1.0"}
    return _assembled(head, lines)


@functools.cache
def _server_format(devices: int) -> str:
    """A server's row with `devices` devices as one %-format: one call per server, not one per device."""
    return '{"device": [' + ", ".join([_DEVICE] * devices) + '], "server_id": "%s"}'


def _plain_rows(lines: List[str], servers: Dict[str, List[Device]]) -> bool:
    """Whether the formatted rows (of strings) are what json.dumps writes: no value held a quote (the count of
    quotes is the format's own), a backslash, a control or a non-ASCII character."""
    text = "".join(lines)
    if not text.isascii():
        return False
    # As bytes, the control characters are found by deleting them (a copy at memory speed; a regular expression's
    # scan of the 4.7 MB of a 4096 x 16 table took 7x as long).
    data = text.encode("ascii")
    devices = sum(map(len, servers.values()))
    return (b"\\" not in data and len(data.translate(None, _CONTROL)) == len(data)
            and data.count(b'"') == 12 * devices + 6 * len(servers))


def write_atomically(path: Path, document: Union[str, Mapping[str, Any]]) -> None:
    """Template one (its document, or its text from template_one_text) to `path` through files.write_atomically:
    readers see the old file or the new one, and only a regular file (or nothing) is ever replaced.
    RankTableError, one line, when it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        files.write_atomically(path, document if isinstance(document, str) else layout(document))
    except OSError as exc:
        raise RankTableError(f"cannot write {path}: {exc.strerror or exc}") from None
