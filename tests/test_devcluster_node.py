"""The dev cluster's real nodes under the real control plane: the upstream kubelet, containerd and runc,
kube-proxy and CoreDNS, checked through the API as a user of a kind cluster would.

Pods are created through the real API server, bound by the real scheduler and run by the node's kubelet
in Kareus's own images; workloads (a batch Job) are driven by the real controllers. Each test gets its
own namespace. Only the GPU is simulated (the device plugin).
"""

from __future__ import annotations

import base64
import ipaddress
import re
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
from kareus_devcluster.cluster import NODE_GPUS, NODE_NAME, node_gpu_uuids
from kube_helpers import read_or_none, wait_until
from kubernetes import client, config
from kubernetes.client.rest import ApiException

PY = "python"  # the image's
IMAGE = "localhost/kareus/runtime:0.1.0"
IMAGE_UID = 65532  # images/runtime.Dockerfile's USER
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def core(dev_cluster, kube_client) -> client.CoreV1Api:
    return client.CoreV1Api(kube_client)


def pod(name: str, command: list[str], *, restart: str = "Never", container: dict | None = None, **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": 5,
                     "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "IfNotPresent",
                                     "command": command, **(container or {})}], **spec}}


def shared(path: Path) -> dict:
    """A hostPath volume of a test's directory (the nodes see the host's /tmp), writable by the image's user."""
    for directory in (path, *path.parents):
        if directory == Path("/tmp"):
            break
        directory.chmod(directory.stat().st_mode | 0o755)
    path.chmod(0o777)
    return {"name": "shared", "hostPath": {"path": str(path), "type": "Directory"}}


SHARED_MOUNT = {"volumeMounts": [{"name": "shared", "mountPath": "/shared"}]}


def wait_pod(core: client.CoreV1Api, namespace: str, name: str, check, timeout_s: float = 90.0):
    return wait_until(lambda: read_or_none(lambda: core.read_namespaced_pod(name, namespace)), check,
                      timeout_s=timeout_s, what=f"pod {namespace}/{name}")


def phase_in(*phases):
    return lambda body: body is not None and body.status.phase in phases


def running(core: client.CoreV1Api, namespace: str, name: str):
    return wait_pod(core, namespace, name, lambda body: body is not None and body.status.phase == "Running" and all(
        c.ready for c in body.status.container_statuses or [None] if c is not None))


def test_nodes_run_the_upstream_kubelet_on_containerd(dev_cluster, kubectl):
    wide = kubectl("get", "nodes", "-o", "wide").stdout.splitlines()
    header, rows = wide[0].split(), [line.split() for line in wide[1:]]
    version, runtime = header.index("VERSION"), header.index("CONTAINER-RUNTIME")
    assert rows and all(re.fullmatch(r"v1\.34\.\d+", row[version]) for row in rows), wide
    assert all(row[-1].startswith("containerd://") for row in rows), wide
    assert runtime == len(header) - 1


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
               f"sa = pathlib.Path({SA_DIR!r})\n"
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
    assert log.split() == ["hello", "greeter", "42", "p-0.svc-name.default.svc", "hello", namespace,
                           f"system:serviceaccount:{namespace}:default"]
    status = done.status.container_statuses[0]
    assert status.image == IMAGE and status.image_id.startswith("sha256:")
    assert status.container_id.startswith("containerd://") and status.restart_count == 0
    assert status.state.terminated.exit_code == 0 and status.state.terminated.reason == "Completed"
    assert done.spec.node_name == NODE_NAME and done.status.start_time
    pod_ip = ipaddress.ip_address(done.status.pod_ip)
    assert not pod_ip.is_loopback and str(pod_ip) != done.status.host_ip and pod_ip in ipaddress.ip_network(
        "10.244.0.0/16")
    assert {c.type: c.status for c in done.status.conditions}["Ready"] == "False"
    assert kubectl("logs", "-n", namespace, "greeter").stdout == log  # kubectl → API server → node, over TLS


def test_exit_codes_restarts_and_crash_loops_are_reported(core, namespace, tmp_path):
    core.create_namespaced_pod(namespace, pod("crasher", [PY, "-c", "import sys; sys.exit(7)"]))
    failed = wait_pod(core, namespace, "crasher", phase_in("Succeeded", "Failed"))
    assert failed.status.phase == "Failed"
    assert failed.status.container_statuses[0].state.terminated.exit_code == 7
    assert failed.status.container_statuses[0].state.terminated.reason == "Error"

    # A restarted container keeps the pod's emptyDir: the second run finds the first one's mark.
    once = "import pathlib, sys; p = pathlib.Path('/state/tried'); first = not p.exists(); p.touch(); sys.exit(3 if first else 0)"
    core.create_namespaced_pod(namespace, pod("flaky", [PY, "-c", once], restart="OnFailure", container={
        "volumeMounts": [{"name": "state", "mountPath": "/state"}]}, volumes=[{"name": "state", "emptyDir": {}}]))
    done = wait_pod(core, namespace, "flaky", phase_in("Succeeded", "Failed"))
    status = done.status.container_statuses[0]
    # One restart (the first run's exit 3), then success; a real kubelet drops lastState once the pod is done.
    assert done.status.phase == "Succeeded" and status.restart_count == 1
    assert status.state.terminated.exit_code == 0


