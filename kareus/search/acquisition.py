"""Acquisition: which unmeasured grid points the next batch measures.

Each pass ranks every unmeasured point by one criterion computed from surrogate predictions:

- `total`: hypervolume improvement (HVI) of the predicted point over the measured front in the
  plane (time, total energy), total energy = T̂·P_static + Ê — pushes the front toward the origin;
- `effective`: HVI in (time, effective energy) — pushes the front down, toward low clocks;
- `static`: static energy is P_static × time, so the (time, static energy) plane is one line and
  its HVI is positive exactly for points predicted faster than the fastest measured one, growing
  as the predicted time drops: ranking by predicted time is that pass;
- `uncertainty`: σ(T̂)+σ(Ê) of a bootstrap ensemble — explores where the surrogates disagree;
- `transfer` (default preset): a configuration (comm SMs, launch slot) that is on the front at
  some clock is likely good at the neighbouring clocks too — the best overlap changes slowly with
  the clock. A clock votes for the configurations whose point at that clock is on the front of
  the whole grid in the (time, effective energy) or (time, total energy) plane, judged on the
  surrogate's values everywhere when they are given (its fit at measured points pools every
  clock's measurements, so one lucky draw among configurations a noise level apart does not
  decide the vote), else on measured values where measured and predictions elsewhere. An
  unmeasured point ranks by its configuration's votes weighted by how near the voting clocks are
  (`exp(-Δ/3)`, Δ in grid steps of the clock), then by total-energy HVI. On grids with more
  configurations than clocks a clock also gives 0.3 of a vote to each point on its own
  (time, effective energy) front: its lean end, where the grid's front goes at lower clocks, is
  carried before configurations on no front at all. Votes from each clock's
  own front alone (before) went to that clock's slowest, leanest configuration at every clock — on
  Qwen3 CP2+TP4 `fwd_qkv_ar` half the budget carried 3 comm SMs to clocks where a lower clock
  beats it, while the fast end's 21 SMs reached 2 clocks of 18; and votes summed over all clocks
  carried a configuration that wins only at the lowest clocks to the highest ones first. Clocks
  with no measurement yet come first, each one's best candidate before any clock's second
  (composition drops a clock with no measurement) — and on grids with no more configurations
  than clocks, every configuration that half the clocks vote for at the highest and the lowest
  clock, where the ends of the front are;
- `extremes` (default preset): the two ends of the front are where a miss costs the most
  hypervolume and where the surrogates extrapolate. Unmeasured neighbours of the fastest measured
  point (the adjacent comm-SM counts or slots at its clock, its configuration one clock higher) and
  of the least-effective-energy one (likewise, one clock lower) alternate, each ranked by its
  predicted objective; then every other point by predicted time, as the `static` pass.
- `neighbours` (default preset, grids with more configurations than clocks): the trees split on
  the clock and cannot carry a configuration's measurements to other clocks, so a ridge of the
  front they mispredict (Llama 3.2 3B `fwd_attn`: 12 comm SMs at the RoPE and attention slots,
  predicted 7–20 % too slow at 1110–930 MHz) is never proposed by the surrogate passes. This pass
  steps from the measured front instead: the unmeasured grid neighbours (adjacent comm-SM count at
  the same slot, the other slots at the same count, the same configuration one clock up or down)
  of every measured point on the (time, total) or (time, effective) front, parents by their
  exclusive hypervolume contribution (largest gap first), round robin; a parent's neighbours by
  how few clocks their configuration was measured at (what the surrogate knows least), then by
  total-energy HVI; then every other point by total-energy HVI. Before all of them come the lean
  probes: each slot's two fewest comm-SM counts at the clock of least predicted total energy and
  at the lowest clock. At the lean ends the compute is slow enough for a collective on few SMs to
  hide under it while the compute keeps the most SMs, so the front there often runs along the
  grid's fewest counts, an edge that stepping from the front reaches last and the trees never
  predict (docs/optimizer.md, seventh pass: 138 → 107 of 1280 searches below 99 %).
- `clocks` (default preset): under measurement noise a clock can lose every draw it has to luckier
  draws at its neighbours, and then holds no point of the measured front although it holds one of
  the true front. The exhaustive search, which measures every configuration at every clock, nearly
  always keeps a point at each front clock; a search that measures a clock a few times loses it
  often, most of all next to where the front is flat in one objective (the least total energy,
  where adjacent clocks differ by less than the noise, and the fastest clocks under the power
  limit), and there a lost point costs the most hypervolume. This pass finds the clocks that hold a
  point of the *predicted* front (the surrogate's fit at measured points, its predictions
  elsewhere; either plane) and none of the *measured* front, most valuable first (the largest
  exclusive hypervolume contribution of the clock's predicted front point), and measures their
  unmeasured points nearest the predicted front (`relative_gap`), round robin; then every other
  point by that gap.

Axes are min-max normalised with the measured points' bounds and the reference point is 1.1 ×
the worst measured value. Points with zero HVI are ranked by how far they are predicted to miss
the front (`dominance_gap`), so a pass never picks at random. The batch is filled pass by pass in
the configured proportions (paper: 40/20/20/20) without duplicates; the last pass fills the rest.
Small batches round most passes' shares to nothing; `carried_batch_sizes` carries each pass's
unspent share to the next batch, so over a search every pass gets its proportion.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from kareus.search.indicators import Normaliser, dominance_gap, hvi_2d, pareto_mask, relative_gap
from kareus.search.problem import SearchSpace

# Transfer: a vote's weight falls by 1/e every this many clock steps from the voting clock.
TRANSFER_CLOCK_SCALE = 3.0
# Neighbours: each slot's this many fewest comm-SM counts are probed at the lean-end clocks.
LEAN_PROBE_COUNTS = 2
# Transfer, many-configuration grids: a clock's vote for a point on its own front only.
TRANSFER_OWN_CLOCK_VOTE = 0.3

PASSES = ("total", "effective", "static", "uncertainty", "transfer", "extremes", "neighbours", "clocks")


@dataclass(frozen=True)
class Planes:
    """Measured and predicted points in the (time, total) and (time, effective) planes."""

    measured_time_s: np.ndarray
    measured_effective_j: np.ndarray
    predicted_time_s: np.ndarray
    predicted_effective_j: np.ndarray
    p_static_w: float
    fitted_time_s: np.ndarray | None = None  # the surrogate at the measured points
    fitted_effective_j: np.ndarray | None = None

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


def carried_batch_sizes(batch_size: int, fractions: Mapping[str, float],
                        owed: Mapping[str, float]) -> tuple[dict[str, int], dict[str, float]]:
    """Per-pass quotas summing to `batch_size` from each share plus what earlier batches owed it.

    Largest remainder: every pass gets the whole part of its due, the largest fractional parts the
    rest. Returns the quotas and what is still owed (due minus quota) for the next batch.
    """
    due = {name: fractions[name] * batch_size + owed.get(name, 0.0) for name in fractions}
    quotas = {name: max(0, int(np.floor(value))) for name, value in due.items()}
    by_remainder = sorted(fractions, key=lambda name: quotas[name] - due[name])
    for name in itertools.islice(itertools.cycle(by_remainder), max(0, batch_size - sum(quotas.values()))):
        quotas[name] += 1
    while sum(quotas.values()) > batch_size:  # debts larger than a batch: the most indebted give way
        quotas[max(quotas, key=quotas.__getitem__)] -= 1
    return quotas, {name: due[name] - quotas[name] for name in fractions}


def configuration_coverage(space: SearchSpace, measured: np.ndarray) -> float:
    """Share of the configurations (comm SMs, launch slot) measured at one clock or more."""
    return len(np.unique(space.configuration_index[measured])) / space.configurations


def adapt_transfer(fractions: Mapping[str, float], coverage: float, transfer_max: float) -> dict[str, float]:
    """Pass shares with the transfer share raised to the configuration coverage, up to `transfer_max`.

    Transfer can only carry configurations that were measured somewhere, and the surrogates rank
    an unseen configuration only by extrapolation: while many configurations are unseen the
    exploring passes keep their share; once (nearly) every configuration has been measured at some
    clock, what is left to learn is which of them win at the clocks where they were not measured,
    and that is the transfer pass's job. The other passes keep their proportions.
    """
    base = fractions.get("transfer", 0.0)
    if base <= 0 or transfer_max <= base:
        return dict(fractions)
    share = min(transfer_max, max(base, coverage))
    rest = (1 - share) / (1 - base) if base < 1 else 0.0
    return {name: share if name == "transfer" else value * rest for name, value in fractions.items()}


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


def _best_guess(space: SearchSpace, measured: np.ndarray, planes: Planes,
                remaining: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every grid point's (time, effective energy): the surrogate's fit where measured (it pools
    every clock's measurements, so one lucky draw does not decide), the measurement where no fit is
    given, the prediction elsewhere."""
    time_s = np.empty(space.size)
    effective_j = np.empty(space.size)
    time_s[measured], effective_j[measured] = planes.measured_time_s, planes.measured_effective_j
    if planes.fitted_time_s is not None and planes.fitted_effective_j is not None:
        time_s[measured], effective_j[measured] = planes.fitted_time_s, planes.fitted_effective_j
    time_s[remaining], effective_j[remaining] = planes.predicted_time_s, planes.predicted_effective_j
    return time_s, effective_j


