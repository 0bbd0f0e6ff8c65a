"""Legitimate clients of `kareus-node` while hostile ones attack it: success rate and p99 latency.

The daemon runs in this process on its simulated backend, on a Unix socket and on TCP
127.0.0.1, with its real authorizers: the kubelet's (a fake proc root says which pod a Unix peer
is in) and the token one (PyJWT-signed ServiceAccount tokens, checked against a JWKS and then a
TokenReview, both answered by `FakeAPIServer`, which also lists the pods and counts every request).
Pods are told apart by their loopback addresses (legitimate pods bind 127.0.0.10 and up, the
attacker pod is 127.0.0.2, other attackers 127.0.0.3–5 and 127.0.1.x), so everything stays on
loopback.

For each attack, `--legit` clients (TCP, each its own pod and GPU) send clock requests (`lock`,
acknowledged) back to back for `--seconds`, while the attack runs in threads; then the next
attack. Printed per attack: the legitimate success rate, p99 latency and its ratio to the quiet
p99, the API-server requests the attack caused, and the attack's own outcome. Target: success
≥ 99 % and p99 ≤ 2 × quiet. Bounded: every attack has a fixed number of sockets or requests and a
deadline.

    python bench/daemon_abuse.py [--seconds 2] [--legit 4] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "node_daemon")]

import jwt  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import rsa  # noqa: E402
from kareus_node.auth import TOKEN_AUDIENCE, KubeletAuthorizer, TokenAuthorizer  # noqa: E402
from kareus_node.ceilings import ClockCeilings  # noqa: E402
from kareus_node.config import parse_config  # noqa: E402
from kareus_node.journal import Journal  # noqa: E402
from kareus_node.jwks import JWKS_MEDIA_TYPE, JWKS_PATH, TokenVerifier  # noqa: E402
from kareus_node.kubeapi import KubeAPIUnavailable  # noqa: E402
from kareus_node.metrics import DaemonMetrics, serve_http  # noqa: E402
from kareus_node.podresources import GPUHolder  # noqa: E402
from kareus_node.pods import JOB_LABEL, PodDirectory  # noqa: E402
from kareus_node.server import Daemon  # noqa: E402

from kareus.daemon_client import DaemonError, protocol  # noqa: E402
from kareus.daemon_client.connection import receive_frame  # noqa: E402
from kareus.gpu import discover  # noqa: E402

NODE = "node-a"
PRODUCT = "A100-SXM4-40GB"
KID = "bench-key"
RECONNECT_EVERY = 100


@dataclass
class FakePod:
    namespace: str
    name: str
    uid: str
    ip: str
    gpus: list[str]
    job: str = ""
    host_network: bool = False


@dataclass
class FakeAPIServer:
    """The API server as the daemon sees it: the pod list, the JWKS, TokenReviews (each counted)."""

    pods: dict[str, FakePod] = field(default_factory=dict)  # uid → pod
    configmaps: dict[str, dict[str, str]] = field(default_factory=dict)  # "namespace/name" → data
    review_latency_s: float = 0.0  # what one TokenReview costs the real one, roughly
    fail: bool = False
    requests: dict[str, int] = field(default_factory=lambda: {"pods": 0, "jwks": 0, "tokenreviews": 0,
                                                              "tokenreviews_forged": 0})

    def __post_init__(self) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self._lock = threading.Lock()

    # -- what the daemon calls (kubeapi.KubeAPI's interface) ------------------------------------
    def get(self, path: str, *, accept: str = "application/json") -> Any:
        if self.fail:
            raise KubeAPIUnavailable(f"GET {path}: connection refused")
        if path == JWKS_PATH:
            if accept != JWKS_MEDIA_TYPE:  # what the real API server answers
                raise KubeAPIUnavailable(f"GET {path}: HTTP 406: Available representations: {JWKS_MEDIA_TYPE}", 406)
            self._count("jwks")
            public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key()))
            return {"keys": [{**public, "kid": KID, "use": "sig", "alg": "RS256"}]}
        if path.startswith("/api/v1/namespaces/") and "/configmaps/" in path:
            namespace, name = path.split("/")[4], path.split("/")[6]
            if f"{namespace}/{name}" not in self.configmaps:
                raise KubeAPIUnavailable(f"GET {path}: HTTP 404", 404)
            return {"kind": "ConfigMap", "data": dict(self.configmaps[f"{namespace}/{name}"])}
        if path.startswith("/api/v1/pods"):
            self._count("pods")
            node = urllib.parse.unquote(path).split("spec.nodeName=")[1]
            assert node == NODE, path
            return {"kind": "PodList", "items": [self._pod_json(pod) for pod in list(self.pods.values())]}
        raise KubeAPIUnavailable(f"GET {path}: HTTP 404", 404)

    def post(self, path: str, body: Any) -> Any:
        if self.fail:
            raise KubeAPIUnavailable(f"POST {path}: connection refused")
        self._count("tokenreviews")
        if self.review_latency_s:
            time.sleep(self.review_latency_s)
        return {"status": self._review(body["spec"]["token"], body["spec"].get("audiences") or [])}

    # -- what tests and attacks use -------------------------------------------------------------
    def add_pod(self, pod: FakePod) -> FakePod:
        self.pods[pod.uid] = pod
        return pod

    def token(self, pod: FakePod, *, audience: str = TOKEN_AUDIENCE, lifetime_s: float = 3600.0,
              key: Any = None) -> str:
        claims = {"aud": [audience], "exp": int(time.time() + lifetime_s), "iat": int(time.time()),
                  "iss": "https://kubernetes.default.svc", "sub": f"system:serviceaccount:{pod.namespace}:trainer",
                  "kubernetes.io": {"namespace": pod.namespace, "pod": {"name": pod.name, "uid": pod.uid},
                                    "node": {"name": NODE}}}
        return jwt.encode(claims, key or self.key, algorithm="RS256", headers={"kid": KID})

    def holders(self) -> dict[str, list[GPUHolder]]:
        held: dict[str, list[GPUHolder]] = {}
        for pod in list(self.pods.values()):
            for uuid in pod.gpus:
                held.setdefault(uuid, []).append(GPUHolder(pod.namespace, pod.name, shared=False))
        return held

    def _count(self, what: str) -> None:
        with self._lock:
            self.requests[what] += 1

    def _pod_json(self, pod: FakePod) -> dict[str, Any]:
        return {"metadata": {"uid": pod.uid, "namespace": pod.namespace, "name": pod.name,
                             "labels": {JOB_LABEL: pod.job} if pod.job else {}},
                "spec": {"nodeName": NODE, "hostNetwork": pod.host_network},
                "status": {"podIP": pod.ip, "podIPs": [{"ip": pod.ip}]} if pod.ip else {}}  # before the kubelet reports it

    def _review(self, token: str, audiences: list[str]) -> dict[str, Any]:
        try:
            claims = jwt.decode(token, self.key.public_key(), algorithms=["RS256"], audience=audiences or None,
                                options={"verify_aud": bool(audiences)})
        except jwt.PyJWTError as error:
            self._count("tokenreviews_forged")
            return {"authenticated": False, "error": f"invalid bearer token, {error}"}
        bound = claims["kubernetes.io"]
        pod = self.pods.get(bound["pod"]["uid"])
        if pod is None or pod.name != bound["pod"]["name"]:
            return {"authenticated": False, "error": "invalid bearer token, pod does not exist"}
        return {"authenticated": True, "audiences": claims["aud"], "user": {
            "username": f"system:serviceaccount:{pod.namespace}:trainer",
            "extra": {"authentication.kubernetes.io/pod-name": [pod.name],
                      "authentication.kubernetes.io/pod-uid": [pod.uid],
                      "authentication.kubernetes.io/node-name": [NODE]}}}


class FakePodResources:
    """The kubelet's pod-resources answer, from the fake API server's pods."""

    def __init__(self, api: FakeAPIServer) -> None:
        self.api = api
        self.calls = 0

    def gpu_holders(self, *, max_age_s: float = 0.0) -> dict[str, list[GPUHolder]]:
        self.calls += 1
        return self.api.holders()


class RunningDaemon:
    """A `Daemon` serving in a thread of its own: Unix socket, TCP on 127.0.0.1, and the metrics
    and health HTTP servers."""

    def __init__(self, tmp: Path, api: FakeAPIServer, *, gpus: int = 8, config: dict[str, Any] | None = None,
                 metrics_authorize: Callable[[str], str] | None = None) -> None:
        self.tmp = tmp
        self.api = api
        self.config = parse_config({"podRecheckSeconds": 0.2, "tokenReviewSeconds": 0.2, **(config or {})})
        self.gpus = discover("sim", count=gpus, product=PRODUCT, node=NODE, state_dir=tmp / "sim")
        self.proc_root = tmp / "proc"
        self.proc_root.mkdir(parents=True, exist_ok=True)
        self.pods = PodDirectory("http://unused.invalid", NODE, max_age_s=self.config.pod_recheck_s,
                                 min_refresh_interval_s=0.0)
        self.pods.api = api  # the directory's reads go to the fake
        self.pod_resources = FakePodResources(api)
        self.verifier = TokenVerifier(api, audience=TOKEN_AUDIENCE)
        self.kubelet = KubeletAuthorizer(self.config, self.pods, self.pod_resources, proc_root=str(self.proc_root))
        self.token_authorizer = TokenAuthorizer(self.config, self.pods, self.pod_resources, api, node_name=NODE,
                                                verifier=self.verifier)
        self.ceilings = ClockCeilings(api, "kareus-node", max_age_s=self.config.pod_recheck_s)
        self.kubelet.ceilings = self.token_authorizer.ceilings = self.ceilings
        self.daemon = Daemon(self.gpus, self.kubelet, self.config, Journal(tmp / "state"), node_name=NODE,
                             recheck=True, token_authorizer=self.token_authorizer)
        self.metrics = DaemonMetrics()
        self.daemon.observe = self.metrics.observe
        self.socket_path = str(tmp / "node.sock")
        self._metrics_authorize = metrics_authorize
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="daemon", daemon=True)

    def __enter__(self) -> RunningDaemon:
        self.daemon.restore()
        self.daemon.start_workers()
        self.metrics.watch(self.daemon)
        ready = lambda: self.daemon.ready and self.daemon.auth_healthy  # noqa: E731
        self.http = serve_http("127.0.0.1", 0, self.metrics, ready, max_connections=self.config.metrics_max_connections,
                               timeout_s=1.0, authorize=self._metrics_authorize)
        self.health = serve_http("127.0.0.1", 0, self.metrics, ready, max_connections=4, timeout_s=1.0,
                                 paths=("/healthz", "/readyz"))
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the daemon did not start")
        return self

    def __exit__(self, *_exc: Any) -> None:
        self._loop.call_soon_threadsafe(self.daemon.stop)
        self._thread.join(120)  # each GPU worker first applies what is queued (at most 5 s each)
        self.http.shutdown()
        self.health.shutdown()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def beat() -> None:
            while True:
                self.metrics.beat()
                await asyncio.sleep(0.5)

        async def main() -> None:
            task = asyncio.create_task(beat())
            try:
                await self.daemon.serve(self.socket_path, on_ready=self._ready.set, tcp=("127.0.0.1", 0))
            finally:
                task.cancel()

        self._loop.run_until_complete(main())

    def call(self, function: Callable[[], Any]) -> Any:
        """Run `function` on the daemon's event loop and return what it returned (or awaited)."""
        async def run() -> Any:
            value = function()
            return await value if asyncio.iscoroutine(value) else value

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    @property
    def tcp(self) -> str:
        host, port = self.daemon.tcp_address
        return f"tcp://{host}:{port}"

    def become(self, pid: int, pod: FakePod | None) -> None:
        """Say, in the fake proc root, that process `pid` runs in `pod` (None: in no pod)."""
        directory = self.proc_root / str(pid)
        directory.mkdir(exist_ok=True)
        path = f"/kubepods/besteffort/pod{pod.uid}/ctr" if pod else "/user.slice/session-1.scope"
        (directory / "cgroup").write_text(f"0::{path}\n")


