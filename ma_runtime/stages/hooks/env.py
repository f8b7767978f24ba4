"""What the hooks do to the environment (`Env`), the env-file format they may write it in (`MA_HOOK_ENV_FILE`), and
which interpreter is the job's."""

import dataclasses
import os
import re
import shutil
from pathlib import Path
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence

from ma_runtime.launch.args import is_shell_form, last_simple_command

ENV_FILE_VAR = "MA_HOOK_ENV_FILE"
# Variables for an environment, not data: a file past this is a mistake, refused before it is read.
ENV_FILE_LIMIT = 1 << 20
# What bash itself changes in every environment it runs: never what a sourced file did.
_SHELL_NOISE = frozenset(("_", "PWD", "OLDPWD", "SHLVL", ENV_FILE_VAR))
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PYTHON_NAME = re.compile(r"python[0-9.]*\Z")


@dataclasses.dataclass(frozen=True)
class Env:
    """Variables to set and to unset: what the hooks did to the environment."""

    set: Mapping[str, str] = dataclasses.field(default_factory=dict)
    unset: FrozenSet[str] = frozenset()

    def apply(self, environ: Mapping[str, str]) -> Dict[str, str]:
        result = {name: value for name, value in environ.items() if name not in self.unset}
        result.update(self.set)
        return result

    def then(self, later: "Env") -> "Env":
        """This, then `later` on top."""
        merged = {name: value for name, value in self.set.items() if name not in later.unset}
        merged.update(later.set)
        return Env(merged, (self.unset - frozenset(later.set)) | later.unset)

    def to_json(self) -> dict:
        return {"set": dict(self.set), "unset": sorted(self.unset)}

    @classmethod
    def from_json(cls, data: dict) -> "Env":
        return cls(dict(data["set"]), frozenset(data["unset"]))

    def __bool__(self) -> bool:
        return bool(self.set or self.unset)


def diff(before: Mapping[str, str], after: Mapping[str, str]) -> Env:
    changed = {name: value for name, value in after.items() if before.get(name) != value and name not in _SHELL_NOISE}
    gone = frozenset(name for name in before if name not in after and name not in _SHELL_NOISE)
    return Env(changed, gone)


def parse_env_file(text: str) -> Dict[str, str]:
    """`NAME=value` lines, `NAME<<DELIM` ... `DELIM` for a multi-line value; blank lines and `#` comments skipped."""
    result: Dict[str, str] = {}
    lines = iter(enumerate(text.split("\n"), 1))
    for number, line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            name, delimiter = line.split("<<", 1)
            value = _until(lines, delimiter.strip(), number)
        elif "=" in line:
            name, value = line.split("=", 1)
        else:
            # Its words are not repeated: a line such as `API_TOKEN s3cret` would put a secret in the message.
            raise ValueError(f"line {number} is not NAME=value (no `=`)")
        if not _NAME.match(name):
            raise ValueError(f"line {number}: what comes before `=` or `<<` is not a variable name (letters, digits "
                             "and _, not starting with a digit)")
        if "\0" in value:  # no environment can hold it: exec would refuse the worker
            raise ValueError(f"line {number}: the value of {name} holds a NUL byte")
        result[name] = value
    return result


def _until(lines, delimiter: str, start: int) -> str:
    if not delimiter:
        raise ValueError(f"line {start}: `NAME<<` needs a delimiter")
    collected = []
    for _number, line in lines:
        if line == delimiter:
            return "\n".join(collected)
        collected.append(line)
    raise ValueError(f"line {start}: no closing {delimiter!r} for the multi-line value")


def job_python(environ: Mapping[str, str], command: Sequence[str]) -> Optional[str]:
    """The job's interpreter, not the runtime's: the platform's conda environment (ANACONDA_DIR and
    DEFAULT_CONDA_ENV_NAME), else the command's own python (`python3.9 train.py`), else python3, python on PATH."""
    # The image's interpreter layout, found like PATH is (the environment the command runs in), not a job setting.
    conda, name = environ.get("ANACONDA_DIR"), environ.get("DEFAULT_CONDA_ENV_NAME")
    if conda and name:
        candidate = Path(conda) / "envs" / name / "bin" / "python"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    words = command_words(command)
    path = environ.get("PATH", os.defpath)
    if words and _PYTHON_NAME.match(os.path.basename(words[0])):
        found = shutil.which(words[0], path=path)
        if found:
            return found
    for name in ("python3", "python"):
        found = shutil.which(name, path=path)
        if found:
            return found
    return None


def command_words(command: Sequence[str]) -> List[str]:
    words = last_simple_command(command[0]) if is_shell_form(command) else list(command)
    # `VAR=value python train.py`: the assignments are not the program.
    while words and "=" in words[0] and _NAME.match(words[0].split("=", 1)[0]):
        words = words[1:]
    return words
