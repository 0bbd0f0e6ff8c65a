"""Partitions: the unit Kareus optimises, and the per-stage workload built from them.

Each microbatch is split into two equal nanobatches. A layer's op sequence is cut at its
communication kernels; a **partition** is one (possibly fused) collective of one nanobatch plus
the contiguous run of computation kernels of the other nanobatch that does not depend on it
(DESIGN.md §2.2, METHOD_NOTES Part B §1.2). Every cut segment yields two partitions (one per
nanobatch orientation), so each partition type appears twice per layer (the CP+TP attention types
once per orientation, i.e. once each per layer). All instances of a type share one
`PartitionConfig`: the **launch slot** (the compute op alongside which the collective starts) and
the **comm SMs** (thread blocks of the collective).

Launch slots name op groups, not indices: consecutive memory-bound ops of the same group
(norm/BDA/fork, QKV-post/RoPE, activation) merge into one slot; every linear and attention op is
its own slot; slots are numbered per group (`norm_0`, `linear_0`, `rope_0`, `attn_0`, `linear_1`).

The partition table below is the one declarative description of the search space: which compute
ops, which collective, which launch slots (the artifact's, METHOD_NOTES §5.2) and the MBO size
class of every type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kareus.errors import KareusError
from kareus.workload.models import ModelShape
from kareus.workload.ops import (
    CommOp,
    ComputeOp,
    LayerDims,
    Op,
    backward_of,
    layer_comms,
    layer_forward_compute,
    layer_sequential_backward,
    layer_sequential_forward,
    nonpartition_backward,
    nonpartition_forward,
)

MERGING_GROUPS = frozenset({"norm", "rope", "activation"})
SIZE_CLASSES = ("small", "medium", "large")

# Compute op runs of the partition segments, named by their forward ops.
_ATTN_RUN = ("bda_mlp", "fork_attn", "norm_attn", "qkv", "qkv_post", "rope", "attention", "proj")
_MLP_RUN = ("bda_attn", "fork_mlp", "norm_mlp", "fc1", "swiglu", "fc2")
_QKV_RUN = ("bda_mlp", "fork_attn", "norm_attn", "qkv", "qkv_post", "rope")
_AO_RUN = ("attention", "proj")
# Backward runs in execution order (reverse of forward), named by the forward op they differentiate.
_BWD_MLP_RUN = ("norm_attn", "fork_attn", "bda_mlp", "fc2", "swiglu", "fc1")
_BWD_ATTN_RUN = ("norm_mlp", "fork_mlp", "bda_attn", "proj", "attention", "rope", "qkv_post", "qkv")
_BWD_O_RUN = ("norm_mlp", "fork_mlp", "bda_attn", "proj")
_BWD_A_RUN = ("attention",)
_BWD_QKV_RUN = ("rope", "qkv_post", "qkv")


@dataclass(frozen=True)
class _TypeSpec:
    name: str
    direction: str
    run: tuple[str, ...]
    comm: str
    launch_slots: tuple[str, ...]
    size_class: str
    per_layer: int  # instances per layer per microbatch instruction


_TP_ONLY = (
    _TypeSpec("fwd_attn", "forward", _ATTN_RUN, "ar_tp", ("norm_0", "linear_0", "rope_0", "attn_0"), "large", 2),
    _TypeSpec("fwd_mlp", "forward", _MLP_RUN, "ar_tp", ("norm_0", "linear_0", "activation_0"), "large", 2),
    _TypeSpec("bwd_mlp", "backward", _BWD_MLP_RUN, "ar_tp", ("norm_0", "linear_0", "activation_0"), "large", 2),
    _TypeSpec("bwd_attn", "backward", _BWD_ATTN_RUN, "ar_tp", ("norm_0", "linear_0", "attn_0", "rope_0"), "large",
              2),
)

_CP_TP = (
    _TypeSpec("fwd_qkv_ar", "forward", _QKV_RUN, "ar_tp", ("norm_0", "linear_0"), "medium", 1),
    _TypeSpec("fwd_qkv_ag", "forward", _QKV_RUN, "ag_kv", ("norm_0", "linear_0", "rope_0"), "medium", 1),
    _TypeSpec("fwd_ao_ag", "forward", _AO_RUN, "ag_kv", ("attn_0", "linear_0"), "small", 1),
    _TypeSpec("fwd_ao_ar", "forward", _AO_RUN, "ar_tp", ("attn_0",), "small", 1),
    _TypeSpec("fwd_mlp", "forward", _MLP_RUN, "ar_tp", ("norm_0", "linear_0", "activation_0"), "large", 2),
    _TypeSpec("bwd_mlp", "backward", _BWD_MLP_RUN, "ar_tp", ("norm_0", "linear_0", "activation_0"), "large", 2),
    _TypeSpec("bwd_o_ar", "backward", _BWD_O_RUN, "ar_tp", ("norm_0",), "small", 1),
    _TypeSpec("bwd_o_ag", "backward", _BWD_O_RUN, "ag_kv", ("norm_0", "linear_0"), "small", 1),
    _TypeSpec("bwd_a_ag", "backward", _BWD_A_RUN, "ag_kv", ("attn_0",), "small", 1),
    _TypeSpec("bwd_a_rs", "backward", _BWD_A_RUN, "rs_dkv", ("attn_0",), "small", 1),
    _TypeSpec("bwd_qkv_rs", "backward", _BWD_QKV_RUN, "rs_dkv", ("rope_0", "linear_0"), "medium", 1),
    _TypeSpec("bwd_qkv_ar", "backward", _BWD_QKV_RUN, "ar_tp", ("rope_0", "linear_0"), "medium", 1),
)


def comm_sms_grid(group_size: int) -> tuple[int, ...]:
    """The comm SM counts searched (METHOD_NOTES §5.4): groups of ≥ 4 GPUs 3..30 step 3, smaller
    groups 1..20."""
    return tuple(range(3, 31, 3)) if group_size >= 4 else tuple(range(1, 21))


def slot_names(ops: tuple[ComputeOp, ...]) -> tuple[str, ...]:
    """The launch-slot name of each op: memory-bound groups merge consecutive ops of the same group,
    linear and attention ops each get their own slot, numbered per group."""
    names: list[str] = []
    counters: dict[str, int] = {}
    previous_group: str | None = None
    for op in ops:
        group = op.slot_group
        if group in MERGING_GROUPS and group == previous_group:
            names.append(names[-1])
        else:
            index = counters.get(group, 0)
            counters[group] = index + 1
            names.append(f"{group}_{index}")
        previous_group = group
    return tuple(names)


@dataclass(frozen=True)
class PartitionConfig:
    """Where a partition's collective starts (`launch_slot`) and how many SMs it gets."""

    launch_slot: str
    comm_sms: int


