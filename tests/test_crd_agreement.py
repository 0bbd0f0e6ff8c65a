"""The CRD (as the API server applies it) and `kareus validate` accept and reject the same manifests.

Two implementations of one contract: the Python spec gives users precise messages and the
operator typed values; the CRD lets the API server refuse a bad job before the operator sees it.
The corpus is the examples, the hand-written invalid manifests (each names the field it breaks)
and hypothesis-generated manifests near the rules' edges, with random junk spliced in.
"""

from __future__ import annotations

import copy
import re
from datetime import datetime
from pathlib import Path

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kareus_operator.crdschema import prepare, schema_errors, validate_object

from kareus.spec import SpecError, load_job, parse_job, validation_errors
from kareus.workload.models import PRESETS

ROOT = Path(__file__).resolve().parents[1]
CRD = yaml.safe_load((ROOT / "crds" / "kareusjob.yaml").read_text())
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
INVALID = sorted((ROOT / "tests" / "data" / "invalid").glob("*.yaml"))


def crd_paths(errors: list[str]) -> list[str]:
    return [error.split(": ", 1)[0] for error in errors if not error.startswith("<nil>")]


def related(python_path: str, crd_path: str) -> bool:
    """Same field, or one names a part of the other (`env[1].name` inside `env[1]`)."""
    short, long = sorted((python_path, crd_path), key=len)
    return long == short or long.startswith((short + ".", short + "["))


def assert_agree(manifest: object) -> None:
    python_errors = validation_errors(manifest)
    crd_errors = validate_object(CRD, manifest)
    assert bool(python_errors) == bool(crd_errors), (manifest, python_errors, crd_errors)
    if not python_errors:
        job = parse_job(manifest)
        # Defaults agree: the object the server stores parses to the same job, and the Python
        # spec's full form is what the server accepts.
        assert parse_job(prepare(CRD, manifest)) == job
        assert validate_object(CRD, job.to_dict()) == []
        return
    paths = crd_paths(crd_errors)
    if len(paths) < len(crd_errors) or "apiVersion" in paths:
        # The server stopped early (unknown version) or skipped CEL after a blocking error, so it
        # may miss a cross-field error the Python spec reports; each error it does report the
        # Python spec reports too.
        python_paths = [error.path for error in python_errors]
        for path in paths:
            assert any(related(path, other) for other in python_paths), (manifest, path, python_errors)
        return
    for error in python_errors:
        assert any(related(error.path, path) for path in paths), (manifest, error, crd_errors)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_for_both(path):
    manifest = yaml.safe_load(path.read_text())
    assert validate_object(CRD, manifest) == []
    load_job(path)
    assert_agree(manifest)


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_corpus_is_rejected_by_both_at_the_named_field(path):
    text = path.read_text()
    [expected] = re.findall(r"^# expect: (\S+)$", text, flags=re.MULTILINE)
    with pytest.raises(SpecError) as caught:
        load_job(path)
    assert any(related(error.path, expected) for error in caught.value.errors), caught.value.errors
    crd_errors = validate_object(CRD, yaml.safe_load(text))
    assert any(related(path_, expected) for path_ in crd_paths(crd_errors)), crd_errors
    assert_agree(yaml.safe_load(text))


def test_corpus_covers_every_cel_rule():
    """Each CEL rule of the CRD is broken by at least one invalid manifest."""
    messages = "\n".join("\n".join(validate_object(CRD, yaml.safe_load(p.read_text()))) for p in INVALID)
    rules = [rule for node in _schemas(CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
             for rule in node.get("x-kubernetes-validations", [])]
    transition = [rule for rule in rules if "oldSelf" in rule["rule"]]
    missing = [rule["message"] for rule in rules if rule not in transition and rule["message"] not in messages]
    assert missing == [], missing
    assert len(transition) == 1  # immutability, covered in test_crd_schema


def _schemas(schema: dict):
    yield schema
    for sub in (schema.get("properties") or {}).values():
        yield from _schemas(sub)
    if "items" in schema:
        yield from _schemas(schema["items"])


# ----------------------------------------------------------------------------- generated manifests

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.lists(st.integers(0, 3), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2),
)


def usually(good: list, bad: list) -> st.SearchStrategy:
    """Mostly a valid value, now and then one that breaks a rule (so ~1/3 of manifests are valid)."""
    return st.integers(0, 19).flatmap(lambda roll: st.sampled_from(bad if roll == 19 else good))


