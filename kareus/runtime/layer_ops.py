"""The computation ops of one Llama-style layer, as the runtime executes them.

A layer is an ordered run of small ops over named *channels* (DESIGN.md §2.2): residual fork,
RMSNorm, QKV linear, QKV post-process (split, optional q/k norm), RoPE, attention, output
projection → AllReduce(TP), bias-dropout-add (BDA), fork, RMSNorm, FC1, SwiGLU, FC2 →
AllReduce(TP), BDA. Each `LayerOp` reads its input channels and writes its output channels
(`main` is the hidden state, `residual` the skip branch, `qkv`, `q`, `k`, `v`, `ctx`, `ffn` the
intermediate tensors), names the layer parameters it uses, and carries its `slot_group`, the
name under which launch slots are counted (`norm`, `linear`, `rope`, `attn`, `activation`),
the same groups `kareus.workload.ops` uses.

Both execution modes use exactly these functions: the sequential mode calls them under ordinary
autograd, the partitioned engine runs each one on detached inputs and back-propagates op by op.
Fork and BDA have a closed-form backward (they only route gradients), so they never build an
autograd graph.

Tensors are batch-first, `[batch, seq, hidden]`; attention tensors are `[batch, heads, seq,
head_dim]`. Sizes are tensor-parallel local: `LocalShape` holds the per-rank head and FFN counts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kareus.errors import KareusError
from kareus.workload.models import ModelShape, RopeScaling


@dataclass(frozen=True)
class LocalShape:
    """The slice of a `ModelShape` one tensor-parallel rank holds."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    qk_norm: bool
    norm_eps: float

    @classmethod
    def of(cls, shape: ModelShape, tp: int) -> LocalShape:
        for field, value in (("heads", shape.num_heads), ("kvHeads", shape.num_kv_heads),
                             ("ffnHidden", shape.ffn_hidden_size)):
            if value % tp:
                raise KareusError(
                    f"model {shape.name}: {field}={value} is not divisible by tensor parallelism {tp}; "
                    f"allowed: a tensor size that divides heads, kvHeads and ffnHidden"
                )
        return cls(shape.hidden_size, shape.num_heads // tp, shape.num_kv_heads // tp, shape.head_dim,
                   shape.ffn_hidden_size // tp, shape.qk_norm, shape.norm_eps)

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


OpFn = Callable[..., tuple[Tensor, ...]]


@dataclass(frozen=True)
class LayerOp:
    """One computation op: `fn(local, params, consts, *inputs) -> outputs` over channels.

    `routing=True` marks fork/BDA: their backward is gradient routing (`route_backward`)."""

    name: str
    slot_group: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple[str, ...]
    fn: OpFn
    routing: bool = False


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Tensor:
    """Inverse frequencies `[head_dim/2]` (fp64) of rotary embeddings with base `theta`, scaled."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    return torch.tensor(scaling.scale(inv_freq.tolist()), dtype=torch.float64)


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, scaling: RopeScaling | None = None) -> tuple[Tensor, Tensor]:
    """cos/sin tables `[seq, head_dim/2]` of rotary embeddings (computed in fp64 for accuracy)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def sequence_consts(seq_len: int, cp: int, cp_rank: int, head_dim: int, theta: float,
                    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    scaling: RopeScaling | None = None) -> dict[str, Tensor]:
    """RoPE tables for this context-parallel rank's chunk of the sequence and, with CP, the causal
    mask of its queries over the whole sequence."""
    chunk = seq_len // cp
    cos, sin = rope_tables(seq_len, head_dim, theta, device, dtype, scaling)
    rows = slice(cp_rank * chunk, (cp_rank + 1) * chunk)
    consts = {"rope_cos": cos[rows], "rope_sin": sin[rows]}
    if cp > 1:
        query_pos = torch.arange(rows.start, rows.stop, device=device)
        consts["attn_mask"] = torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None]
    return consts


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (first half, second half) of the head dimension, as Llama does."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _fork(local, params, consts, x):
    return x, x


def _bda(local, params, consts, x, residual):
    return (x + residual,)


def _norm(local, params, consts, x):
    return (rms_norm(x, params[0], local.norm_eps),)


def _linear(local, params, consts, x):
    return (F.linear(x, params[0]),)