def transfer_rank(space: SearchSpace, measured: np.ndarray, planes: Planes, remaining: np.ndarray,
                  tie_break: np.ndarray) -> np.ndarray:
    """Candidate order for the transfer pass (see the module docstring)."""
    clock_i = space.axes[0]
    config = space.configuration_index
    time_s, effective_j = _best_guess(space, measured, planes, remaining)
    n_clocks = len(space.clocks_mhz)
    # on_front[clock, configuration]: that configuration's point at that clock is on the front
    # of the whole grid (either plane).
    on_front = np.zeros((n_clocks, space.configurations))
    for plane in ("effective", "total"):
        front = np.flatnonzero(pareto_mask(planes._plane(time_s, effective_j, plane)))
        on_front[clock_i[front], config[front]] = 1.0
    if not space.few_configurations:
        # ... and, at a fraction of a vote, the configurations on its own (time, effective) front:
        # its trade-off's lean end, which the grid's front reaches only once measured somewhere.
        for clock in range(n_clocks):
            at_clock = np.flatnonzero(clock_i == clock)
            plane = np.column_stack((time_s[at_clock], effective_j[at_clock]))
            on_front[clock, config[at_clock][pareto_mask(plane)]] += TRANSFER_OWN_CLOCK_VOTE
    votes = on_front.sum(axis=0)
    # A configuration goes first to the clocks next to those it wins at.
    step = np.argsort(np.argsort(space.clocks_mhz))  # clock index -> rank by frequency
    nearness = np.exp(-np.abs(step[:, None] - step[None, :]) / TRANSFER_CLOCK_SCALE)
    local_votes = (nearness @ on_front)[clock_i[remaining], config[remaining]]
    position = np.empty(len(remaining), dtype=int)
    position[tie_break] = np.arange(len(remaining))
    # A clock with no measurement at all comes first: composition drops such a clock. Each such
    # clock's best candidate goes before any clock's second, so a batch covers as many as it can.
    uncovered = ~np.isin(clock_i[remaining], clock_i[measured])
    order = np.lexsort((position, -local_votes, ~uncovered))
    rank = np.empty(len(remaining), dtype=int)
    rank[order] = np.arange(len(remaining))
    first_at_clock = np.zeros(len(remaining), dtype=bool)
    _, first = np.unique(clock_i[remaining[order]], return_index=True)
    first_at_clock[order[first]] = True
    urgent = first_at_clock & uncovered
    if space.few_configurations:
        # Few configurations: the end clocks hold the ends of the front (fastest, least effective
        # energy), where a miss costs the most hypervolume; there every configuration that half
        # the clocks or more vote for is urgent, not only the best — a few points in all.
        ends = (int(np.argmax(space.clocks_mhz)), int(np.argmin(space.clocks_mhz)))
        at_end = np.isin(clock_i[remaining], ends)
        urgent |= at_end & (votes[config[remaining]] >= 0.5 * votes.max())
    return np.lexsort((rank, ~urgent))


