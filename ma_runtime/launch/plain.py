"""The plain launch: the command once, as given.

It forwards nothing: the command is the launcher, and the supervisor's one
signal to its process group is the stop. Its exit code is its own, and its
output comes through the runtime's pipes.
"""


from ma_runtime.errors import ConfigError
from ma_runtime.launch.base import (
    Context,
    Plan,
    WorkerPlan,
    common_env,
    forwards_nothing,
    no_rank_logs,
    no_root_cause,
)

NAME = "plain"
TAKES_NPROC_PER_NODE = False  # one process; a setting that asks for more is an error
OWN_CODE_AFTER_STOP = True  # after a stop: the command's own


def build(spec, context: Context, why: str) -> Plan:
    if spec.nproc_per_node not in (None, 1):
        raise ConfigError(f"MA_RUNTIME_NPROC_PER_NODE={spec.nproc_per_node} asks for {spec.nproc_per_node} processes "
                          f"per node, but the plain launch starts one ({why})",
                          hint="set MA_RUN_METHOD=torchrun or msrun to start several processes per node, or unset "
                               "MA_RUNTIME_NPROC_PER_NODE")
    worker = WorkerPlan("command", tuple(context.argv), common_env(spec, context.attempt),
                        logs={"task": str(spec.task_log_path)})
    return Plan(NAME, why, (worker,), spec.num_hosts, 1)


forwards_to, root_cause, rank_logs = forwards_nothing, no_root_cause, no_rank_logs
