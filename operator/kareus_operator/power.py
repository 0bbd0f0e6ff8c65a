"""The cluster power budget in the operator: one frontier point per running KareusJob, within budget.

One `PowerAllocator` per operator process (it runs where the reconciler runs: in the leader only).
An allocation **pass** lists the KareusJobs the operator watches, takes every job that is planned,
not finished and not suspended, reads its plan ConfigMap (the frontier; parsed plans are cached by
the ConfigMap's resourceVersion) and calls `kareus.power_budget.allocate` with the policy's
`powerBudget`, the jobs in admission order (creation time). A job is *running* once its training
has started (`status.trainingStartTime`); the others are new and may be held.

Passes run when a job enters or leaves Planned/Training, is suspended or resumed, finishes, is
deleted or changes its objective (the controller compares each status it writes with the old one,
`signature`), when the policy's budget changes (checked every `POLICY_CHECK_S`: the operator may
`get` its policy ConfigMap, not list it), on every resync, and on demand from a job's reconcile
when that job is not in the latest allocation or its objective changed since.

The allocation is *applied* by each job's own reconcile (`apply`, called from `Reconciler._train`),
so the job's status has one writer and one write path — the reconciler's Outcome, merged into the
status subresource by the controller — and a pass can never race a reconcile's status write. A
pass only remembers allotments and wakes the jobs whose allotment differs from what their status
says. `apply` rolls a new frontier row and per-GPU power limit out through the plan ConfigMap (as a
re-selection does: the runtime switches at its next step boundary and asks its node agent for the
limit), writes `status.power`, the `PowerAllotted` condition and an Event when the allotment
changes, and tells the reconciler not to create the training Job of a held job.

A job's points are its plan's frontier rows and the power-limited points its plan carries
(`Plan.power_limited_points`, computed by `kareus optimize` on the simulated GPU), so below the
frontiers' low ends the allocation gives some jobs a row under a power limit instead of being
infeasible.

Between a pass that admits a new job and the write of that job's status, the pass keeps the job's
in-flight status (`_pending`), so a second pass in that window still counts it.

Each pass also hands the allotted rows to the clock-ceiling publisher (`clock_ceilings`), which
puts every training pod's ceiling where the node agents enforce it; a training pod appearing or
going (`pod_event`) requests a pass for that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kareus.errors import KareusError
from kareus.plan import Plan, Prediction, plan_at_row
from kareus.policy import ClusterPolicy, PowerBudget
from kareus.power_budget import Allocation, Allotment, PowerJob, PowerPoint, allocate
from kareus.spec import JobSpec, SpecError, parse_job
from kareus_operator import conditions as cond
from kareus_operator import manifests as mf
from kareus_operator.clock_ceilings import CeilingJob, CeilingPublisher
from kareus_operator.kube import ApiError, Kube, path
from kareus_operator.settings import ANNOTATION_PLAN_REVISION

if TYPE_CHECKING:
    from kareus_operator.metrics import OperatorMetrics

log = logging.getLogger(__name__)
CONDITION = "PowerAllotted"
# The condition's reason → the Event posted when a job's allotment changes.
EVENT_REASON = {"Allotted": "PowerAllotted", "PowerBudgetExceeded": "PowerBudgetExceeded", "Held": "PowerHeld"}
POLICY_CHECK_S = 10.0  # how often the budget in the policy ConfigMap is compared with the last pass's
Key = tuple[str, str]  # (namespace, name)


# ---------------------------------------------------------------------- pure parts


def job_key(job: Mapping[str, Any]) -> Key:
    return job["metadata"]["namespace"], job["metadata"]["name"]


def eligible(job: Mapping[str, Any]) -> bool:
    """Whether a KareusJob takes part in the allocation: planned, not finished, not suspended."""
    if job["metadata"].get("deletionTimestamp"):
        return False
    conditions = (job.get("status") or {}).get("conditions") or []
    return (cond.is_true(conditions, "Planned") and not cond.is_true(conditions, "Complete")
            and not cond.is_true(conditions, "Failed") and not cond.is_true(conditions, "Suspended"))


def running(job: Mapping[str, Any]) -> bool:
    """Training has started (the allocator never holds a running job)."""
    return bool((job.get("status") or {}).get("trainingStartTime"))


def signature(status: Mapping[str, Any] | None) -> tuple:
    """What in a job's status an allocation depends on: when it changes, a pass is due."""
    status = status or {}
    conditions = status.get("conditions") or []
    return (status.get("phase"), status.get("objective"), bool(status.get("trainingStartTime")),
            *(cond.is_true(conditions, c) for c in ("Planned", "Suspended", "Complete", "Failed")))


