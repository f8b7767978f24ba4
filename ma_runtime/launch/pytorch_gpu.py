"""The PyTorch-GPU preset: the command once per node, with the platform's `--init_method` appended, and on
several nodes `--rank` and `--world_size` too.

The platform's forms (docs/platform.md, "PyTorch-GPU preset"):
- one node:  `<command> --init_method tcp://<worker-0>:<port>`;
- several:   `<command> --init_method tcp://<worker-0>:<port> --rank <VC_TASK_INDEX> --world_size <MA_NUM_HOSTS>`.
`--world_size` is the NODE count and `--rank` the node's index: the boot file starts its own processes (the
platform's sample mp.spawns one per GPU and multiplies both by its GPU count), so the runtime starts the command
once whatever MA_NUM_GPUS says.

Worker-0 (D36): 127.0.0.1 on one node (nothing to resolve, the rendezvous stays in the container); on several,
the master's name (launch/role.py), which torch resolves itself when it connects. The port is
MA_RUNTIME_INIT_METHOD_PORT: the platform's documents give none.

It forwards nothing: what the command spawns stays in its process group, which the supervisor signals once; the
exit code is the command's own.
"""

from typing import List

from ma_runtime.launch.args import append_words
from ma_runtime.launch.base import (
    Context,
    Launcher,
    Plan,
    WorkerPlan,
    check_once_per_node,
    common_env,
    per_node,
)
from ma_runtime.launch.role import JobVariables, role
from ma_runtime.setting import Setting, port

# This launcher's own settings: spec's table collects them through launch.registry (setting.py: a row).
SETTINGS = (
    Setting("init_method_port", "MA_RUNTIME_INIT_METHOD_PORT", port, "the port of pytorch-gpu's --init_method "
            "(PyTorch's usual MASTER_PORT)", 29500, cli=False, owner=__name__),
)
LOCAL_HOST = "127.0.0.1"


class PytorchGpu(Launcher):
    NAME = "pytorch-gpu"
    TAKES_NPROC_PER_NODE = False  # the boot file's own mp.spawn decides; a setting that asks for more is an error
    OWN_CODE_AFTER_STOP = True  # after a stop: the command's own

    def build(self, spec, context: Context, why: str) -> Plan:
        check_once_per_node(spec, why, "the boot file starts its own processes (mp.spawn, one per GPU)")
        argv = append_words(context.argv, preset_arguments(spec, context))
        worker = WorkerPlan("command", tuple(argv), common_env(spec, context.attempt),
                            logs={"task": str(spec.task_log_path)})
        return Plan(self.NAME, why, (worker,), spec.num_hosts, 1)

    def job_variables(self, spec, context: Context, plan: Plan) -> JobVariables:
        """The --init_method's host and port; per node, the processes the boot file starts (one per card)."""
        master = LOCAL_HOST if spec.num_hosts <= 1 else plan.node.master
        return JobVariables(master, spec.init_method_port, spec.num_hosts, plan.node.node_rank, per_node(spec))


LAUNCHER = PytorchGpu()


def preset_arguments(spec, context: Context) -> List[str]:
    if spec.num_hosts <= 1:
        return ["--init_method", f"tcp://{LOCAL_HOST}:{spec.init_method_port}"]
    node = role(spec)
    address = f"tcp://{node.need_master()}:{spec.init_method_port}"
    return ["--init_method", address, "--rank", str(node.node_rank), "--world_size", str(spec.num_hosts)]
