"""Training data: a token stream and deterministic batches drawn from it.

Tokens come from a file or from a small built-in corpus. File formats (`--data-format`, or from
the name when it is not given):

- `npy`: a NumPy array of integer token ids (memory-mapped, any shape, read flat).
- `bin`: a flat file of little-endian token ids, `uint16` when the model's vocabulary fits in it,
  else `uint32` (`--data-dtype` overrides), memory-mapped — what nanoGPT and llm.c write.
- `megatron`: Megatron-LM's indexed dataset, `PREFIX.bin` + `PREFIX.idx` (the path may be the prefix
  or either file); its documents, concatenated in order, are the stream (as Megatron's GPT dataset
  packs them), the token type is the index's (`kareus.data.megatron` reads it; its writer is
  what `kareus data prepare` uses; both are checked against megatron-core's in the tests). A
  `PREFIX.json` next to it (written by `kareus data prepare`) names the tokenizer and its
  vocabulary: a tokenizer larger than the model's vocabulary is refused before any id is read.
- `bytes`: any other file, read as bytes, i.e. tokenized by the byte-level tokenizer (vocabulary
  256, what the `tiny` preset uses).

Every file is checked whole before training: integer ids, all below the model's vocabulary (a wrong
`--data-dtype` shows up here). The built-in corpus is synthetic English generated from a small
grammar with a fixed seed: repetitive enough that a tiny model's loss drops within a few dozen steps.
It is byte-level, so it is only a corpus for a byte-level model (vocabulary 256, the `tiny` preset)
or a CPU proxy; the trainer refuses a real model without data (`builtin_corpus_allowed`).

Batches are windows of `seq_len + 1` tokens (inputs and next-token targets). From a token file
(npy, bin, megatron) they are read in epochs, as Megatron-LM does: the file is cut into
non-overlapping samples at multiples of `seq_len`, each epoch visits every sample once in an order
drawn from `(seed, epoch)`, and step k takes the k-th global batch of that sequence. From the
built-in corpus and byte files they are windows at offsets drawn from `(seed, step)` (as before:
the demo corpus is small and repetitive). The global batch of a step is a list of sequences; data-parallel rank d,
microbatch m takes sequences `(d·M + m)·mbs …` so any (data, microbatches) split of the same
global batch sees the same sequences — a DP2×M2 run equals a single-process M4 run. A rank reads
only its own windows from the memory-mapped file. The step is the data position: a run resumed at
step N (`kareus.runtime.checkpoint`) reads what an uninterrupted run reads from step N on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from kareus.data import megatron
from kareus.errors import EXIT_CONFIG, KareusError

BYTE_VOCAB = 256
BUILTIN_SOURCE = "builtin-corpus"  # what train.jsonl's data_source says without --data
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


FORMATS = ("npy", "bin", "megatron", "bytes")
ORDERS = ("random", "epochs")
BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_CHECK_CHUNK = 1 << 24  # tokens per chunk of the whole-file vocabulary check


@dataclass(frozen=True)
class TokenData:
    """A run's token stream and what it is (a checkpoint records `identity` and resumes only on the same)."""

    tokens: np.ndarray  # flat integer ids, possibly memory-mapped
    format: str
    source: str = BUILTIN_SOURCE  # the path as given, or the built-in corpus (not in `identity`: mounts move)
    tokenizer: dict | None = None  # the dataset's `PREFIX.json` tokenizer record, when it has one

    @property
    def order(self) -> str:
        """How batches are drawn: token files (npy, bin, megatron) in epochs, as Megatron-LM and
        torchtitan read a corpus; the built-in corpus and byte files as random windows."""
        return "epochs" if self.format in ("npy", "bin", "megatron") else "random"

    @property
    def identity(self) -> dict[str, object]:
        return {"format": self.format, "tokens": int(self.tokens.size), "dtype": str(self.tokens.dtype),
                "order": self.order}


def load_tokens(path: str | Path | None, vocab_size: int) -> np.ndarray:
    """Token ids from `path` (None: the built-in corpus), its format from its name, checked against
    the vocabulary."""
    return load_data(path, vocab_size).tokens


def load_data(path: str | Path | None, vocab_size: int, data_format: str | None = None,
              dtype: str | None = None) -> TokenData:
    """The token stream of `path` in `data_format` (None: from the name; see the module docstring)."""
    if path is None:
        return TokenData(np.frombuffer(builtin_corpus(), dtype=np.uint8), "builtin")
    source = str(path)
    path = Path(path)
    data_format = data_format or infer_format(path)
    if data_format not in FORMATS:
        raise KareusError(f"--data-format must be one of {', '.join(FORMATS)}, got {data_format!r}")
    if dtype is not None and (data_format != "bin" or dtype not in BIN_DTYPES):
        raise KareusError(f"--data-dtype {dtype!r}: only for --data-format bin, one of {', '.join(BIN_DTYPES)}")
    tokenizer = read_metadata(path, vocab_size) if data_format == "megatron" else None
    try:
        if data_format == "npy":
            tokens = _npy(path)
        elif data_format == "bin":
            tokens = _flat_bin(path, BIN_DTYPES[dtype] if dtype else _bin_dtype(vocab_size))
        elif data_format == "megatron":
            tokens = _megatron(path)
        else:
            tokens = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    except (OSError, ValueError) as error:
        raise KareusError(f"--data {path}: cannot read tokens ({data_format}): {error}") from None
    _check_ids(tokens, vocab_size, f"--data {path} ({data_format}, {tokens.dtype})")
    return TokenData(tokens, data_format, source, tokenizer)


def builtin_corpus_allowed(vocab_size: int, proxy: bool) -> bool:
    """The built-in corpus is byte-level: a corpus for a byte-level model (the `tiny` preset's
    vocabulary) or a CPU proxy (a plumbing run), never a stand-in for a real model's text."""
    return proxy or vocab_size == BYTE_VOCAB


