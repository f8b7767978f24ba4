"""The registration of a job's Python processes for stack dumps (see the package's docstring): what each worker's
environment gets, and the attempt's folder where every process opens its file."""

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Dict, Mapping

SITE_DIR = Path(__file__).resolve().parent.parent / "site"
DIR_ENV = "MA_RUNTIME_STACKS_DIR"
SIGNAL_ENV = "MA_RUNTIME_STACKS_SIGNAL"
# A registry nobody has added to for this long and whose processes are all gone was left by a runtime that
# was killed; a younger one may belong to a run whose workers have not started Python yet.
ABANDONED_SECONDS = 3600


def stack_signal() -> int:
    return int(signal.SIGRTMIN) + 4


def worker_env(registry: Path, environ: Mapping[str, str]) -> Dict[str, str]:
    """What a worker's environment gets (added or changed) so that its Python processes register."""
    existing = environ.get("PYTHONPATH")
    # An empty entry means the current directory: none is added where there was no PYTHONPATH (or an empty one).
    path = f"{SITE_DIR}{os.pathsep}{existing}" if existing else str(SITE_DIR)
    return {"PYTHONPATH": path, DIR_ENV: str(registry), SIGNAL_ENV: str(stack_signal())}


def registry_dir(state_dir: Path, run_id: str, attempt: int) -> Path:
    """`<state_dir>/stacks/<run_id>-<attempt>`, created empty (the default umask: the workers may run as another
    user in some images). Registries abandoned by a killed runtime are removed. Raises OSError."""
    root = Path(state_dir) / "stacks"
    registry = root / f"{run_id}-{attempt}"
    _remove_abandoned(root, keep=registry.name)
    shutil.rmtree(registry, ignore_errors=True)
    registry.mkdir(parents=True)
    return registry


def clean(registry: Path) -> None:
    """At the attempt's end."""
    shutil.rmtree(registry, ignore_errors=True)


def _remove_abandoned(root: Path, keep: str) -> None:
    try:
        entries = [entry for entry in root.iterdir() if entry.name != keep]
    except OSError:
        return
    for entry in entries:
        if _abandoned(entry):
            shutil.rmtree(entry, ignore_errors=True)


def _abandoned(registry: Path) -> bool:
    try:
        if registry.is_symlink() or not registry.is_dir():
            return False
        if time.time() - registry.stat().st_mtime < ABANDONED_SECONDS:
            return False
        return not any(name.isdigit() and _alive(int(name)) for name in os.listdir(registry))
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
