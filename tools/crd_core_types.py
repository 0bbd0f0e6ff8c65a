"""Print the CRD schemas of the Kubernetes types a pod override carries (core/v1 Affinity, Volume).

`crds/kareusjob.yaml` types `spec.podTemplateOverrides[].spec.affinity` and `.volumes[]` with these
schemas instead of preserving unknown fields: the API server then prunes and refuses anything that
is not a real Affinity or Volume field, so a manifest cannot nest without limit (a 1000-deep
"affinity" once broke the operator's LIST decoding). They are generated from the OpenAPI v3 document
the Kubernetes release publishes (`api/openapi-spec/v3/api__v1_openapi.json` in its source tree):

    python tools/crd_core_types.py ~/go/pkg/mod/k8s.io/kubernetes@v1.34.4/api/openapi-spec/v3/api__v1_openapi.json

$refs are inlined; defaults and list/map extensions are dropped (the API server applies its own
when the child Job is created); quantities and int-or-strings become `x-kubernetes-int-or-string`;
every list gets `maxItems` and every map `maxProperties` (a structural schema with bounds); an
embedded ObjectMeta keeps only labels and annotations; descriptions keep their first sentence.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import yaml

MAX_ITEMS = 64
MAX_PROPERTIES = 64
ROOTS = {"affinity": "io.k8s.api.core.v1.Affinity", "volume": "io.k8s.api.core.v1.Volume"}
INT_OR_STRING = ("io.k8s.apimachinery.pkg.api.resource.Quantity", "io.k8s.apimachinery.pkg.util.intstr.IntOrString")
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


def first_sentence(text: str) -> str:
    text = " ".join(text.split())
    match = re.match(r"(.+?\.)(\s|$)", text)
    sentence = match.group(1) if match else text
    return sentence if len(sentence) <= 200 else sentence[:197] + "..."


def convert(schemas: dict[str, Any], node: dict[str, Any], description: str, stack: tuple[str, ...]) -> dict[str, Any]:
    ref = node.get("$ref") or next((s["$ref"] for s in node.get("allOf", []) if "$ref" in s), None)
    if ref is not None:
        name = ref.rsplit("/", 1)[1]
        if name in stack:
            raise ValueError(f"recursive type {name} (a structural schema cannot hold it)")
        target = schemas[name]
        description = description or target.get("description", "")
        if name in INT_OR_STRING:
            return {"x-kubernetes-int-or-string": True, "description": first_sentence(description)}
        if name == OBJECT_META:
            target = {"type": "object", "properties": {k: target["properties"][k] for k in ("labels", "annotations")}}
        return convert(schemas, {**target, "description": description}, description, (*stack, name))
    out: dict[str, Any] = {"type": node.get("type", "object"),
                           "description": first_sentence(description or node.get("description", "")
                                                         or "See the Kubernetes API reference.")}
    if node.get("format") in ("int32", "int64", "double"):
        out["format"] = node["format"]
    if "enum" in node:
        out["enum"] = list(node["enum"])
    if out["type"] == "array":
        out["maxItems"] = MAX_ITEMS
        item = node["items"]
        out["items"] = convert(schemas, item, item.get("description", ""), stack)
    elif out["type"] == "object":
        if "properties" in node:
            out["properties"] = {key: convert(schemas, sub, sub.get("description", ""), stack)
                                 for key, sub in sorted(node["properties"].items())}
            if node.get("required"):
                out["required"] = sorted(node["required"])
        elif "additionalProperties" in node:
            value = node["additionalProperties"]
            out["maxProperties"] = MAX_PROPERTIES
            out["additionalProperties"] = convert(schemas, value, value.get("description", ""), stack)
    return out


def schemas_of(openapi: dict[str, Any]) -> dict[str, dict[str, Any]]:
    schemas = openapi["components"]["schemas"]
    return {key: convert(schemas, {"$ref": f"#/components/schemas/{name}"}, "", ()) for key, name in ROOTS.items()}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as handle:
        generated = schemas_of(json.load(handle))
    print(yaml.safe_dump(generated, sort_keys=False, width=10_000), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
