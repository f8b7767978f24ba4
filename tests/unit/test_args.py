"""Argument appending: argv form never meets a shell; shell form feeds the last simple command."""

import json
import sys

import pytest

from ma_runtime.launch.args import build_argv, insert_after_last_word, is_shell_form, last_simple_command
from tests.conftest import run_ma

PAIRS = [("lr", "0.1"), ("name", "a b 'c' \"d\" $(touch pwned)")]


def test_argv_form_appends_words_verbatim():
    assert build_argv(["python", "train.py", "--x", "1"], PAIRS) == [
        "python", "train.py", "--x", "1", "--lr=0.1", "--name=a b 'c' \"d\" $(touch pwned)",
    ]


@pytest.mark.parametrize(
    "command, shell",
    [
        (["python", "train.py"], False),
        (["./train.sh"], False),
        (["/usr/bin/python3"], False),
        (["python train.py"], True),
        (["python a.py; python train.py"], True),
        (["a&&b"], True),
        (["echo $HOME"], True),
    ],
)
def test_shell_form_is_one_word_with_shell_syntax(command, shell):
    assert is_shell_form(command) is shell


@pytest.mark.parametrize(
    "script, expected",
    [
        ("python a.py; python train.py", "python a.py; python train.py X"),
        ("python a.py && python train.py;", "python a.py && python train.py X;"),
        ("python train.py &", "python train.py X &"),
        ("python train.py # a comment", "python train.py X # a comment"),
        ("(cd code && python train.py)", "(cd code && python train.py X)"),
        ("python train.py\n\n", "python train.py X\n\n"),
        ("echo 'a; b'", "echo 'a; b' X"),
        ('echo "x # not a comment"', 'echo "x # not a comment" X'),
        ("python t.py > out.log 2>&1", "python t.py > out.log 2>&1 X"),
    ],
)
def test_insertion_point_is_after_the_last_word(script, expected):
    assert insert_after_last_word(script, "X") == expected


def echo_argv_script(tmp_path, name):
    path = tmp_path / name
    path.write_text(
        "import json, sys, os\n"
        f"open(os.path.join({str(tmp_path)!r}, {name!r} + '.json'), 'w').write(json.dumps(sys.argv[1:]))\n"
    )
    return path


def test_shell_string_gives_arguments_to_its_last_command_only(tmp_path, job_env):
    first, last = echo_argv_script(tmp_path, "first.py"), echo_argv_script(tmp_path, "train.py")
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"hyperparameters": dict(PAIRS)}))
    script = f"{sys.executable} {first} --own; {sys.executable} {last} --own"
    result = run_ma(["--config", str(job), script], job_env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "first.py.json").read_text()) == ["--own"]
    assert json.loads((tmp_path / "train.py.json").read_text()) == ["--own", "--lr=0.1", f"--name={PAIRS[1][1]}"]
    assert not (tmp_path / "pwned").exists(), "a hyperparameter value was evaluated by a shell"


def test_argv_command_gets_arguments_without_any_shell(tmp_path, job_env):
    last = echo_argv_script(tmp_path, "train.py")
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"hyperparameters": dict(PAIRS)}))
    result = run_ma(["--config", str(job), sys.executable, str(last), "--lr", "1"], job_env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "train.py.json").read_text()) == [
        "--lr", "1", "--lr=0.1", f"--name={PAIRS[1][1]}",
    ]
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("script, words", [
    ("cd src && python train.py > out.log", ["python", "train.py"]),
    ("python a.py; python -u b.py --x 1 # comment", ["python", "-u", "b.py", "--x", "1"]),
    ("pip list\nbash run.sh", ["bash", "run.sh"]),
    ("(cd x; python t.py) &", ["python", "t.py"]),
    ("python 'with space.py' 2>&1", ["python", "with space.py", "2"]),
    ('echo "unclosed', []),
])
def test_last_simple_command(script, words):
    assert last_simple_command(script) == words
