"""A real Prometheus for the dev cluster, scraping what the chart's ServiceMonitors and PodMonitors select.

The binary is Debian's `prometheus` package (2.42, with promtool; `make prometheus` installs it):
a distribution package installs in seconds, where building Prometheus from the Go module proxy takes
many minutes on two cores (and would serve no web UI: the module carries no built UI assets), and
the dev cluster needs a scraper, a rule engine and a query engine, not a particular release. The
Prometheus Operator is not run: its job here — turning monitor objects into scrape configuration —
is done by `scrape_configs`, from the monitor objects as the API server holds them.

Debian builds Prometheus without its Kubernetes service discovery (the package leaves client-go
out), so discovery is a small bridge: `PodDiscovery` lists and watches pods through the real API
server — as user `kareus-dev-prometheus`, whose ClusterRole may only get/list/watch pods, services
and namespaces — and writes every pod's container ports as file-SD targets labelled exactly as
`kubernetes_sd_configs` role `pod` labels them (`__meta_kubernetes_pod_label_*`,
`..._container_port_name`, `..._pod_phase`, …; `pod_targets`). Everything after discovery is
Prometheus' own: the relabelling derived from the monitors, scraping, rules, queries.

Why pods rather than the Operator's `role: endpoints`: one discovery (pods) serves both kinds of
monitor, and the pods are what the Services' endpoints hold. A ServiceMonitor is translated to what its
endpoints hold — the pods its Services select, in the Services' namespaces, on the container port the Service
port targets — and a PodMonitor to its own pod selector, namespaces and port. The monitor's path,
interval, timeout, `honorLabels` and relabelings are kept; the target labels are the Operator's
(`namespace`, `pod`, `container`, `endpoint`, `service`; `job` is the Service's name for a
ServiceMonitor and `<namespace>/<name>` for a PodMonitor), so the chart's alerts and dashboards see
the series they would see under the Operator. tests/test_prometheus_sd.py checks that the derived
relabelling selects exactly the targets the monitors' semantics select; the live dashboard test
checks Prometheus' own target list against them on the real pods.

PrometheusRule objects become its rule files, so the chart's alerts are evaluated too.
`DevPrometheus(...).start()` writes the configuration, starts discovery and the process (TSDB under
the cluster's workdir) and waits for `/-/ready`; `refresh()` re-reads the monitors and reloads;
`stop()` ends both; `.url` is its HTTP address (its own web UI: `.url + "/graph"`).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kareus.errors import KareusError
from kareus_devcluster.controlplane import (
    ControlPlane,
    Started,
    last_lines,
    stop_process,
)

MONITORING_GROUP = "monitoring.coreos.com"
PROMETHEUS_USER = "kareus-dev-prometheus"
STARTUP_TIMEOUT_S = 60.0
WATCH_TIMEOUT_S = 5.0  # each pod watch ends after this (the API server closes it), so stop() is prompt
SCRAPE_INTERVAL = "2s"  # what the dev cluster's monitors ask for: a short job still gets many samples
# Chart values that make the dev cluster's release render its monitors and alerts with that interval.
CHART_METRICS_VALUES: dict[str, Any] = {
    "serviceMonitor": {"enabled": True, "interval": SCRAPE_INTERVAL, "scrapeTimeout": SCRAPE_INTERVAL},
    "podMonitor": {"enabled": True, "interval": SCRAPE_INTERVAL},
    "prometheusRule": {"enabled": True},
}
RBAC = [
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": PROMETHEUS_USER},
     "rules": [{"apiGroups": [""], "resources": ["pods", "services", "namespaces"],
                "verbs": ["get", "list", "watch"]}]},
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": PROMETHEUS_USER},
     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": PROMETHEUS_USER},
     "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": PROMETHEUS_USER}]},
]


def prometheus_binary() -> str:
    """`prometheus` from PATH (Debian's package); a KareusError naming the fix otherwise."""
    path = shutil.which("prometheus")
    if path is None:
        raise KareusError("prometheus not found: install Debian's package (`make prometheus`, i.e. "
                          "apt-get install prometheus) or start the dev cluster with --no-prometheus")
    return path


# ---------------------------------------------------------------- the monitoring CRDs


def _crd(kind: str, plural: str) -> dict[str, Any]:
    """A structural CRD that accepts the object as the Prometheus Operator's own CRD would store it.
    Only the API is served here (no Operator runs), so the schema keeps the spec as given; what the
    fields mean is `scrape_configs`' business."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{MONITORING_GROUP}"},
        "spec": {"group": MONITORING_GROUP, "scope": "Namespaced",
                 "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": kind.lower()},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                     "type": "object", "properties": {
                         "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}]},
    }


MONITORING_CRDS = [_crd("ServiceMonitor", "servicemonitors"), _crd("PodMonitor", "podmonitors"),
                   _crd("PrometheusRule", "prometheusrules")]


def install_monitoring(cluster: Any) -> dict[str, Any]:
    """Serve the monitoring API on a `DevCluster` (the CRDs, Established); the chart values under
    `metrics` that make a release render its monitors and alerts for it."""
    cluster.kubectl("apply", "--server-side", "--field-manager=kareus-dev", "-f", "-",
                    input=yaml.safe_dump_all(MONITORING_CRDS))
    for crd in MONITORING_CRDS:
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd['metadata']['name']}")
    return json.loads(json.dumps(CHART_METRICS_VALUES))  # a copy the caller may change


# ---------------------------------------------------------------- monitors → scrape configuration


def label_name(name: str) -> str:
    """A Kubernetes label key as Prometheus' discovery spells it in a meta label."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _alternatives(values: Sequence[str]) -> str:
    return "(" + "|".join(re.escape(v) for v in values) + ")"


def selector_relabelings(selector: Mapping[str, Any]) -> list[dict[str, Any]]:
    """`keep`/`drop` rules that pass exactly the pods a LabelSelector matches."""
    rules: list[dict[str, Any]] = []

    def present_and_value(key: str) -> list[str]:
        return [f"__meta_kubernetes_pod_labelpresent_{label_name(key)}", f"__meta_kubernetes_pod_label_{label_name(key)}"]

    for key, value in sorted((selector.get("matchLabels") or {}).items()):
        rules.append({"action": "keep", "source_labels": present_and_value(key), "regex": f"true;{re.escape(str(value))}"})
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], list(expression.get("values") or [])
        present = [f"__meta_kubernetes_pod_labelpresent_{label_name(key)}"]
        if operator == "In":
            rules.append({"action": "keep", "source_labels": present_and_value(key), "regex": f"true;{_alternatives(values)}"})
        elif operator == "NotIn":
            rules.append({"action": "drop", "source_labels": present_and_value(key), "regex": f"true;{_alternatives(values)}"})
        elif operator == "Exists":
            rules.append({"action": "keep", "source_labels": present, "regex": "true"})
        elif operator == "DoesNotExist":
            rules.append({"action": "drop", "source_labels": present, "regex": "true"})
        else:
            raise KareusError(f"label selector operator {operator!r} is not a Kubernetes one")
    return rules


