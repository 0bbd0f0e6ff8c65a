"""What a job is, as the profiler, the planner and the plan format all describe it.

`JobDescriptor` is what a profile was measured for (every field goes into the profile key);
`PlanJob` is what a plan was made for (enough to rebuild the job's `Workload` and check the plan).
Both are read off a `KareusJob` or `JobSpec` here, so no layer reaches into another's modules for
them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from kareus.workload.models import ModelShape
from kareus.workload.partitions import Workload, build_workload, split_layers

LABEL_UNSAFE = re.compile(r"[^a-z0-9.-]+")  # what a label value or file name may not contain


@dataclass(frozen=True)
class JobDescriptor:
    """The job configuration a profile was measured for (all of it goes into the profile key)."""

    model: str
    tp: int
    cp: int
    pp: int
    dp: int
    seq_len: int
    micro_batch_size: int
    num_micro_batches: int
    activation_checkpointing: bool
    stage_layers: tuple[int, ...]

    @property
    def gpus_per_stage(self) -> int:
        return self.tp * self.cp * self.dp



@dataclass(frozen=True)
class PlanJob:
    """What the plan was made for: enough to rebuild the job's `Workload` and check the plan."""

    model: ModelShape
    gpu: str
    tensor: int
    context: int
    pipeline: int
    data: int
    micro_batch_size: int
    num_micro_batches: int
    sequence_length: int
    activation_checkpointing: bool
    stage_layers: tuple[int, ...]
    clocks_mhz: tuple[int, ...]
    p_static_w: float
    name: str = ""
    steps: int | None = None

    @property
    def gpus_per_stage(self) -> int:
        return self.tensor * self.context * self.data

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_stage * self.pipeline

    def workload(self) -> Workload:
        return _workload(self)

    def to_dict(self) -> dict:
        out = {
            "name": self.name,
            "model": self.model.to_dict(),
            "gpu": self.gpu,
            "tensor": self.tensor,
            "context": self.context,
            "pipeline": self.pipeline,
            "data": self.data,
            "micro_batch_size": self.micro_batch_size,
            "num_micro_batches": self.num_micro_batches,
            "sequence_length": self.sequence_length,
            "activation_checkpointing": self.activation_checkpointing,
            "stage_layers": list(self.stage_layers),
            "clocks_mhz": list(self.clocks_mhz),
            "p_static_w": self.p_static_w,
        }
        if self.steps is not None:
            out["steps"] = self.steps
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> PlanJob:
        return cls(
            model=ModelShape.from_dict(data["model"]),
            gpu=data["gpu"],
            tensor=data["tensor"],
            context=data["context"],
            pipeline=data["pipeline"],
            data=data["data"],
            micro_batch_size=data["micro_batch_size"],
            num_micro_batches=data["num_micro_batches"],
            sequence_length=data["sequence_length"],
            activation_checkpointing=data["activation_checkpointing"],
            stage_layers=tuple(data["stage_layers"]),
            clocks_mhz=tuple(data["clocks_mhz"]),
            p_static_w=float(data["p_static_w"]),
            name=data.get("name", ""),
            steps=data.get("steps"),
        )


@cache
def _workload(job: PlanJob) -> Workload:
    return build_workload(
        job.model, tp=job.tensor, cp=job.context, pp=job.pipeline, seq_len=job.sequence_length,
        micro_batch_size=job.micro_batch_size, activation_checkpointing=job.activation_checkpointing,
        stage_layers=job.stage_layers)


def job_spec_of(job: Any) -> Any:
    """The `JobSpec` of a `KareusJob`, or the `JobSpec` itself."""
    return getattr(job, "spec", job)


def describe_job(job: Any) -> JobDescriptor:
    """The `JobDescriptor` of a `KareusJob` or `JobSpec`."""
    spec = job_spec_of(job)
    par = spec.parallelism
    shape = spec.model_shape()
    return JobDescriptor(
        model=shape.name,
        tp=int(par.tensor),
        cp=int(par.context),
        pp=int(par.pipeline),
        dp=int(par.data),
        seq_len=int(spec.sequence_length),
        micro_batch_size=int(par.micro_batch_size),
        num_micro_batches=int(par.num_micro_batches),
        activation_checkpointing=bool(getattr(par, "activation_checkpointing", True)),
        stage_layers=tuple(split_layers(shape.num_layers, int(par.pipeline))),
    )


def gpu_label(product: str) -> str:
    """A GPU product name in label form: `NVIDIA-A100-SXM4-40GB` → `a100-sxm4-40gb`."""
    name = LABEL_UNSAFE.sub("-", product.lower()).strip("-.")
    return name.removeprefix("nvidia-")
