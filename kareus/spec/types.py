"""The KareusJob specification as typed values (DESIGN.md §4).

A `KareusJob` is a manifest's metadata plus a `JobSpec`: which model (a preset or an explicit
Llama-style shape), how it is split over GPUs (tensor × context × pipeline × data parallel, with
microbatches split into two nanobatches), what to optimise for (exactly one objective: maximum
throughput, a time budget or an energy budget), how the training pods run, how profiling measures,
and the Kubernetes job conventions (suspend, managedBy, deadlines, TTL, backoff).

Values are frozen dataclasses; `to_dict()` gives back the camelCase manifest form with every
default filled in, and parsing that form yields an equal object (round trip). Parsing and
validation live in `kareus.spec.parse`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, ClassVar

from kareus.spec.overrides import PodOverride
from kareus.workload.models import ModelShape, RopeScaling, get_preset

DEFAULT_GPU_PRODUCT = "A100-SXM4-40GB"
DEFAULT_MANAGED_BY = "kareus.dev/operator"

# Explicit shape fields: (manifest name, ModelShape attribute).
SHAPE_FIELDS: tuple[tuple[str, str], ...] = (
    ("layers", "num_layers"),
    ("hidden", "hidden_size"),
    ("ffnHidden", "ffn_hidden_size"),
    ("heads", "num_heads"),
    ("kvHeads", "num_kv_heads"),
    ("headDim", "head_dim"),
    ("vocab", "vocab_size"),
    ("qkNorm", "qk_norm"),
    ("tiedEmbeddings", "tied_embeddings"),
    ("ropeTheta", "rope_theta"),
    ("normEps", "norm_eps"),
    ("ropeScaling", "rope_scaling"),
)
# `ropeScaling`'s manifest fields: (name, RopeScaling attribute, default; None: required).
ROPE_SCALING_FIELDS: tuple[tuple[str, str, Any], ...] = (
    ("type", "type", None),
    ("factor", "factor", None),
    ("lowFreqFactor", "low_freq_factor", 1.0),
    ("highFreqFactor", "high_freq_factor", 4.0),
    ("originalMaxPositionEmbeddings", "original_max_position_embeddings", 8192),
)
# What an explicit shape must give when there is no preset to start from.
EXPLICIT_REQUIRED = ("layers", "hidden", "ffnHidden", "heads", "kvHeads", "vocab")
# A CPU proxy's dimensions: the sizes only. Its structure (q/k norms, tied embeddings, RoPE base)
# is the model's, so its partitions have the same operators and launch slots as the plan's.
PROXY_FIELDS = ("layers", "hidden", "ffnHidden", "heads", "kvHeads", "headDim", "vocab")


def _drop_none(mapping: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in mapping.items() if value is not None}


def _items(mapping: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A hashable view of a mapping field, so values with dict fields stay hashable."""
    return tuple(sorted(mapping.items()))


