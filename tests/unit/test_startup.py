"""What the start-up of a run imports: only what the run needs, when it needs it (issue 29, item 4).

Imports were three quarters of `ma-run`'s start-up. These pin the ones taken out of it, from the interpreter's own
record (`-X importtime` lists every module a process imports), never from a timing.
"""

import subprocess
import sys

import pytest

# ctypes.util: its find_library("c") ran `ldconfig -p` at every start; prctl finds the C library without it.
# asyncio: for the job's code, never the runtime's. yaml: only for a job that has a job file.
NEVER_AT_START = ("ctypes.util", "asyncio", "yaml")
# What a one-node run without hang detection, stage-in or a job file has no use for: the peers' sockets (launchers
# that wait for peers), the progress pattern's matcher, the DNS resolver (several nodes), a temporary file, the
# storage layer (nothing to stage in).
NOT_FOR_A_PLAIN_RUN = ("socket", "tempfile", "ma_runtime.launch.peers", "ma_runtime.supervise.progress",
                       "ma_runtime.stages.preflight.dns_resolve", "ma_runtime.storage.base", "ma_runtime.storage.url",
                       "argparse")


def imported_modules(stderr: str):
    """The modules `python -X importtime` reports, by name."""
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_a_run_imports_none_of_what_it_does_not_need(job_env):
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "ma_runtime", "run", "--", "true"],
                          env=job_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    modules = imported_modules(done.stderr)
    assert "ma_runtime.bootstrap" in modules  # the record is there: the run itself was traced
    assert not [name for name in modules if name.split(".")[0] in NEVER_AT_START or name in NEVER_AT_START]
    assert not [name for name in modules if name in NOT_FOR_A_PLAIN_RUN]


@pytest.mark.parametrize("module", ["ma_runtime.cli", "ma_runtime.bootstrap", "ma_runtime.supervise.pid1",
                                    "ma_runtime.supervise.guard", "ma_runtime.util.logs"])
def test_the_run_path_imports_ctypes_only_when_it_calls_the_c_library(module):
    # A run as PID 1 (the container's entrypoint) never calls prctl in its own process: it never loads ctypes.
    code = (f"import sys, {module}\n"
            "assert 'ctypes' not in sys.modules, 'ctypes imported with the module'\n"
            "from ma_runtime.supervise import pid1\n"
            "assert pid1.become_subreaper(), 'prctl(PR_SET_CHILD_SUBREAPER) failed'\n"
            "assert 'ctypes' in sys.modules and 'ctypes.util' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
