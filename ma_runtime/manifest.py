"""`ma-runtime manifest volcano`: the Volcano Job (batch.volcano.sh/v1alpha1) that runs a job on an on-premise
cluster as the platform would, printed as YAML; nothing is contacted or started.

What it prints (docs/guides/volcano.md says why for each):
- a ConfigMap holding the job file when `--config` is given (mounted, MA_RUNTIME_CONFIG names it), and for NPU
  jobs the `rings-config-<job>` ConfigMap that Ascend's hccl-controller fills with the rank table;
- the Job: `minAvailable` = every pod (gang scheduling), the `env` and `svc` plugins (VC_TASK_INDEX;
  VC_WORKER_HOSTS, VC_WORKER_NUM and the pods' DNS names), `ssh` for mpirun, `maxRetry` = runs (volcano#2012),
  and the lifecycle policies of `POLICIES`, keyed to the runtime's exit codes (errors.py);
- one task `worker` (a multi-node TensorFlow job: `ps` and `worker`) whose pod runs the runtime as its first and
  only container's entrypoint: Volcano reads the exit code of `ContainerStatuses[0]` alone.

The job file is validated as `run` would (spec.load), without this shell's environment: the manifest describes
the job, not the machine it was printed on.
"""

import argparse
import dataclasses
import hashlib
import math
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ma_runtime import __version__
from ma_runtime.errors import ConfigError, ExitCode
from ma_runtime.launch.registry import METHODS
from ma_runtime.setting import BadValue, shown

API_VERSION = "batch.volcano.sh/v1alpha1"
# The entrypoint of the images docker/ builds (entrypoints/ma-runtime-entrypoint): `ma-runtime run -- CMD`.
ENTRYPOINT = "/opt/ma-runtime/bin/ma-runtime-entrypoint"
ACCELERATORS = ("none", "gpu", "npu")
RESOURCES = {"gpu": "nvidia.com/gpu", "npu": "huawei.com/Ascend910"}
DEFAULT_DEVICES = 8  # a whole server: what RTF and the platform's flavours assume
# Volcano's maxRetry counts runs, not restarts (RetryCount >= maxRetry fails the job, volcano#2012): 3 is the
# first run and at most 2 RestartJob; 0 would be defaulted to 3 by Volcano's admission webhook.
MAX_RUNS = 3
PLATFORM_HOME = "/home/ma-user"
JOB_FILE_DIR = "/etc/ma-runtime"
JOB_FILE_NAME = "job.yaml"
# Ascend MindX DL's hccl-controller writes the rank table of a job labelled ring-controller.atlas into this
# ConfigMap, mounted here; the runtime waits for its status=completed (ranktable.py).
RANK_TABLE_DIR = "/user/serverid/devindex/config"
RANK_TABLE_LABEL = ("ring-controller.atlas", "ascend-910")
TF_PORT = 2222  # each TensorFlow task's gRPC port in TF_PS_HOSTS / TF_WORKER_HOSTS (TensorFlow's usual)
# A pod's host name `<job>-<task>-<index>` is one DNS label (svc plugin): 63 characters at most.
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_LABEL_MAX = 63
_IMAGE = re.compile(r"^[^\s]{1,4096}$")
_MAX_NODES = 10_000


@dataclasses.dataclass(frozen=True)
class Policy:
    """One lifecycle policy: a runtime exit code (or a pod event) and the action Volcano takes, with why."""

    action: str
    why: str
    exit_code: Optional[int] = None
    event: Optional[str] = None

    def document(self) -> Dict[str, Any]:
        key = {"exitCode": int(self.exit_code)} if self.exit_code is not None else {"event": self.event}
        return {**key, "action": self.action}


