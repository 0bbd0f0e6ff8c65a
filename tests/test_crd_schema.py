"""The KareusJob CRD's shape (what `kubectl explain` and `kubectl get` show) and how the real API
server applies it: pruning, defaulting, which errors block the CEL rules, where the rules report,
formats, patterns and list keys, metadata, and what a non-strict write does to undeclared fields.

The server is the session's control plane (tests/conftest.py); a dry-run create stores nothing.
"""

from __future__ import annotations

import copy
import re

import pytest
import yaml
from crd_server import CRD_FILE, GROUP, PLURAL, ROOT, VERSION, apply_crd, dry_run_create

from kareus.spec.fields import RFC3339
from kareus.spec.parse import PROFILING_BACKENDS, PROFILING_PRESETS
from kareus.workload.models import PRESETS

CRD = yaml.safe_load(CRD_FILE.read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC = SCHEMA["properties"]["spec"]
STATUS = SCHEMA["properties"]["status"]
CEL_SKIPPED = ("<nil>: Invalid value: null: some validation rules were not checked because the object was "
               "invalid; correct the existing errors to complete validation")


@pytest.fixture(scope="module")
def kareusjob_crd(kubectl, control_plane) -> dict:
    return apply_crd(kubectl, control_plane, CRD_FILE)


@pytest.fixture
def job() -> dict:
    return yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())


def refusal_lines(kube_client, manifest: dict) -> list[str]:
    """The server's refusal of creating `manifest`, one `path: reason` per error."""
    verdict = dry_run_create(kube_client, manifest)
    assert not verdict.accepted, verdict.stored
    # The message is `KareusJob.kareus.dev "name" is invalid: [a, b]` or, for one error, without brackets.
    errors = verdict.message.split(" is invalid: ", 1)[1]
    return re.split(r", (?=\S+: )", errors[1:-1]) if errors.startswith("[") else [errors]


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
        if path == ".metadata":
            # The server refuses a CRD whose root metadata has a description (or anything but `type`
            # and name/generateName); `kubectl explain` shows ObjectMeta's there.
            assert set(schema) == {"type", "properties"}, schema
            continue
        assert schema.get("description"), f"{path} has no description"
        assert schema.get("type") or schema.get("x-kubernetes-int-or-string"), f"{path} has no type"


# Kubernetes types a pod override passes through whole: the API server validates them when the
# child Job is created (their schemas are thousands of lines; a refusal becomes a condition).
OPEN_KUBERNETES_TYPES = (".spec.podTemplateOverrides[].spec.affinity", ".spec.podTemplateOverrides[].spec.volumes[]")


def test_structural_rules():
    """No field may be left open — every object lists its properties or a typed additionalProperties —
    but the Kubernetes types a pod override passes to the API server whole."""
    for path, schema in walk(SCHEMA):
        assert not schema.get("x-kubernetes-preserve-unknown-fields") or path in OPEN_KUBERNETES_TYPES, path
        if schema.get("type") == "object" and path not in (".spec.objective.maxThroughput", *OPEN_KUBERNETES_TYPES):
            assert schema.get("properties") or isinstance(schema.get("additionalProperties"), dict), path
        if schema.get("type") == "array":
            assert "maxItems" in schema, f"{path}: CEL cost estimation needs bounded lists"


def test_enums_match_the_python_spec():
    model = SPEC["properties"]["model"]["properties"]
    assert model["preset"]["enum"] == sorted(PRESETS)
    profiling = SPEC["properties"]["profiling"]["properties"]
    assert sorted(profiling["backend"]["enum"]) == sorted(PROFILING_BACKENDS)
    assert sorted(profiling["preset"]["enum"]) == sorted(PROFILING_PRESETS)


def test_deadline_pattern_is_the_python_specs():
    deadline = SPEC["properties"]["objective"]["properties"]["timeBudget"]["properties"]["deadline"]
    assert deadline["pattern"] == f"^{RFC3339.pattern}$" and deadline["format"] == "date-time"


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
    assert {"iterations", "energyJoules", "averageIterationSeconds", "percentComplete", "etaSeconds"} <= \
        set(props["measured"]["properties"])
    assert set(props["checkpoint"]["properties"]) == {"lastStep", "lastTime", "resumedFromStep"}
    assert {"key", "configMap"} <= set(props["profile"]["properties"])
    assert props["phase"]["enum"] == ["Pending", "Profiling", "Optimizing", "Training", "Succeeded", "Failed",
                                      "Suspended"]


