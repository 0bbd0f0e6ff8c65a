"""An emulated GPU node: a kubelet stand-in that runs the pods the real scheduler binds to it.

What a kubelet does, and this does, against the real API server with the node's own credentials
(`system:node:<name>` in `system:nodes`, so the Node authorizer and NodeRestriction admission
apply to it as to a kubelet):

- registers its Node: `nvidia.com/gpu` capacity, the labels NVIDIA's GPU Feature Discovery sets
  (`nvidia.com/gpu.present`, `.product`, `.count`, `.memory`, `.family`, …), optionally the
  `nvidia.com/gpu:NoSchedule` taint, addresses and the kubelet endpoint; renews its Lease every
  10 s and its NodeStatus (Ready) every 20 s, so node lifecycle never evicts it;
- runs every pod bound to it: volumes (ConfigMap, Secret, projected service-account token through
  the TokenRequest API with the kube-root-ca.crt bundle and the namespace, downward API, emptyDir,
  hostPath under the node's own root directory), environment (values, `$(VAR)` expansion,
  fieldRef incl. labels/annotations, resourceFieldRef, ConfigMap/Secret keys, envFrom), init
  containers then containers, restart policies with back-off, and full status: phase, conditions,
  hostIP/podIP, and per container image, imageID, containerID, state, last state, exit code,
  restart count;
- honours graceful deletion (SIGTERM, the pod's grace period, SIGKILL, then the final delete);
- serves `containerLogs` to the API server over TLS, so `kubectl logs` works, authenticating the
  API server's client certificate against the cluster CA;
- allocates GPUs to containers as the NVIDIA device plugin does (whole GPUs by UUID,
  `NVIDIA_VISIBLE_DEVICES`), and exposes them as the NVIDIA container runtime does: a container
  whose `NVIDIA_VISIBLE_DEVICES` names GPUs (or `all`) gets `KAREUS_SIM_GPU_DIR`, the node's
  directory of simulated GPU state files, so the node agent and the pods given a GPU read and
  account on one shared device (`kareus.gpu.simdevice`); it serves the kubelet's pod-resources gRPC API on
  `<root>/var/lib/kubelet/pod-resources/kubelet.sock`, which the node daemon reads as on a real node;
- puts each container's processes in a `kubepods/…/pod<uid>/<container>` cgroup (pids hierarchy)
  when the machine lets it, so the node daemon's pid → pod lookup works as on a real node.

What it cannot do, and the docs say so: there are no images (a container's `command` runs from the
local PATH; one without a command fails with CreateContainerError), no mount or network
namespaces (every pod shares the host network; mount paths are translated where they appear at the
start of an argument, an environment value or the working directory, and the service-account
volume is named in `KAREUS_SERVICEACCOUNT_DIR`), no users (`runAsUser` is recorded, not applied),
no resource limits, no probes other than "running means ready", and `*.svc` names resolve to
127.0.0.1 (there is no cluster DNS and no kube-proxy).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import ssl
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kareus_devcluster.pki import KeyPair
from kareus_operator.kube import ApiError, Credentials, Kube

log = logging.getLogger("kareus.devcluster.kubelet")

LEASE_RENEW_S = 10.0
STATUS_REPORT_S = 20.0
CONFIGMAP_REFRESH_S = 1.0
MAX_BACKOFF_S = 30.0
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
POD_RESOURCES_DIR = "/var/lib/kubelet/pod-resources"
GPU_RESOURCE = "nvidia.com/gpu"
_SVC_NAME = re.compile(r"^[a-z0-9.-]+\.svc(\.cluster\.local)?$")
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")
_PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "TMPDIR",
               "KAREUS_KUBE_BIN", "KAREUS_KUBE_CACHE")
CGROUP_ROOT = Path("/sys/fs/cgroup/pids")


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class NodeSpec:
    """What the node looks like to the cluster."""

    name: str
    gpus: int = 8
    gpu_product: str = "A100-SXM4-40GB"
    gpu_memory_mib: int = 40960
    gpu_uuids: tuple[str, ...] = ()
    taint_gpus: bool = False
    cpu: str = "16"
    memory: str = "128Gi"
    max_pods: int = 110
    # Every pod of the node has this address (no network namespaces): a loopback address of its own
    # per node, so two nodes' pods can listen on the same port as on two machines.
    address: str = "127.0.0.1"
    labels: Mapping[str, str] = field(default_factory=dict)

    def node_labels(self) -> dict[str, str]:
        labels = {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux",
                  "kubernetes.io/arch": "amd64", "node.kubernetes.io/instance-type": "kareus-dev"}
        if self.gpus:
            product = self.gpu_product if self.gpu_product.startswith("NVIDIA") else f"NVIDIA-{self.gpu_product}"
            labels |= {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": product,
                       "nvidia.com/gpu.count": str(self.gpus), "nvidia.com/gpu.memory": str(self.gpu_memory_mib),
                       "nvidia.com/gpu.family": _gpu_family(self.gpu_product), "nvidia.com/gpu.machine": "kareus-dev",
                       "nvidia.com/mig.capable": "false", "nvidia.com/gpu.sharing-strategy": "none"}
        return labels | dict(self.labels)


def _gpu_family(product: str) -> str:
    families = {"A100": "ampere", "A10": "ampere", "A30": "ampere", "H100": "hopper", "H200": "hopper",
                "B200": "blackwell", "L4": "ada-lovelace", "L40": "ada-lovelace", "V100": "volta"}
    for prefix, family in families.items():
        if prefix in product.upper():
            return family
    return "unknown"


@dataclass
class Container:
    """One container's run: its process, restarts and what its status reports."""

    spec: Mapping[str, Any]
    init: bool
    container_id: str = ""
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    gpus: list[str] = field(default_factory=list)
    log_path: Path | None = None
    cgroup: Path | None = None

    @property
    def name(self) -> str:
        return self.spec["name"]

    def status(self, pod_spec: Mapping[str, Any]) -> dict[str, Any]:
        image = self.spec.get("image") or "kareus-dev/none"
        running = "running" in self.state
        out = {"name": self.name, "image": image, "imageID": image_id(image), "ready": running and not self.init,
               "started": running, "restartCount": self.restarts, "state": self.state,
               "lastState": self.last_state}
        if self.container_id:
            out["containerID"] = self.container_id
        return out


