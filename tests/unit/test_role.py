"""This node's rank and the master (launch/role.py, the one rule), and the variables every command gets.

Each case of the rule as plans show it (`ma-runtime plan --json`'s `node`, the launchers' flags, the commands'
MASTER_ADDR/NODE_RANK/...): no dynamic routing; ROUTE_PLAN=true on Snt9b (MA_MASTER_INDEX set) and on Snt9b23
(unset: the first of VC_WORKER_HOSTS); RANK_AFTER_ACC without ROUTE_PLAN; contradicting variables (78). The job's
own MASTER_ADDR and the like win over the runtime's. Nothing here needs torchrun, msrun or DNS.
"""

import pytest

from ma_runtime.errors import ConfigError, ExitCode
from ma_runtime.launch import plan, role
from ma_runtime.stages.ranktable import node as table_node
from tests.unit import test_plan as plans
from tests.unit.test_plan import HOSTS, TWO_BY_EIGHT, VJ, build, job_variables, prepared

job = plans.job  # the fixture: job(**variables) -> (JobSpec, environ)

THREE = ",".join(HOSTS[:3])
SNT9B = {"ROUTE_PLAN": "true", "MA_MASTER_INDEX": 1}  # the master is task 1


def three_nodes(job, **variables):
    base = {"MA_NUM_HOSTS": 3, "MA_NUM_GPUS": 8, "MA_VJ_NAME": VJ, "VC_WORKER_HOSTS": THREE}
    base.update(variables)
    return job(**{name: value for name, value in base.items() if value is not None})


def test_without_dynamic_routing_the_rank_is_the_task_index_and_the_master_the_first_host(job):
    job_spec, _ = three_nodes(job, VC_TASK_INDEX=2, RANK_AFTER_ACC=0)  # RANK_AFTER_ACC alone: not routing
    node = role.role(job_spec)
    assert (node.node_rank, node.master, node.rank_from, node.master_from, node.is_master) == (
        2, HOSTS[0], "VC_TASK_INDEX", "VC_WORKER_HOSTS", False)


def test_one_node_is_rank_0_and_its_own_master_on_localhost(job):
    job_spec, _ = job(ROUTE_PLAN="true", RANK_AFTER_ACC=0)
    assert role.role(job_spec).to_dict() == {"rank": 0, "master": "localhost", "rank_from": "one node",
                                             "master_from": "one node", "master_task": 0}


def test_route_plan_on_snt9b_the_master_is_master_index_s_node_and_ranks_follow_rank_after_acc(job):
    masters = []
    for task, after in ((0, 2), (1, 0), (2, 1)):
        job_spec, environ = three_nodes(job, MA_RUN_METHOD="torchrun", VC_TASK_INDEX=task, RANK_AFTER_ACC=after,
                                        **SNT9B)
        result = build(job_spec, environ)
        node = result.node
        assert (node.node_rank, node.rank_from, node.master_from, node.master_task) == (
            after, "RANK_AFTER_ACC", "MA_MASTER_INDEX", 1)
        argv = result.workers[0].argv
        assert f"--node_rank={after}" in argv and f"--master_addr={VJ}-worker-1.{VJ}" in argv
        assert result.workers[0].env.items() >= job_variables(f"{VJ}-worker-1.{VJ}", 18888, 3, after, 8).items()
        assert result.to_dict()["node"]["rank"] == after
        masters.append(node.is_master)
    assert masters == [False, True, False]  # task 1, RANK_AFTER_ACC=0: the master


def test_route_plan_on_snt9b23_the_master_is_the_first_host(job):
    job_spec, environ = three_nodes(job, MA_RUN_METHOD="msrun", VC_TASK_INDEX=0, ROUTE_PLAN="true", RANK_AFTER_ACC=2)
    result = build(job_spec, environ, ["/opt/venv/bin/python", "train.py"], resolve=lambda host: f"ip-of-{host}")
    assert (result.node.node_rank, result.node.master, result.node.master_from) == (2, HOSTS[0], "VC_WORKER_HOSTS")
    assert "--node_rank=2" in result.workers[0].argv and f"--master_addr=ip-of-{HOSTS[0]}" in result.workers[0].argv
    # The command's MASTER_ADDR is what msrun is given: the IP.
    assert result.workers[0].env["MASTER_ADDR"] == f"ip-of-{HOSTS[0]}"
    assert result.workers[0].env["NODE_RANK"] == "2"


def test_route_plan_without_rank_after_acc_keeps_the_task_index(job):
    job_spec, environ = three_nodes(job, MA_RUN_METHOD="pytorch-gpu", VC_TASK_INDEX=2, ROUTE_PLAN="true")
    result = build(job_spec, environ)
    assert result.workers[0].argv[-6:] == ("--init_method", f"tcp://{HOSTS[0]}:29500", "--rank", "2",
                                           "--world_size", "3")
    assert result.node.rank_from == "VC_TASK_INDEX"


