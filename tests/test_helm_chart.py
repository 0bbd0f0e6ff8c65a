"""The Helm chart, rendered by the real Helm engine (helm-python-sdk embeds Helm's Go SDK).

Each values set is rendered once per module. The tests check that the chart lints clean, that every
object is valid against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields
fail) and the KareusJob examples against the CRD the chart ships (applied to the session's real API
server), the Pod Security Standards (operator restricted; the node agent the only privileged part),
that each documented toggle changes exactly the objects it should, that values typos fail via
values.schema.json, and that what the chart renders is what the operator, the node agent and the
policy loader actually read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_server import apply_crd, dry_run_create

from kareus.policy import ClockBounds, PolicyError, load_policy
from kareus.spec import parse_job

helm = pytest.importorskip("helm_python", reason="helm-python-sdk has no wheel for this platform")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "kareus"
RELEASE, NAMESPACE = "kareus", "kareus-system"
KUBE_VERSIONS = ("1.30", "1.37")
Key = tuple[str, str, str]  # kind, namespace, name

POLICY = {
    "allowedObjectives": ["maxThroughput", "timeBudget"],
    "defaultObjective": "timeBudget",
    "maxSlowdownPercent": 10,
    "clockBounds": {"default": {"floorMHz": 600}, "gpuModels": {"NVIDIA-A100-SXM4-40GB": {"ceilingMHz": 1350}}},
    "namespaceEnergyBudgets": {"team-a": 5000},
    "profileReuse": False,
    "allowedNamespaces": ["team-a", "team-b"],
}
# Every documented toggle (docs/install.md), rendered once each.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "capabilities": {"nodeAgent": {"securityMode": "capabilities"}},
    "serviceMonitor": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}}},
    "podMonitor": {"metrics": {"podMonitor": {"enabled": True}}},
    "noDashboards": {"grafana": {"dashboards": {"enabled": False}}},
    "dashboardsElsewhere": {"grafana": {"dashboards": {"namespace": "monitoring",
                                                       "annotations": {"grafana_folder": "Kareus"}}}},
    "noCrds": {"crds": {"install": False}},
    "crdsNotKept": {"crds": {"keep": False}},
    "policy": {"policy": POLICY},
    "policySlowdownOnly": {"policy": {"maxSlowdownPercent": 5, "profileReuse": False}},
    "policyClockBounds": {"policy": {"clockBounds": {"default": {"floorMHz": 900, "ceilingMHz": 1410}}}},
    "namespaced": {"operator": {"args": {"watchNamespaces": ["team-a", "team-b"]}}},
    "noNodeAgent": {"nodeAgent": {"enabled": False}},
    "dryRun": {"nodeAgent": {"dryRun": True}},
    "agentNamespaceExternal": {"nodeAgent": {"namespace": {"create": False, "name": "gpu-system"}}},
    "noRbac": {"rbac": {"create": False}},
    "workers": {"workers": {"namespaces": ["ml"]}},
    "runtimeClass": {"nodeAgent": {"runtimeClassName": "nvidia"}},
    "agentWritableRoot": {"nodeAgent": {"readOnlyRootFilesystem": False}},
    "gpuNodeLabels": {"nodeAgent": {"extraGpuNodeLabels": ["accelerator=nvidia", "example.com/gpu-node"],
                                    "nodeSelector": {"pool": "train"}}},
    "pullSecrets": {"workers": {"imagePullSecrets": ["regcred", {"name": "mirror"}]}},
    "rendezvous": {"workers": {"rendezvousTimeoutSeconds": 1800}},
    "nodeToken": {"workers": {"nodeTokenExpirationSeconds": 900}},
    "noWorkerServiceAccount": {"workers": {"createServiceAccount": False}},
    "ownServiceAccounts": {"operator": {"serviceAccount": {"create": False, "name": "ops"}},
                           "nodeAgent": {"serviceAccount": {"create": False, "name": "agent"}}},
    "kueueCheck": {"kueue": {"energyBudgetCheck": {"enabled": True, "clusterQueues": ["gpus", "batch"]}}},
    "policyPeriodic": {"policy": {"namespaceEnergyBudgets": {"team-a": 5000, "team-b": {"kwh": 300, "period": "month"}}}},
    "metricsAuth": {"nodeAgent": {"metricsAuth": "tokenreview", "metricsReaders": [
                        {"kind": "ServiceAccount", "name": "prometheus-k8s", "namespace": "monitoring"}]},
                    "metrics": {"serviceMonitor": {"enabled": True}}},
}
MONITORING_GROUP = "monitoring.coreos.com/v1"


# ---------------------------------------------------------------- rendering


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def rendered(chart):
    """Values-set name → {template path → text}; every set is rendered once."""
    return {name: chart.render(values, name=RELEASE, namespace=NAMESPACE) for name, values in VALUE_SETS.items()}


def objects_of(manifests: dict[str, str]) -> dict[Key, dict]:
    objects: dict[Key, dict] = {}
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                key = (doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"])
                assert key not in objects, f"{key} rendered twice"
                objects[key] = doc
    return objects


@pytest.fixture(scope="module")
def objects(rendered):
    return {name: objects_of(manifests) for name, manifests in rendered.items()}


def one(objs: dict[Key, dict], kind: str, name_suffix: str = "") -> dict:
    found = [o for (k, _, n), o in objs.items() if k == kind and n.endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, found {len(found)}"
    return found[0]


def diff(base: dict[Key, dict], other: dict[Key, dict]) -> tuple[set[Key], set[Key], set[Key]]:
    """(added, removed, changed) object keys from `base` to `other`."""
    added, removed = set(other) - set(base), set(base) - set(other)
    changed = {k for k in set(base) & set(other) if base[k] != other[k]}
    return added, removed, changed


def pod_specs(objs: dict[Key, dict]) -> dict[Key, dict]:
    return {k: o["spec"]["template"]["spec"] for k, o in objs.items() if k[0] in ("Deployment", "DaemonSet")}


# ---------------------------------------------------------------- lint and schemas


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_is_clean(name):
    report = helm.lint(str(CHART), VALUE_SETS[name], strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == [] and report["errors"] == []


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_object_is_valid_kubernetes(objects, version):
    # Each distinct object of every values set, validated once per Kubernetes version.
    unique = {json.dumps(o, sort_keys=True): o for objs in objects.values() for o in objs.values()
              if o["apiVersion"] != MONITORING_GROUP  # prometheus-operator CRDs: see test_monitors_*
              and not o["apiVersion"].startswith("kueue.x-k8s.io/")}  # Kueue's: the real Kueue's CRDs take it
                                                                       # in tests/test_kueue_energy_budget.py
    assert len(unique) > 20
    for obj in unique.values():
        kubernetes_validate.validate(obj, version, strict=True)


def test_schema_validation_catches_a_bad_object():
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
                  "spec": {"selector": {}, "template": {"spec": {"containers": [{"name": "c", "imagee": "x"}]}}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[0], strict=True)


def test_default_render_has_the_expected_objects(objects):
    kinds = sorted(k for k, _, _ in objects["default"])
    assert kinds.count("CustomResourceDefinition") == 2  # KareusJob, KareusEnergyLedger
    assert "AdmissionCheck" not in kinds  # Kueue's CRDs may not exist
    assert kinds.count("Deployment") == 1 and kinds.count("DaemonSet") == 1
    assert kinds.count("Namespace") == 1  # the node agent's own namespace
    assert kinds.count("ConfigMap") == 2 + 3  # policy, node agent config, three dashboards
    assert kinds.count("Service") == 2
    assert "ServiceMonitor" not in kinds and "PodMonitor" not in kinds


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"operater": {"replicas": 1}}, "operater"),
        ({"operator": {"replica": 1}}, "replica"),
        ({"nodeAgent": {"securityMode": "root"}}, "securityMode"),
        ({"nodeAgent": {"dryrun": True}}, "dryrun"),
        ({"metrics": {"serviceMonitor": {"enable": True}}}, "enable"),
        ({"grafana": {"dashboard": {"enabled": True}}}, "dashboard"),
        ({"crds": {"instal": False}}, "instal"),
        ({"policy": {"allowedObjective": ["maxThroughput"]}}, "allowedObjective"),
        ({"policy": {"allowedObjectives": ["fastest"]}}, "allowedObjectives"),
        ({"policy": {"clockBounds": {"default": {"floorMhz": 900}}}}, "floorMhz"),
        ({"policy": {"namespaceEnergyBudgets": {"Team_A": 10}}}, "Team_A"),
        ({"policy": {"namespaceEnergyBudgets": {"team-a": {"kwh": 10, "period": "year"}}}}, "period"),
        ({"kueue": {"energyBudgetCheck": {"clusterQueue": ["gpus"]}}}, "clusterQueue"),
        ({"policy": {"maxSlowdownPercent": "5%"}}, "maxSlowdownPercent"),
        ({"operator": {"args": {"watchNamespaces": ["Not A Namespace"]}}}, "watchNamespaces"),
        ({"operator": {"workerImage": {"pullPolicy": "Sometimes"}}}, "pullPolicy"),
        ({"nodeAgent": {"readOnlyRootFilesystem": "yes"}}, "readOnlyRootFilesystem"),
        ({"nodeAgent": {"runtimeClassName": "NVIDIA runtime"}}, "runtimeClassName"),
        ({"nodeAgent": {"gpuNodeLabels": ["nvidia.com/gpu.present: true"]}}, "gpuNodeLabels"),
        ({"nodeAgent": {"extraGpuNodeLabels": ["=true"]}}, "extraGpuNodeLabels"),
        ({"nodeAgent": {"gpuNodeLabel": []}}, "gpuNodeLabel"),
        ({"workers": {"imagePullSecrets": ["Reg_Cred"]}}, "imagePullSecrets"),
        ({"workers": {"imagePullSecrets": [{"secret": "regcred"}]}}, "imagePullSecrets"),
        ({"workers": {"rendezvousTimeoutSeconds": 0}}, "rendezvousTimeoutSeconds"),
        ({"workers": {"rendezvousTimeoutSeconds": "10m"}}, "rendezvousTimeoutSeconds"),
        ({"workers": {"nodeTokenExpirationSeconds": 300}}, "nodeTokenExpirationSeconds"),
    ],
)
def test_values_typo_fails_via_the_schema(chart, values, field):
    with pytest.raises(helm.HelmValuesError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert field in str(info.value)


# ---------------------------------------------------------------- the CRD


CRDS = {"kareusjob": "kareusjobs.kareus.dev", "kareusenergyledger": "kareusenergyledgers.kareus.dev"}


@pytest.mark.parametrize("name", sorted(CRDS))
def test_chart_crd_is_a_link_to_the_repository_crd(name):
    # Helm cannot read outside the chart; a relative link keeps one source of truth (Helm follows it).
    link = CHART / "files" / f"{name}.crd.yaml"
    assert link.is_symlink() and not Path(link.readlink()).is_absolute()
    assert link.resolve() == (ROOT / "crds" / f"{name}.yaml").resolve()


def test_packaged_chart_carries_the_crd_content_and_no_build_helpers(tmp_path, objects):
    import tarfile

    archive = Path(helm.package(str(CHART), destination=str(tmp_path)))
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
        crd_member = members["kareus/files/kareusjob.crd.yaml"]
        assert crd_member.isfile()  # the link is stored as the file it points to
        assert tar.extractfile(crd_member).read() == (ROOT / "crds" / "kareusjob.yaml").read_bytes()
    assert "kareus/values.schema.json" in members and "kareus/dashboards/job.json" in members
    assert not [n for n in members if n.endswith((".py", ".yamllint"))]
    with helm.Chart.load(str(archive)) as packaged:
        assert objects_of(packaged.render({}, name=RELEASE, namespace=NAMESPACE)) == objects["default"]


@pytest.mark.parametrize("name", sorted(CRDS))
def test_rendered_crd_is_the_repository_crd_plus_labels_and_keep(objects, name):
    source = next(d for d in yaml.safe_load_all((ROOT / "crds" / f"{name}.yaml").read_text()) if d)
    crd = objects["default"][("CustomResourceDefinition", "", CRDS[name])]
    assert crd["spec"] == source["spec"]
    assert crd["metadata"]["name"] == source["metadata"]["name"]
    assert source["metadata"].get("labels", {}).items() <= crd["metadata"]["labels"].items()
    assert crd["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert "helm.sh/resource-policy" not in objects["crdsNotKept"][("CustomResourceDefinition", "", CRDS[name])][
        "metadata"].get("annotations", {})


def test_examples_are_accepted_and_bad_jobs_refused_by_the_shipped_crd(objects, kubectl, control_plane,
                                                                       kube_client, tmp_path):
    """The CRD as the chart renders it, applied to the session's real API server (tests/conftest.py)."""
    shipped = tmp_path / "kareusjob.crd.yaml"
    shipped.write_text(yaml.safe_dump(objects["default"][("CustomResourceDefinition", "", CRDS["kareusjob"])]))
    served = apply_crd(kubectl, control_plane, shipped)
    assert served["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE  # the chart's, not the file's
    jobs = [d for path in sorted((ROOT / "examples").glob("*.yaml")) for d in yaml.safe_load_all(path.read_text())
            if d and d.get("kind") == "KareusJob"]
    assert jobs
    for job in jobs:
        job["metadata"].pop("namespace", None)  # a dry run needs a namespace that exists, not the team's
        verdict = dry_run_create(kube_client, job)
        assert verdict.accepted, (job["metadata"]["name"], verdict)
    broken = json.loads(json.dumps(jobs[0]))
    broken["spec"]["parallelism"]["tensor"] = 0
    broken["spec"]["objective"] = {"maxThroughput": {}, "timeBudget": {"maxSlowdownPercent": 5}}
    verdict = dry_run_create(kube_client, broken)
    assert verdict.status == 422 and {"spec.parallelism.tensor", "spec.objective"} <= set(verdict.fields), verdict


# ---------------------------------------------------------------- security


_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}


