"""The rank table, in process: golden conversions, properties, validation, waiting, this node's view."""

import codecs
import collections
import copy
import json
import os
import re
import stat
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ma_runtime import spec as job_spec
from ma_runtime.errors import ExitCode
from ma_runtime.stages import ranktable
from ma_runtime.stages.ranktable import convert as table_convert
from ma_runtime.stages.ranktable import model as table_model
from ma_runtime.stages.ranktable import node as table_node
from ma_runtime.stages.ranktable import wait as table_wait
from ma_runtime.stages.ranktable.model import RankTableError, RankTableTimeout

DATA = Path(__file__).resolve().parents[1] / "data" / "ranktable"
CASES = sorted(path.name[: -len(".template2.json")] for path in DATA.glob("*.template2.json"))


def golden(case, template):
    return (DATA / f"{case}.template{template}.json").read_text()


def from_text(text, source="table.json"):
    return table_convert.convert(table_convert.parse_template_two(table_convert.load_document(text, source), source))


def rank_map(ranked):
    """(server_id, physical device id) -> rank, from the Ranked model."""
    return {(i.server_id, d.device_id): int(d.rank_id) for i in ranked.instances for d in i.devices}


def table_rank_map(table):
    """(server_id, physical device id) -> rank, from a template-one document."""
    return {(s["server_id"], d["device_id"]): int(d["rank_id"]) for s in table["server_list"] for d in s["device"]}


def all_strings(value):
    if isinstance(value, dict):
        return all(all_strings(v) for v in value.values())
    if isinstance(value, list):
        return all(all_strings(v) for v in value)
    return isinstance(value, str)


class Log:
    """A structlog-style logger that keeps (level, event, fields)."""

    def __init__(self):
        self.records = []

    def info(self, event, **fields):
        self.records.append(("info", event, fields))

    def warning(self, event, **fields):
        self.records.append(("warning", event, fields))

    def error(self, event, **fields):
        self.records.append(("error", event, fields))

    def fields(self, event):
        return [fields for _, name, fields in self.records if name == event]


# --------------------------------------------------------------------------- golden files


def test_every_case_has_both_templates():
    assert len(CASES) >= 9
    for case in CASES:
        assert (DATA / f"{case}.template1.json").is_file(), case


@pytest.mark.parametrize("case", CASES)
def test_conversion_equals_the_golden_template_one(case):
    assert from_text(golden(case, 2)).template_one() == json.loads(golden(case, 1))


@pytest.mark.parametrize("case", CASES)
def test_read_any_converts_template_two_and_keeps_template_one(case):
    expected = json.loads(golden(case, 1))
    assert table_convert.read_any(golden(case, 2), "t2").template_one() == expected
    assert table_convert.read_any(golden(case, 1), "t1").template_one() == expected


def test_platform_example_by_the_documented_values():
    table = from_text(golden("platform_example", 2)).template_one()
    assert table == {
        "server_count": "1",
        "server_list": [{"device": [{"device_id": "4", "device_ip": "192.1.10.254", "rank_id": "0"}],
                         "server_id": "192.168.0.25"}],
        "status": "completed",
        "version": "1.0",
    }


def test_pods_order_by_index_as_numbers_not_strings():
    ranked = from_text(golden("pod_index_numeric", 2))
    assert [i.pod_name for i in ranked.instances] == [f"job3-worker-{k}" for k in (0, 1, 2, 10, 11)]


def test_a_pod_without_index_keeps_the_groups_file_order():
    ranked = from_text(golden("several_groups", 2))
    assert [i.pod_name for i in ranked.instances] == [
        "job1-worker-0", "job1-worker-1", "job1-eval-0", "job1-aux-2", "job1-aux-ps", "job1-aux-1"]


def test_groups_without_devices_add_no_ranks_and_no_servers():
    ranked = from_text(golden("zero_device_group", 2))
    assert ranked.rank_size == 5
    assert [s["server_id"] for s in ranked.template_one()["server_list"]] == ["10.1.0.3", "10.1.0.4", "10.1.0.6"]


def test_pods_on_one_host_become_one_server_in_rank_order():
    table = from_text(golden("shared_server", 2)).template_one()
    assert table["server_count"] == "2"
    assert [d["rank_id"] for d in table["server_list"][0]["device"]] == ["0", "1", "4", "5"]


def test_rank_size_of_sixteen_by_sixteen():
    ranked = from_text(golden("sixteen_by_sixteen", 2))
    assert ranked.rank_size == 256 and len(ranked.template_one()["server_list"]) == 16


@pytest.mark.parametrize(
    "name, index",
    [("job-abc-worker-0", 0), ("job-abc-worker-10", 10), ("worker-007", 7), ("job-abc-ps", None), ("", None),
     (None, None), ("job-10-worker", None)],
)
def test_pod_index(name, index):
    assert table_convert.pod_index(name) == index


@pytest.mark.parametrize("name", ["worker-12\n", "worker-12\n\n", "worker-\n", "12", "\n", "a1b22", "w-²", "w-1²",
                                  "w-٣", "w-0012", "w-12 ", "w-\u200912", "x" * 300 + "7"])
def test_pod_index_reads_what_the_regular_expression_read(name):
    # pod_index was re.search("([0-9]+)$"): its `$` also matches before a final line end; [0-9] is ASCII only.
    found = re.search(r"([0-9]+)$", name)
    assert table_convert.pod_index(name) == (int(found.group(1)) if found else None)


def test_is_template_two():
    assert table_convert.is_template_two(json.loads(golden("two_servers_8", 2)))
    assert not table_convert.is_template_two(json.loads(golden("two_servers_8", 1)))


# --------------------------------------------------------------------------- properties

IPS = ("192.1.10.254", "192.1.10.1", "10.0.0.7", "172.16.3.4", "fe80::1")
PLAIN_NAMES = ("ps", "launcher", "main", "worker-a", "chief")


def count_field(draw, value):
    """A declared count: omitted (None), a string, or an int."""
    return draw(st.sampled_from((None, str(value), value)))


@st.composite
def template_twos(draw):
    """Valid template-two documents: servers may host several pods, whose device ids never collide."""
    servers = [f"10.{k}.0.1" for k in range(draw(st.integers(1, 6)))]
    free = {server: list(range(16)) for server in servers}
    groups = []
    for g in range(draw(st.integers(0, 4))):
        without_devices = draw(st.sampled_from((True, False, False, False)))
        naming = draw(st.sampled_from(("indexed", "indexed", "plain", "mixed")))
        instances = []
        for _ in range(draw(st.integers(0, 5))):
            server = draw(st.sampled_from(servers))
            ids = [] if without_devices or not free[server] else draw(
                st.lists(st.sampled_from(free[server]), unique=True, max_size=8))
            free[server] = [d for d in free[server] if d not in ids]
            indexed = naming == "indexed" or (naming == "mixed" and draw(st.booleans()))
            pod = f"job-g{g}-worker-{draw(st.integers(0, 30))}" if indexed else \
                f"job-g{g}-{draw(st.sampled_from(PLAIN_NAMES))}"
            devices = [{"device_id": draw(st.sampled_from((d, str(d)))), "device_ip": draw(st.sampled_from(IPS))}
                       for d in ids]
            instances.append({"devices": devices, "pod_name": pod, "server_id": server})
        group = {"group_name": f"job-g{g}", "instance_list": instances}
        for name, value in (("instance_count", len(instances)),
                            ("device_count", sum(len(i["devices"]) for i in instances))):
            declared = count_field(draw, value)
            if declared is not None:
                group[name] = declared
        groups.append(group)
    document = {"group_list": groups, "status": "completed"}
    declared = count_field(draw, len(groups))
    if declared is not None:
        document["group_count"] = declared
    return document


