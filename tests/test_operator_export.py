"""Weights in and out on the operator's side (issue 43): `spec.model.pretrained` mounts its claim
read-only and passes `--init-from`; `spec.training.export` passes `--export-dir` on the checkpoint
claim under the job's uid, and a succeeded job names the export in `status.export.path`."""

from __future__ import annotations

import copy

from kareus_operator import manifests as mf
from optimizer_fixtures import small_plan
from test_operator_checkpoints import flag, job_body, train_pod
from test_operator_hostile import CMS, JOBS, NS, MemoryKube, condition, planned_job, reconciler

from kareus.spec import parse_job

CKPT = {"everySteps": 4, "claimName": "ckpts"}


def runtime_args(pod: dict) -> list[str]:
    command = pod["containers"][0]["command"]
    return command[command.index("--") + 1:]


def with_pretrained(pretrained: dict, training: dict | None = None) -> dict:
    job = job_body(training or {})
    job["spec"]["model"]["pretrained"] = pretrained
    return job


def test_the_pretrained_claim_is_mounted_read_only_and_passed_as_init_from():
    pod = train_pod(with_pretrained({"claimName": "models", "path": "llama/tiny"}))
    [volume] = [v for v in pod["volumes"] if v["name"] == "kareus-pretrained"]
    assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "kareus-pretrained"]
    assert mount == {"name": "kareus-pretrained", "mountPath": "/var/kareus/pretrained", "readOnly": True}
    assert flag(runtime_args(pod), "--init-from") == "/var/kareus/pretrained/llama/tiny"
    # The claim's root itself, and a path written with redundant parts, are the mount's own path.
    assert flag(runtime_args(train_pod(with_pretrained({"claimName": "m", "path": "."}))),
                "--init-from") == "/var/kareus/pretrained"
    assert flag(runtime_args(train_pod(with_pretrained({"claimName": "m", "path": "a//b/./"}))),
                "--init-from") == "/var/kareus/pretrained/a/b"


def test_export_goes_to_the_job_uid_on_the_checkpoint_claim_while_checkpoints_stay_under_the_name():
    job = job_body({"checkpoint": CKPT, "export": {}})
    args = runtime_args(train_pod(job))
    assert flag(args, "--checkpoint-dir") == "/var/kareus/checkpoints/quickstart"
    assert flag(args, "--export-dir") == "/var/kareus/checkpoints/1234-abcd/export"
    spec = parse_job({k: job[k] for k in ("apiVersion", "kind", "metadata", "spec")}).spec
    assert mf.export_status_path(job, spec) == "ckpts:1234-abcd/export"


def test_without_pretrained_or_export_nothing_is_added():
    pod = train_pod(job_body({"checkpoint": CKPT}))
    assert "kareus-pretrained" not in {v["name"] for v in pod["volumes"]}
    assert not {"--init-from", "--export-dir"} & set(pod["containers"][0]["command"])
    job = job_body({"checkpoint": CKPT})
    spec = parse_job({k: job[k] for k in ("apiVersion", "kind", "metadata", "spec")}).spec
    assert mf.export_status_path(job, spec) is None


def exporting_job() -> dict:
    job = planned_job("e")
    job["spec"]["model"]["pretrained"] = {"claimName": "models", "path": "tiny"}
    job["spec"]["training"] |= {"checkpoint": CKPT, "export": {}}
    return job


async def test_a_succeeded_job_names_its_export_in_the_status():
    from kareus_operator.reconcile import plan_data

    kube = MemoryKube()
    kube.put(f"{JOBS}/e", exporting_job())
    rec = reconciler(kube)
    outcome = await rec.reconcile(await kube.get(f"{JOBS}/e"), now=1.0e9)  # creates the plan ConfigMap
    kube.objects[f"{CMS}/e-plan"].update(plan_data(small_plan().to_json()))
    for step in range(1, 4):  # planned, then the training Job
        job = await kube.get(f"{JOBS}/e")
        job["status"] = outcome.status
        outcome = await rec.reconcile(job, now=1.0e9 + step)
    train = f"/apis/batch/v1/namespaces/{NS}/jobs/e-train"
    assert train in kube.objects, outcome.status
    args = runtime_args(kube.objects[train]["spec"]["template"]["spec"])
    assert flag(args, "--init-from") == "/var/kareus/pretrained/tiny"
    assert flag(args, "--export-dir") == "/var/kareus/checkpoints/uid-job-e/export"
    assert "export" not in outcome.status  # not before the pods succeeded
    kube.objects[train]["status"] = {"conditions": [{"type": "Complete", "status": "True"}], "succeeded": 1}
    job = await kube.get(f"{JOBS}/e")
    job["status"] = copy.deepcopy(outcome.status)
    outcome = await rec.reconcile(job, now=1.0e9 + 10)
    assert condition(outcome.status, "Complete")["status"] == "True"
    assert outcome.status["export"] == {"path": "ckpts:uid-job-e/export"}
