"""Masking of secrets (AK/SK, tokens, passwords) in anything the runtime prints.

Three nets, because a secret can reach a log line three ways:
- by name: a key or option whose name says it holds a secret (`password`,
  `--secret_key=...`, `OBS_SECURITY_TOKEN`);
- by value: the exact values of secret-named environment variables, wherever
  they appear inside a longer string;
- by shape: strings that look like Huawei Cloud access keys (20 upper-case
  alphanumerics) or secret keys (40 alphanumerics).
"""

import os
import re
from typing import Any, Iterable, Mapping, Optional

MASK = "******"

_SECRET_NAME = re.compile(
    r"(passw(or)?d|passwd|secret|token|credential|private[_-]?key|access[_-]?key"
    r"|api[_-]?key|(^|[_-])(ak|sk)$)",
    re.IGNORECASE,
)
_SECRET_WORD = r"(?:passw(?:or)?d|secret|token|credential|private[_-]?key|access[_-]?key|api[_-]?key)"
_VALUE = r"(?P<value>\"[^\"]*\"|'[^']*'|[^\s,;\"']+)"
# `SECRET_KEY=x`, `password: x`, `--api-token=x` inside a free-text string ...
_INLINE_ASSIGNMENT = re.compile(
    rf"(?P<key>[A-Za-z0-9_.-]*{_SECRET_WORD}[A-Za-z0-9_.-]*)(?P<sep>=|:[ \t]*){_VALUE}", re.IGNORECASE
)
# ... and `--api-token x`, where only the leading dashes make the next word a value.
_INLINE_OPTION = re.compile(
    rf"(?P<key>--?[A-Za-z0-9_.-]*{_SECRET_WORD}[A-Za-z0-9_.-]*)(?P<sep>[ \t]+)(?!-){_VALUE}", re.IGNORECASE
)
_AK_SHAPE = re.compile(r"\b[A-Z0-9]{20}\b")
_SK_SHAPE = re.compile(r"\b[A-Za-z0-9]{40}\b")
# A secret shorter than this is too likely to be a common word to mask by value.
_MIN_VALUE_LEN = 6


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


class Masker:
    """Replaces secrets in strings and nested data; built once per process."""

    def __init__(self, secret_values: Iterable[str] = ()):
        values = sorted({v for v in secret_values if len(v) >= _MIN_VALUE_LEN}, key=len, reverse=True)
        self._values = re.compile("|".join(map(re.escape, values))) if values else None

    @classmethod
    def from_environ(cls, environ: Optional[Mapping[str, str]] = None) -> "Masker":
        environ = os.environ if environ is None else environ
        return cls(value for name, value in environ.items() if is_secret_name(name))

    def text(self, value: str) -> str:
        if self._values is not None:
            value = self._values.sub(MASK, value)
        value = _INLINE_ASSIGNMENT.sub(_mask_inline, value)
        value = _INLINE_OPTION.sub(_mask_inline, value)
        value = _AK_SHAPE.sub(_mask_key_shape, value)
        return _SK_SHAPE.sub(_mask_key_shape, value)

    def data(self, value: Any, key: str = "") -> Any:
        """Masks a JSON-like value; `key` is the name it was stored under."""
        if key and is_secret_name(key) and value not in (None, "", {}, []):
            return MASK
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {k: self.data(v, str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.data(item) for item in value]
        return value


def _mask_inline(match: "re.Match[str]") -> str:
    return f"{match.group('key')}{match.group('sep')}{MASK}"


def _mask_key_shape(match: "re.Match[str]") -> str:
    # A 20- or 40-character word is key-shaped only if it mixes letters and digits
    # (WORKERWORKERWORKERWO is a word, not an access key).
    token = match.group(0)
    return MASK if _mixes_letters_and_digits(token) else token


def _mixes_letters_and_digits(token: str) -> bool:
    return any(c.isdigit() for c in token) and any(c.isalpha() for c in token)