@dataclass(frozen=True)
class PartitionType:
    """One kind of partition: the compute ops of one nanobatch (in order), the other nanobatch's
    collective overlapped with them, and its search space (launch slots, comm SM grid)."""

    name: str
    direction: str
    compute_ops: tuple[ComputeOp, ...]
    comm: CommOp
    launch_slots: tuple[str, ...]
    comm_sms_grid: tuple[int, ...]
    size_class: str

    @property
    def slots(self) -> tuple[str, ...]:
        """The slot name of every compute op, in order."""
        return slot_names(self.compute_ops)

    def slot_op_index(self, slot: str) -> int:
        """Index in `compute_ops` of the first op of `slot`; the collective starts with that op."""
        try:
            return self.slots.index(slot)
        except ValueError:
            allowed = ", ".join(self.launch_slots)
            raise KareusError(f"partition {self.name}: unknown launch slot {slot!r}; allowed: {allowed}") from None

    def validate_config(self, config: PartitionConfig) -> None:
        """Raise a `KareusError` naming the field unless `config` lies in this type's search space."""
        if config.launch_slot not in self.launch_slots:
            raise KareusError(f"partition {self.name}: launch_slot {config.launch_slot!r} not allowed; "
                              f"allowed: {', '.join(self.launch_slots)}")
        if config.comm_sms not in self.comm_sms_grid:
            raise KareusError(f"partition {self.name}: comm_sms {config.comm_sms} not allowed; allowed: "
                              f"{self.comm_sms_grid[0]}..{self.comm_sms_grid[-1]} "
                              f"step {_step(self.comm_sms_grid)}")

    @property
    def grid_size(self) -> int:
        return len(self.launch_slots) * len(self.comm_sms_grid)

    def default_config(self) -> PartitionConfig:
        """Plain nanobatching's launch: at the start of the partition, with the largest SM count."""
        return PartitionConfig(self.launch_slots[0], self.comm_sms_grid[-1])


