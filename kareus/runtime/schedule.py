"""The runtime's schedule: per pipeline stage, the ordered instructions and how to run each.

A plain value type, independent of the plan file, so tests and other trainers can build schedules
directly. `Schedule.from_plan(plan)` reads a `kareus.plan.Plan`; `Schedule.uniform(...)` builds
the synchronous 1F1B order with one clock and mode for every instruction (what runs when there is
no plan); `as_sequential()` keeps the clocks and drops the partition configs (`--schedule
sequential`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from kareus.errors import KareusError
from kareus.plan import Plan, one_f_one_b
from kareus.workload.partitions import PartitionConfig

KINDS = ("forward", "backward")
MODES = ("partitioned", "sequential")


@dataclass(frozen=True)
class RunInstruction:
    """One forward or backward pass of one microbatch on one stage."""

    kind: str
    microbatch: int
    clock_mhz: int | None = None
    mode: str = "partitioned"
    configs: Mapping[str, PartitionConfig] = field(default_factory=dict)
    recompute_configs: Mapping[str, PartitionConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise KareusError(f"instruction kind must be one of {KINDS}, got {self.kind!r}")
        if self.mode not in MODES:
            raise KareusError(f"instruction mode must be one of {MODES}, got {self.mode!r}")

    def label(self, stage: int) -> str:
        """The name used in clock requests and logs, e.g. `stage1/backward/3`."""
        return f"stage{stage}/{self.kind}/{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    """`stages[s]` is stage s's instruction order for one iteration."""

    stages: tuple[tuple[RunInstruction, ...], ...]
    num_microbatches: int

    def __post_init__(self) -> None:
        self.check()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def check(self) -> None:
        """Every stage runs each microbatch's forward once, then its backward once."""
        for s, instructions in enumerate(self.stages):
            seen: set[tuple[str, int]] = set()
            for i, ins in enumerate(instructions):
                where = f"schedule stage {s} instruction {i}"
                if not 0 <= ins.microbatch < self.num_microbatches:
                    raise KareusError(f"{where}: microbatch must be in 0..{self.num_microbatches - 1}, "
                                      f"got {ins.microbatch}")
                if (ins.kind, ins.microbatch) in seen:
                    raise KareusError(f"{where}: {ins.kind} of microbatch {ins.microbatch} appears twice")
                if ins.kind == "backward" and ("forward", ins.microbatch) not in seen:
                    raise KareusError(f"{where}: backward of microbatch {ins.microbatch} before its forward")
                seen.add((ins.kind, ins.microbatch))
            if len(seen) != 2 * self.num_microbatches:
                raise KareusError(f"schedule stage {s}: needs a forward and a backward of each of "
                                  f"{self.num_microbatches} microbatches, got {len(seen)} instructions")

    @classmethod
    def uniform(cls, num_stages: int, num_microbatches: int, *, mode: str = "partitioned",
                clock_mhz: int | None = None, configs: Mapping[str, PartitionConfig] | None = None) -> Schedule:
        """Synchronous 1F1B, every instruction with the same clock, mode and partition configs
        (`configs` holds forward and backward types; recompute uses the forward ones)."""
        configs = dict(configs or {})
        stages = tuple(
            tuple(RunInstruction(kind, m, clock_mhz, mode, _for(configs, kind), _for(configs, "forward")
                                 if kind == "backward" else {})
                  for kind, m in one_f_one_b(num_stages, num_microbatches, s))
            for s in range(num_stages))
        return cls(stages, num_microbatches)

    @classmethod
    def from_plan(cls, plan: Plan) -> Schedule:
        stages = tuple(
            tuple(RunInstruction(i.kind, i.microbatch, i.clock_mhz, i.mode, dict(i.configs), dict(i.recompute_configs))
                  for i in stage.instructions)
            for stage in sorted(plan.stages, key=lambda st: st.stage))
        return cls(stages, plan.job.num_micro_batches)

    def as_sequential(self) -> Schedule:
        """Same order and clocks, Megatron-style sequential execution everywhere."""
        return replace(self, stages=tuple(
            tuple(replace(i, mode="sequential", configs={}, recompute_configs={}) for i in stage)
            for stage in self.stages))

    def comm_sms_in_use(self) -> set[int]:
        """Every SM count any instruction asks for (one NCCL communicator each)."""
        return {c.comm_sms for stage in self.stages for i in stage
                for c in (*i.configs.values(), *i.recompute_configs.values())}


def _for(configs: Mapping[str, PartitionConfig], kind: str) -> dict[str, PartitionConfig]:
    prefix = "fwd_" if kind == "forward" else "bwd_"
    return {k: v for k, v in configs.items() if k.startswith(prefix)}
