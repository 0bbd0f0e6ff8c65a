"""The op graph of one Llama-style transformer layer, per GPU, with FLOPs and HBM bytes.

A layer's forward pass is an ordered run of computation kernels cut by communication kernels
(DESIGN.md §2.2): residual fork, RMSNorm, QKV linear, QKV post-process (+ q/k norm), RoPE,
attention, output projection → AllReduce(TP), bias-dropout-add, fork, RMSNorm, FC1, SwiGLU, FC2 →
AllReduce(TP), bias-dropout-add. With context parallelism (CP) K/V are all-gathered over the CP
group before attention; in backward they are gathered again and their gradients reduce-scattered.

Every `ComputeOp` carries the work one GPU does for it (`flops`, `hbm_bytes`), its `kind`
(`gemm` compute-bound, `memory` memory-bound, `attention` flash attention) and its `slot_group`,
the name under which launch slots are counted (`norm`, `linear`, `rope`, `attn`, `activation`).
Every `CommOp` carries its collective, group and payload. Sizes are for a batch of `batch` sequences
of `seq_local` tokens each (the nanobatch for partitions, the microbatch for sequential execution),
in bf16 (2 bytes per element).

Backward costs follow the usual accounting: a linear's backward is two GEMMs of the forward's size
(input gradient and weight gradient); flash-attention backward is 2.5× the forward FLOPs (five
matmuls instead of two) and re-reads Q, K, V, O and dO; a memory-bound op's backward reads the
incoming gradient and the saved input and writes one gradient.

Shapes, for the simulator's tile and size effects: a GEMM's `rows` × `cols` is its output (tokens ×
output features) and `depth` its reduction (input features); flash attention's `rows` is the number
of independent (sequence, head) problems, `cols` the queries and `depth` the keys of each.
`fixed_bytes` is the part of `hbm_bytes` that does not grow with the tokens: the weights a GEMM
reads, and in backward the weight gradient accumulated into Megatron's fp32 main gradient (read and
written once per backward GEMM call, `GRAD_ACCUM_BYTES_PER_WEIGHT`). Every nanobatch pays these
again, which is the extra memory traffic of nanobatching.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kareus.workload.models import ModelShape

BYTES_PER_ELEMENT = 2  # bf16 activations and weights
COMPUTE_KINDS = ("gemm", "memory", "attention")
SLOT_GROUPS = ("norm", "linear", "rope", "attn", "activation")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
COMM_GROUPS = ("tp", "cp")

# Backward multipliers (see module docstring).
GEMM_BACKWARD_FLOPS = 2.0
ATTENTION_BACKWARD_FLOPS = 2.5
ATTENTION_BACKWARD_BYTES = 2.5
MEMORY_BACKWARD_BYTES = 1.5
# Megatron's gradient-accumulation fusion: the weight-gradient GEMM adds into the fp32 main
# gradient, reading and writing 4 bytes per weight on every call.
GRAD_ACCUM_BYTES_PER_WEIGHT = 8


@dataclass(frozen=True)
class ComputeOp:
    """One computation kernel of one GPU: `flops` and `hbm_bytes` it moves."""

    name: str
    kind: str
    flops: float
    hbm_bytes: float
    slot_group: str
    backward: bool = False
    rows: float = 0.0
    cols: float = 0.0
    depth: float = 0.0
    fixed_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS:
            raise ValueError(f"ComputeOp.kind must be one of {COMPUTE_KINDS}, got {self.kind!r}")
        if self.slot_group not in SLOT_GROUPS:
            raise ValueError(f"ComputeOp.slot_group must be one of {SLOT_GROUPS}, got {self.slot_group!r}")

    def scaled(self, factor: float) -> ComputeOp:
        """The same op on `factor` times as many tokens (the weights are read once either way)."""
        moving = self.hbm_bytes - self.fixed_bytes
        return replace(self, flops=self.flops * factor, hbm_bytes=moving * factor + self.fixed_bytes,
                       rows=self.rows * factor)


@dataclass(frozen=True)
class CommOp:
    """One (possibly fused) collective. `payload_bytes` is the full buffer on one GPU: the tensor
    for an all-reduce, the gathered output for an all-gather, the unreduced input for a
    reduce-scatter."""

    name: str
    collective: str
    group: str
    group_size: int
    payload_bytes: float

    def __post_init__(self) -> None:
        if self.collective not in COLLECTIVES:
            raise ValueError(f"CommOp.collective must be one of {COLLECTIVES}, got {self.collective!r}")
        if self.group not in COMM_GROUPS:
            raise ValueError(f"CommOp.group must be one of {COMM_GROUPS}, got {self.group!r}")

    @property
    def ring_bytes_per_gpu(self) -> float:
        """Bytes each GPU sends (and receives) in a ring: 2(n−1)/n of the payload for an all-reduce
        (reduce-scatter then all-gather), (n−1)/n for an all-gather or a reduce-scatter."""
        n = self.group_size
        steps = 2 * (n - 1) if self.collective == "all_reduce" else n - 1
        return self.payload_bytes * steps / n

    def scaled(self, factor: float) -> CommOp:
        return replace(self, payload_bytes=self.payload_bytes * factor)


Op = ComputeOp | CommOp


@dataclass(frozen=True)
class LayerDims:
    """Per-GPU dimensions of one layer under TP/CP for `batch` sequences of `seq_local` tokens."""

    shape: ModelShape
    tp: int
    cp: int
    batch: int
    seq_local: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_local

    @property
    def q_local(self) -> float:
        return self.shape.q_size / self.tp

    @property
    def kv_local(self) -> float:
        # GQA: KV heads are split across TP ranks (replicated when fewer heads than ranks).
        return max(self.shape.num_kv_heads / self.tp, 1.0) * self.shape.head_dim

    @property
    def ffn_local(self) -> float:
        return self.shape.ffn_hidden_size / self.tp


def _memory(name: str, group: str, elements_moved: float, flops_per_element: float = 0.0) -> ComputeOp:
    return ComputeOp(name, "memory", flops_per_element * elements_moved,
                     elements_moved * BYTES_PER_ELEMENT, group)


def _linear(name: str, tokens: float, in_features: float, out_features: float) -> ComputeOp:
    flops = 2.0 * tokens * in_features * out_features
    weights = in_features * out_features
    elements = tokens * in_features + weights + tokens * out_features
    return ComputeOp(name, "gemm", flops, elements * BYTES_PER_ELEMENT, "linear", rows=tokens, cols=out_features,
                     depth=in_features, fixed_bytes=weights * BYTES_PER_ELEMENT)


def layer_forward_compute(dims: LayerDims) -> dict[str, ComputeOp]:
    """The forward computation kernels of one layer, by name."""
    t, h = dims.tokens, dims.shape.hidden_size
    q, kv, ffn = dims.q_local, dims.kv_local, dims.ffn_local
    qkv_out = q + 2 * kv
    # Causal attention over the full sequence: each local query sees on average half of the
    # (gathered) keys; QK^T and PV are two matmuls of 2·d FLOPs per (query, key) pair.
    seq_kv = dims.seq_local * dims.cp
    attn_flops = 2.0 * 2.0 * dims.tokens * seq_kv * 0.5 * q
    attn_elements = t * (2 * q) + dims.batch * seq_kv * 2 * kv  # read Q, write O, read K, V
    # Splitting the fused QKV output into q, k, v is a view; only q/k RMSNorm (Qwen3) moves data.
    post_elements = 4 * t * (q + kv) if dims.shape.qk_norm else 0.0
    return {
        "bda_mlp": _memory("bda_mlp", "norm", 3 * t * h, 2.0),
        # The residual fork keeps a reference (no copy); its backward's gradient add is counted in
        # the bias-dropout-add backward, which reads and writes the same tensors.
        "fork_attn": _memory("fork_attn", "norm", 0.0),
        "norm_attn": _memory("norm_attn", "norm", 2 * t * h, 4.0),
        "qkv": _linear("qkv", t, h, qkv_out),
        "qkv_post": _memory("qkv_post", "rope", post_elements, 1.0),
        "rope": _memory("rope", "rope", 2 * t * (q + kv), 3.0),
        "attention": ComputeOp("attention", "attention", attn_flops, attn_elements * BYTES_PER_ELEMENT,
                               "attn", rows=dims.batch * q / dims.shape.head_dim, cols=dims.seq_local,
                               depth=seq_kv),
        "proj": _linear("proj", t, q, h),
        "bda_attn": _memory("bda_attn", "norm", 3 * t * h, 2.0),
        "fork_mlp": _memory("fork_mlp", "norm", 0.0),
        "norm_mlp": _memory("norm_mlp", "norm", 2 * t * h, 4.0),
        "fc1": _linear("fc1", t, h, 2 * ffn),
        "swiglu": _memory("swiglu", "activation", 3 * t * ffn, 4.0),
        "fc2": _linear("fc2", t, ffn, h),
    }


def backward_of(op: ComputeOp) -> ComputeOp:
    """The backward kernel of a forward computation kernel (see the module docstring)."""
    flops, hbm_bytes = {
        "gemm": (GEMM_BACKWARD_FLOPS, GEMM_BACKWARD_FLOPS),
        "attention": (ATTENTION_BACKWARD_FLOPS, ATTENTION_BACKWARD_BYTES),
        "memory": (MEMORY_BACKWARD_BYTES, MEMORY_BACKWARD_BYTES),
    }[op.kind]
    fixed = op.fixed_bytes * hbm_bytes
    if op.kind == "gemm":
        fixed += op.depth * op.cols * GRAD_ACCUM_BYTES_PER_WEIGHT
    moving = (op.hbm_bytes - op.fixed_bytes) * hbm_bytes
    return ComputeOp(f"{op.name}_bwd", op.kind, op.flops * flops, moving + fixed, op.slot_group,
                     backward=True, rows=op.rows, cols=op.cols, depth=op.depth, fixed_bytes=fixed)


def layer_comms(dims: LayerDims) -> dict[str, CommOp]:
    """The collectives of one layer: TP all-reduces of the hidden state; with CP the fused K/V
    all-gather and the fused dK/dV reduce-scatter (full gathered K and V buffers)."""
    comms: dict[str, CommOp] = {}
    if dims.tp > 1:
        ar_bytes = dims.tokens * dims.shape.hidden_size * BYTES_PER_ELEMENT
        comms["ar_tp"] = CommOp("ar_tp", "all_reduce", "tp", dims.tp, ar_bytes)
    if dims.cp > 1:
        kv_bytes = 2 * dims.batch * dims.seq_local * dims.cp * dims.kv_local * BYTES_PER_ELEMENT
        comms["ag_kv"] = CommOp("ag_kv", "all_gather", "cp", dims.cp, kv_bytes)
        comms["rs_dkv"] = CommOp("rs_dkv", "reduce_scatter", "cp", dims.cp, kv_bytes)
    return comms


FORWARD_ORDER = ("fork_attn", "norm_attn", "qkv", "qkv_post", "rope", "attention", "proj", "bda_attn",
                 "fork_mlp", "norm_mlp", "fc1", "swiglu", "fc2", "bda_mlp")


def layer_sequential_forward(dims: LayerDims) -> tuple[Op, ...]:
    """One layer's forward pass, Megatron-style: compute, then each collective where it is due."""
    ops = layer_forward_compute(dims)
    comms = layer_comms(dims)
    sequence: list[Op] = []
    for name in FORWARD_ORDER:
        if name == "attention" and "ag_kv" in comms:
            sequence.append(comms["ag_kv"])
        sequence.append(ops[name])
        if name in ("proj", "fc2") and "ar_tp" in comms:
            sequence.append(comms["ar_tp"])
    return tuple(sequence)


