"""`kareus frontier PLAN.json --png OUT.png`: draw every method's frontier stored in a plan.

Axes in seconds (iteration time) and kJ (iteration energy over all GPUs, static included), the
plan's chosen point marked. Plans written by `kareus compare --plan-out` or `kareus optimize
--baselines` carry the baselines' frontiers; others show Kareus' alone.
"""

from __future__ import annotations

import argparse

from kareus.optimizer.plots import plot_plan
from kareus.plan import Plan


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("frontier", help="plot the frontiers stored in a plan",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("plan", metavar="PLAN.json", help="plan written by kareus optimize or compare")
    parser.add_argument("--png", required=True, metavar="OUT.png", help="where to write the chart")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    path = plot_plan(plan, args.png)
    methods = 1 + len(plan.baselines)
    print(f"{methods} frontier{'s' if methods > 1 else ''} → {path}")
    return 0
