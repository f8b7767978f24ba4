"""`ma-runtime manifest volcano`: every launcher's manifest is valid against Volcano's published Job CRD (a copy in
tests/data/volcano/), passes the checks of Volcano's admission webhook, gives the pods the environment the runtime
reads, and its lifecycle policies, run through a mirror of Volcano's job controller, do what docs/guides/volcano.md
documents for each of the runtime's exit codes.

The mirrors follow volcano-sh/volcano at ed72c7c8: pkg/controllers/job/job_controller_util.go (applyPolicies),
job_controller_handler.go (updatePod: the exit code of ContainerStatuses[0]; deletePod: PodEvicted),
state/running.go and state/restarting.go (RestartJob counts a retry; RetryCount >= maxRetry fails the job),
plugins/env and plugins/svc (the variables they inject), webhooks/admission/jobs/validate/util.go (policies).
"""

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import jsonschema
import pytest
import yaml

from ma_runtime import manifest
from ma_runtime import spec as spec_module
from ma_runtime.errors import ExitCode
from ma_runtime.launch.registry import METHODS
from ma_runtime.launch.tensorflow_gpu import cluster_hosts

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "tests" / "data" / "volcano" / "batch.volcano.sh_jobs.yaml"
GUIDE = ROOT / "docs" / "guides" / "volcano.md"
IMAGE = "registry.example/train:1.0"
# One manifest per launcher, as a user would ask for it (the accelerator follows the launcher by default).
LAUNCHES = {
    "rtf": ["--nodes", "2", "--method", "rtf"],
    "torchrun": ["--nodes", "2", "--method", "torchrun", "--accelerator", "gpu", "--devices", "4"],
    "msrun": ["--nodes", "2", "--method", "msrun"],
    "mpirun": ["--nodes", "3", "--method", "mpirun"],
    "pytorch-gpu": ["--nodes", "2", "--method", "pytorch-gpu"],
    "tensorflow-gpu": ["--nodes", "2", "--method", "tensorflow-gpu", "--devices", "1"],
    "plain": ["--method", "plain"],
    "ray": ["--nodes", "2", "--method", "ray"],
}


def print_manifest(*flags: str, command=("python", "train.py")) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ma_runtime", "manifest", "volcano", "--image", IMAGE, *flags,
                           "--", *command], capture_output=True, text=True, timeout=60, cwd=ROOT)


def manifest_documents(*flags: str, **kwargs) -> List[Dict[str, Any]]:
    done = print_manifest(*flags, **kwargs)
    assert done.returncode == 0, done.stderr
    return list(yaml.safe_load_all(done.stdout))


def the_job(documents: List[Dict[str, Any]]) -> Dict[str, Any]:
    (job,) = [document for document in documents if document["kind"] == "Job"]
    return job


# --------------------------------------------------------------------------- the CRD's schema, strict


