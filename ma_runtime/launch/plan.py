"""From the job to the processes to start: a pure function, printed by `ma-runtime plan --json`.

The method (README, "Launchers"):
- `MA_RUN_METHOD` (env or job file `run_method`) names it: `torchrun`, `msrun`, `mpirun`, the
  platform's GPU presets `pytorch-gpu` and `tensorflow-gpu` (the command with the arguments they append), or
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

Each method is one module (plain, rtf, torchrun, msrun, mpirun, pytorch_gpu, tensorflow_gpu; their interface in
base.py), found through registry.py; this module chooses the method, asks its
module for the plan, and adds the warnings. The names other modules import from
here (Plan, Context, the method names, ...) are re-exported from base.py.

`warnings` holds what will go wrong although a plan can be made: the preflight
failure that is certain from the device nodes and PATH (util/accelerators.py
decides, no tool runs), when the run's preflight would stop on it.
"""

import dataclasses
import shlex
from typing import Any, Mapping, Optional, Tuple

from ma_runtime.launch import registry, role
from ma_runtime.launch.base import Context, Plan, Size, WorkerPlan, common_env
from ma_runtime.util import accelerators

__all__ = ["RTF", "TORCHRUN", "MSRUN", "PLAIN", "METHODS", "Context", "Plan", "Size", "WorkerPlan", "common_env",
           "choose", "build", "render", "kept_variables"]
RTF, TORCHRUN, MSRUN, PLAIN = "rtf", "torchrun", "msrun", "plain"
METHODS = registry.METHODS


# --------------------------------------------------------------------------- choosing


def choose(spec) -> Tuple[str, str]:
    """(method, why)."""
    if spec.run_method:
        return spec.run_method, f"MA_RUN_METHOD={spec.run_method}"
    if spec.ranktable_file is not None:
        return RTF, "an NPU job (RANK_TABLE_FILE is set) and MA_RUN_METHOD is unset"
    if accelerators.count_nodes(accelerators.NPU_KIND, accelerators.node_names(spec.preflight_dev_dir)):
        return RTF, f"an NPU job (davinci<N> device nodes in {spec.preflight_dev_dir}) and MA_RUN_METHOD is unset"
    return PLAIN, "not an NPU job and MA_RUN_METHOD is unset: the command runs once"


def build(spec, context: Context) -> Plan:
    method, why = choose(spec)
    launcher = registry.launcher(method)
    plan = launcher.build(spec, context, why)
    if launcher.JOB_WIDE_RANK:
        plan = dataclasses.replace(plan, node=plan.node or role.role(spec))
        plan = _with_job_variables(plan, launcher.job_variables(spec, context, plan).env(), context.environ)
    rejection = _preflight_rejection(spec, context, plan)
    # What the launcher's build found wrong while planning (a launcher not installed), then preflight's certain failure.
    return dataclasses.replace(plan, warnings=(*context.warnings, *([rejection] if rejection else [])))


def _with_job_variables(plan: Plan, variables: Mapping[str, str], environ: Mapping[str, str]) -> Plan:
    """Every worker given the job's variables (role.JobVariables) that the job does not set itself: a value the
    job gave (or its pre-start hook exported) wins. A launcher's own value for a name wins too."""
    given = {name: value for name, value in variables.items() if name not in environ}
    workers = tuple(dataclasses.replace(worker, env={**given, **worker.env}) for worker in plan.workers)
    return dataclasses.replace(plan, workers=workers)


def kept_variables(environ: Mapping[str, str]) -> Tuple[str, ...]:
    """The names of the job's variables (role.JobVariables) the job sets itself, which the runtime leaves as they
    are (the run logs them once)."""
    return tuple(name for name in role.JOB_VARIABLE_NAMES if name in environ)


# --------------------------------------------------------------------------- warnings


def _preflight_rejection(spec, context: Context, plan: Plan) -> Optional[str]:
    """The accelerator check's certain failure, when the run's preflight would stop on it before this plan starts."""
    if not spec.preflight_enabled:
        return None
    failure = accelerators.foreseen(spec, context.environ, context.which)
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
    if registry.launcher(plan.method).TAKES_NPROC_PER_NODE:
        count = plan.processes_per_node if isinstance(plan.processes_per_node, int) else "N"
        return (f"to run {count} processes per node on CPUs instead, set MA_NUM_GPUS=0 "
                f"MA_RUNTIME_NPROC_PER_NODE={count}")
    return "to run on CPUs instead, set MA_NUM_GPUS=0"


def render(document: Mapping[str, Any]) -> str:
    """The plan for a terminal: the method, then each process's command line, environment and logs."""
    lines = [f"method: {document['method']} ({document['why']})",
             f"nodes: {document['nodes']}, processes per node: {document['processes_per_node']}"]
    lines += [f"warning: {warning}" for warning in document["warnings"]]
    services = [{**service, "name": f"service {service['name']}"} for service in document.get("services", ())]
    for worker in [*services, *document["workers"]]:
        lines.append(f"\n[{worker['name']}] {shlex.join(worker['argv'])}")
        lines += [f"  env  {name}={value}" for name, value in worker["env"].items()]
        if worker["cwd"]:
            lines.append(f"  cwd  {worker['cwd']}")
        lines += [f"  log  {kind}: {path}" for kind, path in worker["logs"].items()]
        for path, text in worker.get("files", {}).items():
            lines.append(f"  file {path}")
            lines += [f"       {line}" for line in text.splitlines()]
    return "\n".join(lines) + "\n"
