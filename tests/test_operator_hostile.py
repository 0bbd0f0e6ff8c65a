"""The operator against a hostile tenant (issue 29), over an in-memory API: a decompression bomb in
a plan ConfigMap, overrides Pod Security `restricted` would refuse, forged ConfigMaps, and a job
that breaks its own reconcile. Each is refused with a condition (and an Event) naming the field,
and never reaches the operator's memory or its other jobs."""

from __future__ import annotations

import asyncio
import base64
import copy
import gzip
import json
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import pytest
import yaml
from kareus_operator.metrics import OperatorMetrics
from kareus_operator.reconcile import Reconciler, plan_text
from kareus_operator.settings import Settings

from kareus.compressed import MAX_PLAN_BYTES, DecompressError, gunzip
from kareus.errors import KareusError
from kareus.override_policy import OverridePolicy, check_overrides, load_override_policy
from kareus.policy import PolicyError, load_policy
from kareus.spec import SpecError, parse_job
from kareus.spec.parse import MAX_MICROBATCH_TOKENS, MAX_NESTING_DEPTH, MAX_STAGE_MICROBATCHES, too_deep

ROOT = Path(__file__).resolve().parents[1]
NS = "team"
JOBS = f"/apis/kareus.dev/v1alpha1/namespaces/{NS}/kareusjobs"
CMS = f"/api/v1/namespaces/{NS}/configmaps"
POLICY_CM = "/api/v1/namespaces/kareus-system/configmaps/kareus-policy"


class MemoryKube:
    """get/list/create/merge_patch/delete over a dict of objects by path, as `Kube` answers them."""

    def __init__(self) -> None:
        self.objects: dict[str, dict] = {}
        self.version = 0
        self.created: list[str] = []

    def put(self, url: str, body: dict) -> None:
        self.version += 1
        body.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        self.objects[url] = body

    async def get(self, url: str):
        return copy.deepcopy(self.objects.get(url))

    async def list(self, url: str, label_selector=None, **_):
        return [copy.deepcopy(o) for u, o in self.objects.items() if u.rsplit("/", 1)[0] == url]

    async def create(self, collection: str, body):
        url = f"{collection}/{body['metadata']['name']}"
        if url in self.objects:
            return copy.deepcopy(self.objects[url]), False
        body = copy.deepcopy(dict(body))
        body["metadata"].setdefault("uid", f"uid-{body['metadata']['name']}")
        self.put(url, body)
        self.created.append(url)
        return copy.deepcopy(body), True

    async def merge_patch(self, url: str, patch):
        url = url.removesuffix("/status")  # the status subresource: the same object, its status patched
        body = self.objects[url]
        for key, value in patch.items():
            body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
        self.put(url, body)
        return copy.deepcopy(body)

    async def delete(self, url: str, **_):
        return self.objects.pop(url, None) is not None


def job_manifest(name: str = "a", overrides: list | None = None) -> dict:
    spec = {"model": {"preset": "tiny"}, "sequenceLength": 64,
            "parallelism": {"tensor": 2, "pipeline": 1, "context": 1, "data": 1, "microBatchSize": 4,
                            "numMicroBatches": 2},
            "training": {"image": "x", "steps": 10, "gpusPerNode": 2, "nodes": 1},
            "gpu": {"product": "A100-SXM4-40GB"}, "profiling": {"backend": "sim", "reuse": False},
            "objective": {"maxThroughput": {}}}
    if overrides is not None:
        spec["podTemplateOverrides"] = overrides
    return {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-job-{name}", "generation": 1,
                         "creationTimestamp": "2025-01-01T00:00:00Z"},
            "spec": spec}


def reconciler(kube: MemoryKube, policy: dict | None = None) -> Reconciler:
    if policy is not None:
        kube.put(POLICY_CM, {"metadata": {"name": "kareus-policy"}, "data": {"policy.yaml": yaml.safe_dump(policy)}})
    return Reconciler(kube, Settings(), OperatorMetrics())


def condition(status: dict, type_: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == type_)


