"""JobSpec: the one frozen description of the job, and where each value came from (the package's entry: `load`).

Every setting is one row of the settings table (spec/table.py, `SETTINGS`; setting.py says what a row holds);
the JobSpec's fields are derived from those rows, plus the few that are not settings (the job file's
hyperparameters and channels, provenance). Sources are applied in one order, flags > env > file > defaults, so
a value's provenance is always one of those four words and `--print-config` can show it. The job file is read
by spec/jobfile.py.

The environment is read here, through the rows (`value_from`), and nowhere else except where a comment says
why. The reads that stay elsewhere are of four kinds: the process environment a program is found on or a child
inherits (PATH, HOME, PYTHONPATH, TMPDIR); variables between the runtime's own processes (MA_RUNTIME_LINEAGE,
MA_RUNTIME_STACKS_*); secrets, which never enter the JobSpec because it is printed (the OBS credentials:
util/credentials.py); and what identifies this pod rather than configuring the job (the pod name and IP the
rank table is matched on: stages/ranktable/node.py).
"""

import dataclasses
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ma_runtime.errors import ConfigError
from ma_runtime.setting import BadValue, Setting, closest, shown
from ma_runtime.spec import jobfile
from ma_runtime.spec.jobfile import Channel
from ma_runtime.spec.table import LOG_FORMATS, PREFIX, READ_ELSEWHERE, SETTINGS, SETTINGS_BY_NAME, VARIABLES

PLATFORM_HOME = Path("/home/ma-user")
# Settings whose default is derived from another once that is resolved (never None in a JobSpec).
_DERIVED = {
    "mount_path": lambda values: values["ma_home"] / "modelarts",
    "job_dir": lambda values: values["mount_path"] / "user-job-dir",
    "log_dir": lambda values: values["mount_path"] / "log",
}


class _JobSpecBase:
    """What the JobSpec derives from its settings; the fields themselves come from the table (below)."""

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


def _field_type(setting: Setting) -> Any:
    """The setting's parsed type, Optional where its default is None (unset stays None)."""
    derived = setting.name == "ma_home" or setting.name in _DERIVED
    return Optional[setting.type] if setting.default is None and not derived else setting.type


# The JobSpec: one field per setting, in the table's order (attribute access `spec.<name>`, and
# dataclasses.fields(JobSpec) gives each one's type), then the fields that are not settings.
JobSpec = dataclasses.make_dataclass(
    "JobSpec",
    [
        *((setting.name, _field_type(setting)) for setting in SETTINGS),
        # Ordered (name, value) pairs, appended to the command as --name=value.
        ("hyperparameters", Tuple[Tuple[str, str], ...], dataclasses.field(default=())),
        ("inputs", Tuple[Channel, ...], dataclasses.field(default=())),
        ("outputs", Tuple[Channel, ...], dataclasses.field(default=())),
        ("config_file", Optional[Path], dataclasses.field(default=None)),
        # Where each setting's value came from: "flag", "env", "file" or "default".
        ("sources", Mapping[str, str], dataclasses.field(default_factory=dict, compare=False)),
        # Things the log should say once logging is up (e.g. the laptop fallback).
        ("notes", Tuple[str, ...], dataclasses.field(default=(), compare=False)),
    ],
    bases=(_JobSpecBase,),
    frozen=True,
    namespace={"__module__": __name__, "__doc__": "The job: every setting resolved (flags > env > file > "
               "defaults), its channels and hyperparameters, and where each value came from."},
)


def load(
    flags: Mapping[str, str],
    environ: Mapping[str, str],
    config_file: Optional[str] = None,
) -> JobSpec:
    """Builds the JobSpec; raises ConfigError naming the variable, key or flag at fault."""
    config_path = jobfile.config_path(config_file, environ)
    file_values = jobfile.read(config_path) if config_path else {}
    values: Dict[str, Any] = {}
    sources: Dict[str, str] = {}
    for setting in SETTINGS:
        found = _resolve(setting, flags, environ, file_values)
        if found is not None:
            values[setting.name], sources[setting.name] = found
    notes = _fill_defaults(values, sources)
    return JobSpec(
        **values,
        hyperparameters=jobfile.hyperparameters(file_values.get("hyperparameters")),
        inputs=jobfile.channels("inputs", file_values.get("inputs")),
        outputs=jobfile.channels("outputs", file_values.get("outputs")),
        config_file=config_path,
        sources=sources,
        notes=tuple(notes),
    )


