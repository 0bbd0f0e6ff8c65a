"""Token data of `kareus train`: npy, flat bin (uint16/uint32, memory-mapped) and Megatron-LM's
indexed dataset; bad files get one error naming the field; each data-parallel rank reads only its
own sequences; a resume on other data is refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import yaml

from kareus.cli import main as cli_main
from kareus.errors import KareusError
from kareus.runtime import train
from kareus.runtime.data import Batcher, infer_format, load_data
from kareus.spec import load_job

VOCAB = 256


def write_megatron(prefix, documents: list[list[int]], dtype=np.uint16, *, code: int | None = None) -> None:
    """An indexed dataset as Megatron-LM's `_IndexWriter` writes one: `MMIDIDX\\0\\0`, version 1 (<Q), the
    dtype code (<B), sequence and document counts (<Q), sequence lengths (int32), byte pointers
    (int64), document indices (int64); the tokens concatenated in the `.bin`."""
    codes = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7,
             np.uint16: 8}
    arrays = [np.asarray(doc, dtype=dtype) for doc in documents]
    with open(f"{prefix}.bin", "wb") as f:
        for array in arrays:
            f.write(array.tobytes(order="C"))
    lengths = np.array([a.size for a in arrays], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize)])
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", codes[dtype] if code is None else code))
        f.write(struct.pack("<Q", len(arrays)))
        f.write(struct.pack("<Q", len(arrays) + 1))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.astype(np.int64).tobytes(order="C"))
        f.write(np.arange(len(arrays) + 1, dtype=np.int64).tobytes(order="C"))


def test_npy_is_memory_mapped_and_must_hold_integers(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.int32).reshape(10, 10) % VOCAB)
    data = load_data(tmp_path / "t.npy", VOCAB)
    assert data.format == "npy" and isinstance(data.tokens, np.memmap) and data.tokens.tolist() == list(range(100))
    np.save(tmp_path / "f.npy", np.ones(10, dtype=np.float32))
    with pytest.raises(KareusError, match=r"--data .*f\.npy: cannot read tokens \(npy\): dtype float32: "
                                          r"token ids must be integers"):
        load_data(tmp_path / "f.npy", VOCAB)


def test_flat_bin_is_uint16_when_the_vocabulary_fits_else_uint32(tmp_path):
    ids = np.array([0, 5, 255, 70000, 3], dtype=np.uint32)
    ids.tofile(tmp_path / "t.bin")
    wide = load_data(tmp_path / "t.bin", 100_000)  # beyond uint16: uint32 by default
    assert wide.format == "bin" and wide.tokens.dtype == np.uint32 and wide.tokens.tolist() == ids.tolist()
    ids[3] = 7
    ids.astype(np.uint16).tofile(tmp_path / "n.bin")
    narrow = load_data(tmp_path / "n.bin", VOCAB)
    assert narrow.tokens.dtype == np.uint16 and narrow.tokens.tolist() == ids.tolist()
    as32 = load_data(tmp_path / "t.bin", 100_000, "bin", "uint32")
    assert as32.tokens.tolist()[3] == 70000


def test_a_wrong_dtype_or_ids_beyond_the_vocabulary_name_the_field(tmp_path):
    np.array([1, 2, 300], dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(KareusError, match=r"--data .*t\.bin \(bin, uint16\): token ids must be in 0\.\.255 "
                                          r"\(the model's vocabulary\), found 1\.\.300"):
        load_data(tmp_path / "t.bin", VOCAB)
    # uint16 ids read as uint32: two ids make one, far beyond the vocabulary.
    np.array([1, 2, 300, 4], dtype=np.uint16).tofile(tmp_path / "w.bin")
    with pytest.raises(KareusError, match=r"\(bin, uint32\): token ids must be in 0\.\.99999 .*found 131073\.\.262444"):
        load_data(tmp_path / "w.bin", 100_000)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(KareusError, match="3 bytes is not a whole number of uint16 tokens"):
        load_data(tmp_path / "odd.bin", VOCAB)
    with pytest.raises(KareusError, match="--data-format must be one of npy, bin, megatron, bytes, got 'parquet'"):
        load_data(tmp_path / "t.bin", VOCAB, "parquet")
    with pytest.raises(KareusError, match="--data-dtype 'int8': only for --data-format bin, one of uint16, uint32"):
        load_data(tmp_path / "t.bin", VOCAB, "bin", "int8")
    with pytest.raises(KareusError, match=r"--data .*missing\.bin: cannot read tokens \(bin\)"):
        load_data(tmp_path / "missing.bin", VOCAB)


def test_megatron_indexed_dataset_reads_its_documents_as_one_stream(tmp_path):
    documents = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    write_megatron(tmp_path / "corpus_text_document", documents, np.int32)
    for path in ("corpus_text_document", "corpus_text_document.bin", "corpus_text_document.idx"):
        assert infer_format(tmp_path / path) == "megatron"
        data = load_data(tmp_path / path, VOCAB)
        assert data.format == "megatron" and data.tokens.dtype == np.int32
        assert data.tokens.tolist() == [t for doc in documents for t in doc]
    assert data.identity == {"format": "megatron", "tokens": 9, "dtype": "int32", "order": "epochs"}


@pytest.mark.parametrize("damage,message", [
    ("magic", "is not a Megatron indexed dataset index"),
    ("float", "dtype float32: token ids must be integers"),
    ("short", "has 10 bytes, its index says 6 uint16 tokens (12 bytes)"),
    ("code", "unknown token type code 99"),
])
def test_a_bad_megatron_dataset_is_one_error(tmp_path, damage, message):
    prefix = tmp_path / "c"
    if damage == "float":
        write_megatron(prefix, [[1.0, 2.0]], np.float32)
    else:
        write_megatron(prefix, [[1, 2, 3], [4, 5, 6]], np.uint16, code=99 if damage == "code" else None)
    if damage == "magic":
        idx = bytearray((tmp_path / "c.idx").read_bytes())
        idx[0:7] = b"NOTIDX!"
        (tmp_path / "c.idx").write_bytes(bytes(idx))
    if damage == "short":
        (tmp_path / "c.bin").write_bytes((tmp_path / "c.bin").read_bytes()[:10])
    with pytest.raises(KareusError, match="cannot read tokens") as error:
        load_data(prefix, VOCAB, "megatron")
    assert message in str(error.value)


class _Recording:
    """A token array that records which windows were read."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens, self.read = tokens, []

    @property
    def size(self) -> int:
        return self.tokens.size

    def __getitem__(self, window: slice) -> np.ndarray:
        self.read.append(window.start)
        return self.tokens[window]