def layer_sequential_backward(dims: LayerDims) -> tuple[Op, ...]:
    """One layer's backward pass, Megatron-style: reverse op order, the TP all-reduces after the
    input gradients of FC1 and QKV, with CP the K/V re-gather before and the dK/dV
    reduce-scatter after attention backward."""
    ops = layer_forward_compute(dims)
    comms = layer_comms(dims)
    sequence: list[Op] = []
    for name in reversed(FORWARD_ORDER):
        if name == "attention" and "ag_kv" in comms:
            sequence.append(comms["ag_kv"])
        sequence.append(backward_of(ops[name]))
        if name == "attention" and "rs_dkv" in comms:
            sequence.append(comms["rs_dkv"])
        if name in ("fc1", "qkv") and "ar_tp" in comms:
            sequence.append(comms["ar_tp"])
    return tuple(sequence)


def nonpartition_forward(shape: ModelShape, *, tp: int, tokens: int, first: bool, last: bool) -> tuple[ComputeOp, ...]:
    """Embedding (first stage) and final norm, vocab-parallel output layer and cross-entropy loss
    (last stage) for a whole microbatch of `tokens` tokens on one GPU."""
    h, vocab_local = shape.hidden_size, shape.vocab_size / tp
    ops: list[ComputeOp] = []
    if first:
        ops.append(_memory("embedding", "norm", 2 * tokens * h))
    if last:
        ops.append(_memory("final_norm", "norm", 2 * tokens * h, 4.0))
        ops.append(_linear("output", tokens, h, vocab_local))
        # Softmax cross-entropy: read the logits twice (max/sum, then the loss), ~5 FLOPs each.
        ops.append(_memory("loss", "activation", 2 * tokens * vocab_local, 5.0))
    return tuple(ops)


def nonpartition_backward(forward: tuple[ComputeOp, ...]) -> tuple[ComputeOp, ...]:
    """Backward of the non-partition work, in reverse order."""
    return tuple(backward_of(op) for op in reversed(forward))
