"""May this caller control that GPU? Three answers: the kubelet's, a TokenReview's (both in a
cluster) and an allow-list's.

An `Authorizer` turns a caller's credentials into a `Grant`: who the caller is (an `Owner`, which
labels its leases and metrics) and, for every GPU on the node, either "yes" or the reason why not.
A grant is computed once per connection and re-checked periodically; when the facts behind it
cannot be established (kubelet or API server down) the authorizer raises `AuthUnavailable` and
the daemon fails closed.

- `KubeletAuthorizer` (Unix socket): kernel peer credentials → pid → `/proc/<pid>/cgroup` → pod
  UID → the pod's GPUs.
- `TokenAuthorizer` (TCP): the projected ServiceAccount token the client's `hello` carried
  (audience `kareus-node`) → its signature checked locally (`jwks.TokenVerifier`) → the API
  server's TokenReview (good answers cached by the token's hash) → the pod the token is bound to,
  which must be the connection's peer address (`status.podIPs`) → the pod's GPUs. No cgroup, no
  hostPath: what a pod admitted under Pod Security `restricted` can offer.
- Both share `PodAuthorizer._grant_for_pod`: pod UID → (API server) namespace/name on this node →
  (pod-resources) the GPUs allocated to that pod. Refused: pods not on this node, pods in
  namespaces the policy does not allow, GPUs the pod was not allocated, GPUs allocated as
  time-slicing/MPS replicas, GPUs allocated to several pods.
- `StandaloneAuthorizer`: for machines without a kubelet. An allow-list file maps uids and gids
  to GPU UUIDs (or `all`); without a file, only the daemon's own uid may control every GPU.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import json
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from kareus_node.config import ConfigError, NodeConfig
from kareus_node.identity import PeerCredentials, peer_pidfd, pinned_pod_uid, pod_uid_of
from kareus_node.kubeapi import KubeAPI, KubeAPIUnavailable
from kareus_node.podresources import PodResourcesClient, PodResourcesUnavailable
from kareus_node.pods import PodDirectory, PodDirectoryUnavailable, PodRef

HOLDERS_MAX_AGE_S = 1.0  # the probe before every re-check round always asks afresh

TOKEN_AUDIENCE = "kareus-node"  # what the pods' projected serviceAccountToken volume asks for
TOKEN_PATH = "/var/run/secrets/kareus.dev/node/token"  # where pods mount it (documentation, messages)
TOKEN_REVIEW_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"  # set by API servers ≥ 1.30 (ServiceAccountTokenPodNodeInfo)
SERVICEACCOUNT_USER_PREFIX = "system:serviceaccount:"
MAX_TOKEN_BYTES = 16 * 1024  # a ServiceAccount JWT is ~1 KiB; anything far larger is not one
CLOCK_SKEW_S = 60.0  # the early expiry refusal leaves the node's clock this much leeway over the API server's
MAX_CACHED_REVIEWS = 4096
# A pod's containers can start (and call) before the kubelet has reported its IP to the API
# server; a hello waits this long for the address before answering "unavailable" (retryable),
# less than the 5 s a client waits for an answer.
POD_ADDRESS_WAIT_S = 3.0
POD_ADDRESS_POLL_S = 0.5


class AuthUnavailable(Exception):
    """The facts needed to authorise cannot be established right now (fail closed)."""


@dataclass(frozen=True)
class Owner:
    """Who holds a lease: the process (pid 0, uid -1 over TCP: unknown) and, in a cluster, its pod and KareusJob."""

    pid: int
    uid: int
    namespace: str = ""
    pod: str = ""
    pod_uid: str = ""
    job: str = ""

    def describe(self) -> str:
        return f"pod {self.namespace}/{self.pod}" if self.pod else f"pid {self.pid} (uid {self.uid})"

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "uid": self.uid, "namespace": self.namespace, "pod": self.pod,
                "pod_uid": self.pod_uid, "job": self.job}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Owner:
        return cls(**{key: data[key] for key in ("pid", "uid", "namespace", "pod", "pod_uid", "job") if key in data})


@dataclass(frozen=True)
class BearerToken:
    """A TCP caller's credential: the token its `hello` carried (kept out of every repr and log)
    and the address the connection came from ("" when unknown: not checked)."""

    token: str = field(repr=False)
    peer_ip: str = ""


Credentials = PeerCredentials | BearerToken


@dataclass(frozen=True)
class Grant:
    """The caller and, per GPU UUID, "" when it may control it or the reason it may not.

    `refused` says why the caller itself is refused (not in a pod, its token is invalid), so a TCP
    `hello` can be answered with that one reason; `reviewed_at` is when its token was last reviewed
    (time.monotonic; 0 for grants that have no token)."""

    owner: Owner
    refusals: Mapping[str, str]
    refused: str = ""
    reviewed_at: float = field(default=0.0, compare=False)
    ceiling_mhz: int | None = None  # the pod's clock ceiling the operator published (ceilings.py); None: none

    def reason(self, uuid: str) -> str:
        return self.refusals.get(uuid, f"GPU {uuid} is not on this node")


class Authorizer(ABC):
    @abstractmethod
    def grant(self, caller: Credentials, gpu_uuids: Sequence[str]) -> Grant:
        """What `caller` may control among `gpu_uuids`; raises AuthUnavailable to fail closed."""

    def recheck(self, grant: Grant, gpu_uuids: Sequence[str], caller: Credentials | None = None) -> Grant:
        """The same caller's grant asked afresh (its identity, e.g. its pod, stays what it was)."""
        return grant

    def probe(self) -> None:
        """Raise AuthUnavailable when authorisation facts cannot be established right now."""
        return None  # an allow-list is always available

    def identify(self, peer: PeerCredentials, sock: Any) -> PeerCredentials:
        """A Unix-socket peer's credentials as fixed at accept time (`sock` is its socket)."""
        return peer


