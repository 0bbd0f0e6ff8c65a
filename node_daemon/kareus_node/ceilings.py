"""Per-pod SM clock ceilings that the operator publishes and the daemon enforces.

The power budget is only as strong as its enforcement: the tenant's runtime picks the clocks, so a
ceiling the allocator computed must hold at the node. The operator publishes the ceilings in one
ConfigMap in the node agent's own namespace (default `kareus-node/kareus-clock-ceilings`):
``data: {<pod UID>: "<MHz>"}``. Not pod annotations: a tenant who may patch its pods could raise
its own ceiling, while the agent's namespace is the cluster administrator's (its Pod Security
level is `privileged`, and no tenant role reaches it).

`ClockCeilings.for_pod(uid)` is the ceiling of one pod (None: none). The ConfigMap is read at
most every `max_age_s` (the re-check period); a missing ConfigMap means no ceilings, and an entry
that is not a positive whole number of MHz is ignored with a warning (the operator wrote it;
refusing every clock of the node for one bad entry would punish every other pod). When the API
server cannot be asked the daemon fails closed (`AuthUnavailable`), as for the pod list.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from kareus_node.auth import AuthUnavailable
from kareus_node.kubeapi import KubeAPI, KubeAPIUnavailable

log = logging.getLogger("kareus_node")

DEFAULT_NAME = "kareus-clock-ceilings"


class ClockCeilings:
    """The ceilings of ConfigMap `namespace/name`, cached for `max_age_s`."""

    def __init__(self, api: KubeAPI, namespace: str, name: str = DEFAULT_NAME, *, max_age_s: float = 5.0,
                 now: Callable[[], float] = time.monotonic) -> None:
        self._api = api
        self._path = f"/api/v1/namespaces/{namespace}/configmaps/{name}"
        self.where = f"ConfigMap {namespace}/{name}"
        self._max_age_s = max_age_s
        self._now = now
        self._ceilings: dict[str, int] = {}
        self._read_at = float("-inf")
        self._lock = threading.Lock()

    def for_pod(self, pod_uid: str) -> int | None:
        with self._lock:
            if self._now() - self._read_at >= self._max_age_s:
                self._ceilings = self._read()
                self._read_at = self._now()
            return self._ceilings.get(pod_uid)

    def _read(self) -> dict[str, int]:
        try:
            body = self._api.get(self._path)
        except KubeAPIUnavailable as error:
            if error.status == 404:
                return {}  # nothing published: no pod has a ceiling
            raise AuthUnavailable(f"cannot read the clock ceilings ({self.where}): {error}") from None
        return parse_ceilings(body.get("data") or {} if isinstance(body, dict) else {}, self.where)


def parse_ceilings(data: Mapping[str, object], where: str) -> dict[str, int]:
    """Pod UID → ceiling in MHz from a ConfigMap's data; bad entries are skipped, with a warning."""
    ceilings = {}
    for uid, text in data.items():
        value = str(text).strip()
        if not value.isdecimal() or int(value) <= 0:
            log.warning("%s: %s: %r is not a clock ceiling in MHz (a whole number > 0); ignored", where, uid, text)
            continue
        ceilings[str(uid)] = int(value)
    return ceilings
