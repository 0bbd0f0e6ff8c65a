"""Straggler-aware re-selection: when one data-parallel replica is slower, the others save energy.

Data-parallel replicas meet at every step's gradient all-reduce, so a job runs at its slowest
replica's pace and the others wait, paying static power. If one replica is slower for a few steps
(a GPU that throttles, a weaker part), the others re-select the cheapest frontier point whose
predicted time does not exceed the straggler's time: the job's iteration time stays the same and
its energy falls. When the straggler recovers they return to the objective's point.

`StragglerWatch` decides, step by step, from every replica's time. It is deterministic: every rank
runs it on the same gathered numbers and so reaches the same decision at the same step — the
runtime needs no extra agreement protocol (`kareus.runtime.trainer`). The comparison is made on
each replica's **slowness ratio** (measured time ÷ predicted time of the frontier point it runs),
so a replica that has re-selected a slower point is not mistaken for a straggler, and a systematic
gap between predicted and measured times cancels:

- a replica is the straggler when its ratio exceeds the next slowest replica's by more than
  `threshold` (default 5 %), `patience_steps` steps in a row (default 3) — a one-step hiccup (a
  checkpoint, a data-loader stall) changes nothing;
- the others then run the least-energy frontier point with predicted time ≤ the straggler's time
  ÷ their own ratio, and never slower than the objective allows (a time budget or deadline,
  `max_time_s`): the objective still bounds the job's pace the moment the straggler recovers;
- while re-selected, the straggler is compared with the others' pace *before* they switched
  (their rows' own prediction errors cannot hide or fake a recovery); when its slowdown moves by
  more than `threshold`, the target is re-selected after `patience_steps` more steps; after
  `recovery_steps` steps within the threshold everyone returns. During those steps the job runs
  at the re-selected point's pace: the price of not reacting to a one-step dip.

`simulate_straggler(plan, slowdown=…)` is the twin's what-if (`kareus sim straggler`): one replica
on a simulated GPU whose clock ceiling makes it `slowdown` slower (`kareus.sim.replica`), the same
steps with and without re-selection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kareus.errors import KareusError
from kareus.objective import iteration_budget, parse_objective
from kareus.plan import Plan

REASON_STRAGGLER = "straggler"
REASON_RECOVERED = "recovered"


@dataclass(frozen=True)
class StragglerPolicy:
    """When a slower replica makes the others re-select, and when they return."""

    threshold: float = 0.05
    patience_steps: int = 3
    recovery_steps: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 10:
            raise KareusError(f"straggler threshold must be a fraction in (0, 10), got {self.threshold!r}")
        for name in ("patience_steps", "recovery_steps"):
            if getattr(self, name) < 1:
                raise KareusError(f"straggler {name} must be >= 1, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Decision:
    """Frontier rows every replica runs from the next step on, and why."""

    step: int
    rows: tuple[int, ...]
    reason: str  # "straggler" or "recovered"
    straggler: int | None
    slowdown: float  # the straggler's ratio over the next slowest replica's, minus 1


def objective_max_time_s(plan: Plan, *, steps: int | None = None) -> float | None:
    """The per-iteration time the plan's objective allows (None: no time bound)."""
    try:
        budget = iteration_budget(parse_objective(plan.objective), plan.frontier.points(),
                                  steps=steps or plan.job.steps)
    except KareusError:  # a deadline that passed, no steps to spread over: the objective's own point
        return plan.frontier.rows[plan.selected_row].time_s
    return budget.max_time_s


@dataclass(frozen=True)
class _Held:
    """A re-selection in force: for which replica, the others' pace (ratio) then, its slowdown then."""

    replica: int
    pace: float
    slowdown: float