def bomb(expanded_bytes: int) -> bytes:
    """A gzip stream of `expanded_bytes` spaces, built a MiB at a time (~1000:1)."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    chunk = b" " * (1 << 20)
    parts = [deflate.compress(chunk) for _ in range(expanded_bytes >> 20)]
    return b"".join(parts) + deflate.compress(b" " * (expanded_bytes % (1 << 20))) + deflate.flush()


# ------------------------------------------------------------------ item 1: capped decompression


def test_gunzip_refuses_a_bomb_without_expanding_it():
    packed = bomb(256 << 20)  # 256 MiB of spaces in ~250 KiB, as a tenant's pod could write
    assert len(packed) < (1 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(DecompressError, match="expands past the 32 MiB cap"):
            gunzip(packed, max_bytes=MAX_PLAN_BYTES, what="plan.json.gz")
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 3 * MAX_PLAN_BYTES  # bounded by the cap (and zlib's buffer), not by the stream
    assert gunzip(gzip.compress(b"{}"), max_bytes=2, what="x") == b"{}"
    with pytest.raises(DecompressError, match="truncated"):
        gunzip(gzip.compress(b"{}" * 100)[:-9], max_bytes=1000, what="x")
    with pytest.raises(DecompressError, match="bytes after its end"):  # no second member past the cap
        gunzip(gzip.compress(b"{}") + gzip.compress(b"{}"), max_bytes=1000, what="x")


def test_plan_text_and_plan_loads_refuse_a_bomb():
    packed = base64.b64encode(bomb(MAX_PLAN_BYTES + 1)).decode()
    cm = {"metadata": {"name": "a-plan"}, "binaryData": {"plan.json.gz": packed}}
    with pytest.raises(DecompressError, match=r"ConfigMap a-plan binaryData.plan.json.gz: expands past"):
        plan_text(cm)
    from kareus.plan import Plan, PlanError

    with pytest.raises(PlanError, match="expands past"):
        Plan.loads(bomb(MAX_PLAN_BYTES + 1), source="the mounted plan.json.gz")


async def test_a_bomb_plan_fails_its_job_with_a_condition_and_the_operator_lives():
    kube = MemoryKube()
    job = job_manifest()
    job["status"] = {"conditions": [{"type": "Profiled", "status": "True", "reason": "Measured", "message": "",
                                     "lastTransitionTime": "2025-01-01T00:00:00Z"}],
                     "profile": {"key": "k", "configMap": "kareus-profile-k"}}
    kube.put(f"{JOBS}/a", job)
    kube.put(f"{CMS}/a-plan", {"metadata": {"name": "a-plan", "namespace": NS, "labels": {
        "kareus.dev/job-name": "a", "kareus.dev/job-uid": "uid-job-a"},
        "ownerReferences": [{"uid": "uid-job-a", "controller": True, "kind": "KareusJob", "name": "a"}]},
        "binaryData": {"plan.json.gz": base64.b64encode(bomb(MAX_PLAN_BYTES + 1)).decode()}})
    outcome = await reconciler(kube).reconcile(await kube.get(f"{JOBS}/a"), now=1.0e9)
    failed = condition(outcome.status, "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "InvalidPlan")
    assert "a-plan binaryData.plan.json.gz: expands past the 32 MiB cap" in failed["message"]


# ------------------------------------------------------------------ item 7: overrides


HOST_PATH = [{"roles": ["profile"], "spec": {"volumes": [{"name": "host", "hostPath": {"path": "/"}}],
                                             "volumeMounts": [{"name": "host", "mountPath": "/host"}]}}]


def overrides_of(overrides: list):
    return parse_job(job_manifest(overrides=overrides)).spec.pod_overrides


def test_restricted_defaults_refuse_what_the_review_got_through():
    hostile = overrides_of([{"roles": ["profile", "optimize", "train"], "spec": {
        "volumes": [{"name": "root", "hostPath": {"path": "/"}}, {"name": "nfs", "nfs": {"server": "x", "path": "/"}},
                    {"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}}],
        "priorityClassName": "system-node-critical",
        "tolerations": [{"operator": "Exists"}, {"key": "dedicated", "operator": "Exists"}],
        "env": [{"name": "LD_PRELOAD", "value": "/x.so"}, {"name": "PYTHONPATH", "value": "/evil"},
                {"name": "KAREUS_NODE_ADDRESS", "value": "10.0.0.1"}, {"name": "HF_HOME", "value": "/data"}]},
        "metadata": {"annotations": {"container.apparmor.security.beta.kubernetes.io/kareus": "unconfined"}}}])
    refusals = check_overrides(OverridePolicy(), hostile)
    fields = [r.field for r in refusals]
    at = "spec.podTemplateOverrides[0]"
    assert fields == [f"{at}.spec.volumes[0].hostPath", f"{at}.spec.volumes[1].nfs", f"{at}.spec.priorityClassName",
                      f"{at}.spec.tolerations[0]", f"{at}.spec.env[0].name", f"{at}.spec.env[1].name",
                      f"{at}.spec.env[2].name",
                      f"{at}.metadata.annotations.container.apparmor.security.beta.kubernetes.io/kareus"]
    assert [r.rule for r in refusals][:5] == ["volumeTypes", "volumeTypes", "priorityClassNames", "tolerationKeys",
                                              "deniedEnvNames"]
    assert refusals[6].rule == "deniedEnvPrefixes"
    assert "volume type hostPath is not allowed" in refusals[0].text()
    # What the docs' example asks for passes: a PVC, a named toleration, a plain PriorityClass, HF_HOME.
    assert check_overrides(OverridePolicy(), overrides_of([{"roles": ["train"], "spec": {
        "priorityClassName": "training", "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml"}],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}}],
        "env": [{"name": "HF_HOME", "value": "/data/hf"}]}}])) == []


def test_no_mount_over_the_code_or_the_inputs_of_the_operators_own_pods():
    """Issue 29 item 6: the optimize pod's plan is what the power allocator and the clock ceilings
    trust, so an override may not mount over its code (the venv in /opt/kareus) or its inputs."""
    from kareus_operator.settings import MOUNT_JOB, MOUNT_OUT, MOUNT_PROFILE

    site = "/opt/kareus/lib/python3.12/site-packages/kareus/optimizer"
    paths = [site, MOUNT_PROFILE, MOUNT_JOB, MOUNT_OUT, "/etc", "/var", "/", "/usr/local/lib", "/workspace",
             "/data/../opt/kareus", "/data", "/home/me/cache", "/var/cache/hf"]
    entry = {"volumes": [{"name": "v", "configMap": {"name": "forged"}}],
             "volumeMounts": [{"name": "v", "mountPath": p} for p in paths]}
    for roles in (["optimize"], ["profile"], ["profile", "optimize", "train"]):
        refusals = check_overrides(OverridePolicy(), overrides_of([{"roles": roles, "spec": entry}]))
        refused = [r.field.removeprefix("spec.podTemplateOverrides[0].spec.volumeMounts[") for r in refusals]
        assert refused == [f"{i}].mountPath" for i in range(10)], roles  # all but /data, /home/…, /var/cache/…
        assert refusals[0].rule == "none"
        assert f"{site!r} covers /opt: the " in refusals[0].message and "own image and command" in refusals[0].message
        assert refusals[1].text().startswith(f"spec.podTemplateOverrides[0].spec.volumeMounts[1].mountPath: "
                                             f"'{MOUNT_PROFILE}' covers /etc")
    # The training pod runs the tenant's own image anyway: its mounts are the tenant's business.
    assert check_overrides(OverridePolicy(), overrides_of([{"roles": ["train"], "spec": entry}])) == []


def test_policy_can_allow_what_restricted_refuses():
    policy = load_policy({"podTemplateOverrides": {"volumeTypes": ["hostPath", "emptyDir"],
                                                   "priorityClassNames": ["batch-high"],
                                                   "tolerationKeys": ["*"], "deniedEnvPrefixes": []}}).pod_overrides
    assert check_overrides(policy, overrides_of(HOST_PATH)) == []
    assert check_overrides(policy, overrides_of([{"roles": ["train"], "spec": {"tolerations": [{"operator": "Exists"}],
                                                                                "env": [{"name": "KAREUS_X"}]}}])) == []
    refused = check_overrides(policy, overrides_of([{"roles": ["train"], "spec": {"priorityClassName": "training"}}]))
    assert [r.message for r in refused] == ["'training' is not allowed; allowed: batch-high"]
    assert check_overrides(policy, overrides_of([{"roles": ["train"], "spec": {
        "volumes": [{"name": "s", "secret": {"secretName": "x"}}]}}]))[0].rule == "volumeTypes"
    with pytest.raises(PolicyError, match=r"policy.podTemplateOverrides.volumeType: unknown key"):
        load_policy({"podTemplateOverrides": {"volumeType": ["hostPath"]}})
    with pytest.raises(PolicyError, match=r"policy.podTemplateOverrides.volumeTypes: must be a list"):
        load_policy({"podTemplateOverrides": {"volumeTypes": "hostPath"}})
    assert load_override_policy(None) == OverridePolicy()


async def test_a_hostpath_override_is_refused_with_a_condition_and_an_event_in_any_namespace():
    kube = MemoryKube()
    kube.put(f"{JOBS}/a", job_manifest(overrides=HOST_PATH))
    rec = reconciler(kube)
    outcome = await rec.reconcile(await kube.get(f"{JOBS}/a"), now=1.0e9)
    profiled = condition(outcome.status, "Profiled")
    assert (profiled["status"], profiled["reason"]) == ("False", "OverrideRefused")
    assert profiled["message"].startswith("the operator refused Job a-profile: "
                                          "spec.podTemplateOverrides[0].spec.volumes[0].hostPath: volume type hostPath")
    assert [(t, r) for t, r, _ in outcome.events if r == "OverrideRefused"] == [("Warning", "OverrideRefused")]
    assert f"/apis/batch/v1/namespaces/{NS}/jobs/a-profile" not in kube.objects  # no pod was ever asked for
    assert outcome.requeue_s is not None  # retried: a fixed policy or spec lets the job go on
    kube.put(POLICY_CM, {"metadata": {"name": "kareus-policy"},
                         "data": {"policy.yaml": "podTemplateOverrides: {volumeTypes: [hostPath, configMap, emptyDir]}"}})
    rec._policy = None  # the policy's cache expired
    job = await kube.get(f"{JOBS}/a")
    job["status"] = outcome.status
    again = await rec.reconcile(job, now=1.0e9 + 5)
    assert condition(again.status, "Profiled")["reason"] != "OverrideRefused"
    assert f"/apis/batch/v1/namespaces/{NS}/jobs/a-profile" in kube.objects


# ------------------------------------------------------------------ item 8: deep nesting, one bad job


def deep_manifest(depth: int) -> str:
    """A job whose override affinity nests `depth` objects deep, as JSON (YAML's flow style)."""
    job = job_manifest(overrides=[{"roles": ["train"], "spec": {"affinity": "@@"}}])
    return json.dumps(job).replace('"@@"', '{"a": ' * depth + "{}" + "}" * depth)


@pytest.mark.parametrize("depth", [350, 1500])
def test_kareus_validate_refuses_deep_nesting_with_one_line(tmp_path, depth):
    path = tmp_path / "deep.yaml"
    path.write_text(deep_manifest(depth))
    result = subprocess.run([sys.executable, "-m", "kareus", "validate", str(path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "RecursionError" not in result.stderr + result.stdout
    assert f"more than {MAX_NESTING_DEPTH} deep" in result.stdout + result.stderr or \
        f"at most {MAX_NESTING_DEPTH} deep" in result.stdout + result.stderr


def test_the_depth_limit_holds_every_crd_field_and_names_the_path():
    crd = yaml.safe_load((ROOT / "crds" / "kareusjob.yaml").read_text())
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    deepest, stack = 0, [(root, 0)]
    while stack:
        schema, depth = stack.pop()
        depth += schema.get("type") in ("object", "array")
        deepest = max(deepest, depth)
        stack += [(s, depth) for s in (schema.get("properties") or {}).values()]
        stack += [(schema[k], depth) for k in ("items", "additionalProperties") if isinstance(schema.get(k), dict)]
    assert 12 <= deepest <= MAX_NESTING_DEPTH  # a real manifest at the CRD's deepest field passes
    assert too_deep(json.loads(deep_manifest(MAX_NESTING_DEPTH - 6)), MAX_NESTING_DEPTH) is None
    with pytest.raises(SpecError, match=r"spec.podTemplateOverrides\[0\].spec.affinity(.a)+: nests objects"):
        parse_job(json.loads(deep_manifest(100)))


class EventKube(MemoryKube):
    """MemoryKube that records posted Events and fails on chosen paths."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict] = []
        self.broken_lists: set[str] = set()

    async def request(self, method: str, url: str, body=None, **_):
        assert method == "POST" and url.endswith("/events")
        self.events.append(body)
        return body

    async def list(self, url: str, label_selector=None, **kwargs):
        if url in self.broken_lists:
            raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")
        return await super().list(url, label_selector, **kwargs)


async def test_a_job_that_breaks_its_reconcile_is_stalled_and_the_others_go_on(monkeypatch):
    from kareus_operator.handlers import Controller

    kube = EventKube()
    for name in ("bad", "good"):
        kube.put(f"{JOBS}/{name}", job_manifest(name))
    controller = Controller(kube, Settings(resync_s=600.0))
    real = controller.reconciler.reconcile

    async def reconcile(job, **kwargs):
        if job["metadata"]["name"] == "bad":
            raise RecursionError("maximum recursion depth exceeded while calling a Python object")
        return await real(job, **kwargs)

    monkeypatch.setattr(controller.reconciler, "reconcile", reconcile)
    await controller.reconcile(NS, "bad")
    await controller.reconcile(NS, "good")
    bad = kube.objects[f"{JOBS}/bad"]["status"]
    stalled = condition(bad, "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "ReconcileError")
    assert stalled["message"] == ("the operator could not reconcile this job: RecursionError: maximum recursion "
                                  "depth exceeded while calling a Python object")
    def stall_events() -> list:
        return [(e["type"], e["involvedObject"]["name"]) for e in kube.events if e["reason"] == "ReconcileError"]

    assert stall_events() == [("Warning", "bad")]
    assert ("team", "bad") in controller._wakeups  # tried again after a backoff
    assert condition(kube.objects[f"{JOBS}/good"]["status"], "Profiled")["reason"] == "Profiling"
    await controller.reconcile(NS, "bad")  # the same failure again: no second Event
    assert stall_events() == [("Warning", "bad")]
    monkeypatch.setattr(controller.reconciler, "reconcile", real)
    await controller.reconcile(NS, "bad")
    assert condition(kube.objects[f"{JOBS}/bad"]["status"], "Stalled")["status"] == "False"
    for handle in controller._wakeups.values():
        handle.cancel()


async def test_the_resync_outlives_a_list_it_cannot_decode():
    from kareus_operator.handlers import Controller

    kube = EventKube()
    kube.put("/apis/kareus.dev/v1alpha1/namespaces/other/kareusjobs/c", {**job_manifest("c"),
                                                                        "metadata": {"name": "c", "namespace": "other"}})
    kube.broken_lists.add(JOBS)
    controller = Controller(kube, Settings(resync_s=0.05))
    spawned: list = []
    controller._spawn = spawned.append
    task = asyncio.ensure_future(controller.resync_forever([NS, "other"]))
    await asyncio.sleep(0.3)
    assert not task.done()  # the bad namespace's LIST did not end the loop
    task.cancel()
    assert spawned.count(("other", "c")) >= 2  # and the other namespace's jobs were resynced, again and again


# ------------------------------------------------------------------ item 12: bounds on job size


def sized(pipeline: int, microbatches: int, sequence: int, microbatch_size: int) -> dict:
    job = job_manifest()
    job["spec"]["model"] = {"preset": "llama3.3-70b"}
    job["spec"]["sequenceLength"] = sequence
    job["spec"]["parallelism"] = {"tensor": 1, "pipeline": pipeline, "context": 1, "data": 1,
                                  "microBatchSize": microbatch_size, "numMicroBatches": microbatches}
    job["spec"]["training"].update(nodes=pipeline, gpusPerNode=1)
    return job


def test_the_reviewed_job_size_is_refused_at_both_fields():
    with pytest.raises(SpecError) as caught:
        parse_job(sized(64, 65536, 1 << 20, 4096))  # the review's PP1024 needs more layers than any preset
    messages = {e.path: e.message for e in caught.value.errors}
    assert messages["spec.parallelism.numMicroBatches"] == (
        f"pipeline × numMicroBatches must be at most {MAX_STAGE_MICROBATCHES} (the instructions one plan stores "
        "and the optimizer schedules), got 64 × 65536")
    assert messages["spec.parallelism.microBatchSize"].startswith(
        f"sequenceLength × microBatchSize must be at most {MAX_MICROBATCH_TOKENS} tokens per microbatch")
    parse_job(sized(16, MAX_STAGE_MICROBATCHES // 16, 8192, MAX_MICROBATCH_TOKENS // 8192))  # at the bounds


def test_a_plan_at_the_stage_microbatch_bound_is_stored_and_read_back_under_the_cap():
    from kareus_operator.reconcile import plan_data
    from test_plan_storage import big_plan

    from kareus.plan import Plan

    plan = big_plan(stages=16, microbatches=MAX_STAGE_MICROBATCHES // 16)
    text = plan.to_json()
    stored = plan_data(text)["binaryData"]["plan.json.gz"]
    print(f"plan at the bound: {len(text) / 1e6:.2f} MB of JSON, {len(stored) / 1e6:.3f} MB stored")
    assert len(text) < MAX_PLAN_BYTES / 2  # the cap leaves twice the room the largest admitted plan needs
    assert len(stored) < (1 << 20) * 0.9  # and it fits one ConfigMap
    assert plan_text({"metadata": {"name": "p"}, "binaryData": {"plan.json.gz": stored}}) == text
    assert Plan.loads(base64.b64decode(stored)) == plan


def test_optimize_pods_have_requests_and_a_memory_limit_by_default():
    from kareus_operator import manifests as mf

    job = job_manifest()
    spec = parse_job(job).spec
    pod = mf.optimize_job(job, spec, Settings(), "k")["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"},
                                                 "limits": {"memory": "16Gi"}}
    settings = Settings.from_env({"KAREUS_OPERATOR_OPTIMIZE_POD_CPU_REQUEST": "250m",
                                  "KAREUS_OPERATOR_OPTIMIZE_POD_MEMORY_LIMIT": "4Gi"})
    overridden = parse_job(job_manifest(overrides=[{"roles": ["optimize"], "spec": {
        "resources": {"limits": {"memory": "8Gi", "cpu": "2"}}}}])).spec
    pod = mf.optimize_job(job, overridden, settings, "k")["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "250m", "memory": "2Gi"},
                                                 "limits": {"memory": "8Gi", "cpu": "2"}}  # the job's override wins
    with pytest.raises(KareusError, match="KAREUS_OPERATOR_OPTIMIZE_POD_MEMORY_REQUEST: must be at most the limit"):
        Settings.from_env({"KAREUS_OPERATOR_OPTIMIZE_POD_MEMORY_REQUEST": "32Gi"})
    with pytest.raises(KareusError, match="KAREUS_OPERATOR_OPTIMIZE_POD_CPU_REQUEST: must be a positive CPU"):
        Settings.from_env({"KAREUS_OPERATOR_OPTIMIZE_POD_CPU_REQUEST": "lots"})


# ------------------------------------------------------------------ item 5: forged ConfigMaps


def planned_job(name: str = "b") -> dict:
    job = job_manifest(name)
    job["status"] = {"conditions": [{"type": "Profiled", "status": "True", "reason": "Measured", "message": "",
                                     "lastTransitionTime": "2025-01-01T00:00:00Z"}],
                     "profile": {"key": "k", "configMap": "kareus-profile-k"}}
    return job


async def test_a_plan_planted_by_another_jobs_pod_is_never_trusted():
    from kareus_operator.reconcile import plan_data
    from optimizer_fixtures import small_plan

    kube = MemoryKube()
    kube.put(f"{JOBS}/b", planned_job("b"))
    # What job A's pod could write before the admission policy pinned names and owners: B's name,
    # B's label and an ownerReference to B, but no job-uid label (the operator's alone).
    kube.put(f"{CMS}/b-plan", {"metadata": {"name": "b-plan", "namespace": NS, "labels": {"kareus.dev/job-name": "b"},
                                            "ownerReferences": [{"uid": "uid-job-b", "controller": True}]},
                               **plan_data(small_plan().to_json())})
    outcome = await reconciler(kube).reconcile(await kube.get(f"{JOBS}/b"), now=1.0e9)
    planned = condition(outcome.status, "Planned")
    assert (planned["status"], planned["reason"]) == ("False", "StaleChild")
    assert "plan" not in outcome.status  # its prediction never reached the status
    # The ConfigMap the operator creates before the optimize Job is the one it trusts.
    del kube.objects[f"{CMS}/b-plan"]
    outcome = await reconciler(kube).reconcile(await kube.get(f"{JOBS}/b"), now=1.0e9)
    created = kube.objects[f"{CMS}/b-plan"]["metadata"]
    assert created["labels"]["kareus.dev/job-uid"] == "uid-job-b" and created["ownerReferences"][0]["uid"] == "uid-job-b"
    assert f"/apis/batch/v1/namespaces/{NS}/jobs/b-optimize" in kube.objects


async def test_a_deleted_jobs_pods_cannot_write_into_a_new_job_of_the_same_name():
    """The admission policy ties a worker's writes to its job's name, so a pod of a deleted job
    that still runs (terminating: it checkpoints and publishes once more) could write into a new
    job of that name. The new job creates the ConfigMaps its pods fill only once no such pod runs,
    and a ConfigMap such a pod made meanwhile (no owner, no job-uid: the operator sets both) goes."""
    pods = f"/api/v1/namespaces/{NS}/pods"
    kube = MemoryKube()
    kube.put(f"{JOBS}/a", job_manifest("a"))
    old = {"metadata": {"name": "a-profile-old12", "namespace": NS, "uid": "pod-old",
                        "deletionTimestamp": "2025-01-01T00:00:00Z",
                        "labels": {"kareus.dev/job-name": "a", "kareus.dev/job-uid": "uid-old-a",
                                   "kareus.dev/role": "profile"},
                        "ownerReferences": [{"kind": "Job", "name": "a-profile", "uid": "uid-old-profile-job"}]},
           "status": {"phase": "Running"}}
    kube.put(f"{pods}/a-profile-old12", old)
    # What it published after its job's ConfigMap was garbage-collected: a-profile, labelled, unowned.
    stray = {"metadata": {"name": "a-profile", "namespace": NS, "labels": {"kareus.dev/job-name": "a"}},
             "data": {"profile.json": "{\"forged\": true}"}}
    kube.put(f"{CMS}/a-profile", copy.deepcopy(stray))
    outcome = await reconciler(kube).reconcile(await kube.get(f"{JOBS}/a"), now=1.0e9)
    profiled = condition(outcome.status, "Profiled")
    assert (profiled["status"], profiled["reason"]) == ("False", "StaleChild")
    assert profiled["message"] == ("Pod a-profile-old12 belongs to Job a-profile (uid uid-old-profile-job), not this "
                                   "job; waiting until it is gone (being deleted)")
    assert f"/apis/batch/v1/namespaces/{NS}/jobs/a-profile" not in kube.objects
    assert kube.objects[f"{CMS}/a-profile"]["data"] == stray["data"]  # untouched while the pod may write

    # Finished pods of the old job do not hold it up; once the live one is gone, the stray goes.
    kube.put(f"{pods}/a-profile-old12", {**old, "status": {"phase": "Succeeded"}})
    outcome = await reconciler(kube).reconcile(await kube.get(f"{JOBS}/a"), now=1.0e9)
    made = kube.objects[f"{CMS}/a-profile"]
    assert made["metadata"]["labels"]["kareus.dev/job-uid"] == "uid-job-a" and "data" not in made
    assert made["metadata"]["ownerReferences"][0]["uid"] == "uid-job-a"
    assert [(kind, reason) for kind, reason, _ in outcome.events if reason == "StaleChildRemoved"] == [
        ("Normal", "StaleChildRemoved")]
    assert f"/apis/batch/v1/namespaces/{NS}/jobs/a-profile" in kube.objects
    # A ConfigMap with an owner (an earlier job's, not yet collected) is still waited for, never deleted.
    kube.put(f"{JOBS}/b", job_manifest("b"))
    kube.put(f"{CMS}/b-profile", {"metadata": {"name": "b-profile", "namespace": NS, "labels": {
        "kareus.dev/job-name": "b", "kareus.dev/job-uid": "uid-old-b"}, "ownerReferences": [
        {"kind": "KareusJob", "name": "b", "uid": "uid-old-b", "controller": True}]}})
    outcome = await reconciler(kube).reconcile(await kube.get(f"{JOBS}/b"), now=1.0e9)
    assert condition(outcome.status, "Profiled")["reason"] == "StaleChild"
    assert kube.objects[f"{CMS}/b-profile"]["metadata"]["labels"]["kareus.dev/job-uid"] == "uid-old-b"


async def test_a_profile_cache_is_reused_only_once_the_operator_sealed_it():
    kube = MemoryKube()
    job = job_manifest("c")
    job["spec"]["profiling"]["reuse"] = True
    kube.put(f"{JOBS}/c", job)
    from kareus_operator import manifests as mf

    from kareus.profiler.key import profile_key

    key = profile_key(parse_job(job).spec)
    cache = f"{CMS}/{mf.profile_configmap_name(key)}"
    # A cache a worker wrote outside a profiling Job the operator saw succeed: not reused.
    kube.put(cache, {"metadata": {"name": mf.profile_configmap_name(key), "labels": {"kareus.dev/profile-key": key}},
                     "data": {"profile.json": "{}"}})
    outcome = await reconciler(kube).reconcile(await kube.get(f"{JOBS}/c"), now=1.0e9)
    assert condition(outcome.status, "Profiled")["reason"] != "CacheHit"
    profile_job = f"/apis/batch/v1/namespaces/{NS}/jobs/c-profile"
    assert profile_job in kube.objects  # it profiles instead
    # Its profiling pod publishes into the job's own ConfigMap (the operator created it, owned) and
    # the Job succeeds: the operator copies the measurement into the cache, sealed with this job's UID.
    measured = kube.objects[f"{CMS}/c-profile"]
    assert measured["metadata"]["labels"]["kareus.dev/job-uid"] == "uid-job-c"
    measured["data"] = {"profile.json": '{"measured": true}'}
    kube.objects[profile_job]["status"] = {"conditions": [{"type": "Complete", "status": "True"}], "succeeded": 1}
    job = await kube.get(f"{JOBS}/c")
    job["status"] = outcome.status
    outcome = await reconciler(kube).reconcile(job, now=1.0e9 + 1)
    assert condition(outcome.status, "Profiled")["reason"] == "Measured"
    assert kube.objects[cache]["metadata"]["labels"]["kareus.dev/job-uid"] == "uid-job-c"
    assert kube.objects[cache]["data"] == {"profile.json": '{"measured": true}'}  # the measurement, not the forgery
    # The next job with that key reuses the sealed cache.
    kube.put(f"{JOBS}/d", {**job_manifest("d"), "spec": {**job_manifest("d")["spec"],
                                                        "profiling": {"backend": "sim", "reuse": True}}})
    again = await reconciler(kube).reconcile(await kube.get(f"{JOBS}/d"), now=1.0e9 + 2)
    assert condition(again.status, "Profiled")["reason"] == "CacheHit"
