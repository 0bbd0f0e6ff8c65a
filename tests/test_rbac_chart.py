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
from kube_helpers import read_or_none, wait_until
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
        wait_until(lambda: read_or_none(lambda: jobs.get_namespaced_custom_object(
            "kareus.dev", "v1alpha1", NS, "kareusjobs", "audited")), lambda job: job is None, timeout_s=180,
            what="the job finishing and expiring", interval_s=0.5)
    finally:
        dev_cluster.uninstall(objects)
    time.sleep(1.0)  # the audit backend writes in batches
    events = audit_events(dev_cluster.control_plane.audit_log, started)
    by_user: dict[str, list[dict]] = {}
    for event in events:  # a request that failed authentication (401) names no user, so no component
        by_user.setdefault(event["user"].get("username", ""), []).append(event)
    for user in (OPERATOR, WORKER, NODE_AGENT):
        assert by_user.get(user), f"no request by {user} in the audit log"
        denied = [(e["verb"], e.get("objectRef", {}).get("resource"), e.get("objectRef", {}).get("subresource"))
                  for e in by_user[user] if (e.get("annotations") or {}).get("authorization.k8s.io/decision") == "forbid"]
        assert denied == [], f"{user} was denied by RBAC: {denied}"
    operator_verbs = {(e["verb"], e.get("objectRef", {}).get("resource")) for e in by_user[OPERATOR]}
    assert ("delete", "kareusjobs") in operator_verbs and ("create", "jobs") in operator_verbs
    assert ("create", "pods") not in operator_verbs  # the Job controller makes the phase pods
    # What RBAC cannot restrict, the components restrict themselves — and the log shows it:
    # the node agent lists only its node's pods, the operator lists only the ConfigMaps it labels.
    for user, resource, selector in ((NODE_AGENT, "pods", "fieldSelector=spec.nodeName"),
                                     (OPERATOR, "configmaps", "labelSelector=")):
        collections = [e["requestURI"] for e in by_user[user] if e["verb"] in ("list", "watch")
                       and e.get("objectRef", {}).get("resource") == resource]
        assert collections and all(selector in uri.replace("%3D", "=") for uri in collections), collections
    worker_writes = {(e["verb"], e.get("objectRef", {}).get("resource")) for e in by_user[WORKER]
                     if e["verb"] in ("create", "patch", "update")}
    assert worker_writes and {resource for _, resource in worker_writes} == {"configmaps"}


def worker_pod(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Pod:
    """A pod running as the workers' ServiceAccount (what the operator starts), left sleeping."""
    core.create_namespaced_pod(namespace, {"metadata": {"name": name}, "spec": {
        "serviceAccountName": "kareus-worker", "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "main", "image": "localhost/kareus/runtime:0.1.0", "imagePullPolicy": "IfNotPresent",
                        "command": ["python", "-c", "import time; time.sleep(600)"]}]}})
    return wait_until(lambda: core.read_namespaced_pod(name, namespace), lambda pod: pod.status.phase == "Running",
                      timeout_s=60, what=f"pod {name} running")


def token_client(dev_cluster, core: client.CoreV1Api, namespace: str, pod: client.V1Pod | None) -> client.CoreV1Api:
    """The CoreV1Api of a workers' token, bound to `pod` as a kubelet's projected token is (or unbound)."""
    spec: dict = {"expirationSeconds": 600}
    if pod is not None:
        spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": pod.metadata.name, "uid": pod.metadata.uid}
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
    token = core.create_namespaced_service_account_token("kareus-worker", namespace, request).status.token
    plane = dev_cluster.control_plane
    configuration = client.Configuration()
    configuration.host, configuration.ssl_ca_cert = plane.url, str(plane.ca_file)
    configuration.api_key = {"authorization": f"Bearer {token}"}
    return client.CoreV1Api(client.ApiClient(configuration))


def refused(call) -> str:
    with pytest.raises(ApiException) as error:
        call()
    assert error.value.status in (403, 422), error.value.body
    return error.value.body


@pytest.fixture(scope="module")
def worker_namespace(dev_cluster):
    namespace = f"{NS}2"
    objects = dev_cluster.install_operator(f"{RELEASE}2", f"{RELEASE}2-system", watch_namespaces=[namespace],
                                           settings={})
    yield namespace
    dev_cluster.uninstall(objects)


