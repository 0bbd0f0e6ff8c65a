"""The KareusJob phase machine: Pending → Profiling → Optimizing → Training → Succeeded/Failed.

Reconciliation is level-based: from the job as stored and its children as they exist, compute
the status the job should have and create what is missing. Nothing is remembered between calls
except what is in the API (status, children), so an operator killed at any point and restarted
resumes exactly where it was, and creating a child twice is a harmless 409.

- Profiled: a cached profile (ConfigMap labelled with the profile key) is reused when the job and
  the cluster policy allow it (reason CacheHit); otherwise the profiling pod measures (Measured).
- Planned: the optimizer pod writes the plan ConfigMap; `status.plan` summarises it.
- Training: a headless Service and one pod per node; rank 0 publishes progress, which becomes
  `status.measured`; `BudgetExceeded` warns when the energy budget will be overrun at the current
  rate. A changed `spec.objective` re-selects a plan from the stored frontier (no re-profiling) and
  the new plan reaches the running pods through the mounted ConfigMap (the kubelet refreshes the
  file; a runtime that watches it switches at its next step boundary, restarted ranks use it at once).
- Complete / Failed: terminal. A failed child is retried with exponential backoff (a timestamp in
  status, re-checked by the timer — never a sleep) up to `backoffLimit`, then the job fails with the
  reason. `activeDeadlineSeconds`, `ttlSecondsAfterFinished` and `suspend` are honoured at every step.
"""

from __future__ import annotations

import copy
import datetime
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kareus.errors import KareusError
from kareus.plan import Plan, reselect
from kareus.policy import ClusterPolicy, check_job, load_policy
from kareus.profiler.key import profile_key
from kareus.spec import JobSpec, SpecError, parse_job
from kareus_operator import conditions as cond
from kareus_operator import manifests as mf
from kareus_operator.conditions import Want
from kareus_operator.kube import ApiError, Kube, path
from kareus_operator.metrics import OperatorMetrics
from kareus_operator.publish import PROGRESS_KEY
from kareus_operator.refusals import CONDITION_OF_ROLE, ChildRefused, backoff_s, classify
from kareus_operator.settings import ANNOTATION_PLAN_REVISION, LABEL_ROLE, PLAN_FILE, PROFILE_FILE, Settings

_POLICY_TTL_S = 5.0
_FAILURE_REASONS = {"profile": "ProfilingFailed", "optimize": "OptimizationFailed", "train": "TrainingFailed"}


@dataclass
class Outcome:
    """What one reconcile decided: the new status, when to look again, events, whether to delete."""

    status: dict[str, Any]
    requeue_s: float | None = None
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    delete_job: bool = False


def iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()


def pod_phase(pod: Mapping[str, Any] | None) -> str | None:
    if pod is None or pod["metadata"].get("deletionTimestamp"):
        return None if pod is None else "Terminating"
    return (pod.get("status") or {}).get("phase") or "Pending"


def _finished_at(pod: Mapping[str, Any]) -> float | None:
    times = [parse_iso((s.get("state") or {}).get("terminated", {}).get("finishedAt"))
             for s in (pod.get("status") or {}).get("containerStatuses", []) or []]
    return max((t for t in times if t is not None), default=None)


def pod_failure(pod: Mapping[str, Any]) -> str:
    for status in (pod.get("status") or {}).get("containerStatuses", []) or []:
        terminated = (status.get("state") or {}).get("terminated")
        if terminated and terminated.get("exitCode"):
            return f"pod {pod['metadata']['name']} failed (container {status['name']} exit code {terminated['exitCode']})"
    return f"pod {pod['metadata']['name']} failed: {(pod.get('status') or {}).get('message', 'no reason given')}"


