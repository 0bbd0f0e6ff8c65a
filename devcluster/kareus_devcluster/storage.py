"""Node-local volumes for the dev cluster: a default StorageClass whose claims bind, as kind's do.

kind ships Rancher's local-path-provisioner: a default StorageClass `standard` with
`volumeBindingMode: WaitForFirstConsumer`, whose provisioner, once the scheduler has picked the
node of a claim's first pod (the claim's `volume.kubernetes.io/selected-node` annotation), makes a
directory on that node and a PersistentVolume for it, pinned to the node by node affinity, and
removes both when the claim is deleted (reclaim policy Delete). `LocalPathProvisioner` does the
same for the dev cluster's real nodes, from the dev cluster's process (as Kueue runs beside the
control plane): the directory is `/var/local-path-provisioner/<pv>_<namespace>_<claim>` in the
node's own `/var` (its mount namespace's), the volume a `local` one, so the kubelet mounts it as it
would any node-local disk and applies the pod's fsGroup. Like local-path-provisioner it serves
ReadWriteOnce and ReadWriteOncePod claims, and ReadWriteMany ones whose pods share the node.

Its name on the claims it provisions is local-path-provisioner's, `rancher.io/local-path`.
"""

from __future__ import annotations

import json
import shutil
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kareus_devcluster.controlplane import ControlPlane

STORAGE_CLASS = "standard"  # kind's name for its default class
PROVISIONER = "rancher.io/local-path"
NODE_DIR = "/var/local-path-provisioner"  # inside a node: its own /var
SELECTED_NODE = "volume.kubernetes.io/selected-node"
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
POLL_S = 0.5


def storage_class() -> dict[str, Any]:
    """The default StorageClass, as kind's."""
    return {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
            "metadata": {"name": STORAGE_CLASS,
                         "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
            "provisioner": PROVISIONER, "reclaimPolicy": "Delete", "volumeBindingMode": "WaitForFirstConsumer"}


def volume_name(claim: Mapping[str, Any]) -> str:
    return f"pvc-{claim['metadata']['uid']}"


def volume_dir(claim: Mapping[str, Any]) -> str:
    """The claim's directory inside its node (local-path-provisioner's naming)."""
    meta = claim["metadata"]
    return f"{NODE_DIR}/{volume_name(claim)}_{meta['namespace']}_{meta['name']}"


def persistent_volume(claim: Mapping[str, Any], node: str) -> dict[str, Any]:
    """The PersistentVolume for `claim` on `node`: a local volume bound to the claim, pinned to the node."""
    meta, spec = claim["metadata"], claim["spec"]
    capacity = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
    return {"apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": volume_name(claim), "annotations": {PROVISIONED_BY: PROVISIONER}},
            "spec": {"capacity": {"storage": capacity}, "accessModes": list(spec.get("accessModes") or ["ReadWriteOnce"]),
                     "persistentVolumeReclaimPolicy": "Delete", "storageClassName": STORAGE_CLASS,
                     "volumeMode": spec.get("volumeMode", "Filesystem"),
                     "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": meta["namespace"],
                                  "name": meta["name"], "uid": meta["uid"]},
                     "local": {"path": volume_dir(claim)},
                     "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                         {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}}}}


def wants_volume(claim: Mapping[str, Any]) -> str | None:
    """The node a pending claim of this class waits for a volume on, or None."""
    meta, spec = claim["metadata"], claim.get("spec") or {}
    if (claim.get("status") or {}).get("phase") != "Pending" or spec.get("volumeName"):
        return None
    if spec.get("storageClassName") != STORAGE_CLASS or meta.get("deletionTimestamp"):
        return None
    return (meta.get("annotations") or {}).get(SELECTED_NODE)


class LocalPathProvisioner:
    """Provisions and deletes the class's volumes; `node_root(name)` is a node's directory on this
    host (what the node sees as `/`), None for a node it does not know."""

    def __init__(self, control_plane: ControlPlane, node_root: Callable[[str], Path | None]) -> None:
        self.control_plane, self.node_root = control_plane, node_root
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []  # what went wrong, for a test that wonders why a claim stays Pending

    def start(self) -> None:
        self._request("POST", "/apis/storage.k8s.io/v1/storageclasses", storage_class(), exists_ok=True)
        self._thread = threading.Thread(target=self._run, name="local-path-provisioner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.sync()
            except Exception as error:  # the API may be restarting: record it, try again
                self.errors.append(f"{type(error).__name__}: {error}")

    def sync(self) -> None:
        """One pass: a volume for every claim waiting on its node, none left for a deleted claim."""
        for claim in self._request("GET", "/api/v1/persistentvolumeclaims")["items"]:
            node = wants_volume(claim)
            if node is not None:
                self._provision(claim, node)
        for volume in self._request("GET", "/api/v1/persistentvolumes")["items"]:
            if ((volume["metadata"].get("annotations") or {}).get(PROVISIONED_BY) == PROVISIONER
                    and (volume.get("status") or {}).get("phase") in ("Released", "Failed")):
                self._delete(volume)

    def _provision(self, claim: Mapping[str, Any], node: str) -> None:
        root = self.node_root(node)
        if root is None:
            self.errors.append(f"claim {claim['metadata']['namespace']}/{claim['metadata']['name']}: "
                               f"node {node} is not one of the dev cluster's")
            return
        directory = root / volume_dir(claim).lstrip("/")
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o777)  # as local-path-provisioner's helper makes it: any pod user may write
        self._request("POST", "/api/v1/persistentvolumes", persistent_volume(claim, node), exists_ok=True)

    def _delete(self, volume: Mapping[str, Any]) -> None:
        terms = volume["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
        node = terms[0]["matchExpressions"][0]["values"][0]
        root = self.node_root(node)
        if root is not None:
            shutil.rmtree(root / volume["spec"]["local"]["path"].lstrip("/"), ignore_errors=True)
        self._request("DELETE", f"/api/v1/persistentvolumes/{volume['metadata']['name']}", None, exists_ok=True)

    def _request(self, method: str, url_path: str, body: Any = None, *, exists_ok: bool = False) -> Any:
        admin = self.control_plane.admin
        assert admin is not None, "the control plane is not started"
        context = ssl.create_default_context(cafile=str(self.control_plane.ca_file))
        context.load_cert_chain(str(admin.pair.cert_file), str(admin.pair.key_file))
        request = urllib.request.Request(self.control_plane.url + url_path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, context=context, timeout=10) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as error:
            if exists_ok and error.code in (404, 409):
                return {}
            raise
