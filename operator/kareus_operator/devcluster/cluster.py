"""The dev cluster: API emulator + pod runner + Kareus operator + node daemon, on one machine.

`DevCluster` is the library API (async; `async with DevCluster(workdir) as cluster:`), and
`DevClusterProcess` runs the same thing as a subprocess (`kareus dev-cluster`) for synchronous tests
and for people: it writes a kubeconfig that the official `kubernetes` client, kopf and kubectl can
use, and prints `ready` once the CRD is registered and the operator has been started.

The operator and the node daemon are real subprocesses (`kareus-operator run`, `kareus-node
--backend sim --standalone`), so a test can kill and restart the operator at any moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import kmock
import yaml
from aiohttp.test_utils import RawTestServer

from kareus.errors import KareusError
from kareus_operator.devcluster.emulator import CRD_RESOURCE, NAMESPACES, ApiEmulator
from kareus_operator.devcluster.podrunner import NODE_NAME, PodRunner

NODE_GPUS = 8  # the dev cluster's one node: 8 simulated A100s behind its node daemon
NODE_GPU_PRODUCT = "A100-SXM4-40GB"

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CRD = REPO_ROOT / "crds" / "kareusjob.yaml"
NODES = kmock.resource("", "v1", "nodes")
DEFAULT_NAMESPACES = ("default", "kareus-system")
DAEMON_SOCKET_DIR = "/var/run/kareus"  # hostPath on the node; under the dev node's host root here


def make_certificate(directory: Path) -> tuple[Path, Path] | None:
    """A self-signed serving certificate for 127.0.0.1/localhost (openssl), or None without openssl.

    kubectl sends bearer tokens only over TLS, so the dev API serves HTTPS whenever it can.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "apiserver.crt", directory / "apiserver.key"
    result = subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "30", "-subj", "/CN=kareus-dev-apiserver",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
         "-addext", "basicConstraints=critical,CA:TRUE"], capture_output=True, check=False)
    return (cert, key) if result.returncode == 0 else None


class _TlsServer(RawTestServer):
    """kmock's HTTP server with TLS (aiohttp takes the context at start, kmock passes none)."""

    def __init__(self, handler: Any, *, tls: ssl.SSLContext, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._tls = tls

    async def start_server(self, loop: asyncio.AbstractEventLoop | None = None, **kwargs: Any) -> None:
        await super().start_server(loop=loop, ssl=self._tls, **kwargs)


def write_kubeconfig(path: Path, server: str, token: str, ca_file: Path | None = None) -> None:
    cluster: dict[str, Any] = {"server": server}
    if ca_file is not None:
        cluster["certificate-authority"] = str(ca_file)
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "kareus-dev",
        "clusters": [{"name": "kareus-dev", "cluster": cluster}],
        "users": [{"name": "kareus-dev-admin", "user": {"token": token}}],
        "contexts": [{"name": "kareus-dev", "context": {"cluster": "kareus-dev", "user": "kareus-dev-admin",
                                                         "namespace": "default"}}],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)


def crd_validator() -> Any:
    """B's CRD schema engine (defaults, structural schema, CEL) as the emulator's admission check.

    As the API server does by default, fields the schema does not declare are pruned (dropped
    silently) rather than rejected; everything else the schema or a CEL rule rejects is a 422.
    An update that leaves `spec` as it was skips the CEL rules (the API server's validation
    ratcheting: unchanged values that were valid stay valid), which keeps frequent status writes cheap.
    """
    from kareus_operator import crdschema

    ratcheted: dict[int, dict[str, Any]] = {}

    def validate(crd: Mapping[str, Any], obj: dict[str, Any], old: Mapping[str, Any] | None) -> list[str]:
        stored = crdschema.prepare(dict(crd), obj)
        version = crdschema.served_version(dict(crd), obj.get("apiVersion"))
        if version is not None:
            schema = version["schema"]["openAPIV3Schema"]
            stored = {**prune_unknown(schema, {k: v for k, v in stored.items() if k != "metadata"}),
                      "apiVersion": stored.get("apiVersion"), "kind": stored.get("kind"),
                      "metadata": stored.get("metadata", {})}
        obj.clear()
        obj.update(stored)
        rules = dict(crd)
        if old is not None and stored.get("spec") == old.get("spec"):
            rules = ratcheted.setdefault(id(crd), _without_rules(dict(crd)))
        return crdschema.validate_object(rules, obj, dict(old) if old is not None else None)

    return validate


