"""The Kueue AdmissionCheck controller `kareus.dev/energy-budget`: the queue is where a job waits for budget.

A platform team that runs Kueue attaches an AdmissionCheck whose `spec.controllerName` is
`kareus.dev/energy-budget` (the chart ships one) to its ClusterQueues. Kueue then reserves quota
for a Workload (one per phase Job the operator creates) and waits for this controller's verdict on
it before admitting it. A pass (every `interval_s`, leader only):

1. marks each of our AdmissionChecks `Active` (Kueue treats a check no controller claims as
   inactive, and a ClusterQueue with an inactive check admits nothing);
2. for each watched Workload with quota reserved and our check `Pending`, finds its KareusJob
   (owner Job → `kareus.dev/job-name`) and judges it:
   - the job's predicted energy for its remaining steps (its plan's J/iteration × steps left; before
     a plan exists, what its own `totalKilowattHours` budget still allows, else nothing) must fit
     what its namespace has left in the period: budget − used (the ledger) − what the namespace's
     other admitted, unfinished jobs are predicted to spend;
   - a training Workload's job must not be held by the cluster power budget.
   `Ready` when both hold; `Retry` when waiting can help (another job finishing frees its promise,
   a new period starts, the power allocator admits it): Kueue evicts the Workload and queues it again
   after `requeueAfterSeconds`; `Rejected` when it cannot (the job needs more than a whole period's
   budget, or more than a lifetime budget has left): Kueue deactivates the Workload, and the job's
   reconcile fails the KareusJob with the check's message. A Workload that is not a KareusJob's is `Ready`:
   no Kareus budget applies to it.

The verdict is written with server-side apply as field manager `kareus-energy-budget`, owning only
this check's entry of `status.admissionChecks` (a list map keyed by name). Without Kueue (no
`admissionchecks` resource), the pass finds nothing to do and the operator's own policy check
enforces budgets, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kareus.energy_ledger import JOULES_PER_KWH, BudgetStanding, rfc3339
from kareus.spec import SpecError, parse_job
from kareus_operator.kube import ApiError, Kube, path
from kareus_operator.settings import LABEL_JOB, LABEL_QUEUE, LABEL_ROLE

if TYPE_CHECKING:
    from kareus_operator.energy_ledgers import EnergyLedgers
    from kareus_operator.power import PowerAllocator

log = logging.getLogger(__name__)
CONTROLLER_NAME = "kareus.dev/energy-budget"
KUEUE_API = "kueue.x-k8s.io/v1beta2"
KAREUS_API = "kareus.dev/v1alpha1"
FIELD_MANAGER = "kareus-energy-budget"
RETRY_AFTER_S = 15  # when a promise may free at any time (another job finishing or deleted)
QUEUE_CACHE_S = 10.0  # how long a LocalQueue → checks lookup is trusted
ATTACH_EVERY_S = 60.0  # how often the check is re-applied to its ClusterQueues (a queue re-created)
FINISHED = ("Succeeded", "Failed")
# Kueue's Evicted reason for a Workload it deactivated because a check rejected it, and where our
# rejection's message outlives Kueue's reset of the check to Pending.
DEACTIVATED_BY_CHECK = "DeactivatedDueToAdmissionCheck"
REJECTION_ANNOTATION = "kareus.dev/admission-rejection"


@dataclass(frozen=True)
class Verdict:
    state: str  # Ready, Retry or Rejected
    message: str
    requeue_after_s: int | None = None


# ---------------------------------------------------------------------- pure parts


def remaining_kwh(job: Mapping[str, Any]) -> float:
    """What the job is predicted to spend on its remaining steps: the plan's J/iteration × the steps
    left; without a plan, what its own total-energy budget still allows; otherwise 0 (unknown)."""
    spec, status = job.get("spec") or {}, job.get("status") or {}
    steps = int(((spec.get("training") or {}).get("steps")) or 0)
    measured = status.get("measured") or {}
    done = min(steps, int(measured.get("iterations") or 0))
    per_iteration_j = float((status.get("plan") or {}).get("predictedIterationJoules") or 0.0)
    if per_iteration_j > 0:
        return per_iteration_j * (steps - done) / JOULES_PER_KWH
    total_kwh = ((spec.get("objective") or {}).get("energyBudget") or {}).get("totalKilowattHours")
    if total_kwh:
        return max(0.0, float(total_kwh) - float(measured.get("energyJoules") or 0.0) / JOULES_PER_KWH)
    return 0.0


def promised(job: Mapping[str, Any]) -> bool:
    """Whether an admitted job holds a promise on its namespace's budget: it has started training, is
    not finished and is not suspended (a suspended job is judged again when it resumes)."""
    status = job.get("status") or {}
    return (bool(status.get("trainingStartTime")) and status.get("phase") not in FINISHED
            and not status.get("suspendedSince"))


def reserved_kwh(jobs: Iterable[Mapping[str, Any]], except_uid: str) -> float:
    return sum(remaining_kwh(j) for j in jobs if j["metadata"]["uid"] != except_uid and promised(j))


def judge(budget: BudgetStanding | None, needed_kwh: float, power_held: str | None, now: datetime) -> Verdict:
    """The verdict on one Workload of a KareusJob (see the module docstring)."""
    if budget is not None:
        need = f"needs {needed_kwh:.4g} kWh for its remaining steps" if needed_kwh > 0 else "has no energy prediction yet"
        if not budget.fits(needed_kwh):
            text = f"the job {need}, {max(0.0, budget.remaining_kwh):.4g} kWh left: {budget.text()}"
            if not budget.ever_fits(needed_kwh):
                return Verdict("Rejected", f"{text}; waiting cannot make it fit")
            return Verdict("Retry", text, _retry_after_s(budget, needed_kwh, now))
    if power_held is not None:
        return Verdict("Retry", f"held by the cluster power budget: {power_held}", RETRY_AFTER_S)
    if budget is None:
        return Verdict("Ready", "no energy budget applies to this namespace; the power budget admits it")
    return Verdict("Ready", f"fits: the job needs {needed_kwh:.4g} of the {budget.remaining_kwh:.4g} kWh left "
                            f"({budget.text()})")


def _retry_after_s(budget: BudgetStanding, needed_kwh: float, now: datetime) -> int:
    """Soon when another job's promise may free what is missing; at the period's end when only a new
    period can."""
    without_promises_kwh = budget.budget_kwh - budget.used_kwh
    if budget.period_end is not None and (needed_kwh > without_promises_kwh or without_promises_kwh <= 0):
        return max(RETRY_AFTER_S, int((budget.period_end - now).total_seconds()) + 1)
    return RETRY_AFTER_S


def our_checks(admission_checks: Iterable[Mapping[str, Any]]) -> list[str]:
    return sorted(c["metadata"]["name"] for c in admission_checks
                  if (c.get("spec") or {}).get("controllerName") == CONTROLLER_NAME)


def pending_checks(workload: Mapping[str, Any], checks: Sequence[str]) -> list[str]:
    """Our checks the Workload waits on: quota reserved and the check's state Pending."""
    status = workload.get("status") or {}
    reserved = any(c.get("type") == "QuotaReserved" and c.get("status") == "True" for c in status.get("conditions") or [])
    if not reserved:
        return []
    return [s["name"] for s in status.get("admissionChecks") or [] if s.get("name") in checks and s.get("state") == "Pending"]