# Exit-code policies first: Volcano takes the first policy that matches, so no event policy may shadow them.
POLICIES: Tuple[Policy, ...] = (
    Policy("RestartJob", "preflight failed: the node is bad (DNS, disk, ulimit, devices); a new run is scheduled "
           "afresh", ExitCode.PREFLIGHT_FAILED),
    Policy("RestartJob", "the rank table, the barrier or worker-0's address timed out: a node or the "
           "hccl-controller did not come in time", ExitCode.TIMED_OUT),
    Policy("RestartJob", "hang detected and not restarted in place: a stuck device or link; new pods",
           ExitCode.HANG_DETECTED),
    Policy("RestartJob", "the accelerators stayed held between attempts: relaunching onto them fails again",
           ExitCode.DEVICE_NOT_RELEASED),
    Policy("AbortJob", "bad configuration: every run would fail the same way", ExitCode.BAD_CONFIGURATION),
    Policy("AbortJob", "restarts exhausted: the runtime already restarted in place, the same failure repeated",
           ExitCode.RESTARTS_EXHAUSTED),
    Policy("AbortJob", "a hook failed (pip, CANN's set_env.sh, the pre-start script): the job's own set-up",
           ExitCode.HOOK_FAILED),
    Policy("AbortJob", "the command is not executable in this image", ExitCode.COMMAND_NOT_EXECUTABLE),
    Policy("AbortJob", "the command is not in this image", ExitCode.COMMAND_NOT_FOUND),
    Policy("RestartJob", "the pod was evicted or deleted (node drained, lost or under pressure)",
           event="PodEvicted"),
)
# The runtime's codes that get no policy, on purpose: Volcano then only syncs, and the job ends Failed once every
# pod has ended (other nodes exit 86 by then).
NO_POLICY: Dict[int, str] = {
    ExitCode.INTERNAL_ERROR: "a bug in ma-runtime: a new run would meet it again; the job fails",
    ExitCode.STORAGE_FAILED: "the store failed after retries, or outputs were not synced: a new run would redo "
                             "the training and still need the store; the job fails",
    ExitCode.STOPPED_FOR_JOB: "another node failed first and its own code decides: Volcano acts on the first "
                              "pod failure it handles, so a policy here could restart a job whose origin said "
                              "abort; a lost node's pod is deleted (PodEvicted) and restarts the job",
}


def policy_for(exit_code: Optional[int] = None, event: str = "PodFailed") -> Optional[Policy]:
    """The policy Volcano would match first for a pod failure with `exit_code` (or for `event`), None when none
    does (ma-runtime local's summary names it)."""
    for policy in POLICIES:
        if (policy.event is not None and policy.event == event) or (
                policy.exit_code is not None and event == "PodFailed" and policy.exit_code == exit_code):
            return policy
    return None


def action_for(exit_code: Optional[int] = None, event: str = "PodFailed") -> str:
    """The action the manifest's policies give a pod failure with `exit_code` (or `event`): `SyncJob` when none
    matches."""
    policy = policy_for(exit_code, event)
    return policy.action if policy is not None else "SyncJob"


@dataclasses.dataclass(frozen=True)
class Job:
    """What the manifest describes: the flags, resolved against the job file."""

    name: str
    image: str
    command: Tuple[str, ...]
    entrypoint: Tuple[str, ...]
    nodes: int
    method: str
    accelerator: str
    devices: int
    stop_grace_seconds: float
    final_sync_seconds: float
    sshd_port: int
    job_file: Optional[Tuple[str, str]] = None  # (path as given, its text)
    file_keys: Tuple[str, ...] = ()  # the settings the job file sets: the container's env leaves them to it

    @property
    def tasks(self) -> Tuple[str, ...]:
        """The Volcano tasks: `worker`, or `ps` and `worker` for a multi-node TensorFlow job (one of each per
        node, as the platform runs it)."""
        return ("ps", "worker") if self.method == "tensorflow-gpu" and self.nodes > 1 else ("worker",)

    @property
    def pods(self) -> int:
        return self.nodes * len(self.tasks)

    @property
    def grace_seconds(self) -> int:
        """The stop's grace plus the final sync's budget: the sync's deadline counts from the stop request, so the
        sum bounds how long the runtime takes from SIGTERM to its exit."""
        return int(math.ceil(self.stop_grace_seconds + self.final_sync_seconds))


