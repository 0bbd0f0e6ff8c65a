"""The operator's power-budget pass (`kareus_operator.power`) over an in-memory API: which jobs count,
what each job's reconcile writes (status.power, condition, Event, plan rollout), held jobs, and a
finished job's power going to the others. The allocator itself is tested in test_power_budget.py."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
from kareus_operator import power as pw
from kareus_operator.metrics import OperatorMetrics
from kareus_operator.reconcile import _Pass, plan_data, plan_text
from kareus_operator.settings import ANNOTATION_PLAN_REVISION
from optimizer_fixtures import small_plan

from kareus.plan import Plan
from kareus.policy import ClusterPolicy, PowerBudget
from kareus.power_budget import PowerJob, allocate, plan_power_limited_points
from kareus.spec import parse_job

JOBS = "/apis/kareus.dev/v1alpha1/namespaces/team/kareusjobs"


class MemoryKube:
    """get/list/merge_patch over a dict of objects by path (enough for the power pass)."""

    def __init__(self) -> None:
        self.objects: dict[str, dict] = {}
        self.version = 0

    def put(self, url: str, body: dict) -> None:
        self.version += 1
        body["metadata"]["resourceVersion"] = str(self.version)
        self.objects[url] = body

    async def get(self, url: str):
        return copy.deepcopy(self.objects.get(url))

    async def list(self, url: str, label_selector=None, **_):
        return [copy.deepcopy(o) for u, o in self.objects.items() if u.rsplit("/", 1)[0] == url]

    async def merge_patch(self, url: str, patch: dict):
        body = self.objects[url]
        for key, value in patch.items():
            if isinstance(value, dict) and isinstance(body.get(key), dict):
                merged = {**body[key], **value}
                body[key] = {k: v for k, v in merged.items() if v is not None}
                for k, v in value.items():  # one level deeper (metadata.annotations)
                    if isinstance(v, dict) and isinstance(body[key].get(k), dict):
                        body[key][k] = {**self.objects[url][key].get(k, {}), **v}
            else:
                body[key] = value
        self.put(url, body)
        return copy.deepcopy(body)


def manifest(name: str, objective: dict | None = None, *, created: str = "2025-01-01T00:00:00Z",
             started: bool = True, phase_conditions: tuple = ("Planned",)) -> dict:
    conditions = [{"type": c, "status": "True", "reason": "x", "message": ""} for c in phase_conditions]
    status = {"conditions": conditions, "phase": "Training", "objective": ""}
    if started:
        status["trainingStartTime"] = "2025-01-01T00:01:00Z"
    return {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob",
            "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}", "generation": 1,
                         "creationTimestamp": created},
            "spec": {"model": {"preset": "tiny"}, "sequenceLength": 64,
                     "parallelism": {"tensor": 2, "pipeline": 1, "context": 1, "data": 1, "microBatchSize": 4,
                                     "numMicroBatches": 2},
                     "objective": objective or {"maxThroughput": {}},
                     "training": {"image": "x", "steps": 100, "gpusPerNode": 2, "nodes": 1},
                     "gpu": {"product": "A100-SXM4-40GB"}, "profiling": {"backend": "sim"}},
            "status": status}


@pytest.fixture(scope="module")
def plan() -> Plan:
    return small_plan()


def powers(plan: Plan) -> list[float]:
    return [r.energy_j / r.time_s for r in plan.frontier.rows]


def plan_configmap(name: str, plan: Plan) -> dict:
    """A job's plan ConfigMap as the operator creates it (manifests.job_configmap: its ownerReference
    and job-uid label) and the optimize pod fills it."""
    return {"metadata": {"name": f"{name}-plan", "namespace": "team",
                         "labels": {"kareus.dev/job-name": name, "kareus.dev/job-uid": f"uid-{name}"},
                         "ownerReferences": [{"uid": f"uid-{name}", "controller": True}]},
            **plan_data(plan.to_json())}


def setup(plan: Plan, budget_w: float, jobs: list[dict]) -> tuple[MemoryKube, pw.PowerAllocator, list]:
    kube = MemoryKube()
    for job in jobs:
        name = job["metadata"]["name"]
        kube.put(f"{JOBS}/{name}", job)
        kube.put(f"/api/v1/namespaces/team/configmaps/{name}-plan", plan_configmap(name, plan))
    budget = PowerBudget(cluster_w=budget_w)

    async def policy():
        return ClusterPolicy(power_budget=budget)

    allocator = pw.PowerAllocator(kube, policy, OperatorMetrics(), namespaces=("team",))
    woken: list = []
    allocator.on_change = woken.append
    return kube, allocator, woken


async def reconcile(kube: MemoryKube, allocator: pw.PowerAllocator, name: str) -> tuple[_Pass, bool]:
    """What `Reconciler._train` does with the allocator: apply, then write the status. A job not yet
    planned in the API becomes planned in this pass (as `_optimize` then `_train` do in one pass)."""
    job = await kube.get(f"{JOBS}/{name}")
    p = _Pass(job, now=1.0e9)
    if not pw.eligible(job):
        p.want("Planned", True, "Optimized")
    spec = parse_job({k: job[k] for k in ("apiVersion", "kind", "metadata", "spec")}).spec
    held = await allocator.apply(p, spec, started=bool(job["status"].get("trainingStartTime")))
    p.status["conditions"] = p.conditions
    kube.objects[f"{JOBS}/{name}"]["status"] = p.status
    kube.put(f"{JOBS}/{name}", kube.objects[f"{JOBS}/{name}"])
    return p, held


def stored_row(kube: MemoryKube, name: str) -> int:
    cm = kube.objects[f"/api/v1/namespaces/team/configmaps/{name}-plan"]
    return Plan.loads(plan_text(cm)).selected_row


def test_pure_parts():
    job = manifest("a")
    assert pw.eligible(job) and pw.running(job)
    assert not pw.eligible(manifest("b", phase_conditions=("Planned", "Complete")))
    assert not pw.eligible(manifest("c", phase_conditions=("Planned", "Suspended")))
    assert not pw.eligible(manifest("d", phase_conditions=("Profiled",)))
    assert not pw.running(manifest("e", started=False))
    before = pw.signature(job["status"])
    assert pw.signature({**job["status"], "measured": {"iterations": 5}}) == before  # progress: no pass
    assert pw.signature({**job["status"], "objective": "timeBudget maxSlowdownPercent=5"}) != before
    order = pw.admission_order([manifest("z", created="2025-01-02T00:00:00Z"), manifest("y")])
    assert [j["metadata"]["name"] for j in order] == ["y", "z"]
    power = {"allottedWatts": 4000.0, "frontierRow": 3, "held": False, "feasible": True, "message": "",
             "budget": "cluster", "budgetWatts": 9000.0, "budgetPredictedWatts": 8500.0}
    assert pw.condition_of(power) == (True, "Allotted",
                                      "4000 W at frontier row 3; cluster budget: 8500 W of 9000 W predicted")
    assert pw.condition_of({**power, "held": True})[:2] == (False, "Held")
    assert pw.condition_of({**power, "feasible": False, "message": "over by 5 W"})[1] == "PowerBudgetExceeded"
    assert pw.same_allotment(power, {**power, "allottedWatts": 4000.01, "message": "other words"})
    assert not pw.same_allotment(power, {**power, "frontierRow": 4})


async def test_three_jobs_a_deadline_a_held_job_and_a_finished_one(plan):
    p_w = powers(plan)
    fastest_w = p_w[0]
    assert plan.frontier.rows[0].time_s == min(r.time_s for r in plan.frontier.rows)
    budget_w = 0.85 * 3 * fastest_w  # below the three jobs' max-throughput power
    deadline = {"timeBudget": {"maxSlowdownPercent": 3.0}}
    jobs = [manifest("a"), manifest("b"), manifest("late", deadline)]
    kube, allocator, woken = setup(plan, budget_w, jobs)

    allocation = await allocator.run_pass()
    assert allocation.feasible and allocation.total_power_w <= budget_w
    assert sorted(woken) == [("team", "a"), ("team", "b"), ("team", "late")]  # no status.power yet
    for name in ("a", "b", "late"):
        p, held = await reconcile(kube, allocator, name)
        allotment = allocation.get(f"team/{name}")
        assert not held and p.status["power"]["frontierRow"] == allotment.row == stored_row(kube, name)
        assert p.status["power"]["allottedWatts"] == pytest.approx(p_w[allotment.row], rel=1e-6)
        assert p.status["plan"]["predictedIterationSeconds"] == plan.frontier.rows[allotment.row].time_s
        assert pw.condition_of(p.status["power"])[1] == "Allotted"
        assert ("Normal", "PowerAllotted") in [(t, r) for t, r, _ in p.events]
    # The deadline job keeps a point within 3 % of its fastest; the others make room.
    late = allocation.get("team/late")
    assert plan.frontier.rows[late.row].time_s <= 1.03 * plan.frontier.rows[0].time_s
    assert late.meets_objective
    cm = kube.objects["/api/v1/namespaces/team/configmaps/a-plan"]
    assert cm["metadata"]["annotations"][ANNOTATION_PLAN_REVISION] == "2"

    # A reconcile that changes nothing rolls nothing out and posts no Event.
    p, _ = await reconcile(kube, allocator, "a")
    assert p.events == []

    # A new job the budget cannot fit is held: no training Job, a False condition, a Warning.
    kube.put(f"{JOBS}/new", manifest("new", created="2025-01-03T00:00:00Z", started=False, phase_conditions=("Profiled",)))
    kube.put("/api/v1/namespaces/team/configmaps/new-plan", plan_configmap("new", plan))
    p, held = await reconcile(kube, allocator, "new")
    assert held and p.status["power"]["held"] and p.status["power"]["allottedWatts"] == 0.0
    assert {c["type"]: (c["status"], c["reason"]) for c in p.conditions}["PowerAllotted"] == ("False", "Held")
    assert ("Warning", "PowerHeld") in [(t, r) for t, r, _ in p.events]
    assert allocator.metrics.power_held._value.get() == 1

    # One job finishes: the next pass gives its power to the others (and admits the held one when it fits).
    before = {n: allocator.allocation.get(f"team/{n}").power_w for n in ("a", "b", "late")}
    kube.objects[f"{JOBS}/a"]["status"]["conditions"].append({"type": "Complete", "status": "True", "reason": "x"})
    kube.objects[f"{JOBS}/new"]["metadata"]["deletionTimestamp"] = "2025-01-04T00:00:00Z"  # and the new one goes
    woken.clear()
    allocation = await allocator.run_pass()
    assert allocation.total_power_w <= budget_w
    assert {k for k in woken} >= {("team", "b"), ("team", "late")}
    for name in ("b", "late"):
        assert allocation.get(f"team/{name}").power_w >= before[name]
    assert sum(allocation.get(f"team/{n}").power_w for n in ("b", "late")) > before["b"] + before["late"]
    for name in ("b", "late"):
        p, _ = await reconcile(kube, allocator, name)
        assert stored_row(kube, name) == allocation.get(f"team/{name}").row


async def test_running_jobs_over_budget_keep_their_deadlines(plan):
    p_w = powers(plan)
    budget_w = 2.0 * min(p_w)  # cannot fit three running jobs even at their slowest points
    kube, allocator, _ = setup(plan, budget_w, [manifest("a"), manifest("b"),
                                                manifest("late", {"timeBudget": {"maxSlowdownPercent": 3.0}})])
    allocation = await allocator.run_pass()
    assert not allocation.feasible and not allocation.held
    p, held = await reconcile(kube, allocator, "late")
    assert not held and p.status["power"]["feasible"] is False
    assert pw.condition_of(p.status["power"])[1] == "PowerBudgetExceeded"
    assert plan.frontier.rows[p.status["power"]["frontierRow"]].time_s <= 1.03 * plan.frontier.rows[0].time_s


async def test_no_budget_no_power_status(plan):
    kube, allocator, _ = setup(plan, 1.0, [manifest("a")])

    async def no_budget():
        return ClusterPolicy()

    allocator._policy = no_budget
    p, held = await reconcile(kube, allocator, "a")
    assert not held and "power" not in p.status and stored_row(kube, "a") == plan.selected_row


# ------------------------------------------------------------------ power-limited points (issue 28)


@pytest.fixture(scope="module")
def laddered(plan) -> Plan:
    """The plan with the power-limited points `kareus optimize` stores (the simulated A100's
    power controller), through JSON as the ConfigMap carries it."""
    points = plan_power_limited_points(plan)
    return Plan.loads(replace(plan, power_limited_points=points).to_json())


def json_merge_patch(target: dict, patch: dict) -> dict:
    """RFC 7386, as the API server applies the controller's status patch: null deletes a key."""
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = json_merge_patch(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def test_power_job_offers_the_plans_power_limited_points(plan, laddered):
    job = manifest("a", {"timeBudget": {"maxSlowdownPercent": 3.0}})
    spec = parse_job({k: job[k] for k in ("apiVersion", "kind", "metadata", "spec")}).spec
    budget = PowerBudget(cluster_w=1.0)
    bare, full = pw.power_job(job, spec, plan, budget), pw.power_job(job, spec, laddered, budget)
    assert len(laddered.power_limited_points) > len(laddered.frontier.rows) // 2
    assert full.points[:len(bare.points)] == bare.points and all(p.power_limit_w is None for p in bare.points)
    limited = full.points[len(bare.points):]
    assert [(p.row, p.power_limit_w, p.time_s, p.energy_j) for p in limited] == [
        (p.row, p.power_limit_w, p.time_s, p.energy_j) for p in laddered.power_limited_points]
    # The objective's bounds and the normalisation stay the frontier's: a limited point is slower than its row.
    assert (full.max_time_s, full.fastest_time_s) == (bare.max_time_s, bare.fastest_time_s)


async def test_below_every_frontier_the_allocation_is_feasible_only_with_power_limits(laddered):
    low_w = min(powers(laddered))
    budget_w = 0.9 * 3 * low_w  # three running jobs, each below its frontier's least-power point
    _, allocator, _ = setup(laddered, budget_w, [manifest("a"), manifest("b"), manifest("c")])
    allocation = await allocator.run_pass()
    assert allocation.feasible and not allocation.held and allocation.total_power_w <= budget_w
    limited = [a for a in allocation.allotments if a.power_limit_w is not None]
    assert limited and all(a.power_w < low_w for a in limited)
    # Frontier rows alone (what the operator offered before) cannot meet this budget.
    rows_only = [PowerJob.from_plan(f"team/{n}", laddered) for n in "abc"]
    assert not allocate(rows_only, PowerBudget(cluster_w=budget_w)).feasible


async def test_a_power_limit_is_rolled_out_with_its_row_and_cleared_when_the_allotment_has_none(laddered):
    low_w = min(powers(laddered))
    budget = {"w": 0.9 * 3 * low_w}
    kube, allocator, _ = setup(laddered, budget["w"], [manifest("a"), manifest("b"), manifest("c")])

    async def policy():
        return ClusterPolicy(power_budget=PowerBudget(cluster_w=budget["w"])) if budget["w"] else ClusterPolicy()

    allocator._policy = policy
    allocation = await allocator.run_pass()
    limited = [a.name for a in allocation.allotments if a.power_limit_w is not None]
    assert limited, "no job got a power limit"
    name = limited[0].split("/")[1]
    allotment = allocation.get(f"team/{name}")
    p, held = await reconcile(kube, allocator, name)
    cm = kube.objects[f"/api/v1/namespaces/team/configmaps/{name}-plan"]
    rolled = Plan.loads(plan_text(cm))
    assert not held and rolled.selected_row == allotment.row and rolled.power_limit_w == allotment.power_limit_w
    assert cm["metadata"]["annotations"][ANNOTATION_PLAN_REVISION] == "2"
    # The plan predicts the limited point, slower and lower-power than its row alone.
    row = laddered.frontier.rows[allotment.row]
    assert (rolled.predicted.iteration_time_s, rolled.predicted.iteration_energy_j) == (allotment.time_s,
                                                                                       allotment.energy_j)
    assert rolled.predicted.iteration_time_s > row.time_s
    assert allotment.energy_j / allotment.time_s < row.energy_j / row.time_s
    assert rolled.power_limited_points == laddered.power_limited_points
    power = p.status["power"]
    assert power["powerLimitWatts"] == pytest.approx(allotment.power_limit_w) and power["frontierRow"] == allotment.row
    assert p.status["plan"]["predictedIterationSeconds"] == allotment.time_s
    assert f"under a {allotment.power_limit_w:.0f} W per-GPU power limit" in pw.condition_of(power)[2]
    reallocated = [m for _, r, m in p.events if r == "PlanReallocated"]
    assert reallocated and f"under a {allotment.power_limit_w:.0f} W per-GPU limit" in reallocated[0]
    assert not pw.same_allotment(power, {k: v for k, v in power.items() if k != "powerLimitWatts"})

    # The budget grows past the frontiers' low ends: the job's allotment is a frontier row, the limit goes.
    budget["w"] = 3 * max(powers(laddered))
    before = copy.deepcopy(kube.objects[f"{JOBS}/{name}"]["status"])
    p, _ = await reconcile(kube, allocator, name)
    allotment = allocator.allocation.get(f"team/{name}")
    # The controller merge-patches the status (handlers.py): the limit must leave status.power there too.
    written = json_merge_patch(before, {k: p.status.get(k) for k in set(before) | set(p.status)})
    assert allotment.power_limit_w is None and "powerLimitWatts" not in written["power"]
    assert written["power"]["frontierRow"] == allotment.row
    rolled = Plan.loads(plan_text(kube.objects[f"/api/v1/namespaces/team/configmaps/{name}-plan"]))
    assert rolled.power_limit_w is None and rolled.selected_row == allotment.row == 0
    assert rolled.predicted.iteration_time_s == laddered.frontier.rows[0].time_s
    assert kube.objects[f"/api/v1/namespaces/team/configmaps/{name}-plan"]["metadata"]["annotations"][
        ANNOTATION_PLAN_REVISION] == "3"

    # Limited again, then the budget is removed from the policy: the limit goes with it, the row stays.
    budget["w"] = 0.9 * 3 * low_w
    await reconcile(kube, allocator, name)
    limited_row = allocator.allocation.get(f"team/{name}")
    assert limited_row.power_limit_w is not None
    budget["w"] = 0
    p, held = await reconcile(kube, allocator, name)
    rolled = Plan.loads(plan_text(kube.objects[f"/api/v1/namespaces/team/configmaps/{name}-plan"]))
    assert not held and "power" not in p.status
    assert rolled.power_limit_w is None and rolled.selected_row == limited_row.row
