"""Which processes are the job's ranks and which are launcher machinery (supervise/ranks.py), on process tables
shaped as each launcher's really are (read off real torchrun, msrun, mpirun and ma-run trees); the real trees under
the real runtime are tests/e2e/test_hang_ranks.py."""

import os
import subprocess
import sys
import time

import pytest

from ma_runtime.process import table as proc_table
from ma_runtime.process.table import Proc
from ma_runtime.supervise.ranks import Finder, program, rank_of

PY = "/venv/bin/python"


class Table:
    """A process table with each process's command line and environment."""

    def __init__(self):
        self.procs, self.argv, self.env = {}, {}, {}

    def add(self, pid, ppid, comm, argv=(), start=1, **env):
        self.procs[pid] = Proc("S", ppid, pid, start, comm)
        self.argv[pid], self.env[pid] = list(argv), dict(env)
        return pid

    def finder(self):
        reads = []
        finder = Finder(read_cmdline=lambda pid: reads.append(pid) or self.argv.get(pid, []),
                        read_environ=lambda pid: self.env.get(pid, {}))
        return finder, reads

    def find(self, workers, services=(), finder=None):
        finder = finder or self.finder()[0]
        return {pid: (unit.root, unit.label) for pid, unit in finder.find(workers, services, self.procs).items()}


def test_torchrun_s_agent_is_machinery_its_ranks_and_their_loaders_the_job():
    t = Table()
    t.add(100, 1, "pt_elastic", [PY, "/venv/bin/torchrun", "--nproc_per_node=2", "train.py"], RANK="0")
    t.add(201, 100, "python", [PY, "-u", "train.py"], RANK="0", LOCAL_RANK="0", TORCHELASTIC_RUN_ID="x")
    t.add(202, 100, "python", [PY, "-u", "train.py"], RANK="1", LOCAL_RANK="1", TORCHELASTIC_RUN_ID="x")
    t.add(301, 202, "pt_data_worker", [PY, "-u", "train.py"], RANK="1")  # rank 1's data loader

    assert t.find({"torchrun": 100}) == {201: (201, "rank 0"), 202: (202, "rank 1"), 301: (202, "rank 1")}


def test_torchrun_started_by_a_plain_shell_script_leaves_out_the_shell_and_the_agent():
    """`ma-run bash run.sh`, run.sh calling torchrun: neither the waiting shell nor the agent is a rank."""
    t = Table()
    t.add(100, 1, "bash", ["bash", "run.sh"])
    t.add(110, 100, "torchrun", [PY, "/venv/bin/torchrun", "train.py"])  # before torch names its thread
    t.add(201, 110, "python", [PY, "train.py"], RANK="0")
    t.add(202, 110, "python", [PY, "train.py"], RANK="1")
    t.add(120, 100, "sleep", ["sleep", "1"])  # something else the shell runs is the job

    assert t.find({"command": 100}) == {201: (201, "rank 0"), 202: (202, "rank 1"), 120: (120, "pid 120 (sleep)")}


def test_msrun_s_scheduler_is_machinery_though_it_runs_the_user_s_script():
    t = Table()
    t.add(100, 1, "msrun", [PY, "/ms/bin/msrun", "--worker_num=2", "train.py"], RANK="5")
    t.add(201, 100, "python", ["python", "train.py"], MS_ROLE="MS_SCHED", RANK_ID="0", RANK="5")
    t.add(202, 100, "python", ["python", "train.py"], MS_ROLE="MS_WORKER", RANK_ID="0", RANK="5")
    t.add(203, 100, "python", ["python", "train.py"], MS_ROLE="MS_WORKER", RANK_ID="1", RANK="5")

    assert t.find({"msrun": 100}) == {202: (202, "rank 0"), 203: (203, "rank 1")}


