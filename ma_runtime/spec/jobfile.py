"""The job file: a YAML file of settings (by their job-file keys), hyperparameters, inputs and outputs.

Read with bounds (size, node count after aliases, depth) before anything big is built; an unknown key is an
error naming the closest known one. Its settings are handed back flat (`preflight.checks` as
`preflight_checks`) for spec.load to parse with the other sources; its channels and hyperparameters are
parsed here.
"""

import dataclasses
import itertools
import operator
import re
import stat
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from ma_runtime.errors import ConfigError
from ma_runtime.setting import FILE_SECTIONS, closest, dotted, shown
from ma_runtime.spec.table import SETTINGS_BY_NAME

CONFIG_ENV = "MA_RUNTIME_CONFIG"
# Job-file keys that are not single settings.
FILE_ONLY_KEYS = ("hyperparameters", "inputs", "outputs")
# The platform's hyperparameter names (docs/platform.md, "Launch methods"): at most 64 of [A-Za-z0-9_-].
_HYPERPARAMETER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HYPERPARAMETER_NAMES = re.compile(r"[A-Za-z0-9_-]{1,64}(?:\n[A-Za-z0-9_-]{1,64})*")  # one name a line
# A job file is a few hundred bytes; a bound keeps a hostile one (or /dev/zero) from eating memory.
MAX_JOB_FILE_BYTES = 1 << 20
# YAML aliases let 400 bytes describe gigabytes ("billion laughs"): bounded after composing, before building.
MAX_JOB_FILE_NODES = 100_000
MAX_JOB_FILE_DEPTH = 32
_STRING_TAG = "tag:yaml.org,2002:str"


def config_path(flag_value: Optional[str], environ: Mapping[str, str]) -> Optional[Path]:
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
        from ma_runtime.util.files import kind_of

        raise ConfigError(f"{where}={shown(text)} is {kind_of(mode)}, not a job file",
                          hint="give the path of a YAML job file") from None
    return path


def read(path: Path) -> Dict[str, Any]:
    data = _parse_yaml(path, _read_bounded(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"job file {path}: the top level must be a mapping of keys to values")
    data = _flatten_sections(path, data)
    known = set(SETTINGS_BY_NAME) | set(FILE_ONLY_KEYS)
    for key in data:
        if key not in known:
            raise ConfigError(f"job file {path}: unknown key '{dotted(key)}'", hint=_suggestion(key, known))
    return data


def _read_bounded(path: Path) -> str:
    from ma_runtime.util import files

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
    """Walks the composed graph as construction would expand it (an alias counts every time it is used).

    A node's children are counted together and only mappings and sequences are walked further: a job file of
    40 000 hyperparameters is 40 000 scalars, and a step per scalar cost as much as building them."""
    from yaml import MappingNode, ScalarNode, SequenceNode

    visited = 1
    todo = [(root, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, MappingNode):
            keys, children = zip(*node.value) if node.value else ((), ())
            _check_keys(path, keys)
        elif isinstance(node, SequenceNode):
            children = node.value
        else:
            continue
        visited += len(children)
        if visited > MAX_JOB_FILE_NODES:
            raise ConfigError(f"job file {path}: expands to more than {MAX_JOB_FILE_NODES} values (YAML aliases?)",
                              hint="a job file this large is not a job file; write the values out")
        if children and depth + 1 > MAX_JOB_FILE_DEPTH:
            raise ConfigError(f"job file {path}: nested deeper than {MAX_JOB_FILE_DEPTH} levels",
                              hint="the job file's sections are at most two levels deep")
        # The children that are not scalars, each with its depth (in C: no Python step per scalar).
        scalar = map(isinstance, children, itertools.repeat(ScalarNode))
        nested = itertools.compress(children, map(operator.not_, scalar))
        todo.extend(zip(nested, itertools.repeat(depth + 1)))


def _check_keys(path: Path, keys: tuple) -> None:
    """Every key of a mapping is a string (`1: x` or `on: x` would be built as a number or a boolean)."""
    if set(map(operator.attrgetter("tag"), keys)) <= {_STRING_TAG}:
        return
    for key in keys:
        if key.tag != _STRING_TAG:
            line = key.start_mark.line + 1
            raise ConfigError(f"job file {path}: line {line}: the key {shown(str(key.value))} is not a "
                              f"string ({key.tag.rsplit(':', 1)[-1]})",
                              hint=f"quote it if it is meant as a name: \"{key.value}\":")


def _suggestion(key: str, known) -> str:
    close = closest(dotted(key), (dotted(k) for k in known))
    every = "docs/reference/settings.md lists every key"
    return f"did you mean '{close}'? ({every})" if close else every


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




def hyperparameters(raw: Any) -> Tuple[Tuple[str, str], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise ConfigError("job file key 'hyperparameters' must be a mapping of name: value")
    names = [str(name) for name in raw]
    # One match over all the names (each on its own line) for the common case; a name it refuses is found, and
    # named, by matching them one at a time (40 000 hyperparameters: 40 000 calls saved).
    if not _HYPERPARAMETER_NAMES.fullmatch("\n".join(names)):
        for name in names:
            if not _HYPERPARAMETER_NAME.match(name):
                raise ConfigError(
                    f"job file key 'hyperparameters.{name}': a name must be 1-64 characters of A-Z a-z 0-9 _ -"
                )
    values = list(raw.values())
    # The values' types, not the values, are looked at: a handful, however many hyperparameters.
    if any(not _is_scalar_type(kind) for kind in set(map(type, values))):
        name = next(name for name, value in zip(names, values) if not _is_scalar_type(type(value)))
        raise ConfigError(f"job file key 'hyperparameters.{name}': expected a string, number or boolean")
    # How a value is written after `--name=`: booleans as the platform's True/False, which is what `str` writes.
    return tuple(zip(names, map(str, values)))


def _is_scalar_type(kind: type) -> bool:
    return kind is not type(None) and not issubclass(kind, (dict, list))


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


def channels(kind: str, raw: Any) -> Tuple[Channel, ...]:
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
