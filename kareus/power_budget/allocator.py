"""Cluster power budget: one point per job, the jobs' power within budget, throughput highest.

Every KareusJob's plan carries its iteration frontier: points `(time_s, energy_j)` over all of the
job's GPUs, static energy included, so each point has a predicted average power
`power_w = energy_j / time_s`. A job may also carry **power-limited points** below or beside its
frontier: a frontier row run under a per-GPU board power limit (`PowerPoint.power_limit_w`, what
`nvidia-smi -pl` sets), predicted by the simulated GPU's power controller
(`kareus.power_budget.twin.power_limited_points`). They reach down to the board's lowest limit, so
wherever a uniform power limit meets a budget the allocation can too.

Given a budget in watts — for the whole cluster and/or per GPU product and node pool
(`kareus.policy.PowerBudget`) — `allocate(jobs, budget)` picks one point per job so that the
predicted powers of the jobs under every budget sum to at most that budget and the jobs' summed
**normalised throughput** is largest: a job at point p counts `weight × T_fastest / T_p` (1 at its
fastest point), so jobs of different sizes and models are comparable. It is a multiple-choice
knapsack over the points.

Rules, in order:

1. A job's objective comes first: with a time budget or deadline (`max_time_s`) only points that
   meet it are candidates, with an energy budget only those within it. A frontier with no such
   point leaves the job its fastest (time) or least-energy (energy) point.
2. Running jobs are never held. New jobs (`running=False`) are admitted in list order while every
   budget still fits all admitted jobs at their lowest-power candidates; the others are held (not
   started), and the result says which.
3. The budget is a physical limit, an objective is not: when the running jobs cannot fit at points
   that keep their objectives but can at any of their points, every running job's objective yields
   for this allocation (all its points are candidates), every new job is held, and the result names
   the jobs whose point misses their objective (`meets_objective` false). Only when the running
   jobs cannot fit even at their lowest-power points is the allocation infeasible: they get their
   lowest-power candidates that keep their objectives (never slower than their deadlines) and the
   message says by how much the budget is exceeded.
4. Among admitted jobs, throughput is maximised by one of two methods:

   - `exact`: dynamic programming over power discretised in steps of δ watts (`resolution_w`;
     default: the step at which n·δ is 0.2 % of each budget, coarser only if the largest budget
     would need more than 100,000 steps). Powers are rounded *up* to whole steps, so the
     allocation's true power never exceeds any budget, and its value is at least the true optimum
     for budgets each shrunk by n·δ (n = the jobs under that budget). The same DP with powers
     rounded *down* solves a relaxation, so it and the greedy's LP bound (below) are upper bounds
     on the true optimum; `upper_bound` is the smaller, and `upper_bound − value` a certified gap.
     Budgets must nest (node pools inside GPU products inside the cluster): the DP runs over that
     tree. Budgets that cross, and instances whose DP would take more than `MAX_DP_WORK` cell
     updates (about a thousand jobs), fall back to `greedy` (said in the message). Where the
     greedy's assignment (cheap to compute) has the higher value — rounding can cost the DP up to
     its bound — that one is returned, so `exact` is never worse than `greedy`.
   - `greedy`: every job starts at its lowest-power candidate and climbs its upper concave hull of
     (power, value); the step with the best value per watt that fits every budget on the job's way
     up is taken next. Its bound: the LP relaxation (fractional hull steps) is an upper bound on
     the optimum, and with one budget the greedy is within one hull step's value of it
     (value ≥ LP − max step Δv). `upper_bound` is the smallest of the LP bounds per budget level.

   `incumbents` are whole assignments to compare with (e.g. a uniform power limit's points): one
   that fits every budget, gives each job a candidate and has a higher value is returned instead,
   so the allocation is never worse than any of them.

Limits: predicted power is the plan's average over an iteration, not a peak; power of GPUs that
run no KareusJob is not counted (give the budget net of them); jobs' points are taken as
independent (shared cooling or power delivery is not modelled).
"""

from __future__ import annotations

import heapq
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import cached_property
from typing import Any

import numpy as np

from kareus.errors import KareusError
from kareus.objective import iteration_budget, parse_objective
from kareus.policy import PowerBudget, gpu_model_key