def node_pool(spec: JobSpec, label: str) -> str:
    """The node pool the job's training pods are pinned to (their nodeSelector on `label`), or ""."""
    for override in spec.pod_overrides:
        if "train" in override.roles and label in override.node_selector:
            return override.node_selector[label]
    return ""


def power_job(job: Mapping[str, Any], spec: JobSpec, plan: Plan, budget: PowerBudget) -> PowerJob:
    """The allocator's view of one KareusJob (named `namespace/name`): its frontier rows and its
    plan's power-limited points. The objective's bounds come from the frontier alone (a limited
    point is slower than its row, so "fastest" stays the frontier's)."""
    status = job.get("status") or {}
    done = int((status.get("measured") or {}).get("iterations") or 0)
    namespace, name = job_key(job)
    product = status.get("gpuProduct") if not spec.gpu_pinned and status.get("gpuProduct") else spec.gpu_product
    base = PowerJob.from_plan(f"{namespace}/{name}", plan, objective=spec.objective.to_dict(),
                              steps=max(1, spec.training.steps - done), gpu_product=product,
                              node_pool=node_pool(spec, budget.node_pool_label), running=running(job))
    limited = tuple(PowerPoint(p.row, p.time_s, p.energy_j, power_limit_w=p.power_limit_w)
                    for p in plan.power_limited_points)
    return replace(base, points=base.points + limited) if limited else base