def test_mpirun_its_ssh_and_orted_are_machinery_and_on_other_nodes_the_ranks_are_found_under_sshd():
    t = Table()
    # worker-0: mpirun starts its local ranks and reaches worker-1 through ssh.
    t.add(100, 1, "mpirun", ["mpirun", "-np", "4", "python", "train.py"])
    t.add(150, 100, "ssh", ["ssh", "-p", "36666", "worker-1", "orted", "..."])
    t.add(201, 100, "python", ["python", "train.py"], OMPI_COMM_WORLD_RANK="0")
    t.add(202, 100, "python", ["python", "train.py"], OMPI_COMM_WORLD_RANK="1")
    assert t.find({"mpirun": 100}) == {201: (201, "rank 0"), 202: (202, "rank 1")}

    # worker-1: the command is the runtime's watcher; the ranks come through the runtime's sshd.
    t = Table()
    t.add(100, 1, "python", [PY, "-m", "ma_runtime.launch.peers", "--until-gone", "worker-0:36666"])
    t.add(50, 1, "sshd", ["/usr/sbin/sshd", "-D", "-f", "/home/ssh/sshd_config"])
    t.add(60, 50, "sshd", ["sshd: root@notty"])
    t.add(70, 60, "orted", ["orted", "-mca", "ess", "env"])
    t.add(203, 70, "python", ["python", "train.py"], OMPI_COMM_WORLD_RANK="2")
    t.add(204, 70, "python", ["python", "train.py"], OMPI_COMM_WORLD_RANK="3")
    t.add(80, 50, "sshd", ["sshd: root@pts/0"])  # someone's interactive session: not the job
    t.add(81, 80, "bash", ["-bash"])
    assert t.find({"command": 100}, services=[50]) == {203: (203, "rank 2"), 204: (204, "rank 3")}


def test_a_nested_runtime_its_guard_and_uploader_are_machinery_its_command_the_job():
    t = Table()
    t.add(100, 1, "ma-run", [PY, "/venv/bin/ma-run", "python", "train.py"])
    t.add(110, 100, "ma-guard", ["ma-guard", "run-1"])
    t.add(120, 100, "python3", [PY, "-I", "-c", "import os, sys; from ma_runtime.sync.uploader import main", "/x"])
    t.add(130, 100, "python", ["python", "train.py"])
    t.add(140, 100, "python3", [PY, "-c", "print(1)"])  # anything else run with -c is the job
    assert t.find({"command": 100}) == {130: (130, "pid 130 (python)"), 140: (140, "pid 140 (python3)")}


def test_the_ps_watcher_is_machinery_the_tensorflow_task_it_runs_the_job():
    t = Table()
    t.add(100, 1, "python", [PY, "-I", "-m", "ma_runtime.launch.peers", "--until-gone", "w:1", "--", "python", "ps.py"])
    t.add(101, 100, "python", ["python", "ps.py", "--job_name", "ps"])
    assert t.find({"command": 100}) == {101: (101, "pid 101 (python)")}


def test_a_plain_command_and_everything_it_starts_is_one_rank():
    t = Table()
    t.add(100, 1, "python", ["python", "train.py"])
    t.add(101, 100, "python", ["python", "-c", "from multiprocessing.spawn import spawn_main"])
    t.add(102, 101, "python", ["python", "-c", "x"])
    assert {unit for unit in t.find({"command": 100}).values()} == {(100, "pid 100 (python)")}


def test_rtf_ranks_are_the_runtime_s_workers_named_by_rank_id_before_a_pod_wide_rank():
    t = Table()
    t.add(100, 1, "python", ["python", "train.py"], RANK_ID="0", RANK="7")
    t.add(101, 1, "python", ["python", "train.py"], RANK_ID="1", RANK="7")
    assert t.find({"rank-0": 100, "rank-1": 101}) == {100: (100, "rank 0"), 101: (101, "rank 1")}


