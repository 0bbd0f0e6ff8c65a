"""The controller charges a job's energy to its namespace's ledger only once the status holding that
energy is written (over an in-memory API).

A resync charges every job's *stored* counter. Were the ledger charged before the status write, a
resync landing between the two would charge the stored, smaller counter after the newer one. A
counter that goes down reads as a new run (a gang restart without a checkpoint starts over), so the
stored energy would be counted twice. CI met exactly this on the dev cluster: one 123 J step too
many in the Kueue energy-budget test.
"""

from __future__ import annotations

import json

from kareus_operator.handlers import Controller
from kareus_operator.publish import PROGRESS_KEY
from kareus_operator.reconcile import objective_text
from kareus_operator.settings import Settings
from test_operator_hostile import CMS, JOBS, NS, EventKube, job_manifest

from kareus.spec import parse_job

STEP_J = 123.0
LEDGER = f"/apis/kareus.dev/v1alpha1/kareusenergyledgers/{NS}"


def training_job(steps_done: int) -> dict:
    job = job_manifest("a")
    spec = parse_job(job).spec
    job["status"] = {
        "phase": "Training", "objective": objective_text(spec), "startTime": "2025-01-01T00:00:00Z",
        "restarts": 0, "conditions": [{"type": t, "status": "True", "reason": "x", "message": ""}
                                      for t in ("Profiled", "Planned")],
        "measured": {"iterations": steps_done, "energyJoules": steps_done * STEP_J,
                     "averageIterationSeconds": 1.0}}
    return job


def progress_configmap(steps_done: int) -> dict:
    uid = "uid-job-a"
    return {"metadata": {"name": "a-progress", "namespace": NS,
                         "labels": {"kareus.dev/job-name": "a", "kareus.dev/job-uid": uid},
                         "ownerReferences": [{"uid": uid, "controller": True}]},
            "data": {PROGRESS_KEY: json.dumps({"iterations": steps_done, "energyJoules": steps_done * STEP_J,
                                                "averageIterationSeconds": 1.0})}}


async def test_a_resync_between_a_measurement_and_its_status_write_charges_nothing_twice():
    kube = EventKube()
    kube.put(f"{JOBS}/a", training_job(steps_done=1))
    kube.put(f"{CMS}/a-progress", progress_configmap(steps_done=2))
    controller = Controller(kube, Settings(resync_s=600.0))
    await controller.ledgers.record(kube.objects[f"{JOBS}/a"])  # the pass that wrote step 1 charged it
    assert kube.objects[LEDGER]["status"]["usedJoules"] == STEP_J

    write_status = kube.merge_patch
    resyncs: list[float] = []

    async def merge_patch(url: str, patch):
        if url == f"{JOBS}/a/status":  # the resync lands just before this pass's write does
            await controller.ledgers.sync(NS)
            resyncs.append(kube.objects[LEDGER]["status"]["usedJoules"])
        return await write_status(url, patch)

    kube.merge_patch = merge_patch
    await controller.reconcile(NS, "a")
    for handle in controller._wakeups.values():
        handle.cancel()

    assert kube.objects[f"{JOBS}/a"]["status"]["measured"]["energyJoules"] == 2 * STEP_J
    assert resyncs == [STEP_J]  # the resync saw the stored step and the ledger as it was: nothing new
    ledger = kube.objects[LEDGER]["status"]
    assert (ledger["usedJoules"], ledger["lifetimeJoules"]) == (2 * STEP_J, 2 * STEP_J)  # each step once
    assert ledger["jobs"] == [{"uid": "uid-job-a", "name": "a", "joules": 2 * STEP_J}]
