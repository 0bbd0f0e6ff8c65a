"""Authorisation of TCP callers by their projected ServiceAccount token, against the session's real
kube-apiserver: tokens come from the TokenRequest API (bound to a Pod object, audience kareus-node,
as a kubelet's projected volume gets them) and the authorizer reviews them with the TokenReview
API as its own ServiceAccount, under real RBAC. Then the real `kareus-node` process on simulated
GPUs: a client over TCP locks its pod's GPU (named by NVML index by the device plugin) and the
lease ends with the connection or with the pod."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from kareus_node._proto import api_pb2, api_pb2_grpc
from kareus_node.auth import AuthUnavailable, BearerToken, TokenAuthorizer
from kareus_node.config import parse_config
from kareus_node.kubeapi import KubeAPI
from kareus_node.podresources import GPUHolder, gpu_holders
from kareus_node.pods import PodDirectory
from kubernetes import client
from test_daemon_support import DAEMON_CMD, DaemonProcess, read_line, wait_for

from kareus.daemon_client import (
    DaemonConnection,
    DaemonError,
    connect,
    daemon_endpoint,
    endpoint_from_env,
    protocol,
)
from kareus.gpu import sim_uuid
from kareus.metric_names import GPU_LOCKED_CLOCK_HERTZ

NODE = "node-a"
GPU = [sim_uuid(NODE, "A100-SXM4-40GB", i) for i in range(2)]
AUDIENCE = "kareus-node"


class FakePodResources:
    """The kubelet's answer, already as GPU UUID → holders (what `PodResourcesClient` returns)."""

    def __init__(self, holders: dict[str, list[GPUHolder]]) -> None:
        self.holders = holders

    def gpu_holders(self, *, max_age_s: float = 0.0) -> dict[str, list[GPUHolder]]:
        return self.holders


