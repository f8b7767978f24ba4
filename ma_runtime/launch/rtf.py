"""The rank-table launch (RTF): one process per device the rank table gives this node.

Each rank is the runtime's own worker, in its own process group: no launcher
stands between, so nothing forwards a stop (the supervisor signals each group
once), each exit code is the rank's own, and each rank's output comes through
the runtime's pipes (and into its proc log).
"""

import re

from ma_runtime.errors import ConfigError
from ma_runtime.launch.base import (
    RANK_VARIABLES,
    Context,
    Launcher,
    Plan,
    WorkerPlan,
    common_env,
)


class Rtf(Launcher):
    NAME = "rtf"
    TAKES_NPROC_PER_NODE = False  # the rank table's count; a setting that asks for another is an error
    OWN_CODE_AFTER_STOP = True  # after a stop: each rank's own
    WORKERS = re.compile(r"rank-\d+\Z")  # one per rank: `rank-<RANK_ID>`
    # RANK_ID is what it sets; RANK may be a pod-wide value the scheduler exports to every process.
    RANK_VARIABLES = ("RANK_ID", *(name for name in RANK_VARIABLES if name != "RANK_ID"))

    def build(self, spec, context: Context, why: str) -> Plan:
        return _plan(self.NAME, spec, context, why)


LAUNCHER = Rtf()


def _plan(name: str, spec, context: Context, why: str) -> Plan:
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
    workers = [_rank(spec, context, prepared, device) for device in node.devices]
    return Plan(name, why, tuple(workers), spec.num_hosts, len(workers))


def _rank(spec, context: Context, prepared, device) -> WorkerPlan:
    logical = str(device.logical_id)
    env = {
        **common_env(spec, context.attempt),
        "RANK_TABLE_FILE": str(prepared.path),
        "RANK_ID": str(device.rank_id),
        "RANK_SIZE": str(prepared.node.rank_size),
        # Logical ids, as the container numbers its visible devices (ACL, MindSpore's
        # set_context(device_id=...)); the physical id is in the rank table.
        "ASCEND_DEVICE_ID": logical,
        "DEVICE_ID": logical,
        "JOB_ID": spec.job_id,
        # The platform's layout (docs/platform.md, "Logs"): the log sync mirrors MA_LOG_DIR as it is.
        "ASCEND_PROCESS_LOG_PATH": str(spec.log_dir / f"modelarts-job-{spec.job_id}" / "ascend" / "process_log"
                                       / f"rank_{device.rank_id}"),
    }
    proc_log = spec.log_dir / f"modelarts-job-{spec.job_id}-proc-rank-{device.rank_id}-device-{logical}.txt"
    return WorkerPlan(f"rank-{device.rank_id}", tuple(context.argv), env, logs={"proc": str(proc_log)},
                      rank=device.rank_id)
