"""What the device check's `cuda_smoke` section runs, checked on CPU: the runtime imports without
the optimizer stack, and `explicit_configs` names launch slots and SM counts the engine accepts
(partitioned at those configs equals sequential)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kareus.runtime.optimizer_recipe import OptimizerRecipe
from kareus.runtime.parallel import init_distributed
from kareus.runtime.schedule import Schedule
from kareus.runtime.smoke import LOSS_TOLERANCE, cuda_smoke, explicit_configs
from kareus.runtime.trainer import TrainConfig, run_rank
from kareus.workload.models import get_preset

BLOCKED = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pymoo", "xgboost", "scipy", "kopf", "kubernetes", "sklearn"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import kareus.runtime.smoke
"""


def test_the_runtime_smoke_imports_without_the_optimizer_stack():
    done = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_explicit_configs_cover_every_configured_type_at_its_last_shared_slot():
    configs = explicit_configs(get_preset("tiny"), 8)
    assert sorted(configs) == ["bwd_attn", "bwd_mlp", "fwd_attn", "fwd_mlp"]
    assert {c.comm_sms for c in configs.values()} == {8}
    assert all(c.launch_slot != "norm_0" for c in configs.values())  # not the default first slot


def test_explicit_configs_run_and_match_sequential_on_cpu():
    config = TrainConfig(shape=get_preset("tiny"), seq_len=32, micro_batch_size=2, num_microbatches=2, steps=2,
                         recipe=OptimizerRecipe.constant("sgd", 0.1), device="cpu")
    ctx = init_distributed(config.layout, device="cpu")
    configs = explicit_configs(config.shape, 4)
    part, _ = run_rank(ctx, config, Schedule.uniform(1, 2, mode="partitioned", configs=configs))
    seq, _ = run_rank(ctx, config, Schedule.uniform(1, 2, mode="sequential"))
    assert part.losses == pytest.approx(seq.losses, rel=LOSS_TOLERANCE["float32"])


def test_cuda_smoke_refuses_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(Exception, match="needs a CUDA GPU"):
        cuda_smoke(dtype="bfloat16", configs=explicit_configs(get_preset("tiny"), 8))
