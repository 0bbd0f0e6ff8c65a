"""Training that keeps its work, in the dev cluster (issue 27): a job with `spec.training.checkpoint`
whose training pod is deleted mid-run, or whose training Job Kueue preempts, resumes from its last
checkpoint on the claim and finishes with every step counted once.

The claim is a plain PersistentVolumeClaim without a storage class: the dev cluster's default class
(`kareus_devcluster.storage`, node-local volumes as kind's local-path-provisioner makes them) binds
it once the first training pod is scheduled. The phases are the operator fakes, which checkpoint as
the runtime lays checkpoints out (`step-N/kareus-checkpoint.json`, every `everySteps` and on SIGTERM)
and resume from the newest; every step any run executes is appended to the fakes' state directory.

How "energy is not double counted" is checked: each fake step reports 123 J, so a job of `STEPS`
steps must end with `status.measured.energyJoules` = 123 J × STEPS exactly, while the runs together
executed more than that (the first run's steps plus the second's). Without the progress ledger the
operator showed only the last pod's steps: (STEPS − resumedFromStep) iterations and their energy.
"""

from __future__ import annotations

import pytest
import yaml
from kareus_devcluster.kueue import API, quota_objects
from kube_helpers import PodRecorder, read_or_none, wait_until
from kubernetes import client, config
from operator_fakes import STEP_ENERGY_J, conditions, fake_manifest, settings_env

GROUP, VERSION, PLURAL = "kareus.dev", "v1alpha1", "kareusjobs"
NS, RELEASE = "ckpt", "ckpt"
CLAIM = "checkpoints"
QUEUE = "ckpt-gpus"
STEPS, EVERY = 24, 4
STEP_S = 0.4
GPUS_PER_JOB = 2  # tests/data/tiny-tp2.yaml: one pod of 2 GPUs

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def api(dev_cluster, kueue, tmp_path_factory):
    state = tmp_path_factory.mktemp("fakes")
    objects = dev_cluster.install_operator(RELEASE, f"{RELEASE}-system", watch_namespaces=[NS],
                                           settings=settings_env(state, step_s=STEP_S, steps=STEPS))
    dev_cluster.kubectl("apply", "--server-side", "--field-manager=test", "-f", "-", input=yaml.safe_dump_all([
        *quota_objects(QUEUE, GPUS_PER_JOB, [NS]),
        {"apiVersion": API, "kind": "WorkloadPriorityClass", "metadata": {"name": "ckpt-urgent"}, "value": 1000},
        {"apiVersion": API, "kind": "WorkloadPriorityClass", "metadata": {"name": "ckpt-batch"}, "value": 10},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM, "namespace": NS},
         "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}]))
    api_client = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    yield client.CoreV1Api(api_client), client.CustomObjectsApi(api_client), state
    dev_cluster.uninstall(objects)


def submit(jobs: client.CustomObjectsApi, name: str, *, checkpoint: bool = True,
           priority: str | None = None) -> dict:
    job = fake_manifest()
    job["metadata"] = {"name": name, "namespace": NS}
    if priority is not None:
        job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": QUEUE, "kueue.x-k8s.io/priority-class": priority}
    del job["spec"]["training"]["command"]  # the fake train command
    job["spec"]["training"]["steps"] = STEPS
    if checkpoint:
        job["spec"]["training"]["checkpoint"] = {"everySteps": EVERY, "keep": 2, "claimName": CLAIM}
    return jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job)


def status_of(jobs: client.CustomObjectsApi, name: str) -> dict:
    job = read_or_none(lambda: jobs.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name))
    return (job or {}).get("status") or {}


def wait_status(jobs, name: str, check, what: str, timeout_s: float = 240.0) -> dict:
    return wait_until(lambda: status_of(jobs, name), check, timeout_s=timeout_s, what=f"{name}: {what}",
                      interval_s=0.2)


def mid_run(status: dict) -> bool:
    """Past a checkpoint and well before the end."""
    return (status.get("checkpoint") or {}).get("lastStep", 0) >= EVERY and \
        (status.get("measured") or {}).get("iterations", 0) >= 2 * EVERY


def finished(status: dict) -> bool:
    return status.get("phase") in ("Succeeded", "Failed")


def lines_of(state, name: str, what: str) -> list[int]:
    return [int(line) for line in (state / f"{name}.{what}").read_text().split()]


