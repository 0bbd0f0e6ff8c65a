"""Composition: microbatch frontiers agree with whole-instruction execution and brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optimizer_fixtures import CLOCKS_MHZ, plan_job, simulator, stage_options

from kareus.optimizer.composition import CompositionSettings, microbatch_frontier, pareto_mask
from kareus.optimizer.sources import SimulatorSource, nanobatch_configs


def test_composed_instructions_match_whole_instruction_execution():
    """No fudge factor: Σ instances × partition + non-partition work == the simulated instruction."""
    workload = plan_job().workload()
    sim = simulator()
    checked = 0
    for s, options in enumerate(stage_options()):
        for direction in ("forward", "backward"):
            for option in options.of(direction):
                configs = dict(option.configs) if option.mode == "partitioned" else None
                m = sim.instruction(workload.stages[s], direction, option.clock_mhz, configs,
                                    dict(option.recompute_configs) or None)
                assert m.time_s == pytest.approx(option.time_s, rel=1e-9)
                assert m.energy_j == pytest.approx(option.energy_j, rel=1e-9)
                checked += 1
    assert checked > 40


def test_frontiers_are_pareto_sorted_and_use_recompute_configs():
    for options in stage_options():
        for direction in ("forward", "backward"):
            table = options.of(direction)
            times = [o.time_s for o in table]
            eff = [o.effective_energy_j(simulator().p_static_w) for o in table]
            assert times == sorted(times)
            assert all(a > b for a, b in itertools.pairwise(eff)), "slower options must save effective energy"
        assert all(set(o.recompute_configs) == {"fwd_attn", "fwd_mlp"}
                   for o in options.backward if o.mode == "partitioned")
        assert all(not o.recompute_configs for o in options.forward)


def test_folding_equals_the_full_cross_product():
    """The per-type Pareto folding finds exactly the Pareto set of the full cross product."""
    workload = plan_job().workload()
    source = SimulatorSource(simulator(), workload, (1230,))
    folded = microbatch_frontier(workload, 0, "forward", source, CompositionSettings(sequential=False,
                                                                                    tolerance_j=0.0))
    stage = workload.stages[0]
    p_static = source.p_static_w
    rest_t, rest_e = source.nonpartition(0, "forward", 1230)
    tables = {name: source.partition_candidates(name, 1230) for name in stage.forward_instances}
    names = list(tables)
    brute = []
    for combo in itertools.product(*(tables[n] for n in names)):
        t = rest_t + sum(stage.forward_instances[n] * c.time_s for n, c in zip(names, combo, strict=True))
        e = rest_e + sum(stage.forward_instances[n] * c.energy_j for n, c in zip(names, combo, strict=True))
        brute.append((t, e - p_static * t))
    arr = np.array(brute)
    front = sorted(map(tuple, arr[pareto_mask(arr[:, 0], arr[:, 1])]))
    got = sorted((o.time_s, o.effective_energy_j(p_static)) for o in folded)
    assert len(got) == len(front)
    np.testing.assert_allclose(got, front, rtol=1e-12)


def test_settings_select_modes_and_clocks():
    workload = plan_job().workload()
    source = SimulatorSource(simulator(), workload, CLOCKS_MHZ, nanobatch_configs(workload))
    seq = microbatch_frontier(workload, 1, "backward", source, CompositionSettings(partitioned=False))
    assert seq and all(o.mode == "sequential" for o in seq)
    top = microbatch_frontier(workload, 1, "backward", source, CompositionSettings(sequential=False,
                                                                                  clocks_mhz=(1410,)))
    assert len(top) == 1 and top[0].clock_mhz == 1410 and top[0].mode == "partitioned"
    assert dict(top[0].configs) == {n: workload.partition_types[n].default_config() for n in ("bwd_attn", "bwd_mlp")}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(-5.0, 5.0)), min_size=1, max_size=40))
def test_pareto_mask_keeps_exactly_the_non_dominated(points):
    arr = np.array(points)
    mask = pareto_mask(arr[:, 0], arr[:, 1])
    for i, (t, e) in enumerate(points):
        dominated = any((t2 <= t and e2 <= e) and (t2 < t or e2 < e) for t2, e2 in points)
        if dominated:
            assert not mask[i]
    kept = {points[i] for i in np.flatnonzero(mask)}
    undominated = {p for p in points
                   if not any((q[0] <= p[0] and q[1] <= p[1]) and q != p for q in points)}
    assert kept == undominated
