"""`kareus sim sweep` — measure a partition's configurations on the simulated GPU.

    kareus sim sweep --gpu A100-SXM4-40GB --model llama3.2-3b --tp 4 --cp 1 --seq 4096 --mbs 8 \\
        --partition fwd_attn [--clocks 900:1410:30] [--sms 1:30] [--slots all] [--noise 0.01 --seed 1] --json

`--json` prints a JSON list, one object per configuration (`clock_mhz`, `comm_sms`, `launch_slot`,
`time_s`, `energy_j`, `static_energy_j`, `dynamic_energy_j`, `effective_energy_j`,
`exposed_comm_s`, `avg_clock_mhz`, `avg_power_w`, `throttled`); without it a table. Ranges are
inclusive `start:stop[:step]`. `--partition sequential:P` is P's work executed Megatron-style
(reported per nanobatch, like P); `sequential:layer` one layer's forward pass, Megatron-style.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kareus.cli import stdout_console
from kareus.errors import KareusError
from kareus.sim import paramsfile
from kareus.sim.sweep import default_clocks, parse_range, sweep
from kareus.workload.models import get_shape
from kareus.workload.partitions import Workload, build_workload


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sweep", help="measure a partition's configurations on the simulated GPU",
        description="Sweep clock × comm SMs × launch slot of one partition type on the simulator.")
    add_workload_arguments(parser, "partition type (fwd_attn, …), sequential:TYPE or sequential:layer")
    parser.add_argument("--clocks", help="SM clocks start:stop[:step] in MHz (default: the paper's grid)")
    parser.add_argument("--sms", help="comm SM counts start:stop[:step] (default: the type's grid)")
    parser.add_argument("--slots", nargs="+", default=["all"], help="launch slot names, or all (default)")
    parser.add_argument("--noise", type=float, default=0.0, help="relative measurement noise (default 0)")
    parser.add_argument("--seed", type=int, default=None, help="noise seed")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    paramsfile.add_argument(parser)
    parser.set_defaults(func=run)


def add_workload_arguments(parser: argparse.ArgumentParser, partition_help: str) -> None:
    """The flags naming a GPU, a model layout and one partition type (shared by `sim sweep`/`sim mbo`)."""
    parser.add_argument("--gpu", default="A100-SXM4-40GB", help="GPU product (default A100-SXM4-40GB)")
    parser.add_argument("--model", required=True, help="model preset, e.g. llama3.2-3b (or gpt3-175b)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallelism (default 1)")
    parser.add_argument("--cp", type=int, default=1, help="context parallelism (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallelism (default 1)")
    parser.add_argument("--seq", type=int, required=True, help="sequence length in tokens")
    parser.add_argument("--mbs", type=int, required=True, help="microbatch size (even, >= 2)")
    parser.add_argument("--partition", required=True, help=partition_help)


def workload_from(args: argparse.Namespace) -> Workload:
    """The workload the `add_workload_arguments` flags describe."""
    return build_workload(get_shape(args.model), tp=args.tp, cp=args.cp, pp=args.pp, seq_len=args.seq,
                          micro_batch_size=args.mbs)


def run(args: argparse.Namespace) -> int:
    calibration = paramsfile.load_or_default(args.sim_params)
    gpu = calibration.gpu(args.gpu)
    workload = workload_from(args)
    if args.noise < 0:
        raise KareusError(f"--noise must be >= 0, got {args.noise}")
    clocks = parse_range(args.clocks, "--clocks") if args.clocks else default_clocks(gpu)
    sms = parse_range(args.sms, "--sms") if args.sms else None
    simulator = calibration.simulator(gpu, noise_std=args.noise, seed=args.seed)
    points = list(sweep(simulator, workload, args.partition, clocks_mhz=clocks, comm_sms=sms, slots=args.slots))
    if args.json:
        print(json.dumps(points, indent=1))
    else:
        print_table(points, f"{args.partition} on {gpu.name}: {args.model} TP{args.tp} CP{args.cp} "
                             f"seq {args.seq} mbs {args.mbs}")
    return 0


def print_table(points: list[dict[str, Any]], title: str) -> None:
    from rich.table import Table

    table = Table(title=title)
    for header in ("clock MHz", "comm SMs", "slot", "time ms", "energy J", "static J", "dynamic J",
                   "exposed ms", "avg MHz", "avg W"):
        table.add_column(header, justify="right")
    best = min(points, key=lambda p: p["energy_j"]) if points else None
    for row in points:
        style = "bold green" if row is best else None
        table.add_row(str(row["clock_mhz"]), "-" if row["comm_sms"] is None else str(row["comm_sms"]),
                      row["launch_slot"] or "-", f"{row['time_s'] * 1e3:.3f}", f"{row['energy_j']:.4f}",
                      f"{row['static_energy_j']:.4f}", f"{row['dynamic_energy_j']:.4f}",
                      f"{row['exposed_comm_s'] * 1e3:.3f}", f"{row['avg_clock_mhz']:.0f}", f"{row['avg_power_w']:.0f}",
                      style=style)
    # Off a terminal (pipes, CI logs) rich would squeeze the table into 80 columns.
    stdout_console().print(table)
    if best is not None:
        print(f"least energy: {best['energy_j']:.4f} J at {best['clock_mhz']} MHz, "
              f"comm_sms={best['comm_sms']}, launch_slot={best['launch_slot']}")
