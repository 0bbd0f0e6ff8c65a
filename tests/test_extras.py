"""What each pyproject extra installs is what its image's code needs, and no more.

- `operator` (images/operator.Dockerfile) carries no Helm SDK: the chart is rendered by the dev
  cluster and the tests (`dev`), never by the operator, and no module of `kareus_operator` (or of
  `kareus_node`, or the core) imports `helm_python`.
- `train`'s torch floor is what the runtime calls: `dist.new_group(..., device_id=)` arrived in
  torch 2.6, and every message that names a torch minimum says the same.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
TORCH_FLOOR = (2, 6)


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    return roots


def test_the_helm_sdk_is_a_dev_dependency_only():
    assert "helm-python-sdk" not in names(EXTRAS["operator"])
    assert "helm-python-sdk" in names(EXTRAS["dev"])
    shipped = [*(ROOT / "operator" / "kareus_operator").rglob("*.py"), *(ROOT / "node_daemon" / "kareus_node").rglob("*.py"),
               *(ROOT / "kareus").rglob("*.py")]
    assert shipped
    importers = [str(p.relative_to(ROOT)) for p in shipped if "helm_python" in imported_roots(p)]
    assert importers == []


def test_the_torch_floor_is_what_the_runtime_needs():
    [torch] = [r for r in EXTRAS["train"] if names([r]) == {"torch"}]
    assert torch == "torch>={}.{}".format(*TORCH_FLOOR)
    # Every stated torch minimum in the code and the docs agrees with the extra.
    stated = re.compile(r"torch\s*(?:>=|≥)\s*(\d+)\.(\d+)")
    files = [*(ROOT / "kareus").rglob("*.py"), *(ROOT / "operator").rglob("*.py"), *(ROOT / "docs").glob("*.md"),
             ROOT / "README.md", *(ROOT / "images").glob("*.Dockerfile")]
    found = {(str(p.relative_to(ROOT)), (int(m[0]), int(m[1]))) for p in files for m in stated.findall(p.read_text())}
    assert found and {floor for _, floor in found} == {TORCH_FLOOR}, found
