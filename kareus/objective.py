"""Objectives: which point of a time–energy frontier the user wants (DESIGN.md §2.6).

A frontier is a list of plans, each with an iteration time and an iteration energy (summed over
all GPUs, static energy included). The objective turns that list into one choice:

- `maxThroughput` — the fastest plan (ties: the one using less energy);
- `timeBudget` — the least-energy plan whose iteration time fits the budget. The budget is
  absolute per iteration (`iterationSeconds`), a deadline for the whole job spread over its
  remaining steps (`deadline`), or a slowdown over the fastest plan (`maxSlowdownPercent`);
- `energyBudget` — the fastest plan whose iteration energy fits the budget, per iteration
  (`perIterationJoules`) or for the whole job (`totalKilowattHours` over its steps).

An unmeetable budget is the user's to fix, so it raises a `KareusError` that names the closest
feasible plan instead of silently picking something else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from kareus.errors import KareusError

JOULES_PER_KWH = 3.6e6

KINDS = ("maxThroughput", "timeBudget", "energyBudget")
TIME_FIELDS = ("maxSlowdownPercent", "iterationSeconds", "deadline")
ENERGY_FIELDS = ("perIterationJoules", "totalKilowattHours")


@dataclass(frozen=True)
class Objective:
    """One objective in the `KareusJob` manifest's form; exactly one budget field is set."""

    kind: str = "maxThroughput"
    max_slowdown_percent: float | None = None
    iteration_time_s: float | None = None
    deadline: datetime | None = None
    per_iteration_energy_j: float | None = None
    total_energy_kwh: float | None = None

    def to_dict(self) -> dict:
        """The manifest form, e.g. `{"timeBudget": {"maxSlowdownPercent": 5.0}}`."""
        if self.kind == "maxThroughput":
            return {"maxThroughput": {}}
        fields = {
            "maxSlowdownPercent": self.max_slowdown_percent,
            "iterationSeconds": self.iteration_time_s,
            "deadline": _format_time(self.deadline) if self.deadline else None,
            "perIterationJoules": self.per_iteration_energy_j,
            "totalKilowattHours": self.total_energy_kwh,
        }
        return {self.kind: {k: v for k, v in fields.items() if v is not None}}

    def describe(self) -> str:
        """A short human phrase, e.g. `time budget: at most 5% slower than the fastest plan`."""
        if self.kind == "maxThroughput":
            return "max throughput"
        if self.max_slowdown_percent is not None:
            return f"time budget: at most {self.max_slowdown_percent:g}% slower than the fastest plan"
        if self.iteration_time_s is not None:
            return f"time budget: {self.iteration_time_s:g} s per iteration"
        if self.deadline is not None:
            return f"time budget: finish by {_format_time(self.deadline)}"
        if self.per_iteration_energy_j is not None:
            return f"energy budget: {self.per_iteration_energy_j:g} J per iteration"
        return f"energy budget: {self.total_energy_kwh:g} kWh for the job"


def parse_objective(value: object, path: str = "objective") -> Objective:
    """An `Objective` from the manifest form, an `Objective`, or a spec object with `to_dict()`.

    Errors name the field path and what is allowed.
    """
    if isinstance(value, Objective):
        return value
    if value is None:
        return Objective()
    if isinstance(value, str) and value in KINDS:
        return _from_mapping({value: {}}, path)
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        raise KareusError(f"{path}: must be a mapping with exactly one of {', '.join(KINDS)}")
    return _from_mapping(value, path)


def _from_mapping(value: Mapping, path: str) -> Objective:
    present = [k for k in KINDS if value.get(k) is not None]
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        raise KareusError(f"{path}.{unknown[0]}: unknown objective; allowed: {', '.join(KINDS)}")
    if len(present) != 1:
        raise KareusError(f"{path}: must set exactly one of {', '.join(KINDS)}, got {len(present)}")
    kind = present[0]
    body = value[kind]
    if not isinstance(body, Mapping):
        raise KareusError(f"{path}.{kind}: must be a mapping")
    if kind == "maxThroughput":
        if body:
            raise KareusError(f"{path}.maxThroughput: takes no fields, got {', '.join(sorted(body))}")
        return Objective()
    allowed = TIME_FIELDS if kind == "timeBudget" else ENERGY_FIELDS
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise KareusError(f"{path}.{kind}.{unknown[0]}: unknown field; allowed: {', '.join(allowed)}")
    given = [k for k in allowed if body.get(k) is not None]
    if len(given) != 1:
        raise KareusError(f"{path}.{kind}: must set exactly one of {', '.join(allowed)}")
    name = given[0]
    field_path = f"{path}.{kind}.{name}"
    if name == "deadline":
        return Objective(kind=kind, deadline=_parse_time(body[name], field_path))
    number = _positive(body[name], field_path, allow_zero=name == "maxSlowdownPercent")
    keyword = {
        "maxSlowdownPercent": "max_slowdown_percent",
        "iterationSeconds": "iteration_time_s",
        "perIterationJoules": "per_iteration_energy_j",
        "totalKilowattHours": "total_energy_kwh",
    }[name]
    return Objective(kind=kind, **{keyword: number})


