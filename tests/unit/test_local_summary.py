"""`ma-runtime local`'s closing summary: the Volcano line, from real termination-message files under --out."""

import json

import pytest

from ma_runtime.local.summary import Summary
from ma_runtime.manifest import POLICIES


def summary(tmp_path, codes, origin=None) -> Summary:
    for index in range(len(codes)):
        (tmp_path / f"node{index}").mkdir()
        message = {"category": "user", "reason": "r", "origin": origin} if origin else {}
        (tmp_path / f"node{index}" / "termination-log").write_text(json.dumps(message) if message else "")
    return Summary(tmp_path, codes, {}, {}, [], [], [])


def why(code: int) -> str:
    return next(policy.why for policy in POLICIES if policy.exit_code == code)


@pytest.mark.parametrize("codes, origin, line", [
    ([0, 0], None, "no policy fires (every pod exited 0: the job completes)"),
    ([86, 83], {"task_index": 1, "kind": "hung", "exit_code": 83, "attempt": 1},
     f"RestartJob for node1's exit 83 ({why(83)}); no policy for node0's exit 86"),
    ([82, 86], {"task_index": 0, "kind": "failed", "exit_code": 1, "attempt": 2},
     f"AbortJob for node0's exit 82 ({why(82)}); no policy for node1's exit 86"),
    ([86, 137], {"task_index": 1, "kind": "failed", "exit_code": 137, "attempt": 1},
     "no policy for node0's exit 86, node1's exit 137: the job fails"),
    ([143, 143], None, "no policy for node0's exit 143, node1's exit 143: the job fails"),
    ([86, 86], {"task_index": 1, "kind": "lost", "exit_code": None, "attempt": 1},
     "RestartJob if node1's pod is evicted from its lost node (PodEvicted); no policy for node0's exit 86, "
     "node1's exit 86"),
    ([79], None, f"RestartJob for node0's exit 79 ({why(79)})"),
])
def test_the_volcano_line_names_the_policy_that_would_fire_for_each_node(tmp_path, codes, origin, line):
    report = summary(tmp_path, codes, origin)
    assert report.volcano() == line
    assert f"\n  volcano: {line}\n" in report.text()


def test_a_lost_node_s_verdict_has_no_exit_code(tmp_path):
    report = summary(tmp_path, [86, 86], {"task_index": 1, "kind": "lost", "exit_code": None, "attempt": 1})
    assert report.verdict() == "node1 failed first (lost, attempt 1)"
