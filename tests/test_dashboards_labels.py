"""Dashboards against the real exporters: every label a panel filters, groups or names exists.

The three exporters (node daemon, training worker, operator) are instantiated and their exposition
text parsed, so a renamed label (say `kareusjob` → `job_name`) in an exporter fails here instead of
leaving an empty panel. Prometheus adds target labels to every scraped series (`namespace`, `pod`,
`instance`, …); the node agent's ServiceMonitor keeps the agent's own `namespace`/`pod` labels
(honorLabels) and adds `node`, and the training PodMonitor copies the pod label `kareus.dev/job-name` into `kareusjob`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

promql_parser = pytest.importorskip("promql_parser")
parser = pytest.importorskip("prometheus_client.parser")

DASHBOARD_DIR = Path(__file__).resolve().parents[1] / "helm" / "kareus" / "dashboards"
TARGET_LABELS = {"namespace", "pod", "instance", "job", "service", "endpoint", "container"}
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "6h", "$node": "n", "$namespace": "ns", "$kareusjob": "j"}


def labels_by_series(exposition: str, extra: set[str]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for family in parser.text_string_to_metric_families(exposition):
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return {name: labels | extra | TARGET_LABELS for name, labels in found.items()}


def node_daemon_series(tmp_path) -> dict[str, set[str]]:
    from kareus_node.metrics import DaemonMetrics

    from kareus.gpu import discover

    gpus = {gpu.uuid: gpu for gpu in discover("sim", count=2, node="gpu-node-1", state_dir=tmp_path)}
    owned = next(iter(gpus))
    owner = SimpleNamespace(namespace="team-a", pod="llama-train-0", job="llama")
    daemon = SimpleNamespace(gpus=gpus, leases={owned: SimpleNamespace(owner=owner)}, node_name="gpu-node-1",
                             workers={})
    metrics = DaemonMetrics()
    metrics.watch(daemon)
    metrics.observe("ok", 0.001)
    metrics.observe("rejected", 0.0)
    from prometheus_client import generate_latest

    # The agent's ServiceMonitor relabels the pod's node name into `node` (test_helm_chart checks it).
    return labels_by_series(generate_latest(metrics.registry).decode(), {"node"})


def worker_series() -> dict[str, set[str]]:
    from prometheus_client import generate_latest

    from kareus.runtime.metrics import MetricsExporter, StepRecord

    exporter = MetricsExporter(0, addr="127.0.0.1", rank=0, stage=0, job="llama", plan={"mode": "partitioned"})
    try:
        exporter.observe(StepRecord(step=1, loss=2.0, iteration_time_s=1.5, energy_j=9e3, tokens=4096,
                                    tokens_per_joule=0.45, modelled_time_s=1.4, energy_source="sim"), 1.1e3)
        text = generate_latest(exporter.registry).decode()
    finally:
        exporter.close()
    return labels_by_series(text, {"kareusjob"})  # PodMonitor relabelling


def operator_series() -> dict[str, set[str]]:
    from kareus_operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    metrics.observe("uid-1", "Profiling")
    metrics.observe("uid-1", "Running")
    metrics.profile_cache_hit()
    from kareus.policy import PowerBudget

    job = {"metadata": {"uid": "uid-1", "namespace": "team-a", "name": "llama"}}
    metrics.observe_status(job, {"phase": "Training", "power": {"allottedWatts": 4000.0, "held": False},
                                 "measured": {"energyJoules": 9e3, "averagePowerWatts": 3900.0,
                                              "percentComplete": 25.0, "etaSeconds": 600.0,
                                              "projectedTotalJoules": 3.6e4}})
    metrics.observe_power_budget(PowerBudget(cluster_w=9000.0), None)
    return labels_by_series(metrics.exposition().decode(), set())


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, set[str]]:
    series: dict[str, set[str]] = {}
    for part in (node_daemon_series(tmp_path_factory.mktemp("gpus")), worker_series(), operator_series()):
        series.update(part)
    return series


def parse(expr: str):
    for variable in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(variable, GRAFANA_VARIABLES[variable])
    return promql_parser.parse(expr)


def selectors(node) -> list:
    found = []
    promql_parser.walk(node, lambda n: found.append(n) if isinstance(n, promql_parser.VectorSelector) else None,
                       None)
    return found


def label_problems(expr: str, legend: str, exported: dict[str, set[str]]) -> list[str]:
    problems = []
    tree = parse(expr)
    result_labels: set[str] = set()
    for vs in selectors(tree):
        available = exported.get(vs.name)
        if available is None:
            problems.append(f"{vs.name}: no exporter produced this series")
            continue
        result_labels |= available
        problems += [f"{vs.name}{{{m.name}}}: label not exported" for m in vs.matchers.matchers
                     if m.name not in available]

    def check_grouping(node):
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            for vs in selectors(node.expr):
                missing = set(node.modifier.labels) - exported.get(vs.name, set())
                problems.extend(f"by ({label}) over {vs.name}: label not exported" for label in sorted(missing))

    promql_parser.walk(tree, check_grouping, None)
    problems += [f"legend {{{{{label}}}}}: not a label of the result" for label in re.findall(r"\{\{(\w+)\}\}", legend)
                 if label not in result_labels]
    return problems


DASHBOARDS = {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARD_DIR.glob("*.json"))}


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_label_a_panel_uses_is_exported(exported, name):
    problems = []
    for panel in DASHBOARDS[name]["panels"]:
        for target in panel.get("targets", []):
            legend = target.get("legendFormat", "")
            problems += [f"{panel['title']}: {p}" for p in label_problems(target["expr"], legend, exported)]
    for variable in DASHBOARDS[name]["templating"]["list"]:
        if variable["type"] == "query":
            selector, label = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]["query"]).groups()
            problems += [f"variable {variable['name']}: {p}" for p in label_problems(selector, "", exported)]
            names = {vs.name for vs in selectors(parse(selector))}
            problems += [f"variable {variable['name']}: {label} not on {n}" for n in names if label not in exported[n]]
    assert problems == []


def test_the_label_check_catches_a_wrong_label(exported):
    assert label_problems('sum by (gpu) (kareus_gpu_power_watts{kareus_job="x"})', "{{gpu}}", exported) == [
        "kareus_gpu_power_watts{kareus_job}: label not exported",
        "by (gpu) over kareus_gpu_power_watts: label not exported",
        "legend {{gpu}}: not a label of the result",
    ]
    assert label_problems("kareus_gpu_power_watts", "{{gpu_uuid}}", exported) == []