def pod_uid(n: int) -> str:
    return f"{n:08x}-1111-2222-3333-444455556666"


def token_file(tmp: Path, name: str, token: str) -> str:
    path = tmp / f"{name}.token"
    path.write_text(token)
    return str(path)


def raw_tcp(address: str, *, source_ip: str = "127.0.0.1", timeout_s: float = 5.0) -> socket.socket:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.bind((source_ip, 0))
    sock.connect((host, int(port)))
    return sock


def recv_reply(sock: socket.socket) -> dict[str, Any] | None:
    """The next reply on a raw socket, None when closed."""
    try:
        return receive_frame(sock)
    except (DaemonError, OSError):
        return None


def forged_token(api: FakeAPIServer, pod: FakePod) -> str:
    """A token of the right shape and audience whose signature the API server never made."""
    header, claims, _ = api.token(pod).split(".")
    return f"{header}.{claims}.{base64.urlsafe_b64encode(os.urandom(256)).rstrip(b'=').decode()}"


# ---------------------------------------------------------------- the measurement


@dataclass
class Tally:
    ok: int = 0
    failed: int = 0
    latencies_s: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def p99_s(self) -> float:
        if not self.latencies_s:
            return float("inf")
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    def success(self) -> float:
        total = self.ok + self.failed
        return self.ok / total if total else 0.0


