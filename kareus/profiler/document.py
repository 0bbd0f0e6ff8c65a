"""The profile document: everything the optimizer needs to know about one job on one GPU model.

A profile is what profiling produced, compacted: for every partition type the *measured* points
of its search (clock, comm SMs, launch slot → time and energy), for every pipeline stage and
direction the non-partition work and the whole Megatron-style sequential instruction measured at
every clock of the grid, the GPU's static power and the clock grid, a description of the job it
was measured for, and where it came from (software version, search preset, seed, backend).

Times are wall-clock seconds of one execution; energies are **per GPU** joules of one execution
(a partition is the work of one nanobatch pair, an instruction one microbatch). Effective energy
is `energy_j − p_static_w × time_s` (DESIGN.md §2.1); static energy is added back for the whole
iteration by the optimizer. Only measured points are ever stored, never predictions.

The JSON form is versioned (`apiVersion`, `kind`); `from_dict` rejects anything else with a
`ProfileError` naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kareus.errors import KareusError
from kareus.job import JobDescriptor
from kareus.search.indicators import pareto_mask

API_VERSION = "kareus.dev/v1alpha1"
KIND = "KareusProfile"
DIRECTIONS = ("forward", "backward")


class ProfileError(KareusError):
    """A profile document that cannot be read: the message names the field."""


@dataclass(frozen=True)
class PartitionPoint:
    """One measured configuration of a partition type, per GPU."""

    clock_mhz: int
    comm_sms: int
    launch_slot: str
    time_s: float
    energy_j: float

    def effective_energy_j(self, p_static_w: float) -> float:
        return self.energy_j - p_static_w * self.time_s


@dataclass(frozen=True)
class PartitionProfile:
    """The measured points of one partition type's search and what the search cost."""

    measured: tuple[PartitionPoint, ...]
    evaluations: int
    grid_size: int

    def at_clock(self, clock_mhz: int) -> tuple[PartitionPoint, ...]:
        return tuple(point for point in self.measured if point.clock_mhz == clock_mhz)


class ClockCost(NamedTuple):
    """Time and per-GPU energy of a piece of work run at one clock."""

    time_s: float
    energy_j: float


# stage index → direction ("forward"/"backward") → clock (MHz) → cost
StageClockTable = Mapping[int, Mapping[str, Mapping[int, ClockCost]]]


@dataclass(frozen=True)
class Provenance:
    """Where a profile came from."""

    software_version: str
    preset: str
    seed: int
    backend: str
    created: str = ""
    noise_std: float = 0.0


