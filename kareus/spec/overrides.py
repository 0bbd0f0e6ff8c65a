"""`spec.podTemplateOverrides`: what a user may add to the pods of a KareusJob's children.

In the spirit of Kubeflow Trainer's `podTemplateOverrides`: each entry names the roles it applies
to (`profile`, `optimize`, `train`) and adds scheduling (nodeSelector, tolerations, affinity,
priorityClassName), image pull secrets, volumes and mounts, environment, resources, labels and
annotations. Maps merge (the entry wins), lists append, in entry order. An affinity and a volume
source are checked against core/v1's own schemas as the CRD types them (`kareus.spec.core_types`:
unknown fields, types, bounds), so `kareus validate` names a bad field the API server would refuse;
what only the API server knows (a field's finer semantics) it validates when the child Job is
created, and a refusal becomes the job's condition.

The CRD declares the same shape and limits; `tests/test_crd_agreement.py` holds the two together.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kareus.spec.core_types import schema_errors, schemas
from kareus.spec.fields import FieldError, Fields, as_integer, describe, is_integer

ROLES = ("profile", "optimize", "train")
MAX_OVERRIDES = 8
MAX_ITEMS = 32
MAX_MAP_ENTRIES = 64
# A qualified name as the CRD's CEL rule checks it ([DNS subdomain prefix/]name); the API server
# checks the finer length limits when the pod is created.
QUALIFIED_NAME = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                            r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class PodOverride:
    """One `spec.podTemplateOverrides` entry; Kubernetes objects kept as the dicts the API takes."""

    roles: tuple[str, ...]
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = None
    image_pull_secrets: tuple[dict[str, str], ...] = ()
    volumes: tuple[dict[str, Any], ...] = ()
    volume_mounts: tuple[dict[str, Any], ...] = ()
    env: tuple[Any, ...] = ()  # EnvVar
    resources: Any = None  # ResourcesSpec

    def __hash__(self) -> int:
        return hash((self.roles, repr(self.to_dict())))

    def to_dict(self) -> dict[str, Any]:
        meta = {k: dict(v) for k, v in (("labels", self.labels), ("annotations", self.annotations)) if v}
        spec: dict[str, Any] = {}
        if self.node_selector:
            spec["nodeSelector"] = dict(self.node_selector)
        for key, items in (("tolerations", self.tolerations), ("imagePullSecrets", self.image_pull_secrets),
                           ("volumes", self.volumes), ("volumeMounts", self.volume_mounts)):
            if items:
                spec[key] = [dict(item) for item in items]
        if self.affinity is not None:
            spec["affinity"] = self.affinity
        if self.priority_class_name:
            spec["priorityClassName"] = self.priority_class_name
        if self.env:
            spec["env"] = [{"name": v.name, "value": v.value} for v in self.env]
        if self.resources is not None and self.resources.to_dict():
            spec["resources"] = self.resources.to_dict()
        out: dict[str, Any] = {"roles": list(self.roles)}
        if meta:
            out["metadata"] = meta
        if spec:
            out["spec"] = spec
        return out


def read_overrides(spec: Fields, read_env, read_resources) -> tuple[PodOverride, ...] | None:
    """`spec.podTemplateOverrides`; `read_env`/`read_resources` are the training section's readers
    (the same fields, the same rules)."""
    return _objects(spec, "podTemplateOverrides", lambda entry: _read_entry(entry, read_env, read_resources),
                    max_items=MAX_OVERRIDES)


def _read_entry(entry: Fields, read_env, read_resources) -> PodOverride:
    roles = entry.string_list("roles", max_items=len(ROLES), max_length=16)
    entry.has("roles")
    if "roles" not in entry.data:
        entry.error("roles", "required field is missing")
    elif roles is not None:
        bad = [r for r in roles if r not in ROLES]
        if bad or not roles:
            entry.error("roles", f"must list one or more of {', '.join(ROLES)}, got {describe(list(roles))}")
        elif len(set(roles)) != len(roles):
            entry.error("roles", f"must not repeat a role, got {describe(list(roles))}")
    meta = entry.mapping("metadata")
    labels = annotations = {}
    if meta is not None:
        labels = _string_map(meta, "labels", LABEL_VALUE, max_length=63)
        annotations = _string_map(meta, "annotations", None, max_length=262144)
        meta.finish()
    pod = entry.mapping("spec")
    values: dict[str, Any] = {}
    if pod is not None:
        values = {
            "node_selector": _string_map(pod, "nodeSelector", LABEL_VALUE, max_length=63),
            "tolerations": _objects(pod, "tolerations", _toleration),
            "affinity": _affinity(pod, "affinity"),
            "priority_class_name": pod.string("priorityClassName", None, max_length=253, pattern=DNS_SUBDOMAIN),
            "image_pull_secrets": _objects(pod, "imagePullSecrets", _pull_secret),
            "volumes": _objects(pod, "volumes", _volume),
            "volume_mounts": _objects(pod, "volumeMounts", _mount),
            "env": read_env(pod),
            "resources": read_resources(pod.mapping("resources")) if pod.has("resources") else None,
        }
        pod.finish()
    entry.finish()
    return PodOverride(roles=tuple(roles or ()), labels=labels or {}, annotations=annotations or {},
                       **{k: (v if v is not None else _EMPTY.get(k)) for k, v in values.items()})


_EMPTY: dict[str, Any] = {"node_selector": {}, "tolerations": (), "image_pull_secrets": (), "volumes": (),
                          "volume_mounts": (), "env": ()}


def _string_map(fields: Fields, key: str, value_pattern: re.Pattern | None, *, max_length: int) -> dict[str, str] | None:
    value = fields.data.get(key, {})
    fields.has(key)
    if not isinstance(value, Mapping) or len(value) > MAX_MAP_ENTRIES or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        fields.error(key, f"must map at most {MAX_MAP_ENTRIES} strings to strings, got {describe(value)}")
        return None
    bad_key = next((k for k in value if not (len(k) <= 317 and QUALIFIED_NAME.fullmatch(k))), None)
    if bad_key is not None:
        fields.error(key, f"keys must be qualified names ([DNS-subdomain prefix/]name), got {bad_key!r}")
        return None
    for name, text in value.items():
        if len(text) > max_length or (value_pattern is not None and not value_pattern.fullmatch(text)):
            shape = " of letters, digits, '-', '_' or '.', starting and ending with one" if value_pattern else ""
            fields.errors.append(FieldError(f"{fields.at(key)}.{name}",
                                            f"must be at most {max_length} characters{shape}, got {describe(text)}"))
            return None
    return dict(value)


def _objects(fields: Fields, key: str, read, *, max_items: int = MAX_ITEMS) -> tuple[Any, ...] | None:
    """A list of objects at `key`, each read by `read(Fields)`; None when any of them is wrong."""
    value = fields.data.get(key, [])
    fields.has(key)
    if not isinstance(value, list) or len(value) > max_items:
        fields.error(key, f"must be a list of at most {max_items} objects, got {describe(value)}")
        return None
    before = len(fields.errors)
    items = []
    for index, item in enumerate(value):
        entry = Fields.of(item, f"{fields.at(key)}[{index}]", fields.errors)
        if entry is not None:
            items.append(read(entry))
    return None if len(fields.errors) > before else tuple(items)


def _affinity(fields: Fields, key: str) -> dict[str, Any] | None:
    """A core/v1 Affinity, checked against the schema the CRD types it with."""
    if not fields.has(key):
        return None
    value = fields.data[key]
    if not isinstance(value, Mapping):
        fields.error(key, f"must be an object, got {describe(value)}")
        return None
    if not _schema_checked(fields, dict(value), schemas()["affinity"], fields.at(key)):
        return None
    return dict(value)


def _schema_checked(fields: Fields, value: dict[str, Any], schema: Mapping[str, Any], at: str) -> bool:
    """Whether `value` fits `schema`; every break (a few at most) becomes an error of `fields`."""
    errors = schema_errors(value, schema, at)
    fields.errors += [FieldError(path, message) for path, message in errors]
    return not errors


def _toleration(entry: Fields) -> dict[str, Any]:
    out = {"key": entry.string("key", None, max_length=317, pattern=QUALIFIED_NAME),
           "operator": entry.string("operator", None, max_length=16, choices=TOLERATION_OPERATORS),
           "value": _optional_string(entry, "value", 63, LABEL_VALUE),
           "effect": entry.string("effect", None, max_length=32, choices=TAINT_EFFECTS)}
    if entry.has("tolerationSeconds"):
        seconds = as_integer(entry.data["tolerationSeconds"])
        if not is_integer(seconds) or not INT64[0] <= seconds <= INT64[1]:
            entry.error("tolerationSeconds", f"must be an integer, got {describe(seconds)}")
        else:
            out["tolerationSeconds"] = seconds
    entry.finish()
    return {k: v for k, v in out.items() if v is not None}


def _optional_string(entry: Fields, key: str, max_length: int, pattern: re.Pattern) -> str | None:
    """A string that may be empty (a toleration's value)."""
    if not entry.has(key):
        return None
    value = entry.data[key]
    if not isinstance(value, str) or len(value) > max_length or not pattern.fullmatch(value):
        entry.error(key, f"must be a label value (at most {max_length} characters), got {describe(value)}")
        return None
    return value


def _pull_secret(entry: Fields) -> dict[str, str]:
    name = entry.string("name", max_length=253, pattern=DNS_SUBDOMAIN)
    entry.finish()
    return {"name": name or ""}


def _volume(entry: Fields) -> dict[str, Any]:
    """A core/v1 Volume: its name as every name here, its source against the CRD's schema."""
    name = entry.string("name", max_length=63, pattern=DNS_LABEL)
    source = {key: value for key, value in entry.data.items() if key != "name"}
    _schema_checked(entry, source, {**schemas()["volume"], "required": []}, entry.path)
    return {**entry.data, "name": name or ""}


def _mount(entry: Fields) -> dict[str, Any]:
    out: dict[str, Any] = {"name": entry.string("name", max_length=63, pattern=DNS_LABEL),
                           "mountPath": entry.string("mountPath", max_length=4096)}
    read_only = entry.boolean("readOnly", None)
    if read_only is not None:
        out["readOnly"] = read_only
    sub_path = entry.string("subPath", None, max_length=4096)
    if sub_path is not None:
        out["subPath"] = sub_path
    entry.finish()
    return out
