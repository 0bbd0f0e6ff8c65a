"""End to end with the real runtime: a checkpointed job whose training pod is deleted mid-run resumes
from its last checkpoint and finishes with every step counted once (issue 27).

The session's dev cluster gets an operator release watching namespace `e2e-ckpt` (Pod Security
`restricted`); the job is the tests' small one (the tiny model, tensor parallel 2 on CPU, simulated
GPU energy) with `spec.training.checkpoint` on a claim the dev cluster's default StorageClass binds.
Its pods run the real `kareus profile`, `kareus optimize` and `kareus train … --checkpoint-dir`
(torch.distributed.checkpoint on the node-local volume). Deleting the training pod sends SIGTERM:
the runtime finishes its step, saves a checkpoint and exits 143; the operator restarts the gang,
which resumes there.

How "energy is not double counted" is checked: the progress ledger on the claim (read here from
the node's directory) holds both runs' steps; `status.measured.energyJoules` must be the energy of
each step once (the latest copy), and close to STEPS × the energy of one step — the last pod's
steps alone would be at most (STEPS − resumedFromStep) of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from kube_helpers import read_or_none, wait_until
from kubernetes import client, config

GROUP, VERSION, PLURAL, NS = "kareus.dev", "v1alpha1", "kareusjobs", "e2e-ckpt"
TINY = Path(__file__).resolve().parents[1] / "tests" / "data" / "tiny-tp2.yaml"
SETTINGS = {"RESYNC_S": "2", "BACKOFF_BASE_S": "1", "PROGRESS_INTERVAL_S": "0.5", "LEASE_DURATION_S": "4"}
CLAIM, STEPS, EVERY = "checkpoints", 24, 4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster(dev_cluster):
    objects = dev_cluster.install_operator("e2e-ckpt", "e2e-ckpt-system", watch_namespaces=[NS], settings=SETTINGS)
    api_client = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    core = client.CoreV1Api(api_client)
    core.patch_namespace(NS, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
    core.create_namespaced_persistent_volume_claim(NS, {
        "metadata": {"name": CLAIM}, "spec": {"accessModes": ["ReadWriteOnce"],
                                              "resources": {"requests": {"storage": "1Gi"}}}})
    yield dev_cluster, client.CustomObjectsApi(api_client), core
    dev_cluster.uninstall(objects)


def status_of(jobs, name: str) -> dict:
    job = read_or_none(lambda: jobs.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name))
    return (job or {}).get("status") or {}


def ledger_lines(dev_cluster, core, node: str, job: str) -> list[dict]:
    claim = core.read_namespaced_persistent_volume_claim(CLAIM, NS)
    volume = core.read_persistent_volume(claim.spec.volume_name)
    path = dev_cluster.node(node).root / volume.spec.local.path.lstrip("/") / job / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_deleted_training_pod_resumes_with_the_real_runtime(cluster):
    dev_cluster, jobs, core = cluster
    job = yaml.safe_load(TINY.read_text())
    job["metadata"] = {"name": "tiny-ckpt", "namespace": NS}
    job["spec"]["training"] |= {"steps": STEPS, "checkpoint": {"everySteps": EVERY, "keep": 2, "claimName": CLAIM}}
    jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job)

    def mid_run(s: dict) -> bool:
        past_checkpoint = (s.get("checkpoint") or {}).get("lastStep", 0) >= EVERY
        return (past_checkpoint and (s.get("measured") or {}).get("iterations", 0) >= EVERY + 2) or \
            s.get("phase") in ("Succeeded", "Failed")

    before = wait_until(lambda: status_of(jobs, "tiny-ckpt"), mid_run, timeout_s=400, what="a checkpoint, mid-run",
                        interval_s=0.2)
    assert before["phase"] == "Training", before
    [pod] = [p for p in core.list_namespaced_pod(NS, label_selector="kareus.dev/job-name=tiny-ckpt,"
                                                                   "kareus.dev/role=train").items
             if p.metadata.deletion_timestamp is None]
    core.delete_namespaced_pod(pod.metadata.name, NS)
    final = wait_until(lambda: status_of(jobs, "tiny-ckpt"), lambda s: s.get("phase") in ("Succeeded", "Failed"),
                       timeout_s=400, what="the job finishing", interval_s=0.5)

    assert final["phase"] == "Succeeded", final
    resumed = final["checkpoint"]["resumedFromStep"]
    assert 0 < resumed < STEPS
    measured = final["measured"]
    assert measured["iterations"] == STEPS
    assert measured["percentComplete"] == 100.0 and measured["etaSeconds"] == 0.0

    lines = ledger_lines(dev_cluster, core, pod.spec.node_name, "tiny-ckpt")
    runs = [i for i, line in enumerate(lines) if "run" in line]
    assert len(runs) == 2  # the deleted pod's run and the resumed one
    first, second = lines[runs[0] + 1:runs[1]], lines[runs[1] + 1:]
    assert first[0]["step"] == 0 and second[0]["step"] == resumed
    assert [s["step"] for s in second] == list(range(resumed, STEPS))
    kept = {s["step"]: s["energy_j"] for s in first + second}  # the latest copy of each step
    assert sorted(kept) == list(range(STEPS))
    assert measured["energyJoules"] == pytest.approx(sum(kept.values()), rel=1e-6)
    one_step_j = first[0]["energy_j"]
    assert measured["energyJoules"] == pytest.approx(STEPS * one_step_j, rel=0.1)
    assert sum(s["energy_j"] for s in second) < (1 - resumed / STEPS + 0.1) * measured["energyJoules"]
