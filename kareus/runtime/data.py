"""Training data: a token stream and deterministic batches drawn from it.

Tokens come from a file or from a small built-in corpus. File formats (`--data-format`, or from
the name when it is not given):

- `npy`: a NumPy array of integer token ids (memory-mapped, any shape, read flat).
- `bin`: a flat file of little-endian token ids, `uint16` when the model's vocabulary fits in it,
  else `uint32` (`--data-dtype` overrides), memory-mapped — what nanoGPT and llm.c write.
- `megatron`: Megatron-LM's indexed dataset, `PREFIX.bin` + `PREFIX.idx` (the path may be the prefix
  or either file); its documents, concatenated in order, are the stream (as Megatron's GPT dataset
  packs them), the token type is the index's.
- `bytes`: any other file, read as bytes, i.e. tokenized by the byte-level tokenizer (vocabulary
  256, what the `tiny` preset uses).

Every file is checked whole before training: integer ids, all below the model's vocabulary (a wrong
`--data-dtype` shows up here). The built-in corpus is synthetic English generated from a small
grammar with a fixed seed: repetitive enough that a tiny model's loss drops within a few dozen steps.

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

from dataclasses import dataclass, field
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


FORMATS = ("npy", "bin", "megatron", "bytes")
ORDERS = ("random", "epochs")
BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# Megatron-LM's MMapIndexedDataset index (megatron/core/datasets/indexed_dataset.py): magic, version
# 1, the token type's code, sequence and document counts, then their arrays.
_MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                    7: np.float32, 8: np.uint16}
_CHECK_CHUNK = 1 << 24  # tokens per chunk of the whole-file vocabulary check


@dataclass(frozen=True)
class TokenData:
    """A run's token stream and what it is (a checkpoint records `identity` and resumes only on the same)."""

    tokens: np.ndarray  # flat integer ids, possibly memory-mapped
    format: str

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
    path = Path(path)
    data_format = data_format or infer_format(path)
    if data_format not in FORMATS:
        raise KareusError(f"--data-format must be one of {', '.join(FORMATS)}, got {data_format!r}")
    if dtype is not None and (data_format != "bin" or dtype not in BIN_DTYPES):
        raise KareusError(f"--data-dtype {dtype!r}: only for --data-format bin, one of {', '.join(BIN_DTYPES)}")
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
    return TokenData(tokens, data_format)


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
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    index, data = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    with index.open("rb") as f:
        header = f.read(len(_MEGATRON_MAGIC) + 8 + 1 + 8 + 8)
    if len(header) < 34 or header[:9] != _MEGATRON_MAGIC:
        raise ValueError(f"{index} is not a Megatron indexed dataset index (no MMIDIDX header)")
    version = int.from_bytes(header[9:17], "little")
    code = header[17]
    sequences = int.from_bytes(header[18:26], "little")
    if version != 1:
        raise ValueError(f"{index}: index version {version}, this reader knows version 1")
    if code not in _MEGATRON_DTYPES:
        raise ValueError(f"{index}: unknown token type code {code}")
    dtype = np.dtype(_MEGATRON_DTYPES[code])
    if dtype.kind not in "iu":
        raise ValueError(f"{index}: dtype {dtype.name}: token ids must be integers")
    lengths = np.memmap(index, dtype=np.int32, mode="r", offset=34, shape=(sequences,)) if sequences else []
    total = int(np.sum(lengths, dtype=np.int64))
    size = data.stat().st_size
    if size != total * dtype.itemsize:
        raise ValueError(f"{data} has {size} bytes, its index says {total} {dtype.name} tokens "
                         f"({total * dtype.itemsize} bytes)")
    return np.memmap(data, dtype=dtype, mode="r") if total else np.zeros(0, dtype=dtype)


def _check_ids(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    """Every id in 0..vocab-1, the whole file in chunks (a memory map is never loaded at once)."""
    if not tokens.size:
        return
    chunks = [tokens[start:start + _CHECK_CHUNK] for start in range(0, tokens.size, _CHECK_CHUNK)]
    low, high = min(int(c.min()) for c in chunks), max(int(c.max()) for c in chunks)
    if low < 0 or high >= vocab_size:
        raise KareusError(f"{what}: token ids must be in 0..{vocab_size - 1} (the model's vocabulary), "
                          f"found {low}..{high}")


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
