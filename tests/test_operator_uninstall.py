"""A clean uninstall: with the operator gone, jobs and their namespaces can still be deleted.

The operator puts no finalizer on KareusJobs (ownerReferences carry the children away), so nothing
waits for an operator that is no longer there — the namespace controller and the garbage collector
of the real control plane remove everything.
"""

from __future__ import annotations

import time

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from operator_fakes import QUICKSTART, settings_env

NS = "bye"

pytestmark = pytest.mark.timeout(240)


def test_namespaces_with_jobs_delete_after_the_operator_is_uninstalled(dev_cluster, tmp_path):
    objects = dev_cluster.install_operator("bye", "bye-system", watch_namespaces=[NS],
                                           settings=settings_env(tmp_path, step_s=1.0, steps=300))
    api = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    core, jobs = client.CoreV1Api(api), client.CustomObjectsApi(api)
    job = yaml.safe_load(QUICKSTART.read_text())
    job["metadata"] = {"name": "left-behind", "namespace": NS}
    del job["spec"]["training"]["command"]
    jobs.create_namespaced_custom_object("kareus.dev", "v1alpha1", NS, "kareusjobs", job)
    deadline = time.monotonic() + 90
    while (jobs.get_namespaced_custom_object("kareus.dev", "v1alpha1", NS, "kareusjobs", "left-behind")
           .get("status") or {}).get("phase") != "Training":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    stored = jobs.get_namespaced_custom_object("kareus.dev", "v1alpha1", NS, "kareusjobs", "left-behind")
    assert not stored["metadata"].get("finalizers")

    dev_cluster.uninstall(objects)  # the operator's Deployment, RBAC, ServiceAccounts go
    deadline = time.monotonic() + 60
    while core.list_namespaced_pod("bye-system").items:
        assert time.monotonic() < deadline, "the operator pod never went away"
        time.sleep(0.5)
    core.delete_namespace(NS)
    deadline = time.monotonic() + 120
    while True:
        try:
            core.read_namespace(NS)
        except ApiException as error:
            assert error.status == 404
            break
        assert time.monotonic() < deadline, "the namespace never finished deleting"
        time.sleep(0.5)
