"""Pod UID → namespace, name and labels, for the pods on this node.

The caller's cgroup names its pod by UID, while the kubelet's pod-resources API names pods by
namespace and name; the API server joins the two. `PodDirectory` lists the pods scheduled on this
node (`GET /api/v1/pods?fieldSelector=spec.nodeName=<node>`, the only read the daemon's RBAC
grants) with the in-cluster service-account token, caches them, and refreshes on a miss at most
once a second so a flood of unknown callers cannot flood the API server.

The cache follows deletions: an answer older than `max_age_s` is not trusted even for a UID it
knows, and every refresh replaces the whole table, so a deleted pod's UID is forgotten within
`max_age_s`. That matters because the kubelet's pod-resources API names pods by namespace and
name only: a stale UID → name entry would hand a deleted pod's caller the GPUs of a new pod that
reused the name.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from kareus_node.kubeapi import KubeAPI, KubeAPIUnavailable

JOB_LABEL = "kareus.dev/job-name"  # set by the operator on every pod it creates (kareus_operator.settings.LABEL_JOB)
MIN_REFRESH_INTERVAL_S = 1.0
MAX_AGE_S = 5.0  # the default podRecheckSeconds: a re-check round never trusts an older list


class PodDirectoryUnavailable(Exception):
    """The API server could not be asked; callers fail closed."""


@dataclass(frozen=True)
class PodRef:
    uid: str
    namespace: str
    name: str
    labels: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    ips: tuple[str, ...] = ()  # status.podIPs (for hostNetwork pods: the node's)
    host_network: bool = False

    @property
    def job(self) -> str:
        return self.labels.get(JOB_LABEL, "")


class PodDirectory:
    """The pods on `node_name` as the API server at `api_url` lists them."""

    def __init__(
        self,
        api_url: str,
        node_name: str,
        *,
        token_path: str | None = None,
        ca_path: str | None = None,
        timeout_s: float = 2.0,
        max_age_s: float = MAX_AGE_S,
        min_refresh_interval_s: float = MIN_REFRESH_INTERVAL_S,
    ) -> None:
        selector = urllib.parse.quote(f"spec.nodeName={node_name}")
        self._path = f"/api/v1/pods?fieldSelector={selector}"
        self.api = KubeAPI(api_url, token_path=token_path, ca_path=ca_path, timeout_s=timeout_s)
        self._pods: dict[str, PodRef] = {}
        self._refreshed_at = float("-inf")
        self._max_age_s = max_age_s
        self._min_refresh_interval_s = min_refresh_interval_s
        self._lock = threading.Lock()

    def lookup(self, uid: str, *, needs_address: bool = False) -> PodRef | None:
        """The pod with this UID on this node, refreshing the cache when it is not known yet or too
        old, or (`needs_address`) when the cached pod has no address yet: the kubelet reports a
        pod's IP some time after its containers start, so a list taken in between lacks it."""
        with self._lock:
            age_s = time.monotonic() - self._refreshed_at
            cached = self._pods.get(uid)
            stale = cached is None or age_s > self._max_age_s or (needs_address and not cached.ips)
            if stale and age_s >= self._min_refresh_interval_s:
                self._refresh()
            return self._pods.get(uid)

    def _refresh(self) -> None:
        try:
            body = self.api.get(self._path)
        except KubeAPIUnavailable as error:
            raise PodDirectoryUnavailable(f"cannot list pods on this node from the API server: {error}") from None
        self._refreshed_at = time.monotonic()
        self._pods = {}
        for item in body.get("items", []):
            meta = item.get("metadata", {})
            if meta.get("uid"):
                self._pods[meta["uid"]] = _pod_ref(meta, item.get("spec") or {}, item.get("status") or {})


def _pod_ref(meta: dict, spec: dict, status: dict) -> PodRef:
    ips = [entry.get("ip", "") for entry in status.get("podIPs") or [] if isinstance(entry, dict)]
    ips = [ip for ip in ips or [status.get("podIP", "")] if ip]
    return PodRef(meta["uid"], meta.get("namespace", ""), meta.get("name", ""), meta.get("labels") or {},
                  tuple(ips), bool(spec.get("hostNetwork")))
