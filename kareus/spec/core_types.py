"""The Kubernetes types a pod override carries (core/v1 Affinity and Volume), checked as the CRD does.

`crds/kareusjob.yaml` types `spec.podTemplateOverrides[].spec.affinity` and `.volumes[]` with the
structural schemas `tools/crd_core_types.py` generates from Kubernetes' OpenAPI, so the API server
refuses an unknown field or a wrong type there (kubectl's strict field validation). `kareus
validate` and the operator check the same schemas here, so a bad affinity term is reported with its
field path before any Job is created, not as a pod the API server refuses later.

`core_types.json` holds the two schemas as the CRD has them, descriptions dropped (the package does
not ship the CRD; `tests/test_spec_core_types.py` holds the two equal). After regenerating the CRD:

    python -m kareus.spec.core_types crds/kareusjob.yaml > kareus/spec/core_types.json

`schema_errors(value, schema, path)` walks a value without recursion (the spec's nesting limit
already bounds its depth) and returns at most `MAX_ERRORS` (path, message) pairs. The keywords are
the ones those schemas use: type, properties, required, additionalProperties, items, maxItems,
maxProperties, minLength, maxLength, pattern, format int32/int64, x-kubernetes-int-or-string.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

SCHEMA_FILE = Path(__file__).with_name("core_types.json")
MAX_ERRORS = 8  # one bad subtree is enough to act on; a list of hundreds is not
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_TYPE_NAMES = {"object": "an object", "array": "a list", "string": "a string", "integer": "an integer",
               "number": "a number", "boolean": "true or false"}


@cache
def schemas() -> dict[str, Any]:
    """{"affinity": <core/v1 Affinity>, "volume": <core/v1 Volume>}, as the CRD types them."""
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))


def schema_errors(value: Any, schema: Mapping[str, Any], path: str) -> list[tuple[str, str]]:
    """Where `value` breaks `schema`: (field path, what is allowed), at most MAX_ERRORS of them."""
    errors: list[tuple[str, str]] = []
    stack: list[tuple[Any, Mapping[str, Any], str]] = [(value, schema, path)]
    while stack and len(errors) < MAX_ERRORS:
        node, rule, at = stack.pop()
        problem = _scalar_problem(node, rule)
        if problem is not None:
            errors.append((at, problem))
            continue
        children: list[tuple[Any, Mapping[str, Any], str]] = []
        if isinstance(node, dict):
            properties = rule.get("properties")
            extra = rule.get("additionalProperties")
            if "maxProperties" in rule and len(node) > rule["maxProperties"]:
                errors.append((at, f"must have at most {rule['maxProperties']} entries, got {len(node)}"))
                continue
            errors += [(f"{at}.{key}", "required field is missing") for key in rule.get("required", ())
                       if node.get(key) is None]
            for key, item in node.items():
                if item is None:
                    continue  # the API server drops a null where the schema is not nullable
                if properties is not None and key in properties:
                    children.append((item, properties[key], f"{at}.{key}"))
                elif isinstance(extra, Mapping):
                    children.append((item, extra, f"{at}.{key}"))
                elif properties is not None:
                    errors.append((f"{at}.{key}", _unknown(key, properties)))
        elif isinstance(node, list):
            if "maxItems" in rule and len(node) > rule["maxItems"]:
                errors.append((at, f"must have at most {rule['maxItems']} items, got {len(node)}"))
                continue
            items = rule.get("items")
            if isinstance(items, Mapping):
                children += [(item, items, f"{at}[{index}]") for index, item in enumerate(node)]
        stack += reversed(children)  # depth first, in document order
    return errors[:MAX_ERRORS]


def _scalar_problem(node: Any, rule: Mapping[str, Any]) -> str | None:
    """What is wrong with `node` itself (its type and bounds), not with anything inside it."""
    if rule.get("x-kubernetes-int-or-string"):
        ok = isinstance(node, str) or (isinstance(node, int) and not isinstance(node, bool))
        return None if ok else f"must be an integer or a string, got {_describe(node)}"
    kind = rule.get("type")
    if kind is None:
        return None
    if not _is(node, kind):
        return f"must be {_TYPE_NAMES.get(kind, kind)}, got {_describe(node)}"
    if kind == "string":
        if len(node) < rule.get("minLength", 0):
            return f"must be at least {rule['minLength']} characters, got {_describe(node)}"
        if "maxLength" in rule and len(node) > rule["maxLength"]:
            return f"must be at most {rule['maxLength']} characters, got {len(node)}"
        if "pattern" in rule and not re.search(rule["pattern"], node):
            return f"must match {rule['pattern']}, got {_describe(node)}"
    if kind == "integer" and rule.get("format") in _INT_RANGES:
        low, high = _INT_RANGES[rule["format"]]
        if not low <= node <= high:
            return f"must be an {rule['format']} ({low}..{high}), got {node}"
    return None


def _is(node: Any, kind: str) -> bool:
    if kind == "integer":
        return (isinstance(node, int) and not isinstance(node, bool)) or (isinstance(node, float) and node.is_integer())
    if kind == "number":
        return isinstance(node, int | float) and not isinstance(node, bool)
    return isinstance(node, {"object": dict, "array": list, "string": str, "boolean": bool}.get(kind, object))


def _unknown(key: Any, properties: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(str(key), list(properties), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown field{hint}; allowed: {', '.join(sorted(properties))}"


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _strip(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: _strip(value) for key, value in node.items() if key != "description"}
    if isinstance(node, list):
        return [_strip(value) for value in node]
    return node


def from_crd(crd: Mapping[str, Any]) -> dict[str, Any]:
    """The two schemas as the KareusJob CRD (one parsed YAML document) types them."""
    version = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    override = version["properties"]["spec"]["properties"]["podTemplateOverrides"]["items"]
    pod = override["properties"]["spec"]["properties"]
    return {"affinity": _strip(pod["affinity"]), "volume": _strip(pod["volumes"]["items"])}


if __name__ == "__main__":  # regenerate core_types.json from the CRD (module docstring)
    import yaml

    sys.stdout.write(json.dumps(from_crd(yaml.safe_load(Path(sys.argv[1]).read_text())), indent=1, sort_keys=True)
                     + "\n")