def oracle(document):
    """The rank rule, written out: (server_id, device id) -> rank."""
    ranks, next_rank = {}, 0
    for group in document["group_list"]:
        instances = group["instance_list"]
        found = [re.search(r"(\d+)$", i["pod_name"]) for i in instances]
        order = list(range(len(instances)))
        if all(found):
            order.sort(key=lambda k: int(found[k].group(1)))
        for k in order:
            for device in instances[k]["devices"]:
                ranks[(instances[k]["server_id"], str(device["device_id"]))] = next_rank
                next_rank += 1
    return ranks


PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(template_twos())
def test_conversion_follows_the_rank_rule(document):
    ranked = table_convert.convert(table_convert.parse_template_two(document, "t2"))
    table = ranked.template_one()
    devices = [d for i in document["group_list"] for p in i["instance_list"] for d in p["devices"]]
    assert sorted(int(d["rank_id"]) for s in table["server_list"] for d in s["device"]) == list(range(len(devices)))
    assert ranked.rank_size == len(devices)
    assert table_rank_map(table) == rank_map(ranked) == oracle(document)
    assert all_strings(table) and table["version"] == "1.0"
    servers = [s["server_id"] for s in table["server_list"]]
    assert int(table["server_count"]) == len(servers) == len(set(servers))


@PROPERTY
@given(template_twos())
def test_conversion_keeps_every_device(document):
    table = table_convert.convert(table_convert.parse_template_two(document, "t2")).template_one()
    before = collections.Counter((str(d["device_id"]), d["device_ip"])
                                 for g in document["group_list"] for i in g["instance_list"] for d in i["devices"])
    after = collections.Counter((d["device_id"], d["device_ip"]) for s in table["server_list"] for d in s["device"])
    assert after == before


@PROPERTY
@given(template_twos())
def test_conversion_is_deterministic(document):
    first = table_convert.read_any(json.dumps(document), "t2").template_one()
    again = table_convert.read_any(json.dumps(copy.deepcopy(document), indent=2), "t2").template_one()
    assert json.dumps(first) == json.dumps(again)


@PROPERTY
@given(template_twos())
def test_template_one_output_reads_back_with_the_same_ranks(document):
    ranked = table_convert.read_any(json.dumps(document), "t2")
    again = table_convert.read_any(json.dumps(ranked.template_one()), "t1")
    assert rank_map(again) == rank_map(ranked)
    assert again.rank_size == ranked.rank_size
    assert again.template_one() == ranked.template_one()


# --------------------------------------------------------------------------- the fast path (issue 29)
# read_any checks a table as the platform writes it in bulk; anything else takes the field-by-field reading.
# Either way the answer must be the field-by-field one: the same table, or the same error.

UNUSUAL = [
    lambda d: device(d, 0, 1).update(device_id=1),  # an int id
    lambda d: device(d, 0, 1).update(device_id="01"),  # a leading zero: "01" and "1" are one device
    lambda d: device(d, 0, 1).update(device_id="0"),  # listed twice
    lambda d: device(d, 0, 1).update(device_id="1\n2"),  # a line end inside an id
    lambda d: device(d, 0, 1).update(device_id="²"),
    lambda d: device(d, 0, 1).update(device_ip="fe80::1"),  # IPv6
    lambda d: device(d, 0, 1).update(device_ip="192.1.0.011"),
    lambda d: device(d, 0, 1).update(device_ip="192.1.0.1\x00"),
    lambda d: device(d, 0, 1).update(device_ip=None),
    lambda d: device(d, 0, 1).pop("device_ip"),
    lambda d: pod(d, 1).update(server_id="10.0.0.1"),  # two pods on one host, their device ids colliding
    lambda d: pod(d, 1).update(server_id="10.0.0.1", devices=[{"device_id": "7", "device_ip": "192.1.1.7"}]),
    lambda d: pod(d, 1).update(pod_name=7),
    lambda d: pod(d, 1).update(pod_name="job-worker-a"),  # no index: file order
    lambda d: pod(d, 0).update(pod_name="job-worker-9"),
    lambda d: pod(d, 0).update(devices=[]),
    lambda d: pod(d, 0)["devices"].append("0"),
    lambda d: d["group_list"][0].update(device_count="05"),
    lambda d: d["group_list"][0].update(device_count=5),
    lambda d: d["group_list"][0].update(instance_count="3"),
    lambda d: d["group_list"][0].update(group_name=3),
    lambda d: d.update(group_count=1),
    lambda d: d.update(status=1),
    lambda d: d.update(status='a "quoted" \\ status\n'),
    lambda d: d["group_list"].append({"group_name": "more", "instance_list": [
        {"devices": [{"device_id": "3", "device_ip": "1.1.1.1"}], "pod_name": "x-1", "server_id": "10.0.0.9"}]}),
]


def field_by_field(document):
    """read_any as it was: every table read field by field."""
    text = json.dumps(document)
    loaded = table_convert.load_document(text, "rt.json")
    return table_convert.convert(table_convert.parse_template_two(loaded, "rt.json"), "rt.json")


def outcome(read, document):
    try:
        return read(document)
    except RankTableError as error:
        return f"error: {error}"


@pytest.mark.parametrize("mutate", [None, *UNUSUAL])
def test_read_any_answers_as_the_field_by_field_reading(mutate):
    document = two_with(mutate or (lambda d: None))
    fast = outcome(lambda doc: table_convert.read_any(json.dumps(doc), "rt.json"), document)
    assert fast == outcome(field_by_field, document)
    if not isinstance(fast, str):
        assert table_convert.template_one_text(fast) == table_convert.layout(fast.template_one())


@PROPERTY
@given(template_twos())
def test_read_any_answers_as_the_field_by_field_reading_for_any_table(document):
    ranked = table_convert.read_any(json.dumps(document), "rt.json")
    assert ranked == field_by_field(document)
    assert table_convert.template_one_text(ranked) == table_convert.layout(ranked.template_one())


@pytest.mark.parametrize("device_id, server_id, rank_id", [
    ("0", "10.0.0.1", None), (0, "10.0.0.1", "0"), ("0", 'a"b', "0"), ("0", "a\\b", "0"), ("0", "é", "0"),
    ("0\t", "10.0.0.1", "0"), ("0", "10.0.0.1", "None")])
def test_template_one_text_is_layout_of_template_one_for_any_values(device_id, server_id, rank_id):
    devices = (table_model.Device(device_id, "10.1.0.1", rank_id), table_model.Device("1", "10.1.0.2", "1"))
    ranked = table_model.Ranked((table_model.Instance(server_id, devices), table_model.Instance("10.0.0.3", ())),
                                status='with "quotes"')
    assert table_convert.template_one_text(ranked) == table_convert.layout(ranked.template_one())


# --------------------------------------------------------------------------- validation


