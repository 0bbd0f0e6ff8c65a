"""Pure manifest builders, conditions and settings: no API involved."""

from __future__ import annotations

import json
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

QUICKSTART = Path(__file__).resolve().parents[1] / "tests" / "data" / "tiny-tp2.yaml"  # a small valid job


def job_body(nodes: int = 1, queue: str | None = "team-queue") -> dict:
    job = yaml.safe_load(QUICKSTART.read_text())
    job["metadata"].update(namespace="team-a", uid="1234-abcd", labels={LABEL_QUEUE: queue} if queue else {})
    job["spec"]["training"].update(nodes=nodes, gpusPerNode=2)
    job["spec"]["parallelism"]["data"] = nodes
    job["spec"]["profiling"] = {"backend": "auto"}  # as on a real GPU cluster
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


def container(job: dict) -> dict:
    return job["spec"]["template"]["spec"]["containers"][0]


def test_profile_job_requests_the_gpus_and_publishes_an_unowned_cache_entry():
    job = job_body()
    child = mf.profile_job(job, spec_of(job), Settings(), "tiny-key-1")
    assert (child["apiVersion"], child["kind"], child["metadata"]["name"]) == ("batch/v1", "Job", "quickstart-profile")
    command = container(child)["command"]
    # Into the job's own ConfigMap; the operator copies it into the shared cache, which outlives the job
    # and which no worker writes (issue 29).
    assert command[:4] == ["kareus-operator", "publish", "--configmap", "quickstart-profile"]
    assert "--owner" not in command
    cache = mf.profile_cache("team-a", "tiny-key-1", "{}", "1234-abcd")["metadata"]
    assert cache["name"] == "kareus-profile-tiny-key-1" and "ownerReferences" not in cache
    assert cache["labels"] == {"kareus.dev/profile-key": "tiny-key-1", "kareus.dev/job-uid": "1234-abcd"}
    assert command[command.index("--") + 1:] == ["kareus", "profile", "/etc/kareus/job/job.yaml", "--backend",
                                                 "auto", "--out", "/var/kareus/out/profile.json", "--require-gpu"]
    pod = child["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and container(child)["resources"] == {
        "requests": {"memory": "8Gi"}, "limits": {"nvidia.com/gpu": "2", "memory": "64Gi"}}  # Burstable
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}  # the quickstart pins it
    assert child["spec"]["suspend"] is True  # queued: Kueue admits it
    assert child["spec"]["backoffLimit"] == 3


