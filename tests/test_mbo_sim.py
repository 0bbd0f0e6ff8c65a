"""MBO on the simulated GPU: the default preset finds the exhaustive front with a fifth of the grid."""

from __future__ import annotations

import numpy as np
import pytest
from bench_scripts import load

from kareus.search.algorithms import Exhaustive, get_algorithm, minimize
from kareus.search.indicators import Normaliser, hypervolume
from kareus.search.problem import Candidate, Problem, SearchSpace
from kareus.sim import Simulator, get_gpu
from kareus.workload.models import get_preset
from kareus.workload.partitions import build_workload


def _problem(model: str, tp: int, cp: int, name: str) -> Problem:
    gpu = get_gpu("A100-SXM4-40GB")
    ptype = build_workload(get_preset(model), tp=tp, cp=cp, pp=1, seq_len=4096,
                           micro_batch_size=8).partition_types[name]
    simulator = Simulator(gpu)

    def measure(candidates):
        return [(m.time_s, m.energy_j) for m in (
            simulator.partition(ptype, c.clock_mhz, c.comm_sms, c.launch_slot) for c in candidates)]

    space = SearchSpace(gpu.search_clocks_mhz, ptype.comm_sms_grid, ptype.launch_slots)
    return Problem(name, space, measure, gpu.p_static_w, ptype.size_class)


@pytest.mark.parametrize(("model", "tp", "cp", "name"), [
    ("qwen3-1.7b", 4, 2, "bwd_o_ar"),  # 180 points: 36 measurements allowed
    ("llama3.2-3b", 8, 1, "fwd_mlp"),  # 540 points
])
def test_default_preset_reaches_99_percent_of_exhaustive_hypervolume(model, tp, cp, name):
    problem = _problem(model, tp, cp, name)
    exhaustive = minimize(problem, Exhaustive())
    result = minimize(problem, get_algorithm("default"), seed=1)
    assert result.evaluations <= 0.2 * problem.space.size
    for plane in ("effective", "total"):
        def points(items, plane=plane):
            return np.array([(e.time_s, e.effective_energy_j + (problem.p_static_w * e.time_s
                                                                 if plane == "total" else 0.0)) for e in items])
        scale = Normaliser.fit(points(exhaustive.measured))
        ratio = hypervolume(scale(points(result.frontier))) / hypervolume(scale(points(exhaustive.frontier)))
        assert ratio >= 0.99, (plane, ratio)
    assert {e.candidate.clock_mhz for e in result.measured} == set(problem.space.clocks_mhz)


@pytest.mark.parametrize("seed", [0, 3])
def test_default_preset_finds_the_front_ridge_the_trees_mispredict(seed):
    # Llama 3.2 3B TP8 fwd_attn (720 points): below 1110 MHz the front runs along 12 comm SMs at
    # the RoPE and attention slots, which the trees predict 7-20 % too slow; without the
    # neighbours pass seed 0 reached only 0.968 of the exhaustive hypervolume (total energy).
    problem = _problem("llama3.2-3b", 8, 1, "fwd_attn")
    exhaustive = minimize(problem, Exhaustive())
    result = minimize(problem, get_algorithm("default"), seed=seed)
    assert result.evaluations <= 0.2 * problem.space.size
    for plane in ("effective", "total"):
        def points(items, plane=plane):
            return np.array([(e.time_s, e.effective_energy_j + (problem.p_static_w * e.time_s
                                                                 if plane == "total" else 0.0)) for e in items])
        scale = Normaliser.fit(points(exhaustive.measured))
        ratio = hypervolume(scale(points(result.frontier))) / hypervolume(scale(points(exhaustive.frontier)))
        assert ratio >= 0.99, (plane, ratio)


def _bench():
    return load("mbo_efficiency")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_default_preset_reaches_99_percent_under_noise_on_qwen3_cp2tp4_fwd_qkv_ar(seed):
    # As the bench scores it (1 % noise; the true cost of the configurations on the measured
    # front against the same for the exhaustive search): before the transfer pass voted on the
    # whole grid's front, seeds 0-2 reached 0.9888 / 0.9894 / 0.9900 — the pass spent half of the
    # 72 measurements carrying each clock's leanest configuration (3 comm SMs) to every clock.
    bench = _bench()
    case = bench.Case("qwen3-1.7b", 4, 2, 4096, 8, "fwd_qkv_ar", seed, 0.01)
    result = bench.run_case(case)["methods"]["default"]
    assert result["evaluations"] <= 0.2 * 360
    assert min(result["hv_effective"], result["hv_total"]) >= 0.99, result


