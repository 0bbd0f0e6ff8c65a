"""Parsing and validating KareusJob manifests into `kareus.spec.types` values.

Validation happens in two passes, both collecting every error: field by field (types, bounds,
enumerations, unknown fields — what the CRD's OpenAPI schema says), then across fields (what the
CRD's CEL rules say: exactly one objective, parallelism product equals GPUs, heads divisible by
tensor parallelism, sequence divisible by context parallelism, even microbatches for nanobatching).
Cross-field checks run only over fields that passed the first pass, so one mistake gives one error.
The bounds below are mirrored in `crds/kareusjob.yaml`; `tests/test_crd_agreement.py` checks that
the two accept and reject the same manifests.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kareus.spec.fields import (
    REQUIRED,
    FieldError,
    Fields,
    SpecError,
    as_integer,
    describe,
    is_integer,
    parse_rfc3339,
)
from kareus.spec.overrides import read_overrides
from kareus.spec.types import (
    DEFAULT_GPU_PRODUCT,
    EXPLICIT_REQUIRED,
    PROXY_FIELDS,
    SHAPE_FIELDS,
    CheckpointSpec,
    CpuProxySpec,
    DataSpec,
    EnergyBudget,
    EnvVar,
    ExportSpec,
    JobSpec,
    KareusJob,
    MaxThroughput,
    ModelSpec,
    Objective,
    OptimizerSpec,
    ParallelismSpec,
    PretrainedSpec,
    ProfilingSpec,
    ResourcesSpec,
    TimeBudget,
    TrainingSpec,
)
from kareus.workload.models import PRESETS, ROPE_SCALING_TYPES

# Objects and lists in one manifest, root included: the CRD's deepest field (a projected volume's
# clusterTrustBundle label selector values) is 15 deep; deeper input is refused before anything
# recurses into it (PyYAML, the CRD checks, the operator's YAML dump), so it never reaches a
# RecursionError. tests/test_crd_schema.py holds the CRD to it.
MAX_NESTING_DEPTH = 24
MAX_NAME_LENGTH = 40  # children get suffixes such as `-optimize` and pod hashes; 63 is the label limit
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")  # also the name part of a qualified name
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
DOMAIN_PATH = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)*[a-z0-9]([-a-z0-9]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
QUANTITY = re.compile(r"[+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?")

# ObjectMeta's other fields (k8s.io/apimachinery meta/v1), which the server sets or checks itself.
SERVER_METADATA = ("generateName", "selfLink", "uid", "resourceVersion", "generation", "creationTimestamp",
                   "deletionTimestamp", "deletionGracePeriodSeconds", "ownerReferences", "finalizers",
                   "managedFields")
MAX_INT32 = 2**31 - 1
MAX_ANNOTATIONS_BYTES = 256 * 1024  # apimachinery's TotalAnnotationSizeLimitB
INT64 = (-(2**63), 2**63 - 1)  # a JSON integer outside is a float to the server, not an integer quantity
# Upper bounds keep CEL arithmetic far from overflow and catch unit mistakes (seconds vs. ms).
MODEL_BOUNDS = {"layers": 1024, "hidden": 1 << 20, "ffnHidden": 1 << 22, "heads": 4096, "kvHeads": 4096,
                "headDim": 4096, "vocab": 1 << 24}
# RoPE base and RMSNorm epsilon: released models use 1e4–1e6 and 1e-6–1e-5.
MODEL_NUMBER_BOUNDS = {"ropeTheta": (1.0, 1e10), "normEps": (0.0, 0.1)}
MAX_ROPE_FACTOR = 1024.0
MAX_SEQUENCE_LENGTH = 1 << 20
MAX_DEGREE = 4096
MAX_MICRO_BATCH_SIZE = 4096
MAX_NUM_MICRO_BATCHES = 65536
# What one plan stores (2 instructions per stage and microbatch, each frontier row's choices) and the
# optimizer schedules: PP16 × 256 is a 3.7 MB plan document, this bound ~7 MB, under
# kareus.compressed.MAX_PLAN_BYTES, the cap on reading one back.
MAX_STAGE_MICROBATCHES = 8192
MAX_MICROBATCH_TOKENS = 1 << 20  # sequenceLength × microBatchSize: one microbatch's activations
MAX_STEPS = 10**9
MAX_GPUS_PER_NODE = 64
MAX_NODES = 10000
MAX_BACKOFF_LIMIT = 1000
MAX_CHECKPOINTS_KEPT = 1000
MAX_DATA_PATH_LENGTH = 4096
DATA_FORMATS = ("npy", "bin", "megatron")
# spec.training.optimizer and precision (kareus.runtime.optimizer_recipe, kareus.runtime.precision).
OPTIMIZER_NAMES = ("adamw", "sgd")
LR_SCHEDULES = ("constant", "linear", "cosine", "wsd")
PRECISIONS = ("fp32", "bf16")
MAX_LR = 10.0
MAX_CLIP_GRAD_NORM = 1e6
OBJECTIVE_BOUNDS = {"maxSlowdownPercent": 1000.0, "iterationSeconds": 1e6, "perIterationJoules": 1e12,
                    "totalKilowattHours": 1e9}
MAX_MEASUREMENT_SECONDS = 3600.0
PROFILING_PRESETS = ("default", "paper")
PROFILING_BACKENDS = ("auto", "sim", "nvml")
OBJECTIVE_KINDS = ("maxThroughput", "timeBudget", "energyBudget")
TIME_BUDGET_FORMS = ("maxSlowdownPercent", "iterationSeconds", "deadline")
ENERGY_BUDGET_FORMS = ("perIterationJoules", "totalKilowattHours")


def load_job(path: str | Path) -> KareusJob:
    """Read and validate the KareusJob manifest at `path` (YAML, one document)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError([FieldError(str(path), "no such file")]) from None
    except (OSError, UnicodeDecodeError) as error:
        raise SpecError([FieldError(str(path), f"cannot read: {error}")]) from None
    try:
        documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as error:
        raise SpecError([FieldError(str(path), f"not valid YAML: {_yaml_problem(error)}")]) from None
    except RecursionError:  # PyYAML's composer recurses once per level
        raise SpecError([FieldError(str(path), f"nests objects and lists too deeply to read (a KareusJob nests at "
                                               f"most {MAX_NESTING_DEPTH} deep)")]) from None
    if len(documents) != 1:
        raise SpecError([FieldError(str(path), f"must hold exactly one YAML document, found {len(documents)}")])
    return parse_job(documents[0])


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def parse_job(manifest: Any) -> KareusJob:
    """Validate a whole manifest (apiVersion, kind, metadata, spec); `status` is ignored."""
    errors: list[FieldError] = []
    job = _read_job(manifest, errors)
    if errors or job is None:
        raise SpecError(errors)
    return job