@st.composite
def models(draw):
    kind = draw(st.sampled_from(["preset", "preset", "explicit", "override"]))
    if kind == "preset":
        return {"preset": draw(usually(sorted(PRESETS), ["bogus", ""]))}
    explicit = {
        "layers": draw(st.sampled_from([1, 2, 4, 8])), "hidden": draw(usually([64, 96], [66])),
        "ffnHidden": 128, "heads": draw(usually([2, 4, 8], [1, 3, 6])),
        "kvHeads": draw(usually([1, 2], [4])), "vocab": 256,
    }
    if draw(st.booleans()):
        explicit["headDim"] = draw(st.sampled_from([8, 16]))
    if kind == "override":
        keep = draw(st.sets(st.sampled_from(sorted(explicit)), max_size=2))
        return {"preset": draw(st.sampled_from(sorted(PRESETS)))} | {k: explicit[k] for k in keep}
    if draw(st.integers(0, 9)) == 0:
        del explicit[draw(st.sampled_from(sorted(explicit)))]
    return explicit


@st.composite
def objectives(draw):
    time_forms = [
        {"maxSlowdownPercent": usually([5, 2.5, 1000], [0, -1, 1001])},
        {"iterationSeconds": usually([1.5, 3], [0.0])},
        {"deadline": usually(["2027-01-01T00:00:00Z", "2027-01-01T00:00:00.5+02:00", "2027-01-01t00:00:00z"],
                             ["2027-13-01T00:00:00Z", "tomorrow", "", "2027-01-01T00:00:00"])},
    ]
    energy_forms = [{"perIterationJoules": usually([2.5e4, 7], [0, -3, 1e13])},
                    {"totalKilowattHours": usually([900, 0.5], [0])}]
    forms = {
        "maxThroughput": lambda: {},
        "timeBudget": lambda: {k: draw(v) for k, v in draw(usually(time_forms, [time_forms[0] | time_forms[1], {}])).items()},
        "energyBudget": lambda: {k: draw(v) for k, v in draw(usually(energy_forms, [energy_forms[0] | energy_forms[1], {}])).items()},
    }
    kinds = draw(usually([[kind] for kind in sorted(forms)], [[], ["maxThroughput", "energyBudget"]]))
    return {kind: forms[kind]() for kind in kinds}


@st.composite
def manifests(draw):
    par = {
        "tensor": draw(usually([1, 2, 4, 8], [0, 3])), "pipeline": draw(usually([1, 2, 4], [64])),
        "context": draw(usually([1, 1, 2], [3])), "data": draw(st.sampled_from([1, 2])),
        "microBatchSize": draw(usually([2, 4, 8], [1, 3])), "numMicroBatches": draw(usually([1, 2, 8], [0])),
    }
    for key in ("nanobatching", "activationCheckpointing"):
        if draw(st.booleans()):
            par[key] = draw(st.booleans())
    for key in ("pipeline", "context", "data"):
        if draw(st.integers(0, 3)) == 0:
            del par[key]  # defaults to 1
    world = par.get("tensor", 1) * par.get("pipeline", 1) * par.get("context", 1) * par.get("data", 1)
    nodes = draw(st.sampled_from([1, 2]))
    matching = world // nodes if world and world % nodes == 0 else world
    gpus_per_node = draw(usually([matching], [1, 8])) or 1
    training = {"image": "ghcr.io/kareus-dev/kareus-runtime:0.1.0", "command": ["kareus", "train"],
                "steps": draw(usually([8, 1], [0])), "gpusPerNode": gpus_per_node, "nodes": nodes}
    if draw(st.integers(0, 3)) == 0:
        names = draw(usually([["A"], ["A", "B"]], [["A", "A"], ["1x"], [""]]))
        training["env"] = [{"name": name, "value": "v"} for name in names]
    if draw(st.integers(0, 3)) == 0:
        training["resources"] = {"requests": {"cpu": draw(usually([4, "500m", "64Gi", "1e3"], ["64 GB", 1.5]))}}
    spec = {"model": draw(models()), "sequenceLength": draw(usually([64, 128, 4096], [66, 0, 12])),
            "parallelism": par, "objective": draw(objectives()), "training": training}
    optional = {
        "profiling": st.fixed_dictionaries({}, optional={
            "reuse": st.booleans(), "measurementSeconds": usually([5, 0.5], [0, 4000]),
            "cooldownSeconds": usually([0, 5], [-1]), "preset": usually(["paper", "default"], ["x"]),
            "backend": usually(["sim", "nvml", "auto"], ["cuda"])}),
        "gpu": st.fixed_dictionaries({}, optional={"product": usually(
            ["A100-SXM4-40GB", "NVIDIA-H100-80GB-HBM3"], ["bad product", "-x"])}),
        "suspend": st.booleans(), "backoffLimit": usually([0, 3], [-1, 1001]),
        "managedBy": usually(["kareus.dev/operator", "kueue.x-k8s.io/multikueue"], ["kueue", "a/b/c"]),
        "activeDeadlineSeconds": usually([1, 3600], [0]), "ttlSecondsAfterFinished": usually([0, 60], [-5]),
    }
    for key in draw(st.sets(st.sampled_from(sorted(optional)), max_size=4)):
        spec[key] = draw(optional[key])
    manifest = {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob",
                "metadata": {"name": draw(usually(["job", "a" * 40, "j-1"], ["a" * 41, "Job", "-j"]))},
                "spec": spec}
    return draw(mutated(manifest))


