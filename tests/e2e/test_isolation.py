"""The runtime kept apart from the job's Python: the image's entrypoint runs it as `python -I -m ma_runtime`, so a
job's PYTHONPATH that shadows one of the runtime's packages breaks neither the runtime nor the uploader process it
starts (which gets -I too), while the command still gets that PYTHONPATH."""

import sys

from tests.conftest import task_log


def test_a_jobs_pythonpath_shadowing_the_runtimes_packages_breaks_nothing(job_env, tmp_path):
    import subprocess

    shadow = tmp_path / "job-packages"
    for package in ("yaml", "structlog", "psutil", "obs"):
        (shadow / package).mkdir(parents=True)
        (shadow / package / "__init__.py").write_text(f"raise ImportError('the job shadows {package}')\n")
    out = tmp_path / "synced"
    job = tmp_path / "job.yaml"
    job.write_text(f"outputs:\n  - name: train_url\n    url: {out}/\n")
    env = {**job_env, "PYTHONPATH": str(shadow), "MA_RUNTIME_PREFLIGHT": "off",
           "MA_RUNTIME_SYNC_INTERVAL_SECONDS": "0.2"}
    command = 'echo "$PYTHONPATH" > "${0#--train_url=}/seen" && sleep 1'  # $0: the appended --train_url=<dir>
    done = subprocess.run([sys.executable, "-I", "-m", "ma_runtime", "run", "--config", str(job), "--",
                           "sh", "-c", command], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    log = task_log(env).read_text()
    assert "the job shadows" not in done.stderr + log
    assert 'msg="output upload completed"' in log
    assert (out / "seen").read_text().strip() == str(shadow)  # the command still gets the job's PYTHONPATH
