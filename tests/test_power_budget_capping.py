"""The power budget never worse than uniform power capping (issue 28, item 1).

Allocator rules: a running job's objective yields when only that fits the budget (rule 3),
power-limited points reach the allotment, incumbents are never beaten by a worse result, and the
exact DP hands instances too large for it to the greedy. On the twin (`kareus sim power-budget`):
wherever a uniform limit meets a budget the allocation is feasible and its simulated power within
the budget, and its throughput is at least closed-loop capping's, at equal budget and at equal
drawn power, on one GPU product and on A100s with H100s. Plans are built from the simulator's own
numbers (every row one clock), so the tests do not profile.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import numpy as np
import pytest

from kareus.cli import main
from kareus.errors import KareusError
from kareus.job import PlanJob
from kareus.plan import (
    FrontierRow,
    FrontierTable,
    InstructionOption,
    Plan,
    Prediction,
    Provenance,
    StageOptions,
)
from kareus.policy import PowerBudget
from kareus.power_budget import (
    PowerJob,
    PowerPoint,
    Twin,
    allocate,
    compare_with_uniform_limit,
    plan_power_limited_points,
    power_limited_points,
)
from kareus.power_budget.allocator import MAX_DP_WORK
from kareus.sim import Simulator, get_gpu
from kareus.sim.replica import instruction_cost, replica_iteration
from kareus.workload.models import get_preset
from kareus.workload.partitions import build_workload

A100, H100 = "A100-SXM4-40GB", "H100-SXM5-80GB"


def clock_plan(preset: str, gpu_name: str, *, layers: int = 2, seq: int = 2048, data: int = 2,
               objective: dict | None = None) -> Plan:
    """A DP plan of a `layers`-layer `preset` whose frontier rows run every instruction at one clock
    (every 90 MHz from the top; only rows where slower is cheaper), the simulator's own numbers."""
    shape = get_preset(preset).with_layers(layers)
    workload = build_workload(shape, tp=1, cp=1, pp=1, seq_len=seq, micro_batch_size=2)
    gpu = get_gpu(gpu_name)
    job = PlanJob(shape, gpu.name, 1, 1, 1, data, 2, 2, seq, True, workload.stage_layers, gpu.supported_clocks_mhz,
                  gpu.p_static_w, name=f"{preset}-{gpu_name}", steps=100)
    simulator = Simulator(gpu)

    def option(kind: str, clock: int) -> InstructionOption:
        probe = InstructionOption(clock, "sequential", 1, 1).instruction(kind, 0)
        time_s, effective_j = instruction_cost(simulator, workload, 0, probe)
        return InstructionOption(clock, "sequential", time_s, effective_j + gpu.p_static_w * time_s)

    clocks = tuple(range(gpu.clock_max_mhz, gpu.clock_max_mhz - 900, -90))
    options = StageOptions(tuple(option("forward", c) for c in clocks), tuple(option("backward", c) for c in clocks))
    rows, cheapest_j = [], float("inf")
    for k in range(len(clocks)):
        choice = (((k, k), (k, k)),)
        probe = FrontierTable((options,), (FrontierRow(1.0, 1.0, choice),))
        run = replica_iteration(simulator, workload, [probe.stages_for(0)[0].instructions])
        if data * run.energy_j(1) < cheapest_j:
            rows.append(FrontierRow(run.time_s, data * run.energy_j(1), choice))
            cheapest_j = rows[-1].energy_j
    frontier = FrontierTable((options,), tuple(rows))
    plan = Plan(job, {"maxThroughput": {}}, Prediction(rows[0].time_s, rows[0].energy_j),
                Provenance(method="kareus"), frontier.stages_for(0), frontier)
    plan = Plan.from_dict(plan.to_dict())
    if objective is not None:
        from kareus.plan import reselect

        plan = reselect(plan, objective)
    return plan


# ------------------------------------------------------------------------------ the allocator


