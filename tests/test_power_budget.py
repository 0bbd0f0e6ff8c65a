"""The cluster power allocator (`kareus.power_budget`) against brute force, and its rules.

Small instances: the exact DP equals exhaustive search when powers are whole multiples of its step,
and is within its stated discretisation bound otherwise; the greedy is within its LP bound. Large
instances: both methods' certified gaps. Rules: deadlines kept, new jobs held when the budget
cannot fit them, infeasible budgets reported, a finished job's power goes to the others.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from kareus.policy import PowerBudget
from kareus.power_budget import Allocation, PowerJob, PowerPoint, allocate

PRODUCTS = ("A100-SXM4-40GB", "H100-SXM5-80GB")
POOLS = ("pool-a", "pool-b", "pool-c")  # a and b hold A100s, c H100s: pools nest in products


def frontier(rng: np.random.Generator, n: int, *, integral: bool) -> tuple[PowerPoint, ...]:
    """A frontier-like set: faster points draw more power (and some noise off the curve)."""
    times = np.sort(rng.uniform(1.0, 2.0, n))
    power = 1000.0 / times ** rng.uniform(1.0, 3.0) + rng.uniform(-40, 40, n)
    power = np.maximum(np.round(power) if integral else power, 50.0)
    return tuple(PowerPoint(i, float(t), float(p * t)) for i, (t, p) in enumerate(zip(times, power, strict=True)))


def instance(seed: int, jobs: int, points: int, *, integral: bool, nested: bool) -> list[PowerJob]:
    rng = np.random.default_rng(seed)
    out = []
    for j in range(jobs):
        pool = POOLS[j % len(POOLS)] if nested else ""
        product = PRODUCTS[1] if pool == "pool-c" else PRODUCTS[j % 2 if not nested else 0]
        out.append(PowerJob(f"job{j}", frontier(rng, points, integral=integral), gpu_product=product,
                            node_pool=pool, weight=float(rng.choice([1.0, 2.0]))))
    return out


def between(jobs: list[PowerJob], fraction: float) -> float:
    """`fraction` of the way from the least to the most power `jobs` can draw together."""
    low = sum(min(p.power_w for p in j.points) for j in jobs)
    high = sum(max(p.power_w for p in j.points) for j in jobs)
    return low + fraction * (high - low)


def budget_for(jobs: list[PowerJob], fraction: float, *, nested: bool) -> PowerBudget:
    """A cluster budget at `fraction`; nested: the A100 product and each pool bound at other fractions,
    so that every level can bind."""
    if not nested:
        return PowerBudget(cluster_w=between(jobs, fraction))
    a100 = [j for j in jobs if j.gpu_product == PRODUCTS[0]]
    pools = {pool: between([j for j in jobs if j.node_pool == pool], min(1.0, 1.6 * fraction)) for pool in POOLS}
    return PowerBudget(cluster_w=between(jobs, fraction),
                       gpu_products_w={"NVIDIA-A100-SXM4-40GB": between(a100, min(1.0, 1.3 * fraction))},
                       node_pools_w=pools)


def limits(budget: PowerBudget, jobs: list[PowerJob]) -> list[tuple[float, set[str]]]:
    out = []
    if budget.cluster_w is not None:
        out.append((budget.cluster_w, {j.name for j in jobs}))
    for product, watts in budget.gpu_products_w.items():
        out.append((watts, {j.name for j in jobs if product.endswith(j.gpu_product)}))
    for pool, watts in budget.node_pools_w.items():
        out.append((watts, {j.name for j in jobs if j.node_pool == pool}))
    return out


def brute_force(jobs: list[PowerJob], budget: PowerBudget, shrink_w: float = 0.0) -> float:
    """The optimum by enumeration; each budget shrunk by `shrink_w` per job under it."""
    bounds = [(watts - shrink_w * len(names), names) for watts, names in limits(budget, jobs)]
    best = -math.inf
    for choice in itertools.product(*(j.candidates() for j in jobs)):
        power = {j.name: p.power_w for j, p in zip(jobs, choice, strict=True)}
        if all(sum(power[n] for n in names) <= watts + 1e-9 for watts, names in bounds):
            best = max(best, sum(j.value(p) for j, p in zip(jobs, choice, strict=True)))
    return best


def within_budgets(allocation: Allocation) -> bool:
    return all(b.used_w <= b.limit_w * (1 + 1e-9) for b in allocation.budgets)


def max_step_value(jobs: list[PowerJob]) -> float:
    """The largest value gained by one step between neighbouring candidates (the greedy's bound)."""
    steps = [abs(j.value(a) - j.value(b)) for j in jobs
             for a, b in itertools.pairwise(sorted(j.candidates(), key=lambda p: p.power_w))]
    return max(steps, default=0.0)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_exact_equals_brute_force_on_whole_watt_powers(seed, nested):
    jobs = instance(seed, jobs=4, points=5, integral=True, nested=nested)
    budget = budget_for(jobs, fraction=0.2 + 0.05 * seed, nested=nested)
    result = allocate(jobs, budget, method="exact", resolution_w=1.0)
    assert result.feasible and result.method == "exact" and within_budgets(result)
    assert result.value == pytest.approx(brute_force(jobs, budget), rel=1e-12)
    assert result.upper_bound == pytest.approx(result.value, rel=1e-12)  # exact: no gap left


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_exact_keeps_its_discretisation_bound_on_real_powers(seed, nested):
    jobs = instance(100 + seed, jobs=4, points=6, integral=False, nested=nested)
    budget = budget_for(jobs, fraction=0.35, nested=nested)
    step_w = 25.0  # coarse on purpose, so the bound matters
    result = allocate(jobs, budget, method="exact", resolution_w=step_w)
    optimum = brute_force(jobs, budget)
    assert within_budgets(result)  # powers were rounded up: the true power still fits
    assert brute_force(jobs, budget, shrink_w=step_w) - 1e-9 <= result.value <= optimum + 1e-9
    assert result.upper_bound >= optimum - 1e-9  # the round-down DP is a relaxation


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_greedy_is_within_its_lp_bound(seed, nested):
    jobs = instance(200 + seed, jobs=4, points=6, integral=False, nested=nested)
    budget = budget_for(jobs, fraction=0.3, nested=nested)
    result = allocate(jobs, budget, method="greedy")
    optimum = brute_force(jobs, budget)
    assert within_budgets(result)
    assert result.value <= optimum + 1e-9 <= result.upper_bound + 2e-9
    if not nested:  # one budget: the documented a-priori bound, one hull step
        assert optimum - result.value <= max_step_value(jobs) + 1e-9


def test_large_instances_certified_gaps():
    """60 jobs × 40 points: the exact DP's certified gap is tiny, the greedy's within one hull step."""
    rel_gaps = []
    for seed, nested in itertools.product(range(3), (False, True)):
        jobs = instance(300 + seed, jobs=60, points=40, integral=False, nested=nested)
        budget = budget_for(jobs, fraction=0.4, nested=nested)
        exact = allocate(jobs, budget, method="exact")
        greedy = allocate(jobs, budget, method="greedy")
        assert within_budgets(exact) and within_budgets(greedy)
        assert exact.gap <= 1e-3 * exact.value
        assert greedy.value <= exact.upper_bound + 1e-9
        if not nested:
            assert greedy.upper_bound - greedy.value <= max_step_value(jobs) + 1e-9
        rel_gaps.append((exact.upper_bound - greedy.value) / exact.upper_bound)
    assert max(rel_gaps) < 0.01  # the greedy is within 1 % of the optimum on these


def test_deadline_job_keeps_its_deadline_under_a_tight_budget():
    rng = np.random.default_rng(7)
    deadline = PowerJob("deadline", frontier(rng, 8, integral=True), max_time_s=1.3)
    others = [PowerJob(f"best-effort{k}", frontier(rng, 8, integral=True)) for k in range(2)]
    jobs = [deadline, *others]
    tight = sum(min(p.power_w for p in j.candidates()) for j in jobs) + 10.0
    result = allocate(jobs, PowerBudget(cluster_w=tight))
    assert result.feasible and within_budgets(result)
    mine = result.get("deadline")
    assert mine.time_s <= 1.3 and mine.meets_objective
    fastest_allowed = min(p.time_s for p in deadline.points if p.time_s > 1.3)
    assert fastest_allowed > 1.3  # the frontier had slower, cheaper points it was not given


def test_new_jobs_are_held_in_order_when_the_budget_cannot_fit_them():
    rng = np.random.default_rng(3)
    running = [PowerJob(f"run{k}", frontier(rng, 5, integral=True)) for k in range(2)]
    new = [PowerJob(f"new{k}", frontier(rng, 5, integral=True), running=False) for k in range(2)]
    floor = {j.name: min(p.power_w for p in j.points) for j in running + new}
    budget = PowerBudget(cluster_w=floor["run0"] + floor["run1"] + floor["new0"] + 1.0)
    result = allocate(running + new, budget)
    assert result.feasible and result.held == ("new1",)
    assert result.get("new1").held and result.get("new1").power_w == 0.0 and result.get("new1").row is None
    assert "held" in result.message and "new1" in result.message
    assert within_budgets(result)


def test_an_infeasible_budget_is_reported_and_running_jobs_keep_their_deadlines():
    rng = np.random.default_rng(5)
    deadline = PowerJob("deadline", frontier(rng, 6, integral=True), max_time_s=1.2)
    other = PowerJob("other", frontier(rng, 6, integral=True))
    waiting = PowerJob("waiting", frontier(rng, 6, integral=True), running=False)
    result = allocate([deadline, other, waiting], PowerBudget(cluster_w=100.0))
    assert not result.feasible and result.held == ("waiting",)
    assert "cannot be met" in result.message and "cluster needs" in result.message
    assert result.get("deadline").time_s <= 1.2  # not throttled below its deadline
    lowest = min(other.points, key=lambda p: p.power_w)
    assert result.get("other").row == lowest.row


def test_a_finished_job_gives_its_power_to_the_others():
    rng = np.random.default_rng(11)
    jobs = [PowerJob(f"job{k}", frontier(rng, 10, integral=True)) for k in range(3)]
    budget = budget_for(jobs, 0.3, nested=False)
    before = allocate(jobs, budget)
    after = allocate(jobs[:2], budget)  # job2 finished
    for name in ("job0", "job1"):
        assert after.get(name).power_w >= before.get(name).power_w - 1e-9
    assert sum(after.get(n).normalised_throughput for n in ("job0", "job1")) > \
        sum(before.get(n).normalised_throughput for n in ("job0", "job1"))


def test_crossing_budgets_fall_back_to_greedy_and_say_so():
    rng = np.random.default_rng(2)
    jobs = [PowerJob("a", frontier(rng, 4, integral=True), gpu_product=PRODUCTS[0], node_pool="mixed"),
            PowerJob("b", frontier(rng, 4, integral=True), gpu_product=PRODUCTS[1], node_pool="mixed"),
            PowerJob("c", frontier(rng, 4, integral=True), gpu_product=PRODUCTS[0])]
    budget = PowerBudget(gpu_products_w={PRODUCTS[0]: 900.0}, node_pools_w={"mixed": 900.0})
    result = allocate(jobs, budget, method="exact")
    assert result.method == "greedy" and "cross" in result.message
    assert within_budgets(result)


def test_no_budget_runs_every_job_at_its_fastest_point():
    rng = np.random.default_rng(4)
    jobs = [PowerJob(f"j{k}", frontier(rng, 6, integral=False)) for k in range(3)]
    result = allocate(jobs, PowerBudget())
    assert all(a.normalised_throughput == pytest.approx(1.0) for a in result.allotments)
    assert result.budgets == ()


def test_from_plan_reads_the_frontier_and_the_objectives_bound():
    from optimizer_fixtures import small_plan

    plan = small_plan()
    job = PowerJob.from_plan("llama", plan, objective={"timeBudget": {"maxSlowdownPercent": 5}})
    rows = plan.frontier.rows
    assert [p.row for p in job.points] == list(range(len(rows)))
    assert job.points[0].power_w == pytest.approx(rows[0].energy_j / rows[0].time_s)
    assert job.max_time_s == pytest.approx(min(r.time_s for r in rows) * 1.05)
    assert job.gpu_product == plan.job.gpu
    assert all(p.time_s <= job.max_time_s * (1 + 1e-9) for p in job.candidates())
    status = allocate([job], PowerBudget(cluster_w=1e9)).get("llama").status()
    assert status["frontierRow"] == 0 and status["held"] is False and status["watts"] > 0
