"""Masking of secrets (AK/SK, tokens, passwords) in anything the runtime prints.

Every string the runtime prints (log lines, `--print-config`, `plan`, the
termination message, the preflight report) passes through `Masker.data` or
`Masker.text`. Four nets, because a secret can reach a line four ways:
- by name: a key or option whose name says it holds a secret (`password`,
  `--secret_key=...`, `OBS_SECURITY_TOKEN`); in a command line given as words,
  an option named like a secret masks the next word (`--password hunter2`);
- by value: the values of secret-named environment variables, wherever they
  appear inside a longer string, and in the forms they take when something
  quotes them: escaped (`repr`, JSON), URL-encoded, or split across lines;
- by shape: strings that look like Huawei Cloud access keys (20 upper-case
  alphanumerics) or secret keys (40 alphanumerics).
Values are masked, never names: in `no OBS credentials: OBS_ACCESS_KEY_ID not
set`, the variable's name is what the reader needs.

Every pattern is linear in its input: each key is anchored at the start of a
word and bounded in length, so 16 KiB of `-` costs microseconds, not minutes
(an unanchored `[A-Za-z0-9_.-]*password` backtracks quadratically).

The same pass makes text printable: a string holding bytes that are not UTF-8
(an argument `$'\\xff'`, decoded by Python with surrogate escapes) comes out with
those bytes written `\\xff`, so no writer can fail on them.
"""

import bisect
import itertools
import json
import os
import re
from typing import Any, Iterable, List, Mapping, Optional
from urllib.parse import quote, quote_plus

from ma_runtime.util.credentials import CREDENTIAL_VARIABLES

MASK = "******"