def test_bench_reports_coverage_and_runs_a_held_out_gpu():
    # Coverage: the true front of the configurations a method measured against the noise-free
    # optimum, beside the acceptance's ratio, so a miss can be told from the noise's selection
    # loss; `--gpu`/`--models` run the configurations on a held-out GPU or model.
    bench = _bench()
    todo = bench.cases(True, 1, 0.01, "H100-SXM5-80GB", ("llama3.1-8b", "qwen3-1.7b"))
    assert {c.gpu for c in todo} == {"H100-SXM5-80GB"} and todo[0].model == "llama3.1-8b"
    case = next(c for c in todo if c.partition == "bwd_o_ar")
    result = bench.run_case(case)
    assert result["config"].startswith("H100-SXM5-80GB qwen3-1.7b")
    assert result["grid"] == 25 * 10  # H100: 25 clocks
    for method in result["methods"].values():
        assert 0.0 < method["coverage"] <= 1.0 + 1e-9
    summary = bench.summarise([result])
    assert "types_below_target_coverage" in summary["default"]
    assert bench.main(["--quick", "--seeds", "1", "--partitions", "bwd_o_ar", "--gpu", "A100-SXM4-40GB"]) == 0


def test_relative_gap_is_the_factor_by_which_a_point_misses_the_front():
    bench = _bench()
    plane = np.array([[1.0, 4.0], [2.0, 2.0], [4.0, 1.0], [2.02, 2.04], [8.0, 8.0]])
    # (2.02, 2.04) is within 2 % of (2, 2) on both axes; (8, 8) is nearest (2, 2), a factor 4 off.
    assert bench.relative_gap(plane) == pytest.approx([0.0, 0.0, 0.0, 0.02, 3.0])


def test_bench_oracle_shows_that_measuring_the_front_alone_loses_to_the_noise():
    # The exhaustive search's noisy front holds near-equivalents that the noise drew onto it; a
    # subset loses against it only through such points it did not measure. Llama 3.2 3B CP2+TP4
    # s4096 b16 fwd_ao_ar, seed 2: the noise-free front alone (its 15 points) scores 0.979, the
    # default search's budget (36 points) nearest that front 0.999.
    bench = _bench()
    result = bench.run_case(bench.Case("llama3.2-3b", 4, 2, 4096, 16, "fwd_ao_ar", 2, 0.01))
    band, front = result["oracle"]["band"], result["oracle"]["front"]
    assert band["evaluations"] == result["methods"]["default"]["evaluations"] <= 0.2 * result["grid"]
    assert front["evaluations"] < band["evaluations"]
    assert {o["evaluations"] for name, o in result["oracle"].items() if name.startswith(("within", "ranked"))} == {36}
    assert min(front["hv_effective"], front["hv_total"]) < 0.985
    assert min(band["hv_effective"], band["hv_total"]) >= 0.99
    summary = bench.summarise([result])
    assert summary["oracle_band"]["searches_below_target"] == 0
    assert summary["oracle_front"]["searches_below_target"] == 1
    assert summary["default"]["searches_below_target"] in (0, 1)
    # The counterfactual adds exactly the noise-free front points the default search missed.
    default = result["methods"]["default"]
    missed = round((1 - default["front_points_measured"]) * front["evaluations"])
    assert default["front_completed"]["evaluations"] == default["evaluations"] + missed
    assert summary["default_front_completed"]["extra_evaluations"] == pytest.approx(missed / default["evaluations"])


def test_bench_counts_the_noise_free_front_points_a_search_measured():
    bench = _bench()
    front = np.array([3, 5, 8, 13])
    assert bench.front_points_measured([1, 3, 8, 9], front) == 0.5
    assert bench.front_points_measured([], front) == 0.0
    assert bench.front_points_measured([1], np.array([], dtype=int)) == 1.0


def test_bench_ranked_oracle_measures_the_band_when_exact_and_strays_from_it_with_its_error():
    bench = _bench()
    gap = np.linspace(0.0, 0.1, 101)  # point i lies 0.1 % * i from the front
    exact = bench.ranked_nearest(gap, 10, 0.0, np.random.default_rng(0))
    assert exact == list(range(10))
    # At a 1 % error (ten points' spacing) about a third of the ten picks lie beyond the ten nearest
    # (3.6 on average over these draws), at 0.1 % under one.
    strays = [sum(i >= 10 for i in bench.ranked_nearest(gap, 10, 0.01, np.random.default_rng(seed)))
              for seed in range(200)]
    assert 2.5 < np.mean(strays) < 5
    small = [sum(i >= 10 for i in bench.ranked_nearest(gap, 10, 0.001, np.random.default_rng(seed)))
             for seed in range(200)]
    assert np.mean(small) < 1