def assert_resumed_once_counted(status: dict, state, name: str) -> None:
    assert status["phase"] == "Succeeded", status
    resumed = status["checkpoint"]["resumedFromStep"]
    assert 0 < resumed < STEPS
    assert lines_of(state, name, "runs") == [0, resumed]  # two runs, the second from the checkpoint
    assert status["checkpoint"]["lastStep"] >= resumed
    measured = status["measured"]
    assert measured["iterations"] == STEPS
    assert measured["energyJoules"] == pytest.approx(STEPS * STEP_ENERGY_J, rel=1e-9)  # each step once
    assert measured["percentComplete"] == 100.0 and measured["etaSeconds"] == 0.0
    # Between them the runs executed every step, and more than STEPS of them when the first ran on
    # past its checkpoint; what they ran again is redone energy, never in energyJoules.
    executed = lines_of(state, name, "executed")
    assert sorted(set(executed)) == list(range(STEPS))
    assert measured.get("redoneJoules", 0.0) == pytest.approx((len(executed) - STEPS) * STEP_ENERGY_J, abs=1e-6)


def test_a_deleted_training_pod_resumes_from_its_checkpoint(api):
    core, jobs, state = api
    with PodRecorder(core, NS) as seen:
        submit(jobs, "resume")
        wait_status(jobs, "resume", mid_run, "a checkpoint, mid-run", timeout_s=300)
        [pod] = [p for p in core.list_namespaced_pod(NS, label_selector="kareus.dev/job-name=resume,"
                                                                       "kareus.dev/role=train").items
                 if p.metadata.deletion_timestamp is None]
        core.delete_namespaced_pod(pod.metadata.name, NS)  # graceful: SIGTERM, a checkpoint, exit 143
        final = wait_status(jobs, "resume", finished, "finished", timeout_s=300)
    assert len(seen["resume-train-0"]) == 2  # the deleted pod and the one that resumed
    assert_resumed_once_counted(final, state, "resume")
    claim = core.read_namespaced_persistent_volume_claim(CLAIM, NS)
    assert claim.status.phase == "Bound" and claim.spec.storage_class_name == "standard"  # the default class
    volume = core.read_persistent_volume(claim.spec.volume_name)
    assert volume.spec.local.path.startswith("/var/local-path-provisioner/")
    [term] = volume.spec.node_affinity.required.node_selector_terms
    assert term.match_expressions[0].values == [pod.spec.node_name]  # on the node its first pod ran on


def test_a_kueue_preemption_resumes_from_the_checkpoint(api):
    _, jobs, state = api
    submit(jobs, "low", priority="ckpt-batch")
    wait_status(jobs, "low", mid_run, "a checkpoint, mid-run", timeout_s=300)
    submit(jobs, "high", checkpoint=False, priority="ckpt-urgent")
    preempted = wait_status(jobs, "low", lambda s: conditions({"status": s}).get("Suspended") == ("True", "Queued"),
                            "preempted", timeout_s=120)
    assert preempted["resumePhase"] == "Training"
    assert finished(wait_status(jobs, "high", finished, "finished", timeout_s=300))
    final = wait_status(jobs, "low", finished, "finished", timeout_s=300)
    assert_resumed_once_counted(final, state, "low")
    assert int(final.get("restarts", 0)) == 0  # a preemption is not a failure


def test_a_suspended_job_resumes_from_the_checkpoint(api):
    core, jobs, state = api
    submit(jobs, "paused")
    wait_status(jobs, "paused", mid_run, "a checkpoint, mid-run", timeout_s=300)
    jobs.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "paused", {"spec": {"suspend": True}})
    wait_status(jobs, "paused", lambda s: conditions({"status": s}).get("Suspended") == ("True", "Suspended"),
                "suspended", timeout_s=60)
    wait_until(lambda: core.list_namespaced_pod(NS, label_selector="kareus.dev/job-name=paused,kareus.dev/role=train"),
               lambda pods: all(p.status.phase in ("Succeeded", "Failed") for p in pods.items),
               timeout_s=60, what="paused's training pods stopped")
    jobs.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "paused", {"spec": {"suspend": False}})
    final = wait_status(jobs, "paused", finished, "finished", timeout_s=300)
    assert_resumed_once_counted(final, state, "paused")
    assert int(final.get("restarts", 0)) == 0  # a suspension is not a failure
