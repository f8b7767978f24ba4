"""Appending `--name=value` arguments to the command, the platform's way (docs/platform.md, "Launch methods").

A command given as several words runs as it is, with no shell, and the
arguments become extra words. A command given as one word that contains shell
syntax (`'python a.py; python train.py'`) is the platform's start-command form:
it runs through `/bin/sh -c`, and the arguments, each shell-quoted, are inserted
right after the last word of its last simple command, so that a trailing `;`,
`&`, `)` or `# comment` does not swallow them.
"""

import shlex
from typing import List, Sequence, Tuple

SHELL = "/bin/sh"
# Characters that make a one-word command shell syntax rather than a program name.
_SHELL_SYNTAX = set(" \t\n;&|<>()$`\\\"'*?[]#~=%{}")
_OPERATOR_CHARS = set(";&|<>()")


def is_shell_form(command: Sequence[str]) -> bool:
    return len(command) == 1 and any(c in _SHELL_SYNTAX for c in command[0])


def format_arguments(pairs: Sequence[Tuple[str, str]]) -> List[str]:
    return [f"--{name}={value}" for name, value in pairs]


def build_argv(command: Sequence[str], pairs: Sequence[Tuple[str, str]]) -> List[str]:
    """The argv to exec: the command with the arguments appended."""
    extra = format_arguments(pairs)
    if not is_shell_form(command):
        return list(command) + extra
    script = command[0]
    if extra:
        script = insert_after_last_word(script, " ".join(shlex.quote(arg) for arg in extra))
    return [SHELL, "-c", script]


def append_words(argv: Sequence[str], words: Sequence[str]) -> List[str]:
    """`argv` as build_argv made it, with more words for the command (a launcher's own arguments): in the shell
    form, shell-quoted after the last word of the last simple command, like the others; else at the end."""
    if not words:
        return list(argv)
    if len(argv) == 3 and argv[0] == SHELL and argv[1] == "-c":
        return [SHELL, "-c", insert_after_last_word(argv[2], " ".join(shlex.quote(word) for word in words))]
    return [*argv, *words]


def insert_after_last_word(script: str, text: str) -> str:
    end = _end_of_last_word(script)
    if end is None:
        return f"{script} {text}"
    return f"{script[:end]} {text}{script[end:]}"


def _end_of_last_word(script: str):
    """Index just past the last shell word (not operator, comment or blank), or None.

    A small lexer: it knows quotes, backslash escapes, comments and operators,
    which is all it takes to find where the last simple command's words end.
    """
    end = None
    i, n = 0, len(script)
    in_word = False
    while i < n:
        c = script[i]
        if c == "\\" and i + 1 < n:
            i, in_word = i + 2, True
            end = i
            continue
        if c in ("'", '"'):
            i = _skip_quoted(script, i)
            in_word, end = True, i
            continue
        if c == "#" and not in_word:
            while i < n and script[i] != "\n":
                i += 1
            continue
        if c.isspace() or c in _OPERATOR_CHARS:
            in_word = False
            i += 1
            continue
        in_word = True
        i += 1
        end = i
    return end


def _skip_quoted(script: str, start: int) -> int:
    quote = script[start]
    i = start + 1
    while i < len(script):
        if script[i] == "\\" and quote == '"' and i + 1 < len(script):
            i += 2
            continue
        if script[i] == quote:
            return i + 1
        i += 1
    return len(script)


def last_simple_command(script: str) -> List[str]:
    """The words of a shell script's last simple command, up to its first redirection (`cd src && python
    train.py > out.log` -> [python, train.py]); [] when the script cannot be read as shell words."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|()<>\n")
    lexer.whitespace = " \t\r"  # a newline ends a command, as `;` does
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote
        return []
    commands: List[List[str]] = [[]]
    for token in tokens:
        if token and set(token) <= _OPERATOR_CHARS - set("<>") | {"\n"}:
            commands.append([])
        else:
            commands[-1].append(token)
    last = next((words for words in reversed(commands) if words), [])
    for index, word in enumerate(last):
        if word and set(word) <= set("<>&"):
            return last[:index]
    return last
