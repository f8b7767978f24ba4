"""JobSpec: the one frozen description of the job, and where each value came from.

Every setting is one row of `SETTINGS`: its name (also the job-file key and the
`--flag`), the environment variable that sets it, how a string is parsed, and its
default. Sources are applied in one order, flags > env > file > defaults, so a
value's provenance is always one of those four words and `--print-config` can
show it.
"""

import dataclasses
import os
import re
import stat
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ma_runtime.errors import ConfigError
from ma_runtime.launch import registry as launch_registry

PLATFORM_HOME = Path("/home/ma-user")
PREFLIGHT_CHECKS = ("dns", "disk-size", "ulimit", "gpu", "npu")
DISK_TARGETS = ("root", "shm", "cache")
LOG_FORMATS = ("logfmt", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
# The platform's hyperparameter names (docs/platform.md, "Launch methods"): at most 64 of [A-Za-z0-9_-].
_HYPERPARAMETER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_DECIMAL = re.compile(r"[+-]?[0-9]+\Z")
# A job file is a few hundred bytes; a bound keeps a hostile one (or /dev/zero) from eating memory.
MAX_JOB_FILE_BYTES = 1 << 20
# YAML aliases let 400 bytes describe gigabytes ("billion laughs"): bounded after composing, before building.
MAX_JOB_FILE_NODES = 100_000
MAX_JOB_FILE_DEPTH = 32
# How much of a bad value an error line quotes.
_SHOWN_CHARS = 60


class BadValue(ValueError):
    """A parser's complaint; the caller adds which variable, key or flag it was. `hint` says how to fix it,
    when the parser knows better than the setting's help text."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def _integer(minimum: int, maximum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        word = str(text).strip()
        # Bounded before int(): 5 000 digits cost a quadratic conversion, and no setting needs 20.
        if len(word) > 20 or not _DECIMAL.match(word):
            raise BadValue(f"is not a whole number (expected {minimum} to {maximum})")
        value = int(word)
        if not minimum <= value <= maximum:
            raise BadValue(f"must be between {minimum} and {maximum}")
        return value

    parse.range = (minimum, maximum)
    return parse


def _choice(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = str(text).strip().lower()
        if value not in choices:
            raise BadValue(f"must be one of {', '.join(choices)}")
        return value

    return parse


def _switch(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise BadValue("must be on or off (also 1/0, true/false, yes/no)")


def _number(minimum: float, maximum: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        word = str(text).strip()
        try:
            value = float(word) if len(word) <= 40 else float("nan")
        except ValueError:
            raise BadValue(f"is not a number (expected {minimum:g} to {maximum:g})") from None
        # `not a <= v <= b` is also true for NaN; infinity and 1e308 are above every maximum.
        if not minimum <= value <= maximum:
            raise BadValue(f"must be a number between {minimum:g} and {maximum:g}")
        return value

    parse.range = (minimum, maximum)
    return parse


# Durations: seconds, from 0 to a week. Every wait the runtime makes stays a number that
# select(), threading and time arithmetic accept (1e308 overflows them).
WEEK_SECONDS = 7 * 24 * 3600
_seconds = _number(0, WEEK_SECONDS)
PORT = (1, 65535)
_port = _integer(*PORT)


def _names(allowed: Sequence[str]) -> Callable[[str], Tuple[str, ...]]:
    """A comma-separated subset of `allowed`, in the order given."""

    def parse(text: str) -> Tuple[str, ...]:
        names = tuple(n.strip() for n in str(text).split(",") if n.strip())
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise BadValue(f"names unknown {', '.join(unknown)}; known: {', '.join(allowed)}")
        return names

    return parse


def _exit_codes(text: str) -> Tuple[int, ...]:
    """`93,42`: exit codes, each 1 to 255; empty means none."""
    words = [word.strip() for word in str(text).split(",") if word.strip()]
    if len(words) > 255 or not all(_DECIMAL.match(word) and len(word) <= 3 and 1 <= int(word) <= 255
                                   for word in words):
        raise BadValue("must list exit codes from 1 to 255, separated by commas (e.g. 93,42)")
    return tuple(dict.fromkeys(int(word) for word in words))


def _targets(text: str) -> Tuple[Tuple[str, Path], ...]:
    """`root=/,shm=/dev/shm,cache=/cache`: disk-size targets and their paths."""
    pairs = []
    for part in (p.strip() for p in str(text).split(",") if p.strip()):
        name, sep, path = part.partition("=")
        if not sep or name.strip() not in DISK_TARGETS or not path.strip():
            raise BadValue(f"has a bad entry {part!r}; expected name=path with name in {', '.join(DISK_TARGETS)}")
        pairs.append((name.strip(), Path(path.strip())))
    return tuple(pairs)


def _globs(text: str) -> Tuple[str, ...]:
    """`*.bak,scratch-*`: file-name patterns (fnmatch), never a path. Any glob is safe to match: since Python 3.9
    fnmatch.translate makes every star but the last an atomic group, so matching is linear in the name, however
    many stars (`*a*a*a*a*a*a*a*a*a*a*b`; tests/unit/test_progress.py)."""
    patterns = tuple(dict.fromkeys(word.strip() for word in str(text).split(",") if word.strip()))
    if any("/" in pattern or len(pattern) > 255 for pattern in patterns):
        raise BadValue("must list file-name patterns (no '/'), separated by commas")
    return patterns


def _excludes(text: str) -> Tuple[str, ...]:
    """File or folder names never synced: the writers' temporary files (units.DEFAULT_EXCLUDES) and these."""
    from ma_runtime.sync.units import DEFAULT_EXCLUDES

    return tuple(dict.fromkeys((*DEFAULT_EXCLUDES, *_globs(text))))


def _marker_globs(text: str) -> Tuple[str, ...]:
    """`checkpoint-*/trainer_state.json,*.done`: patterns over the last components of a path (units.matches),
    replacing the defaults; `+step.ok,...` (a leading +) adds them to the defaults instead."""
    from ma_runtime.sync.units import DEFAULT_MARKERS

    text = str(text).strip()
    extend = text.startswith("+")
    patterns = tuple(dict.fromkeys(word.strip() for word in text.lstrip("+").split(",") if word.strip()))
    bad = [p for p in patterns if len(p) > 255 or p.startswith("/") or ".." in p.split("/") or not p.strip("/")]
    if bad or not patterns:
        raise BadValue(f"has a bad pattern {bad[0] if bad else text!r}; expected globs like *.done or "
                       "checkpoint-*/trainer_state.json, separated by commas (a leading + adds to the defaults)")
    return tuple(dict.fromkeys((*DEFAULT_MARKERS, *patterns))) if extend else patterns


def _default_markers() -> Tuple[str, ...]:
    from ma_runtime.sync.units import DEFAULT_MARKERS

    return DEFAULT_MARKERS


def _regex(text: str) -> str:
    """A regular expression (Python's syntax), compiled once here so that a bad one is a 78, not a surprise later.
    Whether it can backtrack catastrophically is not judged here (no test is both sound and complete): it is
    matched in a process of its own with a CPU limit per line (supervise/progress.py)."""
    pattern = str(text)
    if not pattern.strip() or len(pattern) > 1000:
        raise BadValue("must be a regular expression of 1 to 1000 characters")
    try:
        re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as exc:  # `a{99999999999999999999}` is an OverflowError
        raise BadValue(f"is not a valid regular expression: {exc}") from None
    return pattern


def _url(text: str) -> str:
    from ma_runtime.storage import url as storage_url  # obs://, s3://, file:// or a path

    try:
        storage_url.parse(text, where="")  # the problem alone: the error line quotes the value once
    except ConfigError as exc:
        raise BadValue(f"is not a usable URL: {exc.reason}", exc.hint) from None
    return str(text).strip()


def _auto_off_or_path(text: str) -> str:
    """`auto`, `off`, or a file's path (kept as written: found or refused when it is used)."""
    value = str(text).strip()
    if value.lower() in ("auto", "off"):
        return value.lower()
    if not value:
        raise BadValue("must be auto, off or a file's path")
    return value


def _path(text: str) -> Path:
    if not str(text).strip():
        raise BadValue("is an empty path")
    return Path(str(text)).expanduser()


# NCCL_SOCKET_IFNAME's syntax: interface names or prefixes, comma-separated, `^` excluding, `=` matching exactly.
_INTERFACES = re.compile(r"[\^=]?[A-Za-z0-9_.:@-]{1,64}(,[A-Za-z0-9_.:@-]{1,64})*\Z")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}\Z")


