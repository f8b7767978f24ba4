"""Storage URLs: `obs://bucket/key`, `s3://` (the same), `file:///path` and plain paths.

Every URL is validated here, before anything is fetched, because each one also
names a local path: the code lands in `${MA_JOB_DIR}/<last part>` and a single
object in `<channel dir>/<last part>`. So:
- the last part (after one trailing slash) may not be empty, `.` or `..`, nor
  longer than a file name can be (255 bytes): `obs://b/code/..` would otherwise
  stage the code into MA_MOUNT_PATH itself;
- object keys do not normalise `.` and `..` (they are names like any other), so a
  remote URL holding them anywhere is refused rather than guessed at;
- local paths are normalised lexically (`../data/` stays usable, `/a/b/../c` is `/a/c`);
- a control character (a newline, NUL) is refused everywhere: no path can carry NUL,
  and a line-wrapped value is a copy-paste accident, not a name;
- a remote URL is split by hand, not by `urlsplit`: `?` and `#` are legal in keys and
  must not silently become a query or a fragment.
"""

import dataclasses
import os
import re
import unicodedata
from urllib.parse import unquote

from ma_runtime.errors import ConfigError

REMOTE_SCHEMES = ("obs", "s3")
NAME_MAX = 255  # bytes in one path part (Linux)
# S3 and OBS bucket names: letters, digits, dots and hyphens, starting and ending with a letter or digit.
_BUCKET = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?\Z")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):")  # one letter would be a Windows drive, not a scheme


@dataclasses.dataclass(frozen=True)
class Location:
    remote: bool
    bucket: str  # "" for local paths
    key: str  # object key or prefix; for local paths, the absolute, normalised path
    text: str  # as the user wrote it, for messages

    @property
    def is_prefix(self) -> bool:
        """Written as a directory (trailing slash). Otherwise the engine asks the store."""
        return self.key.endswith("/") or (self.remote and self.key == "")

    @property
    def last_part(self) -> str:
        """`obs://b/path/demo-code/` -> `demo-code`: the name the platform keeps locally (docs/platform.md).
        `parse` guarantees it is one safe file name: not empty, `.` or `..`, no `/`, at most 255 bytes."""
        return self.key.rstrip("/").rsplit("/", 1)[-1] or self.bucket


def parse(text: str, where: str = "URL") -> Location:
    """Raises ConfigError naming `where` for anything that is not a usable URL or path."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{where}: empty URL", hint="give obs://bucket/path, s3://bucket/path or a local path")
    text = text.strip()
    if any(unicodedata.category(char) == "Cc" for char in text):
        raise _bad(where, text, "it contains a control character (a newline, tab or NUL)",
                   hint="write the URL on one line, without control characters")
    scheme_match = _SCHEME.match(text)
    scheme = scheme_match.group(1).lower() if scheme_match else ""
    rest = text[scheme_match.end():] if scheme_match else text
    if scheme in REMOTE_SCHEMES:
        location = _remote(rest[2:] if rest.startswith("//") else "", text, where)
    elif scheme == "file":
        host, slash, path = rest[2:].partition("/") if rest.startswith("//") else ("", "/", rest.lstrip("/"))
        if host not in ("", "localhost") or not slash:
            raise _bad(where, text, "file URLs must be file:///absolute/path")
        location = Location(False, "", _local(unquote("/" + path), text, where), text)
    elif scheme:
        raise _bad(where, text, f"unsupported scheme '{scheme}'", hint="use obs://, s3://, file:// or a local path")
    else:
        location = Location(False, "", _local(text, text, where), text)
    return location


def _remote(rest: str, text: str, where: str) -> Location:
    bucket, _, key = rest.partition("/")
    if not bucket or "@" in bucket:
        raise _bad(where, text, "it has no bucket", hint="write obs://<bucket>/<path>")
    if not _BUCKET.match(bucket):
        raise _bad(where, text, f"{bucket!r} is not a bucket name",
                   hint="bucket names are letters, digits, '.' and '-', starting and ending with a letter "
                               "or digit")
    key = unquote(key.lstrip("/"))
    if any(part in (".", "..") for part in key.split("/")):
        raise _bad(where, text, "'.' and '..' are not allowed in an object path",
                   hint="object keys are names, not paths: write the key as it is stored")
    if key:  # else the bucket itself, whose name is the last part
        _check_last_part(key, text, where)
    return Location(True, bucket, key, text)


def _local(path: str, text: str, where: str) -> str:
    _check_last_part(path, text, where)
    # Lexically, like the shell's `cd -L`: a symlink on the way is the target tree's business (safety.py).
    absolute = os.path.normpath(os.path.abspath(os.path.expanduser(path)))
    # Keep the trailing slash: it says "directory" as it does for object prefixes.
    return absolute + "/" if text.endswith("/") and not absolute.endswith("/") else absolute


def _check_last_part(path: str, text: str, where: str) -> None:
    """The last part of `path` as written (one trailing slash allowed) names a local folder or file: it must be
    a name, not empty, `.` or `..`."""
    last = (path[:-1] if path.endswith("/") else path).rsplit("/", 1)[-1]
    if last in ("", ".", ".."):
        named = f"'{last}'" if last else "an empty part"
        raise _bad(where, text, f"it ends in {named}, which names no folder or file",
                   hint="name the folder or object itself, e.g. obs://bucket/path/code")
    if len(last.encode("utf-8", "surrogateescape")) > NAME_MAX:
        raise _bad(where, text, f"its last part is longer than {NAME_MAX} bytes, the longest file name there can be")


def _bad(where: str, text: str, problem: str, hint: str = "") -> ConfigError:
    """`<where>: <the URL>: <problem>`; with `where` empty, the problem alone (the caller quotes the URL)."""
    return ConfigError(f"{where}: {_short(text)}: {problem}" if where else problem, hint=hint)


def _short(text: str, limit: int = 120) -> str:
    """A quotable excerpt: long or odd values are shown escaped and cut."""
    shown = ascii(text)
    return shown if len(shown) <= limit else shown[:limit] + "...'"
