"""From the job to the processes to start: a pure function, printed by `ma-runtime plan --json`.

The method (README, "Launchers"):
- `MA_RUN_METHOD` (env or job file `run_method`) names it: `torchrun`, `msrun`, or
  ma_runtime's own `rtf` (one process per local NPU, the rank-table file launch) and
  `plain` (the command once);
- unset, an NPU job gets `rtf`: NPU device nodes (davinci<N>) under the device
  directory, or `RANK_TABLE_FILE` set; any other job gets `plain`.

Every launcher's command gets the same appended arguments (inputs, outputs,
hyperparameters): torchrun and msrun pass them to each rank, and every RTF copy
has them. The plan lists only the environment each process adds or changes;
the run starts from the runtime's own environment.

Processes per node: MA_RUNTIME_NPROC_PER_NODE, else max(MA_NUM_GPUS, 1), for
torchrun and msrun. RTF's count is the rank table's and plain's is one, so a
setting that asks for another count is a configuration error there, not a
silent surprise. The plan's summary (nodes, processes per node) is read back
from the torchrun flags that will run, MA_EXTRA_TORCHRUN_PARAMS included.

A launcher is looked for beside the command's Python first, then on PATH: a
venv's `python` comes with its own torchrun or msrun, which runs with that venv.

`warnings` holds what will go wrong although a plan can be made: the preflight
failure that is certain from the device nodes and PATH (preflight/accelerator.py
decides, no tool runs), when the run's preflight would stop on it.
"""

import dataclasses
import os
import re
import shlex
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ma_runtime.errors import ConfigError
from ma_runtime.preflight import accelerator

RTF, TORCHRUN, MSRUN, PLAIN = "rtf", "torchrun", "msrun", "plain"
METHODS = (RTF, TORCHRUN, MSRUN, PLAIN)
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?\Z")
_NPU_NODE = re.compile(r"davinci\d+\Z")
_COUNT = re.compile(r"[0-9]+\Z")
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

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "argv": list(self.argv), "env": dict(self.env), "cwd": self.cwd,
                "logs": dict(self.logs), "rank": self.rank}


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


# --------------------------------------------------------------------------- choosing


def choose(spec) -> Tuple[str, str]:
    """(method, why)."""
    if spec.run_method:
        return spec.run_method, f"MA_RUN_METHOD={spec.run_method}"
    if spec.ranktable_file is not None:
        return RTF, "an NPU job (RANK_TABLE_FILE is set) and MA_RUN_METHOD is unset"
    if _npu_nodes(spec.preflight_dev_dir):
        return RTF, f"an NPU job (davinci<N> device nodes in {spec.preflight_dev_dir}) and MA_RUN_METHOD is unset"
    return PLAIN, "not an NPU job and MA_RUN_METHOD is unset: the command runs once"


def _npu_nodes(dev_dir: Path) -> bool:
    try:
        return any(_NPU_NODE.match(name) for name in os.listdir(dev_dir))
    except OSError:
        return False


def build(spec, context: Context) -> Plan:
    method, why = choose(spec)
    builder = {RTF: _rtf, TORCHRUN: _torchrun, MSRUN: _msrun, PLAIN: _plain}[method]
    plan = builder(spec, context, why)
    rejection = _preflight_rejection(spec, context, plan)
    return dataclasses.replace(plan, warnings=(rejection,)) if rejection else plan


def common_env(spec) -> Dict[str, str]:
    """What every process of every launcher gets (pre-start hook exports join later)."""
    return {"MA_PROC_START_CNT": str(spec.proc_start_cnt), "MA_SCHEDULE_CNT": str(spec.schedule_cnt)}


# --------------------------------------------------------------------------- plain and RTF


def _per_node(spec) -> int:
    return spec.nproc_per_node or max(spec.num_gpus, 1)  # MA_NUM_GPUS=0: one process