def template_two():
    """One group, two pods: pod 1 has three devices (so `devices[2]` exists)."""
    return {
        "group_count": "1",
        "group_list": [{
            "device_count": "5",
            "group_name": "job-worker",
            "instance_count": "2",
            "instance_list": [
                {"devices": [{"device_id": str(d), "device_ip": f"192.1.0.{10 + d}"} for d in range(2)],
                 "pod_name": "job-worker-0", "server_id": "10.0.0.1"},
                {"devices": [{"device_id": str(d), "device_ip": f"192.1.1.{10 + d}"} for d in range(3)],
                 "pod_name": "job-worker-1", "server_id": "10.0.0.2"},
            ],
        }],
        "status": "completed",
    }


def template_one():
    return {
        "server_count": "2",
        "server_list": [
            {"device": [{"device_id": "0", "device_ip": "192.1.0.10", "rank_id": "0"},
                        {"device_id": "1", "device_ip": "192.1.0.11", "rank_id": "1"}],
             "server_id": "10.0.0.1"},
            {"device": [{"device_id": "0", "device_ip": "192.1.1.10", "rank_id": "2"}], "server_id": "10.0.0.2"},
        ],
        "status": "completed",
        "version": "1.0",
    }


def device(doc, instance, index):
    return doc["group_list"][0]["instance_list"][instance]["devices"][index]


def pod(doc, instance):
    return doc["group_list"][0]["instance_list"][instance]


def two_with(setter):
    doc = template_two()
    setter(doc)
    return doc


TWO_INVALID = [
    # wrong types
    (lambda d: d.update(group_list={}), "group_list: expected a list, got an object"),
    (lambda d: d["group_list"].__setitem__(0, []), "group_list[0]: expected an object, got a list"),
    (lambda d: d["group_list"][0]["instance_list"].__setitem__(1, "pod"),
     "group_list[0].instance_list[1]: expected an object, got a string"),
    (lambda d: pod(d, 0).update(devices={"device_id": "0"}),
     "group_list[0].instance_list[0].devices: expected a list, got an object"),
    (lambda d: device(d, 1, 2).update(device_ip={"ip": "1.2.3.4"}),
     "group_list[0].instance_list[1].devices[2].device_ip: expected a string, got an object"),
    (lambda d: device(d, 1, 2).update(device_id=True),
     "group_list[0].instance_list[1].devices[2].device_id: expected a string, got a boolean"),
    (lambda d: device(d, 0, 0).update(device_id=1.5),
     "group_list[0].instance_list[0].devices[0].device_id: expected a string, got a number"),
    (lambda d: pod(d, 1).update(server_id=None),
     "group_list[0].instance_list[1].server_id: expected a string, got null"),
    (lambda d: pod(d, 0).update(pod_name=["job-worker-0"]),
     "group_list[0].instance_list[0].pod_name: expected a string, got a list"),
    (lambda d: d.update(status=False), "status: expected a string, got a boolean"),
    (lambda d: d.update(group_count=True), "group_count: expected a string, got a boolean"),
    # missing fields
    (lambda d: d.pop("status"), "status: missing"),
    (lambda d: d["group_list"][0].pop("instance_list"), "group_list[0].instance_list: missing"),
    (lambda d: pod(d, 0).pop("pod_name"), "group_list[0].instance_list[0].pod_name: missing"),
    (lambda d: pod(d, 1).pop("server_id"), "group_list[0].instance_list[1].server_id: missing"),
    (lambda d: pod(d, 1).pop("devices"), "group_list[0].instance_list[1].devices: missing"),
    (lambda d: device(d, 1, 2).pop("device_ip"), "group_list[0].instance_list[1].devices[2].device_ip: missing"),
    (lambda d: device(d, 0, 1).pop("device_id"), "group_list[0].instance_list[0].devices[1].device_id: missing"),
    # bad values
    (lambda d: device(d, 1, 2).update(device_id="0"),
     "group_list[0].instance_list[1].devices[2].device_id: device 0 is listed twice (also at devices[0])"),
    (lambda d: device(d, 1, 2).update(device_id=1),
     "group_list[0].instance_list[1].devices[2].device_id: device 1 is listed twice (also at devices[1])"),
    (lambda d: device(d, 1, 2).update(device_ip="x"),
     "group_list[0].instance_list[1].devices[2].device_ip: 'x' is not an IP address"),
    (lambda d: device(d, 0, 0).update(device_ip="192.1.0.256"),
     "group_list[0].instance_list[0].devices[0].device_ip: '192.1.0.256' is not an IP address"),
    (lambda d: pod(d, 1).update(server_id="node-1"),
     "group_list[0].instance_list[1].server_id: 'node-1' is not an IP address"),
    (lambda d: device(d, 0, 0).update(device_id="npu0"),
     "group_list[0].instance_list[0].devices[0].device_id: expected a non-negative integer, got 'npu0'"),
    (lambda d: device(d, 0, 0).update(device_id=-1),
     "group_list[0].instance_list[0].devices[0].device_id: expected a non-negative integer, got '-1'"),
    # counts that disagree
    (lambda d: d.update(group_count="2"), "group_count: says 2, but there are 1 groups"),
    (lambda d: d.update(group_count=0), "group_count: says 0, but there are 1 groups"),
    (lambda d: d["group_list"][0].update(instance_count="3"),
     "group_list[0].instance_count: says 3, but there are 2 instances"),
    (lambda d: d["group_list"][0].update(device_count="4"),
     "group_list[0].device_count: says 4, but there are 5 devices"),
    (lambda d: d["group_list"][0].update(device_count="0"),
     "group_list[0].device_count: says 0, but there are 5 devices"),
    (lambda d: d.update(group_count="one"), "group_count: expected a non-negative integer, got 'one'"),
]


@pytest.mark.parametrize("mutate, message", TWO_INVALID, ids=[m for _, m in TWO_INVALID])
def test_invalid_template_two_names_the_json_path(mutate, message):
    document = two_with(mutate)
    with pytest.raises(RankTableError) as raised:
        table_convert.read_any(json.dumps(document), "/user/config/jobstart_hccl.json")
    assert str(raised.value) == f"/user/config/jobstart_hccl.json: {message}"
    assert raised.value.exit_code == ExitCode.BAD_CONFIGURATION == 78
    assert raised.value.stage == "ranktable"


def one_with(setter):
    doc = template_one()
    setter(doc)
    return doc


def t1_device(doc, server, index):
    return doc["server_list"][server]["device"][index]


ONE_INVALID = [
    (lambda d: t1_device(d, 1, 0).update(rank_id="1"),
     "server_list[1].device[0].rank_id: rank 1 is given twice (also at server_list[0].device[1].rank_id)"),
    (lambda d: t1_device(d, 1, 0).update(rank_id=0),
     "server_list[1].device[0].rank_id: rank 0 is given twice (also at server_list[0].device[0].rank_id)"),
    (lambda d: t1_device(d, 1, 0).update(rank_id="3"), "server_list: ranks must be 0..2, but 2 is missing"),
    (lambda d: [t1_device(d, s, i).update(rank_id=str(r + 1)) for s, i, r in ((0, 0, 0), (0, 1, 1), (1, 0, 2))],
     "server_list: ranks must be 0..2, but 0 is missing"),
    (lambda d: t1_device(d, 0, 1).pop("rank_id"), "server_list[0].device[1].rank_id: missing"),
    (lambda d: t1_device(d, 0, 1).update(rank_id="-1"),
     "server_list[0].device[1].rank_id: expected a non-negative integer, got '-1'"),
    (lambda d: t1_device(d, 0, 1).update(rank_id=None),
     "server_list[0].device[1].rank_id: expected a string, got null"),
    (lambda d: d.update(server_count="3"), "server_count: says 3, but there are 2 servers"),
    (lambda d: d["server_list"][1].update(device={}), "server_list[1].device: expected a list, got an object"),
    (lambda d: d["server_list"][1].update(server_id="abc"), "server_list[1].server_id: 'abc' is not an IP address"),
    (lambda d: t1_device(d, 0, 0).update(device_ip="::g"),
     "server_list[0].device[0].device_ip: '::g' is not an IP address"),
    (lambda d: d.update(server_list="10.0.0.1"), "server_list: expected a list, got a string"),
]


