"""Kueue, for real: the Kueue controller (built from sigs.k8s.io/kueue) admits the operator's child
Jobs through its batch/v1 integration, on the session's control plane and emulated GPU node.

A ClusterQueue with quota for one job's GPUs: of two queued KareusJobs the second is held — its
child Job suspended, not one of its pods created — until the first finishes, then runs to the end.
A higher-priority job preempts a running one: Kueue evicts its Workload, the training Job is
suspended whole (every pod stopped), and when the quota is free again the same Job resumes whole.
"""

from __future__ import annotations

import pytest
import yaml
from kareus_devcluster.kueue import API, quota_objects
from kube_helpers import read_or_none, wait_until
from kubernetes import client, config
from operator_fakes import conditions, fake_manifest, settings_env

GROUP, VERSION, PLURAL = "kareus.dev", "v1alpha1", "kareusjobs"
NAMESPACE = "queued"
QUEUE = "gpus"
GPUS_PER_JOB = 2  # the tests' small job (tests/data/tiny-tp2.yaml): one pod of 2 GPUs

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def api(dev_cluster, kueue, tmp_path_factory):
    objects = dev_cluster.install_operator("queue", "queue-system", watch_namespaces=[NAMESPACE],
                                           settings=settings_env(tmp_path_factory.mktemp("fakes"), step_s=0.5, steps=16))
    dev_cluster.kubectl("apply", "--server-side", "--field-manager=test", "-f", "-", input=yaml.safe_dump_all([
        *quota_objects(QUEUE, GPUS_PER_JOB, [NAMESPACE]),
        {"apiVersion": API, "kind": "WorkloadPriorityClass", "metadata": {"name": "urgent"}, "value": 1000},
        {"apiVersion": API, "kind": "WorkloadPriorityClass", "metadata": {"name": "batch"}, "value": 10}]))
    api_client = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    yield client.CoreV1Api(api_client), client.BatchV1Api(api_client), client.CustomObjectsApi(api_client)
    dev_cluster.uninstall(objects)


def submit(jobs: client.CustomObjectsApi, name: str, priority: str = "batch") -> dict:
    job = fake_manifest()
    job["metadata"] = {"name": name, "namespace": NAMESPACE,
                       "labels": {"kueue.x-k8s.io/queue-name": QUEUE, "kueue.x-k8s.io/priority-class": priority}}
    del job["spec"]["training"]["command"]  # the fake train command
    job["spec"]["profiling"] = {"reuse": False}  # every job's profiling Job takes the quota too
    return jobs.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, job)


def kareus_job(jobs: client.CustomObjectsApi, name: str) -> dict | None:
    return read_or_none(lambda: jobs.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name))


def wait_job(jobs, name: str, check, timeout_s: float = 180.0) -> dict:
    return wait_until(lambda: kareus_job(jobs, name), check, timeout_s=timeout_s, what=f"KareusJob {name}",
                      interval_s=0.3)


def phase(*phases: str):
    return lambda job: job is not None and (job.get("status") or {}).get("phase") in phases


def pods_of(core: client.CoreV1Api, name: str) -> list:
    return core.list_namespaced_pod(NAMESPACE, label_selector=f"kareus.dev/job-name={name}").items


def children(batch: client.BatchV1Api, name: str) -> list:
    return batch.list_namespaced_job(NAMESPACE, label_selector=f"kareus.dev/job-name={name}").items


def test_the_second_job_waits_for_quota_then_runs(api):
    core, batch, jobs = api
    submit(jobs, "first")
    # Kueue admits each phase Job on its own: the second job is submitted once the first's training
    # gang holds the quota (between the first's phases, the second's profiling could be admitted).
    wait_job(jobs, "first", lambda job: job is not None and (job.get("status") or {}).get("workers", {}).get("ready"))
    submit(jobs, "second")
    held = wait_job(jobs, "second", lambda job: job is not None and
                    conditions(job).get("Suspended") == ("True", "Queued"))
    assert held["status"]["phase"] == "Suspended" and held["status"]["resumePhase"] in ("Pending", "Profiling")
    # While the first job holds the quota, the second's child is suspended and has no pod at all.
    while (kareus_job(jobs, "first")["status"]["phase"]) not in ("Succeeded", "Failed"):
        [child] = children(batch, "second")
        assert child.spec.suspend is True and child.metadata.labels["kueue.x-k8s.io/queue-name"] == QUEUE
        assert pods_of(core, "second") == []
        wait_until(lambda: None, lambda _: True, timeout_s=1, what="a second", interval_s=0.5)
    assert kareus_job(jobs, "first")["status"]["phase"] == "Succeeded"
    done = wait_job(jobs, "second", phase("Succeeded", "Failed"))
    assert done["status"]["phase"] == "Succeeded"
    assert conditions(done)["Suspended"][0] == "False"
    assert float(done["status"]["suspendedSeconds"]) > 0  # the time it waited, which a deadline excludes
    workloads = jobs.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", NAMESPACE, "workloads")["items"]
    admitted = {w["metadata"]["labels"].get("kueue.x-k8s.io/job-uid") for w in workloads
                if any(c["type"] == "Admitted" and c["status"] == "True" for c in w["status"].get("conditions", []))}
    assert {c.metadata.uid for c in children(batch, "second")} <= admitted  # Kueue, not the operator, let it run


def test_a_preempted_training_job_is_suspended_whole_and_resumes_whole(api):
    core, batch, jobs = api
    submit(jobs, "low")
    wait_job(jobs, "low", lambda job: job is not None and (job.get("status") or {}).get("workers", {}).get("ready"))
    [train] = [c for c in children(batch, "low") if c.metadata.labels["kareus.dev/role"] == "train"]
    submit(jobs, "high", priority="urgent")
    preempted = wait_job(jobs, "low", lambda job: job is not None and
                         conditions(job).get("Suspended") == ("True", "Queued"), timeout_s=120)
    assert preempted["status"]["resumePhase"] == "Training"
    wait_until(lambda: pods_of(core, "low"), lambda pods: all(p.status.phase in ("Succeeded", "Failed") for p in pods)
               or not pods, timeout_s=60, what="low's pods stopped")
    assert batch.read_namespaced_job(train.metadata.name, NAMESPACE).spec.suspend is True  # whole gang
    assert wait_job(jobs, "high", phase("Succeeded", "Failed"))["status"]["phase"] == "Succeeded"
    resumed = wait_job(jobs, "low", phase("Succeeded", "Failed"))
    assert resumed["status"]["phase"] == "Succeeded"
    assert batch.read_namespaced_job(train.metadata.name, NAMESPACE).metadata.uid == train.metadata.uid  # same Job
    assert int(resumed["status"].get("restarts", 0)) == 0  # a preemption is not a failure
