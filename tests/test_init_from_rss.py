"""`--init-from` keeps a rank's host memory to its shard plus one full tensor.

A Hugging Face checkpoint of a model large enough to show it (hidden 1024, FFN 4096, vocabulary
4096, 2 layers, fp32: 168 MB) is written, and one TP8 rank loads its stage in a fresh process
(`bench/init_from_rss.py`): its peak resident memory (VmHWM, reset before the load, every weight
touched after it) stays within its shard plus the largest full tensor, far below the checkpoint.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from kareus.workload.models import ModelShape

BENCH = Path(__file__).resolve().parent.parent / "bench" / "init_from_rss.py"


def _bench():
    spec = importlib.util.spec_from_file_location("init_from_rss", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_tp8_rank_holds_its_shard_plus_one_full_tensor(tmp_path):
    bench = _bench()
    shape = ModelShape("rss", 2, 1024, 4096, 8, 8, 128, 4096)
    written = bench.write_model(tmp_path / "hf", shape, torch.float32)
    result = bench.measure_in_child(str(tmp_path / "hf"), 8, 3, 1, 0, "float32")
    assert result["peak_rss_above_start_bytes"] <= result["bound_bytes"], result
    assert result["peak_rss_above_start_bytes"] < written / 2, result  # nowhere near the whole checkpoint
    assert result["shard_bytes"] < written / 3
