"""The per-pod clock ceilings the operator publishes for the node agents (`kareus_operator.clock_ceilings`):
the ceiling a frontier row allows a pod (per stage, or the whole row), which pods count, and the
allocation pass applying the ConfigMap — over an in-memory API, as test_operator_power.py runs it."""

from __future__ import annotations

import copy
import itertools

import pytest
from kareus_operator import clock_ceilings as cc
from kareus_operator import power as pw
from kareus_operator.kube import ApiError
from kareus_operator.metrics import OperatorMetrics
from kareus_operator.settings import Settings
from optimizer_fixtures import small_plan
from test_operator_power import JOBS, MemoryKube, manifest, plan_configmap, powers, reconcile

from kareus.errors import KareusError
from kareus.plan import Plan, plan_at_row
from kareus.policy import ClusterPolicy, PowerBudget
from kareus.runtime.parallel import Layout

CEILINGS = "/api/v1/namespaces/kareus-node/configmaps/kareus-clock-ceilings"
PODS = "/api/v1/namespaces/team/pods"


@pytest.fixture(scope="module")
def plan() -> Plan:
    return small_plan()  # TP 8 × PP 2 on 16 GPUs, clocks 1410/1230/1050 MHz; rows 0..26


def row_clocks(plan: Plan, row: int) -> list[int]:
    """The clocks row `row` uses per stage, read the long way: its instruction lists."""
    return [max(i.clock_mhz for i in stage.instructions) for stage in plan_at_row(plan, row).stages]


# ---------------------------------------------------------------------- pure parts


@pytest.mark.parametrize(("tp", "cp", "pp", "dp"), [(8, 1, 2, 1), (2, 2, 3, 2), (1, 1, 4, 2), (4, 1, 1, 3)])
def test_stage_of_rank_is_the_runtimes_pipeline_rank(plan, tp, cp, pp, dp):
    from dataclasses import replace

    job = replace(plan.job, tensor=tp, context=cp, pipeline=pp, data=dp)
    layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp)
    assert [cc.stage_of_rank(job, r) for r in range(layout.world_size)] == [
        layout.coords(r)[1] for r in range(layout.world_size)]


def test_a_rows_stage_clocks_are_the_highest_its_instructions_use(plan):
    rows = range(len(plan.frontier.rows))
    assert [list(cc.row_stage_clocks_mhz(plan, r)) for r in rows] == [row_clocks(plan, r) for r in rows]
    # The frontier runs from every stage at 1410 MHz down to every stage at 1050 MHz.
    assert cc.row_stage_clocks_mhz(plan, 0) == (1410, 1410)
    assert cc.row_stage_clocks_mhz(plan, len(rows) - 1) == (1050, 1050)
    assert (1230, 1410) in {cc.row_stage_clocks_mhz(plan, r) for r in rows}  # stages differ on some rows


def test_a_pod_gets_the_clock_of_its_own_stages_or_else_the_whole_row(plan):
    row = next(r for r in range(len(plan.frontier.rows)) if len(set(cc.row_stage_clocks_mhz(plan, r))) > 1)
    stage_mhz = cc.row_stage_clocks_mhz(plan, row)
    two_nodes = cc.CeilingJob("team", "uid", plan, row, gpus_per_node=8, nodes=2)  # one stage per node
    assert [cc.pod_ceiling_mhz(two_nodes, rank) for rank in (0, 1)] == list(stage_mhz)
    one_node = cc.CeilingJob("team", "uid", plan, row, gpus_per_node=16, nodes=1)  # both stages on it
    assert cc.pod_ceiling_mhz(one_node, 0) == max(stage_mhz)
    # Stage unknown: no completion index, a rank outside the job, GPUs that are not the plan's.
    assert cc.pod_ceiling_mhz(two_nodes, None) == cc.pod_ceiling_mhz(two_nodes, 2) == max(stage_mhz)
    assert cc.pod_ceiling_mhz(cc.CeilingJob("team", "uid", plan, row, 2, 1), 0) == max(stage_mhz)