METHODS = ("exact", "greedy")
SHRINK = 2e-3  # the exact DP's default step loses at most this share of any budget
MAX_CELLS = 100_000  # DP steps in the largest budget, at most (memory and time bound)
MAX_DP_WORK = 400_000_000  # candidate points × DP steps, at most: beyond it (≈ 1,000 jobs) the greedy runs
_REL = 1e-9  # float slack when comparing sums with budgets
_TIME, _ENERGY = operator.attrgetter("time_s"), operator.attrgetter("energy_j")
_HULL = "_hull_points"  # where a PowerJob caches its hull (computed for many jobs at once by `_warm`)


@dataclass(frozen=True)
class PowerPoint:
    """One point of a job: its row in the plan's frontier table, time and energy (all GPUs), and the
    per-GPU board power limit it runs under (None: the row's clocks alone, no limit set)."""

    row: int
    time_s: float
    energy_j: float
    power_limit_w: float | None = None

    @property
    def power_w(self) -> float:
        return self.energy_j / self.time_s

    @property
    def iterations_per_s(self) -> float:
        return 1.0 / self.time_s


@dataclass(frozen=True)
class PowerJob:
    """A job as the allocator sees it: its frontier, where it runs, whether it runs, its objective's bounds."""

    name: str
    points: tuple[PowerPoint, ...]
    gpu_product: str = ""
    node_pool: str = ""
    running: bool = True
    weight: float = 1.0
    max_time_s: float | None = None  # a time budget or deadline: slower points are never allotted
    max_energy_j: float | None = None  # an energy budget per iteration

    def __post_init__(self) -> None:
        if not self.points:
            raise KareusError(f"job {self.name}: the frontier has no points")
        for p in self.points:
            if not (p.time_s > 0 and p.energy_j > 0 and math.isfinite(p.time_s) and math.isfinite(p.energy_j)):
                raise KareusError(f"job {self.name}: frontier row {p.row} needs time_s > 0 and energy_j > 0")
        if not self.weight > 0:
            raise KareusError(f"job {self.name}: weight must be > 0, got {self.weight}")

    @cached_property
    def fastest_time_s(self) -> float:
        return min(p.time_s for p in self.points)

    @cached_property
    def _point_arrays(self) -> np.ndarray:
        # Vectorised: an operator pass over a thousand jobs of hundreds of points each reads them once.
        return np.array([(p.time_s, p.energy_j) for p in self.points], float).reshape(-1, 2)

    @cached_property
    def _candidate_index(self) -> np.ndarray:
        times, energies = self._point_arrays.T
        fits = np.ones(len(self.points), bool)
        if self.max_time_s is not None:
            fits &= times <= self.max_time_s * (1 + _REL)
        if self.max_energy_j is not None:
            fits &= energies <= self.max_energy_j * (1 + _REL)
        if fits.any():
            return np.flatnonzero(fits)
        if self.max_time_s is not None:
            return np.lexsort((energies, times))[:1]
        return np.lexsort((times, energies))[:1]

    @cached_property
    def _candidates(self) -> tuple[PowerPoint, ...]:
        if self.max_time_s is None and self.max_energy_j is None:
            return self.points
        return tuple(self.points[i] for i in self._candidate_index.tolist())

    @property
    def hull(self) -> tuple[PowerPoint, ...]:
        """The upper concave hull of the candidates in (power, value), from the lowest power up."""
        if _HULL not in self.__dict__:
            _warm([self])
        return self.__dict__[_HULL]

    @property
    def relaxed(self) -> PowerJob:
        """The job with its objective dropped: every point is a candidate (rule 3)."""
        return replace(self, max_time_s=None, max_energy_j=None)

    def meets_objective(self, point: PowerPoint) -> bool:
        fits_time = self.max_time_s is None or point.time_s <= self.max_time_s * (1 + _REL)
        fits_energy = self.max_energy_j is None or point.energy_j <= self.max_energy_j * (1 + _REL)
        return fits_time and fits_energy

    def candidates(self) -> tuple[PowerPoint, ...]:
        """The points the allocator may give this job (rule 1 of the module docstring)."""
        return self._candidates

    def value(self, point: PowerPoint) -> float:
        """Weighted normalised throughput: 1 × weight at the fastest point."""
        return self.weight * self.fastest_time_s / point.time_s

    @classmethod
    def from_plan(cls, name: str, plan: Any, *, objective: object = None, steps: int | None = None,
                  now: datetime | None = None, gpu_product: str | None = None, node_pool: str = "",
                  running: bool = True, weight: float = 1.0) -> PowerJob:
        """From a `kareus.plan.Plan` (its frontier table) and the job's objective (default: the
        plan's). Whole-job budgets are spread over `steps` (the steps still to run; default the
        plan's); a deadline that has passed keeps the job at its fastest point."""
        points = tuple(PowerPoint(i, row.time_s, row.energy_j) for i, row in enumerate(plan.frontier.rows))
        chosen = parse_objective(plan.objective if objective is None else objective)
        try:
            bound = iteration_budget(chosen, [(p.time_s, p.energy_j) for p in points],
                                     steps=steps or plan.job.steps, now=now)
            max_time_s, max_energy_j = bound.max_time_s, bound.max_energy_j
        except KareusError:
            max_time_s, max_energy_j = min(p.time_s for p in points), None
        return cls(name, points, gpu_product=gpu_product or plan.job.gpu, node_pool=node_pool, running=running,
                   weight=weight, max_time_s=max_time_s, max_energy_j=max_energy_j)


