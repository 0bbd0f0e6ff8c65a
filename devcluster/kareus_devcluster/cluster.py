"""The dev cluster: a real control plane, real nodes, and Kareus installed from its chart, in its images.

`DevCluster` (synchronous; `with DevCluster(workdir) as cluster:`) starts, in order:

1. the control plane (`controlplane.ControlPlane`: etcd, kube-apiserver, kube-controller-manager,
   kube-scheduler of the pinned release, and the node network) — or joins one a caller already runs;
2. Kareus's images (`make images`, cached by content) and the nodes (`node.RealNode`: the upstream
   kubelet, containerd and runc, kube-proxy, each node in its own network and mount namespace, the
   images imported), then CoreDNS as kubeadm deploys it (`dns`), and waits until the nodes are Ready
   and hold their heartbeat leases;
   and the default StorageClass `standard`, whose claims get node-local volumes (`storage`, as
   kind's local-path-provisioner provides them);
3. the Helm chart, rendered by the real Helm engine (helm-python-sdk embeds Helm's Go SDK) and
   applied with kubectl as a release named `kareus` in `kareus-system`: the CRD, RBAC, the node
   agent DaemonSet (simulated GPUs: `nodeAgent.backend: sim`) and the operator Deployment, which
   runs in its image on a node under the chart's ServiceAccount, so RBAC applies to it.

Only the GPU is simulated: a device plugin on the kubelet's real device-plugin API
(`deviceplugin`) hands out simulated GPUs by UUID, with the node's simulated-GPU state mounted.

More operator releases (each watching its own namespaces with its own settings) can be installed
with `install_operator`; tests use that to run fast fake phases beside the real ones.
`kareus dev-cluster` is `serve()`: it prints the API URL and kubeconfig, then `ready`, and stops
everything it started on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kareus.errors import KareusError
from kareus.override_policy import RESTRICTED_VOLUME_TYPES
from kareus_devcluster import dns
from kareus_devcluster.controlplane import (
    REPO_ROOT,
    ControlPlane,
    Started,
    last_lines,
    stop_process,
    wait_crd_established,
)
from kareus_devcluster.images import cache_dir, node_images
from kareus_devcluster.kueue import DevKueue, quota_objects
from kareus_devcluster.node import SIM_GPU_DIR, Credentials, NodeSpec, RealNode, image_store
from kareus_devcluster.prometheus import DevPrometheus, install_monitoring
from kareus_devcluster.storage import LocalPathProvisioner

NODE_NAME = "kareus-dev-node"  # the first node; more are <NODE_NAME>-1, -2, …
NODE_GPUS = 8
NODE_GPU_PRODUCT = "A100-SXM4-40GB"
CHART = REPO_ROOT / "helm" / "kareus"
RELEASE, RELEASE_NAMESPACE = "kareus", "kareus-system"
KUEUE_QUEUE = "kareus"  # the dev cluster's ClusterQueue and LocalQueues, with `--kueue`
STARTUP_TIMEOUT_S = 180.0
# The kinds the chart renders, in Helm's install order: a workload starts only once the
# ServiceAccount, ConfigMaps and RBAC it runs with exist.
INSTALL_ORDER = ("Namespace", "CustomResourceDefinition", "ServiceAccount", "Secret", "ConfigMap", "ClusterRole",
                 "ClusterRoleBinding", "Role", "RoleBinding", "Service", "DaemonSet", "Deployment")


def node_name(index: int) -> str:
    return NODE_NAME if index == 0 else f"{NODE_NAME}-{index}"


def node_gpu_uuids(name: str, count: int = NODE_GPUS, product: str = NODE_GPU_PRODUCT) -> list[str]:
    """UUIDs of a node's simulated GPUs: the device plugin hands out exactly those the node
    agent's simulated backend discovers (both deterministic per node, model and index)."""
    from kareus.gpu import discover

    return [gpu.uuid for gpu in discover("sim", count=count, product=product, node=name)]


