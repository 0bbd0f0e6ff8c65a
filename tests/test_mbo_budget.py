"""`bench/mbo_budget.py`: the `default` search with its cap at other shares of the grid."""

from __future__ import annotations

import pytest
from bench_scripts import load

from kareus.search.algorithms import get_algorithm, minimize
from kareus.search.testproblems import overlap_problem


def _problem():
    # A fresh problem per run: its noise is drawn in measurement order, so equal runs see equal draws.
    return overlap_problem(noise_std=0.01, seed=3)


def test_the_shipped_cap_is_the_default_search():
    budget = load("mbo_budget")
    shipped = minimize(_problem(), get_algorithm("default"), seed=1)
    same = minimize(_problem(), budget.default_at(0.2), seed=1)
    assert [e.candidate for e in same.measured] == [e.candidate for e in shipped.measured]


def test_a_larger_cap_runs_the_same_search_longer():
    budget = load("mbo_budget")
    short = minimize(_problem(), budget.default_at(0.2), seed=1)
    longer = minimize(_problem(), budget.default_at(0.25), seed=1)
    assert (short.evaluations, longer.evaluations) == (int(0.2 * 720), int(0.25 * 720))
    # No stopping rule: every batch before the shorter run's last one is the same.
    before_last = short.history[-1].evaluations - len(short.history[-1].evaluated)
    assert before_last > 100
    assert [e.candidate for e in longer.measured[:before_last]] == [e.candidate for e in short.measured[:before_last]]


def test_run_case_scores_each_cap_as_the_efficiency_bench_does():
    budget, efficiency = load("mbo_budget"), load("mbo_efficiency")
    case = efficiency.Case("qwen3-1.7b", 4, 2, 4096, 8, "fwd_qkv_ar", 0, 0.01)
    result = budget.run_case(case, (0.2, 0.25))
    assert result["grid"] == 360
    shipped = efficiency.run_case(case)["methods"]["default"]
    at_20 = result["methods"]["20.0%"]
    assert at_20["evaluations"] == shipped["evaluations"] == 72
    assert (at_20["hv_effective"], at_20["hv_total"]) == (shipped["hv_effective"], shipped["hv_total"])
    assert result["methods"]["25.0%"]["evaluations"] == 90


def _result(config: str, partition: str, scores: dict[str, tuple[float, float]]) -> dict:
    return {"case": {"partition": partition}, "config": config, "grid": 100,
            "methods": {cap: {"evaluations": round(float(cap.rstrip("%"))), "hv_effective": effective, "hv_total": total}
                        for cap, (effective, total) in scores.items()}}


def test_summary_counts_searches_and_types_below_the_target_per_cap():
    budget = load("mbo_budget")
    # Type a: two of three seeds below 99 % at 20 % (one by its total-energy plane only), median 0.985.
    # Type b: one seed below, median 0.995. At 25 % every search reaches the target.
    results = [_result("a", "p", {"20.0%": (0.98, 0.99), "25.0%": (1.0, 1.0)}),
               _result("a", "p", {"20.0%": (1.0, 0.985), "25.0%": (1.0, 1.0)}),
               _result("a", "p", {"20.0%": (1.0, 1.0), "25.0%": (1.0, 1.0)}),
               _result("b", "p", {"20.0%": (0.995, 0.999), "25.0%": (1.0, 0.999)}),
               _result("b", "p", {"20.0%": (0.999, 0.999), "25.0%": (1.0, 1.0)}),
               _result("b", "p", {"20.0%": (0.97, 1.0), "25.0%": (1.0, 1.0)})]
    summary = budget.summarise(results, (0.2, 0.25))
    at_20, at_25 = summary["20.0%"], summary["25.0%"]
    assert at_20["searches_below_target"] == 3 and at_20["lottery"]["per_search_rate"] == 0.5
    assert at_20["types_below_target"] == ["a p"] and at_20["worst_type_median_hv"] == 0.985
    assert at_20["grid_share"] == 0.2 and at_25["grid_share"] == 0.25
    assert at_25["searches_below_target"] == 0 and at_25["types_below_target"] == []


@pytest.mark.parametrize("fractions", ["0.2,1.5", "0,0.2", "0.2,x"])
def test_caps_outside_the_grid_are_refused(fractions, capsys):
    with pytest.raises(SystemExit):
        load("mbo_budget").main(["--fractions", fractions])
    error = capsys.readouterr().err
    assert "--fractions" in error and "(0, 1]" in error and fractions in error
