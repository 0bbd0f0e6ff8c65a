"""The real API server (the CRD applied to it) and `kareus validate` accept and reject the same manifests.

Two implementations of one contract: the Python spec gives users precise messages and the
operator typed values; the CRD lets the API server refuse a bad job before the operator sees it.
The server's verdict is a dry-run create (`dryRun=All`, strict field validation as kubectl sends
it) on the session's control plane. The corpus is the examples, the hand-written invalid manifests
(each names the field it breaks), the edges where the real server first disagreed with the Python
spec, and hypothesis-generated manifests near the rules' edges, with random junk spliced in.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml
from crd_server import CRD_FILE, ROOT, apply_crd, dry_run_create
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kareus.spec import SpecError, load_job, parse_job, validation_errors
from kareus.workload.models import PRESETS

CRD = yaml.safe_load(CRD_FILE.read_text())
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
INVALID = sorted((ROOT / "tests" / "data" / "invalid").glob("*.yaml"))
# Every verdict here is the server's through the CRD.
pytestmark = pytest.mark.usefixtures("kareusjob_crd")


@pytest.fixture(scope="module")
def kareusjob_crd(kubectl, control_plane) -> dict:
    # Module-scoped, so hypothesis examples share it.
    return apply_crd(kubectl, control_plane, CRD_FILE)


def related(python_path: str, server_path: str) -> bool:
    """Same field, or one names a part of the other (`env[1].name` inside `env[1]`)."""
    short, long = sorted((python_path, server_path), key=len)
    return long == short or long.startswith((short + ".", short + "["))


def in_default_namespace(manifest: dict) -> dict:
    """The examples name their teams' namespaces; a dry run only needs one that exists."""
    manifest = copy.deepcopy(manifest)
    manifest["metadata"].pop("namespace", None)
    return manifest


def as_kubectl_sends(value: object) -> object:
    """A YAML manifest as kubectl puts it on the wire: Go's JSON writes a whole float as an integer.

    (A JSON client that sends `2.0` itself gets it refused wherever a CEL rule reads the field.)
    """
    if isinstance(value, dict):
        return {key: as_kubectl_sends(item) for key, item in value.items()}
    if isinstance(value, list):
        return [as_kubectl_sends(item) for item in value]
    return int(value) if isinstance(value, float) and value.is_integer() else value


def assert_agree(kube_client, manifest: object) -> None:
    python_errors = validation_errors(manifest)
    if not isinstance(manifest, dict):
        # The official client only sends objects; nothing else can be a KareusJob.
        assert python_errors, manifest
        return
    verdict = dry_run_create(kube_client, as_kubectl_sends(manifest))
    assert verdict.accepted == (not python_errors), (manifest, python_errors, verdict)
    if verdict.accepted:
        job = parse_job(manifest)
        # Defaults agree: the object the server stores parses to the same job, and the Python
        # spec's full form is what the server accepts.
        assert parse_job(verdict.stored) == job
        assert dry_run_create(kube_client, job.to_dict()).accepted
        return
    server_paths = [path for path in verdict.fields if path != "<nil>"]
    if verdict.status != 422 or len(server_paths) < len(verdict.fields):
        # The server stopped early (a decoding error, HTTP 400) or skipped CEL after a blocking
        # error, so it may miss a cross-field error the Python spec reports; each error it does
        # report the Python spec reports too.
        python_paths = [error.path for error in python_errors]
        for path in server_paths:
            assert any(related(path, other) for other in python_paths), (manifest, path, python_errors)
        return
    for error in python_errors:
        assert any(related(error.path, path) for path in server_paths), (manifest, error, verdict)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_for_both(kube_client, path):
    manifest = in_default_namespace(yaml.safe_load(path.read_text()))
    verdict = dry_run_create(kube_client, manifest)
    assert verdict.accepted, verdict
    assert parse_job(verdict.stored).spec == load_job(path).spec
    assert_agree(kube_client, manifest)


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_corpus_is_rejected_by_both_at_the_named_field(kube_client, path):
    text = path.read_text()
    [expected] = re.findall(r"^# expect: (\S+)$", text, flags=re.MULTILINE)
    with pytest.raises(SpecError) as caught:
        load_job(path)
    assert any(related(error.path, expected) for error in caught.value.errors), caught.value.errors
    manifest = yaml.safe_load(text)
    verdict = dry_run_create(kube_client, manifest)
    assert not verdict.accepted
    if expected == "apiVersion":
        # An unserved version has no schema to name fields by: the server names the version.
        assert f'in version "{manifest["apiVersion"].rpartition("/")[2]}"' in verdict.message, verdict
    else:
        assert any(related(field, expected) for field in verdict.fields), verdict
    assert_agree(kube_client, manifest)


