"""Every component runs under exactly the chart's RBAC — proven by the API server's own audit log.

A job goes through every phase and its TTL deletion under an operator release; its pods publish
as the workers' ServiceAccount, the node agent answers its clock requests. Then the audit log
(level Metadata, every request with the authorizer's decision) must show requests from each
component and not one RBAC denial. A worker's token is also tried on what workers must never do.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from operator_fakes import QUICKSTART

NS, RELEASE = "rbac", "rbac"
pytestmark = pytest.mark.timeout(240)

OPERATOR = f"system:serviceaccount:{RELEASE}-system:{RELEASE}-kareus-operator"
WORKER = f"system:serviceaccount:{NS}:kareus-worker"
NODE_AGENT = "system:serviceaccount:kareus-node:kareus-node-agent"


def audit_events(path, since: datetime) -> list[dict]:
    events = []
    for line in path.read_text().splitlines():
        event = json.loads(line)
        stamp = datetime.fromisoformat(event["stageTimestamp"].replace("Z", "+00:00"))
        if stamp >= since:
            events.append(event)
    return events


def test_the_chart_grants_every_verb_its_components_use(dev_cluster):
    """The real phases (profile, optimize, train with clock requests to the node agent)."""
    started = datetime.now(UTC)
    objects = dev_cluster.install_operator(RELEASE, f"{RELEASE}-system", watch_namespaces=[NS], settings={
        "RESYNC_S": "2", "PROGRESS_INTERVAL_S": "1", "LEASE_DURATION_S": "4"})
    api = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    jobs = client.CustomObjectsApi(api)
    try:
        job = yaml.safe_load(QUICKSTART.read_text())
        job["metadata"] = {"name": "audited", "namespace": NS}
        job["spec"]["ttlSecondsAfterFinished"] = 1  # the operator deletes the finished job
        jobs.create_namespaced_custom_object("kareus.dev", "v1alpha1", NS, "kareusjobs", job)
        deadline = time.monotonic() + 180
        while True:
            try:
                jobs.get_namespaced_custom_object("kareus.dev", "v1alpha1", NS, "kareusjobs", "audited")
            except ApiException as error:
                assert error.status == 404
                break
            assert time.monotonic() < deadline, "the job never finished and expired"
            time.sleep(0.5)
    finally:
        dev_cluster.uninstall(objects)
    time.sleep(1.0)  # the audit backend writes in batches
    events = audit_events(dev_cluster.control_plane.audit_log, started)
    by_user: dict[str, list[dict]] = {}
    for event in events:
        by_user.setdefault(event["user"]["username"], []).append(event)
    for user in (OPERATOR, WORKER, NODE_AGENT):
        assert by_user.get(user), f"no request by {user} in the audit log"
        denied = [(e["verb"], e.get("objectRef", {}).get("resource"), e.get("objectRef", {}).get("subresource"))
                  for e in by_user[user] if (e.get("annotations") or {}).get("authorization.k8s.io/decision") == "forbid"]
        assert denied == [], f"{user} was denied by RBAC: {denied}"
    operator_verbs = {(e["verb"], e.get("objectRef", {}).get("resource")) for e in by_user[OPERATOR]}
    assert ("delete", "kareusjobs") in operator_verbs and ("create", "pods") in operator_verbs
    worker_writes = {(e["verb"], e.get("objectRef", {}).get("resource")) for e in by_user[WORKER]
                     if e["verb"] in ("create", "patch", "update")}
    assert worker_writes and {resource for _, resource in worker_writes} == {"configmaps"}


def test_a_worker_token_can_do_nothing_but_write_configmaps_of_its_namespace(dev_cluster, kube_client):
    core = client.CoreV1Api(kube_client)
    objects = dev_cluster.install_operator(f"{RELEASE}2", f"{RELEASE}2-system", watch_namespaces=[f"{NS}2"],
                                           settings={})
    try:
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                   "spec": {"expirationSeconds": 600}}
        token = core.create_namespaced_service_account_token("kareus-worker", f"{NS}2", request).status.token
        plane = dev_cluster.control_plane
        configuration = client.Configuration()
        configuration.host, configuration.ssl_ca_cert = plane.url, str(plane.ca_file)
        configuration.api_key = {"authorization": f"Bearer {token}"}
        worker_api = client.ApiClient(configuration)
        as_worker = client.CoreV1Api(worker_api)
        as_worker.create_namespaced_config_map(f"{NS}2", {"metadata": {"name": "mine"}, "data": {"a": "1"}})
        refused = {
            "read secrets": lambda: as_worker.list_namespaced_secret(f"{NS}2"),
            "delete pods": lambda: as_worker.delete_collection_namespaced_pod(f"{NS}2"),
            "write another namespace": lambda: as_worker.create_namespaced_config_map(
                "default", {"metadata": {"name": "theirs"}, "data": {}}),
            "patch KareusJobs": lambda: client.CustomObjectsApi(worker_api).patch_namespaced_custom_object_status(
                "kareus.dev", "v1alpha1", f"{NS}2", "kareusjobs", "any", {"status": {}}),
            "list nodes": lambda: as_worker.list_node(),
        }
        for what, call in refused.items():
            with pytest.raises(ApiException) as error:
                call()
            assert error.value.status == 403, what
    finally:
        dev_cluster.uninstall(objects)
