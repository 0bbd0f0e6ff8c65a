"""A namespace's energy ledger: what its jobs spent, per budget period, kept after the jobs are gone.

A namespace's budget (`policy.namespaceEnergyBudgets`) is a number of kilowatt-hours per period:
`lifetime` (never resets; a plain number in the policy), or a calendar `month`, ISO `week`
(Monday 00:00) or `day`, all aligned in UTC. The ledger keeps, per namespace:

- one *meter* per live job: the last energy counter the job reported (joules, monotonic within a
  run; a counter that goes down is a new run of the job, as a Prometheus counter reset is);
- the joules spent in the current period and over the ledger's life, which only grow;
- the last `HISTORY_PERIODS` closed periods.

`record` charges a job's new counter to the period it is read in (the operator reads it each time a
job publishes progress, so a period boundary is placed within one publish interval). `forget` drops
the meters of jobs that no longer exist: their energy stays in the totals. `remaining_kwh` is what a
new job may still be promised, net of what admitted, unfinished jobs are predicted to spend.

Pure: no clocks are read here (callers pass `now`), nothing is stored; the operator persists the
`to_status` form (the KareusEnergyLedger resource's status).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from kareus.errors import KareusError

PERIODS = ("lifetime", "month", "week", "day")
HISTORY_PERIODS = 12
MAX_METERS = 4096  # live jobs per namespace the ledger tracks; bounded so the object stays small
JOULES_PER_KWH = 3.6e6


class LedgerError(KareusError):
    """A stored ledger that cannot be read (names the field)."""


def period_bounds(period: str, at: datetime) -> tuple[datetime | None, datetime | None]:
    """The UTC period containing `at`: (start, end), both None for `lifetime`."""
    at = at.astimezone(UTC)
    midnight = at.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "lifetime":
        return None, None
    if period == "day":
        return midnight, midnight + timedelta(days=1)
    if period == "week":
        start = midnight - timedelta(days=midnight.weekday())
        return start, start + timedelta(days=7)
    if period == "month":
        start = midnight.replace(day=1)
        end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
        return start, end
    raise LedgerError(f"period: must be one of {', '.join(PERIODS)}, got {period!r}")


@dataclass(frozen=True)
class ClosedPeriod:
    start: datetime
    end: datetime
    energy_j: float


@dataclass(frozen=True)
class NamespaceLedger:
    """One namespace's ledger (see the module docstring)."""

    namespace: str
    period: str = "lifetime"
    period_start: datetime | None = None
    period_end: datetime | None = None
    period_energy_j: float = 0.0
    lifetime_energy_j: float = 0.0
    meters_j: Mapping[str, float] = field(default_factory=dict)  # job UID → last counter read
    job_names: Mapping[str, str] = field(default_factory=dict)  # job UID → name, for people
    history: tuple[ClosedPeriod, ...] = ()

    @property
    def period_energy_kwh(self) -> float:
        return self.period_energy_j / JOULES_PER_KWH

    def at(self, now: datetime, period: str | None = None) -> NamespaceLedger:
        """The ledger as of `now` under `period` (default: its own): a period that ended is closed
        into the history and a new one starts at zero. A changed period starts one at once."""
        period = period or self.period
        start, end = period_bounds(period, now)
        if period == self.period and start == self.period_start:
            return self
        history = self.history
        if self.period_start is not None and self.period_end is not None:
            history = (*history, ClosedPeriod(self.period_start, self.period_end, self.period_energy_j))
        return replace(self, period=period, period_start=start, period_end=end, period_energy_j=0.0,
                       history=history[-HISTORY_PERIODS:])

    def record(self, job_uid: str, job_name: str, counter_j: float, now: datetime) -> NamespaceLedger:
        """Charge the energy a job's counter gained since it was last read to the period of `now`."""
        if not counter_j >= 0:  # also refuses NaN
            raise LedgerError(f"energy of job {job_name}: must be joules ≥ 0, got {counter_j!r}")
        ledger = self.at(now)
        last_j = ledger.meters_j.get(job_uid)
        spent_j = counter_j if last_j is None or counter_j < last_j else counter_j - last_j
        if last_j is None and len(ledger.meters_j) >= MAX_METERS:
            raise LedgerError(f"namespace {self.namespace}: more than {MAX_METERS} live jobs to meter")
        return replace(ledger, period_energy_j=ledger.period_energy_j + spent_j,
                       lifetime_energy_j=ledger.lifetime_energy_j + spent_j,
                       meters_j={**ledger.meters_j, job_uid: counter_j},
                       job_names={**ledger.job_names, job_uid: job_name})

    def forget(self, live_uids: Iterable[str]) -> NamespaceLedger:
        """Drop the meters of jobs not in `live_uids` (deleted): what they spent stays counted."""
        live = set(live_uids)
        if set(self.meters_j) <= live:
            return self
        return replace(self, meters_j={u: j for u, j in self.meters_j.items() if u in live},
                       job_names={u: n for u, n in self.job_names.items() if u in live})

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "namespace": self.namespace, "period": self.period,
            "usedJoules": round(self.period_energy_j, 3), "usedKilowattHours": round(self.period_energy_kwh, 6),
            "lifetimeJoules": round(self.lifetime_energy_j, 3),
            "jobs": [{"uid": uid, "name": self.job_names.get(uid, ""), "joules": round(j, 3)}
                     for uid, j in sorted(self.meters_j.items())],
            "history": [{"start": rfc3339(c.start), "end": rfc3339(c.end), "joules": round(c.energy_j, 3)}
                        for c in self.history],
        }
        if self.period_start is not None and self.period_end is not None:
            out |= {"periodStart": rfc3339(self.period_start), "periodEnd": rfc3339(self.period_end)}
        return out

    @classmethod
    def from_status(cls, namespace: str, status: Mapping[str, Any] | None) -> NamespaceLedger:
        """The ledger a stored status holds; an empty one for None. A damaged field is a LedgerError
        naming it (the operator then refuses to overwrite the store rather than lose it)."""
        if not status:
            return cls(namespace)
        where = f"KareusEnergyLedger {namespace}: status"
        period = status.get("period", "lifetime")
        if period not in PERIODS:
            raise LedgerError(f"{where}.period: must be one of {', '.join(PERIODS)}, got {period!r}")
        jobs = status.get("jobs") or []
        if not isinstance(jobs, list):
            raise LedgerError(f"{where}.jobs: must be a list")
        meters, names = {}, {}
        for i, job in enumerate(jobs):
            if not isinstance(job, Mapping) or not isinstance(job.get("uid"), str):
                raise LedgerError(f"{where}.jobs[{i}]: must be {{uid, name, joules}}")
            meters[job["uid"]] = _joules(job.get("joules"), f"{where}.jobs[{i}].joules")
            names[job["uid"]] = str(job.get("name") or "")
        history = []
        for i, closed in enumerate(status.get("history") or []):
            if not isinstance(closed, Mapping):
                raise LedgerError(f"{where}.history[{i}]: must be {{start, end, joules}}")
            history.append(ClosedPeriod(_time(closed.get("start"), f"{where}.history[{i}].start"),
                                        _time(closed.get("end"), f"{where}.history[{i}].end"),
                                        _joules(closed.get("joules"), f"{where}.history[{i}].joules")))
        start = status.get("periodStart")
        return cls(
            namespace=namespace, period=period,
            period_start=None if start is None else _time(start, f"{where}.periodStart"),
            period_end=None if start is None else _time(status.get("periodEnd"), f"{where}.periodEnd"),
            period_energy_j=_joules(status.get("usedJoules", 0.0), f"{where}.usedJoules"),
            lifetime_energy_j=_joules(status.get("lifetimeJoules", 0.0), f"{where}.lifetimeJoules"),
            meters_j=meters, job_names=names, history=tuple(history[-HISTORY_PERIODS:]))