def test_deadlines_yield_when_only_that_fits_the_budget():
    """Rule 3: the running jobs fit only below their deadlines: feasible, new jobs held, misses named."""
    fast = tuple(PowerPoint(i, t, t * w) for i, (t, w) in enumerate([(1.0, 500.0), (1.1, 420.0), (1.6, 300.0)]))
    deadline = PowerJob("deadline", fast, max_time_s=1.15)
    other = PowerJob("other", fast)
    waiting = PowerJob("waiting", fast, running=False)
    result = allocate([deadline, other, waiting], PowerBudget(cluster_w=650.0))
    assert result.feasible and result.held == ("waiting",)
    assert result.total_power_w <= 650.0
    assert result.get("deadline").row == 2 and not result.get("deadline").meets_objective
    assert "yield" in result.message and "deadline" in result.message
    # With room for the deadline, it is kept: the budget fits 420 + 300 W.
    kept = allocate([deadline, other], PowerBudget(cluster_w=720.0))
    assert kept.get("deadline").meets_objective and kept.get("deadline").row == 1
    # Below every point: infeasible as before, the deadline kept.
    over = allocate([deadline, other], PowerBudget(cluster_w=500.0))
    assert not over.feasible and over.get("deadline").time_s <= 1.15


def test_a_power_limited_point_reaches_the_allotment():
    points = (PowerPoint(0, 1.0, 800.0), PowerPoint(0, 1.5, 750.0, power_limit_w=180.0))
    result = allocate([PowerJob("j", points)], PowerBudget(cluster_w=600.0))
    allotment = result.get("j")
    assert result.feasible and allotment.power_limit_w == 180.0 and allotment.row == 0
    assert allotment.status()["powerLimitWatts"] == 180.0 and "180 W per-GPU power limit" in allotment.reason
    assert result.to_dict()["allotments"][0]["power_limit_w"] == 180.0
    assert "powerLimitWatts" not in allocate([PowerJob("j", points)], PowerBudget()).get("j").status()


def brute_force(jobs: list[PowerJob], budget_w: float) -> dict[str, PowerPoint]:
    best, picks = -1.0, {}
    for choice in itertools.product(*(j.candidates() for j in jobs)):
        value = sum(j.value(p) for j, p in zip(jobs, choice, strict=True))
        if sum(p.power_w for p in choice) <= budget_w and value > best:
            best, picks = value, {j.name: p for j, p in zip(jobs, choice, strict=True)}
    return picks


@pytest.mark.parametrize("seed", range(6))
def test_an_incumbent_is_never_beaten_by_a_worse_result(seed):
    rng = np.random.default_rng(seed)
    jobs = []
    for k in range(4):
        times = np.sort(rng.uniform(1.0, 2.0, 6))
        jobs.append(PowerJob(f"j{k}", tuple(PowerPoint(i, float(t), float(t * 900 / t ** 2))
                                           for i, t in enumerate(times))))
    budget_w = 0.75 * sum(max(p.power_w for p in j.points) for j in jobs)
    optimum = brute_force(jobs, budget_w)
    coarse = allocate(jobs, PowerBudget(cluster_w=budget_w), resolution_w=60.0)  # rounding costs value here
    with_incumbent = allocate(jobs, PowerBudget(cluster_w=budget_w), resolution_w=60.0, incumbents=[optimum])
    assert with_incumbent.value == pytest.approx(sum(j.value(optimum[j.name]) for j in jobs), rel=1e-12)
    assert with_incumbent.value >= coarse.value and with_incumbent.total_power_w <= budget_w
    # An incumbent that does not fit is ignored.
    fastest = {j.name: min(j.points, key=lambda p: p.time_s) for j in jobs}
    assert allocate(jobs, PowerBudget(cluster_w=budget_w), incumbents=[fastest]).total_power_w <= budget_w


