"""Profiling: measuring every partition type of a job and writing its profile document.

- `profile_job(job_spec, backend="sim"|"nvml"|"auto", preset="default"|"paper", ...)` runs the
  per-partition searches and the per-clock sweeps and returns a `ProfileDocument`;
- `document` defines the `ProfileDocument` the optimizer reads; `key` names a profile for reuse;
- `store` is the append-only measurement log that makes profiling resumable;
- `backends` (simulated GPU) and `nvml` (real GPUs) measure.
"""

from kareus.profiler.backends import ProfilerBackend, SimBackend
from kareus.profiler.document import (
    ClockCost,
    PartitionPoint,
    PartitionProfile,
    ProfileDocument,
    ProfileError,
    Provenance,
)
from kareus.profiler.key import profile_key
from kareus.profiler.profile import ProfileProgress, clock_grid, profile_job
from kareus.profiler.store import ProfileStore

__all__ = [
    "ClockCost",
    "PartitionPoint",
    "PartitionProfile",
    "ProfileDocument",
    "ProfileError",
    "ProfileProgress",
    "ProfileStore",
    "ProfilerBackend",
    "Provenance",
    "SimBackend",
    "clock_grid",
    "profile_job",
    "profile_key",
]
