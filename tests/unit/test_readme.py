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


def test_the_repository_cites_only_documents_it_ships():
    # Code and README once cited the design notes, the platform contract's sections and line numbers of
    # files we do not ship; docs/platform.md and docs/architecture.md are the repository's own.
    root = Path(__file__).resolve().parents[2]
    foreign = re.compile(r"DESIGN\.md|platform-contract|test-environment\.md|prior-art\.md|§|\b0\d\d:\d{3,}")
    files = [root / "README.md", *root.glob("ma_runtime/**/*.py"), *root.glob("tests/**/*.py"),
             *root.glob("benchmarks/*.py"), *root.glob("scripts/*.sh"), *root.glob("examples/*")]
    cited = [f"{path.relative_to(root)}:{number}" for path in files if path.is_file()
             for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if foreign.search(line) and "foreign = re.compile" not in line]
    assert not cited
    for linked in ("docs/architecture.md", "docs/platform.md"):
        assert (root / linked).is_file() and linked in README


def test_the_package_declares_its_license_the_current_way():
    # `license = { text = ... }` made setuptools print its deprecation box three times in the demo.
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^license = "Apache-2.0"$', pyproject, re.MULTILINE)
    assert '"setuptools>=77"' in pyproject  # the first to read an SPDX license expression