def test_printer_columns():
    columns = CRD["spec"]["versions"][0]["additionalPrinterColumns"]
    default = [c["name"] for c in columns if not c.get("priority")]
    assert default == ["Phase", "Objective", "Pred s/iter", "Pred J/iter", "Energy", "Done %", "ETA s", "Age"]
    paths = {c["name"]: c["jsonPath"] for c in columns}
    assert paths["Done %"] == ".status.measured.percentComplete"
    assert paths["ETA s"] == ".status.measured.etaSeconds"
    assert any(c.get("priority") == 1 for c in columns)
    for column in columns:  # every column points at a declared field
        if column["jsonPath"] == ".metadata.creationTimestamp":
            continue
        node = SCHEMA
        for part in column["jsonPath"].strip(".").split("."):
            node = node["properties"][part]
        assert node["type"] == column["type"], column["name"]


def test_field_reference_lists_every_field():
    """docs/kareusjob.md documents every spec and status field of the CRD."""
    reference = (ROOT / "docs" / "kareusjob.md").read_text()
    for part in ("spec", "status"):
        for path, _ in walk(SCHEMA["properties"][part], part):
            if path.endswith(("{}", "[]")):  # map values and list items of scalars are described by their field
                continue
            assert f"`{path}`" in reference, path


def test_immutability_rule_names_every_spec_field_but_objective_suspend_and_overrides():
    [rule] = [r["rule"] for r in SCHEMA["x-kubernetes-validations"] if "oldSelf" in r["rule"]]
    for key in SPEC["properties"]:
        assert (f"self.spec.{key} == oldSelf.spec.{key}" in rule) == (key not in ("objective", "suspend", "podTemplateOverrides")), key


# ----------------------------------------------------------------------------- on the real API server


@pytest.mark.usefixtures("kareusjob_crd")
def test_nulls_are_pruned_before_defaulting(kube_client, job):
    job["spec"]["profiling"] = {"backend": "sim", "reuse": None}
    job["spec"]["suspend"] = None
    stored = dry_run_create(kube_client, job).stored
    assert stored["spec"]["profiling"] == {"backend": "sim", "reuse": True, "measurementSeconds": 5,
                                           "cooldownSeconds": 5, "preset": "default"}
    assert stored["spec"]["suspend"] is False


@pytest.mark.usefixtures("kareusjob_crd")
def test_bounds_and_enums_refuse_at_their_fields(kube_client, job):
    job["spec"]["parallelism"]["tensor"] = 0
    job["spec"]["profiling"] = {"backend": "rocm"}
    errors = refusal_lines(kube_client, job)
    assert "spec.parallelism.tensor: Invalid value: 0: spec.parallelism.tensor in body should be greater than " \
           "or equal to 1" in errors
    assert 'spec.profiling.backend: Unsupported value: "rocm": supported values: "auto", "sim", "nvml"' in errors


@pytest.mark.usefixtures("kareusjob_crd")
def test_type_errors_skip_the_cel_rules(kube_client, job):
    """What kareus.spec mirrors: a field of the wrong type is the one error, no cross-field ones."""
    job["spec"]["parallelism"]["tensor"] = "two"
    job["spec"]["training"]["nodes"] = 3  # would break the product rule, but CEL does not run
    assert refusal_lines(kube_client, job) == [
        'spec.parallelism.tensor: Invalid value: "string": spec.parallelism.tensor in body must be of type '
        'integer: "string"', CEL_SKIPPED]


@pytest.mark.usefixtures("kareusjob_crd")
def test_cel_rules_report_at_their_field_path(kube_client, job):
    job["spec"]["parallelism"]["data"] = 2
    job["spec"]["objective"] = {"timeBudget": {}}
    assert refusal_lines(kube_client, job) == [
        'spec.parallelism: Invalid value: "object": tensor × pipeline × context × data must equal '
        "training.nodes × training.gpusPerNode",
        'spec.objective.timeBudget: Invalid value: "object": must set exactly one time budget of '
        "maxSlowdownPercent, iterationSeconds, deadline",
    ]


