"""The learning rate as a pure function of the step: linear warmup, then constant, linear, cosine or
warmup-stable-decay (WSD) down to a minimum.

The schedule has no state besides the step it is asked about, and the step is what a checkpoint
records, so a resumed run continues the schedule exactly (no scheduler object to save or restore).

`lr(step)` is the rate of optimizer step `step` (0-based). Warmup rises linearly over the first
`warmup_steps` steps, reaching the peak at the last of them (`peak · (step + 1) / warmup_steps`,
so the first step is never wasted at lr 0, as torchtitan does it). After warmup, with progress
`p = (step − warmup) / (decay_steps − warmup)` clipped to [0, 1] (Megatron-LM's
`OptimizerParamScheduler` counts `decay_steps` from step 0, warmup included):

- constant: the peak, whatever `p`;
- linear:   `min + (peak − min) · (1 − p)`;
- cosine:   `min + (peak − min) · (1 + cos(π p)) / 2` (Megatron's and torchtitan's Llama default);
- wsd:      the peak until the last `wsd_decay_fraction` of the post-warmup steps, then linear to
            `min` (warmup-stable-decay, MiniCPM / Hägele et al. 2024).

From `decay_steps` on the rate stays at `min_lr` (except constant).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kareus.errors import EXIT_CONFIG, KareusError

SCHEDULES = ("constant", "linear", "cosine", "wsd")


@dataclass(frozen=True)
class LrSchedule:
    """Peak and floor rates, warmup and decay lengths in optimizer steps, and the decay's shape."""

    peak_lr: float
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_steps: int = 1
    kind: str = "cosine"
    wsd_decay_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            _bad("schedule", f"must be one of {', '.join(SCHEDULES)}, got {self.kind!r}")
        if not self.peak_lr >= 0:  # 0: a frozen run
            _bad("lr", f"must be >= 0, got {self.peak_lr!r}")
        if not 0 <= self.min_lr <= self.peak_lr:
            _bad("minLr", f"must be in [0, lr = {self.peak_lr:g}], got {self.min_lr!r}")
        if self.warmup_steps < 0:
            _bad("warmupSteps", f"must be >= 0, got {self.warmup_steps}")
        if self.decay_steps < self.warmup_steps:
            _bad("decaySteps", f"must be >= warmupSteps ({self.warmup_steps}): the decay counts from step 0, "
                               f"warmup included, got {self.decay_steps}")
        if not 0 < self.wsd_decay_fraction <= 1:
            _bad("wsdDecayFraction", f"must be in (0, 1], got {self.wsd_decay_fraction!r}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.peak_lr
        span = self.decay_steps - self.warmup_steps
        if self.kind == "wsd":
            # The stable phase keeps the peak; only the last fraction of the span decays.
            decay_len = max(1, round(self.wsd_decay_fraction * span)) if span else 0
            start = self.decay_steps - decay_len
            progress = 1.0 if decay_len == 0 else min(1.0, max(0.0, (step - start) / decay_len))
            return self.min_lr + (self.peak_lr - self.min_lr) * (1.0 - progress)
        progress = 1.0 if span == 0 else min(1.0, (step - self.warmup_steps) / span)
        factor = 1.0 - progress if self.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.peak_lr - self.min_lr) * factor


def _bad(field: str, message: str) -> None:
    raise KareusError(f"optimizer.{field}: {message}", exit_code=EXIT_CONFIG)