def _env_names(text: str) -> Tuple[str, ...]:
    """`HF_TOKEN,WANDB_API_KEY`: environment variable names, comma-separated."""
    names = tuple(dict.fromkeys(word.strip() for word in str(text).split(",") if word.strip()))
    bad = [name for name in names if not _ENV_NAME.match(name)]
    if bad:
        raise BadValue(f"has {bad[0][:_SHOWN_CHARS]!r}, not a variable name; expected names such as HF_TOKEN, "
                       "separated by commas")
    return names


def _matching(pattern: "re.Pattern[str]", what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = str(text).strip()
        if not pattern.match(value):
            raise BadValue(f"is not a valid {what}")
        return value

    return parse


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    env: str
    parse: Callable[[str], Any]
    help: str
    default: Any = None
    # Preflight's many knobs stay off ma-run's --help: env and job file only.
    cli: bool = True

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


# Path defaults are None here: they derive from MA_HOME once it is resolved.
SETTINGS: Tuple[Setting, ...] = (
    Setting("ma_home", "MA_HOME", _path, "job home directory (platform: /home/ma-user)"),
    Setting("mount_path", "MA_MOUNT_PATH", _path, "ModelArts working mount (default: MA_HOME/modelarts)"),
    Setting("job_dir", "MA_JOB_DIR", _path, "parent of the code directory (default: MA_MOUNT_PATH/user-job-dir)"),
    Setting("log_dir", "MA_LOG_DIR", _path, "task log directory (default: MA_MOUNT_PATH/log)"),
    Setting("vj_name", "MA_VJ_NAME", _matching(_JOB_ID, "Volcano job name"), "Volcano job name, ma-job-<uuid>"),
    Setting("task_name", "MA_TASK_NAME", _matching(_TASK_NAME, "task name"), "container role", "worker"),
    Setting("task_index", "VC_TASK_INDEX", _integer(0, 99_999), "this container's index in the job", 0),
    Setting("num_hosts", "MA_NUM_HOSTS", _integer(1, 100_000), "number of nodes in the job", 1),
    Setting("num_gpus", "MA_NUM_GPUS", _integer(0, 1024), "accelerator cards (GPU or NPU) in this container", 0),
    Setting("nproc_per_node", "MA_RUNTIME_NPROC_PER_NODE", _integer(1, 1024), "processes per node for torchrun "
            "and msrun (default: MA_NUM_GPUS, at least 1); asks for N CPU processes without accelerators"),
    Setting("proc_start_cnt", "MA_PROC_START_CNT", _integer(1, 1_000_000), "times the command has started in this "
            "pod", 1),
    Setting("schedule_cnt", "MA_SCHEDULE_CNT", _integer(1, 1_000_000), "times this pod has been scheduled", 1),
    Setting(
        "stop_grace_seconds",
        "MA_RUNTIME_STOP_GRACE_SECONDS",
        _seconds,
        "seconds between forwarding SIGTERM/SIGINT and SIGKILL",
        15.0,
    ),
    Setting("max_restarts", "MA_RUNTIME_MAX_RESTARTS", _integer(0, 128), "restarts of a failed command in place "
            "(0: off)", 0),
    Setting("no_restart_exit_codes", "MA_RUNTIME_NO_RESTART_EXIT_CODES", _exit_codes, "exit codes that end the job "
            "without a restart (78 always does)", (93,)),
    Setting("same_failure_limit", "MA_RUNTIME_SAME_FAILURE_LIMIT", _integer(0, 128), "the same failure this many "
            "times in a row ends the job (0: no limit)", 3),
    Setting("restart_backoff_seconds", "MA_RUNTIME_RESTART_BACKOFF_SECONDS", _number(0, 3600), "wait before the "
            "second restart, doubling for each one after, up to 60 s", 1.0),
    Setting("device_release_seconds", "MA_RUNTIME_DEVICE_RELEASE_SECONDS", _number(0, 3600), "how long to wait "
            "for the accelerators to be released before a restart", 60.0),
    *(
        Setting(f"hang_{name}", env, parse, help, default, cli=False)
        for name, env, parse, help, default in (
            ("detect", "MA_RUNTIME_HANG_DETECT", _choice(("auto", "on", "off")), "hang detection: auto (on when the "
             "job has accelerators), on (also a CPU job: the IO/CPU rule alone), off", "auto"),
            ("detect_time", "MA_HANG_DETECT_TIME", _integer(10, 720), "the platform's hang window in minutes: no "
             "progress for this long is a hang", 30),
            ("detect_seconds", "MA_RUNTIME_HANG_DETECT_SECONDS", _number(5, 720 * 60), "the hang window in seconds, "
             "instead of MA_HANG_DETECT_TIME", None),
            ("startup_seconds", "MA_RUNTIME_HANG_STARTUP_SECONDS", _seconds, "the window before an attempt's first "
             "progress (warm-up, compilation, data loading); default: twice the hang window", None),
            ("restarts", "MA_RUNTIME_HANG_RESTARTS", _integer(0, 128), "hung attempts restarted in a row before the "
             "job ends with 83 (0: none)", 3),
            ("stacks", "MA_RUNTIME_HANG_STACKS", _switch, "Python workers register a faulthandler stack dump, taken "
             "before a hung attempt is stopped", True),
            ("progress_file", "MA_RUNTIME_PROGRESS_FILE", _path, "a file the training touches as it makes "
             "progress: its mtime resets the hang clock", None),
            ("progress_pattern", "MA_RUNTIME_PROGRESS_PATTERN", _regex, "a regular expression: an output line "
             "matching it resets the hang clock", None),
        )
    ),
    *(
        Setting(f"hooks_{name}", env, parse, help, default, cli=False)
        for name, env, parse, help, default in (
            ("pip_install", "MA_RUNTIME_PIP_INSTALL", _switch, "install pip-requirement.txt or requirements.txt "
             "from the top of the code directory with the job's python, once per pod", True),
            ("cann_set_env", "MA_RUNTIME_CANN_SET_ENV", _auto_off_or_path, "CANN's set_env.sh, sourced before the "
             "pre-start hook: auto (the usual /usr/local/Ascend places), off, or its path", "auto"),
            ("pre_start", "MA_RUNTIME_PRE_START", _choice(("auto", "off")), "run ma-pre-start.sh or .py found next "
             "to the boot file or at the top of the code directory (auto), or not (off)", "auto"),
            ("timeout_seconds", "MA_RUNTIME_HOOK_TIMEOUT_SECONDS", _number(1, WEEK_SECONDS), "how long pip, CANN's "
             "set_env.sh and the pre-start hook may each run", 1800.0),
        )
    ),
    Setting("log_format", "MA_RUNTIME_LOG_FORMAT", _choice(LOG_FORMATS), "logfmt or json", "logfmt"),
    Setting("log_level", "MA_RUNTIME_LOG_LEVEL", _choice(LOG_LEVELS), "debug, info, warning or error", "info"),
    *(
        Setting(f"preflight{name}", f"MA_RUNTIME_PREFLIGHT{name.upper()}", parse, help, default, cli=False)
        for name, parse, help, default in (
            ("", _switch, "run the preflight checks before the command", True),
            ("_checks", _names(PREFLIGHT_CHECKS), "checks to run", PREFLIGHT_CHECKS),
            ("_warn_only", _names(PREFLIGHT_CHECKS), "checks whose failure only warns", ()),
            ("_dns_deadline_seconds", _seconds, "how long to keep retrying DNS", 120.0),
            ("_dns_timeout_seconds", _seconds, "timeout of one DNS lookup", 5.0),
            ("_volcano_dir", _path, "directory of Volcano's *.host files", Path("/etc/volcano")),
            ("_disk_targets", _targets, "disk-size targets", (("root", Path("/")), ("shm", Path("/dev/shm")),
                                                              ("cache", Path("/cache")))),
            ("_root_min_gb", _number(0, 1e6), "minimum size of the root filesystem, GB", 32.0),
            ("_shm_min_gb", _number(0, 1e6), "minimum size of /dev/shm, GB", 1.0),
            ("_cache_min_gb", _number(0, 1e6), "minimum size of /cache, GB", 32.0),
            ("_ulimit", _choice(("auto", "always", "never")), "when to check ulimits", "auto"),
            ("_memlock_min_kb", _integer(0, 1 << 40), "minimum max-locked-memory, KB", 16000),
            ("_nofile_min", _integer(0, 1 << 31), "minimum open files", 1000000),
            ("_stack_min_kb", _integer(0, 1 << 40), "minimum stack size, KB", 8000),
            ("_nproc_min", _integer(0, 1 << 31), "minimum user processes", 1000000),
            ("_accelerator", _choice(("auto", "gpu", "npu", "none")), "which accelerator check runs", "auto"),
            ("_dev_dir", _path, "where device nodes are looked for", Path("/dev")),
            ("_tool_timeout_seconds", _seconds, "timeout of nvidia-smi / npu-smi", 10.0),
        )
    ),
    Setting("code_url", "MA_RUNTIME_CODE_URL", _url, "code directory to download into MA_JOB_DIR", cli=False),
    Setting("log_url", "MA_RUNTIME_LOG_URL", _url, "where MA_LOG_DIR is synced (unset: logs stay local)", cli=False),
    *(
        Setting(f"sync_{name}", env, parse, help, default, cli=False)
        for name, env, parse, help, default in (
            ("interval_seconds", "MA_RUNTIME_SYNC_INTERVAL_SECONDS", _number(0.1, 3600), "pause between the end "
             "of one output sync cycle and the start of the next", 5.0),
            ("log_interval_seconds", "MA_RUNTIME_LOG_SYNC_INTERVAL_SECONDS", _number(0.1, 86400), "pause between "
             "two log sync cycles", 30.0),
            ("final_seconds", "MA_RUNTIME_FINAL_SYNC_SECONDS", _seconds, "deadline of the final sync, from the stop "
             "request (or the command's end)", 25.0),
            ("markers", "MA_RUNTIME_SYNC_MARKERS", _marker_globs, "completion markers (globs over a path's last "
             "components; a leading + extends the defaults): the unit a marker completes goes up first, the marker "
             "last", _default_markers()),
            ("exclude", "MA_RUNTIME_SYNC_EXCLUDE", _excludes, "more names (globs) never synced, beside the writers' "
             "temporary files (.tmp*, *.tmp, *.partial, tmp-checkpoint-*)", _excludes("")),
        )
    ),
    Setting("resume", "MA_RUNTIME_RESUME", _choice(("auto", "off")), "auto: every attempt gets MA_RESUME_CHECKPOINT, "
            "the newest complete checkpoint under the output folders; off: not set", "auto", cli=False),
    Setting("storage_endpoint", "MA_S3_ENDPOINT", str, "OBS endpoint, e.g. https://obs.cn-north-4.myhuaweicloud.com",
            cli=False),
    Setting("storage_use_https", "S3_USE_HTTPS", _switch, "HTTPS (1) or HTTP (0) for an endpoint without scheme",
            True, cli=False),
    Setting("storage_verify_ssl", "S3_VERIFY_SSL", _switch, "verify the endpoint's certificate", False, cli=False),
    *(
        Setting(f"storage_{name}", f"MA_RUNTIME_STORAGE_{name.upper()}", parse, help, default, cli=False)
        for name, parse, help, default in (
            ("signature", _choice(("v4", "v2", "obs")), "request signature", "v4"),
            ("region", str, "signing region (default: from the endpoint's host, obs.<region>.)", ""),
            ("path_style", _choice(("auto", "on", "off")), "path-style addressing (auto: on for IPs and "
             "non-Huawei hosts)", "auto"),
            ("workers", _integer(1, 256), "concurrent requests", 16),
            ("part_mb", _number(1, 5120), "part size of ranged downloads and multipart uploads, MB", 32.0),
            ("large_mb", _number(1, 1 << 20), "objects at least this big go in parallel parts, MB", 64.0),
            ("retry_seconds", _seconds, "how long one request is retried", 120.0),
            ("progress_seconds", _seconds, "interval of progress lines", 10.0),
        )
    ),
    Setting("ranktable_file", "RANK_TABLE_FILE", _path, "the HCCL rank table, or the directory holding "
            "jobstart_hccl.json (platform: /user/config)", cli=False),
    Setting("ranktable_wait", "MA_RUNTIME_RANKTABLE", _choice(("auto", "off")), "auto: wait for and convert the "
            "rank table when RANK_TABLE_FILE is set; off: leave it to the command", "auto", cli=False),
    Setting("ranktable_timeout", "MA_RUNTIME_RANKTABLE_TIMEOUT", _seconds, "how long to wait for the rank "
            "table's status=completed, seconds", 1800.0, cli=False),
    Setting("run_method", "MA_RUN_METHOD", _choice(launch_registry.METHODS), "launch method: "
            "torchrun, msrun, mpirun, pytorch-gpu, tensorflow-gpu, rtf (one process per NPU) or plain (once); "
            "unset: rtf on NPU jobs, else plain",
            cli=False),
    Setting("worker_hosts", "VC_WORKER_HOSTS", str, "the job's node domain names, comma-separated, worker-0 first",
            "", cli=False),
    Setting("torchrun_master_port", "MA_TORCHRUN_MASTER_PORT", _port, "torchrun's --master_port on "
            "multi-node jobs", 18888, cli=False),
    Setting("extra_torchrun_params", "MA_EXTRA_TORCHRUN_PARAMS", str, "extra torchrun flags; one it names "
            "replaces the preset one", "", cli=False),
    Setting("ms_ranktable_enable", "MS_RANKTABLE_ENABLE", _switch, "give msrun --rank_table_file", False, cli=False),
    Setting("msrun_cluster_time_out", "MSRUN_CLUSTER_TIME_OUT", _integer(1, WEEK_SECONDS), "msrun's "
            "--cluster_time_out, seconds", 600, cli=False),
    Setting("msrun_master_port", "MA_RUNTIME_MSRUN_MASTER_PORT", _port, "msrun's --master_port (its own "
            "default)", 8118, cli=False),
    Setting("init_method_port", "MA_RUNTIME_INIT_METHOD_PORT", _port, "the port of pytorch-gpu's --init_method "
            "(PyTorch's usual MASTER_PORT)", 29500, cli=False),
    Setting("master_resolve_seconds", "MA_RUNTIME_MASTER_RESOLVE_SECONDS", _seconds, "how long to wait for "
            "worker-0's name to resolve (msrun wants its IP)", 120.0, cli=False),
    Setting("peer_wait_seconds", "MA_RUNTIME_PEER_WAIT_SECONDS", _seconds, "how long a node waits for the "
            "other nodes it needs to answer (mpirun's worker-0 for every sshd, a watcher for what it watches)",
            600.0, cli=False),
    Setting("peer_gone_seconds", "MA_RUNTIME_PEER_GONE_SECONDS", _seconds, "how long every TensorFlow worker's "
            "port must stay closed before a ps takes it for the job's end (a worker restarted in place closes it "
            "meanwhile)", 60.0, cli=False),
    Setting("sshd_port", "MY_SSHD_PORT", _port, "the port of the sshd every node of a multi-node mpirun job "
            "starts (the platform's run_mpi.sh default)", 36666, cli=False),
    Setting("mpi_key_port", "MA_RUNTIME_MPI_KEY_PORT", _port, "the port on which worker-0 of a multi-node "
            "mpirun job serves the job's public key when no SSH trust files are mounted (default: MY_SSHD_PORT + 1)",
            None, cli=False),
    Setting("mpi_slots", "MY_MPI_SLOTS", _integer(1, 1024), "mpirun's processes per node (default: "
            "MA_RUNTIME_NPROC_PER_NODE, else MA_NUM_GPUS, at least 1)", None, cli=False),
    Setting("mpi_btl_tcp_if", "MY_MPI_BTL_TCP_IF", _matching(_INTERFACES, "list of network interfaces"),
            "the interfaces NCCL uses under mpirun (NCCL_SOCKET_IFNAME, unless the job sets that)", "eth0,bond0",
            cli=False),
    Setting("extra_mpirun_params", "MA_RUNTIME_EXTRA_MPIRUN_PARAMS", str, "extra mpirun arguments, after the "
            "runtime's and before the command", "", cli=False),
    Setting("mpi_export", "MA_RUNTIME_MPI_EXPORT", _env_names, "more variables mpirun passes to every rank "
            "by name (-x NAME); the only way to pass one named like a secret", (), cli=False),
    Setting(
        "skip_image_detect",
        "MA_SKIP_IMAGE_DETECT",
        _choice(("0", "1")),
        "the platform's precheck switch: 0 turns preflight off, 1 or unset leaves it on",
        "1",
        cli=False,
    ),
)
SETTINGS_BY_NAME = {setting.name: setting for setting in SETTINGS}
# Parses `--only dns,disk-size` and MA_RUNTIME_PREFLIGHT_CHECKS alike.
parse_check_names = _names(PREFLIGHT_CHECKS)
# Parses a duration the way every *_SECONDS setting is parsed (`ranktable wait --timeout`).
parse_seconds = _seconds
# Job-file keys that are not single settings.
FILE_ONLY_KEYS = ("hyperparameters", "inputs", "outputs")
# Job-file sections whose keys are settings named `<section>_<key>`.
FILE_SECTIONS = ("preflight", "storage", "code", "ranktable", "sync", "hang", "hooks")
CONFIG_ENV = "MA_RUNTIME_CONFIG"


@dataclasses.dataclass(frozen=True)
class JobSpec:
    ma_home: Path
    mount_path: Path
    job_dir: Path
    log_dir: Path
    vj_name: Optional[str]
    task_name: str
    task_index: int
    num_hosts: int
    num_gpus: int
    nproc_per_node: Optional[int]
    proc_start_cnt: int
    schedule_cnt: int
    stop_grace_seconds: float
    max_restarts: int
    no_restart_exit_codes: Tuple[int, ...]
    same_failure_limit: int
    restart_backoff_seconds: float
    device_release_seconds: float
    hang_detect: str
    hang_detect_time: int
    hang_detect_seconds: Optional[float]
    hang_startup_seconds: Optional[float]
    hang_restarts: int
    hang_stacks: bool
    hang_progress_file: Optional[Path]
    hang_progress_pattern: Optional[str]
    hooks_pip_install: bool
    hooks_cann_set_env: str
    hooks_pre_start: str
    hooks_timeout_seconds: float
    log_format: str
    log_level: str
    preflight: bool
    preflight_checks: Tuple[str, ...]
    preflight_warn_only: Tuple[str, ...]
    preflight_dns_deadline_seconds: float
    preflight_dns_timeout_seconds: float
    preflight_volcano_dir: Path
    preflight_disk_targets: Tuple[Tuple[str, Path], ...]
    preflight_root_min_gb: float
    preflight_shm_min_gb: float
    preflight_cache_min_gb: float
    preflight_ulimit: str
    preflight_memlock_min_kb: int
    preflight_nofile_min: int
    preflight_stack_min_kb: int
    preflight_nproc_min: int
    preflight_accelerator: str
    preflight_dev_dir: Path
    preflight_tool_timeout_seconds: float
    skip_image_detect: str
    code_url: Optional[str]
    storage_endpoint: Optional[str]
    storage_use_https: bool
    storage_verify_ssl: bool
    storage_signature: str
    storage_region: str
    storage_path_style: str
    storage_workers: int
    storage_part_mb: float
    storage_large_mb: float
    storage_retry_seconds: float
    storage_progress_seconds: float
    ranktable_file: Optional[Path]
    ranktable_wait: str
    ranktable_timeout: float
    run_method: Optional[str]
    worker_hosts: str
    torchrun_master_port: int
    extra_torchrun_params: str
    ms_ranktable_enable: bool
    msrun_cluster_time_out: int
    msrun_master_port: int
    init_method_port: int
    master_resolve_seconds: float
    peer_wait_seconds: float
    peer_gone_seconds: float
    sshd_port: int
    mpi_key_port: Optional[int]
    mpi_slots: Optional[int]
    mpi_btl_tcp_if: str
    extra_mpirun_params: str
    mpi_export: Tuple[str, ...]
    log_url: Optional[str]
    sync_interval_seconds: float
    sync_log_interval_seconds: float
    sync_final_seconds: float
    sync_markers: Tuple[str, ...]
    sync_exclude: Tuple[str, ...]
    resume: str
    # Ordered (name, value) pairs, appended to the command as --name=value.
    hyperparameters: Tuple[Tuple[str, str], ...] = ()
    inputs: Tuple["Channel", ...] = ()
    outputs: Tuple["Channel", ...] = ()
    config_file: Optional[Path] = None
    # Where each setting's value came from: "flag", "env", "file" or "default".
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)
    # Things the log should say once logging is up (e.g. the laptop fallback).
    notes: Tuple[str, ...] = dataclasses.field(default=(), compare=False)

    @property
    def state_dir(self) -> Path:
        """The runtime's own records (staged.json, transfer state, the converted rank table)."""
        return self.mount_path / ".ma-runtime"

    @property
    def syncs(self) -> bool:
        """Whether anything is synced (outputs not `sync: false`, or a log URL): a job that syncs nothing does not
        even import the sync."""
        return bool(self.log_url) or any(channel.sync for channel in self.outputs)

    @property
    def hang_window_seconds(self) -> float:
        """No progress for this long is a hang: MA_RUNTIME_HANG_DETECT_SECONDS, else MA_HANG_DETECT_TIME minutes."""
        return self.hang_detect_seconds if self.hang_detect_seconds is not None else self.hang_detect_time * 60.0

    @property
    def waits_for_rank_table(self) -> bool:
        """Whether `run` waits for and converts the rank table (ranktable.wait_and_convert)."""
        return self.ranktable_file is not None and self.ranktable_wait != "off"

    @property
    def job_id(self) -> str:
        """`ma-job-<uuid>` and `modelarts-job-<uuid>` both give `<uuid>`; unset gives `local`."""
        name = self.vj_name or "local"
        for prefix in ("ma-job-", "modelarts-job-"):
            if name.startswith(prefix) and len(name) > len(prefix):
                return name[len(prefix) :]
        return name

    @property
    def log_stem(self) -> str:
        """`modelarts-job-<uuid>-<task name>-<task index>`, the platform's log name."""
        return f"modelarts-job-{self.job_id}-{self.task_name}-{self.task_index}"

    @property
    def task_log_path(self) -> Path:
        return self.log_dir / f"{self.log_stem}.log"

    @property
    def termination_path(self) -> Path:
        return self.log_dir / f"{self.log_stem}-termination.json"

    @property
    def preflight_enabled(self) -> bool:
        """`ma-runtime run` runs the preflight unless either switch turns it off."""
        return self.preflight and self.skip_image_detect != "0"

    def settings(self) -> Dict[str, Any]:
        """The resolved settings as JSON-ready data (paths as strings)."""
        return {s.name: _jsonable(getattr(self, s.name)) for s in SETTINGS}


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):
        return ",".join(f"{k}={v}" for k, v in value)
    if isinstance(value, tuple):
        return list(value)
    return value