class PodAuthorizer(Authorizer):
    """The part shared by the cluster authorizers: a pod, by UID, on this node → its GPUs."""

    def __init__(self, config: NodeConfig, pods: PodDirectory, pod_resources: PodResourcesClient) -> None:
        self._config = config
        self._pods = pods
        self._pod_resources = pod_resources
        self.ceilings: Any = None  # a ceilings.ClockCeilings, when the operator publishes per-pod ceilings

    def probe(self) -> None:
        try:
            self._pod_resources.gpu_holders()
        except PodResourcesUnavailable as error:
            raise AuthUnavailable(str(error)) from None

    def _grant_for_pod(self, caller: Owner, pod_uid: str, gpu_uuids: Sequence[str], *,
                       expected: tuple[str, str] | None = None, reviewed_at: float = 0.0,
                       peer_ip: str = "") -> Grant:
        """The grant of pod `pod_uid` for `caller` (its pid/uid); `expected` is the namespace/name
        another source (a token) claims for that UID, which the API server's answer must match;
        `peer_ip`, when given, must be one of the pod's addresses."""
        try:
            pod = self._pods.lookup(pod_uid)
            holders = self._pod_resources.gpu_holders(max_age_s=HOLDERS_MAX_AGE_S)
        except (PodDirectoryUnavailable, PodResourcesUnavailable) as error:
            raise AuthUnavailable(str(error)) from None
        if pod is None:
            who = f"pod {expected[0]}/{expected[1]} ({pod_uid})" if expected else f"pod {pod_uid}"
            owner = replace(caller, pod_uid=pod_uid)
            return _refuse_all(owner, gpu_uuids, f"{who} is not scheduled on this node", reviewed_at=reviewed_at)
        owner = Owner(caller.pid, caller.uid, pod.namespace, pod.name, pod.uid, pod.job)
        if expected is not None and (pod.namespace, pod.name) != expected:
            return _refuse_all(owner, gpu_uuids, f"token names pod {expected[0]}/{expected[1]} but UID {pod_uid} is "
                               f"pod {pod.namespace}/{pod.name}", reviewed_at=reviewed_at)
        if not self._config.namespace_allowed(pod.namespace):
            return _refuse_all(owner, gpu_uuids, f"namespace {pod.namespace} is not allowed by the node policy",
                               reviewed_at=reviewed_at)
        if peer_ip and not pod.ips and not pod.host_network:
            pod = self._pod_with_address(pod)
        if peer_ip and not _peer_is_pod(peer_ip, pod):
            return _refuse_all(owner, gpu_uuids, f"the connection comes from {peer_ip}, not from pod {pod.namespace}/"
                               f"{pod.name}'s address ({', '.join(pod.ips) or 'none yet'}): a token is only good "
                               f"from its own pod", reviewed_at=reviewed_at)
        refusals = {}
        for uuid in gpu_uuids:
            mine = [h for h in holders.get(uuid, []) if (h.namespace, h.pod) == (pod.namespace, pod.name)]
            others = {(h.namespace, h.pod) for h in holders.get(uuid, [])} - {(pod.namespace, pod.name)}
            if not mine:
                refusals[uuid] = f"GPU {uuid} is not allocated to pod {pod.namespace}/{pod.name}"
            elif any(h.shared for h in mine):
                refusals[uuid] = f"GPU {uuid} is shared (time-slicing/MPS replica); clock control is refused"
            elif others:
                refusals[uuid] = f"GPU {uuid} is allocated to several pods; clock control is refused"
            else:
                refusals[uuid] = ""
        ceiling = self.ceilings.for_pod(pod.uid) if self.ceilings is not None else None
        return Grant(owner, refusals, reviewed_at=reviewed_at, ceiling_mhz=ceiling)

    def _pod_with_address(self, pod: PodRef) -> PodRef:
        """`pod` as the API server lists it once the kubelet has reported its address (waiting at
        most POD_ADDRESS_WAIT_S); raises AuthUnavailable if it still has none."""
        deadline = time.monotonic() + POD_ADDRESS_WAIT_S
        while True:
            time.sleep(POD_ADDRESS_POLL_S)
            try:
                fresh = self._pods.lookup(pod.uid, needs_address=True)
            except PodDirectoryUnavailable as error:
                raise AuthUnavailable(str(error)) from None
            if fresh is None or fresh.ips:
                return fresh or pod  # gone: the address check refuses it
            if time.monotonic() >= deadline:
                raise AuthUnavailable(f"pod {pod.namespace}/{pod.name} has no address in the API server yet (the "
                                      f"kubelet has not reported it), so its connection cannot be checked; retry")


