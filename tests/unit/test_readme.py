"""The README is what users read first: its settings and ranges must be the code's."""

import re
from pathlib import Path

from ma_runtime import spec
from ma_runtime.errors import ExitCode

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def _number(value) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def test_every_setting_is_documented():
    missing = [setting.env for setting in spec.SETTINGS if not re.search(rf"`{setting.env}[`=]", README)]
    assert not missing


def test_every_numeric_setting_has_its_range_in_the_readme():
    for setting in spec.SETTINGS:
        bounds = getattr(setting.parse, "range", None)
        if bounds:
            row = f"| `{setting.env}` | {_number(bounds[0])}-{_number(bounds[1])} |"
            assert row in README, row


def test_every_exit_code_is_in_the_readme_table():
    for code in ExitCode:
        assert re.search(rf"^\| {int(code)} \|", README, re.MULTILINE), code
