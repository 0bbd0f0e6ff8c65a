"""Model shapes: the Llama-style decoder dimensions every other part of Kareus reads.

A `ModelShape` is all that the op graph, the simulator and the PyTorch runtime need to know about
a model. Presets cover the paper's models (Llama 3.2 3B, Qwen3 1.7B, the 70B emulation), Llama 3.1
8B and a tiny model for tests and the quickstart; explicit shapes come from the job spec.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kareus.errors import KareusError


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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def with_layers(self, num_layers: int) -> ModelShape:
        return replace(self, num_layers=num_layers)


PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        # Hugging Face configs of the released models.
        ModelShape("llama3.2-3b", 28, 3072, 8192, 24, 8, 128, 128256, tied_embeddings=True),
        ModelShape("qwen3-1.7b", 28, 2048, 6144, 16, 8, 128, 151936, qk_norm=True, tied_embeddings=True,
                   rope_theta=1000000.0, norm_eps=1e-6),
        ModelShape("llama3.1-8b", 32, 4096, 14336, 32, 8, 128, 128256),
        ModelShape("llama3.3-70b", 80, 8192, 28672, 64, 8, 128, 128256),
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
