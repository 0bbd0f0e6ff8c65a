"""What is searched: a configuration grid and a way to measure it.

A configuration (`Candidate`) is a point on three axes: a clock, a count of a resource and a
categorical slot (the profiler reads them as the SM clock, the SMs of the communication kernel and
the launch slot at which the communication starts). The grid is the full cross product of the
three axes (`SearchSpace`); a grid point is addressed by its index, clock-major, so the search
algorithms work on integer arrays and only the measure function sees `Candidate`s.

`Problem.measure` receives a whole batch at once, so a backend may run the batch in parallel (the
NVML profiler launches one distributed run per batch; the simulator is fast enough to loop). It
returns per-GPU `(time_s, energy_j)` for every candidate, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kareus.errors import KareusError


@dataclass(frozen=True)
class Candidate:
    """One point of the grid."""

    clock_mhz: int
    comm_sms: int
    launch_slot: str


MeasureFn = Callable[[Sequence[Candidate]], Sequence[tuple[float, float]]]


@dataclass(frozen=True)
class SearchSpace:
    """The grid clocks × comm SMs × launch slots, indexed clock-major."""

    clocks_mhz: tuple[int, ...]
    comm_sms: tuple[int, ...]
    launch_slots: tuple[str, ...]

    def __post_init__(self) -> None:
        for name in ("clocks_mhz", "comm_sms", "launch_slots"):
            values = getattr(self, name)
            if not values:
                raise KareusError(f"search space {name}: must not be empty")
            if len(set(values)) != len(values):
                raise KareusError(f"search space {name}: values must be distinct, got {list(values)}")

    @property
    def size(self) -> int:
        return len(self.clocks_mhz) * len(self.comm_sms) * len(self.launch_slots)

    @property
    def configurations(self) -> int:
        """Configurations (comm SMs × launch slots) per clock."""
        return len(self.comm_sms) * len(self.launch_slots)

    @property
    def few_configurations(self) -> bool:
        """No more configurations than clocks (single-slot grids): the searches treat these apart."""
        return self.configurations <= len(self.clocks_mhz)

    @cached_property
    def axes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per grid index: (clock index, comm-SM index, slot index)."""
        grid = np.indices((len(self.clocks_mhz), len(self.comm_sms), len(self.launch_slots)))
        return tuple(axis.reshape(-1) for axis in grid)  # type: ignore[return-value]

    @cached_property
    def configuration_index(self) -> np.ndarray:
        """Per grid index: its configuration's index, 0 .. configurations - 1, the same at every clock."""
        _, sms_i, slot_i = self.axes
        return sms_i * len(self.launch_slots) + slot_i

    @cached_property
    def features(self) -> np.ndarray:
        """Surrogate inputs: clock (MHz) and comm SMs numeric, launch slot one-hot."""
        clock_i, sms_i, slot_i = self.axes
        one_hot = np.eye(len(self.launch_slots))[slot_i]
        numeric = np.column_stack((np.asarray(self.clocks_mhz, float)[clock_i], np.asarray(self.comm_sms, float)[sms_i]))
        return np.hstack((numeric, one_hot))

    def candidate(self, index: int) -> Candidate:
        clock_i, sms_i, slot_i = (int(axis[index]) for axis in self.axes)
        return Candidate(self.clocks_mhz[clock_i], self.comm_sms[sms_i], self.launch_slots[slot_i])

    def index_of(self, candidate: Candidate) -> int:
        try:
            clock_i = self.clocks_mhz.index(candidate.clock_mhz)
            sms_i = self.comm_sms.index(candidate.comm_sms)
            slot_i = self.launch_slots.index(candidate.launch_slot)
        except ValueError:
            raise KareusError(f"candidate {candidate} is not on the search grid") from None
        return (clock_i * len(self.comm_sms) + sms_i) * len(self.launch_slots) + slot_i


@dataclass(frozen=True)
class Problem:
    """One search: its grid, how to measure it, and the static power removed from effective energy."""

    name: str
    space: SearchSpace
    measure: MeasureFn
    p_static_w: float
    size_class: str = "medium"  # small (1 compute op) | medium (2-3) | large (>3): sets paper budgets


@dataclass(frozen=True)
class Evaluated:
    """A measured candidate; `source` names the design or pass that chose it."""

    candidate: Candidate
    time_s: float
    energy_j: float
    effective_energy_j: float
    batch: int
    source: str


@dataclass(frozen=True)
class Step:
    """One measured batch of a search, as the search yields it (batch 0 is the initial design)."""

    batch: int
    evaluated: tuple[Evaluated, ...]
    evaluations: int
    hypervolume: float
    max_evaluations: int


@dataclass(frozen=True)
class SearchResult:
    """What a search measured and the measured Pareto set on (time, effective energy)."""

    problem: str
    algorithm: str
    measured: tuple[Evaluated, ...]
    frontier: tuple[Evaluated, ...]
    evaluations: int
    grid_size: int
    history: tuple[Step, ...]
