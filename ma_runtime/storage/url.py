"""Storage URLs: `obs://bucket/key`, `s3://` (the same), `file:///path` and plain paths."""

import dataclasses
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ma_runtime.errors import ConfigError

REMOTE_SCHEMES = ("obs", "s3")


@dataclasses.dataclass(frozen=True)
class Location:
    remote: bool
    bucket: str  # "" for local paths
    key: str  # object key or prefix; for local paths, the absolute path
    text: str  # as the user wrote it, for messages

    @property
    def is_prefix(self) -> bool:
        """Written as a directory (trailing slash). Otherwise the engine asks the store."""
        return self.key.endswith("/") or (self.remote and self.key == "")

    @property
    def last_part(self) -> str:
        """`obs://b/path/demo-code/` -> `demo-code`: the name the platform keeps locally (001:821-824)."""
        return self.key.rstrip("/").rsplit("/", 1)[-1] or self.bucket


def parse(text: str, where: str = "URL") -> Location:
    """Raises ConfigError naming `where` for anything that is not a usable URL or path."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{where}: empty URL", hint="give obs://bucket/path, s3://bucket/path or a local path")
    text = text.strip()
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme in REMOTE_SCHEMES:
        if not parts.netloc or "@" in parts.netloc:
            raise ConfigError(f"{where}: {text!r} has no bucket", hint="write obs://<bucket>/<path>")
        return Location(True, parts.netloc, unquote(parts.path.lstrip("/")), text)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(f"{where}: {text!r}: file URLs must be file:///absolute/path")
        return Location(False, "", _local(unquote(parts.path), text), text)
    if scheme and len(scheme) > 1:  # one letter would be a Windows drive, not a scheme
        raise ConfigError(
            f"{where}: {text!r}: unsupported scheme '{scheme}'", hint="use obs://, s3://, file:// or a local path"
        )
    return Location(False, "", _local(text, text), text)


def _local(path: str, text: str) -> str:
    resolved = str(Path(path).expanduser().absolute())
    # Keep the trailing slash: it says "directory" as it does for object prefixes.
    return resolved + "/" if text.endswith("/") and not resolved.endswith("/") else resolved
