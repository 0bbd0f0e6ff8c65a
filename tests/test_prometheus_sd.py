"""The dev cluster's Prometheus scrapes exactly what the chart's monitors select.

`kareus_devcluster.prometheus.scrape_configs` turns ServiceMonitors and PodMonitors into
`kubernetes_sd_configs` (role: pod) jobs. Here Prometheus' pod discovery is replayed in Python —
one candidate target per container port, with the `__meta_kubernetes_*` labels Prometheus gives it —
and each job's relabelling is applied; the surviving targets must be exactly the (namespace, pod,
port) triples the monitors' own semantics select (a ServiceMonitor: the Services its selector and
namespaceSelector pick, their pods by the Service's selector, the container port the Service port
targets; a PodMonitor: its pod selector, namespaces and port), with the Prometheus Operator's target
labels. The monitors are the chart's (rendered by Helm) and hand-made ones that use every selector
operator; the pods include decoys (other namespaces, labels, ports, finished pods). The generated
configuration is also checked by the real `promtool check config`.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from kareus_devcluster.prometheus import label_name, pod_targets, scrape_configs
from kareus_operator.settings import LABEL_JOB, LABEL_ROLE

helm = pytest.importorskip("helm_python", reason="helm-python-sdk has no wheel for this platform")

ROOT = Path(__file__).resolve().parents[1]
DISCOVERY = {"file_sd_configs": [{"files": ["/tmp/pods.json"]}]}


# ---------------------------------------------------------------- Prometheus' side, replayed


def discovered(pod: dict) -> list[dict[str, str]]:
    """The targets Prometheus' pod role makes of a pod: one per container port (pods without an IP
    give none), labelled as kubernetes_sd_configs labels them."""
    if not pod.get("status", {}).get("podIP"):
        return []
    meta = pod["metadata"]
    base = {"__meta_kubernetes_namespace": meta["namespace"], "__meta_kubernetes_pod_name": meta["name"],
            "__meta_kubernetes_pod_phase": pod["status"].get("phase", "Running"),
            "__meta_kubernetes_pod_node_name": pod["spec"].get("nodeName", "")}
    for key, value in (meta.get("labels") or {}).items():
        base[f"__meta_kubernetes_pod_label_{label_name(key)}"] = value
        base[f"__meta_kubernetes_pod_labelpresent_{label_name(key)}"] = "true"
    targets = []
    for container in pod["spec"]["containers"]:
        for port in container.get("ports") or []:
            targets.append({**base, "__address__": f"{pod['status']['podIP']}:{port['containerPort']}",
                            "__meta_kubernetes_pod_container_name": container["name"],
                            "__meta_kubernetes_pod_container_init": "false",
                            "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                            "__meta_kubernetes_pod_container_port_number": str(port["containerPort"])})
    return targets


def relabel(labels: dict[str, str], rules: list[dict]) -> dict[str, str] | None:
    """Prometheus' relabelling (the actions the derived configs use); None when the target is dropped."""
    labels = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(name, "") for name in rule.get("source_labels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)  # Prometheus anchors every regex
        action = rule.get("action", "replace")
        if action == "keep" and not match:
            return None
        if action == "drop" and match:
            return None
        if action == "replace" and match:
            result = match.expand(rule.get("replacement", "$1").replace("$", "\\"))
            if result:
                labels[rule["target_label"]] = result
            else:
                labels.pop(rule["target_label"], None)
        if action not in ("keep", "drop", "replace"):
            raise AssertionError(f"relabel action {action} not replayed here")
    labels.setdefault("instance", labels["__address__"])
    return labels


def scraped(jobs: list[dict], pods: list[dict]) -> dict[tuple[str, str, str], dict[str, str]]:
    """(namespace, pod, port name) → the target's labels (meta labels removed), over all jobs."""
    found: dict[tuple[str, str, str], dict[str, str]] = {}
    seen: set[tuple[str, tuple[str, str, str]]] = set()
    for job in jobs:
        assert job["file_sd_configs"] == DISCOVERY["file_sd_configs"]  # every job sees every pod
        for pod in pods:
            for target in discovered(pod):
                kept = relabel(target, job["relabel_configs"])
                if kept is not None:
                    key = (pod["metadata"]["namespace"], pod["metadata"]["name"],
                           target["__meta_kubernetes_pod_container_port_name"])
                    # Two monitors may select one port (two jobs scrape it); one job never twice.
                    assert (job["job_name"], key) not in seen, f"{key} scraped twice by {job['job_name']}"
                    seen.add((job["job_name"], key))
                    found[key] = {k: v for k, v in kept.items() if not k.startswith("__")}
    return found


# ---------------------------------------------------------------- the monitors' semantics


def selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, values = e["key"], e.get("values") or []
        if not {"Exists": key in labels, "DoesNotExist": key not in labels,
                "In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values}[e["operator"]]:
            return False
    return True


def in_namespaces(selector: dict | None, own: str, namespace: str) -> bool:
    selector = selector or {}
    return bool(selector.get("any")) or namespace in (selector.get("matchNames") or [own])


def live(pod: dict) -> bool:
    return bool(pod["status"].get("podIP")) and pod["status"].get("phase") not in ("Succeeded", "Failed")


def expected(service_monitors, pod_monitors, services, pods) -> set[tuple[str, str, str]]:
    want = set()
    for monitor in service_monitors:
        ns, spec = monitor["metadata"]["namespace"], monitor["spec"]
        for service in services:
            if not (selects(spec["selector"], service["metadata"].get("labels") or {})
                    and in_namespaces(spec.get("namespaceSelector"), ns, service["metadata"]["namespace"])
                    and service["spec"].get("selector")):
                continue
            for endpoint in spec["endpoints"]:
                port = next((p for p in service["spec"]["ports"] if p.get("name") == endpoint["port"]), None)
                if port is None:
                    continue
                target = port.get("targetPort", port["port"])
                for pod in pods:
                    if (pod["metadata"]["namespace"] == service["metadata"]["namespace"] and live(pod)
                            and selects({"matchLabels": service["spec"]["selector"]}, pod["metadata"]["labels"])):
                        want |= {(pod["metadata"]["namespace"], pod["metadata"]["name"], p.get("name", ""))
                                 for c in pod["spec"]["containers"] for p in c.get("ports") or []
                                 if target in (p.get("name"), p["containerPort"])}
    for monitor in pod_monitors:
        ns, spec = monitor["metadata"]["namespace"], monitor["spec"]
        wanted_ports = {e["port"] for e in spec["podMetricsEndpoints"]}
        for pod in pods:
            if (live(pod) and selects(spec["selector"], pod["metadata"]["labels"])
                    and in_namespaces(spec.get("namespaceSelector"), ns, pod["metadata"]["namespace"])):
                want |= {(pod["metadata"]["namespace"], pod["metadata"]["name"], p["name"])
                         for c in pod["spec"]["containers"] for p in c.get("ports") or [] if p.get("name") in wanted_ports}
    return want


# ---------------------------------------------------------------- fixtures: the chart's objects and pods

_ips = itertools.count(2)


def pod_of(template: dict, namespace: str, name: str, *, phase: str = "Running", ip: bool = True,
           node: str = "gpu-1") -> dict:
    return {"metadata": {**template["metadata"], "namespace": namespace, "name": name},
            "spec": {**template["spec"], "nodeName": node},
            "status": {"phase": phase, **({"podIP": f"127.0.0.{next(_ips)}"} if ip else {})}}


def training_pod(namespace: str, name: str, job: str, ranks: int, *, role: str = "train", phase: str = "Running") -> dict:
    ports = [{"name": "metrics" if r == 0 else f"metrics-{r}", "containerPort": 41000 + r} for r in range(ranks)]
    template = {"metadata": {"labels": {LABEL_JOB: job, LABEL_ROLE: role}},
                "spec": {"containers": [{"name": "train", "ports": ports}]}}
    return pod_of(template, namespace, name, phase=phase)


@pytest.fixture(scope="module")
def chart_objects() -> list[dict]:
    values = {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True, "ranksPerPod": 4}},
              "operator": {"args": {"watchNamespaces": ["team-a", "team-b"]}}}
    with helm.Chart.load(str(ROOT / "helm" / "kareus")) as chart:
        manifests = chart.render(values, name="kareus", namespace="kareus-system")
    return [doc for path, text in manifests.items() if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def kind(objects: list[dict], name: str) -> list[dict]:
    return [o for o in objects if o["kind"] == name]


@pytest.fixture(scope="module")
def chart_pods(chart_objects) -> list[dict]:
    def template(workload: dict) -> dict:
        return workload["spec"]["template"]

    [operator] = kind(chart_objects, "Deployment")
    [agent] = kind(chart_objects, "DaemonSet")
    ns_op, ns_agent = operator["metadata"]["namespace"], agent["metadata"]["namespace"]
    return [
        pod_of(template(operator), ns_op, "kareus-operator-abc"),
        pod_of(template(operator), ns_op, "kareus-operator-old", phase="Succeeded"),  # finished: not scraped
        pod_of(template(operator), ns_op, "kareus-operator-new", ip=False),  # no IP yet: not scraped
        pod_of(template(operator), "elsewhere", "kareus-operator-copy"),  # the Service's namespace only
        pod_of(template(agent), ns_agent, "kareus-node-agent-1", node="gpu-1"),
        pod_of(template(agent), ns_agent, "kareus-node-agent-2", node="gpu-2"),
        training_pod("team-a", "llama-train-0-x1", "llama", 4),
        training_pod("team-a", "llama-train-1-x2", "llama", 2),
        training_pod("team-b", "qwen-train-0-x3", "qwen", 1),
        training_pod("team-c", "other-train-0-x4", "other", 1),  # not a watched namespace
        training_pod("team-a", "llama-profile-x5", "llama", 1, role="profile"),  # not training
        training_pod("team-a", "llama-train-0-old", "llama", 1, phase="Failed"),
        pod_of({"metadata": {"labels": {LABEL_ROLE: "train"}},  # no job label: not a KareusJob's pod
                "spec": {"containers": [{"name": "c", "ports": [{"name": "metrics", "containerPort": 9}]}]}},
               "team-a", "stray"),
    ]


def test_the_chart_monitors_select_the_same_targets(chart_objects, chart_pods):
    sms, pms, services = kind(chart_objects, "ServiceMonitor"), kind(chart_objects, "PodMonitor"), kind(chart_objects, "Service")
    jobs = scrape_configs(sms, pms, services, DISCOVERY)
    got = scraped(jobs, chart_pods)
    want = expected(sms, pms, services, chart_pods)
    assert set(got) == want
    # What is scraped, spelled out: the operator, both agents, every rank of the training pods.
    assert want == {("kareus-system", "kareus-operator-abc", "metrics"),
                    ("kareus-node", "kareus-node-agent-1", "metrics"), ("kareus-node", "kareus-node-agent-2", "metrics"),
                    *{("team-a", "llama-train-0-x1", p) for p in ("metrics", "metrics-1", "metrics-2", "metrics-3")},
                    ("team-a", "llama-train-1-x2", "metrics"), ("team-a", "llama-train-1-x2", "metrics-1"),
                    ("team-b", "qwen-train-0-x3", "metrics")}


def test_targets_carry_the_prometheus_operator_labels(chart_objects, chart_pods):
    jobs = scrape_configs(kind(chart_objects, "ServiceMonitor"), kind(chart_objects, "PodMonitor"),
                          kind(chart_objects, "Service"), DISCOVERY)
    got = scraped(jobs, chart_pods)
    agent = got["kareus-node", "kareus-node-agent-2", "metrics"]
    assert agent["job"] == agent["service"] == "kareus-node-agent-metrics"
    assert agent["node"] == "gpu-2"  # the chart's relabeling: the agent pod's node
    assert (agent["namespace"], agent["pod"], agent["endpoint"]) == ("kareus-node", "kareus-node-agent-2", "metrics")
    operator = got["kareus-system", "kareus-operator-abc", "metrics"]
    assert operator["job"] == "kareus-operator-metrics"
    rank = got["team-a", "llama-train-0-x1", "metrics-3"]
    assert rank["job"] == "kareus-system/kareus-training" and rank["kareusjob"] == "llama"
    assert rank["endpoint"] == "metrics-3" and rank["instance"].endswith(":41003")
    by_name = {j["job_name"]: j for j in jobs}
    assert by_name["serviceMonitor/kareus-node/kareus-node-agent/0/kareus-node-agent-metrics"]["honor_labels"] is True
    assert by_name["serviceMonitor/kareus-system/kareus-operator/0/kareus-operator-metrics"]["honor_labels"] is True
    assert all(j["scrape_interval"] == "30s" and j["metrics_path"] == "/metrics" for j in jobs)


def test_every_selector_operator_selects_as_kubernetes_does():
    def pod(name: str, labels: dict, ns: str = "ns") -> dict:
        return pod_of({"metadata": {"labels": labels},
                       "spec": {"containers": [{"name": "c", "ports": [{"name": "web", "containerPort": 80},
                                                                          {"name": "admin", "containerPort": 81}]}]}},
                      ns, name)

    pods = [pod("a", {"tier": "gpu", "team": "x", "canary": "1"}), pod("b", {"tier": "gpu", "team": "y"}),
            pod("c", {"tier": "cpu", "team": "x"}), pod("d", {"team": "z"}), pod("e", {"tier": "gpu.v2", "team": "x"}),
            pod("f", {"tier": "gpu"}, ns="other"), pod("g", {"tier": "gpu", "team": "x"}, ns="third")]
    monitors = [
        {"metadata": {"namespace": "ns", "name": "in"}, "spec": {
            "selector": {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gpu", "tpu"]}]},
            "namespaceSelector": {"matchNames": ["ns", "other"]}, "podMetricsEndpoints": [{"port": "web"}]}},
        {"metadata": {"namespace": "ns", "name": "notin-exists"}, "spec": {
            "selector": {"matchExpressions": [{"key": "team", "operator": "NotIn", "values": ["y", "z"]},
                                              {"key": "canary", "operator": "DoesNotExist"},
                                              {"key": "tier", "operator": "Exists"}]},
            "namespaceSelector": {"any": True}, "podMetricsEndpoints": [{"port": "admin"}]}},
        {"metadata": {"namespace": "ns", "name": "labels"}, "spec": {  # its own namespace when none is named
            "selector": {"matchLabels": {"tier": "gpu", "team": "x"}}, "podMetricsEndpoints": [{"port": "web"}]}},
    ]
    services = [{"metadata": {"namespace": "ns", "name": "svc", "labels": {"app": "s"}},
                 "spec": {"selector": {"team": "x"}, "ports": [{"name": "http", "port": 8080, "targetPort": 81}]}},
                {"metadata": {"namespace": "ns", "name": "headless-none", "labels": {"app": "s"}},
                 "spec": {"ports": [{"name": "http", "port": 1}]}}]  # no selector: no pods
    service_monitors = [{"metadata": {"namespace": "ns", "name": "sm"},
                         "spec": {"selector": {"matchLabels": {"app": "s"}}, "endpoints": [{"port": "http"}]}}]
    jobs = scrape_configs(service_monitors, monitors, services, DISCOVERY)
    got = set(scraped(jobs, pods))
    assert got == expected(service_monitors, monitors, services, pods)
    # "gpu.v2" is not "gpu": values match literally and anchored, as in Kubernetes
    assert ("ns", "e", "web") not in got and ("ns", "a", "web") in got and ("other", "f", "web") in got
    assert ("third", "g", "admin") in got and ("ns", "c", "admin") in got  # the Service's target port 81 is "admin"


def test_promtool_accepts_the_generated_configuration(chart_objects, tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install Debian's prometheus package (`make prometheus`)", pytrace=False)
    jobs = scrape_configs(kind(chart_objects, "ServiceMonitor"), kind(chart_objects, "PodMonitor"),
                          kind(chart_objects, "Service"), {"file_sd_configs": [{"files": [str(tmp_path / "pods.json")]}]})
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "30s"}, "scrape_configs": jobs}))
    result = subprocess.run([promtool, "check", "config", str(config)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_discovery_bridge_labels_pods_as_the_pod_role_does(chart_pods):
    """Debian's Prometheus has no Kubernetes discovery: the bridge writes file-SD targets, which
    must carry the labels the pod role would (the replay above states them independently)."""
    for pod in chart_pods:
        bridge = [{"__address__": group["targets"][0], **group["labels"]} for group in pod_targets(pod)]
        replay = discovered(pod)
        assert len(bridge) == len(replay), pod["metadata"]["name"]
        for ours, theirs in zip(bridge, replay, strict=True):
            assert theirs.items() <= ours.items()
