"""`kareus sim mbo` — search one partition type's grid on the simulated GPU with MBO.

    kareus sim mbo --gpu A100-SXM4-40GB --model llama3.2-3b --tp 8 --cp 1 --seq 4096 --mbs 8 \\
        --partition fwd_attn [--preset default|paper|exhaustive] [--seed 0] [--noise 0.01] --json

`--json` prints `{"measured": [...], "frontier": [...], "evaluations": N, "grid_size": M, ...}`;
the points have the same fields as `kareus sim sweep` rows. The frontier is the measured Pareto
set on (time, effective energy), fastest first. Without `--json`, a table of the frontier.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from kareus.cli.sim_sweep import add_workload_arguments, print_table, workload_from
from kareus.errors import KareusError
from kareus.search.algorithms import PRESETS, get_algorithm, minimize
from kareus.search.problem import Candidate, Problem, SearchSpace
from kareus.sim import Measurement, paramsfile
from kareus.sim.sweep import default_clocks, point

ALGORITHMS = (*sorted(PRESETS), "exhaustive")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "mbo", help="search a partition type's configurations with MBO on the simulated GPU",
        description="Multi-pass multi-objective Bayesian optimisation of one partition type, simulated.")
    add_workload_arguments(parser, "partition type, e.g. fwd_attn")
    parser.add_argument("--preset", choices=ALGORITHMS, default="default", help="search preset (default: default)")
    parser.add_argument("--seed", type=int, default=0, help="search and noise seed (default 0)")
    parser.add_argument("--noise", type=float, default=0.0, help="relative measurement noise (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    paramsfile.add_argument(parser)
    parser.set_defaults(func=run)


def search(args: argparse.Namespace) -> dict[str, Any]:
    """Run the search the arguments describe; the JSON-ready result."""
    if args.noise < 0:
        raise KareusError(f"--noise: must be >= 0, got {args.noise}")
    calibration = paramsfile.load_or_default(getattr(args, "sim_params", None))
    gpu = calibration.gpu(args.gpu)
    workload = workload_from(args)
    if args.partition not in workload.partition_types:
        known = ", ".join(workload.partition_types) or "none (TP1 and CP1 have no communication)"
        raise KareusError(f"--partition: {args.partition!r} is not a partition type of this job; allowed: {known}")
    ptype = workload.partition_types[args.partition]
    simulator = calibration.simulator(gpu, noise_std=args.noise, seed=args.seed)
    measured: dict[Candidate, Measurement] = {}

    def measure(candidates: Sequence[Candidate]) -> list[tuple[float, float]]:
        for c in candidates:
            measured[c] = simulator.partition(ptype, c.clock_mhz, c.comm_sms, c.launch_slot)
        return [(measured[c].time_s, measured[c].energy_j) for c in candidates]

    space = SearchSpace(tuple(default_clocks(gpu)), tuple(ptype.comm_sms_grid), tuple(ptype.launch_slots))
    problem = Problem(ptype.name, space, measure, gpu.p_static_w, ptype.size_class)
    result = minimize(problem, get_algorithm(args.preset), seed=args.seed)

    def row(c: Candidate) -> dict[str, Any]:
        return point(ptype.name, c.clock_mhz, c.comm_sms, c.launch_slot, measured[c])

    return {
        "measured": [row(e.candidate) for e in result.measured],
        "frontier": [row(e.candidate) for e in result.frontier],
        "evaluations": result.evaluations,
        "grid_size": result.grid_size,
        "partition": ptype.name,
        "preset": args.preset,
        "batches": len(result.history),
        "hypervolume": result.history[-1].hypervolume,
    }


def run(args: argparse.Namespace) -> int:
    output = search(args)
    if args.json:
        print(json.dumps(output, indent=1))
        return 0
    print_table(output["frontier"], f"{output['partition']} frontier ({args.preset}): "
                                     f"{output['evaluations']} of {output['grid_size']} configurations measured")
    return 0
