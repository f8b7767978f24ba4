"""This node's place in the job: its node rank and the master's address, the one rule every part asks.

Who asks: every launcher's plan (torchrun's --node_rank/--master_addr, msrun's, pytorch-gpu's --rank and
--init_method, mpirun's worker-0 and hostfile, RTF's node in the rank table), the variables every command gets
(MASTER_ADDR, NODE_RANK, ...: `JobVariables`), the job's coordinator (the master's runtime hosts the store) and
the peers waits (the others wait for the master). `ma-runtime plan --json` shows the answer under `node`.

The rule (docs/guides/launchers.md, "Node rank and master"):
- one node: rank 0, master `localhost`;
- node rank: VC_TASK_INDEX (or its fallbacks MA_TASK_INDEX, VK_TASK_INDEX); with ROUTE_PLAN=true (the platform's
  dynamic routing) RANK_AFTER_ACC when it is set, as the platform's scripts do (`${RANK_AFTER_ACC:-$VC_TASK_INDEX}`);
- master: the node of rank 0. Without dynamic routing, the first of VC_WORKER_HOSTS, else
  `${MA_VJ_NAME}-${MA_TASK_NAME}-0.${MA_VJ_NAME}`. With ROUTE_PLAN=true the platform gives two forms (Snt9b:
  `${MA_VJ_NAME}-${MA_TASK_NAME}-${MA_MASTER_INDEX:-0}.${MA_VJ_NAME}`; Snt9b23, a supernode pool where those names
  do not resolve: the first of VC_WORKER_HOSTS). The runtime tells them apart by MA_MASTER_INDEX, the variable
  only the Snt9b form reads: set, the Snt9b form; unset, the first of VC_WORKER_HOSTS, which on Snt9b is the same
  node as `${MA_MASTER_INDEX:-0}` gives (task 0's name heads VC_WORKER_HOSTS there).
"""

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from ma_runtime.errors import ConfigError

LOCALHOST = "localhost"  # the master of a one-node job: what the LLM frameworks' scripts default to
# The per-node process count under the names the frameworks' scripts and launchers read: MindSpeed-LLM's and
# AscendSpeed's scripts NPUS_PER_NODE, Megatron-LM's examples GPUS_PER_NODE, LLaMA-Factory's launcher
# NPROC_PER_NODE (docs/guides/launchers.md, "What every command gets").
PER_NODE_NAMES = ("NPUS_PER_NODE", "GPUS_PER_NODE", "NPROC_PER_NODE")
JOB_VARIABLE_NAMES = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", *PER_NODE_NAMES)


@dataclasses.dataclass(frozen=True)
class Role:
    node_rank: int
    master: Optional[str]  # the master's host name (`localhost` on one node); None: the job's variables name none
    rank_from: str  # the variable the rank came from
    master_from: str  # how the master was found
    master_task: int = 0  # the master's task index (VC_TASK_INDEX), as the coordinator names nodes

    @property
    def is_master(self) -> bool:
        return self.node_rank == 0

    def need_master(self) -> str:
        """The master's name, for a launch that cannot go without it: ConfigError (78) when none is known."""
        if self.master is None:
            raise ConfigError("a multi-node launch needs worker-0's address, and VC_WORKER_HOSTS and MA_VJ_NAME "
                              "are unset", hint="the platform sets VC_WORKER_HOSTS; set it when running elsewhere")
        return self.master

    def to_dict(self) -> Dict[str, Any]:
        return {"rank": self.node_rank, "master": self.master, "rank_from": self.rank_from,
                "master_from": self.master_from, "master_task": self.master_task}


def node_rank_of(route_plan: bool, rank_after_acc: Optional[int], task_index: Optional[int]) -> Tuple[Optional[int],
                                                                                                       str]:
    """(this node's rank, the variable it came from) from the raw values: the rank rule itself, for `role` and for
    the rank table's node view, which reads the environment before a JobSpec exists."""
    if route_plan and rank_after_acc is not None:
        return rank_after_acc, "RANK_AFTER_ACC"
    return task_index, "VC_TASK_INDEX"


def role(spec) -> Role:
    """This node's rank and the master; ConfigError (78) for a multi-node job whose variables contradict each other
    (a rank not below MA_NUM_HOSTS, a VC_WORKER_HOSTS of another size, a master that is not rank 0)."""
    if spec.num_hosts <= 1:
        return Role(0, LOCALHOST, "one node", "one node")
    rank, rank_from = node_rank_of(spec.route_plan, spec.rank_after_acc, spec.task_index)
    if not 0 <= rank < spec.num_hosts:
        raise ConfigError(f"{rank_from}={rank} is not below MA_NUM_HOSTS={spec.num_hosts}",
                          hint="this node's rank counts from 0 among the job's nodes")
    master, master_from = _master(spec)
    _check_master_index(spec, rank, rank_from)
    if spec.route_plan and spec.master_index is not None:
        master_task = spec.master_index
    else:  # the first of VC_WORKER_HOSTS is task 0, unless this node is the master
        master_task = spec.task_index if rank == 0 else 0
    return Role(rank, master, rank_from, master_from, master_task)


