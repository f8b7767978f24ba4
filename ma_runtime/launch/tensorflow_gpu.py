"""The TensorFlow-GPU preset: the command once per container, with the platform's ps/worker arguments on
several nodes, and a parameter server that ends when the workers have finished.

The platform's forms (docs/platform.md, "TensorFlow-GPU preset"):
- one node: one container owns the node; the platform documents no arguments, so the command runs as given;
- several: one `ps` and one `worker` container per node, each running
  `<command> --task_index <VC_TASK_INDEX> --ps_hosts <TF_PS_HOSTS> --worker_hosts <TF_WORKER_HOSTS>
  --job_name <MA_TASK_NAME>`.
TF_*_HOSTS look like `[xx-ps-0.xx:PORT,xx-ps-1.xx:PORT]`; the brackets are dropped (D37): TensorFlow's own flags
take `host:port,host:port`, which `split(",")` turns into a cluster spec, and a boot file that strips them
itself still works.

A parameter server never exits by itself (`server.join()`): on a `ps` container the plan's process is the watcher
of peers.py wrapping the command. Once every worker's port in TF_WORKER_HOSTS has answered and then stayed closed
for MA_RUNTIME_PEER_GONE_SECONDS (a worker restarted in place closes it for a while), it ends the command and
exits 0: the workers finished, so the ps did its job. A worker that never answers within
MA_RUNTIME_PEER_WAIT_SECONDS ends the ps with 81; the ps command's own exit, first, is the container's.

It forwards nothing: the watcher and the command share the process group the supervisor signals once (the
watcher then waits for the command and exits with its status).
"""

import re
from typing import List, Mapping, Tuple

from ma_runtime.errors import ConfigError
from ma_runtime.launch.args import append_words
from ma_runtime.launch.base import (
    Context,
    Launcher,
    Plan,
    WorkerPlan,
    check_once_per_node,
    common_env,
)

ROLES = ("ps", "worker")
_SHOWN = 80  # characters of a bad value quoted in an error
_PORT = re.compile(r"[0-9]{1,5}\Z")
_FORMAT_HINT = "the platform sets it: host:port entries, comma-separated, in brackets or not ([a:5000,b:5001])"


class TensorflowGpu(Launcher):
    NAME = "tensorflow-gpu"
    TAKES_NPROC_PER_NODE = False  # one ps or worker per container
    OWN_CODE_AFTER_STOP = True  # after a stop: the command's own (the watcher waits for it and passes it on)
    # The ps and the workers are two tasks, each its own VC_TASK_INDEX from 0 and its own hosts, and a ps ends by
    # watching the workers' ports (peers.py), not with them: each container acts alone, as before.
    JOB_AS_ONE = False
    JOB_WIDE_RANK = False  # no one node rank or master for the whole job: the appended --task_index and hosts say it

    def build(self, spec, context: Context, why: str) -> Plan:
        check_once_per_node(spec, why, "each ps and worker container runs one TensorFlow task")
        argv = list(context.argv)
        if spec.num_hosts > 1:
            argv = _multi_node(spec, context.environ, argv)
        worker = WorkerPlan("command", tuple(argv), common_env(spec, context.attempt),
                            logs={"task": str(spec.task_log_path)})
        return Plan(self.NAME, why, (worker,), spec.num_hosts, 1)


LAUNCHER = TensorflowGpu()


def _multi_node(spec, environ: Mapping[str, str], argv: List[str]) -> List[str]:
    if spec.task_name not in ROLES:
        raise ConfigError(f"MA_TASK_NAME={spec.task_name}, but a multi-node TensorFlow job's containers are "
                          f"{' or '.join(ROLES)}",
                          hint="the platform sets MA_TASK_NAME to ps or worker on TensorFlow jobs; for another "
                               "role, choose MA_RUN_METHOD=plain")
    hosts = {"ps": cluster_hosts(environ, "TF_PS_HOSTS"), "worker": cluster_hosts(environ, "TF_WORKER_HOSTS")}
    mine = hosts[spec.task_name]
    if spec.task_index >= len(mine):
        raise ConfigError(f"VC_TASK_INDEX={spec.task_index}, but TF_{spec.task_name.upper()}_HOSTS names "
                          f"{len(mine)} {spec.task_name} task(s)",
                          hint=f"the index counts from 0 among the job's {spec.task_name} tasks")
    argv = append_words(argv, ["--task_index", str(spec.task_index), "--ps_hosts", _joined(hosts["ps"]),
                               "--worker_hosts", _joined(hosts["worker"]), "--job_name", spec.task_name])
    if spec.task_name == "ps":  # it would serve forever: it ends when every worker has gone
        from ma_runtime.launch import peers  # sockets and processes: only for the ps, when it is planned

        return peers.watcher_argv(hosts["worker"], spec.peer_wait_seconds, argv, gone_seconds=spec.peer_gone_seconds)
    return argv


def cluster_hosts(environ: Mapping[str, str], name: str) -> List[Tuple[str, int]]:
    """TF_PS_HOSTS or TF_WORKER_HOSTS as (host, port) pairs, in order; a trailing comma is tolerated, a hole is
    not (it would shift every task index after it)."""
    # The platform's cluster spec, read when a TensorFlow job is planned rather than as a setting: a value only a
    # TensorFlow job uses must not fail every other job at load.
    text = environ.get(name, "").strip()
    inner = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    entries = [entry.strip() for entry in inner.split(",")]
    while entries and not entries[-1]:
        entries.pop()
    if not entries:
        raise ConfigError(f"{name} is {'empty' if text else 'unset'}, and a multi-node TensorFlow job needs it",
                          hint=_FORMAT_HINT)
    return [_endpoint(name, text, entry) for entry in entries]


def _endpoint(name: str, text: str, entry: str) -> Tuple[str, int]:
    host, _, port = entry.rpartition(":")
    if not host or any(c.isspace() or c in "[]," for c in host) or not _PORT.match(port) or not 0 < int(port) < 65536:
        raise ConfigError(f"{name} has an entry that is not host:port ({entry[:_SHOWN]!r}): {text[:_SHOWN]!r}",
                          hint=_FORMAT_HINT)
    return host, int(port)


def _joined(endpoints: List[Tuple[str, int]]) -> str:
    return ",".join(f"{host}:{port}" for host, port in endpoints)
