"""KareusJob conditions and the phase derived from them (DESIGN.md §4 conventions).

Conditions are keyed by `type` and carry status, a stable CamelCase reason, a message,
`lastTransitionTime` and `observedGeneration`. The rules Kubernetes controllers follow, and this
module enforces: `lastTransitionTime` moves only when `status` flips (a new reason or message on the
same status keeps the time); the whole list is computed and written at once (a merge patch replaces
lists); and `phase` is never stored independently — it is derived from the conditions, so the two
cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The order in which conditions are listed in status (stable output, easy to read).
CONDITION_ORDER = ("Suspended", "Profiled", "Planned", "Training", "Complete", "Failed",
                   "BudgetExceeded", "ClockControlDegraded")
PHASES = ("Pending", "Profiling", "Optimizing", "Training", "Suspended", "Succeeded", "Failed")


@dataclass(frozen=True)
class Condition:
    """One condition as the API stores it."""

    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str = ""
    last_transition_time: str = ""
    observed_generation: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "status": self.status, "reason": self.reason, "message": self.message,
                "lastTransitionTime": self.last_transition_time, "observedGeneration": self.observed_generation}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Condition:
        return cls(str(data["type"]), str(data.get("status", "Unknown")), str(data.get("reason", "")),
                   str(data.get("message", "")), str(data.get("lastTransitionTime", "")),
                   int(data.get("observedGeneration", 0) or 0))


@dataclass(frozen=True)
class Want:
    """What a reconcile wants a condition to say (time and generation are filled in by `merge`)."""

    type: str
    status: bool
    reason: str
    message: str = ""


def merge(current: Iterable[Mapping[str, Any]], wanted: Sequence[Want], *, now: str,
          generation: int) -> list[dict[str, Any]]:
    """The new full condition list: `wanted` applied over `current`, in CONDITION_ORDER."""
    by_type = {c.type: c for c in map(Condition.from_dict, current)}
    for want in wanted:
        status = "True" if want.status else "False"
        old = by_type.get(want.type)
        flipped = old is None or old.status != status
        by_type[want.type] = Condition(want.type, status, want.reason, want.message,
                                       now if flipped else old.last_transition_time, generation)
    order = {name: i for i, name in enumerate(CONDITION_ORDER)}
    ordered = sorted(by_type.values(), key=lambda c: (order.get(c.type, len(order)), c.type))
    return [c.to_dict() for c in ordered]


def is_true(conditions: Iterable[Mapping[str, Any]], type_: str) -> bool:
    return any(c.get("type") == type_ and c.get("status") == "True" for c in conditions)


def find(conditions: Iterable[Mapping[str, Any]], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def phase_of(conditions: Sequence[Mapping[str, Any]]) -> str:
    """The phase a user reads, derived only from conditions (terminal states first)."""
    if is_true(conditions, "Failed"):
        return "Failed"
    if is_true(conditions, "Complete"):
        return "Succeeded"
    if is_true(conditions, "Suspended"):
        return "Suspended"
    if is_true(conditions, "Planned"):
        return "Training"
    if is_true(conditions, "Profiled"):
        return "Optimizing"
    training = find(conditions, "Profiled")
    if training is not None and training.get("reason") in ("Profiling", "Retrying"):
        return "Profiling"
    return "Pending"