@dataclass(frozen=True)
class Allotment:
    """What one job gets: a frontier row (and a per-GPU power limit, if its point needs one) and its
    predicted power, or held (not started)."""

    name: str
    row: int | None
    time_s: float | None
    energy_j: float | None
    power_w: float
    normalised_throughput: float
    held: bool = False
    meets_objective: bool = True
    reason: str = ""
    power_limit_w: float | None = None

    @property
    def iterations_per_s(self) -> float:
        return 1.0 / self.time_s if self.time_s else 0.0

    def status(self) -> dict[str, Any]:
        """A camelCase form for a KareusJob's status (e.g. `status.powerAllotment`)."""
        out = {"watts": round(self.power_w, 3), "frontierRow": self.row, "held": self.held,
               "predictedIterationSeconds": self.time_s, "normalisedThroughput": round(self.normalised_throughput, 6),
               "message": self.reason}
        if self.power_limit_w is not None:
            out["powerLimitWatts"] = round(self.power_limit_w, 3)
        return out


@dataclass(frozen=True)
class BudgetUse:
    """One budget: which jobs it covers, its limit and what the allotments use of it."""

    key: str  # "cluster", "gpuProduct/<name>" or "nodePool/<name>"
    limit_w: float
    used_w: float
    jobs: tuple[str, ...]


@dataclass(frozen=True)
class Allocation:
    """The allocator's result; `allotments` in the jobs' order."""

    allotments: tuple[Allotment, ...]
    method: str
    feasible: bool
    held: tuple[str, ...]
    total_power_w: float
    budgets: tuple[BudgetUse, ...]
    value: float  # Σ weighted normalised throughput
    upper_bound: float  # ≥ the optimum's value (see the module docstring)
    resolution_w: float | None = None  # the exact DP's power step
    message: str = ""

    @property
    def gap(self) -> float:
        """A certified bound on how far `value` is below the optimum."""
        return max(0.0, self.upper_bound - self.value)

    def get(self, name: str) -> Allotment:
        for allotment in self.allotments:
            if allotment.name == name:
                return allotment
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "feasible": self.feasible, "held": list(self.held),
                "total_power_w": self.total_power_w, "value": self.value, "upper_bound": self.upper_bound,
                "gap": self.gap, "resolution_w": self.resolution_w, "message": self.message,
                "budgets": [{"key": b.key, "limit_w": b.limit_w, "used_w": b.used_w, "jobs": list(b.jobs)}
                            for b in self.budgets],
                "allotments": [{"name": a.name, "row": a.row, "time_s": a.time_s, "energy_j": a.energy_j,
                                "power_w": a.power_w, "normalised_throughput": a.normalised_throughput,
                                "held": a.held, "meets_objective": a.meets_objective, "reason": a.reason,
                                "power_limit_w": a.power_limit_w}
                               for a in self.allotments]}


# ---------------------------------------------------------------------------------------------
# Budgets as constraints


@dataclass
class _Constraint:
    key: str
    limit_w: float
    members: frozenset[str]
    level: int  # 0 cluster, 1 GPU product, 2 node pool
    children: list[_Constraint] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)  # jobs directly under this budget