@pytest.mark.usefixtures("kareusjob_crd")
def test_formats_patterns_and_lists(kube_client, job):
    job["spec"]["objective"] = {"timeBudget": {"deadline": "2027-01-01T00:00:00"}}  # no time zone
    job["spec"]["training"]["env"] = [{"name": "A"}, {"name": "A", "value": "2"}]
    job["spec"]["training"]["resources"] = {"limits": {"memory": "80Gi", "cpu": 8, "x": "8\n"}}
    job["spec"]["training"]["command"] = ["x"] * 257
    errors = "\n".join(refusal_lines(kube_client, job))
    assert "spec.objective.timeBudget.deadline: Invalid value" in errors and "date-time" in errors
    assert 'spec.training.env[1]: Duplicate value: {"name":"A"}' in errors
    assert "spec.training.resources.limits.x: Invalid value" in errors  # `$` is the end of the text
    assert "spec.training.resources.limits.memory" not in errors and ".cpu" not in errors
    assert "spec.training.command: Too many: 257: must have at most 256 items" in errors


@pytest.mark.usefixtures("kareusjob_crd")
def test_deadline_pattern_refuses_what_cel_cannot_read(kube_client, job):
    # The date-time format alone lets a lower-case t or z through, and CEL's timestamps cannot read
    # it (a rule evaluation error at the budget); the pattern names the field itself.
    job["spec"]["objective"] = {"timeBudget": {"deadline": "2027-01-01t00:00:00z"}}
    [pattern, cel] = refusal_lines(kube_client, job)
    assert pattern.startswith('spec.objective.timeBudget.deadline: Invalid value: "2027-01-01t00:00:00z": '
                              "spec.objective.timeBudget.deadline in body should match '^")
    assert cel.startswith('spec.objective.timeBudget: Invalid value: "object": Invalid date-time formatted string')


@pytest.mark.usefixtures("kareusjob_crd")
def test_metadata_and_identity(kube_client, job):
    job["metadata"] = {"name": "x" * 41, "labels": {"a": "b"}}
    assert refusal_lines(kube_client, job) == ["metadata.name: Too long: may not be more than 40 bytes", CEL_SKIPPED]
    job["metadata"] = {"generateName": "quick-"}
    assert re.fullmatch(r"quick-[a-z0-9]{5}", dry_run_create(kube_client, job).stored["metadata"]["name"])
    job["kind"] = "Job"
    assert refusal_lines(kube_client, job) == ['kind: Invalid value: "Job": must be KareusJob']
    job["apiVersion"] = "kareus.dev/v2"
    assert dry_run_create(kube_client, job).status == 400  # no schema to check it against


@pytest.mark.usefixtures("kareusjob_crd")
def test_a_non_strict_write_drops_undeclared_fields(kube_client, job):
    """What kopf's patches get (no strict field validation): undeclared fields dropped, not refused."""
    job["spec"]["extra"] = 1
    assert dry_run_create(kube_client, job).status == 400
    stored = dry_run_create(kube_client, job, field_validation="Warn").stored
    assert "extra" not in stored["spec"] and stored["spec"]["backoffLimit"] == 3


@pytest.mark.usefixtures("kareusjob_crd")
def test_status_keeps_only_declared_fields(kube_client, namespace, job):
    from kubernetes import client

    api = client.CustomObjectsApi(kube_client)
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)
    status = {"phase": "Training", "notDeclared": {"x": 1}, "measured": {"iterations": 3, "bogus": 1}}
    stored = api.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, "quickstart",
                                                       {"status": status})
    assert stored["status"] == {"phase": "Training", "measured": {"iterations": 3}}
    # A status written with the create is dropped: the status subresource owns it.
    created = copy.deepcopy(job)
    created["metadata"]["name"] = "with-status"
    created["status"] = {"phase": "Succeeded"}
    assert "status" not in api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, created)