_SECRET_NAME = re.compile(
    r"(passw(or)?d|passwd|secret|token|credential|private[_-]?key|access[_-]?key"
    r"|api[_-]?key|(^|[_-])(ak|sk)$)",
    re.IGNORECASE,
)
_SECRET_WORD = r"(?:passw(?:or)?d|secret|token|credential|private[_-]?key|access[_-]?key|api[_-]?key)"
_KEY_CHARS = r"[A-Za-z0-9_.-]"
# A key starts where a word starts (the look-behind) and is at most 64 + 64 characters around
# its secret word: both bounds keep the search linear.
_KEY = rf"(?<!{_KEY_CHARS}){_KEY_CHARS}{{0,64}}?{_SECRET_WORD}{_KEY_CHARS}{{0,64}}"
# A quoted value ends at its quote or within 4 KiB: an unclosed quote must not send every key
# match to the end of the text.
_VALUE = r"(?P<value>\"[^\"\n]{0,4096}\"|'[^'\n]{0,4096}'|[^\s,;\"']+)"
# `SECRET_KEY=x`, `password: x`, `--api-token=x` inside a free-text string ...
_INLINE_ASSIGNMENT = re.compile(rf"(?P<key>{_KEY})(?P<sep>=|:[ \t]*){_VALUE}", re.IGNORECASE)
# ... and `--api-token x`, where only the leading dashes make the next word a value.
_INLINE_OPTION = re.compile(
    rf"(?P<key>(?<![A-Za-z0-9_.-])--?{_KEY_CHARS}{{0,64}}?{_SECRET_WORD}{_KEY_CHARS}{{0,64}})"
    rf"(?P<sep>[ \t]+)(?!--){_VALUE}",
    re.IGNORECASE,
)
_AK_SHAPE = re.compile(r"\b[A-Z0-9]{20}\b")
_SK_SHAPE = re.compile(r"\b[A-Za-z0-9]{40}\b")
_SHAPE_MIN_LEN = 20
# A command line given as words is masked in one pass over them joined by NUL, which no argument or
# environment value can hold, so no match crosses it; the by-name and by-shape nets, whose patterns cost
# microseconds per word (a job file's 40 000 hyperparameters: more than building them), then run only on
# the words that can match them: a secret word in it (found by str.find, lower-cased, for these stems of
# _SECRET_WORD), or 20 characters for a key shape.
_WORD_SEPARATOR = "\0"
_SECRET_STEMS = ("passw", "secret", "token", "credential", "private", "access", "api")
_SECRET_WORD_ANY_CASE = re.compile(_SECRET_WORD, re.IGNORECASE)
# A secret shorter than this is too likely to be a common word to mask by value.
_MIN_VALUE_LEN = 6
# Names the runtime's own messages use: never masked as if they were values.
KNOWN_NAMES = frozenset(CREDENTIAL_VARIABLES)


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def printable(text: str) -> str:
    """`text` with undecodable bytes (surrogate escapes) written as `\\xNN`: safe for any UTF-8 writer."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return text


def quoted_forms(value: str) -> List[str]:
    """A secret as it may appear once something has quoted it: escaped by repr or JSON, URL-encoded
    (a token in a signed URL), or one line at a time (a wrapped token)."""
    forms = {value, printable(value), value.encode("unicode_escape", "backslashreplace").decode("ascii"),
             repr(value)[1:-1], json.dumps(value)[1:-1], quote(value, safe=""), quote_plus(value)}
    forms.update(line for line in re.split(r"[\r\n]+", value))
    return [form for form in forms if len(form) >= _MIN_VALUE_LEN]


class Masker:
    """Replaces secrets in strings and nested data; built once per process."""

    def __init__(self, secret_values: Iterable[str] = (), names: Iterable[str] = ()):
        forms = {form for value in secret_values for form in quoted_forms(value)}
        ordered = sorted(forms, key=len, reverse=True)  # the longest form first: no half-masked value
        self._values = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self._values_hold_separator = any(_WORD_SEPARATOR in form for form in forms)
        self._names = KNOWN_NAMES | frozenset(names)

    @classmethod
    def from_environ(cls, environ: Optional[Mapping[str, str]] = None) -> "Masker":
        environ = os.environ if environ is None else environ
        return cls((value for name, value in environ.items() if is_secret_name(name)), names=environ.keys())

    def text(self, value: str) -> str:
        return self._by_name_and_shape(self._by_value(printable(value)))

    def _by_value(self, value: str) -> str:
        return self._values.sub(MASK, value) if self._values is not None else value

    def _by_name_and_shape(self, value: str) -> str:
        value = _INLINE_ASSIGNMENT.sub(self._mask_inline, value)
        value = _INLINE_OPTION.sub(self._mask_inline, value)
        value = _AK_SHAPE.sub(_mask_key_shape, value)
        return _SK_SHAPE.sub(_mask_key_shape, value)

    def data(self, value: Any, key: str = "") -> Any:
        """Masks a JSON-like value; `key` is the name it was stored under."""
        if key and is_secret_name(key) and value not in (None, "", {}, []):
            return MASK
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {printable(k) if isinstance(k, str) else k: self.data(v, str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            if value and all(map(isinstance, value, itertools.repeat(str))):
                return self.words(value)
            return [self.data(item) for item in value]
        return value

    def words(self, words: Iterable[str]) -> List[str]:
        """A command line given as words: each masked, and the word after an option named like a secret
        (`--password hunter2`) masked whole, since nothing inside the word says it is one."""
        words = list(words)
        masked = self._each_word(words)
        after_secret_option = False
        for index, word in enumerate(words):
            if after_secret_option and not word.startswith("--"):
                masked[index] = MASK
                after_secret_option = False
                continue
            after_secret_option = word.startswith("-") and "=" not in word and is_secret_name(word.lstrip("-"))
        return masked

    def _each_word(self, words: List[str]) -> List[str]:
        """`[self.text(word) for word in words]`, in one pass (see _WORD_SEPARATOR)."""
        joined = _WORD_SEPARATOR.join(words)
        if len(words) < 2 or self._values_hold_separator or joined.count(_WORD_SEPARATOR) != len(words) - 1:
            return [self.text(word) for word in words]  # a word holds the separator itself
        joined = self._by_value(printable(joined))
        masked = joined.split(_WORD_SEPARATOR)
        for index in _may_match_by_name_or_shape(joined, masked):
            masked[index] = self._by_name_and_shape(masked[index])
        return masked

    def _mask_inline(self, match: "re.Match[str]") -> str:
        if match.group("value") in self._names:
            return match.group(0)  # `credentials: OBS_ACCESS_KEY_ID`: a variable's name, not its value
        return f"{match.group('key')}{match.group('sep')}{MASK}"


def _may_match_by_name_or_shape(joined: str, words: List[str]) -> List[int]:
    """The indexes of the words (joined by _WORD_SEPARATOR) holding a secret word or long enough for a key shape."""
    lengths = list(map(len, words))
    ends = list(itertools.accumulate(map((1).__add__, lengths)))  # each word's end, its separator counted
    found = {bisect.bisect_right(ends, at) for at in _secret_word_positions(joined)}
    found.update(itertools.compress(range(len(words)), map(_SHAPE_MIN_LEN.__le__, lengths)))
    return sorted(found)


def _secret_word_positions(text: str) -> Iterable[int]:
    """Where a secret word may start: each stem's places in ASCII text (at memchr speed), else the pattern's
    own (case-insensitive matching folds a few non-ASCII letters onto ASCII ones: `ſ` is `s`)."""
    if not text.isascii():
        yield from (match.start() for match in _SECRET_WORD_ANY_CASE.finditer(text))
        return
    lowered = text.lower()
    for stem in _SECRET_STEMS:
        at = lowered.find(stem)
        while at != -1:
            yield at
            at = lowered.find(stem, at + 1)


def _mask_key_shape(match: "re.Match[str]") -> str:
    # A 20- or 40-character word is key-shaped only if it mixes letters and digits
    # (WORKERWORKERWORKERWO is a word, not an access key).
    token = match.group(0)
    return MASK if _mixes_letters_and_digits(token) else token


def _mixes_letters_and_digits(token: str) -> bool:
    return any(c.isdigit() for c in token) and any(c.isalpha() for c in token)