def _step(grid: tuple[int, ...]) -> int:
    return grid[1] - grid[0] if len(grid) > 1 else 1


@dataclass(frozen=True)
class StageWorkload:
    """What one pipeline stage runs per microbatch instruction: partition instances per type
    (each is one nanobatch's work), the non-partition ops (embedding on the first stage; final
    norm, output layer and loss on the last), and the same layers as Megatron-style op lists for
    a whole microbatch (backward under activation checkpointing includes the recomputed forward).
    `partition_types` is the workload's, so a stage can be simulated on its own."""

    index: int
    num_layers: int
    forward_instances: Mapping[str, int]
    backward_instances: Mapping[str, int]
    recompute_instances: Mapping[str, int]
    nonpartition_forward_ops: tuple[ComputeOp, ...]
    nonpartition_backward_ops: tuple[ComputeOp, ...]
    sequential_forward_ops: tuple[Op, ...]
    sequential_backward_ops: tuple[Op, ...]
    is_first: bool = False
    is_last: bool = False
    partition_types: Mapping[str, PartitionType] = field(default_factory=dict, repr=False, compare=False)

    def instances(self, direction: str) -> dict[str, int]:
        """Partition type → instances in one instruction of `direction` (backward includes the
        recomputed forward partitions under activation checkpointing)."""
        if direction == "forward":
            return dict(self.forward_instances)
        if direction == "backward":
            merged = dict(self.backward_instances)
            for name, count in self.recompute_instances.items():
                merged[name] = merged.get(name, 0) + count
            return merged
        raise KareusError(f"direction must be 'forward' or 'backward', got {direction!r}")


@dataclass(frozen=True)
class Workload:
    """The whole job's work per GPU: partition types and per-stage instruction contents."""

    shape: ModelShape
    tp: int
    cp: int
    pp: int
    seq_len: int
    micro_batch_size: int
    activation_checkpointing: bool
    partition_types: dict[str, PartitionType]
    stages: tuple[StageWorkload, ...]
    stage_layers: tuple[int, ...] = field(default=())

    @property
    def nanobatch_size(self) -> int:
        return self.micro_batch_size // 2

    @property
    def tokens_per_microbatch(self) -> int:
        """Tokens one GPU processes per microbatch (its CP shard of every sequence)."""
        return self.micro_batch_size * self.seq_len // self.cp

    def partition_type(self, name: str) -> PartitionType:
        try:
            return self.partition_types[name]
        except KeyError:
            known = ", ".join(self.partition_types) or "(none: no TP or CP communication)"
            raise KareusError(f"unknown partition type {name!r}; this workload has: {known}") from None

    def types_for(self, direction: str) -> tuple[str, ...]:
        return tuple(name for name, ptype in self.partition_types.items() if ptype.direction == direction)


