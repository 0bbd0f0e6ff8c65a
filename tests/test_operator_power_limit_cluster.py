"""A power budget below a job's frontier on the real cluster: the operator allots a power-limited point.

An operator release (fake phases) whose plan carries the power-limited points `kareus optimize`
stores, and a policy `powerBudget` below the job's least-power frontier row. The job's
`status.power` names the per-GPU limit the allocator gives it (what `kareus.power_budget.allocate`
gives over the frontier rows and those points), its plan ConfigMap carries that `power_limit_w` and
the limited point's prediction, and its training pod reads the allotted row. Raising the budget
past the frontier rolls a frontier row out again, the limit cleared.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml
from kareus_operator import manifests as mf
from kareus_operator.kube import Kube, load_kubeconfig, path
from kareus_operator.reconcile import plan_text
from operator_fakes import conditions, settings_env
from optimizer_fixtures import small_plan
from test_operator_lifecycle import JOBS_API, fake_job
from test_operator_power_budget import until

from kareus.errors import KareusError
from kareus.plan import Plan
from kareus.policy import PowerBudget
from kareus.power_budget import PowerJob, PowerPoint, allocate, plan_power_limited_points

pytestmark = pytest.mark.timeout(600)
NS = "power-limit"


def expected(plan: Plan, budget_w: float):
    """The allotment the operator should compute for the one running job (`power_job`'s points)."""
    job = PowerJob.from_plan(f"{NS}/limited", plan, objective={"maxThroughput": {}}, steps=8)
    limited = tuple(PowerPoint(p.row, p.time_s, p.energy_j, p.power_limit_w) for p in plan.power_limited_points)
    return allocate([replace(job, points=job.points + limited)], PowerBudget(cluster_w=budget_w)).get(f"{NS}/limited")


async def test_a_budget_below_the_frontier_rolls_out_a_power_limit(dev_cluster, tmp_path):
    plan = small_plan()
    plan = replace(plan, power_limited_points=plan_power_limited_points(plan))
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    power_w = [r.energy_j / r.time_s for r in plan.frontier.rows]
    budget_w = round(0.9 * min(power_w))  # below the job's least-power frontier row
    want = expected(plan, budget_w)
    assert want.power_limit_w is not None and want.power_w <= budget_w
    try:
        objects = dev_cluster.install_operator(
            "power-limit", "power-limit-system", watch_namespaces=[NS],
            settings=settings_env(tmp_path, step_s=0.2, steps=100_000, plan_file=plan_file),
            policy={"powerBudget": {"watts": budget_w}})
    except KareusError:  # why the operator did not start: its last run's log
        logs = dev_cluster.kubectl("logs", "-n", "power-limit-system", "deployment/power-limit-kareus-operator",
                                   "--previous", "--tail=80", check=False)
        print("operator log:", logs.stdout[-8000:], logs.stderr[-1000:])
        raise
    policy_cm = path("v1", "configmaps", "power-limit-system", "power-limit-kareus-policy")
    job_url = path(JOBS_API, "kareusjobs", NS, "limited")
    cm_url = path("v1", "configmaps", NS, mf.plan_configmap_name("limited"))
    try:
        async with Kube(load_kubeconfig(dev_cluster.kubeconfig)) as kube:
            await kube.request("POST", path(JOBS_API, "kareusjobs", NS), fake_job("limited", namespace=NS))

            async def rolled_out(row: int, limit_w: float | None) -> bool:
                job = await kube.get(job_url)
                power = ((job or {}).get("status") or {}).get("power") or {}
                if power.get("frontierRow") != row or power.get("powerLimitWatts") != limit_w:
                    return False
                cm = await kube.get(cm_url)
                stored = Plan.loads(plan_text(cm)) if cm else None
                ran = tmp_path / "limited.row"
                return (stored is not None and stored.selected_row == row and stored.power_limit_w == limit_w
                        and ran.exists() and ran.read_text() == str(row))

            await until(lambda: rolled_out(want.row, want.power_limit_w),
                        what=f"row {want.row} under {want.power_limit_w} W per GPU")
            job = await kube.get(job_url)
            power = job["status"]["power"]
            assert power["allottedWatts"] == pytest.approx(want.power_w, rel=1e-6) and power["allottedWatts"] <= budget_w
            assert power["feasible"] is True and power["held"] is False
            assert conditions(job)["PowerAllotted"] == ("True", "Allotted")
            stored = Plan.loads(plan_text(await kube.get(cm_url)))
            row = plan.frontier.rows[want.row]
            assert stored.predicted.iteration_time_s == want.time_s > row.time_s  # the limited point, slower
            assert job["status"]["plan"]["predictedIterationSeconds"] == want.time_s
            print(f"budget {budget_w} W (least-power row {min(power_w):.0f} W): row {want.row} under "
                  f"{want.power_limit_w} W per GPU, {power['allottedWatts']:.0f} W, {want.time_s:.4f} s/iteration")

            # Room for the fastest row: a frontier row again, the limit cleared in the plan.
            policy = yaml.safe_load((await kube.get(policy_cm))["data"]["policy.yaml"])
            policy["powerBudget"] = {"watts": round(2 * power_w[0])}
            await kube.merge_patch(policy_cm, {"data": {"policy.yaml": yaml.safe_dump(policy)}})
            await until(lambda: rolled_out(0, None), what="row 0 without a power limit")
    finally:
        (tmp_path / "limited.finish").write_text("")
        dev_cluster.uninstall(objects)