def test_graceful_deletion_sends_sigterm_and_waits(core, namespace, tmp_path):
    marker = tmp_path / "terminated"
    program = ("import pathlib, signal, sys, time\n"
               "signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path('/shared/terminated').write_text('bye'), sys.exit(0)))\n"
               "print('up', flush=True)\n"
               "time.sleep(600)\n")
    core.create_namespaced_pod(namespace, pod("sleeper", [PY, "-c", program], container=SHARED_MOUNT,
                                              volumes=[shared(tmp_path)]))
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
               "print(os.environ.get('NVIDIA_VISIBLE_DEVICES', ''), os.environ.get('KAREUS_SIM_GPU_DIR', ''),"
               " os.path.isdir(os.environ.get('KAREUS_SIM_GPU_DIR', '/nonexistent')), flush=True)\n"
               "while not pathlib.Path('/shared/release').exists(): time.sleep(0.05)\n")
    volume = shared(tmp_path)
    for name in ("a", "b", "c"):
        core.create_namespaced_pod(namespace, pod(name, [PY, "-c", program], volumes=[volume], container={
            "resources": {"limits": {"nvidia.com/gpu": "3"}}, **SHARED_MOUNT}))
    core.create_namespaced_pod(namespace, pod("greedy", [PY, "-c", "pass"], container={
        "resources": {"limits": {"nvidia.com/gpu": str(NODE_GPUS + 1)}}}))
    logs = {}
    for name in ("a", "b"):
        wait_pod(core, namespace, name, lambda body, n=name: body is not None and body.status.phase == "Running"
                 and core.read_namespaced_pod_log(n, namespace).strip())
        visible, sim_dir, mounted = core.read_namespaced_pod_log(name, namespace).split()
        logs[name] = set(visible.split(","))
        # The device plugin's Allocate: the node's simulated GPUs' directory, mounted (one shared device)
        assert sim_dir == "/var/lib/kareus-sim-gpus" and mounted == "True"
    assert all(len(held) == 3 for held in logs.values()) and not logs["a"] & logs["b"]
    assert logs["a"] | logs["b"] <= set(node_gpu_uuids(NODE_NAME))
    # 8 GPUs: the scheduler keeps the third pod Pending (its node has 2 left) and the greedy one too.
    assert core.read_namespaced_pod("c", namespace).status.phase == "Pending"
    greedy = core.read_namespaced_pod("greedy", namespace)
    assert greedy.status.phase == "Pending" and "nvidia.com/gpu" in greedy.status.conditions[0].message

    # The node agent reads who holds which GPU exactly as from a kubelet's pod-resources socket.
    holders = PodResourcesClient(str(dev_cluster.nodes[0].pod_resources_socket)).gpu_holders()
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
                        "name": "main", "image": IMAGE, "imagePullPolicy": "IfNotPresent",
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
    kubeconfig = dev_cluster.nodes[0].credentials.kubelet_kubeconfig  # what the node's kubelet runs with
    as_node = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
    with pytest.raises(ApiException) as refused:
        as_node.read_namespaced_secret("private", namespace)
    assert refused.value.status == 403 and f"system:node:{NODE_NAME}" in refused.value.body