def strict(schema: Any) -> Any:
    """The schema with `additionalProperties: false` wherever it lists properties and says nothing of others:
    Kubernetes prunes (or, validating strictly, refuses) an unknown field, where JSON schema would let it pass."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    found = {key: strict(value) for key, value in schema.items()}
    if "properties" in found and "additionalProperties" not in found and \
            not found.get("x-kubernetes-preserve-unknown-fields"):
        found["additionalProperties"] = False
    return found


@pytest.fixture(scope="module")
def job_schema() -> Dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    assert crd["spec"]["group"] + "/" + version["name"] == manifest.API_VERSION
    return strict(version["schema"]["openAPIV3Schema"])


def schema_errors(schema: Dict[str, Any], document: Dict[str, Any]) -> List[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, error.absolute_path))}: {error.message}" for error in validator.iter_errors(document)]


def test_the_strict_schema_refuses_an_unknown_field(job_schema):
    # The check the tests below rely on: a misspelt field is an error, not pruned silently.
    job = the_job(manifest_documents("--method", "plain"))
    wrong = copy.deepcopy(job)
    wrong["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["terminationMessagePolicies"] = "x"
    assert schema_errors(job_schema, wrong)
    wrong = copy.deepcopy(job)
    wrong["spec"]["policies"][0]["exitCodes"] = [1]
    assert schema_errors(job_schema, wrong)
    # The CRD takes any action; Volcano's webhook (mirrored below) does not.
    wrong = copy.deepcopy(job)
    wrong["spec"]["policies"][0]["action"] = "RestartEverything"
    assert admission_errors(wrong)


@pytest.mark.parametrize("method", METHODS)
def test_each_launchers_manifest_is_valid_against_volcanos_crd(job_schema, method):
    documents = manifest_documents(*LAUNCHES[method])
    job = the_job(documents)
    assert job["apiVersion"] == manifest.API_VERSION and job["kind"] == "Job"
    assert schema_errors(job_schema, job) == []
    assert admission_errors(job) == []
    for document in documents:
        if document["kind"] == "ConfigMap":
            assert config_map_errors(document) == []


def test_the_manifest_with_a_job_file_is_valid(job_schema, tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text("stop_grace_seconds: 20\nsync:\n  final_seconds: 100.5\nrun_method: torchrun\n"
                        "num_hosts: 2\n")
    documents = manifest_documents("--config", str(job_file), "--accelerator", "npu")
    assert schema_errors(job_schema, the_job(documents)) == []
    assert [config_map_errors(d) for d in documents if d["kind"] == "ConfigMap"] == [[], []]


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ALLOWED_EVENTS = {"*", "PodFailed", "PodEvicted", "PodPending", "Unknown", "TaskCompleted", "TaskFailed",
                   "JobUpdated"}
_ALLOWED_ACTIONS = {"AbortJob", "RestartJob", "RestartTask", "RestartPod", "RestartPartition", "TerminateJob",
                    "CompleteJob", "ResumeJob"}


def admission_errors(job: Dict[str, Any]) -> List[str]:
    """What Volcano's validating webhook refuses that the CRD allows (validate/admit_job.go, util.go)."""
    errors = []
    spec = job["spec"]
    total = sum(task["replicas"] for task in spec["tasks"])
    if not 0 < spec["minAvailable"] <= total:
        errors.append(f"minAvailable {spec['minAvailable']} not within 1..{total} replicas")
    if spec["maxRetry"] < 1:
        errors.append("maxRetry 0 is defaulted to 3 by the mutating webhook")
    names = [task["name"] for task in spec["tasks"]]
    errors += [f"task name {name} is not a DNS label" for name in names if not _DNS_LABEL.match(name)]
    if len(set(names)) != len(names):
        errors.append("duplicate task names")
    errors += [f"unknown plugin {name}" for name in spec["plugins"] if name not in ("env", "svc", "ssh")]
    events, codes = set(), set()
    for policy in spec["policies"]:
        # The webhook checks the action of an event policy only; an exit code's unknown action would be ignored.
        if policy["action"] not in _ALLOWED_ACTIONS:
            errors.append(f"policy {policy}: no such action")
        has_event = bool(policy.get("event") or policy.get("events"))
        if has_event == ("exitCode" in policy):
            errors.append(f"policy {policy}: exactly one of event and exitCode")
        elif has_event:
            event = policy["event"]
            if event not in _ALLOWED_EVENTS or event in events:
                errors.append(f"policy {policy}: event not allowed, or a duplicate")
            events.add(event)
        elif policy["exitCode"] == 0 or policy["exitCode"] in codes:
            errors.append(f"policy {policy}: exit code 0 or a duplicate")
        else:
            codes.add(policy["exitCode"])
    for task in spec["tasks"]:
        pod = task["template"]["spec"]
        if len(pod["containers"]) != 1:
            errors.append("Volcano reads the exit code of the first container only: one container")
    return errors


def config_map_errors(document: Dict[str, Any]) -> List[str]:
    errors = []
    if document.get("apiVersion") != "v1" or set(document) - {"apiVersion", "kind", "metadata", "data"}:
        errors.append(f"not a plain v1 ConfigMap: {sorted(document)}")
    name = document["metadata"]["name"]
    if not _DNS_LABEL.match(name) or len(name) > 253:
        errors.append(f"name {name} is not a DNS subdomain")
    for key, value in document["data"].items():
        if not re.match(r"^[-._a-zA-Z0-9]+$", key) or not isinstance(value, str):
            errors.append(f"data key {key!r} or its value is not a ConfigMap's")
    return errors


# --------------------------------------------------------------------------- Volcano's policy matching, mirrored