def _relabeling(rule: Mapping[str, Any]) -> dict[str, Any]:
    """A monitor's RelabelConfig (camelCase) in Prometheus' configuration spelling."""
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label", "separator": "separator",
            "regex": "regex", "replacement": "replacement", "modulus": "modulus", "action": "action"}
    unknown = set(rule) - set(keys)
    if unknown:
        raise KareusError(f"relabeling fields {sorted(unknown)} are not supported by the dev cluster")
    out = {keys[k]: v for k, v in rule.items()}
    if "action" in out:
        out["action"] = str(out["action"]).lower()
    return out


_ENDPOINT_FIELDS = {"port", "targetPort", "path", "interval", "scrapeTimeout", "honorLabels", "relabelings",
                    "scheme", "params"}


def _endpoint_config(job_name: str, endpoint: Mapping[str, Any], discovery: Mapping[str, Any],
                     relabel: list[dict[str, Any]]) -> dict[str, Any]:
    unknown = set(endpoint) - _ENDPOINT_FIELDS
    if unknown:  # TLS, auth, metric relabelings…: the chart uses none; say so rather than scrape wrongly
        raise KareusError(f"{job_name}: endpoint fields {sorted(unknown)} are not supported by the dev cluster")
    config: dict[str, Any] = {"job_name": job_name, **discovery,
                              "metrics_path": endpoint.get("path", "/metrics"),
                              "scheme": endpoint.get("scheme", "http"),
                              "honor_labels": bool(endpoint.get("honorLabels", False)),
                              "relabel_configs": [*relabel, *(_relabeling(r) for r in endpoint.get("relabelings") or [])]}
    for key, name in (("interval", "scrape_interval"), ("scrapeTimeout", "scrape_timeout")):
        if key in endpoint:
            config[name] = endpoint[key]
    if "params" in endpoint:
        config["params"] = endpoint["params"]
    return config


