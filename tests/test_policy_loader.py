"""Cluster policy: parsing with field-named errors, defaults, bounds lookup and job checks."""

from __future__ import annotations

import pytest

from kareus.errors import KareusError
from kareus.policy import (
    OBJECTIVES,
    ClockBounds,
    ClusterPolicy,
    PolicyError,
    Violation,
    check_job,
    gpu_model_key,
    job_objective,
    load_policy,
    load_policy_file,
)
from kareus.spec import parse_job

FULL_POLICY = """
allowedObjectives: [maxThroughput, timeBudget]
defaultObjective: timeBudget
maxSlowdownPercent: 10
clockBounds:
  default: {floorMHz: 600, ceilingMHz: 1980}
  gpuModels:
    NVIDIA-A100-SXM4-40GB: {ceilingMHz: 1350}
    H100-SXM: {floorMHz: 900}
namespaceEnergyBudgets: {team-a: 100, team-b: 2.5}
profileReuse: false
allowedNamespaces: [team-a, team-b]
"""


def job(namespace: str = "team-a", objective: dict | None = None, gpu: str | None = None):
    spec = {
        "model": {"preset": "llama3.2-3b"},
        "sequenceLength": 4096,
        "parallelism": {"tensor": 8, "pipeline": 2, "context": 1, "data": 1,
                        "microBatchSize": 8, "numMicroBatches": 8},
        "objective": objective or {"maxThroughput": {}},
        "training": {"image": "registry.example/train:1", "steps": 10, "gpusPerNode": 8, "nodes": 2},
    }
    if gpu:
        spec["gpu"] = {"product": gpu}
    manifest = {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob",
                "metadata": {"name": "j", "namespace": namespace}, "spec": spec}
    return parse_job(manifest).spec


def test_full_policy_parses_every_key():
    policy = load_policy(FULL_POLICY)
    assert policy.allowed_objectives == {"maxThroughput", "timeBudget"}
    assert policy.default_objective == "timeBudget"
    assert policy.max_slowdown_percent == 10.0
    assert policy.default_clock_bounds == ClockBounds(600, 1980)
    assert policy.namespace_energy_budgets_kwh == {"team-a": 100.0, "team-b": 2.5}
    assert policy.profile_reuse is False
    assert policy.allowed_namespaces == {"team-a", "team-b"}


@pytest.mark.parametrize("source", [None, "", "   \n", {}, "# only a comment\n"])
def test_absent_policy_allows_everything(source):
    policy = load_policy(source)
    assert policy == ClusterPolicy()
    assert policy.allowed_objectives == set(OBJECTIVES)
    assert policy.namespace_allowed("anything")
    assert policy.clock_bounds_for("A100-SXM4-40GB") == ClockBounds()
    assert policy.energy_budget_kwh("team-a") is None
    assert policy.reuse_profiles(True)


def test_dict_and_text_sources_agree():
    import yaml

    assert load_policy(yaml.safe_load(FULL_POLICY)) == load_policy(FULL_POLICY)


def test_default_objective_follows_allowed_list_when_absent():
    assert load_policy({"allowedObjectives": ["energyBudget", "timeBudget"]}).default_objective == "timeBudget"


def test_model_bounds_fill_unset_side_from_default_and_match_any_spelling():
    policy = load_policy(FULL_POLICY)
    a100 = ClockBounds(600, 1350)
    for spelling in ("NVIDIA-A100-SXM4-40GB", "A100-SXM4-40GB", "nvidia a100-sxm4-40gb", "A100_SXM4_40GB"):
        assert policy.clock_bounds_for(spelling) == a100
    assert policy.clock_bounds_for("NVIDIA-H100-SXM") == ClockBounds(900, 1980)
    assert policy.clock_bounds_for("H200") == ClockBounds(600, 1980)
    assert policy.clock_bounds_for(None) == ClockBounds(600, 1980)
    assert gpu_model_key("NVIDIA-H200") == "H200"


def test_clock_bounds_allow_and_clamp():
    bounds = ClockBounds(600, 1350)
    assert bounds.allows(600) and bounds.allows(1350) and not bounds.allows(1365) and not bounds.allows(585)
    assert [bounds.clamp(c) for c in (210, 900, 1410)] == [600, 900, 1350]
    open_top = ClockBounds(floor_mhz=900)
    assert open_top.allows(5000) and open_top.clamp(5000) == 5000


def test_profile_reuse_needs_both_job_and_cluster():
    assert not load_policy(FULL_POLICY).reuse_profiles(True)
    assert not ClusterPolicy().reuse_profiles(False)
    assert ClusterPolicy().reuse_profiles(True)