def admission_order(jobs: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Oldest first (the allocator admits new jobs in this order)."""
    return sorted(jobs, key=lambda j: (j["metadata"].get("creationTimestamp") or "", *job_key(j)))


def budget_of(allocation: Allocation, name: str) -> tuple[str, float, float] | None:
    """The tightest budget covering job `name`: (key, limit, predicted use), or None."""
    covering = [b for b in allocation.budgets if name in b.jobs]
    if not covering:
        return None
    tightest = min(covering, key=lambda b: (b.limit_w - b.used_w, len(b.jobs)))
    return tightest.key, tightest.limit_w, tightest.used_w


def power_status(allotment: Allotment, allocation: Allocation) -> dict[str, Any]:
    """`status.power` of one job."""
    out: dict[str, Any] = {
        "allottedWatts": round(allotment.power_w, 3), "frontierRow": allotment.row, "held": allotment.held,
        "meetsObjective": allotment.meets_objective, "feasible": allocation.feasible,
        "normalisedThroughput": round(allotment.normalised_throughput, 6), "message": allotment.reason}
    if allotment.time_s is not None:
        out["predictedIterationSeconds"] = allotment.time_s
    if allotment.power_limit_w is not None:
        out["powerLimitWatts"] = round(allotment.power_limit_w, 3)
    budget = budget_of(allocation, allotment.name)
    if budget is not None:
        out["budget"], out["budgetWatts"], out["budgetPredictedWatts"] = budget[0], budget[1], round(budget[2], 3)
    if not allocation.feasible and allocation.message:
        out["message"] = allocation.message
    return {k: v for k, v in out.items() if v is not None}  # a held job has no row


def condition_of(power: Mapping[str, Any]) -> tuple[bool, str, str]:
    """The PowerAllotted condition (status, reason, message) a `status.power` means."""
    budget = (f"; {power['budget']} budget: {power['budgetPredictedWatts']:.0f} W of {power['budgetWatts']:.0f} W "
              "predicted" if "budget" in power else "")
    if power["held"]:
        return False, "Held", f"held, not started: the power budget cannot fit it{budget}. {power['message']}".strip()
    limit = f" under a {power['powerLimitWatts']:.0f} W per-GPU power limit" if "powerLimitWatts" in power else ""
    text = f"{power['allottedWatts']:.0f} W at frontier row {power['frontierRow']}{limit}{budget}"
    if not power["feasible"]:
        return True, "PowerBudgetExceeded", f"{text}; {power['message']}"
    return True, "Allotted", text


def same_allotment(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Two `status.power` values that need no new Event or rollout (row, power limit, held, feasible,
    watts)."""
    def core(p: Mapping[str, Any] | None) -> tuple | None:
        return None if p is None else (p.get("frontierRow"), p.get("powerLimitWatts"), p.get("held"),
                                       p.get("feasible"), round(float(p.get("allottedWatts") or 0.0), 1))
    return core(a) == core(b)


# ---------------------------------------------------------------------- the allocator


@dataclass(frozen=True)
class _Entry:
    allotment: Allotment
    objective: str  # the objective the allotment was computed for (a change makes it stale)


class PowerAllocator:
    """Allocation passes over the watched KareusJobs; `apply` puts a job's allotment into effect."""

    def __init__(self, kube: Kube, policy: Callable[[], Awaitable[ClusterPolicy]],
                 metrics: OperatorMetrics | None = None, namespaces: Sequence[str] = (),
                 ceilings: CeilingPublisher | None = None) -> None:
        self.kube, self._policy, self.metrics = kube, policy, metrics
        self.namespaces = tuple(namespaces)
        self.ceilings = ceilings
        self._ceiling_jobs: dict[str, CeilingJob] = {}  # job uid → its allotted row, for the pod ceilings
        self._warned_advisory = False
        self.allocation: Allocation | None = None
        self.on_change: Callable[[Key], None] | None = None  # the controller's reconcile spawner
        self._entries: dict[Key, _Entry] = {}
        self._budget: PowerBudget | None = None
        self._plans: dict[Key, tuple[str, Plan]] = {}  # plan ConfigMap → (resourceVersion, plan)
        self._pending: dict[Key, tuple[str, dict[str, Any]]] = {}  # key → (job's resourceVersion, live status)
        self._lock = asyncio.Lock()
        self._wanted = asyncio.Event()

    # -------------------------------------------------------------- triggers

    def request(self) -> None:
        """A pass is due (run by `run_forever` soon, collapsed with other requests)."""
        self._wanted.set()

    def pod_event(self, event: Mapping[str, Any]) -> None:
        """A watched pod changed: a pass is due when that changes which pods have ceilings."""
        if self.ceilings is not None and self.ceilings.pod_event_matters(event):
            self.request()

    async def run_forever(self) -> None:
        """Requested passes, and a pass whenever the policy's budget changes."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wanted.wait(), timeout=POLICY_CHECK_S)
            try:
                budget = (await self._policy()).power_budget
                if self._wanted.is_set() or budget != self._budget or (self.ceilings and self.ceilings.stale):
                    self._wanted.clear()
                    await self.run_pass()
            except (ApiError, OSError, TimeoutError, KareusError) as error:
                log.warning("power allocation pass failed, retrying: %r", error)
                await asyncio.sleep(2.0)
            except Exception:  # never let the loop die; the next trigger retries
                log.exception("power allocation pass failed")
                await asyncio.sleep(2.0)

    # -------------------------------------------------------------- the pass

    async def run_pass(self, current: Mapping[str, Any] | None = None,
                       status: dict[str, Any] | None = None) -> Allocation | None:
        """One allocation over every watched job; `current` (with its in-flight `status`) is the job
        whose reconcile asked, counted as that pass will write it. Wakes the jobs whose allotment
        differs from their status."""
        async with self._lock:
            budget = (await self._policy()).power_budget
            if current is not None and status is not None:
                self._pending[job_key(current)] = (str(current["metadata"].get("resourceVersion", "")), status)
            listed = await self._list()
            changed = self._allocate_jobs(listed, budget, await self._plans_of(listed, budget))
            await self._publish_ceilings(budget)
        for key in changed:
            if self.on_change is not None and (current is None or key != job_key(current)):
                self.on_change(key)
        return self.allocation

    async def _list(self) -> list[dict[str, Any]]:
        jobs: list[dict[str, Any]] = []
        for namespace in self.namespaces or (None,):
            jobs += await self.kube.list(path(mf.API_VERSION, "kareusjobs", namespace))
        out = []
        for job in jobs:
            pending = self._pending.get(job_key(job))
            if pending is not None and pending[0] == str(job["metadata"].get("resourceVersion", "")):
                job = {**job, "status": pending[1]}  # its status write has not landed yet
            else:
                self._pending.pop(job_key(job), None)
            out.append(job)
        return out

    async def _plans_of(self, jobs: Sequence[Mapping[str, Any]], budget: PowerBudget) -> dict[Key, Plan]:
        if not budget.enabled:
            return {}
        plans = {}
        for job in jobs:
            if eligible(job):
                plan = await self.plan_of(job_key(job), uid=job["metadata"]["uid"])
                if plan is not None:
                    plans[job_key(job)] = plan
        return plans

    async def plan_of(self, key: Key, cm: Mapping[str, Any] | None = None, *, uid: str | None = None) -> Plan | None:
        """The job's plan from its ConfigMap (parsed once per resourceVersion); None without one, or
        when `uid` is given and the ConfigMap is not the one the operator made for that job."""
        from kareus_operator.reconcile import plan_text, trusted_configmap

        namespace, name = key
        cm = cm or await self.kube.get(path("v1", "configmaps", namespace, mf.plan_configmap_name(name)))
        if cm is None:
            return None
        if uid is not None and not trusted_configmap(cm, uid):
            log.warning("%s/%s: plan ConfigMap %s is not this job's (owner or job-uid label); not allocated",
                        namespace, name, cm["metadata"].get("name"))
            return None
        version = str(cm["metadata"].get("resourceVersion", ""))
        cached = self._plans.get(key)
        if cached is not None and cached[0] == version:
            return cached[1]
        try:
            plan = Plan.loads(plan_text(cm) or "", source=f"ConfigMap {cm['metadata']['name']}")
        except (KareusError, ValueError, KeyError, TypeError) as error:  # validated: selected_row is a frontier row
            log.info("%s/%s: no usable frontier in its plan, not in the power allocation: %s", namespace, name, error)
            return None
        self._plans[key] = (version, plan)
        return plan

    def _allocate_jobs(self, jobs: Sequence[Mapping[str, Any]], budget: PowerBudget,
                       plans: Mapping[Key, Plan]) -> list[Key]:
        """Allocate (pure given the listed jobs and plans); returns the jobs to wake."""
        from kareus_operator.reconcile import _manifest, objective_text

        old = self._entries
        self._budget = budget
        if not budget.enabled:
            self.allocation, self._entries, self._ceiling_jobs = None, {}, {}
            self._observe(None, budget)
            return [job_key(j) for j in jobs if (j.get("status") or {}).get("power") is not None or job_key(j) in old]
        members, objectives, specs = [], {}, {}
        for job in admission_order([j for j in jobs if eligible(j) and job_key(j) in plans]):
            try:
                spec = parse_job(_manifest(job)).spec
                members.append(power_job(job, spec, plans[job_key(job)], budget))
            except (SpecError, KareusError) as error:
                log.info("%s/%s: not in the power allocation: %s", *job_key(job), error)
                continue
            objectives[job_key(job)], specs[job_key(job)] = objective_text(spec), (job["metadata"]["uid"], spec)
        allocation = allocate(members, budget)
        self.allocation = allocation
        keys = {f"{ns}/{name}": (ns, name) for ns, name in objectives}
        self._entries = {keys[a.name]: _Entry(a, objectives[keys[a.name]]) for a in allocation.allotments}
        self._ceiling_jobs = {}
        for key, entry in self._entries.items():
            if entry.allotment.row is not None:
                uid, spec = specs[key]
                self._ceiling_jobs[uid] = CeilingJob(key[0], uid, plans[key], entry.allotment.row,
                                                     spec.training.gpus_per_node, spec.training.nodes)
        self._observe(allocation, budget)
        wake = []
        by_key = {job_key(j): j for j in jobs}
        for key, entry in self._entries.items():
            written = ((by_key.get(key) or {}).get("status") or {}).get("power")
            if not same_allotment(written, power_status(entry.allotment, allocation)):
                wake.append(key)
        wake += [key for key in old if key not in self._entries and key in by_key]
        return wake

    async def _publish_ceilings(self, budget: PowerBudget) -> None:
        if self.ceilings is None:
            return
        if budget.enabled and not self.ceilings.enabled and not self._warned_advisory:
            self._warned_advisory = True
            log.warning("a power budget is set but no clock-ceiling ConfigMap (KAREUS_OPERATOR_CLOCK_CEILINGS_NAMESPACE): "
                        "the node agents do not enforce it")
        await self.ceilings.publish(self._ceiling_jobs, self.namespaces)

    def _observe(self, allocation: Allocation | None, budget: PowerBudget) -> None:
        if self.metrics is not None:
            self.metrics.observe_power_budget(budget, allocation)

    # -------------------------------------------------------------- applying one job's allotment

    async def allotment_for(self, job: Mapping[str, Any], status: dict[str, Any], spec: JobSpec
                            ) -> tuple[Allotment, Allocation] | None:
        """This job's allotment, from a fresh pass when it is not in the latest one (new, or its
        objective changed); None when there is no budget or the job has no usable frontier."""
        from kareus_operator.reconcile import objective_text

        budget = (await self._policy()).power_budget
        if not budget.enabled:
            if self._budget is not None and self._budget.enabled:
                await self.run_pass()
            return None
        key = job_key(job)
        entry = self._entries.get(key)
        if entry is None or entry.objective != objective_text(spec) or budget != self._budget:
            await self.run_pass(job, status)
            entry = self._entries.get(key)
        if entry is None or self.allocation is None:
            return None
        return entry.allotment, self.allocation

    async def apply(self, p: Any, spec: JobSpec, *, started: bool) -> bool:
        """Put the job's allotment into effect in reconcile pass `p` (a `reconcile._Pass`): roll its
        frontier row out, write `status.power`, the condition and an Event. True: the job is held
        and its training Job must not be created (`started`: the training Job exists)."""
        # The status as this pass will write it (conditions live apart until the Outcome).
        got = await self.allotment_for(p.job, {**p.status, "conditions": p.conditions}, spec)
        old = p.status.get("power")
        if got is None:
            if old is not None:
                p.status.pop("power")
                p.want(CONDITION, False, "NoPowerBudget", "no power budget applies to this job")
                await self._roll_out(p, spec, None, None)  # a limit the budget set goes with it
            return False
        allotment, allocation = got
        power = power_status(allotment, allocation)
        if allotment.held and started:  # cannot happen (running jobs are never held); keep running
            return False
        if not allotment.held:
            pending = self._pending.get((p.ns, p.name))
            if pending is not None and not started:
                pending[1]["trainingStartTime"] = "starting"  # later passes count it as running
            await self._roll_out(p, spec, allotment.row, allotment.power_limit_w,
                                 Prediction(allotment.time_s, allotment.energy_j))
        # The status is merge-patched: a key the old allotment had and this one lacks (a power limit
        # gone, a held job's row) must be written as null or the server keeps it.
        p.status["power"] = {**{k: None for k in old or {} if k not in power}, **power}
        status, reason, message = condition_of(power)
        p.want(CONDITION, status, reason, message)
        if allotment.held:
            p.want("Training", False, "PowerBudgetHeld", message)
        if not same_allotment(old, power):
            p.events.append(("Normal" if reason == "Allotted" else "Warning", EVENT_REASON[reason], message))
        return allotment.held

    async def _roll_out(self, p: Any, spec: JobSpec, row: int | None, power_limit_w: float | None,
                        predicted: Prediction | None = None) -> None:
        """Frontier row `row` (None: the plan's own) under per-GPU `power_limit_w` (None: none) into
        the plan ConfigMap as one new plan revision, if either differs; `predicted` is the point's
        prediction (a limited point is slower than its row)."""
        from kareus_operator.reconcile import PlanSummary, next_plan_revision, plan_data

        cm_name = mf.plan_configmap_name(p.name)
        cm = await self.kube.get(path("v1", "configmaps", p.ns, cm_name))
        plan = await self.plan_of((p.ns, p.name), cm, uid=p.meta["uid"])
        if plan is None:
            return
        row = plan.selected_row if row is None else row
        if plan.selected_row == row and plan.power_limit_w == power_limit_w:
            return
        new = replace(plan_at_row(plan, row), power_limit_w=power_limit_w)
        if power_limit_w is not None and predicted is not None:
            new = replace(new, predicted=predicted)
        written = await self.kube.merge_patch(path("v1", "configmaps", p.ns, cm_name), {
            "metadata": {"annotations": {ANNOTATION_PLAN_REVISION: next_plan_revision(cm)}}, **plan_data(new.to_json())})
        if written is not None:
            self._plans[(p.ns, p.name)] = (str(written["metadata"].get("resourceVersion", "")), new)
        summary = PlanSummary.of(new)
        reselections = int((p.status.get("plan") or {}).get("reselections", 0))
        p.status["plan"] = summary.status(cm_name, reselections=reselections, steps=spec.training.steps)
        p.events.append(("Normal", "PlanReallocated",
                         f"power budget: {_point_text(plan.selected_row, plan.power_limit_w)} → "
                         f"{_point_text(row, power_limit_w)} ({summary.text()})"))


def _point_text(row: int, power_limit_w: float | None) -> str:
    limit = "" if power_limit_w is None else f" under a {power_limit_w:.0f} W per-GPU limit"
    return f"frontier row {row}{limit}"