def test_cluster_dns_and_services_route_over_the_pod_network(core, namespace, kubectl):
    """CoreDNS answers the cluster's names; kube-proxy sends a Service's ClusterIP to its ready pod."""
    server = ("import http.server, socket\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200); self.end_headers(); self.wfile.write(socket.gethostname().encode())\n"
              "http.server.HTTPServer(('', 8000), H).serve_forever()\n")
    core.create_namespaced_pod(namespace, pod("web", [PY, "-c", server], container={
        "ports": [{"containerPort": 8000}],
        "readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1}}))
    core.create_namespaced_service(namespace, {"metadata": {"name": "web"}, "spec": {
        "selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8000}]}})
    running(core, namespace, "web")
    # The endpoints controller lists the ready pod, then kube-proxy programs the rule on its next sync
    # (seconds on a loaded node): a client of a freshly made Service retries until then, as here.
    wait_until(lambda: read_or_none(lambda: core.read_namespaced_endpoints("web", namespace)),
               lambda body: body is not None and bool(body.subsets) and bool(body.subsets[0].addresses),
               timeout_s=60, what="the web Service's ready endpoint")
    kubernetes_ip = core.read_namespaced_service("kubernetes", "default").spec.cluster_ip
    web_ip = core.read_namespaced_service("web", namespace).spec.cluster_ip
    client_program = ("import socket, time, urllib.request\n"
                      "print(socket.gethostbyname('kubernetes.default.svc.cluster.local'))\n"
                      f"print(socket.gethostbyname('web.{namespace}.svc.cluster.local'))\n"
                      "for attempt in range(30):\n"
                      "    try:\n"
                      "        body = urllib.request.urlopen('http://web', timeout=10).read().decode(); break\n"
                      "    except OSError:\n"
                      "        if attempt == 29: raise\n"
                      "        time.sleep(1)\n"
                      "print(body)\n")
    core.create_namespaced_pod(namespace, pod("asker", [PY, "-c", client_program]))
    done = wait_pod(core, namespace, "asker", phase_in("Succeeded", "Failed"))
    log = core.read_namespaced_pod_log("asker", namespace).split()
    assert done.status.phase == "Succeeded", log
    assert log == [kubernetes_ip, web_ip, "web"]  # the short name through the pod's search path
    endpoints = core.read_namespaced_endpoints("kubernetes", "default")
    assert endpoints.subsets and endpoints.subsets[0].addresses  # the API server, behind its Service


def test_exec_and_port_forward_go_through_the_kubelet(core, namespace, kubectl, dev_cluster):
    server = ("import http.server\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200); self.end_headers(); self.wfile.write(b'forwarded')\n"
              "http.server.HTTPServer(('127.0.0.1', 8000), H).serve_forever()\n")
    core.create_namespaced_pod(namespace, pod("inside", [PY, "-c", server]))
    running(core, namespace, "inside")
    uid = kubectl("exec", "-n", namespace, "inside", "--", PY, "-c", "import os; print(os.getuid())").stdout
    assert int(uid) == IMAGE_UID  # the image's USER, applied by runc
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        local = probe.getsockname()[1]
    assert dev_cluster.control_plane is not None
    forward = subprocess.Popen([str(dev_cluster.control_plane.kubectl()), f"--kubeconfig={dev_cluster.kubeconfig}",
                                "port-forward", "-n", namespace, "pod/inside", f"{local}:8000"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert forward.stdout is not None and "Forwarding from" in forward.stdout.readline()
        body = wait_until(lambda: _get(f"http://127.0.0.1:{local}/"), lambda text: text == "forwarded",
                          timeout_s=30, what="the forwarded port")
        assert body == "forwarded"  # the server listens on the pod's loopback only: no route but the kubelet's
    finally:
        forward.terminate()
        forward.wait(timeout=10)


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


def test_security_context_and_limits_are_enforced(core, namespace):
    """runAsUser, a read-only root filesystem and a memory limit, applied by runc and the kernel."""
    program = ("import os, pathlib\n"
               "print(os.getuid(), os.getgid())\n"
               "try:\n    pathlib.Path('/usr/x').write_text('x'); print('wrote')\nexcept OSError as e:\n    print(e.errno)\n"
               "pathlib.Path('/scratch/x').write_text('x'); print('scratch')\n")
    core.create_namespaced_pod(namespace, pod("locked", [PY, "-c", program], container={
        "securityContext": {"runAsUser": 1234, "runAsGroup": 4321, "readOnlyRootFilesystem": True,
                            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]},
        volumes=[{"name": "scratch", "emptyDir": {"sizeLimit": "1Mi"}}]))
    done = wait_pod(core, namespace, "locked", phase_in("Succeeded", "Failed"))
    assert core.read_namespaced_pod_log("locked", namespace).split() == ["1234", "4321", "30", "scratch"]  # EROFS
    assert done.status.phase == "Succeeded"

    hog = "b = bytearray(512 * 1024 * 1024); print('allocated', flush=True)"
    core.create_namespaced_pod(namespace, pod("hog", [PY, "-c", hog], container={
        "resources": {"requests": {"memory": "64Mi"}, "limits": {"memory": "128Mi"}}}))
    killed = wait_pod(core, namespace, "hog", phase_in("Succeeded", "Failed"))
    assert killed.status.phase == "Failed" and killed.status.qos_class == "Burstable"
    assert killed.status.container_statuses[0].state.terminated.reason == "OOMKilled"
