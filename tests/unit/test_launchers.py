"""One module per launcher: the registry, each launcher's interface, and how each one forwards a stop.

torchrun's forwarding is checked twice: against a hand-built process table
(every case the rule names), and against the real torchrun, whose ranks count
the signals they receive.
"""

import dataclasses
import importlib
import os
import pkgutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ma_runtime.launch import plan as plan_module
from ma_runtime.launch import registry
from ma_runtime.launch.base import Context, Launcher, Machinery, Plan, RootCause, WorkerPlan
from ma_runtime.process.table import Proc, processes
from tests.conftest import MA_RUNTIME, alive, wait_for_file
from tests.e2e.test_launchers import TORCH_BIN, needs_torch

LAUNCH_FOLDER = Path(plan_module.__file__).parent
TORCHRUN_SUMMARY = [
    "Root Cause (first observed failure):",
    "[0]:",
    "  time      : 2026-11-22_05:00:49",
    "  rank      : 1 (local_rank: 1)",
    "  exitcode  : 3 (pid: 19876)",
]


# --------------------------------------------------------------------------- the registry


def launcher_modules():
    """The modules of launch/ that hold a launcher (a subclass of base.Launcher), whether registered or not."""
    names = set()
    for info in pkgutil.iter_modules([str(LAUNCH_FOLDER)]):
        module = importlib.import_module(f"ma_runtime.launch.{info.name}")
        if any(isinstance(value, type) and issubclass(value, Launcher) and value is not Launcher
               for value in vars(module).values()):
            names.add(info.name.replace("_", "-"))  # pytorch_gpu.py is the pytorch-gpu launcher
    return names


def test_the_registry_lists_every_launcher_module_and_nothing_else():
    assert launcher_modules() == set(registry.METHODS)
    assert plan_module.METHODS == registry.METHODS
    assert [launcher.NAME for launcher in registry.launchers()] == list(registry.METHODS)


@pytest.mark.parametrize("name", registry.METHODS)
def test_each_launcher_implements_the_interface(name):
    launcher = registry.launcher(name)
    assert isinstance(launcher, Launcher) and name == launcher.NAME
    assert type(launcher).__module__ == f"ma_runtime.launch.{name.replace('-', '_')}"
    assert isinstance(launcher.TAKES_NPROC_PER_NODE, bool)
    assert isinstance(launcher.OWN_CODE_AFTER_STOP, bool)
    assert isinstance(launcher.MACHINERY, Machinery) and launcher.MACHINERY.daemons <= launcher.MACHINERY.processes
    assert launcher.RANK_VARIABLES and all(isinstance(variable, str) for variable in launcher.RANK_VARIABLES)
    assert launcher.WORKERS.pattern.endswith("\\Z")  # a whole name, not a prefix


class Bare(Launcher):
    NAME = "bare"

    def build(self, spec, context, why):
        return Plan(self.NAME, why, (WorkerPlan("command", tuple(context.argv), {}),), 1, 1)


def test_a_launcher_that_declares_only_its_name_and_plan_gets_every_default(tmp_path):
    """The defaults are the plain launch's: one process, its own code, nothing forwarded, no services."""
    bare = Bare()
    assert (bare.TAKES_NPROC_PER_NODE, bare.OWN_CODE_AFTER_STOP) == (False, True)
    assert bare.forwards_to(TORCHRUN_PID, TABLE) == set() and bare.root_cause(TORCHRUN_SUMMARY) is None
    assert bare.rank_logs(bare.build(None, Context(["python"], {}), "test")) is None
    assert bare.start_services(None, {}, None, None, []) is None
    assert not any(dataclasses.astuple(bare.MACHINERY)) and bare.WORKERS.match("command")


def test_a_launcher_without_a_plan_cannot_be_made():
    class NoPlan(Launcher):
        NAME = "no-plan"

    with pytest.raises(TypeError, match="build"):
        NoPlan()


def test_an_unknown_launcher_is_refused_by_name():
    with pytest.raises(ValueError, match=f"bogus.*{', '.join(registry.METHODS)}"):
        registry.launcher("bogus")
    with pytest.raises(ValueError):
        registry.launcher("base")  # a module of launch/, not a launcher