class KubeletAuthorizer(PodAuthorizer):
    """Unix-socket callers: the kernel's peer pid → its cgroup → its pod."""

    def __init__(self, config: NodeConfig, pods: PodDirectory, pod_resources: PodResourcesClient, *, proc_root: str = "/proc") -> None:
        super().__init__(config, pods, pod_resources)
        self._proc_root = proc_root

    def identify(self, peer: PeerCredentials, sock: Any) -> PeerCredentials:
        pidfd = peer_pidfd(sock, peer.pid)
        return replace(peer, pod_uid=pinned_pod_uid(pidfd, peer.pid, proc_root=self._proc_root), pinned=True)

    def grant(self, caller: Credentials, gpu_uuids: Sequence[str]) -> Grant:
        if not isinstance(caller, PeerCredentials):
            return _refuse_all(Owner(0, -1), gpu_uuids, "this authorizer needs kernel peer credentials (Unix socket)")
        pod_uid = caller.pod_uid if caller.pinned else pod_uid_of(caller.pid, proc_root=self._proc_root)
        if pod_uid is None:
            return _refuse_all(Owner(caller.pid, caller.uid), gpu_uuids, f"caller pid {caller.pid} is not in a Kubernetes pod")
        return self._grant_for_pod(Owner(caller.pid, caller.uid), pod_uid, gpu_uuids)

    def recheck(self, grant: Grant, gpu_uuids: Sequence[str], caller: Credentials | None = None) -> Grant:
        owner = grant.owner
        if not owner.pod_uid:
            return grant
        return self._grant_for_pod(Owner(owner.pid, owner.uid), owner.pod_uid, gpu_uuids)


@dataclass(frozen=True)
class TokenIdentity:
    """What a TokenReview says a bound ServiceAccount token stands for."""

    namespace: str
    service_account: str
    pod: str
    pod_uid: str
    node: str  # "" when the API server does not say (before 1.30)


