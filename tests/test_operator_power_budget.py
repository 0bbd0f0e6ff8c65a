"""The cluster power budget on the real cluster: an operator release (fake phases, a real plan with
a 22-point frontier) and policy `powerBudget` below three jobs' combined max-throughput power.

The allotments sum within the budget and are what `kareus.power_budget.allocate` gives for those
jobs; each job's plan ConfigMap holds its allotted row and its training pod reads that row; the
job with a time budget keeps a point meeting it; a fourth job the budget cannot fit is held (no
training Job); finishing one job gives its power to the other two.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from kareus_operator import manifests as mf
from kareus_operator.kube import Kube, load_kubeconfig, path
from kareus_operator.reconcile import plan_text
from operator_fakes import conditions, settings_env
from optimizer_fixtures import small_plan
from test_operator_lifecycle import JOBS_API, events_for, fake_job, wait_for

from kareus.plan import Plan
from kareus.policy import PowerBudget
from kareus.power_budget import PowerJob, allocate

pytestmark = pytest.mark.timeout(600)
NS = "power"
DEADLINE = {"timeBudget": {"maxSlowdownPercent": 3.0}}
OBJECTIVES = {"a": {"maxThroughput": {}}, "b": {"maxThroughput": {}}, "late": DEADLINE}


def expected(plan: Plan, budget_w: float, names: list[str]) -> dict[str, int]:
    """The rows the allocator gives these (running) jobs, computed here as the operator should."""
    jobs = [PowerJob.from_plan(f"{NS}/{n}", plan, objective=OBJECTIVES[n], steps=8) for n in names]
    allocation = allocate(jobs, PowerBudget(cluster_w=budget_w))
    return {n: allocation.get(f"{NS}/{n}").row for n in names}


async def plan_row(kube: Kube, name: str) -> int:
    cm = await kube.get(path("v1", "configmaps", NS, mf.plan_configmap_name(name)))
    return Plan.loads(plan_text(cm)).selected_row


async def until(check, timeout_s: float = 180.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never true: {what}")
        await asyncio.sleep(0.3)


async def test_power_budget_allots_holds_and_reallocates(dev_cluster, tmp_path):
    plan = small_plan()
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    rows = plan.frontier.rows
    power_w = [r.energy_j / r.time_s for r in rows]
    budget_w = round(0.85 * 3 * power_w[0])  # fastest point is row 0
    assert budget_w < 3 * max(power_w)
    objects = dev_cluster.install_operator(
        "power", "power-system", watch_namespaces=[NS],
        settings=settings_env(tmp_path, step_s=0.2, steps=100_000, plan_file=plan_file),
        policy={"powerBudget": {"watts": budget_w}})
    try:
        async with Kube(load_kubeconfig(dev_cluster.kubeconfig)) as kube:
            for name, objective in OBJECTIVES.items():
                job = fake_job(name, namespace=NS, objective=objective)
                await kube.request("POST", path(JOBS_API, "kareusjobs", NS), job)
            want = expected(plan, budget_w, list(OBJECTIVES))

            async def allotted(names, rows_wanted):
                for name in names:
                    job = await kube.get(path(JOBS_API, "kareusjobs", NS, name))
                    power = (job.get("status") or {}).get("power") or {}
                    if power.get("frontierRow") != rows_wanted[name] or not job["status"].get("trainingStartTime"):
                        return False
                    if await plan_row(kube, name) != rows_wanted[name]:
                        return False
                    ran = tmp_path / f"{name}.row"
                    if not ran.exists() or ran.read_text() != str(rows_wanted[name]):
                        return False  # the training pod has not read its allotted row yet
                return True

            await until(lambda: allotted(OBJECTIVES, want), what=f"allotted rows {want}")
            jobs = {n: await kube.get(path(JOBS_API, "kareusjobs", NS, n)) for n in OBJECTIVES}
            watts = {n: j["status"]["power"]["allottedWatts"] for n, j in jobs.items()}
            assert sum(watts.values()) <= budget_w
            assert sum(watts.values()) < 3 * power_w[0]  # somebody runs below max throughput
            for name, job in jobs.items():
                power = job["status"]["power"]
                assert power["allottedWatts"] == pytest.approx(power_w[want[name]], rel=1e-6)
                assert power["held"] is False and power["feasible"] is True and power["budget"] == "cluster"
                assert power["budgetWatts"] == budget_w
                assert conditions(job)["PowerAllotted"] == ("True", "Allotted")
                assert job["status"]["plan"]["predictedIterationSeconds"] == rows[want[name]].time_s
            # The time-budget job keeps a point within 3 % of its fastest.
            assert rows[want["late"]].time_s <= 1.03 * rows[0].time_s and jobs["late"]["status"]["power"]["meetsObjective"]
            assert "PowerAllotted" in await events_for(kube, NS, "a")
            print(f"budget {budget_w} W; allotted {watts} (rows {want}); max-throughput {power_w[0]:.0f} W each")

            # A fourth job cannot fit even at its slowest point: held, no training Job.
            await kube.request("POST", path(JOBS_API, "kareusjobs", NS), fake_job("extra", namespace=NS))
            held = await wait_for(kube, NS, "extra", lambda j: j is not None and conditions(j).get(
                "PowerAllotted") == ("False", "Held"))
            assert held["status"]["power"]["held"] is True and not held["status"].get("trainingStartTime")
            assert await kube.get(path("batch/v1", "jobs", NS, mf.train_job_name("extra"))) is None
            await kube.delete(path(JOBS_API, "kareusjobs", NS, "extra"))
            await wait_for(kube, NS, "extra", lambda j: j is None)

            # Job a finishes: its power goes to b and late.
            (tmp_path / "a.finish").write_text("")
            await wait_for(kube, NS, "a", lambda j: (j.get("status") or {}).get("phase") == "Succeeded")
            after = expected(plan, budget_w, ["b", "late"])
            await until(lambda: allotted(["b", "late"], after), what=f"re-allotted rows {after}")
            again = {n: (await kube.get(path(JOBS_API, "kareusjobs", NS, n)))["status"]["power"]["allottedWatts"]
                     for n in ("b", "late")}
            assert sum(again.values()) <= budget_w
            assert all(again[n] >= watts[n] for n in again) and sum(again.values()) > watts["b"] + watts["late"]
            print(f"after a finished: {again} (rows {after})")
    finally:
        for name in (*OBJECTIVES, "extra"):
            (tmp_path / f"{name}.finish").write_text("")
        dev_cluster.uninstall(objects)
