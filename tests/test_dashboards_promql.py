"""Grafana dashboards: valid PromQL that names only metrics Kareus exports, a datasource variable, a sane layout.

The PromQL is parsed with a real PromQL parser (promql-parser, the Rust parser behind GreptimeDB)
after Grafana's variables are substituted, and every vector selector's metric name must be in
`kareus.metric_names.all_metric_names()` (histogram series may add `_bucket`, `_sum`, `_count`,
counters and histograms `_created`).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from kareus.metric_names import all_metric_names

promql_parser = pytest.importorskip("promql_parser")

CHART = Path(__file__).resolve().parents[1] / "helm" / "kareus"
DASHBOARD_DIR = CHART / "dashboards"
SUFFIXES = ("_bucket", "_sum", "_count", "_created")
# Values Grafana substitutes before a query reaches Prometheus.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m", "$__range": "6h", "$__interval": "30s",
    "$node": "gpu-node-1", "$namespace": "team-a", "$kareusjob": "llama",
}


def load_generator():
    spec = importlib.util.spec_from_file_location("kareus_dashboards_generate", DASHBOARD_DIR / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DASHBOARDS = {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARD_DIR.glob("*.json"))}


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def exprs(dashboard: dict) -> list[str]:
    found = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found.append(label_values_selector(variable["query"]["query"]))
    return found


def label_values_selector(query: str) -> str:
    """The series selector inside Grafana's `label_values(selector, label)`."""
    match = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
    assert match, f"unexpected variable query {query!r}"
    return match.group(1)


def substitute(expr: str) -> str:
    for variable in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(variable, GRAFANA_VARIABLES[variable])
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr!r}"
    return expr


def metric_names_in(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(substitute(expr)), visit, None)
    return names


def base_name(series: str) -> str:
    known = all_metric_names()
    if series in known:
        return series
    for suffix in SUFFIXES:
        if series.endswith(suffix) and series.removesuffix(suffix) in known:
            return series.removesuffix(suffix)
    raise AssertionError(f"{series} is not exported by Kareus (kareus.metric_names)")


def test_three_dashboards_are_shipped():
    assert set(DASHBOARDS) == {"cluster-energy.json", "job.json", "operator.json"}
    uids = [d["uid"] for d in DASHBOARDS.values()]
    assert len(set(uids)) == len(uids)


def test_json_files_match_the_generator():
    rendered = load_generator().render_all()
    for name, text in rendered.items():
        assert (DASHBOARD_DIR / name).read_text() == text, f"{name} is stale: run helm/kareus/dashboards/generate.py"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_expression_parses_and_names_only_exported_metrics(name):
    used = set()
    for expr in exprs(DASHBOARDS[name]):
        series = metric_names_in(expr)
        assert series, f"{expr!r} selects no metric"
        used |= {base_name(s) for s in series}
    assert used


def test_dashboards_cover_what_the_issue_asks_for():
    uses = {name: {base_name(s) for e in exprs(d) for s in metric_names_in(e)} for name, d in DASHBOARDS.items()}
    assert {"kareus_gpu_power_watts", "kareus_gpu_energy_joules_total", "kareus_gpu_sm_clock_hertz",
            "kareus_gpu_clock_changes_total", "kareus_daemon_requests_total"} <= uses["cluster-energy.json"]
    assert {"kareus_iteration_seconds", "kareus_iteration_energy_joules", "kareus_tokens_per_joule",
            "kareus_plan_info"} <= uses["job.json"]
    assert {"kareus_jobs", "kareus_phase_seconds", "kareus_profile_cache_hits_total"} <= uses["operator.json"]
    titles = {p["title"] for p in panels(DASHBOARDS["cluster-energy.json"])}
    assert {"Energy per namespace", "Energy per KareusJob", "Refused clock requests"} <= titles
    assert any("predicted" in p["title"].lower() for p in panels(DASHBOARDS["job.json"]))


def test_the_checker_rejects_an_unknown_metric():
    with pytest.raises(AssertionError, match="not exported"):
        base_name("kareus_gpu_temperature_celsius")
    with pytest.raises(AssertionError, match="not exported"):
        base_name("kareus_jobs_bucketz")
    with pytest.raises(ValueError):
        metric_names_in("sum(rate(kareus_jobs[5m])")


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_datasource_is_a_variable_everywhere(name):
    dashboard = DASHBOARDS[name]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for p in panels(dashboard):
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${datasource}"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_layout_has_unique_ids_and_no_overlaps(name):
    dashboard = DASHBOARDS[name]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
    occupied: set[tuple[int, int]] = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"{p['title']} overlaps another panel"
        occupied |= cells
    for p in panels(dashboard):
        assert p["fieldConfig"]["defaults"]["unit"], p["title"]
        assert p["description"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(set(refs)) == len(refs), p["title"]
