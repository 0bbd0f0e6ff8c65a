"""Kill the operator's pod in every phase: the job still reaches the same final state, no child twice.

The operator is the chart's Deployment pod; "killed" is a force delete (grace period 0, as a node
failure or an OOM kill looks to the API), after which the ReplicaSet controller starts a new pod
that must pick the job up from what it finds in the cluster.
"""

from __future__ import annotations

import pytest
from kube_helpers import PodRecorder, wait_until
from kubernetes import client, config
from operator_fakes import STEP_ENERGY_J, conditions, fake_manifest, settings_env

NS, RELEASE = "restart", "restart"
GROUP, VERSION, PLURAL = "kareus.dev", "v1alpha1", "kareusjobs"
OPERATOR_SELECTOR = "app.kubernetes.io/component=operator,app.kubernetes.io/instance=" + RELEASE

pytestmark = pytest.mark.timeout(300)


def job_status(jobs: client.CustomObjectsApi) -> dict:
    return jobs.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "quickstart").get("status") or {}


def kill_operator(core: client.CoreV1Api) -> str:
    pods = core.list_namespaced_pod(f"{RELEASE}-system", label_selector=OPERATOR_SELECTOR).items
    live = [p for p in pods if p.metadata.deletion_timestamp is None]
    assert len(live) == 1, [p.metadata.name for p in pods]
    core.delete_namespaced_pod(live[0].metadata.name, f"{RELEASE}-system", grace_period_seconds=0)
    return live[0].metadata.uid


def test_operator_killed_in_every_phase_resumes_without_duplicates(dev_cluster, tmp_path):
    objects = dev_cluster.install_operator(RELEASE, f"{RELEASE}-system", watch_namespaces=[NS],
                                           settings=settings_env(tmp_path, step_s=0.4, steps=6, phase_s=2.0))
    api = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    core, jobs = client.CoreV1Api(api), client.CustomObjectsApi(api)
    try:
        with PodRecorder(core, NS) as seen:
            job = fake_manifest()
            del job["spec"]["training"]["command"]
            jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job)

            killed = []
            for phase in ("Profiling", "Optimizing", "Training"):
                wait_until(lambda: job_status(jobs), lambda status, phase=phase: status.get("phase") == phase,
                           timeout_s=120, what=f"phase {phase}", interval_s=0.05)
                killed.append((phase, kill_operator(core)))

            wait_until(lambda: job_status(jobs), lambda status: status.get("phase") in ("Succeeded", "Failed"),
                       timeout_s=180, what="the job finishing")
    finally:
        dev_cluster.uninstall(objects)

    final = jobs.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "quickstart")
    assert [phase for phase, _ in killed] == ["Profiling", "Optimizing", "Training"]
    assert len({uid for _, uid in killed}) == 3  # a new operator pod each time
    assert final["status"]["phase"] == "Succeeded"
    assert conditions(final) == {"Profiled": ("True", "Measured"), "Planned": ("True", "Optimized"),
                                 "Training": ("False", "Completed"), "Complete": ("True", "Completed")}
    assert final["status"]["restarts"] == 0
    assert final["status"]["measured"]["iterations"] == 6
    assert final["status"]["measured"]["energyJoules"] == pytest.approx(6 * STEP_ENERGY_J)
    assert sorted(seen) == ["quickstart-optimize", "quickstart-profile", "quickstart-train-0"]  # by role and index
    assert all(len(uids) == 1 for uids in seen.values()), dict(seen)  # never created twice
