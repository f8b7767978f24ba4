"""This node in the rank table: its instance (by pod name, else IP, else task index) and its devices with their
ranks and logical ids."""

from typing import Mapping, Tuple

from ma_runtime import spec
from ma_runtime.launch.role import node_rank_of
from ma_runtime.stages.ranktable.model import Instance, LocalDevice, NodeView, Ranked, RankTableError

# What identifies this pod, read here rather than from the JobSpec: it names the pod, it does not configure the
# job (a job file every node shares cannot say which pod it is, and no flag sets it). The task index and the card
# count are settings: read through spec's rule (spec.value_from).
POD_NAME_VARIABLES = ("MA_CURRENT_INSTANCE_NAME", "HOSTNAME")
POD_IP_VARIABLE = "MA_CURRENT_IP"


def node_view(ranked: Ranked, environ: Mapping[str, str], hostname: str = "") -> NodeView:
    """This node's instance and devices; RankTableError when it is not in the table or has too few devices."""
    instance, matched_by = _find_node(ranked, environ, hostname)
    by_physical = sorted(instance.devices, key=lambda d: int(d.device_id))
    logical = {device.device_id: position for position, device in enumerate(by_physical)}
    devices = tuple(LocalDevice(logical[d.device_id], d.device_id, int(d.rank_id or 0), d.device_ip)
                    for d in instance.devices)
    wanted = spec.value_from("num_gpus", environ)
    if wanted and wanted > len(devices):
        raise RankTableError(f"MA_NUM_GPUS={wanted}, but the rank table gives this node ({instance.server_id}) "
                             f"{len(devices)} device(s)",
                             hint="the job's flavour and its rank table disagree; check the NPU resources")
    return NodeView(instance.server_id, instance.pod_name, matched_by, devices, ranked.rank_size)


def _find_node(ranked: Ranked, environ: Mapping[str, str], hostname: str) -> Tuple[Instance, str]:
    pod_name = next((environ[name] for name in POD_NAME_VARIABLES if environ.get(name)), hostname)
    for instance in ranked.instances:
        if pod_name and instance.pod_name == pod_name:
            return instance, "pod name"
    current_ip = environ.get(POD_IP_VARIABLE, "")
    matches = [instance for instance in ranked.instances if current_ip and instance.server_id == current_ip]
    if len(matches) == 1:
        return matches[0], "MA_CURRENT_IP"
    # This node's rank (launch/role.py's rule: RANK_AFTER_ACC under dynamic routing, else VC_TASK_INDEX or its
    # fallbacks), its variables read through spec's one rule: the table lists the pods in rank order.
    index, variable = node_rank_of(bool(spec.value_from("route_plan", environ)),
                                   spec.value_from("rank_after_acc", environ), spec.value_from("task_index", environ))
    if index is not None and 0 <= index < len(ranked.instances):
        return ranked.instances[index], variable
    if index is None and len(ranked.instances) == 1:
        return ranked.instances[0], "the only pod"  # a local run: no task index, one pod
    raise RankTableError(
        f"this node is not in the rank table: no pod named {pod_name or '(unknown)'}, no server "
        f"{current_ip or '(MA_CURRENT_IP unset)'}, and {variable}={index if index is not None else '(unset)'} "
        f"is not below its {len(ranked.instances)} pod(s)",
        hint="the rank table is for another job, or this pod's environment is incomplete",
    )