def test_every_phase_job_has_the_pod_failure_policy_and_a_restricted_pod():
    job = job_body(queue=None)
    spec = spec_of(job)
    for child in (mf.profile_job(job, spec, Settings(), "k"), mf.optimize_job(job, spec, Settings(), "k"),
                  mf.train_job(job, spec, Settings())):
        rules = child["spec"]["podFailurePolicy"]["rules"]
        assert rules[0] == {"action": "FailJob", "onExitCodes": {"containerName": "kareus", "operator": "In",
                                                                 "values": [2, 78]}}
        assert rules[1] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
        assert child["spec"]["podReplacementPolicy"] == "Failed" and child["spec"]["suspend"] is False
        pod = child["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"] == {
            "type": "RuntimeDefault"}
        assert container(child)["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert container(child)["securityContext"]["allowPrivilegeEscalation"] is False
        assert not any("hostPath" in volume for volume in pod["volumes"])


def test_optimize_job_mounts_the_profile_and_owns_the_gzipped_plan():
    job = job_body()
    child = mf.optimize_job(job, spec_of(job), Settings(), "tiny-key-1")
    command = container(child)["command"]
    assert "--owner" not in command  # the operator creates the plan ConfigMap, owned (a worker may not set owners)
    plan_cm = mf.job_configmap(job, "quickstart-plan", "optimize")["metadata"]
    assert plan_cm["ownerReferences"][0]["uid"] == "1234-abcd" and plan_cm["labels"]["kareus.dev/job-uid"] == "1234-abcd"
    assert command[command.index("--gzip-file") + 1] == "plan.json.gz=/var/kareus/out/plan.json"
    volumes = {v["name"]: v for v in child["spec"]["template"]["spec"]["volumes"]}
    assert volumes["profile"]["configMap"]["name"] == "kareus-profile-tiny-key-1"
    assert "/etc/kareus/profile/profile.json" in command
    resources = container(child)["resources"]  # a CPU pod: no GPU, no GPU toleration; requests and a memory limit
    assert "nvidia.com/gpu" not in resources["limits"] and set(resources["requests"]) == {"cpu", "memory"}
    assert "tolerations" not in child["spec"]["template"]["spec"]


def test_training_is_an_indexed_job_with_torchrun_env_and_a_daemon_token():
    job = job_body(nodes=2)
    child = mf.train_job(job, spec_of(job), Settings())
    assert child["metadata"]["name"] == "quickstart-train"
    assert (child["spec"]["completionMode"], child["spec"]["completions"], child["spec"]["parallelism"]) == \
        ("Indexed", 2, 2)
    assert child["spec"]["backoffLimit"] == 0  # the operator restarts the whole gang
    pod = child["spec"]["template"]["spec"]
    assert pod["subdomain"] == "quickstart-train"
    env = {e["name"]: e for e in container(child)["env"]}
    assert env["MASTER_ADDR"]["value"] == env["PET_MASTER_ADDR"]["value"] == \
        "quickstart-train-0.quickstart-train.team-a.svc"
    assert env["MASTER_PORT"]["value"] == str(mf.master_port("1234-abcd"))
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == env["PET_NODE_RANK"]["valueFrom"]["fieldRef"][
        "fieldPath"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["NNODES"]["value"] == env["PET_NNODES"]["value"] == "2"
    assert env["KAREUS_DAEMON_ADDRESS"]["value"] == "$(HOST_IP):9477"
    assert env["KAREUS_DAEMON_TOKEN_FILE"]["value"] == "/var/run/secrets/kareus.dev/node/token"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["node-token"]["projected"]["sources"][0]["serviceAccountToken"]["audience"] == "kareus-node"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    command = container(child)["command"]
    assert command[:2] == ["kareus-operator", "publish"] and "--follow-if-rank0" in command
    assert command[command.index("--") + 1:] == ["kareus", "train", "/etc/kareus/job/job.yaml", "--plan",
                                                 "/etc/kareus/plan/plan.json.gz", "--out", "/var/kareus/out",
                                                 "--nproc", "2"]
    assert container(child)["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert [p["name"] for p in container(child)["ports"]] == ["metrics", "metrics-1"]
    service = mf.train_service(job)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"kareus.dev/job-name": "quickstart", "kareus.dev/role": "train"}


def test_no_product_selector_unless_the_job_pins_one():
    job = job_body()
    del job["spec"]["gpu"]
    pod = mf.train_job(job, spec_of(job), Settings())["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_pod_template_overrides_merge_by_role():
    job = job_body()
    job["spec"]["podTemplateOverrides"] = [
        {"roles": ["train"], "metadata": {"labels": {"team": "nlp", "kareus.dev/role": "mine"}},
         "spec": {"nodeSelector": {"pool": "h100"}, "priorityClassName": "training",
                  "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
                  "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}}],
                  "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
                  "env": [{"name": "HF_HOME", "value": "/data/hf"}],
                  "resources": {"requests": {"cpu": "8", "memory": "64Gi"}}}},
        {"roles": ["profile", "train"], "spec": {"imagePullSecrets": [{"name": "registry"}]}}]
    spec = spec_of(job)
    train = mf.train_job(job, spec, Settings())["spec"]["template"]
    pod = train["spec"]
    assert train["metadata"]["labels"]["team"] == "nlp"
    assert train["metadata"]["labels"]["kareus.dev/role"] == "train"  # the operator's own labels stay
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB", "pool": "h100"}
    assert pod["priorityClassName"] == "training" and pod["imagePullSecrets"] == [{"name": "registry"}]
    assert [t["key"] for t in pod["tolerations"]] == ["nvidia.com/gpu", "dedicated"]
    assert pod["volumes"][-1] == {"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}}
    c = pod["containers"][0]
    assert c["volumeMounts"][-1] == {"name": "data", "mountPath": "/data", "readOnly": True}
    assert c["env"][-1] == {"name": "HF_HOME", "value": "/data/hf"}
    assert c["resources"] == {"limits": {"nvidia.com/gpu": "2", "memory": "64Gi"},
                              "requests": {"cpu": "8", "memory": "64Gi"}}
    profile = mf.profile_job(job, spec, Settings(), "k")["spec"]["template"]["spec"]
    assert profile["imagePullSecrets"] == [{"name": "registry"}] and "priorityClassName" not in profile
    assert "imagePullSecrets" not in mf.optimize_job(job, spec, Settings(), "k")["spec"]["template"]["spec"]


def test_command_templates_leave_other_braces_alone():
    settings = Settings(profile_command=("python", "-c", "print({'a': 1})", "{profile}"))
    job = job_body()
    command = container(mf.profile_job(job, spec_of(job), settings, "k"))["command"]
    assert command[-3:] == ["print({'a': 1})", "/var/kareus/out/profile.json", "--require-gpu"]


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


def test_progress_summary_counts_straggler_switches_once_each():
    records = [{"step": i, "iteration_time_s": 0.1, "energy_j": 1.0, "plan_revision": rev, "plan_revision_reason": why,
                "plan_frontier_row": row}
               for i, (rev, why, row) in enumerate([(1, "rollout", 0), (1, "rollout", 0), (2, "straggler", 3),
                                                    (2, "straggler", 3), (3, "recovered", 0), (3, "recovered", 0)])]
    summary = summarise_progress([json.dumps(r) for r in records])
    assert summary["stragglerReselections"] == 2 and summary["planFrontierRow"] == 0
    assert "stragglerReselections" not in summarise_progress([json.dumps(records[0])])


def test_job_ports_stay_below_the_ephemeral_range():
    """An outgoing connection anywhere on a shared host may hold an ephemeral local port (Linux:
    32768–60999), so a pod listening there could fail with EADDRINUSE (seen in the dev cluster)."""
    uids = [f"uid-{i}" for i in range(2000)]
    ports = [mf.master_port(u) for u in uids] + [mf.metrics_port(u) + rank for u in uids for rank in range(8)]
    assert min(ports) >= 20000 and max(ports) < 32768
    assert len({mf.metrics_port(u) for u in uids}) > 700  # still spread over many blocks


def test_worker_image_pull_policy_and_secrets():
    """The chart's operator.workerImage.pullPolicy and workers.imagePullSecrets, as settings."""
    job = job_body(queue=None)
    spec = spec_of(job)
    default = Settings()
    assert default.image == "localhost/kareus/runtime:0.1.0"  # what `make images` tags
    profile, optimize, train = (mf.profile_job(job, spec, default, "k"), mf.optimize_job(job, spec, default, "k"),
                                mf.train_job(job, spec, default))
    # The worker image's policy on the pods that run it; a training pod runs the job's own image.
    assert container(profile)["imagePullPolicy"] == container(optimize)["imagePullPolicy"] == "IfNotPresent"
    assert "imagePullPolicy" not in container(train)
    assert not any("imagePullSecrets" in c["spec"]["template"]["spec"] for c in (profile, optimize, train))
    assert "imagePullPolicy" not in container(mf.profile_job(job, spec, Settings(image_pull_policy=""), "k"))
    settings = Settings.from_env({"KAREUS_OPERATOR_IMAGE_PULL_SECRETS": '["regcred", "mirror"]',
                                  "KAREUS_OPERATOR_IMAGE_PULL_POLICY": "Always"})
    assert settings.image_pull_secrets == ("regcred", "mirror") and settings.image_pull_policy == "Always"
    for child in (mf.profile_job(job, spec, settings, "k"), mf.optimize_job(job, spec, settings, "k"),
                  mf.train_job(job, spec, settings)):
        assert child["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    assert container(mf.optimize_job(job, spec, settings, "k"))["imagePullPolicy"] == "Always"
    # A job's own podTemplateOverrides add to them.
    job["spec"]["podTemplateOverrides"] = [{"roles": ["train"], "spec": {"imagePullSecrets": [{"name": "team"}]}}]
    pod = mf.train_job(job, spec_of(job), settings)["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}, {"name": "team"}]
    assert Settings.from_env({"KAREUS_OPERATOR_IMAGE_PULL_SECRETS": "a,b"}).image_pull_secrets == ("a", "b")
    with pytest.raises(KareusError, match="KAREUS_OPERATOR_IMAGE_PULL_POLICY: must be one of"):
        Settings.from_env({"KAREUS_OPERATOR_IMAGE_PULL_POLICY": "Sometimes"})
    with pytest.raises(KareusError, match="KAREUS_OPERATOR_IMAGE_PULL_SECRETS: must be a JSON list"):
        Settings.from_env({"KAREUS_OPERATOR_IMAGE_PULL_SECRETS": '[{"name": "regcred"}]'})


def rdzv_env(child: dict) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for e in container(child)["env"]:
        if e["name"] in ("KAREUS_RENDEZVOUS_TIMEOUT_S", "PET_RDZV_CONF"):
            values.setdefault(e["name"], []).append(e["value"])
    return values


def test_the_rendezvous_timeout_reaches_kareus_train_and_torchrun():
    job = job_body(nodes=2)
    spec = spec_of(job)
    assert Settings().rendezvous_timeout_s == 600.0
    assert rdzv_env(mf.train_job(job, spec, Settings())) == {
        "KAREUS_RENDEZVOUS_TIMEOUT_S": ["600"], "PET_RDZV_CONF": ["timeout=600,join_timeout=600"]}
    settings = Settings.from_env({"KAREUS_OPERATOR_RENDEZVOUS_TIMEOUT_S": "1799.5"})
    assert rdzv_env(mf.train_job(job, spec, settings)) == {  # whole seconds, never shorter than asked
        "KAREUS_RENDEZVOUS_TIMEOUT_S": ["1800"], "PET_RDZV_CONF": ["timeout=1800,join_timeout=1800"]}
    # Only the training pods rendezvous.
    assert rdzv_env(mf.profile_job(job, spec, settings, "k")) == rdzv_env(mf.optimize_job(job, spec, settings, "k")) == {}
    # A job that sets its own (spec.training.env) keeps it, once.
    job["spec"]["training"]["env"] = [{"name": "PET_RDZV_CONF", "value": "join_timeout=60"}]
    assert rdzv_env(mf.train_job(job, spec_of(job), settings)) == {
        "KAREUS_RENDEZVOUS_TIMEOUT_S": ["1800"], "PET_RDZV_CONF": ["join_timeout=60"]}
    for raw in ("0", "-5", "ten minutes", "nan", "inf"):
        with pytest.raises(KareusError, match="KAREUS_OPERATOR_RENDEZVOUS_TIMEOUT_S: must be a positive number"):
            Settings.from_env({"KAREUS_OPERATOR_RENDEZVOUS_TIMEOUT_S": raw})


def test_every_pod_has_a_read_only_root_and_gpu_pods_memory_that_holds_their_shm():
    job = job_body()
    spec = spec_of(job)
    for child in (mf.profile_job(job, spec, Settings(), "k"), mf.optimize_job(job, spec, Settings(), "k"),
                  mf.train_job(job, spec, Settings())):
        pod = child["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert {v["name"]: v for v in pod["volumes"]}[mounts["/tmp"]] == {"name": "tmp", "emptyDir": {}}
    settings = Settings.from_env({"KAREUS_OPERATOR_SHM_SIZE": "1Gi", "KAREUS_OPERATOR_GPU_POD_MEMORY_REQUEST": "256Mi",
                                  "KAREUS_OPERATOR_GPU_POD_MEMORY_LIMIT": "6Gi"})
    c = mf.train_job(job, spec, settings)["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"] == {"requests": {"memory": "256Mi"}, "limits": {"nvidia.com/gpu": "2", "memory": "6Gi"}}
    with pytest.raises(KareusError, match="GPU_POD_MEMORY_LIMIT: must exceed KAREUS_OPERATOR_SHM_SIZE"):
        Settings.from_env({"KAREUS_OPERATOR_SHM_SIZE": "16Gi", "KAREUS_OPERATOR_GPU_POD_MEMORY_LIMIT": "16Gi"})
    with pytest.raises(KareusError, match="GPU_POD_MEMORY_REQUEST: must be at most the limit"):
        Settings.from_env({"KAREUS_OPERATOR_GPU_POD_MEMORY_REQUEST": "65Gi"})
    with pytest.raises(KareusError, match="SHM_SIZE: must be a positive memory quantity"):
        Settings.from_env({"KAREUS_OPERATOR_SHM_SIZE": "lots"})


def test_a_node_token_shorter_than_the_api_servers_floor_is_one_clear_error():
    assert Settings.from_env({"KAREUS_OPERATOR_NODE_TOKEN_EXPIRATION_S": "600"}).node_token_expiration_s == 600
    with pytest.raises(KareusError, match=r"^KAREUS_OPERATOR_NODE_TOKEN_EXPIRATION_S: must be at least 600 \(the API "
                                          r"server's shortest projected token\), got 300$"):
        Settings.from_env({"KAREUS_OPERATOR_NODE_TOKEN_EXPIRATION_S": "300"})
    with pytest.raises(KareusError, match="NODE_TOKEN_EXPIRATION_S: must be an integer >= 1, got '1h'"):
        Settings.from_env({"KAREUS_OPERATOR_NODE_TOKEN_EXPIRATION_S": "1h"})
