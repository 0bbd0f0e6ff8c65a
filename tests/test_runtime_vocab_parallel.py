"""Vocab-parallel embedding, output layer and cross-entropy (issue 44 item 3).

A TP rank holds vocab/tp rows of the embedding and output layer, its logits are its vocabulary
slice only, and the loss and every gradient equal the replicated (TP1) computation. TP2 and TP4 run
as real gloo process groups on the embedding + head alone (no layers: the block's TP math is
tested in test_runtime_dist), so each spawn is a few seconds.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kareus.errors import EXIT_CONFIG, KareusError
from kareus.runtime.comm import GroupComm
from kareus.runtime.model import StageLayout, StageModel, shard
from kareus.runtime.parallel import spawn_local
from kareus.workload.models import get_preset
from kareus.workload.ops import nonpartition_forward

torch.set_num_threads(1)
TINY = get_preset("tiny")  # vocab 256, hidden 64
BATCH, SEQ = 2, 16
# The head alone (no layers) on one stage: embedding -> final norm -> output layer -> loss.
HEAD_ONLY = StageLayout(0, 1, 0, 0)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, TINY.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    return tokens, torch.roll(tokens, -1, 1)


def _logit_shapes(model: StageModel, hidden: torch.Tensor, targets: torch.Tensor,
                  comm: GroupComm | None) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """The loss, and the shapes of every activation (not a parameter) autograd saves computing it."""
    saved: list[tuple[int, ...]] = []
    weights = {p.data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in weights:
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.head_loss(hidden, targets, 1 / targets.numel(), comm)
    return loss, saved


def _run(model: StageModel, comm: GroupComm | None) -> dict:
    tokens, targets = _batch()
    hidden = model.embed(tokens, comm)
    # A non-trivial hidden state (the embeddings alone are N(0, 0.02²): every logit near zero).
    hidden = hidden * 30.0
    loss, shapes = _logit_shapes(model, hidden, targets, comm)
    loss.backward()
    return {"loss": loss.detach(), "shapes": shapes,
            "grads": {n: p.grad.detach().clone() for n, p in model.named_model_params().items()}}


def _worker(rank: int, store, tp: int, shape, out: str) -> None:
    dist.init_process_group("gloo", store=store, rank=rank, world_size=tp)
    model = StageModel(shape, HEAD_ONLY, tp=tp, tp_rank=rank, seed=7)
    result = _run(model, GroupComm(dist.group.WORLD, tp))
    result["rows"] = {n: tuple(p.shape) for n, p in model.named_model_params().items()}
    torch.save(result, Path(out) / f"rank{rank}.pt")


def _reference(shape) -> dict:
    return _run(StageModel(shape, HEAD_ONLY, seed=7), None)


@pytest.mark.parametrize("tp,tied", [(2, False), (4, False), (2, True)], ids=["tp2", "tp4", "tp2-tied"])
def test_vocab_parallel_equals_replicated(tmp_path, tp, tied):
    shape = replace(TINY, tied_embeddings=tied, num_kv_heads=4)  # 4 K/V heads: TP4 divides them
    spawn_local(tp, _worker, tp, shape, str(tmp_path))
    ref = _reference(shape)
    vocab, h, tokens = shape.vocab_size, shape.hidden_size, BATCH * SEQ
    assert max(torch.Size(s).numel() for s in ref["shapes"]) == tokens * vocab  # TP1: full-vocabulary logits
    for rank in range(tp):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-6, atol=0)
        tables = ("embedding",) if tied else ("embedding", "output")
        for name in tables:
            assert got["rows"][name] == (vocab // tp, h)
        # No activation spans the vocabulary: the largest is this rank's logits slice, 1/tp of TP1's.
        assert all(vocab not in s for s in got["shapes"]), got["shapes"]
        assert max(torch.Size(s).numel() for s in got["shapes"]) == tokens * vocab // tp
        for name, grad in got["grads"].items():
            expected = shard(name, ref["grads"][name], shape, rank, tp)
            scale = float(expected.abs().max())
            assert scale > 0, name
            torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-6 * scale, msg=f"rank {rank} {name}")


def test_a_rank_holds_its_vocabulary_rows_and_the_op_graph_prices_them():
    """A TP2 rank holds vocab/2 rows of the embedding and the output layer, the same per-rank output
    GEMM that the simulator's op graph (`kareus.workload.ops.nonpartition_forward`) prices."""
    full = StageModel(TINY, HEAD_ONLY, seed=7).named_model_params()
    tokens = BATCH * SEQ
    for rank in range(2):
        params = StageModel(TINY, HEAD_ONLY, tp=2, tp_rank=rank, seed=7).named_model_params()
        rows = slice(rank * TINY.vocab_size // 2, (rank + 1) * TINY.vocab_size // 2)
        for name in ("embedding", "output"):
            assert params[name].shape == (TINY.vocab_size // 2, TINY.hidden_size)
            assert torch.equal(params[name], full[name][rows])
        output_gemm = next(op for op in nonpartition_forward(TINY, tp=2, tokens=tokens, first=True, last=True)
                           if op.name == "output")
        assert (output_gemm.cols, output_gemm.depth) == tuple(params["output"].shape)
        assert output_gemm.rows == tokens


def test_a_vocabulary_the_tensor_degree_does_not_divide_is_refused():
    with pytest.raises(KareusError, match=r"spec.model.vocab=255 is not divisible by tensor parallelism 2") as info:
        StageModel(replace(TINY, vocab_size=255), HEAD_ONLY, tp=2, tp_rank=0)
    assert info.value.exit_code == EXIT_CONFIG


@pytest.mark.parametrize("layout", ["row-shards", "replicated-before"])
def test_a_checkpoints_vocabulary_rows_join_into_the_table(tmp_path, layout):
    """`--init-from` / export join a checkpoint's TP row shards of a table; a checkpoint written
    before the vocab-parallel layers (the whole table under every TP rank's key) still reads."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from kareus.runtime.init_from import KareusReader

    table = torch.randn(TINY.vocab_size, TINY.hidden_size, generator=torch.Generator().manual_seed(1))
    pieces = table.chunk(2) if layout == "row-shards" else (table, table)
    state = {f"model/output/tp{r}of2": piece.clone() for r, piece in enumerate(pieces)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    assert torch.equal(KareusReader(tmp_path, TINY).full("output"), table)