def _master(spec) -> Tuple[Optional[str], str]:
    if spec.route_plan and spec.master_index is not None:  # dynamic routing on Snt9b (module docstring)
        if not spec.vj_name:
            raise ConfigError("ROUTE_PLAN=true and MA_MASTER_INDEX is set, but MA_VJ_NAME is unset: the master's "
                              "name is ${MA_VJ_NAME}-${MA_TASK_NAME}-${MA_MASTER_INDEX}.${MA_VJ_NAME}",
                              hint="the platform sets MA_VJ_NAME; set it when running elsewhere")
        if spec.master_index >= spec.num_hosts:
            raise ConfigError(f"MA_MASTER_INDEX={spec.master_index} is not below MA_NUM_HOSTS={spec.num_hosts}",
                              hint="it is the task index of the master node, counting from 0")
        return _platform_name(spec, spec.master_index), "MA_MASTER_INDEX"
    hosts = worker_hosts(spec)
    if hosts:
        return hosts[0], "VC_WORKER_HOSTS"
    if spec.vj_name:
        return _platform_name(spec, 0), "MA_VJ_NAME"
    return None, "unknown: VC_WORKER_HOSTS and MA_VJ_NAME are unset"


def _check_master_index(spec, rank: int, rank_from: str) -> None:
    """With MA_MASTER_INDEX naming the master's task, that task is rank 0 and no other is: else two nodes would
    both serve as master, or none."""
    if not (spec.route_plan and spec.master_index is not None and rank_from == "RANK_AFTER_ACC"):
        return
    if (spec.task_index == spec.master_index) != (rank == 0):
        raise ConfigError(f"RANK_AFTER_ACC={rank} on task {spec.task_index}, but MA_MASTER_INDEX={spec.master_index} "
                          f"names task {spec.master_index} as the master: the master's RANK_AFTER_ACC is 0, and "
                          "only its", hint="the dynamic-routing variables of this job disagree; check ROUTE_PLAN's "
                                           "setup, or unset MA_MASTER_INDEX to take the first of VC_WORKER_HOSTS")


def _platform_name(spec, index: int) -> str:
    """The platform's per-node domain name (not valid on supernode pools)."""
    return f"{spec.vj_name}-{spec.task_name}-{index}.{spec.vj_name}"


def worker_hosts(spec) -> List[str]:
    """VC_WORKER_HOSTS in order (worker-0 first); a trailing comma is tolerated, a hole is not (it would shift
    who worker-0 is), and the count must be MA_NUM_HOSTS."""
    hosts = [host.strip() for host in (spec.worker_hosts or "").split(",")]
    while hosts and not hosts[-1]:
        hosts.pop()
    if not hosts:
        return []
    if not all(hosts):
        raise ConfigError(f"VC_WORKER_HOSTS has an empty entry: {spec.worker_hosts!r}",
                          hint="list every node's domain name, worker-0 first, separated by commas")
    if len(hosts) != spec.num_hosts:
        raise ConfigError(f"VC_WORKER_HOSTS names {len(hosts)} node(s), but MA_NUM_HOSTS={spec.num_hosts}",
                          hint="the two must describe the same job")
    return hosts


def node_names(spec) -> List[str]:
    """Every node's domain name, the master first: VC_WORKER_HOSTS, else the platform's
    `${MA_VJ_NAME}-${MA_TASK_NAME}-<i>.${MA_VJ_NAME}` (run_mpi.sh's; not valid on supernode pools)."""
    master = role(spec).need_master()  # the one error for a job that names neither
    names = worker_hosts(spec) or [_platform_name(spec, index) for index in range(spec.num_hosts)]
    if master not in names:
        raise ConfigError(f"the master {master} is not one of the job's nodes ({', '.join(names)})",
                          hint="VC_WORKER_HOSTS and MA_MASTER_INDEX must describe the same job")
    return [master, *(name for name in names if name != master)]


@dataclasses.dataclass(frozen=True)
class JobVariables:
    """What every command of the job is given (unless the job sets them itself): where the master is and how
    many processes run where, under the names the LLM frameworks' launch scripts read."""

    master_addr: Optional[str]  # None: the job names no master (no VC_WORKER_HOSTS, no MA_VJ_NAME): not given
    master_port: int
    nodes: int
    node_rank: int
    per_node: Any  # a count, or what torchrun takes instead (`auto`, `gpu`)

    def env(self) -> Dict[str, Any]:
        values = {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port), "NNODES": str(self.nodes),
                  "NODE_RANK": str(self.node_rank)}
        if self.master_addr is None:
            del values["MASTER_ADDR"]
        values.update((name, str(self.per_node)) for name in PER_NODE_NAMES)
        return values
