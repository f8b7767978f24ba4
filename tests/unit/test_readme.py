"""The README and the documentation site are what users read: they must say what the code does.

The settings, exit codes and log events are documented by pages generated from the code
(scripts/gen_docs.py); these tests hold the generator to the code and the hand-written pages to the repository.
"""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import yaml

from ma_runtime import spec
from ma_runtime.errors import ExitCode

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _number(value) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def test_the_generated_reference_pages_are_current():
    # A setting, exit code or log event changed without `python scripts/gen_docs.py`: the site would lie.
    checked = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stderr


def test_the_benchmark_verdict_tables_are_generated_from_the_committed_results():
    # The README's benchmark table was once typed by hand and showed 1.65x under "met" for a 1.2x goal.
    checked = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_table.py"), "--check"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr


def test_a_benchmark_verdict_follows_its_figure_not_its_own_word():
    spec = importlib.util.spec_from_file_location("bench_table", ROOT / "scripts" / "bench_table.py")
    bench_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_table)
    record = {"key": "ranktable", "goal": "<= 1.2x a bare JSON load + dump", "source": "issue 29", "limit": 1.2,
              "unit": "x", "at_most": True, "measured": "ratio of the medians", "figure": 1.54, "per_round": None,
              "broken": False, "met": True, "note": ""}
    at_least = {**record, "at_most": False, "limit": 0.9, "figure": 0.63, "met": False}
    lost = {**record, "figure": 1.1, "broken": True, "met": False}  # under the limit, but a line was lost
    none = {**record, "figure": None, "met": None}
    runs = [{"file": "x.json", "command": "benchmarks/x.py", "taken_utc": "now", "cpus": 2,
             "load_at_end": "2 CPUs, load average now 1 1 1", "verdicts": [record, at_least, lost, none]}]
    rows = [line for line in bench_table.table(runs).splitlines() if line.startswith("| ranktable")]
    assert [row.rsplit("|", 2)[1].strip().split(" (")[0] for row in rows] == [
        "**MISSED**", "**MISSED**", "**MISSED**", "no figure"]
    assert bench_table.disagreements(runs) == ["x.json: ranktable"]  # the first says "met" of 1.54x


def test_every_setting_is_documented():
    settings = _page("reference/settings.md")
    missing = [setting.env for setting in spec.SETTINGS if f"| `{setting.env}` |" not in settings]
    assert not missing


def test_every_numeric_setting_has_its_range_in_the_settings_reference():
    rows = {line.split("|")[1].strip(" `"): line for line in _page("reference/settings.md").splitlines()
            if line.startswith("| `")}
    for setting in spec.SETTINGS:
        bounds = getattr(setting.parse, "range", None)
        if bounds:
            assert f"| {_number(bounds[0])}-{_number(bounds[1])} |" in rows[setting.env], setting.env


def test_every_exit_code_is_in_the_readme_table_and_the_reference():
    reference = _page("reference/exit-codes.md")
    for code in ExitCode:
        assert re.search(rf"^\| {int(code)} \|", README, re.MULTILINE), code
        assert re.search(rf"^\| {int(code)} \| `{code.name.lower().replace('_', ' ')}` \|", reference,
                         re.MULTILINE), code


def test_the_log_events_page_lists_the_lines_operators_search_for():
    # The page is read off the source's logger calls: if that reading broke, these would be the first to go.
    events = _page("reference/log-events.md")
    for event in ("`error,exiting: ", "`preflight check`", "`starting command`", "`command exited`",
                  "`restarting command`", "`job suspected hung`", "`rank table waiting`",
                  "`download completed`", "upload completed`", "`stop already under way`"):
        assert event in events, event