def hosts(job: Job, task: str) -> List[str]:
    """The svc plugin's names for a task's pods, `<job>-<task>-<i>.<job>`, as it writes VC_<TASK>_HOSTS."""
    return [f"{job.name}-{task}-{index}.{job.name}" for index in range(job.nodes)]


def documents(job: Job) -> List[Dict[str, Any]]:
    """The ConfigMaps the Job mounts (they must exist first), then the Job."""
    found = []
    if job.job_file is not None:
        found.append(_config_map(f"{job.name}-job-file", {JOB_FILE_NAME: job.job_file[1]}))
    if job.accelerator == "npu":
        # The hccl-controller fills it; `initializing` until then, which the runtime waits out.
        found.append(_config_map(f"rings-config-{job.name}", {"hccl.json": '{"status":"initializing"}'},
                                 dict([RANK_TABLE_LABEL])))
    found.append(volcano_job(job))
    return found


def render(job: Job) -> str:
    import yaml

    header = (f"# Volcano Job for {job.name}, printed by ma-runtime {__version__} (`ma-runtime manifest volcano`).\n"
              "# Create it with `kubectl create -f <this file>`; docs/guides/volcano.md explains each part.\n")
    return header + yaml.safe_dump_all(documents(job), sort_keys=False, default_flow_style=False, width=1000)