def _positive(value: object, path: str, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise KareusError(f"{path}: must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise KareusError(f"{path}: must be {bound}, got {value!r}")
    return float(value)


def _parse_time(value: object, path: str) -> datetime:
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise KareusError(f"{path}: must be an RFC 3339 time such as 2027-01-01T00:00:00Z, "
                              f"got {value!r}") from None
    else:
        raise KareusError(f"{path}: must be an RFC 3339 time string, got {value!r}")
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _format_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Budget:
    """The objective as bounds on one iteration: at most `max_time_s` or at most `max_energy_j`."""

    max_time_s: float | None = None
    max_energy_j: float | None = None


def iteration_budget(objective: Objective, points: Sequence[tuple[float, float]], *,
                     steps: int | None = None, now: datetime | None = None) -> Budget:
    """The per-iteration bound the objective sets on this frontier (none for max throughput).

    Whole-job budgets (a deadline, kWh) are spread evenly over the `steps` still to run.
    """
    if objective.kind == "maxThroughput":
        return Budget()
    if objective.max_slowdown_percent is not None:
        fastest_s = min(t for t, _ in points)
        return Budget(max_time_s=fastest_s * (1.0 + objective.max_slowdown_percent / 100.0))
    if objective.iteration_time_s is not None:
        return Budget(max_time_s=objective.iteration_time_s)
    if objective.per_iteration_energy_j is not None:
        return Budget(max_energy_j=objective.per_iteration_energy_j)
    steps = _require_steps(objective, steps)
    if objective.deadline is not None:
        remaining_s = (objective.deadline - (now or datetime.now(UTC))).total_seconds()
        if remaining_s <= 0:
            raise KareusError(f"objective.timeBudget.deadline: {_format_time(objective.deadline)} "
                              "has already passed")
        return Budget(max_time_s=remaining_s / steps)
    return Budget(max_energy_j=objective.total_energy_kwh * JOULES_PER_KWH / steps)


def _require_steps(objective: Objective, steps: int | None) -> int:
    if steps is None or steps < 1:
        raise KareusError(f"{objective.describe()} needs spec.training.steps >= 1 to be spread "
                          "over iterations")
    return steps


def select_point(points: Sequence[tuple[float, float]], objective: object, *,
                 steps: int | None = None, now: datetime | None = None) -> int:
    """The index of the `(time_s, energy_j)` point the objective picks.

    Raises `KareusError` naming the closest feasible plan when the budget cannot be met.
    """
    if not points:
        raise KareusError("the frontier is empty: nothing to choose from")
    objective = parse_objective(objective)
    budget = iteration_budget(objective, points, steps=steps, now=now)
    indices = range(len(points))
    if budget.max_time_s is not None:
        feasible = [i for i in indices if points[i][0] <= budget.max_time_s * (1 + 1e-12)]
        if not feasible:
            best = min(indices, key=lambda i: points[i])
            raise KareusError(
                f"no plan meets the {objective.describe()} (at most {budget.max_time_s:.4g} s per "
                f"iteration); the closest feasible plan is the fastest one: "
                f"{_point_text(points[best])}")
        return min(feasible, key=lambda i: (points[i][1], points[i][0]))
    if budget.max_energy_j is not None:
        feasible = [i for i in indices if points[i][1] <= budget.max_energy_j * (1 + 1e-12)]
        if not feasible:
            best = min(indices, key=lambda i: (points[i][1], points[i][0]))
            raise KareusError(
                f"no plan meets the {objective.describe()} (at most {budget.max_energy_j:.4g} J per "
                f"iteration); the closest feasible plan is the least-energy one: "
                f"{_point_text(points[best])}")
        return min(feasible, key=lambda i: points[i])
    return min(indices, key=lambda i: points[i])


def _point_text(point: tuple[float, float]) -> str:
    return f"{point[0]:.4g} s and {point[1]:.4g} J per iteration"
