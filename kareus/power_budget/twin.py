"""The twin's comparison of the allocation with uniform per-GPU power limits, and power-limited points.

What clusters do today is a uniform board power limit (`nvidia-smi -pl`): every GPU limited to the
same share of its board's maximum limit (one wattage when all GPUs are one product), each job at
its own plan's point, throttled phase by phase by the simulated GPU's power controller
(`kareus.sim.replica.power_limited`). Its fair form is **closed-loop**: the share raised until the
cluster draws the budget (a uniform limit of budget ÷ GPUs strands the power that GPUs in bubbles
and memory-bound phases do not draw).

`power_limited_points` gives a job points the allocator can choose beyond its frontier: a frontier
row (the plan's selected one, the fastest, the least-power one) under a ladder of per-GPU limits
down to the board's minimum. With them the allocation is feasible wherever a uniform limit is,
and `compare_with_uniform_limit` passes the closed-loop uniform limit's own points to the
allocator as an incumbent, so at equal budget the allocation is never below it. Both sides run
the same plans on the same simulated GPUs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kareus.errors import KareusError
from kareus.policy import PowerBudget
from kareus.power_budget.allocator import Allocation, PowerJob, PowerPoint, allocate

WEIGHTS = ("jobs", "gpus")  # what a job's normalised throughput counts: 1, or its GPUs
LADDER_STEPS = 16  # power limits per board between its minimum and maximum, for the points beyond a frontier
_BISECTION_STEPS = 18  # on the limit share: 2^-18 of the board's range, well under a watt


@dataclass(frozen=True)
class JobRun:
    """One job's iteration as the twin simulates it (all of its GPUs)."""

    name: str
    row: int
    gpus: int
    time_s: float
    energy_j: float
    fastest_time_s: float  # its fastest frontier point, unthrottled: normalised throughput = this / time_s
    power_limit_w: float | None = None  # the per-GPU board limit it ran under (None: none set)

    @property
    def power_w(self) -> float:
        return self.energy_j / self.time_s


@dataclass(frozen=True)
class PolicyRun:
    """Every job's run under one way of keeping the cluster within its power."""

    jobs: tuple[JobRun, ...]

    @property
    def power_w(self) -> float:
        return sum(j.power_w for j in self.jobs)

    @property
    def normalised_throughput(self) -> float:
        return sum(j.fastest_time_s / j.time_s for j in self.jobs)

    def to_dict(self) -> dict[str, Any]:
        normalised = [j.fastest_time_s / j.time_s for j in self.jobs]
        gpus = sum(j.gpus for j in self.jobs)
        return {"iterations_per_s": sum(1.0 / j.time_s for j in self.jobs),
                "normalised_throughput": sum(normalised),
                "mean_normalised_throughput": sum(normalised) / len(normalised),
                # each job's normalised throughput weighted by its GPUs: the share of the GPUs' work done
                "gpu_weighted_normalised_throughput": sum(j.gpus * n for j, n in zip(self.jobs, normalised,
                                                                                      strict=True)) / gpus,
                "power_w": self.power_w,
                "jobs": [{"name": j.name, "frontier_row": j.row, "gpus": j.gpus, "time_s": j.time_s,
                          "energy_j": j.energy_j, "power_w": j.power_w, "normalised_throughput": n,
                          "power_limit_w": j.power_limit_w}
                         for j, n in zip(self.jobs, normalised, strict=True)]}


