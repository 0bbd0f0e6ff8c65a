"""Measurement sources for composition: a profile document, or the simulated GPU directly.

Kareus composes from what profiling measured (`ProfileSource`: each partition type's measured
Pareto set per clock). The baselines and the exhaustive reference need configurations the
profile's search never measured — nanobatching's fixed launch at the partition start, every
grid point — so `SimulatorSource` measures them on the same simulated GPU model, with either
one fixed configuration per type or the whole grid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kareus.optimizer.composition import PartitionCandidate
from kareus.profiler.document import ProfileDocument
from kareus.workload.partitions import PartitionConfig, Workload


@dataclass(frozen=True)
class ProfileSource:
    """Numbers from a profile document: measured points only, Pareto-pruned per clock."""

    profile: ProfileDocument

    @property
    def p_static_w(self) -> float:
        return self.profile.p_static_w

    @property
    def clocks_mhz(self) -> tuple[int, ...]:
        return tuple(self.profile.clocks_mhz)

    def partition_candidates(self, partition_type: str, clock_mhz: int) -> Sequence[PartitionCandidate]:
        if partition_type not in self.profile.partitions:
            return ()
        return tuple(PartitionCandidate(PartitionConfig(p.launch_slot, p.comm_sms), p.time_s, p.energy_j)
                     for p in self.profile.frontier_at(partition_type, clock_mhz))

    def nonpartition(self, stage: int, direction: str, clock_mhz: int) -> tuple[float, float] | None:
        return _lookup(self.profile.nonpartition, stage, direction, clock_mhz)

    def sequential(self, stage: int, direction: str, clock_mhz: int) -> tuple[float, float] | None:
        return _lookup(self.profile.sequential, stage, direction, clock_mhz)


def _lookup(table: Mapping, stage: int, direction: str, clock_mhz: int) -> tuple[float, float] | None:
    cost = table.get(stage, {}).get(direction, {}).get(clock_mhz)
    return None if cost is None else (float(cost[0]), float(cost[1]))


@dataclass
class SimulatorSource:
    """Numbers measured on a `kareus.sim.Simulator` for `workload`.

    `fixed` gives one configuration per partition type (plain nanobatching); without it every
    configuration of the type's grid is measured (the exhaustive reference).
    """

    simulator: object
    workload: Workload
    clocks_mhz: tuple[int, ...]
    fixed: Mapping[str, PartitionConfig] | None = None
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def p_static_w(self) -> float:
        return float(self.simulator.p_static_w)

    def partition_candidates(self, partition_type: str, clock_mhz: int) -> Sequence[PartitionCandidate]:
        key = ("partition", partition_type, clock_mhz)
        if key not in self._memo:
            ptype = self.workload.partition_types[partition_type]
            configs = ([self.fixed[partition_type]] if self.fixed is not None else
                       [PartitionConfig(slot, sms) for slot in ptype.launch_slots for sms in ptype.comm_sms_grid])
            measured = [(c, self.simulator.partition(ptype, clock_mhz, c.comm_sms, c.launch_slot)) for c in configs]
            self._memo[key] = tuple(PartitionCandidate(c, float(m.time_s), float(m.energy_j)) for c, m in measured)
        return self._memo[key]

    def nonpartition(self, stage: int, direction: str, clock_mhz: int) -> tuple[float, float] | None:
        work = self.workload.stages[stage]
        ops = work.nonpartition_forward_ops if direction == "forward" else work.nonpartition_backward_ops
        if not ops:
            return (0.0, 0.0)
        m = self.simulator.sequential(ops, clock_mhz)
        return (float(m.time_s), float(m.energy_j))

    def sequential(self, stage: int, direction: str, clock_mhz: int) -> tuple[float, float] | None:
        m = self.simulator.instruction(self.workload.stages[stage], direction, clock_mhz, None)
        return (float(m.time_s), float(m.energy_j))


def nanobatch_configs(workload: Workload) -> dict[str, PartitionConfig]:
    """Plain nanobatching's configuration: the collective launches at the partition's start with
    NCCL's default share of SMs (NCCL opens up to 32 channels, one CTA each, for large
    collectives on NVLink/NVSwitch systems; the grid's largest value is the nearest)."""
    return {name: ptype.default_config() for name, ptype in workload.partition_types.items()}
