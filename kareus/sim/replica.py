"""One data-parallel replica's iteration on the simulated GPU: the twin's what-ifs of slower GPUs.

A replica is one pipeline: per stage its instructions in issue order (anything with `kind`,
`microbatch`, `clock_mhz`, `mode`, `configs`, `recompute_configs`: a plan's `Instruction` or the
runtime's `RunInstruction`). `replica_iteration` runs each instruction through
`Simulator.instruction` and takes the finish time of the 1F1B pipeline DAG over them
(F(s,m) after F(s−1,m), B(s,m) after B(s+1,m), each stage in its own order).

Two ways a GPU is slower than its preset, both through the simulator's public API:

- a **clock ceiling** (`clock_ceiling_mhz`): every requested clock is capped — a GPU that cannot
  hold its boost clock (thermal throttling, a lower application clock, a weaker part). The
  ceiling may be fractional: it stands for the average clock such a GPU holds. This is the
  straggler of `kareus sim straggler` and of the runtime's `KAREUS_SIM_STRAGGLER` test knob;
  `ceiling_for_slowdown` finds the ceiling that makes an iteration a given fraction slower;
- a **board power limit** (`power_limited(gpu, watts)`, what `nvidia-smi -pl` sets): the preset
  with another `power_limit_w`, which the simulator's power controller throttles to, phase by
  phase (`kareus.sim.clock`). `kareus sim power-budget` uses it for the uniform per-GPU limit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kareus.errors import KareusError
from kareus.sim.gpus import GPUSpec
from kareus.sim.simulator import Simulator
from kareus.workload.partitions import PartitionConfig, Workload

_BISECTION_STEPS = 40


@dataclass(frozen=True)
class ReplicaIteration:
    """One iteration of one replica: its pipeline time and each stage's effective energy per GPU."""

    time_s: float
    stage_effective_energy_j: tuple[float, ...]
    p_static_w: float

    def stage_gpu_energy_j(self, iteration_s: float | None = None) -> tuple[float, ...]:
        """Energy of one GPU of each stage, static power paid for `iteration_s` (default: its own
        time; a replica waiting for a slower one at the gradient all-reduce pays for the wait)."""
        span_s = self.time_s if iteration_s is None else iteration_s
        return tuple(e + self.p_static_w * span_s for e in self.stage_effective_energy_j)

    def energy_j(self, gpus_per_stage: int, iteration_s: float | None = None) -> float:
        """Energy of the replica's GPUs (`gpus_per_stage` = TP × CP per stage)."""
        return gpus_per_stage * sum(self.stage_gpu_energy_j(iteration_s))


def replica_iteration(simulator: Simulator, workload: Workload, stages: Sequence[Sequence[Any]], *,
                      clock_ceiling_mhz: float | None = None) -> ReplicaIteration:
    """Simulate every instruction of `stages` (an instruction without a clock runs at the maximum)."""
    if len(stages) != len(workload.stages):
        raise KareusError(f"the schedule has {len(stages)} stages, the job {len(workload.stages)}")
    # Microbatches repeat a few options: without noise an instruction's cost depends only on what it
    # runs, so each distinct one is simulated once (a 128-microbatch replica: ~500 instructions, ~10 distinct).
    seen: dict[tuple, tuple[float, float]] = {}

    def cost(s: int, ins: Any) -> tuple[float, float]:
        if simulator.noise_std:
            return instruction_cost(simulator, workload, s, ins, clock_ceiling_mhz=clock_ceiling_mhz)
        key = (s, ins.kind, ins.clock_mhz, ins.mode, tuple(sorted(ins.configs.items())),
               tuple(sorted(ins.recompute_configs.items())))
        if key not in seen:
            seen[key] = instruction_cost(simulator, workload, s, ins, clock_ceiling_mhz=clock_ceiling_mhz)
        return seen[key]

    costs = [[cost(s, ins) for ins in stage] for s, stage in enumerate(stages)]
    time_s = pipeline_time_s(stages, [[t for t, _ in row] for row in costs])
    return ReplicaIteration(time_s, tuple(sum(e for _, e in row) for row in costs), simulator.gpu.p_static_w)


