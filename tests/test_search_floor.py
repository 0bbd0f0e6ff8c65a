"""`bench/search_floor.py`: how precisely a search can know the band it must measure."""

from __future__ import annotations

import numpy as np
from bench_scripts import load

from kareus.search.problem import SearchSpace


def _floor():
    return load("search_floor")


SPACE = SearchSpace((900, 1000, 1100, 1200, 1300, 1400), (3, 6, 9, 12), ("a", "b", "c"))


def _grid(per_configuration: int, seed: int = 0) -> np.ndarray:
    """log values that the family with `per_configuration` parameters describes exactly."""
    floor = _floor()
    design = floor.design_matrix(SPACE, per_configuration)
    return design @ np.random.default_rng(seed).normal(0, 0.05, (design.shape[1], 2))


def test_the_family_is_nested_and_describes_its_own_grids_exactly():
    floor = _floor()
    everything = np.arange(SPACE.size)
    ranks = [np.linalg.matrix_rank(floor.design_matrix(SPACE, k)) for k in (1, 2, 3)]
    # 6 clocks + 11 configuration offsets, then 11 more per degree: the 12 terms of a degree sum
    # to a function of the clock, which the clock curve already is.
    assert ranks == [17, 28, 39]
    truth = _grid(2)
    assert max(floor.rms_error(floor.design_matrix(SPACE, 2), everything, truth, truth, everything)) < 1e-12
    # One parameter per configuration cannot describe a drift over the clock.
    assert min(floor.rms_error(floor.design_matrix(SPACE, 1), everything, truth, truth, everything)) > 1e-3


def test_estimable_points_are_those_the_measurements_connect():
    floor = _floor()
    design = floor.design_matrix(SPACE, 1)
    index = {(c.clock_mhz, c.comm_sms, c.launch_slot): i for i, c in enumerate(map(SPACE.candidate, range(SPACE.size)))}
    # Configuration (3, a) at 900 and 1000 MHz, (6, a) at 1000 MHz: (6, a) at 900 MHz follows
    # (the clock curve's step is known from (3, a)); (9, a) was never measured, and 1100 MHz neither.
    measured = np.array([index[(900, 3, "a")], index[(1000, 3, "a")], index[(1000, 6, "a")]])
    mask = floor.estimable(design, measured)
    assert mask[index[(900, 6, "a")]]
    assert mask[measured].all()
    assert not mask[index[(900, 9, "a")]]
    assert not mask[index[(1100, 3, "a")]]
    # With a drift per configuration, (6, a) measured at one clock no longer fixes it at another.
    assert not floor.estimable(floor.design_matrix(SPACE, 2), measured)[index[(900, 6, "a")]]


def test_a_least_squares_fit_errs_by_sigma_root_p_over_n_at_the_measured_points():
    # The variance the note's floor rests on: p parameters from n measurements at noise sigma
    # leave an RMS error of sigma * sqrt(p / n) at the measured points (averaged over draws).
    floor = _floor()
    design = floor.design_matrix(SPACE, 1)
    truth = _grid(1)
    everything = np.arange(SPACE.size)
    sigma, errors = 0.01, []
    for draw in range(200):
        noisy = truth + np.random.default_rng(draw).normal(0, sigma, truth.shape)
        errors.append(np.square(floor.rms_error(design, everything, noisy, truth, everything)))
    p, n = np.linalg.matrix_rank(design), SPACE.size
    measured_rms = float(np.sqrt(np.mean(errors)))
    assert abs(measured_rms / (sigma * np.sqrt(p / n)) - 1) < 0.05


def test_floor_of_a_real_partition_type_reports_bias_and_errors():
    bench = load("mbo_efficiency")
    floor = _floor()
    case = bench.Case("qwen3-1.7b", 4, 2, 4096, 8, "bwd_o_ar", 0, 0.01)  # 180 points, 10 configurations
    out = floor.floor_case(case, within=0.01)
    assert out["budget"] == 36 and out["configurations"] == 10
    assert out["parameters"] == {1: 27, 2: 36, 3: 45}
    for name in ("oracle k=1", "default k=1", "oracle k=2", "default k=2"):
        assert set(out["error"][name]["measured"]) == {"time", "effective"}
    # The band (20 points within 1 % of the front) fits in the oracle's 36: it measured all of it,
    # so it has no unmeasured band point to predict; the search missed some and can place them all.
    assert out["band"] == 20
    assert out["error"]["oracle k=1"]["unmeasured"] is None and out["error"]["oracle k=1"]["estimable"] is None
    assert out["error"]["default k=1"]["estimable"] == 1.0
    # Fitted to 1 % noise, even the oracle's measured band points are known no better than a
    # few tenths of a percent: the acceptance needs 0.25-0.5 %.
    assert out["error"]["oracle k=1"]["measured"]["time"] > 0.002
