"""Data-parallel gradients are summed bucket by bucket, never through one buffer of all of them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kareus.runtime import Schedule, TrainConfig, gradsync, run_rank
from kareus.runtime.gradsync import buckets
from kareus.runtime.optimizer_recipe import OptimizerRecipe
from kareus.runtime.parallel import init_distributed, spawn_local
from kareus.workload.models import get_preset

torch.set_num_threads(1)
TINY = get_preset("tiny")
BUCKET_BYTES = 40_000  # a few of the tiny model's tensors per bucket; its largest (fc1, 90 KB) alone


def test_buckets_keep_order_respect_the_size_and_never_mix_dtypes():
    f32 = [torch.zeros(100), torch.zeros(100), torch.zeros(300)]  # 400, 400, 1200 bytes
    f16 = torch.zeros(10, dtype=torch.float16)
    got = buckets([*f32, f16, torch.zeros(10)], bucket_bytes=800)
    assert [[t.numel() for t in b] for b in got] == [[100, 100], [300], [10], [10]]
    assert got[0][0] is f32[0] and got[2][0] is f16
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        buckets(f32, bucket_bytes=0)


def _config(dp: int, m: int = 2) -> TrainConfig:
    return TrainConfig(shape=TINY, seq_len=16, dp=dp, micro_batch_size=2, num_microbatches=m, steps=3, seed=4,
                       recipe=OptimizerRecipe.constant("sgd", 0.5), device="cpu")


def _worker(rank: int, store, out: str) -> None:
    sizes: list[int] = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, group=None, **kwargs):
        if group is not None:  # the gradient group; step reductions use the world
            sizes.append(tensor.numel() * tensor.element_size())
        return real_all_reduce(tensor, *args, group=group, **kwargs)

    config = _config(2)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(gradsync, "BUCKET_BYTES", BUCKET_BYTES)
        monkeypatch.setattr(dist, "all_reduce", recording_all_reduce)
        ctx = init_distributed(config.layout, rank=rank, store=store, device="cpu")
        result, model = run_rank(ctx, config, Schedule.uniform(1, 2, mode="sequential"), keep_model=True)
    param_sizes = [p.numel() * p.element_size() for p in model.parameters()]
    torch.save({"losses": result.losses, "sizes": sizes, "param_sizes": param_sizes}, Path(out) / f"rank{rank}.pt")


def test_dp_gradients_are_summed_in_buckets_and_train_as_one_process(tmp_path):
    """Fails on the one-flat-buffer sync: its single all-reduce holds every gradient at once."""
    spawn_local(2, _worker, str(tmp_path))
    saved = torch.load(tmp_path / "rank0.pt")
    steps = _config(2).steps
    per_step = len(saved["sizes"]) // steps
    assert per_step > 3 and len(saved["sizes"]) == per_step * steps
    # No buffer beyond a bucket, except a single tensor larger than one (summed in place, uncopied).
    assert all(size <= BUCKET_BYTES or size in saved["param_sizes"] for size in saved["sizes"])
    assert sum(saved["sizes"][:per_step]) == sum(saved["param_sizes"])  # every gradient, each once
    one = _config(1, m=4)  # the same global batch in one process
    reference, _ = run_rank(init_distributed(one.layout, device="cpu"), one, Schedule.uniform(1, 4, mode="sequential"))
    torch.testing.assert_close(torch.tensor(saved["losses"]), torch.tensor(reference.losses), rtol=1e-5, atol=1e-7)
