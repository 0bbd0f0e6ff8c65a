"""`kareus optimize JOB.yaml --profile PROFILE.json --out PLAN.json`: build the training plan.

Composes the profile's measured partition frontiers into microbatch frontiers, solves the 1F1B
iteration frontier with lowtime and writes the plan its objective picks (the job's, or
`--objective`). The plan keeps the whole frontier, so a later objective change needs no new run.
With `--baselines` (simulated GPU) the baselines' frontiers are stored too, for
`kareus frontier`. Beside the frontier the plan stores power-limited points (its selected, fastest
and least-power rows under `--power-limit-steps` per-GPU limits from the board's minimum up,
predicted by the simulated GPU's power controller) for the cluster power budget.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from kareus.cli.compare import solver_settings
from kareus.errors import KareusError
from kareus.objective import parse_objective
from kareus.optimizer.frontier import FrontierSettings
from kareus.power_budget.twin import LADDER_STEPS, check_ladder_steps, plan_power_limited_points
from kareus.profiler.document import ProfileDocument
from kareus.spec import load_job


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("optimize", help="build the training plan from a profile",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("job", metavar="JOB.yaml", help="KareusJob manifest")
    parser.add_argument("--profile", required=True, metavar="PROFILE.json", help="profile document (kareus profile)")
    parser.add_argument("--out", required=True, metavar="PLAN.json", help="where to write the plan")
    parser.add_argument("--objective", metavar="JSON", default=None,
                        help='override spec.objective, e.g. \'{"timeBudget": {"maxSlowdownPercent": 5}}\'')
    parser.add_argument("--baselines", action="store_true",
                        help="also solve the baselines on the simulated GPU and store their frontiers")
    parser.add_argument("--solver-steps", type=int, default=None, metavar="N",
                        help="Phillips–Dessouky steps between the slowest and fastest plan (default: adaptive)")
    parser.add_argument("--max-rows", type=int, default=FrontierSettings.max_rows, metavar="N",
                        help=f"frontier table rows kept (default {FrontierSettings.max_rows})")
    parser.add_argument("--power-limit-steps", type=int, default=LADDER_STEPS, metavar="N",
                        help=f"per-GPU power limits per row in the plan's power-limited points (default {LADDER_STEPS}; "
                             "0: none)")
    from kareus.sim import paramsfile

    paramsfile.add_argument(parser)
    parser.set_defaults(func=run)


def objective_argument(text: str | None) -> object:
    """The `--objective` value parsed and checked, or None."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise KareusError(f"--objective: not valid JSON ({error.msg}); e.g. '{{\"maxThroughput\": {{}}}}'") from None
    return parse_objective(value, path="--objective")


def run(args: argparse.Namespace) -> int:
    objective = objective_argument(args.objective)
    check_ladder_steps(args.power_limit_steps)
    job = load_job(args.job)
    profile = ProfileDocument.load(args.profile)
    settings = solver_settings(args.solver_steps, args.max_rows)
    if args.baselines:
        from kareus.optimizer.baselines import compare_methods
        from kareus.sim import paramsfile

        simulator = paramsfile.load_or_default(args.sim_params).simulator(profile.gpu)
        plan = compare_methods(job, profile, simulator, settings=settings, objective=objective).plan
    else:
        from kareus.optimizer.planning import optimize

        plan = optimize(job, profile, objective=objective, settings=settings)
    plan = replace(plan, power_limited_points=plan_power_limited_points(plan, steps=args.power_limit_steps))
    plan.save(args.out)
    p = plan.predicted
    print(f"plan for {job.name}: {p.iteration_time_s:.4f} s and {p.iteration_energy_j / 1e3:.3f} kJ per "
          f"iteration ({len(plan.frontier.rows)} frontier plans, objective {parse_objective(plan.objective).describe()})"
          f", {len(plan.power_limited_points)} power-limited points → {args.out}")
    return 0
