"""Preflight: disk-size on real tmpfs mounts, ulimit on real lowered rlimits, the report and the entrypoint."""

import json
import os
import resource
import subprocess
import sys

import pytest

from ma_runtime.stages.preflight import disk
from ma_runtime.stages.preflight.model import Status
from tests.conftest import MA_RUN, MA_RUNTIME, log_dir

MA_PREFLIGHT = os.path.join(os.path.dirname(MA_RUN), "ma-preflight")
RESULT_FIELDS = {"item", "status", "code", "value", "threshold", "hint", "target", "unit", "detail", "duration_ms"}


def preflight(args, env, **kwargs):
    return subprocess.run([MA_PREFLIGHT, *args], env=env, capture_output=True, text=True, timeout=60, **kwargs)


@pytest.fixture
def disks(tmpfs, tmp_path, job_env):
    """root = 64 MB, shm = 16 MB, no cache; thresholds in GB so 64 MB passes and 16 MB fails."""
    root, shm = tmpfs("root", "64m"), tmpfs("shm", "16m")
    job_env.update(
        MA_RUNTIME_PREFLIGHT_DISK_TARGETS=f"root={root},shm={shm},cache={tmp_path / 'no-cache'}",
        MA_RUNTIME_PREFLIGHT_ROOT_MIN_GB="0.05",
        MA_RUNTIME_PREFLIGHT_SHM_MIN_GB="0.02",
        MA_RUNTIME_PREFLIGHT_CACHE_MIN_GB="0.01",
    )
    return job_env


def by_target(report):
    return {(c["item"], c["target"]): c for c in report["checks"]}


def test_disk_size_pass_fail_and_skip_on_real_tmpfs(disks):
    result = preflight(["--json", "--only", "disk-size"], disks)
    assert result.returncode == 79
    report = json.loads(result.stdout)
    checks = by_target(report)
    root, shm, cache = checks["disk-size", "root"], checks["disk-size", "shm"], checks["disk-size", "cache"]
    assert root["status"] == "pass" and root["value"] == pytest.approx(0.067, abs=0.001)
    assert root["detail"]["free_gb"] <= root["detail"]["total_gb"]
    assert shm["status"] == "fail" and shm["code"] == "disk-size.too-small" and shm["threshold"] == 0.02
    assert "16.8" not in shm["hint"] and "0.017 GB" in shm["hint"]
    assert cache["status"] == "skip" and "does not exist" in cache["hint"]
    assert report["ok"] is False and report["failed"] == ["disk-size(shm)"]


def test_warn_only_turns_a_failure_into_a_warning(disks):
    disks["MA_RUNTIME_PREFLIGHT_WARN_ONLY"] = "disk-size"
    result = preflight(["--json", "--only", "disk-size"], disks)
    assert result.returncode == 0
    assert by_target(json.loads(result.stdout))["disk-size", "shm"]["status"] == "warn"


def test_report_schema_and_one_item_line_per_result(disks):
    result = preflight(["--json", "--only", "disk-size"], disks)
    report = json.loads(result.stdout)
    assert set(report) == {"ok", "failed", "duration_ms", "checks"}
    assert all(set(check) == RESULT_FIELDS for check in report["checks"])
    item_lines = [line for line in result.stderr.splitlines() if "item=" in line]
    assert len(item_lines) == len(report["checks"]) == 3
    assert any("item=disk-size target=shm result=fail" in line and "level=error" in line for line in item_lines)
    assert "error,exiting" in result.stderr
    assert "Component" not in result.stdout, "log lines must stay on stderr"


def test_human_table_without_json(disks):
    result = preflight(["--only", "disk-size"], disks)
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["ITEM", "TARGET", "RESULT"]
    assert any(line.split()[:3] == ["disk-size", "shm", "FAIL"] for line in lines)
    assert lines[-1] == "preflight FAILED: disk-size(shm)"


def on_a_terminal(args, env):
    """ma-preflight with stdout on a pseudo-terminal, as a person runs it: (exit code, what the terminal showed,
    stderr)."""
    import pty

    controller, terminal = pty.openpty()
    try:
        proc = subprocess.Popen([MA_PREFLIGHT, *args], env=env, stdout=terminal, stderr=subprocess.PIPE, text=True)
        os.close(terminal)
        stderr = proc.communicate(timeout=60)[1]
        shown = b""
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the terminal's last writer is gone
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(controller)
    return proc.returncode, shown.decode(), stderr