def test_collecting_the_launchers_settings_at_start_up_imports_nothing_heavy():
    # spec imports every launcher module for its settings (issue 25: declared in the launcher's module); a
    # launcher module must stay cheap to import: no YAML, no process table, no SDK, no framework, no sshd.
    heavy = ("yaml", "psutil", "requests", "obs", "torch", "mindspore", "ma_runtime.launch.sshd",
             "ma_runtime.launch.sshd_files", "ma_runtime.launch.sshd_key", "ma_runtime.storage.obs")
    script = ("import sys, ma_runtime.spec; "
              "print(*sorted(m for m in sys.modules if m.startswith('ma_runtime.launch.') or m.split('.')[0] in "
              f"{heavy!r} or m in {heavy!r}))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    loaded = result.stdout.split()
    assert not [name for name in loaded if name in heavy or name.split(".")[0] in heavy], loaded
    assert {f"ma_runtime.launch.{method.replace('-', '_')}" for method in registry.METHODS} <= set(loaded)


def test_a_bogus_method_is_one_line_naming_the_valid_ones(job_env):
    job_env["MA_RUN_METHOD"] = "bogus"
    result = subprocess.run([MA_RUNTIME, "plan", "--", "python", "train.py"], env=job_env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 78 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert f"MA_RUN_METHOD='bogus' must be one of {', '.join(registry.METHODS)}" in line
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------- root cause, rank logs


def test_only_torchrun_finds_a_root_cause_in_its_output():
    assert registry.launcher("torchrun").root_cause(TORCHRUN_SUMMARY) == RootCause(1, 3)
    for name in set(registry.METHODS) - {"torchrun"}:
        assert registry.launcher(name).root_cause(TORCHRUN_SUMMARY) is None, name


def test_only_msrun_has_a_rank_log_folder(tmp_path):
    folder = str(tmp_path / "msrun" / "attempt-2")
    msrun_plan = Plan("msrun", "test", (WorkerPlan("msrun", ("msrun",), {}, logs={"msrun": folder}),), 1, 2)
    assert registry.launcher("msrun").rank_logs(msrun_plan) == folder
    for name in set(registry.METHODS) - {"msrun"}:
        other = Plan(name, "test", (WorkerPlan(name, ("x",), {}, logs={"task": "t.log"}),), 1, 1)
        assert registry.launcher(name).rank_logs(other) is None, name


def test_the_attempt_defaults_to_the_first():
    assert Context(["python"], {}).attempt == 1


# --------------------------------------------------------------------------- forwarding a stop

TORCHRUN_PID = 200
TABLE = {
    100: Proc("S", 1, 100, 0),  # ma-run
    TORCHRUN_PID: Proc("S", 100, TORCHRUN_PID, 1),
    201: Proc("S", TORCHRUN_PID, 201, 2),  # rank 0, leading its own group
    202: Proc("R", TORCHRUN_PID, 202, 2),  # rank 1
    210: Proc("S", TORCHRUN_PID, TORCHRUN_PID, 2),  # a helper of torchrun's own, in torchrun's group
    301: Proc("S", 201, 201, 3),  # a child of rank 0, in its group: killpg reaches it
    302: Proc("S", 202, 202, 3),
    311: Proc("S", 301, 201, 4),  # a grandchild, still in rank 0's group
    320: Proc("S", 201, 320, 3),  # a grandchild that left the group by setsid
    321: Proc("S", 320, 320, 4),  # and its own child
    330: Proc("S", 1, 203, 3),  # left in the group of a rank that exited: torchrun skips that rank
}


def test_torchrun_forwards_to_every_process_in_its_childrens_groups():
    assert registry.launcher("torchrun").forwards_to(TORCHRUN_PID, TABLE) == {201, 202, 301, 302, 311}


def test_mpirun_forwards_by_torchrun_s_rule():
    """Each local rank a child of mpirun leading its own group (launch/mpirun.py's docstring)."""
    for table in (TABLE, {**TABLE, TORCHRUN_PID: TABLE[TORCHRUN_PID]._replace(state="T")}):
        assert registry.launcher("mpirun").forwards_to(TORCHRUN_PID, table) == \
            registry.launcher("torchrun").forwards_to(TORCHRUN_PID, table)


def test_torchrun_absent_from_the_table_forwards_nothing():
    table = {pid: proc for pid, proc in TABLE.items() if pid != TORCHRUN_PID}
    assert registry.launcher("torchrun").forwards_to(TORCHRUN_PID, table) == set()


@pytest.mark.parametrize("state", ["T", "t"])
def test_a_stopped_torchrun_forwards_nothing(state):
    table = {**TABLE, TORCHRUN_PID: TABLE[TORCHRUN_PID]._replace(state=state)}
    assert registry.launcher("torchrun").forwards_to(TORCHRUN_PID, table) == set()


@pytest.mark.parametrize("name", sorted(set(registry.METHODS) - {"torchrun", "mpirun"}))
def test_the_other_launchers_forward_nothing(name):
    assert registry.launcher(name).forwards_to(TORCHRUN_PID, TABLE) == set()


# The real torchrun: each rank starts a child in its group and a setsid escapee, and
# every one of them records the stop signals it gets; the escapee blocks them, so
# that one sent to it stays pending where the test can see it.
RANK_SCRIPT = textwrap.dedent("""
    import os, signal, subprocess, sys, time

    out, role = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "rank"

    def record(signum, frame):
        with open(os.path.join(out, f"signal-{os.getpid()}"), "w") as f:
            f.write(signal.Signals(signum).name)
        os._exit(0)

    signal.signal(signal.SIGTERM, record)
    signal.signal(signal.SIGINT, record)
    if role == "escapee":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    if role == "rank":
        subprocess.Popen([sys.executable, __file__, out, "group-child"])
        subprocess.Popen([sys.executable, __file__, out, "escapee"], start_new_session=True)
    with open(os.path.join(out, f"tmp-{os.getpid()}"), "w") as f:
        f.write(role)
    os.rename(os.path.join(out, f"tmp-{os.getpid()}"), os.path.join(out, f"ready-{os.getpid()}"))
    time.sleep(120)
""")


def started(out: Path, count: int, timeout: float = 120.0):
    """{pid: role} once `count` processes have said they are ready."""
    deadline = time.monotonic() + timeout
    while len(list(out.glob("ready-*"))) < count:
        assert time.monotonic() < deadline, f"{count} processes did not start within {timeout} s"
        time.sleep(0.05)
    return {int(path.name.split("-")[1]): path.read_text() for path in out.glob("ready-*")}


def pending_signals(pid: int) -> int:
    """The signals sent to `pid` that it has not taken yet (blocked ones stay here), as a bit mask."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)


@needs_torch
def test_the_real_torchrun_signals_exactly_the_processes_forwards_to_names(tmp_path):
    torchrun = TORCH_BIN / "torchrun"  # beside the test interpreter (torch has no wheel for Python 3.9)
    script, out = tmp_path / "rank.py", tmp_path / "out"
    script.write_text(RANK_SCRIPT)
    out.mkdir()
    argv = [str(torchrun), "--standalone", "--nnodes=1", "--nproc_per_node=2", "--no-python", sys.executable,
            str(script), str(out)]
    with open(tmp_path / "torchrun.log", "wb") as log:
        launcher = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    roles = {}
    try:
        roles = started(out, 6)
        forwarded = registry.launcher("torchrun").forwards_to(launcher.pid, processes())
        assert forwarded == {pid for pid, role in roles.items() if role != "escapee"}
        os.kill(launcher.pid, signal.SIGTERM)
        launcher.wait(timeout=90)
        for pid in forwarded:
            assert wait_for_file(out / f"signal-{pid}", timeout=30).read_text() == "SIGTERM"
        for pid in (pid for pid, role in roles.items() if role == "escapee"):
            assert alive(pid) and pending_signals(pid) == 0, "torchrun signalled a process outside its ranks' groups"
    finally:
        stop_all(launcher, roles)


def stop_all(launcher: subprocess.Popen, roles) -> None:
    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    for pid in roles:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