def test_each_data_parallel_rank_reads_only_its_own_sequences():
    tokens = np.arange(5000) % VOCAB
    whole = Batcher(tokens, 16, 2, 2, dp=2, seed=4)
    reads = []
    for rank in (0, 1):
        recording = _Recording(tokens)
        mine = Batcher(recording, 16, 2, 2, dp=2, seed=4).microbatches(7, rank)  # type: ignore[arg-type]
        assert len(recording.read) == 4  # 2 microbatches × 2 sequences: half the global batch
        reads.append(recording.read)
        for (x, y), (wx, wy) in zip(mine, whole.microbatches(7, rank), strict=True):
            assert torch.equal(x, wx) and torch.equal(y, wy)
    assert not set(reads[0]) & set(reads[1])  # the other half is the other rank's
    single = _Recording(tokens)
    Batcher(single, 16, 2, 4, dp=1, seed=4).microbatches(7, 0)  # type: ignore[arg-type]
    assert single.read == reads[0] + reads[1]  # together: the global batch, in order


def _job(tmp_path, name: str = "data-test") -> str:
    job = {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob", "metadata": {"name": name},
           "spec": {"model": {"preset": "tiny"}, "sequenceLength": 16,
                    "parallelism": {"tensor": 1, "pipeline": 1, "context": 1, "data": 1,
                                    "microBatchSize": 2, "numMicroBatches": 1},
                    "objective": {"maxThroughput": {}},
                    # constant rates: a run extended from 3 to 7 steps continues with the same ones
                    "training": {"image": "x", "steps": 2, "gpusPerNode": 1, "nodes": 1,
                                 "optimizer": {"schedule": "constant", "lr": 3e-3, "warmupSteps": 0,
                                               "weightDecay": 0, "clipGradNorm": 0}}}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def test_kareus_train_reads_a_megatron_dataset_and_refuses_one_beyond_the_vocabulary(tmp_path, capsys):
    rng = np.random.default_rng(0)
    write_megatron(tmp_path / "ok", [rng.integers(0, VOCAB, 300).tolist() for _ in range(4)])
    job_path = _job(tmp_path)
    assert cli_main(["train", job_path, "--steps", "2", "--data", str(tmp_path / "ok"), "--data-format",
                     "megatron", "--json"]) == 0
    assert '"steps": 2' in capsys.readouterr().out
    write_megatron(tmp_path / "big", [[1, 2, 3] * 100, [256] * 10])
    assert cli_main(["train", job_path, "--steps", "1", "--data", str(tmp_path / "big.bin")]) == 78  # retrying cannot fix it
    err = capsys.readouterr().err.strip()
    assert err.startswith("kareus: error: --data") and "(megatron, uint16): token ids must be in 0..255" in err
    assert "\n" not in err


def test_a_resume_goes_on_in_the_files_epochs_and_refuses_other_data(tmp_path):
    rng = np.random.default_rng(1)
    np.save(tmp_path / "a.npy", rng.integers(0, VOCAB, 170))  # 10 samples of 16: 7 steps of 2 run into a second epoch
    np.save(tmp_path / "b.npy", np.arange(3000) % VOCAB)
    job = load_job(_job(tmp_path))
    ckpt, data = str(tmp_path / "ckpt"), str(tmp_path / "a.npy")
    reference = train(job, steps=7, job_name=job.name, data_path=data).losses
    first = train(job, steps=3, job_name=job.name, data_path=data, checkpoint_dir=ckpt, checkpoint_every=3)
    resumed = train(job, steps=7, job_name=job.name, data_path=data, checkpoint_dir=ckpt)
    assert first.losses == reference[:3] and resumed.first_step == 3
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(resumed.losses, reference[3:], strict=True))
    with pytest.raises(KareusError, match=r"not this run's: data\.tokens: checkpoint 170, this run 3000"):
        train(job, steps=9, job_name=job.name, data_path=str(tmp_path / "b.npy"), checkpoint_dir=ckpt)


