"""A real Kubernetes control plane on this machine: etcd, kube-apiserver, controller manager, scheduler.

The binaries are the pinned release built from the Go module proxy (`tools/kube/build.sh`, `make
kube`), or prebuilt ones named by `KAREUS_KUBE_BIN` or envtest's `KUBEBUILDER_ASSETS`. Nothing
about them is emulated: the API server runs with TLS, x509 client authentication, service-account
token signing, `Node,RBAC` authorisation and the admission chain of a production cluster (the
defaults — NamespaceLifecycle, LimitRanger, ServiceAccount, PodSecurity, ResourceQuota, … — plus
NodeRestriction and OwnerReferencesPermissionEnforcement); the controller manager runs every
default controller (garbage collector, namespace, service accounts and tokens, Job, ReplicaSet,
Deployment, DaemonSet, resource quota, node lifecycle, TTL-after-finished, …) with one service
account per controller; the scheduler binds pods to nodes by their resources, taints and selectors.

What is not here is a node: `node.RealNode` runs them (kubelet, containerd, kube-proxy). The API server
listens on the host's address on the dev cluster's node network (`network.ClusterNetwork`, which the
control plane creates), where the nodes and, through the `kubernetes` Service, the pods reach it; etcd,
the controller manager and the scheduler listen on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kareus.errors import KareusError
from kareus_devcluster.network import SERVICE_CIDR, ClusterNetwork
from kareus_devcluster.pki import Authority, KeyPair, service_account_keys

REPO_ROOT = Path(__file__).resolve().parents[2]
KUBE_MODULE = REPO_ROOT / "tools" / "kube"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kubelet", "kube-proxy")
SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service's cluster IP: first of the range
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
ADMISSION_PLUGINS = ("NodeRestriction", "OwnerReferencesPermissionEnforcement")  # on top of the defaults
ADMIN_USER, ADMIN_GROUPS = "kareus-dev-admin", ("system:masters",)
STARTUP_TIMEOUT_S = 120.0


def kube_version() -> str:
    """The pinned Kubernetes release: the `k8s.io/kubernetes` requirement of tools/kube/go.mod."""
    try:
        text = (KUBE_MODULE / "go.mod").read_text()
    except OSError as error:
        raise KareusError(f"cannot read {KUBE_MODULE / 'go.mod'}: {error}") from None
    match = re.search(r"^\s*k8s\.io/kubernetes (v\S+)", text, re.MULTILINE)
    if match is None:
        raise KareusError(f"{KUBE_MODULE / 'go.mod'}: no k8s.io/kubernetes requirement")
    return match.group(1)


def binaries_dir(*, build: bool = False) -> Path:
    """The directory holding all five binaries; with `build`, built first if the cache lacks them.

    Looked up as `tools/kube/build.sh` does: `KAREUS_KUBE_BIN`, `KUBEBUILDER_ASSETS`, then the
    cache `$KAREUS_KUBE_CACHE` (default `~/.cache/kareus/kube`)/<version>/bin.
    """
    for variable in ("KAREUS_KUBE_BIN", "KUBEBUILDER_ASSETS"):
        if value := os.environ.get(variable):
            return _checked(Path(value), f"${variable}")
    cache = Path(os.environ.get("KAREUS_KUBE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or
                                                           Path.home() / ".cache") / "kareus" / "kube")
    directory = cache / kube_version() / "bin"
    if not all((directory / name).exists() for name in BINARIES) and build:
        result = subprocess.run(["bash", str(KUBE_MODULE / "build.sh")], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise KareusError(f"building the control plane failed: {result.stderr.strip().splitlines()[-1:]}")
    return _checked(directory, "the control-plane cache (run `make kube`)")


def _checked(directory: Path, where: str) -> Path:
    missing = [name for name in BINARIES if not os.access(directory / name, os.X_OK)]
    if missing:
        raise KareusError(f"{where}: {directory} lacks {', '.join(missing)}; build them with `make kube` "
                          f"(Go and the Go module proxy) or point KAREUS_KUBE_BIN at a directory that has them")
    return directory


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class Identity:
    """A user of the API: its kubeconfig and the client certificate behind it."""

    user: str
    kubeconfig: Path
    pair: KeyPair


class Started(ABC):
    """`with X(...) as x:` for anything with `start()` and `stop()`; a failed start stops what it began."""

    @abstractmethod
    def start(self) -> None:
        """Start the processes; whatever was begun is stopped again if it raises."""

    @abstractmethod
    def stop(self) -> None:
        """Stop everything `start` began (safe to call after a partial start)."""

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ControlPlane(Started):
    """Start with `start()` (or `with ControlPlane(...)`), stop with `stop()`; logs in `workdir/logs`."""

    def __init__(self, workdir: str | Path, *, binaries: Path | None = None) -> None:
        self.workdir = Path(workdir)
        self.bin = binaries or binaries_dir()
        self.pki_dir = self.workdir / "pki"
        self.log_dir = self.workdir / "logs"
        self.port = free_port()
        self.etcd_port, self.etcd_peer_port = free_port(), free_port()
        self.processes: dict[str, subprocess.Popen] = {}
        self.ca: Authority | None = None
        self.admin: Identity | None = None
        self.kubelet_client: KeyPair | None = None
        self.front_proxy: KeyPair | None = None
        self.sa_keys: KeyPair | None = None
        self.network = ClusterNetwork()

    @property
    def address(self) -> str:
        """The API server's address: the host's on the node network."""
        return self.network.gateway

    @property
    def url(self) -> str:
        return f"https://{self.address}:{self.port}"

    @property
    def ca_file(self) -> Path:
        assert self.ca is not None
        return self.ca.cert_file

    def kubectl(self) -> Path:
        return self.bin / "kubectl"

    def run_kubectl(self, *args: str, kubeconfig: Path | None = None, input: str | None = None,
                    check: bool = True, timeout_s: float = 210.0) -> subprocess.CompletedProcess:
        """The pinned kubectl (as the admin unless `kubeconfig` says otherwise), output as text; a
        failure with `check` is one KareusError with kubectl's own message."""
        assert self.admin is not None, "start() first"
        result = subprocess.run([str(self.kubectl()), f"--kubeconfig={kubeconfig or self.admin.kubeconfig}", *args],
                                input=input, capture_output=True, text=True, timeout=timeout_s, check=False)
        if check and result.returncode != 0:
            raise KareusError(f"kubectl {' '.join(args[:3])}: {result.stderr.strip() or result.stdout.strip()}")
        return result

    # ------------------------------------------------------------------ identities

    def identity(self, name: str, user: str, groups: Sequence[str] = ()) -> Identity:
        """A client certificate for `user` in `groups` and a kubeconfig that uses it."""
        assert self.ca is not None, "start() first"
        pair = self.ca.issue(name, user, groups=tuple(groups), client=True)
        kubeconfig = self.workdir / "kubeconfigs" / f"{name}.kubeconfig"
        write_kubeconfig(kubeconfig, self.url, self.ca_file, pair)
        return Identity(user, kubeconfig, pair)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        self.network.create()
        self.ca = Authority(self.pki_dir)
        serving = self.ca.issue("apiserver", "kube-apiserver", server=True,
                                ips=("127.0.0.1", self.address, SERVICE_IP),
                                dns=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                     "kubernetes.default.svc.cluster.local"))
        self.kubelet_client = self.ca.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client",
                                            groups=("kubeadm:cluster-admins",), client=True)
        self.front_proxy = self.ca.issue("front-proxy-client", "front-proxy-client", client=True)
        self.sa_keys = service_account_keys(self.pki_dir)
        self.admin = self.identity("admin", ADMIN_USER, ADMIN_GROUPS)
        self._start_etcd()
        self._start_apiserver(serving)
        self._wait_ready()
        # The API server's own client certificate, as kubeadm binds it: the kubelets authorize `kubectl
        # logs`, `exec` and `port-forward` against this (webhook authorization).
        self.run_kubectl("apply", "--server-side", "--field-manager=kareus-dev", "-f", "-", input=yaml.safe_dump({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "kube-apiserver-kubelet-api-admin"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "system:kubelet-api-admin"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                          "name": "kube-apiserver-kubelet-client"}]}))
        controller_manager = self.identity("controller-manager", "system:kube-controller-manager")
        scheduler = self.identity("scheduler", "system:kube-scheduler")
        self._spawn("kube-controller-manager", [
            f"--kubeconfig={controller_manager.kubeconfig}",
            f"--authentication-kubeconfig={controller_manager.kubeconfig}",
            f"--authorization-kubeconfig={controller_manager.kubeconfig}",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}", f"--cert-dir={self.workdir / 'kcm-certs'}",
            "--leader-elect=false", "--use-service-account-credentials=true", "--controllers=*",
            f"--service-account-private-key-file={self.sa_keys.key_file}", f"--root-ca-file={self.ca_file}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allocate-node-cidrs=false",
            # Quick reactions for tests; the semantics are the production ones.
            "--concurrent-gc-syncs=5", "--namespace-sync-period=10s", "--node-monitor-period=5s"])
        self._spawn("kube-scheduler", [
            f"--kubeconfig={scheduler.kubeconfig}", f"--authentication-kubeconfig={scheduler.kubeconfig}",
            f"--authorization-kubeconfig={scheduler.kubeconfig}", "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}", f"--cert-dir={self.workdir / 'scheduler-certs'}", "--leader-elect=false"])
        self._wait_controllers()

    def _start_etcd(self) -> None:
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        client = f"http://127.0.0.1:{self.etcd_port}"
        self._spawn("etcd", [
            "--name=default", f"--data-dir={self.workdir / 'etcd'}", f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}", f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}", f"--initial-cluster=default={peer}",
            "--log-level=warn", "--unsafe-no-fsync"])  # test data: durability across power loss is not wanted

    @property
    def audit_log(self) -> Path:
        """The API server's audit log (JSON lines, level Metadata): who asked for what, and the
        authorizer's decision — what RBAC tests read."""
        return self.workdir / "audit.log"

    def _start_apiserver(self, serving: KeyPair) -> None:
        assert self.sa_keys is not None and self.kubelet_client is not None and self.front_proxy is not None
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump({"apiVersion": "audit.k8s.io/v1", "kind": "Policy",
                                          "omitStages": ["RequestReceived"], "rules": [{"level": "Metadata"}]}))
        self._spawn("kube-apiserver", [
            f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}", "--audit-log-format=json",
            "--audit-log-maxsize=200", "--audit-log-maxbackup=1",
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}", f"--bind-address={self.address}",
            f"--secure-port={self.port}", f"--advertise-address={self.address}",
            f"--tls-cert-file={serving.cert_file}", f"--tls-private-key-file={serving.key_file}",
            f"--client-ca-file={self.ca_file}", f"--service-account-issuer={SA_ISSUER}",
            f"--service-account-key-file={self.sa_keys.cert_file}",
            f"--service-account-signing-key-file={self.sa_keys.key_file}",
            "--authorization-mode=Node,RBAC", f"--enable-admission-plugins={','.join(ADMISSION_PLUGINS)}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
            f"--kubelet-client-certificate={self.kubelet_client.cert_file}",
            f"--kubelet-client-key={self.kubelet_client.key_file}",
            f"--kubelet-certificate-authority={self.ca_file}",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            # The aggregation layer's front proxy, as kubeadm configures it; components read this CA
            # from kube-system/extension-apiserver-authentication.
            f"--requestheader-client-ca-file={self.ca_file}", "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={self.front_proxy.cert_file}",
            f"--proxy-client-key-file={self.front_proxy.key_file}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}", "--profiling=false"])

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115  (owned by the process)
        try:
            self.processes[name] = subprocess.Popen([str(self.bin / name), *args], stdout=log,
                                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                    start_new_session=True)
        finally:
            log.close()

    def _ssl_context(self) -> ssl.SSLContext:
        assert self.admin is not None
        context = ssl.create_default_context(cafile=str(self.ca_file))
        context.load_cert_chain(str(self.admin.pair.cert_file), str(self.admin.pair.key_file))
        return context

    def get(self, path: str) -> Any:
        """GET as the admin; the parsed JSON (tests and readiness checks)."""
        with urllib.request.urlopen(self.url + path, context=self._ssl_context(), timeout=10) as response:
            body = response.read()
        return json.loads(body) if body[:1] in (b"{", b"[") else body.decode()

    def _wait_ready(self) -> None:
        def ready() -> bool:
            try:
                return self.get("/readyz") == "ok"
            except (OSError, urllib.error.URLError, ssl.SSLError):
                return False

        self._wait("kube-apiserver /readyz", ready)

    def _wait_controllers(self) -> None:
        """The controllers every pod depends on have run once: the default service account and the
        root-CA ConfigMap a projected service-account volume reads exist in `default`."""
        def ready() -> bool:
            try:
                self.get("/api/v1/namespaces/default/serviceaccounts/default")
                self.get("/api/v1/namespaces/default/configmaps/kube-root-ca.crt")
            except (OSError, urllib.error.URLError):
                return False
            return True

        self._wait("the controller manager's service-account and root-CA controllers", ready)

    def _wait(self, what: str, ready: Any) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            dead = [name for name, process in self.processes.items() if process.poll() is not None]
            if dead:
                raise KareusError(f"{dead[0]} exited with {self.processes[dead[0]].returncode} while waiting for "
                                  f"{what}: {last_lines(self.log_dir / f'{dead[0]}.log')}")
            if ready():
                return
            time.sleep(0.25)
        raise KareusError(f"timed out after {STARTUP_TIMEOUT_S:.0f} s waiting for {what}; logs in {self.log_dir}")

    def stop(self) -> None:
        """SIGTERM in reverse start order (scheduler first, etcd last), SIGKILL after a grace period."""
        for name in reversed(list(self.processes)):
            stop_process(self.processes.pop(name))
        self.network.destroy()

    def alive(self) -> dict[str, bool]:
        return {name: process.poll() is None for name, process in self.processes.items()}


