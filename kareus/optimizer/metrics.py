"""How methods are compared, as the paper does (DESIGN.md §2.6, METHOD_NOTES §7.4).

Every method yields an iteration frontier of (time_s, energy_j) points, energy over all GPUs
with static energy. Against a reference method:

- **max throughput**: each method's fastest point against Megatron-LM's (sequential, max
  clock): percent less time and percent less energy;
- **iso-time energy reduction** (reference Megatron+Perseus): T* is the reference's fastest
  time and E_ref its energy there; the method's least energy among points with T ≤ T*;
  reduction = (E_ref − E) / E_ref;
- **iso-energy time reduction**: E* is the reference's least energy and T_ref its time there;
  the method's least time among points with E ≤ E*; reduction = (T_ref − T) / T_ref.

A method with no point meeting the constraint has no value (`None`, "−" in the paper's Table 4).
`hypervolume_ratio` judges a frontier against another in one normalised plane.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kareus.search.indicators import Normaliser, hypervolume

Point = tuple[float, float]


def fastest(points: Sequence[Point]) -> Point:
    """The minimum-time point (ties: less energy)."""
    return min(points)


def least_energy(points: Sequence[Point]) -> Point:
    """The minimum-energy point (ties: less time)."""
    return min(points, key=lambda p: (p[1], p[0]))


def reduction(reference: float, value: float) -> float:
    """Relative reduction of `value` below `reference` (0.1 = 10 % less)."""
    return (reference - value) / reference


def iso_time_energy_reduction(points: Sequence[Point], reference: Sequence[Point]) -> float | None:
    """Energy saved at the reference's fastest iteration time (None: no point that fast)."""
    t_star, e_ref = fastest(reference)
    feasible = [e for t, e in points if t <= t_star * (1 + 1e-9)]
    return reduction(e_ref, min(feasible)) if feasible else None


def iso_energy_time_reduction(points: Sequence[Point], reference: Sequence[Point]) -> float | None:
    """Time saved at the reference's least iteration energy (None: no point that frugal)."""
    t_ref, e_star = least_energy(reference)
    feasible = [t for t, e in points if e <= e_star * (1 + 1e-9)]
    return reduction(t_ref, min(feasible)) if feasible else None


@dataclass(frozen=True)
class MaxThroughputComparison:
    """A method's fastest point against the baseline's fastest point."""

    time_s: float
    energy_j: float
    time_reduction: float
    energy_reduction: float


def max_throughput_vs(points: Sequence[Point], baseline: Sequence[Point]) -> MaxThroughputComparison:
    t, e = fastest(points)
    t_ref, e_ref = fastest(baseline)
    return MaxThroughputComparison(t, e, reduction(t_ref, t), reduction(e_ref, e))


def dominated_by(points: Sequence[Point], other: Sequence[Point], rel_tol: float = 1e-9) -> list[Point]:
    """The points of `points` that some point of `other` strictly dominates (beyond `rel_tol`)."""
    out = []
    for t, e in points:
        for to, eo in other:
            no_worse = to <= t * (1 + rel_tol) and eo <= e * (1 + rel_tol)
            better = to < t * (1 - rel_tol) or eo < e * (1 - rel_tol)
            if no_worse and better:
                out.append((t, e))
                break
    return out


def hypervolume_ratio(points: Sequence[Point], reference_front: Sequence[Point]) -> float:
    """HV(points) / HV(reference_front) in the (time, energy) plane normalised over both sets,
    reference point 1.1 × the worst value of either. 1.0 means as good as the reference."""
    scale = Normaliser.fit(np.array([*points, *reference_front], dtype=float))
    return hypervolume(scale(points)) / hypervolume(scale(reference_front))