def pod(name: str, job_uid: str, *, rank: int | None = 0, phase: str = "Running", role: str = "train",
        namespace: str = "team", deleting: bool = False) -> dict:
    meta = {"name": name, "namespace": namespace, "uid": f"pod-{name}",
            "labels": {"kareus.dev/role": role, "kareus.dev/job-uid": job_uid, "kareus.dev/job-name": name}}
    if rank is not None:
        meta["annotations"] = {cc.COMPLETION_INDEX: str(rank)}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase}}


def test_only_live_training_pods_of_allotted_jobs_in_their_namespace_count(plan):
    row = len(plan.frontier.rows) - 1
    jobs = {"uid-a": cc.CeilingJob("team", "uid-a", plan, row, 8, 2)}
    pods = [pod("a0", "uid-a"), pod("a1", "uid-a", rank=1, deleting=True),  # terminating: may still hold clocks
            pod("done", "uid-a", phase="Succeeded"), pod("failed", "uid-a", phase="Failed"),
            pod("prof", "uid-a", role="profile"), pod("other", "uid-b"),
            pod("elsewhere", "uid-a", namespace="team-b")]  # the job-uid label of a job in another namespace
    assert cc.pod_ceilings(pods, jobs) == {"pod-a0": 1050, "pod-a1": 1050}


def test_the_configmap_is_bounded_and_refuses_a_bad_value():
    many = {f"uid-{i:05d}": 1050 for i in range(10)}
    assert cc.bounded(many, limit=4) == {f"uid-{i:05d}": 1050 for i in range(4)}
    assert cc.bounded(many) == many
    body = cc.ceilings_configmap({"b": 1230, "a": 1050}, "kareus-node")
    assert body["metadata"] == {"name": "kareus-clock-ceilings", "namespace": "kareus-node",
                                "labels": {"app.kubernetes.io/part-of": "kareus"}}
    assert list(body["data"].items()) == [("a", "1050"), ("b", "1230")]
    with pytest.raises(ValueError, match="clock ceiling of pod a: must be a whole number of MHz > 0"):
        cc.ceilings_configmap({"a": 0}, "kareus-node")
    # What the agent parses back is what was published.
    ceilings = pytest.importorskip("kareus_node.ceilings")
    assert ceilings.parse_ceilings(body["data"], "test") == {"a": 1050, "b": 1230}


def test_settings_name_where_the_ceilings_go():
    assert Settings.from_env({}).clock_ceilings_namespace == ""  # off unless told (the chart tells it)
    settings = Settings.from_env({"KAREUS_OPERATOR_CLOCK_CEILINGS_NAMESPACE": "gpu-system",
                                  "KAREUS_OPERATOR_CLOCK_CEILINGS_CONFIGMAP": "ceilings"})
    assert (settings.clock_ceilings_namespace, settings.clock_ceilings_configmap) == ("gpu-system", "ceilings")
    with pytest.raises(KareusError, match="KAREUS_OPERATOR_CLOCK_CEILINGS_NAMESPACE: must be a namespace name"):
        Settings.from_env({"KAREUS_OPERATOR_CLOCK_CEILINGS_NAMESPACE": "Kareus_Node"})
    with pytest.raises(KareusError, match="KAREUS_OPERATOR_CLOCK_CEILINGS_CONFIGMAP: must be a ConfigMap name"):
        Settings.from_env({"KAREUS_OPERATOR_CLOCK_CEILINGS_CONFIGMAP": "a/b"})


# ---------------------------------------------------------------------- the allocation pass publishes


