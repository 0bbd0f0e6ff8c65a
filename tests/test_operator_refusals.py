"""Refusals are visible and children are adopted by UID only — on the real API server and admission.

Each case makes the real admission chain refuse a child's pods (no ServiceAccount, a ResourceQuota,
a Pod Security level), which the Job controller reports only as FailedCreate Events: the job must
show a False condition naming the cause and an Event carrying the API server's message within
30 s, and go on by itself once the cause is fixed (the Job controller retries the pods). A job deleted and
re-created under the same name while the old children linger (their deletion blocked by a
finalizer) must never use them.
"""

from __future__ import annotations

import pytest
from kube_helpers import read_or_none, wait_until
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from operator_fakes import conditions, fake_manifest, settings_env

GROUP, VERSION, PLURAL = "kareus.dev", "v1alpha1", "kareusjobs"
NAMESPACES = ["no-sa", "quota", "psa", "stale", "open"]
BLOCK = "kareus.dev/test-block"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def api(dev_cluster, tmp_path_factory):
    objects = dev_cluster.install_operator("refuse", "refuse-system", watch_namespaces=NAMESPACES,
                                           settings=settings_env(tmp_path_factory.mktemp("fakes")))
    api_client = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    yield client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)
    dev_cluster.uninstall(objects)


def submit(jobs: client.CustomObjectsApi, namespace: str, name: str = "job", overrides: list | None = None) -> dict:
    job = fake_manifest()
    if namespace == "psa":  # restricted: no hostPath, so none of the fakes' shared state (these jobs use none)
        del job["spec"]["podTemplateOverrides"]
    job["metadata"] = {"name": name, "namespace": namespace}
    del job["spec"]["training"]["command"]  # the fake train command
    if overrides:
        job["spec"]["podTemplateOverrides"] = overrides
        job["spec"]["profiling"] = {"reuse": False}  # the overridden profiling pod must run
    return jobs.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)


def wait_job(jobs: client.CustomObjectsApi, namespace: str, check, name: str = "job", timeout_s: float = 90.0) -> dict:
    return wait_until(lambda: read_or_none(lambda: jobs.get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name)), check, timeout_s=timeout_s, what=f"KareusJob {namespace}/{name}",
        interval_s=0.3)


def refused_with(reason: str):
    return lambda job: job is not None and conditions(job).get("Profiled") == ("False", reason)


def succeeded(job: dict | None) -> bool:
    return job is not None and (job.get("status") or {}).get("phase") == "Succeeded"


def warning_events(core: client.CoreV1Api, namespace: str, reason: str) -> list[str]:
    return [e.message for e in core.list_namespaced_event(namespace).items
            if e.involved_object.kind == "KareusJob" and e.reason == reason and e.type == "Warning"]


def assert_refused(core, jobs, namespace: str, reason: str, server_words: str) -> None:
    job = wait_job(jobs, namespace, refused_with(reason), timeout_s=30)  # the bound on being told
    message = next(c["message"] for c in job["status"]["conditions"] if c["type"] == "Profiled")
    assert server_words in message, message
    events = wait_until(lambda: warning_events(core, namespace, reason), bool, timeout_s=30, what=f"a {reason} Event")
    assert server_words in events[0]


def test_a_missing_service_account_is_reported_and_fixing_it_resumes(api):
    core, jobs = api
    core.delete_namespaced_service_account("kareus-worker", "no-sa")
    submit(jobs, "no-sa")
    assert_refused(core, jobs, "no-sa", "ServiceAccountMissing", 'serviceaccount "kareus-worker" not found')
    core.create_namespaced_service_account("no-sa", {"metadata": {"name": "kareus-worker"}})
    assert succeeded(wait_job(jobs, "no-sa", succeeded))


