"""What every launcher shares: the plan's shape, the context it is built from, and the lookups they all make.

A launcher is one module beside this one (plain, rtf, torchrun, msrun, mpirun, pytorch_gpu, tensorflow_gpu), listed
in registry.METHODS, with the same interface:

- `NAME`: its MA_RUN_METHOD value;
- `TAKES_NPROC_PER_NODE`: whether its processes per node come from
  MA_RUNTIME_NPROC_PER_NODE (else max(MA_NUM_GPUS, 1)), so that a CPU run can
  ask for a count (the preflight warning's advice depends on it);
- `OWN_CODE_AFTER_STOP`: whether its exit code after a requested stop is the
  command's own (a handler that saved and exited 7); False where the launcher
  replaces it (torchrun exits 1 from its signal handler, msrun 0 from its
  SIGINT handler), and the job's code after a stop is then 128+N;
- `build(spec, context, why) -> Plan`: the processes to start, pure;
- `forwards_to(launcher_pid, table) -> Set[int]`: the pids the launcher process
  will itself signal when it receives SIGTERM or SIGINT, so that the supervisor
  signals each process once; `table` is {pid: process} with `.ppid`, `.pgid`,
  `.state`, `.start` (supervise.worker.Proc; launch does not import supervise);
- `root_cause(lines) -> Optional[RootCause]`: the rank that failed first, from
  the launcher's output tail, where the launcher's own exit code hides it;
- `rank_logs(plan) -> Optional[str]`: the folder its ranks write
  `worker_<rank>.log` to, where they write nowhere the runtime already reads;
- optionally `start_services(spec, environ, log, stopped, sinks) -> None`: what
  it keeps running for the whole run, apart from the command (mpirun's sshd),
  started once after the hooks (`start_services` below calls it).

The attempt number lives in `Context`, not in the spec: the run builds the plan
again for each attempt, and `MA_PROC_START_CNT` and per-attempt log folders come
from it.
"""

import dataclasses
import os
import re
import shlex
import shutil
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple, Union

from ma_runtime.errors import ConfigError

# `python`, `python3`, `python3.11`: a command that names an interpreter.
PYTHON = re.compile(r"python(\d+(\.\d+)?)?\Z")
# A count, or what torchrun takes instead and shows as given: `auto`, `cpu`, `gpu`, a node range `1:4`.
Size = Union[int, str]


@dataclasses.dataclass(frozen=True)
class WorkerPlan:
    name: str  # "command", "torchrun", "msrun", or "rank-<r>"
    argv: Tuple[str, ...]
    env: Mapping[str, str]  # added or changed
    cwd: Optional[str] = None  # None: the runtime's own
    logs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    rank: Optional[int] = None
    # {path: text}: files the process reads (mpirun's hostfile), written by the run right before it starts.
    files: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "argv": list(self.argv), "env": dict(self.env), "cwd": self.cwd,
                "logs": dict(self.logs), "rank": self.rank, "files": dict(self.files)}


@dataclasses.dataclass(frozen=True)
class Plan:
    method: str
    why: str  # how the method was chosen
    workers: Tuple[WorkerPlan, ...]
    nodes: Size
    processes_per_node: Size
    warnings: Tuple[str, ...] = ()

    def to_dict(self) -> Dict[str, Any]:
        return {"method": self.method, "why": self.why, "nodes": self.nodes,
                "processes_per_node": self.processes_per_node, "warnings": list(self.warnings),
                "workers": [w.to_dict() for w in self.workers]}


@dataclasses.dataclass(frozen=True)
class Context:
    """What the plan needs besides the JobSpec, gathered by the caller (so the plan stays pure)."""

    argv: Sequence[str]  # the command with its appended arguments
    environ: Mapping[str, str]
    rank_table: Any = None  # ranktable.Prepared, when the job has one
    resolve: Callable[[str], str] = lambda host: host  # host name -> IP (msrun wants an IP)
    # (name, PATH) -> full path; shutil.which's second positional parameter is `mode`, not the PATH.
    which: Callable[[str, Optional[str]], Optional[str]] = lambda name, path=None: shutil.which(name, path=path)
    attempt: int = 1  # which start of the command this plan is for, counting from 1 (MA_PROC_START_CNT)
    # [(host, port)] -> their IPv4 addresses, once each answers a TCP connect (the run waits, bounded:
    # peers.reach_all); by default no wait and the names themselves, so that `ma-runtime plan` never waits.
    reach: Callable[[Sequence[Tuple[str, int]]], List[str]] = lambda endpoints: [host for host, _ in endpoints]
    # The names the runtime's stages set or changed for the workers: the hooks' exports, stage-in's variables.
    exported: Tuple[str, ...] = ()


