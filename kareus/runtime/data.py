"""Training data: a token stream and deterministic batches drawn from it.

Tokens come from a file or from a small built-in corpus. A `.npy` file holds token ids; any other
file is read as bytes, i.e. tokenized by the byte-level tokenizer (vocabulary 256, what the `tiny`
preset uses). The built-in corpus is synthetic English generated from a small grammar with a
fixed seed: repetitive enough that a tiny model's loss drops within a few dozen steps.

Batches are windows of `seq_len + 1` tokens (inputs and next-token targets) at offsets drawn from
`(seed, step)`. The global batch of a step is a list of sequences; data-parallel rank d,
microbatch m takes sequences `(d·M + m)·mbs …` so any (data, microbatches) split of the same
global batch sees the same sequences — a DP2×M2 run equals a single-process M4 run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from kareus.errors import KareusError

BYTE_VOCAB = 256
_SUBJECTS = ("the cat", "a dog", "the old man", "my friend", "the engineer", "a small bird", "the GPU")
_VERBS = ("sees", "likes", "builds", "finds", "trains", "follows", "measures")
_OBJECTS = ("the red ball", "a new model", "the long road", "energy", "the clock", "a quiet river")
_ENDINGS = (".", " today.", " again.", " at night.", " with care.")


def builtin_corpus(num_sentences: int = 4000, seed: int = 1234) -> bytes:
    """Synthetic sentences from a tiny grammar (fixed seed: the corpus never changes)."""
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(num_sentences):
        parts.append(f"{_SUBJECTS[rng.integers(len(_SUBJECTS))]} {_VERBS[rng.integers(len(_VERBS))]} "
                     f"{_OBJECTS[rng.integers(len(_OBJECTS))]}{_ENDINGS[rng.integers(len(_ENDINGS))]}\n")
    return "".join(parts).encode()


def load_tokens(path: str | Path | None, vocab_size: int) -> np.ndarray:
    """Token ids (int64) from `path` (None: the built-in corpus), checked against the vocabulary."""
    if path is None:
        tokens = np.frombuffer(builtin_corpus(), dtype=np.uint8).astype(np.int64)
    else:
        path = Path(path)
        try:
            if path.suffix == ".npy":
                tokens = np.load(path).astype(np.int64).ravel()
            else:
                tokens = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int64)
        except (OSError, ValueError) as error:
            raise KareusError(f"--data {path}: cannot read tokens: {error}") from None
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise KareusError(f"--data: token ids must be in 0..{vocab_size - 1} (the model's vocabulary), "
                          f"found {tokens.min()}..{tokens.max()}")
    return tokens


@dataclass(frozen=True)
class Batcher:
    """Deterministic microbatches of one data-parallel rank."""

    tokens: np.ndarray
    seq_len: int
    micro_batch_size: int
    num_microbatches: int
    dp: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tokens.size < self.seq_len + 2:
            raise KareusError(f"--data: {self.tokens.size} tokens are too few for sequences of "
                              f"{self.seq_len} (need at least {self.seq_len + 2})")

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.num_microbatches * self.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def microbatches(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> list[tuple[Tensor, Tensor]]:
        """(inputs, targets) `[mbs, seq]` for each microbatch of `dp_rank` at `step`."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.tokens.size - self.seq_len - 1, size=self.global_batch_size)
        windows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts])
        windows = torch.from_numpy(windows).to(device)
        per_rank = self.num_microbatches * self.micro_batch_size
        mine = windows[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        return [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(self.micro_batch_size)]
