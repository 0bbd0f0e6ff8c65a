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

import base64
import copy
import dataclasses
import datetime
import gzip
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kareus.compressed import MAX_PLAN_BYTES, DecompressError, gunzip
from kareus.errors import EXIT_CONFIG, KareusError
from kareus.override_policy import check_overrides
from kareus.plan import Plan, reselect
from kareus.policy import ClusterPolicy, check_job, load_policy
from kareus.profiler.key import profile_key
from kareus.sim.gpus import get_gpu
from kareus.spec import JobSpec, SpecError, parse_job
from kareus.workload.memory import memory_plan
from kareus_operator import conditions as cond
from kareus_operator import manifests as mf
from kareus_operator.admission_check import rejection
from kareus_operator.conditions import Want
from kareus_operator.energy_ledgers import EnergyLedgers
from kareus_operator.kube import ApiError, Kube, path
from kareus_operator.metrics import OperatorMetrics
from kareus_operator.progress import checkpoint_status, progress_fields
from kareus_operator.publish import PROGRESS_KEY
from kareus_operator.refusals import CONDITION_OF_ROLE, ChildRefused, Refusal, backoff_s, classify
from kareus_operator.settings import (
    ANNOTATION_PLAN_REVISION,
    LABEL_JOB,
    LABEL_JOB_UID,
    LABEL_QUEUE,
    LABEL_ROLE,
    PLAN_FILE,
    PLAN_FILE_GZ,
    PROFILE_FILE,
    Settings,
)

_POLICY_TTL_S = 5.0
_FAILURE_REASONS = {"profile": "ProfilingFailed", "optimize": "OptimizationFailed", "train": "TrainingFailed"}
# What the Job controller's Failed reasons mean, for the KareusJob's condition message.
_JOB_FAILURE = {"BackoffLimitExceeded": "backoffLimit {limit} reached",
                "PodFailurePolicy": "not retryable: the pod failure policy failed the Job on its exit code",
                "DeadlineExceeded": "the Job's activeDeadlineSeconds passed"}
_API_OF = {"jobs": "batch/v1", "pods": "v1", "configmaps": "v1", "services": "v1"}
_PLURAL_OF = {"Job": "jobs", "Pod": "pods", "ConfigMap": "configmaps", "Service": "services"}
KUEUE_API = "kueue.x-k8s.io/v1beta2"
KUEUE_JOB_UID = "kueue.x-k8s.io/job-uid"
CONTROLLER_UID = "batch.kubernetes.io/controller-uid"


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


def child_phase(job: Mapping[str, Any] | None) -> str | None:
    """A phase Job's state: None (absent), Terminating, Succeeded, Failed, Suspended, Running or Pending."""
    if job is None:
        return None
    if job["metadata"].get("deletionTimestamp"):
        return "Terminating"
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("status") == "True" and condition.get("type") in ("Complete", "Failed"):
            return "Succeeded" if condition["type"] == "Complete" else "Failed"
    if (job.get("spec") or {}).get("suspend"):
        return "Suspended"
    return "Running" if int((job.get("status") or {}).get("ready") or 0) > 0 else "Pending"


def job_condition(job: Mapping[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in (job.get("status") or {}).get("conditions") or []
                 if c.get("type") == type_ and c.get("status") == "True"), None)


