"""The iteration frontier: 1F1B DAG, exact re-evaluation, slack reclaim, lowtime solve."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optimizer_fixtures import stage_options

from kareus.errors import KareusError
from kareus.optimizer.frontier import (
    FrontierSettings,
    PipelineDAG,
    PipelineProblem,
    expand_picks,
    iteration_frontier,
    reclaim_slack,
)
from kareus.plan import InstructionOption, StageOptions

P_STATIC_W = 85.0


@pytest.mark.parametrize(("stages", "microbatches"), [(1, 3), (2, 8), (4, 4), (4, 12)])
def test_uniform_1f1b_makespan_is_the_textbook_formula(stages, microbatches):
    dag = PipelineDAG.build(stages, microbatches)
    forward_s, backward_s = 1.0, 2.0
    durations = [forward_s if kind == "forward" else backward_s for _, kind, _ in dag.nodes]
    assert dag.makespan_s(durations) == pytest.approx((microbatches + stages - 1) * (forward_s + backward_s))


def _table(work_s: float, clocks=(1410, 1200, 1000, 900)) -> tuple[InstructionOption, ...]:
    """A physical-looking option table: slower clocks, less dynamic power, Pareto in time/eff."""
    out = []
    for f in clocks:
        t = work_s * (0.3 + 0.7 * 1410 / f)
        out.append(InstructionOption(f, "sequential", t, (P_STATIC_W + 300 * (f / 1410) ** 2.5) * t))
    return tuple(out)


def _options(stages: int) -> tuple[StageOptions, ...]:
    return tuple(StageOptions(_table(0.1 * (1 + 0.1 * s)), _table(0.3 * (1 + 0.1 * s))) for s in range(stages))


def _independent_energy(options, row, gpus_per_stage: int) -> float:
    """E_iter = gpus_per_stage · Σ E_eff + num_gpus · P_static · T_iter, computed from the row alone."""
    effective = 0.0
    for s, (fwd, bwd) in enumerate(row.choice):
        for kind, picks in (("forward", fwd), ("backward", bwd)):
            effective += sum(options[s].of(kind)[k].effective_energy_j(P_STATIC_W) for k in picks)
    return gpus_per_stage * effective + gpus_per_stage * len(options) * P_STATIC_W * row.time_s


def test_frontier_rows_are_exact_pareto_and_span_fastest_to_energy_minimum():
    options = _options(2)
    table = iteration_frontier(options, 6, p_static_w=P_STATIC_W, gpus_per_stage=8,
                               settings=FrontierSettings(target_steps=150))
    rows = table.rows
    assert len(rows) > 10
    assert all(a.time_s < b.time_s and a.energy_j > b.energy_j for a, b in itertools.pairwise(rows))
    dag = PipelineDAG.build(2, 6)
    fastest = dag.makespan_s([options[s].of(k)[0].time_s for s, k, _ in dag.nodes])
    assert rows[0].time_s == pytest.approx(fastest)
    for row in rows:
        assert row.energy_j == pytest.approx(_independent_energy(options, row, 8), rel=1e-12)
        durations = [options[s].of(k)[row.choice[s][0 if k == "forward" else 1][m]].time_s for s, k, m in dag.nodes]
        assert row.time_s == pytest.approx(dag.makespan_s(durations), rel=1e-12)
    # the all-slowest plan pays more static energy than the frontier's energy minimum
    slowest = PipelineProblem(dag, options, P_STATIC_W, 8).evaluate([len(options[s].of(k)) - 1 for s, k, _ in dag.nodes])
    assert rows[-1].energy_j <= slowest[1]


def test_exponential_and_convex_cost_models_give_close_frontiers():
    options = _options(2)
    ends = {}
    for model in ("exponential", "convex"):
        rows = iteration_frontier(options, 4, p_static_w=P_STATIC_W, gpus_per_stage=1,
                                  settings=FrontierSettings(target_steps=100, cost_model=model)).rows
        ends[model] = (rows[0].time_s, min(r.energy_j for r in rows))
    assert ends["exponential"][0] == pytest.approx(ends["convex"][0])
    assert ends["exponential"][1] == pytest.approx(ends["convex"][1], rel=0.02)


def test_single_option_pipelines_have_one_plan():
    one = (InstructionOption(1410, "sequential", 0.2, 40.0),)
    table = iteration_frontier([StageOptions(one, one)] * 3, 5, p_static_w=P_STATIC_W, gpus_per_stage=2)
    assert len(table.rows) == 1
    assert table.rows[0].time_s == pytest.approx((5 + 3 - 1) * 0.4)


def test_missing_options_are_a_clear_error():
    with pytest.raises(KareusError, match="stage 1 has no measured way to run its backward"):
        iteration_frontier([StageOptions(_table(0.1), _table(0.2)), StageOptions(_table(0.1), ())], 2,
                           p_static_w=P_STATIC_W, gpus_per_stage=1)


def test_long_pipelines_are_solved_compressed_and_evaluated_in_full():
    options = _options(3)
    settings = FrontierSettings(target_steps=100, solve_microbatches=8)
    table = iteration_frontier(options, 40, p_static_w=P_STATIC_W, gpus_per_stage=1, settings=settings)
    assert all(len(f) == 40 and len(b) == 40 for row in table.rows for f, b in row.choice)
    dag = PipelineDAG.build(3, 40)
    assert table.rows[0].time_s == pytest.approx(dag.makespan_s(
        [options[s].of(k)[0].time_s for s, k, _ in dag.nodes]))
    assert table.rows[-1].energy_j < table.rows[0].energy_j * 0.95


def test_expand_picks_keeps_warmup_and_cooldown():
    short, full = PipelineDAG.build(2, 6), PipelineDAG.build(2, 20)
    picks = [m for _, _, m in short.nodes]  # pick = the microbatch index, to trace the mapping
    expanded = dict(zip(full.nodes, expand_picks(short, full, picks), strict=True))
    assert [expanded[(0, "forward", m)] for m in range(20)][:3] == [0, 1, 2]
    assert [expanded[(0, "backward", m)] for m in range(20)][-3:] == [3, 4, 5]
    assert set(expanded[(1, "forward", m)] for m in range(3, 17)) <= {1, 2}


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 8), st.data())
def test_slack_reclaim_never_lengthens_nor_costs_energy(stages, microbatches, data):
    options = tuple(StageOptions(_table(data.draw(st.floats(0.05, 0.5))), _table(data.draw(st.floats(0.1, 1.0))))
                    for _ in range(stages))
    problem = PipelineProblem(PipelineDAG.build(stages, microbatches), options, P_STATIC_W, 1)
    picks = [data.draw(st.integers(0, 3)) for _ in problem.dag.nodes]
    before_t, before_e = problem.evaluate(picks)
    reclaimed = reclaim_slack(problem, picks)
    after_t, after_e = problem.evaluate(reclaimed)
    assert after_t <= before_t * (1 + 1e-9)
    assert after_e <= before_e * (1 + 1e-12)
    assert all(r >= p for r, p in zip(reclaimed, picks, strict=True))


def test_real_microbatch_frontiers_solve():
    options = stage_options()
    table = iteration_frontier(options, 4, p_static_w=85.0, gpus_per_stage=8, settings=FrontierSettings(target_steps=80))
    assert table.rows[0].time_s < table.rows[-1].time_s
    assert any(o.mode == "partitioned" for o in table.options[0].forward)


def test_plans_of_another_method_start_the_solve_and_are_never_beaten_by_it():
    """A method whose options these dominate: each of its plans, mapped onto these options
    instruction by instruction, is a candidate — the result is never dominated by its frontier."""
    from kareus.optimizer.metrics import dominated_by

    ours = _options(3)
    # The other method: the same work 3 % slower and 2 % costlier at every clock.
    theirs = tuple(StageOptions(*(tuple(InstructionOption(o.clock_mhz, o.mode, o.time_s * 1.03, o.energy_j * 1.05)
                                        for o in table) for table in (st.forward, st.backward))) for st in ours)
    other = iteration_frontier(theirs, 16, p_static_w=P_STATIC_W, gpus_per_stage=8,
                               settings=FrontierSettings(target_steps=400))
    # A deliberately coarse solve of our own, so the other method's plans have gaps to fill.
    coarse = iteration_frontier(ours, 16, p_static_w=P_STATIC_W, gpus_per_stage=8,
                                settings=FrontierSettings(target_steps=10, cost_model="convex"))
    started = iteration_frontier(ours, 16, p_static_w=P_STATIC_W, gpus_per_stage=8,
                                 settings=FrontierSettings(target_steps=10, cost_model="convex"), starts=[other])
    def covers(points, reference) -> bool:  # every reference plan is matched or beaten by one of ours
        return all(any(t <= rt * (1 + 1e-12) and e <= re * (1 + 1e-12) for t, e in points) for rt, re in reference)

    assert not covers(coarse.points(), other.points())  # the coarse solve alone leaves gaps
    assert covers(started.points(), other.points())
    assert not dominated_by(started.points(), other.points())
    for row in started.rows:  # every row is exact for its choices
        assert row.energy_j == pytest.approx(_independent_energy(ours, row, 8), rel=1e-9)
    with pytest.raises(ValueError):
        iteration_frontier(ours, 16, p_static_w=P_STATIC_W, gpus_per_stage=8, starts=[
            iteration_frontier(_options(2), 16, p_static_w=P_STATIC_W, gpus_per_stage=8)])
