"""The dev cluster's default StorageClass and its node-local volumes, without a cluster: what the
provisioner creates for a claim the scheduler placed, and which claims it leaves alone. The claim
binding on the real nodes is tested in tests/test_checkpoint_resume.py."""

from __future__ import annotations

import inspect

from kareus_devcluster.storage import (
    PROVISIONER,
    SELECTED_NODE,
    STORAGE_CLASS,
    LocalPathProvisioner,
    persistent_volume,
    storage_class,
    volume_dir,
    wants_volume,
)


def claim(**changes) -> dict:
    body = {"metadata": {"name": "ckpt", "namespace": "team-a", "uid": "u-1",
                         "annotations": {SELECTED_NODE: "node-0"}},
            "spec": {"storageClassName": STORAGE_CLASS, "accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": "2Gi"}}},
            "status": {"phase": "Pending"}}
    for key, value in changes.items():
        section, _, field = key.partition("__")
        body[section][field] = value
    return body


def test_the_class_is_the_default_and_waits_for_the_first_consumer():
    sc = storage_class()
    assert sc["metadata"]["annotations"]["storageclass.kubernetes.io/is-default-class"] == "true"
    assert (sc["volumeBindingMode"], sc["reclaimPolicy"], sc["provisioner"]) == \
        ("WaitForFirstConsumer", "Delete", PROVISIONER)


def test_a_placed_claim_gets_a_local_volume_pinned_to_its_node():
    volume = persistent_volume(claim(), "node-0")
    spec = volume["spec"]
    assert volume["metadata"]["name"] == "pvc-u-1"
    assert spec["claimRef"] == {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": "team-a",
                                "name": "ckpt", "uid": "u-1"}
    assert spec["local"] == {"path": "/var/local-path-provisioner/pvc-u-1_team-a_ckpt"}
    assert spec["capacity"] == {"storage": "2Gi"} and spec["accessModes"] == ["ReadWriteOnce"]
    [term] = spec["nodeAffinity"]["required"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-0"]}]
    assert spec["persistentVolumeReclaimPolicy"] == "Delete" and spec["storageClassName"] == STORAGE_CLASS


def test_only_pending_placed_claims_of_the_class_want_a_volume():
    assert wants_volume(claim()) == "node-0"
    assert wants_volume(claim(status__phase="Bound")) is None
    assert wants_volume(claim(spec__storageClassName="fast")) is None
    assert wants_volume(claim(metadata__annotations={})) is None  # not scheduled yet
    assert wants_volume(claim(spec__volumeName="pvc-u-1")) is None


def test_provisioning_makes_a_writable_directory_in_the_nodes_var(tmp_path):
    created = []

    class Provisioner(LocalPathProvisioner):
        def _request(self, method, url_path, body, *, exists_ok=False):
            created.append((method, url_path, body))
            return {}

    roots = {"node-0": tmp_path / "node-0"}
    provisioner = Provisioner(None, roots.get)  # type: ignore[arg-type]
    provisioner._provision(claim(), "node-0")
    directory = tmp_path / "node-0" / volume_dir(claim()).lstrip("/")
    assert directory.is_dir() and directory.stat().st_mode & 0o777 == 0o777
    assert [(m, p) for m, p, _ in created] == [("POST", "/api/v1/persistentvolumes")]
    provisioner._provision(claim(), "elsewhere")  # a node the dev cluster does not have
    assert "node elsewhere is not one of the dev cluster's" in provisioner.errors[-1]
    provisioner._delete(created[0][2])
    assert not directory.exists() and created[-1][0] == "DELETE"


def test_a_sync_pass_provisions_waiting_claims_and_deletes_released_volumes(tmp_path):
    requests = []
    released = persistent_volume(claim(metadata__uid="u-2"), "node-0") | {"status": {"phase": "Released"}}
    listed = {"/api/v1/persistentvolumeclaims": {"items": [claim(), claim(status__phase="Bound")]},
              "/api/v1/persistentvolumes": {"items": [released]}}

    class Provisioner(LocalPathProvisioner):
        def _request(self, *args, **kwargs):
            # every call must fit the real method's signature (a GET passes no body)
            bound = inspect.signature(LocalPathProvisioner._request).bind(self, *args, **kwargs)
            method, url_path = bound.arguments["method"], bound.arguments["url_path"]
            requests.append((method, url_path))
            return listed.get(url_path, {}) if method == "GET" else {}

    Provisioner(None, {"node-0": tmp_path}.get).sync()  # type: ignore[arg-type]
    assert ("POST", "/api/v1/persistentvolumes") in requests  # the Pending, placed claim
    assert requests.count(("POST", "/api/v1/persistentvolumes")) == 1  # not the Bound one
    assert ("DELETE", "/api/v1/persistentvolumes/pvc-u-2") in requests
