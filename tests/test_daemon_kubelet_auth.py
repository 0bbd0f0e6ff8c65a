"""Authorisation in cluster mode, against a real `kareus-node` process: a fake kubelet pod-resources
gRPC server on a Unix socket, a fake API server listing the node's pods, and a fake proc root that
says which pod the calling process (this test) is in. Only a pod's own, whole, non-MIG GPUs within
policy may be locked; refusals are counted; a pod losing its GPU or the kubelet going away resets
the lock (fail closed)."""

from __future__ import annotations

import json
import os
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from kareus_node._proto import api_pb2, api_pb2_grpc
from test_daemon_support import start_daemon, wait_for

from kareus.daemon_client import DaemonConnection, DaemonError, connect
from kareus.gpu import sim_uuid
from kareus.metric_names import DAEMON_REQUESTS_TOTAL, GPU_LOCKED_CLOCK_HERTZ

GPU = [sim_uuid("node-a", "A100-SXM4-40GB", i) for i in range(4)]
UID = {name: f"{n:08x}-1111-2222-3333-444455556666" for n, name in enumerate(
    ["train", "shared", "mig", "first", "second", "elsewhere", "ghost"], start=1)}
# (namespace, name, uid, GPU device ids as the device plugin reports them)
PODS = [
    ("team-a", "llama-train-0", UID["train"], [GPU[0]]),
    ("team-a", "shared-0", UID["shared"], [GPU[1] + "::0"]),  # time-slicing replica
    ("team-a", "mig-0", UID["mig"], [GPU[2]]),  # MIG is enabled on GPU 2
    ("team-a", "first", UID["first"], [GPU[3]]),
    ("team-b", "second", UID["second"], [GPU[3]]),  # two pods on one GPU
    ("team-c", "elsewhere", UID["elsewhere"], []),  # a namespace the policy does not allow
]


class FakeKubelet(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self) -> None:
        self.pods = list(PODS)

    def List(self, request, context):
        return api_pb2.ListPodResourcesResponse(pod_resources=[
            api_pb2.PodResources(name=name, namespace=ns, containers=[api_pb2.ContainerResources(
                name="main", devices=[api_pb2.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=ids),
                                      api_pb2.ContainerDevices(resource_name="example.com/nic", device_ids=["nic0"])])])
            for ns, name, _uid, ids in self.pods])


