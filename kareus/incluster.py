"""Where a process in a pod finds its service account and the API server.

A kubelet mounts the token, CA and namespace at `/var/run/secrets/kubernetes.io/serviceaccount`
and sets `KUBERNETES_SERVICE_HOST`/`_PORT`; every in-pod client of Kareus reads these two functions.
`KAREUS_SERVICEACCOUNT_DIR` names another directory for a component run outside a pod with a pod's
credentials (the node daemon's tests do).
"""

from __future__ import annotations

import os
from pathlib import Path

SERVICEACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def serviceaccount_dir() -> Path:
    return Path(os.environ.get("KAREUS_SERVICEACCOUNT_DIR") or SERVICEACCOUNT_DIR)


def api_url() -> str | None:
    """`https://HOST:PORT` of the API server as the pod sees it, or None outside a pod."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        return None
    return f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}"