def rejection(workload: Mapping[str, Any]) -> str | None:
    """Why an admission check rejected the Workload, if one did. Kueue deactivates a rejected
    Workload and resets the check to Pending, dropping its message; ours is kept in an annotation."""
    status = workload.get("status") or {}
    for state in status.get("admissionChecks") or []:
        if state.get("state") == "Rejected":
            return f"AdmissionCheck {state.get('name')}: {state.get('message') or 'rejected'}"
    evicted = next((c for c in status.get("conditions") or [] if c.get("type") == "Evicted"
                    and c.get("status") == "True" and c.get("reason") == DEACTIVATED_BY_CHECK), None)
    if evicted is None:
        return None
    kept = ((workload.get("metadata") or {}).get("annotations") or {}).get(REJECTION_ANNOTATION)
    return kept or str(evicted.get("message") or "rejected by an admission check")


def clusterqueue_checks(clusterqueue: Mapping[str, Any]) -> list[str]:
    strategy = ((clusterqueue.get("spec") or {}).get("admissionChecksStrategy") or {}).get("admissionChecks") or []
    return [rule["name"] for rule in strategy if isinstance(rule, Mapping) and rule.get("name")]


# ---------------------------------------------------------------------- the controller


class EnergyAdmissionCheck:
    """Passes over the watched Workloads (see the module docstring)."""

    def __init__(self, kube: Kube, ledgers: EnergyLedgers, power: PowerAllocator | None,
                 namespaces: Sequence[str] = (), interval_s: float = 2.0, *,
                 check_name: str = "kareus-energy-budget", attach_to: Sequence[str] = ()) -> None:
        self.kube, self.ledgers, self.power = kube, ledgers, power
        self.namespaces, self.interval_s = tuple(namespaces), interval_s
        self.check_name, self.attach_to = check_name, tuple(attach_to)
        self._attached_at = -ATTACH_EVERY_S
        self._wake = asyncio.Event()
        self._queues: dict[tuple[str, str], tuple[float, bool]] = {}

    def request(self) -> None:
        self._wake.set()

    async def run_forever(self) -> None:
        while True:
            try:
                await self.run_pass()
            except Exception:  # a pass outlives whatever one Workload or API error throws
                log.exception("energy-budget admission check pass failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)

    async def _listed_checks(self) -> list[dict[str, Any]]:
        """Every AdmissionCheck; none without Kueue (or without the right to read them)."""
        try:
            return await self.kube.list(path(KUEUE_API, "admissionchecks"))
        except ApiError as error:
            if error.code in (403, 404):
                return []
            raise

    async def checks(self) -> list[str]:
        """Our AdmissionChecks' names."""
        return our_checks(await self._listed_checks())

    async def run_pass(self) -> int:
        """One pass; returns the number of verdicts written."""
        listed = await self._listed_checks()
        checks = our_checks(listed)
        if not checks:
            return 0
        await self._mark_active([c for c in listed if c["metadata"]["name"] in checks])
        if self.check_name in checks and time.monotonic() - self._attached_at >= ATTACH_EVERY_S:
            await self.attach()
        written = 0
        for namespace in self.namespaces or (None,):
            jobs: dict[str, list[dict[str, Any]]] = {}  # each namespace's KareusJobs, listed once a pass
            for workload in await self.kube.list(path(KUEUE_API, "workloads", namespace)):
                waiting = pending_checks(workload, checks)
                if waiting:
                    verdict = await self.verdict(workload, jobs)
                    for name in waiting:
                        await self._write(workload, name, verdict)
                        written += 1
        return written

    async def attach(self) -> None:
        """Add our check to each ClusterQueue of `attach_to`, owning only that list entry (server-side
        apply, field manager `kareus-energy-budget`): the queue's other checks stay its owners'."""
        for name in self.attach_to:
            body = {"apiVersion": KUEUE_API, "kind": "ClusterQueue", "metadata": {"name": name},
                    "spec": {"admissionChecksStrategy": {"admissionChecks": [{"name": self.check_name}]}}}
            try:
                await self.kube.request("PATCH", path(KUEUE_API, "clusterqueues", None, name), body,
                                        params={"fieldManager": FIELD_MANAGER, "force": "true"},
                                        content_type="application/apply-patch+yaml")
            except ApiError as error:
                if error.code != 404:
                    raise
                log.warning("ClusterQueue %s does not exist: the energy-budget check is not attached to it", name)
        self._attached_at = time.monotonic()

    async def _mark_active(self, checks: Sequence[Mapping[str, Any]]) -> None:
        for check in checks:
            conditions = (check.get("status") or {}).get("conditions") or []
            if any(c.get("type") == "Active" and c.get("status") == "True" for c in conditions):
                continue
            await self.kube.merge_patch(path(KUEUE_API, "admissionchecks", None, check["metadata"]["name"], "status"), {
                "status": {"conditions": [{
                    "type": "Active", "status": "True", "reason": "Active", "lastTransitionTime": rfc3339(datetime.now(UTC)),
                    "message": "the Kareus operator judges namespace energy and cluster power budgets",
                    "observedGeneration": check["metadata"].get("generation", 1)}]}})

    async def verdict(self, workload: Mapping[str, Any],
                      jobs: dict[str, list[dict[str, Any]]] | None = None) -> Verdict:
        """The verdict on one Workload; `jobs` caches each namespace's KareusJobs for a pass."""
        namespace = workload["metadata"]["namespace"]
        owner = next((o for o in workload["metadata"].get("ownerReferences") or []
                      if o.get("kind") == "Job" and str(o.get("apiVersion", "")).startswith("batch/")), None)
        child = None if owner is None else await self.kube.get(path("batch/v1", "jobs", namespace, owner["name"]))
        labels = ((child or {}).get("metadata") or {}).get("labels") or {}
        job_name = labels.get(LABEL_JOB)
        job = None if not job_name else await self.kube.get(path(KAREUS_API, "kareusjobs", namespace, job_name))
        if job is None or not any(o.get("uid") == job["metadata"]["uid"] for o in child["metadata"].get("ownerReferences") or []):
            return Verdict("Ready", "not a KareusJob's Workload: no Kareus budget applies")
        jobs = {} if jobs is None else jobs
        if namespace not in jobs:
            jobs[namespace] = await self.kube.list(path(KAREUS_API, "kareusjobs", namespace))
        budget = await self.ledgers.standing(namespace, reserved_kwh(jobs[namespace], job["metadata"]["uid"]))
        return judge(budget, remaining_kwh(job), await self._power_held(job, labels.get(LABEL_ROLE)), self.ledgers.clock())

    async def _power_held(self, job: Mapping[str, Any], role: str | None) -> str | None:
        if self.power is None or role != "train":
            return None
        try:
            spec = parse_job(job)
        except SpecError:
            return None  # the job's own reconcile reports it
        got = await self.power.allotment_for(job, dict(job.get("status") or {}), spec)
        if got is None or not got[0].held:
            return None
        return got[0].reason or "no power left for it"

    async def _write(self, workload: Mapping[str, Any], check: str, verdict: Verdict) -> None:
        meta = workload["metadata"]
        state: dict[str, Any] = {"name": check, "state": verdict.state, "message": verdict.message[:32768],
                                 "lastTransitionTime": rfc3339(datetime.now(UTC))}
        if verdict.requeue_after_s is not None and verdict.state == "Retry":
            state["requeueAfterSeconds"] = verdict.requeue_after_s
        body = {"apiVersion": KUEUE_API, "kind": "Workload", "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                "status": {"admissionChecks": [state]}}
        try:
            if verdict.state == "Rejected":  # first: Kueue deactivates the Workload as soon as it sees the state
                await self.kube.merge_patch(path(KUEUE_API, "workloads", meta["namespace"], meta["name"]), {
                    "metadata": {"annotations": {REJECTION_ANNOTATION: f"AdmissionCheck {check}: {verdict.message}"[:4096]}}})
            await self.kube.request("PATCH", path(KUEUE_API, "workloads", meta["namespace"], meta["name"], "status"), body,
                                    params={"fieldManager": FIELD_MANAGER, "force": "true"},
                                    content_type="application/apply-patch+yaml")
        except ApiError as error:
            if error.code != 404:  # gone meanwhile: nothing to judge
                raise
        log.info("workload %s/%s: %s %s: %s", meta["namespace"], meta["name"], check, verdict.state, verdict.message)

    async def queue_checks_energy(self, namespace: str, job: Mapping[str, Any]) -> bool:
        """Whether the job's LocalQueue feeds a ClusterQueue that runs our check (then the queue, not
        the operator's policy check, holds the job for its namespace's energy budget)."""
        queue = (job["metadata"].get("labels") or {}).get(LABEL_QUEUE)
        if not queue:
            return False
        key = (namespace, queue)
        cached = self._queues.get(key)
        if cached is not None and time.monotonic() - cached[0] < QUEUE_CACHE_S:
            return cached[1]
        checked = False
        try:
            local = await self.kube.get(path(KUEUE_API, "localqueues", namespace, queue))
            cq_name = ((local or {}).get("spec") or {}).get("clusterQueue")
            if cq_name:
                cq = await self.kube.get(path(KUEUE_API, "clusterqueues", None, cq_name))
                checked = bool(set(clusterqueue_checks(cq or {})) & set(await self.checks()))
        except ApiError as error:
            if error.code not in (403, 404):
                raise
        self._queues[key] = (time.monotonic(), checked)
        return checked