def _with_head_dim(values: dict[str, Any]) -> dict[str, Any]:
    """Manifest dimensions with `headDim` defaulting to hidden / heads."""
    return {"headDim": values["hidden"] // values["heads"]} | dict(values)


def rope_scaling_of(values: dict[str, Any]) -> RopeScaling:
    """A manifest's `ropeScaling` object as a `RopeScaling` (defaults filled in)."""
    return RopeScaling(**{attr: values.get(key, default) for key, attr, default in ROPE_SCALING_FIELDS})


def rope_scaling_manifest(scaling: RopeScaling) -> dict[str, Any]:
    """The manifest form of `scaling`, every field given."""
    return {key: getattr(scaling, attr) for key, attr, _ in ROPE_SCALING_FIELDS}


def _reshaped(base: ModelShape, name: str, values: dict[str, Any]) -> ModelShape:
    """`base` with the manifest-named dimensions in `values` replaced."""
    attrs = dict(SHAPE_FIELDS)
    values = dict(values)
    if "ropeScaling" in values:
        values["ropeScaling"] = rope_scaling_of(values["ropeScaling"])
    return replace(base, name=name, **{attrs[key]: value for key, value in values.items()})


@dataclass(frozen=True)
class PretrainedSpec:
    """Published weights to start from: the Hugging Face model directory (config.json + safetensors)
    or Kareus checkpoint at `path`, relative to the PersistentVolumeClaim `claim_name`. The operator
    mounts that claim read-only into the training pods and passes `--init-from`; a run resumed from
    its own checkpoint ignores it (the checkpoint wins)."""

    claim_name: str
    path: str

    def to_dict(self) -> dict[str, Any]:
        return {"claimName": self.claim_name, "path": self.path}


@dataclass(frozen=True)
class ModelSpec:
    """A preset name, an explicit shape, or a preset with some dimensions overridden.

    `overrides` maps manifest field names (`layers`, `hidden`, …) to values; with a preset they
    replace the preset's dimensions, without one they are the whole shape (`headDim` defaults to
    hidden / heads, `qkNorm` and `tiedEmbeddings` to false, `ropeTheta` to 500000, `normEps` to
    1e-5, no `ropeScaling`). `ropeScaling` is an object (its manifest form, every field given).
    """

    preset: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    pretrained: PretrainedSpec | None = None  # the starting weights; not part of the shape

    def __hash__(self) -> int:
        return hash((self.preset, _items({k: _items(v) if isinstance(v, dict) else v
                                          for k, v in self.overrides.items()}), self.pretrained))

    def shape(self) -> ModelShape:
        values = dict(self.overrides)
        if self.preset is not None:
            base = get_preset(self.preset)
            name = self.preset if not values else f"{self.preset}-custom"
        else:
            base = ModelShape("custom", 1, 1, 1, 1, 1, 1, 1)
            name = "custom"
            values = _with_head_dim(values)
        return _reshaped(base, name, values)

    def to_dict(self) -> dict[str, Any]:
        pretrained = None if self.pretrained is None else self.pretrained.to_dict()
        return _drop_none({"preset": self.preset}) | dict(self.overrides) | _drop_none({"pretrained": pretrained})


@dataclass(frozen=True)
class ParallelismSpec:
    """How the model is split: degrees of each parallelism and the pipeline's microbatches."""

    tensor: int
    pipeline: int
    context: int
    data: int
    micro_batch_size: int
    num_micro_batches: int
    activation_checkpointing: bool = True
    nanobatching: bool = True

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.context * self.data

    @property
    def global_batch_size(self) -> int:
        """Sequences per iteration over all data-parallel replicas."""
        return self.micro_batch_size * self.num_micro_batches * self.data

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor, "pipeline": self.pipeline, "context": self.context, "data": self.data,
            "microBatchSize": self.micro_batch_size, "numMicroBatches": self.num_micro_batches,
            "activationCheckpointing": self.activation_checkpointing, "nanobatching": self.nanobatching,
        }


@dataclass(frozen=True)
class MaxThroughput:
    """Run at the fastest point of the iteration frontier."""

    kind: ClassVar[str] = "maxThroughput"

    def to_dict(self) -> dict[str, Any]:
        return {self.kind: {}}


@dataclass(frozen=True)
class TimeBudget:
    """The least-energy plan within a time budget; exactly one of the three forms is set.

    `max_slowdown_percent`: iteration time at most this much above the fastest plan's;
    `iteration_seconds`: an absolute per-iteration time; `deadline`: finish all steps by then.
    """

    kind: ClassVar[str] = "timeBudget"
    max_slowdown_percent: float | None = None
    iteration_seconds: float | None = None
    deadline: datetime | None = None

    def to_dict(self) -> dict[str, Any]:
        deadline = self.deadline.isoformat().replace("+00:00", "Z") if self.deadline else None
        return {self.kind: _drop_none({"maxSlowdownPercent": self.max_slowdown_percent,
                                       "iterationSeconds": self.iteration_seconds, "deadline": deadline})}


@dataclass(frozen=True)
class EnergyBudget:
    """The fastest plan within an energy budget; exactly one of the two forms is set.

    `per_iteration_joules`: all GPUs together per iteration; `total_kilowatt_hours`: the whole run.
    """

    kind: ClassVar[str] = "energyBudget"
    per_iteration_joules: float | None = None
    total_kilowatt_hours: float | None = None

    @property
    def total_joules(self) -> float | None:
        return None if self.total_kilowatt_hours is None else self.total_kilowatt_hours * 3.6e6

    def to_dict(self) -> dict[str, Any]:
        return {self.kind: _drop_none({"perIterationJoules": self.per_iteration_joules,
                                       "totalKilowattHours": self.total_kilowatt_hours})}


Objective = MaxThroughput | TimeBudget | EnergyBudget


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: str


@dataclass(frozen=True)
class ResourcesSpec:
    """Container resources per training pod, Kubernetes quantities as strings (`"8"`, `"64Gi"`)."""

    requests: dict[str, str] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash((_items(self.requests), _items(self.limits)))

    def to_dict(self) -> dict[str, Any]:
        return {key: dict(value) for key, value in (("requests", self.requests), ("limits", self.limits))
                if value}