def pss_restricted_violations(pod: dict) -> list[str]:
    """The Pod Security Standards `restricted` profile (Kubernetes 1.29), checked on a pod spec."""
    problems = [f"spec.{host}" for host in ("hostPID", "hostIPC", "hostNetwork") if pod.get(host)]
    pod_ctx = pod.get("securityContext", {})
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= _RESTRICTED_VOLUMES:
            problems.append(f"volume {volume['name']}: {', '.join(sorted(kinds))}")
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        ctx = c.get("securityContext", {})
        where = f"container {c['name']}"
        if ctx.get("privileged"):
            problems.append(f"{where}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation not false")
        if not ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")):
            problems.append(f"{where}: runAsNonRoot not true")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            problems.append(f"{where}: runAsUser 0")
        seccomp = ctx.get("seccompProfile", pod_ctx.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{where}: seccompProfile {seccomp}")
        caps = ctx.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            problems.append(f"{where}: capabilities not dropped")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{where}: adds {caps['add']}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            problems.append(f"{where}: hostPort")
    return problems


def test_pss_checker_flags_what_it_should():
    assert pss_restricted_violations({"containers": [{"name": "c"}]}) == [
        "container c: allowPrivilegeEscalation not false", "container c: runAsNonRoot not true",
        "container c: seccompProfile None", "container c: capabilities not dropped"]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_operator_is_restricted_and_only_the_node_agent_is_privileged(objects, name):
    for (kind, namespace, _), pod in pod_specs(objects[name]).items():
        problems = pss_restricted_violations(pod)
        if kind == "Deployment":
            assert problems == [], problems
            container = pod["containers"][0]
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            assert pod["securityContext"]["runAsUser"] != 0
        else:
            assert kind == "DaemonSet" and namespace == VALUE_SETS[name].get("nodeAgent", {}).get(
                "namespace", {}).get("name", "kareus-node")
            assert "spec.hostPID" in problems
            assert any("hostPath" in p for p in problems)


def test_node_agent_namespace_is_labelled_privileged_and_nothing_else_is(objects):
    namespaces = [o for (k, _, _), o in objects["policy"].items() if k == "Namespace"]
    assert [n["metadata"]["name"] for n in namespaces] == ["kareus-node"]
    assert namespaces[0]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert not any(k == "Namespace" for k, _, _ in objects["agentNamespaceExternal"])


def test_security_modes(objects):
    privileged = one(objects["default"], "DaemonSet")["spec"]["template"]["spec"]
    ctx = privileged["containers"][0]["securityContext"]
    assert ctx["privileged"] is True and privileged["hostPID"] is True
    capable = one(objects["capabilities"], "DaemonSet")["spec"]["template"]["spec"]
    ctx = capable["containers"][0]["securityContext"]
    assert ctx["privileged"] is False and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert ctx["readOnlyRootFilesystem"] is True and capable["hostPID"] is True
    assert [p for p in pss_restricted_violations(capable) if "privileged" in p] == []


def test_node_agent_placement_mounts_and_shutdown(objects):
    spec = one(objects["default"], "DaemonSet")["spec"]["template"]["spec"]
    assert "nodeSelector" not in spec  # GPU nodes are chosen by node affinity (below)
    assert spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": key, "operator": "In", "values": ["true"]}]}
                              for key in GPU_NODE_LABELS]}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["terminationGracePeriodSeconds"] >= 30
    host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert host_paths == {"pod-resources": "/var/lib/kubelet/pod-resources", "state": "/var/lib/kareus",
                          "sockets": "/var/run/kareus"}
    mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["pod-resources"]["readOnly"] is True
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"


