"""The floors run one way: every package imports only the packages below it.

The rules are `ALLOWED` (docs/ARCHITECTURE.md states the same, one line per package). Imports are
read with `ast` from every module, including imports inside functions, so a lazy import cannot
hide an upward edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"kareus": ROOT / "kareus", "kareus_operator": ROOT / "operator" / "kareus_operator",
           "kareus_node": ROOT / "node_daemon" / "kareus_node",
           "kareus_devcluster": ROOT / "devcluster" / "kareus_devcluster"}

BASE = {"kareus", "kareus.errors", "kareus.metric_names"}  # version, errors, metric names
CORE = BASE | {"kareus.search", "kareus.workload", "kareus.spec", "kareus.policy", "kareus.sim", "kareus.gpu",
               "kareus.job", "kareus.objective", "kareus.plan", "kareus.profiler", "kareus.optimizer",
               "kareus.report", "kareus.daemon_client", "kareus.runtime", "kareus.launcher", "kareus.incluster",
               "kareus.straggler", "kareus.power_budget", "kareus.compressed", "kareus.override_policy",
               "kareus.energy_ledger", "kareus.data"}

# unit → the units it may import (besides itself). A unit is `kareus.<top-level module or package>`,
# or one of the shells' packages.
ALLOWED: dict[str, set[str]] = {
    "kareus": set(),
    "kareus.errors": set(),
    "kareus.metric_names": set(),
    "kareus.launcher": {"kareus.errors"},
    "kareus.incluster": set(),
    "kareus.search": {"kareus.errors"},
    "kareus.workload": {"kareus.errors"},
    "kareus.objective": {"kareus.errors"},
    "kareus.compressed": {"kareus.errors"},
    "kareus.override_policy": {"kareus.errors"},
    "kareus.energy_ledger": {"kareus.errors"},
    "kareus.data": {"kareus.errors"},
    "kareus.spec": {"kareus.errors", "kareus.workload"},
    "kareus.policy": {"kareus.errors", "kareus.spec", "kareus.override_policy", "kareus.energy_ledger"},
    "kareus.sim": {"kareus.errors", "kareus.workload"},
    "kareus.gpu": {"kareus.errors", "kareus.sim"},
    "kareus.job": {"kareus.errors", "kareus.workload"},
    "kareus.plan": {"kareus.errors", "kareus.workload", "kareus.job", "kareus.objective", "kareus.compressed"},
    "kareus.profiler": BASE | {"kareus.workload", "kareus.spec", "kareus.sim", "kareus.gpu", "kareus.job",
                               "kareus.search", "kareus.daemon_client", "kareus.policy"},
    "kareus.optimizer": BASE | {"kareus.workload", "kareus.spec", "kareus.sim", "kareus.job", "kareus.objective",
                                "kareus.search", "kareus.plan", "kareus.profiler"},
    "kareus.report": BASE | {"kareus.plan", "kareus.job"},
    "kareus.straggler": BASE | {"kareus.objective", "kareus.plan", "kareus.sim", "kareus.job", "kareus.workload"},
    "kareus.power_budget": BASE | {"kareus.objective", "kareus.plan", "kareus.policy", "kareus.sim"},
    "kareus.daemon_client": BASE,
    "kareus.runtime": BASE | {"kareus.workload", "kareus.spec", "kareus.sim", "kareus.gpu", "kareus.job",
                              "kareus.objective", "kareus.plan", "kareus.daemon_client", "kareus.straggler",
                              "kareus.data"},
    # the shells
    "kareus.cli": CORE | {"kareus_operator", "kareus_devcluster"},
    "kareus.__main__": {"kareus.cli"},
    "kareus_operator": CORE - {"kareus.runtime"},
    # the dev cluster: its own protos (the kubelet's device-plugin API), none of the shells'
    "kareus_devcluster": CORE - {"kareus.runtime"},
    "kareus_node": BASE | {"kareus.gpu", "kareus.sim", "kareus.policy", "kareus.daemon_client", "kareus.launcher",
                           "kareus.incluster"},
}

# Libraries of the shells, never imported by the core.
SHELL_LIBRARIES = {"kopf", "kubernetes", "kmock", "aiohttp", "grpc"}


def unit_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "kareus":
        return parts[0]
    return ".".join(parts[:2])


def module_name(package: str, path: Path) -> str:
    rel = path.relative_to(SOURCES[package]).with_suffix("")
    parts = [package, *rel.parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str) -> set[str]:
    """Every absolute module name an import statement in `source` names (relative ones resolved)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.add(name)
            # `from kareus import plan` imports the module kareus.plan (`__version__` is no module)
            found.update(f"{name}.{alias.name}" for alias in node.names
                         if name == "kareus" and _is_kareus_module(alias.name))
    return found


def _is_kareus_module(name: str) -> bool:
    root = SOURCES["kareus"]
    return (root / f"{name}.py").exists() or (root / name / "__init__.py").exists()


def violations(module: str, source: str) -> list[str]:
    unit = unit_of(module)
    if unit not in ALLOWED:
        return [f"{module}: unit {unit} has no rule in ALLOWED"]
    wrong = []
    for name in sorted(imported_modules(source, module)):
        target = unit_of(name)
        if target in SOURCES or target in ALLOWED or name.startswith("kareus."):
            if target != unit and target not in ALLOWED[unit]:
                wrong.append(f"{module} imports {name} ({unit} may import {sorted(ALLOWED[unit]) or 'nothing of kareus'})")
        elif target in SHELL_LIBRARIES and unit in CORE:
            wrong.append(f"{module} imports {name}: the core ({unit}) never imports a shell library")
    return wrong


def all_modules() -> list[tuple[str, Path]]:
    return [(module_name(package, path), path) for package, root in SOURCES.items()
            for path in sorted(root.rglob("*.py")) if "_proto" not in path.parts]


def test_every_import_runs_down_the_floors() -> None:
    found = [line for module, path in all_modules() for line in violations(module, path.read_text())]
    assert found == []


def test_the_rules_cover_every_unit() -> None:
    units = {unit_of(module) for module, _ in all_modules()}
    assert units <= set(ALLOWED), sorted(units - set(ALLOWED))
    assert len(units) >= 20  # the walk found the packages, not an empty tree


@pytest.mark.parametrize(("module", "source", "expected"), [
    ("kareus.profiler.profile", "from kareus.optimizer.planning import optimize", "imports kareus.optimizer.planning"),
    ("kareus.plan", "def f():\n    from kareus.optimizer import objective\n", "imports kareus.optimizer"),
    ("kareus.search.problem", "from kareus.workload.partitions import PartitionType", "imports kareus.workload"),
    ("kareus.search.problem", "from ..profiler import key", "imports kareus.profiler"),
    ("kareus.sim.physics", "import kopf", "never imports a shell library"),
    ("kareus_operator.main", "from kareus.cli import dispatch", "imports kareus.cli"),
    ("kareus.profiler", "from kareus import optimizer", "imports kareus.optimizer"),
])
def test_an_upward_import_is_caught(module: str, source: str, expected: str) -> None:
    found = violations(module, source)
    assert len(found) == 1 and expected in found[0], found


def test_allowed_imports_pass() -> None:
    assert violations("kareus.optimizer.planning", "from kareus.profiler.document import ProfileDocument") == []
    assert violations("kareus.search.algorithms", "import numpy as np\nfrom kareus.errors import KareusError") == []
