"""Pod UID → namespace, name and labels, for the pods on this node.

The caller's cgroup names its pod by UID, while the kubelet's pod-resources API names pods by
namespace and name; the API server joins the two. `PodDirectory` lists the pods scheduled on this
node (`GET /api/v1/pods?fieldSelector=spec.nodeName=<node>`, the only read the daemon's RBAC
grants) with the in-cluster service-account token, caches them, and refreshes on a miss at most
once a second so a flood of unknown callers cannot flood the API server.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from kareus_node.kubeapi import KubeAPI, KubeAPIUnavailable

JOB_LABEL = "kareus.dev/job-name"  # set by the operator on every pod it creates (kareus_operator.settings.LABEL_JOB)
MIN_REFRESH_INTERVAL_S = 1.0


class PodDirectoryUnavailable(Exception):
    """The API server could not be asked; callers fail closed."""


@dataclass(frozen=True)
class PodRef:
    uid: str
    namespace: str
    name: str
    labels: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

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
    ) -> None:
        selector = urllib.parse.quote(f"spec.nodeName={node_name}")
        self._path = f"/api/v1/pods?fieldSelector={selector}"
        self.api = KubeAPI(api_url, token_path=token_path, ca_path=ca_path, timeout_s=timeout_s)
        self._pods: dict[str, PodRef] = {}
        self._refreshed_at = float("-inf")
        self._lock = threading.Lock()

    def lookup(self, uid: str) -> PodRef | None:
        """The pod with this UID on this node, refreshing the cache when it is not known yet."""
        with self._lock:
            if uid not in self._pods and time.monotonic() - self._refreshed_at >= MIN_REFRESH_INTERVAL_S:
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
                self._pods[meta["uid"]] = PodRef(meta["uid"], meta.get("namespace", ""), meta.get("name", ""), meta.get("labels") or {})
