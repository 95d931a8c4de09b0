"""Imports go one way: a package imports only from the floors below it, and the runtime never imports cost or solver
(docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_dhp"

# Each floor may import from itself and from every floor above it in this list.
FLOORS = (
    ("errors", "files", "config_io", "presets"),
    ("workload",),
    ("plan",),
    ("cost",),
    ("solver",),
    ("viz",),
    ("runtime",),
    ("closed_loop",),
    ("launch",),
    ("models",),
    ("integration",),
    ("verify",),
    ("training", "megatron"),
    ("bridge",),
    ("cli", "__main__", "__init__"),
    ("testing",),
)
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}
PURE = ("workload", "plan", "cost", "solver", "closed_loop.speed_estimator", "closed_loop.scale_fit", "closed_loop.loop")
"""Planning code: runs in a planner thread or a notebook, never touches process groups (a package, or a module of
one whose other modules do: the closed loop estimates and decides in numbers, only its measuring times slots)."""

NEVER = {"runtime": ("cost", "solver")}
"""Floors below a package that it still must not import: the runtime receives a plan (or a function that makes
one) and never prices or solves one itself. (`testing` is the top floor: no module of the package imports it.)"""


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names  # `from megatron_dhp import cost`
                      if _is_module(f"{node.module}.{alias.name}")]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def _is_module(name: str) -> bool:
    """Whether `name` is a module or package of this project (not a name defined in one)."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def _package(name: str) -> str | None:
    """The sub-package of `megatron_dhp` an imported name lies in (None outside the project)."""
    parts = name.split(".")
    return parts[1] if parts[0] == "megatron_dhp" and len(parts) > 1 else None


def _modules() -> list[tuple[str, Path]]:
    return [(p.relative_to(PACKAGE).parts[0].removesuffix(".py"), p) for p in sorted(PACKAGE.rglob("*.py"))]


def test_every_package_sits_on_a_floor():
    assert {top for top, _ in _modules()} <= set(FLOOR)


def test_no_import_goes_up_a_floor():
    upward = []
    for top, path in _modules():
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "megatron_dhp" and len(parts) > 1 and FLOOR[parts[1]] > FLOOR[top]:
                upward.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert upward == []


def _dotted(path: Path) -> str:
    """A module's name below `megatron_dhp` (`closed_loop.loop`)."""
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def test_planning_code_imports_no_torch_distributed():
    offenders = [f"{path.relative_to(PACKAGE)} imports {name}" for top, path in _modules()
                 if top in PURE or _dotted(path) in PURE
                 for name in _imports(path) if name.startswith(("torch.distributed", "megatron.core.parallel_state"))]
    assert offenders == []


def test_every_pure_module_exists():
    assert [name for name in PURE if not _is_module(f"megatron_dhp.{name}")] == []


def test_runtime_imports_no_cost_model_or_planner():
    offenders = [f"{path.relative_to(PACKAGE)} imports {name}" for top, path in _modules() if top in NEVER
                 for name in _imports(path) if _package(name) in NEVER[top]]
    assert offenders == []