def _constraints(jobs: Sequence[PowerJob], budget: PowerBudget) -> list[_Constraint]:
    """Every budget that covers at least one job."""
    names = frozenset(j.name for j in jobs)
    found = []
    if budget.cluster_w is not None:
        found.append(_Constraint("cluster", budget.cluster_w, names, 0))
    for product, watts in budget.gpu_products_w.items():
        members = frozenset(j.name for j in jobs if j.gpu_product and gpu_model_key(j.gpu_product) == gpu_model_key(product))
        found.append(_Constraint(f"gpuProduct/{product}", watts, members, 1))
    for pool, watts in budget.node_pools_w.items():
        found.append(_Constraint(f"nodePool/{pool}", watts, frozenset(j.name for j in jobs if j.node_pool == pool), 2))
    return [c for c in found if c.members]


def _crossing(constraints: Sequence[_Constraint]) -> tuple[_Constraint, _Constraint] | None:
    """Two budgets whose jobs overlap without one containing the other (the DP needs a tree)."""
    for i, a in enumerate(constraints):
        for b in constraints[i + 1:]:
            if a.members & b.members and not (a.members <= b.members or b.members <= a.members):
                return a, b
    return None


def _tree(jobs: Sequence[PowerJob], constraints: Sequence[_Constraint]) -> _Constraint:
    """Nest the (laminar) budgets; the root is the cluster budget, or an unbounded one."""
    ordered = sorted(constraints, key=lambda c: (-len(c.members), c.level))
    root = ordered[0] if ordered and ordered[0].key == "cluster" else _Constraint(
        "(none)", math.inf, frozenset(j.name for j in jobs), -1)
    placed = [root]
    for c in ordered:
        if c is root:
            continue
        parent = min((p for p in placed if c.members <= p.members), key=lambda p: (len(p.members), -p.level))
        parent.children.append(c)
        placed.append(c)
    for job in jobs:
        home = min((p for p in placed if job.name in p.members), key=lambda p: (len(p.members), -p.level))
        home.jobs.append(job.name)
    return root


def _fits(usage: Mapping[str, float], constraints: Sequence[_Constraint]) -> bool:
    return all(usage[c.key] <= c.limit_w * (1 + _REL) + 1e-9 for c in constraints)


# ---------------------------------------------------------------------------------------------
# The allocator


def allocate(jobs: Sequence[PowerJob], budget: PowerBudget, *, method: str | None = None,
             resolution_w: float | None = None,
             incumbents: Sequence[Mapping[str, PowerPoint]] = ()) -> Allocation:
    """One point per job within `budget` (see the module docstring for the rules).

    `method` and `resolution_w` default to the budget's (`PowerBudget.method`, `.resolution_w`);
    `incumbents`: assignments (job name → one of its points) the result is never worse than.
    """
    method = method or budget.method
    if method not in METHODS:
        raise KareusError(f"power allocation method must be one of {', '.join(METHODS)}, got {method!r}")
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise KareusError("power allocation: job names must be unique")
    constraints = _constraints(jobs, budget)
    admitted, held, feasible = _admit(jobs, constraints)
    note = ""
    if not feasible:
        relaxed = [j.relaxed for j in jobs if j.running]
        if not _admit(relaxed, constraints)[2]:
            picks = {j.name: _lowest_power(j) for j in admitted}
            bound = sum(j.value(p) for j in admitted for p in [picks[j.name]])
            result = _result(jobs, picks, held, constraints, method, bound, None, feasible=False)
            return _with_message(result, _infeasible_text(result, held))
        admitted = relaxed  # rule 3: the budget wins over the running jobs' objectives, new jobs wait
        held = [j.name for j in jobs if not j.running]
        note = "the running jobs fit the budget only if their objectives yield; "
    picks, upper, step_w, method, how = _optimise(admitted, constraints, method, resolution_w or budget.resolution_w)
    picks, chosen = _best_of(admitted, constraints, picks, incumbents)
    result = _result(jobs, picks, held, constraints, method, upper, step_w, feasible=True)
    missed = [a.name for a in result.allotments if not a.held and not a.meets_objective]
    if note and missed:
        note += f"objective missed by: {', '.join(missed)}; "
    return _with_message(result, note + how + chosen + _summary_text(result))