@pytest.mark.parametrize("mutate, message", ONE_INVALID, ids=[m for _, m in ONE_INVALID])
def test_invalid_template_one_names_the_json_path(mutate, message):
    with pytest.raises(RankTableError) as raised:
        table_convert.read_any(json.dumps(one_with(mutate)), "rt.json")
    assert str(raised.value) == f"rt.json: {message}"


def test_duplicate_device_in_a_template_one_server_is_refused():
    document = one_with(lambda d: t1_device(d, 0, 1).update(device_id="0"))
    pattern = r"rt\.json: server_list\[0\]\.devices?\[1\]\.device_id: device 0 is listed twice"
    with pytest.raises(RankTableError, match=pattern):
        table_convert.read_any(json.dumps(document), "rt.json")


def test_duplicate_device_in_a_template_one_server_names_the_device_key():
    document = one_with(lambda d: t1_device(d, 0, 1).update(device_id="0"))
    with pytest.raises(RankTableError, match=r"server_list\[0\]\.device\[1\]\.device_id"):
        table_convert.read_any(json.dumps(document), "rt.json")


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"group_list": [', "t.json: not valid JSON ("),
        ("", "t.json: not valid JSON ("),
        ("[1, 2]", "t.json: $: expected an object, got a list"),
        ('"completed"', "t.json: $: expected an object, got a string"),
        ('{"status": "completed"}', "t.json: $: neither template: no group_list (template two) or server_list"),
    ],
)
def test_malformed_documents(text, message):
    with pytest.raises(RankTableError) as raised:
        table_convert.read_any(text, "t.json")
    assert str(raised.value).startswith(message)


def test_template_one_is_kept_as_given():
    document = template_one()
    assert table_convert.read_any(json.dumps(document), "t1").template_one() == document


def test_template_one_with_int_ranks_reads_as_strings():
    document = one_with(lambda d: [t1_device(d, s, i).update(rank_id=r, device_id=int(t1_device(d, s, i)["device_id"]))
                                   for s, i, r in ((0, 0, 0), (0, 1, 1), (1, 0, 2))])
    assert table_convert.read_any(json.dumps(document), "t1").template_one() == template_one()


@pytest.mark.parametrize("field", ["group_count", "device_id"])
def test_unicode_digits_are_a_rank_table_error(field):
    document = template_two()
    if field == "group_count":
        document["group_count"] = "\u00b2"
    else:
        device(document, 0, 0)["device_id"] = "\u00b2"
    with pytest.raises(RankTableError):
        table_convert.read_any(json.dumps(document), "t2")


# --------------------------------------------------------------------------- locating and looking


def test_locate_appends_the_file_name_to_a_directory(tmp_path):
    assert table_wait.locate(str(tmp_path)) == tmp_path / "jobstart_hccl.json"
    (tmp_path / "looks.json").mkdir()
    assert table_wait.locate(str(tmp_path / "looks.json")) == tmp_path / "looks.json" / "jobstart_hccl.json"


def test_locate_treats_a_missing_path_without_json_suffix_as_a_directory(tmp_path):
    assert table_wait.locate(str(tmp_path / "config")) == tmp_path / "config" / "jobstart_hccl.json"
    assert table_wait.locate("/user/config") == Path("/user/config/jobstart_hccl.json")


def test_locate_takes_any_existing_non_directory_as_the_table(tmp_path):
    (tmp_path / "rank_table").write_text("{}")
    os.mkfifo(tmp_path / "fifo")
    assert table_wait.locate(str(tmp_path / "rank_table")) == tmp_path / "rank_table"
    assert table_wait.locate(str(tmp_path / "fifo")) == tmp_path / "fifo"
    assert table_wait.locate("/dev/zero") == Path("/dev/zero")


def test_locate_keeps_a_json_file_path(tmp_path):
    assert table_wait.locate(str(tmp_path / "rank_table.json")) == tmp_path / "rank_table.json"
    assert table_wait.locate("/user/config/jobstart_hccl.json") == Path("/user/config/jobstart_hccl.json")


@pytest.mark.parametrize(
    "content, state",
    [
        (None, "missing"),
        (b"", "empty"),
        (b"  \n", "empty"),
        (b'{"status": "initial', "incomplete JSON"),
        (b'{"status": "initializing", "group_list": []}', "status='initializing'"),
        (b'{"group_list": []}', "no status"),
        (b"[]", "no status"),
        (b'{"status": "completed", "group_list": []}', "completed"),
        ("\u00e4".encode()[:1], "incomplete JSON"),  # a writer half-way through a character
    ],
)
def test_look_names_what_it_found(tmp_path, content, state):
    path = tmp_path / "jobstart_hccl.json"
    if content is not None:
        path.write_bytes(content)
    seen = table_wait.look(path)
    assert seen.state == state
    if state in ("completed", "incomplete JSON", "status='initializing'"):
        assert seen.text == content.decode("utf-8", "ignore")  # a character cut at the end: no text yet


def test_look_at_a_directory_refuses_it(tmp_path):
    with pytest.raises(RankTableError, match=f"^{re.escape(str(tmp_path))} is a directory, not a rank table"):
        table_wait.look(tmp_path)


# --------------------------------------------------------------------------- waiting, on a fake clock


class FakeTime:
    """clock() and sleep() for `wait`: sleeping advances the clock and runs the file changes due by then."""

    def __init__(self, changes=()):
        self.now = 0.0
        self.sleeps = []
        self.changes = sorted(changes, key=lambda change: change[0])

    def clock(self):
        return self.now

    def sleep(self, seconds):
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds
        while self.changes and self.changes[0][0] <= self.now:
            self.changes.pop(0)[1]()


INITIALIZING = json.dumps({**json.loads(golden("platform_example", 2)), "status": "initializing"})
COMPLETED = golden("platform_example", 2)


def test_wait_logs_progress_and_times_out_saying_what_it_saw_last(tmp_path):
    path, log, fake = tmp_path / "jobstart_hccl.json", Log(), FakeTime()
    with pytest.raises(RankTableTimeout) as raised:
        table_wait.wait(path, 25, log, poll=0.5, progress=10, clock=fake.clock, sleep=fake.sleep)
    assert str(raised.value) == f"rank table {path} not completed after 25 s; last seen: missing"
    assert raised.value.exit_code == ExitCode.TIMED_OUT == 81 and raised.value.stage == "ranktable"
    assert log.fields("rank table waiting") == [
        {"path": str(path), "seen": "missing", "elapsed_s": 10.0, "remaining_s": 15.0},
        {"path": str(path), "seen": "missing", "elapsed_s": 20.0, "remaining_s": 5.0},
    ]
    assert fake.now == 25.0 and max(fake.sleeps) == 0.5