def _api_server(queries: list[str]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            queries.append(self.path)
            items = [{"metadata": {"uid": uid, "namespace": ns, "name": name,
                                   "labels": {"kareus.dev/job-name": "llama"} if name.startswith("llama") else {}}}
                     for ns, name, uid, _ids in PODS]
            body = json.dumps({"kind": "PodList", "items": items}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


CGROUP_STYLES = [
    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-ab12.scope\n",
    "12:memory:/kubepods/besteffort/pod{d}/0123abcd\n11:cpu:/kubepods/besteffort/pod{d}/0123abcd\n",
    "0::/kubepods/pod{d}/4567\n",
]


class Cluster:
    def __init__(self, tmp_path) -> None:
        self.kubelet = FakeKubelet()
        self.grpc_socket = str(tmp_path / "kubelet.sock")
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(self.kubelet, self.grpc)
        self.grpc.add_insecure_port(f"unix://{self.grpc_socket}")
        self.grpc.start()
        self.queries: list[str] = []
        self.api = _api_server(self.queries)
        self.proc_root = tmp_path / "proc"
        (self.proc_root / str(os.getpid())).mkdir(parents=True)

    def become(self, pod: str | None, style: int = 0) -> None:
        """Make this test process look, to the daemon, like it runs in `pod` (None: outside any pod)."""
        uid = UID.get(pod, "")
        text = CGROUP_STYLES[style].format(u=uid.replace("-", "_"), d=uid) if pod else "0::/user.slice/session-1.scope\n"
        (self.proc_root / str(os.getpid()) / "cgroup").write_text(text)

    def close(self) -> None:
        self.grpc.stop(None)
        self.api.shutdown()


@pytest.fixture
def cluster(tmp_path):
    cluster = Cluster(tmp_path)
    yield cluster
    cluster.close()


@pytest.fixture
def daemon(tmp_path, cluster):
    config = tmp_path / "config.yaml"
    config.write_text("podRecheckSeconds: 0.2\nallowedNamespaces: [team-a, team-b]\n"
                      "clockBounds:\n  gpuModels:\n    NVIDIA-A100-SXM4-40GB: {floorMHz: 900, ceilingMHz: 1305}\n")
    daemon = start_daemon(tmp_path, "--sim-mig", "2", "--config", str(config), "--kube-api", f"http://127.0.0.1:{cluster.api.server_address[1]}",
                          "--pod-resources-socket", cluster.grpc_socket, "--proc-root", str(cluster.proc_root), gpus=4, socket_name="d.sock")
    yield daemon
    daemon.stop()


def _refusal(socket_path: str, gpu: str, mhz: int = 1200) -> str:
    with DaemonConnection(socket_path) as connection, pytest.raises(DaemonError) as info:
        connection.lock([gpu], mhz)
    assert info.value.code in ("refused", "busy"), info.value
    return str(info.value)


def test_only_the_pods_own_whole_gpus_within_policy_may_be_locked(cluster, daemon):
    cluster.become("train", style=0)
    with DaemonConnection(daemon.socket_path) as connection:
        gpus = {gpu.uuid: gpu for gpu in connection.discover()}
        assert [gpus[g].controllable for g in GPU] == [True, False, False, False]
        assert (gpus[GPU[0]].min_clock_mhz, gpus[GPU[0]].max_clock_mhz) == (900, 1305)
        connection.lock([GPU[0]], 1200, wait=True)
        assert daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU[0], namespace="team-a", pod="llama-train-0",
                             kareusjob="llama", node="node-a") == 1.2e9
        for gpu, mhz, expected in [
            (GPU[1], 1200, f"GPU {GPU[1]} is not allocated to pod team-a/llama-train-0"),
            (GPU[0], 1410, f"clock_mhz: 1410 MHz is outside the policy bounds 900–1305 MHz of GPU {GPU[0]}"),
        ]:
            with pytest.raises(DaemonError) as info:
                connection.lock([gpu], mhz)
            assert expected in str(info.value)
            assert expected in _refusal(daemon.socket_path, gpu, mhz)
    assert wait_for(lambda: daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU[0]) == 0)

    cases = [
        ("shared", 1, GPU[1], "is shared (time-slicing/MPS replica)"),
        ("mig", 2, GPU[2], "has MIG enabled"),
        ("first", 0, GPU[3], "is allocated to several pods"),
        ("second", 1, GPU[3], "is allocated to several pods"),
        ("elsewhere", 2, GPU[0], "namespace team-c is not allowed by the node policy"),
        ("ghost", 0, GPU[0], f"pod {UID['ghost']} is not scheduled on this node"),
        (None, 0, GPU[0], f"caller pid {os.getpid()} is not in a Kubernetes pod"),
    ]
    for pod, style, gpu, reason in cases:
        cluster.become(pod, style)
        assert reason in _refusal(daemon.socket_path, gpu), (pod, reason)
    # 2 refusals on the first connection + 1 each from _refusal for them + one per case.
    assert daemon.metric(DAEMON_REQUESTS_TOTAL, result="refused") == 4 + len(cases)
    assert all("fieldSelector=spec.nodeName%3Dnode-a" in q for q in cluster.queries)
    for uuid in GPU:
        assert daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=uuid) == 0


def test_runtime_client_gets_its_pods_gpus_and_loses_them_with_the_pod(cluster, daemon):
    cluster.become("train", style=1)
    client = connect(daemon.socket_path, job="ignored-when-the-pod-says")
    assert client.gpu_uuids == (GPU[0],)
    client.request_clock(1005, instruction="s0.F0")
    assert client.flush()
    wait_for(lambda: daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU[0], kareusjob="llama") == 1.005e9)
    # The pod is deleted: the kubelet stops listing it; the periodic re-check resets its GPU.
    cluster.kubelet.pods = [p for p in PODS if p[1] != "llama-train-0"]
    wait_for(lambda: daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU[0]) == 0, timeout_s=10)
    client.close()


def test_kubelet_unavailable_fails_closed(cluster, daemon):
    cluster.become("train")
    with DaemonConnection(daemon.socket_path) as connection:
        connection.lock([GPU[0]], 1200, wait=True)
        assert daemon.http_status("/readyz") == 200
        cluster.grpc.stop(None)
        wait_for(lambda: daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU[0]) == 0, timeout_s=10)
        wait_for(lambda: daemon.http_status("/readyz") == 503)
        with pytest.raises(DaemonError) as info:
            connection.lock([GPU[0]], 1200)
        assert info.value.code == "unavailable"
        assert "failing closed" in str(info.value)
    assert daemon.metric(DAEMON_REQUESTS_TOTAL, result="unavailable") >= 1