def _plain(spec, context: Context, why: str) -> Plan:
    if spec.nproc_per_node not in (None, 1):
        raise ConfigError(f"MA_RUNTIME_NPROC_PER_NODE={spec.nproc_per_node} asks for {spec.nproc_per_node} processes "
                          f"per node, but the plain launch starts one ({why})",
                          hint="set MA_RUN_METHOD=torchrun or msrun to start several processes per node, or unset "
                               "MA_RUNTIME_NPROC_PER_NODE")
    worker = WorkerPlan("command", tuple(context.argv), common_env(spec), logs={"task": str(spec.task_log_path)})
    return Plan(PLAIN, why, (worker,), spec.num_hosts, 1)


def _rtf(spec, context: Context, why: str) -> Plan:
    prepared = context.rank_table
    if prepared is None:
        raise ConfigError("the rank-table launch needs a rank table: RANK_TABLE_FILE is unset, or "
                          "MA_RUNTIME_RANKTABLE=off",
                          hint="set RANK_TABLE_FILE (the platform does on NPU jobs), or choose another MA_RUN_METHOD "
                               "(torchrun, msrun, plain)")
    node = prepared.node
    if not node.devices:
        raise ConfigError(f"the rank table gives this node ({node.server_id}) no devices: nothing to start")
    if spec.nproc_per_node not in (None, len(node.devices)):
        raise ConfigError(f"MA_RUNTIME_NPROC_PER_NODE={spec.nproc_per_node}, but the rank-table launch starts one "
                          f"process per device, and the rank table gives this node ({node.server_id}) "
                          f"{len(node.devices)} device(s)",
                          hint="unset MA_RUNTIME_NPROC_PER_NODE, or choose MA_RUN_METHOD=torchrun or msrun")
    workers = []
    for device in node.devices:
        logical = str(device.logical_id)
        env = {
            **common_env(spec),
            "RANK_TABLE_FILE": str(prepared.path),
            "RANK_ID": str(device.rank_id),
            "RANK_SIZE": str(node.rank_size),
            # Logical ids, as the container numbers its visible devices (ACL, MindSpore's
            # set_context(device_id=...)); the physical id is in the rank table.
            "ASCEND_DEVICE_ID": logical,
            "DEVICE_ID": logical,
            "JOB_ID": spec.job_id,
            # The platform's upload layout (docs/platform.md, "Logs").
            "ASCEND_PROCESS_LOG_PATH": str(spec.log_dir / "ascend" / "process_log" / f"rank_{device.rank_id}"),
        }
        proc_log = spec.log_dir / f"modelarts-job-{spec.job_id}-proc-rank-{device.rank_id}-device-{logical}.txt"
        workers.append(WorkerPlan(f"rank-{device.rank_id}", tuple(context.argv), env, logs={"proc": str(proc_log)},
                                  rank=device.rank_id))
    return Plan(RTF, why, tuple(workers), spec.num_hosts, len(workers))


# --------------------------------------------------------------------------- torchrun


def _torchrun(spec, context: Context, why: str) -> Plan:
    launcher = _launcher(context, "torchrun", "torch (pip install torch)")
    per_node = _per_node(spec)
    if spec.num_hosts <= 1:
        preset = ["--standalone", f"--nnodes={spec.num_hosts}", f"--nproc_per_node={per_node}"]
    else:
        _check_node_rank(spec)
        preset = [f"--nnodes={spec.num_hosts}", f"--nproc_per_node={per_node}", f"--node_rank={spec.task_index}",
                  f"--master_addr={master_host(spec, context.environ)}",
                  f"--master_port={spec.torchrun_master_port}", f"--rdzv_id={spec.job_id}",
                  "--rdzv_backend=static"]
    extra = _split_extra(spec.extra_torchrun_params)
    flags = [*_without_flags(preset, _flag_names(extra)), *extra]
    argv = [launcher, *flags, *_torchrun_program(context.argv)]
    worker = WorkerPlan(TORCHRUN, tuple(argv), common_env(spec), logs={"task": str(spec.task_log_path)})
    # What torchrun will do, so read from its flags (MA_EXTRA_TORCHRUN_PARAMS may have replaced the preset ones).
    return Plan(TORCHRUN, why, (worker,), _flag_value(flags, "nnodes"), _flag_value(flags, "nproc_per_node"))


