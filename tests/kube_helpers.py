"""Small helpers the cluster tests share (the fixtures are in conftest.py)."""

from __future__ import annotations

import threading
from collections import defaultdict

from kubernetes import client, watch


class PodRecorder:
    """Every pod UID created in a namespace, by name, from a watch (so none is missed between polls);
    `with PodRecorder(core, ns) as seen:` — `seen[name]` is the set of UIDs that name had."""

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
                self.seen[meta.name].add(meta.uid)

    def __enter__(self) -> dict[str, set[str]]:
        self._thread.start()
        return self.seen

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
