"""The variables every multi-node script needs (MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK, NPUS_PER_NODE), given
by the runtime to a plain command, and dynamic routing's node rank and master (launch/role.py), across two network
namespaces (ma_runtime/local/nodes.py, test_multinode.py's NodePair).

The command is a script in the AscendSpeed shape (jobs/ascendspeed_pretrain.sh) driving a real torchrun with gloo;
no variable of the job is set by hand. With ROUTE_PLAN=true, task 1 has RANK_AFTER_ACC=0: it is the master, its
runtime hosts the job's coordination store and its torchrun runs rank 0.
"""

from tests.conftest import free_port
from tests.e2e import test_multinode as multinode
from tests.e2e.test_launchers import JOBS, TORCH_BIN, needs_torch
from tests.e2e.test_multinode import JOB, needs_namespaces, node_env

node_pair = multinode.node_pair  # the fixture: two nodes, removed whatever the outcome

SCRIPT = JOBS / "ascendspeed_pretrain.sh"


def run_script(pair, job_env, tmp_path, by_node=None):
    """Both nodes run the script under `ma-run` (plain); by_node: {node: its own extra variables}."""
    by_node = by_node or {}
    port = free_port()
    for node in (0, 1):
        env = node_env(pair, job_env, tmp_path, node, TORCH_BIN, MA_RUN_METHOD="plain", MA_NUM_GPUS=1,
                       MA_TORCHRUN_MASTER_PORT=port, **by_node.get(node, {}))
        for name in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "NPUS_PER_NODE"):
            assert name not in env  # nothing by hand
        pair.start(node, env, ["bash", str(SCRIPT)])
    codes = pair.wait(timeout=180)
    outputs = [pair.outputs[node].read_text(errors="replace") for node in (0, 1)]
    errors = [pair.outputs[node].with_suffix(".err").read_text(errors="replace") for node in (0, 1)]
    return codes, outputs, errors, port


@needs_namespaces
@needs_torch
def test_a_plain_ascendspeed_script_all_reduces_across_two_nodes_without_hand_set_variables(job_env, tmp_path,
                                                                                          node_pair):
    codes, outputs, _, port = run_script(node_pair, job_env, tmp_path)

    report = node_pair.report()
    assert codes == [0, 0], report
    for node in (0, 1):
        assert f"node_rank={node} master={node_pair.hosts[0]}:{port} world_size=2" in outputs[node], report
        assert f"rank {node} of 2: all_reduce=3.0" in outputs[node], report


@needs_namespaces
@needs_torch
def test_route_plan_makes_task_1_with_rank_after_acc_0_the_master(job_env, tmp_path, node_pair):
    routing = {"ROUTE_PLAN": "true", "MA_MASTER_INDEX": "1"}
    codes, outputs, errors, port = run_script(node_pair, job_env, tmp_path, {0: {**routing, "RANK_AFTER_ACC": "1"},
                                                                             1: {**routing, "RANK_AFTER_ACC": "0"}})

    report = node_pair.report()
    assert codes == [0, 0], report
    master = f"{JOB}-worker-1.{JOB}"  # ${MA_VJ_NAME}-${MA_TASK_NAME}-${MA_MASTER_INDEX}.${MA_VJ_NAME}
    for task, rank in ((0, 1), (1, 0)):
        assert f"node_rank={rank} master={master}:{port}" in outputs[task], report
        assert f"rank {rank} of 2: all_reduce=3.0" in outputs[task], report
    # The job's coordinator follows the same rule: the master's runtime hosts the store.
    assert "coordination store started" in errors[1] and "coordination store started" not in errors[0], report


