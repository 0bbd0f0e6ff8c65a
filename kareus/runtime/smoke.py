"""`cuda_smoke()`: the runtime's check on one real GPU (what `bench/device_check.py` calls).

On one GPU there is no tensor-parallel partner, so the partitioned run uses the comm stand-in: an
exact no-op kernel (`x *= 1`) on the comm stream at every all-reduce, launched behind an event at
the planned slot and joined at partition end — the same streams and events as with NCCL. It trains
the same model and data partitioned and sequentially (fp32 or bf16) and reports whether the losses
agree, each mode's iteration time, and the energy per iteration from NVML (simulated without NVML).

`configs` (e.g. `explicit_configs(shape, comm_sms)`: every partition type launched at its last
slot) runs the partitioned mode at explicit launch slots and SM counts instead of the defaults.
On one GPU an SM count is checked and carried to the launch but bounds nothing: the stand-in is
not a collective (`comm_sms_enforced` is False in the result).
"""

from __future__ import annotations

import torch

from kareus.errors import KareusError
from kareus.runtime.engine import backward_segments, forward_segments
from kareus.runtime.layer_ops import LayerProgram
from kareus.runtime.optimizer_recipe import OptimizerRecipe
from kareus.runtime.parallel import init_distributed
from kareus.runtime.schedule import Schedule
from kareus.runtime.trainer import TrainConfig, run_rank
from kareus.workload.models import ModelShape, get_preset
from kareus.workload.partitions import PartitionConfig

LOSS_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # bf16 reorders roundings between the modes


def explicit_configs(shape: ModelShape, comm_sms: int, *, cp: int = 1) -> dict[str, PartitionConfig]:
    """Every partition type the engine runs for `shape` (forward and backward), launched at the
    last slot all its segments share (the latest launch) on `comm_sms` SMs."""
    program = LayerProgram.llama(shape.qk_norm)
    layers = range(shape.num_layers)
    slots: dict[str, list[str]] = {}
    for segment in (*forward_segments(program, layers, cp), *backward_segments(program, layers, cp)):
        if segment.comm is None:
            continue  # the trailing partitions launch at their start; the planner does not configure them
        names = list(dict.fromkeys(segment.slots))
        for key in segment.keys:
            slots[key] = [s for s in slots[key] if s in names] if key in slots else names
    return {key: PartitionConfig(names[-1], comm_sms) for key, names in slots.items() if names}


def cuda_smoke(*, steps: int = 6, preset: str = "tiny", seq_len: int = 256, micro_batch_size: int = 8,
               num_microbatches: int = 2, dtype: str = "float32",
               configs: dict[str, PartitionConfig] | None = None) -> dict:
    """Train partitioned (comm stand-in; default configs, or `configs`) and sequentially on GPU 0;
    compare. Needs CUDA."""
    if not torch.cuda.is_available():
        raise KareusError("cuda_smoke needs a CUDA GPU; none is visible")
    config = TrainConfig(shape=get_preset(preset), seq_len=seq_len, micro_batch_size=micro_batch_size,
                         num_microbatches=num_microbatches, steps=steps,
                         recipe=OptimizerRecipe.constant("sgd", 0.1), device="cuda", comm_standin=True, dtype=dtype)
    ctx = init_distributed(config.layout, device="cuda")
    runs = {}
    for mode in ("sequential", "partitioned"):
        schedule = Schedule.uniform(1, num_microbatches, mode=mode,
                                    configs=configs if mode == "partitioned" else None)
        result, _ = run_rank(ctx, config, schedule)
        runs[mode] = result
    seq, part = runs["sequential"], runs["partitioned"]
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(part.losses, seq.losses, strict=True))
    steady = slice(1, None)  # the first step includes CUDA/cuBLAS warm-up
    return {
        "device": torch.cuda.get_device_name(0),
        "steps": steps,
        "dtype": dtype,
        "configs": {k: [c.launch_slot, c.comm_sms] for k, c in sorted((configs or {}).items())} or "default",
        "comm_sms_enforced": False,
        "losses_match": worst <= LOSS_TOLERANCE.get(dtype, 1e-4),
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
