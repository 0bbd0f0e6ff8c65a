"""Every Prometheus Operator monitor the chart renders selects the pods and ports it should.

The chart's ServiceMonitors and PodMonitor (rendered by Helm) are matched, the way the Prometheus
Operator matches them, against what really carries the metrics: the operator's and node agent's
Services and pods (rendered by the same chart) and the training pods the operator builds
(`manifests.train_job`'s pod template). A renamed port or label on either side fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kareus_operator import manifests as mf
from kareus_operator.settings import Settings

from kareus.spec import parse_job

helm = pytest.importorskip("helm_python", reason="helm-python-sdk has no wheel for this platform")

ROOT = Path(__file__).resolve().parents[1]
VALUES = {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
          "operator": {"args": {"watchNamespaces": ["team-a"]}}}


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    with helm.Chart.load(str(ROOT / "helm" / "kareus")) as chart:
        manifests = chart.render(VALUES, name="kareus", namespace="kareus-system")
    return [doc for path, text in manifests.items() if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector's verdict (matchLabels and the matchExpressions operators the chart uses)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        ok = {"Exists": present, "DoesNotExist": not present, "In": labels.get(key) in values,
              "NotIn": labels.get(key) not in values}[operator]
        if not ok:
            return False
    return True


def in_namespaces(selector: dict, namespace: str) -> bool:
    return selector.get("any", False) or namespace in selector.get("matchNames", [])


def pod_template(workload: dict) -> dict:
    return {"metadata": {**workload["spec"]["template"]["metadata"], "namespace": workload["metadata"]["namespace"]},
            "spec": workload["spec"]["template"]["spec"]}


def port_names(pod: dict) -> set[str]:
    return {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", []) if "name" in p}


def training_pod(gpus_per_node: int) -> dict:
    job = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    job["metadata"].update(namespace="team-a", uid="5678-efgh")
    job["spec"]["training"]["gpusPerNode"] = gpus_per_node
    job["spec"]["parallelism"].update(tensor=1, data=gpus_per_node)  # the GPUs must add up
    spec = parse_job({k: job[k] for k in ("apiVersion", "kind", "metadata", "spec")}).spec
    template = mf.train_job(job, spec, Settings())["spec"]["template"]
    return {**template, "metadata": {**template["metadata"], "namespace": "team-a"}}  # the Job's namespace


def test_service_monitors_select_the_operator_and_node_agent_metrics_ports(objects):
    monitors = of_kind(objects, "ServiceMonitor")
    assert len(monitors) == 2
    workloads = [*of_kind(objects, "Deployment"), *of_kind(objects, "DaemonSet")]
    for monitor in monitors:
        spec = monitor["spec"]
        services = [s for s in of_kind(objects, "Service") if selects(spec["selector"], s["metadata"]["labels"])
                    and in_namespaces(spec["namespaceSelector"], s["metadata"]["namespace"])]
        assert len(services) == 1, monitor["metadata"]["name"]
        service = services[0]
        endpoint_ports = {e["port"] for e in spec["endpoints"]}
        service_ports = {p["name"]: p for p in service["spec"]["ports"]}
        assert endpoint_ports <= set(service_ports)
        # The Service's selector finds the workload's pods, and its port targets a named container port.
        pods = [pod_template(w) for w in workloads if w["metadata"]["namespace"] == service["metadata"]["namespace"]
                and selects({"matchLabels": service["spec"]["selector"]}, pod_template(w)["metadata"]["labels"])]
        assert len(pods) == 1
        for name in endpoint_ports:
            assert service_ports[name]["targetPort"] in port_names(pods[0])


@pytest.mark.parametrize("gpus_per_node", [1, 2, 8])
def test_the_pod_monitor_scrapes_every_rank_of_every_training_pod(objects, gpus_per_node):
    (monitor,) = of_kind(objects, "PodMonitor")
    spec = monitor["spec"]
    pod = training_pod(gpus_per_node)
    assert selects(spec["selector"], pod["metadata"]["labels"])
    assert in_namespaces(spec["namespaceSelector"], pod["metadata"]["namespace"])
    scraped = {e["port"] for e in spec["podMetricsEndpoints"]}
    ports = port_names(pod)
    assert len(ports) == gpus_per_node and ports <= scraped  # every rank's port has an endpoint
    container = pod["spec"]["containers"][0]
    base = int(next(e["value"] for e in container["env"] if e["name"] == "KAREUS_METRICS_PORT"))
    assert sorted(p["containerPort"] for p in container["ports"]) == [base + r for r in range(gpus_per_node)]


def test_the_pod_monitor_skips_the_other_phases_pods(objects):
    (monitor,) = of_kind(objects, "PodMonitor")
    job = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    job["metadata"].update(namespace="team-a", uid="5678-efgh")
    spec = parse_job({k: job[k] for k in ("apiVersion", "kind", "metadata", "spec")}).spec
    profile = mf.profile_job(job, spec, Settings(), "key")["spec"]["template"]
    assert not selects(monitor["spec"]["selector"], profile["metadata"]["labels"])
