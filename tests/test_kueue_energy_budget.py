"""Namespace energy budgets through the real Kueue: the operator's AdmissionCheck `kareus.dev/energy-budget`
and its KareusEnergyLedger, on the dev cluster (real kube-apiserver, real Kueue built from
sigs.k8s.io/kueue, real kubelets running the images; the training pods run the operator fakes, which
spend 123 J a step and predict 123 J an iteration).

The chart ships the AdmissionCheck; the operator marks it Active and attaches it to the ClusterQueue
(server-side apply of that one entry). Namespace `metered` has 0.0025 kWh (9000 J) a month:

- `first` is admitted (its training needs 8 × 123 J) and spends a few steps;
- `huge` needs 80 × 123 = 9840 J, more than a whole month's budget: its training Workload is
  Rejected, and the KareusJob fails with the check's message (namespace, use, budget, period end);
- `long` (50 steps, 6150 J) is admitted and trains; `second` (20 steps, 2460 J) then does not fit
  beside `long`'s promise: Retry, evicted and queued again, its Workload says why;
- `long` is deleted mid-run: its promise frees, the energy it spent stays in the ledger, and
  `second` is admitted and succeeds;
- the ledger survives an operator restart and the deletion of every job: `kubectl get kel` still
  shows the month's use against the budget.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from kareus_devcluster.kueue import quota_objects
from kube_helpers import read_or_none, wait_until
from kubernetes import client, config
from operator_fakes import STEP_ENERGY_J, fake_manifest, settings_env

from kareus.energy_ledger import period_bounds

GROUP, VERSION = "kareus.dev", "v1alpha1"
NAMESPACE, RELEASE, RELEASE_NS = "metered", "budget", "budget-system"
QUEUE = "metered"
BUDGET_KWH = 0.0025  # 9000 J
CHECK = "kareus-energy-budget"
GPUS_PER_JOB = 2

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def state(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fakes")


@pytest.fixture(scope="module")
def api(dev_cluster, kueue, state):
    values = dev_cluster.values(operator=True, node_agent=False, worker_namespaces=[NAMESPACE],
                                watch_namespaces=[NAMESPACE], crds=False,
                                settings=settings_env(state, step_s=1.0, steps=400))
    values["policy"] = {**values["policy"],
                        "namespaceEnergyBudgets": {NAMESPACE: {"kwh": BUDGET_KWH, "period": "month"}}}
    values["kueue"] = {"energyBudgetCheck": {"enabled": True, "name": CHECK, "clusterQueues": [QUEUE]}}
    objects = dev_cluster.install(RELEASE, RELEASE_NS, values)  # creates the namespace too
    dev_cluster.kubectl("apply", "--server-side", "--field-manager=test", "-f", "-",
                        input=yaml.safe_dump_all(quota_objects(QUEUE, 2 * GPUS_PER_JOB, [NAMESPACE])))
    api_client = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    yield client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)
    dev_cluster.uninstall(objects)


def submit(jobs: client.CustomObjectsApi, state: Path, name: str, steps: int) -> dict:
    job = fake_manifest(state)
    job["metadata"] = {"name": name, "namespace": NAMESPACE, "labels": {"kueue.x-k8s.io/queue-name": QUEUE}}
    del job["spec"]["training"]["command"]
    job["spec"]["training"]["steps"] = steps  # what the check predicts from (123 J an iteration)
    job["spec"]["profiling"] = {"reuse": False}
    return jobs.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "kareusjobs", job)


def kareus_job(jobs, name: str) -> dict | None:
    return read_or_none(lambda: jobs.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "kareusjobs", name))


def wait_job(jobs, name: str, check, timeout_s: float = 300.0, what: str = "") -> dict:
    return wait_until(lambda: kareus_job(jobs, name), check, timeout_s=timeout_s,
                      what=f"KareusJob {name} {what}".strip(), interval_s=0.5)


def steps_done(job: dict | None) -> int:
    return int(((job or {}).get("status") or {}).get("measured", {}).get("iterations") or 0)


def energy_j(job: dict | None) -> float:
    return float(((job or {}).get("status") or {}).get("measured", {}).get("energyJoules") or 0.0)


def ledger(jobs) -> dict:
    return read_or_none(lambda: jobs.get_cluster_custom_object(GROUP, VERSION, "kareusenergyledgers", NAMESPACE)) or {}


def train_check(jobs, name: str) -> dict | None:
    """Our check's state on the job's training Workload."""
    for workload in jobs.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", NAMESPACE, "workloads")["items"]:
        owners = workload["metadata"].get("ownerReferences") or []
        if any(o.get("name") == f"{name}-train" for o in owners):
            return next((s for s in (workload.get("status") or {}).get("admissionChecks") or [] if s["name"] == CHECK),
                        None)
    return None


def finish(state: Path, name: str) -> None:
    (state / f"{name}.finish").write_text("")  # the fake trainer ends after the step it is in


def test_jobs_wait_in_the_queue_for_their_namespaces_energy_budget(dev_cluster, api, state):
    core, jobs = api
    # The chart's check, claimed by the operator and attached to the ClusterQueue.
    check = wait_until(lambda: read_or_none(lambda: jobs.get_cluster_custom_object("kueue.x-k8s.io", "v1beta2",
                                                                                    "admissionchecks", CHECK)),
                       lambda c: c and any(x["type"] == "Active" and x["status"] == "True"
                                           for x in (c.get("status") or {}).get("conditions") or []),
                       timeout_s=120, what="the AdmissionCheck Active")
    assert check["spec"]["controllerName"] == "kareus.dev/energy-budget"
    # The queue was created after the operator started: attached at the operator's next try (each minute).
    queue = wait_until(lambda: jobs.get_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "clusterqueues", QUEUE),
                       lambda q: (q["spec"].get("admissionChecksStrategy") or {}).get("admissionChecks"),
                       timeout_s=150, what="the check attached to the ClusterQueue")
    assert [c["name"] for c in queue["spec"]["admissionChecksStrategy"]["admissionChecks"]] == [CHECK]

    # Admitted: it fits, trains a few steps and ends.
    submit(jobs, state, "first", steps=8)
    first = wait_job(jobs, "first", lambda j: steps_done(j) >= 5, what="training 5 steps")
    assert train_check(jobs, "first")["state"] == "Ready"
    finish(state, "first")
    first = wait_job(jobs, "first", lambda j: (j.get("status") or {}).get("phase") == "Succeeded")
    first_j = energy_j(first)
    assert first_j == STEP_ENERGY_J * steps_done(first) and first_j > 4 * STEP_ENERGY_J

    # Rejected: more than a whole month's budget, so waiting cannot help.
    submit(jobs, state, "huge", steps=80)
    huge = wait_job(jobs, "huge", lambda j: (j.get("status") or {}).get("phase") == "Failed", what="failed")
    failed = next(c for c in huge["status"]["conditions"] if c["type"] == "Failed")
    _, period_end = period_bounds("month", _now())
    assert failed["reason"] == "AdmissionCheckRejected"
    assert f"AdmissionCheck {CHECK}: the job needs {80 * STEP_ENERGY_J / 3.6e6:.4g} kWh for its remaining steps" \
        in failed["message"]
    assert (f"namespace 'metered' has used {first_j / 3.6e6:.4g} kWh of its {BUDGET_KWH:g} kWh monthly energy budget"
            in failed["message"])
    assert f"the period ends {period_end.strftime('%Y-%m-%dT%H:%M:%SZ')}" in failed["message"]
    assert failed["message"].endswith("waiting cannot make it fit")
    assert core.list_namespaced_pod(NAMESPACE, label_selector="kareus.dev/job-name=huge,kareus.dev/role=train").items == []

    # Held: `second` does not fit beside `long`'s promise; Retry, with the reason on its Workload.
    submit(jobs, state, "long", steps=50)
    wait_job(jobs, "long", lambda j: steps_done(j) >= 1, what="training")
    submit(jobs, state, "second", steps=20)
    held = wait_until(lambda: train_check(jobs, "second"), lambda s: s is not None and s["state"] == "Retry",
                      timeout_s=300, what="second's training Workload held (Retry)", interval_s=0.5)
    assert f"the job needs {20 * STEP_ENERGY_J / 3.6e6:.4g} kWh for its remaining steps" in held["message"]
    assert "promised to admitted jobs" in held["message"]
    assert steps_done(kareus_job(jobs, "second")) == 0
    assert core.list_namespaced_pod(NAMESPACE, label_selector="kareus.dev/job-name=second,kareus.dev/role=train").items == []

    # `long` is deleted mid-run: its energy stays counted, its promise frees, `second` runs.
    long_before = kareus_job(jobs, "long")
    assert steps_done(long_before) < 40, "long trained too far for second to fit after it (this machine is slow)"
    jobs.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "kareusjobs", "long")
    wait_job(jobs, "long", lambda j: j is None, what="deleted")
    kept = wait_until(lambda: ledger(jobs), lambda lg: all(m["name"] != "long" for m in lg["status"].get("jobs", [])),
                      timeout_s=60, what="long's meter dropped")
    long_j = kept["status"]["usedJoules"] - first_j
    assert long_j >= energy_j(long_before) > 0  # what it spent until it was deleted, not given back
    assert long_j % STEP_ENERGY_J == 0
    wait_job(jobs, "second", lambda j: steps_done(j) >= 2, what="admitted after long's promise freed")
    assert train_check(jobs, "second")["state"] == "Ready"
    finish(state, "second")
    second = wait_job(jobs, "second", lambda j: (j.get("status") or {}).get("phase") == "Succeeded")
    second_j = energy_j(second)

    # The ledger: every job's energy, the deleted one's included, against the budget, shown by kubectl.
    expected_j = first_j + long_j + second_j
    status = wait_until(lambda: ledger(jobs)["status"], lambda s: s["usedJoules"] == expected_j, timeout_s=60,
                        what="the ledger counting second")
    assert status["period"] == "month" and status["budgetKilowattHours"] == BUDGET_KWH
    assert status["remainingKilowattHours"] == pytest.approx(BUDGET_KWH - expected_j / 3.6e6, abs=1e-6)
    assert status["periodEnd"] == period_end.strftime("%Y-%m-%dT%H:%M:%SZ")

    # An operator restart forgets nothing; nor does deleting every job.
    for pod in core.list_namespaced_pod(RELEASE_NS, label_selector=f"app.kubernetes.io/instance={RELEASE}").items:
        core.delete_namespaced_pod(pod.metadata.name, RELEASE_NS)
    for name in ("first", "huge", "second"):
        jobs.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "kareusjobs", name)
    dev_cluster.kubectl("-n", RELEASE_NS, "rollout", "status", f"deployment/{RELEASE}-kareus-operator", "--timeout=180s")
    emptied = wait_until(lambda: ledger(jobs)["status"], lambda s: not s.get("jobs"), timeout_s=120,
                         what="the ledger without meters (every job deleted, the new operator's resync)")
    assert emptied["usedJoules"] == expected_j and emptied["lifetimeJoules"] == expected_j
    table = dev_cluster.kubectl("get", "kareusenergyledgers", NAMESPACE)
    header, row = table.stdout.strip().splitlines()
    assert header.split()[:5] == ["NAME", "PERIOD", "USED", "KWH", "BUDGET"]
    name, period, used_kwh, budget_kwh, left_kwh, end = row.split()[:6]
    assert (name, period, end) == (NAMESPACE, "month", status["periodEnd"])
    assert float(used_kwh) == pytest.approx(expected_j / 3.6e6, abs=1e-6) and float(budget_kwh) == BUDGET_KWH
    assert float(left_kwh) == pytest.approx(BUDGET_KWH - expected_j / 3.6e6, abs=1e-6)


def _now() -> datetime:
    return datetime.now(UTC)
