"""The chart's alerts (templates/prometheusrule.yaml) under the real `promtool`.

The PrometheusRule is rendered by the real Helm engine; its groups go to `promtool check rules`
(clean: no error, no warning) and to `promtool test rules` with tests/promtool/alerts_test.yaml,
where every alert has a firing and a non-firing case. A deliberately broken rule must fail those
tests (they are not vacuous), every series an alert reads must be one Kareus exports (or
Prometheus' own `up`), and the operator's per-job series the job alerts read are produced by
`OperatorMetrics.observe_status` as the rules expect them. promtool is Debian's `prometheus`
package (`make prometheus`); without it these tests fail, never skip.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kareus.metric_names import all_metric_names

helm = pytest.importorskip("helm_python", reason="helm-python-sdk has no wheel for this platform")
promql_parser = pytest.importorskip("promql_parser")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "kareus"
TESTS = ROOT / "tests" / "promtool" / "alerts_test.yaml"
BUDGETS_KWH = {"team-a": 0.001, "team-b": {"kwh": 1, "period": "day"}}
VALUES = {"metrics": {"prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
          "policy": {"namespaceEnergyBudgets": BUDGETS_KWH}}
ALERTS = {"KareusNodeAgentDown", "KareusOperatorDown", "KareusGPUClockLockedWithoutOwner",
          "KareusClockControlDegraded", "KareusProfilingStuck", "KareusNamespaceOverEnergyBudget"}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: install Debian's prometheus package (`make prometheus`)", pytrace=False)
    return path


def render(values: dict) -> list[dict]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="kareus", namespace="kareus-system")
    return [doc for path, text in manifests.items() if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(scope="module")
def rule() -> dict:
    [found] = [o for o in render(VALUES) if o["kind"] == "PrometheusRule"]
    return found


def write_rules(directory: Path, spec: dict) -> Path:
    """The rule file promtool reads: the PrometheusRule's spec (`groups:`) as it is."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    shutil.copy(TESTS, directory / TESTS.name)
    return path


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def test_the_rule_is_off_by_default_and_carries_its_labels(rule):
    assert not [o for o in render({}) if o["kind"] == "PrometheusRule"]
    assert rule["metadata"]["namespace"] == "kareus-system"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert set(alerts) == ALERTS
    assert alerts.count("KareusNamespaceOverEnergyBudget") == len(BUDGETS_KWH)  # one per budgeted namespace


def test_the_values_schema_rejects_a_typo():
    report = helm.lint(str(CHART), {"metrics": {"prometheusRule": {"enable": True}}}, strict=True,
                       namespace="kareus-system")
    assert any("'enable' not allowed" in e for e in report["errors"]), report


def test_promtool_check_rules_is_clean(rule, tmp_path):
    path = write_rules(tmp_path, rule["spec"])
    result = run("check", "rules", str(path), cwd=tmp_path)
    print(result.stdout, result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    rules = sum(len(g["rules"]) for g in rule["spec"]["groups"])
    assert f"SUCCESS: {rules} rules found" in result.stdout
    assert "WARNING" not in (result.stdout + result.stderr).upper()


def test_every_alert_has_a_firing_and_a_non_firing_case():
    cases: dict[str, set[str]] = {}
    for test in yaml.safe_load(TESTS.read_text())["tests"]:
        for check in test["alert_rule_test"]:
            cases.setdefault(check["alertname"], set()).add("firing" if check["exp_alerts"] else "quiet")
    assert cases == {alert: {"firing", "quiet"} for alert in ALERTS}


def test_promtool_test_rules_passes(rule, tmp_path):
    write_rules(tmp_path, rule["spec"])
    result = run("test", "rules", TESTS.name, cwd=tmp_path)
    print(result.stdout, result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize(("alert", "change"), [
    ("KareusNodeAgentDown", lambda r: r.update({"for": "15m"})),
    ("KareusGPUClockLockedWithoutOwner", lambda r: r.update({"expr": r["expr"].replace('{pod=""}', "")})),
    ("KareusNamespaceOverEnergyBudget", lambda r: r.update({"expr": r["expr"].replace("> 3600", "> 36000")})),
])
def test_the_unit_tests_catch_a_broken_rule(rule, tmp_path, alert, change):
    spec = copy.deepcopy(rule["spec"])
    matched = [r for g in spec["groups"] for r in g["rules"] if r.get("alert") == alert]
    for r in matched:
        before = dict(r)
        change(r)
    assert matched and r != before
    write_rules(tmp_path, spec)
    result = run("test", "rules", TESTS.name, cwd=tmp_path)
    assert result.returncode != 0 and alert in result.stdout + result.stderr


def test_alerts_read_only_series_kareus_exports(rule):
    known = all_metric_names() | {"up"}
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            names: set[str] = set()
            promql_parser.walk(promql_parser.parse(r["expr"]),
                               lambda n, found=names: found.add(n.name)
                               if isinstance(n, promql_parser.VectorSelector) else None, None)
            assert names and names <= known, (r["alert"], names - known)


def test_the_operator_exports_the_per_job_series_the_alerts_read():
    from kareus_operator.metrics import OperatorMetrics
    from prometheus_client.parser import text_string_to_metric_families

    def samples(metrics: OperatorMetrics) -> dict[tuple[str, tuple], float]:
        found = {}
        for family in text_string_to_metric_families(metrics.exposition().decode()):
            for s in family.samples:
                if s.name.startswith("kareus_job_"):
                    found[s.name, tuple(sorted(s.labels.items()))] = s.value
        return found

    def key(name: str, **labels: str) -> tuple[str, tuple]:
        return name, tuple(sorted({"namespace": "team-a", "kareusjob": "llama", **labels}.items()))

    metrics = OperatorMetrics()
    job = {"metadata": {"uid": "u1", "namespace": "team-a", "name": "llama"}}
    metrics.observe_status(job, {"phase": "Profiling", "conditions": [
        {"type": "Profiled", "status": "False"}]})
    assert samples(metrics) == {key("kareus_job_phase", phase="Profiling"): 1.0,
                                key("kareus_job_condition", condition="Profiled"): 0.0,
                                key("kareus_job_measured_energy_joules"): 0.0}
    metrics.observe_status(job, {"phase": "Training", "measured": {"energyJoules": 1234.5}, "conditions": [
        {"type": "Profiled", "status": "True"}, {"type": "ClockControlDegraded", "status": "True"}]})
    assert samples(metrics) == {key("kareus_job_phase", phase="Training"): 1.0,  # the old phase is gone
                                key("kareus_job_condition", condition="Profiled"): 1.0,
                                key("kareus_job_condition", condition="ClockControlDegraded"): 1.0,
                                key("kareus_job_measured_energy_joules"): 1234.5}
    metrics.forget("u1")
    assert samples(metrics) == {}
