"""What the suite says about itself, and the two modes scripts/test.sh runs it in.

- At the end of every run: the time each test file took (setup, call and teardown of its tests together, the
  slowest first) and how many tests skipped for each reason, so a slow file or a missing tool shows in the log.
- Strict mode (`MA_RUNTIME_TESTS_STRICT=1`, exported by `.ci/run`): a skipped test is a failure, because
  scripts/test.sh installs every tool the suite needs and a skip would let CI pass without testing. Only the
  reasons in EXPECTED_SKIPS stay skips: facts of the machine that no installation changes.
- `--second-python`: the pass on the second interpreter (Python 3.9, what the Ascend images ship): every unit test
  and the end-to-end files in SECOND_PYTHON_E2E, the others deselected (not skipped); see there why.
"""

import os
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

STRICT_VARIABLE = "MA_RUNTIME_TESTS_STRICT"

# Skips that are right even where scripts/test.sh installed everything: the reason, matched as a regular
# expression at the start of the skip's reason, and why no installation changes it.
EXPECTED_SKIPS = {
    r"root reads every folder": "the unreadable-folder case needs a user without CAP_DAC_READ_SEARCH; CI is root",
    r"sshd is installed here": "the no-sshd case runs where sshd is absent; scripts/test.sh installs it",
    r"this process may raise hard limits": "root may raise any limit: the case needs an unprivileged process",
    r"this machine has an InfiniBand device": "the case without InfiniBand cannot run where there is one",
    r"needs /dev/shm on a filesystem of its own": "a property of the container the suite runs in",
    r"port 36666 is taken here": "the platform's fixed sshd port, busy with something else on this machine",
    r".*\b(GPU|NPU|accelerator)s? (is |are )?(absent|missing|not present)": "no accelerator on a CPU machine",
    r".*no wheel for Python 3\.9": "torch 2.13 and the frameworks on it support Python >= 3.10 only",
}

# The end-to-end files the --second-python pass runs, and the runtime's part each one runs as a real process. What
# differs between Python versions is the runtime's own code: every unit test runs on both, and these files; the
# other end-to-end files run on the main Python only, for they add launchers, frameworks and nodes, not runtime
# code: real torchrun, msrun, Lightning and the Trainer (torch has no 3.9 wheel; MindSpore has its own venv), nodes
# in network namespaces (the one-node code paths again), the image (the runtime on the image's own Python), the
# fault proxy's matrices (their retry and sync code runs in tests/unit/test_transfer.py and test_sync.py).
# A new end-to-end file runs on the main Python only until it is added here: add it when it runs runtime code that
# no unit test runs (the multi-node, local-box and framework files to come stay out).
SECOND_PYTHON_E2E = {
    "tests/e2e/test_cli.py": "the console scripts and their arguments",
    "tests/e2e/test_job_as_one.py": "the coordinator: the one runtime code that runs only on several nodes",
    "tests/e2e/test_exit_codes.py": "exit codes and their decoding",
    "tests/e2e/test_termination.py": "the termination message",
    "tests/e2e/test_signal_regime.py": "signal handling, as PID 1 and not",
    "tests/e2e/test_signals_once.py": "one SIGTERM to each process of a plain command",
    "tests/e2e/test_early_stop.py": "a stop before the command starts",
    "tests/e2e/test_init_duties.py": "PID 1's duties (reaping, forwarding), beside tini and dumb-init",
    "tests/e2e/test_hardening.py": "the exit path, the log sink, the masker",
    "tests/e2e/test_output.py": "output forwarding and rank prefixes",
    "tests/e2e/test_leftovers.py": "processes left behind, found and ended",
    "tests/e2e/test_isolation.py": "the runtime isolated from the job's Python",
    "tests/e2e/test_exec_limits.py": "argument and environment limits of exec",
    "tests/e2e/test_attempt_records.py": "attempt records",
    "tests/e2e/test_restarts.py": "the restart policy and its backoff",
    "tests/e2e/test_hang.py": "hang detection on plain commands",
    "tests/e2e/test_progress_pattern.py": "the progress pattern's regular expressions (re differs between versions)",
    "tests/e2e/test_multi_worker.py": "several workers under one supervisor",
    "tests/e2e/test_ranktable.py": "waiting for and converting the rank table",
    "tests/e2e/test_hooks.py": "the pre-start hooks",
    "tests/e2e/test_stagein.py": "stage-in",
    "tests/e2e/test_stagein_hardening.py": "stage-in's hardening",
    "tests/e2e/test_sync.py": "the output sync",
    "tests/e2e/test_uploader_process.py": "the uploader's own process",
}


