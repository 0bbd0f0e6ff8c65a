"""`kareus sim power-budget` — Kareus' power allocation against uniform per-GPU power limits.

    kareus sim power-budget JOB.yaml|PLAN.json … --budget-w W [--method exact|greedy] [--weight jobs|gpus] --json

For the same jobs and cluster budget (watts), the twin runs (a) Kareus' allocation — each job at
the point `kareus.power_budget.allocate` assigns: a frontier row, or a row under a per-GPU power
limit where the budget is below the frontiers — and (b) what a cluster does today: every GPU limited
to the same share of its board's maximum, each job at its own plan's point, throttled by the
simulated GPU's power controller; open-loop (W ÷ GPUs, `uniform_power_limit`), closed-loop (the
share raised until the cluster draws W, `uniform_closed_loop`) and at the share that draws what
Kareus draws (`uniform_at_equal_power`). `--json` prints every number (`docs/power-budget.md`);
`allocation.feasible` is true wherever a uniform limit meets the budget, and then `kareus.power_w`
is within it. A JOB.yaml is profiled and planned on the simulated GPU first; a PLAN.json is used
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
    parser.add_argument("--weight", choices=("jobs", "gpus"), default="jobs",
                        help="maximise the jobs' summed normalised throughput, or each weighted by its GPUs")
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
    result = compare_with_uniform_limit(load_plans(args.files), args.budget_w, method=args.method, weight=args.weight)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{len(result['kareus']['jobs'])} jobs on {result['gpus']} GPUs, budget {result['budget_w']:.0f} W "
          f"(uniform limit {result['uniform_limit_w_per_gpu']:.0f} W per GPU); allocation "
          f"{'feasible' if result['allocation']['feasible'] else 'infeasible'}: {result['allocation']['message']}")
    print(f"{'':34}{'iterations/s':>14}{'normalised':>12}{'power':>12}")
    rows = [("Kareus allocation", result["kareus"]), ("uniform limit W ÷ GPUs", result["uniform_power_limit"])]
    if result["uniform_closed_loop"]["feasible"]:
        rows.append((f"uniform closed loop ({result['uniform_closed_loop']['limit_w_per_gpu']:.0f} W/GPU)",
                     result["uniform_closed_loop"]))
    rows.append((f"uniform at equal power ({result['uniform_at_equal_power']['limit_w_per_gpu']:.0f} W/GPU)",
                 result["uniform_at_equal_power"]))
    for label, r in rows:
        print(f"{label:34}{r['iterations_per_s']:>14.4g}{r['normalised_throughput']:>12.4g}{r['power_w']:>10.0f} W")
    closed = result.get("throughput_ratio_at_equal_budget")
    print(f"throughput ratio (normalised): vs W ÷ GPUs {result['throughput_ratio']:.4f}, at equal budget "
          f"(closed loop) {'-' if closed is None else f'{closed:.4f}'}, at equal drawn power "
          f"{result['throughput_ratio_at_equal_power']:.4f}")
    return 0
