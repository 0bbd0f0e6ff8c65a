"""`cuda_smoke()`: the runtime's check on one real GPU (what `bench/gpu_check.py` can call).

On one GPU there is no tensor-parallel partner, so the partitioned run uses the comm stand-in: an
exact no-op kernel (`x *= 1`) on the comm stream at every all-reduce, launched behind an event at
the planned slot and joined at partition end — the same streams and events as with NCCL. It trains
the same model and data partitioned and sequentially (fp32) and reports whether the losses agree,
each mode's iteration time, and the energy per iteration from NVML (simulated without NVML).
"""

from __future__ import annotations

import torch

from kareus.errors import KareusError
from kareus.runtime.parallel import init_distributed
from kareus.runtime.schedule import Schedule
from kareus.runtime.trainer import TrainConfig, run_rank
from kareus.workload.models import get_preset


def cuda_smoke(*, steps: int = 6, preset: str = "tiny", seq_len: int = 256, micro_batch_size: int = 8,
               num_microbatches: int = 2) -> dict:
    """Train partitioned (comm stand-in) and sequentially on GPU 0; compare. Needs CUDA."""
    if not torch.cuda.is_available():
        raise KareusError("cuda_smoke needs a CUDA GPU; none is visible")
    config = TrainConfig(shape=get_preset(preset), seq_len=seq_len, micro_batch_size=micro_batch_size,
                         num_microbatches=num_microbatches, steps=steps, optimizer="sgd", lr=0.1,
                         device="cuda", comm_standin=True)
    ctx = init_distributed(config.layout, device="cuda")
    runs = {}
    for mode in ("sequential", "partitioned"):
        result, _ = run_rank(ctx, config, Schedule.uniform(1, num_microbatches, mode=mode))
        runs[mode] = result
    seq, part = runs["sequential"], runs["partitioned"]
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(part.losses, seq.losses, strict=True))
    steady = slice(1, None)  # the first step includes CUDA/cuBLAS warm-up
    return {
        "device": torch.cuda.get_device_name(0),
        "steps": steps,
        "losses_match": worst <= 1e-4,
        "max_relative_loss_diff": worst,
        "sequential_iteration_s": _mean(seq.iteration_time_s[steady]),
        "partitioned_iteration_s": _mean(part.iteration_time_s[steady]),
        "sequential_energy_j": _mean(seq.energy_j[steady]),
        "partitioned_energy_j": _mean(part.energy_j[steady]),
        "energy_source": part.energy_source,
        "losses": list(part.losses),
    }


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")