def load(
    flags: Mapping[str, str],
    environ: Mapping[str, str],
    config_file: Optional[str] = None,
) -> JobSpec:
    """Builds the JobSpec; raises ConfigError naming the variable, key or flag at fault."""
    config_path = _config_path(config_file, environ)
    file_values = _read_job_file(config_path) if config_path else {}
    values: Dict[str, Any] = {}
    sources: Dict[str, str] = {}
    for setting in SETTINGS:
        found = _resolve(setting, flags, environ, file_values)
        if found is not None:
            values[setting.name], sources[setting.name] = found
    notes = _fill_defaults(values, sources)
    return JobSpec(
        **values,
        hyperparameters=_hyperparameters(file_values.get("hyperparameters")),
        inputs=_channels("inputs", file_values.get("inputs")),
        outputs=_channels("outputs", file_values.get("outputs")),
        config_file=config_path,
        sources=sources,
        notes=tuple(notes),
    )


def _config_path(flag_value: Optional[str], environ: Mapping[str, str]) -> Optional[Path]:
    text = flag_value if flag_value is not None else environ.get(CONFIG_ENV) or None
    if text is None:
        return None
    where = "--config" if flag_value is not None else CONFIG_ENV
    path = Path(text).expanduser()
    try:
        mode = path.stat().st_mode
    except OSError:
        raise ConfigError(f"{where}={shown(text)}: no such job file", hint="give the path of a YAML job file") from None
    if not stat.S_ISREG(mode):
        from ma_runtime.files import kind_of

        raise ConfigError(f"{where}={shown(text)} is {kind_of(mode)}, not a job file",
                          hint="give the path of a YAML job file") from None
    return path


