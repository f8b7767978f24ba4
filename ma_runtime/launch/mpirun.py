"""mpirun (Open MPI): the platform's MPI launch without its run_mpi.sh, how mpirun stops its ranks, who failed.

The nodes (README, "mpirun"):
- every node of a multi-node job starts an sshd on MY_SSHD_PORT (sshd.py), as the job's service, before
  its plan is built: mpirun on worker-0 starts its daemons (orted) on the others over ssh;
- worker-0 (the master: launch/role.py, VC_TASK_INDEX 0 without dynamic routing) waits, bounded, until every
  node's sshd answers (`Context.reach`), writes the hostfile (`<ip> slots=<n>`, worker-0 first) and runs
  mpirun, whose exit code is the job's;
- every other node runs no command of its own (its ranks come through its sshd): its plan is the peers
  watcher, which exits 0 once worker-0's sshd has answered and then gone, i.e. once worker-0's run has ended
  and swept its services. Its runtime then ends too, and sweeps its sshd and whatever orted left.

The environment of the ranks on the other nodes is the ssh session's, plus what mpirun passes with `-x`: an
explicit list of names (never `NAME=value` for the job's own variables: their values stay out of argv), the
platform's families (what run_mpi.sh passes: MA_*, VC_WORKER_*, PATH, S3_*, SHARED_*), the libraries' and the
interpreter's, what the hooks and stage-in set; never a name that looks like a credential (redact.py), unless
MA_RUNTIME_MPI_EXPORT asks for it by name, and never a value that is this node's only (VC_TASK_INDEX, ...).

How it stops its ranks (checked with Open MPI 4.1.4): each local rank is a child of mpirun leading a process
group of its own; on SIGTERM or SIGINT mpirun sends SIGTERM to each rank's group, tells the remote daemons to
do the same, SIGKILLs what is left about a second later, and exits 1 whatever its ranks did: the rule of
torchrun's `forwards_to`, and the job's code after a stop is 128+N. A rank that exits non-zero ends the job:
mpirun kills the others and exits with that rank's code (3 for 3, 128+N for a death by signal N, the error code
of an MPI_Abort), and its summary names the rank.
"""

import re
from typing import Any, List, Mapping, Optional, Sequence, Set, Tuple

from ma_runtime.errors import RuntimeFailure
from ma_runtime.launch.base import (
    Context,
    Launcher,
    Machinery,
    Plan,
    RootCause,
    WorkerPlan,
    childrens_groups,
    common_env,
    find_launcher,
    per_node,
    split_extra,
)
from ma_runtime.launch.role import node_names, role
from ma_runtime.setting import INTERFACES, Setting, env_names, integer, matching, port, text
from ma_runtime.util.redact import is_secret_name

# This launcher's own settings: spec's table collects them through launch.registry (setting.py: a row).
SETTINGS = (
    Setting("sshd_port", "MY_SSHD_PORT", port, "the port of the sshd every node of a multi-node mpirun job "
            "starts (the platform's run_mpi.sh default)", 36666, cli=False, owner=__name__),
    Setting("mpi_key_port", "MA_RUNTIME_MPI_KEY_PORT", port, "the port on which worker-0 of a multi-node "
            "mpirun job serves the job's public key when no SSH trust files are mounted (default: MY_SSHD_PORT + 1)",
            None, cli=False, owner=__name__),
    Setting("mpi_slots", "MY_MPI_SLOTS", integer(1, 1024), "mpirun's processes per node (default: "
            "MA_RUNTIME_NPROC_PER_NODE, else MA_NUM_GPUS, at least 1)", None, cli=False, owner=__name__),
    Setting("mpi_btl_tcp_if", "MY_MPI_BTL_TCP_IF", matching(INTERFACES, "list of network interfaces"),
            "the interfaces NCCL uses under mpirun (NCCL_SOCKET_IFNAME, unless the job sets that)", "eth0,bond0",
            cli=False, owner=__name__),
    Setting("extra_mpirun_params", "MA_RUNTIME_EXTRA_MPIRUN_PARAMS", text, "extra mpirun arguments, after the "
            "runtime's and before the command", "", cli=False, owner=__name__),
    Setting("mpi_export", "MA_RUNTIME_MPI_EXPORT", env_names, "more variables mpirun passes to every rank "
            "by name (-x NAME); the only way to pass one named like a secret", (), cli=False, owner=__name__),
)
WATCHER = "watcher"  # the plan's worker on the nodes other than worker-0
HOSTFILE = "hostfile"

