"""Bench scripts loaded as modules: they are scripts in `bench/`, not a package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str) -> ModuleType:
    """`bench/<name>.py` as a module, loaded once and kept in `sys.modules` (dataclasses look
    their module up there). The other MBO benches import `mbo_efficiency`, so it is loaded first."""
    if name != "mbo_efficiency":
        load("mbo_efficiency")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
