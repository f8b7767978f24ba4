"""msrun: MindSpore's launcher, its flags from the job, and where its ranks write their output.

It forwards no stop to its ranks (read in MindSpore 2.10's
mindspore/parallel/cluster/process_entity/_api.py):
- each rank is started with `Popen(..., preexec_fn=os.setsid)`, in a session of
  its own, outside msrun's process group, its output sent to
  `<log_dir>/worker_<rank>.log` only;
- msrun installs no SIGTERM handler: a SIGTERM ends msrun at once and its ranks
  get nothing;
- its only handler, SIGINT's (installed by `join_processes`, with --join=True),
  sends SIGKILL to each running rank's process group and to the scheduler, then
  exits 0: no stop signal a rank could handle.
So the supervisor signals the ranks itself, and the rank logs are followed
from `rank_logs`. Each attempt writes to its own folder, `msrun/attempt-<N>`.
"""

import itertools
import os
import re
import shlex
from typing import Optional

from ma_runtime.errors import ConfigError
from ma_runtime.launch.base import (
    PYTHON,
    RANK_VARIABLES,
    Context,
    Helper,
    Launcher,
    Machinery,
    Plan,
    WorkerPlan,
    common_env,
    find_launcher,
    per_node,
    python_folder,
)
from ma_runtime.launch.role import JobVariables, role
from ma_runtime.setting import WEEK_SECONDS, Setting, integer, port, switch

# This launcher's own settings: spec's table collects them through launch.registry (setting.py: a row).
SETTINGS = (
    Setting("ms_ranktable_enable", "MS_RANKTABLE_ENABLE", switch, "give msrun --rank_table_file", False, cli=False,
            owner=__name__),
    Setting("msrun_cluster_time_out", "MSRUN_CLUSTER_TIME_OUT", integer(1, WEEK_SECONDS), "msrun's "
            "--cluster_time_out, seconds", 600, cli=False, owner=__name__),
    Setting("msrun_master_port", "MA_RUNTIME_MSRUN_MASTER_PORT", port, "msrun's --master_port (its own "
            "default)", 8118, cli=False, owner=__name__),
)
_RANK_LOGS = "msrun"  # the worker's logs key for the folder of its ranks' logs


class Msrun(Launcher):
    NAME = "msrun"
    TAKES_NPROC_PER_NODE = True
    # After a stop: msrun's SIGINT handler kills the ranks and exits 0; a SIGTERM kills msrun itself.
    OWN_CODE_AFTER_STOP = False
    WORKERS = re.compile(r"msrun\Z")
    # Its ranks get RANK_ID; RANK may be a pod-wide value the scheduler exports to every process.
    RANK_VARIABLES = ("RANK_ID", *(name for name in RANK_VARIABLES if name != "RANK_ID"))
    # msrun and the scheduler it starts, which runs the user's script with MS_ROLE=MS_SCHED in its environment.
    MACHINERY = Machinery(scripts=frozenset({"msrun"}), modules=frozenset({"mindspore.parallel.cluster.run"}),
                          helper=Helper("MS_ROLE", "MS_SCHED", "msrun's scheduler"))

    # forwards_to, root_cause: none (see the module docstring: SIGTERM reaches no rank, SIGINT only SIGKILLs them;
    # no summary names a rank).

    def build(self, spec, context: Context, why: str) -> Plan:
        return _plan(self.NAME, spec, context, why)

    def job_variables(self, spec, context: Context, plan: Plan) -> JobVariables:
        """What msrun is given: the master's IP (its --master_addr) and --master_port."""
        flags = itertools.takewhile(lambda token: token.startswith("--"), plan.workers[0].argv[1:])  # to the script
        given = dict(token[2:].split("=", 1) for token in flags if "=" in token)
        return JobVariables(given["master_addr"], spec.msrun_master_port, spec.num_hosts, plan.node.node_rank,
                            plan.processes_per_node)

    def rank_logs(self, plan: Plan) -> Optional[str]:
        """The folder the ranks write `worker_<rank>.log` to."""
        return plan.workers[0].logs.get(_RANK_LOGS)


LAUNCHER = Msrun()


def _plan(name: str, spec, context: Context, why: str) -> Plan:
    launcher = find_launcher(context, "msrun", "mindspore (pip install mindspore)")
    argv = list(context.argv)
    if not (len(argv) >= 2 and PYTHON.match(os.path.basename(argv[0])) and argv[1].endswith(".py")):
        raise ConfigError(f"msrun runs a Python script, and the command is {shlex.join(argv)!r}",
                          hint="give the command as `python SCRIPT.py ARGS...`")
    count = per_node(spec)
    node = role(spec)
    master = "127.0.0.1" if spec.num_hosts <= 1 else context.resolve(node.need_master())
    log_dir = spec.log_dir / "msrun" / f"attempt-{context.attempt}"
    command = [launcher, f"--worker_num={spec.num_hosts * count}", f"--local_worker_num={count}",
               f"--master_addr={master}", f"--node_rank={node.node_rank}",
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
    env = {**common_env(spec, context.attempt), "PATH": _python_first(context)}
    worker = WorkerPlan(name, tuple(command), env, logs={"task": str(spec.task_log_path), _RANK_LOGS: str(log_dir)})
    return Plan(name, why, (worker,), spec.num_hosts, count, node=node)


def _python_first(context: Context) -> str:
    """PATH with the command's Python first: msrun starts ranks with `python` from PATH, not its own."""
    path = context.environ.get("PATH", os.defpath)
    folder = python_folder(context)
    if not folder:
        raise ConfigError(f"{context.argv[0]} is not on PATH", hint="name the job's interpreter by its full path")
    return os.pathsep.join([folder, *(part for part in path.split(os.pathsep) if part and part != folder)])
