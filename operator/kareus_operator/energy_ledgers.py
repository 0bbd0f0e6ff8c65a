"""The namespaces' energy ledgers in the cluster: one cluster-scoped `KareusEnergyLedger` per namespace.

A ledger (`kareus.energy_ledger.NamespaceLedger`, stored in the resource's status, named after the
namespace) outlives the jobs it counts and the operator that writes it, so a deleted job no longer
gives its energy back to the budget. Tenants cannot write it: it is cluster-scoped, and the chart
grants only the operator write access.

It is written by the leader only, from three places:

- a job's reconcile, when its measured energy changes, once that status has been written (`record`:
  the job's counter is `status.measured.energyJoules + redoneJoules`, which only grows within a
  run). Never before the write: a resync in between would charge the stored, smaller counter after
  the newer one, which reads as a restart and counts the stored energy twice;
- the job's DELETED event, with the job's last status (`record(..., gone=True)` then drops its meter);
- every resync (`sync`), which rolls periods over, writes each namespace's budget from the policy and
  drops the meters of jobs deleted while no operator was watching.

Each write is a merge patch of the status carrying the `resourceVersion` it was computed from, so
two writers (a handover between replicas) never lose an update: a conflict re-reads and retries.
A ledger whose stored status cannot be read is left as it is (logged), never overwritten.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from kareus.energy_ledger import (
    JOULES_PER_KWH,
    BudgetStanding,
    LedgerError,
    NamespaceLedger,
    rfc3339,
    standing,
)
from kareus.policy import ClusterPolicy
from kareus_operator.kube import ApiError, Kube, path

log = logging.getLogger(__name__)
API_VERSION = "kareus.dev/v1alpha1"
KIND, PLURAL = "KareusEnergyLedger", "kareusenergyledgers"
_CONFLICT_RETRIES = 50  # then the caller retries (a reconcile retries a failed pass)
_CONFLICT_BACKOFF_S = 0.05


def job_energy_j(job: Mapping[str, Any]) -> float:
    """Everything the job's GPUs spent training: the steps that count plus those a restart redid."""
    measured = (job.get("status") or {}).get("measured") or {}
    return float(measured.get("energyJoules") or 0.0) + float(measured.get("redoneJoules") or 0.0)


