"""The operator (the chart's Deployment pod, a real kopf process) on the real cluster, with fast fake phases.

One operator release watches three namespaces and runs several jobs at once, each exercising one
path of the phase machine: success, a retried training failure, an exhausted backoff limit, a
profile cache hit, a policy refusal, suspend and resume, an active deadline, a TTL after finishing
(the operator deletes the job; the garbage collector its children), and deletion of a finished job.
"""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
from kareus_operator.kube import Kube, load_kubeconfig, path
from operator_fakes import STEP_ENERGY_J, conditions, fake_manifest, settings_env

JOBS_API = "kareus.dev/v1alpha1"
POLICY = {"allowedNamespaces": ["obj", "team-a", "team-b"], "profileReuse": True,
          "namespaceEnergyBudgets": {"team-b": 0.0001}}  # 360 J; one fake job measures 492 J
TERMINAL = ("Succeeded", "Failed")

pytestmark = pytest.mark.timeout(240)


def fake_job(name: str, namespace: str = "team-a", **spec_changes) -> dict:
    job = fake_manifest()
    job["metadata"] = {"name": name, "namespace": namespace}
    del job["spec"]["training"]["command"]  # the operator's (fake) train command runs instead
    job["spec"].update(spec_changes)
    return job


async def wait_for(kube: Kube, namespace: str, name: str, check, timeout_s: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout_s
    job = None
    while time.monotonic() < deadline:
        job = await kube.get(path(JOBS_API, "kareusjobs", namespace, name))
        if check(job):
            return job
        await asyncio.sleep(0.3)
    raise AssertionError(f"{namespace}/{name} never reached the expected state; last: {job and job.get('status')}")


def phase_in(*phases):
    return lambda job: job is not None and (job.get("status") or {}).get("phase") in phases


async def events_for(kube: Kube, namespace: str, name: str) -> list[str]:
    return [e["reason"] for e in await kube.list(path("v1", "events", namespace))
            if e.get("involvedObject", {}).get("name") == name]


async def has_events(kube: Kube, namespace: str, name: str, reasons: set[str]) -> bool:
    """Events are posted after the status write, asynchronously (kopf's posting queue): wait a little."""
    deadline = time.monotonic() + 20
    while not reasons <= set(await events_for(kube, namespace, name)):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.3)
    return True