def _neighbours(space: SearchSpace, point: int, remaining: np.ndarray, higher: bool) -> np.ndarray:
    """Mask over `remaining`: the configurations next to `point` at its clock, and its own
    configuration at the next higher (`higher`) or lower clock."""
    clock_i, sms_i, slot_i = space.axes
    c, s, k = clock_i[point], sms_i[point], slot_i[point]
    rc, rs, rk = clock_i[remaining], sms_i[remaining], slot_i[remaining]
    same_clock = (rc == c) & (((rk == k) & (np.abs(rs - s) == 1)) | (rs == s))
    clocks_mhz = np.asarray(space.clocks_mhz)
    beyond = np.flatnonzero(clocks_mhz > clocks_mhz[c] if higher else clocks_mhz < clocks_mhz[c])
    if len(beyond) == 0:
        return same_clock
    next_clock = beyond[np.argmin(np.abs(clocks_mhz[beyond] - clocks_mhz[c]))]
    return same_clock | ((rc == next_clock) & (rs == s) & (rk == k))


def extremes_rank(space: SearchSpace, measured: np.ndarray, planes: Planes, remaining: np.ndarray) -> np.ndarray:
    """Candidate order for the extremes pass (see the module docstring)."""
    fastest = measured[int(np.argmin(planes.measured_time_s))]
    leanest = measured[int(np.argmin(planes.measured_effective_j))]
    near_fast = np.flatnonzero(_neighbours(space, fastest, remaining, higher=True))
    near_lean = np.flatnonzero(_neighbours(space, leanest, remaining, higher=False))
    near_fast = near_fast[np.argsort(planes.predicted_time_s[near_fast], kind="stable")]
    near_lean = near_lean[np.argsort(planes.predicted_effective_j[near_lean], kind="stable")]
    order = [int(p) for pair in itertools.zip_longest(near_fast, near_lean) for p in pair if p is not None]
    order = list(dict.fromkeys(order))
    taken = set(order)
    rest = [int(p) for p in np.argsort(planes.predicted_time_s, kind="stable") if int(p) not in taken]
    return np.asarray(order + rest, dtype=int)


