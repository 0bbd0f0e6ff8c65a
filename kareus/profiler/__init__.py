"""Profiling: measuring every partition type of a job and writing its profile document.

- `profile_job(job_spec, backend="sim"|"nvml"|"auto", preset="default"|"paper", ...)` runs the
  per-partition searches and the per-clock sweeps and returns a `ProfileDocument`;
- `document` defines the `ProfileDocument` the optimizer reads; `key` names a profile for reuse;
- `store` is the append-only measurement log that makes profiling resumable;
- `backends` (simulated GPU) and `nvml` (real GPUs) measure; `kernels` are the emulated GPU ops.

The names below are imported on first use (PEP 562), so `kareus.profiler.kernels` on a bare GPU
machine does not pull the search stack (pymoo, xgboost) in through this package.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ProfilerBackend": "backends", "SimBackend": "backends",
    "ClockCost": "document", "PartitionPoint": "document", "PartitionProfile": "document",
    "ProfileDocument": "document", "ProfileError": "document", "Provenance": "document",
    "profile_key": "key",
    "ProfileProgress": "profile", "clock_grid": "profile", "profile_job": "profile",
    "ProfileStore": "store",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'kareus.profiler' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kareus.profiler.{_WHERE[name]}"), name)
    globals()[name] = value  # the next lookup does not come here
    return value
