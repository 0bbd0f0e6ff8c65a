"""End to end: `examples/quickstart.yaml` through the official `kubernetes` client on the real cluster.

The session's dev cluster (real kube-apiserver, controller manager and scheduler, an emulated GPU
node, the node agent DaemonSet) gets an operator release of the chart watching namespace `e2e`,
which enforces Pod Security `restricted`; the operator runs as the chart's Deployment pod under its
ServiceAccount, and its children are batch/v1 Jobs (training an Indexed Job) whose pods run the
real `kareus profile`, `kareus optimize` and `kareus train --nproc 2` (torch + gloo on CPU,
simulated GPU energy). Checks: the job succeeds with the documented conditions, a plan ConfigMap
and measured energy; the profiling pod requested the job's GPUs and locked their clocks through
the node daemon (the daemon's metrics show the lock owned by that pod); an identical second job
reuses the profile; an objective change while training re-selects the plan from the stored
frontier; deleting a job removes every child through the real garbage collector; invalid
manifests are rejected by the API server with the field path; pods, logs and events are read with
the official client.
"""

from __future__ import annotations

import base64
import copy
import gzip
import json
import re
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml
from kube_helpers import read_or_none, wait_until
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from kareus.spec import load_job

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"
GROUP, VERSION, PLURAL, NS = "kareus.dev", "v1alpha1", "kareusjobs", "e2e"
SETTINGS = {"RESYNC_S": "2", "BACKOFF_BASE_S": "1", "PROGRESS_INTERVAL_S": "0.5", "LEASE_DURATION_S": "4"}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def cluster(dev_cluster):
    objects = dev_cluster.install_operator("e2e", "e2e-system", watch_namespaces=[NS], settings=SETTINGS)
    api_client = config.new_client_from_config(config_file=str(dev_cluster.kubeconfig))
    core = client.CoreV1Api(api_client)
    core.patch_namespace(NS, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}})
    yield dev_cluster, client.CustomObjectsApi(api_client), core
    dev_cluster.uninstall(objects)


def manifest(name: str) -> dict:
    job = yaml.safe_load(QUICKSTART.read_text())
    job["metadata"]["name"] = name
    return job


def get_job(jobs, name: str) -> dict | None:
    return read_or_none(lambda: jobs.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name))


def wait_for(jobs, name: str, check, timeout_s: float = 300.0) -> dict:
    return wait_until(lambda: get_job(jobs, name), check, timeout_s=timeout_s, what=f"KareusJob {name}",
                      interval_s=0.5)


def plan_of(core, name: str) -> dict:
    """The plan document a plan ConfigMap stores (gzip-compressed, in binaryData)."""
    cm = core.read_namespaced_config_map(name, NS)
    return json.loads(gzip.decompress(base64.b64decode(cm.binary_data["plan.json.gz"])))


def agent_metrics_url(core, apps) -> str:
    """The node agent's /metrics on the emulated node (host network: the node's address)."""
    [daemonset] = [d for d in apps.list_daemon_set_for_all_namespaces().items if "node" in d.metadata.name]
    args = daemonset.spec.template.spec.containers[0].args
    port = next(a.split("=", 1)[1] for a in args if a.startswith("--metrics-port="))
    [pod] = core.list_namespaced_pod(daemonset.metadata.namespace).items
    return f"http://{pod.status.pod_ip}:{port}/metrics"


