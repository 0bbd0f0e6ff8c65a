"""The per-pod SM clock ceilings the node agents enforce: what the power budget allows each pod.

The allocator (`kareus_operator.power`) gives every job under a power budget one row of its
frontier; the tenant's runtime then picks the clocks, so the row would be advisory unless the node
holds it. The ceiling of a training pod is the highest SM clock its job's allotted row uses on the
pipeline stages that pod's GPUs run (`pod_ceiling_mhz`); a pod whose stages cannot be told (its
job's GPU count is not its plan's, or it has no completion index) gets the highest clock of the
whole row. Held jobs have no pods; without a power budget no pod has a ceiling.

The node agent (`kareus_node.ceilings`) reads one ConfigMap in its own namespace, where tenants
cannot write: ``data: {<pod UID>: "<MHz>"}``. `CeilingPublisher` is its one writer: the leader's
allocation pass calls `publish` with the allotted jobs (so a pass and a job's reconcile never
race: the reconcile writes the job's status, never this), and it lists the training pods and
server-side-applies the ConfigMap as field manager `kareus-operator` when the ceilings changed.
Keys it applied before and omits now are removed by the API server (its managed fields), so
finished and deleted pods drop out. Pods absent from it have no ceiling beyond the policy bounds.

A pod's UID exists only once the pod does, so a new pod runs without its ceiling until the pod's
watch event reaches a pass (`pod_event_matters`) and the agent re-reads the ConfigMap (at most its
re-check period later); the agent then lowers what the pod holds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from kareus.job import PlanJob
from kareus.plan import Plan
from kareus_operator.kube import ApiError, Kube, path
from kareus_operator.settings import LABEL_JOB_UID, LABEL_ROLE

log = logging.getLogger(__name__)
CONFIGMAP_NAME = "kareus-clock-ceilings"  # kareus_node.ceilings.DEFAULT_NAME
FIELD_MANAGER = "kareus-operator"
# One entry is ~50 bytes (a UID, a clock, JSON quoting): 16384 stay well inside a ConfigMap's 1 MiB.
MAX_ENTRIES = 16384
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # the Job controller's annotation: the node rank
TERMINAL_PHASES = ("Succeeded", "Failed")  # such a pod holds no clock any more


# ---------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class CeilingJob:
    """One job under a power allotment, as its pods' ceilings need it."""

    namespace: str
    uid: str
    plan: Plan
    row: int  # the allotted frontier row
    gpus_per_node: int
    nodes: int


def stage_of_rank(job: PlanJob, rank: int) -> int:
    """The pipeline stage global rank `rank` runs: ranks go tensor fastest, then context, then
    pipeline, then data (`kareus.runtime.parallel.Layout`, which imports torch; tested equal)."""
    return (rank // (job.tensor * job.context)) % job.pipeline


def row_stage_clocks_mhz(plan: Plan, row: int) -> tuple[int, ...]:
    """The highest SM clock frontier row `row` uses on each stage (forward and backward)."""
    table = plan.frontier
    clocks = []
    for stage, (forward, backward) in enumerate(table.rows[row].choice):
        options = table.options[stage]
        clocks.append(max([options.forward[k].clock_mhz for k in set(forward)]
                          + [options.backward[k].clock_mhz for k in set(backward)]))
    return tuple(clocks)


def node_stages(job: CeilingJob, node_rank: int | None) -> set[int] | None:
    """The stages node rank `node_rank`'s GPUs run (global ranks node_rank·gpus_per_node …, as the
    runtime numbers them); None when that cannot be told."""
    plan_job = job.plan.job
    if node_rank is None or not 0 <= node_rank < job.nodes or job.nodes * job.gpus_per_node != plan_job.num_gpus:
        return None
    first = node_rank * job.gpus_per_node
    return {stage_of_rank(plan_job, rank) for rank in range(first, first + job.gpus_per_node)}


def pod_ceiling_mhz(job: CeilingJob, node_rank: int | None) -> int:
    """The highest clock `job`'s allotted row lets the pod of node rank `node_rank` run."""
    clocks = row_stage_clocks_mhz(job.plan, job.row)
    stages = node_stages(job, node_rank)
    return max(clocks) if stages is None else max(clocks[s] for s in stages)


def node_rank_of(pod: Mapping[str, Any]) -> int | None:
    text = str((pod["metadata"].get("annotations") or {}).get(COMPLETION_INDEX, ""))
    return int(text) if text.isdecimal() else None


def is_training_pod(pod: Mapping[str, Any]) -> bool:
    """A training pod that may still hold clocks (terminating ones do, until they are gone)."""
    labels = pod["metadata"].get("labels") or {}
    return labels.get(LABEL_ROLE) == "train" and (pod.get("status") or {}).get("phase") not in TERMINAL_PHASES


def pod_ceilings(pods: Iterable[Mapping[str, Any]], jobs: Mapping[str, CeilingJob]) -> dict[str, int]:
    """Pod UID → ceiling (MHz) of every live training pod of the jobs in `jobs` (by job UID, the
    operator's `job-uid` label, checked against the pod's namespace)."""
    out = {}
    for pod in pods:
        meta = pod["metadata"]
        job = jobs.get((meta.get("labels") or {}).get(LABEL_JOB_UID, ""))
        if job is not None and job.namespace == meta.get("namespace") and is_training_pod(pod):
            out[meta["uid"]] = pod_ceiling_mhz(job, node_rank_of(pod))
    return out


def bounded(ceilings: Mapping[str, int], limit: int = MAX_ENTRIES) -> dict[str, int]:
    """At most `limit` entries (the first by UID); the rest are logged, since they run unbounded."""
    if len(ceilings) <= limit:
        return dict(ceilings)
    kept = dict(sorted(ceilings.items())[:limit])
    log.error("%d training pods under the power budget, %d fit the clock-ceiling ConfigMap; %d run without "
              "a ceiling", len(ceilings), limit, len(ceilings) - limit)
    return kept


def ceilings_configmap(ceilings_mhz: Mapping[str, int], namespace: str, *, name: str = CONFIGMAP_NAME) -> dict[str, Any]:
    """The ConfigMap that gives each pod (by UID) its ceiling in MHz; a bad value is a ValueError
    naming the pod, since the agents would ignore it."""
    data = {}
    for pod_uid, mhz in sorted(ceilings_mhz.items()):
        if isinstance(mhz, bool) or not isinstance(mhz, int) or mhz <= 0:
            raise ValueError(f"clock ceiling of pod {pod_uid}: must be a whole number of MHz > 0, got {mhz!r}")
        data[pod_uid] = str(mhz)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "kareus"}},
            "data": data}


