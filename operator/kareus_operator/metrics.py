"""The operator's Prometheus metrics: jobs per phase, time spent per phase, profile cache hits.

Per job (`observe_status`, labelled `namespace` and `kareusjob`), what the chart's alerts read and
no aggregate can say: the phase a job is in (`kareus_job_phase`, so "profiling for two hours" is one
job's state, not a count that other jobs keep up), each status condition (`kareus_job_condition`:
1 True, 0 False — ClockControlDegraded, BudgetExceeded, …) and the energy `status.measured` holds
(`kareus_job_measured_energy_joules`, summed per namespace against its policy budget, as the
operator's own admission check sums it). A training job's progress: `kareus_job_progress_ratio`,
`kareus_job_eta_seconds` and `kareus_job_projected_energy_joules` (the jobs dashboard's ETA and
energy still to spend, projected minus measured).

One `OperatorMetrics` object owns its own registry (no module-level collectors), so tests and a
restarted operator never share counters.

The cluster power budget: `kareus_power_budget_watts{scope,name}` (each budget of the policy),
`kareus_job_power_allotment_watts` and `kareus_job_measured_power_watts` per job (predicted power of
its allotted frontier point, measured average power; training jobs only) and
`kareus_power_budget_held_jobs`. Phase durations are measured from the moment this operator
process saw a job enter a phase; a restart starts the clock anew (a shorter, never a longer, sample).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kareus import metric_names
from kareus_operator.conditions import PHASES

_PHASE_BUCKETS_S = (1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)


class OperatorMetrics:
    """Tracks the last phase of every job by uid and exports the three operator metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.jobs = Gauge(metric_names.JOBS, "KareusJobs by phase", ["phase"], registry=self.registry)
        self.phase_seconds = Histogram(metric_names.PHASE_SECONDS, "Time a KareusJob spent in a phase",
                                       ["phase"], buckets=_PHASE_BUCKETS_S, registry=self.registry)
        self.cache_hits = Counter(metric_names.PROFILE_CACHE_HITS_TOTAL.removesuffix("_total"),
                                  "Profiles reused from the cache instead of measured", registry=self.registry)
        self._phase: dict[str, tuple[str, float]] = {}  # uid -> (phase, monotonic time entered)
        for phase in PHASES:
            self.jobs.labels(phase=phase).set(0)
            # Every phase's histogram exists from the start at zero, so the first job to leave a phase
            # is an increase rate()/increase() can see (a series born at 1 shows none).
            self.phase_seconds.labels(phase=phase)
        job_labels = ["namespace", "kareusjob"]
        self.job_phase = Gauge(metric_names.JOB_PHASE, "The phase a KareusJob is in (1)", [*job_labels, "phase"],
                               registry=self.registry)
        self.job_condition = Gauge(metric_names.JOB_CONDITION, "A KareusJob's status condition: 1 True, 0 False",
                                   [*job_labels, "condition"], registry=self.registry)
        self.job_energy = Gauge(metric_names.JOB_MEASURED_ENERGY_JOULES,
                                "GPU energy a KareusJob has measured so far (status.measured.energyJoules)",
                                job_labels, registry=self.registry)
        # Progress of a training job (status.measured): what the jobs dashboard shows as ETA and
        # energy still to spend; a finished job's series go.
        self.job_progress = Gauge(metric_names.JOB_PROGRESS_RATIO, "Share of a KareusJob's steps completed "
                                  "(status.measured.percentComplete / 100)", job_labels, registry=self.registry)
        self.job_eta = Gauge(metric_names.JOB_ETA_SECONDS, "Seconds of training a KareusJob has left at its measured "
                             "iteration time (status.measured.etaSeconds)", job_labels, registry=self.registry)
        self.job_projected_energy = Gauge(metric_names.JOB_PROJECTED_ENERGY_JOULES,
                                          "GPU energy of all of a KareusJob's steps at the measured rate "
                                          "(status.measured.projectedTotalJoules)", job_labels, registry=self.registry)
        self._progress_jobs: set[tuple[str, str]] = set()
        # The cluster power budget (kareus_operator.power): each budget, each job's allotment (the
        # predicted power of its frontier point; 0 while held) and measured power, the held jobs.
        self.power_budget = Gauge(metric_names.POWER_BUDGET_WATTS,
                                  "Power budget in watts, per scope (cluster, gpuProduct, nodePool)",
                                  ["scope", "name"], registry=self.registry)
        self.namespace_energy_used = Gauge(
            metric_names.NAMESPACE_ENERGY_USED_JOULES,
            "GPU energy a namespace's KareusJobs spent in the current budget period (its KareusEnergyLedger)",
            ["namespace", "period"], registry=self.registry)
        self.namespace_energy_budget = Gauge(metric_names.NAMESPACE_ENERGY_BUDGET_JOULES,
                                             "A namespace's energy budget per period (policy.namespaceEnergyBudgets)",
                                             ["namespace", "period"], registry=self.registry)
        self._ledger_labels: set[tuple[str, str]] = set()
        self.power_held = Gauge(metric_names.POWER_BUDGET_HELD_JOBS,
                                "KareusJobs held (not started) because the power budget cannot fit them",
                                registry=self.registry)
        self.job_power_allotment = Gauge(metric_names.JOB_POWER_ALLOTMENT_WATTS,
                                         "Predicted average power of a KareusJob's allotted frontier point "
                                         "(status.power.allottedWatts)", job_labels, registry=self.registry)
        self.job_measured_power = Gauge(metric_names.JOB_MEASURED_POWER_WATTS,
                                        "Measured average GPU power of a KareusJob "
                                        "(status.measured.averagePowerWatts)", job_labels, registry=self.registry)
        self._budget_scopes: set[tuple[str, str]] = set()
        self._power_jobs: set[tuple[str, str]] = set()  # labels with power series
        # uid -> (labels, the phase and the conditions exported for it), so a change or `forget`
        # removes exactly the series this job had.
        self._exported: dict[str, tuple[tuple[str, str], str, frozenset[str]]] = {}

    def observe(self, uid: str, phase: str) -> None:
        """Record the job's current phase; a change closes the previous phase's duration."""
        now = time.monotonic()
        previous = self._phase.get(uid)
        if previous is not None and previous[0] == phase:
            return
        if previous is not None:
            self.jobs.labels(phase=previous[0]).dec()
            self.phase_seconds.labels(phase=previous[0]).observe(now - previous[1])
        self.jobs.labels(phase=phase).inc()
        self._phase[uid] = (phase, now)

    def observe_status(self, job: Mapping[str, Any], status: Mapping[str, Any]) -> None:
        """Export one job's phase, conditions and measured energy from the status just written."""
        meta = job["metadata"]
        uid, labels = meta["uid"], (meta["namespace"], meta["name"])
        phase = str(status.get("phase") or "Pending")
        conditions = {str(c["type"]): c.get("status") == "True" for c in status.get("conditions") or []
                      if "type" in c}
        previous = self._exported.get(uid)
        if previous is not None:
            _, old_phase, old_conditions = previous
            if old_phase != phase:
                self.job_phase.remove(*labels, old_phase)
            for condition in old_conditions - set(conditions):
                self.job_condition.remove(*labels, condition)
        self.job_phase.labels(*labels, phase).set(1)
        for condition, true in conditions.items():
            self.job_condition.labels(*labels, condition).set(1 if true else 0)
        energy_j = (status.get("measured") or {}).get("energyJoules")
        self.job_energy.labels(*labels).set(float(energy_j or 0.0))
        self._observe_job_power(labels, phase, status)
        self._observe_progress(labels, phase, status.get("measured") or {})
        self._exported[uid] = (labels, phase, frozenset(conditions))

    def _observe_progress(self, labels: tuple[str, str], phase: str, measured: Mapping[str, Any]) -> None:
        """A training job's progress, ETA and projected energy; none for a job not training."""
        values = {self.job_progress: measured.get("percentComplete"), self.job_eta: measured.get("etaSeconds"),
                  self.job_projected_energy: measured.get("projectedTotalJoules")}
        if phase != "Training" or all(value is None for value in values.values()):
            self._forget_progress(labels)
            return
        for gauge, value in values.items():
            if value is not None:
                gauge.labels(*labels).set(float(value) / (100.0 if gauge is self.job_progress else 1.0))
        self._progress_jobs.add(labels)

    def _forget_progress(self, labels: tuple[str, str]) -> None:
        if labels in self._progress_jobs:
            self._progress_jobs.discard(labels)
            for gauge in (self.job_progress, self.job_eta, self.job_projected_energy):
                with contextlib.suppress(KeyError):
                    gauge.remove(*labels)

    def forget(self, uid: str) -> None:
        previous = self._phase.pop(uid, None)
        if previous is not None:
            self.jobs.labels(phase=previous[0]).dec()
        exported = self._exported.pop(uid, None)
        if exported is not None:  # a deleted job's series go with it (its energy leaves the namespace's sum)
            labels, phase, conditions = exported
            self.job_phase.remove(*labels, phase)
            for condition in conditions:
                self.job_condition.remove(*labels, condition)
            self.job_energy.remove(*labels)
            self._forget_job_power(labels)
            self._forget_progress(labels)

    def _observe_job_power(self, labels: tuple[str, str], phase: str, status: Mapping[str, Any]) -> None:
        """A training job's allotted and measured power; a finished job draws none (series removed)."""
        power = status.get("power")
        measured_w = (status.get("measured") or {}).get("averagePowerWatts")
        if phase in ("Succeeded", "Failed") or (power is None and measured_w is None):
            self._forget_job_power(labels)
            return
        if power is not None:
            self.job_power_allotment.labels(*labels).set(0.0 if power.get("held") else float(power.get("allottedWatts") or 0.0))
        if measured_w is not None and phase == "Training":
            self.job_measured_power.labels(*labels).set(float(measured_w))
        self._power_jobs.add(labels)

    def _forget_job_power(self, labels: tuple[str, str]) -> None:
        if labels in self._power_jobs:
            self._power_jobs.discard(labels)
            for gauge in (self.job_power_allotment, self.job_measured_power):
                with contextlib.suppress(KeyError):
                    gauge.remove(*labels)

    def observe_power_budget(self, budget: Any, allocation: Any) -> None:
        """The budgets (`kareus.policy.PowerBudget`) and the held jobs of the latest allocation."""
        scopes = set()
        if budget.cluster_w is not None:
            scopes.add(("cluster", "cluster", budget.cluster_w))
        scopes |= {("gpuProduct", name, watts) for name, watts in budget.gpu_products_w.items()}
        scopes |= {("nodePool", name, watts) for name, watts in budget.node_pools_w.items()}
        for scope, name, watts in scopes:
            self.power_budget.labels(scope, name).set(float(watts))
        current = {(scope, name) for scope, name, _ in scopes}
        for gone in self._budget_scopes - current:
            self.power_budget.remove(*gone)
        self._budget_scopes = current
        self.power_held.set(len(allocation.held) if allocation is not None else 0)

    def observe_ledger(self, ledger: Any, budget_kwh: float | None) -> None:
        """A namespace's ledger (`kareus.energy_ledger.NamespaceLedger`) as last written, and its budget."""
        for old in [k for k in self._ledger_labels if k[0] == ledger.namespace]:  # a changed period
            for gauge in (self.namespace_energy_used, self.namespace_energy_budget):
                with contextlib.suppress(KeyError):
                    gauge.remove(*old)
            self._ledger_labels.discard(old)
        labels = (ledger.namespace, ledger.period)
        self.namespace_energy_used.labels(*labels).set(ledger.period_energy_j)
        if budget_kwh is not None:
            self.namespace_energy_budget.labels(*labels).set(budget_kwh * 3.6e6)
        self._ledger_labels.add(labels)

    def profile_cache_hit(self) -> None:
        self.cache_hits.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
