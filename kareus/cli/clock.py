"""`kareus clock hold` and `kareus clock status`: an administrator's direct line to `kareus-node`.

`hold` locks GPUs at a clock and keeps the lock exactly as long as the command runs — the lease
belongs to its connection, so killing the command (even with SIGKILL) gives the GPUs back. It is
how one pins a clock for an experiment, and how the daemon's restore rules are demonstrated.
`status` shows what the daemon sees: each GPU's clock, power, energy, lock and owner.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kareus.daemon_client import DaemonConnection, DaemonError

DEFAULT_SOCKET = "/run/kareus/node.sock"


def register(subparsers: argparse._SubParsersAction) -> None:
    hold = subparsers.add_parser("hold", help="lock GPU clocks until this command ends")
    hold.add_argument("--socket", default=DEFAULT_SOCKET, help="the daemon's Unix socket")
    hold.add_argument("--gpu", action="append", required=True, metavar="UUID", help="GPU UUID (repeatable)")
    hold.add_argument("--mhz", type=int, required=True, help="SM clock to lock, in MHz")
    hold.set_defaults(func=run_hold)
    status = subparsers.add_parser("status", help="what the node daemon sees and holds")
    status.add_argument("--socket", default=DEFAULT_SOCKET, help="the daemon's Unix socket")
    status.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    status.set_defaults(func=run_status)


def run_hold(args: argparse.Namespace) -> int:
    with DaemonConnection(args.socket) as connection:
        reply = connection.lock(args.gpu, args.mhz, wait=True)
        note = " (dry run: clocks unchanged)" if reply.get("dry_run") else ""
        print(f"locked {', '.join(args.gpu)} at {args.mhz} MHz{note}; holding until this process ends", flush=True)
        connection.set_timeout(None)
        try:
            connection.receive()  # the daemon never speaks unasked: this returns only when it goes away
        except DaemonError as error:
            raise DaemonError(error.code, "connection to the daemon lost; the lock is gone") from None
    return 1


def run_status(args: argparse.Namespace) -> int:
    with DaemonConnection(args.socket) as connection:
        status = connection.status()
    if args.json:
        status = {k: v for k, v in status.items() if k not in ("v", "id", "ok")}
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    print(f"node {status['node']}  daemon pid {status['pid']}  connections {status['connections']}"
          f"{'  DRY RUN' if status['dry_run'] else ''}")
    rows = [("GPU", "NAME", "LOCKED MHz", "SM MHz", "LIMIT W", "POWER W", "ENERGY J", "CHANGES", "OWNER")]
    rows += [_row(gpu) for gpu in status["gpus"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    if status.get("restored_on_start"):
        print(f"reset on start (left locked by a previous daemon): {', '.join(status['restored_on_start'])}")
    return 0


def _row(gpu: dict[str, Any]) -> tuple[str, ...]:
    owner = gpu.get("owner")
    if owner:
        who = f"{owner['namespace']}/{owner['pod']}" if owner.get("pod") else f"pid {owner['pid']} uid {owner['uid']}"
        who += f" job={owner['job']}" if owner.get("job") else ""
    else:
        who = "-"
    locked, limit = gpu.get("locked_clock_mhz"), gpu.get("power_limit_w")  # no limit: an older daemon
    return (gpu["uuid"], gpu["name"], str(locked) if locked else "-", str(gpu["sm_clock_mhz"]),
            "-" if limit is None else f"{limit:g}", f"{gpu['power_w']:.1f}", f"{gpu['energy_j']:.1f}",
            str(gpu["clock_changes"]), who)


def main(argv: list[str] | None = None) -> int:
    """`python -m kareus.cli.clock …`: the same as `kareus clock …`."""
    from kareus.cli import main as kareus_main

    return kareus_main(["clock", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