def _optimise(members: Sequence[PowerJob], constraints: Sequence[_Constraint], method: str,
              resolution_w: float | None) -> tuple[dict[str, PowerPoint], float, float | None, str, str]:
    """(picks, upper bound, DP step, method used, what happened) for the admitted jobs (rule 4)."""
    note = ""
    if method == "exact" and (crossing := _crossing(constraints)) is not None:
        a, b = crossing
        method, note = "greedy", (f"budgets {a.key} and {b.key} cross (jobs in one but not all of both), so the "
                                  "exact DP (which needs nested budgets) fell back to greedy; ")
    step_w = resolution_w or _default_resolution(constraints)
    if method == "exact" and (work := _dp_work(members, constraints, step_w)) > MAX_DP_WORK:
        method, note = "greedy", (f"the exact DP would take {work:.2g} cell updates (more than {MAX_DP_WORK:.0e}), "
                                  "so it fell back to greedy; ")
    if method == "exact":
        try:
            picks = _exact(members, constraints, step_w, round_up=True)
        except _RoundingInfeasible as error:
            method, note = "greedy", f"{error}, so the exact DP fell back to greedy; "
    if method != "exact":
        return _greedy(members, constraints), _lp_bound(members, constraints), None, "greedy", note
    greedy_picks = _greedy(members, constraints)  # cheap; where rounding lost more, it is better
    if _value(members, greedy_picks) > _value(members, picks):
        picks, note = greedy_picks, note + "the greedy's assignment beat the discretised DP's and is used; "
    upper_picks = _exact(members, constraints, step_w, round_up=False)
    upper = min(_value(members, upper_picks), _lp_bound(members, constraints))
    return picks, upper, step_w, "exact", note


def _dp_work(members: Sequence[PowerJob], constraints: Sequence[_Constraint], step_w: float) -> float:
    """About how many cell updates the two DPs make: candidates × steps of the largest budget."""
    finite = [c.limit_w for c in constraints if math.isfinite(c.limit_w)]
    cells = max(finite, default=0.0) / step_w
    return 2.0 * cells * sum(len(j.candidates()) for j in members)


def _value(members: Sequence[PowerJob], picks: Mapping[str, PowerPoint]) -> float:
    return sum(j.value(picks[j.name]) for j in members)


def _best_of(members: Sequence[PowerJob], constraints: Sequence[_Constraint], picks: dict[str, PowerPoint],
             incumbents: Sequence[Mapping[str, PowerPoint]]) -> tuple[dict[str, PowerPoint], str]:
    """`picks`, or the incumbent with the higher value that gives every job a candidate and fits."""
    best, note = picks, ""
    for k, incumbent in enumerate(incumbents):
        if not all(j.name in incumbent and incumbent[j.name] in j.candidates() for j in members):
            continue
        usage = {c.key: sum(incumbent[j.name].power_w for j in members if j.name in c.members) for c in constraints}
        if _fits(usage, constraints) and _value(members, incumbent) > _value(members, best) + _tolerance(
                _value(members, best)):
            best, note = {j.name: incumbent[j.name] for j in members}, f"incumbent {k} beat the optimiser's and is used; "
    return best, note


def _lowest_power(job: PowerJob) -> PowerPoint:
    """The least-power candidate (the most valuable among equals): where the job's hull starts."""
    return job.hull[0]


def _admit(jobs: Sequence[PowerJob], constraints: Sequence[_Constraint]) -> tuple[list[PowerJob], list[str], bool]:
    """Running jobs always; new jobs in order while every budget fits all at their lowest power."""
    _warm(jobs)
    usage = {c.key: 0.0 for c in constraints}

    def add(job: PowerJob) -> dict[str, float]:
        power = _lowest_power(job).power_w
        return {c.key: usage[c.key] + (power if job.name in c.members else 0.0) for c in constraints}

    admitted = [j for j in jobs if j.running]
    for job in admitted:
        usage = add(job)
    if not _fits(usage, constraints):
        return admitted, [j.name for j in jobs if not j.running], False
    held = []
    for job in (j for j in jobs if not j.running):
        trial = add(job)
        if _fits(trial, constraints):
            usage = trial
            admitted.append(job)
        else:
            held.append(job.name)
    return admitted, held, True


def _default_resolution(constraints: Sequence[_Constraint]) -> float:
    """The step that shrinks no budget by more than `SHRINK` (n·δ ≤ SHRINK·L for each budget of n
    jobs), but no finer than the largest budget in `MAX_CELLS` steps."""
    if not constraints:
        return 1.0  # no budget binds: any step finds the fastest points
    finest = min(c.limit_w * SHRINK / len(c.members) for c in constraints)
    return max(finest, max(c.limit_w for c in constraints) / MAX_CELLS)


class _RoundingInfeasible(Exception):
    """The budget fits the jobs' true powers but not their powers rounded up to the DP's steps."""