def _config_map(name: str, data: Dict[str, str], labels: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    metadata: Dict[str, Any] = {"name": name}
    if labels:
        metadata["labels"] = labels
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def volcano_job(job: Job) -> Dict[str, Any]:
    plugins: Dict[str, List[str]] = {"env": [], "svc": []}
    if job.method == "mpirun":
        # The job's key pair where the runtime's sshd looks for mounted trust files (${MA_HOME}/.ssh: mounted
        # files win over its own key server), and ssh's config on the runtime's sshd port.
        plugins["ssh"] = [f"--ssh-key-file-path={PLATFORM_HOME}/.ssh", f"--ssh-port={job.sshd_port}"]
    metadata: Dict[str, Any] = {"name": job.name}
    if job.accelerator == "npu":
        metadata["labels"] = dict([RANK_TABLE_LABEL])
    return {
        "apiVersion": API_VERSION,
        "kind": "Job",
        "metadata": metadata,
        "spec": {
            "schedulerName": "volcano",
            "queue": "default",
            "minAvailable": job.pods,  # gang: every pod or none (a job's nodes wait for each other anyway)
            "maxRetry": MAX_RUNS,
            "plugins": plugins,
            "policies": [policy.document() for policy in POLICIES],
            "tasks": [_task(job, task) for task in job.tasks],
        },
    }


def _task(job: Job, task: str) -> Dict[str, Any]:
    labels = {"app.kubernetes.io/managed-by": "ma-runtime"}
    if job.accelerator == "npu":
        labels.update([RANK_TABLE_LABEL])
    return {
        "name": task,
        "replicas": job.nodes,
        "template": {
            "metadata": {"labels": labels},
            "spec": {
                # Never: a failed container fails its pod, so Volcano sees the exit code and its policies act
                # (OnFailure would restart it in place, unseen); the runtime restarts in place itself.
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": job.grace_seconds,
                "containers": [_container(job, task)],
                "volumes": _volumes(job),
            },
        },
    }


def _container(job: Job, task: str) -> Dict[str, Any]:
    container: Dict[str, Any] = {
        "name": task,
        "image": job.image,
        "command": list(job.entrypoint),
        "args": list(job.command),
        "env": _env(job, task),
        "volumeMounts": _mounts(job),
        # A runtime killed before it wrote the termination message still leaves its last lines there.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if job.accelerator in RESOURCES:
        # Extended resources: requests must equal limits, and limits alone would set both.
        amount = {RESOURCES[job.accelerator]: job.devices}
        container["resources"] = {"limits": dict(amount), "requests": dict(amount)}
    return container


def _env(job: Job, task: str) -> List[Dict[str, Any]]:
    """The platform's variables. VC_TASK_INDEX (env plugin) and VC_WORKER_HOSTS, VC_WORKER_NUM (svc plugin) come
    from Volcano; a setting the job file gives is left to it (in the container, env would beat the file)."""
    values = {
        "MA_VJ_NAME": job.name,
        "MA_TASK_NAME": task,
        "MA_NUM_HOSTS": str(job.nodes),
        "MA_NUM_GPUS": str(job.devices),
        "MA_RUN_METHOD": job.method,
    }
    for name, env, default in (("ma_home", "MA_HOME", PLATFORM_HOME),
                               ("mount_path", "MA_MOUNT_PATH", f"{PLATFORM_HOME}/modelarts"),
                               ("job_dir", "MA_JOB_DIR", f"{PLATFORM_HOME}/modelarts/user-job-dir"),
                               ("log_dir", "MA_LOG_DIR", f"{PLATFORM_HOME}/modelarts/log")):
        if name not in job.file_keys:
            values[env] = default
    if len(job.tasks) > 1:  # TensorFlow across nodes: the platform's form, in brackets
        for role in job.tasks:
            values[f"TF_{role.upper()}_HOSTS"] = "[" + ",".join(f"{host}:{TF_PORT}" for host in hosts(job, role)) + "]"
    if job.accelerator == "npu" and "ranktable_file" not in job.file_keys:
        values["RANK_TABLE_FILE"] = f"{RANK_TABLE_DIR}/hccl.json"
    if job.job_file is not None:
        values["MA_RUNTIME_CONFIG"] = f"{JOB_FILE_DIR}/{JOB_FILE_NAME}"
    env: List[Dict[str, Any]] = [{"name": name, "value": value} for name, value in values.items()]
    # The pod's own, known only once it is placed: the downward API.
    env += [{"name": "MA_CURRENT_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "MA_CURRENT_INSTANCE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    return env


def _volumes(job: Job) -> List[Dict[str, Any]]:
    # /dev/shm: the container runtime's default is 64 MiB, too small for DataLoader workers and NCCL/HCCL.
    volumes: List[Dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if job.job_file is not None:
        volumes.append({"name": "job-file", "configMap": {"name": f"{job.name}-job-file"}})
    if job.accelerator == "npu":
        volumes.append({"name": "ranktable", "configMap": {"name": f"rings-config-{job.name}"}})
    return volumes


def _mounts(job: Job) -> List[Dict[str, Any]]:
    mounts: List[Dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if job.job_file is not None:
        mounts.append({"name": "job-file", "mountPath": JOB_FILE_DIR, "readOnly": True})
    if job.accelerator == "npu":
        mounts.append({"name": "ranktable", "mountPath": RANK_TABLE_DIR, "readOnly": True})
    return mounts


# --------------------------------------------------------------------------- the command line

PROG = "ma-runtime manifest volcano"
USAGE = (f"{PROG} --image IMAGE [--config job.yaml] [--nodes N] [--method METHOD] [--accelerator none|gpu|npu] "
         "[--devices K] [--name NAME] [--entrypoint WORDS] -- CMD...")


def parser() -> argparse.ArgumentParser:
    from ma_runtime.cli import new_parser

    found = new_parser(prog=PROG, usage=USAGE, allow_abbrev=False,
                    description="Print the Volcano Job (batch.volcano.sh/v1alpha1) that runs CMD under ma-runtime on "
                    "an on-premise Volcano cluster: gang scheduling, the env/svc (ssh) plugins, the platform's "
                    "environment, devices, and lifecycle policies keyed to ma-runtime's exit codes.",
                    epilog="docs/guides/volcano.md: what it prints and the policy table. Exit 0, or 78 on bad input.")
    found.add_argument("--config", metavar="FILE", help="the YAML job file: validated, and shipped in a ConfigMap")
    found.add_argument("--image", metavar="IMAGE", help="the training image, ma-runtime installed (required)")
    found.add_argument("--nodes", metavar="N", help="nodes (default: the job file's num_hosts, else 1)")
    found.add_argument("--method", metavar="METHOD", help=f"launcher: {', '.join(METHODS)} (default: the job "
                       "file's run_method, else rtf with NPUs, plain otherwise)")
    found.add_argument("--accelerator", metavar="KIND", help="none, gpu or npu (default: npu for rtf and msrun, gpu "
                       "for pytorch-gpu and tensorflow-gpu, else none)")
    found.add_argument("--devices", metavar="K", help=f"accelerators per node (default: the job file's num_gpus, "
                       f"else {DEFAULT_DEVICES})")
    found.add_argument("--name", metavar="NAME", help="the Volcano job's name, a DNS label (default: ma-job- and a "
                       "hash of the job, the same for the same job)")
    found.add_argument("--entrypoint", metavar="WORDS", help=f"the container's command before CMD (default: "
                       f"{ENTRYPOINT}, the images' entrypoint; `ma-runtime run --` where it is on PATH)")
    return found


def main(argv: Sequence[str]) -> int:
    """`ma-runtime manifest TARGET ...`: the YAML on stdout; bad input is one line on stderr and 78."""
    from ma_runtime.cli import split_command

    argv = list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(f"usage: ma-runtime manifest volcano ...\n\nPrint a manifest for this job. Targets:\n"
                         f"  volcano   the Volcano Job (see `{PROG} --help`)\n")
        return ExitCode.OK
    if not argv:
        return _refuse(ConfigError("no target given", hint="the one target is volcano"))
    if argv[0] != "volcano":
        return _refuse(ConfigError(f"unknown target {shown(argv[0])}", hint="the one target is volcano"))
    found = parser()
    ours, command = split_command(found, argv[1:])
    options = found.parse_args(ours)
    try:
        job = resolve(options, command)
    except ConfigError as failure:
        return _refuse(failure)
    sys.stdout.write(render(job))
    return ExitCode.OK


def _refuse(failure: ConfigError) -> int:
    hint = f" ({failure.hint})" if failure.hint else ""
    sys.stderr.write(f"{PROG}: error: {failure.reason}{hint}\n")
    return ExitCode.BAD_CONFIGURATION


def resolve(options: argparse.Namespace, command: Sequence[str]) -> Job:
    """The Job from the flags and the job file (flags > file > defaults); ConfigError names what is wrong."""
    from ma_runtime import spec as spec_module

    if not command:
        raise ConfigError("no command given", hint=f"usage: {USAGE}")
    image = options.image or ""
    if not _IMAGE.match(image):
        raise ConfigError("--image is " + ("missing" if not image else f"{shown(image)}, not an image reference"),
                          hint="the training image with ma-runtime installed, e.g. registry.example/train:1.0")
    if options.method is not None and options.method not in METHODS:
        raise ConfigError(f"--method={shown(options.method)} is not a launcher", hint=f"one of {', '.join(METHODS)}")
    flags = {"num_hosts": options.nodes, "run_method": options.method}
    flags = {name: _flag_value(name, value) for name, value in flags.items() if value is not None}
    # Not this shell's environment: the manifest is the job's, whoever prints it.
    spec = spec_module.load(flags, {}, options.config)
    from_file = {name for name, source in spec.sources.items() if source == "file"}
    accelerator = _accelerator(options.accelerator, spec.run_method)
    method = spec.run_method or ("rtf" if accelerator == "npu" else "plain")
    devices = _devices(options.devices, accelerator, spec.num_gpus if "num_gpus" in from_file else None)
    job_file = None
    if spec.config_file is not None:
        job_file = (str(spec.config_file), Path(spec.config_file).read_text(encoding="utf-8"))
    entrypoint = _entrypoint(options.entrypoint)
    name = options.name if options.name is not None else _default_name(image, command, spec.num_hosts, method)
    job = Job(name=name, image=image, command=tuple(command), entrypoint=entrypoint, nodes=spec.num_hosts,
              method=method, accelerator=accelerator, devices=devices, stop_grace_seconds=spec.stop_grace_seconds,
              final_sync_seconds=spec.sync_final_seconds, sshd_port=spec.sshd_port, job_file=job_file,
              file_keys=tuple(sorted(from_file)))
    _check_name(job)
    if job.nodes > _MAX_NODES:
        raise ConfigError(f"--nodes={job.nodes} is more than {_MAX_NODES}", hint="a Volcano job this large is "
                          "beyond what the svc plugin's environment holds")
    return job


def _flag_value(name: str, value: str) -> str:
    from ma_runtime.spec.table import SETTINGS_BY_NAME

    flag = {"num_hosts": "--nodes", "run_method": "--method"}[name]
    try:
        SETTINGS_BY_NAME[name].parse(value)
    except BadValue as exc:
        raise ConfigError(f"{flag}={shown(value)} {exc}") from None
    return value


def _accelerator(given: Optional[str], method: Optional[str]) -> str:
    if given is None:
        return {"rtf": "npu", "msrun": "npu", "pytorch-gpu": "gpu", "tensorflow-gpu": "gpu"}.get(method or "", "none")
    if given not in ACCELERATORS:
        raise ConfigError(f"--accelerator={shown(given)} is not one of {', '.join(ACCELERATORS)}")
    return given


def _devices(given: Optional[str], accelerator: str, from_file: Optional[int]) -> int:
    if accelerator == "none":
        if given is not None and given.strip() != "0":
            raise ConfigError(f"--devices={shown(given)} without an accelerator",
                              hint="add --accelerator gpu or --accelerator npu")
        return 0
    if given is None:
        return from_file if from_file else DEFAULT_DEVICES
    word = given.strip()
    if not word.isdigit() or not 1 <= int(word) <= 1024:
        raise ConfigError(f"--devices={shown(given)} is not a whole number from 1 to 1024",
                          hint=f"{accelerator} cards per node")
    return int(word)


def _entrypoint(given: Optional[str]) -> Tuple[str, ...]:
    if given is None:
        return (ENTRYPOINT,)
    try:
        words = tuple(shlex.split(given))
    except ValueError as exc:
        raise ConfigError(f"--entrypoint={shown(given)}: {exc}") from None
    if not words:
        raise ConfigError("--entrypoint is empty", hint="e.g. --entrypoint 'ma-runtime run --'")
    return words


def _default_name(image: str, command: Sequence[str], nodes: int, method: str) -> str:
    """`ma-job-` and 10 hex digits of the job: printing the same job twice gives the same name."""
    digest = hashlib.sha256("\0".join([image, str(nodes), method, *command]).encode("utf-8", "replace"))
    return f"ma-job-{digest.hexdigest()[:10]}"


def _check_name(job: Job) -> None:
    longest = f"{job.name}-{max(job.tasks, key=len)}-{job.nodes - 1}"
    if not _LABEL.match(job.name) or len(longest) > _DNS_LABEL_MAX:
        raise ConfigError(f"--name={shown(job.name)} cannot name the job's pods (their host name {shown(longest)} "
                          f"must be a DNS label)",
                          hint=f"lowercase letters, digits and '-', starting and ending with a letter or digit, "
                          f"short enough that <name>-<task>-<index> is at most {_DNS_LABEL_MAX} characters")