@pytest.mark.parametrize("variables, words", [
    ({"RANK_AFTER_ACC": 3}, "RANK_AFTER_ACC=3 is not below MA_NUM_HOSTS=3"),
    ({"RANK_AFTER_ACC": 1, "MA_MASTER_INDEX": 2}, "MA_MASTER_INDEX=2 names task 2"),  # task 2 must be rank 0
    ({"RANK_AFTER_ACC": 0, "MA_MASTER_INDEX": 1}, "RANK_AFTER_ACC=0 on task 2"),  # two masters
    ({"RANK_AFTER_ACC": 0, "MA_MASTER_INDEX": 3}, "MA_MASTER_INDEX=3 is not below MA_NUM_HOSTS=3"),
    ({"RANK_AFTER_ACC": 0, "MA_MASTER_INDEX": 2, "MA_VJ_NAME": None}, "MA_VJ_NAME is unset"),
])
def test_contradicting_routing_variables_are_one_configuration_error(job, variables, words):
    job_spec, environ = three_nodes(job, MA_RUN_METHOD="torchrun", VC_TASK_INDEX=2, ROUTE_PLAN="true", **variables)
    with pytest.raises(ConfigError) as caught:
        build(job_spec, environ)
    assert words in caught.value.reason
    assert caught.value.exit_code == ExitCode.BAD_CONFIGURATION


def test_mpirun_under_route_plan_runs_on_the_master_with_its_ranks_first(job):
    from tests.unit.test_mpirun import Reach

    job_spec, environ = three_nodes(job, MA_RUN_METHOD="mpirun", VC_TASK_INDEX=1, RANK_AFTER_ACC=0, **SNT9B,
                                    MA_NUM_GPUS=1)
    reach = Reach()
    result = plan.build(job_spec, plan.Context(["python", "t.py"], environ, which=lambda name, path=None:
                                               f"/opt/bin/{name}", reach=reach))
    assert result.workers[0].name == "mpirun"
    assert [host for host, _ in reach.asked[0]] == [HOSTS[1], HOSTS[0], HOSTS[2]]


def test_the_rank_table_node_is_found_by_rank_after_acc_when_the_pod_is_not_named(job, tmp_path):
    job_spec, environ = job(MA_NUM_HOSTS=2, MA_NUM_GPUS=8, VC_TASK_INDEX=1, ROUTE_PLAN="true", RANK_AFTER_ACC=0,
                            RANK_TABLE_FILE=tmp_path / "config")
    table = prepared(tmp_path, job_spec, environ, TWO_BY_EIGHT)
    view = table_node.node_view(table.ranked, environ, hostname="not-a-pod")
    assert (view.matched_by, [d.rank_id for d in view.devices]) == ("RANK_AFTER_ACC", list(range(8)))


def test_every_command_gets_the_job_variables_unless_the_job_sets_them(job):
    job_spec, environ = three_nodes(job, VC_TASK_INDEX=1, MASTER_PORT=6000, NPUS_PER_NODE=4)
    (worker,) = build(job_spec, environ, ["bash", "run.sh"]).workers
    assert worker.env.items() >= {"MASTER_ADDR": HOSTS[0], "NNODES": "3", "NODE_RANK": "1", "GPUS_PER_NODE": "8",
                                  "NPROC_PER_NODE": "8"}.items()
    assert "MASTER_PORT" not in worker.env and "NPUS_PER_NODE" not in worker.env  # the job's own stay
    assert plan.kept_variables(environ) == ("MASTER_PORT", "NPUS_PER_NODE")


def test_torchrun_s_job_variables_follow_its_flags_extra_params_included(job):
    job_spec, environ = three_nodes(job, MA_RUN_METHOD="torchrun", VC_TASK_INDEX=1,
                                    MA_EXTRA_TORCHRUN_PARAMS="--master_port=29999 --nproc_per_node=2")
    env = build(job_spec, environ).workers[0].env
    assert env.items() >= job_variables(HOSTS[0], 29999, 3, 1, 2).items()


def test_tensorflow_gpu_has_no_job_wide_rank(job):
    job_spec, environ = job(MA_RUN_METHOD="tensorflow-gpu", MA_NUM_HOSTS=2, TF_PS_HOSTS="[ps-0:2222]",
                            TF_WORKER_HOSTS="[w-0:2222,w-1:2222]", MA_TASK_NAME="worker", VC_TASK_INDEX=1)
    result = build(job_spec, environ)
    assert result.node is None and "NODE_RANK" not in result.workers[0].env
