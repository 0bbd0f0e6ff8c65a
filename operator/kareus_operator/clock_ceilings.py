"""The per-pod SM clock ceilings the node agents enforce, as the ConfigMap they read.

The node agent (`kareus_node.ceilings`) reads one ConfigMap in its own namespace, where tenants
cannot write: ``data: {<pod UID>: "<MHz>"}``. `ceilings_configmap` renders it from pod UID →
ceiling; whoever computes the ceilings (the power-budget allocator) applies it, server-side, as
the field manager `kareus-operator`. Pods absent from it have no ceiling beyond the policy bounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CONFIGMAP_NAME = "kareus-clock-ceilings"  # kareus_node.ceilings.DEFAULT_NAME


def ceilings_configmap(ceilings_mhz: Mapping[str, int], namespace: str, *, name: str = CONFIGMAP_NAME) -> dict[str, Any]:
    """The ConfigMap that gives each pod (by UID) its ceiling in MHz; a bad value is a ValueError
    naming the pod, since the agents would ignore it."""
    data = {}
    for pod_uid, mhz in sorted(ceilings_mhz.items()):
        if isinstance(mhz, bool) or not isinstance(mhz, int) or mhz <= 0:
            raise ValueError(f"clock ceiling of pod {pod_uid}: must be a whole number of MHz > 0, got {mhz!r}")
        data[pod_uid] = str(mhz)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "kareus"}},
            "data": data}
