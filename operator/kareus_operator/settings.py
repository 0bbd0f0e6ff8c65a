"""Every operator knob in one frozen object, read from the environment (the Helm chart sets it).

Pod commands are templates: `{job}` is the job manifest file, `{profile}` the profile document,
`{plan}` the plan, `{out}` the pod's output directory and `{nproc}` the processes per node. Tests
and the scale benchmark swap them for fast fake commands; production uses the defaults below, the
real `kareus profile|optimize|train` entry points.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field

from kareus import __version__
from kareus.errors import KareusError

PREFIX = "kareus.dev"
LABEL_JOB = f"{PREFIX}/job-name"
LABEL_JOB_UID = f"{PREFIX}/job-uid"
LABEL_ROLE = f"{PREFIX}/role"
LABEL_PROFILE_KEY = f"{PREFIX}/profile-key"
LABEL_QUEUE = "kueue.x-k8s.io/queue-name"
ANNOTATION_PLAN_REVISION = f"{PREFIX}/plan-revision"

MOUNT_JOB = "/etc/kareus/job"
MOUNT_PROFILE = "/etc/kareus/profile"
MOUNT_PLAN = "/etc/kareus/plan"
MOUNT_OUT = "/var/kareus/out"
MOUNT_CHECKPOINTS = "/var/kareus/checkpoints"  # spec.training.checkpoint.claimName; the job's in <job name>/
MOUNT_DATA = "/var/kareus/data"  # spec.training.data.claimName, read-only
MOUNT_PRETRAINED = "/var/kareus/pretrained"  # spec.model.pretrained.claimName, read-only
EXPORT_DIR = "export"  # spec.training.export: <checkpoint claim>/<job uid>/export
JOB_FILE = "job.yaml"
PROFILE_FILE = "profile.json"
PLAN_FILE = "plan.json"
PLAN_FILE_GZ = "plan.json.gz"
# Worker pods reach the node daemon on their node's address with a projected ServiceAccount token
# of this audience (a token for the API server is not accepted there, and this one is not by it).
DAEMON_TOKEN_AUDIENCE = "kareus-node"
DAEMON_TOKEN_DIR = "/var/run/secrets/kareus.dev/node"
# The runtime image as `make images` tags it (images/runtime.Dockerfile), the chart's operator.workerImage.
DEFAULT_IMAGE = f"localhost/kareus/runtime:{__version__}"
PULL_POLICIES = ("", "Always", "IfNotPresent", "Never")
MEMORY_CHECKS = ("refuse", "warn", "off")


@dataclass(frozen=True)
class Settings:
    """See the module docstring; env names are KAREUS_OPERATOR_<FIELD in upper case>."""

    # The profile and optimize pods' image and its pull policy ("" leaves Kubernetes' default); training
    # pods run the job's spec.training.image.
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    # Secret names set as imagePullSecrets on every pod the operator creates (the chart's workers.imagePullSecrets).
    image_pull_secrets: tuple[str, ...] = ()
    profile_command: tuple[str, ...] = ("kareus", "profile", "{job}", "--backend", "{backend}", "--out", "{profile}")
    optimize_command: tuple[str, ...] = ("kareus", "optimize", "{job}", "--profile", "{profile}", "--out", "{plan}")
    # Used when the job gives no training.command; the job's command gets the same arguments appended.
    train_command: tuple[str, ...] = ("kareus", "train")
    train_args: tuple[str, ...] = ("{job}", "--plan", "{plan}", "--out", "{out}", "--nproc", "{nproc}")
    publish_command: tuple[str, ...] = ("kareus-operator", "publish")
    policy_configmap: str = "kareus-policy"
    policy_namespace: str = "kareus-system"
    # Where the node agents read the per-pod clock ceilings that enforce the power budget (their own
    # namespace, which tenants cannot write; the chart's nodeAgent.namespace.name). Empty: not published,
    # and a power budget stays advisory (the operator warns).
    clock_ceilings_namespace: str = ""
    clock_ceilings_configmap: str = "kareus-clock-ceilings"
    # The Kueue AdmissionCheck this operator answers (controllerName kareus.dev/energy-budget), and the
    # ClusterQueues it adds that check to (the chart's kueue.energyBudgetCheck). Checks of any name with
    # that controllerName are answered; the name matters only for attaching.
    energy_admission_check: str = "kareus-energy-budget"
    energy_admission_clusterqueues: tuple[str, ...] = ()
    # The node daemon's TCP port on every GPU node (the chart's nodeAgent.port).
    node_daemon_port: int = 9477
    # /dev/shm of GPU pods: a memory-backed emptyDir (NCCL's shared-memory transport needs far
    # more than a container runtime's default 64 MiB with several ranks per node).
    shm_size: str = "16Gi"
    # Memory of each GPU pod (profiling and training): requested and limited, so the pod is Burstable and
    # the kernel, not an eviction, bounds it. The limit must exceed shm_size: /dev/shm is charged to it.
    gpu_pod_memory_request: str = "8Gi"
    gpu_pod_memory_limit: str = "64Gi"
    # The optimize pod (CPU only): requested, so the scheduler counts it, and its memory limited, so a
    # job at the spec's size bounds cannot take a node's memory (the chart's workers.optimizePods).
    optimize_pod_cpu_request: str = "1"
    optimize_pod_memory_request: str = "2Gi"
    optimize_pod_memory_limit: str = "16Gi"
    service_account: str = "kareus-worker"
    # How long a training pod waits for every node of its job at the rendezvous: `kareus train` reads
    # KAREUS_RENDEZVOUS_TIMEOUT_S, torchrun PET_RDZV_CONF (timeout=, join_timeout=).
    rendezvous_timeout_s: float = 600.0
    # The lifetime of the GPU pods' node-agent token (a projected ServiceAccount token, audience
    # kareus-node): the kubelet rotates it at 80 % of this, the clock client hands the daemon the new
    # one. The API server refuses less than 600 s.
    node_token_expiration_s: int = 3600
    # A safety net only: children's and the job's own watch events drive reconciles, and backoff,
    # deadline and TTL wake-ups are timed precisely; a running job costs ~4 requests per pass.
    resync_s: float = 120.0
    max_concurrent_reconciles: int = 16
    backoff_base_s: float = 10.0
    backoff_max_s: float = 360.0
    # Training progress (train.jsonl summary) is published at most this often: each publish is one
    # ConfigMap write and one status write.
    progress_interval_s: float = 60.0
    watch_namespaces: tuple[str, ...] = ()
    # Replicas elect a leader on this Lease (in the pod's namespace); empty: no election.
    leader_election_lease: str = "kareus-operator"
    lease_duration_s: float = 15.0
    extra_pod_env: Mapping[str, str] = field(default_factory=dict)
    # A job whose memory plan (kareus.workload.memory) does not fit its GPU: `refuse` fails it before any
    # child exists (reason DoesNotFit); `warn` says so in a Warning Event and goes on (the dev cluster:
    # emulated GPUs train CPU proxies of jobs meant for real ones); `off` skips the plan.
    memory_check: str = "refuse"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for name, default in cls.__dataclass_fields__.items():
            raw = env.get(f"KAREUS_OPERATOR_{name.upper()}")
            if raw is None:
                continue
            values[name] = _parse(name, raw, default.default if default.default is not MISSING else default.default_factory())
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        """Cross-field rules: the GPU pods' memory holds their /dev/shm; names and token lifetimes
        the API server accepts."""
        if self.node_token_expiration_s < MIN_TOKEN_EXPIRATION_S:
            raise KareusError(f"KAREUS_OPERATOR_NODE_TOKEN_EXPIRATION_S: must be at least {MIN_TOKEN_EXPIRATION_S} "
                              f"(the API server's shortest projected token), got {self.node_token_expiration_s}")
        for name, pattern, what in (("clock_ceilings_namespace", _DNS_LABEL, "a namespace name (RFC 1123 label)"),
                                    ("clock_ceilings_configmap", _DNS_SUBDOMAIN, "a ConfigMap name (RFC 1123 subdomain)")):
            value = getattr(self, name)
            if (value or name != "clock_ceilings_namespace") and not pattern.fullmatch(value):
                raise KareusError(f"KAREUS_OPERATOR_{name.upper()}: must be {what}, got {value!r}")
        shm, request = memory_bytes("shm_size", self.shm_size), memory_bytes("gpu_pod_memory_request",
                                                                              self.gpu_pod_memory_request)
        limit = memory_bytes("gpu_pod_memory_limit", self.gpu_pod_memory_limit)
        if limit <= shm:
            raise KareusError(f"KAREUS_OPERATOR_GPU_POD_MEMORY_LIMIT: must exceed KAREUS_OPERATOR_SHM_SIZE "
                              f"({self.shm_size}), since /dev/shm counts against it; got {self.gpu_pod_memory_limit}")
        if request > limit:
            raise KareusError(f"KAREUS_OPERATOR_GPU_POD_MEMORY_REQUEST: must be at most the limit "
                              f"({self.gpu_pod_memory_limit}), got {self.gpu_pod_memory_request}")
        cpu_quantity("optimize_pod_cpu_request", self.optimize_pod_cpu_request)
        if memory_bytes("optimize_pod_memory_request", self.optimize_pod_memory_request) > memory_bytes(
                "optimize_pod_memory_limit", self.optimize_pod_memory_limit):
            raise KareusError(f"KAREUS_OPERATOR_OPTIMIZE_POD_MEMORY_REQUEST: must be at most the limit "
                              f"({self.optimize_pod_memory_limit}), got {self.optimize_pod_memory_request}")


MIN_TOKEN_EXPIRATION_S = 600  # the TokenRequest API's floor for expirationSeconds
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_MEMORY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_FACTORS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def memory_bytes(name: str, quantity: str) -> float:
    """A Kubernetes memory quantity (`512Mi`, `16Gi`, `1G`) in bytes; a bad one names its setting."""
    match = _MEMORY.match(quantity)
    if match is None or float(match.group(1)) <= 0:
        raise KareusError(f"KAREUS_OPERATOR_{name.upper()}: must be a positive memory quantity such as 512Mi "
                          f"or 16Gi, got {quantity!r}")
    return float(match.group(1)) * _FACTORS[match.group(2)]


_CPU = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m)?$")


def cpu_quantity(name: str, quantity: str) -> float:
    """A Kubernetes CPU quantity (`1`, `500m`, `2.5`) in cores; a bad one names its setting."""
    match = _CPU.match(quantity)
    if match is None or float(match.group(1)) <= 0:
        raise KareusError(f"KAREUS_OPERATOR_{name.upper()}: must be a positive CPU quantity such as 1 or 500m, "
                          f"got {quantity!r}")
    return float(match.group(1)) / (1000 if match.group(2) else 1)


def _parse(name: str, raw: str, default: object) -> object:
    key = f"KAREUS_OPERATOR_{name.upper()}"
    try:
        if isinstance(default, tuple):
            value = json.loads(raw) if raw.startswith("[") else [p for p in raw.split(",") if p]
            if not all(isinstance(v, str) for v in value):
                raise ValueError
            return tuple(value)
        if isinstance(default, int):
            number = int(raw)
            if number < 1:
                raise ValueError
            return number
        if isinstance(default, float):
            number = float(raw)
            if not math.isfinite(number) or number <= 0:
                raise ValueError
            return number
        if name == "image_pull_policy" and raw not in PULL_POLICIES:
            raise ValueError
        if name == "memory_check" and raw not in MEMORY_CHECKS:
            raise ValueError
        if name == "extra_pod_env":
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError
            return {str(k): str(v) for k, v in value.items()}
        return raw
    except ValueError:
        allowed = ("a JSON list of strings or a comma-separated list" if isinstance(default, tuple)
                   else "an integer >= 1" if isinstance(default, int)
                   else "a positive number" if isinstance(default, float)
                   else "a JSON object of strings" if name == "extra_pod_env"
                   else f"one of {', '.join(repr(p) for p in PULL_POLICIES)}" if name == "image_pull_policy"
                   else f"one of {', '.join(MEMORY_CHECKS)}" if name == "memory_check"
                   else "a string")
        raise KareusError(f"{key}: must be {allowed}, got {raw!r}") from None