def _contributions(plane: np.ndarray) -> np.ndarray:
    """Each point's exclusive hypervolume contribution to the front of `plane` (normalised; 0 off it)."""
    points = Normaliser.fit(plane)(plane)
    on_front = np.flatnonzero(pareto_mask(points))
    out = np.zeros(len(points))
    for i in on_front:
        others = points[on_front[on_front != i]]
        out[i] = float(hvi_2d(others, points[i])[0])
    return out


def neighbours_rank(space: SearchSpace, measured: np.ndarray, planes: Planes, remaining: np.ndarray,
                    tie_break: np.ndarray) -> np.ndarray:
    """Candidate order for the neighbours pass (see the module docstring)."""
    _, sms_i, slot_i = space.axes
    clock_i = np.argsort(np.argsort(space.clocks_mhz))[space.axes[0]]  # frequency order: ±1 is adjacent
    contribution = np.zeros(len(measured))
    for plane in ("total", "effective"):
        contribution = np.maximum(contribution, _contributions(
            planes._plane(planes.measured_time_s, planes.measured_effective_j, plane)))
    parents = np.flatnonzero(contribution > 0)
    parents = parents[np.argsort(-contribution[parents], kind="stable")]
    position = np.empty(len(remaining), dtype=int)
    position[tie_break] = np.arange(len(remaining))
    rc, rs, rk = clock_i[remaining], sms_i[remaining], slot_i[remaining]
    probes = _lean_probes(space, measured, planes, remaining)
    # The surrogate knows least about a configuration measured at the fewest clocks.
    seen = np.bincount(space.configuration_index[measured], minlength=space.configurations)
    seen_at = seen[space.configuration_index[remaining]]
    per_parent = []
    for parent in measured[parents]:
        c, s, k = clock_i[parent], sms_i[parent], slot_i[parent]
        near = (((rc == c) & (((rk == k) & (np.abs(rs - s) == 1)) | ((rs == s) & (rk != k))))
                | ((np.abs(rc - c) == 1) & (rs == s) & (rk == k)))
        found = np.flatnonzero(near)
        per_parent.append(found[np.lexsort((position[found], seen_at[found]))])
    order = [int(p) for group in itertools.zip_longest(*per_parent) for p in group if p is not None]
    order = list(dict.fromkeys(probes + order))
    taken = set(order)
    rest = [int(p) for p in tie_break if int(p) not in taken]
    return np.asarray(order + rest, dtype=int)


