"""Pure builders of everything the operator creates for a KareusJob (dicts, no API calls).

Names are deterministic (`<job>-profile`, `<job>-optimize`, `<job>-train-<n>`, `<job>-train` for
the headless Service, `<job>-spec`, `<job>-plan`, `<job>-progress`), so creating twice is a 409 and
a restarted operator finds what it made. Children carry a controller ownerReference (garbage
collected with the job) and labels with the job's name, uid, their role, and the job's Kueue queue
label. The profile cache (`kareus-profile-<key>`) is deliberately *not* owned: it outlives the job
so the next job with the same profile key reuses it.

Every pod runs its phase command under `kareus-operator publish`, which writes the result (profile,
plan, training progress) into a ConfigMap with the pod's service account.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Mapping
from typing import Any

import yaml

from kareus.spec import JobSpec
from kareus_operator.settings import (
    JOB_FILE,
    LABEL_JOB,
    LABEL_JOB_UID,
    LABEL_PROFILE_KEY,
    LABEL_QUEUE,
    LABEL_ROLE,
    MOUNT_JOB,
    MOUNT_OUT,
    MOUNT_PLAN,
    MOUNT_PROFILE,
    PLAN_FILE,
    PROFILE_FILE,
    Settings,
)

API_VERSION = "kareus.dev/v1alpha1"
KIND = "KareusJob"


def profile_pod_name(job_name: str) -> str:
    return f"{job_name}-profile"


def optimize_pod_name(job_name: str) -> str:
    return f"{job_name}-optimize"


def train_pod_name(job_name: str, index: int) -> str:
    return f"{job_name}-train-{index}"


def train_service_name(job_name: str) -> str:
    return f"{job_name}-train"


def spec_configmap_name(job_name: str) -> str:
    return f"{job_name}-spec"


def plan_configmap_name(job_name: str) -> str:
    return f"{job_name}-plan"


def progress_configmap_name(job_name: str) -> str:
    return f"{job_name}-progress"


def profile_configmap_name(key: str) -> str:
    return f"kareus-profile-{label_value(key)}"


def label_value(text: str) -> str:
    """A label-safe value (≤ 63 chars of [a-z0-9.-_]); long values keep a hash suffix to stay unique."""
    safe = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._")
    if len(safe) <= 63:
        return safe
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return f"{safe[:52].rstrip('-._')}-{digest}"


def master_port(job_uid: str) -> int:
    """The torch rendezvous port; per job, so jobs sharing a host (the dev cluster) never collide."""
    return 20000 + zlib.crc32(job_uid.encode()) % 20000


def metrics_port(job_uid: str) -> int:
    """The base of a training pod's metrics ports (local rank r serves base + r): per job, for the
    same reason as `master_port`; 8-port blocks in 41000–56999."""
    return 41000 + (zlib.crc32(f"metrics/{job_uid}".encode()) % 2000) * 8


def metrics_port_name(local_rank: int) -> str:
    """`metrics` for local rank 0 (what the chart's PodMonitor selects), `metrics-<r>` after it."""
    return "metrics" if local_rank == 0 else f"metrics-{local_rank}"


def owner_reference(job: Mapping[str, Any]) -> dict[str, Any]:
    meta = job["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def child_labels(job: Mapping[str, Any], role: str) -> dict[str, str]:
    meta = job["metadata"]
    labels = {LABEL_JOB: meta["name"], LABEL_JOB_UID: meta["uid"], LABEL_ROLE: role}
    queue = (meta.get("labels") or {}).get(LABEL_QUEUE)
    if queue:
        labels[LABEL_QUEUE] = queue  # Kueue admits/preempts by it; children must carry it too
    return labels


def _metadata(job: Mapping[str, Any], name: str, role: str) -> dict[str, Any]:
    return {"name": name, "namespace": job["metadata"]["namespace"], "labels": child_labels(job, role),
            "ownerReferences": [owner_reference(job)]}


def spec_configmap(job: Mapping[str, Any]) -> dict[str, Any]:
    """The job manifest as the pods read it (`kareus profile|optimize|train JOB.yaml`)."""
    meta = job["metadata"]
    manifest = {"apiVersion": API_VERSION, "kind": KIND,
                "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "spec": job["spec"]}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(job, spec_configmap_name(meta["name"]), "spec"),
            "data": {JOB_FILE: yaml.safe_dump(manifest, sort_keys=False)}}


_PLACEHOLDER = re.compile(r"\{(job|profile|plan|out|nproc|backend)\}")


def _expand(template: tuple[str, ...], values: Mapping[str, str]) -> list[str]:
    """Fill `{job}`-style placeholders; other braces (e.g. in a `python -c` program) stay as they are."""
    return [_PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), part) for part in template]


def _owner_arg(job: Mapping[str, Any]) -> str:
    meta = job["metadata"]
    return f"{API_VERSION}/{KIND}/{meta['name']}/{meta['uid']}"