def _deadline(text: str):
    return lambda manifest: manifest["spec"].update(objective={"timeBudget": {"deadline": text}})


def _requests(quantities: dict):
    return lambda manifest: manifest["spec"]["training"].update(resources={"requests": quantities})


def _inherited_proxy_sequence(manifest: dict) -> None:
    """Found by hypothesis: a proxy without its own sequenceLength takes the job's; when that breaks the
    context-parallel rule, both sides name spec.sequenceLength alone."""
    manifest["spec"]["sequenceLength"] = 66
    manifest["spec"]["parallelism"].update(tensor=2, context=2)
    del manifest["spec"]["training"]["cpuProxy"]["sequenceLength"]


# Where the real server first disagreed with kareus.spec (each now settled on one side or the other).
EDGES = {
    "null-unknown-field": lambda manifest: manifest["spec"].update(extra=None),
    "unknown-metadata-field": lambda manifest: manifest["metadata"].update(extra="x"),
    "deadline-lower-case": _deadline("2027-01-01t00:00:00z"),
    "deadline-space": _deadline("2027-01-01 00:00:00Z"),
    "deadline-comma-fraction": _deadline("2027-01-01T00:00:00,5Z"),
    "deadline-year-0": _deadline("0000-01-01T00:00:00Z"),
    "deadline-offset-24h": _deadline("2027-01-01T00:00:00+24:00"),
    "deadline-fraction-and-offset": _deadline("2027-01-01T00:00:00.25-05:30"),
    "whole-float-integer": lambda manifest: manifest["spec"]["parallelism"].update(tensor=2.0),
    "whole-float-quantity": _requests({"cpu": 4.0}),
    "quantity-beyond-int64": _requests({"cpu": 2**63}),
    "quantity-int64": _requests({"cpu": 2**63 - 1}),
    "label-key": lambda manifest: manifest["metadata"].update(labels={"a b": "x"}),
    "label-value": lambda manifest: manifest["metadata"].update(labels={"app": "two words"}),
    "label-null-value": lambda manifest: manifest["metadata"].update(labels={"app": None}),
    "annotation-key-case": lambda manifest: manifest["metadata"].update(annotations={"Example.com/Note": "x"}),
    "proxy-inherits-an-indivisible-sequence": _inherited_proxy_sequence,
}


@pytest.mark.parametrize("edit", EDGES.values(), ids=EDGES.keys())
def test_edges_agree(kube_client, edit):
    manifest = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    edit(manifest)
    assert_agree(kube_client, manifest)


def test_whole_floats_reach_the_server_as_integers_through_kubectl(kubectl):
    """What `as_kubectl_sends` assumes: YAML's `2.0` is accepted where a CEL rule reads it."""
    text = (ROOT / "examples" / "quickstart.yaml").read_text().replace("tensor: 4\n", "tensor: 4.0\n")
    assert "tensor: 4.0" in text
    assert parse_job(yaml.safe_load(text)).spec.parallelism.tensor == 4
    created = kubectl("create", "--dry-run=server", "-o", "json", "-n", "default", "-f", "-", input=text)
    assert json.loads(created.stdout)["spec"]["parallelism"]["tensor"] == 4