def value_from(name: str, environ: Mapping[str, str]) -> Optional[Any]:
    """Setting `name` as the environment alone gives it (its variable, then its aliases), parsed; None when none
    is set. The one rule for reading a setting's variables: `load` and the rank table's node view use it."""
    found = _from_environ(SETTINGS_BY_NAME[name], environ)
    return None if found is None else _parsed(SETTINGS_BY_NAME[name], *found)


def unknown_variables(environ: Mapping[str, str]) -> List[Dict[str, str]]:
    """The fields of one "unknown variable" warning for every variable with the runtime's prefix that nothing reads
    (a misspelt MA_RUNTIME_MAX_RESTARTS would otherwise be ignored without a word): the variable, and the known one it
    most likely misspells."""
    known = {name[len(PREFIX):] for name in (*VARIABLES, *READ_ELSEWHERE) if name.startswith(PREFIX)}
    warnings = []
    for name in sorted(environ):
        if name.startswith(PREFIX) and name[len(PREFIX):] not in known:
            # Compared without the prefix, which every name shares and which would make any two look alike.
            close = closest(name[len(PREFIX):], known)
            every = "docs/reference/settings.md lists every variable"
            hint = f"did you mean {PREFIX}{close}? ({every})" if close else f"no setting reads it ({every})"
            warnings.append({"variable": name, "hint": hint})
    return warnings


def warn_unknown_variables(log: Any, environ: Mapping[str, str]) -> None:
    """One warning per variable `unknown_variables` finds; every command that loads the job's settings says them."""
    for fields in unknown_variables(environ):
        log.warning("unknown variable", **fields)


def early_log_format(environ: Mapping[str, str]) -> str:
    """MA_RUNTIME_LOG_FORMAT before the spec is loaded, so that a spec that fails to load is reported in the
    format asked for; a bad value is logfmt here (load then says what is wrong with it)."""
    value = (environ.get(SETTINGS_BY_NAME["log_format"].env) or "logfmt").strip().lower()
    return value if value in LOG_FORMATS else "logfmt"


def _from_environ(setting: Setting, environ: Mapping[str, str]) -> Optional[Tuple[str, str]]:
    """(raw value, variable) from the first of the setting's variables that is set."""
    for variable in setting.envs:
        raw = environ.get(variable) or None  # an empty variable counts as unset: the platform exports some empty
        if raw is not None:
            return raw, variable
    return None


def _resolve(setting: Setting, flags: Mapping[str, str], environ: Mapping[str, str], file_values: Mapping[str, Any]):
    """(value, source) from the first source that sets it, or None."""
    raw = flags.get(setting.name)
    if raw is not None:
        return _parsed(setting, raw, setting.flag), "flag"
    from_environ = _from_environ(setting, environ)
    if from_environ is not None:
        return _parsed(setting, *from_environ), "env"
    raw = file_values.get(setting.name)
    if raw is None:
        return None
    where = f"job file key '{setting.file_key}'"
    if isinstance(raw, list):
        raw = ",".join(str(item) for item in raw)
    if isinstance(raw, bool):
        raw = "on" if raw else "off"
    if isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a single number or string, got {raw!r}")
    return _parsed(setting, raw, where), "file"


def _parsed(setting: Setting, raw: Any, where: str) -> Any:
    try:
        return setting.parse(str(raw))
    except BadValue as exc:
        hint = exc.hint or f"{setting.env}: {setting.help}"
        raise ConfigError(f"{where}={shown(str(raw))} {exc}", hint=hint) from None


def _fill_defaults(values: Dict[str, Any], sources: Dict[str, str]) -> List[str]:
    notes: List[str] = []
    if "ma_home" not in values:
        values["ma_home"], note = _default_home()
        sources["ma_home"] = "default"
        if note:
            notes.append(note)
    for name, default in _DERIVED.items():
        if name not in values:
            values[name], sources[name] = default(values), "default"
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
