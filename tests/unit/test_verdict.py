"""The exit code, failing rank and reason of a finished command agree (issue 10, item 19)."""

import types

import pytest

from ma_runtime import bootstrap
from ma_runtime.launch import plan as plan_module
from ma_runtime.output import LinePump
from ma_runtime.supervise.supervisor import Outcome

SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_05:00:49
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 19876)
"""


class Recorder:
    def __init__(self):
        self.messages = []

    def write_termination(self, **fields):
        self.messages.append(fields)


def torchrun_worker(summary: str):
    pump = LinePump(-1, [], "torchrun-stderr")
    pump._keep_tail(summary.encode())
    return types.SimpleNamespace(pid=123, pumps=[LinePump(-1, [], "torchrun-stdout"), pump], stderr_pump=pump)


def torchrun_plan():
    worker = plan_module.WorkerPlan("torchrun", ("torchrun", "t.py"), {})
    return plan_module.Plan(plan_module.TORCHRUN, "test", (worker,), 1, 2)


@pytest.mark.parametrize(
    "code, exit_code, reason, signal",
    [
        ("3", 3, "rank 1 failed first: the command exited with code 3", None),
        ("-9", 137, "rank 1 failed first: the command was killed by SIGKILL", "SIGKILL"),
        ("-11", 139, "rank 1 failed first: the command died of SIGSEGV", "SIGSEGV"),
    ],
)
def test_torchruns_failing_rank_gives_the_code_the_reason_and_the_signal(code, exit_code, reason, signal):
    worker = torchrun_worker(SUMMARY.format(code=code))
    context = Recorder()
    outcome = Outcome(returncode=1, exit_code=1, worker=worker)  # torchrun's own 1, whatever the ranks did
    assert bootstrap._finish(outcome, worker, context, torchrun_plan()) == exit_code
    (message,) = context.messages
    assert (message["exit_code"], message["rank"], message["reason"], message["signal"]) == (
        exit_code, 1, reason, signal)


def test_without_a_summary_torchruns_own_code_stands():
    worker = torchrun_worker("RuntimeError: something else\n")
    context = Recorder()
    outcome = Outcome(returncode=1, exit_code=1, worker=worker)
    assert bootstrap._finish(outcome, worker, context, torchrun_plan()) == 1
    (message,) = context.messages
    assert message["reason"] == "the command exited with code 1" and message["rank"] is None
