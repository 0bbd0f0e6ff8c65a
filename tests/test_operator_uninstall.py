"""A clean uninstall: with the operator gone, jobs and their namespaces can still be deleted.

The operator puts no finalizer on KareusJobs (ownerReferences carry the children away), so nothing
waits for an operator that is no longer there — the namespace controller and the garbage collector
of the real control plane remove everything.
"""

from __future__ import annotations

import pytest
from kube_helpers import read_or_none, wait_until
from kubernetes import client, config
from operator_fakes import fake_manifest, settings_env

NS = "bye"

pytestmark = pytest.mark.timeout(240)


def test_namespaces_with_jobs_delete_after_the_operator_is_uninstalled(dev_cluster, tmp_path):
    objects = dev_cluster.install_operator("bye", "bye-system", watch_namespaces=[NS],
                                           settings=settings_env(tmp_path, step_s=1.0, steps=300))
    api = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    core, jobs = client.CoreV1Api(api), client.CustomObjectsApi(api)
    job = fake_manifest()
    job["metadata"] = {"name": "left-behind", "namespace": NS}
    del job["spec"]["training"]["command"]
    jobs.create_namespaced_custom_object("kareus.dev", "v1alpha1", NS, "kareusjobs", job)
    stored = wait_until(lambda: jobs.get_namespaced_custom_object("kareus.dev", "v1alpha1", NS, "kareusjobs",
                                                                  "left-behind"),
                        lambda job: (job.get("status") or {}).get("phase") == "Training", timeout_s=90,
                        what="left-behind training", interval_s=0.3)
    assert not stored["metadata"].get("finalizers")

    dev_cluster.uninstall(objects)  # the operator's Deployment, RBAC, ServiceAccounts go
    wait_until(lambda: core.list_namespaced_pod("bye-system").items, lambda pods: not pods, timeout_s=60,
               what="the operator pod going away", interval_s=0.5)
    core.delete_namespace(NS)
    wait_until(lambda: read_or_none(lambda: core.read_namespace(NS)), lambda ns: ns is None, timeout_s=120,
               what="the namespace finishing deleting", interval_s=0.5)
