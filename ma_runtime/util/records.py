"""The runtime's records: what one run leaves for the next in the state folder, read back whole or not at all.

Every record the runtime reads (the attempt record, stage-in's `staged.json`, the hooks' `pip.json` and
`pre-start.json`, the sync's manifests, the transfers' part records and journals) goes through `load`:

- read with a size bound, never waiting on a FIFO (`files.read_regular`);
- decoded as strict JSON: no NaN or Infinity, no number too large for a float (`1e400`), no integer of more
  digits than Python converts in linear time;
- validated field by field by the record's owner (`validate`, built from the checks below): types (an int is
  never a bool, a float or a string of digits), ranges, and consistency between fields.

A record that fails any of these is **set aside**: renamed beside itself to `<name>.set-aside-<UTC time>`, kept
for whoever wants to look, with one warning (`record set aside`: the path, what was wrong, the new name, and what
the run does instead). The caller then goes on as if there had been no record: a first start, a fresh fetch, a
fresh upload. Nothing a record holds can stop the run or reach a command unchecked. The warning names types and
fields, never a record's values (pre-start.json may hold a secret).
"""

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, TypeVar, Union

from ma_runtime.util import files

T = TypeVar("T")

# Python before the limit on int(str) (3.9.14, 3.10.7) converts digits in quadratic time: bound them ourselves.
_MAX_DIGITS = 4300
# Every number the runtime records (sizes, times in ns, inodes, counts) fits 64 bits: nothing outside is one of ours.
INT_MIN, INT_MAX = -(1 << 63), (1 << 64) - 1
_EVENT = "record set aside"


class Invalid(ValueError):
    """What is wrong with a record, in words that repeat none of its values."""


class NotJSON(Invalid):
    """Text that does not parse as JSON at all (a line a crash cut short is one)."""


def load(path: Union[str, Path], validate: Callable[[Any], T], log, what: str, then: str,
         limit: int = files.RECORD_LIMIT, parse: Optional[Callable[[bytes], Any]] = None) -> Optional[T]:
    """`validate(document)` of the record at `path`; None when there is none, or when it was set aside (one
    warning: `what` names the record, `then` says what the run does without it). `parse`: the bytes to a document,
    for a record that is not one JSON document (a journal of JSON lines); `decode` by default."""
    try:
        return read(path, validate, limit, parse)
    except Invalid as problem:
        set_aside(path, str(problem), log, what, then)
        return None


def read(path: Union[str, Path], validate: Callable[[Any], T], limit: int = files.RECORD_LIMIT,
         parse: Optional[Callable[[bytes], Any]] = None) -> Optional[T]:
    """`validate(document)` of the record at `path`, None when there is none; Invalid when it cannot be used."""
    try:
        data = files.read_regular(path, limit)
    except (FileNotFoundError, NotADirectoryError):  # no state folder (or a file in its place): no record
        return None
    except files.NotAFile as exc:
        raise Invalid(f"{exc.kind} is where the record should be") from None
    except files.TooLarge as exc:
        raise Invalid(f"{exc.size} bytes, over the {limit} a record may have") from None
    except OSError as exc:
        raise Invalid(f"it cannot be read: {exc.strerror or exc}") from None
    if data is None:
        return None
    try:
        return validate((parse or decode)(data))
    except Invalid:
        raise
    # A validator that meets a shape it did not foresee: the record is what is wrong, not the runtime.
    except (TypeError, KeyError, IndexError, AttributeError) as exc:
        raise Invalid(f"not in the expected form ({type(exc).__name__})") from None


