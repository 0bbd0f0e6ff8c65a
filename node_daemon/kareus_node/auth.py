"""May this caller control that GPU? Two answers: the kubelet's (in a cluster) and an allow-list's.

An `Authorizer` turns a peer's kernel credentials into a `Grant`: who the caller is (an `Owner`,
which labels its leases and metrics) and, for every GPU on the node, either "yes" or the reason
why not. A grant is computed once per connection and re-checked periodically; when the facts
behind it cannot be established (kubelet or API server down) the authorizer raises
`AuthUnavailable` and the daemon fails closed.

- `KubeletAuthorizer`: pid → `/proc/<pid>/cgroup` → pod UID → (API server) namespace/name →
  (pod-resources) the GPUs allocated to that pod. Refused: callers outside pods, pods in
  namespaces the policy does not allow, GPUs the pod was not allocated, GPUs allocated as
  time-slicing/MPS replicas, GPUs allocated to several pods.
- `StandaloneAuthorizer`: for machines without a kubelet. An allow-list file maps uids and gids
  to GPU UUIDs (or `all`); without a file, only the daemon's own uid may control every GPU.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kareus_node.config import ConfigError, NodeConfig
from kareus_node.identity import PeerCredentials, pod_uid_of
from kareus_node.podresources import PodResourcesClient, PodResourcesUnavailable
from kareus_node.pods import PodDirectory, PodDirectoryUnavailable

HOLDERS_MAX_AGE_S = 1.0  # the probe before every re-check round always asks afresh


class AuthUnavailable(Exception):
    """The facts needed to authorise cannot be established right now (fail closed)."""


@dataclass(frozen=True)
class Owner:
    """Who holds a lease: the process and, in a cluster, its pod and KareusJob."""

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
class Grant:
    """The caller and, per GPU UUID, "" when it may control it or the reason it may not."""

    owner: Owner
    refusals: Mapping[str, str]

    def reason(self, uuid: str) -> str:
        return self.refusals.get(uuid, f"GPU {uuid} is not on this node")


class Authorizer(ABC):
    @abstractmethod
    def grant(self, peer: PeerCredentials, gpu_uuids: Sequence[str]) -> Grant:
        """What `peer` may control among `gpu_uuids`; raises AuthUnavailable to fail closed."""

    def recheck(self, grant: Grant, gpu_uuids: Sequence[str]) -> Grant:
        """The same caller's grant asked afresh (its identity, e.g. its pod, stays what it was)."""
        return grant

    def probe(self) -> None:
        """Raise AuthUnavailable when authorisation facts cannot be established right now."""
        return None  # an allow-list is always available


class KubeletAuthorizer(Authorizer):
    def __init__(self, config: NodeConfig, pods: PodDirectory, pod_resources: PodResourcesClient, *, proc_root: str = "/proc") -> None:
        self._config = config
        self._pods = pods
        self._pod_resources = pod_resources
        self._proc_root = proc_root

    def grant(self, peer: PeerCredentials, gpu_uuids: Sequence[str]) -> Grant:
        pod_uid = pod_uid_of(peer.pid, proc_root=self._proc_root)
        if pod_uid is None:
            return _refuse_all(Owner(peer.pid, peer.uid), gpu_uuids, f"caller pid {peer.pid} is not in a Kubernetes pod")
        return self._grant_for_pod(peer, pod_uid, gpu_uuids)

    def probe(self) -> None:
        try:
            self._pod_resources.gpu_holders()
        except PodResourcesUnavailable as error:
            raise AuthUnavailable(str(error)) from None

    def recheck(self, grant: Grant, gpu_uuids: Sequence[str]) -> Grant:
        owner = grant.owner
        if not owner.pod_uid:
            return grant
        return self._grant_for_pod(PeerCredentials(owner.pid, owner.uid, -1), owner.pod_uid, gpu_uuids)

    def _grant_for_pod(self, peer: PeerCredentials, pod_uid: str, gpu_uuids: Sequence[str]) -> Grant:
        try:
            pod = self._pods.lookup(pod_uid)
            holders = self._pod_resources.gpu_holders(max_age_s=HOLDERS_MAX_AGE_S)
        except (PodDirectoryUnavailable, PodResourcesUnavailable) as error:
            raise AuthUnavailable(str(error)) from None
        if pod is None:
            return _refuse_all(Owner(peer.pid, peer.uid, pod_uid=pod_uid), gpu_uuids, f"pod {pod_uid} is not scheduled on this node")
        owner = Owner(peer.pid, peer.uid, pod.namespace, pod.name, pod.uid, pod.job)
        if not self._config.namespace_allowed(pod.namespace):
            return _refuse_all(owner, gpu_uuids, f"namespace {pod.namespace} is not allowed by the node policy")
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
        return Grant(owner, refusals)


@dataclass(frozen=True)
class AllowRule:
    uid: int | None
    gid: int | None
    gpus: frozenset[str] | None  # None: every GPU


class StandaloneAuthorizer(Authorizer):
    def __init__(self, rules: Sequence[AllowRule] | None = None) -> None:
        self._rules = tuple(rules) if rules is not None else (AllowRule(os.getuid(), None, None),)

    def grant(self, peer: PeerCredentials, gpu_uuids: Sequence[str]) -> Grant:
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


def _refuse_all(owner: Owner, gpu_uuids: Sequence[str], reason: str) -> Grant:
    return Grant(owner, dict.fromkeys(gpu_uuids, reason))