@dataclass
class StragglerWatch:
    """The per-step re-selection decisions of a job with `replicas` data-parallel replicas.

    `points` are the frontier's `(time_s, energy_j)`; every replica starts on `base_row`.
    """

    points: Sequence[tuple[float, float]]
    base_row: int
    replicas: int
    policy: StragglerPolicy = StragglerPolicy()
    max_time_s: float | None = None
    rows: list[int] = field(init=False)
    slowdown: float | None = field(init=False, default=None)  # the slowest replica's, at the last step
    straggler: int | None = field(init=False, default=None)  # the slowest replica, if beyond the threshold
    _streak: int = field(init=False, default=0)
    _calm: int = field(init=False, default=0)
    _candidate: tuple[int, tuple[int, ...]] | None = field(init=False, default=None)
    _held: _Held | None = field(init=False, default=None)  # the straggler the others re-selected for

    def __post_init__(self) -> None:
        if self.replicas < 1 or not 0 <= self.base_row < len(self.points):
            raise KareusError(f"straggler watch: need >= 1 replica and a base row in the frontier, got "
                              f"{self.replicas} and {self.base_row}")
        self.rows = [self.base_row] * self.replicas

    @property
    def reselected(self) -> bool:
        return any(r != self.base_row for r in self.rows)

    def reset(self, points: Sequence[tuple[float, float]], base_row: int, max_time_s: float | None) -> None:
        """A new plan was rolled out (objective change): every replica runs its point from now on."""
        self.points, self.base_row, self.max_time_s = points, base_row, max_time_s
        self.rows = [base_row] * self.replicas
        self._streak, self._calm, self._candidate, self._held = 0, 0, None, None

    def ratios(self, times_s: Sequence[float]) -> list[float]:
        """Each replica's measured time over the predicted time of the row it runs."""
        if len(times_s) != self.replicas:
            raise KareusError(f"straggler watch: {len(times_s)} replica times for {self.replicas} replicas")
        return [t / self.points[r][0] for t, r in zip(times_s, self.rows, strict=True)]

    def observe(self, step: int, times_s: Sequence[float]) -> Decision | None:
        """This step's replica times; a `Decision` when the rows change from the next step on."""
        if self.replicas < 2:
            return None
        ratios = self.ratios(times_s)
        if self._held is None:
            return self._watch_for_straggler(step, times_s, ratios)
        return self._follow_straggler(step, times_s, ratios)

    def _watch_for_straggler(self, step: int, times_s: Sequence[float], ratios: list[float]) -> Decision | None:
        slowest = max(range(self.replicas), key=lambda r: (ratios[r], -r))
        pace = max(ratios[r] for r in range(self.replicas) if r != slowest)
        slowdown = self._note(ratios[slowest] / pace - 1.0, slowest)
        wanted = self._target_rows(slowest, times_s[slowest] / pace) if slowdown > self.policy.threshold else None
        if wanted is None or wanted == tuple(self.rows):
            self._streak, self._candidate = 0, None
            return None
        if self._candidate is None or self._candidate[0] != slowest:
            self._streak = 0
        self._candidate = (slowest, wanted)
        self._streak += 1
        if self._streak < self.policy.patience_steps:
            return None
        # From now on the straggler is compared with the others' pace on the base row, frozen here,
        # so the rows they re-selected (and those rows' prediction errors) cannot hide or fake it.
        self._held = _Held(slowest, pace, slowdown)
        return self._decide(step, wanted, REASON_STRAGGLER, slowest, slowdown)

    def _follow_straggler(self, step: int, times_s: Sequence[float], ratios: list[float]) -> Decision | None:
        held = self._held
        slowdown = self._note(ratios[held.replica] / held.pace - 1.0, held.replica)
        if slowdown <= self.policy.threshold:
            self._streak = 0
            self._calm += 1
            if self._calm < self.policy.recovery_steps:
                return None
            self._held = None
            return self._decide(step, (self.base_row,) * self.replicas, REASON_RECOVERED, None, slowdown)
        self._calm = 0
        # Re-target only when the straggler's slowdown moved by more than the threshold (no churn).
        wanted = self._target_rows(held.replica, times_s[held.replica] / held.pace)
        if abs(slowdown - held.slowdown) <= self.policy.threshold or wanted == tuple(self.rows):
            self._streak = 0
            return None
        self._streak += 1
        if self._streak < self.policy.patience_steps:
            return None
        self._held = _Held(held.replica, held.pace, slowdown)
        return self._decide(step, wanted, REASON_STRAGGLER, held.replica, slowdown)

    def _note(self, slowdown: float, slowest: int) -> float:
        self.slowdown = slowdown
        self.straggler = slowest if slowdown > self.policy.threshold else None
        return slowdown

    def _decide(self, step: int, rows: tuple[int, ...], reason: str, straggler: int | None,
                slowdown: float) -> Decision:
        self.rows, self._streak, self._calm, self._candidate = list(rows), 0, 0, None
        return Decision(step, rows, reason, straggler, slowdown)

    def _target_rows(self, straggler: int, budget_s: float) -> tuple[int, ...]:
        """The straggler keeps the base row; the others the least-energy row predicted within
        `budget_s` (the straggler's time in the others' predicted terms) and the objective's bound."""
        limit_s = budget_s if self.max_time_s is None else min(budget_s, self.max_time_s)
        fitting = [i for i, (t, _) in enumerate(self.points) if t <= limit_s * (1 + 1e-12)]
        row = min(fitting, key=lambda i: (self.points[i][1], self.points[i][0])) if fitting else self.base_row
        if self.points[row][1] >= self.points[self.base_row][1]:
            row = self.base_row  # nothing cheaper fits: stay
        return tuple(self.base_row if r == straggler else row for r in range(self.replicas))