def decode(data: bytes) -> Any:
    """Strict JSON: UTF-8, no NaN or Infinity, every float finite, integers of bounded length."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Invalid(f"not UTF-8 text (byte {exc.start})") from None
    return decode_text(text)


def decode_text(text: str) -> Any:
    """`decode` of text already decoded (a journal's lines keep undecodable bytes as surrogates)."""
    hooks: Dict[str, Any] = {"parse_float": _finite, "parse_constant": _no_constant}
    if not hasattr(sys, "get_int_max_str_digits"):
        hooks["parse_int"] = _bounded_int
    try:
        return json.loads(text, **hooks)
    except Invalid:
        raise
    except json.JSONDecodeError as exc:
        raise NotJSON(f"not JSON: {str(exc)[:200]}") from None
    except ValueError as exc:  # an int past Python's digit limit
        raise Invalid(f"not JSON a record holds: {str(exc)[:200]}") from None
    except RecursionError:
        raise Invalid("not JSON a record holds: nested too deeply") from None


def make_way(path: Union[str, Path], log, what: str) -> None:
    """For a record about to be written afresh (not read: a first start): what is not a regular file at `path` (a
    FIFO, a directory) is set aside the same way, so that it cannot stop the write."""
    try:
        files.writable_target(path)
    except files.NotAFile as exc:
        set_aside(path, f"{exc.kind} is where the record should be", log, what, then="the record is written afresh")


def set_aside(path: Union[str, Path], problem: str, log, what: str, then: str) -> Optional[Path]:
    """Renames the record to `<name>.set-aside-<UTC time>` (a free name) and says so once; returns the new name, or
    None when it could not be renamed (also said, in the same one warning)."""
    path = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    kept: Optional[Path] = None
    error = ""
    for suffix in ("", *(f"-{n}" for n in range(1, 100))):
        candidate = path.with_name(f"{path.name}.set-aside-{stamp}{suffix}")
        if os.path.lexists(candidate):
            continue
        try:
            os.rename(path, candidate)
            kept = candidate
        except FileNotFoundError:
            error = "it was gone"  # taken away meanwhile: nothing left to set aside
        except OSError as exc:
            error = exc.strerror or str(exc)
        break
    if kept is not None:
        log.warning(_EVENT, record=what, path=str(path), problem=problem, kept_as=str(kept), then=then)
    else:
        log.warning(_EVENT, record=what, path=str(path), problem=problem,
                    kept_as=f"(not renamed: {error or 'no free name'})", then=then)
    return kept


# --------------------------------------------------------------------------- the checks validators are built from


def described(value: Any) -> str:
    """What a value is, never what it holds: `a str`, `null`, `a bool`, `-1000000`, `an int of 30 digits`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, int):
        return str(value) if abs(value) < 10 ** 12 else f"an int of {len(str(abs(value)))} digits"
    return {str: "a str", float: "a float", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def mapping(value: Any, where: str) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise Invalid(f"{where}: an object is wanted, found {described(value)}")
    return value


def field(document: Dict[str, Any], name: str) -> Any:
    if name not in document:
        raise Invalid(f"`{name}` is missing")
    return document[name]


def exactly(document: Dict[str, Any], names, where: str) -> None:
    """`document` has these fields and no other."""
    missing = [name for name in names if name not in document]
    if missing:
        raise Invalid(f"{where}: `{missing[0]}` is missing")
    extra = sorted(str(name) for name in document if name not in names)
    if extra:
        raise Invalid(f"{where}: unexpected field `{extra[0][:40]}`")


def integer(value: Any, where: str, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """An int (a bool, a float or a string of digits is not one) in low..high, and of 64 bits either way."""
    lowest = INT_MIN if low is None else max(low, INT_MIN)
    highest = INT_MAX if high is None else min(high, INT_MAX)
    if type(value) is not int or not lowest <= value <= highest:
        wanted = f"an int in {low}..{high}" if low is not None and high is not None else \
            f"an int >= {low} (64 bits)" if low is not None else "an int of 64 bits"
        raise Invalid(f"{where}: {wanted} is wanted, found {described(value)}")
    return value


def number(value: Any, where: str) -> float:
    """An int or a finite float (not a bool)."""
    if type(value) not in (int, float) or not math.isfinite(value):
        raise Invalid(f"{where}: a number is wanted, found {described(value)}")
    return value


def text(value: Any, where: str, optional: bool = False) -> Optional[str]:
    if isinstance(value, str) or (optional and value is None):
        return value
    raise Invalid(f"{where}: a string{' or null' if optional else ''} is wanted, found {described(value)}")


def flag(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    raise Invalid(f"{where}: true or false is wanted, found {described(value)}")


def strings(value: Any, where: str) -> Dict[str, str]:
    """An object of strings."""
    for item in mapping(value, where).values():
        text(item, f"{where}: an entry")
    return value


def string_list(value: Any, where: str) -> List[str]:
    if not isinstance(value, list):
        raise Invalid(f"{where}: a list is wanted, found {described(value)}")
    for item in value:
        text(item, f"{where}: an entry")
    return value


# --------------------------------------------------------------------------- decoding


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Invalid(f"not JSON a record holds: a number too large for a float ({len(text)} characters)")
    return value


def _no_constant(name: str) -> Any:
    raise Invalid(f"not JSON a record holds: {name} is not a number")


def _bounded_int(text: str) -> int:
    if len(text) > _MAX_DIGITS:
        raise Invalid(f"not JSON a record holds: an integer of {len(text)} digits")
    return int(text)

