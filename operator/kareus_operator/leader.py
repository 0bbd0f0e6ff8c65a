"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection does it.

With several operator replicas exactly one acts: the holder of the Lease. A candidate takes the
Lease only when it is free or when its record has not changed for a whole lease duration *as the
candidate observed it* (its own monotonic clock, so clock skew between nodes cannot hand the Lease
over early). The leader renews every `renew_s`; if it cannot renew within `lease_s` it has lost
the Lease and must stop acting at once — the operator exits and its pod restarts as a candidate.
On a clean shutdown the leader releases the Lease, so a rolling update hands over in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp

from kareus_operator.kube import ApiError, Kube, path

log = logging.getLogger(__name__)
LEASES = "coordination.k8s.io/v1"


def _now_micro() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class LeaseSettings:
    namespace: str
    name: str
    identity: str
    lease_s: float = 15.0
    renew_s: float = 5.0
    retry_s: float = 2.0


class LeaderElector:
    """`await acquire()` blocks until this process leads; `await hold(lost)` renews until stopped."""

    def __init__(self, kube: Kube, settings: LeaseSettings) -> None:
        self.kube, self.settings = kube, settings
        self._observed: tuple[str, float] | None = None  # (record's resourceVersion, when it was first seen)

    @property
    def _path(self) -> str:
        return path(LEASES, "leases", self.settings.namespace, self.settings.name)

    def _record(self, transitions: int, acquired: str | None = None) -> dict[str, Any]:
        s = self.settings
        return {"holderIdentity": s.identity, "leaseDurationSeconds": int(s.lease_s),
                "acquireTime": acquired or _now_micro(), "renewTime": _now_micro(), "leaseTransitions": transitions}

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this process holds the Lease afterwards."""
        s = self.settings
        lease = await self.kube.get(self._path)
        if lease is None:
            body = {"apiVersion": LEASES, "kind": "Lease", "metadata": {"name": s.name, "namespace": s.namespace},
                    "spec": self._record(0)}
            try:
                await self.kube.request("POST", path(LEASES, "leases", s.namespace), body)
            except ApiError as error:
                if error.code == 409:
                    return False  # another candidate created it first
                raise
            return True
        spec = lease.get("spec") or {}
        version = lease["metadata"]["resourceVersion"]
        if self._observed is None or self._observed[0] != version:
            self._observed = (version, time.monotonic())
        holder = spec.get("holderIdentity") or ""
        duration_s = float(spec.get("leaseDurationSeconds") or s.lease_s)
        mine = holder == s.identity
        expired = time.monotonic() - self._observed[1] > duration_s
        if holder and not mine and not expired:
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine else 1)
        lease["spec"] = self._record(transitions, spec.get("acquireTime") if mine else None)
        try:
            updated = await self.kube.request("PUT", self._path, lease)  # resourceVersion: optimistic lock
        except ApiError as error:
            if error.code == 409:
                return False
            raise
        self._observed = (updated["metadata"]["resourceVersion"], time.monotonic())
        return True

    async def acquire(self) -> None:
        announced = False
        while True:
            with contextlib.suppress(ApiError, aiohttp.ClientError, TimeoutError):
                if await self.try_acquire_or_renew():
                    log.info("leading as %s (Lease %s/%s)", self.settings.identity, self.settings.namespace,
                             self.settings.name)
                    return
            if not announced:
                log.info("waiting for the Lease %s/%s held by another replica", self.settings.namespace,
                         self.settings.name)
                announced = True
            await asyncio.sleep(self.settings.retry_s)

    async def hold(self, lost: asyncio.Event) -> None:
        """Renew every `renew_s`; set `lost` when no renewal succeeded for a lease duration."""
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.settings.renew_s)
            try:
                if await self.try_acquire_or_renew():
                    last_ok = time.monotonic()
                    continue
                log.error("the Lease was taken by another replica: stopping")
            except (ApiError, aiohttp.ClientError, TimeoutError) as error:
                if time.monotonic() - last_ok <= self.settings.lease_s:
                    log.warning("Lease renewal failed (%r); retrying", error)
                    continue
                log.error("could not renew the Lease for %.0f s: stopping", self.settings.lease_s)
            lost.set()
            return

    async def release(self) -> None:
        """Give the Lease up (a clean shutdown): the next candidate need not wait for it to expire."""
        with contextlib.suppress(ApiError, aiohttp.ClientError, TimeoutError):
            lease = await self.kube.get(self._path)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.settings.identity:
                lease["spec"] = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1,
                                 "renewTime": _now_micro()}
                await self.kube.request("PUT", self._path, lease)
