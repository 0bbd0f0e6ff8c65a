"""`kareus dev-cluster`: a real Kubernetes cluster on this machine, with Kareus installed. Run it as root.

It starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler of the pinned release
(`make kube` builds them; KAREUS_KUBE_BIN or KUBEBUILDER_ASSETS name prebuilt ones); one or more
nodes, each in its own network and mount namespace: the upstream kubelet with containerd and runc,
kube-proxy, and a device plugin that advertises simulated GPUs (`make images` builds the images they
run); CoreDNS; the Helm chart — the CRD, RBAC, the operator Deployment and the node agent DaemonSet —
and a real Prometheus (Debian's package) that scrapes what the chart's ServiceMonitors and
PodMonitors select and evaluates its alerts. Then it writes an admin kubeconfig, prints the API and
Prometheus URLs (open `<prometheus>/graph` for the live series) and `ready`. Ctrl-C stops
everything it started.
The API server listens on the host's address on the node network, 198.18.k.1 (a bridge on
198.18.k.0/24, RFC 2544's test range); nothing is routed off the machine. Only the GPU is simulated;
docs/operator.md says exactly what runs.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

from kareus.errors import KareusError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("dev-cluster", help="run a local Kubernetes cluster with Kareus installed",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", required=True, type=Path, help="where to write the admin kubeconfig")
    parser.add_argument("--workdir", type=Path, help="control-plane data, nodes' pods and logs (default: a temporary directory)")
    parser.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="nvidia.com/gpu per node (default 8)")
    parser.add_argument("--gpu-product", default="A100-SXM4-40GB", help="simulated GPU model (default A100-SXM4-40GB)")
    parser.add_argument("--taint-gpu-nodes", action="store_true", help="taint the nodes nvidia.com/gpu:NoSchedule")
    parser.add_argument("--no-operator", action="store_true", help="install the chart with the operator scaled to 0")
    parser.add_argument("--no-node-daemon", action="store_true", help="install the chart without the node agent")
    parser.add_argument("--operator-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for `kareus-operator run` (repeatable; chart value operator.args.extra)")
    parser.add_argument("--operator-env", action="append", default=[], metavar="KAREUS_OPERATOR_NAME=VALUE",
                        help="operator setting (repeatable; chart value operator.settings)")
    parser.add_argument("--worker-namespace", action="append", default=[], metavar="NS",
                        help="namespace that gets the workers' ServiceAccount (repeatable; default: default)")
    parser.add_argument("--no-prometheus", action="store_true",
                        help="do not run Prometheus (by default a real one scrapes what the chart's monitors "
                             "select; `make prometheus` installs it)")
    parser.add_argument("--kueue", action="store_true",
                        help="run the real Kueue controller (`make kueue` builds it) with a ClusterQueue over "
                             "every GPU and a LocalQueue `kareus` in each worker namespace")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from kareus_devcluster import cluster
    except ImportError as error:
        raise KareusError(f"dev-cluster needs the operator extra (pip install 'kareus[operator]'): {error}") from None
    for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
        if value < (1 if flag == "--nodes" else 0):
            raise KareusError(f"{flag}: must be >= {1 if flag == '--nodes' else 0}, got {value}")
    settings = {}
    for item in args.operator_env:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("KAREUS_OPERATOR_"):
            raise KareusError(f"--operator-env: expected KAREUS_OPERATOR_NAME=VALUE, got {item!r}")
        settings[name] = value
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kareus-dev-"))
    options = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "gpu_product": args.gpu_product,
               "taint_gpus": args.taint_gpu_nodes, "operator": not args.no_operator,
               "node_agent": not args.no_node_daemon, "operator_args": args.operator_arg,
               "operator_settings": settings, "worker_namespaces": args.worker_namespace or ["default"],
               "prometheus": not args.no_prometheus, "kueue": args.kueue}
    with contextlib.suppress(KeyboardInterrupt):
        cluster.serve(workdir, args.kubeconfig, **options)
    return 0
