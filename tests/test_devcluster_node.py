"""The emulated GPU node under the real control plane: what a kubelet does, checked through the API.

Pods are created through the real API server, bound by the real scheduler and run by the node;
workloads (a batch Job) are driven by the real controllers. Each test gets its own namespace.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest
from kareus_devcluster.cluster import NODE_GPUS, NODE_NAME, node_gpu_uuids
from kube_helpers import read_or_none, wait_until
from kubernetes import client
from kubernetes.client.rest import ApiException

PY = sys.executable

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def core(dev_cluster, kube_client) -> client.CoreV1Api:
    return client.CoreV1Api(kube_client)


def pod(name: str, command: list[str], *, restart: str = "Never", container: dict | None = None, **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "t"}},
            "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": 5,
                     "containers": [{"name": "main", "image": "example.org/test:1", "command": command,
                                     **(container or {})}], **spec}}


def wait_pod(core: client.CoreV1Api, namespace: str, name: str, check, timeout_s: float = 60.0):
    return wait_until(lambda: read_or_none(lambda: core.read_namespaced_pod(name, namespace)), check,
                      timeout_s=timeout_s, what=f"pod {namespace}/{name}")


def phase_in(*phases):
    return lambda body: body is not None and body.status.phase in phases


def test_the_node_registers_like_a_gpu_node(dev_cluster, kube_client):
    node = client.CoreV1Api(kube_client).read_node(NODE_NAME)
    labels = node.metadata.labels
    assert labels["nvidia.com/gpu.present"] == "true" and labels["nvidia.com/gpu.count"] == str(NODE_GPUS)
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-40GB" and labels["kubernetes.io/hostname"] == NODE_NAME
    assert node.status.capacity["nvidia.com/gpu"] == str(NODE_GPUS) == node.status.allocatable["nvidia.com/gpu"]
    assert {c.type: c.status for c in node.status.conditions}["Ready"] == "True"
    assert node.status.node_info.kubelet_version == dev_cluster.control_plane.get("/version")["gitVersion"]
    lease = client.CoordinationV1Api(kube_client).read_namespaced_lease(NODE_NAME, "kube-node-lease")
    assert lease.spec.holder_identity == NODE_NAME and lease.spec.renew_time is not None


def test_a_pod_runs_with_its_environment_volumes_token_and_status(core, namespace, kubectl):
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "cfg"}, "data": {"greeting": "hello"}})
    program = ("import json, os, pathlib, ssl, sys, urllib.request\n"
               "sa = pathlib.Path(os.environ['KAREUS_SERVICEACCOUNT_DIR'])\n"
               "request = urllib.request.Request('https://%s:%s/apis/authentication.k8s.io/v1/selfsubjectreviews' % ("
               "os.environ['KUBERNETES_SERVICE_HOST'], os.environ['KUBERNETES_SERVICE_PORT']), method='POST', data=b'{}',"
               " headers={'Authorization': 'Bearer ' + (sa / 'token').read_text(), 'Content-Type': 'application/json'})\n"
               "who = json.load(urllib.request.urlopen(request, context=ssl.create_default_context(cafile=str(sa / 'ca.crt'))))\n"
               "print(pathlib.Path(sys.argv[1]).read_text(), os.environ['MY_POD'], os.environ['FIXED'], os.environ['PEER'],"
               " os.environ['GREETING'], (sa / 'namespace').read_text(), who['status']['userInfo']['username'])\n")
    env = [{"name": "MY_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "FIXED", "value": "4$(SUFFIX)"}, {"name": "SUFFIX", "value": "2"},
           {"name": "PEER", "value": "p-0.svc-name.default.svc"},
           {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "greeting"}}}]
    env = [env[2], *env[:2], *env[3:]]  # $(SUFFIX) expands only when SUFFIX is defined earlier
    core.create_namespaced_pod(namespace, pod("greeter", [PY, "-c", program, "/etc/cfg/greeting"], container={
        "env": env, "volumeMounts": [{"name": "cfg", "mountPath": "/etc/cfg"}]},
        volumes=[{"name": "cfg", "configMap": {"name": "cfg"}}]))
    done = wait_pod(core, namespace, "greeter", phase_in("Succeeded", "Failed"))
    log = core.read_namespaced_pod_log("greeter", namespace)
    assert done.status.phase == "Succeeded", log
    assert log.split() == ["hello", "greeter", "42", "127.0.0.1", "hello", namespace,
                           f"system:serviceaccount:{namespace}:default"]
    status = done.status.container_statuses[0]
    assert status.image == "example.org/test:1" and status.image_id.startswith("example.org/test@sha256:")
    assert status.container_id.startswith("kareus-dev://") and status.restart_count == 0
    assert status.state.terminated.exit_code == 0 and status.state.terminated.reason == "Completed"
    assert done.spec.node_name == NODE_NAME and done.status.pod_ip and done.status.start_time
    assert {c.type: c.status for c in done.status.conditions}["Ready"] == "False"
    assert kubectl("logs", "-n", namespace, "greeter").stdout == log  # kubectl → API server → node, over TLS


def test_exit_codes_restarts_and_crash_loops_are_reported(core, namespace, tmp_path):
    core.create_namespaced_pod(namespace, pod("crasher", [PY, "-c", "import sys; sys.exit(7)"]))
    failed = wait_pod(core, namespace, "crasher", phase_in("Succeeded", "Failed"))
    assert failed.status.phase == "Failed"
    assert failed.status.container_statuses[0].state.terminated.exit_code == 7
    assert failed.status.container_statuses[0].state.terminated.reason == "Error"

    marker = tmp_path / "tried"
    once = f"import pathlib, sys; p = pathlib.Path({str(marker)!r}); first = not p.exists(); p.touch(); sys.exit(3 if first else 0)"
    core.create_namespaced_pod(namespace, pod("flaky", [PY, "-c", once], restart="OnFailure"))
    done = wait_pod(core, namespace, "flaky", phase_in("Succeeded", "Failed"))
    status = done.status.container_statuses[0]
    assert done.status.phase == "Succeeded" and status.restart_count == 1
    assert status.last_state.terminated.exit_code == 3


def test_graceful_deletion_sends_sigterm_and_waits(core, namespace, tmp_path):
    marker = tmp_path / "terminated"
    program = (f"import pathlib, signal, sys, time\n"
               f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(marker)!r}).write_text('bye'), sys.exit(0)))\n"
               f"print('up', flush=True)\n"
               f"time.sleep(600)\n")
    core.create_namespaced_pod(namespace, pod("sleeper", [PY, "-c", program]))
    wait_pod(core, namespace, "sleeper", lambda body: body is not None and body.status.phase == "Running"
             and "up" in core.read_namespaced_pod_log("sleeper", namespace))
    core.delete_namespaced_pod("sleeper", namespace)
    terminating = core.read_namespaced_pod("sleeper", namespace)
    assert terminating.metadata.deletion_timestamp is not None  # the kubelet, not the API, ends the pod
    wait_pod(core, namespace, "sleeper", lambda body: body is None, timeout_s=30)
    assert marker.read_text() == "bye"


def test_gpus_are_whole_exclusive_and_visible_through_pod_resources(dev_cluster, core, namespace, tmp_path):
    from kareus_node.podresources import PodResourcesClient

    release = tmp_path / "release"
    program = ("import os, pathlib, sys, time\n"
               "print(os.environ.get('NVIDIA_VISIBLE_DEVICES', ''), flush=True)\n"
               "while not pathlib.Path(sys.argv[1]).exists(): time.sleep(0.05)\n")
    for name in ("a", "b", "c"):
        core.create_namespaced_pod(namespace, pod(name, [PY, "-c", program, str(release)],
                                                  container={"resources": {"limits": {"nvidia.com/gpu": "3"}}}))
    core.create_namespaced_pod(namespace, pod("greedy", [PY, "-c", "pass"], container={
        "resources": {"limits": {"nvidia.com/gpu": str(NODE_GPUS + 1)}}}))
    logs = {}
    for name in ("a", "b"):
        wait_pod(core, namespace, name, lambda body, n=name: body is not None and body.status.phase == "Running"
                 and core.read_namespaced_pod_log(n, namespace).strip())
        logs[name] = set(core.read_namespaced_pod_log(name, namespace).split()[0].split(","))
    assert all(len(held) == 3 for held in logs.values()) and not logs["a"] & logs["b"]
    assert logs["a"] | logs["b"] <= set(node_gpu_uuids(NODE_NAME))
    # 8 GPUs: the scheduler keeps the third pod Pending (its node has 2 left) and the greedy one too.
    assert core.read_namespaced_pod("c", namespace).status.phase == "Pending"
    greedy = core.read_namespaced_pod("greedy", namespace)
    assert greedy.status.phase == "Pending" and "nvidia.com/gpu" in greedy.status.conditions[0].message

    # The node agent reads who holds which GPU exactly as from a kubelet's pod-resources socket.
    socket = Path(dev_cluster.nodes[0].root) / "host" / "var/lib/kubelet/pod-resources/kubelet.sock"
    holders = PodResourcesClient(str(socket)).gpu_holders()
    mine = {uuid for uuid, pods in holders.items() for held in pods if held.namespace == namespace}
    assert mine == logs["a"] | logs["b"]
    release.touch()
    done = wait_pod(core, namespace, "c", phase_in("Succeeded", "Failed"))
    assert done.status.phase == "Succeeded"


def test_the_job_controller_runs_a_batch_job_to_completion(dev_cluster, kube_client, namespace):
    batch = client.BatchV1Api(kube_client)
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "two"},
           "spec": {"completions": 2, "parallelism": 2, "completionMode": "Indexed", "backoffLimit": 0,
                    "template": {"spec": {"restartPolicy": "Never", "containers": [{
                        "name": "main", "image": "example.org/test:1",
                        "command": [PY, "-c", "import os; print('index', os.environ['JOB_COMPLETION_INDEX'])"]}]}}}}
    batch.create_namespaced_job(namespace, job)
    def finished(status) -> bool:  # SuccessCriteriaMet comes first, Complete once the pods are done
        return bool(status.failed) or any(c.type in ("Complete", "Failed") and c.status == "True"
                                          for c in status.conditions or [])

    status = wait_until(lambda: batch.read_namespaced_job("two", namespace).status, finished, timeout_s=90,
                        what="Job two")
    assert status.succeeded == 2 and not status.failed
    assert {c.type for c in status.conditions if c.status == "True"} >= {"SuccessCriteriaMet", "Complete"}


def test_the_node_is_held_to_node_authorization(dev_cluster, namespace, kube_client):
    """The node's own credentials (system:node:<name>) cannot read a Secret no pod of it uses."""
    core = client.CoreV1Api(kube_client)
    core.create_namespaced_secret(namespace, {"metadata": {"name": "private"},
                                              "data": {"k": base64.b64encode(b"v").decode()}})
    plane = dev_cluster.control_plane
    node_config = json.loads((dev_cluster.workdir / f"node-{NODE_NAME}.json").read_text())
    configuration = client.Configuration()
    configuration.host, configuration.ssl_ca_cert = plane.url, str(plane.ca_file)
    configuration.cert_file, configuration.key_file = node_config["cert_file"], node_config["key_file"]
    as_node = client.CoreV1Api(client.ApiClient(configuration))
    with pytest.raises(ApiException) as refused:
        as_node.read_namespaced_secret("private", namespace)
    assert refused.value.status == 403 and f"system:node:{NODE_NAME}" in refused.value.body
