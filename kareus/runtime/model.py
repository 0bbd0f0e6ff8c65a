"""The parameters of one pipeline stage on one tensor-parallel rank, and the non-partition work.

Every rank generates the *full* (unsharded) tensor of each parameter it holds from a generator
seeded by (seed, parameter name), then keeps its tensor-parallel slice. So a model initialises
identically whatever the layout — TP2×PP2 and a single process start from the same weights, which
is what lets the tests compare them — and `shard` is the one place that knows the layout:

- QKV is column-parallel by heads (each rank gets its query heads and its K/V heads),
- FC1 is column-parallel (gate and up halves sliced alike), projection and FC2 row-parallel,
- norms, the embedding and the output layer are replicated: their gradients come out identical
  on every TP rank because their inputs and output-gradients are all-reduced already.

Layers are named by their global index (`layers.7.qkv`), so a stage holds exactly its layers.
The embedding lives on the first stage, final norm + output layer + loss on the last; with tied
embeddings and several stages both ends hold a copy whose gradients are summed every step.

Parameters are made one at a time: a full tensor is generated, this rank's slice is *copied* out of
it (a view would keep the whole full tensor alive: about 100 GB of host memory per rank for a 70B
stage at TP8) and moved to the device before the next one is generated. So a rank's host memory
never holds more than its shard plus one full tensor (on a GPU: one full tensor).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kareus.runtime.layer_ops import LocalShape, rms_norm
from kareus.workload.models import ModelShape

INIT_STD = 0.02


@dataclass(frozen=True)
class StageLayout:
    """Which layers and ends of the model a stage holds."""

    stage: int
    num_stages: int
    first_layer: int
    num_layers: int

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

    @classmethod
    def of(cls, stage: int, stage_layers: tuple[int, ...]) -> StageLayout:
        return cls(stage, len(stage_layers), sum(stage_layers[:stage]), stage_layers[stage])


def full_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Unsharded shape of each per-layer parameter (weights are `[out, in]`)."""
    shapes = {
        "norm_attn": (shape.hidden_size,),
        "qkv": (shape.q_size + 2 * shape.kv_size, shape.hidden_size),
        "proj": (shape.hidden_size, shape.q_size),
        "norm_mlp": (shape.hidden_size,),
        "fc1": (2 * shape.ffn_hidden_size, shape.hidden_size),
        "fc2": (shape.hidden_size, shape.ffn_hidden_size),
    }
    if shape.qk_norm:
        shapes["q_norm"] = (shape.head_dim,)
        shapes["k_norm"] = (shape.head_dim,)
    return shapes


# RMSNorm weights: per layer, the q/k norms (Qwen3) and the final one. They scale, so they start at one.
NORM_PARAMS = frozenset({"norm_attn", "norm_mlp", "q_norm", "k_norm", "final_norm"})
# Linear layers that write into the residual stream (attention output and FC2).
RESIDUAL_OUTPUTS = frozenset({"proj", "fc2"})


def init_full(name: str, dims: tuple[int, ...], shape: ModelShape, seed: int) -> Tensor:
    """The full initial value of parameter `name`, as Megatron-LM initialises a GPT (and torchtitan
    its Llama, up to the depth scaling):

    - every RMSNorm weight is one (the norm starts as a pure normalisation);
    - the embedding, the output layer, QKV and FC1 are N(0, 0.02²);
    - the residual-writing outputs (`proj`, `fc2`) are N(0, (0.02 / sqrt(2·layers))²), so the residual
      stream's variance does not grow with depth at initialisation (GPT-2, Megatron's
      `scaled_init_method_normal`).
    Random values come from a generator seeded by (seed, name): the same whatever the layout."""
    base = name.rsplit(".", 1)[-1]
    if base in NORM_PARAMS:
        return torch.ones(dims)
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    std = INIT_STD / math.sqrt(2 * shape.num_layers) if base in RESIDUAL_OUTPUTS else INIT_STD
    return torch.randn(dims, generator=generator).mul_(std)  # in place: one full tensor, not two


