"""MBO on the simulated GPU: the default preset finds the exhaustive front with a fifth of the grid."""

from __future__ import annotations

import numpy as np
import pytest

from kareus.search.algorithms import Exhaustive, get_algorithm, minimize
from kareus.search.indicators import Normaliser, hypervolume
from kareus.search.problem import Problem, SearchSpace
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