class Twin:
    """The jobs (`(name, Plan)` each) on their simulated GPUs; each replica, row and limit simulated once
    (replicas of the same job layout share their runs: every energy term scales with the replicas).
    `runs`: another twin's runs to share (keyed by layout, so any jobs may share them)."""

    def __init__(self, plans: Sequence[tuple[str, Any]], runs: dict | None = None) -> None:
        from kareus.sim import get_gpu

        self.plans = list(plans)
        self.gpus = [get_gpu(plan.job.gpu) for _, plan in self.plans]
        self._layouts = [repr(replace(plan.job, data=1, name="")) for _, plan in self.plans]
        self.runs: dict[tuple[str, int, float | None], Any] = {} if runs is None else runs

    def run(self, k: int, row: int, limit_w: float | None = None) -> JobRun:
        """Job k at frontier row `row`, its GPUs limited to `limit_w` each (None or the board's maximum:
        no limit)."""
        from kareus.sim import Simulator
        from kareus.sim.replica import power_limited, replica_iteration

        name, plan = self.plans[k]
        gpu = self.gpus[k]
        limit_w = None if limit_w is None or limit_w >= gpu.power_limit_w else float(limit_w)
        key = (self._layouts[k], row, limit_w)
        if key not in self.runs:
            board = gpu if limit_w is None else power_limited(gpu, limit_w)
            stages = [stage.instructions for stage in plan.frontier.stages_for(row)]
            self.runs[key] = replica_iteration(Simulator(board), plan.job.workload(), stages)
        replica = self.runs[key]
        per_stage = plan.job.tensor * plan.job.context * plan.job.data
        return JobRun(name, row, job_gpus(plan), replica.time_s, replica.energy_j(per_stage),
                      min(r.time_s for r in plan.frontier.rows), limit_w)

    def limit_w(self, k: int, share: float) -> float:
        """Job k's per-GPU limit at `share` of its board's maximum, within what the board accepts."""
        gpu = self.gpus[k]
        return min(max(share * gpu.power_limit_w, gpu.power_limit_min_w), gpu.power_limit_w)

    def uniform(self, share: float) -> PolicyRun:
        """Every job at its plan's selected row, every GPU limited to `share` of its board's maximum."""
        return PolicyRun(tuple(self.run(k, plan.selected_row, self.limit_w(k, share))
                               for k, (_, plan) in enumerate(self.plans)))

    @property
    def lowest_share(self) -> float:
        """The share at which every board is at its minimum limit."""
        return max(gpu.power_limit_min_w / gpu.power_limit_w for gpu in self.gpus)


def job_gpus(plan: Any) -> int:
    job = plan.job
    return job.tensor * job.context * job.pipeline * job.data


def power_limited_points(twin: Twin, k: int, *, steps: int = LADDER_STEPS,
                         extra_limits_w: Sequence[float] = ()) -> tuple[PowerPoint, ...]:
    """Job k's points beyond its frontier: its selected, fastest and least-power rows, each under
    `steps` per-GPU limits from the board's minimum up (and `extra_limits_w`), where the limit slows
    the row (a limit the row never reaches adds nothing)."""
    plan = twin.plans[k][1]
    gpu = twin.gpus[k]
    rows = plan.frontier.rows
    bases = {plan.selected_row, min(range(len(rows)), key=lambda r: rows[r].time_s),
             min(range(len(rows)), key=lambda r: rows[r].energy_j / rows[r].time_s)}
    span_w = gpu.power_limit_w - gpu.power_limit_min_w
    limits = sorted({gpu.power_limit_min_w + span_w * i / steps for i in range(steps)}
                    | {w for w in extra_limits_w if gpu.power_limit_min_w <= w < gpu.power_limit_w})
    points = []
    for row in sorted(bases):
        free = twin.run(k, row)
        for limit_w in limits:
            run = twin.run(k, row, limit_w)
            if run.time_s > free.time_s * (1 + 1e-9):
                points.append(PowerPoint(row, run.time_s, run.energy_j, power_limit_w=limit_w))
    return tuple(points)


def check_ladder_steps(steps: int) -> int:
    """`steps` if a plan can store its ladder (three rows of `steps` limits each), else one error."""
    from kareus.plan import MAX_POWER_LIMITED_POINTS

    if not 0 <= steps <= MAX_POWER_LIMITED_POINTS // 3:
        raise KareusError(f"--power-limit-steps must be 0..{MAX_POWER_LIMITED_POINTS // 3}, got {steps}")
    return steps


def plan_power_limited_points(plan: Any, *, steps: int = LADDER_STEPS) -> tuple[Any, ...]:
    """What `kareus optimize` stores in a plan (`Plan.power_limited_points`): `power_limited_points`
    of the plan alone on its simulated GPU, each point taken as its row's plan prediction times the
    twin's ratio of the limited to the free run of that row — the plan's own numbers for the row
    (a profile measured on a real GPU differs from the preset), the limit's effect from the twin's
    power controller (on a plan profiled on the simulator the ratios are the runs themselves).
    Only points slower and lower-power than their row are kept. Empty when the simulator has no
    preset of the plan's GPU, or `steps` is 0."""
    from kareus.plan import PowerLimitedPoint
    from kareus.sim import get_gpu

    if check_ladder_steps(steps) == 0:
        return ()
    try:
        get_gpu(plan.job.gpu)
    except KareusError:
        return ()
    twin = Twin([(plan.job.name or "plan", plan)])
    points = []
    for point in power_limited_points(twin, 0, steps=steps):
        row, free = plan.frontier.rows[point.row], twin.run(0, point.row)
        time_s = row.time_s * point.time_s / free.time_s
        energy_j = row.energy_j * point.energy_j / free.energy_j
        if time_s > row.time_s and energy_j / time_s < row.energy_j / row.time_s:
            points.append(PowerLimitedPoint(point.row, point.power_limit_w, time_s, energy_j))
    return tuple(points)