def too_deep(document: Any, limit: int) -> str | None:
    """The path of the first value nested more than `limit` objects/lists deep, or None; iterative,
    so any depth is measured without recursing."""
    stack: list[tuple[Any, int, str]] = [(document, 0, "")]
    while stack:
        value, depth, at = stack.pop()
        if isinstance(value, Mapping):
            children = [(v, f"{at}.{k}" if at else str(k)) for k, v in value.items()]
        elif isinstance(value, list):
            children = [(v, f"{at}[{i}]") for i, v in enumerate(value)]
        else:
            continue
        if depth + 1 > limit:
            return at or "(document)"
        stack.extend((v, depth + 1, path) for v, path in reversed(children))
    return None


def parse_spec(spec: Any, path: str = "spec") -> JobSpec:
    """Validate the `spec` part alone; returns a `JobSpec`."""
    errors: list[FieldError] = []
    result = _read_spec(spec, path, errors) if _shallow(spec, path, errors, depth=1) else None
    if errors or result is None:
        raise SpecError(errors)
    return result


def validation_errors(manifest: Any) -> list[FieldError]:
    """Every problem with `manifest`; empty when it is a valid KareusJob."""
    errors: list[FieldError] = []
    _read_job(manifest, errors)
    return errors


def _shallow(document: Any, path: str, errors: list[FieldError], *, depth: int = 0) -> bool:
    """False, with the error, when `document` (found `depth` levels into a manifest) nests deeper
    than any KareusJob field; checked before any reader recurses into it."""
    deep = too_deep(document, MAX_NESTING_DEPTH - depth)
    if deep is None:
        return True
    where = path if deep == "(document)" else f"{path}.{deep}" if path and not deep.startswith("[") else f"{path}{deep}"
    errors.append(FieldError(where, f"nests objects and lists more than {MAX_NESTING_DEPTH} deep "
                                    f"(no KareusJob field is that deep)"))
    return False


def _read_job(manifest: Any, errors: list[FieldError]) -> KareusJob | None:
    if not _shallow(manifest, "", errors):
        return None
    top = Fields.of(manifest, "", errors)
    if top is None:
        return None
    top.string("apiVersion", max_length=64, choices=(KareusJob.API_VERSION,))
    top.string("kind", max_length=64, choices=(KareusJob.KIND,))
    top.has("status")  # written by the operator; not part of what a user asks for
    meta = top.mapping("metadata", required=True)
    spec_value = top.data.get("spec")
    top.has("spec")
    top.finish()
    identity = _read_metadata(meta) if meta is not None else None
    if spec_value is None:
        errors.append(FieldError("spec", "required field is missing"))
        return None
    spec = _read_spec(spec_value, "spec", errors)
    if identity is None or spec is None:
        return None
    name, namespace, labels, annotations = identity
    return KareusJob(name=name, namespace=namespace, labels=labels, annotations=annotations, spec=spec)


