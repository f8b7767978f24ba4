"""Ray (MA_RUN_METHOD=ray): the platform's documented Ray bootstrap (a shell loop users paste) done by the runtime.

The nodes (docs/guides/launchers.md, "ray"):
- every node runs its Ray node as the job's service (`children.start_service`), started once per run after the
  hooks, alive across attempts, stopped gracefully when the run ends: the keeper of ray_node.py running
  `ray start --block`. Worker-0 (VC_TASK_INDEX 0) starts the head on MA_RUNTIME_RAY_PORT (6379, Ray's default) and
  waits, bounded, until it answers; every other node first waits for the head with the peers wait (81 naming
  worker-0), then joins it (`ray start --address=<worker-0>:<port>`). Each node offers its accelerators: `NPU`
  from MA_NUM_GPUS on an NPU job (Ray does not count NPUs), GPUs and CPUs as Ray counts them;
- worker-0's plan is the driver: ray_node.py's `await` waits, bounded, until the cluster reports every node
  (logged with how many joined; 81 naming the missing ones), then becomes the command (exec) with RAY_ADDRESS set.
  Its exit code is the job's (OUTCOME_ON_WORKER_0, as for mpirun);
- every other node runs no command: its plan is the peers watcher of the head's port, which exits 0 once the head
  is gone for MA_RUNTIME_PEER_GONE_SECONDS (worker-0's run ended and stopped it; a head the keeper starts again
  closes its port for a moment only). Its runtime then ends and stops its Ray node.

A restart in place runs the driver again against the same cluster: the services outlive attempts. A Ray node
that died is started again by its keeper, a worker node joins the head again once the head it knew is gone, so
the next attempt's wait finds the whole cluster again.

`ray` is the job's: looked for beside the command's Python, then on PATH, never imported by the runtime; missing,
it is one line and 127. The Ray processes get the job's environment (its tasks run in them), with two defaults of
Ray's turned off unless the job sets them: usage statistics (RAY_USAGE_STATS_ENABLED=0: a training cluster calls
no one) and the drain on SIGTERM (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0: Ray's 30 s would outlast the runtime's
grace).
"""

import json
import os
import re
from typing import Dict, List, Mapping, Sequence

from ma_runtime.errors import CommandNotFound
from ma_runtime.launch.base import (
    Context,
    Launcher,
    Machinery,
    Plan,
    WorkerPlan,
    check_once_per_node,
    common_env,
    launcher_missing,
    python_folder,
    split_extra,
)
from ma_runtime.launch.role import node_names, role
from ma_runtime.setting import Setting, port, switch, text

# This launcher's own settings: spec's table collects them through launch.registry (setting.py: a row).
SETTINGS = (
    Setting("ray_port", "MA_RUNTIME_RAY_PORT", port, "the port of the Ray head worker-0 starts (its GCS) and the "
            "other nodes join (MA_RUN_METHOD=ray)", 6379, cli=False, owner=__name__),
    Setting("ray_dashboard", "MA_RUNTIME_RAY_DASHBOARD", switch, "whether the Ray head serves its dashboard "
            "(MA_RUN_METHOD=ray)", False, cli=False, owner=__name__),
    Setting("extra_ray_params", "MA_RUNTIME_EXTRA_RAY_PARAMS", text, "extra `ray start` flags on every node, after "
            "the runtime's (--num-cpus=4, --temp-dir=...)", "", cli=False, owner=__name__),
)
DRIVER, WATCHER, NODE = "driver", "watcher", "ray-node"
# Ray's defaults the runtime turns off unless the job's environment sets them (the module docstring says why).
RAY_DEFAULTS = (("RAY_USAGE_STATS_ENABLED", "0"), ("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0"))
_INTERPRETER = re.compile(rb"#!\s*(\S*python[0-9.]*)\s*$")


class Ray(Launcher):
    NAME = "ray"
    TAKES_NPROC_PER_NODE = False  # one driver on worker-0; Ray starts its workers itself
    # After a stop: the SIGTERM handler ray.init installs in the driver exits with the signal's number (15), not
    # a code of the job's; the job's code is then 128+N, as under torchrun.
    OWN_CODE_AFTER_STOP = False
    # worker-0's driver runs the job; the other nodes' command only waits for the head to go (like mpirun's).
    OUTCOME_ON_WORKER_0 = True
    WORKERS = re.compile(rf"({DRIVER}|{WATCHER})\Z")
    # The runtime's ray_node.py (its wait before the driver, its keeper), the `ray` CLI, and Ray's daemons by the
    # names they take: raylet starts the workers that run the job's tasks (`ray::<task>`, `ray::IDLE`), which are
    # the job, and its two agents, which are not.
    MACHINERY = Machinery(scripts=frozenset({"ray"}), modules=frozenset({"ma_runtime.launch.ray_node"}),
                          processes=frozenset({"raylet", "gcs_server", "ray::DashboardA", "ray::RuntimeEnv"}),
                          daemons=frozenset({"raylet"}))

    def build(self, spec, context: Context, why: str) -> Plan:
        check_once_per_node(spec, why, "Ray's own workers run the job's tasks")
        try:
            ray = find_ray(context.argv, context.environ, context.which)
        except CommandNotFound as missing:
            ray = launcher_missing(context, "ray", missing)
        service = node_service(spec, context.environ, ray)
        if not role(spec).is_master:
            return Plan(self.NAME, why, (_watcher(spec, context),), spec.num_hosts, 1, services=(service,))
        argv = [*_await_argv(spec, context.environ, ray), "--", *context.argv]
        env = {**common_env(spec, context.attempt), "RAY_ADDRESS": head_address(spec)}
        driver = WorkerPlan(DRIVER, tuple(argv), env, logs={"task": str(spec.task_log_path)})
        return Plan(self.NAME, why, (driver,), spec.num_hosts, 1, services=(service,))

    def start_services(self, spec, environ: Mapping[str, str], log, stopped, sinks, command=()) -> None:
        """This node's Ray node, as the job's service (ray_node.py's keeper): the head on worker-0, started and
        waited for; on the others, once the head answers (the peers wait, 81 naming worker-0), a node joining it."""
        from ma_runtime.launch import ray_node

        service = node_service(spec, environ, find_ray(command, environ))
        ray_node.start_service(spec, service, head_address(spec), environ, log, stopped, sinks)