def _read_job_file(path: Path) -> Dict[str, Any]:
    data = _parse_yaml(path, _read_bounded(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"job file {path}: the top level must be a mapping of keys to values")
    data = _flatten_sections(path, data)
    known = set(SETTINGS_BY_NAME) | set(FILE_ONLY_KEYS)
    for key in data:
        if key not in known:
            raise ConfigError(f"job file {path}: unknown key '{_dotted(key)}'", hint=_suggestion(key, known))
    return data


def _read_bounded(path: Path) -> str:
    from ma_runtime import files

    try:
        data = files.read_regular(path, MAX_JOB_FILE_BYTES)
    except files.TooLarge:
        hint = "a job file holds settings, inputs and hyperparameters; data belongs in inputs"
        raise ConfigError(f"job file {path} is over {MAX_JOB_FILE_BYTES >> 20} MiB: not a job file",
                          hint=hint) from None
    except OSError as exc:  # NotAFile too: replaced by a FIFO since it was looked at
        raise ConfigError(f"job file {path}: cannot read it: {exc.strerror or exc}") from None
    if data is None:
        raise ConfigError(f"job file {path}: no such job file", hint="give the path of a YAML job file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"job file {path}: not UTF-8 text (byte {exc.start})",
                          hint="save the job file as UTF-8") from None


def _parse_yaml(path: Path, text: str) -> Any:
    """The document, built only after its node graph passed the bounds: aliases expanding past
    MAX_JOB_FILE_NODES, nesting deeper than MAX_JOB_FILE_DEPTH, and keys that are not strings are
    refused before anything big is built."""
    # PyYAML costs ~25 ms to import; only jobs that have a file pay it.
    import yaml

    loader_class = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    loader = loader_class(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(path, node)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"job file {path}: YAML syntax error{where}: {problem}") from None
    finally:
        loader.dispose()


def _check_nodes(path: Path, root: Any) -> None:
    """Walks the composed graph as construction would expand it (an alias counts every time it is used)."""
    from yaml import MappingNode, SequenceNode

    visited = 0
    todo = [(root, 1)]
    while todo:
        node, depth = todo.pop()
        visited += 1
        if visited > MAX_JOB_FILE_NODES:
            raise ConfigError(f"job file {path}: expands to more than {MAX_JOB_FILE_NODES} values (YAML aliases?)",
                              hint="a job file this large is not a job file; write the values out")
        if depth > MAX_JOB_FILE_DEPTH:
            raise ConfigError(f"job file {path}: nested deeper than {MAX_JOB_FILE_DEPTH} levels",
                              hint="the job file's sections are at most two levels deep")
        if isinstance(node, MappingNode):
            for key, value in node.value:
                if key.tag != "tag:yaml.org,2002:str":
                    line = key.start_mark.line + 1
                    raise ConfigError(f"job file {path}: line {line}: the key {shown(str(key.value))} is not a "
                                      f"string ({key.tag.rsplit(':', 1)[-1]})",
                                      hint=f"quote it if it is meant as a name: \"{key.value}\":")
                todo.append((value, depth + 1))
        elif isinstance(node, SequenceNode):
            todo.extend((item, depth + 1) for item in node.value)


def _suggestion(key: str, known) -> str:
    import difflib

    names = sorted(_dotted(k) for k in known)
    close = difflib.get_close_matches(_dotted(key), names, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'? (the README's Settings table lists every key)"
    return "the README's Settings table lists every key"


def _flatten_sections(path: Path, data: Dict[str, Any]) -> Dict[str, Any]:
    """`preflight: {checks: [...]}` is the setting `preflight_checks`; `preflight: off` is `preflight`."""
    flat: Dict[str, Any] = {}
    for key, value in data.items():
        if key in FILE_SECTIONS and isinstance(value, dict):
            for sub, sub_value in value.items():
                flat[f"{key}_{sub}"] = sub_value
        else:
            flat[key] = value
    return flat


def _dotted(key: str) -> str:
    for section in FILE_SECTIONS:
        if key.startswith(section + "_"):
            return f"{section}.{key[len(section) + 1:]}"
    return key


def _resolve(setting: Setting, flags: Mapping[str, str], environ: Mapping[str, str], file_values: Mapping[str, Any]):
    """(value, source) from the first source that sets it, or None."""
    candidates = (
        ("flag", flags.get(setting.name), f"{setting.flag}"),
        # An empty variable counts as unset: the platform exports some names empty.
        ("env", environ.get(setting.env) or None, setting.env),
        ("file", file_values.get(setting.name), f"job file key '{_dotted(setting.name)}'"),
    )
    for source, raw, where in candidates:
        if raw is None:
            continue
        if source == "file" and isinstance(raw, list):
            raw = ",".join(str(item) for item in raw)
        if source == "file" and isinstance(raw, bool):
            raw = "on" if raw else "off"
        if source == "file" and isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a single number or string, got {raw!r}")
        try:
            return setting.parse(str(raw)), source
        except BadValue as exc:
            hint = exc.hint or f"{setting.env}: {setting.help}"
            raise ConfigError(f"{where}={shown(str(raw))} {exc}", hint=hint) from None
    return None


def shown(value: str) -> str:
    """A bad value as an error line quotes it: repr'd, and cut (a 30 000-letter value is not a message)."""
    if len(value) <= _SHOWN_CHARS:
        return repr(value)
    return f"{value[:_SHOWN_CHARS]!r}... ({len(value)} characters)"


def _fill_defaults(values: Dict[str, Any], sources: Dict[str, str]) -> List[str]:
    notes: List[str] = []
    if "ma_home" not in values:
        values["ma_home"], note = _default_home()
        sources["ma_home"] = "default"
        if note:
            notes.append(note)
    derived = {
        "mount_path": lambda: values["ma_home"] / "modelarts",
        "job_dir": lambda: values["mount_path"] / "user-job-dir",
        "log_dir": lambda: values["mount_path"] / "log",
    }
    for name, default in derived.items():
        if name not in values:
            values[name], sources[name] = default(), "default"
    for setting in SETTINGS:
        if setting.name not in values:
            values[setting.name], sources[setting.name] = setting.default, "default"
    return notes


def _default_home() -> Tuple[Path, Optional[str]]:
    """The platform's /home/ma-user, or on a laptop a directory we may write to."""
    if PLATFORM_HOME.is_dir() and os.access(PLATFORM_HOME, os.W_OK):
        return PLATFORM_HOME, None
    user_home = Path.home()
    fallback = user_home / ".ma-runtime" if os.access(user_home, os.W_OK) else Path.cwd() / ".ma-runtime"
    return fallback, f"MA_HOME is unset and {PLATFORM_HOME} is missing or read-only; using {fallback}"


def _hyperparameters(raw: Any) -> Tuple[Tuple[str, str], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise ConfigError("job file key 'hyperparameters' must be a mapping of name: value")
    pairs = []
    for name, value in raw.items():
        name = str(name)
        if not _HYPERPARAMETER_NAME.match(name):
            raise ConfigError(
                f"job file key 'hyperparameters.{name}': a name must be 1-64 characters of A-Z a-z 0-9 _ -"
            )
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"job file key 'hyperparameters.{name}': expected a string, number or boolean")
        pairs.append((name, format_value(value)))
    return tuple(pairs)


@dataclasses.dataclass(frozen=True)
class Channel:
    """One input or output of the job file: where it lives, and how the command hears of it."""

    kind: str  # "inputs" or "outputs"
    index: int  # position in its list: the platform's `<name>_<index>` local directory
    name: str  # the parameter name: --<name>=<local path>, or the variable <name>
    url: str
    mode: str = "argument"  # "argument" or "env"
    predownload: bool = False  # outputs: fetch what is already there (resume)
    sync: bool = True  # outputs: uploaded while the command runs and at its end
    delete: bool = False  # outputs: a file uploaded, then removed locally, is removed from the store

    def local_dir(self, mount_path: Path) -> Path:
        """`${MA_MOUNT_PATH}/inputs/data_url_0`, `${MA_MOUNT_PATH}/outputs/train_url_0` (docs/platform.md, D10)."""
        return mount_path / self.kind / f"{self.name}_{self.index}"


_CHANNEL_KEYS = {"inputs": ("name", "url", "mode"),
                 "outputs": ("name", "url", "mode", "predownload", "sync", "delete")}


def _channels(kind: str, raw: Any) -> Tuple[Channel, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"job file key '{kind}' must be a list of {{name, url, ...}} entries")
    return tuple(_channel(kind, index, entry) for index, entry in enumerate(raw))


def _channel(kind: str, index: int, entry: Any) -> Channel:
    where = f"job file key '{kind}[{index}]'"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a mapping with name and url")
    unknown = [k for k in entry if k not in _CHANNEL_KEYS[kind]]
    if unknown:
        raise ConfigError(f"{where}: unknown key '{unknown[0]}'", hint=f"known: {', '.join(_CHANNEL_KEYS[kind])}")
    name, url = str(entry.get("name") or ""), entry.get("url")
    if not _HYPERPARAMETER_NAME.match(name):
        raise ConfigError(f"{where}: name {name!r} must be 1-64 characters of A-Z a-z 0-9 _ -")
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"{where}: url is missing")
    from ma_runtime.storage import url as storage_url  # validates obs://, s3://, file://, paths

    storage_url.parse(url, f"{where}.url")
    mode = str(entry.get("mode", "argument"))
    if mode not in ("argument", "env"):
        raise ConfigError(f"{where}: mode must be argument or env, not {mode!r}")
    switches = {key: entry.get(key, default) for key, default in (("predownload", False), ("sync", True),
                                                                    ("delete", False))}
    for key, value in switches.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be true or false")
    return Channel(kind, index, name, url.strip(), mode, **switches)


def format_value(value: Any) -> str:
    """How a YAML value is written after `--name=`: booleans as the platform's True/False."""
    if isinstance(value, bool):
        return "True" if value else "False"
    return str(value)
