"""One setting's declaration (`Setting`) and the parsers its values go through: the vocabulary of every row of
the settings table, spec's own (spec/table.py) and each launcher's (launch/<method>.py, `SETTINGS`).

A leaf module: the launchers declare their rows with it, and spec collects them through launch.registry, so
nothing here may import spec or launch. Each parser carries what the docs and the JobSpec need to know of it:
`type` (what it returns), `kind` (its range or form in words), and for numbers `range` (minimum, maximum).
"""

import dataclasses
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Tuple

from ma_runtime.errors import ConfigError

DISK_TARGETS = ("root", "shm", "cache")
# Job-file sections whose keys are settings named `<section>_<key>` (`preflight: {checks: [...]}`).
FILE_SECTIONS = ("preflight", "storage", "code", "ranktable", "sync", "hang", "hooks")
_DECIMAL = re.compile(r"[+-]?[0-9]+\Z")
# How much of a bad value an error line quotes.
_SHOWN_CHARS = 60


class BadValue(ValueError):
    """A parser's complaint; the caller adds which variable, key or flag it was. `hint` says how to fix it,
    when the parser knows better than the setting's help text."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def _described(parse: Callable[[str], Any], type_: Any, kind: str) -> Callable[[str], Any]:
    """`parse` with what it returns and its form in words, for the JobSpec's field types and the docs."""
    parse.type = type_
    parse.kind = kind
    return parse


def integer(minimum: int, maximum: int) -> Callable[[str], int]:
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
    return _described(parse, int, f"whole number, {minimum} to {maximum}")