def legit_clients(bench: Bench, seconds: float) -> Tally:
    """Each legitimate pod connects from its own address (hello with its token), then sends clock
    requests (`lock`, acknowledged once the daemon took it) back to back, connecting anew every
    `RECONNECT_EVERY` requests as new ranks and restarted pods do, so that admission is measured too."""
    tally = Tally()
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(index: int) -> None:
        pod = bench.legit[index]
        token = Path(bench.legit_tokens[index]).read_text()
        clocks = [1005, 1110, 1200, 1305]
        sock = None
        n = 0
        while time.monotonic() < deadline:
            started = time.perf_counter()
            why = ""
            try:
                if sock is None:
                    sock = raw_tcp(bench.daemon.tcp, source_ip=pod.ip)
                    why = _answer(sock, {"v": 1, "id": 1, "op": "hello", "token": token})
                if not why:
                    why = _answer(sock, {"v": 1, "id": 2, "op": "lock", "gpus": pod.gpus,
                                         "clock_mhz": clocks[n % len(clocks)]})
            except OSError as error:
                why = type(error).__name__
            elapsed = time.perf_counter() - started
            n += 1
            if why or n % RECONNECT_EVERY == 0:
                sock.close() if sock is not None else None
                sock = None
            with lock:
                if not why:
                    tally.ok += 1
                    tally.latencies_s.append(elapsed)
                else:
                    tally.failed += 1
                    tally.errors[why] = tally.errors.get(why, 0) + 1
        if sock is not None:
            sock.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bench.legit))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 30)
    return tally


