"""The operator against a hostile tenant (issue 29), over an in-memory API: a decompression bomb in
a plan ConfigMap, overrides Pod Security `restricted` would refuse, forged ConfigMaps, and a job
that breaks its own reconcile. Each is refused with a condition (and an Event) naming the field,
and never reaches the operator's memory or its other jobs."""

from __future__ import annotations

import base64
import copy
import gzip
import tracemalloc
import zlib

import pytest
import yaml
from kareus_operator.metrics import OperatorMetrics
from kareus_operator.reconcile import Reconciler, plan_text
from kareus_operator.settings import Settings

from kareus.compressed import MAX_PLAN_BYTES, DecompressError, gunzip
from kareus.override_policy import OverridePolicy, check_overrides, load_override_policy
from kareus.policy import PolicyError, load_policy
from kareus.spec import parse_job

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