def volcano_action(job: Dict[str, Any], task: str, event: str, exit_code: int = 0) -> str:
    """applyPolicies: the task's policies, then the job's; in each, a policy's events are matched before its exit
    code, and the first match wins; no match is SyncJob. PodPending's event policies need a timeout."""

    def match(policies) -> Optional[str]:
        for policy in policies or ():
            events = list(policy.get("events") or []) + ([policy["event"]] if policy.get("event") else [])
            if events and (event in events or "*" in events) and (event != "PodPending" or policy.get("timeout")):
                return policy["action"]
            if policy.get("exitCode") is not None and policy["exitCode"] == exit_code:
                return policy["action"]
        return None

    for spec_task in job["spec"]["tasks"]:
        if spec_task["name"] == task:
            found = match(spec_task.get("policies"))
            if found:
                return found
            break
    return match(job["spec"].get("policies")) or "SyncJob"


def pod_failed(job: Dict[str, Any], exit_code: int, task: str = "worker") -> str:
    """updatePod: a pod turned Failed carries ContainerStatuses[0]'s exit code and the event PodFailed."""
    return volcano_action(job, task, "PodFailed", exit_code)


def documented_policies() -> Dict[str, str]:
    """The guide's table: `| 79 | preflight failed | RestartJob | why |` rows, the code (or event) -> the action."""
    rows = {}
    for line in GUIDE.read_text().splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and (cells[0].isdigit() or cells[0] == "PodEvicted"):
            rows[cells[0]] = cells[2].split()[0].strip("`*")
    return rows


@pytest.fixture(scope="module")
def every_job() -> Dict[str, Dict[str, Any]]:
    return {method: the_job(manifest_documents(*flags)) for method, flags in LAUNCHES.items()}


def test_every_runtime_exit_code_is_in_the_guides_table():
    documented = documented_policies()
    missing = [int(code) for code in ExitCode if code != ExitCode.OK and str(int(code)) not in documented]
    assert missing == [], "docs/guides/volcano.md's policy table lacks these exit codes"
    assert documented["PodEvicted"] == "RestartJob"


@pytest.mark.parametrize("code", [int(code) for code in ExitCode if code != ExitCode.OK])
def test_each_exit_code_leads_to_the_documented_action(every_job, code):
    expected = documented_policies()[str(code)]
    expected = "SyncJob" if expected == "none" else expected
    for method, job in every_job.items():
        for task in (t["name"] for t in job["spec"]["tasks"]):
            assert pod_failed(job, code, task) == expected, f"{method}, task {task}, exit {code}"
    assert manifest.action_for(code) == expected


def test_the_documented_decisions(every_job):
    job = every_job["torchrun"]
    restart = {ExitCode.PREFLIGHT_FAILED, ExitCode.TIMED_OUT, ExitCode.HANG_DETECTED, ExitCode.DEVICE_NOT_RELEASED}
    abort = {ExitCode.BAD_CONFIGURATION, ExitCode.RESTARTS_EXHAUSTED}
    assert {pod_failed(job, code) for code in restart} == {"RestartJob"}
    assert {pod_failed(job, code) for code in abort} == {"AbortJob"}
    # The origin decides: a node stopped for the job (86) has no policy of its own.
    assert pod_failed(job, ExitCode.STOPPED_FOR_JOB) == "SyncJob"
    # The training's own failures and deaths by signal: no policy, the job fails when its pods have.
    assert {pod_failed(job, code) for code in (1, 2, 137, 139, 143)} == {"SyncJob"}
    # deletePod: an evicted or deleted pod restarts the job.
    assert volcano_action(job, "worker", "PodEvicted") == "RestartJob"
    assert manifest.action_for(event="PodEvicted") == "RestartJob"


def job_outcome(job: Dict[str, Any], failures: List[List[int]]) -> List[str]:
    """The job's phases as Volcano's state machine moves them: each run, the exit codes of its failed pods in the
    order the controller handles them (none: every pod succeeded). Running: the first action other than SyncJob
    decides (RestartJob counts a retry; AbortJob aborts); in Restarting every later request only continues the
    restart; then RetryCount >= maxRetry fails the job, else it is Pending and runs again."""
    phases = []
    for retries, codes in enumerate(failures, start=1):
        if not codes:
            return phases + ["Completed"]
        action = next((a for a in (pod_failed(job, code) for code in codes) if a != "SyncJob"), "SyncJob")
        if action == "AbortJob":
            return phases + ["Aborted"]
        if action == "SyncJob":
            return phases + ["Failed"]  # every pod ended, fewer succeeded than minAvailable
        if retries >= job["spec"]["maxRetry"]:
            return phases + ["Failed"]
        phases.append("Restarting")
    return phases + ["Running"]  # still running after the runs given


