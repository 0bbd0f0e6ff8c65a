"""The operator's KareusEnergyLedger store against the real kube-apiserver (the session's control plane,
the repository's CRD): records survive the writer, concurrent writers lose no update (resourceVersion
preconditions), a damaged ledger is never overwritten, a resync drops the meters of deleted jobs but
keeps their energy, and a month that ends closes into the history."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pytest
from kareus_devcluster.controlplane import wait_crd_established
from kareus_operator.energy_ledgers import API_VERSION, PLURAL, EnergyLedgers
from kareus_operator.kube import Kube, load_kubeconfig, path

from kareus.policy import load_policy

ROOT_CRD = "crds/kareusenergyledger.yaml"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ledger_crd(kubectl):
    from crd_server import ROOT
    kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=test", "-f", str(ROOT / ROOT_CRD))
    wait_crd_established(kubectl, "kareusenergyledgers.kareus.dev", 60)


def a_job(uid: str, name: str, namespace: str, energy_j: float, redone_j: float = 0.0) -> dict:
    return {"metadata": {"uid": uid, "name": name, "namespace": namespace},
            "status": {"measured": {"energyJoules": energy_j, "redoneJoules": redone_j}}}


class Clock:
    def __init__(self, at: datetime) -> None:
        self.at = at

    def __call__(self) -> datetime:
        return self.at


async def store(control_plane, clock: Clock, budgets) -> tuple[Kube, EnergyLedgers]:
    kube = await Kube(load_kubeconfig(control_plane.admin.kubeconfig)).__aenter__()
    policy = load_policy({"namespaceEnergyBudgets": budgets})

    async def current_policy():
        return policy

    return kube, EnergyLedgers(kube, current_policy, clock)


async def test_records_from_concurrent_writers_all_count_and_outlive_them(control_plane, ledger_crd, namespace):
    clock = Clock(datetime(2026, 12, 31, 23, 0, tzinfo=UTC))
    budgets = {namespace: {"kwh": 1.0, "period": "month"}}
    (kube_a, a), (kube_b, b) = await store(control_plane, clock, budgets), await store(control_plane, clock, budgets)
    try:
        # Two operators (a handover) record ten jobs each at once: every joule is counted once.
        await asyncio.gather(*(writer.record(a_job(f"{tag}{i}", f"{tag}{i}", namespace, 100.0 * (i + 1)))
                               for tag, writer in (("a", a), ("b", b)) for i in range(10)))
        stored = await kube_a.get(path(API_VERSION, PLURAL, None, namespace))
        assert stored["status"]["usedJoules"] == 2 * 100.0 * sum(range(1, 11))
        assert len(stored["status"]["jobs"]) == 20 and stored["status"]["budgetKilowattHours"] == 1.0
        # A job's counter that grows is charged the difference; redone steps count as spent.
        await a.record(a_job("a0", "a0", namespace, 150.0, redone_j=25.0))
        # A deleted job's final record drops its meter, not its energy.
        await b.record(a_job("b0", "b0", namespace, 100.0), gone=True)
        status = (await kube_b.get(path(API_VERSION, PLURAL, None, namespace)))["status"]
        assert status["usedJoules"] == 11000.0 + 75.0
        assert {j["uid"] for j in status["jobs"]} == {f"a{i}" for i in range(10)} | {f"b{i}" for i in range(1, 10)}
        # A new writer (an operator restart) reads what is stored; a resync forgets the jobs that are gone.
        kube_c, c = await store(control_plane, clock, budgets)
        await c.sync(namespace, jobs=[a_job("a1", "a1", namespace, 200.0)])
        status = (await kube_c.get(path(API_VERSION, PLURAL, None, namespace)))["status"]
        assert status["usedJoules"] == 11075.0 and [j["uid"] for j in status["jobs"]] == ["a1"]
        assert (await c.standing(namespace)).used_kwh == pytest.approx(11075.0 / 3.6e6)
        # The month ends: the used energy closes into the history, the new month starts at zero.
        clock.at = datetime(2027, 1, 1, 0, 0, 5, tzinfo=UTC)
        await c.record(a_job("a1", "a1", namespace, 260.0))
        status = (await kube_c.get(path(API_VERSION, PLURAL, None, namespace)))["status"]
        assert status["usedJoules"] == 60.0 and status["periodStart"] == "2027-01-01T00:00:00Z"
        assert status["history"] == [{"start": "2026-12-01T00:00:00Z", "end": "2027-01-01T00:00:00Z", "joules": 11075.0}]
        assert status["lifetimeJoules"] == 11135.0
        await kube_c.__aexit__(None, None, None)
    finally:
        await kube_a.__aexit__(None, None, None)
        await kube_b.__aexit__(None, None, None)


async def test_a_damaged_ledger_is_left_as_stored(control_plane, ledger_crd, namespace, caplog):
    clock = Clock(datetime(2026, 12, 2, tzinfo=UTC))
    kube, ledgers = await store(control_plane, clock, {namespace: 1})
    try:
        await ledgers.record(a_job("u", "j", namespace, 500.0))
        stored = await kube.get(path(API_VERSION, PLURAL, None, namespace))
        # Someone with cluster rights writes what the schema allows but the ledger cannot read: a period
        # with a start and no end.
        await kube.merge_patch(path(API_VERSION, PLURAL, None, namespace, "status"),
                               {"status": {"periodStart": "2026-12-01T00:00:00Z"}})
        before = await kube.get(path(API_VERSION, PLURAL, None, namespace))
        await ledgers.record(a_job("u", "j", namespace, 900.0))
        after = await kube.get(path(API_VERSION, PLURAL, None, namespace))
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
        assert "the ledger is left as stored, not overwritten" in caplog.text
        assert json.dumps(after["status"]["usedJoules"]) == json.dumps(stored["status"]["usedJoules"])
    finally:
        await kube.__aexit__(None, None, None)