@pytest.mark.parametrize("args, logged", [([], False), (["--json"], False), (["--log-results"], True)])
def test_on_a_terminal_each_result_is_shown_once_unless_the_log_lines_are_asked_for(disks, args, logged):
    code, shown, stderr = on_a_terminal(["--only", "disk-size", *args], disks)
    assert code == 79
    assert "shm" in shown  # the report, on the terminal
    item_lines = [line for line in stderr.splitlines() if 'msg="preflight check"' in line]
    assert len(item_lines) == (3 if logged else 0), stderr
    assert "preflight failed" in stderr  # the summary and the reason for the exit code stay


def test_piped_each_result_is_a_log_line_for_collectors(disks):
    result = preflight(["--only", "disk-size"], disks)  # stdout is a pipe here
    assert len([line for line in result.stderr.splitlines() if 'msg="preflight check"' in line]) == 3


# Each target's fix: shm is memory sized by the container, cache the flavour's local disk, root the node's disk.
TARGET_FIXES = {
    "root": ("a node with a larger disk", "MA_RUNTIME_PREFLIGHT_ROOT_MIN_GB"),
    "shm": ("--shm-size", "medium: Memory", "MA_RUNTIME_PREFLIGHT_SHM_MIN_GB"),
    "cache": ("flavour", "/cache", "MA_RUNTIME_PREFLIGHT_CACHE_MIN_GB"),
}


@pytest.mark.parametrize("target", sorted(TARGET_FIXES))
def test_a_too_small_target_gets_the_hint_that_fits_it(tmp_path, target):
    result = disk.check_target(target, tmp_path, 1e6)  # no filesystem here is a petabyte
    assert (result.status, result.code, result.target) == (Status.FAIL, "disk-size.too-small", target)
    assert str(tmp_path) in result.hint and "1e+06 GB" in result.hint
    for words in TARGET_FIXES[target]:
        assert words in result.hint, (target, result.hint)
    if target != "root":
        assert "larger disk" not in result.hint  # not what fixes a small /dev/shm or /cache


def test_a_missing_shm_says_how_to_mount_one(tmp_path):
    result = disk.check_target("shm", tmp_path / "absent", 1)
    assert (result.status, result.code) == (Status.FAIL, "disk-size.missing")
    assert "--shm-size" in result.hint and "medium: Memory" in result.hint


def lowered(resource_id, soft, hard):
    def apply():
        resource.setrlimit(resource_id, (soft, hard))

    return apply


def ulimit_env(job_env, **minimums):
    limits = {"memlock_min_kb": 0, "nofile_min": 0, "stack_min_kb": 0, "nproc_min": 0, **minimums}
    job_env["MA_RUNTIME_PREFLIGHT_ULIMIT"] = "always"
    job_env.update({f"MA_RUNTIME_PREFLIGHT_{k.upper()}": str(v) for k, v in limits.items()})
    return job_env


def test_ulimit_raises_a_low_soft_limit_to_the_hard_limit(job_env):
    env = ulimit_env(job_env, nofile_min=2000)
    result = preflight(["--json", "--only", "ulimit"], env, preexec_fn=lowered(resource.RLIMIT_NOFILE, 512, 4096))
    nofile = by_target(json.loads(result.stdout))["ulimit", "nofile"]
    assert nofile["status"] == "pass" and nofile["value"] == 4096
    assert nofile["detail"]["soft_before"] == 512
    assert result.returncode == 0


def can_raise_hard_limits() -> bool:
    probe = "import resource as r; s, h = r.getrlimit(r.RLIMIT_NOFILE); r.setrlimit(r.RLIMIT_NOFILE, (h + 1, h + 1))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def test_ulimit_below_an_unraisable_hard_limit_fails_without_crashing(job_env):
    if can_raise_hard_limits():
        pytest.skip("this process may raise hard limits (CAP_SYS_RESOURCE): nothing is unraisable here")
    env = ulimit_env(job_env, nofile_min=10000)
    result = preflight(["--json", "--only", "ulimit"], env, preexec_fn=lowered(resource.RLIMIT_NOFILE, 512, 4096))
    assert result.returncode == 79 and "Traceback" not in result.stderr
    nofile = by_target(json.loads(result.stdout))["ulimit", "nofile"]
    assert nofile["status"] == "fail" and nofile["code"] == "ulimit.too-low" and nofile["value"] == 4096
    assert "hard limit stays 4096" in nofile["detail"]["not_raised"]


