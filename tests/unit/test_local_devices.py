"""`ma-runtime local --accelerator npu --ranktable one|two`: the box's rank table in either template."""

import json

import pytest

from ma_runtime.local import devices, runner
from ma_runtime.local.nodes import Nodes
from ma_runtime.stages.ranktable.convert import read_any


@pytest.mark.parametrize("template, key", [("two", "group_list"), ("one", "server_list")])
def test_either_template_gives_the_runtime_the_same_ranks(template, key):
    """What the runtime reads from the box's table: every node's address, its devices, ranks in node order."""
    table = devices.ranktable(Nodes(2, prefix="ma-unit"), 3, template)
    assert key in table and table["status"] == "completed"
    ranked = read_any(json.dumps(table), f"template {template}")
    servers = ranked.template_one()["server_list"]
    assert [server["server_id"] for server in servers] == ["10.200.0.1", "10.200.0.2"]
    assert [[(device["device_id"], device["rank_id"]) for device in server["device"]] for server in servers] == \
        [[("0", "0"), ("1", "1"), ("2", "2")], [("0", "3"), ("1", "4"), ("2", "5")]]


def test_the_template_is_two_unless_asked_and_only_for_an_npu_job():
    assert runner.Options(["--accelerator", "npu", "--", "true"]).ranktable == "two"
    assert runner.Options(["--accelerator", "npu", "--ranktable", "one", "--", "true"]).ranktable == "one"
    with pytest.raises(runner.UsageError, match=r"^--ranktable one: only an NPU job has a rank table \(add "
                                                 r"--accelerator npu\)$"):
        runner.Options(["--ranktable", "one", "--", "true"])