GPU_NODE_LABELS = ("nvidia.com/gpu.present", "nvidia.com/gpu.deploy.device-plugin",
                   "feature.node.kubernetes.io/pci-10de.present")


def node_matches(pod: dict, labels: dict[str, str]) -> bool:
    """Would the scheduler place `pod` on a node with `labels`? nodeSelector and required node
    affinity (terms ORed, expressions ANDed; the operators the chart renders)."""
    if not selects(pod.get("nodeSelector", {}), labels):
        return False
    required = pod.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return True

    def holds(expression: dict) -> bool:
        key, operator = expression["key"], expression["operator"]
        if operator == "Exists":
            return key in labels
        assert operator == "In", operator
        return labels.get(key) in expression["values"]

    return any(all(holds(e) for e in term["matchExpressions"]) for term in required["nodeSelectorTerms"])


# Labels of GPU nodes under each way of running NVIDIA's stack, and of a CPU node.
GFD_NODE = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}
GPU_OPERATOR_NODE = {"nvidia.com/gpu.deploy.device-plugin": "true", "nvidia.com/gpu.deploy.driver": "true"}
NFD_NODE = {"feature.node.kubernetes.io/pci-10de.present": "true"}
CPU_NODE = {"kubernetes.io/os": "linux", "feature.node.kubernetes.io/pci-8086.present": "true"}