def stop_process(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def last_lines(path: Path, count: int = 5) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(lines[-count:]) or "(empty log)"


def write_kubeconfig(path: Path, server: str, ca_file: Path, pair: KeyPair, *, namespace: str = "default") -> None:
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "kareus-dev",
        "clusters": [{"name": "kareus-dev", "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": "kareus-dev", "user": {"client-certificate": str(pair.cert_file),
                                                  "client-key": str(pair.key_file)}}],
        "contexts": [{"name": "kareus-dev", "context": {"cluster": "kareus-dev", "user": "kareus-dev",
                                                         "namespace": namespace}}],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)


def kubectl_path() -> str | None:
    """kubectl from the control-plane binaries, else from PATH."""
    with contextlib.suppress(KareusError):
        return str(binaries_dir() / "kubectl")
    return shutil.which("kubectl")


def wait_crd_established(kubectl: Any, name: str, timeout_s: float = 60.0) -> None:
    """Until CRD `name` is Established. Polled, not `kubectl wait --for=condition=Established`, which
    fails at once ("status.conditions accessor error") while a just-created CRD's conditions are
    still null, a window a large schema (the KareusJob's typed pod overrides) makes wide enough to hit."""
    deadline = time.monotonic() + timeout_s
    jsonpath = 'jsonpath={.status.conditions[?(@.type=="Established")].status}'
    while True:
        result = kubectl("get", f"crd/{name}", "-o", jsonpath, check=False)
        if result.returncode == 0 and result.stdout.strip() == "True":
            return
        if time.monotonic() > deadline:
            said = (result.stderr or result.stdout or "").strip()
            raise KareusError(f"CRD {name} is not Established after {timeout_s:.0f} s{': ' + said if said else ''}")
        time.sleep(0.2)