def locked_by(url: str) -> set[str]:
    """Pods the agent's metrics show holding a clock lock now."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {m.group(1) for m in re.finditer(r'^kareus_gpu_locked_clock_hertz\{[^}]*pod="([^"]+)"[^}]*\} ([0-9.e+]+)$',
                                            text, re.MULTILINE) if float(m.group(2)) > 0}


def phase(job: dict | None) -> str | None:
    return ((job or {}).get("status") or {}).get("phase")


def conditions(job: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in (job.get("status") or {}).get("conditions", [])}


def test_invalid_manifests_are_rejected_with_field_paths(cluster):
    _, jobs, _ = cluster
    bad = manifest("bad")
    bad["spec"]["parallelism"]["tensor"] = 0
    with pytest.raises(ApiException) as error:
        jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, bad)
    assert error.value.status == 422 and "spec.parallelism.tensor" in error.value.body
    two = manifest("two-objectives")
    two["spec"]["objective"]["energyBudget"] = {"perIterationJoules": 5.0}
    with pytest.raises(ApiException) as error:
        jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, two)
    assert error.value.status == 422 and "spec.objective" in error.value.body
    assert get_job(jobs, "bad") is None


def test_quickstart_end_to_end(cluster):
    _, jobs, core = cluster
    apps, batch = client.AppsV1Api(core.api_client), client.BatchV1Api(core.api_client)
    created = jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, manifest("quickstart"))
    assert created["metadata"]["uid"] and created["metadata"]["generation"] == 1

    # The profiling pod asks for the job's GPUs and locks their clocks through the node daemon.
    url, lockers = agent_metrics_url(core, apps), set()
    first = wait_until(lambda: (lockers.update(locked_by(url)), get_job(jobs, "quickstart"))[1],
                       lambda j: conditions(j or {}).get("Profiled") == ("True", "Measured"), timeout_s=300,
                       what="the quickstart's profile", interval_s=0.2)
    [profile_pod] = core.list_namespaced_pod(NS, label_selector="kareus.dev/job-name=quickstart,"
                                                                "kareus.dev/role=profile").items
    gpus = str(load_job(QUICKSTART).spec.training.gpus_per_node)  # the quickstart's 4
    limits = profile_pod.spec.containers[0].resources.limits
    assert limits["nvidia.com/gpu"] == gpus and set(limits) == {"nvidia.com/gpu", "memory"}
    assert profile_pod.status.qos_class == "Burstable"  # memory requested and limited, above its /dev/shm
    assert profile_pod.metadata.name in lockers, (profile_pod.metadata.name, lockers)
    assert all(v.host_path is None for v in profile_pod.spec.volumes)

    # A second identical job, created once the first has profiled, reuses the profile.
    jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, manifest("quickstart-2"))
    second = wait_for(jobs, "quickstart-2", lambda j: phase(j) in ("Training", "Failed"))
    assert conditions(second)["Profiled"] == ("True", "CacheHit"), second["status"]
    assert second["status"]["profile"]["key"] == first["status"]["profile"]["key"]

    # Changing the objective while training re-selects from the stored frontier (no re-profiling).
    plan_before = plan_of(core, "quickstart-2-plan")
    objective = {"spec": {"objective": {"maxThroughput": None, "timeBudget": {"maxSlowdownPercent": 20.0}}}}
    jobs.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "quickstart-2", copy.deepcopy(objective))
    reselected = wait_for(jobs, "quickstart-2", lambda j: (j["status"].get("plan") or {}).get("reselections") == 1
                          or phase(j) in ("Succeeded", "Failed"))
    assert conditions(reselected)["Planned"] == ("True", "Reselected"), reselected["status"]
    plan_after = plan_of(core, "quickstart-2-plan")
    assert plan_after["objective"] != plan_before["objective"]
    assert plan_after["frontier"] == plan_before["frontier"]  # same frontier: nothing re-profiled or re-solved
    assert plan_after["predicted"]["iteration_energy_j"] <= plan_before["predicted"]["iteration_energy_j"]
    assert core.list_namespaced_pod(NS, label_selector="kareus.dev/job-name=quickstart-2,kareus.dev/role=profile").items == []

    done = wait_for(jobs, "quickstart", lambda j: phase(j) in ("Succeeded", "Failed"))
    assert done["status"]["phase"] == "Succeeded", done["status"]
    assert conditions(done) == {"Profiled": ("True", "Measured"), "Planned": ("True", "Optimized"),
                                "Training": ("False", "Completed"), "Complete": ("True", "Completed")}
    plan_cm = core.read_namespaced_config_map(done["status"]["plan"]["configMap"], NS)
    plan = plan_of(core, done["status"]["plan"]["configMap"])
    assert plan["kind"] == "KareusPlan" and done["status"]["plan"]["frontierPoints"] == len(plan["frontier"]["rows"])
    assert plan_cm.metadata.owner_references[0].uid == created["metadata"]["uid"]
    measured = done["status"]["measured"]
    assert measured["iterations"] == 8 and measured["energyJoules"] > 0 and measured["averageIterationSeconds"] > 0
    children = {j.metadata.labels["kareus.dev/role"]: j for j in
                batch.list_namespaced_job(NS, label_selector="kareus.dev/job-name=quickstart").items}
    assert sorted(children) == ["optimize", "profile", "train"]  # every phase a batch/v1 Job
    assert children["train"].spec.completion_mode == "Indexed" and children["train"].spec.completions == 1
    assert all(j.status.succeeded == j.spec.completions for j in children.values())
    [train_pod] = core.list_namespaced_pod(NS, label_selector="kareus.dev/job-name=quickstart,kareus.dev/role=train,"
                                                              "batch.kubernetes.io/job-completion-index=0").items
    assert train_pod.spec.hostname == "quickstart-train-0" and train_pod.spec.subdomain == "quickstart-train"
    assert "kareus train: 8 steps" in core.read_namespaced_pod_log(train_pod.metadata.name, NS)
    assert train_pod.status.container_statuses[0].image_id and train_pod.status.container_statuses[0].image
    assert train_pod.status.container_statuses[0].state.terminated.exit_code == 0
    wanted = {"PhaseProfiling", "PhaseOptimizing", "PhaseTraining", "PhaseSucceeded"}
    wait_until(lambda: {e.reason for e in core.list_namespaced_event(NS).items if e.involved_object.name == "quickstart"},
               lambda reasons: wanted <= reasons, timeout_s=20, what="the phase Events")  # posted after the status
    finished_second = wait_for(jobs, "quickstart-2", lambda j: phase(j) in ("Succeeded", "Failed"))
    assert finished_second["status"]["phase"] == "Succeeded", finished_second["status"]

    # Deleting the job removes every child (the garbage collector works asynchronously, as on any
    # cluster); the shared profile cache stays.
    jobs.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "quickstart")
    wait_for(jobs, "quickstart", lambda j: j is None, timeout_s=60)
    selector = "kareus.dev/job-name=quickstart"

    def children() -> list:
        return [*core.list_namespaced_pod(NS, label_selector=selector).items,
                *batch.list_namespaced_job(NS, label_selector=selector).items,
                *core.list_namespaced_config_map(NS, label_selector=selector).items,
                *core.list_namespaced_service(NS, label_selector=selector).items]

    wait_until(children, lambda left: left == [], timeout_s=60, what="garbage collection of the children")
    assert core.read_namespaced_config_map(done["status"]["profile"]["configMap"], NS).data["profile.json"]


def test_auto_backend_on_a_pod_without_a_gpu_fails_clearly_and_caches_nothing(cluster):
    """The emulated node's pods see no NVML device: `profiling.backend: auto` must not pass the
    simulator's numbers off as this GPU's profile."""
    _, jobs, core = cluster
    job = manifest("nogpu")
    job["spec"]["profiling"] = {"backend": "auto", "reuse": False}
    jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job)
    failed = wait_for(jobs, "nogpu", lambda j: phase(j) in ("Succeeded", "Failed"), timeout_s=180)
    assert conditions(failed)["Failed"] == ("True", "NoGPUVisible"), failed["status"]
    message = next(c["message"] for c in failed["status"]["conditions"] if c["type"] == "Failed")
    assert "no GPU is visible" in message and "not retryable" in message, message
    assert failed["status"].get("restarts", 0) == 0  # exit 78: the pod failure policy failed the Job at once
    key = failed["status"]["profile"]["key"]
    assert not key.startswith("sim-")
    assert read_or_none(lambda: core.read_namespaced_config_map(failed["status"]["profile"]["configMap"], NS)) is None


def test_a_training_pod_stopped_by_sigterm_holds_no_clock_afterwards(cluster):
    """Deleting a training pod mid-run (what a node drain or a preemption does): the kubelet sends
    SIGTERM, the ranks stop together after their step and exit 143, and the node agent no longer
    shows a clock locked by that pod (its lease ended, the GPU's clock was restored)."""
    _, jobs, core = cluster
    apps = client.AppsV1Api(core.api_client)
    job = manifest("graceful")
    job["spec"]["training"]["steps"] = 20000  # far more than the test lets it run
    jobs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job)
    url = agent_metrics_url(core, apps)
    selector = "kareus.dev/job-name=graceful,kareus.dev/role=train"

    def locking_train_pod() -> str | None:
        pods = {p.metadata.name for p in core.list_namespaced_pod(NS, label_selector=selector).items
                if p.status.phase == "Running"}
        return next(iter(pods & locked_by(url)), None)

    pod = wait_until(locking_train_pod, bool, timeout_s=300, what="a training pod holding a clock lock")
    exit_codes: list[int] = []
    stream = watch.Watch()

    def record_exit() -> None:
        for event in stream.stream(core.list_namespaced_pod, NS, field_selector=f"metadata.name={pod}",
                                   timeout_seconds=120):
            for status in event["object"].status.container_statuses or ():
                if status.state.terminated is not None:
                    exit_codes.append(status.state.terminated.exit_code)
            if event["type"] == "DELETED":
                stream.stop()

    watcher = threading.Thread(target=record_exit, daemon=True)
    watcher.start()
    core.delete_namespaced_pod(pod, NS)  # the default grace period: SIGTERM first
    watcher.join(timeout=130)
    assert exit_codes and set(exit_codes) == {143}, exit_codes  # stopped after a step, not killed
    wait_until(lambda: locked_by(url), lambda lockers: pod not in lockers, timeout_s=30,
               what=f"the node agent releasing {pod}'s clock lock")
    jobs.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "graceful")
    wait_for(jobs, "graceful", lambda j: j is None, timeout_s=60)