class TokenAuthorizer(PodAuthorizer):
    """TCP callers: a projected ServiceAccount token (audience `kareus-node`), reviewed by the API
    server (TokenReview, as the daemon's own ServiceAccount), names the pod it is bound to.

    A bound token validates only while its pod exists (with that UID) and the token has not
    expired, so re-reviewing it is how a re-check learns that the pod is gone even before the
    kubelet stops listing it. Reviews are re-done at most every `review_interval_s` (the API
    server answers every leased connection of every node); the pod-resources part of the grant is
    re-checked on every round regardless."""

    def __init__(self, config: NodeConfig, pods: PodDirectory, pod_resources: PodResourcesClient, api: KubeAPI, *,
                 node_name: str, audience: str = TOKEN_AUDIENCE, review_interval_s: float | None = None,
                 verifier: Any = None) -> None:
        super().__init__(config, pods, pod_resources)
        self._api = api
        self._node_name = node_name
        self._audience = audience
        self._review_interval_s = config.token_review_s if review_interval_s is None else review_interval_s
        self._verifier = verifier  # a jwks.TokenVerifier; None: the TokenReview alone decides
        self._reviews: dict[str, tuple[TokenIdentity, float]] = {}  # sha256(token) → (identity, good until)
        self._reviews_lock = threading.Lock()
        self.reviews_posted = 0

    def grant(self, caller: Credentials, gpu_uuids: Sequence[str]) -> Grant:
        token = caller.token if isinstance(caller, BearerToken) else ""
        peer_ip = caller.peer_ip if isinstance(caller, BearerToken) else ""
        reviewed_at = time.monotonic()
        identity, reason = self.review(token)
        if identity is None:
            return _refuse_all(Owner(0, -1), gpu_uuids, reason, reviewed_at=reviewed_at)
        return self._grant_for_pod(Owner(0, -1), identity.pod_uid, gpu_uuids,
                                   expected=(identity.namespace, identity.pod), reviewed_at=reviewed_at,
                                   peer_ip=peer_ip)

    def recheck(self, grant: Grant, gpu_uuids: Sequence[str], caller: Credentials | None = None) -> Grant:
        owner = grant.owner
        if not owner.pod_uid:
            return grant  # refused at connect; stays refused
        reviewed_at = grant.reviewed_at
        peer_ip = caller.peer_ip if isinstance(caller, BearerToken) else ""
        if time.monotonic() - reviewed_at >= self._review_interval_s:
            reviewed_at = time.monotonic()
            identity, reason = self.review(caller.token if isinstance(caller, BearerToken) else "", cached=False)
            if identity is None:
                return _refuse_all(owner, gpu_uuids, reason, reviewed_at=reviewed_at)
            if identity.pod_uid != owner.pod_uid:
                return _refuse_all(owner, gpu_uuids, f"the connection's token now names pod {identity.namespace}/"
                                   f"{identity.pod}, not {owner.namespace}/{owner.pod}", reviewed_at=reviewed_at)
        fresh = self._grant_for_pod(Owner(0, -1), owner.pod_uid, gpu_uuids, expected=(owner.namespace, owner.pod),
                                    reviewed_at=reviewed_at, peer_ip=peer_ip)
        return fresh

    def review(self, token: str, *, cached: bool = True) -> tuple[TokenIdentity | None, str]:
        """(identity, "") for a valid bound token of this audience, else (None, why not);
        raises AuthUnavailable when the API server cannot answer (fail closed). A good answer is
        reused for `review_interval_s` (never past the token's expiry) unless `cached` is False."""
        if not token:
            return None, (f"no token: a TCP connection must send hello with token, a projected ServiceAccount token "
                          f"with audience {self._audience} (pods mount it at {TOKEN_PATH})")
        shape = _unverified_claims_problem(token, self._audience)
        if shape:  # refused without asking the API server: garbage must not cost it a request
            return None, f"token refused: {shape}"
        key = hashlib.sha256(token.encode()).hexdigest()
        with self._reviews_lock:
            hit = self._reviews.get(key)
        if cached and hit is not None and time.monotonic() < hit[1]:
            return hit[0], ""
        if self._verifier is not None:
            problem = self._verifier.problem(token)
            if problem:
                return None, f"token refused: {problem}"
        identity, reason = self._post_review(token)
        with self._reviews_lock:
            self._reviews.pop(key, None)
            if identity is not None and self._review_interval_s > 0:
                self._remember(key, identity, token)
        return identity, reason

    def _remember(self, key: str, identity: TokenIdentity, token: str) -> None:
        until = time.monotonic() + self._review_interval_s
        expiry = _unverified_expiry(token)
        if expiry is not None:
            until = min(until, time.monotonic() + expiry - time.time())
        now = time.monotonic()
        for old in [k for k, (_, good_until) in self._reviews.items() if good_until <= now]:
            del self._reviews[old]
        while len(self._reviews) >= MAX_CACHED_REVIEWS:
            del self._reviews[next(iter(self._reviews))]
        self._reviews[key] = (identity, until)

    def _post_review(self, token: str) -> tuple[TokenIdentity | None, str]:
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token, "audiences": [self._audience]}}
        self.reviews_posted += 1
        try:
            answer = self._api.post(TOKEN_REVIEW_PATH, body)
        except KubeAPIUnavailable as error:
            hint = " (the node agent's ServiceAccount needs RBAC to create tokenreviews)" if error.status == 403 else ""
            raise AuthUnavailable(f"cannot review the token with the API server: {error}{hint}") from None
        status = answer.get("status") or {}
        if not status.get("authenticated"):
            return None, f"token refused by the API server's TokenReview: {status.get('error') or 'not authenticated'}"
        if self._audience not in (status.get("audiences") or []):
            return None, f"token refused: not valid for audience {self._audience}"
        user = status.get("user") or {}
        username = str(user.get("username", ""))
        namespace, _, account = username.removeprefix(SERVICEACCOUNT_USER_PREFIX).partition(":")
        if not username.startswith(SERVICEACCOUNT_USER_PREFIX) or not namespace or not account:
            return None, f"token refused: {username or 'its user'} is not a ServiceAccount"
        extra = user.get("extra") or {}
        pod, pod_uid, node = (_first(extra.get(key)) for key in (POD_NAME_EXTRA, POD_UID_EXTRA, NODE_NAME_EXTRA))
        if not pod or not pod_uid:
            return None, (f"token refused: it is not bound to a pod (use a projected serviceAccountToken volume, "
                          f"audience {self._audience})")
        if node and node != self._node_name:
            return None, f"pod {namespace}/{pod} runs on node {node}, not on this node ({self._node_name})"
        return TokenIdentity(namespace, account, pod, pod_uid, node), ""