def quota_in_force(core: client.CoreV1Api, namespace: str) -> bool:
    """Whether the API server's quota admission refuses a pod now (a dry run: nothing is created).

    A new ResourceQuota is not enforced at once: admission reads quotas from an informer and, while
    that has none for the namespace, from a live list it caches for 30 s, so a pod created right
    after the quota can still be admitted (seen once under load: the profiling pod ran)."""
    probe = {"metadata": {"generateName": "quota-probe-"},
             "spec": {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                      "containers": [{"name": "probe", "image": "localhost/kareus/runtime:0.1.0", "securityContext": {
                          "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}]}}
    try:
        core.create_namespaced_pod(namespace, probe, dry_run="All")
    except ApiException as error:
        return error.status == 403 and "exceeded quota" in (error.body or "")
    return False


def test_a_resource_quota_is_reported_and_lifting_it_resumes(api):
    core, jobs = api
    core.create_namespaced_resource_quota("quota", {"metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}})
    wait_until(lambda: quota_in_force(core, "quota"), bool, timeout_s=60, what="the no-pods quota in force")
    submit(jobs, "quota")
    assert_refused(core, jobs, "quota", "QuotaExceeded", "exceeded quota: no-pods")
    core.delete_namespaced_resource_quota("no-pods", "quota")
    assert succeeded(wait_job(jobs, "quota", succeeded))


def test_pod_security_restricted_admits_the_workers_and_rejects_a_hostpath_override(api):
    core, jobs = api
    core.patch_namespace("psa", {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
    submit(jobs, "psa", "plain")
    assert succeeded(wait_job(jobs, "psa", succeeded, name="plain"))  # every phase's pods pass `restricted`
    submit(jobs, "psa", overrides=[{"roles": ["profile"], "spec": {
        "volumes": [{"name": "host", "hostPath": {"path": "/var/run"}}],
        "volumeMounts": [{"name": "host", "mountPath": "/host"}]}}])
    assert_refused(core, jobs, "psa", "PodSecurityRejected", 'violates PodSecurity "restricted:latest"')
    core.patch_namespace("psa", {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "privileged"}}})
    assert succeeded(wait_job(jobs, "psa", succeeded))


def test_the_operator_refuses_an_override_volume_the_policy_does_not_allow_in_any_namespace(api):
    """Issue 29: the operator's own check, before any pod is asked for, whatever the namespace's Pod
    Security label ("open" has none): nfs is outside Pod Security restricted's volume types and the
    dev cluster's policy adds only hostPath (the fakes' shared directory)."""
    core, jobs = api
    submit(jobs, "open", overrides=[{"roles": ["profile"], "spec": {
        "volumes": [{"name": "share", "nfs": {"server": "10.0.0.1", "path": "/"}}],
        "volumeMounts": [{"name": "share", "mountPath": "/share"}]}}])
    job = wait_job(jobs, "open", refused_with("OverrideRefused"), timeout_s=30)
    message = next(c["message"] for c in job["status"]["conditions"] if c["type"] == "Profiled")
    assert "spec.podTemplateOverrides[0].spec.volumes[0].nfs: volume type nfs is not allowed" in message, message
    events = wait_until(lambda: warning_events(core, "open", "OverrideRefused"), bool, timeout_s=30,
                        what="an OverrideRefused Event")
    assert "volume type nfs is not allowed" in events[0]
    assert core.list_namespaced_pod("open", label_selector="kareus.dev/job-name=job").items == []
    assert read_or_none(lambda: client.BatchV1Api(core.api_client).read_namespaced_job("job-profile", "open")) is None


def test_a_recreated_job_never_uses_the_old_jobs_children(api):
    core, jobs = api
    old = submit(jobs, "stale", "same")
    wait_job(jobs, "stale", succeeded, name="same")
    old_plan = core.read_namespaced_config_map("same-plan", "stale")
    core.patch_namespaced_config_map("same-plan", "stale", {"metadata": {"finalizers": [BLOCK]}})  # GC cannot finish
    jobs.delete_namespaced_custom_object(GROUP, VERSION, "stale", PLURAL, "same")
    wait_job(jobs, "stale", lambda job: job is None, name="same")
    new = submit(jobs, "stale", "same")
    assert new["metadata"]["uid"] != old["metadata"]["uid"]

    waiting = wait_job(jobs, "stale", lambda job: job is not None and (conditions(job).get("Planned") or ("",))[0]
                       == "False" and conditions(job)["Planned"][1] == "StaleChild", name="same", timeout_s=60)
    assert old["metadata"]["uid"] in next(c["message"] for c in waiting["status"]["conditions"] if c["type"] == "Planned")
    lingering = core.read_namespaced_config_map("same-plan", "stale")
    assert lingering.metadata.uid == old_plan.metadata.uid and lingering.metadata.deletion_timestamp is not None

    core.patch_namespaced_config_map("same-plan", "stale", {"metadata": {"finalizers": None}})
    done = wait_job(jobs, "stale", succeeded, name="same")
    plan = core.read_namespaced_config_map("same-plan", "stale")
    assert plan.metadata.uid != old_plan.metadata.uid
    assert [o.uid for o in plan.metadata.owner_references] == [new["metadata"]["uid"]]
    assert done["status"]["plan"]["configMap"] == "same-plan"
    train = client.BatchV1Api(core.api_client).read_namespaced_job("same-train", "stale")
    assert [o.uid for o in train.metadata.owner_references] == [new["metadata"]["uid"]]
