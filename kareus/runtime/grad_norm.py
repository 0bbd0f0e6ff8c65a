"""The global gradient norm of the whole model, and clipping by it.

Every rank holds part of the model: a pipeline stage, a tensor-parallel shard of it, and a copy
that its data- and context-parallel replicas hold alike. The norm must count every gradient
element of the model exactly once, whatever the layout, so a TP2 × PP2 run clips exactly as a
single process would:

- a TP-sharded parameter (QKV, FC1, projection, FC2; any parameter whose local size is less than
  its full size) is counted on every TP rank, each for its own shard;
- a TP-replicated parameter (norm gains, replicated embedding and output layer) is counted on
  TP rank 0 only;
- a tied embedding held by both pipeline ends is counted on the first stage only;
- data- and context-parallel replicas (their gradients already summed, so equal) are counted on
  replica 0 only.

Each rank sums its counted squares in fp64 and one all-reduce over the whole world adds them up,
as Megatron-LM's `get_grad_norm_fp32` does over its model-parallel group (here the world, because
replicas contribute zero). Clipping scales every gradient by `max_norm / (norm + 1e-6)` when that
is below 1 (torch's `clip_grad_norm_`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from kareus.runtime.model import full_shapes
from kareus.workload.models import ModelShape

_CLIP_EPS = 1e-6


def full_numel(name: str, shape: ModelShape) -> int:
    """Elements of the whole (unsharded) parameter `name`."""
    base = name.rsplit(".", 1)[-1]
    if base in ("embedding", "output"):
        return shape.vocab_size * shape.hidden_size
    if base == "final_norm":
        return shape.hidden_size
    dims = full_shapes(shape)[base]
    numel = 1
    for d in dims:
        numel *= d
    return numel


def counted_here(name: str, local: Tensor, shape: ModelShape, *, tp_rank: int, pp_rank: int, dp_rank: int,
                 cp_rank: int) -> bool:
    """Whether this rank's copy of parameter `name` adds to the global norm (module docstring)."""
    if dp_rank or cp_rank:
        return False
    if name == "embedding" and shape.tied_embeddings and pp_rank > 0:
        return False  # the last stage's tied copy: the first stage counts it
    sharded = local.numel() < full_numel(name, shape)
    return sharded or tp_rank == 0


def local_sum_of_squares(grads: Mapping[str, Tensor], counted: Mapping[str, bool]) -> Tensor:
    """fp64 sum of the squares of the counted gradients on this rank (on their device)."""
    total: Tensor | None = None
    for name, grad in grads.items():
        if not counted[name]:
            continue
        part = torch.linalg.vector_norm(grad, dtype=torch.float64).square()
        total = part if total is None else total + part
    if total is None:
        device = next(iter(grads.values())).device if grads else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float64, device=device)
    return total


def global_grad_norm(grads: Mapping[str, Tensor], counted: Mapping[str, bool], *, distributed: bool) -> float:
    """The norm of the whole model's gradient (collective over the world when `distributed`)."""
    total = local_sum_of_squares(grads, counted)
    if distributed:
        dist.all_reduce(total)
    return float(total.sqrt())


def clip_(grads: Mapping[str, Tensor], norm: float, max_norm: float) -> float:
    """Scale `grads` in place so their global `norm` is at most `max_norm` (0: no clipping);
    returns the factor applied."""
    if max_norm <= 0:
        return 1.0
    coef = max_norm / (norm + _CLIP_EPS)
    if coef >= 1.0:
        return 1.0
    for grad in grads.values():
        grad.mul_(coef)
    return coef