def _answer(sock: socket.socket, request: dict[str, Any]) -> str:
    """"" when the daemon answered `request` with ok, else its error code (or "closed")."""
    sock.sendall(protocol.encode_frame(request))
    reply = recv_reply(sock)
    if reply is None:
        return "closed"
    return "" if reply.get("ok") else str((reply.get("error") or {}).get("code", "error"))


class Bench:
    """The daemon, its fake API server, the legitimate pods (one GPU each) and an attacker pod."""

    def __init__(self, tmp: Path, *, legit: int = 4, config: dict[str, Any] | None = None) -> None:
        self.tmp = tmp
        self.api = FakeAPIServer(review_latency_s=0.002)
        gpus = discover("sim", count=legit + 2, product=PRODUCT, node=NODE)
        self.legit = [self.api.add_pod(FakePod("team-a", f"train-{i}", pod_uid(i + 1), f"127.0.0.{10 + i}",
                                                [gpus[i].uuid], job="llama")) for i in range(legit)]
        self.attacker = self.api.add_pod(FakePod("team-x", "mallory-0", pod_uid(99), "127.0.0.2",
                                                 [gpus[legit].uuid], job="mallory"))
        self.legit_tokens = [token_file(tmp, pod.name, self.api.token(pod)) for pod in self.legit]
        # The chart's re-review period; re-checks every second, so that revocation runs during the attacks.
        self.daemon = RunningDaemon(tmp, self.api, gpus=legit + 2,
                                    config={"podRecheckSeconds": 1, "tokenReviewSeconds": 60, **(config or {})})


# ---------------------------------------------------------------- the attacks (each bounded)


def attack_idle_sockets(bench: Bench, stop: threading.Event) -> dict[str, Any]:
    """Unauthenticated peers on four addresses keep 64 idle TCP sockets open, reconnecting when cut."""
    held: list[socket.socket] = []
    opened = 0
    while not stop.is_set() and opened < 20_000:
        while len(held) < 64 and opened < 20_000:
            with contextlib.suppress(OSError):
                held.append(raw_tcp(bench.daemon.tcp, source_ip=f"127.0.0.{2 + opened % 4}", timeout_s=0.05))
            opened += 1
        alive = []
        for sock in held:
            try:
                if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    sock.close()
                    continue
            except BlockingIOError:
                pass
            except OSError:
                sock.close()
                continue
            alive.append(sock)
        held = alive
        stop.wait(0.01)
    for sock in held:
        sock.close()
    return {"sockets_opened": opened}