class DevCluster(Started):
    """See the module docstring. `stop()` ends every process it started and nothing else."""

    def __init__(self, workdir: str | Path, *, control_plane: ControlPlane | None = None,
                 kubeconfig: str | Path | None = None, nodes: int = 1, gpus_per_node: int = NODE_GPUS,
                 gpu_product: str = NODE_GPU_PRODUCT, taint_gpus: bool = False, pods_per_node: int = 110,
                 operator: bool = True,
                 node_agent: bool = True, operator_settings: Mapping[str, str] | None = None,
                 operator_args: Sequence[str] = (),
                 worker_namespaces: Sequence[str] = ("default",), watch_namespaces: Sequence[str] = (),
                 prometheus: bool = False, kueue: bool = False) -> None:
        if nodes < 1:
            raise KareusError(f"nodes: must be >= 1, got {nodes}")
        self.workdir = Path(workdir)
        self.owns_control_plane = control_plane is None
        self.control_plane = control_plane
        self.kubeconfig = Path(kubeconfig) if kubeconfig else self.workdir / "kubeconfig"
        self.node_count, self.gpus_per_node, self.gpu_product = nodes, gpus_per_node, gpu_product
        self.taint_gpus, self.pods_per_node = taint_gpus, pods_per_node
        self.want_operator, self.want_node_agent = operator, node_agent
        self.operator_settings = dict(operator_settings or {})
        self.operator_args = list(operator_args)
        self.worker_namespaces, self.watch_namespaces = list(worker_namespaces), list(watch_namespaces)
        self.nodes: list[RealNode] = []
        self._started_nodes = 0  # node names are never reused: a removed node's may still be known
        self._images: list[tuple[str, Path]] = []
        self._image_root: Path | None = None
        # Unix sockets (containerd's, the kubelet's, the device plugin's) live under the nodes' roots, which
        # the host reaches too: keep those paths short (a socket's path has at most 107 bytes).
        self._short_root: Path | None = None
        self.want_prometheus = prometheus  # a real Prometheus scraping what the chart's monitors select
        self.prometheus: DevPrometheus | None = None
        self.want_kueue = kueue  # the real Kueue controller, with a ClusterQueue over every GPU
        self.kueue: DevKueue | None = None
        self.storage: LocalPathProvisioner | None = None  # the default StorageClass's node-local volumes

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        assert self.control_plane is not None
        return self.control_plane.url

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.control_plane is None:
            self.control_plane = ControlPlane(self.workdir / "control-plane")
            self.control_plane.start()
        assert self.control_plane.admin is not None
        self.kubeconfig.parent.mkdir(parents=True, exist_ok=True)
        self.kubeconfig.write_text(self.control_plane.admin.kubeconfig.read_text())
        self.kubeconfig.chmod(0o600)
        self._short_root = Path(tempfile.mkdtemp(prefix="kd-"))
        self._images = node_images()
        self._image_root = image_store(self._images, cache_dir() / "containerd")
        for index in range(self.node_count):
            self.nodes.append(self._start_node(node_name(index), gpus=self.gpus_per_node, taint=self.taint_gpus))
        if self.taint_gpus:  # the operator tolerates no GPU taint: give it a node, as a real cluster has
            self.nodes.append(self._start_node(f"{NODE_NAME}-cpu", gpus=0, taint=False))
        self._wait_nodes_ready()
        dns.install(self)
        self.storage = LocalPathProvisioner(self.control_plane, self._node_root)
        self.storage.start()
        values = self.values(operator=self.want_operator, node_agent=self.want_node_agent)
        if self.want_prometheus:
            values["metrics"] = install_monitoring(self)
        self.install(RELEASE, RELEASE_NAMESPACE, values)
        if self.want_prometheus:
            self.prometheus = DevPrometheus(self.workdir / "prometheus", self.control_plane)
            self.prometheus.start()
        if self.want_kueue:
            self.kueue = DevKueue(self.workdir / "kueue", self.control_plane)
            self.kueue.start()
            gpus = self.gpus_per_node * self.node_count
            self.kubectl("apply", "--server-side", "--field-manager=kareus-dev", "-f", "-", input=yaml.safe_dump_all(
                quota_objects(KUEUE_QUEUE, gpus, list(self.worker_namespaces))))

    def stop(self) -> None:
        """Every part is stopped even when stopping an earlier one fails (a node left half stopped must
        not keep the control plane and the other nodes running); a failure is raised once all are stopped."""
        with contextlib.ExitStack() as parts:  # exits in reverse: the order below is the stop order
            if self._short_root is not None:
                parts.callback(subprocess.run, ["rm", "-rf", "--one-file-system", str(self._short_root)], check=False)
                self._short_root = None
            if self.owns_control_plane and self.control_plane is not None:
                parts.callback(self.control_plane.stop)
            for node in reversed(self.nodes):
                parts.callback(self._stop_node, node)
            self.nodes = []
            for name in ("prometheus", "kueue", "storage"):
                if (part := getattr(self, name)) is not None:
                    parts.callback(part.stop)
                    setattr(self, name, None)

    # ------------------------------------------------------------------ nodes

    def _start_node(self, name: str, *, gpus: int, taint: bool, gpu_product: str | None = None) -> RealNode:
        plane = self.control_plane
        assert plane is not None and plane.ca is not None
        self._started_nodes += 1
        product = gpu_product or self.gpu_product
        address = plane.network.add_node(name)
        kubelet = plane.identity(f"node-{name}", f"system:node:{name}", ("system:nodes",))
        proxy = plane.identity(f"kube-proxy-{name}", "system:kube-proxy")
        serving = plane.ca.issue(f"kubelet-{name}", name, server=True, ips=(address.ip,), dns=(name,))
        spec = NodeSpec(name=name, gpus=gpus, gpu_product=product, taint_gpus=taint, max_pods=self.pods_per_node,
                        gpu_uuids=tuple(node_gpu_uuids(name, gpus, product)) if gpus else ())
        assert self._short_root is not None
        root = self._short_root / name
        (self.workdir / "nodes").mkdir(parents=True, exist_ok=True)
        link = self.workdir / "nodes" / name
        if not link.is_symlink():
            link.symlink_to(root, target_is_directory=True)
        node = RealNode(spec, address, root, binaries=plane.bin, slot=plane.network.slot,
                        credentials=Credentials(plane.ca_file, kubelet.kubeconfig, proxy.kubeconfig,
                                                serving.cert_file, serving.key_file),
                        images=self._images, image_root=self._image_root)
        try:
            node.start()
        except BaseException:
            self._stop_node(node)
            raise
        return node

    def _stop_node(self, node: RealNode) -> None:
        node.stop()
        assert self.control_plane is not None
        self.control_plane.network.remove_node(node.spec.name)

    def _node_root(self, name: str) -> Path | None:
        return next((node.root for node in self.nodes if node.spec.name == name), None)

    def node(self, name: str) -> RealNode:
        return next(n for n in self.nodes if n.spec.name == name)

    def _wait_nodes_ready(self) -> None:
        gpus = {node.spec.name: node.spec.gpus for node in self.nodes}

        def ready() -> bool:
            """Ready, with the device plugin's GPUs allocatable (registered after the kubelet starts) and the
            node's heartbeat lease held (the kubelet creates it asynchronously, retrying with backoff until
            the API server's kube-node-lease namespace exists, so Ready can come first on a loaded machine)."""
            assert self.control_plane is not None
            items = self.control_plane.get("/api/v1/nodes")["items"]
            ready_names = {n["metadata"]["name"] for n in items if any(
                c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
                and int(n["status"].get("allocatable", {}).get("nvidia.com/gpu", "0")) == gpus.get(
                    n["metadata"]["name"], -1)}
            leases = self.control_plane.get("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases")
            held = {lease["metadata"]["name"] for lease in leases["items"]
                    if lease.get("spec", {}).get("holderIdentity") == lease["metadata"]["name"]}
            return set(gpus) <= ready_names & held

        self._wait("the nodes to be Ready and hold their leases", ready)

    # ------------------------------------------------------------------ the chart

    def values(self, *, operator: bool, node_agent: bool, settings: Mapping[str, str] | None = None,
               args: Sequence[str] | None = None, worker_namespaces: Sequence[str] | None = None,
               watch_namespaces: Sequence[str] | None = None, crds: bool = True) -> dict[str, Any]:
        """Chart values of a dev-cluster release (everything else stays the chart's default)."""
        settings = self.operator_settings if settings is None else settings
        return {
            "crds": {"install": crds},
            "operator": {"replicas": 1 if operator else 0,
                         # Emulated GPUs train CPU proxies: a job whose GPU model would not fit its GPU's
                         # memory (the quickstart's Llama 3.2 3B) gets a Warning Event and still runs.
                         "settings": {"MEMORY_CHECK": "warn",
                                      **{k.removeprefix("KAREUS_OPERATOR_"): str(v) for k, v in settings.items()}},
                         "args": {"watchNamespaces": list(self.watch_namespaces if watch_namespaces is None
                                                          else watch_namespaces),
                                  "extra": list(self.operator_args if args is None else args)}},
            "workers": {"namespaces": list(self.worker_namespaces if worker_namespaces is None else worker_namespaces),
                        # What a user with small nodes sets: many jobs' pods share this machine's memory.
                        "gpuPods": {"shmSize": "1Gi", "memoryRequest": "256Mi", "memoryLimit": "6Gi"},
                        "optimizePods": {"cpuRequest": "50m", "memoryRequest": "128Mi", "memoryLimit": "4Gi"}},
            # The operator's test fakes share a host directory with the tests through a hostPath override,
            # which the operator refuses unless the cluster policy lists the volume type.
            "policy": {"podTemplateOverrides": {"volumeTypes": [*RESTRICTED_VOLUME_TYPES, "hostPath"]}},
            "nodeAgent": {"enabled": node_agent, "backend": "sim",
                          "sim": {"gpus": max(self.gpus_per_node, 1), "product": self.gpu_product,
                                  "deviceDir": SIM_GPU_DIR}},
        }

    def render(self, release: str, namespace: str, values: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The chart's objects for these values, as the Helm engine renders them (NOTES dropped)."""
        try:
            import helm_python as helm
        except ImportError as error:
            raise KareusError(f"the dev cluster renders the chart with helm-python-sdk: {error}") from None
        with helm.Chart.load(str(CHART)) as chart:
            manifests = chart.render(dict(values), name=release, namespace=namespace)
        objects = [doc for path, text in sorted(manifests.items()) if not path.endswith("NOTES.txt")
                   for doc in yaml.safe_load_all(text) if doc]
        return sorted(objects, key=lambda obj: INSTALL_ORDER.index(obj["kind"]) if obj["kind"] in INSTALL_ORDER
                      else len(INSTALL_ORDER))

    def install(self, release: str, namespace: str, values: Mapping[str, Any]) -> list[dict[str, Any]]:
        """`helm install`'s effect: namespaces, then the rendered objects applied (CRDs first), then wait
        for the operator Deployment and the node agent DaemonSet to be available."""
        objects = self.render(release, namespace, values)
        for name in {namespace, *values.get("workers", {}).get("namespaces", [])}:
            self.kubectl("create", "namespace", name, check=False)
        stream = yaml.safe_dump_all(objects, sort_keys=False)
        self.kubectl("apply", "--server-side", "--force-conflicts", f"--field-manager=helm-{release}", "-f", "-",
                     input=stream)
        for obj in objects:
            if obj["kind"] == "CustomResourceDefinition":
                wait_crd_established(self.kubectl, obj["metadata"]["name"])
        for obj in objects:
            if obj["kind"] in ("Deployment", "DaemonSet"):
                ns = obj["metadata"]["namespace"]
                rollout = self.kubectl("rollout", "status", f"{obj['kind'].lower()}/{obj['metadata']['name']}",
                                       "-n", ns, f"--timeout={int(STARTUP_TIMEOUT_S)}s", check=False)
                if rollout.returncode != 0:
                    raise KareusError(f"{obj['kind']} {ns}/{obj['metadata']['name']} did not become available: "
                                      f"{rollout.stderr.strip()}\n{self._describe(ns)}")
        return objects

    def _describe(self, namespace: str) -> str:
        """What a person would look at: the namespace's pods and its latest events."""
        pods = self.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
        events = self.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout
        return f"{pods}\n" + "\n".join(events.splitlines()[-15:])

    def install_operator(self, release: str, namespace: str, *, watch_namespaces: Sequence[str],
                         settings: Mapping[str, str], args: Sequence[str] = (),
                         policy: Mapping[str, Any] | None = None,
                         operator_values: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Another operator (no node agent, CRD left to the main release) watching only its namespaces,
        with its own settings, cluster policy (chart value `policy`) and other `operator.*` values."""
        values = self.values(operator=True, node_agent=False, settings=settings, args=args,
                             worker_namespaces=watch_namespaces, watch_namespaces=watch_namespaces, crds=False)
        values["operator"].update(operator_values or {})
        if policy is not None:
            values["policy"] = {**values["policy"], **policy}
        return self.install(release, namespace, values)

    def add_node(self, *, gpus: int = 0, gpu_product: str | None = None, taint: bool = False) -> str:
        """One more node, of another GPU product if given and with the nvidia.com/gpu taint if asked;
        its name."""
        name = node_name(self._started_nodes)
        self.nodes.append(self._start_node(name, gpus=gpus, taint=taint, gpu_product=gpu_product))
        self._wait_nodes_ready()
        return name

    def remove_node(self, name: str) -> None:
        """Stop a node and delete its Node object (its pods go with it, as after a drain)."""
        node = self.node(name)
        self.kubectl("drain", name, "--force", "--ignore-daemonsets", "--delete-emptydir-data",
                     "--grace-period=5", "--timeout=60s", check=False)
        self._stop_node(node)
        self.nodes.remove(node)
        self.kubectl("delete", "node", name, "--wait=false", check=False)

    def uninstall(self, objects: Sequence[Mapping[str, Any]]) -> None:
        """Delete what `install` applied, as `helm uninstall` orders it: the workloads first, waiting
        until their pods are gone (foreground), then RBAC and the rest — so no pod outlives the
        permissions it runs with. CRDs and namespaces stay (the chart keeps users' jobs)."""
        kept = {"CustomResourceDefinition", "Namespace"}
        workloads = [o for o in objects if o["kind"] in ("Deployment", "DaemonSet")]
        rest = [o for o in objects if o["kind"] not in kept and o not in workloads]
        for batch, wait in ((workloads, ["--cascade=foreground", "--wait=true", "--timeout=120s"]),
                            (rest, ["--wait=false"])):
            if batch:
                self.kubectl("delete", "--ignore-not-found", *wait, "-f", "-",
                             input=yaml.safe_dump_all(batch, sort_keys=False))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        assert self.control_plane is not None
        return self.control_plane.run_kubectl(*args, kubeconfig=self.kubeconfig, input=input, check=check,
                                              timeout_s=STARTUP_TIMEOUT_S + 30)

    def _wait(self, what: str, ready: Any) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            for node in self.nodes:
                if (component := node.dead()) is not None:
                    raise KareusError(f"node {node.spec.name}: {component} exited: "
                                      f"{last_lines(node.log_dir / f'{component}.log')}")
            if ready():
                return
            time.sleep(0.25)
        raise KareusError(f"timed out waiting for {what}")


def serve(workdir: Path, kubeconfig: Path, **options: Any) -> None:
    """Run a dev cluster until SIGINT/SIGTERM; prints `ready` once everything is up."""
    stopping = {"now": False}

    def stop(_signum: int, _frame: Any) -> None:
        stopping["now"] = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    with DevCluster(workdir, kubeconfig=kubeconfig, **options) as cluster:
        print(f"API {cluster.url}, kubeconfig {cluster.kubeconfig}", flush=True)
        print(f"nodes {', '.join(node.spec.name for node in cluster.nodes)}; logs in {workdir}", flush=True)
        if cluster.prometheus is not None:
            url = cluster.prometheus.url
            print(f"prometheus: {url}", flush=True)
            print(f"  live series in Prometheus' own UI: {url}/graph?g0.expr=kareus_gpu_power_watts (targets at "
                  f"{url}/targets, the chart's alerts at {url}/alerts)", flush=True)
        if cluster.kueue is not None:
            print(f"kueue: ClusterQueue and LocalQueue {KUEUE_QUEUE!r} (every GPU); label a KareusJob "
                  f"kueue.x-k8s.io/queue-name={KUEUE_QUEUE} to queue it", flush=True)
        print("ready", flush=True)
        while not stopping["now"]:
            time.sleep(0.2)


class DevClusterProcess:
    """`kareus dev-cluster` as a subprocess, for synchronous callers (scripts, benchmarks)."""

    def __init__(self, workdir: str | Path, *, extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.workdir = Path(workdir)
        self.kubeconfig = self.workdir / "kubeconfig"
        self.extra_args, self.env, self.startup_timeout_s = list(extra_args), dict(env or {}), startup_timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> DevClusterProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "dev-cluster.log", "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kareus", "dev-cluster", "--kubeconfig", str(self.kubeconfig),
                 "--workdir", str(self.workdir), *self.extra_args],
                stdout=subprocess.PIPE, stderr=log, env={**os.environ, **self.env}, start_new_session=True, text=True)
        deadline = time.monotonic() + self.startup_timeout_s
        assert self.process.stdout is not None
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if line.strip() == "ready":
                return self
            if not line and self.process.poll() is not None:
                break
        self.__exit__()
        raise RuntimeError(f"dev cluster did not start; see {self.workdir / 'dev-cluster.log'}")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            stop_process(self.process, grace_s=60.0)
            if self.process.stdout is not None:
                self.process.stdout.close()