def instruction_cost(simulator: Simulator, workload: Workload, stage: int, ins: Any, *,
                     clock_ceiling_mhz: float | None = None) -> tuple[float, float]:
    """(time_s, effective energy per GPU) of one instruction of `stage`, its clock capped."""
    gpu = simulator.gpu
    clock = float(ins.clock_mhz or gpu.clock_max_mhz)
    if clock_ceiling_mhz is not None:
        clock = min(clock, clock_ceiling_mhz)
    m = simulator.instruction(workload.stages[stage], ins.kind, clock, _configs(workload, stage, ins))
    return m.time_s, m.effective_energy_j


def _configs(workload: Workload, stage: int, ins: Any) -> dict[str, PartitionConfig] | None:
    """The instruction's partition configs, defaults for types it does not name; None = sequential."""
    types = workload.partition_types
    if ins.mode == "sequential" or not types:
        return None
    given: Mapping[str, PartitionConfig] = {**ins.recompute_configs, **ins.configs}
    return {name: given.get(name) or types[name].default_config() for name in workload.stages[stage].instances(ins.kind)}


def pipeline_time_s(stages: Sequence[Sequence[Any]], times_s: Sequence[Sequence[float]]) -> float:
    """Finish time of the pipeline DAG given each instruction's duration."""
    num_stages = len(stages)
    done: dict[tuple[int, str, int], float] = {}
    cursor = [0] * num_stages
    clock = [0.0] * num_stages
    remaining = sum(len(stage) for stage in stages)
    while remaining:
        progressed = False
        for s in range(num_stages):
            while cursor[s] < len(stages[s]):
                ins = stages[s][cursor[s]]
                dep = (s - 1, "forward", ins.microbatch) if ins.kind == "forward" else (s + 1, "backward", ins.microbatch)
                if 0 <= dep[0] < num_stages and dep not in done:
                    break
                clock[s] = max(clock[s], done.get(dep, 0.0)) + times_s[s][cursor[s]]
                done[(s, ins.kind, ins.microbatch)] = clock[s]
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise KareusError("schedule deadlocks: a stage waits for an instruction that never runs")
    return max(clock)


def ceiling_for_slowdown(time_at: Callable[[float], float], gpu: GPUSpec, slowdown: float) -> float:
    """The clock ceiling (MHz) at which `time_at(ceiling)` is `1 + slowdown` times `time_at(max clock)`.

    `time_at` is non-increasing in the ceiling (a lower cap never speeds work up); bisection to
    well below a kHz. Raises `KareusError` when even the lowest clock is not that slow.
    """
    if not 0 <= slowdown < 10:
        raise KareusError(f"slowdown must be a fraction in [0, 10), got {slowdown!r}")
    high = float(gpu.clock_max_mhz)
    if slowdown == 0:
        return high
    target_s = time_at(high) * (1.0 + slowdown)
    low = float(gpu.clock_min_mhz)
    if time_at(low) < target_s:
        raise KareusError(f"a {slowdown:.0%} slowdown is more than {gpu.name} at its lowest clock "
                          f"({gpu.clock_min_mhz} MHz) gives")
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (low + high)
        if time_at(mid) >= target_s:
            low = mid
        else:
            high = mid
    return low


def power_limited(gpu: GPUSpec, power_limit_w: float) -> GPUSpec:
    """The GPU with board power limit `power_limit_w` (within what the board accepts)."""
    if not gpu.power_limit_min_w <= power_limit_w <= gpu.power_limit_w:
        raise KareusError(f"power limit {power_limit_w:.0f} W outside {gpu.name}'s settable range "
                          f"{gpu.power_limit_min_w:.0f}..{gpu.power_limit_w:.0f} W")
    return replace(gpu, power_limit_w=float(power_limit_w))
