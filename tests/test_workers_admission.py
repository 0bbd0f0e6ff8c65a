"""The workers' ValidatingAdmissionPolicy as the chart renders it, in the session's real API server.

No kubelet is needed: a pod that is never scheduled still exists, and a ServiceAccount token bound to
it (a TokenRequest, as the kubelet asks for a projected token) carries that pod's name to admission.
The rendered policy's binding is narrowed to this test's namespace, so other modules' workers in the
same session meet only their own release's policy. (tests/test_rbac_chart.py runs the whole policy
on the dev cluster, with running pods.)

Issue 29 item 6: the power budget's clock ceilings come from the frontier the allocator reads out of
`<job>-plan`, so the one role that runs the tenant's own image and command — training — must not be
able to rewrite it. Each role writes only the ConfigMap it fills.
"""

from __future__ import annotations

import pytest
import yaml
from kube_helpers import wait_until
from kubernetes import client
from kubernetes.client.rest import ApiException

helm = pytest.importorskip("helm_python", reason="helm-python-sdk has no wheel for this platform")

from test_helm_chart import CHART, objects_of  # noqa: E402

RELEASE = "admtest"
WORKER_SA = "kareus-worker"
ROLE_MESSAGE = "may write only the ConfigMap its role fills"


def chart_objects(namespace: str) -> list[dict]:
    """The policy, its binding (narrowed to `namespace`) and the workers' account and RBAC there."""
    with helm.Chart.load(str(CHART)) as chart:
        rendered = objects_of(chart.render({"workers": {"namespaces": [namespace]}}, name=RELEASE,
                                           namespace=f"{RELEASE}-system"))
    wanted = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    picked = [o for (kind, ns, _), o in rendered.items() if kind in wanted or
              (ns == namespace and kind in ("ServiceAccount", "Role", "RoleBinding"))]
    binding = next(o for o in picked if o["kind"] == "ValidatingAdmissionPolicyBinding")
    binding["spec"]["matchResources"] = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}
    assert {o["kind"] for o in picked} == wanted | {"ServiceAccount", "Role", "RoleBinding"}
    return picked


def pod_client(control_plane, core: client.CoreV1Api, namespace: str, name: str) -> client.CoreV1Api:
    """The CoreV1Api of a worker token bound to pod `name` (created, never scheduled)."""
    pod = core.create_namespaced_pod(namespace, {"metadata": {"name": name}, "spec": {
        "serviceAccountName": WORKER_SA, "restartPolicy": "Never",
        "containers": [{"name": "main", "image": "localhost/kareus/runtime:0.1.0"}]}})
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
        "expirationSeconds": 600,
        "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": pod.metadata.uid}}}
    token = core.create_namespaced_service_account_token(WORKER_SA, namespace, request).status.token
    configuration = client.Configuration()
    configuration.host, configuration.ssl_ca_cert = control_plane.url, str(control_plane.ca_file)
    configuration.api_key = {"authorization": f"Bearer {token}"}
    return client.CoreV1Api(client.ApiClient(configuration))


def refusal(call) -> str:
    """The API server's refusal of `call` (an admission denial), as its message."""
    with pytest.raises(ApiException) as error:
        call()
    assert error.value.status in (403, 422), error.value.body
    return error.value.body


def test_each_worker_role_writes_only_the_configmap_it_fills(control_plane, kube_client, kubectl, namespace):
    ns = namespace
    objs = chart_objects(ns)
    kubectl("apply", "--server-side", "--field-manager=kareus-tests", "-f", "-",
            input="---\n".join(yaml.safe_dump(o) for o in objs))
    core = client.CoreV1Api(kube_client)
    try:
        for suffix in ("profile", "plan", "progress"):  # as the operator creates them
            core.create_namespaced_config_map(ns, {"metadata": {"name": f"a-{suffix}", "labels": {
                "kareus.dev/job-name": "a", "kareus.dev/job-uid": "uid-a"}}, "data": {"v": "0"}})
        train = pod_client(control_plane, core, ns, "a-train-0-x7k2p")
        optimize = pod_client(control_plane, core, ns, "a-optimize-q9z4m")
        profile = pod_client(control_plane, core, ns, "a-profile-b3c4d")
        # The policy is in force once a training pod's write of its plan is refused (admission
        # picks a new policy up asynchronously).
        message = wait_until(lambda: _outcome(lambda: train.patch_namespaced_config_map("a-plan", ns, {"data": {"v": "x"}})),
                             lambda outcome: outcome != "ok", timeout_s=60, what="the workers' policy in force")
        assert ROLE_MESSAGE in message and "a-train-0-x7k2p" in message
        assert "a training pod never writes its job's plan" in message

        train.patch_namespaced_config_map("a-progress", ns, {"data": {"v": "1"}})  # what it fills
        optimize.patch_namespaced_config_map("a-plan", ns, {"data": {"v": "plan"}})
        profile.patch_namespaced_config_map("a-profile", ns, {"data": {"v": "measured"}})
        for who, name in ((train, "a-profile"), (optimize, "a-progress"), (optimize, "a-profile"),
                          (profile, "a-plan"), (profile, "a-progress")):
            assert ROLE_MESSAGE in refusal(lambda who=who, name=name: who.patch_namespaced_config_map(
                name, ns, {"data": {"v": "forged"}}))
        # Nor can a training pod delete its plan (RBAC: workers never delete) and make one of its own.
        refusal(lambda: train.delete_namespaced_config_map("a-plan", ns))
        core.delete_namespaced_config_map("a-plan", ns)
        assert ROLE_MESSAGE in refusal(lambda: train.create_namespaced_config_map(ns, {"metadata": {
            "name": "a-plan", "labels": {"kareus.dev/job-name": "a"}}, "data": {"v": "forged"}}))
        assert {name: cm.data for name, cm in ((n, core.read_namespaced_config_map(n, ns))
                                              for n in ("a-profile", "a-progress"))} == {
            "a-profile": {"v": "measured"}, "a-progress": {"v": "1"}}
    finally:
        for o in objs:
            if o["kind"].startswith("ValidatingAdmissionPolicy"):
                kubectl("delete", o["kind"], o["metadata"]["name"], "--ignore-not-found", "--wait=false")


def _outcome(call) -> str:
    try:
        call()
    except ApiException as error:
        return error.body or str(error.status)
    return "ok"