class _Curve:
    """Best value with at most g power steps (g = 0..cap) over the jobs and sub-budgets merged so far.

    Each merge keeps the curve before it; backtracking recomputes the choice at the one g it needs
    (cheaper than an argmax table for every g)."""

    def __init__(self, cap: int) -> None:
        self.best = np.zeros(cap + 1)
        self.steps: list[tuple] = []

    @property
    def cap(self) -> int:
        return len(self.best) - 1

    def add_job(self, name: str, units: np.ndarray, values: np.ndarray) -> None:
        new = np.full(self.cap + 1, -np.inf)
        for u, v in zip(units, values, strict=True):
            if u <= self.cap:
                np.maximum(new[u:], self.best[:self.cap + 1 - u] + v, out=new[u:])
        self.steps.append(("job", name, self.best, units, values))
        self.best = new

    def add_curve(self, child: _Curve) -> None:
        new = np.full(self.cap + 1, -np.inf)
        rises = _rises(child.best[:self.cap + 1])
        for h in rises:
            np.maximum(new[h:], self.best[:self.cap + 1 - h] + child.best[h], out=new[h:])
        self.steps.append(("curve", child, self.best, rises))
        self.best = new

    def backtrack(self, g: int, out: dict[str, int]) -> None:
        target = self.best[g]
        for step in reversed(self.steps):
            if step[0] == "job":
                _, name, before, units, values = step
                k = next(k for k, (u, v) in enumerate(zip(units, values, strict=True))
                         if u <= g and before[g - u] + v >= target - _tolerance(target))
                out[name] = k
                g -= int(units[k])
                target = before[g]
            else:
                _, child, before, rises = step
                h = next(int(h) for h in rises
                         if h <= g and before[g - h] + child.best[h] >= target - _tolerance(target))
                child.backtrack(h, out)
                g -= h
                target = before[g]

    def lowest_best(self) -> int:
        """The smallest g reaching the best value (least power among the optima)."""
        return int(np.flatnonzero(self.best >= self.best.max() - 1e-12)[0])


def _rises(curve: np.ndarray) -> np.ndarray:
    """Where a non-decreasing step curve rises: only there is using more power worth it."""
    finite = np.isfinite(curve)
    previous = np.concatenate(([-np.inf], np.maximum.accumulate(np.where(finite, curve, -np.inf))[:-1]))
    return np.flatnonzero(finite & (curve > previous))


def _tolerance(value: float) -> float:
    return 1e-9 * max(1.0, abs(value))


def _exact(jobs: Sequence[PowerJob], constraints: Sequence[_Constraint], step_w: float, *,
           round_up: bool) -> dict[str, PowerPoint]:
    by_name = {j.name: j for j in jobs}
    root = _tree(jobs, [_Constraint(c.key, c.limit_w, c.members & set(by_name), c.level) for c in constraints
                        if c.members & set(by_name)])
    options = {j.name: j.candidates() for j in jobs}

    def units(job: PowerJob) -> np.ndarray:
        scaled = np.array([p.power_w / step_w for p in options[job.name]])
        return (np.ceil(scaled - 1e-9) if round_up else np.floor(scaled + 1e-9)).astype(np.int64)

    def solve(node: _Constraint) -> _Curve:
        curve = _Curve(math.floor(node.limit_w / step_w + 1e-9))
        for name in node.jobs:
            job = by_name[name]
            curve.add_job(name, units(job), np.array([job.value(p) for p in options[name]]))
        for child in node.children:
            curve.add_curve(solve(child))
        if not np.isfinite(curve.best[-1]):
            raise _RoundingInfeasible(f"power budget {node.key} fits the jobs only by less than their powers "
                                      f"rounded up to {step_w:g} W steps")
        return curve

    chosen: dict[str, int] = {}
    if math.isfinite(root.limit_w):
        curve = solve(root)
        curve.backtrack(curve.lowest_best(), chosen)
    else:  # no cluster budget: the sub-budgets are independent, unbudgeted jobs run flat out
        for child in root.children:
            curve = solve(child)
            curve.backtrack(curve.lowest_best(), chosen)
        for name in root.jobs:
            job = by_name[name]
            chosen[name] = max(range(len(options[name])), key=lambda k, job=job, name=name: (
                job.value(options[name][k]), -options[name][k].power_w))
    return {name: options[name][k] for name, k in chosen.items()}


# -- greedy on the convex hulls ----------------------------------------------------------------