@dataclass(frozen=True)
class AllowRule:
    uid: int | None
    gid: int | None
    gpus: frozenset[str] | None  # None: every GPU


class StandaloneAuthorizer(Authorizer):
    def __init__(self, rules: Sequence[AllowRule] | None = None) -> None:
        self._rules = tuple(rules) if rules is not None else (AllowRule(os.getuid(), None, None),)

    def grant(self, caller: Credentials, gpu_uuids: Sequence[str]) -> Grant:
        if not isinstance(caller, PeerCredentials):
            return _refuse_all(Owner(0, -1), gpu_uuids, "the allow-list needs kernel peer credentials (Unix socket)")
        peer = caller
        matching = [r for r in self._rules if r.uid == peer.uid or (r.gid is not None and r.gid == peer.gid)]
        refusals = {}
        for uuid in gpu_uuids:
            allowed = any(r.gpus is None or uuid in r.gpus for r in matching)
            refusals[uuid] = "" if allowed else f"uid {peer.uid}/gid {peer.gid} is not allowed GPU {uuid} by the allow-list"
        return Grant(Owner(peer.pid, peer.uid), refusals)


def load_allow_list(path: str | Path) -> list[AllowRule]:
    """Read an allow-list: ``allow: [{uid: 1000, gpus: [GPU-…]}, {gid: 27, gpus: all}]``."""
    where = f"allow-list {path}"
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except OSError as error:
        raise ConfigError(f"{where}: cannot be read ({error.strerror or error})") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{where}: not valid YAML ({error})") from None
    entries = raw.get("allow") if isinstance(raw, Mapping) else None
    if not isinstance(entries, list):
        raise ConfigError(f"{where}: allow: must be a list of {{uid|gid, gpus}} entries")
    return [_rule(entry, f"{where}: allow[{i}]") for i, entry in enumerate(entries)]


