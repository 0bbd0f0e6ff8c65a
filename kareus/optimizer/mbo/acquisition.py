"""Acquisition: which unmeasured grid points the next batch measures.

Each pass ranks every unmeasured point by one criterion computed from surrogate predictions:

- `total`: hypervolume improvement (HVI) of the predicted point over the measured front in the
  plane (time, total energy), total energy = T̂·P_static + Ê — pushes the front toward the origin;
- `effective`: HVI in (time, effective energy) — pushes the front down, toward low clocks;
- `static`: static energy is P_static × time, so the (time, static energy) plane is one line and
  its HVI is positive exactly for points predicted faster than the fastest measured one, growing
  as the predicted time drops: ranking by predicted time is that pass;
- `uncertainty`: σ(T̂)+σ(Ê) of a bootstrap ensemble — explores where the surrogates disagree.

Axes are min-max normalised with the measured points' bounds and the reference point is 1.1 ×
the worst measured value. Points with zero HVI are ranked by how far they are predicted to miss
the front (`dominance_gap`), so a pass never picks at random. The batch is filled pass by pass in
the configured proportions (paper: 40/20/20/20) without duplicates; the last pass fills the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kareus.optimizer.mbo.indicators import Normaliser, dominance_gap, hvi_2d

PASSES = ("total", "effective", "static", "uncertainty")


@dataclass(frozen=True)
class Planes:
    """Measured and predicted points in the (time, total) and (time, effective) planes."""

    measured_time_s: np.ndarray
    measured_effective_j: np.ndarray
    predicted_time_s: np.ndarray
    predicted_effective_j: np.ndarray
    p_static_w: float

    def _plane(self, time_s: np.ndarray, effective_j: np.ndarray, plane: str) -> np.ndarray:
        energy = effective_j + self.p_static_w * time_s if plane == "total" else effective_j
        return np.column_stack((time_s, energy))

    def improvement_rank(self, plane: str) -> np.ndarray:
        """Candidate order, best first, by HVI in `plane`, ties broken by the dominance gap."""
        measured = self._plane(self.measured_time_s, self.measured_effective_j, plane)
        predicted = self._plane(self.predicted_time_s, self.predicted_effective_j, plane)
        scale = Normaliser.fit(measured)
        front, points = scale(measured), scale(predicted)
        hvi = hvi_2d(front, points)
        gap = dominance_gap(front, points)
        return np.lexsort((gap, -hvi))


def batch_sizes(batch_size: int, fractions: Mapping[str, float]) -> dict[str, int]:
    """Per-pass quotas summing to `batch_size`; the last pass takes the rounding remainder."""
    names = list(fractions)
    quotas = {name: round(fractions[name] * batch_size) for name in names[:-1]}
    while sum(quotas.values()) > batch_size:  # rounding up can overshoot on tiny batches
        largest = max(quotas, key=quotas.__getitem__)
        quotas[largest] -= 1
    quotas[names[-1]] = batch_size - sum(quotas.values())
    return quotas


def fill_batch(rankings: Mapping[str, np.ndarray], quotas: Mapping[str, int]) -> list[tuple[int, str]]:
    """Take each pass's quota from its ranking in order, skipping points already chosen.

    `rankings` are orders over the same candidate positions. Returns (position, pass) pairs.
    """
    chosen: list[tuple[int, str]] = []
    taken: set[int] = set()
    for name, quota in quotas.items():
        picked = 0
        for position in rankings[name]:
            if picked == quota:
                break
            if int(position) in taken:
                continue
            chosen.append((int(position), name))
            taken.add(int(position))
            picked += 1
    wanted = sum(quotas.values())
    backfill = rankings[next(iter(quotas))]  # a pass that ran out is made up by the first pass
    for position in backfill:
        if len(chosen) >= wanted:
            break
        if int(position) not in taken:
            chosen.append((int(position), next(iter(quotas))))
            taken.add(int(position))
    return chosen


def rank_passes(planes: Planes, uncertainty: np.ndarray | None) -> dict[str, np.ndarray]:
    """The candidate order of every pass."""
    rankings = {
        "total": planes.improvement_rank("total"),
        "effective": planes.improvement_rank("effective"),
        "static": np.argsort(planes.predicted_time_s, kind="stable"),
    }
    if uncertainty is not None:
        rankings["uncertainty"] = np.argsort(-uncertainty, kind="stable")
    return rankings