def test_the_readme_gives_the_two_commands_and_they_run_what_it_says():
    block = re.search(r"## Two commands on a fresh machine\n\n```sh\n(.*?)```", README, re.DOTALL)
    assert block, "the README's two commands are gone"
    assert block.group(1) == (
        "bash scripts/demo.sh    # sets up .venv and runs the demo training job under ma-run\n"
        "bash scripts/test.sh    # sets up .venv with the test tools and runs lint and every test\n")
    demo = (ROOT / "scripts" / "demo.sh").read_text(encoding="utf-8")
    assert re.search(r"ma-run --config examples/job.yaml -- \S*python examples/train.py", demo)
    test = (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")
    assert ".venv" in test and "ruff check" in test and "-m pytest" in test
    # CI runs exactly the README's test command.
    assert (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().endswith("bash scripts/test.sh")


def test_the_readme_is_short_and_its_links_lead_somewhere():
    assert len(README.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#]+\.md)(?:#([^)]*))?\)", README):
        path, anchor = ROOT / target[0], target[1]
        assert path.is_file(), target[0]
        if anchor:
            assert anchor in _anchors(path.read_text(encoding="utf-8")), f"{target[0]}#{anchor}"
    for linked in ("docs/architecture.md", "docs/platform.md"):
        assert (ROOT / linked).is_file() and linked in README


def _anchors(markdown: str):
    """Heading ids as GitHub and MkDocs' toc both make them (the headings here use no character they differ on)."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", markdown, re.MULTILINE)}


def test_the_site_navigation_lists_every_page():
    # mkdocs --strict says so too, but only where mkdocs is installed (scripts/docs.sh); this needs nothing.
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))

    def pages(nav):
        for entry in nav:
            for value in entry.values():
                yield from pages(value) if isinstance(value, list) else [value]

    listed = set(pages(config["nav"]))
    on_disk = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")}
    assert listed == on_disk


def test_the_architecture_names_every_module_and_test_file():
    # docs/architecture.md once called mpirun "planned" and left 19 of 53 test files out.
    architecture = _page("architecture.md")
    modules = [path.relative_to(ROOT / "ma_runtime") for path in (ROOT / "ma_runtime").rglob("*.py")]
    unnamed = [str(module) for module in modules if str(module) not in architecture and module.name not in architecture]
    assert not unnamed, "modules docs/architecture.md does not name"
    tests = [path.relative_to(ROOT / "tests") for path in (ROOT / "tests").glob("*/test_*.py")]
    unnamed = [str(test) for test in tests if f"`{test}`" not in architecture]
    assert not unnamed, "test files docs/architecture.md does not name"
    # Every launcher that exists is built: none may be called planned.
    planned = architecture.split("**Not built yet (planned).**", 1)[1].split("\n\n", 1)[0]
    launchers = {path.stem.replace("_", "-") for path in (ROOT / "ma_runtime" / "launch").glob("*.py")}
    assert not [name for name in launchers if re.search(rf"\b{re.escape(name)}\b", planned)]


def test_the_repository_cites_only_documents_it_ships():
    # Code and README once cited the design notes, the platform contract's sections and line numbers of
    # files we do not ship; docs/platform.md and docs/architecture.md are the repository's own.
    foreign = re.compile(r"DESIGN\.md|platform-contract|test-environment\.md|prior-art\.md|§|\b0\d\d:\d{3,}")
    files = [ROOT / "README.md", *DOCS.glob("guides/*.md"), *DOCS.glob("reference/*.md"), DOCS / "index.md",
             DOCS / "benchmarks.md", *ROOT.glob("ma_runtime/**/*.py"), *ROOT.glob("tests/**/*.py"),
             *ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.sh"), *ROOT.glob("scripts/*.py"),
             *ROOT.glob("examples/*")]
    cited = [f"{path.relative_to(ROOT)}:{number}" for path in files if path.is_file()
             for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if foreign.search(line) and "foreign = re.compile" not in line]
    assert not cited


def test_the_package_declares_its_license_the_current_way():
    # `license = { text = ... }` made setuptools print its deprecation box three times in the demo.
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^license = "Apache-2.0"$', pyproject, re.MULTILINE)
    assert '"setuptools>=77"' in pyproject  # the first to read an SPDX license expression


def test_the_test_tools_include_the_docs_builder():
    # scripts/docs.sh builds the site with the .venv that scripts/test.sh installs with the test extra.
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^docs = \["mkdocs>=1\.6"\]', pyproject, re.MULTILINE)
    assert '"ma-runtime[docs]"' in pyproject