def attack_forged_hellos(bench: Bench, stop: threading.Event) -> dict[str, Any]:
    """Hellos with forged tokens (right audience, signature nobody made) from many addresses."""
    sent = 0
    while not stop.is_set() and sent < 5_000:
        with contextlib.suppress(OSError), raw_tcp(bench.daemon.tcp, source_ip=f"127.0.1.{sent % 200 + 1}") as sock:
            sock.sendall(protocol.encode_frame({"v": 1, "id": 1, "op": "hello",
                                                "token": forged_token(bench.api, bench.legit[0])}))
            recv_reply(sock)
        sent += 1
    return {"hellos": sent}


def attack_hello_flood(bench: Bench, stop: threading.Event) -> dict[str, Any]:
    """One address sends valid-looking hellos as fast as it can (its own, real token)."""
    token = bench.api.token(bench.attacker)
    sent = refused = 0
    while not stop.is_set() and sent < 5_000:
        with contextlib.suppress(OSError), raw_tcp(bench.daemon.tcp, source_ip=bench.attacker.ip) as sock:
            sock.sendall(protocol.encode_frame({"v": 1, "id": 1, "op": "hello", "token": token}))
            reply = recv_reply(sock)
            refused += bool(reply and not reply.get("ok"))
        sent += 1
    return {"hellos": sent, "refused": refused}


def attack_session_hoard(bench: Bench, stop: threading.Event) -> dict[str, Any]:
    """The attacker pod opens as many authenticated sessions as it is let, and keeps them."""
    path = token_file(bench.tmp, "mallory", bench.api.token(bench.attacker))
    held, refused = [], 0
    for _ in range(80):
        if stop.is_set():
            break
        try:
            held.append(_raw_session(bench, path))
        except DaemonError:
            refused += 1
    stop.wait()
    for connection in held:
        connection.close()
    return {"sessions_held": len(held), "refused": refused}


class _RawSession:
    """An authenticated session on a raw socket (DaemonConnection cannot pick its source address)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def close(self) -> None:
        self.sock.close()


def _raw_session(bench: Bench, path: str) -> _RawSession:
    sock = raw_tcp(bench.daemon.tcp, source_ip=bench.attacker.ip)
    sock.sendall(protocol.encode_frame({"v": 1, "id": 1, "op": "hello", "token": Path(path).read_text()}))
    reply = recv_reply(sock)
    if not reply or not reply.get("ok"):
        sock.close()
        raise DaemonError("busy", str(reply))
    return _RawSession(sock)


def attack_token_replay(bench: Bench, stop: threading.Event) -> dict[str, Any]:
    """A sniffed legitimate token replayed from another address tries to lock its pod's GPU."""
    token = Path(bench.legit_tokens[0]).read_text()
    tries = locked = 0  # the replayer's address is not the pod's
    while not stop.is_set() and tries < 500:
        with contextlib.suppress(OSError), raw_tcp(bench.daemon.tcp, source_ip="127.0.0.9") as sock:
            sock.sendall(protocol.encode_frame({"v": 1, "id": 1, "op": "hello", "token": token}))
            sock.sendall(protocol.encode_frame({"v": 1, "id": 2, "op": "lock", "gpus": bench.legit[0].gpus,
                                                "clock_mhz": 1005}))
            first, second = recv_reply(sock), recv_reply(sock)
            locked += bool(first and first.get("ok") and second and second.get("ok"))
        tries += 1
        stop.wait(0.01)
    return {"replays": tries, "locked": locked}


def attack_metrics_sockets(bench: Bench, stop: threading.Event) -> dict[str, Any]:
    """150 idle sockets on the metrics port; then: does the localhost health probe still answer?"""
    host, port = bench.daemon.http.server_address[:2]
    socks = []
    for _ in range(150):
        with contextlib.suppress(OSError):
            socks.append(socket.create_connection((host, port), timeout=1))
    health = _http_status(bench.daemon.health.server_address[1], "/healthz")
    stop.wait()
    for sock in socks:
        sock.close()
    return {"idle_sockets": len(socks), "healthz": health}


