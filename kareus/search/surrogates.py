"""Surrogates: gradient-boosted trees predicting time and effective energy of unmeasured points.

Two independent regressors are fitted on all measurements of a partition type: one for time and
one for effective energy (DESIGN.md §2.4). Total energy is never fitted; it is derived as
`T̂·P_static + Ê`. Trees suit the mixed numeric/categorical grid and fit in time linear in the
number of points. Targets are min-max normalised before fitting, so the bootstrap ensemble's
uncertainty `σ(T̂) + σ(Ê)` adds comparable quantities.

`TreeSettings.monotone_clock` asks XGBoost for time that never increases with the clock (a
physical fact: the same work at a higher clock is not slower), which lets one clock's
measurements inform its neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xgboost as xgb


@dataclass(frozen=True)
class TreeSettings:
    """XGBoost settings; the defaults are the paper's (depth 6, eta 0.3, 100 rounds)."""

    max_depth: int = 6
    eta: float = 0.3
    rounds: int = 100
    subsample: float = 0.8
    colsample_bytree: float = 0.8
    min_child_weight: float = 1.0
    monotone_clock: bool = False  # feature 0 is the clock


def _fit(features: np.ndarray, target: np.ndarray, settings: TreeSettings, seed: int,
         monotone: int = 0) -> xgb.Booster:
    params = {
        "objective": "reg:squarederror",
        "max_depth": settings.max_depth,
        "eta": settings.eta,
        "subsample": settings.subsample,
        "colsample_bytree": settings.colsample_bytree,
        "min_child_weight": settings.min_child_weight,
        "nthread": 1,  # tiny data: threads cost more than they save, and the machine is shared
        "seed": seed,
        "verbosity": 0,
    }
    if monotone:
        params["monotone_constraints"] = "(" + ",".join([str(monotone)] + ["0"] * (features.shape[1] - 1)) + ")"
    # A DMatrix built with the default thread pool costs more than fitting these trees.
    data = xgb.DMatrix(features, label=target, nthread=1)
    return xgb.train(params, data, num_boost_round=settings.rounds)


def min_max_bounds(values: np.ndarray) -> tuple[float, float]:
    """(low, span) that map `values` onto [0, 1]; a constant maps to 0 with a nonzero span."""
    low = float(values.min())
    span = float(values.max()) - low
    return low, span if span > 0 else max(abs(low), 1e-12)


@dataclass(frozen=True)
class Prediction:
    """Surrogate predictions in the measurements' units."""

    time_s: np.ndarray
    effective_energy_j: np.ndarray


class Surrogate:
    """A time model and an effective-energy model fitted on the same measurements."""

    def __init__(self, settings: TreeSettings, features: np.ndarray, time_s: np.ndarray,
                 effective_energy_j: np.ndarray, *, seed: int = 0) -> None:
        self._time_scale = min_max_bounds(time_s)
        self._energy_scale = min_max_bounds(effective_energy_j)
        time_n = (time_s - self._time_scale[0]) / self._time_scale[1]
        energy_n = (effective_energy_j - self._energy_scale[0]) / self._energy_scale[1]
        self._time = _fit(features, time_n, settings, seed, -1 if settings.monotone_clock else 0)
        self._energy = _fit(features, energy_n, settings, seed)

    def predict_normalised(self, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._time.inplace_predict(features), self._energy.inplace_predict(features)

    def predict(self, features: np.ndarray) -> Prediction:
        time_n, energy_n = self.predict_normalised(features)
        return Prediction(
            time_s=time_n * self._time_scale[1] + self._time_scale[0],
            effective_energy_j=energy_n * self._energy_scale[1] + self._energy_scale[0],
        )


def bootstrap_uncertainty(settings: TreeSettings, features: np.ndarray, time_s: np.ndarray,
                          effective_energy_j: np.ndarray, query: np.ndarray, *, members: int = 5,
                          fraction: float = 0.8, seed: int = 0) -> np.ndarray:
    """σ(T̂) + σ(Ê) over `members` surrogates, each fitted on a `fraction` resample, normalised targets."""
    rng = np.random.default_rng(seed)
    n = len(time_s)
    size = max(2, round(fraction * n))
    times, energies = [], []
    # Normalise once with the full data so every member predicts on the same scale.
    (time_low, time_span), (energy_low, energy_span) = min_max_bounds(time_s), min_max_bounds(effective_energy_j)
    time_n = (time_s - time_low) / time_span
    energy_n = (effective_energy_j - energy_low) / energy_span
    for member in range(members):
        rows = rng.choice(n, size=size, replace=True)
        model = Surrogate(settings, features[rows], time_n[rows], energy_n[rows], seed=seed + member)
        prediction = model.predict(query)
        times.append(prediction.time_s)
        energies.append(prediction.effective_energy_j)
    return np.std(times, axis=0) + np.std(energies, axis=0)