# Prometheus-Operator target labels, and what every target needs: running, not an init container.
_COMMON = [
    {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
    {"action": "drop", "source_labels": ["__meta_kubernetes_pod_container_init"], "regex": "true"},
]
_TARGET_LABELS = [
    {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
    {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
]


def _namespaces(selector: Mapping[str, Any] | None, own: str) -> list[str] | None:
    """The namespaces a monitor's namespaceSelector covers; None for all (`any: true`)."""
    selector = selector or {}
    if selector.get("any"):
        return None
    return list(selector.get("matchNames") or [own])


def _namespace_rule(namespaces: list[str] | None) -> list[dict[str, Any]]:
    """What `kubernetes_sd_configs.namespaces` would restrict, as a relabel rule."""
    if namespaces is None:
        return []
    return [{"action": "keep", "source_labels": ["__meta_kubernetes_namespace"], "regex": _alternatives(sorted(namespaces))}]


def _port_rule(target_port: str | int) -> dict[str, Any]:
    if isinstance(target_port, int) or str(target_port).isdigit():
        return {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_number"],
                "regex": str(target_port)}
    return {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
            "regex": re.escape(str(target_port))}


def scrape_configs(service_monitors: Sequence[Mapping[str, Any]], pod_monitors: Sequence[Mapping[str, Any]],
                   services: Sequence[Mapping[str, Any]], discovery: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Prometheus scrape jobs equivalent to the monitors, over targets labelled as the pod role labels
    them; `discovery` is the jobs' service-discovery entry (e.g. `{"file_sd_configs": [...]}`).
    See the module docstring."""
    jobs: list[dict[str, Any]] = []
    for monitor in sorted(service_monitors, key=lambda o: (o["metadata"]["namespace"], o["metadata"]["name"])):
        meta, spec = monitor["metadata"], monitor.get("spec") or {}
        namespaces = _namespaces(spec.get("namespaceSelector"), meta["namespace"])
        # The Services this monitor selects (a ServiceMonitor's selector is on Services' labels).
        chosen = [s for s in services if (namespaces is None or s["metadata"]["namespace"] in namespaces)
                  and _selects(spec.get("selector") or {}, s["metadata"].get("labels") or {})
                  and (s.get("spec") or {}).get("selector")]
        for index, endpoint in enumerate(spec.get("endpoints") or []):
            for service in sorted(chosen, key=lambda s: (s["metadata"]["namespace"], s["metadata"]["name"])):
                ports = {p.get("name"): p for p in service["spec"].get("ports") or []}
                if "port" in endpoint:
                    if endpoint["port"] not in ports:
                        continue
                    target_port = ports[endpoint["port"]].get("targetPort", ports[endpoint["port"]]["port"])
                    endpoint_name = endpoint["port"]
                else:
                    target_port = endpoint["targetPort"]
                    endpoint_name = str(target_port)
                name = service["metadata"]["name"]
                relabel = [*_COMMON, *_namespace_rule([service["metadata"]["namespace"]]),
                           *selector_relabelings({"matchLabels": service["spec"]["selector"]}),
                           _port_rule(target_port), *_TARGET_LABELS,
                           {"target_label": "service", "replacement": name},
                           {"target_label": "endpoint", "replacement": endpoint_name},
                           {"target_label": "job", "replacement": name}]
                job_name = f"serviceMonitor/{meta['namespace']}/{meta['name']}/{index}/{name}"
                jobs.append(_endpoint_config(job_name, endpoint, discovery, relabel))
    for monitor in sorted(pod_monitors, key=lambda o: (o["metadata"]["namespace"], o["metadata"]["name"])):
        meta, spec = monitor["metadata"], monitor.get("spec") or {}
        namespaces = _namespaces(spec.get("namespaceSelector"), meta["namespace"])
        for index, endpoint in enumerate(spec.get("podMetricsEndpoints") or []):
            port = endpoint.get("port", endpoint.get("targetPort"))
            relabel = [*_COMMON, *_namespace_rule(namespaces), *selector_relabelings(spec.get("selector") or {}),
                       _port_rule(port), *_TARGET_LABELS,
                       {"target_label": "endpoint", "replacement": str(port)},
                       {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"}]
            job_name = f"podMonitor/{meta['namespace']}/{meta['name']}/{index}"
            jobs.append(_endpoint_config(job_name, endpoint, discovery, relabel))
    return jobs


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector's verdict on a set of labels (for picking a ServiceMonitor's Services)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        ok = {"Exists": key in labels, "DoesNotExist": key not in labels,
              "In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values}[operator]
        if not ok:
            return False
    return True


# ---------------------------------------------------------------- discovery: pods → file-SD targets


def pod_targets(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The file-SD target groups of one pod, labelled as Prometheus' `kubernetes_sd_configs` role `pod`
    labels them: one target per container port (a container without ports: one at the pod's IP),
    none for a pod without an IP."""
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    ip = status.get("podIP")
    if not ip:
        return []
    group = {"__meta_kubernetes_namespace": meta["namespace"], "__meta_kubernetes_pod_name": meta["name"],
             "__meta_kubernetes_pod_ip": ip, "__meta_kubernetes_pod_uid": meta.get("uid", ""),
             "__meta_kubernetes_pod_node_name": spec.get("nodeName", ""),
             "__meta_kubernetes_pod_host_ip": status.get("hostIP", ""),
             "__meta_kubernetes_pod_phase": status.get("phase", ""),
             "__meta_kubernetes_pod_ready": str(any(c.get("type") == "Ready" and c.get("status") == "True"
                                                    for c in status.get("conditions") or [])).lower()}
    for owner in meta.get("ownerReferences") or []:
        if owner.get("controller"):
            group["__meta_kubernetes_pod_controller_kind"] = owner.get("kind", "")
            group["__meta_kubernetes_pod_controller_name"] = owner.get("name", "")
    for kind, values in (("label", meta.get("labels")), ("annotation", meta.get("annotations"))):
        for key, value in (values or {}).items():
            group[f"__meta_kubernetes_pod_{kind}_{label_name(key)}"] = str(value)
            group[f"__meta_kubernetes_pod_{kind}present_{label_name(key)}"] = "true"
    targets = []
    for init, containers in (("false", spec.get("containers") or []), ("true", spec.get("initContainers") or [])):
        for container in containers:
            labels = {"__meta_kubernetes_pod_container_name": container["name"],
                      "__meta_kubernetes_pod_container_image": container.get("image", ""),
                      "__meta_kubernetes_pod_container_init": init}
            ports = container.get("ports") or []
            if not ports:
                targets.append({"targets": [ip], "labels": {**group, **labels}})
            for port in ports:
                targets.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": {
                    **group, **labels, "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                    "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "TCP")}})
    return targets