class RootCause(NamedTuple):
    rank: int
    returncode: int  # Popen style: -N for death by signal N


def common_env(spec, attempt: int) -> Dict[str, str]:
    """What every process of every launcher gets (pre-start hook exports join later)."""
    return {"MA_PROC_START_CNT": str(attempt), "MA_SCHEDULE_CNT": str(spec.schedule_cnt)}


def per_node(spec) -> int:
    return spec.nproc_per_node or max(spec.num_gpus, 1)  # MA_NUM_GPUS=0: one process


def master_host(spec, environ: Mapping[str, str]) -> str:
    """Worker-0's domain name: the first of VC_WORKER_HOSTS, else `<vj>-<task>-0.<vj>` (invalid on supernodes)."""
    hosts = worker_hosts(spec)
    if hosts:
        return hosts[0]
    if spec.vj_name:
        return f"{spec.vj_name}-{spec.task_name}-0.{spec.vj_name}"
    raise ConfigError("a multi-node launch needs worker-0's address, and VC_WORKER_HOSTS and MA_VJ_NAME are unset",
                      hint="the platform sets VC_WORKER_HOSTS; set it when running elsewhere")


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


def check_node_rank(spec) -> None:
    if not 0 <= spec.task_index < spec.num_hosts:
        raise ConfigError(f"VC_TASK_INDEX={spec.task_index} is not below MA_NUM_HOSTS={spec.num_hosts}",
                          hint="this node's index counts from 0 among the job's nodes")


def check_once_per_node(spec, why: str, starter: str) -> None:
    """A launch that runs the command once per node refuses a MA_RUNTIME_NPROC_PER_NODE asking for more, rather
    than ignoring it; `starter` says who starts the processes instead."""
    if spec.nproc_per_node not in (None, 1):
        raise ConfigError(f"MA_RUNTIME_NPROC_PER_NODE={spec.nproc_per_node} asks for {spec.nproc_per_node} "
                          f"processes per node, but {why} runs the command once per node: {starter}",
                          hint="unset MA_RUNTIME_NPROC_PER_NODE, or set MA_RUN_METHOD=torchrun to have the runtime "
                               "start several processes per node")


def split_extra(name: str, text: Optional[str]) -> List[str]:
    """A setting of extra launcher flags, split as a shell would split it, never evaluated."""
    try:
        return shlex.split(text or "")
    except ValueError as exc:
        raise ConfigError(f"{name} cannot be split ({exc}): {text!r}", hint="balance the quotes") from None


def find_launcher(context: Context, name: str, package: str) -> str:
    """The launcher beside the command's Python first (installed with it, it runs with it), then on PATH."""
    folder = python_folder(context)
    found = (folder and context.which(name, folder)) or context.which(name, context.environ.get("PATH"))
    if not found:
        where = f"not in {folder} beside {context.argv[0]}, not on PATH" if folder else "not on PATH"
        raise ConfigError(f"MA_RUN_METHOD={name}, but {name} is not installed ({where})",
                          hint=f"install it in the image: {package}")
    return found


def python_folder(context: Context) -> Optional[str]:
    """The folder of the command's Python, named by its path or found on the job's PATH; None for other commands."""
    program = context.argv[0] if context.argv else ""
    if not PYTHON.match(os.path.basename(program)):
        return None
    found = program if os.sep in program else context.which(program, context.environ.get("PATH", os.defpath))
    return os.path.dirname(os.path.abspath(found)) if found else None


# What a launcher without the matching trait says (plain and rtf: the runtime's own processes).


def forwards_nothing(launcher_pid: int, table: Mapping[int, Any]) -> Set[int]:
    return set()


def no_root_cause(lines: Sequence[str]) -> Optional[RootCause]:
    return None


def no_rank_logs(plan: Plan) -> Optional[str]:
    return None


def start_services(launcher, spec, environ: Mapping[str, str], log, stopped, sinks: Sequence[Any]) -> None:
    """The launcher's services (the optional trait): most launchers have none."""
    start = getattr(launcher, "start_services", None)
    if start is not None:
        start(spec, environ, log, stopped, sinks)