def test_what_a_process_is_is_read_once_and_again_after_an_exec():
    t = Table()
    t.add(100, 1, "sh", ["sh", "-c", "exec torchrun train.py"])
    t.add(201, 100, "python", ["python", "train.py"], RANK="0")
    finder, reads = t.finder()
    assert t.find({"command": 100}, finder=finder) == {100: (100, "pid 100 (sh)"), 201: (100, "pid 100 (sh)")}
    assert t.find({"command": 100}, finder=finder) == {100: (100, "pid 100 (sh)"), 201: (100, "pid 100 (sh)")}
    assert sorted(reads) == [100, 201]  # once each for two looks
    # sh execs torchrun: the same pid and start time, another name.
    t.add(100, 1, "torchrun", [PY, "/venv/bin/torchrun", "train.py"])
    assert t.find({"command": 100}, finder=finder) == {201: (201, "rank 0")}
    # A pid reused by another process (another start time) is looked at again.
    t.add(201, 100, "python", ["python", "other.py"], start=9)
    assert t.find({"command": 100}, finder=finder) == {201: (201, "pid 201 (python)")}


@pytest.mark.parametrize("argv, what", [
    ([PY, "/venv/bin/torchrun", "--nnodes=1", "t.py"], "torchrun"),
    (["/venv/bin/torchrun", "t.py"], "torchrun"),
    (["python3.11", "-u", "-X", "faulthandler", "-m", "torch.distributed.run", "t.py"], "torchrun"),
    (["python", "-m", "torch.distributed.launch", "t.py"], "torchrun"),
    (["python", "/ms/bin/msrun", "--worker_num=2", "t.py"], "msrun"),
    (["python", "-m", "mindspore.parallel.cluster.run", "t.py"], "msrun"),
    (["python", "-W", "ignore", "/venv/bin/ma-run", "python", "t.py"], "ma-runtime"),
    (["python", "train.py", "-m", "torch.distributed.run"], None),  # the script's own arguments
    (["python", "torchrun.py"], None),
    (["python", "-c", "import torch"], None),
    (["bash", "run.sh"], None),
    ([], None),
])
def test_a_command_line_names_a_launcher(argv, what):
    assert program(argv) == what


def test_the_rank_variable_each_launcher_sets_first():
    pod = {"RANK": "7", "RANK_ID": "2"}
    assert rank_of(pod, "torchrun") == 7 and rank_of(pod, "rank-2") == 2 and rank_of(pod, "msrun") == 2
    assert rank_of({"OMPI_COMM_WORLD_RANK": "3"}, "mpirun") == 3
    assert rank_of({"RANK": "x"}, "command") is None


def test_real_processes_are_read_from_proc():
    """The readers on a real child: its command line, its environment, its name in the table."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "torchrun"],
                             env={**os.environ, "RANK": "4"})
    try:
        deadline = time.monotonic() + 10
        while proc_table.cmdline(child.pid)[1:2] != ["-c"] and time.monotonic() < deadline:
            time.sleep(0.01)  # until the exec is done
        assert proc_table.cmdline(child.pid)[1:] == ["-c", "import time; time.sleep(30)", "torchrun"]
        assert proc_table.environ(child.pid)["RANK"] == "4"
        table = proc_table.processes()
        assert table[child.pid].comm.startswith("python")
        found = Finder().find({"command": child.pid}, (), table)
        assert found[child.pid].label == "rank 4"
    finally:
        child.kill()
        child.wait()
    assert proc_table.cmdline(child.pid) == [] and proc_table.environ(child.pid) == {}


def test_each_launcher_s_declared_words_are_what_tells_its_machinery():
    """ranks.py reads the words from every registered launcher (launch/base.py Machinery): a launcher's module is
    the one place that names its programs."""
    from ma_runtime.launch import registry

    for launcher in registry.launchers():
        machinery = launcher.MACHINERY
        for script in machinery.scripts:
            assert program([f"/venv/bin/{script}", "t.py"]) == launcher.NAME == program([PY, f"/x/{script}"])
        for module in machinery.modules:
            assert program([PY, "-m", module, "t.py"]) == launcher.NAME
        for name in machinery.processes:
            t = Table()
            t.add(100, 1, name, [name])
            t.add(201, 100, "python", ["python", "train.py"], RANK="0")
            assert t.find({"command": 100}) == {201: (201, "rank 0")}, name