def _rule(entry: Any, where: str) -> AllowRule:
    if not isinstance(entry, Mapping) or set(entry) - {"uid", "gid", "gpus"}:
        raise ConfigError(f"{where}: must be a mapping with keys uid and/or gid, and gpus")
    ids = {}
    for key in ("uid", "gid"):
        value = entry.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(f"{where}.{key}: must be a non-negative integer, got {value!r}")
        ids[key] = value
    if ids["uid"] is None and ids["gid"] is None:
        raise ConfigError(f"{where}: needs a uid or a gid")
    gpus = entry.get("gpus")
    if gpus == "all":
        return AllowRule(ids["uid"], ids["gid"], None)
    if not isinstance(gpus, list) or not all(isinstance(g, str) and g.startswith("GPU-") for g in gpus):
        raise ConfigError(f"{where}.gpus: must be 'all' or a list of GPU UUIDs (GPU-…)")
    return AllowRule(ids["uid"], ids["gid"], frozenset(gpus))


def _refuse_all(owner: Owner, gpu_uuids: Sequence[str], reason: str, *, reviewed_at: float = 0.0) -> Grant:
    return Grant(owner, dict.fromkeys(gpu_uuids, reason), refused=reason, reviewed_at=reviewed_at)


def _first(values: Any) -> str:
    """The single value of a TokenReview `extra` entry (a list of strings)."""
    return str(values[0]) if isinstance(values, list) and values else ""


def _peer_is_pod(peer_ip: str, pod: PodRef) -> bool:
    """Whether a TCP connection from `peer_ip` can be pod `pod`'s. A hostNetwork pod shares the
    node's addresses, loopback included, so for it this tells the node from elsewhere, not one
    node process from another (docs/node-daemon.md, threat model)."""
    try:
        peer = ipaddress.ip_address(peer_ip)
    except ValueError:
        return False
    if isinstance(peer, ipaddress.IPv6Address) and peer.ipv4_mapped:
        peer = peer.ipv4_mapped
    if pod.host_network and peer.is_loopback:
        return True
    return any(_same_ip(peer, ip) for ip in pod.ips)


def _same_ip(peer: Any, text: str) -> bool:
    try:
        return ipaddress.ip_address(text) == peer
    except ValueError:
        return False


def _unverified_expiry(token: str) -> float | None:
    try:
        claims = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=" * (-len(token.split(".")[1]) % 4)))
    except (binascii.Error, ValueError, IndexError):
        return None
    expiry = claims.get("exp") if isinstance(claims, dict) else None
    return float(expiry) if isinstance(expiry, (int, float)) and not isinstance(expiry, bool) else None


def _unverified_claims_problem(token: str, audience: str) -> str:
    """Why `token` cannot be a current ServiceAccount JWT for `audience`, judged from its unverified
    claims ("" when it may be one). Only ever used to refuse early; acceptance is the TokenReview's."""
    if len(token) > MAX_TOKEN_BYTES:
        return f"longer than {MAX_TOKEN_BYTES} bytes"
    parts = token.split(".")
    if len(parts) != 3:
        return "not a JSON Web Token"
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (binascii.Error, ValueError):
        return "not a JSON Web Token"
    if not isinstance(claims, dict):
        return "not a JSON Web Token"
    audiences = claims.get("aud")
    audiences = [audiences] if isinstance(audiences, str) else audiences if isinstance(audiences, list) else []
    if audience not in audiences:
        return f"its audience is {', '.join(map(str, audiences)) or 'unset'}, not {audience}"
    expiry = claims.get("exp")
    if isinstance(expiry, (int, float)) and not isinstance(expiry, bool) and expiry + CLOCK_SKEW_S < time.time():
        return "it has expired"
    return ""
