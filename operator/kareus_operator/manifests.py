"""Pure builders of everything the operator creates for a KareusJob (dicts, no API calls).

The phases run as Kubernetes Jobs, as Kubeflow Trainer and JobSet run theirs, so the Job
controller's semantics (pod failure policy, backoff, suspension, Kueue's batch/v1 integration)
apply unchanged:

- `<job>-profile`: a batch Job of one pod that requests the job's GPUs per node, scheduled like
  a training pod, and publishes the profile cache (`kareus-profile-<key>`, deliberately *not*
  owned: it outlives the job so the next job with the same profile key reuses it);
- `<job>-optimize`: a batch Job of one CPU pod that publishes the plan (`<job>-plan`);
- `<job>-train`: an Indexed Job, one pod per node (completion index = node rank), with stable
  hostnames `<job>-train-<index>.<job>-train.<ns>.svc` through the headless Service of the same
  name and the rendezvous environment torchrun reads (`PET_*`, `MASTER_ADDR`, `MASTER_PORT`).

Names are deterministic, so creating twice is a 409 and a restarted operator finds what it made.
Children carry a controller ownerReference (garbage collected with the job) and labels with the
job's name, uid, their role and the job's Kueue queue; a queued child is created suspended and
Kueue admits it (all of its pods as one gang). Every pod runs its phase command under
`kareus-operator publish`, which writes the result into a ConfigMap with the pod's token.

Worker pods satisfy Pod Security `restricted` (non-root, no privilege escalation, all
capabilities dropped, RuntimeDefault seccomp, no hostPath): they reach the node daemon over
the node's address with a projected ServiceAccount token of audience `kareus-node`.
"""

from __future__ import annotations

import copy
import hashlib
import math
import posixpath
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from kareus.errors import NON_RETRYABLE_EXIT_CODES
from kareus.spec import JobSpec
from kareus_operator.ledger import LEDGER_FILE
from kareus_operator.settings import (
    DAEMON_TOKEN_AUDIENCE,
    DAEMON_TOKEN_DIR,
    EXPORT_DIR,
    JOB_FILE,
    LABEL_JOB,
    LABEL_JOB_UID,
    LABEL_PROFILE_KEY,
    LABEL_QUEUE,
    LABEL_ROLE,
    MOUNT_CHECKPOINTS,
    MOUNT_DATA,
    MOUNT_JOB,
    MOUNT_OUT,
    MOUNT_PLAN,
    MOUNT_PRETRAINED,
    MOUNT_PROFILE,
    PLAN_FILE,
    PLAN_FILE_GZ,
    PROFILE_FILE,
    Settings,
)

API_VERSION = "kareus.dev/v1alpha1"
KIND = "KareusJob"
KUEUE_LABELS = (LABEL_QUEUE, "kueue.x-k8s.io/priority-class")
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
CONTAINER = "kareus"
# The annotation the Job controller gives every pod of an Indexed Job.
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def profile_job_name(job_name: str) -> str:
    return f"{job_name}-profile"


def optimize_job_name(job_name: str) -> str:
    return f"{job_name}-optimize"


def train_job_name(job_name: str) -> str:
    return f"{job_name}-train"


def train_hostname(job_name: str, index: int) -> str:
    """The hostname the Job controller gives index `index` of the Indexed training Job."""
    return f"{train_job_name(job_name)}-{index}"


def train_service_name(job_name: str) -> str:
    return train_job_name(job_name)


def spec_configmap_name(job_name: str) -> str:
    return f"{job_name}-spec"


def plan_configmap_name(job_name: str) -> str:
    return f"{job_name}-plan"


def progress_configmap_name(job_name: str) -> str:
    return f"{job_name}-progress"


def profile_configmap_name(key: str) -> str:
    return f"kareus-profile-{label_value(key)}"


def measured_profile_configmap_name(job_name: str) -> str:
    """Where a job's profiling pod publishes what it measured; the operator copies it into the
    shared cache (`profile_cache`), which no worker writes."""
    return f"{job_name}-profile"


