"""The optimizer recipe: which optimizer, its hyperparameters, the learning-rate schedule, weight
decay groups and gradient clipping, as one typed value (`spec.training.optimizer`, `kareus train`'s
flags).

The defaults are Llama pre-training's as Megatron-LM and torchtitan run it: AdamW with betas
(0.9, 0.95), eps 1e-8, decoupled weight decay 0.1 on matrices only (norm gains and biases are not
decayed; Megatron decays embeddings too, `decay_embeddings` turns that off), global gradient-norm
clipping at 1.0, linear warmup then cosine decay to a tenth of the peak (Llama 2 and 3).

Values the recipe leaves open are resolved per run (`schedule(steps, shape)`):
- the peak `lr` follows the Llama 3 paper by model size (8B 3e-4, 70B 1.5e-4, 405B 8e-5); models
  under 10M parameters (`tiny`, CPU proxies) get 1e-2, the best of a sweep on the built-in corpus
  (docs/runtime.md, "Training recipe");
- `min_lr` is a tenth of the peak;
- `warmup_steps` is 2000 (Llama 2/3, Megatron's Llama examples), at most a tenth of `decay_steps`
  so a short run still spends most of its steps at a useful rate;
- `decay_steps` is the run's steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from kareus.errors import EXIT_CONFIG, KareusError
from kareus.runtime.lr_schedule import SCHEDULES, LrSchedule
from kareus.workload.models import ModelShape

OPTIMIZERS = ("adamw", "sgd")
# Llama 3 (Dubey et al. 2024, table 3 and section 3.4.1) peak rates by model size, and the sweep's best for tiny models.
PEAK_LR_BY_PARAMS = ((10e6, 1e-2), (20e9, 3e-4), (150e9, 1.5e-4), (float("inf"), 8e-5))
DEFAULT_WARMUP_STEPS = 2000
EMBEDDINGS = ("embedding",)


@dataclass(frozen=True)
class OptimizerRecipe:
    """Everything the optimizer step does; None fields are resolved per run (module docstring)."""

    name: str = "adamw"
    lr: float | None = None  # peak
    min_lr: float | None = None
    warmup_steps: int | None = None
    schedule_kind: str = "cosine"
    decay_steps: int | None = None  # counted from step 0, warmup included
    wsd_decay_fraction: float = 0.2
    weight_decay: float = 0.1
    decay_embeddings: bool = True
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad_norm: float = 1.0  # 0: no clipping

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            _bad("name", f"must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        if self.schedule_kind not in SCHEDULES:
            _bad("schedule", f"must be one of {', '.join(SCHEDULES)}, got {self.schedule_kind!r}")
        if self.lr is not None and not 0 <= self.lr <= 10:  # 0: a frozen run (a weights round trip)
            _bad("lr", f"must be in [0, 10], got {self.lr!r}")
        if self.min_lr is not None and not 0 <= self.min_lr <= (self.lr if self.lr is not None else 10):
            _bad("minLr", f"must be in [0, lr], got {self.min_lr!r}")
        for name, value in (("warmupSteps", self.warmup_steps), ("decaySteps", self.decay_steps)):
            if value is not None and value < 0:
                _bad(name, f"must be >= 0, got {value}")
        if self.warmup_steps is not None and self.decay_steps is not None and self.decay_steps < self.warmup_steps:
            _bad("decaySteps", f"must be >= warmupSteps ({self.warmup_steps}), got {self.decay_steps}")
        if not 0 < self.wsd_decay_fraction <= 1:
            _bad("wsdDecayFraction", f"must be in (0, 1], got {self.wsd_decay_fraction!r}")
        if not 0 <= self.weight_decay <= 1:
            _bad("weightDecay", f"must be in [0, 1], got {self.weight_decay!r}")
        for name, value in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0 <= value < 1:
                _bad(name, f"must be in [0, 1), got {value!r}")
        if not 0 < self.eps <= 1:
            _bad("eps", f"must be in (0, 1], got {self.eps!r}")
        if not self.clip_grad_norm >= 0:  # NaN too
            _bad("clipGradNorm", f"must be >= 0 (0: no clipping), got {self.clip_grad_norm!r}")

    @classmethod
    def constant(cls, name: str = "adamw", lr: float = 3e-3) -> OptimizerRecipe:
        """The runtime's recipe before schedules existed: a constant rate, no decay, no clipping."""
        return cls(name=name, lr=lr, min_lr=lr, warmup_steps=0, schedule_kind="constant", weight_decay=0.0,
                   clip_grad_norm=0.0)

    @classmethod
    def from_spec(cls, spec: Any | None) -> OptimizerRecipe:
        """From a `kareus.spec.OptimizerSpec` (None: the defaults); its None fields keep the defaults."""
        if spec is None:
            return cls()
        return cls().with_overrides(**{f.name: getattr(spec, f.name) for f in fields(cls) if hasattr(spec, f.name)})

    def with_overrides(self, **values: Any) -> OptimizerRecipe:
        """This recipe with every non-None value of `values` (flags given on the command line) set."""
        return replace(self, **{k: v for k, v in values.items() if v is not None})

    def peak_lr(self, shape: ModelShape) -> float:
        if self.lr is not None:
            return self.lr
        params = _params(shape)
        return next(lr for limit, lr in PEAK_LR_BY_PARAMS if params < limit)

    def schedule(self, steps: int, shape: ModelShape) -> LrSchedule:
        """The learning-rate schedule of a run of `steps` steps of `shape`."""
        peak = self.peak_lr(shape)
        decay = self.decay_steps if self.decay_steps is not None else steps
        warmup = self.warmup_steps if self.warmup_steps is not None else min(DEFAULT_WARMUP_STEPS, decay // 10)
        floor = self.min_lr if self.min_lr is not None else peak / 10
        if floor > peak:
            _bad("minLr", f"must be at most the peak lr {peak:g}, got {floor!r}")
        return LrSchedule(peak, floor, warmup, max(decay, warmup), self.schedule_kind, self.wsd_decay_fraction)

    def decays(self, name: str, param: torch.Tensor) -> bool:
        """Whether weight decay applies to parameter `name`: matrices, not norm gains or biases
        (vectors); embeddings as `decay_embeddings` says."""
        if param.dim() < 2:
            return False
        return self.decay_embeddings or name.rsplit(".", 1)[-1] not in EMBEDDINGS

    def param_groups(self, params: Mapping[str, torch.Tensor]) -> list[dict[str, Any]]:
        """Two groups, decayed and not (an empty one left out), each with its parameter names."""
        groups = []
        for decayed in (True, False):
            names = [n for n, p in params.items() if self.decays(n, p) == decayed]
            if names:
                groups.append({"params": [params[n] for n in names], "names": names,
                               "weight_decay": self.weight_decay if decayed else 0.0})
        return groups

    def build(self, params: Mapping[str, torch.Tensor], lr: float) -> torch.optim.Optimizer:
        """The optimizer over `params` (by name), starting at rate `lr` (the schedule sets it every step)."""
        groups = self.param_groups(params)
        if self.name == "sgd":
            return torch.optim.SGD(groups, lr=lr)
        return torch.optim.AdamW(groups, lr=lr, betas=(self.beta1, self.beta2), eps=self.eps)

    def describe(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _params(shape: ModelShape) -> float:
    """Parameters of a Llama-style model (per layer: attention and SwiGLU weights; plus embeddings)."""
    per_layer = shape.hidden_size * (shape.q_size + 2 * shape.kv_size) + shape.q_size * shape.hidden_size \
        + 3 * shape.hidden_size * shape.ffn_hidden_size
    tables = 1 if shape.tied_embeddings else 2
    return shape.num_layers * per_layer + tables * shape.vocab_size * shape.hidden_size


def _bad(field: str, message: str) -> None:
    raise KareusError(f"optimizer.{field}: {message}", exit_code=EXIT_CONFIG)
