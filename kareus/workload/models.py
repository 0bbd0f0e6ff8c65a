"""Model shapes: the Llama-style decoder dimensions every other part of Kareus reads.

A `ModelShape` is all that the op graph, the simulator and the PyTorch runtime need to know about
a model. Presets cover the paper's models (Llama 3.2 3B, Qwen3 1.7B, the 70B emulation), Llama 3.1
8B and a tiny model for tests and the quickstart; explicit shapes come from the job spec.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from kareus.errors import KareusError

# RoPE scaling kinds the runtime implements, by their Hugging Face `rope_type` name.
ROPE_SCALING_TYPES = ("llama3",)


@dataclass(frozen=True)
class RopeScaling:
    """How a model stretches its rotary frequencies past the context it was pre-trained on.

    `llama3` (Llama 3.1/3.2/3.3): wavelengths shorter than `original_max_position_embeddings /
    high_freq_factor` keep their frequency, those longer than `... / low_freq_factor` are divided by
    `factor`, and the band between is interpolated smoothly between the two. Other kinds are named
    in `ROPE_SCALING_TYPES` as they are implemented."""

    type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.type not in ROPE_SCALING_TYPES:
            raise KareusError(f"rope scaling type {self.type!r} is not implemented; allowed: "
                              f"{', '.join(ROPE_SCALING_TYPES)}")
        if not self.factor >= 1 or not 0 < self.low_freq_factor < self.high_freq_factor:
            raise KareusError(f"rope scaling needs factor >= 1 and 0 < lowFreqFactor < highFreqFactor, got "
                              f"factor {self.factor}, lowFreqFactor {self.low_freq_factor}, highFreqFactor "
                              f"{self.high_freq_factor}")
        if self.original_max_position_embeddings < 1:
            raise KareusError(f"rope scaling originalMaxPositionEmbeddings must be >= 1, got "
                              f"{self.original_max_position_embeddings}")

    def scale(self, inv_freq: list[float]) -> list[float]:
        """The scaled inverse frequencies (radians per position) of `inv_freq`."""
        context = self.original_max_position_embeddings
        low_wavelen, high_wavelen = context / self.low_freq_factor, context / self.high_freq_factor
        out = []
        for freq in inv_freq:
            wavelen = 2 * math.pi / freq
            if wavelen < high_wavelen:
                out.append(freq)
            elif wavelen > low_wavelen:
                out.append(freq / self.factor)
            else:
                smooth = (context / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
                out.append((1 - smooth) * freq / self.factor + smooth * freq)
        return out


# The released Llama 3.1 8B / 3.3 70B and Llama 3.2 3B configs (their config.json's rope_scaling).
LLAMA31_ROPE = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
LLAMA32_ROPE = RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    qk_norm: bool = False
    tied_embeddings: bool = False
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    rope_scaling: RopeScaling | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def with_layers(self, num_layers: int) -> ModelShape:
        return replace(self, num_layers=num_layers)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values by attribute name; `rope_scaling` only when set, so the documents made
        before it existed (plans, profile keys, checkpoint manifests) read and hash the same."""
        out: dict[str, Any] = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "rope_scaling"}
        if self.rope_scaling is not None:
            out["rope_scaling"] = asdict(self.rope_scaling)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelShape:
        values = dict(data)
        if values.get("rope_scaling") is not None:
            values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
        return cls(**values)


PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        # The released models' Hugging Face configs (config.json), rope scaling included.
        ModelShape("llama3.2-3b", 28, 3072, 8192, 24, 8, 128, 128256, tied_embeddings=True,
                   rope_scaling=LLAMA32_ROPE),
        ModelShape("qwen3-1.7b", 28, 2048, 6144, 16, 8, 128, 151936, qk_norm=True, tied_embeddings=True,
                   rope_theta=1000000.0, norm_eps=1e-6),
        ModelShape("llama3.1-8b", 32, 4096, 14336, 32, 8, 128, 128256, rope_scaling=LLAMA31_ROPE),
        ModelShape("llama3.3-70b", 80, 8192, 28672, 64, 8, 128, 128256, rope_scaling=LLAMA31_ROPE),
        # Byte-level vocabulary: the runtime's built-in corpus tokenizes to bytes.
        ModelShape("tiny", 4, 64, 176, 4, 2, 16, 256, rope_theta=10000.0),
    )
}


# Workloads the simulator is calibrated on that are not job presets (the job spec's preset enum,
# and so the CRD, lists only `PRESETS`). GPT-3 175B (Brown et al. 2020: 96 layers, hidden 12288,
# 96 heads of 128, GELU MLP of 4·hidden, vocabulary 50257) in the Llama-style op graph: full
# multi-head attention, and a SwiGLU MLP of 8/3·hidden whose weights and FLOPs equal GPT-3's
# (two 4h matrices = three 8h/3 ones). Perseus' A100 profiles measure one of its pipeline stages.
CALIBRATION_PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("gpt3-175b", 96, 12288, 32768, 96, 96, 128, 50257, rope_theta=10000.0),
    )
}


def get_shape(name: str) -> ModelShape:
    """A job preset or a calibration workload (simulator commands accept both)."""
    if name in CALIBRATION_PRESETS:
        return CALIBRATION_PRESETS[name]
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted([*PRESETS, *CALIBRATION_PRESETS]))
        raise KareusError(f"unknown model preset {name!r}; allowed: {known}") from None


def get_preset(name: str) -> ModelShape:
    """The preset called `name`; a `KareusError` listing the known presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise KareusError(f"unknown model preset {name!r}; allowed: {known}") from None