async def gone(kube: Kube, namespace: str, selector: str, plurals=("pods", "configmaps", "services")) -> bool:
    """No child left with this label: the garbage collector deletes them after their owner, in time."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not any([await kube.list(path("v1", plural, namespace), selector) for plural in plurals]):
            return True
        await asyncio.sleep(0.5)
    return False


@pytest.fixture
def operator_release(dev_cluster, tmp_path):
    """`release(name, namespaces, **settings)`: an operator release with fake phases, removed afterwards."""
    installed = []

    def release(name: str, namespaces: list[str], **fake) -> None:
        installed.append(dev_cluster.install_operator(name, f"{name}-system", watch_namespaces=namespaces,
                                                      settings=settings_env(tmp_path, **fake), policy=POLICY))

    yield release
    for objects in installed:
        dev_cluster.uninstall(objects)


async def test_jobs_reach_their_outcomes(dev_cluster, operator_release):
    operator_release("life", ["team-a", "team-b", "forbidden"])
    async with Kube(load_kubeconfig(dev_cluster.kubeconfig)) as kube:
        slow = fake_job("slow", activeDeadlineSeconds=2)
        slow["spec"]["training"]["env"] = [{"name": "FAKE_STEP_S", "value": "10"}]
        jobs = [fake_job("ok"), fake_job("retry-f1train"), fake_job("doomed-f9optimize", backoffLimit=1),
                fake_job("refused", namespace="forbidden"), fake_job("paused", suspend=True), slow,
                fake_job("shortlived", ttlSecondsAfterFinished=1), fake_job("spender", namespace="team-b"),
                fake_job("nodaemon")]
        for job in jobs:
            await kube.request("POST", path(JOBS_API, "kareusjobs", job["metadata"]["namespace"]), job)

        ok = await wait_for(kube, "team-a", "ok", phase_in(*TERMINAL))
        assert ok["status"]["phase"] == "Succeeded"
        assert conditions(ok) == {"Profiled": ("True", "Measured"), "Planned": ("True", "Optimized"),
                                  "Training": ("False", "Completed"), "Complete": ("True", "Completed")}
        assert ok["status"]["measured"]["iterations"] == 4
        assert ok["status"]["measured"]["energyJoules"] == pytest.approx(4 * STEP_ENERGY_J)
        assert ok["status"]["plan"]["configMap"] == "ok-plan" and ok["status"]["plan"]["frontierPoints"] == 3
        assert ok["status"]["observedGeneration"] == ok["metadata"]["generation"]
        # No finalizer: a job (and its namespace) can always be deleted, operator or not.
        assert "finalizers" not in ok["metadata"]
        assert await has_events(kube, "team-a", "ok", {"PhaseProfiling", "PhaseOptimizing", "PhaseTraining",
                                                       "PhaseSucceeded"}), await events_for(kube, "team-a", "ok")

        # A second identical job reuses the profile: no profiling pod at all.
        await kube.request("POST", path(JOBS_API, "kareusjobs", "team-a"), fake_job("again"))
        again = await wait_for(kube, "team-a", "again", phase_in(*TERMINAL))
        assert conditions(again)["Profiled"] == ("True", "CacheHit") and again["status"]["profile"]["cacheHit"]
        assert await kube.get(path("v1", "pods", "team-a", "again-profile")) is None
        assert again["status"]["profile"]["key"] == ok["status"]["profile"]["key"]

        unclocked = await wait_for(kube, "team-a", "nodaemon", phase_in(*TERMINAL))
        assert unclocked["status"]["phase"] == "Succeeded"  # training goes on at default clocks
        assert conditions(unclocked)["ClockControlDegraded"] == ("True", "NodeAgentUnavailable")

        retried = await wait_for(kube, "team-a", "retry-f1train", phase_in(*TERMINAL))
        assert retried["status"]["phase"] == "Succeeded" and retried["status"]["restarts"] == 1, retried["status"]
        assert await has_events(kube, "team-a", "retry-f1train", {"ChildRestarted"})

        doomed = await wait_for(kube, "team-a", "doomed-f9optimize", phase_in(*TERMINAL))
        assert conditions(doomed)["Failed"] == ("True", "OptimizationFailed")
        assert doomed["status"]["restarts"] == 1 and "exit code 3" in doomed["status"]["lastFailure"]
        assert "backoffLimit 1" in next(c["message"] for c in doomed["status"]["conditions"] if c["type"] == "Failed")

        refused = await wait_for(kube, "forbidden", "refused", phase_in(*TERMINAL))
        failed = next(c for c in refused["status"]["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "PolicyViolation" and "policy.allowedNamespaces" in failed["message"]
        assert await kube.list(path("v1", "pods", "forbidden")) == []

        # The namespace's energy budget: the first job spends it, the next one is refused.
        spender = await wait_for(kube, "team-b", "spender", phase_in(*TERMINAL))
        assert spender["status"]["phase"] == "Succeeded"
        await kube.request("POST", path(JOBS_API, "kareusjobs", "team-b"), fake_job("latecomer", namespace="team-b"))
        latecomer = await wait_for(kube, "team-b", "latecomer", phase_in(*TERMINAL))
        failed = next(c for c in latecomer["status"]["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "PolicyViolation" and "policy.namespaceEnergyBudgets" in failed["message"]

        late = await wait_for(kube, "team-a", "slow", phase_in(*TERMINAL))
        assert conditions(late)["Failed"] == ("True", "DeadlineExceeded")
        assert all(p["status"].get("phase") in ("Succeeded", "Failed")
                   for p in await kube.list(path("v1", "pods", "team-a"), "kareus.dev/job-name=slow"))

        paused = await wait_for(kube, "team-a", "paused", phase_in("Suspended"))
        assert conditions(paused)["Suspended"] == ("True", "Suspended")
        assert await kube.list(path("v1", "pods", "team-a"), "kareus.dev/job-name=paused") == []
        await kube.merge_patch(path(JOBS_API, "kareusjobs", "team-a", "paused"), {"spec": {"suspend": False}})
        resumed = await wait_for(kube, "team-a", "paused", phase_in(*TERMINAL))
        assert resumed["status"]["phase"] == "Succeeded"
        assert conditions(resumed)["Suspended"] == ("False", "Resumed")

        # ttlSecondsAfterFinished: the finished job is deleted, its children with it.
        await wait_for(kube, "team-a", "shortlived", lambda job: job is None)
        assert await gone(kube, "team-a", "kareus.dev/job-name=shortlived")

        # Deleting a job removes every child it owns; the profile cache stays for the next job.
        await kube.delete(path(JOBS_API, "kareusjobs", "team-a", "ok"))
        await wait_for(kube, "team-a", "ok", lambda job: job is None)
        assert await gone(kube, "team-a", "kareus.dev/job-name=ok")
        assert await kube.get(path("v1", "configmaps", "team-a", ok["status"]["profile"]["configMap"])) is not None


async def test_objective_change_without_a_frontier_keeps_the_plan(dev_cluster, operator_release):
    """A plan that cannot be re-selected (the fake plan has no frontier table) is kept, with a warning."""
    operator_release("obj", ["obj"], step_s=0.5, steps=20)
    async with Kube(load_kubeconfig(dev_cluster.kubeconfig)) as kube:
        await kube.request("POST", path(JOBS_API, "kareusjobs", "obj"), fake_job("obj", namespace="obj"))
        await wait_for(kube, "obj", "obj", phase_in("Training"))
        changed = copy.deepcopy({"spec": {"objective": {"maxThroughput": None,
                                                        "energyBudget": {"perIterationJoules": 100.0}}}})
        await kube.merge_patch(path(JOBS_API, "kareusjobs", "obj", "obj"), changed)
        job = await wait_for(kube, "obj", "obj", phase_in(*TERMINAL))
        assert job["status"]["objective"] == "energyBudget perIterationJoules=100.0"
        assert await has_events(kube, "obj", "obj", {"ReselectFailed"})
        # 123 J measured per iteration against a 100 J budget.
        assert conditions(job)["BudgetExceeded"] == ("True", "EnergyBudgetExceeded")