def test_wait_tolerates_missing_empty_and_half_written_files(tmp_path):
    path, log = tmp_path / "jobstart_hccl.json", Log()
    fake = FakeTime([
        (1.0, lambda: path.write_text("")),
        (2.0, lambda: path.write_text(COMPLETED[: len(COMPLETED) // 2])),
        (3.0, lambda: path.write_text(INITIALIZING)),
        (4.0, lambda: path.write_text(COMPLETED[:-20])),
        (5.0, lambda: path.write_text(COMPLETED)),
    ])
    text = table_wait.wait(path, 60, log, poll=0.5, progress=1.0, clock=fake.clock, sleep=fake.sleep)
    assert text == COMPLETED and fake.now == 5.0
    assert [f["seen"] for f in log.fields("rank table waiting")] == [
        "empty", "incomplete JSON", "status='initializing'", "incomplete JSON"]
    assert [f["elapsed_s"] for f in log.fields("rank table waiting")] == [1.0, 2.0, 3.0, 4.0]


def test_wait_times_out_naming_the_status_it_last_saw(tmp_path):
    path = tmp_path / "jobstart_hccl.json"
    path.write_text(INITIALIZING)
    fake = FakeTime()
    with pytest.raises(RankTableTimeout, match=r"not completed after 1\.5 s; last seen: status='initializing'$"):
        table_wait.wait(path, 1.5, Log(), clock=fake.clock, sleep=fake.sleep)


def test_wait_returns_at_once_when_already_completed(tmp_path):
    path, log, fake = tmp_path / "jobstart_hccl.json", Log(), FakeTime()
    path.write_text(COMPLETED)
    assert table_wait.wait(path, 0, log, clock=fake.clock, sleep=fake.sleep) == COMPLETED
    assert fake.sleeps == [] and log.records == []


def test_wait_never_sleeps_past_the_deadline(tmp_path):
    fake = FakeTime()
    with pytest.raises(RankTableTimeout):
        table_wait.wait(tmp_path / "absent.json", 1.25, Log(), poll=0.5, clock=fake.clock, sleep=fake.sleep)
    assert fake.sleeps == [0.5, 0.5, 0.25]


def test_wait_with_zero_timeout_fails_without_sleeping(tmp_path):
    fake = FakeTime()
    with pytest.raises(RankTableTimeout, match="last seen: missing"):
        table_wait.wait(tmp_path / "absent.json", 0, Log(), clock=fake.clock, sleep=fake.sleep)
    assert fake.sleeps == []


# --------------------------------------------------------------------------- this node


FOUR_ORDER = (2, 0, 3, 1)  # file order of the pods
PHYSICAL = {0: list(range(8)), 1: list(range(15, 7, -1)), 2: list(range(8)), 3: [3, 1, 7, 5, 0, 2, 6, 4]}


def four_servers():
    """Four pods of eight devices, listed out of order; pod 1 has physical ids 15..8, pod 3 a shuffle of 0..7."""
    instances = [{"devices": [{"device_id": str(d), "device_ip": f"192.9.{p}.{d}"} for d in PHYSICAL[p]],
                  "pod_name": f"job9-worker-{p}", "server_id": f"10.9.0.{p + 1}"} for p in FOUR_ORDER]
    document = {"group_count": "1", "group_list": [{"device_count": "32", "group_name": "job-worker",
                                                    "instance_count": "4", "instance_list": instances}],
                "status": "completed"}
    return table_convert.read_any(json.dumps(document), "four.json")


@pytest.mark.parametrize("index", range(4))
def test_each_task_index_gets_its_server_ranks_and_logical_ids(index):
    view = table_node.node_view(four_servers(), {"VC_TASK_INDEX": str(index)})
    assert (view.server_id, view.pod_name, view.matched_by) == (f"10.9.0.{index + 1}", f"job9-worker-{index}",
                                                               "VC_TASK_INDEX")
    assert [d.rank_id for d in view.devices] == list(range(8 * index, 8 * index + 8))
    assert [d.device_id for d in view.devices] == [str(p) for p in PHYSICAL[index]]
    assert sorted(d.logical_id for d in view.devices) == list(range(8))
    ascending = sorted(PHYSICAL[index])
    assert all(d.logical_id == ascending.index(int(d.device_id)) for d in view.devices)
    assert all(d.device_ip == f"192.9.{index}.{d.device_id}" for d in view.devices)
    assert view.rank_size == 32


def test_logical_ids_follow_physical_order_not_rank_order():
    devices = table_node.node_view(four_servers(), {"VC_TASK_INDEX": "1"}).devices
    assert [(d.rank_id, d.device_id, d.logical_id) for d in devices][:2] == [(8, "15", 7), (9, "14", 6)]


@pytest.mark.parametrize("name", ["MA_TASK_INDEX", "VK_TASK_INDEX"])
def test_task_index_fallbacks(name):
    view = table_node.node_view(four_servers(), {name: "2"})
    assert view.server_id == "10.9.0.3" and view.matched_by == "VC_TASK_INDEX"


def test_vc_task_index_comes_before_its_fallbacks():
    assert table_node.node_view(four_servers(), {"VC_TASK_INDEX": "3", "MA_TASK_INDEX": "0"}).server_id == "10.9.0.4"


@pytest.mark.parametrize(
    "environ, hostname",
    [
        ({"MA_CURRENT_INSTANCE_NAME": "job9-worker-3", "HOSTNAME": "job9-worker-0", "VC_TASK_INDEX": "0"}, ""),
        ({"HOSTNAME": "job9-worker-3", "VC_TASK_INDEX": "0"}, "job9-worker-1"),
        ({"VC_TASK_INDEX": "0"}, "job9-worker-3"),
    ],
)
def test_pod_name_match_comes_first(environ, hostname):
    view = table_node.node_view(four_servers(), environ, hostname)
    assert (view.server_id, view.matched_by) == ("10.9.0.4", "pod name")
    assert [d.rank_id for d in view.devices] == list(range(24, 32))


def test_current_ip_match_comes_before_task_index():
    view = table_node.node_view(four_servers(), {"MA_CURRENT_IP": "10.9.0.3", "VC_TASK_INDEX": "0",
                                                "HOSTNAME": "not-a-pod"})
    assert (view.server_id, view.matched_by) == ("10.9.0.3", "MA_CURRENT_IP")


def test_current_ip_shared_by_two_pods_falls_back_to_task_index():
    ranked = table_convert.read_any(golden("shared_server", 2), "shared")
    view = table_node.node_view(ranked, {"MA_CURRENT_IP": "10.5.0.1", "VC_TASK_INDEX": "2"})
    assert (view.pod_name, view.matched_by) == ("job5-worker-2", "VC_TASK_INDEX")
    assert [d.rank_id for d in view.devices] == [4, 5]


def test_template_one_matches_by_current_ip():
    ranked = table_convert.read_any(golden("two_servers_8", 1), "t1")
    view = table_node.node_view(ranked, {"MA_CURRENT_IP": "172.16.0.11"})
    assert view.matched_by == "MA_CURRENT_IP" and view.pod_name is None
    assert [d.rank_id for d in view.devices] == list(range(8, 16))


def test_more_gpus_wanted_than_the_node_has_is_an_error():
    with pytest.raises(RankTableError, match=r"MA_NUM_GPUS=16, but the rank table gives this node \(10\.9\.0\.1\) 8"):
        table_node.node_view(four_servers(), {"VC_TASK_INDEX": "0", "MA_NUM_GPUS": "16"})
    assert len(table_node.node_view(four_servers(), {"VC_TASK_INDEX": "0", "MA_NUM_GPUS": "8"}).devices) == 8


def test_a_node_not_in_the_table_is_an_error():
    environ = {"VC_TASK_INDEX": "9", "HOSTNAME": "elsewhere-0", "MA_CURRENT_IP": "10.99.0.1"}
    with pytest.raises(RankTableError) as raised:
        table_node.node_view(four_servers(), environ, "elsewhere")
    message = str(raised.value)
    assert "not in the rank table" in message and "elsewhere-0" in message and "10.99.0.1" in message
    assert "VC_TASK_INDEX=9" in message and "4 pod(s)" in message
    assert raised.value.exit_code == 78


def test_no_hints_at_all_is_an_error():
    with pytest.raises(RankTableError, match=r"VC_TASK_INDEX=\(unset\)"):
        table_node.node_view(four_servers(), {})


# --------------------------------------------------------------------------- the stage in `ma-runtime run`


def spec_for(tmp_path, source, wait="auto", timeout=5.0):
    """A real JobSpec, as `ma-runtime run` builds it from the environment."""
    environ = {"MA_MOUNT_PATH": str(tmp_path / "mount"), "MA_HOME": str(tmp_path / "home"),
               "MA_RUNTIME_RANKTABLE": wait, "MA_RUNTIME_RANKTABLE_TIMEOUT": str(timeout)}
    if source is not None:
        environ["RANK_TABLE_FILE"] = str(source)
    return job_spec.load({}, environ)


def test_prepare_writes_template_one_and_gives_the_workers_its_path(tmp_path):
    source = tmp_path / "config"
    source.mkdir()
    (source / "jobstart_hccl.json").write_text(golden("two_servers_8", 2))
    log = Log()
    prepared = ranktable.wait_and_convert(spec_for(tmp_path, source), {"VC_TASK_INDEX": "1"}, log)
    target = tmp_path / "mount" / ".ma-runtime" / "rank_table" / "jobstart_hccl.json"
    assert prepared.path == target and prepared.source == source / "jobstart_hccl.json"
    assert json.loads(target.read_text()) == json.loads(golden("two_servers_8", 1))
    assert prepared.env == {"RANK_TABLE_FILE": str(target), "RANK_SIZE": "16"}
    assert [p.name for p in source.iterdir()] == ["jobstart_hccl.json"]
    assert (source / "jobstart_hccl.json").read_text() == golden("two_servers_8", 2)
    assert [p.name for p in target.parent.iterdir()] == ["jobstart_hccl.json"]
    assert log.fields("rank table wait started") == [{"path": str(source / "jobstart_hccl.json"), "timeout_s": 5.0}]
    (ready,) = log.fields("rank table ready")
    assert ready["ranks"] == "8,9,10,11,12,13,14,15" and ready["server_id"] == "172.16.0.11"
    assert ready["rank_size"] == 16 and ready["servers"] == "2" and ready["matched_by"] == "VC_TASK_INDEX"


@pytest.mark.parametrize("wait, configured", [("off", True), ("auto", False)])
def test_prepare_does_nothing_when_off_or_unset(tmp_path, wait, configured):
    spec = spec_for(tmp_path, tmp_path / "absent" if configured else None, wait=wait)
    assert ranktable.wait_and_convert(spec, {"VC_TASK_INDEX": "0"}, Log()) is None
    assert not (tmp_path / "mount").exists()


def test_prepare_times_out_on_a_missing_table(tmp_path):
    with pytest.raises(RankTableTimeout, match="last seen: missing"):
        ranktable.wait_and_convert(spec_for(tmp_path, tmp_path / "config", timeout=0), {"VC_TASK_INDEX": "0"}, Log())


# --- pods sharing a host, pods without devices, a local run, the file's layout ----------------------


def test_two_pods_on_one_host_listing_the_same_device_are_refused():
    document = template_two()
    pod(document, 1)["server_id"] = "10.0.0.1"  # both pods on one host, both with devices 0 and 1
    with pytest.raises(RankTableError, match=r"pods job-worker-0 and job-worker-1 both list device 0 of server "
                                             r"10\.0\.0\.1"):
        table_convert.read_any(json.dumps(document), "rt.json")


def test_a_pod_without_devices_is_its_own_node_and_not_in_template_one():
    document = {
        "group_count": "2", "status": "completed",
        "group_list": [
            {"device_count": "0", "group_name": "ps", "instance_count": "1",
             "instance_list": [{"devices": [], "pod_name": "job-ps-0", "server_id": "10.0.0.1"}]},
            {"device_count": "1", "group_name": "worker", "instance_count": "1",
             "instance_list": [{"devices": [{"device_id": "3", "device_ip": "192.1.0.3"}],
                                "pod_name": "job-worker-0", "server_id": "10.0.0.2"}]},
        ],
    }
    ranked = table_convert.read_any(json.dumps(document), "rt.json")

    view = table_node.node_view(ranked, {"HOSTNAME": "job-ps-0", "MA_CURRENT_IP": "10.0.0.1", "VC_TASK_INDEX": "0"})

    assert (view.pod_name, view.devices, view.rank_size) == ("job-ps-0", (), 1)
    assert [server["server_id"] for server in ranked.template_one()["server_list"]] == ["10.0.0.2"]


def test_a_local_run_without_a_task_index_takes_the_only_pod():
    ranked = table_convert.read_any(json.dumps(template_two()), "rt.json")
    single = table_model.Ranked(ranked.instances[:1])
    assert table_node.node_view(single, {}).matched_by == "the only pod"
    with pytest.raises(RankTableError, match="not in the rank table"):
        table_node.node_view(ranked, {})  # two pods: no guessing


def test_the_written_layout_is_the_same_json_with_one_server_per_line():
    document = table_convert.read_any(json.dumps(template_two()), "rt.json").template_one()
    text = table_convert.layout(document)
    assert json.loads(text) == document
    assert [line.strip()[:12] for line in text.splitlines() if "server_id" in line] == ['{"device": [', '{"device": [']


# --------------------------------------------------------------------------- hostile tables
# What no writer can turn into a completed table fails at once (RankTableError, exit 78), through every entry:
# look (the wait loop), wait, prepare (`ma-runtime run`), peek (`ma-runtime plan`), read_any.

BOUND = 32 << 20  # the documented bound on a rank table's size: 32 MiB
DEEP = 100_000


def completed_with(extra):
    """The platform's completed example with one more top-level field, `extra` as raw JSON text."""
    return COMPLETED.rstrip()[:-1].rstrip() + f', "extra": {extra}\n}}\n'


def completed_with_group_count(raw):
    assert '"group_count": "1"' in COMPLETED
    return COMPLETED.replace('"group_count": "1"', f'"group_count": {raw}')


HOSTILE_JSON = [
    ("deep lists", completed_with("[" * DEEP + "]" * DEEP), r"nested too deeply"),
    ("deep objects", completed_with('{"a": ' * DEEP + "1" + "}" * DEEP), r"nested too deeply"),
    ("deep, unclosed", "[" * DEEP, r"nested too deeply"),
    ("5000-digit int", completed_with("1" * 5000), r"a number 5000 characters long \(1111111111111111\.\.\.\)"),
    ("4000-digit int", completed_with("7" * 4000), r"a number 4000 characters long"),
    ("33-digit int", completed_with("1" * 33), r"a number 33 characters long"),
    ("5000-digit negative", completed_with("-" + "9" * 5000), r"a number 5001 characters long \(-9999"),
    ("5000-digit count", completed_with_group_count("1" * 5000), r"a number 5000 characters long"),
    ("5000-digit fraction", completed_with("0." + "1" * 5000), r"a number 5002 characters long"),
    ("5000-digit exponent", completed_with("1e" + "0" * 5000 + "1"), r"a number 5003 characters long"),
    ("overflowing float", completed_with("1e400"), r"the number 1e400 is out of range"),
    ("NaN", completed_with("NaN"), r"NaN is not a number a rank table holds"),
    ("Infinity", completed_with("Infinity"), r"Infinity is not a number a rank table holds"),
    ("-Infinity", completed_with("-Infinity"), r"-Infinity is not a number a rank table holds"),
    ("NaN count", completed_with_group_count("NaN"), r"NaN is not a number"),
]


@pytest.mark.parametrize("text, message", [c[1:] for c in HOSTILE_JSON], ids=[c[0] for c in HOSTILE_JSON])
def test_read_any_refuses_json_no_rank_table_holds(text, message):
    with pytest.raises(RankTableError, match=r"^t\.json: " + message) as raised:
        table_convert.read_any(text, "t.json")
    assert raised.value.exit_code == ExitCode.BAD_CONFIGURATION
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 300


@pytest.mark.parametrize("text, message", [c[1:] for c in HOSTILE_JSON], ids=[c[0] for c in HOSTILE_JSON])
def test_wait_fails_at_once_on_json_no_rank_table_holds(tmp_path, text, message):
    path, fake = tmp_path / "jobstart_hccl.json", FakeTime()
    path.write_text(text)
    with pytest.raises(RankTableError, match=message):
        table_wait.wait(path, 60, Log(), clock=fake.clock, sleep=fake.sleep)
    assert fake.sleeps == []


def test_numbers_of_up_to_32_characters_and_unused_floats_are_read():
    for extra in ("1" * 32, "-" + "1" * 31, "1.5", "-2.5e-3", "1" * 20 + ".0"):
        ranked = table_convert.read_any(completed_with(extra), "t.json")
        assert ranked.template_one() == json.loads(golden("platform_example", 1))


def fifo(path):
    os.mkfifo(path)


def directory(path):
    path.mkdir()


def character_device(path):
    path.symlink_to("/dev/null")  # reads as empty: never a table (/dev/zero would be endless)


def oversized(path):
    with open(path, "wb") as handle:
        handle.truncate(BOUND + 1)  # sparse: the size alone must refuse it


def content(data):
    return lambda path: path.write_bytes(data)


HOSTILE_FILES = [
    ("FIFO", fifo, r" is a FIFO, not a rank table \(expected a JSON file\)"),
    ("character device", character_device, r" is a character device, not a rank table \(expected a JSON file\)"),
    ("directory", directory, r" is a directory, not a rank table \(expected a JSON file\)"),
    ("over 32 MiB", oversized, r" is 33554433 bytes, over the 32 MiB a rank table may have"),
    ("UTF-16", content(COMPLETED.encode("utf-16")), r": UTF-16 or UTF-32 .*; a rank table is UTF-8 JSON"),
    ("UTF-16 without BOM", content(COMPLETED.encode("utf-16-le")), r": UTF-16 or UTF-32 .*; a rank table is UTF-8"),
    ("UTF-16 BE", content(COMPLETED.encode("utf-16-be")), r": UTF-16 or UTF-32"),
    ("UTF-32", content(COMPLETED.encode("utf-32")), r": UTF-16 or UTF-32"),
    ("UTF-16 BOM only", content(b"\xff\xfe"), r": UTF-16 or UTF-32"),
    ("NUL byte", content(COMPLETED.encode()[:40] + b"\0" + COMPLETED.encode()[40:]), r": UTF-16 or UTF-32"),
    ("Latin-1", content(COMPLETED.replace("job-trainjob", "job-tr\u00e4injob").encode("latin-1")),
     r": not UTF-8 \(byte \d+\); a rank table is UTF-8 JSON"),
    ("cut character mid-file", content("\u00e4".encode()[:1] + b" " + COMPLETED.encode()),
     r": not UTF-8 \(byte 0\)"),
]
HOSTILE_IDS = [c[0] for c in HOSTILE_FILES]


class FifoReleaser:
    """Guards a test against a reader blocked in open() on a FIFO: after 5 s, it opens the write end again and
    again, so each blocked open returns (to read nothing) and the test fails on its assertions, not by hanging."""

    def __init__(self, path):
        self.path = path
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._release, daemon=True)

    def _release(self):
        if self.stop.wait(5):
            return
        while not self.stop.wait(0.02):
            try:
                os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass  # no reader waiting (ENXIO), or the FIFO is gone

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def hostile_at(tmp_path, make):
    """The hostile thing at config/jobstart_hccl.json: RANK_TABLE_FILE=config finds it there."""
    config = tmp_path / "config"
    config.mkdir()
    make(config / "jobstart_hccl.json")
    return config / "jobstart_hccl.json"


@pytest.mark.parametrize("make, message", [c[1:] for c in HOSTILE_FILES], ids=HOSTILE_IDS)
def test_look_refuses_what_never_becomes_a_table(tmp_path, make, message):
    path = hostile_at(tmp_path, make)
    with FifoReleaser(path), pytest.raises(RankTableError, match="^" + re.escape(str(path)) + message) as raised:
        table_wait.look(path)
    assert raised.value.exit_code == ExitCode.BAD_CONFIGURATION and "\n" not in str(raised.value)


@pytest.mark.parametrize("make, message", [c[1:] for c in HOSTILE_FILES], ids=HOSTILE_IDS)
def test_wait_fails_at_once_on_what_never_becomes_a_table(tmp_path, make, message):
    path, fake = hostile_at(tmp_path, make), FakeTime()
    with FifoReleaser(path), pytest.raises(RankTableError, match=message):
        table_wait.wait(path, 60, Log(), clock=fake.clock, sleep=fake.sleep)
    assert fake.sleeps == []


@pytest.mark.parametrize("make, message", [c[1:] for c in HOSTILE_FILES], ids=HOSTILE_IDS)
def test_prepare_fails_at_once_and_writes_nothing(tmp_path, make, message):
    path = hostile_at(tmp_path, make)
    with FifoReleaser(path), pytest.raises(RankTableError, match=message):
        ranktable.wait_and_convert(spec_for(tmp_path, path.parent, timeout=2), {"VC_TASK_INDEX": "0"}, Log())
    assert not (tmp_path / "mount").exists()


@pytest.mark.parametrize("make, message", [c[1:] for c in HOSTILE_FILES], ids=HOSTILE_IDS)
def test_peek_refuses_what_never_becomes_a_table(tmp_path, make, message):
    path = hostile_at(tmp_path, make)
    with FifoReleaser(path), pytest.raises(RankTableError, match=message):
        ranktable.peek(spec_for(tmp_path, path.parent), {"VC_TASK_INDEX": "0"})


def test_read_table_refuses_the_same_files(tmp_path):
    for name, make, message in HOSTILE_FILES:
        path = tmp_path / name.replace(" ", "-")
        path.mkdir()
        with pytest.raises(RankTableError, match=message):
            table_wait.read_table(hostile_at(path, make))


def test_a_table_of_exactly_32_mib_is_read(tmp_path):
    path = tmp_path / "jobstart_hccl.json"
    path.write_bytes(COMPLETED.encode().ljust(BOUND))
    assert table_wait.look(path).state == "completed"
    assert table_wait.read_table(path).rstrip() == COMPLETED.rstrip()


def test_a_utf8_byte_order_mark_is_tolerated(tmp_path):
    path = tmp_path / "jobstart_hccl.json"
    path.write_bytes(codecs.BOM_UTF8 + COMPLETED.encode())
    assert table_wait.wait(path, 0, Log()) == COMPLETED
    assert table_wait.read_table(path) == COMPLETED


def test_a_character_cut_at_the_end_is_not_yet(tmp_path):
    """The writer is half-way through a multi-byte character: a half-written file, not a broken one."""
    path, log = tmp_path / "jobstart_hccl.json", Log()
    whole = COMPLETED.replace("job-trainjob", "job-tr\u00e4injob").encode()
    cut = whole[: whole.index("\u00e4".encode()) + 1]
    fake = FakeTime([(0.5, lambda: path.write_bytes(cut)), (1.5, lambda: path.write_bytes(whole))])
    path.write_bytes(cut)
    assert table_wait.look(path).state == "incomplete JSON"
    assert table_wait.wait(path, 60, log, progress=1.0, clock=fake.clock, sleep=fake.sleep) == whole.decode()
    assert [f["seen"] for f in log.fields("rank table waiting")] == ["incomplete JSON"]


def test_read_table_of_a_character_cut_at_the_end_says_so(tmp_path):
    path = tmp_path / "jobstart_hccl.json"
    path.write_bytes(COMPLETED.encode() + "\u00e4".encode()[:1])
    with pytest.raises(RankTableError, match=r"ends inside a UTF-8 character \(byte \d+\): half-written"):
        table_wait.read_table(path)


def test_read_table_of_a_missing_file_says_cannot_read(tmp_path):
    path = tmp_path / "absent.json"
    with pytest.raises(RankTableError, match=f"^cannot read the rank table {re.escape(str(path))}: No such file"):
        table_wait.read_table(path)


# --------------------------------------------------------------------------- writing over what is not a file


def character_device_node(path):
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 7))  # /dev/full's numbers, in a scratch folder
    except PermissionError:
        pytest.skip("mknod needs root (CAP_MKNOD)")