def test_a_worker_token_can_do_nothing_but_write_configmaps_of_its_namespace(dev_cluster, kube_client,
                                                                            worker_namespace):
    core = client.CoreV1Api(kube_client)
    as_worker = token_client(dev_cluster, core, worker_namespace, worker_pod(core, worker_namespace, "w-train-0-abcde"))
    as_worker.create_namespaced_config_map(worker_namespace, {"metadata": {
        "name": "w-progress", "labels": {"kareus.dev/job-name": "w"}}, "data": {"a": "1"}})
    worker_api = as_worker.api_client
    for what, call in {
        "read secrets": lambda: as_worker.list_namespaced_secret(worker_namespace),
        "delete pods": lambda: as_worker.delete_collection_namespaced_pod(worker_namespace),
        "write another namespace": lambda: as_worker.create_namespaced_config_map(
            "default", {"metadata": {"name": "theirs", "labels": {"kareus.dev/job-name": "w"}}, "data": {}}),
        "patch KareusJobs": lambda: client.CustomObjectsApi(worker_api).patch_namespaced_custom_object_status(
            "kareus.dev", "v1alpha1", worker_namespace, "kareusjobs", "any", {"status": {}}),
        "list nodes": lambda: as_worker.list_node(),
    }.items():
        with pytest.raises(ApiException) as error:
            call()
        assert error.value.status == 403, what


def test_a_worker_writes_only_its_own_jobs_configmaps(dev_cluster, kube_client, worker_namespace):
    """The chart's ValidatingAdmissionPolicy, in the real API server: what RBAC cannot express."""
    ns = worker_namespace
    core = client.CoreV1Api(kube_client)
    for name, labels in (("a-plan", {"kareus.dev/job-name": "a"}), ("b-plan", {"kareus.dev/job-name": "b"}),
                         ("kareus-profile-k", {"kareus.dev/profile-key": "k"})):
        core.create_namespaced_config_map(ns, {"metadata": {"name": name, "labels": labels}, "data": {"v": "0"}})
    a_train = token_client(dev_cluster, core, ns, worker_pod(core, ns, "a-train-0-x7k2p"))
    b_profile = token_client(dev_cluster, core, ns, worker_pod(core, ns, "b-profile-q9z4m"))
    unbound = token_client(dev_cluster, core, ns, None)

    a_train.create_namespaced_config_map(ns, {"metadata": {  # its own job's, the one its role fills: fine
        "name": "a-progress", "labels": {"kareus.dev/job-name": "a"}}, "data": {"v": "1"}})
    # Not its own job's plan: the power budget's frontier and clock ceilings come from it (issue 29 item 6).
    assert "may write only the ConfigMap its role fills" in refused(
        lambda: a_train.patch_namespaced_config_map("a-plan", ns, {"data": {"v": "1"}}))
    b_profile.create_namespaced_config_map(ns, {"metadata": {  # a profiling pod publishes its measurement
        "name": "b-profile", "labels": {"kareus.dev/job-name": "b"}}, "data": {"profile.json": "{}"}})
    message = refused(lambda: a_train.patch_namespaced_config_map("b-plan", ns, {"data": {"v": "x"}}))
    assert "may write only its own job's ConfigMaps" in message
    refused(lambda: a_train.patch_namespaced_config_map("kareus-profile-k", ns, {"data": {"v": "x"}}))
    refused(lambda: a_train.patch_namespaced_config_map(  # relabelling another job's ConfigMap as its own
        "b-plan", ns, {"metadata": {"labels": {"kareus.dev/job-name": "a"}}}))
    refused(lambda: a_train.delete_namespaced_config_map("b-plan", ns))
    refused(lambda: a_train.create_namespaced_config_map(ns, {"metadata": {"name": "loose"}, "data": {}}))
    assert "bound to its pod" in refused(lambda: unbound.patch_namespaced_config_map("a-plan", ns, {"data": {"v": "y"}}))
    assert core.read_namespaced_config_map("b-plan", ns).data == {"v": "0"}

    # Issue 29: what the operator trusts is the operator's. A worker's ConfigMap is named for its own
    # job and carries no ownerReferences or job-uid label of the worker's making; no worker writes a
    # profile cache (the operator copies <job>-profile into it), not even a profiling pod.
    # (the server's JSON escapes < and >, so the assertion stops before them)
    assert "may write only its own job's ConfigMaps (label kareus.dev/job-name, named " in refused(
        lambda: a_train.create_namespaced_config_map(
        ns, {"metadata": {"name": "b-progress", "labels": {"kareus.dev/job-name": "a"}}, "data": {}}))
    owner = {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob", "name": "b", "uid": "uid-b", "controller": True}
    assert "ownerReferences" in refused(lambda: a_train.create_namespaced_config_map(ns, {"metadata": {
        "name": "a-progress", "labels": {"kareus.dev/job-name": "a"}, "ownerReferences": [owner]}, "data": {}}))
    assert "job-uid label is the operator's" in refused(lambda: a_train.patch_namespaced_config_map(
        "a-progress", ns, {"metadata": {"labels": {"kareus.dev/job-uid": "uid-a"}}}))
    assert "no profile cache" in refused(lambda: b_profile.patch_namespaced_config_map(
        "kareus-profile-k", ns, {"data": {"v": "forged"}}))
    refused(lambda: b_profile.create_namespaced_config_map(
        ns, {"metadata": {"name": "kareus-profile-s2", "labels": {"kareus.dev/profile-key": "s2"}}, "data": {}}))
    assert core.read_namespaced_config_map("kareus-profile-k", ns).data == {"v": "0"}