def test_max_retry_counts_runs_not_restarts(every_job):
    # volcano#2012: maxRetry N allows N runs, N-1 restarts.
    job = every_job["rtf"]
    assert job["spec"]["maxRetry"] == manifest.MAX_RUNS == 3
    always_a_bad_node = [[ExitCode.PREFLIGHT_FAILED]] * 10
    assert job_outcome(job, always_a_bad_node) == ["Restarting", "Restarting", "Failed"]


def test_a_node_stopped_for_the_job_cannot_overrule_the_origin(every_job):
    # The other nodes' 86 may reach the controller before the origin's code: it must not decide.
    job = every_job["torchrun"]
    assert job_outcome(job, [[ExitCode.STOPPED_FOR_JOB, ExitCode.BAD_CONFIGURATION]]) == ["Aborted"]
    assert job_outcome(job, [[ExitCode.STOPPED_FOR_JOB, ExitCode.RESTARTS_EXHAUSTED]]) == ["Aborted"]
    assert job_outcome(job, [[ExitCode.STOPPED_FOR_JOB, ExitCode.HANG_DETECTED], []]) == ["Restarting", "Completed"]
    assert job_outcome(job, [[ExitCode.STOPPED_FOR_JOB, 1]]) == ["Failed"]


def test_no_event_policy_shadows_an_exit_code(every_job):
    for job in every_job.values():
        policies = job["spec"]["policies"]
        first_event = next(i for i, p in enumerate(policies) if "event" in p)
        assert all("exitCode" in p for p in policies[:first_event])
        assert all("exitCode" not in p for p in policies[first_event:])
        assert all(p.get("event") not in ("PodFailed", "*") for p in policies)


# --------------------------------------------------------------------------- what the pods get


def pod_environment(job: Dict[str, Any], task: str, index: int) -> Dict[str, str]:
    """The container's environment as Volcano makes the pod: the template's values, the env plugin's
    VK_TASK_INDEX and VC_TASK_INDEX, the svc plugin's VC_<TASK>_HOSTS and VC_<TASK>_NUM for every task (from its
    ConfigMap); the downward API's fields for pod `<job>-<task>-<index>`."""
    name = job["metadata"]["name"]
    (spec_task,) = [t for t in job["spec"]["tasks"] if t["name"] == task]
    (container,) = spec_task["template"]["spec"]["containers"]
    pod_name = f"{name}-{task}-{index}"
    fields = {"status.podIP": f"10.0.0.{index + 1}", "metadata.name": pod_name}
    environ = {}
    for variable in container["env"]:
        environ[variable["name"]] = variable.get("value") or fields[variable["valueFrom"]["fieldRef"]["fieldPath"]]
    assert "env" in job["spec"]["plugins"] and "svc" in job["spec"]["plugins"]
    environ.update(VK_TASK_INDEX=str(index), VC_TASK_INDEX=str(index))
    for other in job["spec"]["tasks"]:
        key = other["name"].replace("-", "_").upper()
        hosts = [f"{name}-{other['name']}-{i}.{name}" for i in range(other["replicas"])]
        environ[f"VC_{key}_HOSTS"] = ",".join(hosts)
        environ[f"VC_{key}_NUM"] = str(len(hosts))
    return environ


@pytest.mark.parametrize("method", METHODS)
def test_the_runtime_reads_the_job_from_what_volcano_gives_each_pod(every_job, method):
    job = every_job[method]
    name = job["metadata"]["name"]
    nodes = job["spec"]["tasks"][-1]["replicas"]
    for spec_task in job["spec"]["tasks"]:
        for index in range(spec_task["replicas"]):
            environ = pod_environment(job, spec_task["name"], index)
            spec = spec_module.load({}, environ)
            assert (spec.vj_name, spec.task_name, spec.task_index) == (name, spec_task["name"], index)
            assert spec.num_hosts == nodes and spec.run_method == method
            assert spec.worker_hosts == ",".join(f"{name}-worker-{i}.{name}" for i in range(nodes))
            assert str(spec.log_dir) == "/home/ma-user/modelarts/log"
            assert environ["MA_CURRENT_INSTANCE_NAME"] == f"{name}-{spec_task['name']}-{index}"