class _Pass:
    """The working state of one reconcile pass over one job."""

    def __init__(self, job: dict[str, Any], now: float) -> None:
        self.job, self.now = job, now
        self.meta = job["metadata"]
        self.status: dict[str, Any] = copy.deepcopy(job.get("status") or {})
        self.conditions: list[dict[str, Any]] = list(self.status.get("conditions") or [])
        self.wants: list[Want] = []
        self.events: list[tuple[str, str, str]] = []
        self.requeue_s: float | None = None
        self.delete_job = False

    @property
    def ns(self) -> str:
        return self.meta["namespace"]

    @property
    def name(self) -> str:
        return self.meta["name"]

    def want(self, type_: str, status: bool, reason: str, message: str = "") -> None:
        self.wants.append(Want(type_, status, reason, message))
        self.conditions = cond.merge(self.conditions, [self.wants[-1]], now=iso(self.now),
                                     generation=self.meta.get("generation", 1))

    def true(self, type_: str) -> bool:
        return cond.is_true(self.conditions, type_)

    def requeue(self, seconds: float) -> None:
        seconds = max(0.5, seconds)
        self.requeue_s = seconds if self.requeue_s is None else min(self.requeue_s, seconds)

    def outcome(self) -> Outcome:
        old_phase = (self.job.get("status") or {}).get("phase")
        self.status["conditions"] = self.conditions
        self.status["phase"] = cond.phase_of(self.conditions)
        self.status["observedGeneration"] = self.meta.get("generation", 1)
        if self.status["phase"] != old_phase:
            self.events.insert(0, ("Warning" if self.status["phase"] == "Failed" else "Normal",
                                   f"Phase{self.status['phase']}", self._phase_message()))
        return Outcome(self.status, self.requeue_s, self.events, self.delete_job)

    def _phase_message(self) -> str:
        latest = max(self.conditions, key=lambda c: c.get("lastTransitionTime", ""), default=None)
        return f"{latest['type']}={latest['status']} ({latest['reason']}): {latest['message']}" if latest else ""