def test_token_files_are_read_in_epochs_every_sample_once():
    seq, tokens = 8, np.arange(8 * 12 + 1) % VOCAB  # 12 samples
    batcher = Batcher(tokens, seq, 2, 1, dp=2, seed=5, order="epochs")  # global batch 4: an epoch is 3 steps
    assert batcher.num_samples == 12
    seen = [x[:, 0].tolist() for step in range(6) for rank in (0, 1) for x, _ in batcher.microbatches(step, rank)]
    first, second = sorted(t for b in seen[:6] for t in b), sorted(t for b in seen[6:] for t in b)
    assert first == second == [(i * seq) % VOCAB for i in range(12)]  # each epoch: every sample once
    assert [t for b in seen[:6] for t in b] != [t for b in seen[6:] for t in b]  # reshuffled per epoch
    x, y = batcher.microbatches(0, 0)[0]
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.shape == (2, seq)
    # The step is the position: a fresh batcher (a resumed run) at step 4 reads what this one reads.
    again = Batcher(tokens, seq, 2, 1, dp=2, seed=5, order="epochs")
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again.microbatches(4, 1), batcher.microbatches(4, 1),
                                                        strict=True))
    # Any (data, microbatches) split of the global batch sees the same sequences.
    one = Batcher(tokens, seq, 2, 2, dp=1, seed=5, order="epochs").microbatches(4, 0)
    assert [b[0].tolist() for b in one] == [b[0].tolist() for r in (0, 1) for b in batcher.microbatches(4, r)]
    with pytest.raises(KareusError, match="data order must be one of"):
        Batcher(tokens, seq, 2, 1, order="sorted")