def _warm(jobs: Sequence[PowerJob]) -> None:
    """Compute the hulls of all `jobs` not yet computed in one vectorised pass, into each job's cache.

    Per job, numpy's call overhead would dominate a pass over a thousand jobs of hundreds of points
    each; flat arrays over all of them cost a few calls in all. A job's hull only depends on its
    own fields (it is frozen), so caching it on the job is safe."""
    cold = [j for j in jobs if _HULL not in j.__dict__]
    if not cold:
        return
    candidates = [j.candidates() for j in cold]
    flat = [p for c in candidates for p in c]
    owner = np.repeat(np.arange(len(cold)), [len(c) for c in candidates])
    times = np.fromiter(map(_TIME, flat), float, len(flat))
    energies = np.fromiter(map(_ENERGY, flat), float, len(flat))
    power = energies / times
    starts = np.searchsorted(owner, np.arange(len(cold)))
    fastest = np.minimum.reduceat(times, starts) if len(flat) else times
    for k, job in enumerate(cold):  # a job's fastest point is among its candidates unless an objective filtered
        if job.candidates() is job.points and "fastest_time_s" not in job.__dict__:
            job.__dict__["fastest_time_s"] = float(fastest[k])
    value = np.array([j.weight * j.fastest_time_s for j in cold])[owner] / times
    order = np.lexsort((-value, power, owner))  # per job: by power, the most valuable first among equals
    lifted = value[order] + owner[order] * (value.max() + 1.0)  # each job above all earlier ones: one running max
    before = np.concatenate(([-np.inf], np.maximum.accumulate(lifted)[:-1]))
    kept = order[lifted > before]  # points that add value for more power (a job's first always does)
    while len(kept) > 2:
        # A point on or below the chord of its neighbours (of its own job) is no vertex of the hull of
        # the points left, so all such points can go at once; powers strictly rise within a job here.
        x, y, o = power[kept], value[kept], owner[kept]
        inner = ((o[:-2] == o[1:-1]) & (o[1:-1] == o[2:])
                 & ((y[1:-1] - y[:-2]) * (x[2:] - x[1:-1]) <= (y[2:] - y[1:-1]) * (x[1:-1] - x[:-2])))
        if not inner.any():
            break
        kept = kept[np.concatenate(([True], ~inner, [True]))]
    bounds = np.searchsorted(owner[kept], np.arange(len(cold) + 1)).tolist()
    indices = kept.tolist()
    for k, job in enumerate(cold):
        job.__dict__[_HULL] = tuple(flat[i] for i in indices[bounds[k]:bounds[k + 1]])


def _slope(job: PowerJob, a: PowerPoint, b: PowerPoint) -> float:
    return (job.value(b) - job.value(a)) / max(b.power_w - a.power_w, 1e-12)


def _greedy(jobs: Sequence[PowerJob], constraints: Sequence[_Constraint]) -> dict[str, PowerPoint]:
    _warm(jobs)
    hulls = {j.name: j.hull for j in jobs}
    at = {j.name: 0 for j in jobs}
    mine = {j.name: [c for c in constraints if j.name in c.members] for j in jobs}
    usage = {c.key: sum(hulls[n][0].power_w for n in c.members if n in hulls) for c in constraints}
    heap = [(-_slope(j, hulls[j.name][0], hulls[j.name][1]), i, j.name) for i, j in enumerate(jobs)
            if len(hulls[j.name]) > 1]
    heapq.heapify(heap)
    index = {j.name: (i, j) for i, j in enumerate(jobs)}
    while heap:
        _, i, name = heapq.heappop(heap)
        hull, k = hulls[name], at[name]
        extra_w = hull[k + 1].power_w - hull[k].power_w
        if not all(usage[c.key] + extra_w <= c.limit_w * (1 + _REL) + 1e-9 for c in mine[name]):
            continue  # this job's later hull steps hang on this one: it stays here
        for c in mine[name]:
            usage[c.key] += extra_w
        at[name] = k + 1
        if k + 2 < len(hull):
            heapq.heappush(heap, (-_slope(index[name][1], hull[k + 1], hull[k + 2]), i, name))
    return {name: hulls[name][k] for name, k in at.items()}


