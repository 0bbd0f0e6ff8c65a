"""`kareus dev-cluster`: a local Kubernetes API with the Kareus operator, for development and tests.

It starts the API emulator (kmock's `KubernetesEmulator`, made realistic), registers the KareusJob
CRD, runs pods as local processes, starts the operator and a simulated node daemon, writes a
kubeconfig and prints `ready`. Stop it with Ctrl-C. Nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from pathlib import Path

from kareus.errors import KareusError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("dev-cluster", help="run a local Kubernetes API with the Kareus operator",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", required=True, type=Path, help="where to write the kubeconfig")
    parser.add_argument("--workdir", type=Path, help="pods' sandboxes and logs (default: a temporary directory)")
    parser.add_argument("--crd", type=Path, help="CRD YAML to register (default: the repository's crds/kareusjob.yaml)")
    parser.add_argument("--no-operator", action="store_true", help="do not start the operator")
    parser.add_argument("--no-node-daemon", action="store_true", help="do not start the simulated node daemon")
    parser.add_argument("--operator-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for `kareus-operator run` (repeatable)")
    parser.add_argument("--operator-env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment variable for the operator (repeatable)")
    parser.add_argument("--pod-slots", type=int, metavar="N",
                        help="at most N pods run at once; the rest wait in Pending (default: no limit)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from kareus_operator.devcluster import cluster
    except ImportError as error:
        raise KareusError(f"dev-cluster needs the operator extra (pip install 'kareus[operator]'): {error}") from None
    if args.pod_slots is not None and args.pod_slots < 1:
        raise KareusError(f"--pod-slots: must be >= 1, got {args.pod_slots}")
    env = {}
    for item in args.operator_env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise KareusError(f"--operator-env: expected NAME=VALUE, got {item!r}")
        env[name] = value
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kareus-dev-"))
    options = {"operator": not args.no_operator, "node_daemon": not args.no_node_daemon,
               "operator_args": args.operator_arg, "operator_env": env, "pod_slots": args.pod_slots}
    if args.crd is not None:
        if not args.crd.exists():
            raise KareusError(f"--crd: no such file {args.crd}")
        options["crd_path"] = args.crd
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(cluster.serve(workdir, args.kubeconfig, **options))
    return 0

