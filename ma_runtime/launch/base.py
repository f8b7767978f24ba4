"""What every launcher shares: its interface (`Launcher`), the plan's shape, the context it is built from, and the
lookups they all make.

A launcher is one module beside this one (plain, rtf, torchrun, msrun, mpirun, pytorch_gpu, tensorflow_gpu), listed
in registry.METHODS, whose `LAUNCHER` is the one instance of its subclass of `Launcher`. The class lists every trait
the runtime asks of a launcher, each with the default of a launch where the runtime starts the command's processes
itself (plain, rtf): a launcher overrides only what differs, and `build`, which none can do without.

The attempt number lives in `Context`, not in the spec: the run builds the plan
again for each attempt, and `MA_PROC_START_CNT` and per-attempt log folders come
from it.
"""

import abc
import dataclasses
import os
import re
import shlex
import shutil
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple, Union

from ma_runtime.errors import ConfigError, RuntimeFailure

# `python`, `python3`, `python3.11`: a command that names an interpreter.
PYTHON = re.compile(r"python(\d+(\.\d+)?)?\Z")
# A count, or what torchrun takes instead and shows as given: `auto`, `cpu`, `gpu`, a node range `1:4`.
Size = Union[int, str]
# A process that runs no signal handler until it is continued: stopped by a signal, or by a tracer.
_STOPPED = ("T", "t")


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
    node: Any = None  # role.Role: this node's rank and the master (plan.build adds it)
    # What the launcher keeps running for the whole run (Ray's node), shown here; started by `start_services`.
    services: Tuple[WorkerPlan, ...] = ()

    def to_dict(self) -> Dict[str, Any]:
        return {"method": self.method, "why": self.why, "nodes": self.nodes,
                "processes_per_node": self.processes_per_node, "warnings": list(self.warnings),
                "node": self.node.to_dict() if self.node is not None else None,
                "workers": [w.to_dict() for w in self.workers], "services": [s.to_dict() for s in self.services]}


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
    # `ma-runtime plan`: nothing is started, so a launcher that is not installed is a warning (in `warnings`), not
    # the run's error; the plan shows the launcher's bare name where its path would be.
    planning: bool = False
    warnings: List[str] = dataclasses.field(default_factory=list)


class RootCause(NamedTuple):
    rank: int
    returncode: int  # Popen style: -N for death by signal N


def common_env(spec, attempt: int) -> Dict[str, str]:
    """What every process of every launcher gets (pre-start hook exports join later)."""
    return {"MA_PROC_START_CNT": str(attempt), "MA_SCHEDULE_CNT": str(spec.schedule_cnt)}


def per_node(spec) -> int:
    return spec.nproc_per_node or max(spec.num_gpus, 1)  # MA_NUM_GPUS=0: one process


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
        return launcher_missing(context, name, ConfigError(f"MA_RUN_METHOD={name}, but {name} is not installed "
                                                           f"({where})", hint=f"install it in the image: {package}"))
    return found


def launcher_missing(context: Context, name: str, failure: RuntimeFailure) -> str:
    """A run stops on `failure`; a plan records it as a warning and goes on with the launcher's bare name."""
    if not context.planning:
        raise failure
    context.warnings.append(f"{failure}; the run would stop here with exit {int(failure.exit_code)} ({failure.hint})")
    return name


def python_folder(context: Context) -> Optional[str]:
    """The folder of the command's Python, named by its path or found on the job's PATH; None for other commands."""
    program = context.argv[0] if context.argv else ""
    if not PYTHON.match(os.path.basename(program)):
        return None
    found = program if os.sep in program else context.which(program, context.environ.get("PATH", os.defpath))
    return os.path.dirname(os.path.abspath(found)) if found else None


# --------------------------------------------------------------------------- the interface


class Helper(NamedTuple):
    """A process a launcher starts beside its ranks that runs the user's code too, told apart by its environment."""

    variable: str
    value: str
    label: str  # what supervise/ranks.py calls it ("msrun's scheduler")


@dataclasses.dataclass(frozen=True)
class Machinery:
    """How supervise/ranks.py tells a launcher's own processes from the job's ranks, wherever they run in a worker's
    tree (a plain `bash run.sh` may start torchrun itself): the hang monitor judges the ranks alone, since a launcher
    keeps working while its ranks are stuck."""

    scripts: FrozenSet[str] = frozenset()  # its programs' file names, run as they are or by `python <path>`
    modules: FrozenSet[str] = frozenset()  # the modules `python -m` runs it as
    # The names (/proc/<pid>/comm) its processes take: torch names its agent's main thread pt_elastic, whatever
    # started it (accelerate launch); MPI's launchers and daemons by their own names.
    processes: FrozenSet[str] = frozenset()
    # Those of `processes` that start ranks for a launcher on another node: below one is the job, even in the
    # tree of a service (the runtime's sshd, through which mpirun's orted comes).
    daemons: FrozenSet[str] = frozenset()
    # What `processes` start to reach the other nodes (ssh, rsh): machinery too.
    remote_shells: FrozenSet[str] = frozenset()
    # A child of it (found by `scripts` or `modules`) with this in its environment is no rank.
    helper: Optional[Helper] = None