def _lp_value(jobs: Sequence[PowerJob], limit_w: float) -> float:
    """The LP relaxation's optimum for `jobs` under one budget: fractional hull steps."""
    _warm(jobs)
    hulls = [j.hull for j in jobs]
    owner = np.repeat(np.arange(len(jobs)), [len(h) for h in hulls])
    times, energies = np.array([(p.time_s, p.energy_j) for h in hulls for p in h], float).reshape(-1, 2).T
    power = energies / times
    value = np.array([j.weight * j.fastest_time_s for j in jobs])[owner] / times
    first = np.concatenate(([True], owner[1:] != owner[:-1]))
    gains, watts = np.diff(value)[~first[1:]], np.diff(power)[~first[1:]]  # steps within a job
    order = np.argsort(-gains / np.maximum(watts, 1e-12), kind="stable")  # a job's steps stay in order (concave)
    gains, watts = gains[order], watts[order]
    room = limit_w - float(power[first].sum())
    done = np.cumsum(watts)
    full = int(np.searchsorted(done, room, side="right"))  # whole steps that fit
    total = float(value[first].sum()) + float(gains[:full].sum())
    if room > 0 and full < len(gains):
        total += gains[full] * (room - (done[full - 1] if full else 0.0)) / watts[full]
    return total


def _lp_bound(jobs: Sequence[PowerJob], constraints: Sequence[_Constraint]) -> float:
    """An upper bound on the optimum: per budget level (disjoint budgets), the LP of each budget plus
    every job outside them at its best; the smallest over the levels."""
    _warm(jobs)
    best = {j.name: j.value(j.hull[-1]) for j in jobs}  # a hull ends at the most valuable candidate
    bounds = [sum(best.values())]
    for level in (0, 1, 2):
        chosen = [c for c in constraints if c.level == level]
        if not chosen:
            continue
        covered = set().union(*(c.members for c in chosen))
        bound = sum(best[n] for n in best if n not in covered)
        bound += sum(_lp_value([j for j in jobs if j.name in c.members], c.limit_w) for c in chosen)
        bounds.append(bound)
    return min(bounds)


# -- results -----------------------------------------------------------------------------------


def _result(jobs: Sequence[PowerJob], picks: Mapping[str, PowerPoint], held: Iterable[str],
            constraints: Sequence[_Constraint], method: str, upper: float, step_w: float | None, *,
            feasible: bool) -> Allocation:
    held = tuple(held)
    allotments = []
    for job in jobs:
        if job.name in held:
            allotments.append(Allotment(job.name, None, None, None, 0.0, 0.0, held=True,
                                        reason="held: the power budget cannot fit this job as well"))
            continue
        p = picks[job.name]
        limit = "" if p.power_limit_w is None else f" under a {p.power_limit_w:.0f} W per-GPU power limit"
        allotments.append(Allotment(job.name, p.row, p.time_s, p.energy_j, p.power_w, job.fastest_time_s / p.time_s,
                                    meets_objective=job.meets_objective(p),
                                    reason=f"allotted {p.power_w:.0f} W: frontier row {p.row}{limit}, "
                                           f"{p.time_s:.4g} s/iteration", power_limit_w=p.power_limit_w))
    power = {a.name: a.power_w for a in allotments}
    uses = tuple(BudgetUse(c.key, c.limit_w, sum(power[n] for n in c.members), tuple(sorted(c.members)))
                 for c in constraints)
    value = sum(j.value(picks[j.name]) for j in jobs if j.name in picks)
    return Allocation(tuple(allotments), method, feasible, held, sum(power.values()), uses, value,
                      max(upper, value), step_w)


def _with_message(result: Allocation, message: str) -> Allocation:
    return replace(result, message=message)


def _summary_text(result: Allocation) -> str:
    uses = ", ".join(f"{b.key} {b.used_w:.0f}/{b.limit_w:.0f} W" for b in result.budgets) or "no budget binds"
    held = f"; held (budget too small for them too): {', '.join(result.held)}" if result.held else ""
    return f"{len(result.allotments) - len(result.held)} job(s) allotted, {uses}{held}"


def _infeasible_text(result: Allocation, held: Sequence[str]) -> str:
    over = [b for b in result.budgets if b.used_w > b.limit_w * (1 + _REL)]
    parts = ", ".join(f"{b.key} needs {b.used_w:.0f} W of {b.limit_w:.0f} W" for b in over)
    text = (f"the power budget cannot be met: the running jobs at their lowest-power points that keep their "
            f"deadlines need more ({parts}); they keep those points")
    return text + (f"; new jobs held: {', '.join(held)}" if held else "")