def shard(name: str, full: Tensor, shape: ModelShape, tp_rank: int, tp: int) -> Tensor:
    """This tensor-parallel rank's slice of the full parameter `name`: its own storage, never a
    view of `full` (or the full tensor could not be freed)."""
    if tp == 1:
        return full
    base = name.rsplit(".", 1)[-1]
    local = LocalShape.of(shape, tp)
    if base == "qkv":
        hd = shape.head_dim
        q, k, v = full.split((shape.q_size, shape.kv_size, shape.kv_size))
        qs = local.num_heads * hd
        kvs = local.num_kv_heads * hd
        return torch.cat((q[tp_rank * qs:(tp_rank + 1) * qs], k[tp_rank * kvs:(tp_rank + 1) * kvs],
                          v[tp_rank * kvs:(tp_rank + 1) * kvs]))
    if base == "fc1":
        gate, up = full.chunk(2)
        n = local.ffn_hidden_size
        return torch.cat((gate[tp_rank * n:(tp_rank + 1) * n], up[tp_rank * n:(tp_rank + 1) * n]))
    if base in ("proj", "fc2"):
        return full.chunk(tp, dim=1)[tp_rank].contiguous()
    return full


def initial_params(shape: ModelShape, layout: StageLayout, tp: int, tp_rank: int,
                   seed: int) -> Iterator[tuple[str, Tensor]]:
    """(name, this rank's initial value) of each parameter of the stage, made one at a time: the
    full tensor behind a slice is freed before the next is generated."""
    for layer in layout.layers:
        for base, dims in full_shapes(shape).items():
            name = f"layers.{layer}.{base}"
            yield name, shard(name, init_full(name, dims, shape, seed), shape, tp_rank, tp)
    table = (shape.vocab_size, shape.hidden_size)
    if layout.is_first or (layout.is_last and shape.tied_embeddings):
        yield "embedding", init_full("embedding", table, shape, seed)
    if layout.is_last:
        yield "final_norm", init_full("final_norm", (shape.hidden_size,), shape, seed)
        if not shape.tied_embeddings:
            yield "output", init_full("output", table, shape, seed)


class StageModel(nn.Module):
    """Parameters of one stage on one TP rank, plus the embedding and head computations."""

    def __init__(self, shape: ModelShape, layout: StageLayout, *, tp: int = 1, tp_rank: int = 0, seed: int = 0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 params: Iterable[tuple[str, Tensor]] | None = None) -> None:
        """`params`: (name, this rank's value) of every parameter in `initial_params`' order, made
        one at a time (pretrained weights, `kareus.runtime.init_from`); default: `initial_params`."""
        super().__init__()
        self.shape = shape
        self.layout = layout
        self.local = LocalShape.of(shape, tp)
        self.tp, self.tp_rank = tp, tp_rank
        self.params = nn.ParameterDict()
        if params is None:
            params = initial_params(shape, layout, tp, tp_rank, seed)
        for name, local in params:
            self.params[_key(name)] = nn.Parameter(local.to(device=device, dtype=dtype))
            del local  # on a GPU the host copy goes before the next full tensor is made

    def param(self, name: str) -> nn.Parameter:
        return self.params[_key(name)]

    def layer_params(self, layer: int, names: tuple[str, ...]) -> tuple[Tensor, ...]:
        return tuple(self.params[_key(f"layers.{layer}.{n}")] for n in names)

    def named_model_params(self) -> dict[str, nn.Parameter]:
        """Parameters by their model name (`layers.3.fc1`, `embedding`, …)."""
        return {_name(k): p for k, p in self.params.items()}

    def embed(self, tokens: Tensor) -> Tensor:
        return F.embedding(tokens, self.param("embedding"))

    def head_loss(self, hidden: Tensor, targets: Tensor, loss_scale: float) -> Tensor:
        """Sum of token cross-entropies times `loss_scale` (1 / tokens of the global batch), so
        microbatch and data-parallel gradients simply add up to the global mean's gradient."""
        out = self.param("embedding") if self.shape.tied_embeddings else self.param("output")
        logits = F.linear(rms_norm(hidden, self.param("final_norm"), self.shape.norm_eps), out)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: loss in fp32
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        return loss * loss_scale


def _key(name: str) -> str:
    # ParameterDict keys may not contain dots.
    return name.replace(".", "__")


def _name(key: str) -> str:
    return key.replace("__", ".")
