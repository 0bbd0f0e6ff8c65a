"""Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`), read and written without Megatron.

The format is megatron-core's `megatron.core.datasets.indexed_dataset` (`_IndexWriter`,
`_IndexReader`): the `.bin` holds the token ids of every sequence back to back; the `.idx` is the
header `MMIDIDX\\0\\0`, version 1 (<Q), the token type's code (<B), the sequence and document counts
(<Q), then the sequence lengths (int32), their byte offsets in the `.bin` (int64) and the document
indices (int64: the sequence each document starts at, then the sequence count); a multimodal
dataset's int8 sequence modes may follow. `read_megatron_index` reads it (checking that the
sequences tile the `.bin` in order, which reading it as one token stream assumes); `MegatronWriter`
writes one with each document one sequence, byte for byte what megatron-core's
`IndexedDatasetBuilder.add_document` writes (tested against megatron-core 0.16.1, a test
dependency only: the runtime's image does not carry Megatron Core for one file format).

`PREFIX.json` beside it is Kareus' own record of the tokenizer that made it (`kareus.data.prepare`).
Neither torch nor the runtime is imported here, so preparing data starts in well under a second.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kareus.errors import EXIT_CONFIG, KareusError

MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                    7: np.float32, 8: np.uint16}
CODES = {np.dtype(t): code for code, t in DTYPES.items()}
# Megatron's `DType.optimal_dtype`: uint16 below 65500 ids (its margin under 2^16), else int32.
UINT16_BELOW = 65500
_CHECK_CHUNK = 1 << 22  # index entries per chunk of the checks


def metadata_path(path: str | Path) -> Path:
    """`PREFIX.json` of a Megatron dataset given as its prefix or either of its files."""
    path = Path(path)
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    return Path(f"{prefix}.json")


@dataclass(frozen=True)
class MegatronIndex:
    """A Megatron-LM indexed dataset as its `.idx` describes it (megatron-core's `_IndexReader`)."""

    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32, tokens per sequence
    sequence_pointers: np.ndarray  # int64, byte offset of each sequence in the `.bin`
    document_indices: np.ndarray  # int64, sequence index where each document starts (+ the end)
    bin_path: Path

    def tokens(self) -> np.ndarray:
        """The `.bin` as one stream of ids (memory-mapped)."""
        total = int(np.sum(self.sequence_lengths, dtype=np.int64))
        return np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(total,)) if total else \
            np.zeros(0, dtype=self.dtype)

    def sequence(self, i: int) -> np.ndarray:
        """Sequence `i` as megatron-core's `IndexedDataset[i]` returns it."""
        return np.memmap(self.bin_path, dtype=self.dtype, mode="r", offset=int(self.sequence_pointers[i]),
                         shape=(int(self.sequence_lengths[i]),)) if self.sequence_lengths[i] else \
            np.zeros(0, dtype=self.dtype)


def read_megatron_index(path: str | Path) -> MegatronIndex:
    """The index of the dataset at `path` (its prefix or either file), checked against its `.bin`:
    the sequences must tile the file in order, which is what reading it as one stream assumes."""
    path = Path(path)
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    index, data = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    with index.open("rb") as f:
        header = f.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES or header[:9] != MAGIC:
        raise ValueError(f"{index} is not a Megatron indexed dataset index (no MMIDIDX header)")
    version, code, sequences, documents = struct.unpack("<QBQQ", header[9:])
    if version != 1:
        raise ValueError(f"{index}: index version {version}, this reader knows version 1")
    if code not in DTYPES:
        raise ValueError(f"{index}: unknown token type code {code}")
    dtype = np.dtype(DTYPES[code])
    if dtype.kind not in "iu":
        raise ValueError(f"{index}: dtype {dtype.name}: token ids must be integers")
    # Then sequence lengths (int32), pointers (int64), document indices (int64); a multimodal
    # dataset's int8 modes may follow and are not read.
    needed = HEADER_BYTES + 12 * sequences + 8 * documents
    if index.stat().st_size < needed:
        raise ValueError(f"{index}: {index.stat().st_size} bytes, its header promises {sequences} sequences "
                         f"and {documents} document indices ({needed} bytes)")
    # Mapped, not loaded: a corpus of 10^8 documents has 2 GB of index, and every rank opens it.
    lengths, pointers, doc_index = (
        np.memmap(index, dtype=kind, mode="r", offset=start, shape=(count,)) if count else np.zeros(0, kind)
        for kind, start, count in (("<i4", HEADER_BYTES, sequences),
                                   ("<i8", HEADER_BYTES + 4 * sequences, sequences),
                                   ("<i8", HEADER_BYTES + 12 * sequences, documents)))
    total = _check_tiling(index, data, dtype, lengths, pointers)
    if documents and (doc_index[0] != 0 or doc_index[-1] != sequences or any(
            np.any(np.diff(doc_index[a:a + _CHECK_CHUNK + 1]) < 0) for a in range(0, documents, _CHECK_CHUNK))):
        raise ValueError(f"{index}: document indices must rise from 0 to the {sequences} sequences")
    size = data.stat().st_size
    if size != total * dtype.itemsize:
        raise ValueError(f"{data} has {size} bytes, its index says {total} {dtype.name} tokens "
                         f"({total * dtype.itemsize} bytes)")
    return MegatronIndex(dtype, lengths, pointers, doc_index, data)


