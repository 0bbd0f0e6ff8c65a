"""Kareus against the baselines on one simulated configuration: the issue's acceptance claims.

Llama 3.2 3B, TP8 PP2, microbatch 8, sequence 4096 (the paper's first configuration, 4
microbatches to stay quick), profiled with the default MBO preset on the simulated A100.
"""

from __future__ import annotations

import pytest
from optimizer_fixtures import job, simulator

from kareus.optimizer import metrics
from kareus.optimizer.baselines import METHODS, compare_methods, method_frontier
from kareus.optimizer.frontier import FrontierSettings
from kareus.plan import validate_plan
from kareus.profiler import profile_job

SETTINGS = FrontierSettings()  # adaptive: 1000 steps for this 16-instruction pipeline


@pytest.fixture(scope="module")
def setup():
    the_job = job(microbatches=4, objective={"timeBudget": {"maxSlowdownPercent": 5}})
    profile = profile_job(the_job, backend="sim", seed=0)
    return the_job, profile, compare_methods(the_job, profile, simulator(), settings=SETTINGS)


def test_kareus_is_never_dominated_by_a_baseline(setup):
    _, _, comparison = setup
    kareus = comparison.methods["kareus"].points
    for name in METHODS:
        assert metrics.dominated_by(kareus, comparison.methods[name].points) == [], name


def test_max_throughput_beats_megatron_in_time_and_energy(setup):
    _, _, comparison = setup
    row = comparison.metrics["per_method"]["kareus"]
    assert row["max_throughput_time_reduction"] > 0.05
    assert row["max_throughput_energy_reduction"] > 0.02


def test_iso_time_and_iso_energy_gains_over_megatron_perseus(setup):
    _, _, comparison = setup
    row = comparison.metrics["per_method"]["kareus"]
    assert row["iso_time_energy_reduction"] > 0.05
    assert row["iso_energy_time_reduction"] > 0.05
    reference = comparison.metrics["per_method"]["megatron_perseus"]
    assert reference["iso_time_energy_reduction"] == pytest.approx(0.0)


def test_baselines_are_what_they_claim(setup):
    _, profile, comparison = setup
    megatron = comparison.methods["megatron"]
    assert len(megatron.points) == 1
    top = max(profile.clocks_mhz)
    for options in megatron.frontier.options:
        assert [(o.mode, o.clock_mhz) for o in options.forward + options.backward] == [("sequential", top)] * 2
    for options in comparison.methods["megatron_perseus"].frontier.options:
        assert {o.mode for o in options.forward + options.backward} == {"sequential"}
    for options in comparison.methods["nanobatch_perseus"].frontier.options:
        assert {o.mode for o in options.forward} == {"partitioned"}
        assert {c.comm_sms for o in options.forward for c in o.configs.values()} == {30}
    # Perseus never loses to its max-clock counterpart at its fastest point
    assert min(comparison.methods["megatron_perseus"].points)[1] <= megatron.points[0][1]


def test_profiled_frontier_is_within_one_percent_of_exhaustive(setup):
    the_job, profile, comparison = setup
    exhaustive = method_frontier("kareus_exhaustive", the_job, profile, simulator(), SETTINGS)
    assert metrics.hypervolume_ratio(comparison.methods["kareus"].points, exhaustive.points) >= 0.99


def test_comparison_json_shape_and_plan(setup):
    _, _, comparison = setup
    data = comparison.to_dict()
    assert set(data["methods"]) == set(METHODS)
    point = data["methods"]["kareus"]["frontier"][0]
    assert set(point) == {"time_s", "energy_j"} and point["time_s"] > 0
    assert data["metrics"]["iso_reference"] == "megatron_perseus"
    plan = comparison.plan
    assert set(plan.baselines) == set(METHODS) - {"kareus"}
    assert plan.objective == {"timeBudget": {"maxSlowdownPercent": 5.0}}
    assert plan.predicted.iteration_time_s <= min(comparison.methods["kareus"].points)[0] * 1.05
    assert validate_plan(plan.to_dict()) == []
