"""The plain launch: the command once, as given.

It forwards nothing: the command is the launcher, and the supervisor's one
signal to its process group is the stop. Its exit code is its own, and its
output comes through the runtime's pipes.
"""


from ma_runtime.errors import ConfigError
from ma_runtime.launch.base import (
    Context,
    Launcher,
    Plan,
    WorkerPlan,
    common_env,
    per_node,
)
from ma_runtime.launch.role import JobVariables


class Plain(Launcher):
    """Every trait but `build` is the default: one process, its exit code its own, nothing forwarded."""

    NAME = "plain"
    TAKES_NPROC_PER_NODE = False  # one process; a setting that asks for more is an error

    def build(self, spec, context: Context, why: str) -> Plan:
        if spec.nproc_per_node not in (None, 1):
            raise ConfigError(f"MA_RUNTIME_NPROC_PER_NODE={spec.nproc_per_node} asks for {spec.nproc_per_node} "
                              f"processes per node, but the plain launch starts one ({why})",
                              hint="set MA_RUN_METHOD=torchrun or msrun to start several processes per node, or "
                                   "unset MA_RUNTIME_NPROC_PER_NODE")
        worker = WorkerPlan("command", tuple(context.argv), common_env(spec, context.attempt),
                            logs={"task": str(spec.task_log_path)})
        return Plan(self.NAME, why, (worker,), spec.num_hosts, 1)

    def job_variables(self, spec, context: Context, plan: Plan) -> JobVariables:
        """Per node, the processes the command's own launcher should start: one per card (MA_NUM_GPUS, at
        least 1), as the platform's DDP scripts take NGPUS_PER_NODE from MA_NUM_GPUS."""
        return JobVariables(plan.node.master, spec.torchrun_master_port, spec.num_hosts, plan.node.node_rank,
                            per_node(spec))


LAUNCHER = Plain()