def test_a_multi_node_tensorflow_job_is_a_ps_and_a_worker_per_node(every_job):
    job = every_job["tensorflow-gpu"]
    name = job["metadata"]["name"]
    assert [(t["name"], t["replicas"]) for t in job["spec"]["tasks"]] == [("ps", 2), ("worker", 2)]
    assert job["spec"]["minAvailable"] == 4
    environ = pod_environment(job, "ps", 1)
    assert cluster_hosts(environ, "TF_PS_HOSTS") == [(f"{name}-ps-{i}.{name}", manifest.TF_PORT) for i in (0, 1)]
    assert cluster_hosts(environ, "TF_WORKER_HOSTS") == [(f"{name}-worker-{i}.{name}", manifest.TF_PORT)
                                                         for i in (0, 1)]


def container_of(job: Dict[str, Any], task: int = 0) -> Dict[str, Any]:
    return job["spec"]["tasks"][task]["template"]["spec"]["containers"][0]


def test_the_pod_runs_the_runtime_first_with_the_platforms_parts(every_job):
    for method, job in every_job.items():
        pod = job["spec"]["tasks"][0]["template"]["spec"]
        container = container_of(job)
        assert container["command"] == [manifest.ENTRYPOINT] and container["args"] == ["python", "train.py"]
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert pod["restartPolicy"] == "Never"
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert job["spec"]["minAvailable"] == sum(t["replicas"] for t in job["spec"]["tasks"]), method
        assert ("ssh" in job["spec"]["plugins"]) == (method == "mpirun")
        # The defaults: 15 s of stop grace and 25 s of final sync.
        assert pod["terminationGracePeriodSeconds"] == 40


@pytest.mark.parametrize("method, resource, count", [
    ("rtf", "huawei.com/Ascend910", 8), ("msrun", "huawei.com/Ascend910", 8), ("torchrun", "nvidia.com/gpu", 4),
    ("pytorch-gpu", "nvidia.com/gpu", 8), ("mpirun", None, 0), ("plain", None, 0),
])
def test_devices_are_the_containers_resources_and_ma_num_gpus(every_job, method, resource, count):
    job = every_job[method]
    container = container_of(job)
    environ = {v["name"]: v.get("value") for v in container["env"]}
    assert environ["MA_NUM_GPUS"] == str(count)
    if resource is None:
        assert "resources" not in container
    else:
        assert container["resources"] == {"limits": {resource: count}, "requests": {resource: count}}


def test_an_npu_job_waits_for_the_rank_table_of_its_configmap(every_job):
    documents = manifest_documents(*LAUNCHES["rtf"])
    job = the_job(documents)
    name = job["metadata"]["name"]
    (table,) = [d for d in documents if d["kind"] == "ConfigMap"]
    assert table["metadata"]["name"] == f"rings-config-{name}"
    assert yaml.safe_load(table["data"]["hccl.json"]) == {"status": "initializing"}
    assert job["metadata"]["labels"] == {"ring-controller.atlas": "ascend-910"}
    environ = pod_environment(job, "worker", 0)
    spec = spec_module.load({}, environ)
    assert spec.ranktable_file == Path(manifest.RANK_TABLE_DIR, "hccl.json") and spec.waits_for_rank_table


