"""The PyTorch training runtime: a Llama-style model executing a Kareus plan.

What training pods run (`kareus train`). A plan says, per pipeline instruction (forward or backward
of one microbatch on one stage), the GPU clock, whether to run it *partitioned* — two nanobatches,
each collective of one overlapping the other's computation, launched at the planned slot with the
planned comm SMs — or *sequential* (Megatron-style), and the partition configs.

Modules, one idea each:
- `layer_ops`: the ops of a layer over named channels (shared by both execution modes);
- `model`: a stage's TP-sharded parameters, deterministic whatever the layout; embedding and loss;
- `engine`: the partitioned overlap engine (op-level manual backward) and the sequential block;
- `comm`: async TP/CP collectives (gloo on CPU; CUDA comm stream, events, CTA-bounded NCCL groups);
- `schedule`: the runtime's instruction lists (from a plan, or uniform 1F1B);
- `follower`: `PlanFollower`, the hooks any training loop can call to follow a schedule;
- `pipeline`: one stage executing its instructions with point-to-point sends;
- `parallel`: rank layout, process groups, torchrun environment, local spawning;
- `data`, `energy`, `metrics`: tokens and batches; iteration energy; train.jsonl and Prometheus;
- `trainer`: `TrainConfig`, `run_rank`, and `train(job, plan) -> TrainResult`.
"""

from kareus.runtime.follower import ClockRequest, PlanFollower
from kareus.runtime.schedule import RunInstruction, Schedule
from kareus.runtime.trainer import TrainConfig, TrainResult, build_schedule, run_rank, train

__all__ = [
    "ClockRequest",
    "PlanFollower",
    "RunInstruction",
    "Schedule",
    "TrainConfig",
    "TrainResult",
    "build_schedule",
    "run_rank",
    "train",
]