# ---------------------------------------------------------------------------------------------
# The twin's what-if


@dataclass(frozen=True)
class StepCost:
    """One simulated iteration of the whole job: time (slowest replica) and energy (all GPUs)."""

    time_s: float
    energy_j: float
    rows: tuple[int, ...]


@dataclass(frozen=True)
class StragglerRun:
    """The same steps without and with re-selection."""

    job: str
    replicas: int
    straggler: int
    slowdown: float
    clock_ceiling_mhz: float
    without: tuple[StepCost, ...]
    with_reselection: tuple[StepCost, ...]
    decisions: tuple[Decision, ...]

    def to_dict(self) -> dict[str, Any]:
        def summary(costs: Sequence[StepCost]) -> dict[str, Any]:
            n = len(costs)
            return {"time_s": sum(c.time_s for c in costs) / n, "energy_j": sum(c.energy_j for c in costs) / n,
                    "total_time_s": sum(c.time_s for c in costs), "total_energy_j": sum(c.energy_j for c in costs),
                    "steps": n, "final_rows": list(costs[-1].rows)}

        without, with_ = summary(self.without), summary(self.with_reselection)
        with_["switches"] = [{"step": d.step, "reason": d.reason, "rows": list(d.rows), "straggler": d.straggler,
                              "slowdown": d.slowdown} for d in self.decisions]
        return {"job": self.job, "replicas": self.replicas, "straggler_replica": self.straggler,
                "slowdown": self.slowdown, "clock_ceiling_mhz": self.clock_ceiling_mhz,
                "without": without, "with": with_,
                "time_change": with_["time_s"] / without["time_s"] - 1.0,
                "energy_saving": 1.0 - with_["energy_j"] / without["energy_j"]}


def simulate_straggler(plan: Plan, *, slowdown: float, straggler: int = 1, steps: int = 20,
                       slow_steps: tuple[int, int] | None = None,
                       policy: StragglerPolicy = StragglerPolicy()) -> StragglerRun:
    """`steps` iterations of `plan`'s job with replica `straggler` on a GPU `slowdown` slower (for
    steps in `slow_steps` = [first, end), default all), without and with re-selection."""
    from kareus.sim import Simulator, get_gpu
    from kareus.sim.replica import ceiling_for_slowdown, replica_iteration

    job = plan.job
    if job.data < 2:
        raise KareusError(f"job {job.name or '(unnamed)'} has spec.parallelism.data {job.data}: a straggler needs "
                          "at least 2 data-parallel replicas")
    if not 0 <= straggler < job.data:
        raise KareusError(f"--replica must be in 0..{job.data - 1}, got {straggler}")
    if steps < 1:
        raise KareusError(f"--steps must be >= 1, got {steps}")
    simulator, workload = Simulator(get_gpu(job.gpu)), job.workload()
    per_replica_gpus = job.tensor * job.context
    base = plan.selected_row
    memo: dict[tuple[int, float | None], Any] = {}

    def iteration(row: int, ceiling: float | None = None):
        if (row, ceiling) not in memo:
            memo[(row, ceiling)] = replica_iteration(simulator, workload, _stages(plan, row),
                                                     clock_ceiling_mhz=ceiling)
        return memo[(row, ceiling)]

    ceiling = ceiling_for_slowdown(lambda c: iteration(base, c).time_s, simulator.gpu, slowdown)
    first, end = slow_steps or (0, steps)

    def step_cost(step: int, rows: Sequence[int]) -> StepCost:
        slow = first <= step < end
        runs = [iteration(row, ceiling if slow and r == straggler else None) for r, row in enumerate(rows)]
        time_s = max(run.time_s for run in runs)
        return StepCost(time_s, sum(run.energy_j(per_replica_gpus, time_s) for run in runs), tuple(rows))

    without = tuple(step_cost(k, [base] * job.data) for k in range(steps))
    watch = StragglerWatch(plan.frontier.points(), base, job.data, policy, objective_max_time_s(plan))
    costs, decisions = [], []
    for k in range(steps):
        cost = step_cost(k, watch.rows)
        costs.append(cost)
        slow = first <= k < end
        times = [iteration(row, ceiling if slow and r == straggler else None).time_s for r, row in enumerate(watch.rows)]
        if (decision := watch.observe(k, times)) is not None:
            decisions.append(decision)
    return StragglerRun(job.name, job.data, straggler, slowdown, ceiling, without, tuple(costs), tuple(decisions))


def _stages(plan: Plan, row: int) -> list[tuple]:
    return [stage.instructions for stage in plan.frontier.stages_for(row)]