def test_the_node_agent_runs_on_gpu_nodes_however_they_are_labelled(objects):
    pod = one(objects["default"], "DaemonSet")["spec"]["template"]["spec"]
    for labels in (GFD_NODE, GPU_OPERATOR_NODE, NFD_NODE, {"nvidia.com/gpu.present": "true"}):
        assert node_matches(pod, labels), labels
    assert not node_matches(pod, CPU_NODE)
    assert not node_matches(pod, {"nvidia.com/gpu.present": "false"})
    # The plain device plugin labels nothing: a label of the user's own (any value, or key=value) does,
    # ORed with the defaults; a nodeSelector still narrows (ANDed).
    own = one(objects["gpuNodeLabels"], "DaemonSet")["spec"]["template"]["spec"]
    terms = own["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[-2:] == [{"matchExpressions": [{"key": "accelerator", "operator": "In", "values": ["nvidia"]}]},
                          {"matchExpressions": [{"key": "example.com/gpu-node", "operator": "Exists"}]}]
    assert own["nodeSelector"] == {"pool": "train"}
    assert node_matches(own, {"accelerator": "nvidia", "pool": "train"})
    assert node_matches(own, {"example.com/gpu-node": "", "pool": "train"})
    assert node_matches(own, {**GFD_NODE, "pool": "train"})
    assert not node_matches(own, GFD_NODE)  # not in the pool
    assert not node_matches(own, {"accelerator": "amd", "pool": "train"})


@pytest.mark.parametrize(
    ("affinity", "expected"),
    [
        # A required node affinity of the user's own replaces the GPU node terms.
        ({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "mine", "operator": "Exists"}]}]}}}, None),
        # Anything else is kept beside them.
        ({"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "preference": {"matchExpressions": [{"key": "fast", "operator": "Exists"}]}}]},
          "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
              {"labelSelector": {"matchLabels": {"app": "x"}}, "topologyKey": "kubernetes.io/hostname"}]}}, "gpu"),
    ],
)
def test_the_node_agent_affinity_merges_with_the_users(chart, affinity, expected):
    objs = objects_of(chart.render({"nodeAgent": {"affinity": affinity}}, name=RELEASE, namespace=NAMESPACE))
    rendered = one(objs, "DaemonSet")["spec"]["template"]["spec"]["affinity"]
    if expected is None:
        assert rendered == affinity
    else:
        required = rendered["nodeAffinity"].pop("requiredDuringSchedulingIgnoredDuringExecution")
        assert [t["matchExpressions"][0]["key"] for t in required["nodeSelectorTerms"]] == list(GPU_NODE_LABELS)
        assert rendered == affinity
    kubernetes_validate.validate(one(objs, "DaemonSet"), KUBE_VERSIONS[0], strict=True)


def test_without_gpu_node_labels_the_agent_runs_wherever_its_node_selector_says(chart):
    objs = objects_of(chart.render({"nodeAgent": {"gpuNodeLabels": [], "nodeSelector": {"gpu": "yes"}}},
                                   name=RELEASE, namespace=NAMESPACE))
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    assert "affinity" not in pod and pod["nodeSelector"] == {"gpu": "yes"}