def choice(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = str(text).strip().lower()
        if value not in choices:
            raise BadValue(f"must be one of {', '.join(choices)}")
        return value

    parse.choices = tuple(choices)
    return _described(parse, str, f"one of {', '.join(choices)}")


def _switch(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise BadValue("must be on or off (also 1/0, true/false, yes/no)")


switch = _described(_switch, bool, "on or off (also 1/0, true/false, yes/no)")


def number(minimum: float, maximum: float, unit: str = "number") -> Callable[[str], float]:
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
    return _described(parse, float, f"{unit}, {minimum:g} to {maximum:g}")


# Durations: seconds, from 0 to a week. Every wait the runtime makes stays a number that
# select(), threading and time arithmetic accept (1e308 overflows them).
WEEK_SECONDS = 7 * 24 * 3600
seconds = number(0, WEEK_SECONDS, "seconds")
PORT = (1, 65535)
port = integer(*PORT)
port.kind = f"port, {PORT[0]} to {PORT[1]}"


def _text(text: str) -> str:
    return str(text)


text = _described(_text, str, "text")


def names(allowed: Sequence[str]) -> Callable[[str], Tuple[str, ...]]:
    """A comma-separated subset of `allowed`, in the order given."""

    def parse(text: str) -> Tuple[str, ...]:
        found = tuple(n.strip() for n in str(text).split(",") if n.strip())
        unknown = [n for n in found if n not in allowed]
        if unknown:
            raise BadValue(f"names unknown {', '.join(unknown)}; known: {', '.join(allowed)}")
        return found

    parse.choices = tuple(allowed)
    return _described(parse, Tuple[str, ...], f"comma-separated, from {', '.join(allowed)}")


def _exit_codes(text: str) -> Tuple[int, ...]:
    """`93,42`: exit codes, each 1 to 255; empty means none."""
    words = [word.strip() for word in str(text).split(",") if word.strip()]
    if len(words) > 255 or not all(_DECIMAL.match(word) and len(word) <= 3 and 1 <= int(word) <= 255
                                   for word in words):
        raise BadValue("must list exit codes from 1 to 255, separated by commas (e.g. 93,42)")
    return tuple(dict.fromkeys(int(word) for word in words))


exit_codes = _described(_exit_codes, Tuple[int, ...], "exit codes 1 to 255, comma-separated")


def _targets(text: str) -> Tuple[Tuple[str, Path], ...]:
    """`root=/,shm=/dev/shm,cache=/cache`: disk-size targets and their paths."""
    pairs = []
    for part in (p.strip() for p in str(text).split(",") if p.strip()):
        name, sep, path = part.partition("=")
        if not sep or name.strip() not in DISK_TARGETS or not path.strip():
            raise BadValue(f"has a bad entry {part!r}; expected name=path with name in {', '.join(DISK_TARGETS)}")
        pairs.append((name.strip(), Path(path.strip())))
    return tuple(pairs)


targets = _described(_targets, Tuple[Tuple[str, Path], ...],
                     f"name=path, comma-separated, with name in {', '.join(DISK_TARGETS)}")


def globs(text: str) -> Tuple[str, ...]:
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

    return tuple(dict.fromkeys((*DEFAULT_EXCLUDES, *globs(text))))


excludes = _described(_excludes, Tuple[str, ...], "file-name globs, comma-separated")


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


marker_globs = _described(_marker_globs, Tuple[str, ...], "path globs, comma-separated (a leading + extends the "
                          "defaults)")


def default_markers() -> Tuple[str, ...]:
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


regex = _described(_regex, str, "regular expression (Python's), 1 to 1000 characters")


def _url(text: str) -> str:
    from ma_runtime.storage import url as storage_url  # obs://, s3://, file:// or a path

    try:
        storage_url.parse(text, where="")  # the problem alone: the error line quotes the value once
    except ConfigError as exc:
        raise BadValue(f"is not a usable URL: {exc.reason}", exc.hint) from None
    return str(text).strip()


url = _described(_url, str, "URL (obs://, s3://, file://) or path")


def _auto_off_or_path(text: str) -> str:
    """`auto`, `off`, or a file's path (kept as written: found or refused when it is used)."""
    value = str(text).strip()
    if value.lower() in ("auto", "off"):
        return value.lower()
    if not value:
        raise BadValue("must be auto, off or a file's path")
    return value


auto_off_or_path = _described(_auto_off_or_path, str, "auto, off or a file's path")


def _path(text: str) -> Path:
    if not str(text).strip():
        raise BadValue("is an empty path")
    return Path(str(text)).expanduser()


path = _described(_path, Path, "path")

# NCCL_SOCKET_IFNAME's syntax: interface names or prefixes, comma-separated, `^` excluding, `=` matching exactly.
INTERFACES = re.compile(r"[\^=]?[A-Za-z0-9_.:@-]{1,64}(,[A-Za-z0-9_.:@-]{1,64})*\Z")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}\Z")


def _env_names(text: str) -> Tuple[str, ...]:
    """`HF_TOKEN,WANDB_API_KEY`: environment variable names, comma-separated."""
    found = tuple(dict.fromkeys(word.strip() for word in str(text).split(",") if word.strip()))
    bad = [name for name in found if not _ENV_NAME.match(name)]
    if bad:
        raise BadValue(f"has {bad[0][:_SHOWN_CHARS]!r}, not a variable name; expected names such as HF_TOKEN, "
                       "separated by commas")
    return found


env_names = _described(_env_names, Tuple[str, ...], "variable names, comma-separated")


def matching(pattern: "re.Pattern[str]", what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = str(text).strip()
        if not pattern.match(value):
            raise BadValue(f"is not a valid {what}")
        return value

    return _described(parse, str, what)


def shown(value: str) -> str:
    """A bad value as an error line quotes it: repr'd, and cut (a 30 000-letter value is not a message)."""
    if len(value) <= _SHOWN_CHARS:
        return repr(value)
    return f"{value[:_SHOWN_CHARS]!r}... ({len(value)} characters)"


def closest(word: str, names: Iterable[str]) -> Optional[str]:
    """The known name `word` most likely misspells, or None: the "did you mean" of a job-file key, a variable or
    a flag. difflib is imported here, when something is misspelt, not at every start."""
    import difflib

    found = difflib.get_close_matches(word, sorted(names), n=1, cutoff=0.6)
    return found[0] if found else None


def dotted(key: str) -> str:
    """A setting's name as its job-file key: `preflight_checks` is `preflight.checks` (a key of its section)."""
    for section in FILE_SECTIONS:
        if key.startswith(section + "_"):
            return f"{section}.{key[len(section) + 1:]}"
    return key


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the settings table. Every other place that names a setting derives it from here: the JobSpec's
    field (`name`, `type`), the environment variables read (`env`, then `aliases`), the job-file key (`file_key`),
    the `--flag` (`flag`, when `cli`), the variable the command is given (`exported`), the docs (`help`, `kind`,
    `default`, `owner`)."""

    name: str
    env: str
    parse: Callable[[str], Any]
    help: str
    default: Any = None
    # Preflight's many knobs stay off ma-run's --help: env and job file only.
    cli: bool = True
    # Other variables that give the same value, read in this order after `env` (the platform's fallbacks).
    aliases: Tuple[str, ...] = ()
    # Given to the command under `env`, resolved (flags > env > file > default), so it sees the job the runtime saw.
    exported: bool = False
    # Which module declares the row: "spec", or the launcher's module (launch.torchrun, ...).
    owner: str = "spec"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def file_key(self) -> str:
        return dotted(self.name)

    @property
    def envs(self) -> Tuple[str, ...]:
        """Every variable the setting is read from, first first."""
        return (self.env, *self.aliases)

    @property
    def type(self) -> Any:
        """What the parsed value is (int, float, bool, str, Path, tuples); Optional in the JobSpec when the default
        is None."""
        return getattr(self.parse, "type", Any)

    @property
    def kind(self) -> str:
        """The value's form or range in words (`whole number, 0 to 128`, `one of auto, off`, `seconds, 0 to ...`)."""
        return getattr(self.parse, "kind", "text")

    @property
    def range(self) -> Optional[Tuple[float, float]]:
        """(minimum, maximum) of a numeric setting, else None."""
        return getattr(self.parse, "range", None)