def _containers(value, path=()):
    if isinstance(value, dict):
        yield path, value
        for key, item in value.items():
            yield from _containers(item, (*path, key))
    elif isinstance(value, list):
        yield path, value
        for index, item in enumerate(value):
            yield from _containers(item, (*path, index))


@st.composite
def mutated(draw, manifest):
    """Most manifests untouched; some with a field replaced by junk, removed, or an unknown one added."""
    action = draw(st.sampled_from(["none", "none", "none", "none", "junk", "drop", "add"]))
    if action == "none":
        return manifest
    manifest = copy.deepcopy(manifest)
    node = draw(st.sampled_from([node for _, node in _containers(manifest) if node]))
    if isinstance(node, list):
        node[draw(st.integers(0, len(node) - 1))] = draw(JUNK)
        return manifest
    key = draw(st.sampled_from(sorted(node, key=str)))
    if action == "junk":
        node[key] = draw(JUNK)
    elif action == "drop":
        del node[key]
    else:
        node[draw(st.sampled_from(["extra", "microbatchSize", "Tensor"]))] = draw(JUNK)
    return manifest


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(manifests())
def test_generated_manifests_agree(manifest):
    assert_agree(manifest)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(JUNK | st.dictionaries(st.sampled_from(["apiVersion", "kind", "metadata", "spec"]), JUNK, max_size=4))
def test_junk_never_crashes_either_validator(document):
    assert validation_errors(document)
    assert validate_object(CRD, document) if isinstance(document, dict) else True


# ----------------------------------------------------------------------------- an independent oracle


def draft4(schema: dict) -> dict:
    """The CRD's OpenAPI schema as a JSON Schema (draft 4) with unknown fields forbidden."""
    out = {key: value for key, value in schema.items()
           if not key.startswith("x-kubernetes-") and key not in ("default", "description", "nullable")}
    if "properties" in schema:
        out["properties"] = {key: draft4(sub) for key, sub in schema["properties"].items()}
        out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = draft4(schema["additionalProperties"])
    if "items" in schema:
        out["items"] = draft4(schema["items"])
    return out


def _oracle():
    schema = draft4(CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"]["additionalProperties"] = True  # ObjectMeta: only name is restricted
    schema["properties"]["apiVersion"]["enum"] = ["kareus.dev/v1alpha1"]
    schema["properties"]["kind"]["enum"] = ["KareusJob"]
    schema["required"] = [*schema["required"], "apiVersion", "kind"]  # the server routes by them
    formats = jsonschema.FormatChecker(formats=())
    formats.checks("date-time")(lambda text: not isinstance(text, str) or bool(
        re.fullmatch(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})", text)
        and _iso(text)))
    return jsonschema.Draft4Validator(schema, format_checker=formats)


def _iso(text: str) -> bool:
    try:
        datetime.fromisoformat(text.upper().replace(" ", "T"))
    except ValueError:
        return False
    return True


ORACLE = _oracle()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(manifests())
def test_structural_checks_agree_with_jsonschema(manifest):
    """The schema engine's OpenAPI part (no CEL) accepts what a JSON Schema validator accepts."""
    stored = prepare(CRD, manifest)
    if not isinstance(stored.get("metadata"), dict) or not stored["metadata"].get("name"):
        return  # ObjectMeta's own rules (a name is required), outside the schema
    # List-map key uniqueness has no JSON Schema counterpart.
    ours = [error for error in schema_errors(CRD, manifest, rules=False) if error.kind != "Duplicate value"]
    theirs = list(ORACLE.iter_errors(stored))
    assert bool(ours) == bool(theirs), (manifest, [str(e) for e in ours], [e.message for e in theirs])