def read_metadata(path: str | Path, vocab_size: int) -> dict | None:
    """The tokenizer record of the dataset at `path` (None without a `PREFIX.json`), refused when
    its vocabulary is larger than the model's: ids the embedding has no row for would appear in
    any later document, so the check does not wait for one."""
    meta = megatron.metadata_path(path)
    if not meta.exists():
        return None
    try:
        record = json.loads(meta.read_text())
        tokenizer = record["tokenizer"]
        tokenizer_vocab = int(tokenizer["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise KareusError(f"--data {path}: {meta} is not a `kareus data prepare` record ({error!r})",
                          exit_code=EXIT_CONFIG) from None
    if tokenizer_vocab > vocab_size:
        raise KareusError(f"--data {path}: its tokenizer {tokenizer.get('name', '?')!r} has a vocabulary of "
                          f"{tokenizer_vocab} ({meta}), larger than the model's {vocab_size}: the model's "
                          f"vocabulary (spec.model vocab) must be at least the tokenizer's", exit_code=EXIT_CONFIG)
    return tokenizer


def infer_format(path: Path) -> str:
    """`.npy` → npy; a Megatron `.bin`/`.idx` pair (or its prefix) → megatron; other `.bin` → bin; else bytes."""
    if path.suffix == ".npy":
        return "npy"
    if path.suffix in (".bin", ".idx") and path.with_suffix(".idx").exists() and path.with_suffix(".bin").exists():
        return "megatron"
    if path.suffix == ".bin":
        return "bin"
    if not path.suffix and Path(f"{path}.idx").exists():
        return "megatron"
    return "bytes"


def _bin_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _npy(path: Path) -> np.ndarray:
    tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    if tokens.dtype.kind not in "iu":
        raise ValueError(f"dtype {tokens.dtype}: token ids must be integers")
    return tokens.reshape(-1)


def _flat_bin(path: Path, dtype: type) -> np.ndarray:
    size = path.stat().st_size
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        raise ValueError(f"{size} bytes is not a whole number of {np.dtype(dtype).name} tokens")
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _megatron(path: Path) -> np.ndarray:
    """The `.bin` of a Megatron indexed dataset as one stream, after checking it against its `.idx`."""
    return megatron.read_megatron_index(path).tokens()


def _check_ids(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    """Every id in 0..vocab-1, the whole file in chunks (a memory map is never loaded at once)."""
    if not tokens.size:
        return
    chunks = [tokens[start:start + _CHECK_CHUNK] for start in range(0, tokens.size, _CHECK_CHUNK)]
    low, high = min(int(c.min()) for c in chunks), max(int(c.max()) for c in chunks)
    if low < 0 or high >= vocab_size:
        raise KareusError(f"{what}: token ids must be in 0..{vocab_size - 1} (the model's vocabulary), "
                          f"found {low}..{high}", exit_code=EXIT_CONFIG)


@dataclass(frozen=True)
class Batcher:
    """Deterministic microbatches of one data-parallel rank."""

    tokens: np.ndarray
    seq_len: int
    micro_batch_size: int
    num_microbatches: int
    dp: int = 1
    seed: int = 0
    order: str = "random"  # random: windows anywhere; epochs: every sample once per epoch, shuffled
    _permutations: dict[int, np.ndarray] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise KareusError(f"data order must be one of {ORDERS}, got {self.order!r}")
        if self.tokens.size < self.seq_len + 2:
            raise KareusError(f"--data: {self.tokens.size} tokens are too few for sequences of "
                              f"{self.seq_len} (need at least {self.seq_len + 2})")

    @property
    def num_samples(self) -> int:
        """Non-overlapping samples of an epoch: windows at multiples of `seq_len` (each shares its
        last token, the last target, with the next one's first input, as Megatron's GPT samples do)."""
        return (self.tokens.size - 1) // self.seq_len

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.num_microbatches * self.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def microbatches(self, step: int, dp_rank: int, device: torch.device | str = "cpu") -> list[tuple[Tensor, Tensor]]:
        """(inputs, targets) `[mbs, seq]` for each microbatch of `dp_rank` at `step`."""
        starts = self._starts(step)
        per_rank = self.num_microbatches * self.micro_batch_size
        mine = starts[dp_rank * per_rank:(dp_rank + 1) * per_rank]  # only these pages of a mapped file are read
        windows = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64) for s in mine])
        windows = torch.from_numpy(windows).to(device)
        return [(mb[:, :-1], mb[:, 1:]) for mb in windows.split(self.micro_batch_size)]

    def _starts(self, step: int) -> np.ndarray:
        """Token offsets of the global batch's sequences at `step`."""
        if self.order == "random":
            rng = np.random.default_rng([self.seed, step])
            return rng.integers(0, self.tokens.size - self.seq_len - 1, size=self.global_batch_size)
        # Samples consumed before this step: the step is the position in the (epoch, sample) order.
        first = step * self.global_batch_size
        epochs, within = np.divmod(np.arange(first, first + self.global_batch_size), self.num_samples)
        return np.array([self._permutation(int(e))[w] for e, w in zip(epochs, within, strict=True)],
                        dtype=np.int64) * self.seq_len

    def _permutation(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s sample order from `(seed, epoch)`; the two latest are kept (a step can span two)."""
        if epoch not in self._permutations:
            if len(self._permutations) >= 2:
                self._permutations.pop(min(self._permutations))
            kind = np.int32 if self.num_samples < 1 << 31 else np.int64
            self._permutations[epoch] = np.random.default_rng([self.seed, 1 << 20, epoch]).permutation(
                self.num_samples).astype(kind)
        return self._permutations[epoch]
