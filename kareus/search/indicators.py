"""How a search is judged: Pareto sets and hypervolume in a two-objective plane.

Every objective is minimised. A plane is an `(n, 2)` array, e.g. (time, effective energy).
`pareto_mask` and `hypervolume` delegate to pymoo (`NonDominatedSorting`, `HV`); the acquisition
needs the hypervolume *improvement* of every unmeasured grid point at once, which `hvi_2d`
computes exactly and vectorised from the staircase of the current front (tested against pymoo).

Axes are min-max normalised with bounds taken from measured points (`Normaliser`), and the
reference point sits at 1.1 × the worst measured value, i.e. 1.1 in normalised units.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pymoo.indicators.hv import HV
from pymoo.util.nds.non_dominated_sorting import NonDominatedSorting

REFERENCE = 1.1  # reference point in normalised units: 1.1 × the worst value


def pareto_mask(points: np.ndarray) -> np.ndarray:
    """Boolean mask of the non-dominated rows of `points` (minimisation); exact duplicates keep one."""
    points = np.asarray(points, dtype=float)
    mask = np.zeros(len(points), dtype=bool)
    if len(points) == 0:
        return mask
    _, first = np.unique(points, axis=0, return_index=True)
    front = NonDominatedSorting().do(points[first], only_non_dominated_front=True)
    mask[first[np.asarray(front, dtype=int)]] = True
    return mask


@dataclass(frozen=True)
class Normaliser:
    """Min-max scaling of a two-objective plane: `lower` maps to 0, `upper` to 1."""

    lower: tuple[float, float]
    upper: tuple[float, float]

    @classmethod
    def fit(cls, points: np.ndarray) -> Normaliser:
        points = np.asarray(points, dtype=float)
        lower = points.min(axis=0)
        upper = points.max(axis=0)
        return cls((float(lower[0]), float(lower[1])), (float(upper[0]), float(upper[1])))

    def __call__(self, points: np.ndarray) -> np.ndarray:
        lower = np.asarray(self.lower)
        span = np.asarray(self.upper) - lower
        span = np.where(span > 0, span, np.maximum(np.abs(lower), 1e-12))  # a flat axis still scales
        return (np.asarray(points, dtype=float) - lower) / span


def hypervolume(points: np.ndarray, reference: float = REFERENCE) -> float:
    """Hypervolume of `points` (already normalised) against the point (reference, reference)."""
    points = np.asarray(points, dtype=float)
    inside = points[np.all(points < reference, axis=1)]
    if len(inside) == 0:
        return 0.0
    return float(HV(ref_point=np.array([reference, reference]))(inside))


def _staircase(front: np.ndarray, reference: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segments [start, end) along x with the front's best y on each (reference before the first)."""
    front = front[np.all(front < reference, axis=1)]
    front = front[pareto_mask(front)] if len(front) else front
    order = np.argsort(front[:, 0]) if len(front) else np.array([], dtype=int)
    xs = front[order, 0]
    ys = front[order, 1]
    starts = np.concatenate(([-np.inf], xs))
    ends = np.concatenate((xs, [reference]))
    levels = np.concatenate(([reference], ys))
    return starts, ends, levels


def hvi_2d(front: np.ndarray, candidates: np.ndarray, reference: float = REFERENCE) -> np.ndarray:
    """Exact hypervolume improvement of each candidate point added alone to `front` (normalised)."""
    candidates = np.asarray(candidates, dtype=float).reshape(-1, 2)
    starts, ends, levels = _staircase(np.asarray(front, dtype=float).reshape(-1, 2), reference)
    cx = candidates[:, :1]
    cy = candidates[:, 1:]
    width = np.clip(np.minimum(ends, reference) - np.maximum(starts, cx), 0.0, None)
    height = np.clip(levels - cy, 0.0, None)
    return (width * height).sum(axis=1)


def relative_gap(plane: np.ndarray) -> np.ndarray:
    """Per point of `plane`, the least ε such that a point of its front is within a factor 1 + ε of
    it on both axes (0 on the front). Relative, as measurement noise is: an additive gap on
    normalised axes ranks a point a noise level off a steep part of the front as far."""
    plane = np.asarray(plane, dtype=float)
    front = plane[pareto_mask(plane)]
    return np.min(np.max(plane[:, None, :] / front[None, :, :], axis=2), axis=1) - 1


def dominance_gap(front: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """How far each candidate must move (in both axes at once) to escape domination by `front`.

    Zero for candidates that are not dominated. Used to rank candidates whose improvement is zero,
    so a pass that runs out of improving points still picks the most promising ones.
    """
    front = np.asarray(front, dtype=float).reshape(-1, 2)
    candidates = np.asarray(candidates, dtype=float).reshape(-1, 2)
    if len(front) == 0:
        return np.zeros(len(candidates))
    # Escaping one front point needs to beat it in either axis (the smaller excess); escaping the
    # front needs that for the worst point.
    excess = np.minimum(candidates[:, None, 0] - front[None, :, 0], candidates[:, None, 1] - front[None, :, 1])
    return np.clip(excess.max(axis=1), 0.0, None)
