"""The partitioned overlap engine: a stage's layers run as partitions over two nanobatches.

A microbatch is split in two nanobatches (NB0, NB1) along the batch dimension. The stage's op
sequence is cut at its collectives into *segments*; every segment yields two partitions
(METHOD_NOTES Part B §1.2): NB0 runs the segment's compute while NB1's collective of the previous
segment is in flight, then NB1 runs the same compute while NB0's collective of this segment is in
flight. A partition's *type* names it (tensor parallel only: `fwd_attn`, `fwd_mlp`, `bwd_mlp`,
`bwd_attn`; with context parallelism the attention splits further: `fwd_qkv_ar`, `fwd_qkv_ag`,
`fwd_ao_ag`, `fwd_ao_ar`, `bwd_o_ar`, `bwd_o_ag`, `bwd_a_ag`, `bwd_a_rs`, `bwd_qkv_rs`, `bwd_qkv_ar`;
plus the trailing `fwd_trail`/`bwd_trail`). One `PartitionConfig` per type says at which launch
slot the collective starts and with how many SMs. Each partition ends with a join.

Collectives: the TP all-reduce of `main` (after the projection and FC2 in forward, after the QKV
and FC1 input gradients in backward); with CP the fused K/V all-gather over the CP group before
attention, the K/V re-gather before attention backward (forward keeps only the local K/V) and the
reduce-scatter of dK/dV after it.

Backward is executed op by op: in forward every op ran on detached inputs (`OpRecord`), so in
backward `torch.autograd.grad` of that op alone gives its input and parameter gradients, and the
schedule — not autograd — decides the order, which is what lets a backward collective overlap the
other nanobatch's compute. Gradients flow through named channels exactly as activations do.
With CP, attention is recomputed in backward from the re-gathered K/V.

With activation checkpointing a forward instruction keeps only inputs: `stage` checkpointing the
stage input, and the backward instruction re-runs the forward partitions of the whole stage (with the
plan's *recompute* configs) and then its backward partitions; `layer` checkpointing (the default)
each layer's input, and the backward re-runs and differentiates one layer at a time, in reverse, with
a `PartitionedBlock` per layer (`layers=`) so only one layer's op records are alive at once. A
one-layer block has the same partition types and launch slots as the stage's (the BDA that leads
`fwd_attn` and the norm + fork that lead `bwd_mlp` across a layer boundary merge into `norm_0` there,
and run in their layer's `fwd_trail` / `bwd_trail` here), so the instruction's configs apply to it.

`SequentialBlock` is the Megatron-style reference: the whole microbatch, the same op functions,
blocking collectives, ordinary autograd.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kareus.errors import KareusError
from kareus.runtime.comm import (
    AllReduceBackward,
    AllReduceForward,
    CommHandle,
    GatherSequence,
    GroupComm,
    pack_kv,
    unpack_kv,
)
from kareus.runtime.layer_ops import LayerOp, LayerProgram, route_backward
from kareus.runtime.model import StageModel
from kareus.runtime.precision import accumulate_grad
from kareus.workload.partitions import MERGING_GROUPS, PartitionConfig

NUM_NANOBATCHES = 2
AR_TP, AG_KV, RS_DKV = "ar_tp", "ag_kv", "rs_dkv"


@dataclass(frozen=True)
class Step:
    """One op of one layer (stage-global layer index)."""

    layer: int
    op: LayerOp


@dataclass(frozen=True)
class Segment:
    """A compute run, the partition type of each nanobatch running it, and the collective that
    follows it (`ar_tp`, `ag_kv`, `rs_dkv` or None) for the layer of its last op."""

    keys: tuple[str, str]
    steps: tuple[Step, ...]
    comm: str | None

    @property
    def slots(self) -> tuple[str, ...]:
        return slot_names(tuple(s.op.slot_group for s in self.steps))

    @property
    def layer(self) -> int:
        return self.steps[-1].layer

    def slot_index(self, slot: str) -> int:
        """Index of the first op of `slot` (configs are checked by `PartitionedBlock.check_configs`)."""
        return self.slots.index(slot)


def slot_names(groups: tuple[str, ...]) -> tuple[str, ...]:
    """Launch-slot names (`norm_0`, `linear_0`, …) of a run of ops given their slot groups: merging
    groups fold consecutive ops into one slot; each linear/attention op is its own slot."""
    names: list[str] = []
    counters: dict[str, int] = {}
    for i, group in enumerate(groups):
        if group in MERGING_GROUPS and i > 0 and groups[i - 1] == group:
            names.append(names[-1])
            continue
        counters[group] = counters.get(group, -1) + 1
        names.append(f"{group}_{counters[group]}")
    return tuple(names)


@dataclass(frozen=True)
class Partition:
    """Nanobatch `nb` runs `segment`'s compute; the collective of (`comm_nb`, `comm_segment`)
    overlaps it (None: no collective)."""

    key: str
    nb: int
    segment: int
    comm_nb: int | None
    comm_segment: int | None


def _run(layer: int, ops: tuple[LayerOp, ...]) -> tuple[Step, ...]:
    return tuple(Step(layer, op) for op in ops)


def forward_segments(program: LayerProgram, layers: range, cp: int = 1) -> tuple[Segment, ...]:
    attn_head, attn_tail = program.attention[:-2], program.attention[-2:]  # … RoPE | attention, proj
    segments: list[Segment] = []
    for i, layer in enumerate(layers):
        lead = (Step(layer - 1, program.closing),) if i > 0 else ()
        if cp == 1:
            segments.append(Segment(("fwd_attn", "fwd_attn"), lead + _run(layer, program.attention), AR_TP))
        else:
            segments.append(Segment(("fwd_qkv_ar", "fwd_qkv_ag"), lead + _run(layer, attn_head), AG_KV))
            segments.append(Segment(("fwd_ao_ag", "fwd_ao_ar"), _run(layer, attn_tail), AR_TP))
        segments.append(Segment(("fwd_mlp", "fwd_mlp"), _run(layer, program.mlp), AR_TP))
    segments.append(Segment(("fwd_trail", "fwd_trail"), (Step(layers[-1], program.closing),), None))
    return tuple(segments)


def backward_segments(program: LayerProgram, layers: range, cp: int = 1) -> tuple[Segment, ...]:
    """The forward steps in reverse, cut after the QKV and FC1 input gradients (their all-reduce)
    and, with CP, before and after attention (K/V re-gather, dK/dV reduce-scatter)."""
    attention = tuple(reversed(program.attention))  # proj, attention, rope, qkv_post, qkv, norm, fork
    mlp = tuple(reversed(program.mlp))  # fc2, swiglu, fc1, norm, fork, bda
    segments: list[Segment] = []
    for i, layer in enumerate(reversed(layers)):
        # The next layer's input norm + fork lead this layer's MLP backward run.
        lead = _run(layer + 1, attention[-2:]) if i > 0 else ()
        segments.append(Segment(("bwd_mlp", "bwd_mlp"), (*lead, Step(layer, program.closing), *_run(layer, mlp[:3])),
                                AR_TP))
        if cp == 1:
            segments.append(Segment(("bwd_attn", "bwd_attn"), _run(layer, mlp[3:] + attention[:-2]), AR_TP))
        else:
            segments.append(Segment(("bwd_o_ar", "bwd_o_ag"), _run(layer, mlp[3:] + attention[:1]), AG_KV))
            segments.append(Segment(("bwd_a_ag", "bwd_a_rs"), _run(layer, attention[1:2]), RS_DKV))
            segments.append(Segment(("bwd_qkv_rs", "bwd_qkv_ar"), _run(layer, attention[2:-2]), AR_TP))
    segments.append(Segment(("bwd_trail", "bwd_trail"), _run(layers[0], attention[-2:]), None))
    return tuple(segments)


def partitions_of(segments: tuple[Segment, ...]) -> tuple[Partition, ...]:
    parts: list[Partition] = []
    for s, segment in enumerate(segments):
        previous = s > 0 and segments[s - 1].comm is not None
        parts.append(Partition(segment.keys[0], 0, s, 1 if previous else None, s - 1 if previous else None))
        own = segment.comm is not None
        parts.append(Partition(segment.keys[1], 1, s, 0 if own else None, s if own else None))
    return tuple(parts)


@dataclass
class OpRecord:
    """What backward needs of one executed op: its detached inputs and its outputs (no outputs:
    the op is recomputed in backward)."""

    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]


@dataclass
class NanoState:
    """One nanobatch's channels (activations), gradient channels, op records and, with CP, each
    layer's local K/V (re-gathered for attention backward)."""

    acts: dict[str, Tensor] = field(default_factory=dict)
    grads: dict[str, Tensor] = field(default_factory=dict)
    records: dict[tuple[int, str], OpRecord] = field(default_factory=dict)
    local_kv: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)