class Reconciler:
    """Reconciles KareusJobs through a `Kube` client; one instance per operator process."""

    def __init__(self, kube: Kube, settings: Settings, metrics: OperatorMetrics) -> None:
        self.kube, self.settings, self.metrics = kube, settings, metrics
        self._policy: tuple[float, ClusterPolicy] | None = None
        self._refusals: dict[str, int] = {}  # job uid → refusals in a row (the backoff's exponent)

    # ------------------------------------------------------------------ entry

    async def reconcile(self, job: dict[str, Any], *, now: float | None = None) -> Outcome | None:
        """The new status for `job`, having created/deleted children as needed; None: not ours."""
        if job["metadata"].get("deletionTimestamp"):
            return None
        p = _Pass(job, time.time() if now is None else now)
        try:
            spec = parse_job(_manifest(job)).spec
        except SpecError as error:
            p.want("Failed", True, "InvalidSpec", str(error))
            return p.outcome()
        if not spec.managed_by_kareus:
            return None
        if p.true("Complete") or p.true("Failed"):
            self._expire(p, spec)
            return p.outcome()
        p.status.setdefault("startTime", iso(p.now))
        p.status.setdefault("restarts", 0)
        if await self._refused_by_policy(p, spec) or await self._past_deadline(p, spec):
            return p.outcome()
        if await self._suspended(p, spec):
            return p.outcome()
        try:
            await self._advance(p, spec)
        except ChildRefused as refused:
            self._report_refusal(p, refused)
            return p.outcome()
        except StaleChild as stale:
            p.want(stale.condition, False, "StaleChild", str(stale))
            p.requeue(2.0)
            return p.outcome()
        self._refusals.pop(job["metadata"]["uid"], None)
        return p.outcome()

    async def _advance(self, p: _Pass, spec: JobSpec) -> None:
        if not p.true("Planned"):
            await self._ensure_spec(p)  # the pods read it; training pods get it before they are created
        if not p.true("Profiled") and not await self._profile(p, spec):
            return
        if not p.true("Planned") and not await self._optimize(p, spec):
            return
        await self._train(p, spec)

    def _report_refusal(self, p: _Pass, refused: ChildRefused) -> None:
        """A False condition naming the cause, an Event with the server's words when it is new, and
        the next attempt after an exponential backoff (the cause may be fixed at any time)."""
        uid = p.meta["uid"]
        attempt = self._refusals.get(uid, 0) + 1
        self._refusals[uid] = attempt
        old = cond.find(p.conditions, refused.condition)
        message = refused.text()
        if old is None or (old.get("reason"), old.get("message")) != (refused.refusal.reason, message):
            p.events.append(("Warning", refused.refusal.reason, message))
        p.want(refused.condition, False, refused.refusal.reason, message)
        p.requeue(backoff_s(attempt))

    # ------------------------------------------------------------------ guards

    async def policy(self) -> ClusterPolicy:
        if self._policy is not None and time.monotonic() - self._policy[0] < _POLICY_TTL_S:
            return self._policy[1]
        s = self.settings
        cm = await self.kube.get(path("v1", "configmaps", s.policy_namespace, s.policy_configmap))
        text = ((cm or {}).get("data") or {}).get("policy.yaml")
        try:
            policy = load_policy(text)
        except KareusError:
            policy = ClusterPolicy()  # a broken policy must not stop every job; the chart validates it
        self._policy = (time.monotonic(), policy)
        return policy

    async def _refused_by_policy(self, p: _Pass, spec: JobSpec) -> bool:
        if p.true("Profiled"):
            return False  # admitted once; a later policy change does not kill running jobs
        policy = await self.policy()
        used_kwh = await self._namespace_used_kwh(p.ns) if policy.energy_budget_kwh(p.ns) is not None else 0.0
        violations = check_job(policy, p.ns, spec, namespace_used_kwh=used_kwh)
        if not violations:
            return False
        message = "; ".join(f"policy.{v.rule}: {v.message}" for v in violations)
        p.want("Failed", True, "PolicyViolation", message)
        return True

    async def _namespace_used_kwh(self, namespace: str) -> float:
        """Energy the namespace's KareusJobs have measured so far (for its policy budget)."""
        jobs = await self.kube.list(path(mf.API_VERSION, "kareusjobs", namespace))
        return sum(float(((j.get("status") or {}).get("measured") or {}).get("energyJoules") or 0.0)
                   for j in jobs) / 3.6e6

    async def _past_deadline(self, p: _Pass, spec: JobSpec) -> bool:
        if spec.active_deadline_seconds is None:
            return False
        started = parse_iso(p.status.get("startTime")) or p.now
        left_s = started + spec.active_deadline_seconds - p.now
        if left_s > 0:
            p.requeue(left_s)
            return False
        await self._stop_pods(p, spec)
        p.want("Failed", True, "DeadlineExceeded",
               f"the job ran longer than activeDeadlineSeconds={spec.active_deadline_seconds}")
        p.status["completionTime"] = iso(p.now)
        return True

    async def _suspended(self, p: _Pass, spec: JobSpec) -> bool:
        if not spec.suspend:
            if p.true("Suspended"):
                p.want("Suspended", False, "Resumed", "the job resumed from where it was suspended")
            return False
        await self._stop_pods(p, spec)
        if not p.true("Suspended"):
            p.want("Suspended", True, "Suspended", "spec.suspend is true: pods stopped")
            if p.true("Planned"):
                p.want("Training", False, "Suspended", "training pods stopped; training restarts on resume")
        return True

    def _expire(self, p: _Pass, spec: JobSpec) -> None:
        finished = parse_iso(p.status.get("completionTime"))
        if spec.ttl_seconds_after_finished is None or finished is None:
            return
        left_s = finished + spec.ttl_seconds_after_finished - p.now
        if left_s <= 0:
            p.delete_job = True
        else:
            p.requeue(left_s)

    # ------------------------------------------------------------------ phases

    async def _profile(self, p: _Pass, spec: JobSpec) -> bool:
        key = profile_key(spec)
        cm_name = mf.profile_configmap_name(key)
        p.status["profile"] = {"key": key, "configMap": cm_name}
        reuse = (await self.policy()).reuse_profiles(spec.profiling.reuse)
        cache = await self.kube.get(path("v1", "configmaps", p.ns, cm_name))
        cached = PROFILE_FILE in ((cache or {}).get("data") or {})
        pod_name = mf.profile_pod_name(p.name)
        pod = await self._child(p, "pods", pod_name, "profile")
        if cached and pod is None and reuse:
            self.metrics.profile_cache_hit()
            p.status["profile"]["cacheHit"] = True
            p.want("Profiled", True, "CacheHit", f"reused the cached profile {cm_name}")
            return True
        state = await self._run_pod(p, spec, "profile", pod, lambda: mf.profile_pod(p.job, spec, self.settings, key))
        if state == "Succeeded":
            if not cached:
                return self._fail(p, "ProfilingFailed", f"pod {pod_name} succeeded but published no profile")
            p.status["profile"]["cacheHit"] = False
            p.want("Profiled", True, "Measured", f"profiled by pod {pod_name}; stored in {cm_name}")
            return True
        if state == "Failed":
            return False
        p.want("Profiled", False, "Retrying" if state == "Retrying" else "Profiling",
               f"pod {pod_name} is {state.lower()}")
        return False

    async def _optimize(self, p: _Pass, spec: JobSpec) -> bool:
        cm_name = mf.plan_configmap_name(p.name)
        plan_cm = await self._child(p, "configmaps", cm_name, "optimize")
        text = ((plan_cm or {}).get("data") or {}).get(PLAN_FILE)
        pod_name = mf.optimize_pod_name(p.name)
        if text is None:
            pod = await self._child(p, "pods", pod_name, "optimize")
            key = p.status["profile"]["key"]
            state = await self._run_pod(p, spec, "optimize", pod, lambda: mf.optimize_pod(p.job, self.settings, key))
            if state == "Failed":
                return False
            if state != "Succeeded":
                p.want("Planned", False, "Optimizing", f"pod {pod_name} is {state.lower()}")
                return False
            return self._fail(p, "OptimizationFailed", f"pod {pod_name} succeeded but published no plan")
        try:
            summary = PlanSummary.from_json(text)
        except ValueError as error:
            return self._fail(p, "NoFeasiblePlan", f"ConfigMap {cm_name}: {error}")
        p.status["plan"] = summary.status(cm_name, reselections=0, steps=spec.training.steps)
        p.status["objective"] = objective_text(spec)
        p.want("Planned", True, "Optimized", f"plan {cm_name}: {summary.text()}")
        return True

    async def _train(self, p: _Pass, spec: JobSpec) -> None:
        await self._maybe_reselect(p, spec)
        names = [mf.train_pod_name(p.name, i) for i in range(spec.training.nodes)]
        pods = [await self._child(p, "pods", n, "train") for n in names]
        await self._measure(p, spec)
        phases = [pod_phase(pod) for pod in pods]
        p.status.setdefault("trainingStartTime", iso(p.now))
        p.status["workers"] = {"active": sum(ph in ("Pending", "Running") for ph in phases),
                               "succeeded": phases.count("Succeeded"), "failed": phases.count("Failed")}
        if all(ph == "Succeeded" for ph in phases):
            p.want("Training", False, "Completed", f"{len(names)} training pod(s) succeeded")
            p.want("Complete", True, "Completed", _measured_text(p.status.get("measured")))
            p.status["completionTime"] = iso(p.now)
            self._expire(p, spec)
            return
        failed = [pod for pod, ph in zip(pods, phases, strict=True) if ph == "Failed"]
        if failed:
            await self._retry_gang(p, spec, names, failed)
            return
        if any(ph == "Terminating" for ph in phases):
            p.requeue(1.0)
            return
        if any(pod is None for pod in pods):
            await self._ensure_spec(p)
            await self._ensure(mf.train_service(p.job))
        for index, pod in enumerate(pods):
            if pod is None:
                await self._ensure(mf.train_pod(p.job, spec, self.settings, index))
        running = sum(ph == "Running" for ph in phases)
        p.want("Training", True, "Running", f"{running}/{len(names)} training pod(s) running")

    async def _retry_gang(self, p: _Pass, spec: JobSpec, names: list[str], failed: list[dict[str, Any]]) -> None:
        """One failed rank fails the step for all: restart every training pod together (as JobSet does)."""
        p.status["lastFailure"] = pod_failure(failed[0])
        if await self._retry_after_backoff(p, spec, failed[0], names) or not p.true("Failed"):
            p.want("Training", False, "Retrying", f"{p.status['lastFailure']}; restarting all ranks")

    async def _maybe_reselect(self, p: _Pass, spec: JobSpec) -> None:
        """A new objective while training: a plan from the stored frontier, rolled out via the ConfigMap."""
        wanted = objective_text(spec)
        if p.status.get("objective") == wanted:
            return
        p.status["objective"] = wanted  # tried once per change, whatever the result
        cm_name = mf.plan_configmap_name(p.name)
        cm = await self._child(p, "configmaps", cm_name, "train")
        try:
            current = Plan.loads(((cm or {}).get("data") or {})[PLAN_FILE], source=f"ConfigMap {cm_name}")
            done = int(((p.status.get("measured") or {}).get("iterations")) or 0)
            plan = reselect(current, spec.objective, steps=max(1, spec.training.steps - done))
        except (KareusError, KeyError) as error:
            p.events.append(("Warning", "ReselectFailed", f"keeping the current plan: {error}"))
            return
        reselections = int((p.status.get("plan") or {}).get("reselections", 0)) + 1
        await self.kube.merge_patch(path("v1", "configmaps", p.ns, cm_name), {
            "metadata": {"annotations": {ANNOTATION_PLAN_REVISION: str(reselections + 1)}},
            "data": {PLAN_FILE: plan.to_json()}})
        summary = PlanSummary.of(plan)
        p.status["plan"] = summary.status(cm_name, reselections=reselections, steps=spec.training.steps)
        p.want("Planned", True, "Reselected", f"objective changed to {wanted}: {summary.text()}")
        p.events.append(("Normal", "PlanReselected", f"objective {wanted}: {summary.text()}"))

    async def _measure(self, p: _Pass, spec: JobSpec) -> None:
        cm = await self._child(p, "configmaps", mf.progress_configmap_name(p.name), "train")
        text = ((cm or {}).get("data") or {}).get(PROGRESS_KEY)
        if not text:
            return
        try:
            progress = json.loads(text)
            measured = {"iterations": int(progress["iterations"]), "energyJoules": float(progress["energyJoules"]),
                        "averageIterationSeconds": float(progress["averageIterationSeconds"])}
        except (ValueError, KeyError, TypeError):
            return
        if progress.get("clockControlDegraded"):
            p.want("ClockControlDegraded", True, "NodeAgentUnavailable",
                   f"training runs at default clocks: {progress['clockControlDegraded']}")
        if measured["iterations"]:
            per_iteration_j = measured["energyJoules"] / measured["iterations"]
            measured["averageIterationJoules"] = per_iteration_j
            measured["projectedTotalJoules"] = per_iteration_j * spec.training.steps
            if measured["averageIterationSeconds"] > 0:
                measured["averagePowerWatts"] = per_iteration_j / measured["averageIterationSeconds"]
        if measured != {k: v for k, v in (p.status.get("measured") or {}).items() if k != "lastUpdateTime"}:
            measured["lastUpdateTime"] = iso(p.now)
        else:
            measured["lastUpdateTime"] = p.status["measured"].get("lastUpdateTime", iso(p.now))
        p.status["measured"] = measured
        over = _budget_overrun(spec, measured)
        if over is not None:
            p.want("BudgetExceeded", True, "EnergyBudgetExceeded", over)
        elif cond.find(p.conditions, "BudgetExceeded") is not None:
            p.want("BudgetExceeded", False, "WithinBudget", "the projected energy is within the budget")

    # ------------------------------------------------------------------ children

    async def _run_pod(self, p: _Pass, spec: JobSpec, stage: str, pod: dict[str, Any] | None, build) -> str:
        """Drive one run-once pod; returns Succeeded, Failed (final), Retrying, Pending or Running."""
        phase = pod_phase(pod)
        if phase == "Failed":
            p.status["lastFailure"] = pod_failure(pod)
            if not await self._retry_after_backoff(p, spec, pod, [pod["metadata"]["name"]]):
                return "Failed" if p.true("Failed") else "Retrying"
            return "Retrying"
        if phase == "Terminating":
            p.requeue(1.0)
            return "Pending"
        if pod is None:
            await self._ensure(build())
            return "Pending"
        return phase

    async def _retry_after_backoff(self, p: _Pass, spec: JobSpec, failed: dict[str, Any], names: list[str]) -> bool:
        """A failed child is kept (for its logs) until its backoff ends, then deleted to be recreated.

        As the Job controller does, the delay grows as base · 2^restarts from the failure time;
        after `backoffLimit` restarts the job fails. True when the pods were deleted for a retry.
        """
        restarts = int(p.status.get("restarts", 0))
        if restarts >= spec.backoff_limit:
            self._fail(p, _FAILURE_REASONS.get(failed["metadata"]["labels"].get(LABEL_ROLE), "ChildFailed"),
                       f"{p.status['lastFailure']} (backoffLimit {spec.backoff_limit} reached)")
            return False
        delay_s = min(self.settings.backoff_base_s * 2**restarts, self.settings.backoff_max_s)
        retry_at = (_finished_at(failed) or p.now) + delay_s
        if p.now < retry_at:
            p.requeue(retry_at - p.now)
            return False
        for name in names:
            await self.kube.delete(path("v1", "pods", p.ns, name))
        p.status["restarts"] = restarts + 1
        p.events.append(("Warning", "ChildRestarted", f"{p.status['lastFailure']}; restart "
                                                      f"{restarts + 1}/{spec.backoff_limit}"))
        p.requeue(0.5)
        return True

    def _fail(self, p: _Pass, reason: str, message: str) -> bool:
        p.want("Failed", True, reason, message)
        p.status["completionTime"] = iso(p.now)
        return False

    async def _stop_pods(self, p: _Pass, spec: JobSpec) -> None:
        names = [mf.profile_pod_name(p.name), mf.optimize_pod_name(p.name)]
        names += [mf.train_pod_name(p.name, i) for i in range(spec.training.nodes)]
        for name in names:
            pod = await self.kube.get(path("v1", "pods", p.ns, name))
            if owned_by(pod, p.meta["uid"]) and pod_phase(pod) in ("Pending", "Running"):
                await self.kube.delete(path("v1", "pods", p.ns, name))

    async def _child(self, p: _Pass, plural: str, name: str, role: str) -> dict[str, Any] | None:
        """The child of that name if this job (by UID) owns it; None if there is none.

        A same-named object owned by anyone else — a deleted job's child the garbage collector has
        not removed yet — is never used: the job waits until it is gone (StaleChild)."""
        body = await self.kube.get(path("v1", plural, p.ns, name))
        if body is None or owned_by(body, p.meta["uid"]):
            return body
        raise StaleChild(body, role)

    async def _ensure(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """Create a child; an existing one must be this job's. A refusal is raised as ChildRefused."""
        plural = {"Pod": "pods", "ConfigMap": "configmaps", "Service": "services"}[body["kind"]]
        meta = body["metadata"]
        try:
            existing, created = await self.kube.create(path("v1", plural, meta["namespace"]), body)
        except ApiError as error:
            refusal = classify(error)
            if refusal.retryable:
                raise
            raise ChildRefused(body["kind"], meta["name"], meta["labels"].get(LABEL_ROLE, ""), refusal) from None
        owner_uid = meta["ownerReferences"][0]["uid"]
        if not created and existing is not None and not owned_by(existing, owner_uid):
            raise StaleChild(existing, meta["labels"].get(LABEL_ROLE, ""))
        return existing

    async def _ensure_spec(self, p: _Pass) -> None:
        """The job manifest the pods read; updated when the spec changed before training started."""
        body = mf.spec_configmap(p.job)
        existing = await self._ensure(body)
        if existing is not None and (existing.get("data") or {}) != body["data"]:
            await self.kube.merge_patch(path("v1", "configmaps", p.ns, body["metadata"]["name"]),
                                        {"data": body["data"]})


# ---------------------------------------------------------------------- pure helpers


class StaleChild(Exception):
    """A child's name is taken by an object this job does not own."""

    def __init__(self, body: Mapping[str, Any], role: str) -> None:
        meta = body["metadata"]
        owners = [f"{o.get('kind')} {o.get('name')} (uid {o.get('uid')})" for o in meta.get("ownerReferences") or []]
        state = "being deleted" if meta.get("deletionTimestamp") else "not yet garbage-collected"
        super().__init__(f"{body.get('kind', 'object')} {meta['name']} belongs to {', '.join(owners) or 'no owner'}, "
                         f"not this job; waiting until it is gone ({state})")
        self.condition = CONDITION_OF_ROLE.get(role, "Profiled")


def owned_by(body: Mapping[str, Any] | None, uid: str) -> bool:
    """Whether `body` names `uid` as its controller owner."""
    return body is not None and any(o.get("uid") == uid and o.get("controller")
                                    for o in body["metadata"].get("ownerReferences") or [])


def _manifest(job: Mapping[str, Any]) -> dict[str, Any]:
    meta = job["metadata"]
    metadata = {k: meta[k] for k in ("name", "namespace", "labels", "annotations") if meta.get(k)}
    return {"apiVersion": job.get("apiVersion", mf.API_VERSION), "kind": job.get("kind", mf.KIND),
            "metadata": metadata, "spec": job.get("spec") or {}}


def objective_text(spec: JobSpec) -> str:
    """The objective as one canonical line (`status.objective`, the Objective printer column, and
    what a change is detected by): `maxThroughput`, `timeBudget maxSlowdownPercent=5.0`, …"""
    ((kind, params),) = spec.objective.to_dict().items()
    settings = " ".join(f"{key}={value}" for key, value in sorted((params or {}).items()))
    return f"{kind} {settings}".strip()


@dataclass(frozen=True)
class PlanSummary:
    """What `status.plan` shows of a plan document (read without the full semantic validation,
    which needs the workload and is the runtime's job when it loads the plan)."""

    iteration_s: float
    iteration_j: float
    frontier_points: int

    @classmethod
    def of(cls, plan: Plan) -> PlanSummary:
        return cls(plan.predicted.iteration_time_s, plan.predicted.iteration_energy_j, len(plan.frontier.rows))

    @classmethod
    def from_json(cls, text: str) -> PlanSummary:
        try:
            data = json.loads(text)
            predicted = data["predicted"]
            summary = cls(float(predicted["iteration_time_s"]), float(predicted["iteration_energy_j"]),
                          len(data["frontier"]["rows"]))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"not a plan document ({type(error).__name__}: {error})") from None
        if not (summary.iteration_s > 0 and summary.iteration_j > 0 and summary.frontier_points > 0):
            raise ValueError("the plan predicts no positive iteration time and energy")
        return summary

    def status(self, cm_name: str, *, reselections: int, steps: int) -> dict[str, Any]:
        return {"configMap": cm_name, "predictedIterationSeconds": self.iteration_s,
                "predictedIterationJoules": self.iteration_j, "predictedTotalJoules": self.iteration_j * steps,
                "frontierPoints": self.frontier_points, "reselections": reselections}

    def text(self) -> str:
        return f"{self.iteration_s:.4g} s/iteration, {self.iteration_j:.4g} J/iteration, {self.frontier_points} frontier points"


def _measured_text(measured: Mapping[str, Any] | None) -> str:
    if not measured:
        return "training finished"
    return (f"{measured['iterations']} iterations, {measured['energyJoules']:.4g} J, "
            f"{measured['averageIterationSeconds']:.4g} s/iteration")


def _budget_overrun(spec: JobSpec, measured: Mapping[str, Any]) -> str | None:
    """Why the energy budget will be exceeded at the current rate, or None."""
    budget = spec.objective
    if getattr(budget, "kind", None) != "energyBudget" or not measured["iterations"]:
        return None
    per_iteration_j = measured["energyJoules"] / measured["iterations"]
    if budget.per_iteration_joules is not None and per_iteration_j > budget.per_iteration_joules:
        return f"{per_iteration_j:.4g} J/iteration measured > budget {budget.per_iteration_joules:.4g} J/iteration"
    if budget.total_kilowatt_hours is not None:
        projected_j = per_iteration_j * spec.training.steps
        budget_j = budget.total_kilowatt_hours * 3.6e6
        if projected_j > budget_j:
            return f"projected {projected_j / 3.6e6:.4g} kWh for {spec.training.steps} steps > budget {budget.total_kilowatt_hours:.4g} kWh"
    return None