def test_bench_repair_names_the_fewest_missed_front_points_that_restore_the_target():
    # Greedy: each step adds the missed exhaustive-front point that raises the score most, until
    # the target; a search at the target needs none.
    bench = _bench()
    gains = {10: 0.008, 11: 0.015, 12: 0.002}

    def score(chosen: list[int]) -> float:
        return 0.97 + sum(g for point, g in gains.items() if point in chosen)

    def describe(point: int) -> tuple:
        return Candidate(1000 + point, 3, "a"), "inside"

    steps = bench.repair([1, 2, 3], [2, 10, 11, 12], score, describe)
    assert [s["clock_mhz"] for s in steps] == [1011, 1010]  # 0.985, then 0.993 >= 0.99
    assert steps[-1]["score"] == pytest.approx(0.993)
    assert bench.repair([10, 11], [10, 11, 12], score, describe) == []


def test_default_preset_probes_the_fewest_comm_sms_where_total_energy_is_least():
    # Llama 3.2 3B CP2+TP4 s4096 b8 bwd_qkv_ar, seed 4, as the bench scores it (1 % noise): the
    # front's lean end in total energy is 3 comm SMs at the RoPE slot at 1050 MHz, the grid's edge;
    # before the lean probes the search never measured it there and reached 0.9662 (total energy)
    # of the exhaustive hypervolume, after 0.9991.
    bench = _bench()
    result = bench.run_case(bench.Case("llama3.2-3b", 4, 2, 4096, 8, "bwd_qkv_ar", 4, 0.01))["methods"]["default"]
    assert result["evaluations"] <= 0.2 * 360
    assert min(result["hv_effective"], result["hv_total"]) >= 0.99


def test_bench_lottery_tells_a_type_the_search_misses_from_the_noise():
    # 40 types × 6 seeds, 24 of 240 searches below (10 %): one type below in 5 of its 6 seeds (a
    # binomial tail of 5e-5 at 10 %, under 0.05 / 40), the others' 19 spread one or two a type.
    bench = _bench()

    def result(kind: int, seed: int, below: bool) -> dict:
        score = {"hv_effective": 0.98 if below else 1.0, "hv_total": 1.0}
        return {"config": f"type {kind}", "case": {"partition": "p", "seed": seed}, "methods": {"default": score}}

    spread = [1] * 15 + [2] * 2 + [0] * 22
    results = [result(0, seed, seed < 5) for seed in range(6)]
    results += [result(kind, seed, seed < count) for kind, count in enumerate(spread, 1) for seed in range(6)]
    luck = bench.lottery(results)
    assert luck["per_search_rate"] == pytest.approx(24 / 240)
    assert luck["systematic"] == [("type 0 p", 5, 6)]
    # More than half of 6 below: P(K >= 4) at 10 %; at least half: P(K >= 3).
    low, high = luck["expected_types_below"]
    assert low == pytest.approx(40 * 0.00127, rel=0.01) and high == pytest.approx(40 * 0.01585, rel=0.01)
    # Three seeds: P(K >= 2) = 3p^2 - 2p^3, and no type can be named.
    three = bench.lottery([r for r in results if r["case"]["seed"] < 3])
    assert three["expected_types_below"][0] == pytest.approx(three["expected_types_below"][1])
    assert three["systematic"] == []


def test_clocks_pass_keeps_the_least_total_energy_clock_on_the_front():
    # Llama 3.2 3B CP2+TP4 s8192 b8 bwd_a_ag, seed 2: every configuration is within 0.25 % of the
    # front, and the least total energy is at 1050 MHz. Before the clocks pass the search measured
    # 1050 MHz twice and 1080 MHz seven times; 1080's luckiest draws pushed both 1050 points off its
    # front, and it scored 0.9755 (1.2 % of hypervolume is that one point).
    bench = _bench()
    result = bench.run_case(bench.Case("llama3.2-3b", 4, 2, 8192, 8, "bwd_a_ag", 2, 0.01))["methods"]["default"]
    assert result["evaluations"] <= 0.2 * 360
    assert min(result["hv_effective"], result["hv_total"]) >= 0.99, result
    assert result["repair"] == []
