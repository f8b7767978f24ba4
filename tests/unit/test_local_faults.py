"""`ma-runtime local --inject FAULT`: the parser, every kind and every way a value can be wrong."""

import pytest

from ma_runtime.local.faults import BadFault, Fault, parse


@pytest.mark.parametrize("text, fault", [
    ("kill@1:rank=3:after=20s", Fault("kill", 1, 20.0, rank=3)),
    ("hang@1:rank=0:after=30s", Fault("hang", 1, 30.0)),
    ("exit@0:code=3:after=10s", Fault("exit", 0, 10.0, code=3)),
    ("exit@1", Fault("exit", 1, 0.0, code=1)),
    ("netdrop@2:after=15s", Fault("netdrop", 2, 15.0)),
    ("preempt:after=60s", Fault("preempt", None, 60.0)),
    ("preempt", Fault("preempt", None, 0.0)),
    ("kill@0:after=1.5m", Fault("kill", 0, 90.0)),
    ("hang@0:after=2", Fault("hang", 0, 2.0)),
    ("kill@0:after=1h:rank=2", Fault("kill", 0, 3600.0, rank=2)),
])
def test_each_kind_reads_as_documented(text, fault):
    assert parse(text, nodes=3) == fault


@pytest.mark.parametrize("text, said", [
    ("crash@1", "unknown fault 'crash'"),
    ("kill", "kill needs @NODE, a node index from 0 to 2"),
    ("kill@3", "from 0 to 2 (--nodes 3)"),
    ("kill@-1", "needs @NODE"),
    ("kill@x", "needs @NODE"),
    ("preempt@0", "preempt stops every node"),
    ("kill@1:code=3", "'code=3' is not a setting of kill (it takes rank=, after=)"),
    ("netdrop@1:rank=0", "not a setting of netdrop (it takes after=)"),
    ("kill@1:rank", "'rank' is not a setting of kill"),
    ("kill@1:after=soon", "after='soon' is not a duration"),
    ("kill@1:after=-1s", "is not a duration"),
    ("exit@1:code=0", "code='0' must be a whole number from 1 to 255"),
    ("exit@1:code=256", "from 1 to 255"),
    ("kill@1:rank=1.5", "rank='1.5' must be a whole number"),
])
def test_a_bad_fault_says_what_is_wrong(text, said):
    with pytest.raises(BadFault) as raised:
        parse(text, nodes=3)
    message = str(raised.value)
    assert said in message and "\n" not in message
    assert message.startswith(f"--inject {text!r}")
