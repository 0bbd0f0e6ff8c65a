"""The cluster power budget on the real cluster: an operator release (fake phases, a real plan with
a 22-point frontier) and policy `powerBudget` below three jobs' combined max-throughput power.

The allotments sum within the budget and are what `kareus.power_budget.allocate` gives for those
jobs; each job's plan ConfigMap holds its allotted row and its training pod reads that row; the
job with a time budget keeps a point meeting it; a fourth job the budget cannot fit is held (no
training Job); finishing one job gives its power to the other two.

The budget holds at the node (`test_a_tight_budget_is_enforced_at_the_node`): a job under a budget
that fits only its slowest row gets, in the node agents' ConfigMap `kareus-node/kareus-clock-ceilings`,
that row's highest clock (1050 MHz) for its training pod, and the node agent refuses the pod a lock
at 1410 MHz while granting one at the ceiling.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from kareus_operator import clock_ceilings as cc
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


async def until(check, timeout_s: float = 180.0, what: str = "", why=None) -> None:
    """Poll `check` until true; a timeout names `what` and, when given, `why()` (what still lagged)."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never true: {what}" + (f"; last: {why()}" if why else ""))
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

            lag: dict[str, str] = {}

            async def allotted(names, rows_wanted):
                for name in names:
                    job = await kube.get(path(JOBS_API, "kareusjobs", NS, name))
                    status = job.get("status") or {}
                    power = status.get("power") or {}
                    if power.get("frontierRow") != rows_wanted[name] or not status.get("trainingStartTime"):
                        lag["why"] = (f"{name}: status.power {power}, phase {status.get('phase')}"
                                      + (f" ({status['lastFailure']})" if status.get("lastFailure") else ""))
                        return False
                    if (row := await plan_row(kube, name)) != rows_wanted[name]:
                        lag["why"] = f"{name}: the plan ConfigMap's row {row}"
                        return False
                    ran = tmp_path / f"{name}.row"
                    if not ran.exists() or ran.read_text() != str(rows_wanted[name]):
                        ran_row = ran.read_text() if ran.exists() else None
                        lag["why"] = f"{name}: the training pod still runs row {ran_row}"
                        return False  # the training pod has not read its allotted row yet
                return True

            await until(lambda: allotted(OBJECTIVES, want), what=f"allotted rows {want}", why=lambda: lag.get("why"))
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
            await until(lambda: allotted(["b", "late"], after), what=f"re-allotted rows {after}",
                        why=lambda: lag.get("why"))
            again = {n: (await kube.get(path(JOBS_API, "kareusjobs", NS, n)))["status"]["power"]["allottedWatts"]
                     for n in ("b", "late")}
            assert sum(again.values()) <= budget_w
            assert all(again[n] >= watts[n] for n in again) and sum(again.values()) > watts["b"] + watts["late"]
            print(f"after a finished: {again} (rows {after})")
    finally:
        for name in (*OBJECTIVES, "extra"):
            (tmp_path / f"{name}.finish").write_text("")
        dev_cluster.uninstall(objects)


CAP_NS = "power-cap"
CEILINGS = path("v1", "configmaps", "kareus-node", "kareus-clock-ceilings")


async def training_pod_uid(kube: Kube, namespace: str, name: str) -> str | None:
    """The UID of job `name`'s one running training pod."""
    pods = await kube.list(path("v1", "pods", namespace), label_selector=f"kareus.dev/job-name={name},kareus.dev/role=train")
    running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
    return running[0]["metadata"]["uid"] if len(running) == 1 else None


async def ceilings(kube: Kube) -> dict[str, str]:
    return dict(((await kube.get(CEILINGS)) or {}).get("data") or {})


async def test_a_tight_budget_is_enforced_at_the_node(dev_cluster, tmp_path):
    plan = small_plan()
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    slowest = len(plan.frontier.rows) - 1
    power_w = [r.energy_j / r.time_s for r in plan.frontier.rows]
    tight_w = round(power_w[slowest]) + 1  # one job at its slowest row, nothing faster
    assert power_w[slowest - 1] > tight_w
    low_mhz = max(cc.row_stage_clocks_mhz(plan, slowest))
    assert low_mhz == 1050 and max(cc.row_stage_clocks_mhz(plan, 0)) == 1410
    objects = dev_cluster.install_operator(
        "power-cap", "power-cap-system", watch_namespaces=[CAP_NS],
        settings=settings_env(tmp_path, step_s=0.2, steps=100_000, plan_file=plan_file),
        policy={"powerBudget": {"watts": tight_w}})
    try:
        async with Kube(load_kubeconfig(dev_cluster.kubeconfig)) as kube:
            await kube.request("POST", path(JOBS_API, "kareusjobs", CAP_NS), fake_job("capped", namespace=CAP_NS))

            async def at_row(row: int) -> bool:
                job = await kube.get(path(JOBS_API, "kareusjobs", CAP_NS, "capped"))
                power = ((job or {}).get("status") or {}).get("power") or {}
                ran = tmp_path / "capped.row"
                return power.get("frontierRow") == row and ran.exists() and ran.read_text() == str(row)

            await until(lambda: at_row(slowest), what=f"the job running its slowest row {slowest}")
            # The pod runs (it wrote its row) before the kubelet's status update says Running.
            await until(lambda: training_pod_uid(kube, CAP_NS, "capped"), timeout_s=60,
                        what="the training pod Running in the API")
            uid = await training_pod_uid(kube, CAP_NS, "capped")
            assert uid is not None

            async def ceiling_is(mhz: int) -> bool:
                return (await ceilings(kube)).get(uid) == str(mhz)

            await until(lambda: ceiling_is(low_mhz), what=f"pod {uid}'s clock ceiling {low_mhz} MHz")

            async def lock(clock_mhz: int) -> dict:
                """The training pod's own lock request through the node agent (operator_fakes)."""
                result = tmp_path / "capped.lock-result"
                result.unlink(missing_ok=True)
                (tmp_path / "capped.lock-request").write_text(str(clock_mhz))
                await until(lambda: asyncio.sleep(0, result.exists()), timeout_s=60,
                            what=f"the pod's lock at {clock_mhz} MHz")
                return json.loads(result.read_text())

            async def lock_eventually(clock_mhz: int, ok: bool) -> dict:
                """The agent reads the ceilings at most once per re-check: ask until its answer is `ok`."""
                deadline = time.monotonic() + 60
                while (answer := await lock(clock_mhz))["ok"] is not ok and time.monotonic() < deadline:
                    await asyncio.sleep(1.0)
                return answer

            refused = await lock_eventually(1410, ok=False)
            assert refused["ok"] is False and refused["code"] == "refused", refused
            assert f"above the clock ceiling {low_mhz} MHz" in refused["message"], refused
            granted = await lock(low_mhz)
            assert granted["ok"] is True and granted["gpus"], granted
            print(f"budget {tight_w} W: row {slowest}, ceiling {low_mhz} MHz; a lock at 1410 MHz: {refused['message']}")
    finally:
        (tmp_path / "capped.finish").write_text("")
        dev_cluster.uninstall(objects)
