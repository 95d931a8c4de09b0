"""Imports go one way: a package imports only from the floors below it (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_dhp"

# Each floor may import from itself and from every floor above it in this list.
FLOORS = (
    ("errors", "config_io", "presets"),
    ("workload",),
    ("plan",),
    ("cost",),
    ("solver",),
    ("viz",),
    ("runtime",),
    ("testing",),
    ("integration",),
    ("training", "megatron"),
    ("cli", "__main__", "__init__"),
)
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}
PURE = ("workload", "plan", "cost", "solver")
"""Planning code: runs in a planner thread or a notebook, never touches process groups."""


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


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


def test_planning_code_imports_no_torch_distributed():
    offenders = [f"{path.relative_to(PACKAGE)} imports {name}" for top, path in _modules() if top in PURE
                 for name in _imports(path) if name.startswith(("torch.distributed", "megatron.core.parallel_state"))]
    assert offenders == []