def _http_status(port: int, path: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


ATTACKS: dict[str, Callable[[Bench, threading.Event], dict[str, Any]]] = {
    "idle-sockets": attack_idle_sockets,
    "forged-hellos": attack_forged_hellos,
    "hello-flood": attack_hello_flood,
    "session-hoard": attack_session_hoard,
    "token-replay": attack_token_replay,
    "metrics-sockets": attack_metrics_sockets,
}


def run(*, seconds: float = 2.0, legit: int = 4, attacks: list[str] | None = None,
        config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Quiet, then each attack: the legitimate clients' numbers and the attack's own. The clients
    and the attacker each run in a process of their own (forked), so neither takes the daemon's
    interpreter lock; what the attack cost the API server, and the daemon's threads, are read here."""
    with tempfile.TemporaryDirectory(prefix="kareus-abuse-", ignore_cleanup_errors=True) as tmp:
        bench = Bench(Path(tmp), legit=legit, config=config)
        with bench.daemon:
            _forked(legit_clients, bench, min(0.5, seconds))  # warm up: keys fetched, reviews cached
            quiet = _forked(legit_clients, bench, seconds)
            results: dict[str, Any] = {"quiet": _summary(quiet, quiet)}
            for name in attacks or list(ATTACKS):
                before = dict(bench.api.requests)
                turned_away = bench.daemon.http.turned_away
                stop = FORK.Event()
                outcome = FORK.Queue()
                attacker = FORK.Process(target=_attack, args=(ATTACKS[name], bench, stop, outcome))
                attacker.start()
                time.sleep(0.2)  # the attack is under way before the clients are measured
                threads = threading.active_count()
                tally = _forked(legit_clients, bench, seconds)
                threads = max(threads, threading.active_count())
                stop.set()
                result = outcome.get(timeout=60)
                attacker.join(60)
                result.update(tokenreviews=bench.api.requests["tokenreviews"] - before["tokenreviews"],
                              forged_reviewed=bench.api.requests["tokenreviews_forged"] - before["tokenreviews_forged"],
                              daemon_threads=threads, metrics_turned_away=bench.daemon.http.turned_away - turned_away)
                results[name] = {**_summary(tally, quiet), "attack": result}
    return results


FORK = multiprocessing.get_context("fork")


def _forked(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a forked child; its pickled result."""
    answer = FORK.Queue()
    child = FORK.Process(target=_put, args=(answer, function, args))
    child.start()
    value = answer.get(timeout=120)
    child.join(30)
    return value


def _put(answer: Any, function: Callable[..., Any], args: tuple[Any, ...]) -> None:
    answer.put(function(*args))


def _attack(attack: Callable[[Bench, Any], dict[str, Any]], bench: Bench, stop: Any, outcome: Any) -> None:
    outcome.put(attack(bench, stop))


def _summary(tally: Tally, quiet: Tally) -> dict[str, Any]:
    return {"requests": tally.ok + tally.failed, "success": round(tally.success(), 4),
            "p99_ms": round(tally.p99_s() * 1e3, 3), "p99_ratio": round(tally.p99_s() / quiet.p99_s(), 2),
            "median_ms": round(statistics.median(tally.latencies_s) * 1e3, 3) if tally.latencies_s else None,
            "errors": tally.errors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per attack (and quiet)")
    parser.add_argument("--legit", type=int, default=4, help="legitimate clients, one pod and GPU each")
    parser.add_argument("--attack", action="append", choices=list(ATTACKS), help="only these (repeatable)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = run(seconds=args.seconds, legit=args.legit, attacks=args.attack)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'attack':<16} {'requests':>8} {'success':>8} {'p99 ms':>8} {'p99/quiet':>9}  attack outcome")
    for name, row in results.items():
        outcome = ", ".join(f"{k}={v}" for k, v in row.get("attack", {}).items())
        print(f"{name:<16} {row['requests']:>8} {row['success'] * 100:>7.2f}% {row['p99_ms']:>8.2f} "
              f"{row['p99_ratio']:>9.2f}  {outcome}")
    held = all(row["success"] >= 0.99 and row["p99_ratio"] <= 2.0 for row in results.values())
    print("target (success >= 99 %, p99 <= 2x quiet):", "met" if held else "NOT met")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
