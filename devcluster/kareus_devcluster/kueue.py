"""The real Kueue controller beside the dev cluster's control plane.

Kueue (`sigs.k8s.io/kueue`, pinned in `tools/kueue/go.mod`) is built from the Go module proxy by
`tools/kueue/build.sh` (`make kueue`) into a cache, with the CRDs, the webhook list and the
controller's ClusterRole of the same module version. `DevKueue(...).start()`:

- applies Kueue's CRDs (server-side: they are larger than an annotation may hold) and its
  ClusterRole, bound to the user `kareus-dev-kueue`, whose client certificate the control plane's
  CA issues — the controller runs with exactly the permissions its release grants it;
- writes a `Configuration` (integration `batch/job` only, as the operator's children are batch
  Jobs; no leader election; the webhook on 127.0.0.1 with a serving certificate from the same CA)
  and starts the controller as a local process, as the control plane's own components run;
- registers Kueue's own mutating and validating webhooks for Jobs and for its API types, with a
  `url` client config instead of the in-cluster Service (the controller runs beside the control plane,
  not in a pod, so no Service fronts it), once its webhook server answers.

`stop()` removes the webhook configurations before it stops the process (with `failurePolicy:
Fail` they would otherwise refuse every Job on a control plane other tests share), then the
process. What is not the release's: the controller is not a pod (it runs in a private mount namespace,
`unshare --mount`, so its fixed metrics-certificate path holds ours), and its certificates come
from the dev cluster's CA instead of Kueue's internal certificate manager.
"""

from __future__ import annotations

import base64
import copy
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from kareus.errors import KareusError
from kareus_devcluster.controlplane import ControlPlane, Started, free_port, last_lines, stop_process

KUEUE_MODULE = Path(__file__).resolve().parents[2] / "tools" / "kueue"
KUEUE_USER = "kareus-dev-kueue"
KUEUE_NAMESPACE = "kueue-system"
WEBHOOK_NAMES = ("kareus-dev-kueue-mutating", "kareus-dev-kueue-validating")
STARTUP_TIMEOUT_S = 120.0
METRICS_CERTS = Path("/etc/kueue/metrics/certs")
API = "kueue.x-k8s.io/v1beta2"


def kueue_dir(*, build: bool = False) -> Path:
    """The built Kueue (bin/kueue, crds/, webhooks.yaml, rbac/); with `build`, built first
    if the cache lacks it. `KAREUS_KUEUE_DIR` names a prebuilt one."""
    result = subprocess.run(["bash", str(KUEUE_MODULE / "build.sh")], capture_output=True, text=True, check=False,
                            env={**os.environ, **({} if build else {"KAREUS_KUEUE_NO_BUILD": "1"})})
    if result.returncode != 0:
        raise KareusError(f"Kueue is not built: {(result.stderr.strip().splitlines() or ['?'])[-1]} "
                          "(run `make kueue`)")
    return Path(result.stdout.strip().splitlines()[-1])


def kueue_webhooks(manifest_text: str, url: str, ca_bundle: str) -> list[dict[str, Any]]:
    """Kueue's webhook configurations for Jobs and its own API, pointed at `url`."""
    wanted = ("batch-v1-job", "kueue-x-k8s-io")
    configurations = []
    for document, name in zip([d for d in yaml.safe_load_all(manifest_text) if d], WEBHOOK_NAMES, strict=True):
        hooks = []
        for hook in document.get("webhooks") or []:
            service = (hook.get("clientConfig") or {}).get("service") or {}
            if any(part in service.get("path", "") for part in wanted):
                hook = copy.deepcopy(hook)
                hook["clientConfig"] = {"url": url + service["path"], "caBundle": ca_bundle}
                hooks.append(hook)
        configurations.append({"apiVersion": document["apiVersion"], "kind": document["kind"],
                               "metadata": {"name": name}, "webhooks": hooks})
    return configurations


