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


def test_the_stack_dumps_under_each_node_s_log_are_listed_by_node_and_attempt(tmp_path):
    report = summary(tmp_path, [86, 83])
    for node, attempt, names in ((1, 10, ["pid-7-python.txt"]), (1, 2, ["pid-5-python.txt", "summary.txt"]),
                                 (0, 2, []), (0, 1, ["pid-3-python.txt"])):
        folder = tmp_path / f"node{node}" / "log" / f"modelarts-job-local-worker-{node}-stacks" / f"attempt-{attempt}"
        folder.mkdir(parents=True)
        for name in names:
            (folder / name).write_text("Thread 0x1 (most recent call first):\n")
    stacks = tmp_path / "node{}" / "log" / "modelarts-job-local-worker-{}-stacks" / "attempt-{}"
    assert report.stacks() == [f"node0 attempt 1: 1 file(s) in {str(stacks).format(0, 0, 1)}",
                               f"node1 attempt 2: 2 file(s) in {str(stacks).format(1, 1, 2)}",
                               f"node1 attempt 10: 1 file(s) in {str(stacks).format(1, 1, 10)}"]
    assert f"\n  stacks: node1 attempt 10: 1 file(s) in {str(stacks).format(1, 1, 10)}\n" in report.text()


def test_no_stacks_line_when_no_dump_was_taken(tmp_path):
    assert "stacks:" not in summary(tmp_path, [0, 0]).text()