def _read_metadata(meta: Fields) -> tuple[str, str, dict[str, str], dict[str, str]] | None:
    """Name and namespace checked here; other ObjectMeta fields (uid, resourceVersion, …) are the
    server's, and a field ObjectMeta lacks is unknown, as the server's strict decoding says."""
    name = meta.string("name", max_length=MAX_NAME_LENGTH, pattern=DNS_LABEL,
                       hint=" (a DNS-1123 label: lower-case letters, digits and '-')")
    namespace = meta.string("namespace", "default", max_length=63, pattern=DNS_LABEL)
    labels = _string_map(meta, "labels", labels=True)
    annotations = _string_map(meta, "annotations", labels=False)
    for key in SERVER_METADATA:
        meta.has(key)
    meta.finish()
    if None in (name, namespace, labels, annotations):
        return None
    return name, namespace, labels, annotations


def _string_map(fields: Fields, key: str, *, labels: bool) -> dict[str, str] | None:
    """Labels or annotations, checked as the API server checks ObjectMeta."""
    value = fields.data.get(key, {})
    fields.has(key)
    if isinstance(value, Mapping):
        value = {k: "" if v is None else v for k, v in value.items()}  # Go decodes a null string as ""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in value.items()):
        fields.error(key, f"must map strings to strings, got {describe(value)}")
        return None
    # The server lower-cases annotation keys before checking them, not label keys.
    bad_key = next((k for k in value if not _qualified_name(k if labels else k.lower())), None)
    if bad_key is not None:
        fields.error(key, "keys must be qualified names ([DNS-subdomain prefix/]name, the name at most 63 "
                          f"letters, digits, '-', '_' or '.'), got {bad_key!r}")
        return None
    if labels:
        bad_value = next((v for v in value.values() if v and not (len(v) <= 63 and LABEL_VALUE.fullmatch(v))), None)
        if bad_value is not None:
            fields.error(key, "values must be empty or at most 63 letters, digits, '-', '_' or '.', starting and "
                              f"ending with a letter or digit, got {bad_value!r}")
            return None
    elif sum(len(k.encode()) + len(v.encode()) for k, v in value.items()) > MAX_ANNOTATIONS_BYTES:
        fields.error(key, f"may hold at most {MAX_ANNOTATIONS_BYTES} bytes of keys and values")
        return None
    return dict(value)