def test_corpus_covers_every_cel_rule(kube_client):
    """Each CEL rule of the CRD is broken by at least one invalid manifest, as the server reports."""
    messages = "\n".join(dry_run_create(kube_client, yaml.safe_load(p.read_text())).message for p in INVALID)
    rules = [rule for node in _schemas(CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
             for rule in node.get("x-kubernetes-validations", [])]
    transition = [rule for rule in rules if "oldSelf" in rule["rule"]]
    missing = [rule["message"] for rule in rules if rule not in transition and rule["message"] not in messages]
    assert missing == [], missing
    assert len(transition) == 1  # immutability, covered in test_crd_apiserver


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
def cpu_proxies(draw):
    proxy = {"layers": draw(usually([1, 2, 4], [0])), "hidden": draw(usually([64, 96], [66])), "ffnHidden": 176,
             "heads": draw(usually([2, 4, 8], [1, 3, 6])), "kvHeads": draw(usually([1, 2], [4])), "vocab": 256}
    if draw(st.booleans()):
        proxy["headDim"] = draw(st.sampled_from([8, 16]))
    if draw(st.booleans()):
        proxy["sequenceLength"] = draw(usually([64, 128], [66, 0]))
    if draw(st.integers(0, 9)) == 0:
        del proxy[draw(st.sampled_from(sorted(proxy)))]
    return proxy


@st.composite
def objectives(draw):
    time_forms = [
        {"maxSlowdownPercent": usually([5, 2.5, 1000], [0, -1, 1001])},
        {"iterationSeconds": usually([1.5, 3], [0.0])},
        {"deadline": usually(["2027-01-01T00:00:00Z", "2027-01-01T00:00:00.5+02:00", "2027-06-30T23:59:59-09:30"],
                             ["2027-13-01T00:00:00Z", "tomorrow", "", "2027-01-01T00:00:00", "2027-01-01t00:00:00z",
                              "2027-02-29T00:00:00Z", "2027-01-01T00:00:00+24:00"])},
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
    training = {"image": "localhost/kareus/runtime:0.1.0", "command": ["kareus", "train"],
                "steps": draw(usually([8, 1], [0])), "gpusPerNode": gpus_per_node, "nodes": nodes}
    if draw(st.integers(0, 3)) == 0:
        names = draw(usually([["A"], ["A", "B"]], [["A", "A"], ["1x"], [""]]))
        training["env"] = [{"name": name, "value": "v"} for name in names]
    if draw(st.integers(0, 3)) == 0:
        training["resources"] = {"requests": {"cpu": draw(usually([4, "500m", "64Gi", "1e3"], ["64 GB", 1.5]))}}
    if draw(st.integers(0, 3)) == 0:
        training["cpuProxy"] = draw(cpu_proxies())
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
    metadata = {"name": draw(usually(["job", "a" * 40, "j-1"], ["a" * 41, "Job", "-j"]))}
    if draw(st.integers(0, 5)) == 0:
        metadata["labels"] = draw(usually([{"app": "x"}, {"kareus.dev/team": "a", "empty": ""}],
                                          [{"a b": "c"}, {"app": "c d"}, {"-app": "x"}, {"Example.com/app": "x"}]))
    if draw(st.integers(0, 5)) == 0:
        metadata["annotations"] = draw(usually([{"note": "any text at all"}, {"Example.com/Note": ""}],
                                               [{"a/b/c": "x"}, {"note": "x" * (256 * 1024)}]))
    manifest = {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob", "metadata": metadata, "spec": spec}
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
@given(manifest=manifests())
def test_generated_manifests_agree(kube_client, manifest):
    assert_agree(kube_client, manifest)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(document=JUNK | st.dictionaries(st.sampled_from(["apiVersion", "kind", "metadata", "spec"]), JUNK, max_size=4))
def test_junk_is_refused_by_both(kube_client, document):
    assert validation_errors(document)
    assert_agree(kube_client, document)