class PodDiscovery:
    """Lists, then watches, every pod through the API server and keeps `path` (file-SD JSON) equal to
    their targets; Prometheus' file discovery picks each rewrite up."""

    def __init__(self, server: str, ca_file: Path, cert_file: Path, key_file: Path, path: Path) -> None:
        self.server, self.path = server, path
        self._context = ssl.create_default_context(cafile=str(ca_file))
        self._context.load_cert_chain(str(cert_file), str(key_file))
        self._pods: dict[str, Mapping[str, Any]] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        version = self._list()  # targets exist before Prometheus first reads the file
        self._thread = threading.Thread(target=self._run, args=(version,), name="pod-discovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * WATCH_TIMEOUT_S)
            self._thread = None

    def _get(self, query: str, timeout_s: float):
        return urllib.request.urlopen(f"{self.server}/api/v1/pods?{query}", context=self._context, timeout=timeout_s)

    def _list(self) -> str:
        with self._get("limit=0", 30) as response:
            body = json.loads(response.read())
        self._pods = {pod["metadata"]["uid"]: pod for pod in body["items"]}
        self._write()
        return body["metadata"]["resourceVersion"]

    def _run(self, version: str) -> None:
        while not self._stopping.is_set():
            try:
                query = urllib.parse.urlencode({"watch": "1", "resourceVersion": version,
                                                "timeoutSeconds": str(int(WATCH_TIMEOUT_S))})
                with self._get(query, WATCH_TIMEOUT_S + 10) as response:
                    for line in response:
                        event = json.loads(line)
                        if event["type"] == "ERROR":  # e.g. 410 Gone: the version is too old
                            raise ValueError(event["object"].get("message", "watch error"))
                        pod = event["object"]
                        version = pod["metadata"]["resourceVersion"]
                        if event["type"] == "DELETED":
                            self._pods.pop(pod["metadata"]["uid"], None)
                        else:
                            self._pods[pod["metadata"]["uid"]] = pod
                        self._write()
                        if self._stopping.is_set():
                            return
            except (OSError, ValueError, KeyError):
                if self._stopping.wait(1.0):
                    return
                try:
                    version = self._list()
                except (OSError, ValueError, KeyError):
                    continue

    def _write(self) -> None:
        groups = [group for pod in sorted(self._pods.values(), key=lambda p: (p["metadata"]["namespace"],
                                                                              p["metadata"]["name"]))
                  for group in pod_targets(pod)]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        os.replace(tmp, self.path)  # Prometheus never reads half a file


# ---------------------------------------------------------------- the process


_hosts = itertools.count()


class DevPrometheus(Started):
    """Prometheus for a running control plane; see the module docstring."""

    def __init__(self, workdir: str | Path, control_plane: ControlPlane, *, port: int | None = None) -> None:
        self.workdir = Path(workdir)
        self.control_plane = control_plane
        self.port = port or 9090
        self.host = None  # its place on the node network (`start`): the pods' addresses are routed there only
        self.process: subprocess.Popen | None = None
        self.config_file = self.workdir / "prometheus.yml"
        self.rules_dir = self.workdir / "rules"
        self.log = self.workdir / "prometheus.log"
        self.discovery: PodDiscovery | None = None

    @property
    def url(self) -> str:
        assert self.host is not None, "start() first"
        return f"http://{self.host.ip}:{self.port}"

    # ------------------------------------------------------------------ configuration

    @property
    def targets_file(self) -> Path:
        return self.workdir / "pods.json"

    def _discovery(self) -> dict[str, Any]:
        return {"file_sd_configs": [{"files": [str(self.targets_file)], "refresh_interval": "5s"}]}

    def _list(self, path: str) -> list[dict[str, Any]]:
        try:
            return self.control_plane.get(path)["items"]
        except urllib.error.HTTPError as error:
            if error.code == 404:  # the monitoring CRDs are not installed: nothing to scrape
                return []
            raise

    def configuration(self) -> dict[str, Any]:
        """The Prometheus configuration for the monitors the API server holds now (rule files written)."""
        group = f"/apis/{MONITORING_GROUP}/v1"
        services = self._list("/api/v1/services")
        jobs = scrape_configs(self._list(f"{group}/servicemonitors"), self._list(f"{group}/podmonitors"),
                              services, self._discovery())
        self.rules_dir.mkdir(parents=True, exist_ok=True)
        for old in self.rules_dir.glob("*.yaml"):
            old.unlink()
        for rule in self._list(f"{group}/prometheusrules"):
            meta = rule["metadata"]
            (self.rules_dir / f"{meta['namespace']}-{meta['name']}.yaml").write_text(
                yaml.safe_dump({"groups": (rule.get("spec") or {}).get("groups") or []}, sort_keys=False))
        return {"global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL,
                           "evaluation_interval": SCRAPE_INTERVAL},
                "rule_files": [str(self.rules_dir / "*.yaml")], "scrape_configs": jobs}

    def _write_config(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(yaml.safe_dump(self.configuration(), sort_keys=False))

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        binary = prometheus_binary()
        plane = self.control_plane
        plane.run_kubectl("apply", "--server-side", "--field-manager=kareus-dev", "-f", "-", input=yaml.safe_dump_all(RBAC))
        self._write_config()
        identity = plane.identity("prometheus", PROMETHEUS_USER)
        self.discovery = PodDiscovery(plane.url, plane.ca_file, identity.pair.cert_file, identity.pair.key_file,
                                      self.targets_file)
        self.discovery.start()
        self.host = plane.network.add_node(f"prometheus-{next(_hosts)}", pods=False)
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{self.host.netns}", binary, f"--config.file={self.config_file}",
                 f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address={self.host.ip}:{self.port}", "--web.enable-lifecycle",
                 # Nothing is kept beyond a dev session; an hour-long session fits easily.
                 "--storage.tsdb.retention.time=1d", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise KareusError(f"prometheus exited with {self.process.returncode}: {last_lines(self.log)}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise KareusError(f"prometheus did not become ready in {STARTUP_TIMEOUT_S:.0f} s: {last_lines(self.log)}")

    def refresh(self) -> None:
        """Re-read the monitors and rules from the API server and reload Prometheus."""
        self._write_config()
        request = urllib.request.Request(self.url + "/-/reload", method="POST")
        with urllib.request.urlopen(request, timeout=30):
            pass

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, grace_s=15.0)
            self.process = None
        if self.discovery is not None:
            self.discovery.stop()
            self.discovery = None
        if self.host is not None:
            for name, address in list(self.control_plane.network.nodes.items()):
                if address == self.host:
                    self.control_plane.network.remove_node(name)
            self.host = None

    # ------------------------------------------------------------------ queries

    def api(self, path: str, **params: Any) -> Any:
        """GET `/api/v1/<path>` with `params`; the `data` of a success, a KareusError with
        Prometheus' own message otherwise."""
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None}, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as error:
            body = json.loads(error.read() or b"{}")
        if body.get("status") != "success":
            raise KareusError(f"prometheus {path}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]