def test_an_instance_too_large_for_the_dp_goes_to_the_greedy_and_says_so():
    rng = np.random.default_rng(1)
    jobs = [PowerJob(f"j{k}", tuple(PowerPoint(i, 1.0 + i / 100, 1000.0 - 3 * i + float(rng.uniform(0, 1)))
                                    for i in range(100))) for k in range(1000)]
    budget_w = 0.8 * sum(max(p.power_w for p in j.points) for j in jobs)
    assert MAX_DP_WORK < 2 * 100_000 * 100 * 1000  # this instance is beyond the DP
    result = allocate(jobs, PowerBudget(cluster_w=budget_w), method="exact")
    assert result.method == "greedy" and "fell back to greedy" in result.message
    assert result.feasible and result.total_power_w <= budget_w
    assert result.gap <= 1e-3 * result.value


# ------------------------------------------------------------------------------ on the twin


@pytest.fixture(scope="module")
def a100_plans():
    return [("fast", clock_plan("llama3.2-3b", A100)), ("wide", clock_plan("qwen3-1.7b", A100, data=4)),
            ("8b", clock_plan("llama3.1-8b", A100))]


@pytest.fixture(scope="module")
def mixed_plans(a100_plans):
    return [*a100_plans, ("h100", clock_plan("llama3.2-3b", H100)), ("h100-8b", clock_plan("llama3.1-8b", H100))]


@pytest.fixture(scope="module")
def deadline_plans(mixed_plans):
    return [*mixed_plans, ("deadline", clock_plan("llama3.1-8b", A100, objective={"timeBudget": {"maxSlowdownPercent": 5}}))]


def frontier_floor_w(plans) -> float:
    return sum(min(r.energy_j / r.time_s for r in plan.frontier.rows) for _, plan in plans)


@pytest.mark.parametrize("mix", ["a100_plans", "mixed_plans", "deadline_plans"])
def test_feasible_wherever_a_uniform_limit_is_and_never_over_the_budget(mix, request):
    plans = request.getfixturevalue(mix)
    twin = Twin(plans)
    lowest_w = twin.uniform(twin.lowest_share).power_w  # every board at its minimum limit
    full_w = twin.uniform(1.0).power_w
    floor_w = frontier_floor_w(plans)
    assert lowest_w < 0.7 * floor_w  # the frontiers end well above what capping reaches
    for budget_w in np.linspace(1.01 * lowest_w, 0.95 * full_w, 6):
        result = compare_with_uniform_limit(plans, float(budget_w), twin=twin)
        closed = result["uniform_closed_loop"]
        assert closed["feasible"] and closed["power_w"] <= budget_w * (1 + 1e-9)
        assert result["allocation"]["feasible"], result["allocation"]["message"]
        assert result["allocation"]["predicted_power_w"] <= budget_w * (1 + 1e-9)
        assert result["kareus"]["power_w"] <= budget_w * (1 + 1e-9)  # the twin agrees with the prediction
        if mix != "deadline_plans":  # there capping slows the deadline job, the allocation does not
            assert result["throughput_ratio_at_equal_budget"] >= 1 - 1e-9
            assert result["throughput_ratio_at_equal_power"] >= 1 - 1e-9
        if budget_w < floor_w:  # below the frontiers: some job runs under a power limit
            assert any(j["power_limit_w"] is not None for j in result["kareus"]["jobs"])


def test_the_deadline_job_keeps_its_deadline_where_the_budget_allows(deadline_plans):
    plans = deadline_plans
    deadline = plans[-1][1]
    fastest_s = min(r.time_s for r in deadline.frontier.rows)
    full_w = Twin(plans).uniform(1.0).power_w
    result = compare_with_uniform_limit(plans, 0.85 * full_w)
    ours = {j["name"]: j for j in result["kareus"]["jobs"]}
    assert ours["deadline"]["time_s"] <= 1.05 * fastest_s * (1 + 1e-9)
    capped = {j["name"]: j for j in result["uniform_closed_loop"]["jobs"]}
    assert capped["deadline"]["time_s"] > ours["deadline"]["time_s"]  # capping slows it like the others


