"""Validating custom objects against a CRD the way the Kubernetes API server does.

The development cluster (an API emulator) and the CRD agreement tests need the server's view of a
KareusJob: null fields pruned, defaults applied, then the structural OpenAPI v3 schema checked
(types, required, enums, bounds, lengths, patterns, formats, list-map keys, unknown fields) and,
when no blocking error was found, the CEL rules (`x-kubernetes-validations`) evaluated with
`cel-python`, transition rules (those using `oldSelf`) only on updates. Errors read like the
server's, field path first: `spec.parallelism.tensor: Invalid value: 0: spec.parallelism.tensor in
body should be greater than or equal to 1`.

Unknown fields are errors here (the server prunes them, or rejects them under strict field
validation, which kubectl uses by default); CEL then sees the object without them, as the server
does. Only the schema features the Kareus CRD uses are implemented, and each as the server does it.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import celpy
from celpy import celtypes

# Errors after which the server skips CEL rules (apiextensions-apiserver's hasBlockingErr).
BLOCKING = frozenset({"Unsupported value", "Required value", "Too long", "Too many", "Invalid type"})
CEL_SKIPPED = ("some validation rules were not checked because the object was invalid; correct the existing "
               "errors to complete validation")
DATE_TIME = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
CEL_REASONS = {"FieldValueForbidden": "Forbidden", "FieldValueRequired": "Required value",
               "FieldValueDuplicate": "Duplicate value", "FieldValueInvalid": "Invalid value"}


@dataclass(frozen=True)
class SchemaError:
    path: str
    kind: str  # the server's error type: Invalid value, Required value, Too long, …
    detail: str

    def __str__(self) -> str:
        # The server prints a type error as an invalid value; the kind only matters for blocking.
        kind = "Invalid value" if self.kind == "Invalid type" else self.kind
        return f"{self.path}: {kind}: {self.detail}" if self.detail else f"{self.path}: {kind}"


# ---------------------------------------------------------------------------------------------
# Locating the schema


def served_version(crd: dict, api_version: Any) -> dict | None:
    """The CRD version entry that `api_version` (group/version) names, when it is served."""
    group = crd["spec"]["group"]
    for version in crd["spec"]["versions"]:
        if api_version == f"{group}/{version['name']}" and version.get("served", True):
            return version
    return None


def version_schema(crd: dict, version: str | None = None) -> dict:
    """The openAPIV3Schema of `version` (the storage version when None)."""
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version or (version is None and entry.get("storage")):
            return entry["schema"]["openAPIV3Schema"]
    raise KeyError(f"CRD {crd['metadata']['name']} has no version {version!r}")


# ---------------------------------------------------------------------------------------------
# Pruning nulls and defaulting


def prune_nulls(schema: dict, obj: Any) -> Any:
    """A copy of `obj` without null-valued fields the schema does not mark nullable."""
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            sub = _property_schema(schema, key)
            if value is None and not (sub or {}).get("nullable", False):
                continue
            out[key] = prune_nulls(sub or {}, value)
        return out
    if isinstance(obj, list):
        return [prune_nulls(schema.get("items", {}), item) for item in obj]
    return obj


def apply_defaults(schema: dict, obj: Any) -> Any:
    """A copy of `obj` with the schema's defaults filled in where fields are absent (recursively).

    As the server: a default fills an absent field of an object that exists, and defaults inside
    a defaulted value apply too (`profiling: {}` gets `reuse: true`, …). Given a whole CRD instead
    of a schema, does what the server does on write: picks the version and prunes nulls first.
    """
    if schema.get("kind") == "CustomResourceDefinition":
        return prepare(schema, obj)
    if isinstance(obj, dict):
        out = dict(obj)
        for key, sub in (schema.get("properties") or {}).items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
        for key, value in out.items():
            sub = _property_schema(schema, key)
            if sub is not None:
                out[key] = apply_defaults(sub, value)
        return out
    if isinstance(obj, list):
        return [apply_defaults(schema.get("items", {}), item) for item in obj]
    return obj


def _property_schema(schema: dict, key: Any) -> dict | None:
    properties = schema.get("properties") or {}
    if key in properties:
        return properties[key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else None


# ---------------------------------------------------------------------------------------------
# Structural validation


def _type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null" if value is None else type(value).__name__


INT64 = (-(2**63), 2**63 - 1)


def _type_ok(schema: dict, value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
        return False  # JSON decoding on the server fails beyond int64
    if schema.get("x-kubernetes-int-or-string"):
        return _type_of(value) in ("integer", "string")
    wanted = schema.get("type")
    got = _type_of(value)
    return wanted is None or got == wanted or (wanted == "number" and got == "integer")


def _show(value: Any) -> str:
    if isinstance(value, dict | list):
        return f'"{_type_of(value)}"'
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


class _Walker:
    """Checks one object against one schema, collecting `SchemaError`s and the pruned object."""

    def __init__(self) -> None:
        self.errors: list[SchemaError] = []

    def fail(self, path: str, kind: str, detail: str = "") -> None:
        self.errors.append(SchemaError(path, kind, detail))

    def check(self, schema: dict, value: Any, path: str) -> Any:
        """Validate `value`; return it with unknown fields removed (what CEL gets to see)."""
        if not _type_ok(schema, value):
            wanted = "integer or string" if schema.get("x-kubernetes-int-or-string") else schema["type"]
            self.fail(path, "Invalid type", f"{_show(value)}: {path} in body must be of type {wanted}: "
                                            f"{json.dumps(_type_of(value))}")
            return value
        if isinstance(value, dict):
            return self._object(schema, value, path)
        if isinstance(value, list):
            return self._array(schema, value, path)
        self._scalar(schema, value, path)
        return value

    def _object(self, schema: dict, value: dict, path: str) -> dict:
        for key in schema.get("required", []):
            if key not in value:
                self.fail(_join(path, key), "Required value")
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            self.fail(path, "Too many", f"{len(value)}: must have at most {schema['maxProperties']} items")
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        kept = {}
        for key, item in value.items():
            sub = properties.get(key) if isinstance(key, str) else None
            if sub is None and isinstance(extra, dict) and isinstance(key, str):
                sub = extra
            if sub is None:
                if not schema.get("x-kubernetes-preserve-unknown-fields"):
                    self.fail(_join(path, key), "Forbidden", "field not declared in schema")
                    continue
                kept[key] = item
                continue
            kept[key] = self.check(sub, item, _join(path, key))
        return kept

    def _array(self, schema: dict, value: list, path: str) -> list:
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            self.fail(path, "Too many", f"{len(value)}: must have at most {schema['maxItems']} items")
        items = schema.get("items", {})
        kept = [self.check(items, item, f"{path}[{index}]") for index, item in enumerate(value)]
        if schema.get("x-kubernetes-list-type") == "map":
            self._map_keys(schema["x-kubernetes-list-map-keys"], kept, path)
        return kept

    def _map_keys(self, keys: list[str], items: list, path: str) -> None:
        seen: set[str] = set()
        for index, item in enumerate(items):
            if not isinstance(item, dict):
                continue
            identity = json.dumps({key: item.get(key) for key in keys}, sort_keys=True)
            if identity in seen:
                self.fail(f"{path}[{index}]", "Duplicate value", identity)
            seen.add(identity)

    def _scalar(self, schema: dict, value: Any, path: str) -> None:
        if "enum" in schema and value not in schema["enum"]:
            allowed = ", ".join(_show(item) for item in schema["enum"])
            self.fail(path, "Unsupported value", f"{_show(value)}: supported values: {allowed}")
            return
        if isinstance(value, str):
            self._string(schema, value, path)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            self._number(schema, value, path)

    def _string(self, schema: dict, value: str, path: str) -> None:
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            self.fail(path, "Too long", f"may not be more than {schema['maxLength']} bytes")
        if "minLength" in schema and len(value) < schema["minLength"]:
            self.fail(path, "Invalid value", f"{_show(value)}: {path} in body should be at least "
                                             f"{schema['minLength']} chars long")
        if "pattern" in schema and not _pattern(schema["pattern"]).search(value):
            self.fail(path, "Invalid value", f"{_show(value)}: {path} in body should match "
                                             f"'{schema['pattern']}'")
        if schema.get("format") == "date-time" and not is_date_time(value):
            self.fail(path, "Invalid value", f"{_show(value)}: {path} in body must be of type date-time: "
                                             f"{_show(value)}")

    def _number(self, schema: dict, value: float, path: str) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            self.fail(path, "Invalid value", f"{value}: {path} in body must be a finite number")
            return
        if "minimum" in schema:
            low = schema["minimum"]
            if schema.get("exclusiveMinimum") and not value > low:
                self.fail(path, "Invalid value", f"{_show(value)}: {path} in body should be greater than {low}")
            elif not value >= low:
                self.fail(path, "Invalid value", f"{_show(value)}: {path} in body should be greater than "
                                                 f"or equal to {low}")
        if "maximum" in schema:
            high = schema["maximum"]
            if schema.get("exclusiveMaximum") and not value < high:
                self.fail(path, "Invalid value", f"{_show(value)}: {path} in body should be less than {high}")
            elif not value <= high:
                self.fail(path, "Invalid value", f"{_show(value)}: {path} in body should be less than "
                                                 f"or equal to {high}")


@functools.lru_cache(maxsize=256)
def _pattern(pattern: str) -> re.Pattern:
    # ECMA/RE2 `$` ends the text; Python's `$` would also match before a final newline.
    return re.compile(pattern[:-1] + r"\Z" if pattern.endswith("$") and not pattern.endswith(r"\$") else pattern)


def is_date_time(text: str) -> bool:
    """RFC 3339 date-time, the `date-time` format (a time zone is mandatory)."""
    if not DATE_TIME.match(text):
        return False
    try:
        datetime.fromisoformat(text.upper().replace(" ", "T"))
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# CEL rules


@functools.lru_cache(maxsize=512)
def _program(expression: str) -> celpy.Runner:
    environment = celpy.Environment()
    return environment.program(environment.compile(expression))


def to_cel(schema: dict, value: Any) -> Any:
    """A JSON value as the CEL type the server gives it (numbers of `type: number` are doubles)."""
    if isinstance(value, dict):
        return celtypes.MapType({celtypes.StringType(key): to_cel(_property_schema(schema, key) or {}, item)
                                 for key, item in value.items()})
    if isinstance(value, list):
        return celtypes.ListType([to_cel(schema.get("items", {}), item) for item in value])
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, int):
        return celtypes.DoubleType(value) if schema.get("type") == "number" else celtypes.IntType(value)
    if isinstance(value, float):
        return celtypes.DoubleType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    return None


def _nodes(schema: dict, value: Any, old: Any, path: str) -> Iterator[tuple[dict, Any, Any, str]]:
    """Every (schema, value, old value or None, path) in the object, old correlated where it can be."""
    yield schema, value, old, path
    if isinstance(value, dict):
        for key, item in value.items():
            sub = _property_schema(schema, key)
            if sub is not None:
                old_item = old.get(key) if isinstance(old, dict) else None
                yield from _nodes(sub, item, old_item, _join(path, key))
    elif isinstance(value, list):
        items = schema.get("items", {})
        keys = schema.get("x-kubernetes-list-map-keys") if schema.get("x-kubernetes-list-type") == "map" else None
        for index, item in enumerate(value):
            yield from _nodes(items, item, _correlate(keys, item, old), f"{path}[{index}]")


def _correlate(keys: list[str] | None, item: Any, old: Any) -> Any:
    """The old element of a list-map with the same keys; none for atomic lists (as the server)."""
    if not keys or not isinstance(old, list) or not isinstance(item, dict):
        return None
    for candidate in old:
        if isinstance(candidate, dict) and all(candidate.get(key) == item.get(key) for key in keys):
            return candidate
    return None


def _rule_errors(schema: dict, value: Any, old: Any, path: str) -> list[SchemaError]:
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        expression = rule["rule"]
        transition = re.search(r"\boldSelf\b", expression) is not None
        if transition and old is None:
            continue
        where = (path + rule.get("fieldPath", "")).lstrip(".")
        activation = {"self": to_cel(schema, value)}
        if transition:
            activation["oldSelf"] = to_cel(schema, old)
        try:
            result = _program(expression).evaluate(activation)
        except (celpy.CELEvalError, ValueError, TypeError, OverflowError) as error:
            result = celpy.CELEvalError(str(error))
        if isinstance(result, celpy.CELEvalError):
            errors.append(SchemaError(where or "<nil>", "Invalid value",
                                      f'"object": rule evaluation error: {result.args[0] if result.args else result}'))
        elif not (isinstance(result, celtypes.BoolType) and bool(result)):
            message = _message(rule, activation)
            errors.append(SchemaError(where or "<nil>", CEL_REASONS.get(rule.get("reason", ""), "Invalid value"),
                                      f'"object": {message}' if rule.get("reason") in (None, "FieldValueInvalid")
                                      else message))
    return errors


def _message(rule: dict, activation: dict) -> str:
    if "messageExpression" in rule:
        try:
            return str(_program(rule["messageExpression"]).evaluate(activation))
        except celpy.CELEvalError:
            pass
    return rule.get("message") or f"failed rule: {rule['rule']}"


# ---------------------------------------------------------------------------------------------
# The entry point


def validate_object(crd: dict, obj: dict, old: dict | None = None) -> list[str]:
    """Every error the API server would report for creating `obj` (updating `old` to it).

    The object is checked as the server stores it: nulls pruned and defaults applied first (pass
    it through `prepare` to get that form). Returns an empty list for a valid object.
    """
    return [str(error) for error in schema_errors(crd, obj, old)]


def prepare(crd: dict, obj: dict) -> dict:
    """`obj` as the server would store it: nulls pruned, defaults applied (a copy)."""
    if not isinstance(obj, dict):
        return obj
    version = served_version(crd, obj.get("apiVersion")) if isinstance(obj, dict) else None
    schema = version["schema"]["openAPIV3Schema"] if version else version_schema(crd)
    return apply_defaults(schema, prune_nulls(schema, obj))


def prune_unknown(crd: dict, obj: dict) -> dict:
    """`obj` without the fields its schema does not declare (metadata kept whole), as stored.

    What the server does on a write without strict field validation (kopf's patches, for one):
    undeclared fields are dropped with a warning instead of refusing the request.
    """
    version = served_version(crd, obj.get("apiVersion"))
    schema = version["schema"]["openAPIV3Schema"] if version else version_schema(crd)
    body = {key: value for key, value in obj.items() if key != "metadata"}
    root = {**schema, "properties": {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}}
    kept = _Walker().check(root, body, "")
    return {**kept, "metadata": obj["metadata"]} if "metadata" in obj else kept


def schema_errors(crd: dict, obj: Any, old: dict | None = None, *, rules: bool = True) -> list[SchemaError]:
    """`validate_object`, as structured errors; `rules=False` checks the OpenAPI schema alone."""
    if not isinstance(obj, dict):
        return [SchemaError("<nil>", "Invalid type", f"{_show(obj)}: the object must be of type object")]
    walker = _Walker()
    version = served_version(crd, obj.get("apiVersion"))
    if version is None:
        served = ", ".join(f"{crd['spec']['group']}/{v['name']}" for v in crd["spec"]["versions"] if v.get("served", True))
        walker.fail("apiVersion", "Unsupported value", f"{_show(obj.get('apiVersion'))}: supported values: {served}")
        return walker.errors
    if obj.get("kind") != crd["spec"]["names"]["kind"]:
        walker.fail("kind", "Unsupported value", f"{_show(obj.get('kind'))}: supported values: "
                                                 f"{_show(crd['spec']['names']['kind'])}")
    schema = version["schema"]["openAPIV3Schema"]
    current = prepare(crd, obj)
    previous = prepare(crd, old) if isinstance(old, dict) else None
    pruned = _check_root(walker, schema, current)
    if not rules:
        return walker.errors
    if any(error.kind in BLOCKING for error in walker.errors):
        return [*walker.errors, SchemaError("<nil>", "Invalid value", f'"null": {CEL_SKIPPED}')]
    # The stored old object was valid; prune it the same way so CEL compares like with like.
    old_pruned = _check_root(_Walker(), schema, previous) if previous is not None else None
    for node_schema, value, old_value, path in _nodes(schema, pruned, old_pruned, ""):
        walker.errors.extend(_rule_errors(node_schema, value, old_value, path))
    return walker.errors


def _check_root(walker: _Walker, schema: dict, obj: dict) -> dict:
    """The root: metadata is ObjectMeta (only its declared fields are checked), the rest is schema."""
    meta = obj.get("metadata", {})
    body = {key: value for key, value in obj.items() if key != "metadata"}
    root = {**schema, "properties": {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}}
    pruned = walker.check(root, body, "")
    meta_schema = (schema.get("properties") or {}).get("metadata", {})
    if not isinstance(meta, dict):
        walker.fail("metadata", "Invalid type", f"{_show(meta)}: metadata in body must be of type object")
        return pruned
    if not meta.get("name") and not meta.get("generateName"):
        walker.fail("metadata.name", "Required value", "name or generateName is required")
    for key in ("labels", "annotations"):
        entries = meta.get(key, {})
        if not isinstance(entries, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in entries.items()):
            walker.fail(f"metadata.{key}", "Invalid type", f"{_show(entries)}: must map strings to strings")
    declared = {key: meta[key] for key in (meta_schema.get("properties") or {}) if key in meta}
    walker.check({**meta_schema, "required": []}, declared, "metadata")
    return {**pruned, "metadata": {key: meta[key] for key in ("name", "generateName") if key in meta}}

