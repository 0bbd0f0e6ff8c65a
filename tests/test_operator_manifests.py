"""Pure manifest builders, conditions and settings: no API involved."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kareus_operator import conditions as cond
from kareus_operator import manifests as mf
from kareus_operator.conditions import Want
from kareus_operator.publish import summarise_progress
from kareus_operator.settings import LABEL_QUEUE, Settings

from kareus.errors import KareusError
from kareus.spec import parse_job

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"


def job_body(nodes: int = 1, queue: str | None = "team-queue") -> dict:
    job = yaml.safe_load(QUICKSTART.read_text())
    job["metadata"].update(namespace="team-a", uid="1234-abcd", labels={LABEL_QUEUE: queue} if queue else {})
    job["spec"]["training"].update(nodes=nodes, gpusPerNode=2)
    job["spec"]["parallelism"]["data"] = nodes
    return job


def spec_of(job: dict):
    return parse_job({k: job[k] for k in ("apiVersion", "kind", "metadata", "spec")}).spec


def test_children_are_owned_labelled_and_named_deterministically():
    job = job_body()
    cm = mf.spec_configmap(job)
    assert cm["metadata"]["name"] == "quickstart-spec"
    assert cm["metadata"]["ownerReferences"] == [{"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob",
                                                  "name": "quickstart", "uid": "1234-abcd", "controller": True,
                                                  "blockOwnerDeletion": True}]
    assert cm["metadata"]["labels"] == {"kareus.dev/job-name": "quickstart", "kareus.dev/job-uid": "1234-abcd",
                                        "kareus.dev/role": "spec", LABEL_QUEUE: "team-queue"}
    assert yaml.safe_load(cm["data"]["job.yaml"])["spec"] == job["spec"]
    assert mf.spec_configmap(job) == cm  # pure: same input, same output
    assert LABEL_QUEUE not in mf.spec_configmap(job_body(queue=None))["metadata"]["labels"]


def test_profile_pod_publishes_an_unowned_cache_entry():
    job = job_body()
    pod = mf.profile_pod(job, spec_of(job), Settings(), "tiny-key-1")
    command = pod["spec"]["containers"][0]["command"]
    assert pod["metadata"]["name"] == "quickstart-profile"
    assert command[:4] == ["kareus-operator", "publish", "--configmap", "kareus-profile-tiny-key-1"]
    assert "--owner" not in command  # the cache outlives the job
    assert command[command.index("--") + 1:] == ["kareus", "profile", "/etc/kareus/job/job.yaml", "--backend",
                                                 "auto", "--out", "/var/kareus/out/profile.json"]
    assert pod["spec"]["restartPolicy"] == "Never"


def test_optimize_pod_mounts_the_profile_and_owns_the_plan():
    job = job_body()
    pod = mf.optimize_pod(job, Settings(), "tiny-key-1")
    command = pod["spec"]["containers"][0]["command"]
    assert command[command.index("--owner") + 1] == "kareus.dev/v1alpha1/KareusJob/quickstart/1234-abcd"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["profile"]["configMap"]["name"] == "kareus-profile-tiny-key-1"
    assert "/etc/kareus/profile/profile.json" in command


def test_train_pods_get_rank_env_plan_socket_and_one_publisher():
    job = job_body(nodes=2)
    spec = spec_of(job)
    pods = [mf.train_pod(job, spec, Settings(), i) for i in range(2)]
    assert [p["metadata"]["name"] for p in pods] == ["quickstart-train-0", "quickstart-train-1"]
    envs = [{e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]} for p in pods]
    assert envs[1]["MASTER_ADDR"] == "quickstart-train-0.quickstart-train.team-a.svc"
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] == str(mf.master_port("1234-abcd"))
    assert [e["NODE_RANK"] for e in envs] == ["0", "1"] and envs[0]["NNODES"] == "2"
    commands = [p["spec"]["containers"][0]["command"] for p in pods]
    assert commands[0][:2] == ["kareus-operator", "publish"] and "--follow" in commands[0]
    assert commands[1] == ["kareus", "train", "/etc/kareus/job/job.yaml", "--plan", "/etc/kareus/plan/plan.json",
                           "--out", "/var/kareus/out", "--nproc", "2"]
    mounts = {m["name"]: m["mountPath"] for m in pods[0]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["plan"] == "/etc/kareus/plan" and mounts["node-socket"] == "/var/run/kareus"
    assert pods[0]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert pods[0]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}
    service = mf.train_service(job)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"kareus.dev/job-name": "quickstart", "kareus.dev/role": "train"}


def test_command_templates_leave_other_braces_alone():
    settings = Settings(profile_command=("python", "-c", "print({'a': 1})", "{profile}"))
    job = job_body()
    command = mf.profile_pod(job, spec_of(job), settings, "k")["spec"]["containers"][0]["command"]
    assert command[-2:] == ["print({'a': 1})", "/var/kareus/out/profile.json"]


def test_label_values_are_safe_and_unique():
    long_key = "x" * 80
    value = mf.label_value(long_key)
    assert len(value) <= 63 and value != mf.label_value("x" * 81)
    assert mf.label_value("Tiny/A100 key") == "tiny-a100-key"


def test_condition_time_moves_only_when_status_flips():
    first = cond.merge([], [Want("Profiled", False, "Profiling", "pod pending")], now="T1", generation=1)
    second = cond.merge(first, [Want("Profiled", False, "Profiling", "pod running")], now="T2", generation=2)
    assert second[0]["lastTransitionTime"] == "T1" and second[0]["message"] == "pod running"
    assert second[0]["observedGeneration"] == 2
    third = cond.merge(second, [Want("Profiled", True, "CacheHit"), Want("Suspended", False, "Resumed")],
                       now="T3", generation=2)
    assert [c["type"] for c in third] == ["Suspended", "Profiled"]  # stable order
    assert third[1]["lastTransitionTime"] == "T3"


@pytest.mark.parametrize(("wants", "phase"), [
    ([], "Pending"),
    ([Want("Profiled", False, "Profiling")], "Profiling"),
    ([Want("Profiled", True, "Measured")], "Optimizing"),
    ([Want("Profiled", True, "CacheHit"), Want("Planned", True, "Optimized")], "Training"),
    ([Want("Planned", True, "Optimized"), Want("Suspended", True, "Suspended")], "Suspended"),
    ([Want("Planned", True, "Optimized"), Want("Complete", True, "Completed")], "Succeeded"),
    ([Want("Complete", True, "Completed"), Want("Failed", True, "TrainingFailed")], "Failed"),
])
def test_phase_is_derived_from_conditions(wants, phase):
    assert cond.phase_of(cond.merge([], wants, now="T", generation=1)) == phase


def test_settings_from_env_and_errors_name_the_variable():
    settings = Settings.from_env({"KAREUS_OPERATOR_RESYNC_S": "3", "KAREUS_OPERATOR_TRAIN_COMMAND": '["python", "t.py"]',
                                  "KAREUS_OPERATOR_EXTRA_POD_ENV": '{"A": "1"}'})
    assert settings.resync_s == 3.0 and settings.train_command == ("python", "t.py")
    assert settings.extra_pod_env == {"A": "1"}
    with pytest.raises(KareusError, match="KAREUS_OPERATOR_RESYNC_S: must be a positive number"):
        Settings.from_env({"KAREUS_OPERATOR_RESYNC_S": "-1"})


def test_progress_summary_ignores_partial_lines():
    lines = ['{"step": 0, "iteration_time_s": 0.5, "energy_j": 100}',
             '{"step": 1, "iteration_time_s": 0.7, "energy_j": 140}', '{"step": 2, "iter']
    assert summarise_progress(lines) == {"iterations": 2, "energyJoules": 240.0,
                                         "averageIterationSeconds": 0.6, "lastStep": 1}
    degraded = '{"step": 2, "iteration_time_s": 1, "energy_j": 1, "clock_control": "degraded", "clock_control_reason": "GPU shared"}'
    assert summarise_progress([*lines[:2], degraded])["clockControlDegraded"] == "GPU shared"


def test_operator_metrics_follow_phase_changes():
    from kareus_operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    metrics.observe("a", "Profiling")
    metrics.observe("b", "Profiling")
    metrics.observe("a", "Profiling")  # no change, no double count
    metrics.observe("a", "Training")
    metrics.profile_cache_hit()
    metrics.forget("b")
    text = metrics.exposition().decode()
    assert 'kareus_jobs{phase="Profiling"} 0.0' in text and 'kareus_jobs{phase="Training"} 1.0' in text
    assert 'kareus_phase_seconds_count{phase="Profiling"} 1.0' in text
    assert "kareus_profile_cache_hits_total 1.0" in text