def _lean_probes(space: SearchSpace, measured: np.ndarray, planes: Planes, remaining: np.ndarray) -> list[int]:
    """Positions in `remaining`: each slot's fewest comm-SM counts (`LEAN_PROBE_COUNTS`) at the
    clock of least predicted total energy and at the lowest clock, fewest counts first."""
    clock_i, sms_i, _ = space.axes
    time_s, effective_j = _best_guess(space, measured, planes, remaining)
    lean_clocks = dict.fromkeys((int(clock_i[int(np.argmin(effective_j + planes.p_static_w * time_s))]),
                                 int(np.argmin(space.clocks_mhz))))
    fewest = np.argsort(space.comm_sms, kind="stable")[:LEAN_PROBE_COUNTS]
    rc, rs = clock_i[remaining], sms_i[remaining]
    probes: list[int] = []
    for count in fewest:
        for clock in lean_clocks:  # `remaining` is in grid order, so each group is in slot order
            probes.extend(int(p) for p in np.flatnonzero((rs == count) & (rc == clock)))
    return probes


def clocks_rank(space: SearchSpace, measured: np.ndarray, planes: Planes, remaining: np.ndarray) -> np.ndarray:
    """Candidate order for the clocks pass (see the module docstring)."""
    clock_i = space.axes[0]
    time_s, effective_j = _best_guess(space, measured, planes, remaining)
    # worth[clock]: the most hypervolume one of its points holds alone on the predicted front.
    worth = np.zeros(len(space.clocks_mhz))
    gap = np.full(len(remaining), np.inf)
    for plane in ("effective", "total"):
        points = planes._plane(time_s, effective_j, plane)
        on_front = np.flatnonzero(pareto_mask(points))
        np.maximum.at(worth, clock_i[on_front], _contributions(points)[on_front] + 1e-12)
        gap = np.minimum(gap, relative_gap(points)[remaining])
    kept = np.zeros(len(space.clocks_mhz), dtype=bool)
    for plane in ("effective", "total"):
        points = planes._plane(planes.measured_time_s, planes.measured_effective_j, plane)
        kept[clock_i[measured[pareto_mask(points)]]] = True
    lost = [clock for clock in np.argsort(-worth, kind="stable") if worth[clock] > 0 and not kept[clock]]
    at_clock = clock_i[remaining]
    per_clock = []
    for clock in lost:
        found = np.flatnonzero(at_clock == clock)
        per_clock.append(found[np.argsort(gap[found], kind="stable")])
    order = [int(p) for group in itertools.zip_longest(*per_clock) for p in group if p is not None]
    taken = set(order)
    rest = [int(p) for p in np.argsort(gap, kind="stable") if int(p) not in taken]
    return np.asarray(order + rest, dtype=int)


def rank_passes(planes: Planes, uncertainty: np.ndarray | None,
                grid: tuple[SearchSpace, np.ndarray, np.ndarray] | None = None,
                passes: Collection[str] = PASSES) -> dict[str, np.ndarray]:
    """The candidate order of every pass in `passes` that can run.

    `uncertainty` is needed by the uncertainty pass, `grid` = (space, measured, remaining grid
    indices) by the transfer, extremes, neighbours and clocks passes.
    """
    rankings = {
        "total": planes.improvement_rank("total"),
        "effective": planes.improvement_rank("effective"),
        "static": np.argsort(planes.predicted_time_s, kind="stable"),
    }
    if uncertainty is not None:
        rankings["uncertainty"] = np.argsort(-uncertainty, kind="stable")
    if grid is not None:
        space, measured, remaining = grid
        if "transfer" in passes:
            rankings["transfer"] = transfer_rank(space, measured, planes, remaining, rankings["total"])
        if "extremes" in passes:
            rankings["extremes"] = extremes_rank(space, measured, planes, remaining)
        if "neighbours" in passes:
            rankings["neighbours"] = neighbours_rank(space, measured, planes, remaining, rankings["total"])
        if "clocks" in passes:
            rankings["clocks"] = clocks_rank(space, measured, planes, remaining)
    return rankings
