"""The KareusJob CRD's shape (what `kubectl explain` and `kubectl get` show) and the schema engine."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml
from kareus_operator.crdschema import (
    apply_defaults,
    prepare,
    prune_nulls,
    prune_unknown,
    validate_object,
    version_schema,
)

from kareus.spec.parse import PROFILING_BACKENDS, PROFILING_PRESETS
from kareus.workload.models import PRESETS

ROOT = Path(__file__).resolve().parents[1]
CRD = yaml.safe_load((ROOT / "crds" / "kareusjob.yaml").read_text())
SCHEMA = version_schema(CRD)
SPEC = SCHEMA["properties"]["spec"]
STATUS = SCHEMA["properties"]["status"]


@pytest.fixture
def job() -> dict:
    return yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())


def walk(schema: dict, path: str = ""):
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{key}")
    if "items" in schema:
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def test_names_and_version():
    names = CRD["spec"]["names"]
    assert CRD["metadata"]["name"] == "kareusjobs.kareus.dev" and CRD["spec"]["group"] == "kareus.dev"
    assert (names["kind"], names["plural"], names["shortNames"], names["categories"]) == \
        ("KareusJob", "kareusjobs", ["kj", "kjob"], ["kareus"])
    [version] = CRD["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}


def test_every_field_is_described_and_typed():
    for path, schema in walk(SCHEMA):
        assert schema.get("description"), f"{path} has no description"
        assert schema.get("type") or schema.get("x-kubernetes-int-or-string"), f"{path} has no type"


def test_structural_rules():
    """No field may be left open: every object lists its properties or a typed additionalProperties."""
    for path, schema in walk(SCHEMA):
        assert not schema.get("x-kubernetes-preserve-unknown-fields"), path
        if schema.get("type") == "object" and path not in (".spec.objective.maxThroughput",):
            assert schema.get("properties") or isinstance(schema.get("additionalProperties"), dict), path
        if schema.get("type") == "array":
            assert "maxItems" in schema, f"{path}: CEL cost estimation needs bounded lists"


def test_enums_match_the_python_spec():
    model = SPEC["properties"]["model"]["properties"]
    assert model["preset"]["enum"] == sorted(PRESETS)
    profiling = SPEC["properties"]["profiling"]["properties"]
    assert sorted(profiling["backend"]["enum"]) == sorted(PROFILING_BACKENDS)
    assert sorted(profiling["preset"]["enum"]) == sorted(PROFILING_PRESETS)


def test_cel_preset_tables_match_the_presets():
    """The CEL rules carry each preset's heads, kvHeads and layers; they must be the presets' numbers."""
    rules = " ".join(rule["rule"] for _, schema in walk(SCHEMA) for rule in schema.get("x-kubernetes-validations", []))
    tables = re.findall(r"\{('[^}]*)\}\[self\.(?:model\.)?preset\]", rules)
    assert len(tables) == 5
    found = [dict((k, int(v)) for k, v in re.findall(r"'([^']+)': (\d+)", table)) for table in tables]
    expected = [{name: getattr(shape, attr) for name, shape in PRESETS.items()}
                for attr in ("num_heads", "num_kv_heads", "num_layers", "num_heads", "num_kv_heads")]
    assert found == expected


def test_status_declares_what_the_operator_writes():
    props = STATUS["properties"]
    for key in ("phase", "observedGeneration", "conditions", "profile", "plan", "measured", "startTime",
                "completionTime", "trainingStartTime", "restarts"):
        assert key in props
    condition = props["conditions"]["items"]["properties"]
    assert set(condition) == {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}
    assert props["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    assert {"configMap", "predictedIterationSeconds", "predictedIterationJoules", "frontierPoints"} <= \
        set(props["plan"]["properties"])
    assert {"iterations", "energyJoules", "averageIterationSeconds"} <= set(props["measured"]["properties"])
    assert {"key", "configMap"} <= set(props["profile"]["properties"])
    assert props["phase"]["enum"] == ["Pending", "Profiling", "Optimizing", "Training", "Succeeded", "Failed",
                                      "Suspended"]


def test_printer_columns():
    columns = CRD["spec"]["versions"][0]["additionalPrinterColumns"]
    default = [c["name"] for c in columns if not c.get("priority")]
    assert default == ["Phase", "Objective", "Pred s/iter", "Pred J/iter", "Energy", "Age"]
    assert any(c.get("priority") == 1 for c in columns)
    for column in columns:  # every column points at a declared field
        if column["jsonPath"] == ".metadata.creationTimestamp":
            continue
        node = SCHEMA
        for part in column["jsonPath"].strip(".").split("."):
            node = node["properties"][part]
        assert node["type"] == column["type"], column["name"]


def test_defaults_fill_what_the_user_left_out(job):
    stored = prepare(CRD, job)
    assert stored["spec"]["profiling"] == {"reuse": True, "measurementSeconds": 5, "cooldownSeconds": 5,
                                           "preset": "default", "backend": "auto"}
    assert stored["spec"]["gpu"] == {"product": "A100-SXM4-40GB"}
    assert stored["spec"]["backoffLimit"] == 3 and stored["spec"]["suspend"] is False
    assert "activeDeadlineSeconds" not in stored["spec"]
    assert job["spec"].get("profiling") is None  # the input is not modified
    assert apply_defaults(CRD, job) == stored  # a whole CRD works too (as the dev cluster calls it)
    user_set = copy.deepcopy(job)
    user_set["spec"]["profiling"] = {"backend": "sim", "reuse": None}
    assert prepare(CRD, user_set)["spec"]["profiling"]["backend"] == "sim"
    assert prepare(CRD, user_set)["spec"]["profiling"]["reuse"] is True  # null pruned, then defaulted
    assert prune_nulls(SCHEMA, {"spec": {"suspend": None}}) == {"spec": {}}


def test_server_style_messages(job):
    job["spec"]["parallelism"]["tensor"] = 0
    job["spec"]["profiling"] = {"backend": "rocm"}
    job["spec"]["extra"] = True
    errors = validate_object(CRD, job)
    assert "spec.parallelism.tensor: Invalid value: 0: spec.parallelism.tensor in body should be greater than " \
           "or equal to 1" in errors
    assert 'spec.profiling.backend: Unsupported value: "rocm": supported values: "auto", "sim", "nvml"' in errors
    assert "spec.extra: Forbidden: field not declared in schema" in errors


def test_type_errors_skip_cel_like_the_server(job):
    job["spec"]["parallelism"]["tensor"] = "two"
    job["spec"]["training"]["nodes"] = 3  # would break the product rule, but CEL does not run
    errors = validate_object(CRD, job)
    assert errors[0].startswith('spec.parallelism.tensor: Invalid value: "two": spec.parallelism.tensor in body '
                                "must be of type integer")
    assert errors[-1].endswith("some validation rules were not checked because the object was invalid; correct "
                               "the existing errors to complete validation")
    assert len(errors) == 2


def test_cel_rules_report_at_their_field_path(job):
    job["spec"]["parallelism"]["data"] = 2
    job["spec"]["objective"] = {"timeBudget": {}}
    assert validate_object(CRD, job) == [
        'spec.parallelism: Invalid value: "object": tensor × pipeline × context × data must equal '
        "training.nodes × training.gpusPerNode",
        'spec.objective.timeBudget: Invalid value: "object": must set exactly one time budget of '
        "maxSlowdownPercent, iterationSeconds, deadline",
    ]


def test_formats_patterns_lists(job):
    job["spec"]["objective"] = {"timeBudget": {"deadline": "2027-01-01T00:00:00"}}  # no time zone
    job["spec"]["training"]["env"] = [{"name": "A"}, {"name": "A", "value": "2"}]
    job["spec"]["training"]["resources"] = {"limits": {"memory": "80Gi", "cpu": 8, "x": "8\n"}}
    job["spec"]["training"]["command"] = ["x"] * 257
    errors = "\n".join(validate_object(CRD, job))
    assert "spec.objective.timeBudget.deadline: Invalid value" in errors and "date-time" in errors
    assert 'spec.training.env[1]: Duplicate value: {"name": "A"}' in errors
    assert "spec.training.resources.limits.x: Invalid value" in errors  # `$` is the end of the text
    assert "spec.training.resources.limits.memory" not in errors and ".cpu" not in errors
    assert "spec.training.command: Too many: 257: must have at most 256 items" in errors


def test_metadata_and_identity(job):
    job["metadata"] = {"name": "x" * 41, "uid": "abc", "labels": {"a": "b"}}
    assert validate_object(CRD, job) == ["metadata.name: Too long: may not be more than 40 bytes", "<nil>: Invalid "
                                         "value: \"null\": some validation rules were not checked because the "
                                         "object was invalid; correct the existing errors to complete validation"]
    job["metadata"] = {"generateName": "quick-"}
    assert validate_object(CRD, job) == []
    job["kind"] = "Job"
    assert validate_object(CRD, job)[0] == 'kind: Unsupported value: "Job": supported values: "KareusJob"'
    job["apiVersion"] = "kareus.dev/v2"
    assert validate_object(CRD, job) == ['apiVersion: Unsupported value: "kareus.dev/v2": supported values: '
                                         "kareus.dev/v1alpha1"]


def test_spec_is_immutable_once_training_started(job):
    old = prepare(CRD, job)
    old["status"] = {"phase": "Training", "trainingStartTime": "2026-01-01T00:00:00Z"}
    new = copy.deepcopy(old)
    new["spec"]["objective"] = {"energyBudget": {"perIterationJoules": 1e4}}
    new["spec"]["suspend"] = True
    assert validate_object(CRD, new, old) == []
    for change in ({"backoffLimit": 4}, {"sequenceLength": 128}, {"managedBy": "example.com/other"}):
        changed = copy.deepcopy(new)
        changed["spec"].update(change)
        assert validate_object(CRD, changed, old) == ["spec: Forbidden: is immutable once training started, "
                                                      "except objective and suspend"]
    removed = copy.deepcopy(old)
    del removed["spec"]["gpu"]  # defaulted back to the same value: not a change
    assert validate_object(CRD, removed, old) == []
    before_training = copy.deepcopy(old)
    before_training["status"] = {"phase": "Profiling"}
    changed["spec"]["sequenceLength"] = 128
    assert validate_object(CRD, changed, before_training) == []


def test_field_reference_lists_every_field():
    """docs/kareusjob.md documents every spec and status field of the CRD."""
    reference = (ROOT / "docs" / "kareusjob.md").read_text()
    for part in ("spec", "status"):
        for path, _ in walk(SCHEMA["properties"][part], part):
            if path.endswith(("{}", "[]")):  # map values and list items of scalars are described by their field
                continue
            assert f"`{path}`" in reference, path


def test_immutability_rule_names_every_spec_field_but_objective_and_suspend():
    [rule] = [r["rule"] for r in SCHEMA["x-kubernetes-validations"] if "oldSelf" in r["rule"]]
    for key in SPEC["properties"]:
        assert (f"self.spec.{key} == oldSelf.spec.{key}" in rule) == (key not in ("objective", "suspend")), key


@pytest.mark.parametrize(("field", "value"), [
    ("model", {"preset": "tiny", "layers": 2}), ("sequenceLength", 128), ("parallelism", {"tensor": 2,
     "microBatchSize": 2, "numMicroBatches": 2}), ("profiling", {"backend": "sim"}), ("gpu", {"product": "H200"}),
    ("backoffLimit", 0), ("managedBy", "example.com/x"), ("activeDeadlineSeconds", 60),
    ("ttlSecondsAfterFinished", 5)])
def test_each_field_is_frozen_by_training(job, field, value):
    old = prepare(CRD, job)
    old["status"] = {"trainingStartTime": "2026-01-01T00:00:00Z"}
    new = copy.deepcopy(old)
    new["spec"][field] = value
    immutable = "spec: Forbidden: is immutable once training started, except objective and suspend"
    assert validate_object(CRD, new, old) == [immutable]
    new_training = copy.deepcopy(old)
    new_training["spec"]["training"]["args"] = ["--seed", "1"]
    assert validate_object(CRD, new_training, old) == [immutable]


def test_prune_unknown_drops_undeclared_fields_like_a_non_strict_write(job):
    job["metadata"]["uid"] = "u-1"
    job["spec"]["extra"] = 1
    job["status"] = {"phase": "Training", "notDeclared": {"x": 1}, "measured": {"iterations": 3, "bogus": 1}}
    stored = prune_unknown(CRD, job)
    assert "extra" not in stored["spec"] and stored["metadata"]["uid"] == "u-1"
    assert stored["status"] == {"phase": "Training", "measured": {"iterations": 3}}
    assert validate_object(CRD, stored) == []
