"""The dev cluster's kubelet: pods run as local processes.

A pod that appears in the emulator is bound to the dev node, its volumes are materialised in a
sandbox directory (ConfigMap keys as files, refreshed when the ConfigMap changes as the kubelet
does; `emptyDir`; `hostPath` under the dev node's host root), and each container's command runs with
the pod's environment. There are no mount namespaces, so a mount path is translated: wherever it
appears at the start of an argument, an environment value or the working directory, the sandbox
path replaces it. Cluster DNS is equally simple: every `*.svc` name resolves to 127.0.0.1, because
all pods share the loopback interface.

Pods get the API's address (`KUBERNETES_SERVICE_HOST/PORT`, plus `KAREUS_API_URL` with the
scheme) and a service-account token and CA certificate in a directory named by
`KAREUS_SERVICEACCOUNT_DIR`. Status goes Pending → Running → Succeeded/Failed with container
states and exit codes; logs are kept per container and served through `/pods/NAME/log`. Deleting a
pod terminates its processes (SIGTERM, then SIGKILL after the grace period).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kmock

from kareus_operator.devcluster.emulator import PODS as PODS_RESOURCE
from kareus_operator.devcluster.emulator import ApiEmulator, ApiError, now_iso

CONFIGMAPS = kmock.resource("", "v1", "configmaps")
NODE_NAME = "kareus-dev-node"
_GRACE_S = 2.0
_SVC_NAME = re.compile(r"^[a-z0-9.-]+\.svc(\.cluster\.local)?$")
_PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "TMPDIR")


@dataclass
class RunningPod:
    """What the runner knows about one pod it started."""

    namespace: str
    name: str
    uid: str
    sandbox: Path
    processes: list[asyncio.subprocess.Process] = field(default_factory=list)
    task: asyncio.Task | None = None
    configmaps: dict[str, Path] = field(default_factory=dict)  # ConfigMap name -> directory
    host_paths: dict[str, Path] = field(default_factory=dict)  # volume name -> host directory
    gpus: list[str] = field(default_factory=list)  # UUIDs of the node's GPUs allocated to the pod


class PodRunner:
    """Runs every pod of the emulator on this machine; `start()` subscribes, `stop()` kills all."""

    def __init__(self, api: ApiEmulator, root: Path, *, api_url: str, host_root: Path | None = None,
                 extra_env: Mapping[str, str] | None = None, pod_slots: int | None = None,
                 ca_file: Path | None = None, gpu_uuids: Sequence[str] = ()) -> None:
        self.api, self.root, self.api_url = api, Path(root), api_url
        self.host_root = Path(host_root) if host_root else self.root / "host"
        self.extra_env = dict(extra_env or {})
        self.ca_file = ca_file
        self.pods: dict[str, RunningPod] = {}  # by uid
        self._tasks: list[asyncio.Task] = []
        self._stopping: set[asyncio.Task] = set()
        self._finished_logs: dict[tuple[str, str], Path] = {}
        # The node's capacity: pods beyond it wait in Pending, as on a full node.
        self._slots = asyncio.Semaphore(pod_slots) if pod_slots else None
        # The node's GPUs, handed out whole to pods that request `nvidia.com/gpu`, as the NVIDIA
        # device plugin does; a pod sees its own in NVIDIA_VISIBLE_DEVICES.
        self.gpu_uuids = tuple(gpu_uuids)
        self._free_gpus = list(self.gpu_uuids)
        self._gpus_freed = asyncio.Condition()
        api.log_reader = self.read_log

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow_pods()), asyncio.create_task(self._follow_configmaps())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(self._terminate(pod) for pod in list(self.pods.values())), return_exceptions=True)

    # ------------------------------------------------------------------ watching

    async def _follow_pods(self) -> None:
        async for event in self.api.watch_events(PODS_RESOURCE, None):
            pod = event["object"]
            uid = pod["metadata"]["uid"]
            gone = event["type"] == "DELETED" or pod["metadata"].get("deletionTimestamp")
            if gone:
                if uid in self.pods:
                    stopping = asyncio.create_task(self._terminate(self.pods.pop(uid)))
                    self._stopping.add(stopping)
                    stopping.add_done_callback(self._stopping.discard)
                continue
            phase = (pod.get("status") or {}).get("phase")
            if uid not in self.pods and phase in (None, "Pending"):
                running = RunningPod(pod["metadata"]["namespace"], pod["metadata"]["name"], uid,
                                     self.root / "pods" / pod["metadata"]["namespace"] / f"{pod['metadata']['name']}-{uid[:8]}")
                self.pods[uid] = running
                running.task = asyncio.create_task(self._run(running, pod))

    async def _follow_configmaps(self) -> None:
        async for event in self.api.watch_events(CONFIGMAPS, None):
            if event["type"] == "DELETED":
                continue
            cm = event["object"]
            for pod in list(self.pods.values()):
                target = pod.configmaps.get(cm["metadata"]["name"])
                if target is not None and pod.namespace == cm["metadata"]["namespace"]:
                    _write_configmap(target, cm)

    # ------------------------------------------------------------------ one pod

    async def _run(self, pod: RunningPod, body: dict[str, Any]) -> None:
        wanted = _gpu_request(body)
        if wanted > len(self.gpu_uuids):
            with contextlib.suppress(ApiError):
                await self._set_status(pod, {"phase": "Failed", "reason": "OutOfnvidia.com/gpu", "message": (
                    f"pod requests {wanted} nvidia.com/gpu; the node has {len(self.gpu_uuids)}")})
            return
        try:
            if wanted:
                await self._allocate_gpus(pod, wanted)
            if self._slots is None:
                await self._run_admitted(pod, body)
                return
            async with self._slots:
                await self._run_admitted(pod, body)
        finally:
            await self._release_gpus(pod)

    async def _allocate_gpus(self, pod: RunningPod, wanted: int) -> None:
        """Wait (Pending) until `wanted` GPUs are free, then give them to the pod."""
        async with self._gpus_freed:
            await self._gpus_freed.wait_for(lambda: len(self._free_gpus) >= wanted)
            pod.gpus, self._free_gpus = self._free_gpus[:wanted], self._free_gpus[wanted:]

    async def _release_gpus(self, pod: RunningPod) -> None:
        if not pod.gpus:
            return
        async with self._gpus_freed:
            self._free_gpus += pod.gpus
            pod.gpus = []
            self._gpus_freed.notify_all()

    async def _run_admitted(self, pod: RunningPod, body: dict[str, Any]) -> None:
        try:
            await self._bind(pod)
            await self._prepare(pod, body)
            await self._set_status(pod, {"phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1",
                                         "startTime": now_iso(),
                                         "conditions": [{"type": "Ready", "status": "True"}]})
            spec = body.get("spec", {})
            env_base = self._env(pod, body)
            codes: dict[str, int] = {}
            for container in spec.get("initContainers", []) or []:
                codes[container["name"]] = code = await self._exec(pod, container, env_base)
                if code != 0:
                    break
            else:
                results = await asyncio.gather(*(self._exec(pod, c, env_base) for c in spec.get("containers", [])))
                codes.update(zip((c["name"] for c in spec.get("containers", [])), results, strict=True))
            failed = any(code != 0 for code in codes.values())
            await self._set_status(pod, {
                "phase": "Failed" if failed else "Succeeded",
                "conditions": [{"type": "Ready", "status": "False"}],
                "containerStatuses": [
                    {"name": name, "ready": False, "restartCount": 0,
                     "state": {"terminated": {"exitCode": code, "reason": "Error" if code else "Completed",
                                              "finishedAt": now_iso()}}}
                    for name, code in codes.items()]})
        except ApiError:
            pass  # the pod is gone while we were starting or finishing it
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a pod the runner cannot start fails, like a kubelet's
            with contextlib.suppress(ApiError):
                await self._set_status(pod, {"phase": "Failed", "reason": "RunnerError", "message": str(error)})

    async def _bind(self, pod: RunningPod) -> None:
        body = self.api.get(PODS_RESOURCE, pod.namespace, pod.name)
        if not body.get("spec", {}).get("nodeName"):
            await self.api.patch(PODS_RESOURCE, pod.namespace, pod.name, {"spec": {"nodeName": NODE_NAME}},
                                 "application/merge-patch+json")

    async def _prepare(self, pod: RunningPod, body: dict[str, Any]) -> None:
        """Materialise volumes, waiting (as a kubelet does) for ConfigMaps that do not exist yet."""
        pod.sandbox.mkdir(parents=True, exist_ok=True)
        (pod.sandbox / "logs").mkdir(exist_ok=True)
        sa_dir = pod.sandbox / "serviceaccount"
        sa_dir.mkdir(exist_ok=True)
        (sa_dir / "token").write_text(self.api.new_token())
        (sa_dir / "namespace").write_text(pod.namespace)
        if self.ca_file is not None:
            shutil.copyfile(self.ca_file, sa_dir / "ca.crt")
        for volume in body.get("spec", {}).get("volumes", []) or []:
            target = pod.sandbox / "volumes" / volume["name"]
            if "configMap" in volume:
                name = volume["configMap"]["name"]
                while True:
                    try:
                        cm = self.api.get(CONFIGMAPS, pod.namespace, name)
                        break
                    except ApiError:
                        await asyncio.sleep(0.2)
                _write_configmap(target, cm)
                pod.configmaps[name] = target
            elif "hostPath" in volume:
                host = self.host_root / volume["hostPath"]["path"].lstrip("/")
                host.mkdir(parents=True, exist_ok=True)
                pod.host_paths[volume["name"]] = host  # used directly: Unix socket paths must stay short
            else:
                target.mkdir(parents=True, exist_ok=True)  # emptyDir and anything else: a fresh dir

    def _env(self, pod: RunningPod, body: dict[str, Any]) -> dict[str, str]:
        env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")])
        host, port = self.api_url.split("://", 1)[1].rsplit(":", 1)
        env.update({
            "KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port.rstrip("/"),
            "KAREUS_API_URL": self.api_url, "KAREUS_SERVICEACCOUNT_DIR": str(pod.sandbox / "serviceaccount"),
            "HOSTNAME": body.get("spec", {}).get("hostname") or pod.name, "OMP_NUM_THREADS": "1",
        })
        if pod.gpus:
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(pod.gpus)
        env.update(self.extra_env)
        return env

    async def _exec(self, pod: RunningPod, container: Mapping[str, Any], env_base: dict[str, str]) -> int:
        body = self.api.get(PODS_RESOURCE, pod.namespace, pod.name)
        mounts = self._mounts(pod, container)
        env = dict(env_base)
        for var in container.get("env", []) or []:
            env[var["name"]] = _translate(self._env_value(var, body, pod), mounts)
        argv = [_translate(a, mounts) for a in list(container.get("command", [])) + list(container.get("args", []))]
        if not argv:
            raise ValueError(f"container {container.get('name')!r} has no command (the dev cluster has no images)")
        workdir = Path(_translate(container["workingDir"], mounts)) if container.get("workingDir") else pod.sandbox
        workdir.mkdir(parents=True, exist_ok=True)
        log_path = pod.sandbox / "logs" / f"{container['name']}.log"
        self._finished_logs[(pod.namespace, pod.name)] = log_path
        with open(log_path, "ab") as log:
            try:
                process = await asyncio.create_subprocess_exec(
                    *argv, env=env, cwd=workdir, stdout=log, stderr=asyncio.subprocess.STDOUT,
                    stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
            except OSError as error:
                log.write(f"failed to start {argv[0]!r}: {error}\n".encode())
                return 127
        pod.processes.append(process)
        return await process.wait()

    def _mounts(self, pod: RunningPod, container: Mapping[str, Any]) -> list[tuple[str, str]]:
        pairs = []
        for mount in container.get("volumeMounts", []) or []:
            source = pod.host_paths.get(mount["name"], pod.sandbox / "volumes" / mount["name"])
            if mount.get("subPath"):
                source = source / mount["subPath"]
            pairs.append((mount["mountPath"].rstrip("/"), str(source)))
        return sorted(pairs, key=lambda p: -len(p[0]))  # longest mount path first

    def _env_value(self, var: Mapping[str, Any], body: Mapping[str, Any], pod: RunningPod) -> str:
        if "value" in var:
            value = str(var["value"])
            return "127.0.0.1" if _SVC_NAME.match(value) else value
        source = var.get("valueFrom", {})
        if "fieldRef" in source:
            current: Any = body
            for part in re.split(r"\.(?![^\[]*\])", source["fieldRef"]["fieldPath"]):
                if match := re.match(r"^(\w+)\['([^']+)'\]$", part):
                    current = (current.get(match.group(1)) or {}).get(match.group(2))
                else:
                    current = current.get(part) if isinstance(current, Mapping) else None
            if source["fieldRef"]["fieldPath"] in ("status.podIP", "status.hostIP"):
                return "127.0.0.1"
            return "" if current is None else str(current)
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            return self.api.get(CONFIGMAPS, pod.namespace, ref["name"]).get("data", {}).get(ref["key"], "")
        return ""

    async def _set_status(self, pod: RunningPod, status: dict[str, Any]) -> None:
        await self.api.patch(PODS_RESOURCE, pod.namespace, pod.name, {"status": status},
                             "application/merge-patch+json", "status")

    async def _terminate(self, pod: RunningPod) -> None:
        for process in pod.processes:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        for process in pod.processes:
            try:
                await asyncio.wait_for(process.wait(), _GRACE_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        if pod.task is not None and not pod.task.done():
            pod.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pod.task

    async def read_log(self, namespace: str, name: str, container: str | None) -> str | None:
        pod = next((p for p in self.pods.values() if (p.namespace, p.name) == (namespace, name)), None)
        if pod is not None:
            logs = sorted((pod.sandbox / "logs").glob(f"{container or '*'}.log"))
            return "".join(p.read_text(errors="replace") for p in logs) if logs else None
        path = self._finished_logs.get((namespace, name))
        return path.read_text(errors="replace") if path and path.exists() else None


def _gpu_request(body: Mapping[str, Any]) -> int:
    """Whole GPUs the pod asks for: the sum of its containers' `nvidia.com/gpu` limits."""
    containers = body.get("spec", {}).get("containers", []) or []
    return sum(int((c.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu", 0)) for c in containers)


def _translate(value: str, mounts: list[tuple[str, str]]) -> str:
    for mount_path, source in mounts:
        if value == mount_path or value.startswith(mount_path + "/"):
            return source + value[len(mount_path):]
        if "=" in value:  # --flag=/mount/path/file
            flag, _, rest = value.partition("=")
            if rest == mount_path or rest.startswith(mount_path + "/"):
                return f"{flag}={source}{rest[len(mount_path):]}"
    return value


def _write_configmap(target: Path, cm: Mapping[str, Any]) -> None:
    """Write every key as a file, atomically per file; keys that disappeared are removed."""
    target.mkdir(parents=True, exist_ok=True)
    data = dict(cm.get("data") or {})
    for key, text in data.items():
        tmp = target / f".{key}.tmp"
        tmp.write_text(text)
        os.replace(tmp, target / key)
    for stale in target.iterdir():
        if not stale.name.startswith(".") and stale.name not in data:
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()