def _without_rules(value: Any) -> Any:
    """A copy of a CRD without its CEL rules."""
    if isinstance(value, dict):
        return {k: _without_rules(v) for k, v in value.items() if k != "x-kubernetes-validations"}
    if isinstance(value, list):
        return [_without_rules(v) for v in value]
    return value


def prune_unknown(schema: Mapping[str, Any], value: Any) -> Any:
    """Drop fields a structural schema does not declare (the API server's pruning)."""
    if isinstance(value, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return value
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        out = {}
        for key, item in value.items():
            sub = properties.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                out[key] = prune_unknown(sub, item)
        return out
    if isinstance(value, list):
        return [prune_unknown(schema.get("items") or {}, item) for item in value]
    return value


class DevCluster:
    """Start/stop everything in this event loop; see the module docstring."""

    def __init__(self, workdir: str | Path, *, kubeconfig: str | Path | None = None,
                 crd_path: str | Path | None = DEFAULT_CRD, operator: bool = True, node_daemon: bool = True,
                 operator_args: Sequence[str] = (), operator_env: Mapping[str, str] | None = None,
                 pod_env: Mapping[str, str] | None = None, pod_slots: int | None = None,
                 tls: bool = True) -> None:
        self.workdir = Path(workdir)
        self.kubeconfig = Path(kubeconfig) if kubeconfig else self.workdir / "kubeconfig"
        self.crd_path = Path(crd_path) if crd_path else None
        self.want_operator, self.want_node_daemon = operator, node_daemon
        self.operator_args, self.operator_env = list(operator_args), dict(operator_env or {})
        self.api = ApiEmulator()
        self.token = self.api.new_token()
        self.pod_env = dict(pod_env or {})
        self.pod_slots = pod_slots
        self.tls = tls
        self.ca_file: Path | None = None
        self.server: kmock.Server | None = None
        self.runner: PodRunner | None = None
        self.operator_process: subprocess.Popen | None = None
        self.node_process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.url).rstrip("/")

    @property
    def host_root(self) -> Path:
        return self.workdir / "node" / "host"

    async def __aenter__(self) -> DevCluster:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(ImportError):
            self.api.custom_validator = crd_validator()
        await self.api.__aenter__()
        pair = make_certificate(self.workdir / "pki") if self.tls else None
        if pair is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(*pair)
            self.ca_file = pair[0]
            self.server = kmock.Server(self.api, server_cls=functools.partial(_TlsServer, tls=context))
        else:
            self.server = kmock.Server(self.api)
        await self.server.__aenter__()
        self.api.resources.load_bundled()
        for namespace in DEFAULT_NAMESPACES:
            await self.api.create(NAMESPACES, None, {"metadata": {"name": namespace}})
        await self.api.create(NODES, None, {"metadata": {"name": NODE_NAME, "labels": {
            "kubernetes.io/hostname": NODE_NAME, "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": f"NVIDIA-{NODE_GPU_PRODUCT}"}},
            "status": {"capacity": {"nvidia.com/gpu": str(NODE_GPUS)},
                       "allocatable": {"nvidia.com/gpu": str(NODE_GPUS)}}})
        if self.crd_path is not None:
            if not self.crd_path.exists():
                raise KareusError(f"CRD file {self.crd_path} not found; pass --crd PATH (crds/kareusjob.yaml)")
            for doc in yaml.safe_load_all(self.crd_path.read_text()):
                if doc:
                    await self.api.create(CRD_RESOURCE, None, doc)
        write_kubeconfig(self.kubeconfig, self.url, self.token, self.ca_file)
        self.runner = PodRunner(self.api, self.workdir / "node", api_url=self.url, host_root=self.host_root,
                                extra_env=self.pod_env, pod_slots=self.pod_slots, ca_file=self.ca_file,
                                gpu_uuids=node_gpu_uuids())
        await self.runner.start()
        if self.want_node_daemon:
            self.node_process = self._start_node_daemon()
        if self.want_operator:
            self.start_operator()

    def start_operator(self) -> subprocess.Popen:
        """(Re)start the operator subprocess; its log goes to workdir/operator.log."""
        env = {**os.environ, **self.operator_env}
        env.setdefault("KAREUS_OPERATOR_NODE_SOCKET_DIR", DAEMON_SOCKET_DIR)
        log = open(self.workdir / "operator.log", "ab")  # noqa: SIM115  (owned by the process)
        self.operator_process = subprocess.Popen(
            [sys.executable, "-m", "kareus_operator.main", "run", "--kubeconfig", str(self.kubeconfig),
             *self.operator_args], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        return self.operator_process

    def kill_operator(self) -> None:
        """SIGKILL, as a crashing pod or a node failure would."""
        _kill(self.operator_process, signal.SIGKILL)
        self.operator_process = None

    def _start_node_daemon(self) -> subprocess.Popen | None:
        exe = shutil.which("kareus-node", path=str(Path(sys.executable).parent))
        if exe is None:
            return None
        socket_dir = self.host_root / DAEMON_SOCKET_DIR.lstrip("/")
        socket_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "node-daemon.log", "ab")  # noqa: SIM115
        process = subprocess.Popen(
            [exe, "--backend", "sim", "--sim-gpus", str(NODE_GPUS), "--sim-product", NODE_GPU_PRODUCT,
             "--standalone", "--socket", str(socket_dir / "node.sock"),
             "--state-dir", str(self.workdir / "node" / "state"), "--node-name", NODE_NAME,
             "--metrics-address", "127.0.0.1", "--metrics-port", "0"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return process

    async def stop(self) -> None:
        # Both at once: the node daemon must not outlive the cluster however long the operator takes.
        _kill_all([self.operator_process, self.node_process])
        if self.runner is not None:
            await self.runner.stop()
            self.runner = None
        if self.server is not None:
            await self.server.__aexit__(None, None, None)
            self.server = None
        if self.api.active:
            await self.api.__aexit__(None, None, None)


def node_gpu_uuids() -> list[str]:
    """UUIDs of the node daemon's simulated GPUs (deterministic per node, model and index)."""
    from kareus.gpu import discover

    return [gpu.uuid for gpu in discover("sim", count=NODE_GPUS, product=NODE_GPU_PRODUCT, node=NODE_NAME)]


def _kill_all(processes: Sequence[subprocess.Popen | None], grace_s: float = 5.0) -> None:
    """SIGTERM every process group, then SIGKILL what is left after the grace period."""
    alive = [p for p in processes if p is not None and p.poll() is None]
    for process in alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in alive:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _kill(process: subprocess.Popen | None, sig: int) -> None:
    if process is None or process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


async def serve(workdir: Path, kubeconfig: Path, **options: Any) -> None:
    """Run a dev cluster until SIGINT/SIGTERM; prints `ready` once it serves."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with DevCluster(workdir, kubeconfig=kubeconfig, **options) as cluster:
        print(f"API {cluster.url}, kubeconfig {cluster.kubeconfig}", flush=True)
        print("ready", flush=True)
        await stop.wait()


class DevClusterProcess:
    """`kareus dev-cluster` as a subprocess, for synchronous callers (tests, scripts)."""

    def __init__(self, workdir: str | Path, *, extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, startup_timeout_s: float = 60.0) -> None:
        self.workdir = Path(workdir)
        self.kubeconfig = self.workdir / "kubeconfig"
        self.extra_args, self.env, self.startup_timeout_s = list(extra_args), dict(env or {}), startup_timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> DevClusterProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kareus", "dev-cluster", "--kubeconfig", str(self.kubeconfig),
             "--workdir", str(self.workdir), *self.extra_args],
            stdout=subprocess.PIPE, stderr=open(self.workdir / "dev-cluster.log", "ab"),
            env={**os.environ, **self.env}, start_new_session=True, text=True)
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
        # The dev cluster needs up to its own grace period to stop the operator and the node daemon.
        _kill_all([self.process], grace_s=20.0)
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()