# The variables a rank's environment names its rank by, asked in this order: torchrun sets RANK, Open MPI
# OMPI_COMM_WORLD_RANK, PMIx and PMI launchers theirs.
RANK_VARIABLES = ("RANK", "RANK_ID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


class Launcher(abc.ABC):
    """What the runtime asks of a launcher (one subclass per launcher module; its defaults are plain's)."""

    NAME: str  # its MA_RUN_METHOD value
    # Whether its processes per node come from MA_RUNTIME_NPROC_PER_NODE (else max(MA_NUM_GPUS, 1)), so that a CPU
    # run can ask for a count (the preflight warning's advice depends on it). False: it starts a count of its own,
    # and a setting that asks for another is a configuration error.
    TAKES_NPROC_PER_NODE = False
    # Whether its exit code after a requested stop is the command's own (a handler that saved and exited 7); False
    # where the launcher replaces it (torchrun exits 1 from its signal handler, msrun 0 from its SIGINT handler),
    # and the job's code after a stop is then 128+N.
    OWN_CODE_AFTER_STOP = True
    # Whether a multi-node job of this launcher runs as one (coordinator.py: a barrier before each attempt, one
    # restart for the job, 86 on the nodes that did not fail first). False where the job's nodes are of several
    # tasks that end differently (TensorFlow's ps and workers).
    JOB_AS_ONE = True
    # Whether worker-0's command alone decides each attempt of a multi-node job: the other nodes only serve it (an
    # sshd for mpirun's ranks), and their command ends when worker-0's has (together.Watch stops it).
    OUTCOME_ON_WORKER_0 = False
    # Whether its nodes have one job-wide rank (launch/role.py): the plan shows it, and every command gets the job's
    # variables (MASTER_ADDR, NODE_RANK, ...). False where the job's nodes are of several tasks each numbered from 0
    # (TensorFlow's ps and workers).
    JOB_WIDE_RANK = True
    # The names of the workers its plans hold (WorkerPlan.name), which supervise/ranks.py and supervise/stacks/
    # know a worker's tree by: "command" for a launch that runs the command as given.
    WORKERS = re.compile(r"command\Z")
    # The variables its ranks' environment names their rank by, asked in this order (supervise/ranks.py labels
    # each rank by it); its ranks' launcher may set others too (a scheduler may export RANK to every process).
    RANK_VARIABLES: Tuple[str, ...] = RANK_VARIABLES
    MACHINERY = Machinery()  # nothing between the supervisor and the command

    @abc.abstractmethod
    def build(self, spec, context: Context, why: str) -> Plan:
        """The processes to start for one attempt: pure, but for `context`'s lookups."""

    def job_variables(self, spec, context: Context, plan: Plan) -> Any:
        """The variables every command of the job gets (role.JobVariables), agreeing with what this launcher is
        given: by default the master's name (`plan.node`), MA_TORCHRUN_MASTER_PORT's value, and the plan's
        processes per node."""
        from ma_runtime.launch.role import JobVariables

        return JobVariables(plan.node.master, spec.torchrun_master_port, spec.num_hosts, plan.node.node_rank,
                            plan.processes_per_node)

    def forwards_to(self, launcher_pid: int, table: Mapping[int, Any]) -> Set[int]:
        """The pids the launcher process will itself signal when it receives SIGTERM or SIGINT, so that the
        supervisor signals each process once; `table` is {pid: process} with `.ppid`, `.pgid`, `.state`, `.start`
        (process.table.Proc). By default none: the supervisor's own signal is the stop."""
        return set()

    def root_cause(self, lines: Sequence[str]) -> Optional[RootCause]:
        """The rank that failed first, read from the launcher's output tail where its own exit code hides it."""
        return None

    def rank_logs(self, plan: Plan) -> Optional[str]:
        """The folder its ranks write `worker_<rank>.log` to, where they write nowhere the runtime already reads
        (the runtime follows those files onto the console)."""
        return None

    def start_services(self, spec, environ: Mapping[str, str], log, stopped, sinks: Sequence[Any],
                       command: Sequence[str] = ()) -> None:
        """What it keeps running for the whole run, apart from the command (mpirun's sshd, Ray's node): started once,
        after the hooks, in the stage thread (`stopped` is set on a stop); its output to `sinks`; `command` is the
        job's (Ray's node looks for `ray` beside its Python). Most launchers have none."""
        return None


def childrens_groups(launcher_pid: int, table: Mapping[int, Any]) -> Set[int]:
    """Every process in a group led by one of the launcher's living children (its ranks), while the launcher is
    alive and able to run its signal handler: whom torchrun and mpirun signal on a stop (launch/torchrun.py)."""
    launcher = table.get(launcher_pid)
    if launcher is None or launcher.state in _STOPPED:
        return set()
    ranks = {pid for pid, proc in table.items() if proc.ppid == launcher_pid}
    return {pid for pid, proc in table.items() if proc.pgid in ranks}