def _qualified_name(key: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if slash and not (len(prefix) <= 253 and DNS_SUBDOMAIN.fullmatch(prefix)):
        return False
    return len(name) <= 63 and LABEL_VALUE.fullmatch(name) is not None


def _read_spec(value: Any, path: str, errors: list[FieldError]) -> JobSpec | None:
    spec = Fields.of(value, path, errors)
    if spec is None:
        return None
    before = len(errors)
    model = _read_model(spec.mapping("model", required=True))
    sequence_length = spec.integer("sequenceLength", maximum=MAX_SEQUENCE_LENGTH)
    parallelism = _read_parallelism(spec.mapping("parallelism", required=True))
    objective = _read_objective(spec.mapping("objective", required=True))
    training = _read_training(spec.mapping("training", required=True))
    profiling = _read_profiling(spec.mapping("profiling"))
    gpu = spec.mapping("gpu")
    gpu_product = None
    if gpu is not None:
        gpu_product = gpu.string("product", None, max_length=63, pattern=LABEL_VALUE,
                                 hint=" (a node label value such as NVIDIA-A100-SXM4-40GB)")
        gpu.finish()
    overrides = read_overrides(spec, _read_env, _read_resources)
    suspend = spec.boolean("suspend", False)
    managed_by = spec.string("managedBy", None, max_length=63, pattern=DOMAIN_PATH,
                             hint=" (a domain-prefixed path such as kareus.dev/operator)")
    active_deadline = spec.integer("activeDeadlineSeconds", None, maximum=MAX_INT32)
    ttl = spec.integer("ttlSecondsAfterFinished", None, minimum=0, maximum=MAX_INT32)
    backoff_limit = spec.integer("backoffLimit", 3, minimum=0, maximum=MAX_BACKOFF_LIMIT)
    spec.finish()
    if len(errors) > before:
        return None
    job_spec = JobSpec(model=model, sequence_length=sequence_length, parallelism=parallelism,
                       objective=objective, training=training, profiling=profiling,
                       gpu_product=gpu_product or DEFAULT_GPU_PRODUCT, gpu_pinned=gpu_product is not None,
                       pod_overrides=overrides or (), suspend=suspend, managed_by=managed_by, active_deadline_seconds=active_deadline,
                       ttl_seconds_after_finished=ttl, backoff_limit=backoff_limit)
    errors.extend(cross_field_errors(job_spec, path))
    return None if len(errors) > before else job_spec


def _read_model(model: Fields | None) -> ModelSpec | None:
    if model is None:
        return None
    before = len(model.errors)
    preset = model.string("preset", None, max_length=64, choices=sorted(PRESETS))
    overrides: dict[str, Any] = {}
    for key, _attr in SHAPE_FIELDS:
        if key in ("qkNorm", "tiedEmbeddings"):
            value = model.boolean(key, None)
        elif key in MODEL_NUMBER_BOUNDS:
            low, high = MODEL_NUMBER_BOUNDS[key]
            value = model.number(key, None, minimum=low, maximum=high, exclusive_minimum=key == "normEps")
        elif key == "ropeScaling":
            value = _read_rope_scaling(model.mapping(key)) if model.has(key) else None
        else:
            value = model.integer(key, None, maximum=MODEL_BOUNDS[key])
        if value is not None:
            overrides[key] = value
    pretrained = _read_pretrained(model.mapping("pretrained")) if model.has("pretrained") else None
    model.finish()
    if len(model.errors) > before:
        return None
    if preset is None:
        missing = [key for key in EXPLICIT_REQUIRED if key not in overrides]
        if missing:
            model.error(None, f"set preset (one of {', '.join(sorted(PRESETS))}) or an explicit shape; "
                              f"missing {', '.join(missing)}")
            return None
    return ModelSpec(preset=preset, overrides=overrides, pretrained=pretrained)


def _read_pretrained(pretrained: Fields | None) -> PretrainedSpec | None:
    """`spec.model.pretrained`: a claim and a path inside it (the path rules are checked across fields)."""
    if pretrained is None:
        return None
    before = len(pretrained.errors)
    claim_name = pretrained.string("claimName", max_length=253, pattern=DNS_SUBDOMAIN,
                                   hint=" (a PersistentVolumeClaim name)")
    model_path = pretrained.string("path", max_length=MAX_DATA_PATH_LENGTH)
    pretrained.finish()
    return None if len(pretrained.errors) > before else PretrainedSpec(claim_name, model_path)


def _read_rope_scaling(scaling: Fields | None) -> dict[str, Any] | None:
    """`spec.model.ropeScaling` in its manifest form with every default filled in."""
    if scaling is None:
        return None
    before = len(scaling.errors)
    values = {
        "type": scaling.string("type", max_length=32, choices=ROPE_SCALING_TYPES),
        "factor": scaling.number("factor", minimum=1, maximum=MAX_ROPE_FACTOR),
        "lowFreqFactor": scaling.number("lowFreqFactor", 1.0, minimum=0, maximum=MAX_ROPE_FACTOR,
                                        exclusive_minimum=True),
        "highFreqFactor": scaling.number("highFreqFactor", 4.0, minimum=0, maximum=MAX_ROPE_FACTOR,
                                         exclusive_minimum=True),
        "originalMaxPositionEmbeddings": scaling.integer("originalMaxPositionEmbeddings", 8192,
                                                         maximum=MAX_SEQUENCE_LENGTH),
    }
    scaling.finish()
    if len(scaling.errors) > before:
        return None
    if not values["lowFreqFactor"] < values["highFreqFactor"]:
        scaling.error("highFreqFactor", f"must be greater than lowFreqFactor ({values['lowFreqFactor']:g}), "
                                        f"got {values['highFreqFactor']:g}")
        return None
    return values


def _read_parallelism(par: Fields | None) -> ParallelismSpec | None:
    if par is None:
        return None
    before = len(par.errors)
    values = {
        "tensor": par.integer("tensor", 1, maximum=MAX_DEGREE),
        "pipeline": par.integer("pipeline", 1, maximum=MAX_DEGREE),
        "context": par.integer("context", 1, maximum=MAX_DEGREE),
        "data": par.integer("data", 1, maximum=MAX_DEGREE),
        "micro_batch_size": par.integer("microBatchSize", maximum=MAX_MICRO_BATCH_SIZE),
        "num_micro_batches": par.integer("numMicroBatches", maximum=MAX_NUM_MICRO_BATCHES),
        "activation_checkpointing": par.boolean("activationCheckpointing", True),
        "nanobatching": par.boolean("nanobatching", True),
    }
    par.finish()
    return None if len(par.errors) > before else ParallelismSpec(**values)


def _exactly_one(fields: Fields, names: tuple[str, ...], what: str) -> str | None:
    present = [name for name in names if fields.has(name)]
    nulls = [name for name in names if name in fields.null_keys]
    if len(present) == 1:
        return present[0]
    got = ", ".join(present) if present else "none"
    hint = f" (a bare `{nulls[0]}:` is null; write `{nulls[0]}: {{}}`)" if nulls and not present else ""
    fields.error(None, f"must set exactly one {what} of {', '.join(names)}; got {got}{hint}")
    return None


def _read_objective(obj: Fields | None) -> Objective | None:
    if obj is None:
        return None
    before = len(obj.errors)
    kind = _exactly_one(obj, OBJECTIVE_KINDS, "objective")
    result: Objective | None = None
    if obj.has("maxThroughput"):
        inner = obj.mapping("maxThroughput")
        if inner is not None:
            inner.finish()
        result = MaxThroughput()
    if obj.has("timeBudget"):
        result = _read_time_budget(obj.mapping("timeBudget"))
    if obj.has("energyBudget"):
        result = _read_energy_budget(obj.mapping("energyBudget"))
    obj.finish()
    return result if kind is not None and len(obj.errors) == before else None


def _budget_number(fields: Fields, key: str) -> float | None:
    return fields.number(key, None, minimum=0.0, maximum=OBJECTIVE_BOUNDS[key], exclusive_minimum=True)


def _read_time_budget(budget: Fields | None) -> TimeBudget | None:
    if budget is None:
        return None
    _exactly_one(budget, TIME_BUDGET_FORMS, "time budget")
    deadline = None
    text = budget.string("deadline", None, max_length=64)
    if text is not None:
        deadline = parse_rfc3339(text)
        if deadline is None:
            budget.error("deadline", f"must be an RFC 3339 date-time such as 2027-01-01T00:00:00Z, got {text!r}")
    result = TimeBudget(max_slowdown_percent=_budget_number(budget, "maxSlowdownPercent"),
                        iteration_seconds=_budget_number(budget, "iterationSeconds"), deadline=deadline)
    budget.finish()
    return result


def _read_energy_budget(budget: Fields | None) -> EnergyBudget | None:
    if budget is None:
        return None
    _exactly_one(budget, ENERGY_BUDGET_FORMS, "energy budget")
    result = EnergyBudget(per_iteration_joules=_budget_number(budget, "perIterationJoules"),
                          total_kilowatt_hours=_budget_number(budget, "totalKilowattHours"))
    budget.finish()
    return result


def _read_training(train: Fields | None) -> TrainingSpec | None:
    if train is None:
        return None
    before = len(train.errors)
    image = train.string("image", max_length=1024)
    # Sizes keep the CRD's immutability rule within the API server's CEL cost budget.
    command = train.string_list("command", max_items=256, max_length=1024)
    args = train.string_list("args", max_items=256, max_length=1024)
    steps = train.integer("steps", maximum=MAX_STEPS)
    gpus_per_node = train.integer("gpusPerNode", maximum=MAX_GPUS_PER_NODE)
    nodes = train.integer("nodes", maximum=MAX_NODES)
    env = _read_env(train)
    resources = _read_resources(train.mapping("resources")) if train.has("resources") else None
    cpu_proxy = _read_cpu_proxy(train.mapping("cpuProxy")) if train.has("cpuProxy") else None
    checkpoint = _read_checkpoint(train.mapping("checkpoint")) if train.has("checkpoint") else None
    data = _read_data(train.mapping("data")) if train.has("data") else None
    export = _read_export(train.mapping("export")) if train.has("export") else None
    optimizer = _read_optimizer(train.mapping("optimizer")) if train.has("optimizer") else None
    precision = train.string("precision", None, max_length=8, choices=PRECISIONS)
    tf32 = train.boolean("tf32", None)
    train.finish()
    if len(train.errors) > before:
        return None
    return TrainingSpec(image=image, steps=steps, gpus_per_node=gpus_per_node, nodes=nodes, command=command,
                        args=args, env=env, resources=resources, cpu_proxy=cpu_proxy, checkpoint=checkpoint,
                        data=data, export=export, optimizer=optimizer, precision=precision, tf32=tf32)


def _read_export(export: Fields | None) -> ExportSpec | None:
    """`spec.training.export`: `{}` for now (no options yet, so any field is unknown)."""
    if export is None:
        return None
    before = len(export.errors)
    export.finish()
    return None if len(export.errors) > before else ExportSpec()


def _read_optimizer(opt: Fields | None) -> OptimizerSpec | None:
    if opt is None:
        return None
    before = len(opt.errors)
    values = {
        "name": opt.string("name", None, max_length=16, choices=OPTIMIZER_NAMES),
        "lr": opt.number("lr", None, minimum=0.0, maximum=MAX_LR, exclusive_minimum=True),
        "min_lr": opt.number("minLr", None, minimum=0.0, maximum=MAX_LR),
        "warmup_steps": opt.integer("warmupSteps", None, minimum=0, maximum=MAX_STEPS),
        "schedule_kind": opt.string("schedule", None, max_length=16, choices=LR_SCHEDULES),
        "decay_steps": opt.integer("decaySteps", None, maximum=MAX_STEPS),
        "wsd_decay_fraction": opt.number("wsdDecayFraction", None, minimum=0.0, maximum=1.0, exclusive_minimum=True),
        "weight_decay": opt.number("weightDecay", None, minimum=0.0, maximum=1.0),
        "decay_embeddings": opt.boolean("decayEmbeddings", None),
        "beta1": _beta(opt, "beta1"),
        "beta2": _beta(opt, "beta2"),
        "eps": opt.number("eps", None, minimum=0.0, maximum=1.0, exclusive_minimum=True),
        "clip_grad_norm": opt.number("clipGradNorm", None, minimum=0.0, maximum=MAX_CLIP_GRAD_NORM),
    }
    opt.finish()
    if len(opt.errors) > before:
        return None
    if values["min_lr"] is not None and values["lr"] is not None and values["min_lr"] > values["lr"]:
        opt.error("minLr", f"must be at most lr ({values['lr']:g}): the schedule decays to it, got {values['min_lr']:g}")
    if values["warmup_steps"] is not None and values["decay_steps"] is not None \
            and values["warmup_steps"] > values["decay_steps"]:
        opt.error("decaySteps", f"must be at least warmupSteps ({values['warmup_steps']}): the decay counts from "
                                f"step 0, warmup included, got {values['decay_steps']}")
    return None if len(opt.errors) > before else OptimizerSpec(**values)


def _beta(opt: Fields, key: str) -> float | None:
    """An Adam beta: a number in [0, 1); 1 would freeze the moment estimate."""
    value = opt.number(key, None, minimum=0.0, maximum=1.0)
    if value is not None and value >= 1.0:
        opt.error(key, f"must be a number in [0, 1), got {describe(value)}")
        return None
    return value


def _read_checkpoint(ckpt: Fields | None) -> CheckpointSpec | None:
    if ckpt is None:
        return None
    before = len(ckpt.errors)
    every_steps = ckpt.integer("everySteps", maximum=MAX_STEPS)
    keep = ckpt.integer("keep", None, maximum=MAX_CHECKPOINTS_KEPT)
    claim_name = ckpt.string("claimName", None, max_length=253, pattern=DNS_SUBDOMAIN,
                             hint=" (a PersistentVolumeClaim name)")
    ckpt.finish()
    return None if len(ckpt.errors) > before else CheckpointSpec(every_steps, keep, claim_name)


def _read_data(data: Fields | None) -> DataSpec | None:
    if data is None:
        return None
    before = len(data.errors)
    data_path = data.string("path", max_length=MAX_DATA_PATH_LENGTH)
    data_format = data.string("format", max_length=16, choices=DATA_FORMATS)
    claim_name = data.string("claimName", None, max_length=253, pattern=DNS_SUBDOMAIN,
                             hint=" (a PersistentVolumeClaim name)")
    data.finish()
    return None if len(data.errors) > before else DataSpec(data_path, data_format, claim_name)


def _read_cpu_proxy(proxy: Fields | None) -> CpuProxySpec | None:
    if proxy is None:
        return None
    before = len(proxy.errors)
    dims = {key: value for key in PROXY_FIELDS
            if (value := proxy.integer(key, None if key == "headDim" else REQUIRED, maximum=MODEL_BOUNDS[key]))
            is not None}
    sequence_length = proxy.integer("sequenceLength", None, maximum=MAX_SEQUENCE_LENGTH)
    proxy.finish()
    return None if len(proxy.errors) > before else CpuProxySpec(dims=dims, sequence_length=sequence_length)


def _read_env(train: Fields) -> tuple[EnvVar, ...]:
    value = train.data.get("env", [])
    train.has("env")
    if not isinstance(value, list) or len(value) > 128:
        train.error("env", f"must be a list of at most 128 {{name, value}} objects, got {describe(value)}")
        return ()
    result: list[EnvVar] = []
    seen: set[str] = set()
    for index, item in enumerate(value):
        var = Fields.of(item, f"{train.at('env')}[{index}]", train.errors)
        if var is None:
            continue
        name = var.string("name", max_length=256, pattern=ENV_NAME)
        text = var.data.get("value", "")
        var.has("value")
        if not isinstance(text, str) or len(text) > 4096:
            var.error("value", f"must be a string of at most 4096 characters, got {describe(text)}")
        var.finish()
        if name is not None and name in seen:
            var.error("name", f"duplicate environment variable {name!r}")
        if name is not None:
            seen.add(name)
            result.append(EnvVar(name, text if isinstance(text, str) else ""))
    return tuple(result)


def _read_resources(res: Fields | None) -> ResourcesSpec | None:
    if res is None:
        return None
    parts: dict[str, dict[str, str]] = {}
    for key in ("requests", "limits"):
        parts[key] = {}
        section = res.mapping(key)
        if section is None:
            continue
        for name in list(section.data):
            quantity = as_integer(section.data[name])
            section.has(name)
            if is_integer(quantity) and INT64[0] <= quantity <= INT64[1]:
                parts[key][name] = str(quantity)
            elif isinstance(quantity, str) and QUANTITY.fullmatch(quantity):
                parts[key][name] = quantity
            else:
                section.error(name, f"must be a Kubernetes quantity such as 8, 500m or 64Gi, got {describe(quantity)}")
        if len(section.data) > 32:
            section.error(None, "must list at most 32 resources")
    res.finish()
    return ResourcesSpec(**parts)


def _read_profiling(prof: Fields | None) -> ProfilingSpec | None:
    if prof is None:
        return None
    before = len(prof.errors)
    values = {
        "reuse": prof.boolean("reuse", True),
        "measurement_seconds": prof.number("measurementSeconds", 5.0, minimum=0.0,
                                           maximum=MAX_MEASUREMENT_SECONDS, exclusive_minimum=True),
        "cooldown_seconds": prof.number("cooldownSeconds", 5.0, minimum=0.0, maximum=MAX_MEASUREMENT_SECONDS),
        "preset": prof.string("preset", "default", max_length=16, choices=PROFILING_PRESETS),
        "backend": prof.string("backend", "auto", max_length=16, choices=PROFILING_BACKENDS),
    }
    prof.finish()
    return None if len(prof.errors) > before else ProfilingSpec(**values)


def cross_field_errors(spec: JobSpec, path: str = "spec") -> list[FieldError]:
    """The CEL rules of the CRD, over a `JobSpec` whose fields are individually valid."""
    errors: list[FieldError] = []
    par = spec.parallelism
    shape = spec.model_shape()
    model_path = f"{path}.model"
    errors += _attention_errors(shape, model_path, explicit_head_dim=spec.model.preset is not None
                                or "headDim" in spec.model.overrides)
    if shape.num_heads % par.tensor:
        errors.append(FieldError(f"{path}.parallelism.tensor", f"must divide the number of attention heads "
                                 f"({shape.num_heads}), got {par.tensor}"))
    if shape.num_kv_heads % par.tensor:
        errors.append(FieldError(f"{path}.parallelism.tensor", f"must divide kvHeads ({shape.num_kv_heads}): "
                                 f"each tensor-parallel rank holds whole key/value heads, got {par.tensor}"))
    if shape.num_layers < par.pipeline:
        errors.append(FieldError(f"{path}.parallelism.pipeline", f"must be at most the number of layers "
                                 f"({shape.num_layers}), got {par.pipeline}"))
    if par.nanobatching and (par.micro_batch_size < 2 or par.micro_batch_size % 2):
        errors.append(FieldError(f"{path}.parallelism.microBatchSize", "must be even and >= 2 when "
                                 f"nanobatching is on (two equal nanobatches), got {par.micro_batch_size}"))
    errors += _sequence_errors(spec.sequence_length, par.context, f"{path}.sequenceLength")
    if par.world_size != spec.num_gpus:
        errors.append(FieldError(f"{path}.parallelism", f"tensor × pipeline × context × data = {par.world_size} "
                                 f"must equal training.nodes × training.gpusPerNode = {spec.num_gpus}"))
    if par.pipeline * par.num_micro_batches > MAX_STAGE_MICROBATCHES:
        errors.append(FieldError(f"{path}.parallelism.numMicroBatches", f"pipeline × numMicroBatches must be at most "
                                 f"{MAX_STAGE_MICROBATCHES} (the instructions one plan stores and the optimizer "
                                 f"schedules), got {par.pipeline} × {par.num_micro_batches}"))
    if spec.sequence_length * par.micro_batch_size > MAX_MICROBATCH_TOKENS:
        errors.append(FieldError(f"{path}.parallelism.microBatchSize", f"sequenceLength × microBatchSize must be at "
                                 f"most {MAX_MICROBATCH_TOKENS} tokens per microbatch, got {spec.sequence_length} × "
                                 f"{par.micro_batch_size}"))
    if spec.training.cpu_proxy is not None:
        errors += _proxy_errors(spec, f"{path}.training.cpuProxy")
    errors += _storage_errors(spec.training, f"{path}.training")
    if spec.model.pretrained is not None:
        errors += _claim_path_errors(spec.model.pretrained.path, f"{model_path}.pretrained.path")
    return errors


def _storage_errors(training: TrainingSpec, path: str) -> list[FieldError]:
    """A checkpoint interval longer than the run never saves; a data path is inside its claim
    (relative, never climbing out) or, without one, absolute in the image."""
    errors = []
    ckpt, data = training.checkpoint, training.data
    if ckpt is not None and ckpt.every_steps > training.steps:
        errors.append(FieldError(f"{path}.checkpoint.everySteps", f"must be at most training.steps "
                                 f"({training.steps}): a longer interval never saves, got {ckpt.every_steps}"))
    if data is not None:
        if data.claim_name is not None:
            errors += _claim_path_errors(data.path, f"{path}.data.path")
        else:
            if not data.path.startswith("/"):
                errors.append(FieldError(f"{path}.data.path", "must be absolute (a path in the training image) "
                                         f"when no claimName is set, got {data.path!r}"))
            if ".." in data.path.split("/"):
                errors.append(FieldError(f"{path}.data.path", f"must not contain a '..' segment, got {data.path!r}"))
    if training.export is not None and (ckpt is None or ckpt.claim_name is None):
        # The export is written next to the checkpoints, on their claim: without one nothing outlives the pod.
        errors.append(FieldError(f"{path}.export", "needs training.checkpoint with a claimName: the export is "
                                 "written on the checkpoint claim (<claim>/<job uid>/export/)"))
    return errors


def _claim_path_errors(claim_path: str, where: str) -> list[FieldError]:
    """A path inside a claim: relative to its root, never climbing out of it."""
    errors = []
    if claim_path.startswith("/"):
        errors.append(FieldError(where, f"must be relative to the claim's root, got {claim_path!r}"))
    if ".." in claim_path.split("/"):
        errors.append(FieldError(where, f"must not contain a '..' segment, got {claim_path!r}"))
    return errors


def _attention_errors(shape, path: str, *, explicit_head_dim: bool) -> list[FieldError]:
    errors = []
    if shape.num_heads % shape.num_kv_heads:
        errors.append(FieldError(f"{path}.kvHeads", f"heads ({shape.num_heads}) must be a multiple of "
                                 f"kvHeads ({shape.num_kv_heads}) for grouped-query attention"))
    if not explicit_head_dim and shape.hidden_size % shape.num_heads:
        errors.append(FieldError(f"{path}.headDim", f"required when hidden ({shape.hidden_size}) is not "
                                 f"divisible by heads ({shape.num_heads})"))
    return errors


def _sequence_errors(sequence_length: int, context: int, path: str) -> list[FieldError]:
    chunks = 1 if context == 1 else 2 * context
    if sequence_length % chunks:
        return [FieldError(path, f"must be divisible by {chunks} (2 × context parallelism, for load-balanced "
                                 f"context parallel chunks), got {sequence_length}")]
    return []


def _proxy_errors(spec: JobSpec, path: str) -> list[FieldError]:
    """The proxy runs the job's layout: its heads split over the same tensor-parallel ranks, its
    layers over the same stages, its sequence over the same context-parallel ranks."""
    proxy, par = spec.training.cpu_proxy, spec.parallelism
    shape = spec.cpu_proxy_shape()
    errors = _attention_errors(shape, path, explicit_head_dim="headDim" in proxy.dims)
    for key, count in (("heads", shape.num_heads), ("kvHeads", shape.num_kv_heads)):
        if count % par.tensor:
            errors.append(FieldError(f"{path}.{key}", f"must be divisible by parallelism.tensor ({par.tensor}): "
                                     f"the proxy runs the job's layout, got {count}"))
    if shape.num_layers < par.pipeline:
        errors.append(FieldError(f"{path}.layers", f"must be at least parallelism.pipeline ({par.pipeline}): "
                                 f"every stage holds a layer, got {shape.num_layers}"))
    if proxy.sequence_length is None:
        # It inherits spec.sequenceLength, whose own check names that field: one error, as the CRD gives.
        return errors
    return errors + _sequence_errors(proxy.sequence_length, par.context, f"{path}.sequenceLength")


def immutable_changes(old: JobSpec, new: JobSpec, path: str = "spec") -> list[FieldError]:
    """Fields changed between two `JobSpec`s that may not change once training started.

    Only `objective` (re-selects a plan from the stored frontier), `suspend` and
    `podTemplateOverrides` (they shape child Jobs created after the change: a restarted gang) may
    change; the CRD enforces the same with a transition rule keyed on `status.trainingStartTime`.
    """
    before, after = old.to_dict(), new.to_dict()
    keys = sorted((set(before) | set(after)) - {"objective", "suspend", "podTemplateOverrides"})
    return [FieldError(f"{path}.{key}", "is immutable once training started (only objective and suspend "
                       "may change)") for key in keys if before.get(key) != after.get(key)]
