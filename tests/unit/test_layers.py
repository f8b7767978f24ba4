"""The package's import arrows point one way: a module imports from its own layer or below, never above.

The layers, bottom to top (a top-level module or sub-package of ma_runtime names its layer):
  util, errors, process (and the package's own __init__)  what everything uses
  storage (and coordination) < sync < setting < launch < spec < supervise < stages
  the run itself: cli, commands, bootstrap, run_context, attempt, coordinator, together, verdict, ending, termination,
  __main__, local
Every import counts, the ones inside a function and under TYPE_CHECKING too: a lazy import still makes the
lower layer need the upper one. A new top-level module or sub-package must be given a layer here.
"""

import ast
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest

import ma_runtime

PACKAGE = Path(ma_runtime.__file__).resolve().parent
LAYERS = (
    ("util", "errors", "process", ""),  # "": the package itself (`import ma_runtime`, its __version__)
    ("storage", "coordination"),
    ("sync",),
    ("setting",),
    ("launch",),
    ("spec",),
    ("supervise",),
    ("stages",),
    ("cli", "commands", "bootstrap", "run_context", "attempt", "coordinator", "together", "verdict", "ending",
     "termination", "__main__", "local", "manifest"),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def top_name(module: str) -> str:
    """The top-level module or sub-package of ma_runtime that `module` is in ("" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(module: str) -> Optional[int]:
    return RANK.get(top_name(module))


def modules() -> Iterator[Tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("ma_runtime", *path.relative_to(PACKAGE).with_suffix("").parts)
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative / "__init__.py").is_file()


def imported(module: str, tree: ast.AST, is_package: bool) -> Iterator[Tuple[int, str]]:
    """(line, module) for each ma_runtime module the source imports."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "ma_runtime")
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node, is_package)
            if base.split(".")[0] != "ma_runtime":
                continue
            for alias in node.names:
                # `from ma_runtime import errors` imports the module errors; `from x import name` the module x.
                full = f"{base}.{alias.name}"
                yield node.lineno, full if is_module(full) else base


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    package = package if is_package else package[:-1]
    package = package[: len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def upward(module: str, source: str, filename: str, is_package: bool = False) -> List[str]:
    """Each import of `source` (module `module`) that points to a layer above the module's own."""
    own = layer_of(module)
    found = []
    for line, target in sorted(set(imported(module, ast.parse(source, filename), is_package))):
        if layer_of(target) is not None and own is not None and layer_of(target) > own:
            found.append(f"{filename}:{line}: {module} ({top_name(module)}) imports {target} "
                         f"({top_name(target)}, a layer above)")
    return found


def test_every_module_has_a_layer():
    unplaced = sorted({top_name(module) for module, _ in modules() if layer_of(module) is None})
    assert not unplaced, f"give these a layer in LAYERS (tests/unit/test_layers.py): {unplaced}"


def test_no_import_points_up():
    found = []
    for module, path in modules():
        found += upward(module, path.read_text(), str(path.relative_to(PACKAGE.parent)), path.name == "__init__.py")
    assert not found, "imports that point up a layer (move the thing to the layer where it belongs):\n" + \
        "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("from ma_runtime.stages.preflight import accelerator", "ma_runtime.stages.preflight.accelerator"),
    ("from ma_runtime.stages.preflight.accelerator import choose", "ma_runtime.stages.preflight.accelerator"),
    ("import ma_runtime.supervise.guard", "ma_runtime.supervise.guard"),
    ("def later():\n    from ma_runtime import verdict", "ma_runtime.verdict"),  # a lazy import counts
    ("from ..supervise.pid1 import reap", "ma_runtime.supervise.pid1"),  # relative
])
def test_an_import_above_is_named(source, expected):
    (found,) = upward("ma_runtime.launch.plan", source, "plan.py")
    assert f"imports {expected} " in found


@pytest.mark.parametrize("source", [
    "from ma_runtime.process import lifecycle",
    "from ma_runtime import errors",
    "import ma_runtime",
    "from ma_runtime.launch import registry",
    "from ma_runtime.storage.url import Url",
    "from . import base",
    "import os",
])
def test_an_import_of_the_same_layer_or_below_passes(source):
    assert upward("ma_runtime.launch.plan", source, "plan.py") == []
