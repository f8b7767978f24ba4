"""The pip requirements of the code directory, installed into the job's interpreter once per pod."""

import time
from typing import List, Mapping

from ma_runtime.errors import HookFailed
from ma_runtime.stages.hooks.env import job_python
from ma_runtime.stages.hooks.running import HookStage, Record, first_file, sha256, supervised
from ma_runtime.util import records

REQUIREMENT_NAMES = ("pip-requirement.txt", "requirements.txt")  # the platform's two names; the first found


def install(run: HookStage) -> None:
    found = first_file(run.code_dir, REQUIREMENT_NAMES)
    if found is None:
        return
    python = job_python(run.environ, run.command)
    if python is None:
        raise HookFailed(f"cannot install {found}: no Python interpreter for the job on PATH",
                         hint="put the job's python3 on PATH (or set ANACONDA_DIR and DEFAULT_CONDA_ENV_NAME), "
                              "or turn the install off with MA_RUNTIME_PIP_INSTALL=off", stage="pip")
    record = Record(run.spec.state_dir / "pip.json", run.reuse, _valid_pip, "the pip record",
                     "the requirements are installed again", run.log)
    key = {"file": str(found), "sha256": sha256(found), "python": python}
    if record.matches(key):
        run.log.info("pip requirements already installed in this pod; not installed again", file=str(found))
        return
    argv = [python, "-m", "pip", "install", "--no-input", "--disable-pip-version-check", "-r", str(found),
            *_index_options(run.spec, run.environ)]
    run.log.info("installing pip requirements", file=str(found), python=python)
    started = time.monotonic()
    result = supervised(run, argv, run.environ, "pip install", "pip")
    if result.code != 0:
        what = result.why if result.hint else f"with exit code {result.code}"  # not started: why, in its words
        raise HookFailed(f"pip install -r {found.name} failed {what}", hint=result.hint or _pip_hint(run),
                         stage="pip", tail=result.tail, hook_exit_code=result.code)
    run.log.info("pip requirements installed", file=str(found), elapsed_s=round(time.monotonic() - started, 3))
    record.write(key, run.log, "pip install")


def _index_options(spec, environ: Mapping[str, str]) -> List[str]:
    """The platform's pip source (MA_PIP_URL, and MA_PIP_HOST as trusted: it is often plain HTTP), unless the job
    chose its own index (PIP_INDEX_URL), which wins. PIP_INDEX_URL is read from the environment: it is pip's own
    variable, which pip reads from the same environment, not a setting of ours."""
    url = spec.hooks_pip_url.strip()
    if not url or environ.get("PIP_INDEX_URL"):
        return []
    host = spec.hooks_pip_host.strip()
    return ["--index-url", url, *(["--trusted-host", host] if host else [])]


def _pip_hint(run: HookStage) -> str:
    hint = "the lines above are pip's; fix the requirements file, or set MA_RUNTIME_PIP_INSTALL=off and install " \
           "the packages in the image"
    if run.spec.num_hosts > 10 and not run.spec.hooks_pip_url:
        hint += " (the platform removes its pip source from jobs of more than 10 nodes)"
    return hint


def _valid_pip(document) -> dict:
    """pip.json: the requirements file, its hash and the interpreter that installed it."""
    records.exactly(records.mapping(document, "the record"), ("file", "sha256", "python"), "the record")
    for name in ("file", "sha256", "python"):
        records.text(document[name], f"`{name}`")
    return document
