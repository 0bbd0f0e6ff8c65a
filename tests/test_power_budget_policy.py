"""`policy.powerBudget`: the loader (`kareus.policy`) and the chart (values, schema, policy ConfigMap).

The chart is rendered by the real Helm engine (helm-python-sdk), as `tests/test_helm_chart.py`
does; what it renders into the policy ConfigMap must parse with the operator's loader to the same
budget, and a typo in the values must fail at install with the field's name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kareus.policy import DEFAULT_NODE_POOL_LABEL, PolicyError, PowerBudget, load_policy

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "kareus"
RELEASE, NAMESPACE = "kareus", "kareus-system"
BUDGET = {"watts": 120000, "gpuProducts": {"NVIDIA-A100-SXM4-40GB": 80000, "H100-SXM": 30000.5},
          "nodePools": {"a100-pool-1": 40000}, "nodePoolLabel": "cloud.google.com/gke-nodepool",
          "method": "greedy", "resolutionWatts": 5}


def test_power_budget_parses_every_key():
    budget = load_policy({"powerBudget": BUDGET}).power_budget
    assert budget == PowerBudget(cluster_w=120000.0,
                                 gpu_products_w={"NVIDIA-A100-SXM4-40GB": 80000.0, "H100-SXM": 30000.5},
                                 node_pools_w={"a100-pool-1": 40000.0},
                                 node_pool_label="cloud.google.com/gke-nodepool", method="greedy", resolution_w=5.0)
    assert budget.enabled
    assert budget.product_w("A100-SXM4-40GB") == 80000.0 and budget.product_w("nvidia h100-sxm") == 30000.5
    assert budget.product_w("H200") is None


def test_absent_or_empty_budget_is_off():
    for source in (None, {}, {"powerBudget": {}}, {"powerBudget": None}):
        budget = load_policy(source).power_budget
        assert budget == PowerBudget() and not budget.enabled
    assert PowerBudget().node_pool_label == DEFAULT_NODE_POOL_LABEL and PowerBudget().method == "exact"
    assert load_policy({"powerBudget": {"nodePools": {"p": 10}}}).power_budget.enabled


@pytest.mark.parametrize(("budget", "field"), [
    ({"watt": 100}, "policy.powerBudget.watt: unknown key"),
    ({"watts": 0}, "policy.powerBudget.watts: must be > 0"),
    ({"watts": "10kW"}, "policy.powerBudget.watts: must be a number"),
    ({"watts": True}, "policy.powerBudget.watts: must be a number"),
    ({"gpuProducts": {"A100": -5}}, "policy.powerBudget.gpuProducts.A100: must be > 0"),
    ({"gpuProducts": [1]}, "policy.powerBudget.gpuProducts: must map GPU product names to watts"),
    ({"gpuProducts": {"A100-SXM4-40GB": 1, "NVIDIA-A100-SXM4-40GB": 2}}, "name the same GPU product"),
    ({"nodePools": {"pool": None}}, "policy.powerBudget.nodePools.pool: must be a number of watts"),
    ({"nodePoolLabel": "not a label"}, "policy.powerBudget.nodePoolLabel"),
    ({"method": "lp"}, "policy.powerBudget.method: must be one of exact, greedy"),
    ({"resolutionWatts": -1}, "policy.powerBudget.resolutionWatts: must be > 0"),
    (7, "policy.powerBudget: must be a mapping"),
])
def test_bad_budget_is_one_error_naming_the_field(budget, field):
    with pytest.raises(PolicyError, match="^" + field.replace(".", r"\.").replace("[", r"\[")
                       if field.startswith("policy") else field):
        load_policy({"powerBudget": budget})


# ---------------------------------------------------------------- the chart

helm = pytest.importorskip("helm_python", reason="helm-python-sdk has no wheel for this platform")


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded


def policy_document(chart, values: dict) -> str:
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc and doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == f"{RELEASE}-policy":
                return doc["data"]["policy.yaml"]
    raise AssertionError("no policy ConfigMap rendered")


def test_chart_renders_the_budget_the_loader_reads(chart):
    assert load_policy(policy_document(chart, {})).power_budget == PowerBudget()
    rendered = load_policy(policy_document(chart, {"policy": {"powerBudget": BUDGET}}))
    assert rendered.power_budget == load_policy({"powerBudget": BUDGET}).power_budget


@pytest.mark.parametrize(("budget", "field"), [
    ({"watt": 100}, "watt"),
    ({"watts": -1}, "watts"),
    ({"gpuProducts": {"A100": "lots"}}, "A100"),
    ({"method": "fastest"}, "method"),
    ({"nodePools": {"p": 0}}, "p"),
])
def test_chart_schema_refuses_a_bad_budget(chart, budget, field):
    with pytest.raises(helm.HelmValuesError) as info:
        chart.render({"policy": {"powerBudget": budget}}, name=RELEASE, namespace=NAMESPACE)
    assert field in str(info.value)