def _torchrun_program(argv: Sequence[str]) -> List[str]:
    """`python SCRIPT ARGS` -> `SCRIPT ARGS` (torchrun runs it with its Python); anything else, an interpreter
    named by its path included, runs as a program (`--no-python`), so the job's own interpreter runs it."""
    if len(argv) >= 2 and _PYTHON.match(argv[0]) and not argv[1].startswith("-"):
        return list(argv[1:])
    return ["--no-python", *argv]


def _split_extra(text: str) -> List[str]:
    """Split like a shell would, never evaluated."""
    try:
        return shlex.split(text or "")
    except ValueError as exc:
        raise ConfigError(f"MA_EXTRA_TORCHRUN_PARAMS cannot be split ({exc}): {text!r}",
                          hint="balance the quotes") from None


def _flag_name(token: str) -> Optional[str]:
    # torchrun takes --nproc-per-node and --nproc_per_node alike.
    return token[2:].split("=", 1)[0].replace("-", "_") if token.startswith("--") and len(token) > 2 else None


def _flag_names(tokens: Sequence[str]) -> set:
    return {name for name in map(_flag_name, tokens) if name}


def _without_flags(preset: Sequence[str], names: set) -> List[str]:
    """A flag the extra parameters name replaces the preset one instead of appearing twice."""
    return [token for token in preset if _flag_name(token) not in names]


def _flag_value(flags: Sequence[str], name: str) -> Size:
    """The value torchrun takes for `--<name>` from its own flags: `--name=V` or `--name V`, the last one given
    winning (argparse's rule); a count as a number, anything else as given."""
    value = ""
    for index, token in enumerate(flags):
        if _flag_name(token) != name:
            continue
        spelled, equals, value = token.partition("=")
        if not equals:
            following = flags[index + 1] if index + 1 < len(flags) else ""
            value = "" if following.startswith("-") else following
        if not value:
            raise ConfigError(f"MA_EXTRA_TORCHRUN_PARAMS gives {spelled} no value",
                              hint=f"write it {spelled}=VALUE")
    return int(value) if _COUNT.match(value) else value


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


def _check_node_rank(spec) -> None:
    if not 0 <= spec.task_index < spec.num_hosts:
        raise ConfigError(f"VC_TASK_INDEX={spec.task_index} is not below MA_NUM_HOSTS={spec.num_hosts}",
                          hint="this node's index counts from 0 among the job's nodes")


def _launcher(context: Context, name: str, package: str) -> str:
    """The launcher beside the command's Python first (installed with it, it runs with it), then on PATH."""
    folder = _python_folder(context)
    found = (folder and context.which(name, folder)) or context.which(name, context.environ.get("PATH"))
    if not found:
        where = f"not in {folder} beside {context.argv[0]}, not on PATH" if folder else "not on PATH"
        raise ConfigError(f"MA_RUN_METHOD={name}, but {name} is not installed ({where})",
                          hint=f"install it in the image: {package}")
    return found


def _python_folder(context: Context) -> Optional[str]:
    """The folder of the command's Python, named by its path or found on the job's PATH; None for other commands."""
    program = context.argv[0] if context.argv else ""
    if not _PYTHON.match(os.path.basename(program)):
        return None
    found = program if os.sep in program else context.which(program, context.environ.get("PATH", os.defpath))
    return os.path.dirname(os.path.abspath(found)) if found else None


# --------------------------------------------------------------------------- msrun