def closed_loop_share(uniform: Callable[[float], PolicyRun], power_w: float, low: float) -> float | None:
    """The largest share in [low, 1] at which `uniform(share)` draws at most `power_w` (bisection);
    None when even `low` draws more."""
    if uniform(1.0).power_w <= power_w:
        return 1.0
    if uniform(low).power_w > power_w:
        return None
    high = 1.0
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (low + high)
        if uniform(mid).power_w <= power_w:
            low = mid
        else:
            high = mid
    return low


def compare_with_uniform_limit(plans: Sequence[tuple[str, Any]], budget_w: float, *,
                               method: str = "exact", twin: Twin | None = None,
                               weight: str = "jobs") -> dict[str, Any]:
    """For the same jobs (`(name, Plan)` each) and cluster budget, on the twin: Kareus' allocation
    (each job at its allotted point, frontier or power-limited), a uniform limit of budget ÷ GPUs
    (open-loop, today's `uniform_power_limit`), the closed-loop uniform limit that draws the budget,
    and a uniform limit that draws what Kareus' allocation draws. `twin`: one over the same `plans`
    (its runs are reused, e.g. over several budgets). `weight`: what the allocator maximises, the
    jobs' summed normalised throughput (`jobs`) or each weighted by its GPUs (`gpus`); the ratios
    are of the same sum."""
    if weight not in WEIGHTS:
        raise KareusError(f"--weight must be one of {', '.join(WEIGHTS)}, got {weight!r}")
    if not budget_w > 0:
        raise KareusError(f"--budget-w must be > 0, got {budget_w}")
    if not plans:
        raise KareusError("no jobs to compare")
    twin = twin or Twin(plans)
    gpus = sum(job_gpus(plan) for _, plan in plans)
    open_share = budget_w / sum(job_gpus(plan) * gpu.power_limit_w for (_, plan), gpu in zip(plans, twin.gpus,
                                                                                               strict=True))
    closed = closed_loop_share(twin.uniform, budget_w, twin.lowest_share)
    if closed is None and open_share < twin.lowest_share:
        gpu = max(twin.gpus, key=lambda g: g.power_limit_min_w / g.power_limit_w)
        raise KareusError(f"{budget_w:.0f} W over {gpus} GPUs is {budget_w / gpus:.0f} W per GPU, below {gpu.name}'s "
                          f"minimum power limit of {gpu.power_limit_min_w:.0f} W, and at that limit the jobs draw "
                          f"{twin.uniform(twin.lowest_share).power_w:.0f} W")
    allocation = _allocation(twin, budget_w, closed, method, weight)
    if allocation.held:
        raise KareusError(f"the budget cannot run job {allocation.held[0]} at all ({allocation.message})")
    ours = PolicyRun(tuple(twin.run(k, a.row, a.power_limit_w) for k, a in enumerate(allocation.allotments)))
    matched = closed_loop_share(twin.uniform, ours.power_w, twin.lowest_share) or twin.lowest_share
    theirs, matched_run = twin.uniform(open_share), twin.uniform(matched)
    key = "normalised_throughput" if weight == "jobs" else "gpu_weighted_normalised_throughput"

    def ratio(run: PolicyRun) -> float:
        return ours.to_dict()[key] / run.to_dict()[key]

    result = {"budget_w": budget_w, "gpus": gpus, "uniform_limit_w_per_gpu": budget_w / gpus,
              "allocation": {"method": allocation.method, "feasible": allocation.feasible,
                             "predicted_power_w": allocation.total_power_w, "value": allocation.value,
                             "upper_bound": allocation.upper_bound, "gap": allocation.gap,
                             "resolution_w": allocation.resolution_w, "message": allocation.message},
              "kareus": _missing(ours, twin), "uniform_power_limit": _missing(theirs, twin),
              "weight": weight, "throughput_ratio": ratio(theirs),
              "iterations_ratio": ours.to_dict()["iterations_per_s"] / theirs.to_dict()["iterations_per_s"],
              # A uniform limit leaves power unused where GPUs draw less than it (bubbles, memory-bound
              # phases); raised (or lowered) until the cluster draws what Kareus' allocation draws:
              "uniform_at_equal_power": {**_limits(twin, matched), **_missing(matched_run, twin)},
              "throughput_ratio_at_equal_power": ratio(matched_run),
              "uniform_closed_loop": {"feasible": closed is not None}}
    if closed is not None:
        closed_run = twin.uniform(closed)
        result["uniform_closed_loop"] |= {**_limits(twin, closed), **_missing(closed_run, twin)}
        result["throughput_ratio_at_equal_budget"] = ratio(closed_run)
    return result