LAUNCHER = Ray()


# --------------------------------------------------------------------------- finding ray


def find_ray(argv: Sequence[str], environ: Mapping[str, str], which=None) -> str:
    """The job's `ray`: beside the command's Python first (installed with it, it runs with it), then on PATH;
    CommandNotFound (127) when neither has it."""
    context = Context(argv, environ) if which is None else Context(argv, environ, which=which)
    folder = python_folder(context)
    found = (folder and context.which("ray", folder)) or context.which("ray", environ.get("PATH", os.defpath))
    if not found:
        where = f"not in {folder} beside {argv[0]}, not on PATH" if folder else "not on PATH"
        raise CommandNotFound(f"MA_RUN_METHOD=ray, but ray is not installed ({where})",
                              hint="install it in the job's Python: pip install 'ray[default]'")
    return found


def ray_python(ray: str) -> str:
    """The interpreter the `ray` script runs on (its #! line: pip writes the venv's python there), which has the
    `ray` package the wait before the driver asks; else the python beside it."""
    try:
        with open(ray, "rb") as script:
            first = script.readline(512)
    except OSError:
        first = b""
    found = _INTERPRETER.match(first)
    if found and os.path.isabs(found.group(1).decode(errors="replace")):
        return found.group(1).decode()
    return os.path.join(os.path.dirname(ray), "python")


# --------------------------------------------------------------------------- the plan


def head_address(spec) -> str:
    """`<worker-0>:<port>`: what the other nodes join and the driver's RAY_ADDRESS."""
    host = role(spec).need_master() if spec.num_hosts > 1 else "127.0.0.1"
    return f"{host}:{spec.ray_port}"


def node_service(spec, environ: Mapping[str, str], ray: str) -> WorkerPlan:
    """This node's `ray start --block`, as its keeper runs it, with the environment Ray's processes add."""
    argv = [ray, "start", "--block"]
    if role(spec).is_master:  # the one rule (role.py): ROUTE_PLAN's master included
        argv += ["--head", f"--port={spec.ray_port}", f"--include-dashboard={str(spec.ray_dashboard).lower()}"]
    else:
        argv += [f"--address={head_address(spec)}"]
    address = environ.get("MA_CURRENT_IP", "").strip()
    if address and spec.num_hosts > 1:  # the platform's container IP: Ray's own guess routes to 8.8.8.8
        argv += [f"--node-ip-address={address}"]
    resources = accelerator_resources(spec, environ)
    if resources:
        argv += [f"--resources={json.dumps(resources, separators=(',', ':'))}"]
    argv += split_extra("MA_RUNTIME_EXTRA_RAY_PARAMS", spec.extra_ray_params)
    env = {name: value for name, value in RAY_DEFAULTS if name not in environ}
    return WorkerPlan(NODE, tuple(argv), env, logs={"task": str(spec.task_log_path)})


def accelerator_resources(spec, environ: Mapping[str, str]) -> Dict[str, int]:
    """`{"NPU": MA_NUM_GPUS}` on an NPU job (the platform's script: Ray counts no NPUs); nothing otherwise: Ray
    counts GPUs and CPUs itself."""
    from ma_runtime.util import accelerators

    if spec.num_gpus and accelerators.flavour(spec, environ) == accelerators.NPU:
        return {"NPU": spec.num_gpus}
    return {}


def node_hosts(spec) -> List[str]:
    """Every node's name, the master first (role.py's rule, as mpirun's)."""
    if spec.num_hosts <= 1:
        return ["127.0.0.1"]
    return node_names(spec)


def _await_argv(spec, environ: Mapping[str, str], ray: str) -> List[str]:
    from ma_runtime.launch import ray_node

    return ray_node.await_argv(head_address(spec), ray_python(ray), node_hosts(spec),
                               spec.peer_wait_seconds)


def _watcher(spec, context: Context) -> WorkerPlan:
    from ma_runtime.launch import peers

    host, _, port_text = head_address(spec).rpartition(":")
    argv = peers.watcher_argv([(host, int(port_text))], spec.peer_wait_seconds, gone_seconds=spec.peer_gone_seconds)
    return WorkerPlan(WATCHER, tuple(argv), common_env(spec, context.attempt), logs={"task": str(spec.task_log_path)})