@dataclass(frozen=True)
class CpuProxySpec:
    """A narrow stand-in the runtime trains when it runs on CPU (no GPU visible).

    Profiling, the plan and every time and energy number stay those of the job's model on its
    simulated GPU; the proxy only makes the real runtime (processes, collectives, the plan's
    schedule, clock requests) run in seconds. `dims` maps `PROXY_FIELDS` names to values (all but
    `headDim` required; it defaults to hidden / heads); `sequence_length` defaults to the job's.
    On a GPU the proxy is ignored: the job's model trains.
    """

    dims: dict[str, int] = field(default_factory=dict)
    sequence_length: int | None = None

    def __hash__(self) -> int:
        return hash((_items(self.dims), self.sequence_length))

    def shape(self, model: ModelShape) -> ModelShape:
        return _reshaped(model, f"{model.name}-cpu-proxy", _with_head_dim(self.dims))

    def to_dict(self) -> dict[str, Any]:
        return dict(self.dims) | _drop_none({"sequenceLength": self.sequence_length})


@dataclass(frozen=True)
class CheckpointSpec:
    """Checkpoints of the training run: every `every_steps` steps, the last `keep` of them kept (the
    runtime's default when None), on the PersistentVolumeClaim `claim_name`, which the operator
    mounts into the training pods. Without a claim nothing outlives a pod, so no checkpoint is kept."""

    every_steps: int
    keep: int | None = None
    claim_name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return _drop_none({"everySteps": self.every_steps, "keep": self.keep, "claimName": self.claim_name})


@dataclass(frozen=True)
class DataSpec:
    """The token corpus: `path` in `format` (`npy`, `bin`: a flat uint16/uint32 token file, or
    `megatron`: Megatron-LM's indexed dataset, `path` its prefix of `.bin` + `.idx`). With
    `claim_name` the path is relative to that PersistentVolumeClaim (mounted read-only into the
    training pods); without it the path is absolute in the training image."""

    path: str
    format: str
    claim_name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return _drop_none({"path": self.path, "format": self.format, "claimName": self.claim_name})


@dataclass(frozen=True)
class ExportSpec:
    """Export the trained model as a Hugging Face directory after the final step: rank 0's training
    pod writes it next to the checkpoints, `<checkpoint claim>/<job uid>/export/`, and the operator
    names it in `status.export.path`. No options yet; the object leaves room for them."""

    def to_dict(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class OptimizerSpec:
    """`spec.training.optimizer`: the optimizer recipe; None fields take the runtime's defaults
    (`kareus.runtime.optimizer_recipe`: AdamW, cosine to lr/10 after warmup, weight decay 0.1,
    clipping at 1.0). Field names are the recipe's."""

    name: str | None = None
    lr: float | None = None
    min_lr: float | None = None
    warmup_steps: int | None = None
    schedule_kind: str | None = None
    decay_steps: int | None = None
    wsd_decay_fraction: float | None = None
    weight_decay: float | None = None
    decay_embeddings: bool | None = None
    beta1: float | None = None
    beta2: float | None = None
    eps: float | None = None
    clip_grad_norm: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return _drop_none({manifest: getattr(self, attr) for manifest, attr in OPTIMIZER_FIELDS})


# `spec.training.optimizer` fields: (manifest name, OptimizerSpec attribute).
OPTIMIZER_FIELDS: tuple[tuple[str, str], ...] = (
    ("name", "name"), ("lr", "lr"), ("minLr", "min_lr"), ("warmupSteps", "warmup_steps"),
    ("schedule", "schedule_kind"), ("decaySteps", "decay_steps"), ("wsdDecayFraction", "wsd_decay_fraction"),
    ("weightDecay", "weight_decay"), ("decayEmbeddings", "decay_embeddings"), ("beta1", "beta1"),
    ("beta2", "beta2"), ("eps", "eps"), ("clipGradNorm", "clip_grad_norm"),
)


@dataclass(frozen=True)
class TrainingSpec:
    """The training pods: one per node, each with `gpus_per_node` GPUs, running `steps` iterations."""

    image: str
    steps: int
    gpus_per_node: int
    nodes: int
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: tuple[EnvVar, ...] = ()
    resources: ResourcesSpec | None = None
    cpu_proxy: CpuProxySpec | None = None
    checkpoint: CheckpointSpec | None = None
    data: DataSpec | None = None
    export: ExportSpec | None = None
    optimizer: OptimizerSpec | None = None
    precision: str | None = None  # fp32 | bf16 (bf16 compute, fp32 master weights); None: fp32
    tf32: bool | None = None  # TF32 for fp32 matmuls on GPU; None: on

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"image": self.image}
        if self.command:
            out["command"] = list(self.command)
        if self.args:
            out["args"] = list(self.args)
        out |= {"steps": self.steps, "gpusPerNode": self.gpus_per_node, "nodes": self.nodes}
        if self.env:
            out["env"] = [{"name": var.name, "value": var.value} for var in self.env]
        if self.resources is not None:
            out["resources"] = self.resources.to_dict()
        if self.cpu_proxy is not None:
            out["cpuProxy"] = self.cpu_proxy.to_dict()
        if self.checkpoint is not None:
            out["checkpoint"] = self.checkpoint.to_dict()
        if self.data is not None:
            out["data"] = self.data.to_dict()
        if self.export is not None:
            out["export"] = self.export.to_dict()
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer.to_dict()
        if self.precision is not None:
            out["precision"] = self.precision
        if self.tf32 is not None:
            out["tf32"] = self.tf32
        return out