def test_ulimit_is_skipped_without_infiniband_unless_forced(job_env):
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this machine has an InfiniBand device")
    for mode, expected in (("auto", "skip"), ("never", "skip")):
        job_env["MA_RUNTIME_PREFLIGHT_ULIMIT"] = mode
        report = json.loads(preflight(["--json", "--only", "ulimit"], job_env).stdout)
        assert [c["status"] for c in report["checks"]] == [expected]


def test_the_workers_inherit_the_raised_limits(disks):
    disks.update(MA_RUNTIME_PREFLIGHT_CHECKS="ulimit", MA_RUNTIME_PREFLIGHT_ULIMIT="always",
                 MA_RUNTIME_PREFLIGHT_NOFILE_MIN="2000", MA_RUNTIME_PREFLIGHT_MEMLOCK_MIN_KB="0",
                 MA_RUNTIME_PREFLIGHT_NPROC_MIN="0")
    result = subprocess.run([MA_RUN, "sh", "-c", "ulimit -n"], env=disks, capture_output=True, text=True,
                            preexec_fn=lowered(resource.RLIMIT_NOFILE, 512, 4096), timeout=60)
    assert result.stdout == "4096\n", result.stderr


def test_a_failed_preflight_stops_the_entrypoint_before_the_command(disks, tmp_path):
    marker = tmp_path / "command-ran"
    result = subprocess.run([MA_RUN, "touch", str(marker)], env=disks, capture_output=True, text=True, timeout=60)
    assert result.returncode == 79
    assert not marker.exists()
    (error,) = [line for line in result.stderr.splitlines() if "error,exiting" in line]
    assert "disk-size(shm)" in error and "--shm-size" in error and "larger disk" not in error
    message = json.loads((log_dir(disks) / "modelarts-job-local-worker-0-termination.json").read_text())
    assert message["stage"] == "preflight" and message["category"] == "infrastructure"
    assert message["exit_code"] == 79 and "disk-size(shm)" in message["reason"]


@pytest.mark.parametrize(
    "switches, runs_preflight",
    [
        ({"MA_SKIP_IMAGE_DETECT": "0"}, False),
        ({"MA_SKIP_IMAGE_DETECT": "1"}, True),
        ({"MA_RUNTIME_PREFLIGHT": "off"}, False),
        ({}, True),
    ],
)
def test_preflight_switches(disks, switches, runs_preflight):
    disks.update(switches)
    result = subprocess.run([MA_RUN, "true"], env=disks, capture_output=True, text=True, timeout=60)
    assert (result.returncode == 79) is runs_preflight
    assert ("preflight skipped" in result.stderr) is not runs_preflight


def test_job_file_preflight_section(disks, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("preflight:\n  warn_only: [disk-size]\n  checks: [disk-size]\n")
    result = subprocess.run([MA_RUN, "--config", str(job), "true"], env=disks, capture_output=True, text=True)
    assert result.returncode == 0 and "result=warn" in result.stderr
    job.write_text("preflight:\n  bogus: 1\n")
    bad = subprocess.run([MA_RUN, "--config", str(job), "true"], env=disks, capture_output=True, text=True)
    assert bad.returncode == 78 and "unknown key 'preflight.bogus'" in bad.stderr


@pytest.mark.parametrize(
    "variable, value, expected",
    [
        ("MA_RUNTIME_PREFLIGHT_CHECKS", "dns,foo", "names unknown foo"),
        ("MA_RUNTIME_PREFLIGHT_ROOT_MIN_GB", "big", "is not a number"),
        ("MA_RUNTIME_PREFLIGHT_DISK_TARGETS", "home=/home", "bad entry 'home=/home'"),
        ("MA_SKIP_IMAGE_DETECT", "yes", "must be one of 0, 1"),
    ],
)
def test_bad_preflight_settings_are_one_line_78(job_env, variable, value, expected):
    job_env[variable] = value
    for argv in ([MA_RUN, "true"], [MA_PREFLIGHT]):
        result = subprocess.run(argv, env=job_env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 78 and expected in result.stderr and variable in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_ma_runtime_preflight_is_ma_preflight_and_skip_works(disks):
    result = subprocess.run([MA_RUNTIME, "preflight", "--json", "--only", "disk-size,ulimit", "--skip", "ulimit"],
                            env=disks, capture_output=True, text=True, timeout=60)
    assert {c["item"] for c in json.loads(result.stdout)["checks"]} == {"disk-size"}
    assert result.returncode == 79