class EnergyLedgers:
    """Reads and writes the KareusEnergyLedger resources (see the module docstring)."""

    def __init__(self, kube: Kube, policy: Callable[[], Awaitable[ClusterPolicy]],
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.kube, self.policy, self.clock = kube, policy, clock
        self._locks: dict[str, asyncio.Lock] = {}
        # Called with each ledger as written and its budget (the operator's metrics).
        self.on_write: Callable[[NamespaceLedger, float | None], None] = lambda _ledger, _budget_kwh: None
        self._warned_missing = False

    def _lock(self, namespace: str) -> asyncio.Lock:
        return self._locks.setdefault(namespace, asyncio.Lock())

    async def read(self, namespace: str) -> NamespaceLedger:
        """The namespace's ledger as stored (an empty one when none is), rolled to the policy's
        current period. Raises LedgerError for a damaged one."""
        obj = await self.kube.get(path(API_VERSION, PLURAL, None, namespace))
        policy = await self.policy()
        ledger = NamespaceLedger.from_status(namespace, (obj or {}).get("status"))
        return ledger.at(self.clock(), policy.energy_period(namespace))

    async def standing(self, namespace: str, reserved_kwh: float = 0.0) -> BudgetStanding | None:
        """The namespace's budget against its ledger; None when the policy gives it no budget."""
        policy = await self.policy()
        budget_kwh = policy.energy_budget_kwh(namespace)
        if budget_kwh is None:
            return None
        ledger = await self.read(namespace)
        return standing(ledger, budget_kwh, policy.energy_period(namespace), self.clock(), reserved_kwh)

    async def record(self, job: Mapping[str, Any], *, gone: bool = False) -> None:
        """Charge what the job spent since its last record; `gone`: it was deleted (drop its meter)."""
        uid = job["metadata"]["uid"]

        def change(ledger: NamespaceLedger) -> NamespaceLedger:
            ledger = self._charge(ledger, job)
            return ledger.forget(set(ledger.meters_j) - {uid}) if gone else ledger

        await self._update(job["metadata"]["namespace"], change)

    async def sync(self, namespace: str, jobs: Iterable[Mapping[str, Any]] | None = None) -> None:
        """Roll the period, write the budget, charge every listed job and drop the meters of jobs
        that are gone. Lists the namespace's jobs itself (under the namespace's lock, so no record
        slips between the list and the forgetting) unless given them."""
        async with self._lock(namespace):
            listed = list(jobs) if jobs is not None else await self.kube.list(
                path(API_VERSION, "kareusjobs", namespace))

            def change(ledger: NamespaceLedger) -> NamespaceLedger:
                for job in listed:
                    ledger = self._charge(ledger, job)
                return ledger.forget(job["metadata"]["uid"] for job in listed)

            await self._update(namespace, change, locked=True)

    def _charge(self, ledger: NamespaceLedger, job: Mapping[str, Any]) -> NamespaceLedger:
        """The job's counter charged (a job that has spent nothing and has no meter gets none)."""
        meta, counter_j = job["metadata"], job_energy_j(job)
        if counter_j > 0 or meta["uid"] in ledger.meters_j:
            ledger = ledger.record(meta["uid"], meta["name"], counter_j, self.clock())
        return ledger

    async def namespaces(self) -> list[str]:
        """The namespaces that have a ledger."""
        return [obj["metadata"]["name"] for obj in await self.kube.list(path(API_VERSION, PLURAL))]

    async def _update(self, namespace: str, change: Callable[[NamespaceLedger], NamespaceLedger],
                      *, locked: bool = False) -> None:
        if not locked:
            async with self._lock(namespace):
                return await self._update(namespace, change, locked=True)
        try:
            await self._write(namespace, change)
        except ApiError as error:
            if error.code not in (403, 404):
                raise
            if not self._warned_missing:  # an older chart: no ledger CRD, or no right to it
                self._warned_missing = True
                log.warning("energy ledgers are not kept (%s): install the chart's KareusEnergyLedger CRD "
                            "and RBAC; namespace budgets count nothing until then", error)

    async def _write(self, namespace: str, change: Callable[[NamespaceLedger], NamespaceLedger]) -> None:
        for _ in range(_CONFLICT_RETRIES):
            obj = await self.kube.get(path(API_VERSION, PLURAL, None, namespace))
            policy = await self.policy()
            try:
                old = NamespaceLedger.from_status(namespace, (obj or {}).get("status"))
            except LedgerError as error:
                log.error("%s; the ledger is left as stored, not overwritten", error)
                return
            new = change(old.at(self.clock(), policy.energy_period(namespace)))
            status = ledger_status(new, policy.energy_budget_kwh(namespace), self.clock())
            if obj is not None and _same(obj.get("status"), status):
                self.on_write(new, policy.energy_budget_kwh(namespace))
                return
            if obj is None:
                # Created (by us or a writer racing us, who may have written its status already): recompute
                # from what is stored, never patch with what was computed from no ledger.
                await self.kube.create(path(API_VERSION, PLURAL), {
                    "apiVersion": API_VERSION, "kind": KIND,
                    "metadata": {"name": namespace, "labels": {"app.kubernetes.io/part-of": "kareus"}}})
                continue
            try:
                await self.kube.merge_patch(path(API_VERSION, PLURAL, None, namespace, "status"), {
                    "metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]}, "status": status})
            except ApiError as error:
                if error.code == 409:  # written meanwhile: recompute from what is stored now
                    await asyncio.sleep(random.uniform(0, _CONFLICT_BACKOFF_S))
                    continue
                raise
            self.on_write(new, policy.energy_budget_kwh(namespace))
            return
        raise ApiError(409, "Conflict", f"KareusEnergyLedger {namespace}: {_CONFLICT_RETRIES} conflicting writes in a row")


def ledger_status(ledger: NamespaceLedger, budget_kwh: float | None, now: datetime) -> dict[str, Any]:
    """The resource's status: the ledger plus the budget it is held to (fields a period or budget no
    longer has are written as null, which a merge patch removes)."""
    status: dict[str, Any] = {"periodStart": None, "periodEnd": None, **ledger.to_status(),
                              "budgetKilowattHours": budget_kwh, "remainingKilowattHours": None}
    if budget_kwh is not None:
        status["remainingKilowattHours"] = round(max(0.0, budget_kwh - ledger.period_energy_j / JOULES_PER_KWH), 6)
    status["updateTime"] = rfc3339(now)
    return status


def _same(stored: Mapping[str, Any] | None, status: Mapping[str, Any]) -> bool:
    """Equal but for the write time (and the nulls a stored status does not keep)."""
    def core(s: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in s.items() if k != "updateTime" and v is not None}
    return stored is not None and core(stored) == core(status)