@dataclass
class PodRun:
    """A pod this node is running."""

    namespace: str
    name: str
    uid: str
    sandbox: Path
    body: dict[str, Any]
    containers: dict[str, Container] = field(default_factory=dict)
    task: asyncio.Task | None = None
    configmaps: dict[str, tuple[Path, Mapping[str, Any]]] = field(default_factory=dict)  # volume → (dir, source)
    mounts: dict[str, Path] = field(default_factory=dict)  # volume name → directory
    terminating: bool = False
    start_time: str = ""
    phase: str = "Pending"
    reason: str = ""
    message: str = ""


class EmulatedNode:
    """One node; `await start()` registers it and begins running pods, `await stop()` ends them all."""

    def __init__(self, spec: NodeSpec, root: Path, *, server: str, ca_file: Path, identity: KeyPair,
                 serving: KeyPair, kubelet_port: int, extra_env: Mapping[str, str] | None = None) -> None:
        self.spec = spec
        self.root = Path(root)
        self.host_root = self.root / "host"
        self.server, self.ca_file = server, Path(ca_file)
        self.credentials = Credentials(server=server, ca_file=str(ca_file), cert_file=str(identity.cert_file),
                                       key_file=str(identity.key_file))
        self.serving, self.kubelet_port = serving, kubelet_port
        self.extra_env = dict(extra_env or {})
        self.pods: dict[str, PodRun] = {}  # by uid
        self.kube: Kube | None = None
        self._tasks: list[asyncio.Task] = []
        self._pending: set[asyncio.Task] = set()
        self._runner: web.AppRunner | None = None
        self._free_gpus = list(spec.gpu_uuids)
        self._grpc: Any = None
        self._cgroups = _cgroups_usable()
        self._cgroup_base = node_cgroup(spec.name, os.getpid()) / "kubepods"

    @property
    def sim_gpu_dir(self) -> Path:
        """The node's simulated GPUs: one state file each (counter, lock), like the node's /dev/nvidia*."""
        return self.host_root / "dev" / "kareus-sim-gpu"

    @property
    def pod_resources_socket(self) -> Path:
        return self.host_root / POD_RESOURCES_DIR.lstrip("/") / "kubelet.sock"

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.host_root.mkdir(parents=True, exist_ok=True)
        self.kube = await Kube(self.credentials).__aenter__()
        await self._serve_kubelet_api()
        self._serve_pod_resources()
        await self._register()
        self._tasks = [asyncio.create_task(self._keep_lease()), asyncio.create_task(self._keep_status()),
                       asyncio.create_task(self._follow_pods()), asyncio.create_task(self._refresh_configmaps())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(self._kill(pod, grace_s=2.0) for pod in list(self.pods.values())),
                             return_exceptions=True)
        for pod in list(self.pods.values()):
            if pod.task is not None:
                pod.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pod.task
        if self._grpc is not None:
            self._grpc.stop(grace=None)
        if self._runner is not None:
            await self._runner.cleanup()
        if self.kube is not None:
            await self.kube.__aexit__(None, None, None)
        remove_cgroups(self._cgroup_base.parent)

    # ------------------------------------------------------------------ node object

    def _node_status(self) -> dict[str, Any]:
        capacity = {"cpu": self.spec.cpu, "memory": self.spec.memory, "pods": str(self.spec.max_pods),
                    "ephemeral-storage": "100Gi"}
        if self.spec.gpus:
            capacity[GPU_RESOURCE] = str(self.spec.gpus)
        now = now_iso()
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kareus emulated kubelet is ready",
                 "lastHeartbeatTime": now, "lastTransitionTime": now}
        pressure = [{"type": kind, "status": "False", "reason": f"KubeletHasNo{kind}", "message": "", "lastHeartbeatTime": now,
                     "lastTransitionTime": now} for kind in ("MemoryPressure", "DiskPressure", "PIDPressure")]
        return {
            "capacity": capacity, "allocatable": dict(capacity), "conditions": [*pressure, ready],
            "addresses": [{"type": "InternalIP", "address": self.spec.address},
                          {"type": "Hostname", "address": self.spec.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
            "nodeInfo": {"machineID": hashlib.md5(self.spec.name.encode()).hexdigest(),
                         "systemUUID": hashlib.md5(self.spec.name.encode()).hexdigest(),
                         "bootID": str(os.getpid()), "kernelVersion": os.uname().release,
                         "osImage": "kareus emulated node", "containerRuntimeVersion": "kareus-dev://1",
                         "kubeletVersion": _kube_version(), "kubeProxyVersion": "", "operatingSystem": "linux",
                         "architecture": "amd64"},
        }

    async def _register(self) -> None:
        assert self.kube is not None
        taints = [{"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}] if self.spec.taint_gpus else []
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.spec.name, "labels": self.spec.node_labels()},
                "spec": {"taints": taints} if taints else {}, "status": self._node_status()}
        _, created = await self.kube.create("/api/v1/nodes", body)
        if not created:
            await self.kube.merge_patch(f"/api/v1/nodes/{self.spec.name}", {"metadata": {"labels": self.spec.node_labels()}})
        await self._report_status()

    async def _report_status(self) -> None:
        assert self.kube is not None
        await self.kube.request("PATCH", f"/api/v1/nodes/{self.spec.name}/status", {"status": self._node_status()},
                                content_type="application/strategic-merge-patch+json")

    async def _keep_status(self) -> None:
        while True:
            await asyncio.sleep(STATUS_REPORT_S)
            with contextlib.suppress(ApiError, aiohttp.ClientError, OSError):
                await self._report_status()

    async def _keep_lease(self) -> None:
        assert self.kube is not None
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.spec.name}"
        while True:
            try:
                node = await self.kube.get(f"/api/v1/nodes/{self.spec.name}")
                lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                         "metadata": {"name": self.spec.name, "namespace": "kube-node-lease", "ownerReferences": [
                             {"apiVersion": "v1", "kind": "Node", "name": self.spec.name,
                              "uid": (node or {}).get("metadata", {}).get("uid", "")}]},
                         "spec": {"holderIdentity": self.spec.name, "leaseDurationSeconds": 40,
                                  "renewTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}}
                existing = await self.kube.get(path)
                if existing is None:
                    await self.kube.request("POST", path.rsplit("/", 1)[0], lease)
                else:
                    lease["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
                    await self.kube.request("PUT", path, lease)
            except (ApiError, aiohttp.ClientError, OSError) as error:
                log.warning("node %s: lease renewal failed: %s", self.spec.name, error)
            await asyncio.sleep(LEASE_RENEW_S)

    # ------------------------------------------------------------------ pods

    async def _follow_pods(self) -> None:
        """List + watch the pods bound to this node (relisting on 410 Gone, as an informer does)."""
        assert self.kube is not None
        while True:
            try:
                async for event in self.kube.watch_events("/api/v1/pods",
                                                          {"fieldSelector": f"spec.nodeName={self.spec.name}"}):
                    if event["type"] == "DELETED":
                        self._on_deleted(event["object"])
                    else:
                        self._on_pod(event["object"])
            except asyncio.CancelledError:
                raise
            except (ApiError, aiohttp.ClientError, OSError, ValueError) as error:
                log.warning("node %s: pod watch failed (%s); relisting", self.spec.name, error)
                await asyncio.sleep(1.0)

    def _on_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        run = self.pods.get(meta["uid"])
        if run is None:
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                if meta.get("deletionTimestamp"):
                    self._background(self._finalize_delete(meta["namespace"], meta["name"], meta["uid"]))
                return  # finished before this node (re)started: nothing to run
            sandbox = self.root / "pods" / meta["namespace"] / f"{meta['name']}-{meta['uid'][:8]}"
            run = PodRun(meta["namespace"], meta["name"], meta["uid"], sandbox, pod)
            self.pods[meta["uid"]] = run
            run.task = asyncio.create_task(self._run_pod(run))
            return
        run.body = pod
        if meta.get("deletionTimestamp") and not run.terminating:
            run.terminating = True
            grace = meta.get("deletionGracePeriodSeconds")
            self._background(self._delete_gracefully(run, 30.0 if grace is None else float(grace)))

    def _background(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _on_deleted(self, pod: Mapping[str, Any]) -> None:
        run = self.pods.get(pod["metadata"]["uid"])
        if run is not None and not run.terminating:
            run.terminating = True  # force-deleted (grace 0): kill at once, nothing left to report
            self._background(self._kill_and_forget(run))

    async def _kill_and_forget(self, run: PodRun) -> None:
        await self._kill(run, grace_s=0.0)
        self._forget(run)

    def _release(self, run: PodRun) -> None:
        """A pod that ended gives its GPUs back (the device manager reclaims a terminated pod's
        devices) and its cgroups go; the scheduler already counts it out."""
        for container in run.containers.values():
            self._free_gpus += container.gpus
            container.gpus = []
            remove_cgroups(container.cgroup)

    def _forget(self, run: PodRun) -> None:
        self.pods.pop(run.uid, None)
        self._release(run)
        if run.task is not None and not run.task.done():
            run.task.cancel()

    async def _delete_gracefully(self, run: PodRun, grace_s: float) -> None:
        await self._kill(run, grace_s=grace_s)
        if run.task is not None and not run.task.done():
            run.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await run.task
        with contextlib.suppress(ApiError, aiohttp.ClientError, OSError):
            await self._patch_status(run)
        await self._finalize_delete(run.namespace, run.name, run.uid)
        self._forget(run)

    async def _finalize_delete(self, namespace: str, name: str, uid: str) -> None:
        """The kubelet's last word on a terminating pod: delete it now, this very object only."""
        assert self.kube is not None
        with contextlib.suppress(ApiError, aiohttp.ClientError, OSError):
            await self.kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}",
                                    {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}})

    async def _kill(self, run: PodRun, *, grace_s: float) -> None:
        processes = [c.process for c in run.containers.values() if c.process and c.process.returncode is None]
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        if processes:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(p.wait() for p in processes)), timeout=max(grace_s, 0.01))
        for process in processes:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()

    # ------------------------------------------------------------------ one pod's life

    async def _run_pod(self, run: PodRun) -> None:
        spec = run.body.get("spec", {})
        run.start_time = now_iso()
        run.containers = {c["name"]: Container(c, init=True) for c in spec.get("initContainers") or []}
        run.containers |= {c["name"]: Container(c, init=False) for c in spec.get("containers") or []}
        try:
            if not self._allocate_gpus(run):
                run.phase, run.reason = "Failed", "UnexpectedAdmissionError"
                run.message = f"Allocate failed due to requested number of devices unavailable for {GPU_RESOURCE}"
                await self._patch_status(run)
                return
            await self._patch_status(run)
            await self._prepare_volumes_retrying(run)
            policy = spec.get("restartPolicy", "Always")
            for container in (c for c in run.containers.values() if c.init):
                while True:
                    code = await self._run_container(run, container)
                    if code == 0:
                        break
                    if policy == "Never":
                        run.phase, run.reason = "Failed", ""
                        await self._patch_status(run)
                        return
                    await self._back_off(run, container)
            run.phase = "Running"
            await asyncio.gather(*(self._keep_running(run, c, policy) for c in run.containers.values() if not c.init))
            codes = [_exit_code(c) for c in run.containers.values() if not c.init]
            run.phase = "Succeeded" if all(code == 0 for code in codes) else "Failed"
            await self._patch_status(run)
        except asyncio.CancelledError:
            raise
        except MountError as error:
            run.phase, run.reason, run.message = "Failed", "FailedMount", str(error)
            with contextlib.suppress(ApiError, aiohttp.ClientError, OSError):
                await self._patch_status(run)
        except (ApiError, aiohttp.ClientError, OSError) as error:
            log.warning("pod %s/%s: %s", run.namespace, run.name, error)
        finally:
            if run.phase in ("Succeeded", "Failed"):
                self._release(run)

    async def _keep_running(self, run: PodRun, container: Container, policy: str) -> None:
        while True:
            code = await self._run_container(run, container)
            if run.terminating or policy == "Never" or (policy == "OnFailure" and code == 0):
                return
            await self._back_off(run, container)

    async def _back_off(self, run: PodRun, container: Container) -> None:
        container.last_state = dict(container.state)
        container.state = {"waiting": {"reason": "CrashLoopBackOff",
                                       "message": f"back-off restarting failed container {container.name}"}}
        await self._patch_status(run)
        await asyncio.sleep(min(MAX_BACKOFF_S, 1.0 * 2 ** min(container.restarts, 5)))
        container.restarts += 1

    async def _run_container(self, run: PodRun, container: Container) -> int:
        spec = container.spec
        try:
            env = await self._environment(run, container)
        except MountError as error:
            container.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(error)}}
            await self._patch_status(run)
            return 128
        argv = [expand(arg, env) for arg in [*(spec.get("command") or []), *(spec.get("args") or [])]]
        mounts = self._mount_table(run, spec)
        argv = [translate(arg, mounts) for arg in argv]
        if not spec.get("command"):
            container.state = {"waiting": {"reason": "CreateContainerError", "message": (
                "the emulated node runs a container's command from the local PATH and has no images: "
                "this container sets no command")}}
            await self._patch_status(run)
            return 128
        workdir = Path(translate(spec["workingDir"], mounts)) if spec.get("workingDir") else run.sandbox
        workdir.mkdir(parents=True, exist_ok=True)
        container.log_path = run.sandbox / "logs" / f"{container.name}-{container.restarts}.log"
        container.log_path.parent.mkdir(parents=True, exist_ok=True)
        container.container_id = f"kareus-dev://{hashlib.sha256(f'{run.uid}/{container.name}/{container.restarts}'.encode()).hexdigest()}"
        container.cgroup = self._cgroup_for(run, container)
        started = now_iso()
        with open(container.log_path, "ab") as handle:
            try:
                container.process = await asyncio.create_subprocess_exec(
                    *_in_cgroup(container.cgroup, argv), env=env,
                    cwd=workdir, stdout=handle, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True)
            except OSError as error:
                handle.write(f"failed to start {argv[0]!r}: {error}\n".encode())
                container.state = {"terminated": {"exitCode": 128, "reason": "StartError", "message": str(error),
                                                  "startedAt": started, "finishedAt": now_iso(),
                                                  "containerID": container.container_id}}
                await self._patch_status(run)
                return 128
        container.state = {"running": {"startedAt": started}}
        await self._patch_status(run)
        code = await container.process.wait()
        exit_code = code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as runtimes report
        container.state = {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                          "startedAt": started, "finishedAt": now_iso(),
                                          "containerID": container.container_id}}
        message = termination_message(spec, container.log_path, exit_code)
        if message:
            container.state["terminated"]["message"] = message
        if not run.terminating:
            with contextlib.suppress(ApiError, aiohttp.ClientError, OSError):
                await self._patch_status(run)
        return exit_code

    def _allocate_gpus(self, run: PodRun) -> bool:
        """The device plugin's Allocate: whole GPUs per container, from the node's free ones."""
        wanted = {name: int(((c.spec.get("resources") or {}).get("limits") or {}).get(GPU_RESOURCE, 0))
                  for name, c in run.containers.items()}
        if sum(wanted.values()) > len(self._free_gpus):
            return False
        for name, count in wanted.items():
            run.containers[name].gpus, self._free_gpus = self._free_gpus[:count], self._free_gpus[count:]
        return True

    # ------------------------------------------------------------------ status

    async def _patch_status(self, run: PodRun) -> None:
        assert self.kube is not None
        spec = run.body.get("spec", {})
        inits = [c for c in run.containers.values() if c.init]
        mains = [c for c in run.containers.values() if not c.init]
        initialized = all("terminated" in c.state and c.state["terminated"]["exitCode"] == 0 for c in inits)
        ready = run.phase == "Running" and all("running" in c.state for c in mains)
        now = now_iso()

        def condition(kind: str, ok: bool, reason: str = "") -> dict[str, Any]:
            out = {"type": kind, "status": "True" if ok else "False", "lastProbeTime": None, "lastTransitionTime": now}
            if reason and not ok:
                out["reason"] = reason
            return out

        finished = "PodCompleted" if run.phase in ("Succeeded", "Failed") else "ContainersNotReady"
        status: dict[str, Any] = {
            "phase": run.phase, "hostIP": self.spec.address, "hostIPs": [{"ip": self.spec.address}],
            "podIP": self.spec.address, "podIPs": [{"ip": self.spec.address}], "startTime": run.start_time,
            "conditions": [condition("PodReadyToStartContainers", True), condition("Initialized", initialized,
                                                                               "ContainersNotInitialized"),
                           condition("Ready", ready, finished), condition("ContainersReady", ready, finished)],
            "containerStatuses": [c.status(spec) for c in mains],
        }
        if inits:
            status["initContainerStatuses"] = [c.status(spec) for c in inits]
        if run.reason:
            status["reason"], status["message"] = run.reason, run.message
        await self.kube.request("PATCH", f"/api/v1/namespaces/{run.namespace}/pods/{run.name}/status",
                                {"metadata": {"uid": run.uid}, "status": status},
                                content_type="application/strategic-merge-patch+json")

    # ------------------------------------------------------------------ volumes

    async def _prepare_volumes_retrying(self, run: PodRun) -> None:
        """Set the volumes up, retrying API refusals as the kubelet's pod sync does: right after a
        pod is bound, the Node authorizer may not know the node → pod relation yet (403 "no
        relationship found") for the token or a ConfigMap."""
        delay_s = 0.2
        while True:
            try:
                await self._prepare_volumes(run)
                return
            except ApiError as error:
                if run.terminating or error.code not in (403, 404, 429, 500, 503):
                    raise
                log.info("pod %s/%s: volumes not ready (%s); retrying in %.1f s", run.namespace, run.name, error, delay_s)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 5.0)

    async def _prepare_volumes(self, run: PodRun) -> None:
        assert self.kube is not None
        run.sandbox.mkdir(parents=True, exist_ok=True)
        for volume in run.body.get("spec", {}).get("volumes") or []:
            name = volume["name"]
            target = run.sandbox / "volumes" / name
            if "hostPath" in volume:
                run.mounts[name] = self._host_path(volume["hostPath"])
                continue
            target.mkdir(parents=True, exist_ok=True)
            run.mounts[name] = target
            if "configMap" in volume or "secret" in volume or "projected" in volume or "downwardAPI" in volume:
                files = await self._volume_files(run, volume)
                write_files(target, files)
                if "configMap" in volume or "projected" in volume:
                    run.configmaps[name] = (target, volume)

    def _host_path(self, source: Mapping[str, Any]) -> Path:
        path = self.host_root / source["path"].lstrip("/")
        kind = source.get("type", "")
        if kind == "DirectoryOrCreate" or (kind == "" and not path.exists()):
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "Directory" and not path.is_dir():
            raise MountError(f'hostPath type check failed: {source["path"]} is not a directory')
        elif kind == "FileOrCreate" and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        elif kind in ("File", "Socket") and not path.exists():
            raise MountError(f'hostPath type check failed: {source["path"]} does not exist')
        return path

    async def _volume_files(self, run: PodRun, volume: Mapping[str, Any]) -> dict[str, bytes]:
        """The files a ConfigMap/Secret/projected/downward-API volume holds, waiting for missing sources."""
        if "configMap" in volume:
            return await self._object_files(run, "configmaps", volume["configMap"])
        if "secret" in volume:
            return await self._object_files(run, "secrets", {**volume["secret"], "name": volume["secret"]["secretName"]})
        if "downwardAPI" in volume:
            return self._downward_files(run, volume["downwardAPI"].get("items") or [])
        files: dict[str, bytes] = {}
        for source in volume["projected"].get("sources") or []:
            if "serviceAccountToken" in source:
                token = source["serviceAccountToken"]
                files[token["path"]] = (await self._token(run, token)).encode()
            elif "configMap" in source:
                files |= await self._object_files(run, "configmaps", source["configMap"])
            elif "secret" in source:
                files |= await self._object_files(run, "secrets", source["secret"])
            elif "downwardAPI" in source:
                files |= self._downward_files(run, source["downwardAPI"].get("items") or [])
        return files

    async def _object_files(self, run: PodRun, plural: str, ref: Mapping[str, Any], *, wait: bool = True) -> dict[str, bytes]:
        assert self.kube is not None
        while True:
            obj = await self.kube.get(f"/api/v1/namespaces/{run.namespace}/{plural}/{ref['name']}")
            if obj is not None:
                break
            if ref.get("optional"):
                return {}
            if not wait:
                raise MountError(f"{plural[:-1]} {ref['name']!r} not found")
            await asyncio.sleep(0.5)  # the kubelet retries a missing ConfigMap/Secret until it appears
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()} if plural == "configmaps" else {
            k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        data |= {k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}
        items = ref.get("items")
        if not items:
            return data
        return {item["path"]: data[item["key"]] for item in items if item["key"] in data}

    def _downward_files(self, run: PodRun, items: Sequence[Mapping[str, Any]]) -> dict[str, bytes]:
        files = {}
        for item in items:
            if "fieldRef" in item:
                files[item["path"]] = field_value(run.body, item["fieldRef"]["fieldPath"], self.spec.address).encode()
        return files

    async def _token(self, run: PodRun, source: Mapping[str, Any]) -> str:
        """A bound service-account token for this pod, from the TokenRequest API (what the Node
        authorizer lets a node ask for the pods bound to it)."""
        assert self.kube is not None
        account = run.body["spec"].get("serviceAccountName") or "default"
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
            "audiences": [source["audience"]] if source.get("audience") else None,
            "expirationSeconds": int(source.get("expirationSeconds", 3607)),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": run.name, "uid": run.uid}}}
        answer = await self.kube.request("POST", f"/api/v1/namespaces/{run.namespace}/serviceaccounts/{account}/token",
                                         request)
        return answer["status"]["token"]

    async def _refresh_configmaps(self) -> None:
        """ConfigMap volumes follow their ConfigMaps, as the kubelet's periodic sync does."""
        while True:
            await asyncio.sleep(CONFIGMAP_REFRESH_S)
            for run in list(self.pods.values()):
                for target, volume in list(run.configmaps.values()):
                    with contextlib.suppress(ApiError, aiohttp.ClientError, OSError, MountError, KeyError):
                        if "configMap" in volume:
                            files = await self._object_files(run, "configmaps", volume["configMap"], wait=False)
                            write_files(target, files)

    # ------------------------------------------------------------------ environment

    def _mount_table(self, run: PodRun, spec: Mapping[str, Any]) -> list[tuple[str, str]]:
        pairs = []
        for mount in spec.get("volumeMounts") or []:
            source = run.mounts.get(mount["name"])
            if source is None:
                continue
            if mount.get("subPath"):
                source = source / mount["subPath"]
            pairs.append((mount["mountPath"].rstrip("/") or "/", str(source)))
        return sorted(pairs, key=lambda pair: -len(pair[0]))  # longest mount path first

    async def _environment(self, run: PodRun, container: Container) -> dict[str, str]:
        spec = container.spec
        env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")])
        host, port = self.server.split("://", 1)[1].rsplit(":", 1)
        env |= {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port,
                "KUBERNETES_SERVICE_PORT_HTTPS": port, "HOSTNAME": run.body["spec"].get("hostname") or run.name,
                "OMP_NUM_THREADS": "1"}
        mounts = self._mount_table(run, spec)  # the container's own values name paths inside it
        sa = next((source for path, source in mounts if path == SA_MOUNT), None)
        if sa is not None:
            env["KAREUS_SERVICEACCOUNT_DIR"] = sa
        if container.gpus:
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(container.gpus)  # what the NVIDIA container runtime reads
        for source in spec.get("envFrom") or []:
            prefix = source.get("prefix", "")
            ref = source.get("configMapRef") or source.get("secretRef") or {}
            data = await self._object_files(run, "configmaps" if "configMapRef" in source else "secrets", ref, wait=False)
            env |= {prefix + k: translate(v.decode(), mounts) for k, v in data.items()}
        for var in spec.get("env") or []:
            env[var["name"]] = translate(await self._env_value(run, container, var, env), mounts)
        env |= self.extra_env
        visible = env.get("NVIDIA_VISIBLE_DEVICES", "")
        if self.spec.gpus and visible and visible not in ("none", "void"):
            # The NVIDIA container runtime exposes the GPUs NVIDIA_VISIBLE_DEVICES names (the device
            # plugin's UUIDs, or `all` as the node agent asks); here a simulated GPU is a state file
            # in the node's device directory, shared by every container given it (kareus.gpu.simdevice).
            env["KAREUS_SIM_GPU_DIR"] = str(self.sim_gpu_dir)
        return env

    async def _env_value(self, run: PodRun, container: Container, var: Mapping[str, Any], env: Mapping[str, str]) -> str:
        if "value" in var:
            value = expand(str(var["value"]), env)
            return "127.0.0.1" if _SVC_NAME.match(value) else value
        source = var.get("valueFrom") or {}
        if "fieldRef" in source:
            return field_value(run.body, source["fieldRef"]["fieldPath"], self.spec.address)
        if "resourceFieldRef" in source:
            return resource_value(container.spec, source["resourceFieldRef"])
        for key, plural in (("configMapKeyRef", "configmaps"), ("secretKeyRef", "secrets")):
            if key in source:
                ref = source[key]
                data = await self._object_files(run, plural, ref, wait=False)
                if ref["key"] not in data and not ref.get("optional"):
                    raise MountError(f"couldn't find key {ref['key']} in {plural[:-1]} {run.namespace}/{ref['name']}")
                return data.get(ref["key"], b"").decode()
        return ""

    def _cgroup_for(self, run: PodRun, container: Container) -> Path | None:
        if not self._cgroups:
            return None
        qos = (run.body.get("status") or {}).get("qosClass", "BestEffort").lower()
        path = self._cgroup_base / qos / f"pod{run.uid}" / container.name
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        return path

    # ------------------------------------------------------------------ the kubelet's HTTPS API

    async def _serve_kubelet_api(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", lambda _request: web.Response(text="ok"))
        app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", self._logs)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.ca_file))
        context.load_cert_chain(str(self.serving.cert_file), str(self.serving.key_file))
        context.verify_mode = ssl.CERT_REQUIRED  # only the API server (its kubelet-client certificate) may ask
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.spec.address, self.kubelet_port, ssl_context=context).start()

    async def _logs(self, request: web.Request) -> web.StreamResponse:
        namespace, name, container_name = (request.match_info[k] for k in ("namespace", "pod", "container"))
        run = next((r for r in self.pods.values() if (r.namespace, r.name) == (namespace, name)), None)
        logs = sorted((self.root / "pods" / namespace).glob(f"{name}-*/logs/{container_name}-*.log"),
                      key=lambda p: (p.stat().st_mtime, p.name)) if run is None else sorted(
            (run.sandbox / "logs").glob(f"{container_name}-*.log"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        if not logs:
            return web.Response(status=404, text=f"container {container_name!r} in pod {namespace}/{name} has no log")
        previous = request.query.get("previous") == "true"
        path = logs[-2] if previous and len(logs) > 1 else logs[-1]
        text = path.read_bytes()
        if "tailLines" in request.query:
            lines = text.splitlines(keepends=True)
            text = b"".join(lines[-int(request.query["tailLines"]):]) if int(request.query["tailLines"]) else b""
        if "limitBytes" in request.query:
            text = text[: int(request.query["limitBytes"])]
        if request.query.get("follow") != "true" or run is None:
            return web.Response(body=text, content_type="text/plain")
        response = web.StreamResponse()
        response.content_type = "text/plain"
        await response.prepare(request)
        await response.write(text)
        offset = path.stat().st_size
        container = run.containers.get(container_name)
        while container is not None and container.process is not None and container.process.returncode is None:
            await asyncio.sleep(0.2)
            with open(path, "rb") as handle:
                handle.seek(offset)
                chunk = handle.read()
            if chunk:
                offset += len(chunk)
                await response.write(chunk)
        return response

    # ------------------------------------------------------------------ pod-resources gRPC

    def _serve_pod_resources(self) -> None:
        from concurrent import futures

        import grpc
        from kareus_node._proto import api_pb2, api_pb2_grpc

        node = self

        class Lister(api_pb2_grpc.PodResourcesListerServicer):
            def List(self, request: Any, context: Any) -> Any:
                pods = []
                for run in list(node.pods.values()):
                    containers = [api_pb2.ContainerResources(name=c.name, devices=[
                        api_pb2.ContainerDevices(resource_name=GPU_RESOURCE, device_ids=list(c.gpus))] if c.gpus else [])
                        for c in run.containers.values()]
                    pods.append(api_pb2.PodResources(name=run.name, namespace=run.namespace, containers=containers))
                return api_pb2.ListPodResourcesResponse(pod_resources=pods)

        self.pod_resources_socket.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.pod_resources_socket.unlink()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(Lister(), server)
        server.add_insecure_port(f"unix://{self.pod_resources_socket}")
        server.start()
        self._grpc = server


class MountError(Exception):
    """A volume the pod needs cannot be set up (the kubelet's FailedMount)."""


def image_id(image: str) -> str:
    """What a container runtime reports as the image's id; here a digest of the reference, since the
    emulated node pulls nothing."""
    name = image.split("@", 1)[0].rsplit(":", 1)[0] if "/" in image or ":" in image else image
    return f"{name}@sha256:{hashlib.sha256(image.encode()).hexdigest()}"


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined variables replaced, `$$` escapes, the rest kept."""
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR_REF.sub(replace, value)


def field_value(pod: Mapping[str, Any], field_path: str, address: str = "127.0.0.1") -> str:
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status") or {}
    if match := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", field_path):
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    simple = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
              "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
              "spec.serviceAccountName": spec.get("serviceAccountName"), "status.hostIP": address,
              "status.hostIPs": address, "status.podIP": address, "status.podIPs": address}
    if field_path in ("metadata.labels", "metadata.annotations"):
        return "\n".join(f'{k}="{v}"' for k, v in sorted((meta.get(field_path.split(".")[1]) or {}).items()))
    value = simple.get(field_path, status.get(field_path.removeprefix("status.")) if field_path.startswith("status.") else None)
    return "" if value is None else str(value)


def resource_value(container: Mapping[str, Any], ref: Mapping[str, Any]) -> str:
    kind, _, resource = ref["resource"].partition(".")
    value = ((container.get("resources") or {}).get(kind) or {}).get(resource)
    return "" if value is None else str(value)


def translate(value: str, mounts: Sequence[tuple[str, str]]) -> str:
    """A path inside the container → where the volume really is (no mount namespaces here)."""
    for mount_path, source in mounts:
        if value == mount_path or value.startswith(mount_path + "/"):
            return source + value[len(mount_path):]
        if "=" in value:  # --flag=/mount/path/file
            flag, _, rest = value.partition("=")
            if rest == mount_path or rest.startswith(mount_path + "/"):
                return f"{flag}={source}{rest[len(mount_path):]}"
    return value


def write_files(target: Path, files: Mapping[str, bytes]) -> None:
    """Every file atomically; files no longer in the source are removed (a ConfigMap volume's update)."""
    target.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        path = target / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    top = {Path(name).parts[0] for name in files}
    for stale in target.iterdir():
        if not stale.name.startswith(".") and stale.name not in top:
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()


def termination_message(spec: Mapping[str, Any], log_path: Path, exit_code: int) -> str:
    """The kubelet's termination message: the file at terminationMessagePath is not writable here
    (no mount namespace), so only `FallbackToLogsOnError` gives one — as the kubelet does, the
    log's last 80 lines, at most 2048 bytes, of a container that failed."""
    if exit_code == 0 or spec.get("terminationMessagePolicy") != "FallbackToLogsOnError":
        return ""
    try:
        lines = log_path.read_bytes().splitlines()[-80:]
    except OSError:
        return ""
    return b"\n".join(lines)[-2048:].decode(errors="replace")


def _exit_code(container: Container) -> int:
    return int(container.state.get("terminated", {}).get("exitCode", 1))


def node_cgroup(name: str, pid: int) -> Path:
    """The cgroup a node (by its process id) puts its pods under."""
    return CGROUP_ROOT / f"kareus-{name}-{pid}"


def _cgroups_usable() -> bool:
    probe = CGROUP_ROOT / f"kareus-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError:
        return False
    return True


def _in_cgroup(path: Path | None, argv: Sequence[str]) -> list[str]:
    """`argv` started inside the cgroup: a shell joins it, then execs the command, so the command and
    every process it forks are in it from their first instruction (no pre-exec hook in a threaded
    parent, no window in which a child could escape)."""
    if path is None:
        return list(argv)
    return ["/bin/sh", "-c", f'echo $$ > "{path}/cgroup.procs" && exec "$@"', "kareus-container", *argv]


def remove_cgroups(path: Path | None) -> None:
    """Kill what is left in a cgroup tree, then remove it bottom-up, as a kubelet tears a pod's
    cgroup down: a process that escaped its container's process group (a daemon, an orphan) dies too."""
    if path is None or not path.exists():
        return
    for procs in path.rglob("cgroup.procs"):
        with contextlib.suppress(OSError, ValueError):
            for pid in procs.read_text().split():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while any(procs.read_text().strip() for procs in path.rglob("cgroup.procs")) and time.monotonic() < deadline:
        time.sleep(0.05)
    for child in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):
            child.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()


def _kube_version() -> str:
    with contextlib.suppress(Exception):
        from kareus_devcluster.controlplane import kube_version

        return kube_version()
    return "v0.0.0"


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kareus_devcluster.kubelet CONFIG.json`: run one emulated node until SIGTERM.

    The node is its own process, as a kubelet is, so a test can stop one node without the others.
    Prints `ready` once the Node is registered and pods can run.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="kareus-dev-node")
    parser.add_argument("config", type=Path, help="node configuration written by DevCluster (JSON)")
    args = parser.parse_args(argv)
    config = json.loads(args.config.read_text())
    spec = NodeSpec(**{**config["spec"], "gpu_uuids": tuple(config["spec"]["gpu_uuids"])})
    node = EmulatedNode(spec, Path(config["root"]), server=config["server"], ca_file=Path(config["ca_file"]),
                        identity=KeyPair(Path(config["cert_file"]), Path(config["key_file"])),
                        serving=KeyPair(Path(config["serving_cert_file"]), Path(config["serving_key_file"])),
                        kubelet_port=int(config["kubelet_port"]), extra_env=config.get("extra_env"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await node.start()
        print("ready", flush=True)
        try:
            await stop.wait()
        finally:
            await node.stop()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
