"""The settings table: every setting the runtime reads, one `Setting` row each (setting.py says what a row holds).

Rows are declared where their knowledge lives: the job's own here, each launcher's in its module
(launch/<method>.py, `SETTINGS`), collected through launch.registry. Everything else that names a setting (the
JobSpec's fields, `--flags`, job-file keys, what the command is given, the docs) is derived from these rows.
"""

import re
from pathlib import Path
from typing import Tuple

from ma_runtime.launch import registry as launch_registry
from ma_runtime.setting import (
    WEEK_SECONDS,
    Setting,
    auto_off_or_path,
    choice,
    default_markers,
    excludes,
    exit_codes,
    integer,
    marker_globs,
    matching,
    names,
    number,
    path,
    port,
    regex,
    seconds,
    switch,
    targets,
    text,
    url,
)

PREFLIGHT_CHECKS = ("dns", "disk-size", "ulimit", "gpu", "npu")
LOG_FORMATS = ("logfmt", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
# auto, off, or etcd://host:port[,host:port...] (no user or password: the store holds no secret, nor its URL)
_COORDINATOR = re.compile(r"^(auto|off|etcd://[A-Za-z0-9.\[\]:-]+(,[A-Za-z0-9.\[\]:-]+)*)$")
COORDINATOR_PORT = 29655  # clear of the platform's 18888, 36666/36667, torchrun's 29500 and its c10d 29400

# Path defaults are None here: they derive from MA_HOME once it is resolved.
SETTINGS: Tuple[Setting, ...] = (
    Setting("ma_home", "MA_HOME", path, "job home directory (platform: /home/ma-user)",
            exported=True),
    Setting("mount_path", "MA_MOUNT_PATH", path, "ModelArts working mount (default: MA_HOME/modelarts)",
            exported=True),
    Setting("job_dir", "MA_JOB_DIR", path, "parent of the code directory (default: MA_MOUNT_PATH/user-job-dir)",
            exported=True),
    Setting("log_dir", "MA_LOG_DIR", path, "task log directory (default: MA_MOUNT_PATH/log)", exported=True),
    Setting("vj_name", "MA_VJ_NAME", matching(_JOB_ID, "Volcano job name"), "Volcano job name, ma-job-<uuid>",
            exported=True),
    Setting("task_name", "MA_TASK_NAME", matching(_TASK_NAME, "task name"), "container role", "worker", exported=True),
    Setting("task_index", "VC_TASK_INDEX", integer(0, 99_999), "this container's index in the job", 0,
            # The platform's fallbacks, in this order (docs/platform.md: run_mpi.sh reads them too).
            aliases=("MA_TASK_INDEX", "VK_TASK_INDEX"), exported=True),
    # Dynamic routing (the platform's ROUTE_PLAN): this node's rank and the master (launch/role.py, the one rule).
    Setting("route_plan", "ROUTE_PLAN", switch, "the platform's dynamic routing: the node rank is RANK_AFTER_ACC "
            "and the master MA_MASTER_INDEX's node", False, cli=False),
    Setting("rank_after_acc", "RANK_AFTER_ACC", integer(0, 99_999), "this node's rank after dynamic routing "
            "(with ROUTE_PLAN=true; default: VC_TASK_INDEX)", None, cli=False),
    Setting("master_index", "MA_MASTER_INDEX", integer(0, 99_999), "the master's task index under dynamic "
            "routing on Snt9b (with ROUTE_PLAN=true; unset: the first of VC_WORKER_HOSTS)", None, cli=False),
    Setting("num_hosts", "MA_NUM_HOSTS", integer(1, 100_000), "number of nodes in the job", 1, exported=True),
    Setting("num_gpus", "MA_NUM_GPUS", integer(0, 1024), "accelerator cards (GPU or NPU) in this container", 0,
            exported=True),
    Setting("nproc_per_node", "MA_RUNTIME_NPROC_PER_NODE", integer(1, 1024), "processes per node for torchrun "
            "and msrun (default: MA_NUM_GPUS, at least 1); asks for N CPU processes without accelerators"),
    Setting("proc_start_cnt", "MA_PROC_START_CNT", integer(1, 1_000_000), "times the command has started in this "
            "pod", 1),
    Setting("schedule_cnt", "MA_SCHEDULE_CNT", integer(1, 1_000_000), "times this pod has been scheduled", 1,
            exported=True),
    Setting(
        "stop_grace_seconds",
        "MA_RUNTIME_STOP_GRACE_SECONDS",
        seconds,
        "seconds between forwarding SIGTERM/SIGINT and SIGKILL",
        15.0,
    ),
    Setting("max_restarts", "MA_RUNTIME_MAX_RESTARTS", integer(0, 128), "restarts of a failed command in place "
            "(0: off)", 0),
    Setting("no_restart_exit_codes", "MA_RUNTIME_NO_RESTART_EXIT_CODES", exit_codes, "exit codes that end the job "
            "without a restart (78 always does)", (93,)),
    Setting("same_failure_limit", "MA_RUNTIME_SAME_FAILURE_LIMIT", integer(0, 128), "the same failure this many "
            "times in a row ends the job (0: no limit)", 3),
    Setting("restart_backoff_seconds", "MA_RUNTIME_RESTART_BACKOFF_SECONDS", number(0, 3600), "wait before the "
            "second restart, doubling for each one after, up to 60 s", 1.0),
    Setting("device_release_seconds", "MA_RUNTIME_DEVICE_RELEASE_SECONDS", number(0, 3600), "how long to wait "
            "for the accelerators to be released before a restart", 60.0),
    *(
        # The progress file is given to the command too: the training knows what to touch however it was set.
        Setting(f"hang_{name}", env, parse, help, default, cli=False, exported=name == "progress_file")
        for name, env, parse, help, default in (
            ("detect", "MA_RUNTIME_HANG_DETECT", choice(("auto", "on", "off")), "hang detection: auto (on when the "
             "job has accelerators), on (also a CPU job: the IO/CPU rule alone), off", "auto"),
            ("detect_time", "MA_HANG_DETECT_TIME", integer(10, 720), "the platform's hang window in minutes: no "
             "progress for this long is a hang", 30),
            ("detect_seconds", "MA_RUNTIME_HANG_DETECT_SECONDS", number(5, 720 * 60), "the hang window in seconds, "
             "instead of MA_HANG_DETECT_TIME", None),
            ("startup_seconds", "MA_RUNTIME_HANG_STARTUP_SECONDS", seconds, "the window before an attempt's first "
             "progress (warm-up, compilation, data loading); default: twice the hang window", None),
            ("restarts", "MA_RUNTIME_HANG_RESTARTS", integer(0, 128), "hung attempts restarted in a row before the "
             "job ends with 83 (0: none)", 3),
            ("stacks", "MA_RUNTIME_HANG_STACKS", switch, "Python workers register a faulthandler stack dump, taken "
             "before a hung attempt is stopped", True),
            ("progress_file", "MA_RUNTIME_PROGRESS_FILE", path, "a file the training touches as it makes "
             "progress: its mtime resets the hang clock", None),
            ("progress_pattern", "MA_RUNTIME_PROGRESS_PATTERN", regex, "a regular expression: an output line "
             "matching it resets the hang clock", None),
        )
    ),
    *(
        Setting(f"hooks_{name}", env, parse, help, default, cli=False)
        for name, env, parse, help, default in (
            ("pip_install", "MA_RUNTIME_PIP_INSTALL", switch, "install pip-requirement.txt or requirements.txt "
             "from the top of the code directory with the job's python, once per pod", True),
            ("cann_set_env", "MA_RUNTIME_CANN_SET_ENV", auto_off_or_path, "CANN's set_env.sh, sourced before the "
             "pre-start hook: auto (the usual /usr/local/Ascend places), off, or its path", "auto"),
            ("pre_start", "MA_RUNTIME_PRE_START", choice(("auto", "off")), "run ma-pre-start.sh or .py found next "
             "to the boot file or at the top of the code directory (auto), or not (off)", "auto"),
            ("timeout_seconds", "MA_RUNTIME_HOOK_TIMEOUT_SECONDS", number(1, WEEK_SECONDS), "how long pip, CANN's "
             "set_env.sh and the pre-start hook may each run", 1800.0),
            ("pip_url", "MA_PIP_URL", text, "the platform's pip index, given to pip as --index-url unless the job "
             "sets PIP_INDEX_URL (the platform removes it from jobs of more than 10 nodes)", ""),
            ("pip_host", "MA_PIP_HOST", text, "the platform's pip host, given to pip as --trusted-host with "
             "MA_PIP_URL (it is often plain HTTP)", ""),
        )
    ),
    Setting("log_format", "MA_RUNTIME_LOG_FORMAT", choice(LOG_FORMATS), "logfmt or json", "logfmt"),
    Setting("log_level", "MA_RUNTIME_LOG_LEVEL", choice(LOG_LEVELS), "debug, info, warning or error", "info"),
    *(
        Setting(f"preflight{name}", f"MA_RUNTIME_PREFLIGHT{name.upper()}", parse, help, default, cli=False)
        for name, parse, help, default in (
            ("", switch, "run the preflight checks before the command", True),
            ("_checks", names(PREFLIGHT_CHECKS), "checks to run", PREFLIGHT_CHECKS),
            ("_warn_only", names(PREFLIGHT_CHECKS), "checks whose failure only warns", ()),
            ("_dns_deadline_seconds", seconds, "how long to keep retrying DNS", 120.0),
            ("_dns_timeout_seconds", seconds, "timeout of one DNS lookup", 5.0),
            ("_volcano_dir", path, "directory of Volcano's *.host files", Path("/etc/volcano")),
            ("_disk_targets", targets, "disk-size targets", (("root", Path("/")), ("shm", Path("/dev/shm")),
                                                              ("cache", Path("/cache")))),
            ("_root_min_gb", number(0, 1e6), "minimum size of the root filesystem, GB", 32.0),
            ("_shm_min_gb", number(0, 1e6), "minimum size of /dev/shm, GB", 1.0),
            ("_cache_min_gb", number(0, 1e6), "minimum size of /cache, GB", 32.0),
            ("_ulimit", choice(("auto", "always", "never")), "when to check ulimits", "auto"),
            ("_memlock_min_kb", integer(0, 1 << 40), "minimum max-locked-memory, KB", 16000),
            ("_nofile_min", integer(0, 1 << 31), "minimum open files", 1000000),
            ("_stack_min_kb", integer(0, 1 << 40), "minimum stack size, KB", 8000),
            ("_nproc_min", integer(0, 1 << 31), "minimum user processes", 1000000),
            ("_accelerator", choice(("auto", "gpu", "npu", "none")), "which accelerator check runs", "auto"),
            ("_dev_dir", path, "where device nodes are looked for", Path("/dev")),
            ("_tool_timeout_seconds", seconds, "timeout of nvidia-smi / npu-smi", 10.0),
        )
    ),
    Setting("code_url", "MA_RUNTIME_CODE_URL", url, "code directory to download into MA_JOB_DIR", cli=False),
    Setting("log_url", "MA_RUNTIME_LOG_URL", url, "where MA_LOG_DIR is synced (unset: logs stay local)", cli=False),
    *(
        Setting(f"sync_{name}", env, parse, help, default, cli=False)
        for name, env, parse, help, default in (
            ("interval_seconds", "MA_RUNTIME_SYNC_INTERVAL_SECONDS", number(0.1, 3600), "pause between the end "
             "of one output sync cycle and the start of the next", 5.0),
            ("log_interval_seconds", "MA_RUNTIME_LOG_SYNC_INTERVAL_SECONDS", number(0.1, 86400), "pause between "
             "two log sync cycles", 30.0),
            ("final_seconds", "MA_RUNTIME_FINAL_SYNC_SECONDS", seconds, "deadline of the final sync, from the stop "
             "request (or the command's end)", 25.0),
            ("markers", "MA_RUNTIME_SYNC_MARKERS", marker_globs, "completion markers (globs over a path's last "
             "components; a leading + extends the defaults): the unit a marker completes goes up first, the marker "
             "last", default_markers()),
            ("exclude", "MA_RUNTIME_SYNC_EXCLUDE", excludes, "more names (globs) never synced, beside the writers' "
             "temporary files (.tmp*, *.tmp, *.partial, tmp-checkpoint-*)", excludes("")),
        )
    ),
    Setting("resume", "MA_RUNTIME_RESUME", choice(("auto", "off")), "auto: every attempt gets MA_RESUME_CHECKPOINT, "
            "the newest complete checkpoint under the output folders; off: not set", "auto", cli=False),
    Setting("storage_endpoint", "MA_S3_ENDPOINT", text, "OBS endpoint, e.g. https://obs.cn-north-4.myhuaweicloud.com",
            cli=False),
    Setting("storage_use_https", "S3_USE_HTTPS", switch, "HTTPS (1) or HTTP (0) for an endpoint without scheme",
            True, cli=False),
    Setting("storage_verify_ssl", "S3_VERIFY_SSL", switch, "verify the endpoint's certificate", False, cli=False),
    *(
        Setting(f"storage_{name}", f"MA_RUNTIME_STORAGE_{name.upper()}", parse, help, default, cli=False)
        for name, parse, help, default in (
            ("signature", choice(("v4", "v2", "obs")), "request signature", "v4"),
            ("region", text, "signing region (default: from the endpoint's host, obs.<region>.)", ""),
            ("path_style", choice(("auto", "on", "off")), "path-style addressing (auto: on for IPs and "
             "non-Huawei hosts)", "auto"),
            ("workers", integer(1, 256), "concurrent requests", 16),
            ("part_mb", number(1, 5120), "part size of ranged downloads and multipart uploads, MB", 32.0),
            ("large_mb", number(1, 1 << 20), "objects at least this big go in parallel parts (ranged downloads, "
             "multipart uploads); smaller files go up in one PUT (and none over 5120, the most a PUT carries), MB",
             64.0),
            ("retry_seconds", seconds, "how long one request is retried", 120.0),
            ("first_contact_attempts", integer(1, 100), "attempts of a request to an endpoint that never answered in "
             "this run and cannot be connected to (refused, name not resolved, connect timeout); then the endpoint "
             "is taken as wrong for the run", 5),
            ("progress_seconds", seconds, "interval of progress lines", 10.0),
        )
    ),
    Setting("ranktable_file", "RANK_TABLE_FILE", path, "the HCCL rank table, or the directory holding "
            "jobstart_hccl.json (platform: /user/config)", cli=False),
    Setting("ranktable_wait", "MA_RUNTIME_RANKTABLE", choice(("auto", "off")), "auto: wait for and convert the "
            "rank table when RANK_TABLE_FILE is set; off: leave it to the command", "auto", cli=False),
    Setting("ranktable_timeout", "MA_RUNTIME_RANKTABLE_TIMEOUT", seconds, "how long to wait for the rank "
            "table's status=completed, seconds", 1800.0, cli=False),
    Setting("run_method", "MA_RUN_METHOD", choice(launch_registry.METHODS), "launch method: "
            "torchrun, msrun, mpirun, ray, pytorch-gpu, tensorflow-gpu, rtf (one process per NPU) or plain (once); "
            "unset: rtf on NPU jobs, else plain"),
    Setting("worker_hosts", "VC_WORKER_HOSTS", text, "the job's node domain names, comma-separated, worker-0 first",
            "", cli=False),
    # Each launcher's own (launch/<method>.py, `SETTINGS`), in launch.registry.METHODS order.
    *launch_registry.settings(),
    Setting("master_resolve_seconds", "MA_RUNTIME_MASTER_RESOLVE_SECONDS", seconds, "how long to wait for "
            "worker-0's name to resolve (msrun wants its IP)", 120.0, cli=False),
    Setting("peer_wait_seconds", "MA_RUNTIME_PEER_WAIT_SECONDS", seconds, "how long a node waits for the "
            "other nodes it needs to answer (mpirun's worker-0 for every sshd, a watcher for what it watches)",
            600.0, cli=False),
    Setting("peer_gone_seconds", "MA_RUNTIME_PEER_GONE_SECONDS", seconds, "how long every TensorFlow worker's "
            "port must stay closed before a ps takes it for the job's end (a worker restarted in place closes it "
            "meanwhile), and Ray's head port before the other nodes do (MA_RUN_METHOD=ray)", 60.0, cli=False),
    Setting("coordinator", "MA_RUNTIME_COORDINATOR", matching(_COORDINATOR, "auto, off or etcd://host:port[,...]"),
            "the job across nodes: auto (multi-node jobs meet before each attempt and restart together; worker-0 "
            "hosts the store), off (each node alone), or etcd://host:port[,host:port...] (an etcd holds it)", "auto"),
    Setting("coordinator_port", "MA_RUNTIME_COORDINATOR_PORT", port, "the port worker-0's runtime hosts the job's "
            "coordination store on (auto)", COORDINATOR_PORT),
    Setting("barrier_seconds", "MA_RUNTIME_BARRIER_SECONDS", number(1, WEEK_SECONDS, "seconds"), "how long the "
            "nodes wait for each other before each attempt, then exit 81 naming the missing ones", 600.0),
    Setting("node_lost_seconds", "MA_RUNTIME_NODE_LOST_SECONDS", number(2, 3600, "seconds"), "a node whose runtime "
            "is silent this long is lost: the others stop their workers (and restart, or exit 86)", 30.0),
    Setting(
        "skip_image_detect",
        "MA_SKIP_IMAGE_DETECT",
        choice(("0", "1")),
        "the platform's precheck switch: 0 turns preflight off, 1 or unset leaves it on",
        "1",
        cli=False,
    ),
)
SETTINGS_BY_NAME = {setting.name: setting for setting in SETTINGS}
# Parses `--only dns,disk-size` and MA_RUNTIME_PREFLIGHT_CHECKS alike.
parse_check_names = names(PREFLIGHT_CHECKS)
# Parses a duration the way every *_SECONDS setting is parsed (`ranktable wait --timeout`).
parse_seconds = seconds
# The settings the command is given under their variable's name (attempt_processes.worker_env).
EXPORTED: Tuple[Setting, ...] = tuple(setting for setting in SETTINGS if setting.exported)
# Every variable a setting is read from (tests clear them to give a job a clean environment).
VARIABLES: Tuple[str, ...] = tuple(name for setting in SETTINGS for name in setting.envs)
# The runtime's own prefix: a variable with it that nothing reads is a typo until shown otherwise (a warning).
PREFIX = "MA_RUNTIME_"
# Variables with the prefix read outside this table: the job file's path (spec/jobfile.py), the termination message's
# (termination.py), those the runtime gives its command (process/worker.py, supervise/stacks/registry.py,
# launch/torchrun_gate.py), the
# image's entrypoint shim's (entrypoints/ma-runtime-entrypoint) and the project's test suite's (tests/suite_plugin.py).
READ_ELSEWHERE = ("MA_RUNTIME_CONFIG", "MA_RUNTIME_TERMINATION_LOG", "MA_RUNTIME_LINEAGE", "MA_RUNTIME_STACKS_DIR",
                  "MA_RUNTIME_STACKS_SIGNAL", "MA_RUNTIME_TORCHRUN_GATE", "MA_RUNTIME_VENV", "MA_RUNTIME_TESTS_STRICT")