class ApplyKube(MemoryKube):
    """MemoryKube plus what the publisher does: list pods by label, server-side apply (each apply
    holds all of the manager's keys, so it replaces `data`), and failures on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.applies: list[dict] = []
        self.fail_apply = False

    async def list(self, url: str, label_selector=None, **_):
        items = await super().list(url)
        if label_selector:
            key, _, value = label_selector.partition("=")
            items = [o for o in items if (o["metadata"].get("labels") or {}).get(key) == value]
        return items

    async def request(self, method: str, url: str, body=None, *, params=None, content_type=None):
        assert (method, content_type) == ("PATCH", "application/apply-patch+yaml")
        assert params == {"fieldManager": "kareus-operator", "force": "true"}
        if self.fail_apply:
            raise ApiError(403, "Forbidden", "configmaps is forbidden")
        self.applies.append(copy.deepcopy(body))
        old = self.objects.get(url, {})
        self.put(url, {**copy.deepcopy(body), "metadata": {**old.get("metadata", {}), **body["metadata"]}})
        return copy.deepcopy(self.objects[url])

    def ceilings(self) -> dict[str, str]:
        return dict((self.objects.get(CEILINGS) or {}).get("data") or {})


def allocator_for(plan: Plan, jobs: list[dict], budget: list[PowerBudget]) -> tuple[ApplyKube, pw.PowerAllocator]:
    kube = ApplyKube()
    for job in jobs:
        name = job["metadata"]["name"]
        kube.put(f"{JOBS}/{name}", job)
        kube.put(f"/api/v1/namespaces/team/configmaps/{name}-plan", plan_configmap(name, plan))

    async def policy():
        return ClusterPolicy(power_budget=budget[0])

    publisher = cc.CeilingPublisher(kube, "kareus-node")
    allocator = pw.PowerAllocator(kube, policy, OperatorMetrics(), namespaces=("team",), ceilings=publisher)
    allocator.on_change = lambda key: None
    return kube, allocator


def put_pod(kube: ApplyKube, body: dict) -> None:
    kube.put(f"{PODS}/{body['metadata']['name']}", body)


def two_stage_job(name: str, **kwargs) -> dict:
    """A job whose spec runs the plan's 16 GPUs as 2 nodes × 8: node rank r runs stage r."""
    job = manifest(name, **kwargs)
    job["spec"]["model"] = {"preset": "llama3.2-3b"}
    job["spec"]["parallelism"].update(tensor=8, pipeline=2)
    job["spec"]["training"].update(gpusPerNode=8, nodes=2)
    return job