def _pod(job: Mapping[str, Any], name: str, role: str, image: str, command: list[str],
         volumes: list[tuple[str, dict[str, Any], str]], settings: Settings,
         env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A run-once pod; `volumes` are (name, volume source, mount path)."""
    job_volume = ("job", {"configMap": {"name": spec_configmap_name(job["metadata"]["name"])}}, MOUNT_JOB)
    out_volume = ("out", {"emptyDir": {}}, MOUNT_OUT)
    all_volumes = [job_volume, out_volume, *volumes]
    pod_env = [{"name": "KAREUS_JOB_NAME", "value": job["metadata"]["name"]},
               {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    pod_env += [{"name": k, "value": v} for k, v in {**settings.extra_pod_env, **(env or {})}.items()]
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": _metadata(job, name, role),
        "spec": {
            "restartPolicy": "Never",
            "serviceAccountName": settings.service_account,
            "containers": [{
                "name": "kareus", "image": image, "command": command, "env": pod_env,
                "volumeMounts": [{"name": n, "mountPath": m} for n, _, m in all_volumes],
            }],
            "volumes": [{"name": n, **source} for n, source, _ in all_volumes],
        },
    }


def profile_pod(job: Mapping[str, Any], spec: JobSpec, settings: Settings, profile_key: str) -> dict[str, Any]:
    out = f"{MOUNT_OUT}/{PROFILE_FILE}"
    phase = _expand(settings.profile_command, {"job": f"{MOUNT_JOB}/{JOB_FILE}", "profile": out,
                                               "out": MOUNT_OUT, "backend": spec.profiling.backend})
    publish = [*settings.publish_command, "--configmap", profile_configmap_name(profile_key),
               "--label", f"{LABEL_PROFILE_KEY}={label_value(profile_key)}", "--file", f"{PROFILE_FILE}={out}", "--"]
    return _pod(job, profile_pod_name(job["metadata"]["name"]), "profile", settings.image, publish + phase, [], settings)


def optimize_pod(job: Mapping[str, Any], settings: Settings, profile_key: str) -> dict[str, Any]:
    name = job["metadata"]["name"]
    out = f"{MOUNT_OUT}/{PLAN_FILE}"
    phase = _expand(settings.optimize_command, {"job": f"{MOUNT_JOB}/{JOB_FILE}", "out": MOUNT_OUT,
                                                "profile": f"{MOUNT_PROFILE}/{PROFILE_FILE}", "plan": out})
    publish = [*settings.publish_command, "--configmap", plan_configmap_name(name), "--owner", _owner_arg(job),
               "--label", f"{LABEL_JOB}={name}", "--file", f"{PLAN_FILE}={out}", "--"]
    profile_volume = ("profile", {"configMap": {"name": profile_configmap_name(profile_key)}}, MOUNT_PROFILE)
    return _pod(job, optimize_pod_name(name), "optimize", settings.image, publish + phase, [profile_volume], settings)


def train_service(job: Mapping[str, Any]) -> dict[str, Any]:
    """Headless Service: stable DNS names `<job>-train-<n>.<job>-train.<ns>.svc` for the rendezvous."""
    name = job["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(job, train_service_name(name), "train"),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {LABEL_JOB: name, LABEL_ROLE: "train"},
                     "ports": [{"name": "rendezvous", "port": master_port(job["metadata"]["uid"])}]}}


def train_pod(job: Mapping[str, Any], spec: JobSpec, settings: Settings, index: int) -> dict[str, Any]:
    meta = job["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    training = spec.training
    values = {"job": f"{MOUNT_JOB}/{JOB_FILE}", "plan": f"{MOUNT_PLAN}/{PLAN_FILE}", "out": MOUNT_OUT,
              "nproc": str(training.gpus_per_node)}
    command = list(training.command) or list(settings.train_command)
    command += _expand(settings.train_args, values) + list(training.args)
    if index == 0:
        command = [*settings.publish_command, "--configmap", progress_configmap_name(name), "--owner", _owner_arg(job),
                   "--label", f"{LABEL_JOB}={name}", "--follow", f"{MOUNT_OUT}/train.jsonl",
                   "--interval-s", str(settings.progress_interval_s), "--", *command]
    env = {
        "MASTER_ADDR": f"{train_pod_name(name, 0)}.{train_service_name(name)}.{namespace}.svc",
        "MASTER_PORT": str(master_port(meta["uid"])), "NNODES": str(training.nodes), "NODE_RANK": str(index),
        "NPROC_PER_NODE": str(training.gpus_per_node), "KAREUS_DAEMON_SOCKET": f"{settings.node_socket_dir}/node.sock",
        "KAREUS_METRICS_PORT": str(metrics_port(meta["uid"])),
        **{var.name: var.value for var in training.env},
    }
    plan_volume = ("plan", {"configMap": {"name": plan_configmap_name(name)}}, MOUNT_PLAN)
    socket_volume = ("node-socket", {"hostPath": {"path": settings.node_socket_dir, "type": "DirectoryOrCreate"}},
                     settings.node_socket_dir)
    pod = _pod(job, train_pod_name(name, index), "train", training.image, command, [plan_volume, socket_volume],
               settings, env)
    pod["metadata"]["labels"][f"{LABEL_ROLE}-index"] = str(index)
    pod["spec"]["hostname"] = train_pod_name(name, index)
    pod["spec"]["subdomain"] = train_service_name(name)
    resources: dict[str, dict[str, str]] = {"limits": {"nvidia.com/gpu": str(training.gpus_per_node)}}
    if training.resources is not None:
        for part in ("requests", "limits"):
            resources.setdefault(part, {}).update(getattr(training.resources, part))
    pod["spec"]["containers"][0]["resources"] = resources
    base = metrics_port(meta["uid"])  # one Prometheus endpoint per local rank (its GPU's series)
    pod["spec"]["containers"][0]["ports"] = [
        {"name": metrics_port_name(rank), "containerPort": base + rank, "protocol": "TCP"}
        for rank in range(training.gpus_per_node)]
    gpu = (job["spec"].get("gpu") or {}).get("product")
    if gpu:
        pod["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": gpu if gpu.startswith("NVIDIA") else f"NVIDIA-{gpu}"}
    return pod
