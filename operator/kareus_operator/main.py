"""`kareus-operator`: run the operator (`run`), or the in-pod result publisher (`publish`).

`run` logs in with a kubeconfig (`--kubeconfig`) or the pod's service account, serves metrics on
`--metrics-port` (127.0.0.1 unless `--metrics-address` says otherwise) and reconciles KareusJobs in
every namespace or only in `--namespace` ones. Settings come from `KAREUS_OPERATOR_*` variables
(`kareus_operator.settings`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path


def _build_parser() -> argparse.ArgumentParser:
    from kareus_operator import publish

    parser = argparse.ArgumentParser(prog="kareus-operator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser("run", help="reconcile KareusJobs")
    run.add_argument("--kubeconfig", type=Path, help="kubeconfig file (default: in-cluster service account)")
    run.add_argument("--context", help="kubeconfig context (default: current)")
    run.add_argument("--namespace", action="append", default=[], help="watch only these namespaces (repeatable)")
    run.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free port)")
    run.add_argument("--metrics-address", default="127.0.0.1")
    run.add_argument("--health-port", type=int,
                     help="serve /healthz and /readyz (the kubelet's probes) on this port (default: none)")
    run.add_argument("--health-address", default="127.0.0.1")
    run.add_argument("--verbose", action="store_true")
    run.set_defaults(func=_run)
    publish.register(commands)
    return parser


def _run(args: argparse.Namespace) -> int:
    import kopf

    from kareus_operator.handlers import Controller, build_registry, configure
    from kareus_operator.kube import Kube, in_cluster_credentials, load_kubeconfig
    from kareus_operator.settings import Settings

    settings = Settings.from_env()
    credentials = load_kubeconfig(args.kubeconfig, args.context) if args.kubeconfig else in_cluster_credentials()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # one line per handler call is noise
    namespaces = args.namespace or list(settings.watch_namespaces)

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with Kube(credentials) as kube:
            controller = Controller(kube, settings)
            registry = build_registry(controller)

            @kopf.on.login(registry=registry)
            def login(**_: object) -> kopf.ConnectionInfo:
                return kopf.ConnectionInfo(server=credentials.server, token=credentials.token,
                                           ca_path=credentials.ca_file, insecure=credentials.insecure,
                                           certificate_path=credentials.cert_file,
                                           private_key_path=credentials.key_file,
                                           default_namespace=credentials.namespace)

            kopf_settings = kopf.OperatorSettings()
            configure(kopf_settings, settings.resync_s)
            if args.metrics_port is not None:
                from prometheus_client import start_http_server

                server, _ = start_http_server(args.metrics_port, args.metrics_address, registry=controller.metrics.registry)
                print(f"metrics on http://{args.metrics_address}:{server.server_port}/metrics", flush=True)
            health = None
            if args.health_port is not None:
                from kareus_operator import health as health_endpoints

                health = await health_endpoints.serve(kube, args.health_address, args.health_port)
            elector = _elector(kube, settings)
            lost = asyncio.Event()
            if elector is not None:
                acquiring = asyncio.create_task(elector.acquire())
                stopping = asyncio.create_task(stop.wait())
                await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                if not acquiring.done():  # asked to stop while waiting for the Lease
                    acquiring.cancel()
                    if health is not None:
                        await health.cleanup()
                    return 0
            controller.power.namespaces = tuple(namespaces)
            controller.admission.namespaces = tuple(namespaces)
            tasks = [asyncio.create_task(controller.resync_forever(namespaces)),
                     asyncio.create_task(controller.watch_children(namespaces)),
                     asyncio.create_task(controller.power.run_forever()),
                     asyncio.create_task(controller.admission.run_forever())]
            if elector is not None:
                tasks += [asyncio.create_task(elector.hold(lost)), asyncio.create_task(_stop_when(lost, stop))]
            try:
                await kopf.operator(registry=registry, settings=kopf_settings, standalone=True,
                                    clusterwide=not namespaces, namespaces=namespaces, stop_flag=stop)
            finally:
                for task in tasks:
                    task.cancel()
                if elector is not None and not lost.is_set():
                    await elector.release()
                if health is not None:
                    await health.cleanup()
        return 1 if lost.is_set() else 0  # a lost Lease: exit, so the pod restarts as a candidate

    return asyncio.run(main())


def _elector(kube, settings):
    """The Lease election of `settings.leader_election_lease` (empty: none, one replica acts alone)."""
    if not settings.leader_election_lease:
        return None
    from kareus_operator.leader import LeaderElector, LeaseSettings

    identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    namespace = os.environ.get("POD_NAMESPACE") or settings.policy_namespace
    lease_s = settings.lease_duration_s
    return LeaderElector(kube, LeaseSettings(namespace, settings.leader_election_lease, identity, lease_s=lease_s,
                                             renew_s=lease_s / 3, retry_s=min(2.0, lease_s / 5)))


async def _stop_when(lost: asyncio.Event, stop: asyncio.Event) -> None:
    await lost.wait()
    stop.set()


def main(argv: Sequence[str] | None = None) -> int:
    from kareus.launcher import dispatch

    return dispatch(_build_parser(), argv, prog="kareus-operator")


if __name__ == "__main__":
    sys.exit(main())
