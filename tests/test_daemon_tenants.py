"""Hostile tenants against the node daemon (issue 29, the daemon's items 2, 3, 4, 9, 10 and 11).

The daemon runs in this process on its simulated backend, with its real authorizers, over loopback
(bench/daemon_abuse.py's harness): TCP callers present PyJWT-signed ServiceAccount tokens that the
daemon checks against a JWKS and a TokenReview answered by a fake API server, which also lists the
pods (with their IPs) and counts every request; pods are told apart by their loopback addresses.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from kareus_node.admission import HelloLimiter
from kareus_node.config import ConfigError, parse_config
from kareus_node.metrics import DaemonMetrics, serve_http
from kareus_node.metrics_auth import MetricsAuthorizer
from kareus_node.pods import PodDirectory
from test_daemon_support import wait_for

from kareus.daemon_client import DaemonConnection, DaemonError, open_connection
from kareus.policy import DEFAULT_FLOOR_FRACTION, default_floor_mhz

_SPEC = importlib.util.spec_from_file_location("daemon_abuse", Path(__file__).resolve().parent.parent / "bench" / "daemon_abuse.py")
abuse = importlib.util.module_from_spec(_SPEC)
sys.modules["daemon_abuse"] = abuse
_SPEC.loader.exec_module(abuse)

FakeAPIServer, FakePod, RunningDaemon = abuse.FakeAPIServer, abuse.FakePod, abuse.RunningDaemon
raw_tcp, recv_reply, answer = abuse.raw_tcp, abuse.recv_reply, abuse._answer


class Node:
    """A running daemon, its fake API server and three pods: two tenants' trainers and an attacker."""

    def __init__(self, tmp_path: Path, **config) -> None:
        self.api = FakeAPIServer()
        self.daemon = RunningDaemon(tmp_path, self.api, gpus=4, config=config)
        gpus = [gpu.uuid for gpu in self.daemon.gpus]
        self.gpus = gpus
        self.train = self.api.add_pod(FakePod("team-a", "llama-0", abuse.pod_uid(1), "127.0.0.10", [gpus[0]], job="llama"))
        self.other = self.api.add_pod(FakePod("team-b", "gpt-0", abuse.pod_uid(2), "127.0.0.11", [gpus[1]], job="gpt"))
        self.mallory = self.api.add_pod(FakePod("team-x", "mallory-0", abuse.pod_uid(3), "127.0.0.2", [gpus[2]]))

    def session(self, pod, *, token: str | None = None, source_ip: str | None = None, job: str = "") -> socket.socket:
        """A TCP session of `pod` (its token, from its address) that said hello; fails if refused."""
        sock = raw_tcp(self.daemon.tcp, source_ip=source_ip or pod.ip)
        request = {"v": 1, "id": 1, "op": "hello", "token": token or self.api.token(pod), "job": job}
        why = answer(sock, request)
        assert why == "", why
        return sock

    def hello(self, pod, *, token: str | None = None, source_ip: str | None = None) -> dict | None:
        """The answer to one hello on a fresh connection (which is then closed)."""
        with raw_tcp(self.daemon.tcp, source_ip=source_ip or pod.ip) as sock:
            sock.sendall(abuse.protocol.encode_frame({"v": 1, "id": 1, "op": "hello", "token": token or self.api.token(pod)}))
            return recv_reply(sock)


def _request(sock: socket.socket, op: str, **fields) -> dict:
    sock.sendall(abuse.protocol.encode_frame({"v": 1, "id": 7, "op": op, **fields}))
    reply = recv_reply(sock)
    assert reply is not None, f"{op}: the daemon closed the connection"
    return reply