def test_cli_json_contract(capsys, tmp_path, a100_plans):
    paths = []
    for name, plan in a100_plans:
        paths.append(str(tmp_path / f"{name}.json"))
        plan.save(paths[-1])
    twin = Twin(a100_plans)
    budget_w = 0.5 * (twin.uniform(twin.lowest_share).power_w + frontier_floor_w(a100_plans))
    assert main(["sim", "power-budget", *paths, "--budget-w", f"{budget_w:.3f}", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("budget_w", "gpus", "uniform_limit_w_per_gpu", "allocation", "kareus", "uniform_power_limit",
                "throughput_ratio", "iterations_ratio", "uniform_at_equal_power", "throughput_ratio_at_equal_power",
                "uniform_closed_loop", "throughput_ratio_at_equal_budget"):
        assert key in result
    assert result["allocation"]["feasible"] is True and result["kareus"]["power_w"] <= result["budget_w"] * (1 + 1e-9)
    assert result["uniform_at_equal_power"]["limits_w"] and result["uniform_closed_loop"]["limit_share"] <= 1.0


def test_cli_table_names_the_closed_loop_baseline(capsys, tmp_path, a100_plans):
    path = tmp_path / "fast.json"
    a100_plans[0][1].save(path)
    full_w = Twin(a100_plans[:1]).uniform(1.0).power_w
    assert main(["sim", "power-budget", str(path), "--budget-w", f"{0.6 * full_w:.1f}"]) == 0
    out = capsys.readouterr().out
    assert "allocation feasible" in out and "uniform closed loop" in out and "at equal drawn power" in out


def test_gpu_weighted_allocation_is_never_below_capping_on_that_sum(mixed_plans):
    twin = Twin(mixed_plans)
    budget_w = 0.55 * twin.uniform(1.0).power_w
    result = compare_with_uniform_limit(mixed_plans, budget_w, twin=twin, weight="gpus")
    ours, closed = result["kareus"], result["uniform_closed_loop"]
    assert result["weight"] == "gpus" and result["allocation"]["feasible"]
    assert result["throughput_ratio_at_equal_budget"] == pytest.approx(
        ours["gpu_weighted_normalised_throughput"] / closed["gpu_weighted_normalised_throughput"])
    assert result["throughput_ratio_at_equal_budget"] >= 1 - 1e-9 and ours["power_w"] <= budget_w * (1 + 1e-9)
    with pytest.raises(KareusError, match="--weight must be one of jobs, gpus"):
        compare_with_uniform_limit(mixed_plans, budget_w, twin=twin, weight="watts")


def test_a_plans_stored_points_keep_its_own_row_numbers_and_take_the_limits_effect_from_the_twin(a100_plans):
    plan = a100_plans[0][1]
    twin = Twin([("fast", plan)])
    points = plan_power_limited_points(plan)
    assert points and [(p.row, p.power_limit_w) for p in points] == [
        (p.row, p.power_limit_w) for p in power_limited_points(twin, 0)]
    for p in points:  # the plan's rows are the twin's own numbers here: the points are its limited runs
        run = twin.run(0, p.row, p.power_limit_w)
        assert (p.time_s, p.energy_j) == (pytest.approx(run.time_s, rel=1e-12), pytest.approx(run.energy_j, rel=1e-12))
    # A plan whose profile measured 10 % slower and 20 % more energy than the preset (a real board):
    # each point is its row's own prediction times the twin's limited-to-free ratio.
    measured = replace(plan, frontier=replace(plan.frontier, rows=tuple(
        replace(r, time_s=1.1 * r.time_s, energy_j=1.2 * r.energy_j) for r in plan.frontier.rows)))
    scaled = plan_power_limited_points(measured)
    assert [(p.row, p.power_limit_w) for p in scaled] == [(p.row, p.power_limit_w) for p in points]
    for a, b in zip(scaled, points, strict=True):
        assert (a.time_s, a.energy_j) == (pytest.approx(1.1 * b.time_s, rel=1e-12), pytest.approx(1.2 * b.energy_j,
                                                                                                  rel=1e-12))
    assert plan_power_limited_points(plan, steps=0) == ()
    unknown = replace(plan, job=replace(plan.job, gpu="MI300X"))  # no preset: no ladder, the plan stays valid
    assert plan_power_limited_points(unknown) == ()
    with pytest.raises(KareusError, match=r"--power-limit-steps must be 0\.\.21, got 22"):
        plan_power_limited_points(plan, steps=22)


def test_plan_predictions_off_the_twin_still_keep_the_twin_within_the_budget(a100_plans):
    """Frontier rows predicting 2 % less energy than the twin runs them: the comparison replaces the
    allotted points by the twin's numbers until they agree, so the twin's power stays in budget."""

    optimistic = []
    for name, plan in a100_plans:
        rows = tuple(FrontierRow(r.time_s, 0.98 * r.energy_j, r.choice) for r in plan.frontier.rows)
        optimistic.append((name, replace(plan, frontier=FrontierTable(plan.frontier.options, rows))))
    twin = Twin(optimistic)
    budget_w = 0.9 * twin.uniform(1.0).power_w  # within the frontiers: frontier rows are allotted
    result = compare_with_uniform_limit(optimistic, budget_w, twin=twin)
    assert result["kareus"]["power_w"] <= budget_w * (1 + 1e-9)
    assert result["kareus"]["power_w"] == pytest.approx(result["allocation"]["predicted_power_w"], rel=1e-12)
    assert any(j["power_limit_w"] is None for j in result["kareus"]["jobs"])


def test_time_budgets_missed_are_named(deadline_plans):
    twin = Twin(deadline_plans)
    result = compare_with_uniform_limit(deadline_plans, 0.8 * twin.uniform(1.0).power_w, twin=twin)
    assert result["kareus"]["time_budgets_missed"] == []
    assert result["uniform_closed_loop"]["time_budgets_missed"] == ["deadline"]  # only it has a time budget


def reference_hull(job: PowerJob) -> list[PowerPoint]:
    """The upper concave hull, one job at a time (Andrew's monotone chain), for `_warm` to match."""
    points = sorted(job.candidates(), key=lambda p: (p.power_w, -job.value(p)))
    rising = []
    for p in points:
        if not rising or job.value(p) > job.value(rising[-1]):
            rising.append(p)
    hull: list[PowerPoint] = []
    for p in rising:
        while len(hull) >= 2 and ((job.value(hull[-1]) - job.value(hull[-2])) * (p.power_w - hull[-1].power_w)
                                  <= (job.value(p) - job.value(hull[-1])) * (hull[-1].power_w - hull[-2].power_w)):
            hull.pop()
        hull.append(p)
    return hull


def test_hulls_of_many_jobs_at_once_match_one_at_a_time():
    rng = np.random.default_rng(9)
    jobs = []
    for k in range(40):
        n = int(rng.integers(1, 30))
        times = rng.uniform(1.0, 3.0, n)
        power = rng.choice([300.0, 400.0, 500.0], n) if k % 5 == 0 else rng.uniform(200.0, 900.0, n)  # ties too
        points = tuple(PowerPoint(i, float(t), float(t * w)) for i, (t, w) in enumerate(zip(times, power, strict=True)))
        jobs.append(PowerJob(f"j{k}", points, weight=float(rng.choice([1.0, 8.0])),
                             max_time_s=2.0 if k % 3 == 0 else None))
    budget_w = 0.5 * sum(max(p.power_w for p in j.points) for j in jobs)
    result = allocate(jobs, PowerBudget(cluster_w=budget_w), method="greedy")  # computes every hull in one pass
    assert result.feasible and result.total_power_w <= budget_w
    for job in jobs:
        assert list(job.hull) == reference_hull(job), job.name
