"""The node agent's part of the Helm chart for TCP callers and real GPU nodes, rendered by the real
Helm engine: the agent listens on the node's address (hostNetwork, $(HOST_IP):nodeAgent.port) and
the operator is told the same port; its ServiceAccount may create TokenReviews; no
system-node-critical outside kube-system — the chart's own PriorityClass when asked for; the values
schema refuses bad values; what the chart renders is what `kareus-node` parses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk has no wheel for this platform")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

CHART = Path(__file__).resolve().parents[1] / "helm" / "kareus"
RELEASE, NAMESPACE, AGENT_NS = "kareus", "kareus-system", "kareus-node"
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "port": {"nodeAgent": {"port": 19477}},
    "ownPriorityClass": {"nodeAgent": {"priorityClass": {"create": True, "value": 2000000}}},
    "existingPriorityClass": {"nodeAgent": {"priorityClassName": "gpu-infrastructure"}},
    "capabilities": {"nodeAgent": {"securityMode": "capabilities"}},
    "namespaced": {"operator": {"args": {"watchNamespaces": ["team-a"]}}},
    "agentNamespaceExternal": {"nodeAgent": {"namespace": {"create": False, "name": "gpu-system"}}},
    "noCeilings": {"operator": {"publishClockCeilings": False}},
    "noNodeAgent": {"nodeAgent": {"enabled": False}},
}
CEILINGS = "kareus-clock-ceilings"


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def objects(chart):
    rendered = {}
    for name, values in VALUE_SETS.items():
        objs = {}
        for path, text in chart.render(values, name=RELEASE, namespace=NAMESPACE).items():
            if not path.endswith("NOTES.txt"):
                for doc in yaml.safe_load_all(text):
                    if doc:
                        objs[(doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"])] = doc
        rendered[name] = objs
    return rendered


def agent_pod(objs) -> dict:
    return objs[("DaemonSet", AGENT_NS, "kareus-node-agent")]["spec"]["template"]["spec"]


def operator_env(objs) -> dict[str, str]:
    [deployment] = [o for (kind, _, _), o in objs.items() if kind == "Deployment"]
    return {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_objects_are_valid_kubernetes(objects, name):
    for obj in objects[name].values():
        if obj["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(obj, "1.30", strict=True)


@pytest.mark.parametrize(("name", "port"), [("default", 9477), ("port", 19477)])
def test_the_agent_listens_on_the_node_address_at_the_port_the_operator_uses(objects, name, port):
    node_main = pytest.importorskip("kareus_node.main")
    pod = agent_pod(objects[name])
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    args = node_main.build_parser().parse_args(container["args"])
    assert args.listen_tcp == ("$(HOST_IP)", port)  # the kubelet expands $(HOST_IP) from the env var
    assert {"name": "api", "containerPort": port, "protocol": "TCP"} in container["ports"]
    assert operator_env(objects[name])["KAREUS_OPERATOR_NODE_DAEMON_PORT"] == str(port)


def test_the_agent_may_review_tokens_and_nothing_more_than_that(objects):
    """By default: its node's pods, TokenReviews, and the keys tokens are signed with (checked locally
    before a review is asked for); SubjectAccessReviews only with metricsAuth."""
    role = objects["default"][("ClusterRole", "", "kareus-node-agent")]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
        {"nonResourceURLs": ["/openid/v1/jwks"], "verbs": ["get"]}]


def namespaced_rules(objs, namespace: str, subject: str) -> list[dict]:
    """The rules the Roles bound in `namespace` give ServiceAccount `subject`."""
    bound = {o["roleRef"]["name"] for (kind, ns, _), o in objs.items() if kind == "RoleBinding" and ns == namespace
             and any(s["name"] == subject for s in o["subjects"])}
    return [rule for (kind, ns, name), o in objs.items() if kind == "Role" and ns == namespace and name in bound
            for rule in o["rules"]]


@pytest.mark.parametrize(("name", "agent_ns"), [("default", AGENT_NS), ("namespaced", AGENT_NS),
                                                ("agentNamespaceExternal", "gpu-system")])
def test_the_agent_enforces_the_ceilings_the_operator_may_write_and_nothing_else_there(objects, name, agent_ns):
    """The agent reads (GET, as kareus_node.ceilings does) one ConfigMap in its own namespace; the
    operator is told that namespace and name, and may get, create (server-side apply) and patch
    only that ConfigMap there."""
    node_main = pytest.importorskip("kareus_node.main")
    settings_module = pytest.importorskip("kareus_operator.settings")
    objs = objects[name]
    [daemonset] = [o for (kind, _, _), o in objs.items() if kind == "DaemonSet"]
    args = node_main.build_parser().parse_args(daemonset["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args.clock_ceilings == (agent_ns, CEILINGS)
    env = operator_env(objs)
    settings = settings_module.Settings.from_env({k: v for k, v in env.items() if k.startswith("KAREUS_OPERATOR_")})
    assert (settings.clock_ceilings_namespace, settings.clock_ceilings_configmap) == (agent_ns, CEILINGS)
    one_configmap = {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [CEILINGS]}
    assert namespaced_rules(objs, agent_ns, "kareus-node-agent") == [{**one_configmap, "verbs": ["get"]}]
    assert namespaced_rules(objs, agent_ns, "kareus-operator") == [{**one_configmap, "verbs": ["get", "create", "patch"]}]
    [binding] = [o for (kind, ns, n), o in objs.items() if kind == "RoleBinding" and ns == agent_ns
                 and n == "kareus-operator-clock-ceilings"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kareus-operator", "namespace": NAMESPACE}]
    if name == "namespaced":  # no cluster-wide rule reaches the agent's ConfigMaps either
        cluster = [r for (kind, _, n), o in objs.items() if kind == "ClusterRole" and n.startswith("kareus-operator")
                   for r in o["rules"]]
        assert not any("configmaps" in r.get("resources", []) for r in cluster)


def test_ceilings_publishing_off_and_an_operator_only_release(objects):
    """publishClockCeilings false: no Role in the agent's namespace and the operator is told no namespace
    (the agent still reads the ConfigMap, now absent: no ceilings). Without the node agent, the operator
    still publishes into the agent namespace another release runs."""
    off = objects["noCeilings"]
    assert operator_env(off)["KAREUS_OPERATOR_CLOCK_CEILINGS_NAMESPACE"] == ""
    assert not namespaced_rules(off, AGENT_NS, "kareus-operator")
    assert namespaced_rules(off, AGENT_NS, "kareus-node-agent")
    alone = objects["noNodeAgent"]
    assert operator_env(alone)["KAREUS_OPERATOR_CLOCK_CEILINGS_NAMESPACE"] == AGENT_NS
    assert namespaced_rules(alone, AGENT_NS, "kareus-operator") and not namespaced_rules(alone, AGENT_NS,
                                                                                         "kareus-node-agent")


def test_no_system_node_critical_and_an_own_priority_class_on_request(objects):
    assert "priorityClassName" not in agent_pod(objects["default"])
    assert not any(kind == "PriorityClass" for kind, _, _ in objects["default"])
    own = objects["ownPriorityClass"][("PriorityClass", "", "kareus-node-agent")]
    assert own["value"] == 2000000 and own["globalDefault"] is False
    assert agent_pod(objects["ownPriorityClass"])["priorityClassName"] == "kareus-node-agent"
    assert agent_pod(objects["existingPriorityClass"])["priorityClassName"] == "gpu-infrastructure"
    assert not any(kind == "PriorityClass" for kind, _, _ in objects["existingPriorityClass"])


def test_capabilities_mode_needs_no_cgroup_mount_for_either_driver(objects):
    # The agent joins the host's cgroup namespace itself (CAP_SYS_ADMIN, hostPID), so the
    # cgroupfs driver's paths read as on the host; nothing driver-specific is mounted.
    pod = agent_pod(objects["capabilities"])
    assert pod["hostPID"] is True
    assert pod["containers"][0]["securityContext"]["capabilities"]["add"] == ["SYS_ADMIN"]
    assert not any("cgroup" in v.get("hostPath", {}).get("path", "") for v in pod["volumes"])


def test_the_token_review_interval_reaches_the_daemon_config(objects, tmp_path):
    node_config = pytest.importorskip("kareus_node.config")
    path = tmp_path / "config.yaml"
    path.write_text(objects["default"][("ConfigMap", AGENT_NS, "kareus-node-agent")]["data"]["config.yaml"])
    assert node_config.load_config(path).token_review_s == 60.0


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"nodeAgent": {"port": 0}}, "port"),
        ({"nodeAgent": {"port": "9477"}}, "port"),
        ({"nodeAgent": {"priorityClass": {"create": True, "value": 2000000001}}}, "value"),
        ({"nodeAgent": {"priorityClas": {"create": True}}}, "priorityClas"),
        ({"nodeAgent": {"limits": {"tokenReviewSeconds": 0}}}, "tokenReviewSeconds"),
        ({"operator": {"publishClockCeilings": "yes"}}, "publishClockCeilings"),
    ],
)
def test_bad_values_fail_via_the_schema(chart, values, field):
    with pytest.raises(helm.HelmValuesError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert field in str(info.value)