def test_the_job_file_travels_in_a_configmap_and_sets_the_grace(tmp_path):
    job_file = tmp_path / "job.yaml"
    text = ("stop_grace_seconds: 20\nsync:\n  final_seconds: 100.5\nlog_dir: /cache/logs\nrun_method: torchrun\n"
            "num_hosts: 3\nhyperparameters:\n  lr: 0.1\n")
    job_file.write_text(text)
    documents = manifest_documents("--config", str(job_file))
    job = the_job(documents)
    (config_map,) = [d for d in documents if d["kind"] == "ConfigMap"]
    assert config_map["data"] == {"job.yaml": text}
    assert job["spec"]["tasks"][0]["replicas"] == 3
    pod = job["spec"]["tasks"][0]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 121  # ceil(20 + 100.5)
    assert {"name": "job-file", "configMap": {"name": config_map["metadata"]["name"]}} in pod["volumes"]
    # In the pod: the file, where MA_RUNTIME_CONFIG says, gives what the environment leaves to it.
    mounted = tmp_path / "etc" / "job.yaml"
    mounted.parent.mkdir()
    mounted.write_text(config_map["data"]["job.yaml"])
    environ = pod_environment(job, "worker", 2)
    assert environ.pop("MA_RUNTIME_CONFIG") == f"{manifest.JOB_FILE_DIR}/{manifest.JOB_FILE_NAME}"
    spec = spec_module.load({}, environ, str(mounted))
    assert str(spec.log_dir) == "/cache/logs" and spec.stop_grace_seconds == 20
    assert spec.hyperparameters == (("lr", "0.1"),) and spec.task_index == 2


def test_flags_beat_the_job_file(tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text("run_method: torchrun\nnum_hosts: 3\nnum_gpus: 2\n")
    job = the_job(manifest_documents("--config", str(job_file), "--nodes", "4", "--method", "mpirun",
                                     "--accelerator", "gpu"))
    environ = {v["name"]: v.get("value") for v in container_of(job)["env"]}
    assert (environ["MA_NUM_HOSTS"], environ["MA_RUN_METHOD"], environ["MA_NUM_GPUS"]) == ("4", "mpirun", "2")


def test_the_default_name_is_the_jobs_own_and_a_name_can_be_given():
    first = the_job(manifest_documents("--nodes", "2"))["metadata"]["name"]
    assert first == the_job(manifest_documents("--nodes", "2"))["metadata"]["name"]
    assert re.match(r"^ma-job-[0-9a-f]{10}$", first)
    assert first != the_job(manifest_documents("--nodes", "3"))["metadata"]["name"]
    job = the_job(manifest_documents("--name", "bert-large", "--entrypoint", "ma-runtime run --"))
    assert job["metadata"]["name"] == "bert-large"
    assert container_of(job)["command"] == ["ma-runtime", "run", "--"]


@pytest.mark.parametrize("flags, command, said", [
    ([], (), "no command given"),
    (["--image", ""], ("python",), "--image is missing"),
    (["--image", "a b"], ("python",), "not an image reference"),
    (["--nodes", "0"], ("python",), "--nodes='0' must be between 1 and"),
    (["--nodes", "two"], ("python",), "--nodes='two' is not a whole number"),
    (["--method", "deepspeed"], ("python",), "--method='deepspeed' is not a launcher"),
    (["--accelerator", "tpu"], ("python",), "--accelerator='tpu' is not one of none, gpu, npu"),
    (["--devices", "4"], ("python",), "--devices='4' without an accelerator"),
    (["--accelerator", "gpu", "--devices", "0"], ("python",), "not a whole number from 1 to 1024"),
    (["--name", "Bad_Name"], ("python",), "cannot name the job's pods"),
    (["--name", "a" * 60, "--nodes", "20"], ("python",), "cannot name the job's pods"),
    (["--entrypoint", "'unclosed"], ("python",), "--entrypoint="),
    (["--config", "/nonexistent/job.yaml"], ("python",), "no such job file"),
    (["--frobnicate"], ("python",), "unknown option --frobnicate"),
])
def test_bad_input_is_one_line_and_78(flags, command, said):
    done = print_manifest(*flags, command=command)
    assert done.returncode == ExitCode.BAD_CONFIGURATION
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and said in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_a_bad_job_file_is_one_line_and_78(tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text("stop_grace_second: 20\n")
    done = print_manifest("--config", str(job_file))
    assert done.returncode == ExitCode.BAD_CONFIGURATION and len(done.stderr.splitlines()) == 1
    assert "unknown key 'stop_grace_second'" in done.stderr


@pytest.mark.parametrize("words, said", [(["kubeflow"], "unknown target 'kubeflow'"), ([], "no target given")])
def test_an_unknown_or_missing_target_is_one_line_and_78(words, said):
    done = subprocess.run([sys.executable, "-m", "ma_runtime", "manifest", *words], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert done.returncode == ExitCode.BAD_CONFIGURATION and said in done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stdout == ""
