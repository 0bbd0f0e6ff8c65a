"""`kareus.spec` checks an override's affinity and volumes against core/v1's schemas as the CRD types
them (`kareus.spec.core_types`): the packaged copy is the CRD's, and what the API server's strict
validation refuses there (unknown fields, wrong types, bounds) is refused with its field path. The
API server's own verdicts on the same manifests: tests/test_crd_agreement.py (invalid corpus)."""

from __future__ import annotations

import copy

import pytest
import yaml
from crd_server import CRD_FILE, ROOT

from kareus.spec import SpecError, parse_job
from kareus.spec.core_types import MAX_ERRORS, from_crd, schema_errors, schemas

QUICKSTART = ROOT / "examples" / "quickstart.yaml"
AT = "spec.podTemplateOverrides[0].spec"
AFFINITY = {  # a real one: GPU nodes by label, spread over zones, away from other jobs' pods
    "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-A100-SXM4-40GB"]}]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 50, "preference": {"matchExpressions": [{"key": "zone", "operator": "Exists"}]}}]},
    "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 10, "podAffinityTerm": {
        "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"kareus.dev/role": "train"}}}}]}}
VOLUMES = [{"name": "cfg", "configMap": {"name": "settings", "defaultMode": 0o644, "items": [{"key": "a", "path": "a"}]}},
           {"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
           {"name": "data", "persistentVolumeClaim": {"claimName": "corpus", "readOnly": True}}]


def with_override(spec: dict) -> dict:
    manifest = yaml.safe_load(QUICKSTART.read_text())
    manifest["spec"]["podTemplateOverrides"] = [{"roles": ["train"], "spec": spec}]
    return manifest


def errors_of(spec: dict) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_job(with_override(spec))
    return [str(error) for error in caught.value.errors]


def test_the_packaged_schemas_are_the_crds():
    assert schemas() == from_crd(yaml.safe_load(CRD_FILE.read_text())), (
        "regenerate: python -m kareus.spec.core_types crds/kareusjob.yaml > kareus/spec/core_types.json")


def test_real_affinities_and_volumes_pass():
    spec = parse_job(with_override({"affinity": AFFINITY, "volumes": VOLUMES})).spec
    assert spec.pod_overrides[0].affinity == AFFINITY and list(spec.pod_overrides[0].volumes) == VOLUMES
    # A null is what the API server drops where the schema is not nullable: not an error.
    assert parse_job(with_override({"affinity": {"nodeAffinity": None}}))


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda a, v: a["podAntiAffinity"].update(preferredDuringSchedulingIgnoredDuringExecution="spread"),
     f"{AT}.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution: must be a list, got 'spread'"),
    (lambda a, v: a["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0].update(wieght=1),
     f"{AT}.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].wieght: unknown field "
     f"(did you mean weight?)"),
    (lambda a, v: a["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0].update(weight=2**31),
     "weight: must be an int32 (-2147483648..2147483647), got 2147483648"),
    (lambda a, v: a["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0].update(weight=True),
     "weight: must be an integer, got True"),
    (lambda a, v: a["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"].pop(
        "topologyKey"), "podAffinityTerm.topologyKey: required field is missing"),
    (lambda a, v: v[1]["emptyDir"].update(sizeLimit=["1Gi"]), f"{AT}.volumes[1].emptyDir.sizeLimit: must be an integer or a string"),
    (lambda a, v: v[0].update(hostPth={"path": "/"}), f"{AT}.volumes[0].hostPth: unknown field (did you mean hostPath?)"),
    (lambda a, v: v[0]["configMap"].update(items=[{"key": "k", "path": "p"}] * 65),
     f"{AT}.volumes[0].configMap.items: must have at most 64 items, got 65"),
])
def test_what_the_crd_refuses_is_refused_with_its_path(edit, expected):
    affinity, volumes = copy.deepcopy(AFFINITY), copy.deepcopy(VOLUMES)
    edit(affinity, volumes)
    errors = errors_of({"affinity": affinity, "volumes": volumes})
    assert any(expected in error for error in errors), errors


def test_a_flood_of_bad_fields_is_a_few_errors():
    junk = {f"field{i}": i for i in range(500)}
    assert len(schema_errors(junk, schemas()["affinity"], "affinity")) == MAX_ERRORS
    assert len(errors_of({"affinity": junk})) == MAX_ERRORS
