"""Multi-pass MBO on closed-form problems: indicators, batch split, designs, stopping, presets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pymoo.indicators.hv import HV

from kareus.errors import KareusError
from kareus.search.acquisition import batch_sizes, fill_batch
from kareus.search.algorithms import (
    PAPER_BUDGETS,
    Exhaustive,
    MultiPassMBO,
    RandomSearch,
    frontier_of,
    get_algorithm,
    minimize,
)
from kareus.search.designs import random_design, stratified_design
from kareus.search.indicators import dominance_gap, hvi_2d, hypervolume, pareto_mask
from kareus.search.problem import Problem, SearchSpace
from kareus.search.testproblems import overlap_problem

points_2d = st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(front=points_2d, candidates=points_2d)
def test_hvi_matches_pymoo_hypervolume_difference(front, candidates):
    front, candidates = np.array(front), np.array(candidates)
    hv = HV(ref_point=np.array([1.1, 1.1]))
    base = hv(front)
    expected = [hv(np.vstack((front, c))) - base for c in candidates]
    assert np.allclose(hvi_2d(front, candidates), expected, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(points=points_2d)
def test_pareto_mask_is_the_set_of_non_dominated_points(points):
    points = np.array(points)
    mask = pareto_mask(points)
    for i, p in enumerate(points):
        dominated = any(np.all(q <= p) and np.any(q < p) for q in points)
        assert not (mask[i] and dominated)
    # every distinct non-dominated point is kept exactly once
    kept = {tuple(p) for p in points[mask]}
    assert len(kept) == int(mask.sum())
    assert kept == {tuple(p) for p in points if not any(np.all(q <= p) and np.any(q < p) for q in points)}


def test_dominance_gap_is_zero_off_the_dominated_region_and_grows_inside_it():
    front = np.array([[0.2, 0.8], [0.5, 0.3]])
    gaps = dominance_gap(front, np.array([[0.1, 0.9], [0.6, 0.4], [0.9, 0.9]]))
    assert gaps[0] == 0.0
    assert gaps[1] == pytest.approx(0.1)
    assert gaps[2] == pytest.approx(0.4)  # beat (0.5, 0.3) in time: 0.9 - 0.5


def test_hypervolume_of_a_single_point():
    assert hypervolume(np.array([[0.1, 0.1]])) == pytest.approx(1.0)
    assert hypervolume(np.array([[1.2, 0.0]])) == 0.0


@pytest.mark.parametrize("size", [1, 2, 3, 5, 16, 32])
def test_batch_split_is_40_20_20_20_and_sums_to_the_batch(size):
    quotas = batch_sizes(size, {"total": 0.4, "effective": 0.2, "static": 0.2, "uncertainty": 0.2})
    assert sum(quotas.values()) == size
    assert all(q >= 0 for q in quotas.values())
    if size == 16:
        assert quotas == {"total": 6, "effective": 3, "static": 3, "uncertainty": 4}
    if size == 32:
        assert quotas == {"total": 13, "effective": 6, "static": 6, "uncertainty": 7}


def test_fill_batch_never_duplicates_and_backfills_a_pass_that_ran_out():
    rankings = {"total": np.array([0, 1, 2, 3]), "effective": np.array([0, 1, 2, 3]),
                "static": np.array([1, 0, 3, 2]), "uncertainty": np.array([3, 2, 1, 0])}
    chosen = fill_batch(rankings, {"total": 2, "effective": 1, "static": 1, "uncertainty": 1})
    positions = [p for p, _ in chosen]
    assert len(positions) == len(set(positions)) == 4  # only four candidates exist
    assert [s for _, s in chosen][:2] == ["total", "total"]
    assert dict(chosen)[2] == "effective" and dict(chosen)[3] == "static"


def test_stratified_design_balances_clocks_and_is_distinct():
    space = SearchSpace(tuple(range(900, 1411, 30)), tuple(range(3, 31, 3)), ("a", "b", "c"))
    design = stratified_design(space, 54, np.random.default_rng(3))
    assert len(set(design.tolist())) == 54
    clocks = np.bincount(space.axes[0][design], minlength=18)
    assert clocks.min() == clocks.max() == 3
    sms = np.bincount(space.axes[1][design], minlength=10)
    assert sms.min() >= 5  # Latin-hypercube spread over comm SMs
    assert len(set(random_design(space, 100, np.random.default_rng(0)).tolist())) == 100


def _small_problem(noise_std: float = 0.0, seed: int = 0, size_class: str = "medium") -> Problem:
    return overlap_problem(clocks_mhz=tuple(range(1110, 1411, 60)), slots=("norm_0", "linear_0", "attn_0"),
                           noise_std=noise_std, seed=seed, size_class=size_class)


def _hv_ratio(result, reference, p_static_w):
    from kareus.search.indicators import Normaliser

    def plane(items):
        return np.array([(e.time_s, e.effective_energy_j) for e in items])

    scale = Normaliser.fit(plane(reference.measured))
    return hypervolume(scale(plane(result.frontier))) / hypervolume(scale(plane(reference.frontier)))


def test_paper_preset_spends_the_paper_budget_without_duplicates():
    problem = overlap_problem(size_class="small", clocks_mhz=tuple(range(900, 1411, 30)), slots=("norm_0",))
    result = minimize(problem, get_algorithm("paper"), seed=4)
    keys = [e.candidate for e in result.measured]
    assert len(keys) == len(set(keys)) == result.evaluations
    assert result.grid_size == 180
    assert result.history[0].evaluations == PAPER_BUDGETS["small"].n_init == 36
    assert all(len(step.evaluated) == 16 for step in result.history[1:])
    assert result.evaluations <= PAPER_BUDGETS["small"].evaluations == 84
    sources = {e.source for e in result.measured}
    assert {"initial", "total", "effective", "static", "uncertainty"} <= sources


def test_frontier_is_the_measured_pareto_set_only():
    problem = _small_problem(noise_std=0.02, seed=1)
    result = minimize(problem, get_algorithm("default"), seed=2)
    measured = set(result.measured)
    assert set(result.frontier) <= measured
    assert set(result.frontier) == set(frontier_of(result.measured))
    times = [e.time_s for e in result.frontier]
    assert times == sorted(times)


def test_default_preset_matches_exhaustive_with_a_fifth_of_the_grid():
    problem = overlap_problem(noise_std=0.0)  # 18 clocks x 10 SM counts x 4 slots = 720
    exhaustive = minimize(problem, Exhaustive())
    result = minimize(problem, get_algorithm("default"), seed=0)
    assert result.evaluations <= 0.2 * problem.space.size
    assert _hv_ratio(result, exhaustive, problem.p_static_w) >= 0.99
    measured_clocks = {e.candidate.clock_mhz for e in result.measured}
    assert measured_clocks == set(problem.space.clocks_mhz)  # composition needs every clock


def test_search_is_deterministic_for_a_seed():
    first = minimize(_small_problem(), get_algorithm("default"), seed=7)
    second = minimize(_small_problem(), get_algorithm("default"), seed=7)
    assert [e.candidate for e in first.measured] == [e.candidate for e in second.measured]


def test_stopping_rule_ends_the_search_when_the_front_stops_improving():
    space = SearchSpace(tuple(range(900, 1411, 30)), tuple(range(1, 21)), ("a", "b"))

    def flat(candidates):  # every configuration costs the same: no batch can improve the front
        return [(1.0, 100.0) for _ in candidates]

    problem = Problem("flat", space, flat, 85.0, "large")
    result = minimize(problem, get_algorithm("paper"), seed=0)
    assert len(result.history) == 3  # initial design + the two batches of the moving average
    assert result.evaluations == 96 + 2 * 32


def test_random_and_exhaustive_cover_what_they_promise():
    problem = _small_problem()
    assert minimize(problem, Exhaustive()).evaluations == problem.space.size
    result = minimize(problem, RandomSearch(evaluations=25, batch_size=10), seed=1)
    assert result.evaluations == 25 and [len(s.evaluated) for s in result.history] == [10, 10, 5]


def test_unknown_algorithm_and_bad_size_class_are_clear_errors():
    with pytest.raises(KareusError, match="allowed: paper, default, exhaustive, random"):
        get_algorithm("bayes")
    with pytest.raises(KareusError, match="size class"):
        minimize(_small_problem(size_class="huge"), MultiPassMBO(get_algorithm("paper").settings))


def test_transfer_pass_carries_a_winning_configuration_to_other_clocks():
    from kareus.search.acquisition import Planes, transfer_rank

    space = SearchSpace((1410, 1200, 1000), (3, 6, 9), ("a",))
    # Measured: at 1410 and 1200 every configuration; comm_sms=6 is strictly best at both.
    measured = np.array([0, 1, 2, 3, 4, 5])
    time_s = np.array([1.2, 1.0, 1.1, 1.4, 1.2, 1.3])
    effective = np.array([5.0, 4.0, 4.5, 4.0, 3.0, 3.5])
    remaining = np.array([6, 7, 8])  # 1000 MHz: 3, 6, 9 SMs
    planes = Planes(time_s, effective, np.array([1.5, 1.5, 1.5]), np.array([2.0, 2.0, 2.0]), 85.0)
    order = transfer_rank(space, measured, planes, remaining, tie_break=np.array([0, 1, 2]))
    assert remaining[order[0]] == 7  # comm_sms=6 at 1000 MHz


def _stopping_default() -> MultiPassMBO:
    """The default preset with the stopping rule it had before the eighth pass (docs/optimizer.md)."""
    settings = dataclasses.replace(get_algorithm("default").settings, stop_window=3, stop_after_fraction=0.1,
                                   stop_needs_every_clock=True, stop_epsilon=1e-4)
    return MultiPassMBO(settings)


def test_default_preset_spends_its_whole_budget_when_the_front_stops_improving():
    space = SearchSpace(tuple(range(900, 1411, 30)), tuple(range(1, 21)), ("a", "b"))
    problem = Problem("flat", space, lambda cs: [(1.0, 100.0) for _ in cs], 85.0, "large")
    result = minimize(problem, get_algorithm("default"), seed=0)
    assert result.evaluations == int(0.2 * space.size)


def test_stopping_rule_waits_for_a_tenth_of_the_grid():
    space = SearchSpace(tuple(range(900, 1411, 30)), tuple(range(1, 21)), ("a", "b"))
    problem = Problem("flat", space, lambda cs: [(1.0, 100.0) for _ in cs], 85.0, "large")
    result = minimize(problem, _stopping_default(), seed=0)
    assert 0.1 * space.size <= result.evaluations < 0.2 * space.size


def test_transfer_share_follows_the_configuration_coverage():
    from kareus.search.acquisition import adapt_transfer, configuration_coverage

    space = SearchSpace((1410, 1200), (3, 6, 9, 12), ("a", "b"))  # 8 configurations per clock
    assert configuration_coverage(space, np.array([0, 1, 8, 9])) == 0.25  # the same two at both clocks
    fractions = {"transfer": 0.6, "total": 0.2, "uncertainty": 0.2}
    assert adapt_transfer(fractions, 0.3, 0.8) == fractions  # few seen: the exploring passes keep theirs
    raised = adapt_transfer(fractions, 1.0, 0.8)
    assert raised["transfer"] == 0.8 and raised["total"] == pytest.approx(0.1) == raised["uncertainty"]
    assert sum(adapt_transfer(fractions, 0.7, 0.8).values()) == pytest.approx(1.0)
    assert adapt_transfer(fractions, 1.0, 0.0) == fractions  # paper-style settings: fixed shares


def test_default_preset_on_a_single_slot_grid_carries_the_winners_to_every_clock():
    # 18 clocks x 10 SM counts x 1 slot: 20 % is 36 points, two per clock. Every configuration is
    # seen in the initial sweep, so transfer takes most of each batch (a fixed 60 % reached 0.985).
    problem = overlap_problem(clocks_mhz=tuple(range(900, 1411, 30)), slots=("norm_0",))
    exhaustive = minimize(problem, Exhaustive())
    result = minimize(problem, get_algorithm("default"), seed=0)
    assert result.evaluations <= 36
    assert _hv_ratio(result, exhaustive, problem.p_static_w) >= 0.995
    initial = len(result.history[0].evaluated)
    assert sum(e.source == "transfer" for e in result.measured) >= 0.7 * (result.evaluations - initial)


def test_carried_quotas_give_every_pass_its_share_over_small_batches():
    from kareus.search.acquisition import carried_batch_sizes

    fractions = {"transfer": 0.6, "total": 0.15, "effective": 0.1, "extremes": 0.05, "uncertainty": 0.1}
    # Per batch of 4 plain rounding gives the effective and extremes passes nothing, ever.
    assert batch_sizes(4, fractions)["effective"] == batch_sizes(4, fractions)["extremes"] == 0
    owed: dict[str, float] = {}
    totals = dict.fromkeys(fractions, 0)
    for _ in range(20):
        quotas, owed = carried_batch_sizes(4, fractions, owed)
        assert sum(quotas.values()) == 4 and min(quotas.values()) >= 0
        for name, quota in quotas.items():
            totals[name] += quota
    assert totals == {name: round(share * 80) for name, share in fractions.items()}
    assert all(abs(debt) < 1 for debt in owed.values())


def test_default_preset_sweeps_the_middle_clock_on_a_grid_with_few_configurations():
    single_slot = overlap_problem(clocks_mhz=tuple(range(900, 1411, 30)), slots=("norm_0",))  # 10 configurations
    budget = get_algorithm("default").settings.budget(single_slot)
    assert budget.sweep and budget.n_init == 10
    result = minimize(single_slot, get_algorithm("default"), seed=0)
    initial = result.history[0].evaluated
    middle = sorted(single_slot.space.clocks_mhz)[8]  # the lower median of 18
    assert {e.candidate.clock_mhz for e in initial} == {middle}
    assert sorted(e.candidate.comm_sms for e in initial) == sorted(single_slot.space.comm_sms)
    # Then transfer covers the other clocks, one point per clock while some are uncovered.
    first = [e.candidate.clock_mhz for e in result.history[1].evaluated if e.source == "transfer"]
    assert len(first) >= 2 and len(set(first)) == len(first) and middle not in first
    assert {e.candidate.clock_mhz for e in result.measured} == set(single_slot.space.clocks_mhz)
    # Many configurations: one point per clock, Latin-hypercube, as before.
    four_slots = overlap_problem(clocks_mhz=tuple(range(900, 1411, 30)))
    assert not get_algorithm("default").settings.budget(four_slots).sweep


def test_extremes_pass_explores_next_to_both_ends_of_the_measured_front():
    from kareus.search.acquisition import Planes, extremes_rank

    space = SearchSpace((1410, 1200, 1000), (3, 6, 9), ("a",))
    measured = np.array([1, 3, 5])  # (1410, 6) the fastest, (1200, 3) the leanest, (1200, 9)
    time_s = np.array([1.0, 1.5, 1.2])
    effective = np.array([5.0, 3.0, 4.0])
    remaining = np.setdiff1d(np.arange(space.size), measured)  # 0 2 4 6 7 8
    predicted_time = np.array([1.1, 0.9, 1.3, 1.6, 1.4, 1.7])
    predicted_effective = np.array([5.5, 5.2, 4.5, 3.1, 3.4, 3.6])
    planes = Planes(time_s, effective, predicted_time, predicted_effective, 85.0)
    order = remaining[extremes_rank(space, measured, planes, remaining)]
    # Next to the fastest (no higher clock): (1410, 9) then (1410, 3) by predicted time; next to
    # the leanest: (1000, 3) one clock lower, then (1200, 6) by predicted effective energy —
    # alternating; then the rest by predicted time.
    assert list(order) == [2, 6, 0, 4, 7, 8]
    assert sorted(order) == sorted(remaining)


def test_clocks_pass_redraws_at_a_front_clock_the_noise_left_off_the_measured_front():
    from kareus.search.acquisition import Planes, clocks_rank

    space = SearchSpace((1400, 1200, 1000), (2, 4), ("a",))
    measured = np.array([0, 2, 4])  # 2 SMs at every clock; grid index = clock * 2 + comm-SM index
    remaining = np.array([1, 3, 5])  # 4 SMs at every clock
    fit_time, fit_effective = np.array([1.0, 1.2, 1.5]), np.array([3.0, 2.0, 1.5])  # all three on the front
    predicted_time, predicted_effective = np.array([1.02, 1.22, 1.52]), np.array([3.05, 2.05, 1.52])

    def order(measured_effective: np.ndarray) -> list[int]:
        planes = Planes(fit_time, measured_effective, predicted_time, predicted_effective, 0.5,
                        fit_time, fit_effective)
        return list(remaining[clocks_rank(space, measured, planes, remaining)])

    # 1200 MHz drew high (3.1 J), so 1400 MHz dominates it and the measured front lost that clock,
    # which the fit still puts on the front: its other configuration goes first.
    assert order(np.array([3.0, 3.1, 1.5])) == [3, 5, 1]
    # No clock lost: by relative gap to the predicted front (1.3 %, 2.0 %, 2.5 %).
    assert order(fit_effective) == [5, 1, 3]


def test_transfer_votes_on_the_surrogate_fit_when_given():
    from kareus.search.acquisition import Planes, transfer_rank

    space = SearchSpace((1410, 1200, 1000), (3, 6), ("a",))
    measured = np.array([0, 1, 2, 3])  # both configurations at 1410 and 1200
    # Measured: 3 SMs looks best at both clocks by a lucky draw; the fit pools it back.
    time_s = np.array([1.00, 1.01, 1.20, 1.21])
    effective = np.array([4.00, 4.01, 3.00, 3.01])
    remaining = np.array([4, 5])
    predicted = (np.array([1.4, 1.4]), np.array([2.0, 2.0]))
    raw = Planes(time_s, effective, *predicted, 85.0)
    fitted = Planes(time_s, effective, *predicted, 85.0,
                    np.array([1.01, 1.00, 1.21, 1.20]), np.array([4.01, 4.00, 3.01, 3.00]))
    assert remaining[transfer_rank(space, measured, raw, remaining, np.array([1, 0]))[0]] == 4
    assert remaining[transfer_rank(space, measured, fitted, remaining, np.array([0, 1]))[0]] == 5


def test_transfer_measures_the_voted_configurations_at_both_end_clocks_of_a_small_grid():
    from kareus.search.acquisition import Planes, transfer_rank

    space = SearchSpace((1410, 1300, 1200, 1100), (3, 6, 9), ("a",))  # 3 configurations, 4 clocks
    measured = np.array([3, 4, 5])  # a sweep at 1300 MHz: 3 SMs lean, 6 SMs fast, 9 SMs dominated
    time_s, effective = np.array([1.3, 1.0, 1.1]), np.array([3.0, 4.0, 4.5])
    remaining = np.setdiff1d(np.arange(space.size), measured)
    # Predicted like the sweep clock everywhere (trees with one clock of data cannot tell clocks apart).
    predicted_time = np.tile([1.3, 1.0, 1.1], 3)
    predicted_effective = np.tile([3.0, 4.0, 4.5], 3)
    planes = Planes(time_s, effective, predicted_time, predicted_effective, 85.0)
    order = remaining[transfer_rank(space, measured, planes, remaining, np.arange(len(remaining)))]
    urgent = set(order[:5].tolist())
    # Each uncovered clock's best point, plus the other voted configuration at 1410 and 1100 MHz.
    assert {0, 1, 9, 10} <= urgent and len(urgent & {6, 7}) == 1
    assert {2, 8, 11} & urgent == set()  # 9 SMs is on no front


def test_stopping_rule_waits_for_every_clock():
    # Flat costs: no batch improves the front, so the stopping rule would end the search after
    # the sweep and three batches (22 points), with most clocks never measured.
    space = SearchSpace(tuple(range(900, 1411, 30)), tuple(range(3, 31, 3)), ("a",))
    problem = Problem("flat", space, lambda cs: [(1.0, 100.0) for _ in cs], 85.0, "small")
    result = minimize(problem, _stopping_default(), seed=0)
    assert {e.candidate.clock_mhz for e in result.measured} == set(space.clocks_mhz)
    assert result.evaluations < 0.2 * space.size  # and then it does stop


def test_neighbours_pass_steps_from_the_front_to_a_configuration_the_surrogate_misjudges(monkeypatch):
    from kareus.search import acquisition
    from kareus.search.acquisition import Planes, neighbours_rank

    monkeypatch.setattr(acquisition, "LEAN_PROBE_COUNTS", 0)  # the stepping alone; the probes below
    # Two slots, three SM counts, three clocks. Measured: (6, a) at every clock (the front), and
    # two dominated points, (3, a) at 1410 and (9, a) at 1200. (6, b) was never measured.
    space = SearchSpace((1410, 1200, 1000), (3, 6, 9), ("a", "b"))
    cell = {(c, s, k): (c * 3 + s) * 2 + k for c in range(3) for s in range(3) for k in range(2)}
    measured = np.array([cell[0, 1, 0], cell[1, 1, 0], cell[2, 1, 0], cell[0, 0, 0], cell[1, 2, 0]])
    time_s = np.array([1.0, 1.2, 1.5, 1.6, 1.4])
    effective = np.array([5.0, 4.0, 3.0, 5.6, 4.5])
    remaining = np.setdiff1d(np.arange(space.size), measured)
    # The surrogate ranks (6, b) last of all: it has no measurement of that configuration.
    unseen = np.array([space.configuration_index[g] == 3 for g in remaining])
    tie_break = np.argsort(unseen, kind="stable")
    planes = Planes(time_s, effective, np.full(len(remaining), 2.0), np.full(len(remaining), 6.0), 85.0)
    order = remaining[neighbours_rank(space, measured, planes, remaining, tie_break)]
    assert sorted(order) == sorted(remaining)
    # The front's unmeasured neighbours come first, and first of all the never-measured (6, b)
    # at each front point's clock: the surrogate's ranking does not hide it.
    assert set(order[:3]) == {cell[0, 1, 1], cell[1, 1, 1], cell[2, 1, 1]}
    near_front = {cell[c, s, k] for c in range(3) for s, k in ((0, 0), (2, 0), (1, 1))} - set(measured)
    assert set(order[:len(near_front)]) == near_front
    # (3, b) and (9, b) are next to no front point: after, in the tie break's order.
    assert list(order[len(near_front):]) == [g for g in remaining[tie_break] if g not in near_front]


def test_neighbours_pass_probes_each_slots_fewest_comm_sms_at_the_lean_end_clocks_first():
    from kareus.search.acquisition import LEAN_PROBE_COUNTS, Planes, neighbours_rank

    # Three clocks, four SM counts, two slots. Least total energy is predicted at 1200 MHz; the
    # lowest clock is 1000. Measured: (6, a) at every clock and (3, a) at 1200 MHz.
    assert LEAN_PROBE_COUNTS == 2
    space = SearchSpace((1410, 1200, 1000), (12, 3, 9, 6), ("a", "b"))  # counts in any order
    cell = {(c, s, k): (c * 4 + s) * 2 + k for c in range(3) for s in range(4) for k in range(2)}
    three, six = 1, 3  # grid positions of 3 and 6 SMs
    measured = np.array([cell[0, six, 0], cell[1, six, 0], cell[2, six, 0], cell[1, three, 0]])
    time_s = np.array([1.0, 1.2, 1.5, 1.25])
    effective = np.array([50.0, 20.0, 19.0, 21.0])  # total (85 W static): 135, 122, 146.5, 127.25
    remaining = np.setdiff1d(np.arange(space.size), measured)
    planes = Planes(time_s, effective, np.full(len(remaining), 2.0), np.full(len(remaining), 60.0), 85.0)
    order = remaining[neighbours_rank(space, measured, planes, remaining, np.arange(len(remaining)))]
    assert sorted(order) == sorted(remaining)
    # Fewest counts first (3 SMs, then 6), each at the least-total-energy clock, then the lowest,
    # each slot in turn; the measured ones skipped.
    assert list(order[:5]) == [cell[1, three, 1], cell[2, three, 0], cell[2, three, 1],
                               cell[1, six, 1], cell[2, six, 1]]
    # Then the stepping from the front as before: 9 and 12 SMs are never probed.
    assert not {cell[c, s, k] for c in (1, 2) for s in (0, 2) for k in (0, 1)} & set(order[:5])


def test_transfer_carries_a_configuration_to_the_clocks_next_to_where_it_is_on_the_whole_front():
    from kareus.search.acquisition import Planes, transfer_rank

    # Five clocks, three SM counts, two slots. (21, a) is the fast end at every clock; (3, a) is
    # every clock's slowest and leanest point, so it is on each clock's own front, but on the
    # grid's front only at 1000 MHz (a lower clock beats it everywhere else); the others lose at
    # every clock. Votes from each clock's own front tie the two and carried (3, a) to the high
    # clocks first (Qwen3 CP2+TP4 fwd_qkv_ar: half the budget spent so).
    space = SearchSpace((1400, 1300, 1200, 1100, 1000), (3, 12, 21), ("a", "b"))
    clock_i, sms_i, slot_i = space.axes
    f = np.asarray(space.clocks_mhz, float)[clock_i] / 1400
    fast = (sms_i == 2) & (slot_i == 0)
    lean = (sms_i == 0) & (slot_i == 0)
    time_s = np.where(fast, 1.0, np.where(lean, 1.6, 1.3)) / f
    effective = np.where(fast, 2.0, np.where(lean, 1.8, 2.1)) * f**2
    # Every clock measured once (no clock is urgent), both ends at 1400 and 1000 MHz.
    other = (sms_i == 1) & (slot_i == 1)
    measured = np.flatnonzero(other | ((fast | lean) & np.isin(clock_i, [0, 4])))
    remaining = np.setdiff1d(np.arange(space.size), measured)
    planes = Planes(time_s[measured], effective[measured], time_s[remaining], effective[remaining], 0.1)
    tie_break = np.argsort(~lean[remaining], kind="stable")  # the surrogate passes favour (3, a)
    order = remaining[transfer_rank(space, measured, planes, remaining, tie_break)]
    assert set(order[:3]) == set(np.flatnonzero(fast & np.isin(clock_i, [1, 2, 3])))
    # (3, a) goes first next to 1000 MHz, where it wins, and last to 1300 MHz.
    lean_order = [int(clock_i[g]) for g in order if lean[g]]
    assert lean_order == [3, 2, 1]


def test_transfer_gives_each_clocks_own_lean_end_a_fraction_of_a_vote():
    from kareus.search.acquisition import Planes, transfer_rank

    # As above, but (3, b) beats (3, a) at 1000 MHz, so (3, a) is on the grid's front nowhere,
    # only on each of the other clocks' own fronts (their lean end). It is still worth carrying
    # before the configurations on no front at all: the lean end is where the grid's front goes
    # at the low clocks (full bench: 8 types below 99 % with whole-front votes alone, 4 with it).
    space = SearchSpace((1400, 1300, 1200, 1100, 1000), (3, 12, 21), ("a", "b"))
    clock_i, sms_i, slot_i = space.axes
    f = np.asarray(space.clocks_mhz, float)[clock_i] / 1400
    fast = (sms_i == 2) & (slot_i == 0)
    lean = (sms_i == 0) & (slot_i == 0)
    low = (sms_i == 0) & (slot_i == 1)
    time_s = np.where(fast, 1.0, np.where(lean, 1.6, 1.7)) / f
    effective = np.where(fast, 2.0, np.where(lean, 1.8, 2.1)) * f**2
    best_low = low & (clock_i == 4)
    time_s[best_low], effective[best_low] = 1.5 / f[best_low], 1.7 * f[best_low] ** 2
    other = (sms_i == 1) & (slot_i == 1)
    measured = np.flatnonzero(other | ((fast | lean | low) & np.isin(clock_i, [0, 4])))
    remaining = np.setdiff1d(np.arange(space.size), measured)
    planes = Planes(time_s[measured], effective[measured], time_s[remaining], effective[remaining], 0.1)
    tie_break = np.argsort(lean[remaining], kind="stable")  # the surrogate passes put (3, a) last
    order = remaining[transfer_rank(space, measured, planes, remaining, tie_break)]
    assert set(order[:3]) == set(np.flatnonzero(fast & np.isin(clock_i, [1, 2, 3])))
    rank = {int(g): i for i, g in enumerate(order)}
    nowhere = [g for g in remaining if not (fast | lean | low)[g]]  # on no clock's front
    assert max(rank[g] for g in np.flatnonzero(lean) if g in rank) < min(rank[g] for g in nowhere)