@dataclass(frozen=True)
class BudgetStanding:
    """A namespace's budget against its ledger: what is used, promised and left in this period."""

    namespace: str
    budget_kwh: float
    period: str
    used_kwh: float
    reserved_kwh: float
    period_end: datetime | None

    @property
    def remaining_kwh(self) -> float:
        return self.budget_kwh - self.used_kwh - self.reserved_kwh

    def fits(self, needed_kwh: float) -> bool:
        """Whether a job needing `needed_kwh` fits now (an exhausted budget fits nothing, not even a
        job without a prediction)."""
        return self.remaining_kwh > 0 and needed_kwh <= self.remaining_kwh

    def ever_fits(self, needed_kwh: float) -> bool:
        """Whether the job could fit once promises to other jobs free up (or, for a periodic
        budget, in a fresh period): False means waiting can never admit it."""
        if self.period == "lifetime":
            left_kwh = self.budget_kwh - self.used_kwh
            return left_kwh > 0 and needed_kwh <= left_kwh
        return needed_kwh <= self.budget_kwh

    def text(self) -> str:
        """`namespace 'a' has used 1.2 of its 5 kWh monthly budget (…); the period ends …`."""
        label = {"lifetime": "lifetime", "month": "monthly", "week": "weekly", "day": "daily"}[self.period]
        reserved = f", {self.reserved_kwh:.4g} kWh promised to admitted jobs" if self.reserved_kwh > 0 else ""
        end = "" if self.period_end is None else f"; the period ends {rfc3339(self.period_end)}"
        return (f"namespace {self.namespace!r} has used {self.used_kwh:.4g} kWh of its {self.budget_kwh:.4g} kWh "
                f"{label} energy budget{reserved}{end}")


def standing(ledger: NamespaceLedger, budget_kwh: float, period: str, now: datetime,
             reserved_kwh: float = 0.0) -> BudgetStanding:
    """The budget's standing at `now` (the ledger rolled into the current period first)."""
    current = ledger.at(now, period)
    return BudgetStanding(ledger.namespace, budget_kwh, period, current.period_energy_kwh, max(0.0, reserved_kwh),
                          current.period_end)


def rfc3339(at: datetime) -> str:
    """`2027-01-01T00:00:00Z`: the UTC second, as Kubernetes writes times."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _time(value: Any, where: str) -> datetime:
    try:
        at = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        raise LedgerError(f"{where}: must be an RFC 3339 time, got {value!r}") from None
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)


def _joules(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise LedgerError(f"{where}: must be joules ≥ 0, got {value!r}")
    return float(value)
