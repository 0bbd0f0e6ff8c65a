"""Composition: from per-partition frontiers to microbatch frontiers (DESIGN.md §2.5).

A microbatch instruction (forward or backward of one microbatch on one pipeline stage) runs at
one SM clock. Partitioned, it executes every partition type `instances` times (two nanobatch
orientations per layer; backward under activation checkpointing also re-runs the forward
partitions, with their own "recompute" configs) plus the non-partition work (embedding, output
layer, loss). Every instance of a type shares one configuration, so at clock f

    T(f, θ) = Σ_types n_type · T_type(f, θ_type) + T_nonpartition(f),   E likewise,

and the microbatch frontier is the Pareto set over all clocks and configuration tuples θ, plus
the Megatron-style sequential execution measured per clock, on (time, effective energy).

The cross product over types is exact yet small because the Pareto set of a sum is contained in
the sum of the Pareto sets: types are folded in one at a time, pruning to the Pareto set after
each (a Minkowski sum of frontiers, never the full product). Where the numbers come from is a
`MeasurementSource`: the profile (Kareus), or the simulator for configurations a profile never
measured (the baselines' fixed configs, the exhaustive reference).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kareus.plan import DIRECTIONS, InstructionOption, StageOptions
from kareus.workload.partitions import PartitionConfig, StageWorkload, Workload


@dataclass(frozen=True)
class PartitionCandidate:
    """One configuration of a partition type at one clock: time and energy per GPU."""

    config: PartitionConfig
    time_s: float
    energy_j: float


class MeasurementSource(Protocol):
    """Where composition takes its numbers from (per GPU, one execution each)."""

    p_static_w: float
    clocks_mhz: tuple[int, ...]

    def partition_candidates(self, partition_type: str, clock_mhz: int) -> Sequence[PartitionCandidate]:
        """Configurations of `partition_type` at `clock_mhz`; empty if none was measured."""

    def nonpartition(self, stage: int, direction: str, clock_mhz: int) -> tuple[float, float] | None:
        """(time_s, energy_j) of the stage's non-partition work, or None if not measured."""

    def sequential(self, stage: int, direction: str, clock_mhz: int) -> tuple[float, float] | None:
        """(time_s, energy_j) of the whole instruction run sequentially, or None if not measured."""


@dataclass(frozen=True)
class CompositionSettings:
    """Which candidates enter the microbatch frontier.

    `clocks_mhz` restricts the clocks (None: all of the source's); `partitioned` and `sequential`
    switch the two execution modes; `tolerance_j` drops a point whose effective energy is not at
    least that much below every faster point's (measurement noise makes near-ties meaningless).
    """

    partitioned: bool = True
    sequential: bool = True
    clocks_mhz: tuple[int, ...] | None = None
    tolerance_j: float = 1e-4


def pareto_mask(time_s: np.ndarray, effective_j: np.ndarray, tolerance_j: float = 0.0) -> np.ndarray:
    """Points on the (time, effective energy) Pareto front: each must beat every faster point's
    effective energy by more than `tolerance_j`. Ties in time keep the lower energy."""
    order = np.lexsort((effective_j, time_s))
    sorted_e = effective_j[order]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], sorted_e[:-1])))
    keep_sorted = sorted_e < best_before - tolerance_j
    mask = np.zeros(len(time_s), dtype=bool)
    mask[order[keep_sorted]] = True
    return mask


@dataclass(frozen=True)
class _Factor:
    """One partition type's share of an instruction: `count` instances with shared config."""

    role: str  # "configs" or "recompute_configs"
    partition_type: str
    count: int


def _factors(stage: StageWorkload, direction: str) -> list[_Factor]:
    if direction == "forward":
        return [_Factor("configs", t, n) for t, n in stage.forward_instances.items() if n > 0]
    return ([_Factor("configs", t, n) for t, n in stage.backward_instances.items() if n > 0]
            + [_Factor("recompute_configs", t, n) for t, n in stage.recompute_instances.items() if n > 0])