def terminated_state(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    """The failed container's `terminated` state, if one failed."""
    for status in (pod.get("status") or {}).get("containerStatuses", []) or []:
        terminated = (status.get("state") or {}).get("terminated")
        if terminated and terminated.get("exitCode"):
            return terminated
    return None


def pod_failure(pod: Mapping[str, Any]) -> str:
    terminated = terminated_state(pod)
    if terminated is not None:
        # FallbackToLogsOnError: the message is the container's last log lines; our CLIs end a
        # failure with one line saying what is wrong, which is what a user needs to read.
        lines = [line for line in str(terminated.get("message") or "").strip().splitlines() if line.strip()]
        said = f": {lines[-1].strip()}" if lines else ""
        return f"pod {pod['metadata']['name']} failed (exit code {terminated['exitCode']}){said}"
    return f"pod {pod['metadata']['name']} failed: {(pod.get('status') or {}).get('message', 'no reason given')}"


def disrupted(pod: Mapping[str, Any]) -> bool:
    """Whether the pod was preempted, evicted or drained (the DisruptionTarget condition)."""
    return any(c.get("type") == "DisruptionTarget" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


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
        self.child_suspended = False  # the current child Job is held suspended (Kueue)

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
        if self.true("Stalled"):  # set by the controller when a pass raised; this one did not
            self.want("Stalled", False, "Reconciled", "the operator reconciles this job again")
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
        self.power: Any = None  # a kareus_operator.power.PowerAllocator, wired by the controller
        self.ledgers = EnergyLedgers(kube, self.policy)
        self.admission: Any = None  # a kareus_operator.admission_check.EnergyAdmissionCheck, wired likewise

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
        if await self._refused_by_policy(p, spec) or self._does_not_fit(p, spec) or await self._past_deadline(p, spec):
            return p.outcome()
        if await self._suspended(p, spec):
            return p.outcome()
        try:
            await self._advance(p, spec)
            self._account_suspension(p, p.child_suspended)
            if not p.child_suspended and _suspended_for(p) == "Queued":
                p.want("Suspended", False, "Admitted", "Kueue admitted the current child Job")
                p.status.pop("resumePhase", None)
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
        queued = self.admission is not None and await self.admission.queue_checks_energy(p.ns, p.job)
        energy = None
        if not queued and policy.energy_budget_kwh(p.ns) is not None and self.ledgers is not None:
            energy = await self.ledgers.standing(p.ns)
        violations = check_job(policy, p.ns, spec, energy=energy, check_energy=not queued)
        if not violations:
            return False
        message = "; ".join(f"policy.{v.rule}: {v.message}" for v in violations)
        p.want("Failed", True, "PolicyViolation", message)
        return True

    def _does_not_fit(self, p: _Pass, spec: JobSpec) -> bool:
        """Fail a job whose memory plan does not fit its GPU before any child exists (the message is
        `kareus validate`'s line); with `memory_check: warn` a Warning Event says so and the job goes on. Checked until the job
        is first admitted (Profiled), like the policy: a running job is not failed by a new estimate."""
        if self.settings.memory_check == "off" or p.true("Profiled"):
            return False
        try:
            refusal = memory_plan(spec).fits(get_gpu(spec.gpu_product))
        except KareusError as error:  # an unplannable spec: the spec's own checks should have caught it
            refusal = f"no memory plan: {error}"
        if refusal is None:
            return False
        if self.settings.memory_check == "warn":
            # An Event on the pass that admits the job (no Profiled condition yet), not a condition:
            # the job runs as if it fitted, and its conditions say only what it did.
            if cond.find(p.conditions, "Profiled") is None:
                p.events.append(("Warning", "DoesNotFit", f"{refusal} (memory check: warn, running anyway)"))
            return False
        p.want("Failed", True, "DoesNotFit", refusal)
        return True

    async def _past_deadline(self, p: _Pass, spec: JobSpec) -> bool:
        """`activeDeadlineSeconds` counts active time only: time suspended (by `spec.suspend`, or a
        child held by Kueue until admission or after preemption) is excluded, as Job does."""
        if spec.active_deadline_seconds is None:
            return False
        started = parse_iso(p.status.get("startTime")) or p.now
        suspended_s = float(p.status.get("suspendedSeconds") or 0.0)
        since = parse_iso(p.status.get("suspendedSince"))
        if since is not None:
            return False  # the clock is stopped while suspended
        left_s = started + suspended_s + spec.active_deadline_seconds - p.now
        if left_s > 0:
            p.requeue(left_s)
            return False
        await self._stop_children(p)
        p.want("Failed", True, "DeadlineExceeded",
               f"the job was active longer than activeDeadlineSeconds={spec.active_deadline_seconds}")
        p.status["completionTime"] = iso(p.now)
        return True

    async def _suspended(self, p: _Pass, spec: JobSpec) -> bool:
        """`spec.suspend` suspends the current child Job (it keeps its place; its pods stop) and
        resuming unsuspends it, so the job continues from `status.resumePhase`. A child queued in
        Kueue is suspended and resumed through its Workload (`spec.active`), since Kueue
        unsuspends an admitted Job it sees suspended."""
        if not spec.suspend and _suspended_for(p) != "Suspended":
            return False  # no child was suspended for spec.suspend: nothing to resume
        children = [c for c in [await self._child(p, "jobs", name, role)
                                for name, role in self._child_jobs(p)] if c is not None]
        for child in children:
            if child_phase(child) in ("Succeeded", "Failed", "Terminating"):
                continue
            await self._set_child_suspended(p, child, spec.suspend)
        if not spec.suspend:
            if _suspended_for(p) == "Suspended":
                p.want("Suspended", False, "Resumed", "the job resumed from where it was suspended")
                p.status.pop("resumePhase", None)
            return False
        if _suspended_for(p) != "Suspended":
            p.status["resumePhase"] = _active_phase(p.status.get("phase"))
            p.want("Suspended", True, "Suspended", "spec.suspend is true: the current child Job is suspended")
            if p.true("Training"):
                p.want("Training", False, "Suspended", "training pods stopped; training restarts on resume")
        self._account_suspension(p, True)
        return True

    def _child_jobs(self, p: _Pass) -> list[tuple[str, str]]:
        return [(mf.profile_job_name(p.name), "profile"), (mf.optimize_job_name(p.name), "optimize"),
                (mf.train_job_name(p.name), "train")]

    async def _set_child_suspended(self, p: _Pass, child: Mapping[str, Any], suspend: bool) -> None:
        name = child["metadata"]["name"]
        if (child["metadata"].get("labels") or {}).get(LABEL_QUEUE):
            try:
                workloads = await self.kube.list(path(KUEUE_API, "workloads", p.ns),
                                                 f"{KUEUE_JOB_UID}={child['metadata']['uid']}")
            except ApiError as error:
                if error.code != 404:
                    raise
                workloads = []  # no Kueue here: the queue label means nothing, so does its Workload
            for workload in workloads:
                if bool((workload.get("spec") or {}).get("active", True)) == suspend:
                    await self.kube.merge_patch(path(KUEUE_API, "workloads", p.ns, workload["metadata"]["name"]),
                                                {"spec": {"active": not suspend}})
            return
        if bool((child.get("spec") or {}).get("suspend")) != suspend:
            await self.kube.merge_patch(path("batch/v1", "jobs", p.ns, name), {"spec": {"suspend": suspend}})

    def _account_suspension(self, p: _Pass, suspended: bool) -> None:
        """Suspended time, summed into `status.suspendedSeconds` (the active deadline excludes it)."""
        since = parse_iso(p.status.get("suspendedSince"))
        if suspended and since is None:
            p.status["suspendedSince"] = iso(p.now)
        elif not suspended and since is not None:
            p.status["suspendedSeconds"] = round(float(p.status.get("suspendedSeconds") or 0.0) + p.now - since, 3)
            p.status.pop("suspendedSince", None)

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
        key = self._profile_key(p, spec)
        cm_name = mf.profile_configmap_name(key)
        p.status["profile"] = {"key": key, "configMap": cm_name}
        reuse = (await self.policy()).reuse_profiles(spec.profiling.reuse)
        cache = await self.kube.get(path("v1", "configmaps", p.ns, cm_name))
        cached = sealed_profile(cache)
        job_name = mf.profile_job_name(p.name)
        child = await self._child(p, "jobs", job_name, "profile")
        if cached and child is None and reuse:
            self.metrics.profile_cache_hit()
            p.status["profile"]["cacheHit"] = True
            p.want("Profiled", True, "CacheHit", f"reused the cached profile {cm_name}")
            return True
        state = await self._run_job(p, spec, "profile", child,
                                    lambda: mf.profile_job(p.job, spec, self.settings, key))
        if state == "Succeeded":
            if not spec.gpu_pinned and spec.profiling.backend != "sim":
                key = self._profile_key(p, spec)  # the product it ran on is known now
                cm_name = mf.profile_configmap_name(key)
                p.status["profile"] = {"key": key, "configMap": cm_name}
            if not await self._publish_profile(p, key):
                return self._fail(p, "ProfilingFailed", f"Job {job_name} succeeded but published no profile "
                                  f"{mf.measured_profile_configmap_name(p.name)}")
            p.status["profile"]["cacheHit"] = False
            p.want("Profiled", True, "Measured", f"profiled by Job {job_name}; stored in {cm_name}")
            return True
        if state not in ("Failed", "Suspended"):
            p.want("Profiled", False, "Profiling", f"Job {job_name} is {state.lower()}")
        return False

    async def _publish_profile(self, p: _Pass, key: str) -> bool:
        """Copy what this job's profiling Job measured (its own ConfigMap, which only its pods may
        write) into the shared cache of `key`, sealed with this job's UID. Workers never write a
        cache (the chart's admission policy), so a cache is only ever what a profiling Job the
        operator saw succeed measured; an unsealed one (an older operator's) is never reused."""
        measured = await self._child(p, "configmaps", mf.measured_profile_configmap_name(p.name), "profile")
        text = ((measured or {}).get("data") or {}).get(PROFILE_FILE)
        if not text:
            return False
        body = mf.profile_cache(p.ns, key, text, p.meta["uid"])
        _, created = await self.kube.create(path("v1", "configmaps", p.ns), body)
        if not created:
            await self.kube.merge_patch(path("v1", "configmaps", p.ns, body["metadata"]["name"]),
                                        {"metadata": {"labels": body["metadata"]["labels"]}, "data": body["data"]})
        return True

    def _profile_key(self, p: _Pass, spec: JobSpec) -> str:
        """The job's profile key; a job that pins no GPU product is keyed by the product its
        profiling pod ran on (`status.gpuProduct`), never by the planning default."""
        product = p.status.get("gpuProduct")
        if not spec.gpu_pinned and product and spec.profiling.backend != "sim":
            spec = dataclasses.replace(spec, gpu_product=product)
        return profile_key(spec)

    async def _optimize(self, p: _Pass, spec: JobSpec) -> bool:
        cm_name = mf.plan_configmap_name(p.name)
        plan_cm = await self._child(p, "configmaps", cm_name, "optimize")
        try:
            text = plan_text(plan_cm)
        except DecompressError as error:
            return self._fail(p, "InvalidPlan", str(error))
        job_name = mf.optimize_job_name(p.name)
        if text is None:
            child = await self._child(p, "jobs", job_name, "optimize")
            key = p.status["profile"]["key"]
            state = await self._run_job(p, spec, "optimize", child,
                                        lambda: mf.optimize_job(p.job, spec, self.settings, key))
            if state in ("Failed", "Suspended"):
                return False
            if state != "Succeeded":
                p.want("Planned", False, "Optimizing", f"Job {job_name} is {state.lower()}")
                return False
            return self._fail(p, "OptimizationFailed", f"Job {job_name} succeeded but published no plan")
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
        job_name = mf.train_job_name(p.name)
        child = await self._child(p, "jobs", job_name, "train")
        await self._measure(p, spec)
        if self.power is not None and await self.power.apply(p, spec, started=child is not None):
            return  # held by the cluster power budget: no training Job until a pass admits it
        p.status.setdefault("trainingStartTime", iso(p.now))
        if child is None:
            await self._ensure_spec(p)
            await self._check_overrides(p, spec, "train", mf.train_job_name(p.name))
            await self._ensure_filled(p, mf.progress_configmap_name(p.name), "train")
            await self._ensure(mf.train_service(p.job))
            await self._ensure(mf.train_job(p.job, spec, self.settings))
            p.want("Training", True, "Starting", f"created the Indexed Job {job_name} ({spec.training.nodes} pod(s))")
            return
        counts = child.get("status") or {}
        p.status["workers"] = {key: int(counts.get(key) or 0) for key in ("active", "ready", "succeeded", "failed")}
        phase = child_phase(child)
        if phase == "Terminating":
            p.requeue(1.0)
            return
        if phase == "Succeeded":
            p.want("Training", False, "Completed", f"{spec.training.nodes} training pod(s) succeeded")
            p.want("Complete", True, "Completed", _measured_text(p.status.get("measured")))
            p.status["completionTime"] = iso(p.now)
            # A rank exits 0 only after its part of the export is done (rank 0 renames it into place).
            if (export := mf.export_status_path(p.job, spec)) is not None:
                p.status["export"] = {"path": export}
            self._expire(p, spec)
            return
        pods = await self._pods_of(p, child)
        if not pods and phase == "Pending":
            await self._refused_pods(p, child, "train")
        await self._record_gpu(p, pods)
        if phase == "Failed" or any(disrupted(pod) for pod in pods):
            await self._restart_gang(p, spec, child, pods)
            return
        if phase == "Suspended":
            if await self._rejected_by_queue(p, child):
                return
            self._waiting(p, child, "Training")
            return
        p.want("Training", True, "Running", f"{p.status['workers']['ready']}/{spec.training.nodes} training pod(s) ready")

    async def _restart_gang(self, p: _Pass, spec: JobSpec, child: Mapping[str, Any],
                            pods: list[dict[str, Any]]) -> None:
        """One failed rank fails the step for every rank: the whole Indexed Job is recreated, as
        JobSet restarts its Jobs. A non-retryable exit code (the pod failure policy's FailJob)
        fails the KareusJob at once; a disruption restarts without counting against the limit."""
        failed = [pod for pod in pods if terminated_state(pod) is not None]
        was_disrupted = any(disrupted(pod) for pod in pods)
        condition = job_condition(child, "Failed") or {}
        p.status["lastFailure"] = (pod_failure(failed[0]) if failed else
                                   f"Job {child['metadata']['name']}: {condition.get('message') or 'a pod was disrupted'}")
        if condition.get("reason") == "PodFailurePolicy" and not was_disrupted:
            self._fail(p, "TrainingFailed", f"{p.status['lastFailure']} (not retryable)")
            return
        restarts = int(p.status.get("restarts", 0))
        if not was_disrupted and restarts >= spec.backoff_limit:
            self._fail(p, "TrainingFailed", f"{p.status['lastFailure']} (backoffLimit {spec.backoff_limit} reached)")
            return
        if not was_disrupted:
            delay_s = min(self.settings.backoff_base_s * 2**restarts, self.settings.backoff_max_s)
            retry_at = (parse_iso(condition.get("lastTransitionTime")) or p.now) + delay_s
            if p.now < retry_at:
                p.want("Training", False, "Retrying", f"{p.status['lastFailure']}; restarting all ranks")
                p.requeue(retry_at - p.now)
                return
            p.status["restarts"] = restarts + 1
        # Foreground: the new gang starts only after every old pod is gone (same hostnames, ports).
        await self.kube.delete(path("batch/v1", "jobs", p.ns, child["metadata"]["name"]), propagation="Foreground")
        why = "a pod was disrupted (not counted)" if was_disrupted else f"restart {restarts + 1}/{spec.backoff_limit}"
        p.events.append(("Warning", "ChildRestarted", f"{p.status['lastFailure']}; {why}"))
        p.want("Training", False, "Retrying", f"{p.status['lastFailure']}; restarting all ranks")
        p.requeue(0.5)

    async def _maybe_reselect(self, p: _Pass, spec: JobSpec) -> None:
        """A new objective while training: a plan from the stored frontier, rolled out via the ConfigMap."""
        wanted = objective_text(spec)
        if p.status.get("objective") == wanted:
            return
        p.status["objective"] = wanted  # tried once per change, whatever the result
        cm_name = mf.plan_configmap_name(p.name)
        cm = await self._child(p, "configmaps", cm_name, "train")
        try:
            text = plan_text(cm)
            if text is None:
                raise KeyError(PLAN_FILE)
            current = Plan.loads(text, source=f"ConfigMap {cm_name}")
            done = int(((p.status.get("measured") or {}).get("iterations")) or 0)
            plan = reselect(current, spec.objective, steps=max(1, spec.training.steps - done))
        except (KareusError, KeyError) as error:
            p.events.append(("Warning", "ReselectFailed", f"keeping the current plan: {error}"))
            return
        reselections = int((p.status.get("plan") or {}).get("reselections", 0)) + 1
        await self.kube.merge_patch(path("v1", "configmaps", p.ns, cm_name), {
            "metadata": {"annotations": {ANNOTATION_PLAN_REVISION: next_plan_revision(cm)}},
            **plan_data(plan.to_json())})
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
            measured |= {key: int(progress[key]) for key in ("planFrontierRow", "stragglerReselections")
                         if key in progress}
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
        measured |= progress_fields(progress, measured, spec.training.steps)
        checkpoint = checkpoint_status(progress, p.status.get("checkpoint"))
        if checkpoint is not None:
            p.status["checkpoint"] = checkpoint
        if measured != {k: v for k, v in (p.status.get("measured") or {}).items() if k != "lastUpdateTime"}:
            measured["lastUpdateTime"] = iso(p.now)
        else:
            measured["lastUpdateTime"] = p.status["measured"].get("lastUpdateTime", iso(p.now))
        # The ledger is charged by the controller once this status has landed, never before: a
        # resync charging the stored (older) counter after a newer one would read it as a restart.
        p.status["measured"] = measured
        over = _budget_overrun(spec, measured)
        if over is not None:
            p.want("BudgetExceeded", True, "EnergyBudgetExceeded", over)
        elif cond.find(p.conditions, "BudgetExceeded") is not None:
            p.want("BudgetExceeded", False, "WithinBudget", "the projected energy is within the budget")

    # ------------------------------------------------------------------ children

    async def _run_job(self, p: _Pass, spec: JobSpec, stage: str, child: dict[str, Any] | None, build) -> str:
        """Drive one phase Job; returns Succeeded, Failed (final), Suspended, Pending or Running.

        The Job controller retries failed pods up to the job's backoffLimit (disruptions excluded
        by the pod failure policy); its Failed condition fails the KareusJob with the pod's own
        last words as the reason's message."""
        phase = child_phase(child)
        if child is None:
            await self._check_overrides(p, spec, stage, f"{p.name}-{stage}")
            filled = {"profile": mf.measured_profile_configmap_name, "optimize": mf.plan_configmap_name}.get(stage)
            if filled is not None:  # the ConfigMap its pod fills, created owned so it can be trusted
                await self._ensure_filled(p, filled(p.name), stage)
            await self._ensure(build())
            return "Pending"
        # The Job controller's failed pods are its retries, but for the last one when it gave up.
        retries = int((child.get("status") or {}).get("failed") or 0) - (phase == "Failed")
        p.status["restarts"] = max(int(p.status.get("restarts", 0)), retries)
        if phase == "Terminating":
            p.requeue(1.0)
            return "Pending"
        pods = await self._pods_of(p, child)
        if not pods and phase == "Pending":
            await self._refused_pods(p, child, stage)
        if stage == "profile":
            await self._record_gpu(p, pods)
        if phase == "Failed":
            failed = sorted((pod for pod in pods if terminated_state(pod) is not None),
                            key=lambda pod: str((terminated_state(pod) or {}).get("finishedAt") or ""))
            condition = job_condition(child, "Failed") or {}
            text = pod_failure(failed[-1]) if failed else f"Job {child['metadata']['name']}: {condition.get('message', '')}"
            p.status["lastFailure"] = text
            exit_codes = {int((terminated_state(pod) or {}).get("exitCode") or 0) for pod in failed}
            reason = ("NoGPUVisible" if stage == "profile" and EXIT_CONFIG in exit_codes
                      else _FAILURE_REASONS.get(stage, "ChildFailed"))
            why = _JOB_FAILURE.get(condition.get("reason"), str(condition.get("reason") or "failed"))
            self._fail(p, reason, f"{text} ({why.format(limit=spec.backoff_limit)})")
            return "Failed"
        if phase == "Suspended":
            if await self._rejected_by_queue(p, child):
                return "Failed"
            self._waiting(p, child, CONDITION_OF_ROLE[stage])
        return phase

    async def _rejected_by_queue(self, p: _Pass, child: Mapping[str, Any]) -> bool:
        """A queued child whose Workload an admission check rejected (the energy-budget check when
        waiting cannot make the job fit): Kueue deactivates the Workload and the Job would stay
        suspended for ever, so the job fails with the check's message."""
        if not (child["metadata"].get("labels") or {}).get(LABEL_QUEUE):
            return False
        try:
            workloads = await self.kube.list(path(KUEUE_API, "workloads", p.ns), f"{KUEUE_JOB_UID}={child['metadata']['uid']}")
        except ApiError as error:
            if error.code in (403, 404):
                return False
            raise
        message = next((m for m in map(rejection, workloads) if m), None)
        if message is None:
            return False
        await self._stop_children(p)
        self._fail(p, "AdmissionCheckRejected", message)
        return True

    def _waiting(self, p: _Pass, child: Mapping[str, Any], condition: str) -> None:
        """A child held suspended by Kueue (not admitted yet, or preempted): the job waits, and the
        time counts as suspended."""
        queue = (child["metadata"].get("labels") or {}).get(LABEL_QUEUE)
        who = f"until Kueue admits it from LocalQueue {queue}" if queue else "(spec.suspend of the Job)"
        message = f"Job {child['metadata']['name']} is suspended {who}"
        p.want(condition, False, "Queued", message)
        if queue and _suspended_for(p) != "Queued":
            p.status.setdefault("resumePhase", _active_phase(p.status.get("phase")))
            p.want("Suspended", True, "Queued", message)
        p.child_suspended = True

    async def _refused_pods(self, p: _Pass, child: Mapping[str, Any], role: str) -> None:
        """A child Job whose pods the API server refuses (a missing ServiceAccount, a quota, a Pod
        Security level) says so only in the Job controller's FailedCreate Events: raise the latest
        as the refusal it is, so the job shows it as it would a refusal of its own request."""
        events = await self.kube.list(path("v1", "events", p.ns),
                                      field_selector=f"involvedObject.uid={child['metadata']['uid']},reason=FailedCreate")
        if not events:
            return
        latest = max(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
        message = str(latest.get("message") or "").removeprefix("Error creating: ")
        raise ChildRefused("Pod", f"of Job {child['metadata']['name']}", role, classify(ApiError(403, "Forbidden", message)))

    async def _pods_of(self, p: _Pass, child: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The pods of this very Job (by its UID: a recreated Job's name is reused)."""
        return await self.kube.list(path("v1", "pods", p.ns), f"{CONTROLLER_UID}={child['metadata']['uid']}")

    async def _record_gpu(self, p: _Pass, pods: list[dict[str, Any]]) -> None:
        """`status.gpuProduct`: the product of the node the job's GPU pods run on (from GPU
        Feature Discovery's label), so a job that pinned none knows what it ran on."""
        if p.status.get("gpuProduct"):
            return
        node_name = next((pod["spec"]["nodeName"] for pod in pods if (pod.get("spec") or {}).get("nodeName")), None)
        if node_name is None:
            return
        try:
            node = await self.kube.get(path("v1", "nodes", None, node_name))
        except ApiError:
            return  # a chart without the node read: nothing recorded, nothing broken
        product = ((node or {}).get("metadata", {}).get("labels") or {}).get(mf.GPU_PRODUCT_LABEL)
        if product:
            p.status["gpuProduct"] = product

    def _fail(self, p: _Pass, reason: str, message: str) -> bool:
        p.want("Failed", True, reason, message)
        p.status["completionTime"] = iso(p.now)
        return False

    async def _stop_children(self, p: _Pass) -> None:
        """Delete the unfinished phase Jobs (their pods go with them)."""
        for name, _role in self._child_jobs(p):
            child = await self.kube.get(path("batch/v1", "jobs", p.ns, name))
            if owned_by(child, p.meta["uid"]) and child_phase(child) not in ("Succeeded", "Failed", "Terminating"):
                await self.kube.delete(path("batch/v1", "jobs", p.ns, name))

    async def _child(self, p: _Pass, plural: str, name: str, role: str) -> dict[str, Any] | None:
        """The child of that name if this job (by UID) owns it; None if there is none.

        A same-named object owned by anyone else — a deleted job's child the garbage collector has
        not removed yet — is never used: the job waits until it is gone (StaleChild)."""
        body = await self.kube.get(path(_API_OF[plural], plural, p.ns, name))
        if body is None or (trusted_configmap(body, p.meta["uid"]) if plural == "configmaps"
                            else owned_by(body, p.meta["uid"])):
            return body
        raise StaleChild(body, role)

    async def _ensure(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """Create a child; an existing one must be this job's. A refusal is raised as ChildRefused."""
        plural = _PLURAL_OF[body["kind"]]
        meta = body["metadata"]
        try:
            existing, created = await self.kube.create(path(body["apiVersion"], plural, meta["namespace"]), body)
        except ApiError as error:
            refusal = classify(error)
            if refusal.retryable:
                raise
            raise ChildRefused(body["kind"], meta["name"], meta["labels"].get(LABEL_ROLE, ""), refusal) from None
        owner_uid = meta["ownerReferences"][0]["uid"]
        if not created and existing is not None and not owned_by(existing, owner_uid):
            raise StaleChild(existing, meta["labels"].get(LABEL_ROLE, ""))
        return existing

    async def _ensure_filled(self, p: _Pass, name: str, role: str) -> None:
        """The empty ConfigMap a worker of `role` fills, created owned (`mf.job_configmap`) — but only
        once no pod of an earlier job of the same name runs. Such a pod (its job deleted, its pods
        still terminating: a training pod checkpoints and publishes once more on SIGTERM) has the
        same job name, so the workers' admission policy lets it write this job's ConfigMaps of that
        name (issue 29). A ConfigMap of that name with neither an ownerReference nor a `job-uid`
        label can only be such a pod's (the operator sets both, a worker may set neither): once those
        pods are gone it is deleted and made anew, where it used to block the job for good."""
        stale = await self._earlier_jobs_pods(p)
        if stale:
            raise StaleChild({**stale[0], "kind": "Pod"}, role)  # a list's items carry no kind
        try:
            await self._ensure(mf.job_configmap(p.job, name, role))
        except StaleChild as taken:
            meta = taken.body.get("metadata") or {}
            if meta.get("ownerReferences") or LABEL_JOB_UID in (meta.get("labels") or {}):
                raise
            await self.kube.delete(path("v1", "configmaps", p.ns, name))
            p.events.append(("Normal", "StaleChildRemoved", f"deleted ConfigMap {name}, which a pod of an earlier "
                             f"job of this name made"))
            await self._ensure(mf.job_configmap(p.job, name, role))

    async def _earlier_jobs_pods(self, p: _Pass) -> list[dict[str, Any]]:
        """Pods of an earlier KareusJob of this name (another `job-uid`) that may still run."""
        pods = await self.kube.list(path("v1", "pods", p.ns), f"{LABEL_JOB}={p.name}")
        return [pod for pod in pods
                if ((pod["metadata"].get("labels") or {}).get(LABEL_JOB) == p.name
                    and (pod["metadata"].get("labels") or {}).get(LABEL_JOB_UID) != p.meta["uid"]
                    and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))]

    async def _check_overrides(self, p: _Pass, spec: JobSpec, role: str, name: str) -> None:
        """The job's overrides for `role`, refused before the child exists when the cluster policy
        (or Pod Security `restricted`, which it defaults to) would not have them — in any namespace,
        whatever its own Pod Security label: the profiling and optimizing pods write what other
        jobs trust."""
        refusals = check_overrides((await self.policy()).pod_overrides, spec.pod_overrides, role)
        if refusals:
            raise ChildRefused("Job", name, role, Refusal("OverrideRefused", "; ".join(r.text() for r in refusals),
                                                          retryable=False), by="the operator")

    async def _ensure_spec(self, p: _Pass) -> None:
        """The job manifest the pods read; updated when the spec changed before training started."""
        body = mf.spec_configmap(p.job)
        existing = await self._ensure(body)
        if existing is not None and (existing.get("data") or {}) != body["data"]:
            await self.kube.merge_patch(path("v1", "configmaps", p.ns, body["metadata"]["name"]),
                                        {"data": body["data"]})


# ---------------------------------------------------------------------- pure helpers


def plan_text(cm: Mapping[str, Any] | None) -> str | None:
    """The plan document a plan ConfigMap holds: gzip-compressed in `binaryData` (a plan for
    PP16 × 256 microbatches is megabytes of JSON, over a ConfigMap's 1 MiB), or plain in `data`.
    A malformed or oversized `binaryData` raises DecompressError naming the ConfigMap."""
    if cm is None:
        return None
    packed = (cm.get("binaryData") or {}).get(PLAN_FILE_GZ)
    if packed is not None:
        # The pod that wrote it runs the tenant's image: expanded under a cap, never unbounded.
        what = f"ConfigMap {(cm.get('metadata') or {}).get('name', '')} binaryData.{PLAN_FILE_GZ}"
        try:
            raw = base64.b64decode(packed, validate=True)
        except ValueError as error:
            raise DecompressError(f"{what}: not base64 ({error})") from None
        text = gunzip(raw, max_bytes=MAX_PLAN_BYTES, what=what)
        try:
            return text.decode()
        except UnicodeDecodeError as error:
            raise DecompressError(f"{what}: not UTF-8 text ({error})") from None
    return (cm.get("data") or {}).get(PLAN_FILE)


def next_plan_revision(cm: Mapping[str, Any] | None) -> str:
    """The revision a rewritten plan ConfigMap gets: one past its current annotation (a running
    runtime switches plans when it sees the revision change)."""
    annotations = ((cm or {}).get("metadata") or {}).get("annotations") or {}
    return str(int(annotations.get(ANNOTATION_PLAN_REVISION) or 1) + 1)


def plan_data(text: str) -> dict[str, Any]:
    """The ConfigMap fields that store `text` as `plan_text` reads it (and drop a plain copy)."""
    packed = base64.b64encode(gzip.compress(text.encode(), mtime=0)).decode()
    return {"binaryData": {PLAN_FILE_GZ: packed}, "data": {PLAN_FILE: None}}


def _suspended_for(p: _Pass) -> str | None:
    """Why the job is suspended (the True Suspended condition's reason), or None."""
    found = cond.find(p.conditions, "Suspended")
    return found.get("reason") if found is not None and found.get("status") == "True" else None


def _active_phase(phase: str | None) -> str:
    return phase if phase in ("Pending", "Profiling", "Optimizing", "Training") else "Pending"



class StaleChild(Exception):
    """A child's name is taken by an object this job does not own."""

    def __init__(self, body: Mapping[str, Any], role: str) -> None:
        meta = body["metadata"]
        owners = [f"{o.get('kind')} {o.get('name')} (uid {o.get('uid')})" for o in meta.get("ownerReferences") or []]
        state = "being deleted" if meta.get("deletionTimestamp") else "not yet garbage-collected"
        super().__init__(f"{body.get('kind', 'object')} {meta['name']} belongs to {', '.join(owners) or 'no owner'}, "
                         f"not this job; waiting until it is gone ({state})")
        self.body = body
        self.condition = CONDITION_OF_ROLE.get(role, "Profiled")


def trusted_configmap(body: Mapping[str, Any] | None, uid: str) -> bool:
    """Whether a job ConfigMap is the one the operator created for job `uid`: its controller
    ownerReference and its `job-uid` label, neither of which a worker may set (issue 29: a pod of
    another job in the namespace cannot plant one)."""
    labels = ((body or {}).get("metadata") or {}).get("labels") or {}
    return owned_by(body, uid) and labels.get(LABEL_JOB_UID) == uid


def sealed_profile(body: Mapping[str, Any] | None) -> bool:
    """Whether a profile cache holds a profile and was sealed by the operator (`Reconciler._seal_profile`)."""
    labels = ((body or {}).get("metadata") or {}).get("labels") or {}
    return PROFILE_FILE in ((body or {}).get("data") or {}) and bool(labels.get(LABEL_JOB_UID))


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
