"""`kareus-node`: the command line of the node daemon.

Wires the parts together — GPUs from `kareus.gpu` (NVML, or simulated with `--backend sim`), an
authorizer (the kubelet's view, or `--standalone` with an allow-list; with `--listen-tcp` also the
TokenReview one for TCP callers), the journal in `--state-dir`, the policy file, the metrics
endpoint — restores what a previous instance left locked, then serves until SIGTERM/SIGINT, when
it resets every GPU it still holds.
Once serving it prints one line: ``kareus-node: serving socket=… tcp=host:port metrics=http://host:port
health=http://127.0.0.1:port …``. The health server (the kubelet's probes) listens on localhost only.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from kareus import incluster as in_cluster
from kareus.errors import KareusError
from kareus.gpu import BACKENDS, discover
from kareus_node.auth import (
    TOKEN_AUDIENCE,
    Authorizer,
    KubeletAuthorizer,
    StandaloneAuthorizer,
    TokenAuthorizer,
    load_allow_list,
)
from kareus_node.ceilings import ClockCeilings
from kareus_node.config import NodeConfig, load_config
from kareus_node.identity import enter_host_cgroup_namespace
from kareus_node.journal import Journal, JournalError
from kareus_node.jwks import TokenVerifier
from kareus_node.kubeapi import KubeAPI
from kareus_node.metrics import DaemonMetrics, serve_http
from kareus_node.metrics_auth import MetricsAuthorizer
from kareus_node.podresources import DEFAULT_SOCKET, PodResourcesClient
from kareus_node.pods import PodDirectory
from kareus_node.server import Daemon

log = logging.getLogger("kareus_node")

DEFAULT_DAEMON_SOCKET = "/run/kareus/node.sock"
DEFAULT_STATE_DIR = "/var/lib/kareus-node"
DEFAULT_METRICS_PORT = 9402
DEFAULT_HEALTH_PORT = 0  # a free port; the chart sets a fixed one for its probes
HEALTH_ADDRESS = "127.0.0.1"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kareus-node", description="Kareus node daemon: authorised GPU clock control and GPU metrics.")
    parser.add_argument("--socket", default=DEFAULT_DAEMON_SOCKET, help="Unix socket of the local API")
    parser.add_argument("--listen-tcp", metavar="HOST:PORT", type=_host_port, default=None,
                        help="also serve the API on TCP (callers authenticate with a ServiceAccount token; cluster mode)")
    parser.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="where the lease journal lives (hostPath)")
    parser.add_argument("--backend", choices=BACKENDS, default="nvml", help="GPU backend")
    parser.add_argument("--sim-gpus", type=_positive_int, default=1, help="number of simulated GPUs (--backend sim)")
    parser.add_argument("--sim-product", default="A100-SXM4-40GB", help="simulated GPU model (--backend sim)")
    parser.add_argument("--sim-mig", default="", help="comma-separated indices of simulated GPUs with MIG enabled")
    parser.add_argument("--sim-device-dir", default=os.environ.get("KAREUS_SIM_GPU_DIR") or None,
                        help="the node's shared simulated GPUs (one state file each, which the pods allocated them "
                             "account their work on; default $KAREUS_SIM_GPU_DIR, which the dev cluster's device "
                             "plugin sets); without it the simulated GPUs are this process's own (--backend sim)")
    parser.add_argument("--standalone", action="store_true", help="no kubelet: authorise by uid/gid allow-list")
    parser.add_argument("--allow-list", help="standalone allow-list file (default: only this daemon's uid, all GPUs)")
    parser.add_argument("--config", help="policy file (YAML; see docs/node-daemon.md)")
    parser.add_argument("--node-name", default=os.environ.get("NODE_NAME") or socket.gethostname())
    parser.add_argument("--dry-run", action="store_true", help="observe only: never change a clock")
    parser.add_argument("--pod-resources-socket", default=DEFAULT_SOCKET, help="kubelet pod-resources socket")
    parser.add_argument("--kube-api", default=None, help="API server URL (default: in-cluster)")
    parser.add_argument("--proc-root", default="/proc", help="where to read /proc/<pid>/cgroup (hostPID)")
    parser.add_argument("--clock-ceilings", metavar="NAMESPACE/NAME", type=_namespaced_name, default=None,
                        help="enforce the per-pod clock ceilings the operator publishes in this ConfigMap (cluster mode)")
    parser.add_argument("--metrics-address", default="0.0.0.0", help="address of the metrics endpoint")
    parser.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT, help="0 picks a free port")
    parser.add_argument("--metrics-auth", choices=("none", "tokenreview"), default="none",
                        help="tokenreview: /metrics needs a bearer token whose user RBAC lets get /metrics")
    parser.add_argument("--health-port", type=int, default=DEFAULT_HEALTH_PORT,
                        help="/healthz and /readyz on 127.0.0.1 for the kubelet's probes (default 0: a free port)")
    parser.add_argument("--log-format", choices=("json", "text"), default="text")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_format, args.log_level)
    if not args.standalone:
        # Before any thread starts (grpc, asyncio's executor): a thread stays in the cgroup
        # namespace it was created in, and /proc/<pid>/cgroup is rendered relative to the reader's.
        note = enter_host_cgroup_namespace(args.proc_root)
        if note:
            log.warning("%s", note)
    try:
        return asyncio.run(_run(args))
    except KareusError as error:
        print(f"kareus-node: error: {error}", file=sys.stderr)
        return error.exit_code


async def _run(args: argparse.Namespace) -> int:
    if args.listen_tcp and args.standalone:
        raise KareusError("--listen-tcp: TCP callers authenticate with ServiceAccount tokens, which needs cluster mode, not --standalone")
    config = load_config(args.config)
    if args.dry_run:
        config = dataclasses.replace(config, dry_run=True)
    gpus = _open_gpus(args)
    try:
        journal = Journal(args.state_dir)
    except JournalError as error:
        raise KareusError(str(error)) from None
    authorizer, token_authorizer = _authorizers(args, config, gpus)
    daemon = Daemon(gpus, authorizer, config, journal, node_name=args.node_name,
                    recheck=not args.standalone, token_authorizer=token_authorizer)
    metrics = DaemonMetrics()
    daemon.observe = metrics.observe
    restored = daemon.restore()
    if restored:
        log.warning("reset %d GPU(s) left locked by a previous daemon: %s", len(restored), ", ".join(restored))
    daemon.start_workers()
    metrics.watch(daemon)
    def ready() -> bool:
        return daemon.ready and daemon.auth_healthy

    authorize = _metrics_authorizer(args) if args.metrics_auth == "tokenreview" else None
    try:
        http = serve_http(args.metrics_address, args.metrics_port, metrics, ready,
                          max_connections=config.metrics_max_connections, authorize=authorize)
    except OSError as error:
        raise KareusError(f"--metrics-port {args.metrics_port}: cannot listen on {args.metrics_address} "
                          f"({error.strerror or error})") from None
    try:
        health = serve_http(HEALTH_ADDRESS, args.health_port, metrics, ready, max_connections=4,
                            paths=("/healthz", "/readyz"))
    except OSError as error:
        http.shutdown()
        raise KareusError(f"--health-port {args.health_port}: cannot listen on {HEALTH_ADDRESS} "
                          f"({error.strerror or error})") from None
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, daemon.stop)
    heartbeat = asyncio.create_task(_heartbeat(metrics))

    def announce() -> None:
        host, port = http.server_address[:2]
        mode = "standalone" if args.standalone else "kubelet"
        tcp = f" tcp={_format_host_port(*daemon.tcp_address)}" if daemon.tcp_address else ""
        print(f"kareus-node: serving socket={args.socket}{tcp} metrics=http://{host}:{port} "
              f"health=http://{HEALTH_ADDRESS}:{health.server_address[1]} gpus={len(gpus)} "
              f"mode={mode} dry_run={str(config.dry_run).lower()}", flush=True)

    try:
        await daemon.serve(args.socket, on_ready=announce, tcp=args.listen_tcp)
    except OSError as error:
        daemon.stop()
        where = f"--socket {args.socket}" if daemon._server is None else f"--listen-tcp {_format_host_port(*args.listen_tcp)}"
        raise KareusError(f"{where}: cannot serve ({error.strerror or error})") from None
    finally:
        heartbeat.cancel()
        http.shutdown()
        health.shutdown()
    log.info("stopped; every GPU this daemon held is back at default clocks")
    return 0


def _open_gpus(args: argparse.Namespace) -> list:
    if args.backend == "sim":
        mig = tuple(int(i) for i in args.sim_mig.split(",") if i.strip())
        # Simulated GPUs persist their lock in the state dir, as a real GPU keeps it across a daemon crash;
        # shared ones (the node's devices, which the pods' runtimes account their work on) keep it in the device.
        return discover("sim", count=args.sim_gpus, product=args.sim_product, node=args.node_name,
                        mig_indices=mig, state_dir=Path(args.state_dir) / "sim", device_dir=args.sim_device_dir)
    return discover("nvml")


def _authorizers(args: argparse.Namespace, config: NodeConfig, gpus: list) -> tuple[Authorizer, Authorizer | None]:
    """(the Unix socket's authorizer, the TCP listener's or None)."""
    if args.standalone:
        return StandaloneAuthorizer(load_allow_list(args.allow_list) if args.allow_list else None), None
    api_url = args.kube_api or in_cluster.api_url()
    if not api_url:
        raise KareusError("no Kubernetes API server: run in a pod, pass --kube-api URL, or use --standalone")
    pods = PodDirectory(api_url, args.node_name, max_age_s=config.pod_recheck_s)
    # The device plugin may name GPUs by NVML index instead of UUID (DEVICE_ID_STRATEGY=index).
    pod_resources = PodResourcesClient(args.pod_resources_socket, gpu_index={gpu.index: gpu.uuid for gpu in gpus})
    kubelet = KubeletAuthorizer(config, pods, pod_resources, proc_root=args.proc_root)
    ceilings = ClockCeilings(pods.api, *args.clock_ceilings, max_age_s=config.pod_recheck_s) if args.clock_ceilings else None
    kubelet.ceilings = ceilings
    if not args.listen_tcp:
        return kubelet, None
    verifier = TokenVerifier(pods.api, audience=TOKEN_AUDIENCE)
    tokens = TokenAuthorizer(config, pods, pod_resources, pods.api, node_name=args.node_name, verifier=verifier)
    tokens.ceilings = ceilings
    return kubelet, tokens


def _metrics_authorizer(args: argparse.Namespace) -> MetricsAuthorizer:
    api_url = args.kube_api or in_cluster.api_url()
    if not api_url:
        raise KareusError("--metrics-auth tokenreview: no Kubernetes API server (run in a pod or pass --kube-api URL)")
    return MetricsAuthorizer(KubeAPI(api_url))


def _namespaced_name(text: str) -> tuple[str, str]:
    namespace, sep, name = text.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAMESPACE/NAME")
    return namespace, name


def _host_port(text: str) -> tuple[str, int]:
    """`HOST:PORT` or `[v6]:PORT` → (host, port)."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdecimal() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def _format_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _heartbeat(metrics: DaemonMetrics) -> None:
    while True:
        metrics.beat()
        await asyncio.sleep(1.0)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


class _JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _configure_logging(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JSONFormatter() if log_format == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
