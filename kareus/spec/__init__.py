"""The KareusJob specification: typed values (`types`), manifest parsing and validation (`parse`).

`load_job(path)` / `parse_job(manifest)` return a `KareusJob` or raise `SpecError` listing every
problem as `FieldError(path, message)`, e.g. `spec.parallelism.tensor: must be an integer in [1,
4096], got 0`. The CRD (`crds/kareusjob.yaml`) validates the same rules on the API server.
"""

from kareus.spec.fields import FieldError, SpecError
from kareus.spec.parse import (
    cross_field_errors,
    immutable_changes,
    load_job,
    parse_job,
    parse_spec,
    validation_errors,
)
from kareus.spec.types import (
    DEFAULT_GPU_PRODUCT,
    DEFAULT_MANAGED_BY,
    CheckpointSpec,
    CpuProxySpec,
    DataSpec,
    EnergyBudget,
    EnvVar,
    ExportSpec,
    JobSpec,
    KareusJob,
    MaxThroughput,
    ModelSpec,
    Objective,
    OptimizerSpec,
    ParallelismSpec,
    PretrainedSpec,
    ProfilingSpec,
    ResourcesSpec,
    TimeBudget,
    TrainingSpec,
)

__all__ = [
    "DEFAULT_GPU_PRODUCT",
    "DEFAULT_MANAGED_BY",
    "CheckpointSpec",
    "CpuProxySpec",
    "DataSpec",
    "EnergyBudget",
    "EnvVar",
    "ExportSpec",
    "FieldError",
    "JobSpec",
    "KareusJob",
    "MaxThroughput",
    "ModelSpec",
    "Objective",
    "OptimizerSpec",
    "ParallelismSpec",
    "PretrainedSpec",
    "ProfilingSpec",
    "ResourcesSpec",
    "SpecError",
    "TimeBudget",
    "TrainingSpec",
    "cross_field_errors",
    "immutable_changes",
    "load_job",
    "parse_job",
    "parse_spec",
    "validation_errors",
]