@dataclass(frozen=True)
class ProfileDocument:
    """A compact, versioned profile of one job configuration on one GPU model."""

    key: str
    gpu: str
    p_static_w: float
    clocks_mhz: tuple[int, ...]
    job: JobDescriptor
    partitions: Mapping[str, PartitionProfile]
    nonpartition: StageClockTable
    sequential: StageClockTable
    provenance: Provenance
    extra: Mapping[str, Any] = field(default_factory=dict)

    def frontier_at(self, partition_type: str, clock_mhz: int) -> tuple[PartitionPoint, ...]:
        """Measured points of `partition_type` at `clock_mhz` that are Pareto-optimal on
        (time, effective energy), fastest first; empty if that clock was not measured."""
        if partition_type not in self.partitions:
            raise KeyError(partition_type)
        return self._clock_frontiers.get((partition_type, int(clock_mhz)), ())

    @cached_property
    def _clock_frontiers(self) -> dict[tuple[str, int], tuple[PartitionPoint, ...]]:
        """Every (type, clock) frontier, computed once: composition asks for them many times."""
        frontiers = {}
        for name, profile in self.partitions.items():
            by_clock: dict[int, list[PartitionPoint]] = {}
            for point in profile.measured:
                by_clock.setdefault(point.clock_mhz, []).append(point)
            for clock, points in by_clock.items():
                frontiers[(name, clock)] = pareto_points(tuple(points), self.p_static_w)
        return frontiers

    def frontier(self, partition_type: str) -> tuple[PartitionPoint, ...]:
        """The Pareto set of all measured points of `partition_type` on (time, effective energy)."""
        return pareto_points(self.partitions[partition_type].measured, self.p_static_w)

    @property
    def evaluations(self) -> int:
        return sum(profile.evaluations for profile in self.partitions.values())

    # --- JSON -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "key": self.key,
            "gpu": self.gpu,
            "p_static_w": self.p_static_w,
            "clocks_mhz": list(self.clocks_mhz),
            "job": {**_fields(self.job), "stage_layers": list(self.job.stage_layers)},
            "partitions": {
                name: {
                    "evaluations": profile.evaluations,
                    "grid_size": profile.grid_size,
                    "measured": [_fields(point) for point in profile.measured],
                }
                for name, profile in self.partitions.items()
            },
            "nonpartition": _table_to_json(self.nonpartition),
            "sequential": _table_to_json(self.sequential),
            "provenance": _fields(self.provenance),
            "extra": dict(self.extra),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProfileDocument:
        if not isinstance(data, Mapping):
            raise ProfileError("profile: must be a JSON object")
        if data.get("apiVersion") != API_VERSION or data.get("kind") != KIND:
            raise ProfileError(
                f"profile.apiVersion/kind: must be {API_VERSION}/{KIND}, "
                f"got {data.get('apiVersion')!r}/{data.get('kind')!r}"
            )
        try:
            job = dict(_require(data, "job"))
            job["stage_layers"] = tuple(int(n) for n in job.get("stage_layers", ()))
            partitions = {
                str(name): PartitionProfile(
                    measured=tuple(PartitionPoint(**point) for point in entry["measured"]),
                    evaluations=int(entry["evaluations"]),
                    grid_size=int(entry["grid_size"]),
                )
                for name, entry in _require(data, "partitions").items()
            }
            return cls(
                key=str(_require(data, "key")),
                gpu=str(_require(data, "gpu")),
                p_static_w=float(_require(data, "p_static_w")),
                clocks_mhz=tuple(int(clock) for clock in _require(data, "clocks_mhz")),
                job=JobDescriptor(**job),
                partitions=partitions,
                nonpartition=_table_from_json(_require(data, "nonpartition")),
                sequential=_table_from_json(_require(data, "sequential")),
                provenance=Provenance(**_require(data, "provenance")),
                extra=dict(data.get("extra", {})),
            )
        except ProfileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ProfileError(f"profile: malformed document ({type(error).__name__}: {error})") from None

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)  # readers never see half a document

    @classmethod
    def load(cls, path: str | Path) -> ProfileDocument:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ProfileError(f"profile file {path}: not found") from None
        except json.JSONDecodeError as error:
            raise ProfileError(f"profile file {path}: not valid JSON ({error})") from None
        return cls.from_dict(data)


def pareto_points(points: tuple[PartitionPoint, ...], p_static_w: float) -> tuple[PartitionPoint, ...]:
    """The points that are Pareto-optimal on (time, effective energy), fastest first."""
    if not points:
        return ()
    plane = np.array([(p.time_s, p.effective_energy_j(p_static_w)) for p in points])
    keep = [point for point, on_front in zip(points, pareto_mask(plane), strict=True) if on_front]
    return tuple(sorted(keep, key=lambda p: (p.time_s, p.effective_energy_j(p_static_w))))


def _fields(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}


def _require(data: Mapping[str, Any], name: str) -> Any:
    if name not in data:
        raise ProfileError(f"profile.{name}: required field missing")
    return data[name]


def _table_to_json(table: StageClockTable) -> dict[str, Any]:
    return {
        str(stage): {
            direction: {str(clock): [cost.time_s, cost.energy_j] for clock, cost in by_clock.items()}
            for direction, by_clock in by_direction.items()
        }
        for stage, by_direction in table.items()
    }


def _table_from_json(data: Mapping[str, Any]) -> dict[int, dict[str, dict[int, ClockCost]]]:
    table: dict[int, dict[str, dict[int, ClockCost]]] = {}
    for stage, by_direction in data.items():
        for direction, by_clock in by_direction.items():
            if direction not in DIRECTIONS:
                raise ProfileError(f"profile stage {stage}: direction must be one of {DIRECTIONS}, got {direction!r}")
            table.setdefault(int(stage), {})[direction] = {
                int(clock): ClockCost(float(cost[0]), float(cost[1])) for clock, cost in by_clock.items()
            }
    return table