async def test_the_pass_publishes_each_training_pods_ceiling_and_follows_the_budget(plan):
    p_w = powers(plan)
    slowest = len(p_w) - 1
    # Room for both jobs at row 19, where stage 0 runs at most 1050 MHz and stage 1 at 1410 MHz.
    assert cc.row_stage_clocks_mhz(plan, 19) == (1050, 1410)
    budget = [PowerBudget(cluster_w=2 * p_w[19] + 1.0)]
    jobs = [two_stage_job("a"), two_stage_job("b", created="2025-01-02T00:00:00Z")]
    kube, allocator = allocator_for(plan, jobs, budget)
    for name, rank in itertools.product("ab", (0, 1)):
        put_pod(kube, pod(f"{name}{rank}", f"uid-{name}", rank=rank))
    put_pod(kube, pod("c0", "uid-c"))  # a training pod of a job that is not under the budget

    allocation = await allocator.run_pass()
    rows = {n: allocation.get(f"team/{n}").row for n in "ab"}
    want = {f"pod-{n}{r}": str(cc.row_stage_clocks_mhz(plan, rows[n])[r]) for n in "ab" for r in (0, 1)}
    assert kube.ceilings() == want
    assert rows == {"a": 19, "b": 19}
    assert want == {"pod-a0": "1050", "pod-a1": "1410", "pod-b0": "1050", "pod-b1": "1410"}  # per stage

    # Nothing changed: no second write.
    await allocator.run_pass()
    assert len(kube.applies) == 1

    # A pod finishes and another goes: both leave the ConfigMap; the watch events say a pass is due.
    finished = pod("b1", "uid-b", rank=1, phase="Succeeded")
    assert allocator.ceilings.pod_event_matters({"type": "MODIFIED", "object": finished})
    assert allocator.ceilings.pod_event_matters({"type": "DELETED", "object": pod("a1", "uid-a", rank=1)})
    put_pod(kube, finished)
    del kube.objects[f"{PODS}/a1"]
    # A new pod of an allotted job matters; one of a job without an allotment does not.
    assert allocator.ceilings.pod_event_matters({"type": "ADDED", "object": pod("a9", "uid-a", rank=1)})
    assert not allocator.ceilings.pod_event_matters({"type": "ADDED", "object": pod("c1", "uid-c")})
    await allocator.run_pass()
    assert set(kube.ceilings()) == {"pod-a0", "pod-b0"}

    # A tighter budget lowers the ceilings: both jobs at their slowest row, 1050 MHz on every stage.
    budget[0] = PowerBudget(cluster_w=2 * p_w[slowest] + 1.0)
    allocation = await allocator.run_pass()
    assert [allocation.get(f"team/{n}").row for n in "ab"] == [slowest, slowest]
    assert kube.ceilings() == {"pod-a0": "1050", "pod-b0": "1050"}

    # A job the budget cannot fit is held: it has no training pods, hence no entries (its stray pod neither).
    held = two_stage_job("late", created="2025-01-03T00:00:00Z", started=False)
    kube.put(f"{JOBS}/late", held)
    kube.put("/api/v1/namespaces/team/configmaps/late-plan", plan_configmap("late", plan))
    put_pod(kube, pod("late0", "uid-late"))
    allocation = await allocator.run_pass()
    assert allocation.get("team/late").held and set(kube.ceilings()) == {"pod-a0", "pod-b0"}

    # No budget: no entries.
    budget[0] = PowerBudget()
    await allocator.run_pass()
    assert kube.ceilings() == {} and CEILINGS in kube.objects


async def test_a_failed_publish_is_retried_and_a_fresh_operator_clears_what_it_finds(plan):
    budget = [PowerBudget(cluster_w=10 * powers(plan)[0])]
    kube, allocator = allocator_for(plan, [manifest("a")], budget)
    put_pod(kube, pod("a0", "uid-a"))
    kube.fail_apply = True
    await allocator.run_pass()
    assert allocator.ceilings.stale and CEILINGS not in kube.objects
    kube.fail_apply = False
    await allocator.run_pass()
    # The tiny spec's 2 GPUs are not the plan's 16: the pod's stage is unknown, it gets the row's highest clock.
    row = allocator.allocation.get("team/a").row
    assert kube.ceilings() == {"pod-a0": str(max(cc.row_stage_clocks_mhz(plan, row)))}
    assert not allocator.ceilings.stale

    # A restarted operator without a budget empties the ConfigMap it finds with entries ...
    budget[0] = PowerBudget()
    _, fresh = allocator_for(plan, [manifest("a")], budget)
    fresh.kube = fresh.ceilings.kube = kube
    await fresh.run_pass()
    assert kube.ceilings() == {}
    # ... and creates none where there is none.
    empty, other = allocator_for(plan, [manifest("a")], budget)
    await other.run_pass()
    assert CEILINGS not in empty.objects and empty.applies == []


async def test_reconciles_apply_rows_the_published_ceilings_already_hold(plan):
    """The job's reconcile rolls its allotted row out; the ceiling its pod got from the pass is that row's."""
    budget = [PowerBudget(cluster_w=2 * min(powers(plan)) + 1.0)]
    kube, allocator = allocator_for(plan, [manifest("a"), manifest("b")], budget)
    put_pod(kube, pod("a0", "uid-a"))
    await allocator.run_pass()
    _, held = await reconcile(kube, allocator, "a")
    assert not held
    row = kube.objects[f"{JOBS}/a"]["status"]["power"]["frontierRow"]
    assert kube.ceilings() == {"pod-a0": str(max(cc.row_stage_clocks_mhz(plan, row)))} == {"pod-a0": "1050"}