# Passed by name to every rank: the platform's families (run_mpi.sh's `env | grep`, its credential families
# SCC* and CRED* left out), the communication libraries', the interpreter's.
_FAMILIES = ("MA_", "VC_WORKER_", "S3_", "SHARED_", "NCCL_", "HCCL_", "HOROVOD_", "OMP_", "PYTHON")
_NAMES = frozenset(("PATH", "LD_LIBRARY_PATH", "LD_PRELOAD"))
# This node's own: another node's ranks must not get worker-0's values.
_THIS_NODE = frozenset(("VC_TASK_INDEX", "MA_TASK_INDEX", "VK_TASK_INDEX", "NODE_RANK", "RANK_AFTER_ACC",
                        "MA_RUNTIME_LINEAGE", "MA_RUNTIME_STACKS_DIR", "MA_RUNTIME_STACKS_SIGNAL"))
_THIS_NODE_FAMILY = "MA_CURRENT_"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# The root causes mpirun's summaries name, e.g. `Process name: [[15347,1],2]` then `Exit code:    3`.
_EXITED = re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]\s*\n\s*Exit code:\s*(-?\d+)")
_SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
_ABORTED = re.compile(r"MPI_ABORT was invoked on rank (\d+) in communicator \S+\s+with errorcode (-?\d+)")


class Mpirun(Launcher):
    NAME = "mpirun"
    # Its processes per node: MY_MPI_SLOTS, else MA_RUNTIME_NPROC_PER_NODE, else MA_NUM_GPUS (at least 1).
    TAKES_NPROC_PER_NODE = True
    # After a stop mpirun exits 1, whatever its ranks' handlers did.
    OWN_CODE_AFTER_STOP = False
    # worker-0's mpirun runs every rank; the other nodes' command only waits for it to end (peers.py).
    OUTCOME_ON_WORKER_0 = True
    WORKERS = re.compile(rf"(mpirun|{WATCHER})\Z")
    # MPI's launchers and daemons by name (Open MPI's, PRRTE's, MPICH Hydra's: a `bash run.sh` may start any), and
    # the ssh or rsh they start to reach the other nodes; on those nodes the ranks are orted's children.
    MACHINERY = Machinery(
        processes=frozenset({"mpirun", "mpiexec", "orterun", "orted", "prterun", "prted", "prte", "hydra_pmi_proxy",
                             "mpiexec.hydra", "hydra_bstrap_proxy"}),
        daemons=frozenset({"orted", "prted", "hydra_pmi_proxy"}),
        remote_shells=frozenset({"ssh", "rsh"}))

    def build(self, spec, context: Context, why: str) -> Plan:
        count = spec.mpi_slots or per_node(spec)
        if spec.num_hosts <= 1:
            return _mpirun_plan(spec, context, why, count, ["localhost"])
        nodes = node_names(spec)  # the master first: its mpirun's ranks come first
        if not role(spec).is_master:
            return _watcher_plan(spec, context, why, count, nodes[0])
        addresses = context.reach([(node, spec.sshd_port) for node in nodes])
        if len(addresses) != len(nodes):
            raise RuntimeFailure("stopped while waiting for the other nodes", stage="launch")
        return _mpirun_plan(spec, context, why, count, addresses)

    def forwards_to(self, launcher_pid: int, table: Mapping[int, Any]) -> Set[int]:
        """The rule of torchrun's (see the module docstring)."""
        return childrens_groups(launcher_pid, table)

    def root_cause(self, lines: Sequence[str]) -> Optional[RootCause]:
        """The rank mpirun's last summary names (a non-zero exit, a death by signal, an MPI_Abort), or None."""
        text = "\n".join(lines)
        found: List[Tuple[int, RootCause]] = []
        for pattern, sign in ((_EXITED, 1), (_SIGNALLED, -1), (_ABORTED, 1)):
            found += [(match.start(), RootCause(int(match.group(1)), sign * int(match.group(2))))
                      for match in pattern.finditer(text)]
        return max(found)[1] if found else None

    # rank_logs: none; its ranks' output comes through mpirun's own (remote ones too), which the runtime pipes.

    def start_services(self, spec, environ: Mapping[str, str], log, stopped, sinks, command=()) -> None:
        """The node's sshd, on a multi-node job: worker-0's ssh reaches the others through theirs, and the others
        watch worker-0's to learn when its run ended. Without mounted trust files, worker-0 also serves the job's
        public key, and the others fetch it from worker-0 first (sshd.py)."""
        if spec.num_hosts <= 1:
            return
        # A job without the nodes' names fails before an sshd is started for nothing.
        worker_0 = node_names(spec)[0]
        from ma_runtime.launch import sshd

        sshd.start(spec, environ, log, stopped, sinks, client=role(spec).is_master, worker_0=worker_0)


