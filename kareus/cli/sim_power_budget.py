"""`kareus sim power-budget` — Kareus' power allocation against a uniform per-GPU power limit.

    kareus sim power-budget JOB.yaml|PLAN.json … --budget-w W [--method exact|greedy] --json

For the same jobs and cluster budget (watts), the twin runs (a) Kareus' allocation — each job at
the frontier point `kareus.power_budget.allocate` assigns — and (b) what a cluster does today: a
uniform per-GPU power limit of W ÷ GPUs, each job at its own plan's point, throttled by the
simulated GPU's power controller. `--json` prints `{"kareus": {…}, "uniform_power_limit": {…},
"throughput_ratio": …}` with iterations/s summed, normalised throughput (each job's fastest point
= 1) and power. A JOB.yaml is profiled and planned on the simulated GPU first; a PLAN.json is used
as it is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kareus.errors import KareusError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("power-budget", help="power allocation vs a uniform per-GPU power limit",
                                   description=__doc__.splitlines()[0].split(" — ")[1])
    parser.add_argument("files", nargs="+", metavar="JOB.yaml|PLAN.json", help="jobs (manifests or plans)")
    parser.add_argument("--budget-w", type=float, required=True, help="cluster power budget in watts")
    parser.add_argument("--method", choices=("exact", "greedy"), default="exact", help="allocator (default exact)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def load_plans(paths: list[str]) -> list[tuple[str, object]]:
    """`(name, Plan)` per file; names made unique by suffixing the position."""
    from kareus.cli.sim_straggler import load_or_plan
    from kareus.plan import Plan

    plans = []
    for k, path in enumerate(paths):
        if Path(path).suffix in (".json", ".gz"):
            plan = Plan.load(path)
            name = plan.job.name or Path(path).stem
        else:
            job, plan = load_or_plan(path, None)
            name = job.name
        if name in {n for n, _ in plans}:
            name = f"{name}-{k}"
        plans.append((name, plan))
    return plans


def run(args: argparse.Namespace) -> int:
    from kareus.power_budget import compare_with_uniform_limit

    if not args.budget_w > 0:
        raise KareusError(f"--budget-w: must be > 0, got {args.budget_w}")
    result = compare_with_uniform_limit(load_plans(args.files), args.budget_w, method=args.method)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{len(result['kareus']['jobs'])} jobs on {result['gpus']} GPUs, budget {result['budget_w']:.0f} W "
          f"(uniform limit {result['uniform_limit_w_per_gpu']:.0f} W per GPU)")
    print(f"{'':24}{'iterations/s':>14}{'normalised':>12}{'power':>12}")
    for label, key in (("Kareus allocation", "kareus"), ("uniform power limit", "uniform_power_limit")):
        r = result[key]
        print(f"{label:24}{r['iterations_per_s']:>14.4g}{r['normalised_throughput']:>12.4g}{r['power_w']:>10.0f} W")
    print(f"throughput ratio (normalised) {result['throughput_ratio']:.4f}, iterations/s ratio "
          f"{result['iterations_ratio']:.4f}")
    return 0
