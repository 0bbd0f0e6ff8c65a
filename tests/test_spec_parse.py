"""The job spec: examples load, every error names its field, defaults and round trips hold."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from kareus.errors import KareusError
from kareus.spec import (
    EnergyBudget,
    ExportSpec,
    FieldError,
    KareusJob,
    MaxThroughput,
    PretrainedSpec,
    SpecError,
    TimeBudget,
    immutable_changes,
    load_job,
    parse_job,
    parse_spec,
    validation_errors,
)
from kareus.workload.models import PRESETS, RopeScaling

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.fixture
def quickstart() -> dict:
    return yaml.safe_load((ROOT / "tests" / "data" / "tiny-tp2.yaml").read_text())


def errors_of(manifest: dict) -> dict[str, str]:
    return {error.path: error.message for error in validation_errors(manifest)}


def test_quickstart_is_the_documented_job():
    job = load_job(ROOT / "examples" / "quickstart.yaml")
    spec = job.spec
    assert (job.name, job.namespace) == ("quickstart", "default")
    assert spec.model_shape() == PRESETS["llama3.2-3b"]
    par = spec.parallelism
    assert (par.tensor, par.pipeline, par.context, par.data) == (4, 1, 1, 1)
    assert (par.micro_batch_size, par.num_micro_batches) == (8, 2)
    assert par.activation_checkpointing and par.nanobatching
    assert spec.sequence_length == 4096 and spec.training.steps == 8 and spec.num_gpus == 4
    # On CPU a narrow proxy trains; its structure is the model's, its sizes its own.
    proxy = spec.cpu_proxy_shape()
    assert (proxy.num_layers, proxy.hidden_size, proxy.num_heads, proxy.num_kv_heads, proxy.head_dim) == (2, 128, 8, 4, 16)
    assert (proxy.qk_norm, proxy.tied_embeddings, proxy.rope_theta) == (False, True, PRESETS["llama3.2-3b"].rope_theta)
    assert spec.cpu_proxy_sequence_length == 64
    assert spec.objective == MaxThroughput()
    assert spec.gpu_product == "A100-SXM4-40GB"
    assert spec.training.command == ("kareus", "train")
    assert spec.profiling.reuse and spec.profiling.backend == "sim" and spec.profiling.preset == "default"
    assert spec.profiling.measurement_seconds == 5.0 and spec.backoff_limit == 3 and not spec.suspend
    assert spec.managed_by_kareus


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_round_trip(path):
    job = load_job(path)
    assert parse_job(job.to_dict()) == job
    assert parse_job(yaml.safe_load(yaml.safe_dump(job.to_dict()))) == job


def test_paper_examples():
    llama = load_job(ROOT / "examples" / "llama3.2-3b-a100.yaml").spec
    assert llama.model_shape().name == "llama3.2-3b" and llama.num_gpus == 16
    assert (llama.parallelism.tensor, llama.parallelism.pipeline) == (8, 2)
    assert llama.objective == TimeBudget(max_slowdown_percent=5.0)
    qwen = load_job(ROOT / "examples" / "qwen3-1.7b-cp2tp4.yaml").spec
    assert (qwen.parallelism.context, qwen.parallelism.tensor, qwen.parallelism.pipeline) == (2, 4, 2)
    budget = load_job(ROOT / "examples" / "llama3.1-8b-energy-budget.yaml").spec.objective
    assert isinstance(budget, EnergyBudget) and budget.total_joules == pytest.approx(900 * 3.6e6)


def test_all_errors_are_reported_with_paths(quickstart):
    spec = quickstart["spec"]
    spec["parallelism"]["tensor"] = 0
    spec["training"]["steps"] = "ten"
    spec["profiling"] = {"backend": "rocm", "measurmentSeconds": 3}
    spec["model"]["preset"] = "gpt-5"
    with pytest.raises(SpecError) as caught:
        parse_job(quickstart)
    error = caught.value
    assert isinstance(error, KareusError)
    assert [e.path for e in error.errors] == [
        "spec.model.preset", "spec.parallelism.tensor", "spec.training.steps",
        "spec.profiling.backend", "spec.profiling.measurmentSeconds"]
    assert str(error).splitlines()[1] == "spec.parallelism.tensor: must be an integer in [1, 4096], got 0"
    assert "allowed here: backend, cooldownSeconds" in str(error)
    assert "tiny" in error.errors[0].message  # the allowed presets are listed


@pytest.mark.parametrize(("change", "path", "fragment"), [
    (lambda s: s["parallelism"].update(data=2), "spec.parallelism", "= 4 must equal"),
    (lambda s: s["parallelism"].update(microBatchSize=3), "spec.parallelism.microBatchSize", "even"),
    (lambda s: s["parallelism"].update(microBatchSize=1, nanobatching=True), "spec.parallelism.microBatchSize",
     "got 1"),
    (lambda s: s["parallelism"].update(tensor=1, context=2, microBatchSize=4) or s.update(sequenceLength=66),
     "spec.sequenceLength", "divisible by 4"),
    (lambda s: s["parallelism"].update(tensor=1, pipeline=8) or s["training"].update(gpusPerNode=8),
     "spec.parallelism.pipeline", "at most the number of layers (4)"),
    (lambda s: s["parallelism"].update(tensor=4) or s["training"].update(gpusPerNode=4),
     "spec.parallelism.tensor", "kvHeads (2)"),
    (lambda s: s.update(objective={}), "spec.objective", "got none"),
    (lambda s: s.update(objective={"maxThroughput": {}, "timeBudget": {"iterationSeconds": 2}}),
     "spec.objective", "got maxThroughput, timeBudget"),
    (lambda s: s.update(objective={"energyBudget": {}}), "spec.objective.energyBudget", "got none"),
    (lambda s: s.update(objective={"energyBudget": {"perIterationJoules": 0}}),
     "spec.objective.energyBudget.perIterationJoules", "(0, 1e+12]"),
    (lambda s: s.update(objective={"timeBudget": {"deadline": "2027-01-01"}}),
     "spec.objective.timeBudget.deadline", "RFC 3339"),
    (lambda s: s.update(objective={"maxThroughput": {"fast": True}}), "spec.objective.maxThroughput.fast",
     "unknown field"),
    (lambda s: s.update(model={"layers": 2, "hidden": 64}), "spec.model", "missing ffnHidden, heads, kvHeads, vocab"),
    (lambda s: s.update(model={"layers": 2, "hidden": 66, "ffnHidden": 8, "heads": 4, "kvHeads": 2, "vocab": 9}),
     "spec.model.headDim", "not divisible by heads (4)"),
    (lambda s: s.update(managedBy="kueue"), "spec.managedBy", "domain-prefixed path"),
    (lambda s: s["training"].update(env=[{"name": "1 A", "value": "x"}]), "spec.training.env[0].name", "must match"),
    (lambda s: s["training"].update(command="kareus train"), "spec.training.command", "list"),
    (lambda s: s["training"].update(command=["kareus", 7]), "spec.training.command[1]", "string"),
    (lambda s: s.update(gpu={"product": "A100 SXM4"}), "spec.gpu.product", "node label value"),
    (lambda s: s.update(suspend="yes"), "spec.suspend", "true or false"),
    (lambda s: s["parallelism"].update(tensor=2.5), "spec.parallelism.tensor", "integer"),
    (lambda s: s["parallelism"].update(tensor=True), "spec.parallelism.tensor", "integer"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_rule_violations_name_their_field(quickstart, change, path, fragment):
    change(quickstart["spec"])
    errors = errors_of(quickstart)
    assert path in errors, errors
    assert fragment in errors[path]


def test_whole_floats_are_integers_as_kubectl_sends_them(quickstart):
    # YAML's `2.0` reaches the API server as 2 (kubectl writes JSON with Go, which drops the fraction).
    quickstart["spec"]["parallelism"]["tensor"] = 2.0
    quickstart["spec"]["training"]["resources"] = {"requests": {"cpu": 4.0}}
    spec = parse_job(quickstart).spec
    assert spec.parallelism.tensor == 2 and isinstance(spec.parallelism.tensor, int)
    assert spec.training.resources.requests == {"cpu": "4"}


def test_bare_objective_key_gets_a_hint(quickstart):
    quickstart["spec"]["objective"] = {"maxThroughput": None}
    assert "write `maxThroughput: {}`" in errors_of(quickstart)["spec.objective"]


def test_cross_field_checks_wait_for_valid_fields(quickstart):
    """One mistake, one error: a bad tensor degree is not also reported as a product mismatch."""
    quickstart["spec"]["parallelism"]["tensor"] = -1
    assert list(errors_of(quickstart)) == ["spec.parallelism.tensor"]


def test_explicit_shape_and_preset_overrides(quickstart):
    quickstart["spec"]["model"] = {"layers": 3, "hidden": 96, "ffnHidden": 256, "heads": 6, "kvHeads": 2,
                                   "vocab": 512, "qkNorm": True}
    shape = parse_job(quickstart).spec.model_shape()
    assert (shape.name, shape.num_layers, shape.head_dim, shape.qk_norm, shape.tied_embeddings) == \
        ("custom", 3, 16, True, False)
    quickstart["spec"]["model"] = {"preset": "llama3.3-70b", "layers": 4}
    quickstart["spec"]["sequenceLength"] = 64
    shape = parse_job(quickstart).spec.model_shape()
    assert shape.num_layers == 4 and shape.hidden_size == 8192 and shape.name == "llama3.3-70b-custom"


def test_rope_and_norm_fields_reach_the_shape_and_round_trip(quickstart):
    quickstart["spec"]["model"] = {"layers": 2, "hidden": 64, "ffnHidden": 96, "heads": 4, "kvHeads": 4,
                                   "vocab": 256, "ropeTheta": 1e4, "normEps": 1e-6,
                                   "ropeScaling": {"type": "llama3", "factor": 32}}
    job = parse_job(quickstart)
    shape = job.spec.model_shape()
    assert (shape.rope_theta, shape.norm_eps) == (1e4, 1e-6)
    assert shape.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)  # the defaults are Llama 3.x's
    assert parse_job(job.to_dict()) == job
    assert hash(job) == hash(parse_job(job.to_dict()))
    # A preset keeps its released scaling unless the manifest replaces it.
    quickstart["spec"]["model"] = {"preset": "llama3.1-8b", "layers": 2}
    assert parse_job(quickstart).spec.model_shape().rope_scaling.factor == 8.0


@pytest.mark.parametrize(("scaling", "path", "fragment"), [
    ({"factor": 8}, "spec.model.ropeScaling.type", "required"),
    ({"type": "llama3", "factor": 0.5}, "spec.model.ropeScaling.factor", "[1, 1024]"),
    ({"type": "llama3", "factor": 8, "lowFreqFactor": 4, "highFreqFactor": 4},
     "spec.model.ropeScaling.highFreqFactor", "greater than lowFreqFactor"),
    ({"type": "llama3", "factor": 8, "originalMaxPositionEmbeddings": 0},
     "spec.model.ropeScaling.originalMaxPositionEmbeddings", "integer"),
    ({"type": "llama3", "factor": 8, "beta": 1}, "spec.model.ropeScaling.beta", "unknown field"),
    ("llama3", "spec.model.ropeScaling", "object"),
])
def test_bad_rope_scaling_is_one_error_at_its_field(quickstart, scaling, path, fragment):
    quickstart["spec"]["model"] = {"preset": "tiny", "ropeScaling": scaling}
    errors = errors_of(quickstart)
    assert list(errors) == [path] and fragment in errors[path]


def test_objectives_and_deadline(quickstart):
    quickstart["spec"]["objective"] = {"timeBudget": {"deadline": "2027-01-01T00:00:00Z"}}
    objective = parse_job(quickstart).spec.objective
    assert objective.deadline == datetime(2027, 1, 1, tzinfo=UTC)
    assert objective.to_dict() == {"timeBudget": {"deadline": "2027-01-01T00:00:00Z"}}
    quickstart["spec"]["objective"] = {"energyBudget": {"perIterationJoules": 2.5e4}}
    assert parse_job(quickstart).spec.objective == EnergyBudget(per_iteration_joules=25000.0)


def test_metadata_rules(quickstart):
    quickstart["metadata"]["name"] = "a" * 41
    assert "metadata.name" in errors_of(quickstart)
    quickstart["metadata"] = {"name": "Upper"}
    assert "DNS-1123" in errors_of(quickstart)["metadata.name"]
    # What the API server adds (uid, resourceVersion, managedFields, status) does not disturb parsing.
    quickstart["metadata"] = {"name": "ok", "namespace": "ns", "uid": "u", "resourceVersion": "7",
                              "labels": {"kueue.x-k8s.io/queue-name": "q"}, "managedFields": [{}]}
    quickstart["status"] = {"phase": "Training"}
    job = parse_job(quickstart)
    assert job.namespace == "ns" and job.labels == {"kueue.x-k8s.io/queue-name": "q"}
    quickstart["extra"] = 1
    assert "extra" in errors_of(quickstart)


@pytest.mark.parametrize(("metadata", "problem"), [
    ({"labels": {"a b": "x"}}, "qualified names"), ({"labels": {"example.com/a/b": "x"}}, "qualified names"),
    ({"labels": {"app": "two words"}}, "at most 63"), ({"labels": {"app": "x" * 64}}, "at most 63"),
    ({"annotations": {"-note": "x"}}, "qualified names"), ({"annotations": {"note": "x" * 256 * 1024}}, "bytes"),
    ({"extra": None}, "unknown field"),
])
def test_metadata_is_checked_as_the_api_server_checks_it(quickstart, metadata, problem):
    quickstart["metadata"].update(metadata)
    [(path, message)] = errors_of(quickstart).items()
    assert path.startswith("metadata.") and problem in message


def test_metadata_the_api_server_accepts(quickstart):
    # Annotation keys are checked lower-cased; a null label or annotation value is Go's "".
    quickstart["metadata"].update(labels={"example.com/app": "", "team": None},
                                  annotations={"Example.com/Note": "any text", "n": None})
    job = parse_job(quickstart)
    assert job.labels == {"example.com/app": "", "team": ""} and job.annotations["n"] == ""


@pytest.mark.parametrize("junk", [None, [], "spec", 3, {"spec": []}, {1: 2}, {"apiVersion": 5}])
def test_junk_documents_are_errors_not_crashes(junk):
    with pytest.raises(SpecError) as caught:
        parse_job(junk)
    assert caught.value.errors and all(isinstance(e, FieldError) for e in caught.value.errors)


def test_parse_spec_alone(quickstart):
    spec = parse_spec(quickstart["spec"])
    assert spec.to_dict()["gpu"] == {"product": "A100-SXM4-40GB"}
    with pytest.raises(SpecError, match=r"^job\.sequenceLength: must be an integer"):
        parse_spec({**quickstart["spec"], "sequenceLength": 0}, path="job")


def test_load_job_file_problems(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_job(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [\n")
    with pytest.raises(SpecError, match=r"not valid YAML: .* line 2"):
        load_job(broken)
    two = tmp_path / "two.yaml"
    two.write_text("a: 1\n---\nb: 2\n")
    with pytest.raises(SpecError, match="exactly one YAML document, found 2"):
        load_job(two)


def test_immutable_changes_allow_objective_and_suspend_only(quickstart):
    old = parse_job(quickstart).spec
    changed = copy.deepcopy(quickstart)
    changed["spec"]["objective"] = {"timeBudget": {"maxSlowdownPercent": 10}}
    changed["spec"]["suspend"] = True
    assert immutable_changes(old, parse_job(changed).spec) == []
    changed["spec"]["training"]["steps"] = 80
    changed["spec"]["backoffLimit"] = 5
    assert [e.path for e in immutable_changes(old, parse_job(changed).spec)] == \
        ["spec.backoffLimit", "spec.training"]


def test_values_are_frozen_and_hashable(quickstart):
    quickstart["metadata"]["labels"] = {"team": "a"}
    quickstart["spec"]["model"]["layers"] = 2
    quickstart["spec"]["training"]["resources"] = {"limits": {"memory": "8Gi"}}
    job = parse_job(quickstart)
    assert isinstance(job, KareusJob)
    assert hash(job) == hash(parse_job(copy.deepcopy(quickstart))) and len({job, parse_job(job.to_dict())}) == 1
    with pytest.raises(AttributeError):
        job.spec.sequence_length = 1  # type: ignore[misc]


def test_pretrained_and_export_parse_and_round_trip(quickstart):
    quickstart["spec"]["model"]["pretrained"] = {"claimName": "models", "path": "llama/tiny"}
    quickstart["spec"]["training"] |= {"checkpoint": {"everySteps": 4, "claimName": "ckpt"}, "export": {}}
    job = parse_job(quickstart)
    assert job.spec.model.pretrained == PretrainedSpec("models", "llama/tiny")
    assert job.spec.training.export == ExportSpec()
    assert job.spec.model_shape() == PRESETS["tiny"]  # the weights' source is not part of the shape
    assert parse_job(job.to_dict()) == job and hash(job) == hash(parse_job(job.to_dict()))
    assert job.to_dict()["spec"]["training"]["export"] == {}
    del quickstart["spec"]["training"]["export"], quickstart["spec"]["model"]["pretrained"]
    plain = parse_job(quickstart)
    assert plain.spec.training.export is None and plain.spec.model.pretrained is None
    assert "export" not in plain.to_dict()["spec"]["training"]
    assert "pretrained" not in plain.to_dict()["spec"]["model"]


@pytest.mark.parametrize(("change", "path", "fragment"), [
    (lambda s: s["model"].update(pretrained={"claimName": "Models_1", "path": "m"}),
     "spec.model.pretrained.claimName", "PersistentVolumeClaim"),
    (lambda s: s["model"].update(pretrained={"claimName": "models"}), "spec.model.pretrained.path", "required"),
    (lambda s: s["model"].update(pretrained={"claimName": "models", "path": "/m"}),
     "spec.model.pretrained.path", "relative to the claim's root"),
    (lambda s: s["model"].update(pretrained={"claimName": "models", "path": "a/../../etc"}),
     "spec.model.pretrained.path", "'..'"),
    (lambda s: s["model"].update(pretrained={"claimName": "models", "path": "m", "readOnly": True}),
     "spec.model.pretrained.readOnly", "unknown field"),
    (lambda s: s["training"].update(export={}), "spec.training.export", "needs training.checkpoint with a claimName"),
    (lambda s: s["training"].update(export={}, checkpoint={"everySteps": 4}),
     "spec.training.export", "needs training.checkpoint with a claimName"),
    (lambda s: s["training"].update(export={"format": "hf"}, checkpoint={"everySteps": 4, "claimName": "c"}),
     "spec.training.export.format", "unknown field"),
    (lambda s: s["training"].update(export="yes", checkpoint={"everySteps": 4, "claimName": "c"}),
     "spec.training.export", "object"),
])
def test_bad_pretrained_or_export_is_one_error_at_its_field(quickstart, change, path, fragment):
    change(quickstart["spec"])
    errors = errors_of(quickstart)
    assert list(errors) == [path] and fragment in errors[path], errors
