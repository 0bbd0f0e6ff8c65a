"""A memory plan: each pipeline stage's peak memory on one GPU, before anything runs.

A rank holds its stage's share of the model (TP-sharded QKV/FC1/projection/FC2, replicated norms,
the embedding on the first stage and the final norm + output layer on the last, full-vocabulary
on every TP rank unless `vocab_parallel`), their gradients, the optimizer's state and fp32
master copies, the activations its backward will need and the communication buffers of its
groups. What is counted, per rank of stage s (`MemoryInputs` names each choice):

- **weights** at the parameter dtype (fp32 4 B, bf16 2 B); **master** fp32 copies in bf16 (4 B);
  **gradients** fp32 (4 B: fp32 `.grad`, or bf16's fp32 `main_grad`); **optimizer** AdamW's two
  fp32 moments (8 B; SGD without momentum keeps none). A distributed optimizer (ZeRO-1) keeps the
  masters and moments of 1 / (DP × CP) of them.
- **optimizer temporaries**: AdamW's step makes a denominator per tensor: with foreach (the GPU
  default) one fp32 copy of all parameters at once, without it (the CPU default) two of the largest.
- **activations**: the tensors our layer ops save for backward, counted op by op
  (`kareus.runtime.layer_ops`), per token of one microbatch and at the compute dtype:
  `6h + 4q + 4kv + 4f` per layer under autograd (sequential engine), `+2h` in the partitioned
  engine, whose op records also keep the projection and FC2 outputs (h hidden, q/kv the local
  query/key-value widths, f the local FFN width). 1F1B keeps `min(pp - s, microbatches)`
  microbatches in flight on stage s. `layer` checkpointing (what the runtime runs for
  `activationCheckpointing: true`) keeps every layer's input and recomputes one layer at a time;
  `stage` checkpointing (the runtime's former behaviour, still selectable in `TrainConfig`) keeps
  each in-flight microbatch's stage input and recomputes the whole stage for one microbatch.
- **logits**: the output layer's `[mbs, seq/cp, vocab(/tp)]` in fp32: the saved log-softmax of
  every in-flight microbatch, and in its backward the upstream and the softmax gradients beside it.
- **comm buffers**: the pipeline sends (a stage keeps every activation and gradient it sent until
  the iteration ends, `kareus.runtime.p2p`) and one 25 MiB gradient bucket when DP × CP > 1.
- **context**: CUDA context, cuBLAS workspace and NCCL communicators, a fixed allowance on a GPU.

Parts present at one moment are added; the peak is the largest of four moments: the end of the
forwards in flight, the loss backward (last stage), the end of a stage backward, the optimizer step.
The estimate is checked against measured peaks on CPU (`tests/test_memory_plan_measured.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from kareus.errors import EXIT_CONFIG, KareusError
from kareus.workload.models import ModelShape
from kareus.workload.partitions import split_layers

GIB = 2**30
BUCKET_BYTES = 25 * 2**20  # kareus.runtime.gradsync.BUCKET_BYTES (not imported: this module has no torch)
# CUDA context (~0.5 GiB on A100/H100), cuBLAS workspaces and NCCL's communicator buffers.
CUDA_CONTEXT_GIB = 1.0
PRECISIONS = {"fp32": 4, "bf16": 2}  # bytes per element of weights and activations
OPTIMIZERS = ("adamw", "sgd")
CHECKPOINTING = ("none", "stage", "layer")
ENGINES = ("partitioned", "sequential")
# Breakdown order of the one-line refusal.
PARTS = ("weights", "gradients", "optimizer", "master", "optimizer temporaries", "activations", "logits",
         "comm buffers", "context")


@dataclass(frozen=True)
class MemoryInputs:
    """Everything the plan depends on. `checkpointing`: none | stage (the whole stage recomputed) |
    layer (one layer at a time: what `activationCheckpointing: true` runs); `engine`: how forwards keep their
    activations (partitioned op records or sequential autograd)."""

    shape: ModelShape
    seq_len: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    num_microbatches: int = 1
    checkpointing: str = "stage"
    precision: str = "fp32"
    optimizer: str = "adamw"
    distributed_optimizer: bool = False
    vocab_parallel: bool = False
    engine: str = "partitioned"
    stage_layers: tuple[int, ...] | None = None
    foreach_optimizer: bool = True
    context_gib: float = CUDA_CONTEXT_GIB

    def __post_init__(self) -> None:
        for name, allowed in (("precision", tuple(PRECISIONS)), ("optimizer", OPTIMIZERS),
                              ("checkpointing", CHECKPOINTING), ("engine", ENGINES)):
            if getattr(self, name) not in allowed:
                raise KareusError(f"memory plan: {name} {getattr(self, name)!r} is not known; allowed: "
                                  f"{', '.join(allowed)}", exit_code=EXIT_CONFIG)
        for name in ("seq_len", "tp", "pp", "cp", "dp", "micro_batch_size", "num_microbatches"):
            if getattr(self, name) < 1:
                raise KareusError(f"memory plan: {name} must be >= 1, got {getattr(self, name)}",
                                  exit_code=EXIT_CONFIG)

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return self.stage_layers or split_layers(self.shape.num_layers, self.pp)


@dataclass(frozen=True)
class StageMemory:
    """One rank of one stage at its peak: bytes by part (`PARTS` order), and at which moment."""

    stage: int
    layers: int
    moment: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def breakdown(self) -> str:
        """`weights 3.8, optimizer 15.3, …` (GiB, one decimal, every nonzero part in `PARTS` order)."""
        return ", ".join(f"{name} {self.parts[name] / GIB:.1f}" for name in PARTS if self.parts.get(name, 0) > 0)


@dataclass(frozen=True)
class MemoryPlan:
    inputs: MemoryInputs
    stages: tuple[StageMemory, ...]

    @property
    def worst(self) -> StageMemory:
        """The stage whose rank needs the most (the first of equals)."""
        return max(self.stages, key=lambda s: (s.peak_bytes, -s.stage))

    def fits(self, gpu: Any) -> str | None:
        """None when every rank fits `gpu` (a `kareus.sim.gpus.GPUSpec`), else the one-line reason."""
        worst = self.worst
        if worst.peak_bytes <= gpu.memory_gib * GIB:
            return None
        return (f"stage {worst.stage} rank needs {worst.peak_gib:.1f} GiB on {gpu.name} "
                f"({worst.breakdown()}); the GPU has {gpu.memory_gib:.1f} GiB")

    def table(self) -> list[str]:
        return [f"stage {s.stage} ({s.layers} layers): peak {s.peak_gib:.1f} GiB at {s.moment} ({s.breakdown()})"
                for s in self.stages]


def memory_plan(source: Any, **overrides: Any) -> MemoryPlan:
    """The plan for a `MemoryInputs`, or for a `JobSpec`/`KareusJob` (`inputs_of_job`); `overrides`
    replace inputs (e.g. `vocab_parallel=True`)."""
    inputs = source if isinstance(source, MemoryInputs) else inputs_of_job(source)
    if overrides:
        inputs = replace(inputs, **overrides)
    stage_layers = inputs.layers_per_stage
    return MemoryPlan(inputs, tuple(_stage(inputs, s, n) for s, n in enumerate(stage_layers)))


def inputs_of_job(job: Any) -> MemoryInputs:
    """The plan's inputs for a job's *GPU* model (a CPU proxy does not change what the GPUs need).
    Precision and optimizer come from `spec.training` when the spec has them (fp32, AdamW otherwise)."""
    spec = getattr(job, "spec", job)
    par = spec.parallelism
    training = spec.training
    optimizer = getattr(getattr(training, "optimizer", None), "name", None) or "adamw"
    ckpt = par.activation_checkpointing
    checkpointing = {True: "layer", False: "none"}.get(ckpt, ckpt) if isinstance(ckpt, bool) else str(ckpt)
    # `selective` recomputes less than a layer: a layer's plan is the safe side of it.
    checkpointing = {"selective": "layer"}.get(checkpointing, checkpointing)
    return MemoryInputs(spec.model_shape(), spec.sequence_length, tp=par.tensor, pp=par.pipeline, cp=par.context,
                        dp=par.data, micro_batch_size=par.micro_batch_size, num_microbatches=par.num_micro_batches,
                        checkpointing=checkpointing, precision=getattr(training, "precision", None) or "fp32",
                        optimizer=optimizer,
                        engine="partitioned" if getattr(par, "nanobatching", True) else "sequential")


# ------------------------------------------------------------------------------------------ counting

def stage_param_counts(inputs: MemoryInputs, stage: int, layers: int) -> tuple[int, int]:
    """(elements this rank holds, elements of its largest tensor) for `stage` with `layers` layers."""
    shape, tp = inputs.shape, inputs.tp
    h, q, kv, f = shape.hidden_size, shape.q_size, shape.kv_size, shape.ffn_hidden_size
    sharded = {"qkv": (q + 2 * kv) * h // tp, "proj": h * q // tp, "fc1": 2 * f * h // tp, "fc2": h * f // tp}
    norms = 2 * h + (2 * shape.head_dim if shape.qk_norm else 0)
    per_layer = sum(sharded.values()) + norms
    table = shape.vocab_size * h // (tp if inputs.vocab_parallel else 1)
    first, last = stage == 0, stage == inputs.pp - 1
    count = layers * per_layer
    tables = 0
    if first or (last and shape.tied_embeddings):
        tables += 1  # the embedding (a tied model's last stage holds a copy of it)
    if last:
        count += h  # final norm
        if not shape.tied_embeddings:
            tables += 1
    largest = max([*sharded.values(), table] if tables else sharded.values())
    return count + tables * table, largest


def layer_activation_elements(inputs: MemoryInputs) -> int:
    """Elements one layer saves for backward per token (see the module docstring)."""
    shape, tp = inputs.shape, inputs.tp
    h, q, kv, f = shape.hidden_size, shape.q_size // tp, shape.kv_size // tp, shape.ffn_hidden_size // tp
    per_layer = 6 * h + 4 * q + 4 * kv + 4 * f
    if shape.qk_norm:
        per_layer += 2 * (q + kv)  # the q/k norms' saved inputs and normalised products
    if inputs.engine == "partitioned":
        per_layer += 2 * h
    return per_layer


def _stage(inputs: MemoryInputs, stage: int, layers: int) -> StageMemory:
    shape = inputs.shape
    act_b = PRECISIONS[inputs.precision]
    mixed = inputs.precision != "fp32"
    params, largest = stage_param_counts(inputs, stage, layers)
    shards = inputs.dp * inputs.cp if inputs.distributed_optimizer else 1
    first, last = stage == 0, stage == inputs.pp - 1
    h = shape.hidden_size

    weights = params * act_b
    master = math.ceil(params / shards) * 4 if mixed else 0
    optimizer = math.ceil(params / shards) * 8 if inputs.optimizer == "adamw" else 0
    grads = params * 4
    if inputs.optimizer != "adamw":
        step_temps = 0
    elif inputs.foreach_optimizer:
        step_temps = math.ceil(params / shards) * 4
    else:
        step_temps = 2 * largest * 4
    # bf16's fp32 main_grad buffers live for the whole run; fp32 grads are set to None every step.
    grads_persist = mixed

    tokens = inputs.micro_batch_size * inputs.seq_len // inputs.cp
    in_flight = min(inputs.pp - stage, inputs.num_microbatches)
    # A backward already ran when the last in-flight forward finishes (1F1B steady state).
    steady = inputs.num_microbatches > in_flight
    layer_acts = layer_activation_elements(inputs) * tokens * act_b
    boundary = h * tokens * act_b  # one stage input / output / received or sent tensor
    out_extra = (2 if inputs.engine == "partitioned" else 1) * boundary  # the stage output (+ nanobatch halves)
    head = 2 * boundary if last else 0  # the final norm's saved product and output
    if inputs.checkpointing == "none":
        per_mb_fwd = layers * layer_acts + out_extra + head
        recompute = 0
    elif inputs.checkpointing == "stage":
        per_mb_fwd = boundary + head
        recompute = layers * layer_acts + out_extra
    else:
        per_mb_fwd = layers * boundary + head
        recompute = layer_acts
    vocab = shape.vocab_size // (inputs.tp if inputs.vocab_parallel else 1)
    logits_one = tokens * vocab * 4 if last else 0
    head_grads = (shape.vocab_size * h // (inputs.tp if inputs.vocab_parallel else 1) + h) * 4 if last else 0
    # The loss backward: the saved log-softmax, its upstream gradient and the logits' gradient (and
    # in bf16 the logits gradient cast back for the output GEMM).
    logits_bwd = 3 * logits_one + (tokens * vocab * act_b if mixed and last else 0)

    sends = (0 if last else inputs.num_microbatches) + (0 if first else inputs.num_microbatches)
    p2p = sends * boundary if inputs.pp > 1 else 0
    bucket = BUCKET_BYTES if inputs.dp * inputs.cp > 1 else 0
    static = {"weights": weights, "optimizer": optimizer, "master": master,
              "context": int(inputs.context_gib * GIB)}

    grads_then = grads if (steady or grads_persist) else 0
    moments = {
        "forwards in flight": {"gradients": grads_then, "activations": in_flight * per_mb_fwd,
                               "logits": in_flight * logits_one, "comm buffers": p2p},
        "loss backward": {"gradients": grads_then or head_grads, "activations": in_flight * per_mb_fwd,
                          "logits": (in_flight - 1) * logits_one + logits_bwd, "comm buffers": p2p},
        "stage backward": {"gradients": grads, "activations": (in_flight - 1) * per_mb_fwd + recompute,
                           "logits": (in_flight - 1) * logits_one, "comm buffers": p2p},
        "optimizer step": {"gradients": grads, "optimizer temporaries": step_temps, "comm buffers": bucket},
    }
    if not last:
        del moments["loss backward"]
    # Checkpointing recomputes with the kept inputs still held (layer: all of them at the last
    # layer's recompute; each is dropped once its layer is done): that is the stage backward's start.
    if inputs.checkpointing != "none":
        held = boundary if inputs.checkpointing == "stage" else layers * boundary
        moments["stage backward"]["activations"] = (in_flight - 1) * per_mb_fwd + held + recompute
    name, parts = max(moments.items(), key=lambda item: sum(item[1].values()))
    merged = static | parts
    return StageMemory(stage, layers, name, {part: int(merged.get(part, 0)) for part in PARTS})