def test_runtime_class_and_read_only_root_of_the_node_agent(objects):
    default = one(objects["default"], "DaemonSet")["spec"]["template"]["spec"]
    assert "runtimeClassName" not in default  # the node's default runtime
    assert one(objects["runtimeClass"], "DaemonSet")["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    # The agent writes only to its mounts (journal, socket, /tmp), so its root is read-only in both
    # security modes unless asked otherwise.
    assert default["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    writable = one(objects["agentWritableRoot"], "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert writable["securityContext"] == {"privileged": True, "runAsUser": 0, "readOnlyRootFilesystem": False}
    writable = one(objects_of_values({"nodeAgent": {"readOnlyRootFilesystem": False, "securityMode": "capabilities"}}),
                   "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert writable["readOnlyRootFilesystem"] is False and writable["capabilities"]["add"] == ["SYS_ADMIN"]
    mounts = {m["mountPath"] for m in default["containers"][0]["volumeMounts"] if not m.get("readOnly")}
    assert mounts == {"/var/lib/kareus", "/var/run/kareus", "/tmp"}


def objects_of_values(values: dict) -> dict[Key, dict]:
    with helm.Chart.load(str(CHART)) as loaded:
        return objects_of(loaded.render(values, name=RELEASE, namespace=NAMESPACE))


# ---------------------------------------------------------------- RBAC


def rules_of(objs: dict[Key, dict], kind: str) -> list[tuple[str, dict]]:
    return [(name, rule) for (k, _, name), o in objs.items() if k == kind for rule in o["rules"]]


@pytest.mark.parametrize("name", ["default", "namespaced", "policy"])
def test_rbac_is_least_privilege(objects, name):
    objs = objects[name]
    rules = rules_of(objs, "ClusterRole") + rules_of(objs, "Role")
    assert rules
    for _, rule in rules:
        if "nonResourceURLs" in rule:  # a URL rule names URLs, no resources; never a wildcard either
            assert "resources" not in rule and not any("*" in url for url in rule["nonResourceURLs"])
            assert rule["verbs"] == ["get"]
            continue
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule.get("apiGroups", [])
        assert "secrets" not in rule["resources"]
        assert not {"roles", "rolebindings", "clusterroles", "clusterrolebindings"} & set(rule["resources"])
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
    agent = [r for n, r in rules_of(objs, "ClusterRole") if n.endswith("node-agent")]
    # its node's pods (pod UID → name, labels), TokenReviews of its TCP callers' tokens, and the keys
    # those tokens are signed with (checked before any TokenReview)
    assert agent == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
                     {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
                     {"nonResourceURLs": ["/openid/v1/jwks"], "verbs": ["get"]}]
    for n, rule in rules_of(objs, "ClusterRole"):
        if "kareusjobs" in rule.get("resources", []):
            # never create jobs; delete only for ttlSecondsAfterFinished
            assert rule["verbs"] == ["get", "list", "watch", "patch", "update", "delete"]
        if n.endswith("-discovery"):
            assert set(rule["verbs"]) <= {"get", "list", "watch"}


def test_watched_namespaces_get_roles_instead_of_cluster_wide_rights(objects):
    added, removed, _ = diff(objects["default"], objects["namespaced"])
    assert ("ClusterRole", "", "kareus-operator") in removed
    assert ("ClusterRoleBinding", "", "kareus-operator") in removed
    for namespace in ("team-a", "team-b"):
        assert ("Role", namespace, "kareus-operator") in added
        assert ("RoleBinding", namespace, "kareus-operator") in added
        assert ("ServiceAccount", namespace, "kareus-worker") in added
    assert removed >= DEFAULT_WORKERS  # workers only where the operator acts
    policy_role = objects["namespaced"][("Role", NAMESPACE, "kareus-operator-policy")]
    assert policy_role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"],
                                     "resourceNames": ["kareus-policy"], "verbs": ["get", "watch"]}]


def test_the_energy_budget_check_ships_with_the_rights_it_needs_and_no_more(objects):
    check = objects["kueueCheck"][("AdmissionCheck", "", "kareus-energy-budget")]
    assert check["apiVersion"] == "kueue.x-k8s.io/v1beta2" and check["spec"] == {"controllerName": "kareus.dev/energy-budget"}
    env = {e["name"]: e.get("value") for e in one(objects["kueueCheck"], "Deployment")["spec"]["template"]["spec"][
        "containers"][0]["env"]}
    assert env["KAREUS_OPERATOR_ENERGY_ADMISSION_CHECK"] == "kareus-energy-budget"
    assert env["KAREUS_OPERATOR_ENERGY_ADMISSION_CLUSTERQUEUES"] == "gpus,batch"
    budgets = objects["kueueCheck"][("ClusterRole", "", "kareus-operator-budgets")]["rules"]
    assert {"apiGroups": ["kueue.x-k8s.io"], "resources": ["clusterqueues"], "resourceNames": ["gpus", "batch"],
            "verbs": ["patch"]} in budgets
    # Without attached queues (the default) the operator may read ClusterQueues but patch none.
    default = objects["default"][("ClusterRole", "", "kareus-operator-budgets")]["rules"]
    assert not any("clusterqueues" in r["resources"] and "patch" in r["verbs"] for r in default)
    assert {"apiGroups": ["kareus.dev"], "resources": ["kareusenergyledgers/status"], "verbs": ["get", "patch"]} in default
    # The ledgers have no delete and no update: the operator only adds to them.
    assert all(not {"delete", "update"} & set(r["verbs"]) for r in default)


def test_periodic_budgets_reach_the_policy_the_operator_reads(objects):
    text = objects["policyPeriodic"][("ConfigMap", NAMESPACE, "kareus-policy")]["data"]["policy.yaml"]
    policy = load_policy(text)
    assert policy.energy_budget_kwh("team-b") == 300 and policy.energy_period("team-b") == "month"
    assert policy.energy_period("team-a") == "lifetime"


# ---------------------------------------------------------------- toggles change exactly what they should


def keys(*items: tuple[str, str, str]) -> set[Key]:
    return set(items)


AGENT_NS = "kareus-node"
# A cluster-wide install creates the workers' identity in `default`, where the quickstart's job lands.
DEFAULT_WORKERS = {(kind, "default", "kareus-worker") for kind in ("ServiceAccount", "Role", "RoleBinding")}
DASHBOARDS = {("ConfigMap", NAMESPACE, f"kareus-dashboard-{n}") for n in ("cluster-energy", "job", "operator")}
WORKERS = {(kind, ns, "kareus-worker") for ns in ("team-a", "team-b")
           for kind in ("ServiceAccount", "Role", "RoleBinding")}


@pytest.mark.parametrize(
    ("name", "added", "removed", "changed"),
    [
        ("capabilities", set(), set(), keys(("DaemonSet", AGENT_NS, "kareus-node-agent"))),
        ("serviceMonitor", keys(("ServiceMonitor", NAMESPACE, "kareus-operator"),
                                ("ServiceMonitor", AGENT_NS, "kareus-node-agent")), set(), set()),
        ("podMonitor", keys(("PodMonitor", NAMESPACE, "kareus-training")), set(), set()),
        ("noDashboards", set(), DASHBOARDS, set()),
        ("dashboardsElsewhere", {(k, "monitoring", n) for k, _, n in DASHBOARDS}, DASHBOARDS, set()),
        ("noCrds", set(), {("CustomResourceDefinition", "", n) for n in CRDS.values()}, set()),
        ("crdsNotKept", set(), set(), {("CustomResourceDefinition", "", n) for n in CRDS.values()}),
        # the check object, the operator's settings naming it, and the right to patch only those queues
        ("kueueCheck", keys(("AdmissionCheck", "", "kareus-energy-budget")), set(),
         keys(("Deployment", NAMESPACE, "kareus-operator"), ("ClusterRole", "", "kareus-operator-budgets"))),
        # the policy and the alert rules read the budgets (no PrometheusRule by default: only the policy)
        ("policyPeriodic", set(), set(), keys(("ConfigMap", NAMESPACE, "kareus-policy"))),
        ("policySlowdownOnly", set(), set(), keys(("ConfigMap", NAMESPACE, "kareus-policy"))),
        # Clock bounds and allowed namespaces are also enforced by the node agent, which reads them at start.
        ("policyClockBounds", set(), set(), keys(("ConfigMap", NAMESPACE, "kareus-policy"),
                                                 ("ConfigMap", AGENT_NS, "kareus-node-agent"),
                                                 ("DaemonSet", AGENT_NS, "kareus-node-agent"))),
        ("policy", WORKERS, DEFAULT_WORKERS, keys(("ConfigMap", NAMESPACE, "kareus-policy"),
                                        ("ConfigMap", AGENT_NS, "kareus-node-agent"),
                                        ("DaemonSet", AGENT_NS, "kareus-node-agent"))),
        ("dryRun", set(), set(), keys(("ConfigMap", AGENT_NS, "kareus-node-agent"),
                                      ("DaemonSet", AGENT_NS, "kareus-node-agent"))),
        ("workers", {(k, "ml", "kareus-worker") for k in ("ServiceAccount", "Role", "RoleBinding")}, DEFAULT_WORKERS,
         set()),
        ("runtimeClass", set(), set(), keys(("DaemonSet", AGENT_NS, "kareus-node-agent"))),
        ("agentWritableRoot", set(), set(), keys(("DaemonSet", AGENT_NS, "kareus-node-agent"))),
        ("gpuNodeLabels", set(), set(), keys(("DaemonSet", AGENT_NS, "kareus-node-agent"))),
        # the operator sets them on the pods it creates; the chart's worker service account carries them too
        ("pullSecrets", set(), set(), keys(("Deployment", NAMESPACE, "kareus-operator"),
                                           ("ServiceAccount", "default", "kareus-worker"))),
        ("rendezvous", set(), set(), keys(("Deployment", NAMESPACE, "kareus-operator"))),
        ("nodeToken", set(), set(), keys(("Deployment", NAMESPACE, "kareus-operator"))),
        ("noWorkerServiceAccount", set(), keys(("ServiceAccount", "default", "kareus-worker")), set()),
    ],
)
def test_toggle_changes_exactly_the_expected_objects(objects, name, added, removed, changed):
    assert diff(objects["default"], objects[name]) == (added, removed, changed)


def test_disabling_the_node_agent_removes_all_of_it(objects):
    added, removed, changed = diff(objects["default"], objects["noNodeAgent"])
    assert added == set() and changed == set()
    assert removed == {("Namespace", "", AGENT_NS), ("ServiceAccount", AGENT_NS, "kareus-node-agent"),
                       ("ClusterRole", "", "kareus-node-agent"), ("ClusterRoleBinding", "", "kareus-node-agent"),
                       ("Role", AGENT_NS, "kareus-node-agent-clock-ceilings"),
                       ("RoleBinding", AGENT_NS, "kareus-node-agent-clock-ceilings"),
                       ("ConfigMap", AGENT_NS, "kareus-node-agent"), ("Service", AGENT_NS, "kareus-node-agent-metrics"),
                       ("DaemonSet", AGENT_NS, "kareus-node-agent")}


def test_own_service_accounts_are_bound_instead_of_created(objects):
    added, removed, changed = diff(objects["default"], objects["ownServiceAccounts"])
    assert added == set()
    assert removed == {("ServiceAccount", NAMESPACE, "kareus-operator"), ("ServiceAccount", AGENT_NS, "kareus-node-agent")}
    assert {k for k, _, _ in changed} == {"Deployment", "DaemonSet", "ClusterRoleBinding", "RoleBinding"}
    objs = objects["ownServiceAccounts"]
    assert one(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    assert one(objs, "DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"] == "agent"
    bindings = [o for (k, _, _), o in objs.items() if k.endswith("RoleBinding")]
    subjects = {s["name"] for o in bindings if o["metadata"]["labels"]["app.kubernetes.io/component"] != "worker"
                for s in o["subjects"]}
    assert subjects == {"ops", "agent"}
    assert {s["name"] for o in bindings if o["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
            for s in o["subjects"]} == {"kareus-worker"}


def test_rbac_create_false_removes_only_rbac(objects):
    added, removed, changed = diff(objects["default"], objects["noRbac"])
    assert added == set() and changed == set()
    assert {k for k, _, _ in removed} == {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


# ---------------------------------------------------------------- what the components read


def policy_document(objs: dict[Key, dict]) -> str:
    return objs[("ConfigMap", NAMESPACE, "kareus-policy")]["data"]["policy.yaml"]


def test_policy_configmap_parses_with_the_operator_loader(objects):
    assert load_policy(policy_document(objects["default"])) == load_policy(None)
    policy = load_policy(policy_document(objects["policy"]))
    assert policy == load_policy(POLICY)
    assert policy.default_objective == "timeBudget" and policy.max_slowdown_percent == 10
    assert policy.clock_bounds_for("A100-SXM4-40GB") == ClockBounds(600, 1350)
    assert policy.energy_budget_kwh("team-a") == 5000 and not policy.profile_reuse
    assert policy.allowed_namespaces == {"team-a", "team-b"}


BAD_POLICIES = [
    {"allowedObjectives": ["timeBudget"], "defaultObjective": "maxThroughput"},
    {"allowedObjectives": []},
    {"defaultObjective": "cheapest"},
    {"maxSlowdownPercent": 0},
    {"clockBounds": {"default": {"floorMHz": 1500, "ceilingMHz": 1400}}},
    {"clockBounds": {"default": {"floorMHz": 1500}, "gpuModels": {"A100": {"ceilingMHz": 1400}}}},
    {"clockBounds": {"gpuModels": {"A100": {"floorMHz": 1200.5}}}},
    {"namespaceEnergyBudgets": {"team-a": -1}},
    {"allowedNamespaces": ["-bad"]},
    {"profileReuse": "yes"},
]


@pytest.mark.parametrize("policy", BAD_POLICIES, ids=lambda p: json.dumps(p, sort_keys=True))
def test_chart_refuses_every_policy_the_loader_refuses(chart, policy):
    with pytest.raises(PolicyError):
        load_policy(policy)
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as info:
        chart.render({"policy": policy}, name=RELEASE, namespace=NAMESPACE)
    assert "policy" in str(info.value) or next(iter(policy)) in str(info.value)


def test_operator_settings_and_flags_are_what_the_operator_reads(objects, monkeypatch):
    settings_module = pytest.importorskip("kareus_operator.settings")
    main = pytest.importorskip("kareus_operator.main")
    for name in ("default", "namespaced"):
        deployment = one(objects[name], "Deployment")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("KAREUS_OPERATOR_")}
        settings = settings_module.Settings.from_env(env)
        assert settings.policy_configmap == "kareus-policy" and settings.policy_namespace == NAMESPACE
        assert settings.node_daemon_port == 9477
        assert settings.image == "localhost/kareus/runtime:0.1.0" == settings_module.Settings().image
        assert settings.image_pull_policy == "IfNotPresent" and settings.image_pull_secrets == ()
        assert settings.rendezvous_timeout_s == 600.0 == settings_module.Settings().rendezvous_timeout_s
        assert settings.service_account == "kareus-worker"
        args = main._build_parser().parse_args(container["args"])
        assert container["command"] == ["kareus-operator"] and args.command == "run"
        watched = VALUE_SETS[name].get("operator", {}).get("args", {}).get("watchNamespaces", [])
        assert args.namespace == watched and list(settings.watch_namespaces) == watched
        assert args.metrics_port == container["ports"][0]["containerPort"] and args.metrics_address == "$(POD_IP)"  # the pod address, from the downward API
    settings = {e["name"]: e["value"] for e in one(objects["default"], "Deployment")["spec"]["template"]["spec"][
        "containers"][0]["env"] if "value" in e}
    assert set(settings) - {"POD_NAME", "POD_NAMESPACE", "POD_IP"} <= {
        f"KAREUS_OPERATOR_{f.upper()}" for f in settings_module.Settings.__dataclass_fields__}


def operator_settings(objs: dict[Key, dict]):
    """The operator's Settings exactly as its container's environment gives them."""
    settings_module = pytest.importorskip("kareus_operator.settings")
    container = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return settings_module.Settings.from_env({e["name"]: e["value"] for e in container["env"]
                                              if e["name"].startswith("KAREUS_OPERATOR_")})


def quickstart_job(namespace: str | None = None) -> dict:
    job = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    job["metadata"].update(namespace=namespace or job["metadata"].get("namespace", "default"), uid="u-1")
    return job


def test_images_are_the_ones_make_images_tags(objects):
    """`make images` tags localhost/kareus/<image>:<version>; the chart, the operator's default and
    every example use exactly those names, so a default install runs what the build made."""
    from kareus import __version__

    settings_module = pytest.importorskip("kareus_operator.settings")
    objs = objects["default"]
    operator = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    agent = one(objs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert operator["image"] == f"localhost/kareus/operator:{__version__}"
    assert agent["image"] == f"localhost/kareus/node-agent:{__version__}"
    assert operator["imagePullPolicy"] == agent["imagePullPolicy"] == "IfNotPresent"
    runtime = f"localhost/kareus/runtime:{__version__}"
    assert operator_settings(objs).image == runtime == settings_module.Settings().image
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    examples = [d for path in sorted((ROOT / "examples").glob("*.yaml")) for d in yaml.safe_load_all(path.read_text())
                if d and d.get("kind") == "KareusJob"]
    assert examples and {job["spec"]["training"]["image"] for job in examples} == {runtime}


def test_a_default_install_has_a_worker_identity_where_the_quickstart_runs(objects):
    manifests = pytest.importorskip("kareus_operator.manifests")
    objs = objects["default"]
    settings = operator_settings(objs)
    job = quickstart_job()
    namespace = job["metadata"]["namespace"]
    assert namespace == "default"  # the quickstart names none
    for kind in ("ServiceAccount", "Role", "RoleBinding"):
        assert (kind, namespace, settings.service_account) in objs
    spec = parse_job(job).spec
    for child in (manifests.profile_job(job, spec, settings, "k"), manifests.optimize_job(job, spec, settings, "k"),
                  manifests.train_job(job, spec, settings)):
        assert child["metadata"]["namespace"] == namespace
        assert child["spec"]["template"]["spec"]["serviceAccountName"] == settings.service_account
    binding = objs[("RoleBinding", namespace, settings.service_account)]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": settings.service_account, "namespace": namespace}]
    # Watching namespaces (or allowing only some) moves the identity there, and only there.
    namespaced = {k for k in objects["namespaced"] if k[0] == "ServiceAccount" and k[2] == "kareus-worker"}
    assert namespaced == {("ServiceAccount", ns, "kareus-worker") for ns in ("team-a", "team-b")}
    # Without the chart's service account the Role and its binding stay, for one you create yourself.
    mine = objects["noWorkerServiceAccount"]
    assert ("ServiceAccount", namespace, "kareus-worker") not in mine and ("RoleBinding", namespace, "kareus-worker") in mine


def test_worker_image_pull_secrets_reach_every_pod_and_the_service_account(objects):
    manifests = pytest.importorskip("kareus_operator.manifests")
    objs = objects["pullSecrets"]
    settings = operator_settings(objs)
    assert settings.image_pull_secrets == ("regcred", "mirror")  # names, or {name: ...} entries
    assert objs[("ServiceAccount", "default", "kareus-worker")]["imagePullSecrets"] == [
        {"name": "regcred"}, {"name": "mirror"}]
    job = quickstart_job("team-a")
    spec = parse_job(job).spec
    for child in (manifests.profile_job(job, spec, settings, "k"), manifests.optimize_job(job, spec, settings, "k"),
                  manifests.train_job(job, spec, settings)):
        assert child["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    default = operator_settings(objects["default"])
    assert "imagePullSecrets" not in manifests.train_job(job, spec, default)["spec"]["template"]["spec"]
    assert "imagePullSecrets" not in objects["default"][("ServiceAccount", "default", "kareus-worker")]


def test_the_rendezvous_timeout_reaches_the_training_pods(objects):
    manifests = pytest.importorskip("kareus_operator.manifests")
    job = quickstart_job()
    spec = parse_job(job).spec
    for name, seconds in (("default", "600"), ("rendezvous", "1800")):
        settings = operator_settings(objects[name])
        assert settings.rendezvous_timeout_s == float(seconds)
        pod = manifests.train_job(job, spec, settings)["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["KAREUS_RENDEZVOUS_TIMEOUT_S"] == seconds  # `kareus train`'s own rendezvous
        assert env["PET_RDZV_CONF"] == f"timeout={seconds},join_timeout={seconds}"  # torchrun's


def test_the_node_token_lifetime_reaches_the_gpu_pods_projected_token(objects):
    manifests = pytest.importorskip("kareus_operator.manifests")
    job = quickstart_job()
    spec = parse_job(job).spec
    for name, seconds in (("default", 3600), ("nodeToken", 900)):
        settings = operator_settings(objects[name])
        assert settings.node_token_expiration_s == seconds
        for pod_job in (manifests.train_job(job, spec, settings), manifests.profile_job(job, spec, settings, "key")):
            volumes = {v["name"]: v for v in pod_job["spec"]["template"]["spec"]["volumes"]}
            [source] = volumes["node-token"]["projected"]["sources"]
            assert source["serviceAccountToken"] == {"audience": "kareus-node", "expirationSeconds": seconds,
                                                     "path": "token"}


def test_node_agent_flags_and_config_are_what_the_daemon_reads(objects, tmp_path):
    node_main = pytest.importorskip("kareus_node.main")
    node_config = pytest.importorskip("kareus_node.config")
    for name in ("default", "policy", "dryRun"):
        config_text = objects[name][("ConfigMap", AGENT_NS, "kareus-node-agent")]["data"]["config.yaml"]
        path = tmp_path / f"{name}.yaml"
        path.write_text(config_text)
        config = node_config.load_config(path)
        assert config.dry_run is (name == "dryRun")
        assert config.policy.clock_bounds_for("A100-SXM4-40GB") == load_policy(
            policy_document(objects[name])).clock_bounds_for("A100-SXM4-40GB")
        assert config.policy.allowed_namespaces == load_policy(policy_document(objects[name])).allowed_namespaces
    container = one(objects["default"], "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    args = node_main.build_parser().parse_args(container["args"])
    assert container["command"] == ["kareus-node"]
    assert args.backend == "nvml" and args.config == "/etc/kareus-node/config.yaml"
    assert args.socket == "/var/run/kareus/node.sock"
    assert args.state_dir == "/var/lib/kareus"
    assert args.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert args.metrics_port == container["ports"][0]["containerPort"]
    assert args.node_name == "$(NODE_NAME)"  # the kubelet expands it from the NODE_NAME env var


def test_agent_probes_are_on_localhost_and_metrics_may_need_a_token(objects):
    node_main = pytest.importorskip("kareus_node.main")
    container = one(objects["default"], "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    args = node_main.build_parser().parse_args(container["args"])
    assert args.health_port == 9403 and args.metrics_auth == "none"
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert container[probe]["httpGet"] == {"host": "127.0.0.1", "path": path, "port": 9403}
    assert not [n for (k, _, n) in objects["default"] if k == "ClusterRole" and n.endswith("metrics-reader")]
    guarded = objects["metricsAuth"]
    container = one(guarded, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert node_main.build_parser().parse_args(container["args"]).metrics_auth == "tokenreview"
    agent = [r for n, r in rules_of(guarded, "ClusterRole") if n.endswith("node-agent")]
    assert {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]} in agent
    assert [r for n, r in rules_of(guarded, "ClusterRole") if n.endswith("metrics-reader")] == [
        {"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    binding = one(guarded, "ClusterRoleBinding", "metrics-reader")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "prometheus-k8s", "namespace": "monitoring"}]
    monitor = one(guarded, "ServiceMonitor", "node-agent")
    assert monitor["spec"]["endpoints"][0]["bearerTokenFile"] == "/var/run/secrets/kubernetes.io/serviceaccount/token"


def test_daemon_port_agrees_between_agent_and_operator(objects):
    agent = one(objects["default"], "DaemonSet")["spec"]["template"]["spec"]
    operator = one(objects["default"], "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in operator["env"]}
    # The operator points worker pods at $(HOST_IP):port; the agent listens there (host network).
    assert agent["hostNetwork"] is True
    assert f"--listen-tcp=$(HOST_IP):{env['KAREUS_OPERATOR_NODE_DAEMON_PORT']}" in agent["containers"][0]["args"]


# ---------------------------------------------------------------- services, monitors, dashboards, labels


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_services_select_their_pods_and_ports(objects):
    objs = objects["default"]
    workloads = {k: o for k, o in objs.items() if k[0] in ("Deployment", "DaemonSet")}
    for (kind, namespace, name), service in objs.items():
        if kind != "Service":
            continue
        [target] = [w for (_, ns, _), w in workloads.items()
                    if ns == namespace and selects(service["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        ports = {p["name"] for c in target["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports, name
    for workload in workloads.values():
        assert selects(workload["spec"]["selector"]["matchLabels"], workload["spec"]["template"]["metadata"]["labels"])


def test_monitors_select_the_metrics_services(objects):
    objs = objects["serviceMonitor"]
    for (kind, namespace, _), monitor in objs.items():
        if kind != "ServiceMonitor":
            continue
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert monitor["spec"]["namespaceSelector"]["matchNames"] == [namespace]
        [service] = [s for (k, ns, _), s in objs.items() if k == "Service" and ns == namespace
                     and selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        assert [e["port"] for e in monitor["spec"]["endpoints"]] == [p["name"] for p in service["spec"]["ports"]]
    agent = objs[("ServiceMonitor", AGENT_NS, "kareus-node-agent")]
    assert agent["spec"]["endpoints"][0]["honorLabels"] is True  # the agent's namespace/pod labels win
    assert agent["spec"]["endpoints"][0]["relabelings"] == [
        {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}]
    pod_monitor = objects["podMonitor"][("PodMonitor", NAMESPACE, "kareus-training")]
    settings = pytest.importorskip("kareus_operator.settings")
    assert pod_monitor["spec"]["selector"]["matchExpressions"][0]["key"] == settings.LABEL_JOB
    assert pod_monitor["spec"]["selector"]["matchLabels"] == {settings.LABEL_ROLE: "train"}
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}


def test_dashboard_configmaps_carry_the_dashboards(objects):
    objs = objects["default"]
    for name in ("cluster-energy", "job", "operator"):
        cm = objs[("ConfigMap", NAMESPACE, f"kareus-dashboard-{name}")]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        shipped = json.loads((CHART / "dashboards" / f"{name}.json").read_text())
        assert json.loads(cm["data"][f"{name}.json"]) == shipped
    elsewhere = objects["dashboardsElsewhere"][("ConfigMap", "monitoring", "kareus-dashboard-job")]
    assert elsewhere["metadata"]["annotations"] == {"grafana_folder": "Kareus"}


RECOMMENDED = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
               "app.kubernetes.io/component", "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by",
               "helm.sh/chart")


@pytest.mark.parametrize("name", ["default", "policy", "serviceMonitor", "podMonitor"])
def test_every_object_has_the_recommended_labels(objects, name):
    for key, obj in objects[name].items():
        labels = obj["metadata"]["labels"]
        assert all(label in labels for label in RECOMMENDED), key
        assert labels["app.kubernetes.io/instance"] == RELEASE and labels["app.kubernetes.io/managed-by"] == "Helm"


def test_notes_say_what_to_do_next(rendered):
    notes = rendered["default"]["kareus/templates/NOTES.txt"]
    assert "kubectl -n kareus-system rollout status deployment/kareus-operator" in notes
    assert "kareus-policy" in notes and "grafana_dashboard=1" in notes
    no_crds = rendered["noCrds"]["kareus/templates/NOTES.txt"]
    assert "kubectl apply --server-side -f crds/kareusjob.yaml" in no_crds
    assert "apply the KareusJob CRD" not in notes
    assert "release=kube-prometheus-stack" in rendered["serviceMonitor"]["kareus/templates/NOTES.txt"]


# ---------------------------------------------------------------- yamllint


def test_yamllint_chart_values_and_examples():
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    chart_config = YamlLintConfig(file=str(CHART / ".yamllint"))
    default_config = YamlLintConfig("extends: default")  # what `make lint` applies to examples/
    problems = []
    for path in (CHART / "values.yaml", CHART / "Chart.yaml"):
        problems += [f"{path.name}:{p}" for p in linter.run(path.read_text(), chart_config)]
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        problems += [f"{path.name}:{p}" for p in linter.run(path.read_text(), default_config)]
    assert problems == []
    assert list(linter.run("a:  1\nb: [1,2]\n", chart_config))  # the linter does find problems