class Cluster:
    """A namespace with a training pod's ServiceAccount and Pod objects, and the node agent's own
    ServiceAccount bound to exactly what the chart grants it (read pods, create tokenreviews)."""

    def __init__(self, kube_client, namespace: str, tmp_path, control_plane, *, review_rights: bool = True) -> None:
        self.core = client.CoreV1Api(kube_client)
        self.rbac = client.RbacAuthorizationV1Api(kube_client)
        self.namespace = namespace
        self.plane = control_plane
        for account in ("trainer", "agent"):
            self.core.create_namespaced_service_account(namespace, {"metadata": {"name": account}})
        rules = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
                 {"nonResourceURLs": ["/openid/v1/jwks"], "verbs": ["get"]}]  # the token signing keys
        if review_rights:
            rules.append({"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]})
        self.role = f"{namespace}-agent"
        self.rbac.create_cluster_role({"metadata": {"name": self.role}, "rules": rules})
        self.rbac.create_cluster_role_binding({
            "metadata": {"name": self.role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": self.role},
            "subjects": [{"kind": "ServiceAccount", "name": "agent", "namespace": namespace}]})
        self.agent_dir = tmp_path / "agent-sa"
        self.agent_dir.mkdir()
        (self.agent_dir / "token").write_text(self.token("agent", audiences=None))
        (self.agent_dir / "ca.crt").write_bytes(control_plane.ca_file.read_bytes())

    def pod(self, name: str, node: str = NODE, *, job: str = "llama") -> client.V1Pod:
        """A pod of KareusJob `job` (the label the operator sets) whose address, as a kubelet would
        report it, is loopback: the daemon checks that a token comes from its pod's address."""
        pod = self.core.create_namespaced_pod(self.namespace, {"metadata": {"name": name, "labels": {
            "kareus.dev/job-name": job}}, "spec": {
            "nodeName": node, "serviceAccountName": "trainer", "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "example.org/train:1"}]}})
        self.core.patch_namespaced_pod_status(name, self.namespace, {"status": {
            "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}})
        return pod

    def token(self, account: str = "trainer", *, pod: client.V1Pod | None = None,
              audiences: list[str] | None = (AUDIENCE,)) -> str:
        spec: dict = {"expirationSeconds": 600}
        if audiences:
            spec["audiences"] = list(audiences)
        if pod is not None:
            spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": pod.metadata.name, "uid": pod.metadata.uid}
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        return self.core.create_namespaced_service_account_token(account, self.namespace, request).status.token

    def delete_pod(self, name: str) -> None:
        self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)

    def authorizer(self, holders: dict[str, list[GPUHolder]], **config) -> TokenAuthorizer:
        api = KubeAPI(self.plane.url, token_path=str(self.agent_dir / "token"), ca_path=str(self.agent_dir / "ca.crt"))
        # A pod list that stays as it was (as the fake kubelet does): only a token's review can tell a pod is gone.
        pods = PodDirectory(self.plane.url, NODE, token_path=str(self.agent_dir / "token"),
                            ca_path=str(self.agent_dir / "ca.crt"), max_age_s=3600.0)
        return TokenAuthorizer(parse_config(config), pods, FakePodResources(holders), api, node_name=NODE,
                               review_interval_s=0.0)

    def close(self) -> None:
        self.rbac.delete_cluster_role_binding(self.role)
        self.rbac.delete_cluster_role(self.role)


@pytest.fixture
def cluster(kube_client, namespace, tmp_path, control_plane):
    made = Cluster(kube_client, namespace, tmp_path, control_plane)
    yield made
    made.close()


def _forged(claims: dict) -> str:
    """A JWT-shaped token with these claims and a signature nobody made."""
    def part(data: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()
    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2lnbmF0dXJl"


# ---------------------------------------------------------------- the authorizer


def test_a_bound_token_grants_exactly_its_pods_gpus(cluster):
    pod = cluster.pod("train-0")
    holders = {GPU[0]: [GPUHolder(cluster.namespace, "train-0", shared=False)],
               GPU[1]: [GPUHolder(cluster.namespace, "other-0", shared=False)]}
    grant = cluster.authorizer(holders).grant(BearerToken(cluster.token(pod=pod)), GPU)
    assert grant.refused == ""
    assert (grant.owner.namespace, grant.owner.pod, grant.owner.pod_uid) == (cluster.namespace, "train-0", pod.metadata.uid)
    assert grant.reason(GPU[0]) == ""
    assert grant.reason(GPU[1]) == f"GPU {GPU[1]} is not allocated to pod {cluster.namespace}/train-0"


def test_tokens_that_do_not_name_a_pod_of_this_node_for_this_audience_are_refused(cluster):
    pod = cluster.pod("train-0")
    elsewhere = cluster.pod("train-1", node="node-b")
    authorizer = cluster.authorizer({GPU[0]: [GPUHolder(cluster.namespace, "train-0", shared=False)]})
    valid = cluster.token(pod=pod)
    header, claims, signature = valid.split(".")
    cases = [
        ("", "no token: a TCP connection must send hello with token"),
        (cluster.token(pod=pod, audiences=["https://example.org"]), "its audience is https://example.org, not kareus-node"),
        (cluster.token(pod=pod, audiences=None), "not kareus-node"),  # the API server's own audience
        (cluster.token(audiences=[AUDIENCE]), "it is not bound to a pod"),
        (_forged({"aud": [AUDIENCE], "exp": 1}), "it has expired"),
        (f"{header}.{claims}.{signature[:-4]}AAAA", "token refused by the API server's TokenReview"),  # signature broken
        ("not-a-jwt", "not a JSON Web Token"),
    ]
    for token, reason in cases:
        grant = authorizer.grant(BearerToken(token), GPU)
        assert reason in grant.refused, (reason, grant.refused)
        assert all(grant.reason(uuid) for uuid in GPU)
    grant = authorizer.grant(BearerToken(cluster.token(pod=elsewhere)), GPU)
    # API servers since 1.30 name the pod's node in the review; older ones leave it to the pod list.
    assert "runs on node node-b" in grant.refused or "is not scheduled on this node" in grant.refused
    strict = cluster.authorizer({}, allowedNamespaces=["team-z"])
    assert f"namespace {cluster.namespace} is not allowed" in strict.grant(BearerToken(valid), GPU).refused


def test_the_recheck_re_reviews_the_token_so_a_deleted_pod_loses_its_gpus(cluster):
    pod = cluster.pod("train-0")
    authorizer = cluster.authorizer({GPU[0]: [GPUHolder(cluster.namespace, "train-0", shared=False)]})
    token = BearerToken(cluster.token(pod=pod))
    grant = authorizer.grant(token, GPU)
    assert authorizer.recheck(grant, GPU, token).reason(GPU[0]) == ""
    cluster.delete_pod("train-0")
    # The kubelet (fake) still lists the pod: only the token's review can tell that it is gone.
    fresh = wait_for(lambda: (g := authorizer.recheck(grant, GPU, token)).reason(GPU[0]) and g)
    assert "token refused by the API server's TokenReview" in fresh.reason(GPU[0])
    assert authorizer.grant(token, GPU).refused


def test_without_rbac_for_tokenreviews_it_fails_closed_and_says_why(kube_client, namespace, tmp_path, control_plane):
    cluster = Cluster(kube_client, namespace, tmp_path, control_plane, review_rights=False)
    try:
        pod = cluster.pod("train-0")
        with pytest.raises(AuthUnavailable, match=r"HTTP 403.*needs RBAC to create tokenreviews"):
            cluster.authorizer({}).grant(BearerToken(cluster.token(pod=pod)), GPU)
    finally:
        cluster.close()


# ---------------------------------------------------------------- pod-resources: index → UUID


def test_device_plugin_indices_name_the_same_gpus_as_uuids():
    def pod(name: str, ids: list[str]) -> api_pb2.PodResources:
        return api_pb2.PodResources(name=name, namespace="ns", containers=[api_pb2.ContainerResources(
            name="main", devices=[api_pb2.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=ids)])])

    index = {0: GPU[0], 1: GPU[1]}
    holders = gpu_holders([pod("a", ["0"]), pod("b", ["1::2"]), pod("c", [GPU[0]]), pod("d", ["7", "0:1"])], index)
    assert holders[GPU[0]] == [GPUHolder("ns", "a", False), GPUHolder("ns", "c", False)]
    assert holders[GPU[1]] == [GPUHolder("ns", "b", True)]  # a replica of GPU 1
    # An index this node has no GPU for, and a MIG device in index form, match no GPU.
    assert holders["7"] == [GPUHolder("ns", "d", False)] and holders["0:1"] == [GPUHolder("ns", "d", False)]
    assert gpu_holders([pod("a", ["0"])]) == {"0": [GPUHolder("ns", "a", False)]}  # without a map: as reported


# ---------------------------------------------------------------- the daemon over TCP


class FakeKubelet(api_pb2_grpc.PodResourcesListerServicer):
    """Lists pod train-0 holding GPU 0, named by index as DEVICE_ID_STRATEGY=index does."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace

    def List(self, request, context):
        return api_pb2.ListPodResourcesResponse(pod_resources=[api_pb2.PodResources(
            name="train-0", namespace=self.namespace, containers=[api_pb2.ContainerResources(
                name="main", devices=[api_pb2.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=["0"])])])])


@pytest.fixture
def tcp_daemon(cluster, tmp_path, monkeypatch):
    grpc_socket = str(tmp_path / "kubelet.sock")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(FakeKubelet(cluster.namespace), server)
    server.add_insecure_port(f"unix://{grpc_socket}")
    server.start()
    config = tmp_path / "config.yaml"
    config.write_text("podRecheckSeconds: 0.2\ntokenReviewSeconds: 0.2\nrequestTimeoutSeconds: 2\n")
    env = {**os.environ, "KAREUS_SERVICEACCOUNT_DIR": str(cluster.agent_dir)}  # the agent pod's own token and CA
    cmd = [*DAEMON_CMD, "--backend", "sim", "--sim-gpus", "2", "--socket", str(tmp_path / "node.sock"),
           "--state-dir", str(tmp_path / "state"), "--metrics-port", "0", "--metrics-address", "127.0.0.1",
           "--node-name", NODE, "--config", str(config), "--kube-api", cluster.plane.url,
           "--pod-resources-socket", grpc_socket, "--proc-root", str(tmp_path / "proc"), "--listen-tcp", "127.0.0.1:0"]
    with open(tmp_path / "daemon.log", "a") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    line = read_line(proc)
    assert "serving" in line, line
    daemon = DaemonProcess(proc, str(tmp_path / "node.sock"), tmp_path / "state", line.split("metrics=")[1].split()[0])
    daemon.address = line.split(" tcp=")[1].split()[0]
    yield daemon
    daemon.stop()
    server.stop(None)


def _write_token(tmp_path, cluster, pod) -> str:
    path = tmp_path / "pod-token" / "token"
    path.parent.mkdir(exist_ok=True)
    path.write_text(cluster.token(pod=pod))
    return str(path)


def test_a_pod_locks_its_gpu_over_tcp_and_the_lease_ends_with_the_connection(cluster, tcp_daemon, tmp_path, monkeypatch):
    pod = cluster.pod("train-0")
    monkeypatch.setenv("KAREUS_DAEMON_TOKEN_FILE", _write_token(tmp_path, cluster, pod))
    clock = connect(f"tcp://{tcp_daemon.address}", job="llama")
    assert not clock.degraded, clock.degraded_reason
    assert clock.gpu_uuids == (GPU[0],)  # the device plugin said "0"
    clock.request_clock(1200, instruction="s0.F0")
    assert clock.flush()
    labels = {"gpu_uuid": GPU[0], "namespace": cluster.namespace, "pod": "train-0", "kareusjob": "llama"}
    wait_for(lambda: tcp_daemon.metric(GPU_LOCKED_CLOCK_HERTZ, **labels) == 1.2e9)
    clock.close()
    wait_for(lambda: tcp_daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU[0]) == 0)

    # A connection that just drops (the process was killed) ends its lease the same way.
    connection = DaemonConnection(f"tcp://{tcp_daemon.address}")
    connection.lock([GPU[0]], 1005, wait=True)
    with pytest.raises(DaemonError, match="is not allocated to pod"):
        connection.lock([GPU[1]], 1005)
    assert tcp_daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU[0]) == 1.005e9
    connection._sock.close()  # no reset, no shutdown: the kernel closes the socket as at SIGKILL
    wait_for(lambda: tcp_daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU[0]) == 0)


def test_a_deleted_pods_lease_is_released_when_its_token_stops_validating(cluster, tcp_daemon, tmp_path):
    pod = cluster.pod("train-0")
    with DaemonConnection(f"tcp://{tcp_daemon.address}", token_file=_write_token(tmp_path, cluster, pod)) as connection:
        connection.lock([GPU[0]], 1200, wait=True)
        assert tcp_daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU[0]) == 1.2e9
        cluster.delete_pod("train-0")  # the fake kubelet still lists it: the token review or the pod list must notice
        wait_for(lambda: tcp_daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU[0]) == 0, timeout_s=20)
        # The session is closed with one note saying why: whichever noticed first, the review (the
        # API server may still validate the token for a moment) or the pod list, which the daemon
        # trusts for podRecheckSeconds at most (test_the_recheck_re_reviews_the_token… checks the review alone).
        with pytest.raises(DaemonError, match=r"TokenReview|is not scheduled on this node"):
            connection.lock([GPU[0]], 1200)


def test_a_tcp_caller_without_a_valid_token_gets_one_refusal_and_is_disconnected(cluster, tcp_daemon, tmp_path):
    endpoint = f"tcp://{tcp_daemon.address}"
    with pytest.raises(DaemonError, match="no token: a TCP connection must send hello with token") as info:
        DaemonConnection(endpoint, token_file=str(tmp_path / "missing"))
    assert info.value.code == "refused"
    bad = tmp_path / "bad-token"
    bad.write_text(cluster.token(pod=cluster.pod("train-0"), audiences=["https://example.org"]))
    assert connect(endpoint, token_file=str(bad)).degraded_reason.endswith("its audience is https://example.org, not kareus-node")

    host, port = tcp_daemon.address.rsplit(":", 1)
    for first in ({"v": 1, "id": 1, "op": "status"}, {"v": 1, "id": 1, "op": "hello", "token": "x.y.z"}):
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(protocol.encode_frame(first))
            raw.sendall(protocol.encode_frame({"v": 1, "id": 2, "op": "discover"}))
            reply = protocol.decode_body(_recv_frame(raw))
            assert reply["ok"] is False and reply["error"]["code"] == "refused", reply
            assert raw.recv(1) == b""  # closed after that one answer: the discover was never read


def _recv_frame(sock: socket.socket) -> bytes:
    header = sock.recv(protocol.HEADER.size, socket.MSG_WAITALL)
    return sock.recv(protocol.frame_length(header), socket.MSG_WAITALL)


def test_a_rotated_token_is_handed_over_and_may_not_switch_pods(cluster, tcp_daemon, tmp_path):
    pod, other = cluster.pod("train-0"), cluster.pod("other-0")
    token_file = _write_token(tmp_path, cluster, pod)
    with DaemonConnection(f"tcp://{tcp_daemon.address}", token_file=token_file) as connection:
        connection.lock([GPU[0]], 1200, wait=True)
        assert connection.refresh_token(force=True) is False  # unchanged: nothing sent
        Path(token_file).write_text(cluster.token(pod=pod))  # what the kubelet's rotation does
        assert connection.refresh_token(force=True) is True
        assert connection.receive()["ok"] is True
        connection.lock([GPU[0]], 1005, wait=True)
        assert tcp_daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU[0]) == 1.005e9
        Path(token_file).write_text(cluster.token(pod=other))
        assert connection.refresh_token(force=True) is True
        reply = connection.receive()
        assert reply["error"]["code"] == "refused" and "not this connection's pod" in reply["error"]["message"]
        wait_for(lambda: tcp_daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU[0]) == 0)  # closed: lease ended


def test_the_endpoint_comes_from_the_flags_or_the_environment(monkeypatch):
    import argparse

    from kareus.cli import profile, train

    assert daemon_endpoint("/run/kareus/node.sock", None) == "/run/kareus/node.sock"
    assert daemon_endpoint("/run/kareus/node.sock", "10.0.0.5:9477") == "tcp://10.0.0.5:9477"
    assert endpoint_from_env({"KAREUS_DAEMON_SOCKET": "/s", "KAREUS_DAEMON_ADDRESS": "10.0.0.5:9477"}) == "tcp://10.0.0.5:9477"
    assert endpoint_from_env({"KAREUS_DAEMON_SOCKET": "/s"}) == "/s" and endpoint_from_env({}) is None
    with pytest.raises(DaemonError, match="is not HOST:PORT"):
        DaemonConnection("tcp://10.0.0.5")
    monkeypatch.setenv("KAREUS_DAEMON_ADDRESS", "10.0.0.5:9477")
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers()
    train.register(commands)
    profile.register(commands)
    assert parser.parse_args(["train", "job.yaml"]).daemon_address == "10.0.0.5:9477"
    assert parser.parse_args(["profile", "job.yaml", "--out", "p.json"]).daemon_address == "10.0.0.5:9477"
    assert parser.parse_args(["train", "job.yaml", "--daemon-address", "h:1"]).daemon_address == "h:1"


def test_a_clock_client_that_sends_nothing_still_hands_over_the_rotated_token(cluster, tcp_daemon, tmp_path, monkeypatch):
    """A plan at one clock sends one lock, then nothing for hours: the client's keeper thread must
    send the kubelet's rotated token anyway, or the daemon's re-review of the old one ends the
    lease when it expires. Seen here without a single request after the lock: a token of another
    pod, handed over by the keeper alone, is refused and ends the lease."""
    import kareus.daemon_client.connection as connection_module

    monkeypatch.setattr(connection_module, "TOKEN_RECHECK_S", 0.2)
    pod, other = cluster.pod("train-0"), cluster.pod("other-0")
    token_file = _write_token(tmp_path, cluster, pod)
    clock = connect(f"tcp://{tcp_daemon.address}", job="llama", token_file=token_file)
    try:
        assert not clock.degraded, clock.degraded_reason
        clock.request_clock(1200, instruction="s0.F0")
        assert clock.flush()
        wait_for(lambda: tcp_daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU[0]) == 1.2e9)
        Path(token_file).write_text(cluster.token(pod=pod))  # the kubelet's rotation: accepted, the lease stays
        wait_for(lambda: clock.flush() and clock._connection._token == Path(token_file).read_text())
        assert not clock.degraded, clock.degraded_reason
        assert tcp_daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU[0]) == 1.2e9
        Path(token_file).write_text(cluster.token(pod=other))
        wait_for(lambda: tcp_daemon.metric(GPU_LOCKED_CLOCK_HERTZ, gpu_uuid=GPU[0]) == 0)
        wait_for(lambda: clock.degraded)
        assert any("not this connection's pod" in error for error in clock.errors), list(clock.errors)
    finally:
        clock.close()