def _check_tiling(index: Path, data: Path, dtype: np.dtype, lengths: np.ndarray, pointers: np.ndarray) -> int:
    """Tokens in all sequences, after checking, a chunk at a time, that each starts where the one
    before it ends (the running sum of the lengths): what reading the `.bin` as one stream assumes."""
    running = 0
    for start in range(0, lengths.size, _CHECK_CHUNK):
        chunk = np.asarray(lengths[start:start + _CHECK_CHUNK], dtype=np.int64)
        ends = np.cumsum(chunk) + running
        if chunk.min() < 0 or np.any(np.asarray(pointers[start:start + _CHECK_CHUNK]) != (ends - chunk) * dtype.itemsize):
            raise ValueError(f"{index}: its sequences do not follow each other in {data} (pointers are not the "
                             "running sum of the lengths)")
        running = int(ends[-1])
    return running


def token_dtype(vocab_size: int) -> np.dtype:
    """The token type megatron-core picks for a tokenizer's vocabulary (`DType.optimal_dtype`)."""
    return np.dtype(np.uint16 if vocab_size < UINT16_BELOW else np.int32)


class MegatronWriter:
    """Writes a Megatron-LM indexed dataset one document at a time, each document one sequence
    (what megatron-core's `IndexedDatasetBuilder.add_document` makes without sentence splitting).

    Memory stays bounded whatever the corpus: tokens go to `PREFIX.bin` as they come, the
    per-document lengths to a side file (4 bytes a document), and `close()` streams the index from
    it in chunks. Files are written under temporary names and renamed by `close()`, so an
    interrupted run leaves no dataset that looks whole."""

    _CHUNK = 1 << 20  # sequences per chunk when the index is assembled

    def __init__(self, prefix: str | Path, dtype: np.dtype | type) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES or self.dtype.kind not in "iu":
            raise KareusError(f"Megatron token type must be an integer type of {sorted(str(d) for d in CODES)}, "
                              f"got {self.dtype}", exit_code=EXIT_CONFIG)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = Path(f"{self.prefix}.bin.tmp")
        self._lengths_tmp = Path(f"{self.prefix}.lengths.tmp")
        self._bin = self._bin_tmp.open("wb")
        self._lengths = self._lengths_tmp.open("wb")
        self.documents = 0
        self.tokens = 0
        self._info = np.iinfo(self.dtype)

    def add_document(self, ids: Iterable[int] | np.ndarray) -> None:
        array = np.asarray(ids)
        if array.size and (int(array.min()) < self._info.min or int(array.max()) > self._info.max):
            raise KareusError(f"token ids {int(array.min())}..{int(array.max())} do not fit the dataset's "
                              f"{self.dtype.name}",
                              exit_code=EXIT_CONFIG)
        self._bin.write(array.astype(self.dtype.newbyteorder("<"), copy=False).tobytes(order="C"))
        self._lengths.write(np.int32(array.size).astype("<i4").tobytes())
        self.documents += 1
        self.tokens += int(array.size)

    def close(self) -> tuple[Path, Path]:
        """Finish the index; returns (`.bin`, `.idx`)."""
        self._bin.close()
        self._lengths.close()
        n = self.documents
        idx_tmp = Path(f"{self.prefix}.idx.tmp")
        with idx_tmp.open("wb") as out:
            out.write(MAGIC + struct.pack("<QBQQ", 1, CODES[self.dtype], n, n + 1))
            lengths = np.memmap(self._lengths_tmp, dtype="<i4", mode="r", shape=(n,)) if n else np.zeros(0, "<i4")
            for start in range(0, n, self._CHUNK):
                out.write(np.ascontiguousarray(lengths[start:start + self._CHUNK]).tobytes())
            pointer = 0
            for start in range(0, n, self._CHUNK):
                chunk = np.asarray(lengths[start:start + self._CHUNK], dtype=np.int64) * self.dtype.itemsize
                ends = np.cumsum(chunk) + pointer
                out.write((ends - chunk).astype("<i8").tobytes())
                pointer = int(ends[-1])
            for start in range(0, n + 1, self._CHUNK):
                out.write(np.arange(start, min(start + self._CHUNK, n + 1), dtype="<i8").tobytes())
            del lengths
        bin_path, idx_path = Path(f"{self.prefix}.bin"), Path(f"{self.prefix}.idx")
        os.replace(self._bin_tmp, bin_path)
        os.replace(idx_tmp, idx_path)
        self._lengths_tmp.unlink()
        return bin_path, idx_path

    def abort(self) -> None:
        """Drop what was written (an error mid-way)."""
        self._bin.close()
        self._lengths.close()
        for tmp in (self._bin_tmp, self._lengths_tmp, Path(f"{self.prefix}.idx.tmp")):
            tmp.unlink(missing_ok=True)