# ---------------------------------------------------------------------- the publisher


class CeilingPublisher:
    """Applies the ceilings ConfigMap `namespace/name` (an empty namespace: publishing is off)."""

    def __init__(self, kube: Kube, namespace: str, name: str = CONFIGMAP_NAME) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.published: dict[str, int] | None = None  # what the ConfigMap holds (None: not known yet)
        self.stale = False  # the last publish failed: the next pass (or the policy check) retries
        self._job_uids: set[str] = set()

    @property
    def enabled(self) -> bool:
        return bool(self.namespace)

    async def publish(self, jobs: Mapping[str, CeilingJob], namespaces: Sequence[str]) -> None:
        """The ceilings of the training pods of `jobs` (job UID → job) in the watched `namespaces`
        (none: every one); API failures are logged and leave the publisher `stale`."""
        if not self.enabled:
            return
        self._job_uids = set(jobs)
        try:
            if not jobs and self.published is None:
                self.published = await self._existing()  # after a restart: clear only what is there
            ceilings = bounded(pod_ceilings(await self._training_pods(namespaces), jobs)) if jobs else {}
            if ceilings != self.published:
                await self._apply(ceilings)
            self.stale = False
        except (ApiError, aiohttp.ClientError, TimeoutError) as error:
            self.stale = True
            log.warning("clock ceilings not published to ConfigMap %s/%s, retrying: %r", self.namespace, self.name,
                        error)

    def pod_event_matters(self, event: Mapping[str, Any]) -> bool:
        """Whether a pod watch event changes the published set: a live training pod of a job under
        an allotment that has no entry yet, or an entry whose pod is gone or finished."""
        if not self.enabled:
            return False
        pod = event.get("object") or {}
        meta = pod.get("metadata") or {}
        known = meta.get("uid") in (self.published or {})
        if event.get("type") == "DELETED" or not is_training_pod(pod):
            return known
        return not known and (meta.get("labels") or {}).get(LABEL_JOB_UID) in self._job_uids

    async def _training_pods(self, namespaces: Sequence[str]) -> list[dict[str, Any]]:
        pods: list[dict[str, Any]] = []
        for namespace in namespaces or (None,):
            pods += await self.kube.list(path("v1", "pods", namespace), label_selector=f"{LABEL_ROLE}=train")
        return pods

    async def _existing(self) -> dict[str, int] | None:
        cm = await self.kube.get(path("v1", "configmaps", self.namespace, self.name))
        return {} if cm is None or not cm.get("data") else None  # entries of unknown pods: rewrite them

    async def _apply(self, ceilings: dict[str, int]) -> None:
        body = ceilings_configmap(ceilings, self.namespace, name=self.name)
        await self.kube.request("PATCH", path("v1", "configmaps", self.namespace, self.name), body,
                                params={"fieldManager": FIELD_MANAGER, "force": "true"},
                                content_type="application/apply-patch+yaml")
        self.published = ceilings
        log.info("clock ceilings of %d training pods published to ConfigMap %s/%s", len(ceilings), self.namespace,
                 self.name)