LAUNCHER = Mpirun()


# --------------------------------------------------------------------------- the plan


def _mpirun_plan(spec, context: Context, why: str, count: int, hosts: Sequence[str]) -> Plan:
    from ma_runtime.launch import sshd_files

    launcher = find_launcher(context, "mpirun", "Open MPI (Debian/Ubuntu: apt-get install openmpi-bin)")
    hostfile = sshd_files.folder(spec) / HOSTFILE
    argv = [launcher, "-np", str(len(hosts) * count), "-hostfile", str(hostfile)]
    if len(hosts) > 1:  # one node: mpirun starts every rank itself, no ssh
        # Open MPI splits this at every space and quotes it again for orted's remote shell: client_config is a
        # plain path whatever MA_HOME holds (sshd_files.named_folder).
        argv += ["-mca", "plm_rsh_args", f"-p {spec.sshd_port} -F {sshd_files.client_config(spec)}"]
    argv += ["-bind-to", "none", "-map-by", "slot", "-mca", "pml", "ob1", "-mca", "btl", "^openib"]
    if len(hosts) > 1:
        argv += ["-mca", "plm_rsh_no_tree_spawn", "true"]
    argv += [*exports(spec, context), *split_extra("MA_RUNTIME_EXTRA_MPIRUN_PARAMS", spec.extra_mpirun_params),
             *context.argv]
    worker = WorkerPlan(Mpirun.NAME, tuple(argv), common_env(spec, context.attempt),
                        logs={"task": str(spec.task_log_path)},
                        files={str(hostfile): "".join(f"{host} slots={count}\n" for host in hosts)})
    return Plan(Mpirun.NAME, why, (worker,), len(hosts), count)


def _watcher_plan(spec, context: Context, why: str, count: int, master: str) -> Plan:
    from ma_runtime.launch import peers

    argv = peers.watcher_argv([(master, spec.sshd_port)], spec.peer_wait_seconds)
    worker = WorkerPlan(WATCHER, tuple(argv), common_env(spec, context.attempt),
                        logs={"task": str(spec.task_log_path)})
    return Plan(Mpirun.NAME, why, (worker,), spec.num_hosts, count)


def exports(spec, context: Context) -> List[str]:
    """mpirun's `-x` words: the platform's presets (the job's own value wins: then the name alone), then every
    name a rank needs, sorted, then the names MA_RUNTIME_MPI_EXPORT asks for."""
    present = {*context.environ, *common_env(spec, context.attempt), *context.exported}
    presets = _presets(spec)
    words: List[str] = []
    for name, value in presets:
        words += ["-x", name if name in present else f"{name}={value}"]
    skip = {name for name, _ in presets}
    chosen = sorted(name for name in present if name not in skip and _passes(name, context.exported))
    asked = [name for name in spec.mpi_export if name in present and name not in skip and name not in chosen]
    for name in (*chosen, *asked):
        words += ["-x", name]
    return words


def _presets(spec) -> Tuple[Tuple[str, str], ...]:
    """What the platform's run_mpi.sh gives every rank."""
    return (("NCCL_SOCKET_IFNAME", spec.mpi_btl_tcp_if), ("NCCL_SOCKET_FAMILY", "AF_INET"), ("NCCL_DEBUG", "INFO"),
            ("HOROVOD_MPI_THREADS_DISABLE", "1"))


def _passes(name: str, exported: Sequence[str]) -> bool:
    if not _NAME.match(name) or is_secret_name(name) or name in _THIS_NODE or name.startswith(_THIS_NODE_FAMILY):
        return False
    return name in _NAMES or name.startswith(_FAMILIES) or name in exported