@pytest.mark.parametrize(
    ("text", "field", "allowed"),
    [
        ("allowedObjective: [maxThroughput]", "policy.allowedObjective", "allowedObjectives"),
        ("allowedObjectives: [maxThroughput, fastest]", "policy.allowedObjectives[1]", "timeBudget"),
        ("allowedObjectives: []", "policy.allowedObjectives", "non-empty"),
        ("defaultObjective: cheapest", "policy.defaultObjective", "maxThroughput"),
        ("{allowedObjectives: [timeBudget], defaultObjective: maxThroughput}", "policy.defaultObjective",
         "allowedObjectives"),
        ("maxSlowdownPercent: -5", "policy.maxSlowdownPercent", "> 0"),
        ("maxSlowdownPercent: true", "policy.maxSlowdownPercent", "number"),
        ("maxSlowdownPercent: .nan", "policy.maxSlowdownPercent", "number"),
        ("clockBounds: {default: {floorMhz: 600}}", "policy.clockBounds.default.floorMhz", "floorMHz"),
        ("clockBounds: {default: {floorMHz: 1500, ceilingMHz: 1400}}", "policy.clockBounds.default.floorMHz",
         "must not exceed"),
        ("clockBounds: {default: {floorMHz: 1200.5}}", "policy.clockBounds.default.floorMHz", "whole number"),
        ("clockBounds: {gpuModels: {A100: {ceilingMHz: 0}}}", "policy.clockBounds.gpuModels.A100.ceilingMHz",
         "> 0"),
        ("clockBounds: {default: {floorMHz: 1500}, gpuModels: {A100: {ceilingMHz: 1400}}}",
         "policy.clockBounds.gpuModels.A100", "exceeds"),
        ("clockBounds: {perModel: {}}", "policy.clockBounds.perModel", "gpuModels"),
        ("namespaceEnergyBudgets: {Team_A: 5}", "policy.namespaceEnergyBudgets.Team_A", "namespace name"),
        ("namespaceEnergyBudgets: {team-a: 0}", "policy.namespaceEnergyBudgets.team-a", "> 0"),
        ("namespaceEnergyBudgets: {team-a: null}", "policy.namespaceEnergyBudgets.team-a", "kilowatt-hours"),
        ("namespaceEnergyBudgets: [team-a]", "policy.namespaceEnergyBudgets", "kilowatt-hours"),
        ("profileReuse: 'yes'", "policy.profileReuse", "true or false"),
        ("allowedNamespaces: team-a", "policy.allowedNamespaces", "list"),
        ("allowedNamespaces: [ok, -bad]", "policy.allowedNamespaces[1]", "namespace name"),
        ("[1, 2]", "policy", "mapping"),
        ("key: [unclosed", "policy", "YAML"),
    ],
)
def test_bad_policy_names_the_field(text, field, allowed):
    with pytest.raises(PolicyError) as info:
        load_policy(text)
    message = str(info.value)
    assert message.startswith(f"{field}:") or message.startswith(f"{field} "), message
    assert allowed in message
    assert isinstance(info.value, KareusError)


def test_policy_file_reads_and_reports_missing(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(FULL_POLICY)
    assert load_policy_file(path) == load_policy(FULL_POLICY)
    with pytest.raises(PolicyError, match="cannot be read"):
        load_policy_file(tmp_path / "absent.yaml")


def test_permissive_policy_accepts_every_objective():
    for objective in ({"maxThroughput": {}}, {"timeBudget": {"maxSlowdownPercent": 50}},
                      {"energyBudget": {"totalKilowattHours": 1e6}}):
        assert check_job(ClusterPolicy(), "anywhere", job("anywhere", objective)) == []


def test_check_job_reports_every_violation_at_once():
    policy = load_policy(FULL_POLICY)
    violations = check_job(policy, "team-c", job("team-c", {"energyBudget": {"perIterationJoules": 1e4}}))
    assert [v.rule for v in violations] == ["allowedNamespaces", "allowedObjectives"]
    assert "team-c" in violations[0].message and "team-a, team-b" in violations[0].message
    assert "spec.objective.energyBudget" in violations[1].message
    assert "maxThroughput, timeBudget" in violations[1].message


def test_slowdown_limit():
    policy = load_policy(FULL_POLICY)
    assert check_job(policy, "team-a", job(objective={"timeBudget": {"maxSlowdownPercent": 10}})) == []
    [violation] = check_job(policy, "team-a", job(objective={"timeBudget": {"maxSlowdownPercent": 12.5}}))
    assert violation == Violation(
        "maxSlowdownPercent",
        "spec.objective.timeBudget.maxSlowdownPercent: 12.5 exceeds the cluster limit of 10",
    )
    # An absolute iteration time is judged by the optimizer, not by the slowdown limit.
    assert check_job(policy, "team-a", job(objective={"timeBudget": {"iterationSeconds": 99}})) == []


def test_namespace_energy_budget():
    policy = load_policy({"namespaceEnergyBudgets": {"team-a": 100}})
    energy = {"energyBudget": {"totalKilowattHours": 60}}
    assert check_job(policy, "team-a", job(objective=energy)) == []
    assert check_job(policy, "team-a", job(objective=energy), namespace_used_kwh=40) == []
    [over] = check_job(policy, "team-a", job(objective=energy), namespace_used_kwh=50)
    assert over.rule == "namespaceEnergyBudgets" and "60 is more than the 50 kWh left" in over.message
    [spent] = check_job(policy, "team-a", job(), namespace_used_kwh=100)
    assert spent.rule == "namespaceEnergyBudgets" and "used 100 kWh of its 100 kWh" in spent.message
    # Namespaces without a budget are not limited.
    assert check_job(policy, "team-b", job("team-b", energy), namespace_used_kwh=1e9) == []


def test_job_objective_reads_the_spec():
    policy = ClusterPolicy()
    assert job_objective(policy, job()).kind == "maxThroughput"
    slow = job_objective(policy, job(objective={"timeBudget": {"maxSlowdownPercent": 7}}))
    assert (slow.kind, slow.max_slowdown_percent, slow.total_kwh) == ("timeBudget", 7.0, None)
    energy = job_objective(policy, job(objective={"energyBudget": {"totalKilowattHours": 3}}))
    assert (energy.kind, energy.total_kwh) == ("energyBudget", 3.0)
