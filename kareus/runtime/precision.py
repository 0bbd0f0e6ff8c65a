"""Mixed precision as Megatron-LM does it: compute in bf16, keep and update fp32.

In bf16 the model's parameters (what the forward and backward compute with) are bf16, but the
optimizer steps fp32 *master* copies of them, with fp32 AdamW state. An update below half a bf16
ulp of a weight would vanish if applied to the bf16 weight itself (20 AdamW steps at lr 3e-4 moved
0 of tiny's 64 final-norm gains); applied to the fp32 master it accumulates until the rounded bf16
copy moves.

Gradients are accumulated in fp32 too: every bf16 parameter has an fp32 `main_grad` buffer (the
name Megatron uses) that each microbatch's — and each nanobatch's — gradient is added into the
moment it is produced (`accumulate_grad` for the partitioned engine's op-level backward, a
post-accumulate hook for autograd's), so a sum over many microbatches does not round in bf16. The
buffers are the masters' `.grad`, which the data- and context-parallel all-reduce sums in fp32,
which the gradient norm reads and the optimizer steps from. After the step the masters are rounded
into the bf16 parameters.

In fp32 the masters are the model's parameters themselves and nothing is copied.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def accumulate_grad(param: Tensor, grad: Tensor) -> None:
    """Add a gradient of `param`: into its fp32 `main_grad` when it has one, else into `.grad`."""
    main = getattr(param, "main_grad", None)
    if main is not None:
        main.add_(grad)
    elif param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


def _into_main_grad(param: Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


class MasterParams:
    """The parameters the optimizer steps (`masters`, by name) and their gradients (`grads`)."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        self.params = params
        self.mixed = any(p.dtype != torch.float32 for p in params.values())
        if not self.mixed:
            self.masters = params
            return
        self.masters = {name: nn.Parameter(p.detach().float().clone()) for name, p in params.items()}
        for name, p in params.items():
            master = self.masters[name]
            master.grad = torch.zeros_like(master)
            p.main_grad = master.grad  # one buffer: what backward accumulates is what the optimizer reads
            p.register_post_accumulate_grad_hook(_into_main_grad)

    def zero_grad(self) -> None:
        if self.mixed:
            for master in self.masters.values():
                master.grad.zero_()
        else:
            for p in self.params.values():
                p.grad = None

    def grads(self) -> dict[str, Tensor]:
        """Every master's gradient by name (zeros for a parameter this step did not reach)."""
        for p in self.masters.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return {name: p.grad for name, p in self.masters.items()}

    @torch.no_grad()
    def to_model(self) -> None:
        """Round the masters into the compute parameters (after a step, after a resume)."""
        if self.mixed:
            for name, p in self.params.items():
                p.copy_(self.masters[name])
