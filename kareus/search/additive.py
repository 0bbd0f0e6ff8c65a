"""An additive surrogate that shares each configuration's effect across clocks.

On a grid with one slot (a partition type with one launch slot), the best comm-SM count at one clock is usually the best
or nearly the best at its neighbours: the configurations' effects on time and effective energy
are offsets on a clock curve that all of them share, changing slowly with the clock (and switching
where compute stops hiding the collective). Two configurations a noise level apart can then only
be told apart by pooling their measurements over many clocks. Trees cannot pool that way (they
split on the clock first and see a handful of points per leaf); this model does:

    y(clock c, configuration k) = g(c) + a(k) + d(k, c)

- `g`: the shared clock curve, one value per clock, penalised on its second difference over
  clocks sorted by frequency, so a clock with no measurement is interpolated (extrapolated at
  the ends) from its neighbours;
- `a`: a configuration's mean offset (a small ridge keeps the split between `g` and `a` unique);
- `d`: how the offset drifts with the clock, penalised on its step from one clock to the next
  (a random walk: a switch is allowed, noise is not) and by a ridge toward the mean offset.

Fitting is one penalised least-squares solve, the posterior mean of the Gaussian Markov random
field these penalties define, on min-max normalised targets (the penalties are relative to a
noise of about 1 % of the range). A configuration never measured gets the shared curve only.
Time and effective energy are fitted separately, as the trees are; total energy is derived.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy.linalg import block_diag

from kareus.search.problem import SearchSpace
from kareus.search.surrogates import Prediction, min_max_bounds


@dataclass(frozen=True)
class AdditiveSettings:
    """Penalty weights, relative to the squared residual of a normalised measurement."""

    clock_smoothness: float = 1.0  # on the shared curve's second difference
    offset_ridge: float = 1e-3  # on a configuration's mean offset
    drift_smoothness: float = 4.0  # on a configuration's offset step between adjacent clocks
    drift_ridge: float = 0.1  # on a configuration's offset drift from its mean


@lru_cache(maxsize=16)
def _penalty(order: tuple[int, ...], n_configs: int, settings: AdditiveSettings) -> np.ndarray:
    """The penalty's normal matrix over (g per clock, a per configuration, d per configuration × clock)."""
    n_clocks = len(order)
    second = np.zeros((max(n_clocks - 2, 0), n_clocks))
    for row, (left, mid, right) in enumerate(zip(order, order[1:], order[2:], strict=False)):
        second[row, [left, mid, right]] = 1.0, -2.0, 1.0
    first = np.zeros((max(n_clocks - 1, 0), n_clocks))
    for row, (low, high) in enumerate(itertools.pairwise(order)):
        first[row, [low, high]] = -1.0, 1.0
    drift = settings.drift_smoothness * first.T @ first + settings.drift_ridge * np.eye(n_clocks)
    # A whisper of ridge on g: before two clocks are measured its level and slope are otherwise free.
    curve = settings.clock_smoothness * second.T @ second + 1e-6 * np.eye(n_clocks)
    penalty = block_diag(curve, settings.offset_ridge * np.eye(n_configs), *[drift] * n_configs)
    penalty.flags.writeable = False  # cached and shared between fits
    return penalty


class AdditiveSurrogate:
    """Time and effective energy as shared clock curve + smoothly drifting configuration offsets."""

    def __init__(self, settings: AdditiveSettings, space: SearchSpace, measured: np.ndarray,
                 time_s: np.ndarray, effective_energy_j: np.ndarray) -> None:
        self._space = space
        self._scales = (min_max_bounds(time_s), min_max_bounds(effective_energy_j))
        targets = np.column_stack([(values - low) / span for values, (low, span)
                                   in zip((time_s, effective_energy_j), self._scales, strict=True)])
        design = self._design(np.asarray(measured, dtype=int))
        order = tuple(int(i) for i in np.argsort(space.clocks_mhz))
        normal = design.T @ design + _penalty(order, space.configurations, settings)
        self._theta = np.linalg.solve(normal, design.T @ targets)

    def _design(self, indices: np.ndarray) -> np.ndarray:
        n_clocks, n_configs = len(self._space.clocks_mhz), self._space.configurations
        clock = self._space.axes[0][indices]
        config = self._space.configuration_index[indices]
        rows = np.arange(len(indices))
        design = np.zeros((len(indices), n_clocks + n_configs + n_configs * n_clocks))
        design[rows, clock] = 1.0
        design[rows, n_clocks + config] = 1.0
        design[rows, n_clocks + n_configs + config * n_clocks + clock] = 1.0
        return design

    def predict(self, indices: np.ndarray) -> Prediction:
        """Predictions at grid indices, in the measurements' units."""
        normalised = self._design(np.asarray(indices, dtype=int)) @ self._theta
        (time_low, time_span), (energy_low, energy_span) = self._scales
        return Prediction(time_s=normalised[:, 0] * time_span + time_low,
                          effective_energy_j=normalised[:, 1] * energy_span + energy_low)