def _allocation(twin: Twin, budget_w: float, closed: float | None, method: str, weight: str) -> Allocation:
    """The allocation over every job's frontier and power-limited points, the closed-loop uniform
    limit's points (when it meets the budget) an incumbent. A plan's frontier rows are its
    optimizer's predictions, which can differ a little from the twin's run of them: the points the
    incumbent uses and those allotted are replaced by the twin's numbers, and the allocation rerun
    until every allotted point is the twin's (so the twin's power is the predicted power)."""
    jobs = []
    for k, (name, plan) in enumerate(twin.plans):
        extra = () if closed is None else (twin.limit_w(k, closed),)
        job = PowerJob.from_plan(name, plan, weight=1.0 if weight == "jobs" else float(job_gpus(plan)))
        jobs.append(replace(job, points=job.points + power_limited_points(twin, k, extra_limits_w=extra)))
    uniform = [] if closed is None else [twin.run(k, plan.selected_row, twin.limit_w(k, closed))
                                         for k, (_, plan) in enumerate(twin.plans)]
    for k, run in enumerate(uniform):
        jobs[k] = _as_run(jobs[k], run)
    while True:
        incumbent = {job.name: _point_of(job, run) for job, run in zip(jobs, uniform, strict=True)}
        allocation = allocate(jobs, PowerBudget(cluster_w=budget_w), method=method,
                              incumbents=[incumbent] if incumbent else ())
        runs = {k: twin.run(k, a.row, a.power_limit_w) for k, a in enumerate(allocation.allotments) if not a.held}
        stale = [k for k, run in runs.items() if (run.time_s, run.energy_j) != (allocation.allotments[k].time_s,
                                                                                allocation.allotments[k].energy_j)]
        if not stale:
            return allocation
        for k in stale:  # each round makes at least one more point the twin's: this ends
            jobs[k] = _as_run(jobs[k], runs[k])


def _as_run(job: PowerJob, run: JobRun) -> PowerJob:
    """The job with the point that `run` is set to the twin's time and energy."""
    target = _point_of(job, run)
    points = tuple(PowerPoint(p.row, run.time_s, run.energy_j, p.power_limit_w) if p is target else p
                   for p in job.points)
    return replace(job, points=points)


def _point_of(job: PowerJob, run: JobRun) -> PowerPoint:
    """The job's point that `run` is (a frontier row when no limit binds)."""
    same = [p for p in job.points if p.row == run.row and p.power_limit_w == run.power_limit_w]
    if run.power_limit_w is not None and not same:  # the limit did not slow the row: its frontier point
        same = [p for p in job.points if p.row == run.row and p.power_limit_w is None]
    return same[0]


def _missing(run: PolicyRun, twin: Twin) -> dict[str, Any]:
    """The run's dict with `time_budgets_missed`: the jobs slower than their objective's time bound."""
    bounds = {name: PowerJob.from_plan(name, plan).max_time_s for name, plan in twin.plans}
    missed = [j.name for j in run.jobs if bounds[j.name] is not None and j.time_s > bounds[j.name] * (1 + 1e-9)]
    return {**run.to_dict(), "time_budgets_missed": missed}


def _limits(twin: Twin, share: float) -> dict[str, Any]:
    limits = {twin.gpus[k].name: twin.limit_w(k, share) for k in range(len(twin.plans))}
    weights = [job_gpus(plan) for _, plan in twin.plans]
    mean_w = sum(w * twin.limit_w(k, share) for k, w in enumerate(weights)) / sum(weights)
    return {"limit_share": share, "limit_w_per_gpu": mean_w, "limits_w": limits}