def _fold(factors: Sequence[_Factor], source: MeasurementSource, clock_mhz: int,
          tolerance_j: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, list] | None:
    """The Pareto set of Σ count·(time, effective energy) over the factors' candidates.

    Returns (time_s, effective_j, choice index per factor, candidates per factor), or None if a
    factor has no candidate at this clock.
    """
    time_s = np.zeros(1)
    eff_j = np.zeros(1)
    choice = np.zeros((1, 0), dtype=np.int32)
    tables = []
    for factor in factors:
        candidates = list(source.partition_candidates(factor.partition_type, clock_mhz))
        if not candidates:
            return None
        t = np.array([c.time_s for c in candidates]) * factor.count
        e = np.array([c.energy_j - source.p_static_w * c.time_s for c in candidates]) * factor.count
        keep = np.flatnonzero(pareto_mask(t, e))
        candidates = [candidates[i] for i in keep]
        t, e = t[keep], e[keep]
        tables.append(candidates)
        time_s = (time_s[:, None] + t[None, :]).ravel()
        eff_j = (eff_j[:, None] + e[None, :]).ravel()
        rows = np.repeat(choice, len(candidates), axis=0)
        cols = np.tile(np.arange(len(candidates), dtype=np.int32), len(choice))[:, None]
        choice = np.hstack([rows, cols])
        keep = pareto_mask(time_s, eff_j, tolerance_j)
        time_s, eff_j, choice = time_s[keep], eff_j[keep], choice[keep]
    return time_s, eff_j, choice, tables


def microbatch_frontier(workload: Workload, stage: int, direction: str, source: MeasurementSource,
                        settings: CompositionSettings = CompositionSettings()) -> tuple[InstructionOption, ...]:
    """The Pareto-optimal ways to run one instruction of `stage`, fastest first (energies per GPU)."""
    stage_work = workload.stages[stage]
    factors = _factors(stage_work, direction)
    p_static_w = source.p_static_w
    options: list[InstructionOption] = []
    for clock in settings.clocks_mhz or source.clocks_mhz:
        if settings.sequential:
            measured = source.sequential(stage, direction, clock)
            if measured is not None:
                options.append(InstructionOption(clock, "sequential", measured[0], measured[1]))
        if settings.partitioned:
            options += _partitioned_options(factors, stage, direction, clock, source, settings.tolerance_j)
    if not options:
        return ()
    t = np.array([o.time_s for o in options])
    e = np.array([o.effective_energy_j(p_static_w) for o in options])
    keep = np.flatnonzero(pareto_mask(t, e, settings.tolerance_j))
    return tuple(sorted((options[i] for i in keep), key=lambda o: o.time_s))


def _partitioned_options(factors: Sequence[_Factor], stage: int, direction: str, clock: int,
                         source: MeasurementSource, tolerance_j: float) -> list[InstructionOption]:
    rest = source.nonpartition(stage, direction, clock)
    if rest is None:
        return []
    folded = _fold(factors, source, clock, tolerance_j)
    if folded is None:
        return []
    time_s, eff_j, choice, tables = folded
    p_static_w = source.p_static_w
    out = []
    for row in range(len(time_s)):
        picks: dict[str, dict[str, PartitionConfig]] = {"configs": {}, "recompute_configs": {}}
        for k, factor in enumerate(factors):
            picks[factor.role][factor.partition_type] = tables[k][choice[row, k]].config
        total_t = float(time_s[row]) + rest[0]
        # Energies are carried as totals per GPU; effective energy is linear in time, so the sum
        # of effective parts plus the static part of the summed time is the same total.
        total_e = float(eff_j[row]) + (rest[1] - p_static_w * rest[0]) + p_static_w * total_t
        out.append(InstructionOption(clock, "partitioned", total_t, total_e,
                                     picks["configs"], picks["recompute_configs"]))
    return out


def compose_stages(workload: Workload, source: MeasurementSource,
                   settings: CompositionSettings = CompositionSettings()) -> tuple[StageOptions, ...]:
    """The forward and backward microbatch frontiers of every stage."""
    stages = []
    for s in range(len(workload.stages)):
        fwd, bwd = (microbatch_frontier(workload, s, d, source, settings) for d in DIRECTIONS)
        stages.append(StageOptions(fwd, bwd))
    return tuple(stages)