def _closed(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    """Whether the daemon closes `sock` within `timeout_s` (a closing note may come first)."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


@pytest.fixture
def node(tmp_path, request):
    made = Node(tmp_path, **getattr(request, "param", {}))
    with made.daemon:
        yield made


# ---------------------------------------------------------------- item 2: connection slots


@pytest.mark.parametrize("node", [{"maxConnections": 8, "helloRatePerSecond": 1000}], indirect=True)
def test_idle_unauthenticated_sockets_cannot_crowd_out_authenticated_clients(node):
    idle = [raw_tcp(node.daemon.tcp, source_ip=f"127.0.0.{3 + i % 4}") for i in range(16)]
    try:
        wait_for(lambda: node.daemon.call(lambda: node.daemon.daemon.admission.pending) >= 8)
        outcomes = []
        for _ in range(30):  # what the review measured: 2 ok and 28 busy with 8 idle sockets
            try:
                sock = node.session(node.train)
                outcomes.append(answer(sock, {"v": 1, "id": 2, "op": "lock", "gpus": [node.gpus[0]], "clock_mhz": 1200}))
                sock.close()
            except AssertionError as refused:
                outcomes.append(str(refused))
        assert outcomes == [""] * 30
        with DaemonConnection(node.daemon.socket_path) as unix:  # the Unix socket is a pool of its own too
            assert len(unix.status()["gpus"]) == 4  # this test process is the node's administrator
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.parametrize("node", [{"maxPendingPerPeer": 2, "maxConnectionsPerPod": 3, "maxConnections": 8,
                                   "reservedUnixConnections": 4}], indirect=True)
def test_caps_per_address_per_pod_and_the_unix_reserve(node):
    first, second = (raw_tcp(node.daemon.tcp, source_ip="127.0.0.3") for _ in range(2))
    third = raw_tcp(node.daemon.tcp, source_ip="127.0.0.3")
    reply = recv_reply(third)
    assert reply["error"]["code"] == "busy" and "from 127.0.0.3 (limit 2)" in reply["error"]["message"]
    held = [node.session(node.mallory) for _ in range(3)]
    refused = node.hello(node.mallory)
    assert refused["error"]["code"] == "busy" and "limit 3 a pod" in refused["error"]["message"]
    held.append(node.session(node.train))  # 4 TCP sessions: all that the Unix reserve leaves them
    refused = node.hello(node.other)
    assert refused["error"]["code"] == "busy" and "4 of them kept for the Unix socket" in refused["error"]["message"]
    with DaemonConnection(node.daemon.socket_path) as unix:
        assert unix.status()["connections"] == 2 + 4 + 1  # pending, authenticated TCP, this one
    for sock in [first, second, third, *held]:
        sock.close()


@pytest.mark.parametrize("node", [{"idleTimeoutSeconds": 0.3}], indirect=True)
def test_a_silent_session_without_a_lease_is_closed_and_one_with_a_lease_is_kept(node):
    idle = node.session(node.other)
    holding = node.session(node.train)
    assert _request(holding, "lock", gpus=[node.gpus[0]], clock_mhz=1200)["ok"]
    assert _closed(idle, timeout_s=5.0)
    assert not _closed(holding, timeout_s=1.0)  # three idle timeouts later: still there, lease and all
    assert node.daemon.call(lambda: node.daemon.daemon.leases[node.gpus[0]].owner.pod) == "llama-0"
    holding.close()


def test_sessions_without_leases_are_closed_when_their_token_stops_validating(node):
    sessions = [node.session(node.other) for _ in range(8)]
    node.api.pods.pop(node.other.uid)  # the pod is deleted: its bound token no longer validates
    assert all(_closed(sock, timeout_s=5.0) for sock in sessions)
    wait_for(lambda: node.daemon.call(lambda: len(node.daemon.daemon.sessions)) == 0)  # each reader saw its end


def test_the_connection_limits_are_checked_when_the_config_is_read():
    config = parse_config({"maxConnections": 40})
    assert (config.unix_reserve, config.max_pending_connections, config.max_pending_per_peer) == (5, 32, 16)
    assert parse_config({"maxConnections": 40, "reservedUnixConnections": 0}).unix_reserve == 0
    with pytest.raises(ConfigError, match="reservedUnixConnections: must be less than maxConnections"):
        parse_config({"maxConnections": 4, "reservedUnixConnections": 4})
    with pytest.raises(ConfigError, match="idleTimeoutSeconds: must be a number > 0"):
        parse_config({"idleTimeoutSeconds": 0})


# ---------------------------------------------------------------- item 3: TokenReview amplification


def test_forged_tokens_never_cost_a_tokenreview_and_good_reviews_are_reused(node):
    for i in range(30):  # from 30 addresses, so no rate limit hides what the pre-filter does
        reply = node.hello(node.train, token=abuse.forged_token(node.api, node.train), source_ip=f"127.0.1.{i + 1}")
        assert reply["error"]["code"] == "refused"
        assert "signature does not verify against the API server's keys" in reply["error"]["message"]
    other_key = abuse.rsa.generate_private_key(public_exponent=65537, key_size=2048)
    reply = node.hello(node.train, token=node.api.token(node.train, key=other_key))
    assert "signature does not verify" in reply["error"]["message"]
    assert node.api.requests["tokenreviews"] == 0
    token = node.api.token(node.train)
    for _ in range(3):
        assert node.hello(node.train, token=token)["ok"]
    assert node.api.requests["tokenreviews"] == 1  # one review; the other hellos reused it
    assert node.api.requests["jwks"] == 1


def test_hellos_are_rate_limited_per_address(node):
    node.daemon.daemon.hellos = HelloLimiter(5.0, now=lambda: 100.0)  # time stands still: the burst only
    token = node.api.token(node.mallory)
    replies = [node.hello(node.mallory, token=token) for _ in range(30)]
    refused = [r for r in replies if not r["ok"]]
    assert len(refused) == 20  # a burst of twice the rate (10), then nothing until tokens refill
    assert all(r["error"]["code"] == "busy" and "too many hellos from 127.0.0.2" in r["error"]["message"] for r in refused)
    assert node.hello(node.train)["ok"]  # another address is not affected


def test_without_the_signing_keys_it_fails_closed(node):
    node.api.fail = True
    reply = node.hello(node.train)
    assert reply["error"]["code"] == "unavailable" and "token signing keys" in reply["error"]["message"]


def test_the_signing_keys_are_asked_for_in_the_media_type_the_api_server_serves(tmp_path):
    """The real API server answers /openid/v1/jwks only as application/jwk-set+json (406 otherwise)."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kareus_node.jwks import TokenVerifier
    from kareus_node.kubeapi import KubeAPI

    api = FakeAPIServer()
    accepts = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            accepts.append(self.headers.get("Accept"))
            ok = self.path == "/openid/v1/jwks" and self.headers.get("Accept") == "application/jwk-set+json"
            body = json.dumps(api.get(self.path, accept="application/jwk-set+json")).encode() if ok else b"{}"
            self.send_response(200 if ok else 406)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        kube = KubeAPI(f"http://127.0.0.1:{server.server_address[1]}", token_path=str(tmp_path / "none"),
                       ca_path=str(tmp_path / "none"))
        pod = FakePod("team-a", "llama-0", abuse.pod_uid(1), "10.0.0.1", [])
        assert TokenVerifier(kube, audience="kareus-node").problem(api.token(pod)) == ""
        assert accepts == ["application/jwk-set+json"]
    finally:
        server.shutdown()


# ---------------------------------------------------------------- item 4: token replay, clock floor


def test_a_token_replayed_from_another_address_is_refused(node):
    token = node.api.token(node.train)
    reply = node.hello(node.train, token=token, source_ip="127.0.0.9")
    assert reply["error"]["code"] == "refused"
    assert "comes from 127.0.0.9, not from pod team-a/llama-0's address (127.0.0.10)" in reply["error"]["message"]
    sock = node.session(node.train, token=token)  # from its own pod: fine
    assert _request(sock, "lock", gpus=[node.gpus[0]], clock_mhz=1200)["ok"]
    sock.close()
    node.train.ip, node.train.host_network = "10.0.0.5", True  # a hostNetwork pod has the node's addresses
    token = node.api.token(node.train)
    wait_for(lambda: node.hello(node.train, token=token, source_ip="127.0.0.1")["ok"])  # once the pod list shows it


def test_a_hello_before_the_pods_address_is_reported_waits_for_it(node):
    """A pod's containers start, and call, before the kubelet reports its IP to the API server (a
    CI run's profiling pod was refused "(none yet)"): the hello waits for the address."""
    pod = node.api.add_pod(FakePod("team-a", "llama-1", abuse.pod_uid(4), "", [node.gpus[3]]))
    threading.Timer(1.0, lambda: setattr(pod, "ip", "127.0.0.12")).start()
    reply = node.hello(pod, source_ip="127.0.0.12")
    assert reply is not None and reply["ok"], reply
    assert node.hello(pod, source_ip="127.0.0.13")["error"]["code"] == "refused"  # and then it is checked


def test_a_pod_whose_address_never_comes_is_answered_unavailable_and_the_client_asks_again(node, tmp_path):
    pod = node.api.add_pod(FakePod("team-a", "llama-1", abuse.pod_uid(4), "", [node.gpus[3]]))
    reply = node.hello(pod, source_ip="127.0.0.1")
    assert reply["error"]["code"] == "unavailable", reply
    assert "pod team-a/llama-1 has no address in the API server yet" in reply["error"]["message"]
    token_file = tmp_path / "token"
    token_file.write_text(node.api.token(pod))
    endpoint = node.daemon.tcp
    with pytest.raises(DaemonError, match="no address in the API server yet") as refused:
        DaemonConnection(endpoint, token_file=str(token_file))
    assert refused.value.code == "unavailable" and refused.value.answered
    threading.Timer(4.0, lambda: setattr(pod, "ip", "127.0.0.1")).start()  # after a first wait ran out
    with open_connection(endpoint, token_file=str(token_file)) as connection:
        assert [gpu.uuid for gpu in connection.discover() if gpu.controllable] == [node.gpus[3]]
    with pytest.raises(DaemonError, match="cannot connect"):  # no daemon there: answered at once, no waiting
        open_connection(str(tmp_path / "none.sock"))


@pytest.mark.parametrize("node", [{"defaultFloorFraction": 0.5}], indirect=True)
def test_without_a_policy_floor_the_default_floor_bounds_what_a_token_can_do(node):
    sock = node.session(node.train)
    gpu = next(g for g in _request(sock, "discover")["gpus"] if g["uuid"] == node.gpus[0])
    assert gpu["min_clock_mhz"] == 705  # half the A100's 1410 MHz
    reply = _request(sock, "lock", gpus=[node.gpus[0]], clock_mhz=210)
    assert reply["error"]["code"] == "refused" and "outside the policy bounds 705–1410 MHz" in reply["error"]["message"]
    sock.close()
    with pytest.raises(ConfigError, match="defaultFloorFraction: must be a share of the top clock"):
        parse_config({"defaultFloorFraction": 1.5})


def test_the_default_floor_is_on_and_a_replayed_token_cannot_lock_below_it(node):
    """No config key: kareus.policy.DEFAULT_FLOOR_FRACTION (0.6) of the A100's 1410 MHz, 846 MHz."""
    assert parse_config({}).default_floor_fraction == DEFAULT_FLOOR_FRACTION == 0.6
    assert parse_config({"defaultFloorFraction": 0}).default_floor_fraction == 0  # a platform may turn it off
    stolen = node.api.token(node.train)
    sock = node.session(node.train, token=stolen)  # a replay that also has the pod's address
    gpu = next(g for g in _request(sock, "discover")["gpus"] if g["uuid"] == node.gpus[0])
    assert (gpu["min_clock_mhz"], gpu["max_clock_mhz"]) == (846, 1410)
    for clock_mhz in (210, 840):
        reply = _request(sock, "lock", gpus=[node.gpus[0]], clock_mhz=clock_mhz)
        assert reply["error"]["code"] == "refused", reply
        assert f"clock_mhz: {clock_mhz} MHz is outside the policy bounds 846–1410 MHz" in reply["error"]["message"]
    reply = _request(sock, "schedule", gpus=[node.gpus[0]], clocks_mhz=[1410, 840])
    assert reply["error"]["code"] == "refused" and "846–1410 MHz" in reply["error"]["message"], reply
    assert node.daemon.gpus[0].locked_clock_mhz() is None
    assert _request(sock, "lock", gpus=[node.gpus[0]], clock_mhz=885)["ok"]  # the profiler's lowest A100 clock
    sock.close()


@pytest.mark.parametrize("gpu", ["A100-SXM4-40GB", "H100-SXM", "H200"])
def test_the_profilers_clock_grid_stays_above_the_default_floor(gpu):
    """What the method asks for never meets the default floor: the grid is the same with it."""
    from kareus.profiler.profile import clock_grid
    from kareus.sim.gpus import get_gpu

    supported = tuple(int(c) for c in get_gpu(gpu).supported_clocks_mhz)
    grid = clock_grid(supported)
    assert grid == clock_grid(supported, floor_mhz=0)  # the floor cuts nothing off
    assert min(grid) >= default_floor_mhz(max(supported))
    # A floor above the grid's low end cuts it there, never below.
    assert min(clock_grid(supported, floor_mhz=grid[2])) == grid[2]


@pytest.mark.parametrize("node", [{}, {"clockBounds": {"default": {"floorMHz": 1005}}}], indirect=True)
def test_profiling_through_the_daemon_profiles_only_clocks_it_may_lock(node, tmp_path, monkeypatch):
    """A profiling pod under the default floor, or under a higher policy floor, still profiles:
    it asks only for the clocks the daemon reports it may lock."""
    from operator_fakes import QUICKSTART

    from kareus.profiler.backends import SimBackend
    from kareus.profiler.profile import profile_job
    from kareus.spec import load_job

    pod = node.api.add_pod(FakePod("team-a", "tiny-profile-abcde", abuse.pod_uid(5), "127.0.0.1", [node.gpus[3]]))
    token_file = tmp_path / "token"
    token_file.write_text(node.api.token(pod))
    monkeypatch.setenv("KAREUS_DAEMON_TOKEN_FILE", str(token_file))
    floor_mhz = node.daemon.config.policy.default_clock_bounds.floor_mhz or 846
    doc = profile_job(load_job(QUICKSTART), backend=SimBackend("A100-SXM4-40GB"), daemon_endpoint=node.daemon.tcp)
    assert doc.clocks_mhz[0] == 1410 and min(doc.clocks_mhz) >= floor_mhz
    assert min(doc.clocks_mhz) == (900 if floor_mhz == 846 else 1005)  # the grid, cut at a higher floor
    assert node.daemon.gpus[3].locked_clock_mhz() is None  # reset when profiling ended


# ---------------------------------------------------------------- item 10: ownership of reads, job labels


def test_read_and_status_show_only_the_callers_gpus(node):
    neighbour = node.session(node.other)
    assert _request(neighbour, "lock", gpus=[node.gpus[1]], clock_mhz=1200, wait=True)["ok"]
    sock = node.session(node.train)
    locked = {g["uuid"]: g["locked_clock_mhz"] for g in _request(sock, "discover")["gpus"]}
    assert locked[node.gpus[1]] is None  # the neighbour's GPU is named, its state is not shown
    reply = _request(sock, "read", gpus=[node.gpus[1]])
    assert reply["error"]["code"] == "refused"
    assert f"GPU {node.gpus[1]} is not allocated to pod team-a/llama-0" in reply["error"]["message"]
    assert [g["uuid"] for g in _request(sock, "read", gpus=[node.gpus[0]])["gpus"]] == [node.gpus[0]]
    assert [g["uuid"] for g in _request(sock, "status")["gpus"]] == [node.gpus[0]]
    sock.close()
    neighbour.close()
    with DaemonConnection(node.daemon.socket_path) as admin:  # outside any pod, the daemon's own user
        assert len(admin.status()["gpus"]) == 4


def test_the_job_label_comes_from_the_pod_never_from_the_hello(node):
    sock = node.session(node.train, job="gpt")
    assert _request(sock, "lock", gpus=[node.gpus[0]], clock_mhz=1200)["ok"]
    unlabelled = node.session(node.mallory, job="gpt")
    assert _request(unlabelled, "lock", gpus=[node.gpus[2]], clock_mhz=1200)["ok"]
    jobs = node.daemon.call(lambda: {uuid: lease.owner.job for uuid, lease in node.daemon.daemon.leases.items()})
    assert jobs == {node.gpus[0]: "llama", node.gpus[2]: ""}
    sock.close()
    unlabelled.close()


# ---------------------------------------------------------------- item 11: revocation gaps


def test_the_recheck_loop_survives_an_exception(node):
    sock = node.session(node.train)
    assert _request(sock, "lock", gpus=[node.gpus[0]], clock_mhz=1200)["ok"]
    authorizer = node.daemon.token_authorizer
    real = authorizer.recheck
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in one round")
        return real(*args, **kwargs)

    authorizer.recheck = flaky
    wait_for(lambda: len(calls) >= 1)
    node.api.pods.pop(node.train.uid)
    assert _closed(sock, timeout_s=5.0)  # a later round still ran, and ended the pod's lease
    assert node.daemon.call(lambda: dict(node.daemon.daemon.leases)) == {}
    assert node.daemon.daemon.recheck_errors == 1


def test_the_pod_cache_forgets_deleted_pods():
    api = FakeAPIServer()
    pod = api.add_pod(FakePod("team-a", "worker-0", abuse.pod_uid(1), "10.0.0.1", ["GPU-x"]))
    directory = PodDirectory("http://unused.invalid", abuse.NODE, max_age_s=0.05, min_refresh_interval_s=0.0)
    directory.api = api
    assert directory.lookup(pod.uid).name == "worker-0"
    api.pods.pop(pod.uid)  # deleted, and a pod of the same name comes back with a new UID
    api.add_pod(FakePod("team-a", "worker-0", abuse.pod_uid(2), "10.0.0.2", ["GPU-x"]))
    assert directory.lookup(pod.uid).name == "worker-0"  # a fresh cache answers from memory
    time.sleep(0.1)
    assert directory.lookup(pod.uid) is None
    assert directory.lookup(abuse.pod_uid(2)).ips == ("10.0.0.2",)


def test_unix_identity_is_fixed_at_accept(node):
    node.daemon.become(os.getpid(), node.other)
    with DaemonConnection(node.daemon.socket_path) as connection:
        connection.call("hello")  # answered: the connection was accepted, and its pod read
        node.daemon.become(os.getpid(), node.train)  # what a reused pid would show
        with pytest.raises(DaemonError, match="is not allocated to pod team-b/gpt-0"):
            connection.lock([node.gpus[0]], 1200)
        connection.lock([node.gpus[1]], 1200)
        assert node.daemon.call(lambda: node.daemon.daemon.leases[node.gpus[1]].owner.pod) == "gpt-0"


def test_a_peer_that_exited_before_its_pod_was_read_has_no_pod(tmp_path):
    from kareus_node.identity import pinned_pod_uid

    proc_root = tmp_path / "proc"
    (proc_root / str(os.getpid())).mkdir(parents=True)
    (proc_root / str(os.getpid()) / "cgroup").write_text(f"0::/kubepods/pod{abuse.pod_uid(1)}/c\n")
    assert pinned_pod_uid(os.pidfd_open(os.getpid()), os.getpid(), proc_root=proc_root) == abuse.pod_uid(1)
    child = os.fork()
    if child == 0:
        os._exit(0)
    pidfd = os.pidfd_open(child)
    os.waitpid(child, 0)
    (proc_root / str(child)).mkdir()
    (proc_root / str(child) / "cgroup").write_text(f"0::/kubepods/pod{abuse.pod_uid(2)}/c\n")  # another's now
    assert pinned_pod_uid(pidfd, child, proc_root=proc_root) is None


# ---------------------------------------------------------------- item 6: per-pod clock ceilings


def test_the_daemon_enforces_the_clock_ceilings_the_operator_publishes(node):
    from kareus_operator.clock_ceilings import ceilings_configmap

    sock = node.session(node.train)
    assert _request(sock, "lock", gpus=[node.gpus[0]], clock_mhz=1305, wait=True)["ok"]
    published = ceilings_configmap({node.train.uid: 1100, node.other.uid: 900}, "kareus-node")
    node.api.configmaps["kareus-node/kareus-clock-ceilings"] = published["data"]
    gpu = node.daemon.gpus[0]
    wait_for(lambda: gpu.locked_clock_mhz() == 1095)  # the re-check lowered the held clock to the ceiling
    reply = _request(sock, "lock", gpus=[node.gpus[0]], clock_mhz=1200)
    assert reply["error"]["code"] == "refused"
    assert "above the clock ceiling 1095 MHz the operator set for pod team-a/llama-0" in reply["error"]["message"]
    assert next(g for g in _request(sock, "discover")["gpus"] if g["uuid"] == node.gpus[0])["max_clock_mhz"] == 1095
    assert _request(sock, "lock", gpus=[node.gpus[0]], clock_mhz=1005)["ok"]
    node.api.configmaps["kareus-node/kareus-clock-ceilings"] = {node.train.uid: "fast"}  # a bad entry: ignored
    wait_for(lambda: _request(sock, "lock", gpus=[node.gpus[0]], clock_mhz=1305)["ok"])
    sock.close()
    with pytest.raises(ValueError, match="clock ceiling of pod p: must be a whole number of MHz > 0"):
        ceilings_configmap({"p": 0}, "kareus-node")


# ---------------------------------------------------------------- item 9: the metrics/health server


def test_the_metrics_server_is_bounded_and_probes_have_their_own(tmp_path):
    metrics = DaemonMetrics()
    http = serve_http("127.0.0.1", 0, metrics, lambda: True, max_connections=4, timeout_s=0.5)
    health = serve_http("127.0.0.1", 0, metrics, lambda: True, max_connections=2, timeout_s=0.5,
                        paths=("/healthz", "/readyz"))
    threads_before = threading.active_count()
    idle = [socket.create_connection(http.server_address[:2], timeout=5) for _ in range(150)]
    try:
        wait_for(lambda: http.turned_away >= 140, timeout_s=20)
        assert threading.active_count() - threads_before <= 4  # was one thread per socket
        assert _status(health.server_address[1], "/healthz") == 200
        assert _status(health.server_address[1], "/metrics") == 404  # health only
        for sock in idle:  # turned away at once, or (the four served) dropped when their request stalled
            assert sock.recv(1) == b""
        assert _status(http.server_address[1], "/metrics") == 200
    finally:
        for sock in idle:
            sock.close()
        http.shutdown()
        health.shutdown()


class _ReviewingAPI:
    def __init__(self) -> None:
        self.posts = []

    def post(self, path, body):
        self.posts.append(path)
        if path.endswith("tokenreviews"):
            good = body["spec"]["token"] in ("prometheus", "tenant")
            return {"status": {"authenticated": good, "user": {"username": f"system:serviceaccount:x:{body['spec']['token']}"}}}
        return {"status": {"allowed": body["spec"]["user"].endswith(":prometheus")}}


def test_metrics_behind_tokenreview_and_rbac():
    api = _ReviewingAPI()
    authorize = MetricsAuthorizer(api)
    metrics = DaemonMetrics()
    http = serve_http("127.0.0.1", 0, metrics, lambda: True, authorize=authorize)
    port = http.server_address[1]
    try:
        assert _status(port, "/metrics") == 401
        assert _status(port, "/metrics", token="forged") == 401
        assert _status(port, "/metrics", token="tenant") == 403
        for _ in range(3):
            assert _status(port, "/metrics", token="prometheus") == 200
        assert _status(port, "/healthz") == 200  # health needs no token
        assert len(api.posts) == 1 + 2 + 2  # forged: one review; tenant and prometheus: two each, once
    finally:
        http.shutdown()


def _status(port: int, path: str, *, token: str = "") -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


# ---------------------------------------------------------------- the bench, small


def test_the_abuse_bench_keeps_legitimate_clients_served():
    results = abuse.run(seconds=0.4, legit=2)
    assert set(results) == {"quiet", *abuse.ATTACKS}
    for name, row in results.items():
        assert row["success"] >= 0.99, (name, row)
        assert row["requests"] > 0
    assert results["forged-hellos"]["attack"]["forged_reviewed"] == 0
    assert results["token-replay"]["attack"]["locked"] == 0
    assert results["metrics-sockets"]["attack"]["healthz"] == 200