def _msrun(spec, context: Context, why: str) -> Plan:
    launcher = _launcher(context, "msrun", "mindspore (pip install mindspore)")
    argv = list(context.argv)
    if not (len(argv) >= 2 and _PYTHON.match(os.path.basename(argv[0])) and argv[1].endswith(".py")):
        raise ConfigError(f"msrun runs a Python script, and the command is {shlex.join(argv)!r}",
                          hint="give the command as `python SCRIPT.py ARGS...`")
    per_node = _per_node(spec)
    if spec.num_hosts > 1:
        _check_node_rank(spec)
    master = "127.0.0.1" if spec.num_hosts <= 1 else context.resolve(master_host(spec, context.environ))
    log_dir = spec.log_dir / "msrun" / f"attempt-{spec.proc_start_cnt}"
    command = [launcher, f"--worker_num={spec.num_hosts * per_node}", f"--local_worker_num={per_node}",
               f"--master_addr={master}", f"--node_rank={spec.task_index}",
               f"--master_port={spec.msrun_master_port}", f"--log_dir={log_dir}", "--join=True",
               f"--cluster_time_out={spec.msrun_cluster_time_out}",
               # No `tail -f` children: the runtime follows the rank logs itself, with rank prefixes. ("-1" means
               # all ranks; a rank that does not exist means none: msrun warns once per rank about it.)
               "--tail_worker_log=-2"]
    if spec.ms_ranktable_enable:
        if context.rank_table is None:
            raise ConfigError("MS_RANKTABLE_ENABLE=True, but there is no rank table to give msrun",
                              hint="set RANK_TABLE_FILE (the platform does on NPU jobs), or unset MS_RANKTABLE_ENABLE")
        command.append(f"--rank_table_file={context.rank_table.path}")
    command += argv[1:]
    env = {**common_env(spec), "PATH": _python_first(context)}
    worker = WorkerPlan(MSRUN, tuple(command), env, logs={"task": str(spec.task_log_path), "msrun": str(log_dir)})
    return Plan(MSRUN, why, (worker,), spec.num_hosts, per_node)


def _python_first(context: Context) -> str:
    """PATH with the command's Python first: msrun starts ranks with `python` from PATH, not its own."""
    path = context.environ.get("PATH", os.defpath)
    folder = _python_folder(context)
    if not folder:
        raise ConfigError(f"{context.argv[0]} is not on PATH", hint="name the job's interpreter by its full path")
    return os.pathsep.join([folder, *(part for part in path.split(os.pathsep) if part and part != folder)])


# --------------------------------------------------------------------------- warnings


def _preflight_rejection(spec, context: Context, plan: Plan) -> Optional[str]:
    """The accelerator check's certain failure, when the run's preflight would stop on it before this plan starts."""
    if not spec.preflight_enabled:
        return None
    failure = accelerator.foreseen(spec, context.environ, context.which)
    if failure is None or failure.item not in spec.preflight_checks or failure.item in spec.preflight_warn_only:
        return None
    advice = _without_accelerators(spec, plan, failure.code)
    return f"preflight will fail {failure.code}: {failure.hint}" + (f"; {advice}" if advice else "")


def _without_accelerators(spec, plan: Plan, code: str) -> str:
    """How to run this plan on a machine without accelerators, where that is what the job may want."""
    if spec.preflight_accelerator != "auto":
        return (f"MA_RUNTIME_PREFLIGHT_ACCELERATOR={spec.preflight_accelerator} asks for this check; "
                "set MA_RUNTIME_PREFLIGHT_ACCELERATOR=auto to let a CPU job skip it")
    if spec.num_gpus == 0 or code.endswith(".too-few"):
        return ""  # the check's own hint says what to fix
    if plan.method in (TORCHRUN, MSRUN):
        count = plan.processes_per_node if isinstance(plan.processes_per_node, int) else "N"
        return (f"to run {count} processes per node on CPUs instead, set MA_NUM_GPUS=0 "
                f"MA_RUNTIME_NPROC_PER_NODE={count}")
    return "to run on CPUs instead, set MA_NUM_GPUS=0"


def render(document: Mapping[str, Any]) -> str:
    """The plan for a terminal: the method, then each process's command line, environment and logs."""
    lines = [f"method: {document['method']} ({document['why']})",
             f"nodes: {document['nodes']}, processes per node: {document['processes_per_node']}"]
    lines += [f"warning: {warning}" for warning in document["warnings"]]
    for worker in document["workers"]:
        lines.append(f"\n[{worker['name']}] {shlex.join(worker['argv'])}")
        lines += [f"  env  {name}={value}" for name, value in worker["env"].items()]
        if worker["cwd"]:
            lines.append(f"  cwd  {worker['cwd']}")
        lines += [f"  log  {kind}: {path}" for kind, path in worker["logs"].items()]
    return "\n".join(lines) + "\n"