def _qkv_post(local, params, consts, qkv):
    b, s, _ = qkv.shape
    q_end = local.num_heads * local.head_dim
    k_end = q_end + local.num_kv_heads * local.head_dim
    q = qkv[..., :q_end].reshape(b, s, local.num_heads, local.head_dim).transpose(1, 2)
    k = qkv[..., q_end:k_end].reshape(b, s, local.num_kv_heads, local.head_dim).transpose(1, 2)
    v = qkv[..., k_end:].reshape(b, s, local.num_kv_heads, local.head_dim).transpose(1, 2)
    if local.qk_norm:
        q = rms_norm(q, params[0], local.norm_eps)
        k = rms_norm(k, params[1], local.norm_eps)
    return q, k, v.contiguous()


def _rope(local, params, consts, q, k):
    cos, sin = consts["rope_cos"], consts["rope_sin"]
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _attention(local, params, consts, q, k, v):
    # With context parallelism q holds this rank's chunk and k/v the whole sequence: the causal
    # mask is then offset by the chunk's position (`attn_mask`, True = may attend).
    mask = consts.get("attn_mask")
    gqa = local.num_heads != local.num_kv_heads
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    b, _, s, _ = out.shape
    return (out.transpose(1, 2).reshape(b, s, local.num_heads * local.head_dim),)


def _swiglu(local, params, consts, ffn):
    gate, up = ffn.chunk(2, dim=-1)
    return (F.silu(gate) * up,)


def _attention_ops(qk_norm: bool) -> tuple[LayerOp, ...]:
    return (
        LayerOp("fork_attn", "norm", ("main",), ("main", "residual"), (), _fork, routing=True),
        LayerOp("norm_attn", "norm", ("main",), ("main",), ("norm_attn",), _norm),
        LayerOp("qkv", "linear", ("main",), ("qkv",), ("qkv",), _linear),
        LayerOp("qkv_post", "rope", ("qkv",), ("q", "k", "v"), ("q_norm", "k_norm") if qk_norm else (),
                _qkv_post),
        LayerOp("rope", "rope", ("q", "k"), ("q", "k"), (), _rope),
        LayerOp("attention", "attn", ("q", "k", "v"), ("ctx",), (), _attention),
        LayerOp("proj", "linear", ("ctx",), ("main",), ("proj",), _linear),
    )


def _mlp_ops() -> tuple[LayerOp, ...]:
    return (
        LayerOp("bda_attn", "norm", ("main", "residual"), ("main",), (), _bda, routing=True),
        LayerOp("fork_mlp", "norm", ("main",), ("main", "residual"), (), _fork, routing=True),
        LayerOp("norm_mlp", "norm", ("main",), ("main",), ("norm_mlp",), _norm),
        LayerOp("fc1", "linear", ("main",), ("ffn",), ("fc1",), _linear),
        LayerOp("swiglu", "activation", ("ffn",), ("ffn",), (), _swiglu),
        LayerOp("fc2", "linear", ("ffn",), ("main",), ("fc2",), _linear),
    )


MLP_BDA = LayerOp("bda_mlp", "norm", ("main", "residual"), ("main",), (), _bda, routing=True)


@dataclass(frozen=True)
class LayerProgram:
    """A layer's forward as two comm-terminated runs: attention (ends with the projection, then
    the TP all-reduce) and MLP (BDA … FC2, then the all-reduce); the MLP's BDA closes the layer.
    """

    attention: tuple[LayerOp, ...]
    mlp: tuple[LayerOp, ...]
    closing: LayerOp

    @classmethod
    def llama(cls, qk_norm: bool) -> LayerProgram:
        return cls(_attention_ops(qk_norm), _mlp_ops(), MLP_BDA)

    def forward_ops(self) -> tuple[LayerOp, ...]:
        return (*self.attention, *self.mlp, self.closing)


def route_backward(op: LayerOp, grads_out: Sequence[Tensor | None]) -> tuple[Tensor | None, ...]:
    """Input gradients of a routing op: fork sums its two branches, BDA copies to both."""
    if op.fn is _fork:
        main, residual = grads_out
        if main is None:
            return (residual,)
        return (main if residual is None else main + residual,)
    (grad,) = grads_out
    return grad, grad