class DevKueue(Started):
    """Kueue for a running control plane; see the module docstring."""

    def __init__(self, workdir: str | Path, control_plane: ControlPlane) -> None:
        self.workdir = Path(workdir)
        self.control_plane = control_plane
        self.webhook_port, self.health_port = free_port(), free_port()
        self.process: subprocess.Popen | None = None
        self.log = self.workdir / "kueue.log"

    def configuration(self, cert_dir: Path) -> dict[str, Any]:
        return {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration", "namespace": KUEUE_NAMESPACE,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"port": self.webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "manageJobsWithoutQueueName": False,
            "integrations": {"frameworks": ["batch/job"]},
        }

    def start(self) -> None:
        source = kueue_dir()
        plane = self.control_plane
        self.workdir.mkdir(parents=True, exist_ok=True)
        crds = sorted((source / "crds").glob("*.yaml"))
        plane.run_kubectl("apply", "--server-side", "--field-manager=kareus-dev", *(f"-f={f}" for f in crds))
        plane.run_kubectl("wait", "--for=condition=Established", "--timeout=60s",
                          *(f"crd/{yaml.safe_load(f.read_text())['metadata']['name']}" for f in crds))
        plane.run_kubectl("apply", "--server-side", "--field-manager=kareus-dev", "-f", "-",
                          input=yaml.safe_dump_all(self._rbac(source)))
        identity = plane.identity("kueue", KUEUE_USER)
        assert plane.ca is not None
        cert_dir = self.workdir / "certs"
        cert_dir.mkdir(exist_ok=True)
        serving = plane.ca.issue("kueue-webhook", "kueue-webhook", server=True, ips=("127.0.0.1",))
        (cert_dir / "tls.crt").write_bytes(serving.cert_file.read_bytes())
        (cert_dir / "tls.key").write_bytes(serving.key_file.read_bytes())
        config = self.workdir / "config.yaml"
        config.write_text(yaml.safe_dump(self.configuration(cert_dir), sort_keys=False))
        # Without Kueue's internal certificate manager the binary reads its metrics certificate
        # from a fixed path (/etc/kueue/metrics/certs): a private mount namespace puts ours there.
        METRICS_CERTS.mkdir(parents=True, exist_ok=True)
        command = (f"mount --bind {cert_dir} {METRICS_CERTS} && "
                   f"exec {source / 'bin' / 'kueue'} --config={config} --zap-log-level=info "
                   # The on-demand visibility API is an aggregated API server of its own (and more
                   # fixed certificate paths); nothing here reads it.
                   "--feature-gates=VisibilityOnDemand=false")
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", command],
                env={**os.environ, "KUBECONFIG": str(identity.kubeconfig)},
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready()
        ca_bundle = base64.b64encode(plane.ca.cert_file.read_bytes()).decode()
        hooks = kueue_webhooks((source / "webhooks.yaml").read_text(), f"https://127.0.0.1:{self.webhook_port}",
                               ca_bundle)
        plane.run_kubectl("apply", "--server-side", "--field-manager=kareus-dev", "-f", "-",
                          input=yaml.safe_dump_all(hooks))

    def _rbac(self, source: Path) -> list[dict[str, Any]]:
        """The release's ClusterRole and its Role on Secrets in Kueue's namespace, for our user."""
        role = yaml.safe_load((source / "rbac" / "role.yaml").read_text())
        role["metadata"] = {"name": KUEUE_USER}
        secrets = yaml.safe_load((source / "rbac" / "manager_secrets_role.yaml").read_text())
        secrets["metadata"] = {"name": KUEUE_USER, "namespace": KUEUE_NAMESPACE}
        subjects = [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": KUEUE_USER}]
        return [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUEUE_NAMESPACE}}, role, secrets,
                {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                 "metadata": {"name": KUEUE_USER}, "subjects": subjects,
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": KUEUE_USER}},
                {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                 "metadata": {"name": KUEUE_USER, "namespace": KUEUE_NAMESPACE}, "subjects": subjects,
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": KUEUE_USER}}]

    def _wait_ready(self) -> None:
        """Ready when the health endpoint says so and the webhook server completes a TLS handshake."""
        assert self.process is not None and self.control_plane.ca is not None
        context = ssl.create_default_context(cafile=str(self.control_plane.ca.cert_file))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise KareusError(f"kueue exited with {self.process.returncode}: {last_lines(self.log)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2):
                    pass
                with urllib.request.urlopen(f"https://127.0.0.1:{self.webhook_port}/", timeout=2, context=context):
                    pass
                return
            except urllib.error.HTTPError:
                return  # the webhook server answered (404 on /): TLS works
            except OSError:
                time.sleep(0.25)
        raise KareusError(f"kueue did not become ready in {STARTUP_TIMEOUT_S:.0f} s: {last_lines(self.log)}")

    def stop(self) -> None:
        if self.process is None:
            return
        for kind, name in zip(("mutatingwebhookconfiguration", "validatingwebhookconfiguration"), WEBHOOK_NAMES,
                              strict=True):
            self.control_plane.run_kubectl("delete", kind, name, "--ignore-not-found", check=False)
        stop_process(self.process)
        self.process = None


def quota_objects(name: str, gpus: int, namespaces: list[str], *, preemption: bool = True) -> list[dict[str, Any]]:
    """A ResourceFlavor, a ClusterQueue with `gpus` nvidia.com/gpu of quota and a LocalQueue `name` in
    each namespace: the setup a platform team writes. Kueue admits only what its queue covers, and the
    GPU pods request memory too: CPU and memory are covered with quotas nothing here reaches."""
    unbounded = {"cpu": "1000", "memory": "100Ti"}
    cluster_queue: dict[str, Any] = {
        "apiVersion": API, "kind": "ClusterQueue", "metadata": {"name": name},
        "spec": {"namespaceSelector": {},
                 "resourceGroups": [{"coveredResources": ["cpu", "memory", "nvidia.com/gpu"], "flavors": [
                     {"name": name, "resources": [
                         *({"name": resource, "nominalQuota": quota} for resource, quota in unbounded.items()),
                         {"name": "nvidia.com/gpu", "nominalQuota": gpus}]}]}]}}
    if preemption:
        cluster_queue["spec"]["preemption"] = {"withinClusterQueue": "LowerPriority"}
    return [{"apiVersion": API, "kind": "ResourceFlavor", "metadata": {"name": name}}, cluster_queue,
            *({"apiVersion": API, "kind": "LocalQueue", "metadata": {"name": name, "namespace": namespace},
               "spec": {"clusterQueue": name}} for namespace in namespaces)]
