"""Small helpers the cluster tests share (the fixtures are in conftest.py)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

import yaml
from kubernetes import client, watch
from kubernetes.client.rest import ApiException


class PodRecorder:
    """Every pod UID created in a namespace, from a watch (so none is missed between polls);
    `with PodRecorder(core, ns) as seen:` — `seen[key]` is the set of UIDs a child pod had, keyed
    `<job>-<role>[-<completion index>]` (the Job controller names pods with a random suffix), or
    by name for any other pod."""

    def __init__(self, core: client.CoreV1Api, namespace: str) -> None:
        self.core, self.namespace = core, namespace
        self.seen: dict[str, set[str]] = defaultdict(set)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        stream = watch.Watch()
        while not self._stop.is_set():
            for event in stream.stream(self.core.list_namespaced_pod, self.namespace, timeout_seconds=2):
                meta = event["object"].metadata
                self.seen[child_key(meta)].add(meta.uid)

    def __enter__(self) -> dict[str, set[str]]:
        self._thread.start()
        return self.seen

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def child_key(meta) -> str:
    labels = meta.labels or {}
    if "kareus.dev/role" not in labels:
        return meta.name
    index = labels.get("batch.kubernetes.io/job-completion-index")
    key = f"{labels['kareus.dev/job-name']}-{labels['kareus.dev/role']}"
    return f"{key}-{index}" if index is not None else key


def read_or_none(read):
    """`read()`, or None when the object does not exist (404)."""
    try:
        return read()
    except ApiException as error:
        if error.status != 404:
            raise
        return None


def wait_until(read, check, *, timeout_s: float, what: str, interval_s: float = 0.2):
    """Poll `read()` until `check` accepts its value, and return it; a timeout is a test failure
    naming `what` and the last value (a bound on waiting, not a speed goal)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if check(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s:.0f} s; last: {value}")
        time.sleep(interval_s)


def install_platform_monitors(dev_cluster) -> dict[str, Any]:
    """The monitoring API on the session's cluster and the platform release's monitors and rules
    (node agents, training pods in every namespace), as a platform team's Prometheus Operator
    would have them; the chart's `metrics` values, for a release's own monitors."""
    from kareus_devcluster.cluster import RELEASE, RELEASE_NAMESPACE
    from kareus_devcluster.prometheus import MONITORING_GROUP, install_monitoring

    metrics = install_monitoring(dev_cluster)
    platform = dev_cluster.values(operator=False, node_agent=True, worker_namespaces=())
    platform["metrics"] = metrics
    monitoring = [o for o in dev_cluster.render(RELEASE, RELEASE_NAMESPACE, platform)
                  if o["apiVersion"].startswith(MONITORING_GROUP)]
    dev_cluster.kubectl("apply", "--server-side", f"--field-manager=helm-{RELEASE}", "-f", "-",
                        input=yaml.safe_dump_all(monitoring))
    return metrics