def profile_cache(namespace: str, key: str, profile_text: str, job_uid: str) -> dict[str, Any]:
    """The shared profile cache of `key`, as the operator writes it from a job's measured profile:
    unowned (it outlives the job), sealed with the measuring job's UID."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": profile_configmap_name(key), "namespace": namespace,
                         "labels": {LABEL_PROFILE_KEY: label_value(key), LABEL_JOB_UID: job_uid}},
            "data": {PROFILE_FILE: profile_text}}


def label_value(text: str) -> str:
    """A label-safe value (≤ 63 chars of [a-z0-9.-_]); long values keep a hash suffix to stay unique."""
    safe = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._")
    if len(safe) <= 63:
        return safe
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return f"{safe[:52].rstrip('-._')}-{digest}"


# A job's listening ports, per job so jobs sharing one host (the dev cluster's emulated nodes share
# its network) do not collide, and below Linux's ephemeral range (32768–60999 by default), where
# any outgoing connection on the host may hold the same local port and make the bind fail.
MASTER_PORTS = (20000, 26000)
METRICS_PORTS = (26000, 32400)  # 8-port blocks: local rank r serves base + r


def master_port(job_uid: str) -> int:
    """The torch rendezvous port of a job."""
    low, high = MASTER_PORTS
    return low + zlib.crc32(job_uid.encode()) % (high - low)


def metrics_port(job_uid: str) -> int:
    """The base of a training pod's metrics ports (local rank r serves base + r)."""
    low, high = METRICS_PORTS
    return low + (zlib.crc32(f"metrics/{job_uid}".encode()) % ((high - low) // 8)) * 8


def metrics_port_name(local_rank: int) -> str:
    """`metrics` for local rank 0 (what the chart's PodMonitor selects), `metrics-<r>` after it."""
    return "metrics" if local_rank == 0 else f"metrics-{local_rank}"


def gpu_node_label(product: str) -> str:
    """GPU Feature Discovery's spelling of a product (`NVIDIA-A100-SXM4-40GB`)."""
    return product if product.startswith("NVIDIA") else f"NVIDIA-{product}"


def rendezvous_env(timeout_s: float) -> dict[str, str]:
    """How long a training pod waits for all of its job's nodes: `kareus train`'s own rendezvous
    (KAREUS_RENDEZVOUS_TIMEOUT_S) and torchrun's (`--rdzv-conf` through PET_RDZV_CONF: `timeout` for
    the static rendezvous, `join_timeout` for c10d), in whole seconds."""
    seconds = str(max(1, math.ceil(timeout_s)))
    return {"KAREUS_RENDEZVOUS_TIMEOUT_S": seconds, "PET_RDZV_CONF": f"timeout={seconds},join_timeout={seconds}"}


def owner_reference(job: Mapping[str, Any]) -> dict[str, Any]:
    meta = job["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def queue_name(job: Mapping[str, Any]) -> str | None:
    return (job["metadata"].get("labels") or {}).get(LABEL_QUEUE) or None


def child_labels(job: Mapping[str, Any], role: str) -> dict[str, str]:
    meta = job["metadata"]
    labels = {LABEL_JOB: meta["name"], LABEL_JOB_UID: meta["uid"], LABEL_ROLE: role}
    # Kueue's batch/v1 integration admits a child Job by its queue and orders and preempts it by
    # its WorkloadPriorityClass: both are the KareusJob's.
    labels |= {key: value for key, value in (meta.get("labels") or {}).items() if key in KUEUE_LABELS and value}
    return labels


def _metadata(job: Mapping[str, Any], name: str, role: str) -> dict[str, Any]:
    return {"name": name, "namespace": job["metadata"]["namespace"], "labels": child_labels(job, role),
            "ownerReferences": [owner_reference(job)]}


def job_configmap(job: Mapping[str, Any], name: str, role: str) -> dict[str, Any]:
    """An empty ConfigMap a worker fills (the plan, the progress): created by the operator, so its
    ownerReference and `job-uid` label are the operator's — a worker may set neither (the chart's
    admission policy), which is what lets the operator trust what it reads back (issue 29)."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(job, name, role)}


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


# ---------------------------------------------------------------------- pod templates

Volume = tuple[str, dict[str, Any], str]  # (name, volume source, mount path)

_RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
                   "seccompProfile": {"type": "RuntimeDefault"}}
# A read-only root filesystem too: Kareus writes only to its mounted directories (/out, /tmp, /dev/shm).
_RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                         "runAsNonRoot": True, "readOnlyRootFilesystem": True,
                         "seccompProfile": {"type": "RuntimeDefault"}}


def _pod_template(job: Mapping[str, Any], spec: JobSpec, role: str, image: str, command: list[str],
                  volumes: Sequence[Volume], settings: Settings, *, gpus: int = 0,
                  env: Sequence[Mapping[str, Any]] = (), pull_policy: str = "",
                  resources: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The pod of one phase; with `gpus`, a GPU pod: it requests them, tolerates the GPU taint,
    gets a memory-backed /dev/shm for NCCL and a token for the node daemon. Every pod carries the
    settings' image pull secrets; `pull_policy` (empty: Kubernetes' default) is its image's."""
    all_volumes = [("job", {"configMap": {"name": spec_configmap_name(job["metadata"]["name"])}}, MOUNT_JOB),
                   ("out", {"emptyDir": {}}, MOUNT_OUT),
                   # HOME and every cache (torch, Triton, matplotlib) of the runtime image live here.
                   ("tmp", {"emptyDir": {}}, "/tmp"), *volumes]
    pod_env: list[dict[str, Any]] = [
        {"name": "KAREUS_JOB_NAME", "value": job["metadata"]["name"]},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    container: dict[str, Any] = {"name": CONTAINER, "image": image, "command": command,
                                 "securityContext": copy.deepcopy(_RESTRICTED_CONTAINER),
                                 "terminationMessagePolicy": "FallbackToLogsOnError"}
    if pull_policy:
        container["imagePullPolicy"] = pull_policy
    if resources is not None:
        container["resources"] = copy.deepcopy(dict(resources))
    pod_spec: dict[str, Any] = {"restartPolicy": "Never", "serviceAccountName": settings.service_account,
                                "securityContext": copy.deepcopy(_RESTRICTED_POD), "containers": [container]}
    if settings.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in settings.image_pull_secrets]
    if gpus:
        all_volumes += [("dshm", {"emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}}, "/dev/shm"),
                        ("node-token", {"projected": {"sources": [{"serviceAccountToken": {
                            "audience": DAEMON_TOKEN_AUDIENCE, "expirationSeconds": settings.node_token_expiration_s,
                            "path": "token"}}]}},
                         DAEMON_TOKEN_DIR)]
        pod_env += [{"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
                    {"name": "KAREUS_DAEMON_ADDRESS", "value": f"$(HOST_IP):{settings.node_daemon_port}"},
                    {"name": "KAREUS_DAEMON_TOKEN_FILE", "value": f"{DAEMON_TOKEN_DIR}/token"}]
        # Burstable: memory requested and limited (the limit holds the memory-backed /dev/shm).
        container["resources"] = {"requests": {"memory": settings.gpu_pod_memory_request},
                                  "limits": {GPU_RESOURCE: str(gpus), "memory": settings.gpu_pod_memory_limit}}
        pod_spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
        if spec.gpu_pinned:
            pod_spec["nodeSelector"] = {GPU_PRODUCT_LABEL: gpu_node_label(spec.gpu_product)}
    pod_env += [{"name": k, "value": v} for k, v in settings.extra_pod_env.items()]
    container["env"] = [*pod_env, *env]
    container["volumeMounts"] = [{"name": n, "mountPath": m} for n, _, m in all_volumes]
    pod_spec["volumes"] = [{"name": n, **source} for n, source, _ in all_volumes]
    template = {"metadata": {"labels": child_labels(job, role)}, "spec": pod_spec}
    for override in spec.pod_overrides:
        if role in override.roles:
            apply_override(template, override)
    return template


def apply_override(template: dict[str, Any], override: Any) -> None:
    """Merge one `spec.podTemplateOverrides` entry into a pod template: maps merge (the override
    wins), lists append, resources merge per resource; the operator's own labels stay."""
    meta, pod, container = template["metadata"], template["spec"], template["spec"]["containers"][0]
    own_labels = dict(meta["labels"])
    meta["labels"] = {**override.labels, **own_labels}
    if override.annotations:
        meta["annotations"] = {**meta.get("annotations", {}), **override.annotations}
    if override.node_selector:
        pod["nodeSelector"] = {**pod.get("nodeSelector", {}), **override.node_selector}
    for key, items in (("tolerations", override.tolerations), ("imagePullSecrets", override.image_pull_secrets),
                       ("volumes", override.volumes)):
        if items:
            pod[key] = [*pod.get(key, []), *copy.deepcopy(list(items))]
    if override.affinity:
        pod["affinity"] = copy.deepcopy(override.affinity)
    if override.priority_class_name:
        pod["priorityClassName"] = override.priority_class_name
    if override.volume_mounts:
        container["volumeMounts"] = [*container["volumeMounts"], *copy.deepcopy(list(override.volume_mounts))]
    if override.env:
        container["env"] = [*container["env"], *({"name": v.name, "value": v.value} for v in override.env)]
    if override.resources is not None:
        resources = container.setdefault("resources", {})
        for part in ("requests", "limits"):
            values = getattr(override.resources, part)
            if values:
                resources[part] = {**resources.get(part, {}), **values}


def _batch_job(job: Mapping[str, Any], name: str, role: str, template: dict[str, Any], *,
               backoff_limit: int, settings: Settings, completions: int = 1, indexed: bool = False,
               suspend: bool = False) -> dict[str, Any]:
    """A batch/v1 Job around one pod template, with the pod failure policy every phase shares:
    disruptions (preemption, eviction, node drain) do not count against the backoff limit; a
    non-retryable exit code fails the Job at once."""
    rules = [{"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                   "values": list(NON_RETRYABLE_EXIT_CODES)}},
             {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
    body: dict[str, Any] = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(job, name, role),
        "spec": {"completions": completions, "parallelism": completions, "backoffLimit": backoff_limit,
                 "podFailurePolicy": {"rules": rules}, "podReplacementPolicy": "Failed",
                 "manualSelector": False, "suspend": suspend or queue_name(job) is not None,
                 "ttlSecondsAfterFinished": None, "template": template}}
    body["spec"] = {k: v for k, v in body["spec"].items() if v is not None}
    if indexed:
        body["spec"]["completionMode"] = "Indexed"
    return body


def profile_job(job: Mapping[str, Any], spec: JobSpec, settings: Settings, profile_key: str, *,
                suspend: bool = False) -> dict[str, Any]:
    out = f"{MOUNT_OUT}/{PROFILE_FILE}"
    phase = _expand(settings.profile_command, {"job": f"{MOUNT_JOB}/{JOB_FILE}", "profile": out,
                                               "out": MOUNT_OUT, "backend": spec.profiling.backend})
    if spec.profiling.backend == "auto":
        phase.append("--require-gpu")  # in a pod, `auto` never falls back to the simulator
    # Into the job's own ConfigMap (created by the operator); the operator fills the shared cache.
    name = job["metadata"]["name"]
    publish = [*settings.publish_command, "--configmap", measured_profile_configmap_name(name),
               "--label", f"{LABEL_JOB}={name}", "--file", f"{PROFILE_FILE}={out}", "--"]
    template = _pod_template(job, spec, "profile", settings.image, publish + phase, [], settings,
                             gpus=spec.training.gpus_per_node, pull_policy=settings.image_pull_policy)
    return _batch_job(job, profile_job_name(job["metadata"]["name"]), "profile", template,
                      backoff_limit=spec.backoff_limit, settings=settings, suspend=suspend)


def optimize_job(job: Mapping[str, Any], spec: JobSpec, settings: Settings, profile_key: str, *,
                 suspend: bool = False) -> dict[str, Any]:
    name = job["metadata"]["name"]
    out = f"{MOUNT_OUT}/{PLAN_FILE}"
    phase = _expand(settings.optimize_command, {"job": f"{MOUNT_JOB}/{JOB_FILE}", "out": MOUNT_OUT,
                                                "profile": f"{MOUNT_PROFILE}/{PROFILE_FILE}", "plan": out})
    # No --owner: the operator created the ConfigMap with its ownerReference (job_configmap).
    publish = [*settings.publish_command, "--configmap", plan_configmap_name(name),
               "--label", f"{LABEL_JOB}={name}", "--gzip-file", f"{PLAN_FILE_GZ}={out}", "--"]
    profile_volume = ("profile", {"configMap": {"name": profile_configmap_name(profile_key)}}, MOUNT_PROFILE)
    # Requests and a memory limit by default (a job's overrides may change them per resource).
    resources = {"requests": {"cpu": settings.optimize_pod_cpu_request, "memory": settings.optimize_pod_memory_request},
                 "limits": {"memory": settings.optimize_pod_memory_limit}}
    template = _pod_template(job, spec, "optimize", settings.image, publish + phase, [profile_volume], settings,
                             pull_policy=settings.image_pull_policy, resources=resources)
    return _batch_job(job, optimize_job_name(name), "optimize", template, backoff_limit=spec.backoff_limit,
                      settings=settings, suspend=suspend)


def train_service(job: Mapping[str, Any]) -> dict[str, Any]:
    """Headless Service: stable DNS names `<job>-train-<n>.<job>-train.<ns>.svc` for the rendezvous."""
    name = job["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(job, train_service_name(name), "train"),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {LABEL_JOB: name, LABEL_ROLE: "train"},
                     "ports": [{"name": "rendezvous", "port": master_port(job["metadata"]["uid"])}]}}


def checkpoint_dir(job_name: str) -> str:
    """Where a job's checkpoints (and its progress ledger) live on its checkpoint claim."""
    return f"{MOUNT_CHECKPOINTS}/{job_name}"


def export_subdir(job_uid: str) -> str:
    """Where a job's Hugging Face export lives on its checkpoint claim, relative to the claim's root.
    Keyed by the uid, not the name: a job recreated under the same name never overwrites an earlier
    job's model, and its checkpoints (under the name) still resume."""
    return f"{job_uid}/{EXPORT_DIR}"


def export_status_path(job: Mapping[str, Any], spec: JobSpec) -> str | None:
    """`status.export.path` of a succeeded job that exports: `<checkpoint claim>:<job uid>/export`."""
    ckpt = spec.training.checkpoint
    if spec.training.export is None or ckpt is None or ckpt.claim_name is None:
        return None
    return f"{ckpt.claim_name}:{export_subdir(job['metadata']['uid'])}"


def storage(job: Mapping[str, Any], spec: JobSpec) -> tuple[list[Volume], list[str], list[str]]:
    """The training pods' claims (checkpoints read-write, data and pretrained weights read-only),
    the runtime's flags for them and the publisher's (the ledger that carries progress across
    restarts): none without a claim, so a job without one runs as it always did."""
    volumes: list[Volume] = []
    runtime: list[str] = []
    publisher: list[str] = []
    ckpt, data, pretrained = spec.training.checkpoint, spec.training.data, spec.model.pretrained
    if ckpt is not None and ckpt.claim_name is not None:
        directory = checkpoint_dir(job["metadata"]["name"])
        volumes.append(("kareus-checkpoints", {"persistentVolumeClaim": {"claimName": ckpt.claim_name}}, MOUNT_CHECKPOINTS))
        runtime += ["--checkpoint-dir", directory, "--checkpoint-every", str(ckpt.every_steps)]
        if ckpt.keep is not None:
            runtime += ["--checkpoint-keep", str(ckpt.keep)]
        if spec.training.export is not None:
            runtime += ["--export-dir", f"{MOUNT_CHECKPOINTS}/{export_subdir(job['metadata']['uid'])}"]
        publisher += ["--ledger", f"{directory}/{LEDGER_FILE}", "--checkpoint-dir", directory]
    if pretrained is not None:
        volumes.append(("kareus-pretrained", {"persistentVolumeClaim": {"claimName": pretrained.claim_name,
                                                                        "readOnly": True}}, MOUNT_PRETRAINED))
        # normpath: `.` (the claim's root) is the mount itself, not `/var/kareus/pretrained/.`
        runtime += ["--init-from", posixpath.normpath(f"{MOUNT_PRETRAINED}/{pretrained.path}")]
    if data is not None:
        path = data.path
        if data.claim_name is not None:
            volumes.append(("kareus-data", {"persistentVolumeClaim": {"claimName": data.claim_name, "readOnly": True}},
                            MOUNT_DATA))
            path = f"{MOUNT_DATA}/{data.path}"
        runtime += ["--data", path, "--data-format", data.format]
    return volumes, runtime, publisher


def train_job(job: Mapping[str, Any], spec: JobSpec, settings: Settings, *, suspend: bool = False) -> dict[str, Any]:
    """The Indexed training Job. Its own backoff limit is 0: one failed rank fails the step for
    every rank, so the operator restarts the whole gang (as JobSet's failure policy does) and
    counts restarts against `spec.backoffLimit`; disruptions are ignored by the pod failure policy
    and restarted by the operator without counting."""
    meta = job["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    training = spec.training
    values = {"job": f"{MOUNT_JOB}/{JOB_FILE}", "plan": f"{MOUNT_PLAN}/{PLAN_FILE_GZ}", "out": MOUNT_OUT,
              "nproc": str(training.gpus_per_node)}
    claims, storage_args, ledger_args = storage(job, spec)
    command = list(training.command) or list(settings.train_command)
    command += _expand(settings.train_args, values) + storage_args + list(training.args)
    # Every rank runs the publisher; only node rank 0 follows train.jsonl (the others just run).
    command = [*settings.publish_command, "--configmap", progress_configmap_name(name),
               "--label", f"{LABEL_JOB}={name}", "--follow", f"{MOUNT_OUT}/train.jsonl", "--follow-if-rank0",
               "--interval-s", str(settings.progress_interval_s), *ledger_args, "--", *command]
    master = f"{train_hostname(name, 0)}.{train_service_name(name)}.{namespace}.svc"
    port = str(master_port(meta["uid"]))
    index = {"valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}}
    own_env = {var.name for var in training.env}
    env: list[dict[str, Any]] = [
        {"name": "NODE_RANK", **index}, {"name": "PET_NODE_RANK", **index},
        *({"name": k, "value": v} for k, v in {
            "MASTER_ADDR": master, "MASTER_PORT": port, "PET_MASTER_ADDR": master, "PET_MASTER_PORT": port,
            "NNODES": str(training.nodes), "PET_NNODES": str(training.nodes),
            "NPROC_PER_NODE": str(training.gpus_per_node), "PET_NPROC_PER_NODE": str(training.gpus_per_node),
            "KAREUS_METRICS_PORT": str(metrics_port(meta["uid"]))}.items()),
        # How long the nodes wait for each other; a job's own value in training.env wins.
        *({"name": k, "value": v} for k, v in rendezvous_env(settings.rendezvous_timeout_s).items() if k not in own_env),
        *({"name": var.name, "value": var.value} for var in training.env)]
    plan_volume = ("plan", {"configMap": {"name": plan_configmap_name(name)}}, MOUNT_PLAN)
    template = _pod_template(job, spec, "train", training.image, command, [plan_volume, *claims], settings,
                             gpus=training.gpus_per_node, env=env)
    pod = template["spec"]
    pod["subdomain"] = train_service_name(name)
    container = pod["containers"][0]
    for mount in container["volumeMounts"]:
        if mount["name"] in ("kareus-data", "kareus-pretrained"):
            mount["readOnly"] = True
    if training.resources is not None:
        for part in ("requests", "limits"):
            container["resources"].setdefault(part, {}).update(getattr(training.resources, part))
    base = metrics_port(meta["uid"])  # one Prometheus endpoint per local rank (its GPU's series)
    container["ports"] = [{"name": metrics_port_name(rank), "containerPort": base + rank, "protocol": "TCP"}
                          for rank in range(training.gpus_per_node)]
    return _batch_job(job, train_job_name(name), "train", template, backoff_limit=0, settings=settings,
                      completions=training.nodes, indexed=True, suspend=suspend)
