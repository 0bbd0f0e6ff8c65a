"""kopf wiring: thin handlers that route events to the `Reconciler` and write its status.

- every KareusJob event reconciles that job, and a resync loop (one LIST per `resync_s`) every job
  — not kopf timers, which would put a finalizer on every job;
- events of pods and ConfigMaps labelled with a job name reconcile their job (children's changes
  drive progress without polling); they are watched with that label selector on the server, so
  the operator never reads the namespaces' other ConfigMaps and pods (kopf's label filters are
  client-side);
- the cluster power budget (`kareus_operator.power`): status changes that matter to it, deletions,
  the resync and training pods coming or going (their clock ceilings) request an allocation pass,
  whose changed allotments reconcile their jobs;
- a job's DELETED event forgets its metrics; the children go with the job through
  ownerReferences. There is no deletion handler, hence no finalizer: nothing has to happen
  before a job may go, so an uninstalled operator never blocks a job's (or its namespace's)
  deletion.

One job is reconciled by one task at a time (events arriving meanwhile collapse into one more
pass), always from a freshly read body, and
the status is written only when it changed — so the write's own watch event ends the loop.
kopf keeps its progress and diff-base under the `kareus.dev` prefix.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import aiohttp
import kopf

from kareus_operator import conditions as cond
from kareus_operator.admission_check import EnergyAdmissionCheck
from kareus_operator.clock_ceilings import CeilingPublisher
from kareus_operator.energy_ledgers import job_energy_j
from kareus_operator.kube import ApiError, Kube, path
from kareus_operator.metrics import OperatorMetrics
from kareus_operator.power import PowerAllocator, signature
from kareus_operator.reconcile import Reconciler
from kareus_operator.refusals import backoff_s
from kareus_operator.settings import LABEL_JOB, PREFIX, Settings

GROUP, VERSION, PLURAL = "kareus.dev", "v1alpha1", "kareusjobs"
_RETRY_S = 2.0
# The children whose changes drive a job: its phase Jobs, their pods, its ConfigMaps.
CHILD_KINDS = (("batch/v1", "jobs"), ("v1", "pods"), ("v1", "configmaps"))
log = logging.getLogger(__name__)
API_VERSION = f"{GROUP}/{VERSION}"


class Controller:
    """The operator's shared state for one process: client, reconciler, metrics, per-job locks."""

    def __init__(self, kube: Kube, settings: Settings, metrics: OperatorMetrics | None = None) -> None:
        self.kube, self.settings = kube, settings
        self.metrics = metrics or OperatorMetrics()
        self.reconciler = Reconciler(kube, settings, self.metrics)
        # The cluster power budget: passes over all jobs; each job's reconcile applies its allotment.
        self.power = PowerAllocator(kube, self.reconciler.policy, self.metrics, settings.watch_namespaces,
                                    ceilings=CeilingPublisher(kube, settings.clock_ceilings_namespace,
                                                              settings.clock_ceilings_configmap))
        self.power.on_change = self._spawn
        self.reconciler.power = self.power
        # Namespace energy ledgers (written on measurement, deletion and resync) and the Kueue
        # admission check that holds queued jobs for their budgets.
        self.ledgers = self.reconciler.ledgers
        self.ledgers.on_write = self.metrics.observe_ledger
        self.admission = EnergyAdmissionCheck(kube, self.ledgers, self.power, settings.watch_namespaces,
                                              check_name=settings.energy_admission_check,
                                              attach_to=settings.energy_admission_clusterqueues)
        self.reconciler.admission = self.admission
        self._running: set[tuple[str, str]] = set()
        self._dirty: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task] = set()
        # At most this many jobs are reconciled at once (a work queue, as controller-runtime's
        # MaxConcurrentReconciles); the others wait here instead of in the HTTP connection pool.
        self._slots = asyncio.Semaphore(settings.max_concurrent_reconciles)
        self._wakeups: dict[tuple[str, str], asyncio.TimerHandle] = {}
        # resourceVersion of each job's last status write: its own watch event needs no pass
        self._written: dict[tuple[str, str], str] = {}
        self._stalls: dict[tuple[str, str], int] = {}  # failed reconciles in a row (the backoff's exponent)

    async def reconcile(self, namespace: str, name: str, logger: logging.Logger | Any = None) -> None:
        """Reconcile one job; requests arriving while it runs collapse into one more pass.

        A burst (a watch re-list replays every pod, ConfigMap and job) thus costs one or two passes
        per job instead of one per event.
        """
        key = (namespace, name)
        if key in self._running:
            self._dirty.add(key)
            return
        self._running.add(key)
        try:
            while True:
                self._dirty.discard(key)
                async with self._slots:
                    try:
                        await self._reconcile_once(namespace, name)
                    except (ApiError, aiohttp.ClientError, TimeoutError) as error:
                        # The API is busy or restarting: look again soon rather than at the next resync.
                        (logger or log).warning("reconcile of %s/%s failed, retrying: %r", namespace, name, error)
                        self._wake_later(key, _RETRY_S)
                        return
                    except Exception as error:  # one job's fault must not reach the others
                        (logger or log).exception("reconcile of %s/%s raised; the job is marked Stalled", namespace, name)
                        await self._report_stalled(namespace, name, error)
                        return
                self._stalls.pop(key, None)
                if key not in self._dirty:
                    return
        finally:
            self._running.discard(key)

    async def _reconcile_once(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        job = await self.kube.get(path(API_VERSION, PLURAL, namespace, name))
        if job is None:
            self._forget(key)
            return
        outcome = await self.reconciler.reconcile(job)
        if outcome is None:
            return
        if outcome.delete_job:
            await self.kube.delete(path(API_VERSION, PLURAL, namespace, name))
            self.power.request()
            return
        old = job.get("status") or {}
        if outcome.status != old:
            patch = {k: outcome.status.get(k) for k in set(old) | set(outcome.status)}
            written = await self.kube.merge_patch(path(API_VERSION, PLURAL, namespace, name, "status"),
                                                  {"status": patch})
            if written is not None:
                self._written[key] = written["metadata"]["resourceVersion"]
                if job_energy_j(written) != job_energy_j(job):
                    await self._record_energy(written)
        if signature(old) != signature(outcome.status):
            # Entered/left Planned or Training, finished, suspended, new objective. Asked after the
            # write: a pass that listed the jobs before it landed would still count this one as it was.
            self.power.request()
        self.metrics.observe(job["metadata"]["uid"], outcome.status["phase"])
        self.metrics.observe_status(job, outcome.status)
        for type_, reason, message in outcome.events:
            await self._post_event(job, type_, reason, message)
        if outcome.requeue_s is not None:
            self._wake_later(key, outcome.requeue_s)

    async def _report_stalled(self, namespace: str, name: str, error: BaseException) -> None:
        """A reconcile that raised (a bug, or a job built to break it): the job says so in a
        `Stalled` condition and a Warning Event, and is tried again after a backoff, while every
        other job goes on. Writing that needs the job readable; when even that fails, the log is
        all there is, and the retry still comes."""
        key = (namespace, name)
        attempt = self._stalls.get(key, 0) + 1
        self._stalls[key] = attempt
        self._wake_later(key, backoff_s(attempt, self.settings.backoff_base_s))
        message = f"the operator could not reconcile this job: {type(error).__name__}: {error}"[:1024]
        try:
            job = await self.kube.get(path(API_VERSION, PLURAL, namespace, name))
            if job is None:
                return
            status = job.get("status") or {}
            old = cond.find(status.get("conditions") or [], "Stalled")
            conditions = cond.merge(status.get("conditions") or [], [cond.Want("Stalled", True, "ReconcileError", message)],
                                    now=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                                    generation=job["metadata"].get("generation", 1))
            await self.kube.merge_patch(path(API_VERSION, PLURAL, namespace, name, "status"),
                                        {"status": {"conditions": conditions}})
            if old is None or old.get("status") != "True" or old.get("message") != message:
                await self._post_event(job, "Warning", "ReconcileError", message)
        except Exception:  # the job may be what cannot be read
            log.exception("%s/%s: could not record the failed reconcile on the job", namespace, name)

    async def _post_event(self, job: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on the job, written directly: reconciles also run outside kopf's handler
        context (child watches, resync), where kopf.event has no queue to post to."""
        meta = job["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {"apiVersion": "v1", "kind": "Event",
                 "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                 "involvedObject": {"apiVersion": API_VERSION, "kind": "KareusJob", "name": meta["name"],
                                    "namespace": meta["namespace"], "uid": meta["uid"],
                                    "resourceVersion": meta.get("resourceVersion", "")},
                 "type": type_, "reason": reason, "message": message[:1024], "count": 1,
                 "firstTimestamp": now, "lastTimestamp": now, "source": {"component": "kareus-operator"},
                 "reportingComponent": "kareus.dev/operator",
                 "reportingInstance": os.environ.get("POD_NAME") or socket.gethostname()}
        try:
            await self.kube.request("POST", path("v1", "events", meta["namespace"]), event)
        except (ApiError, aiohttp.ClientError, TimeoutError) as error:
            log.warning("event %s on %s/%s not posted: %r", reason, meta["namespace"], meta["name"], error)

    def _wake_later(self, key: tuple[str, str], delay_s: float) -> None:
        """A precise re-check (backoff end, deadline, TTL) between resync ticks."""
        if delay_s >= self.settings.resync_s:
            return  # the resync timer comes first anyway
        old = self._wakeups.pop(key, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self._wakeups[key] = loop.call_later(delay_s, self._spawn, key)

    def _spawn(self, key: tuple[str, str]) -> None:
        task = asyncio.ensure_future(self.reconcile(*key))
        self._tasks.add(task)  # keep a reference until it is done
        task.add_done_callback(self._tasks.discard)

    def is_own_write(self, body: Mapping[str, Any]) -> bool:
        """The job as this operator's last status write left it: reconciling it again would only
        read what was just written."""
        meta = body["metadata"]
        return self._written.get((meta["namespace"], meta["name"])) == meta.get("resourceVersion")

    def _forget(self, key: tuple[str, str]) -> None:
        self._written.pop(key, None)
        handle = self._wakeups.pop(key, None)
        if handle is not None:
            handle.cancel()

    async def watch_children(self, namespaces: list[str]) -> None:
        """Reconcile a job when one of its labelled Jobs, pods or ConfigMaps changes."""
        await asyncio.gather(*(self._watch_children(api_version, plural, namespace)
                               for api_version, plural in CHILD_KINDS for namespace in namespaces or [None]))

    async def _watch_children(self, api_version: str, plural: str, namespace: str | None) -> None:
        while True:
            try:
                async for event in self.kube.watch_events(path(api_version, plural, namespace),
                                                          {"labelSelector": LABEL_JOB}):
                    meta = event["object"]["metadata"]
                    job = (meta.get("labels") or {}).get(LABEL_JOB)
                    if job:
                        self._spawn((meta["namespace"], job))
                    if plural == "pods":
                        self.power.pod_event(event)  # a training pod came or went: its clock ceiling
            except (ApiError, aiohttp.ClientError, TimeoutError, ValueError) as error:
                log.warning("watch of %s failed (%r); relisting", plural, error)
                await asyncio.sleep(_RETRY_S)

    async def resync_forever(self, namespaces: list[str]) -> None:
        """Every `resync_s`, reconcile every job (a safety net under the watch-driven passes)."""
        while True:
            await asyncio.sleep(self.settings.resync_s)
            for namespace in namespaces or [None]:
                try:
                    jobs = await self.kube.list(path(API_VERSION, PLURAL, namespace))
                except Exception as error:  # the resync outlives any list it cannot read
                    log.warning("resync: cannot list KareusJobs: %r", error)
                    continue
                for job in jobs:
                    self._spawn((job["metadata"]["namespace"], job["metadata"]["name"]))
            await self._sync_ledgers(namespaces)
            self.power.request()

    async def _sync_ledgers(self, namespaces: list[str]) -> None:
        """Roll the ledgers' periods, write their budgets, and drop the meters of jobs deleted while
        no operator watched: every watched namespace with a budget or a ledger."""
        try:
            policy = await self.reconciler.policy()
            known = set(await self.ledgers.namespaces())
        except Exception as error:  # no ledger CRD (an older chart): budgets fall back to nothing stored
            log.warning("resync: cannot list KareusEnergyLedgers: %r", error)
            return
        wanted = known | set(policy.namespace_energy_budgets_kwh)
        for namespace in sorted(wanted if not namespaces else wanted & set(namespaces)):
            try:
                await self.ledgers.sync(namespace)
            except Exception as error:
                log.warning("resync: ledger of %s not synced: %r", namespace, error)

    def forget_job(self, body: Mapping[str, Any]) -> None:
        # The deleted job's last status charges what it spent since its last record; its energy stays.
        task = asyncio.ensure_future(self._record_deleted(body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.admission.request()  # its promise on the namespace's budget is gone
        self.metrics.forget(body["metadata"]["uid"])
        self.power.request()  # its power goes to the others
        self._forget((body["metadata"]["namespace"], body["metadata"]["name"]))

    async def _record_energy(self, written: Mapping[str, Any]) -> None:
        """Charge what a job spent to its namespace's ledger, from the status just written."""
        try:
            await self.ledgers.record(written)
        except Exception as error:  # the next resync charges it from the stored status
            log.warning("ledger: %s/%s not recorded: %r", written["metadata"]["namespace"],
                        written["metadata"]["name"], error)

    async def _record_deleted(self, body: Mapping[str, Any]) -> None:
        try:
            await self.ledgers.record(body, gone=True)
        except Exception as error:  # the next resync drops the meter; what it spent since is lost
            log.warning("ledger: deleted job %s/%s not recorded: %r", body["metadata"]["namespace"],
                        body["metadata"]["name"], error)


def configure(settings: kopf.OperatorSettings, resync_s: float) -> None:
    settings.persistence.finalizer = f"{PREFIX}/finalizer"  # the name older versions added; kopf removes it
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration")
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 90
    settings.networking.request_timeout = 60
    settings.batching.idle_timeout = 1.0


def build_registry(controller: Controller) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def job_event(event: Mapping[str, Any], body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
        if event.get("type") == "DELETED":
            controller.forget_job(body)
            return
        if controller.is_own_write(body):
            return
        await controller.reconcile(body.metadata.namespace, body.metadata.name, logger)

    return registry
