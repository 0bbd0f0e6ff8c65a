"""Profiling: measuring every partition type of a job and writing its profile document.

`document` defines the `ProfileDocument` the optimizer reads; `key` names a profile for reuse.
"""

from kareus.profiler.document import (
    ClockCost,
    JobDescriptor,
    PartitionPoint,
    PartitionProfile,
    ProfileDocument,
    ProfileError,
    Provenance,
)
from kareus.profiler.key import describe_job, profile_key

__all__ = [
    "ClockCost",
    "JobDescriptor",
    "PartitionPoint",
    "PartitionProfile",
    "ProfileDocument",
    "ProfileError",
    "Provenance",
    "describe_job",
    "profile_key",
]