@dataclass(frozen=True)
class ProfilingSpec:
    """How partitions are measured: cache reuse, measurement window, search preset, GPU backend."""

    reuse: bool = True
    measurement_seconds: float = 5.0
    cooldown_seconds: float = 5.0
    preset: str = "default"
    backend: str = "auto"

    def to_dict(self) -> dict[str, Any]:
        return {"reuse": self.reuse, "measurementSeconds": self.measurement_seconds,
                "cooldownSeconds": self.cooldown_seconds, "preset": self.preset, "backend": self.backend}


@dataclass(frozen=True)
class JobSpec:
    """Everything a KareusJob asks for; see the module docstring and docs/kareusjob.md."""

    model: ModelSpec
    sequence_length: int
    parallelism: ParallelismSpec
    objective: Objective
    training: TrainingSpec
    profiling: ProfilingSpec = ProfilingSpec()
    # The product to plan for; a node selector only when the manifest names it (`gpu_pinned`).
    gpu_product: str = DEFAULT_GPU_PRODUCT
    gpu_pinned: bool = False
    pod_overrides: tuple[PodOverride, ...] = ()
    suspend: bool = False
    managed_by: str | None = None
    active_deadline_seconds: int | None = None
    ttl_seconds_after_finished: int | None = None
    backoff_limit: int = 3

    @property
    def num_gpus(self) -> int:
        return self.training.nodes * self.training.gpus_per_node

    @property
    def managed_by_kareus(self) -> bool:
        """Whether the Kareus operator reconciles this job (an external controller may own it)."""
        return self.managed_by in (None, DEFAULT_MANAGED_BY)

    def model_shape(self) -> ModelShape:
        return self.model.shape()

    def cpu_proxy_shape(self) -> ModelShape | None:
        proxy = self.training.cpu_proxy
        return None if proxy is None else proxy.shape(self.model_shape())

    @property
    def cpu_proxy_sequence_length(self) -> int:
        proxy = self.training.cpu_proxy
        return self.sequence_length if proxy is None or proxy.sequence_length is None else proxy.sequence_length

    def to_dict(self) -> dict[str, Any]:
        return _drop_none({
            "model": self.model.to_dict(),
            "sequenceLength": self.sequence_length,
            "parallelism": self.parallelism.to_dict(),
            "objective": self.objective.to_dict(),
            "training": self.training.to_dict(),
            "profiling": self.profiling.to_dict(),
            "gpu": {"product": self.gpu_product} if self.gpu_pinned else {},
            "podTemplateOverrides": [o.to_dict() for o in self.pod_overrides] or None,
            "suspend": self.suspend,
            "managedBy": self.managed_by,
            "activeDeadlineSeconds": self.active_deadline_seconds,
            "ttlSecondsAfterFinished": self.ttl_seconds_after_finished,
            "backoffLimit": self.backoff_limit,
        })


@dataclass(frozen=True)
class KareusJob:
    """A KareusJob manifest: identity (name, namespace, labels, annotations) and its `spec`."""

    API_VERSION: ClassVar[str] = "kareus.dev/v1alpha1"
    KIND: ClassVar[str] = "KareusJob"

    name: str
    spec: JobSpec
    namespace: str = "default"
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash((self.name, self.namespace, _items(self.labels), _items(self.annotations), self.spec))

    def to_dict(self) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if self.labels:
            metadata["labels"] = dict(self.labels)
        if self.annotations:
            metadata["annotations"] = dict(self.annotations)
        return {"apiVersion": self.API_VERSION, "kind": self.KIND, "metadata": metadata,
                "spec": self.spec.to_dict()}