@dataclass
class BlockContext:
    """What a forward instruction leaves for the backward one."""

    mode: str
    inputs: tuple[Tensor, ...]
    states: tuple[NanoState, ...] = ()
    output: Tensor | None = None


class StageBlock:
    """What both execution modes of a stage's layers share: parameters, groups, constants, ops."""

    def __init__(self, model: StageModel, tp: GroupComm, consts: Mapping[str, Tensor],
                 cp: GroupComm | None = None) -> None:
        self.model = model
        self.tp = tp
        self.cp = cp or GroupComm(None, 1)
        self.consts = consts
        self.program = LayerProgram.llama(model.shape.qk_norm)


class PartitionedBlock(StageBlock):
    """Runs a stage's layers as partitions; see the module docstring."""

    def __init__(self, model: StageModel, tp: GroupComm, consts: Mapping[str, Tensor],
                 cp: GroupComm | None = None, layers: range | None = None) -> None:
        """`layers`: the stage-global layers this block runs (default: all of the stage's)."""
        super().__init__(model, tp, consts, cp)
        layers = model.layout.layers if layers is None else layers
        self.fwd_segments = forward_segments(self.program, layers, self.cp.size)
        self.bwd_segments = backward_segments(self.program, layers, self.cp.size)
        self.fwd_partitions = partitions_of(self.fwd_segments)
        self.bwd_partitions = partitions_of(self.bwd_segments)
        # Set to a list to record the issue order: (event "comm"|"op", forward?, segment, nanobatch, op index).
        self.trace: list[tuple] | None = None

    def check_configs(self, configs: Mapping[str, PartitionConfig], *, forward: bool, where: str) -> None:
        """Raise a `KareusError` unless every config names a partition type this stage executes in
        that direction, one of its launch slots, and a positive SM count."""
        segments = {key: s for s in (self.fwd_segments if forward else self.bwd_segments) for key in s.keys}
        for key, config in configs.items():
            if key not in segments:
                raise KareusError(f"{where}: partition type {key!r} is not run here; allowed: {', '.join(segments)}")
            slots = tuple(dict.fromkeys(segments[key].slots))
            if config.launch_slot not in slots:
                raise KareusError(f"{where}.{key}.launch_slot: {config.launch_slot!r} is not an op of the partition; "
                                  f"allowed: {', '.join(slots)}")
            if not isinstance(config.comm_sms, int) or config.comm_sms < 1:
                raise KareusError(f"{where}.{key}.comm_sms: must be an integer >= 1, got {config.comm_sms!r}")

    # forward -----------------------------------------------------------------------------------
    def forward(self, x: Tensor, configs: Mapping[str, PartitionConfig], *, record: bool) -> tuple[Tensor, list]:
        states = [NanoState(acts={"main": half}) for half in x.chunk(NUM_NANOBATCHES)]
        with torch.no_grad():
            self._run(self.fwd_segments, self.fwd_partitions, states, configs, forward=True, record=record)
        return torch.cat([s.acts["main"] for s in states]), states

    def _forward_step(self, step: Step, state: NanoState, record: bool) -> None:
        op = step.op
        inputs = tuple(state.acts[c] for c in op.inputs)
        params = self.model.layer_params(step.layer, op.params)
        if record and self._recomputed(op):
            state.records[(step.layer, op.name)] = OpRecord(inputs[:1], ())  # q; K/V are re-gathered
            outputs = op.fn(self.model.local, params, self.consts, *inputs)
        elif record and not op.routing:
            leaves = tuple(t.detach().requires_grad_() for t in inputs)
            with torch.enable_grad():
                outputs = op.fn(self.model.local, params, self.consts, *leaves)
            state.records[(step.layer, op.name)] = OpRecord(leaves, outputs)
        else:
            outputs = op.fn(self.model.local, params, self.consts, *inputs)
        for channel, tensor in zip(op.outputs, outputs, strict=True):
            state.acts[channel] = tensor.detach()

    def _recomputed(self, op: LayerOp) -> bool:
        """With CP, attention keeps no gathered K/V for backward: it is recomputed from a re-gather."""
        return self.cp.size > 1 and op.name == "attention"

    # backward ----------------------------------------------------------------------------------
    def backward(self, states: list[NanoState], grad_y: Tensor, configs: Mapping[str, PartitionConfig]) -> Tensor:
        for state, grad in zip(states, grad_y.chunk(NUM_NANOBATCHES), strict=True):
            state.grads = {"main": grad}
            state.acts.clear()
        self._run(self.bwd_segments, self.bwd_partitions, states, configs, forward=False, record=False)
        return torch.cat([s.grads.pop("main") for s in states])

    def _backward_step(self, step: Step, state: NanoState) -> None:
        op = step.op
        grads_out = [state.grads.pop(c, None) for c in op.outputs]
        if all(g is None for g in grads_out):
            return
        if op.routing:
            grads_in = route_backward(op, grads_out)
        else:
            record = state.records.pop((step.layer, op.name))
            if not record.outputs:
                record = self._recompute(step, record, state)
            grads_in = self._op_grads(step, record, grads_out)
        for channel, grad in zip(op.inputs, grads_in, strict=True):
            if grad is not None:
                state.grads[channel] = grad if channel not in state.grads else state.grads[channel] + grad

    def _recompute(self, step: Step, record: OpRecord, state: NanoState) -> OpRecord:
        leaves = (record.inputs[0].detach().requires_grad_(),
                  *(state.acts.pop(c).requires_grad_() for c in step.op.inputs[1:]))
        params = self.model.layer_params(step.layer, step.op.params)
        with torch.enable_grad():
            outputs = step.op.fn(self.model.local, params, self.consts, *leaves)
        return OpRecord(leaves, outputs)

    def _op_grads(self, step: Step, rec: OpRecord, grads_out: list[Tensor | None]) -> tuple[Tensor | None, ...]:
        params = self.model.layer_params(step.layer, step.op.params)
        pairs = [(o, g) for o, g in zip(rec.outputs, grads_out, strict=True) if g is not None]
        wrt = rec.inputs + params
        grads = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
        for param, grad in zip(params, grads[len(rec.inputs):], strict=True):
            if grad is not None:
                accumulate_grad(param, grad)  # into the fp32 main_grad in bf16 (kareus.runtime.precision)
        return grads[:len(rec.inputs)]

    # the partition loop ------------------------------------------------------------------------
    def _run(self, segments: tuple[Segment, ...], partitions: tuple[Partition, ...], states: list[NanoState],
             configs: Mapping[str, PartitionConfig], *, forward: bool, record: bool) -> None:
        """Run partitions in order; each issues its collective (for the other nanobatch) right
        before the op of its launch slot, and joins it at its end."""
        for part in partitions:
            segment = segments[part.segment]
            config = configs.get(part.key)
            handle: CommHandle | None = None
            launch_at = segment.slot_index(config.launch_slot) if config else 0
            for i, step in enumerate(segment.steps):
                if part.comm_nb is not None and i == launch_at:
                    handle = self._launch(segments[part.comm_segment], states[part.comm_nb], forward,
                                          config.comm_sms if config else None)
                    self._trace("comm", forward, part.segment, part.nb, i)
                if forward:
                    self._forward_step(step, states[part.nb], record)
                else:
                    self._backward_step(step, states[part.nb])
                self._trace("op", forward, part.segment, part.nb, i)
            if handle is not None:
                handle.join()

    def _launch(self, segment: Segment, state: NanoState, forward: bool, comm_sms: int | None) -> CommHandle:
        """Start the collective that follows `segment`, on nanobatch `state`'s tensors."""
        if segment.comm == AR_TP:
            return self.tp.launch_all_reduce((state.acts if forward else state.grads)["main"], comm_sms)
        if segment.comm == AG_KV:
            if forward:
                state.local_kv[segment.layer] = (state.acts["k"], state.acts["v"])
            kv = pack_kv(*state.local_kv[segment.layer])

            def gathered(packed: Tensor) -> None:
                state.acts["k"], state.acts["v"] = unpack_kv(packed)

            return self.cp.launch_all_gather(kv, comm_sms, gathered)
        dkv = pack_kv(state.grads.pop("k"), state.grads.pop("v"))

        def scattered(packed: Tensor) -> None:
            state.grads["k"], state.grads["v"] = unpack_kv(packed)

        return self.cp.launch_reduce_scatter(dkv, comm_sms, scattered)

    def _trace(self, *event) -> None:
        if self.trace is not None:
            self.trace.append(event)


class SequentialBlock(StageBlock):
    """Megatron-style execution of the whole microbatch with standard autograd (the reference)."""

    def forward(self, x: Tensor, layers: range | None = None) -> Tensor:
        """`layers`: the stage-global layers to run (default: all of the stage's)."""
        acts = {"main": x}
        for layer in self.model.layout.layers if layers is None else layers:
            for op in self.program.forward_ops():
                inputs = [acts[c] for c in op.inputs]
                if op.name in ("qkv", "fc1"):
                    inputs[0] = AllReduceBackward.apply(inputs[0], self.tp)
                if op.name == "attention" and self.cp.size > 1:
                    inputs[1:] = [GatherSequence.apply(t, self.cp) for t in inputs[1:]]
                outputs = op.fn(self.model.local, self.model.layer_params(layer, op.params), self.consts, *inputs)
                if op.name in ("proj", "fc2"):
                    outputs = (AllReduceForward.apply(outputs[0], self.tp),)
                acts.update(zip(op.outputs, outputs, strict=True))
        return acts["main"]