def fifo_behind_a_link(path):
    os.mkfifo(path.with_name("fifo"))
    path.symlink_to("fifo")


IN_THE_WAY = [
    ("FIFO", fifo, stat.S_ISFIFO, "a FIFO"),
    ("character device", character_device_node, stat.S_ISCHR, "a character device"),
    ("directory", directory, stat.S_ISDIR, "a directory"),
    ("link to a FIFO", fifo_behind_a_link, stat.S_ISFIFO, "a FIFO"),
]


@pytest.mark.parametrize("make, kind, name", [c[1:] for c in IN_THE_WAY], ids=[c[0] for c in IN_THE_WAY])
def test_write_atomically_never_replaces_what_is_not_a_file(tmp_path, make, kind, name):
    target = tmp_path / "out.json"
    make(target)
    before = sorted(p.name for p in tmp_path.iterdir())
    document = table_convert.read_any(COMPLETED, "t2").template_one()
    with pytest.raises(RankTableError) as raised:
        table_convert.write_atomically(target, document)
    assert str(raised.value) == f"cannot write {target}: {name} is in the way (only a regular file is ever replaced)"
    assert raised.value.exit_code == ExitCode.BAD_CONFIGURATION
    assert kind(os.stat(target).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_prepare_never_replaces_a_fifo_at_the_converted_path(tmp_path):
    source = tmp_path / "config"
    source.mkdir()
    (source / "jobstart_hccl.json").write_text(golden("two_servers_8", 2))
    spec = spec_for(tmp_path, source)
    target = ranktable.converted_path(spec)
    target.parent.mkdir(parents=True)
    os.mkfifo(target)
    with pytest.raises(RankTableError, match=r"cannot write .*: a FIFO is in the way"):
        ranktable.wait_and_convert(spec, {"VC_TASK_INDEX": "0"}, Log())
    assert stat.S_ISFIFO(os.lstat(target).st_mode)
    assert [p.name for p in target.parent.iterdir()] == ["jobstart_hccl.json"]


def test_write_atomically_replaces_a_regular_file_through_its_link(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    (tmp_path / "link.json").symlink_to("real.json")
    document = table_convert.read_any(COMPLETED, "t2").template_one()
    table_convert.write_atomically(tmp_path / "link.json", document)
    assert (tmp_path / "link.json").is_symlink() and json.loads(real.read_text()) == document


@pytest.mark.parametrize("how", ["flag", "file"])
def test_prepare_finds_this_node_by_the_task_index_from_a_flag_or_the_job_file(tmp_path, how):
    # The node view read VC_TASK_INDEX from the environment only: `--task-index 1` was ignored.
    source = tmp_path / "config"
    source.mkdir()
    (source / "jobstart_hccl.json").write_text(golden("two_servers_8", 2))
    environ = {"MA_MOUNT_PATH": str(tmp_path / "mount"), "MA_HOME": str(tmp_path / "home"),
               "RANK_TABLE_FILE": str(source)}
    job = tmp_path / "job.yaml"
    job.write_text("task_index: 1\n")
    spec = job_spec.load({"task_index": "1"}, environ) if how == "flag" else job_spec.load({}, environ, str(job))
    prepared = ranktable.wait_and_convert(spec, environ, Log())
    assert prepared.node.server_id == "172.16.0.11" and prepared.node.matched_by == "VC_TASK_INDEX"


def test_the_spec_and_the_node_view_read_the_task_index_by_one_rule(tmp_path):
    # MA_TASK_INDEX alone: the node view found pod 1 while spec (and so the launch's node rank) said 0.
    source = tmp_path / "config"
    source.mkdir()
    (source / "jobstart_hccl.json").write_text(golden("two_servers_8", 2))
    environ = {"MA_HOME": str(tmp_path / "home"), "RANK_TABLE_FILE": str(source), "MA_TASK_INDEX": "1"}
    spec = job_spec.load({}, environ)
    prepared = ranktable.wait_and_convert(spec, environ, Log())
    assert spec.task_index == 1 and prepared.node.server_id == "172.16.0.11"


@pytest.mark.parametrize("enabled", [True, False])
def test_the_conversion_leaves_the_garbage_collector_as_it_found_it(enabled):
    # It pauses the cyclic collector while it makes a big table's objects, and restores it, on errors too.
    import gc

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        table_convert.template_one_text(from_text(golden("two_servers_8", 2)))
        assert gc.isenabled() is enabled
        with pytest.raises(RankTableError):
            table_convert.read_any("{", "bad.json")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