def split_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage. The last stage also runs the output layer and the loss, counted as one
    layer's work (Llama 3.2 3B: the 128k-vocabulary projection is ~4 layers of FLOPs but
    memory-light; the paper's artifact uses 15/13 for 28 layers on 2 stages); the layer-equivalents
    are split as evenly as possible, earlier stages taking the extra. Falls back to a plain even
    split when that would leave the last stage without a layer."""
    if pp < 1 or pp > num_layers:
        raise KareusError(f"pipeline parallelism must be in 1..{num_layers} (the model's layers), got {pp}")
    if pp == 1:
        return (num_layers,)
    shares = list(_even(num_layers + 1, pp))
    shares[-1] -= 1
    return tuple(shares) if shares[-1] >= 1 else _even(num_layers, pp)


def _even(total: int, parts: int) -> tuple[int, ...]:
    base, extra = divmod(total, parts)
    return tuple(base + (1 if index < extra else 0) for index in range(parts))


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise KareusError(f"{name} must be an integer >= 1, got {value!r}")


def _type_specs(tp: int, cp: int) -> tuple[_TypeSpec, ...]:
    if tp > 1 and cp == 1:
        return _TP_ONLY
    if tp > 1 and cp > 1:
        return _CP_TP
    if tp == 1 and cp == 1:
        return ()
    raise KareusError("context parallelism needs tensor parallelism >= 2 for partitioned execution: "
                      "partitions are defined for TP-only and CP+TP layouts")


def _build_type(spec: _TypeSpec, dims: LayerDims) -> PartitionType:
    forward = layer_forward_compute(dims)
    ops = tuple(forward[name] if spec.direction == "forward" else backward_of(forward[name]) for name in spec.run)
    comm = layer_comms(dims)[spec.comm]
    return PartitionType(spec.name, spec.direction, ops, comm, spec.launch_slots, comm_sms_grid(comm.group_size),
                         spec.size_class)


def build_workload(shape: ModelShape, *, tp: int, cp: int, pp: int, seq_len: int, micro_batch_size: int,
                   activation_checkpointing: bool = True, stage_layers: tuple[int, ...] | None = None) -> Workload:
    """The op graph, partition types and per-stage work for one job layout on one GPU."""
    _check_positive(tp=tp, cp=cp, pp=pp, seq_len=seq_len, micro_batch_size=micro_batch_size)
    if micro_batch_size < 2 or micro_batch_size % 2:
        raise KareusError(f"micro_batch_size must be even and >= 2 (two nanobatches), got {micro_batch_size}")
    if seq_len % cp:
        raise KareusError(f"seq_len {seq_len} must be divisible by context parallelism {cp}")
    layers = tuple(stage_layers) if stage_layers is not None else split_layers(shape.num_layers, pp)
    if len(layers) != pp or sum(layers) != shape.num_layers or min(layers) < 1:
        raise KareusError(f"stage_layers must be {pp} positive counts summing to {shape.num_layers}, got {layers}")
    seq_local = seq_len // cp
    nano = LayerDims(shape, tp, cp, micro_batch_size // 2, seq_local)
    micro = LayerDims(shape, tp, cp, micro_batch_size, seq_local)
    specs = _type_specs(tp, cp)
    types = {spec.name: _build_type(spec, nano) for spec in specs}
    stages = tuple(_build_stage(index, count, pp, specs, micro, activation_checkpointing, types)
                   for index, count in enumerate(layers))
    return Workload(shape, tp, cp, pp, seq_len, micro_batch_size, activation_checkpointing, types, stages, layers)


def _build_stage(index: int, num_layers: int, pp: int, specs: tuple[_TypeSpec, ...], micro: LayerDims,
                 activation_checkpointing: bool, types: dict[str, PartitionType]) -> StageWorkload:
    forward = {spec.name: spec.per_layer * num_layers for spec in specs if spec.direction == "forward"}
    backward = {spec.name: spec.per_layer * num_layers for spec in specs if spec.direction == "backward"}
    recompute = dict(forward) if activation_checkpointing else {}
    first, last = index == 0, index == pp - 1
    np_forward = nonpartition_forward(micro.shape, tp=micro.tp, tokens=micro.tokens, first=first, last=last)
    layer_fwd = layer_sequential_forward(micro)
    layer_bwd = layer_sequential_backward(micro)
    seq_backward = (layer_fwd + layer_bwd if activation_checkpointing else layer_bwd) * num_layers
    return StageWorkload(index, num_layers, forward, backward, recompute, np_forward,
                         nonpartition_backward(np_forward), layer_fwd * num_layers, seq_backward, first, last, types)