def strict() -> bool:
    return os.environ.get(STRICT_VARIABLE, "") not in ("", "0")


def expected_skip(reason: str) -> bool:
    return any(re.match(pattern, reason) for pattern in EXPECTED_SKIPS)


def pytest_addoption(parser):
    parser.addoption("--second-python", action="store_true",
                     help="the pass on the second Python: the unit tests and the end-to-end files in "
                          "tests/suite_plugin.py's SECOND_PYTHON_E2E")


def pytest_configure(config):
    config.stash[_TIMES] = defaultdict(float)
    config.stash[_SKIPS] = Counter()
    config.stash[_STRICT_FILES] = []


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--second-python"):
        return
    root = Path(str(config.rootpath))
    kept, left_out = [], []
    for item in items:
        (kept if _on_second_python(_relative(item.path, root)) else left_out).append(item)
    config.stash[_LEFT_OUT] = sorted({_relative(item.path, root) for item in left_out})
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A whole file skipped at import (`pytest.importorskip` at the top) is counted, and in strict mode fails the
    run at its end (a collection error would stop every other file from running)."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        reason = _skip_reason(report)
        collector.config.stash[_SKIPS][reason] += 1
        if strict() and not expected_skip(reason):
            collector.config.stash[_STRICT_FILES].append(f"{report.nodeid}: {_strict_message(reason)}")


def pytest_sessionfinish(session, exitstatus):
    if session.config.stash.get(_STRICT_FILES, []) and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    item.config.stash[_TIMES][_relative(item.path, Path(str(item.config.rootpath)))] += report.duration
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if strict() and not expected_skip(reason):
        report.outcome = "failed"
        report.longrepr = _strict_message(reason)
    else:
        item.config.stash[_SKIPS][reason] += 1


def pytest_terminal_summary(terminalreporter, config):
    times, skips = config.stash[_TIMES], config.stash[_SKIPS]
    write = terminalreporter.write_line
    if times:
        terminalreporter.section("time per test file")
        for path, seconds in sorted(times.items(), key=lambda pair: -pair[1]):
            write(f"{seconds:8.1f} s  {path}")
        write(f"{sum(times.values()):8.1f} s  in all ({len(times)} files)")
    if skips:
        terminalreporter.section("skips per reason")
        for reason, count in skips.most_common():
            write(f"{count:5d}  {reason}{'  (expected here)' if expected_skip(reason) else ''}")
    if config.stash[_STRICT_FILES]:
        terminalreporter.section("files skipped at import: failures in strict mode")
        for line in config.stash[_STRICT_FILES]:
            write(line)
    left_out = config.stash.get(_LEFT_OUT, [])
    if left_out:
        terminalreporter.section(f"left out on Python {sys.version_info[0]}.{sys.version_info[1]} (--second-python)")
        write(f"{len(left_out)} end-to-end files run on the main Python only (tests/suite_plugin.py, SECOND_PYTHON_E2E "
              f"says why): {', '.join(Path(path).name for path in left_out)}")


_TIMES = pytest.StashKey()
_SKIPS = pytest.StashKey()
_LEFT_OUT = pytest.StashKey()
_STRICT_FILES = pytest.StashKey()


def _on_second_python(path: str) -> bool:
    return not path.startswith("tests/e2e/") or path in SECOND_PYTHON_E2E


def _relative(path, root: Path) -> str:
    try:
        return str(Path(str(path)).relative_to(root))
    except ValueError:
        return str(path)


def _skip_reason(report) -> str:
    """The reason text of a skip report, without pytest's 'Skipped: ' prefix."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


def _strict_message(reason: str) -> str:
    return (f"skipped in strict mode ({STRICT_VARIABLE}=1), where scripts/test.sh installs what the suite needs: "
            f"{reason}. Install what it names, or, if no installation can change it, add the reason to "
            f"EXPECTED_SKIPS in tests/suite_plugin.py saying why")
