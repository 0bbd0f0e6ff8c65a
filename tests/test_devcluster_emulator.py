"""The dev cluster's API emulator behaves like an API server where an operator depends on it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import kmock
import pytest
import yaml
from kareus_operator.devcluster import patching
from kareus_operator.devcluster.cluster import DEFAULT_CRD, crd_validator
from kareus_operator.devcluster.emulator import CRD_RESOURCE, NAMESPACES, ApiEmulator
from kareus_operator.kube import ApiError, Credentials, Kube, path

JOBS = "/apis/kareus.dev/v1alpha1/namespaces/team-a/kareusjobs"
QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"


@pytest.fixture
async def api():
    emulator = ApiEmulator(custom_validator=crd_validator())
    async with emulator, kmock.Server(emulator) as server:
        emulator.resources.load_bundled()
        token = emulator.new_token()
        await emulator.create(NAMESPACES, None, {"metadata": {"name": "team-a"}})
        for doc in yaml.safe_load_all(DEFAULT_CRD.read_text()):
            if doc:
                await emulator.create(CRD_RESOURCE, None, doc)
        async with Kube(Credentials(server=str(server.url).rstrip("/"), token=token)) as kube:
            kube.emulator = emulator
            yield kube


def quickstart() -> dict:
    job = yaml.safe_load(QUICKSTART.read_text())
    job["metadata"]["namespace"] = "team-a"
    return job


async def test_identity_fields_and_bodies_on_create_and_patch(api):
    created, fresh = await api.create(path("v1", "configmaps", "team-a"), {"metadata": {"name": "c"}, "data": {"a": "1"}})
    assert fresh and created["metadata"]["uid"] and created["metadata"]["generation"] == 1
    rv1 = int(created["metadata"]["resourceVersion"])
    again, fresh = await api.create(path("v1", "configmaps", "team-a"), {"metadata": {"name": "c"}, "data": {"a": "2"}})
    assert not fresh and again["data"] == {"a": "1"}  # 409 → the existing object
    patched = await api.merge_patch(path("v1", "configmaps", "team-a", "c"), {"data": {"a": None, "b": "2"}})
    assert patched["data"] == {"b": "2"} and int(patched["metadata"]["resourceVersion"]) > rv1
    assert patched["metadata"]["uid"] == created["metadata"]["uid"] and patched["metadata"]["generation"] == 2
    same = await api.merge_patch(path("v1", "configmaps", "team-a", "c"), {"data": {"b": "2"}})
    assert same["metadata"]["resourceVersion"] == patched["metadata"]["resourceVersion"]  # no-op write


async def test_missing_namespace_and_authentication(api):
    with pytest.raises(ApiError) as error:
        await api.create(path("v1", "configmaps", "nowhere"), {"metadata": {"name": "c"}})
    assert error.value.code == 404 and "nowhere" in error.value.message
    async with Kube(Credentials(server=api.credentials.server, token="wrong")) as stranger:
        with pytest.raises(ApiError) as error:
            await stranger.list(path("v1", "configmaps", "team-a"))
    assert error.value.code == 401


async def test_crd_defaults_status_split_and_generation(api):
    job = quickstart()
    job["status"] = {"phase": "Succeeded"}
    created = await api.request("POST", JOBS, job)
    assert "status" not in created  # status is written only through the subresource
    assert created["spec"]["profiling"]["reuse"] is True  # a CRD default was applied
    url = f"{JOBS}/quickstart"
    after_status = await api.merge_patch(url + "/status", {"status": {"phase": "Profiling"}, "spec": {"suspend": True}})
    assert after_status["status"]["phase"] == "Profiling" and after_status["spec"].get("suspend") is not True
    assert after_status["metadata"]["generation"] == 1
    after_spec = await api.merge_patch(url, {"spec": {"suspend": True}, "status": {"phase": "Failed"}})
    assert after_spec["spec"]["suspend"] is True and after_spec["status"]["phase"] == "Profiling"
    assert after_spec["metadata"]["generation"] == 2
    pruned = await api.merge_patch(url + "/status", {"status": {"undeclared": 1, "restarts": 2}})
    assert "undeclared" not in pruned["status"] and pruned["status"]["restarts"] == 2


async def test_invalid_custom_objects_get_422_with_field_paths(api):
    job = quickstart()
    job["spec"]["parallelism"]["tensor"] = 0
    job["spec"]["objective"] = {"maxThroughput": {}, "energyBudget": {"perIterationJoules": 10}}
    with pytest.raises(ApiError) as error:
        await api.request("POST", JOBS, job)
    assert error.value.code == 422
    assert "spec.parallelism.tensor" in error.value.message and "objective" in error.value.message


async def test_json_patch_test_op_conflicts_with_422(api):
    created, _ = await api.create(path("v1", "configmaps", "team-a"), {"metadata": {"name": "j"}})
    url = path("v1", "configmaps", "team-a", "j")
    ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": created["metadata"]["resourceVersion"]},
           {"op": "add", "path": "/metadata/finalizers", "value": ["x/y"]}]
    body = await api.request("PATCH", url, ops, content_type="application/json-patch+json")
    assert body["metadata"]["finalizers"] == ["x/y"]
    with pytest.raises(ApiError) as error:  # the same test again: the version moved on
        await api.request("PATCH", url, ops, content_type="application/json-patch+json")
    assert error.value.code == 422


async def test_finalizers_and_owner_garbage_collection(api):
    owner = await api.request("POST", JOBS, quickstart())
    ref = {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob", "name": "quickstart",
           "uid": owner["metadata"]["uid"], "controller": True}
    await api.create(path("v1", "configmaps", "team-a"), {"metadata": {"name": "child", "ownerReferences": [ref]}})
    await api.create(path("v1", "pods", "team-a"), {"metadata": {"name": "kid", "ownerReferences": [ref]},
                                                    "spec": {"containers": [{"name": "c", "command": ["true"]}]}})
    await api.create(path("v1", "configmaps", "team-a"), {"metadata": {"name": "stranger"}})
    await api.merge_patch(f"{JOBS}/quickstart", {"metadata": {"finalizers": ["kareus.dev/finalizer"]}})
    await api.delete(f"{JOBS}/quickstart")
    held = await api.get(f"{JOBS}/quickstart")
    assert held["metadata"]["deletionTimestamp"]  # the finalizer holds it
    assert await api.get(path("v1", "configmaps", "team-a", "child")) is not None
    await api.merge_patch(f"{JOBS}/quickstart", {"metadata": {"finalizers": None}})
    assert await api.get(f"{JOBS}/quickstart") is None
    assert await api.get(path("v1", "configmaps", "team-a", "child")) is None
    assert await api.get(path("v1", "pods", "team-a", "kid")) is None
    assert await api.get(path("v1", "configmaps", "team-a", "stranger")) is not None


async def test_list_and_watch_with_selectors(api):
    for name, role in (("a", "x"), ("b", "y"), ("c", "x")):
        await api.create(path("v1", "configmaps", "team-a"), {"metadata": {"name": name, "labels": {"role": role}}})
    assert [o["metadata"]["name"] for o in await api.list(path("v1", "configmaps", "team-a"), "role=x")] == ["a", "c"]
    assert [o["metadata"]["name"] for o in await api.list(path("v1", "configmaps", "team-a"), "role notin (x)")] == ["b"]
    emulator = api.emulator
    events: list[tuple[str, str]] = []

    async def watch() -> None:
        stream = emulator.watch_events(kmock.resource("", "v1", "configmaps"), "team-a", {"labelSelector": "role=x"})
        async for event in stream:
            events.append((event["type"], event["object"]["metadata"]["name"]))
            if len(events) == 4:
                return

    task = asyncio.create_task(watch())
    await asyncio.sleep(0.05)
    await api.create(path("v1", "configmaps", "team-a"), {"metadata": {"name": "d", "labels": {"role": "x"}}})
    await api.create(path("v1", "configmaps", "team-a"), {"metadata": {"name": "e", "labels": {"role": "y"}}})
    await api.delete(path("v1", "configmaps", "team-a", "a"))
    await asyncio.wait_for(task, 5)
    assert events == [("ADDED", "a"), ("ADDED", "c"), ("ADDED", "d"), ("DELETED", "a")]


def test_patch_dialects_and_selector_parsing():
    assert patching.merge_patch({"a": {"b": 1, "c": [1]}}, {"a": {"b": None, "c": [2]}}) == {"a": {"c": [2]}}
    doc = patching.json_patch({"l": [1, 3]}, [{"op": "add", "path": "/l/1", "value": 2},
                                               {"op": "replace", "path": "/l/0", "value": 0}])
    assert doc == {"l": [0, 2, 3]}
    with pytest.raises(patching.PatchError):
        patching.json_patch({}, [{"op": "remove", "path": "/missing"}])
    selector = patching.parse_label_selector("app=x,tier in (a, b),!legacy")
    assert patching.labels_match(selector, {"app": "x", "tier": "b"})
    assert not patching.labels_match(selector, {"app": "x", "tier": "c"})
    assert not patching.labels_match(selector, {"app": "x", "tier": "a", "legacy": ""})
    assert patching.fields_match("metadata.name=n,status.phase!=Running", {"metadata": {"name": "n"}})
    assert json.dumps(patching.merge_patch(None, {"x": 1})) == '{"x": 1}'


async def test_kubectl_tables_use_the_crd_printer_columns(api):
    await api.request("POST", JOBS, quickstart())
    await api.merge_patch(f"{JOBS}/quickstart/status", {"status": {"phase": "Training", "objective": "maxThroughput"}})
    async with api._session.get(api.credentials.server + JOBS,
                                headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}) as response:
        table = await response.json()
    names = [c["name"] for c in table["columnDefinitions"]]
    assert table["kind"] == "Table" and names[:3] == ["Name", "Phase", "Objective"] and names[-1] == "Age"
    assert table["rows"][0]["cells"][:3] == ["quickstart", "Training", "maxThroughput"]
