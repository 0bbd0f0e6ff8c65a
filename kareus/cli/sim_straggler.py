"""`kareus sim straggler` — one data-parallel replica on a slower simulated GPU, with and without re-selection.

    kareus sim straggler JOB.yaml --slowdown 0.15 [--plan PLAN.json] [--replica 1] [--steps 20]
        [--recover-at STEP] [--threshold 0.05] [--patience 3] [--recovery 3] --json

Replica `--replica` runs on GPUs whose clock ceiling makes the job's plan `--slowdown` slower
(`kareus.sim.replica`); the same steps are simulated without re-selection (the others wait at the
gradient all-reduce) and with it (the others run the cheapest frontier point not slower than the
straggler, `kareus.straggler`). `--recover-at` ends the slowdown at that step, so the return shows.
`--json` prints `{"without": {"time_s", "energy_j", …}, "with": {…, "switches": […]}, …}`: time and
energy per iteration (mean over the steps), all GPUs. Without `--plan` the job is profiled and
planned on the simulated GPU first (as `kareus run --no-train` would).
"""

from __future__ import annotations

import argparse
import json

from kareus.errors import KareusError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("straggler", help="a slower data-parallel replica: energy with and without re-selection",
                                   description=__doc__.splitlines()[0].split(" — ")[1])
    parser.add_argument("job", metavar="JOB.yaml", help="KareusJob manifest (spec.parallelism.data >= 2)")
    parser.add_argument("--slowdown", type=float, required=True, help="how much slower the straggler is, e.g. 0.15")
    parser.add_argument("--plan", metavar="PLAN.json", help="the job's plan (default: profile and plan it here)")
    parser.add_argument("--replica", type=int, default=1, help="which replica is slower (default 1)")
    parser.add_argument("--steps", type=int, default=20, help="steps to simulate (default 20)")
    parser.add_argument("--recover-at", type=int, default=None, help="the straggler recovers at this step")
    parser.add_argument("--threshold", type=float, default=0.05, help="straggler threshold (default 0.05)")
    parser.add_argument("--patience", type=int, default=3, help="slow steps before re-selecting (default 3)")
    parser.add_argument("--recovery", type=int, default=3, help="calm steps before returning (default 3)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def load_or_plan(job_path: str, plan_path: str | None):
    """The job's plan: read from `plan_path`, or profiled and optimised on the simulated GPU."""
    from kareus.plan import Plan
    from kareus.spec import load_job

    job = load_job(job_path)
    if plan_path:
        plan = Plan.load(plan_path)
        par = job.spec.parallelism
        if (plan.job.tensor, plan.job.context, plan.job.pipeline, plan.job.data) != \
                (par.tensor, par.context, par.pipeline, par.data):
            raise KareusError(f"--plan {plan_path} was made for another layout than {job_path}")
        return job, plan
    from kareus.optimizer.planning import optimize
    from kareus.profiler.profile import profile_job

    profile = profile_job(job, backend="sim", preset=job.spec.profiling.preset, seed=0)
    return job, optimize(job, profile)


def run(args: argparse.Namespace) -> int:
    from kareus.straggler import StragglerPolicy, simulate_straggler

    if args.recover_at is not None and not 0 < args.recover_at <= args.steps:
        raise KareusError(f"--recover-at: must be in 1..--steps ({args.steps}), got {args.recover_at}")
    policy = StragglerPolicy(args.threshold, args.patience, args.recovery)
    job, plan = load_or_plan(args.job, args.plan)
    slow_steps = (0, args.recover_at) if args.recover_at is not None else None
    result = simulate_straggler(plan, slowdown=args.slowdown, straggler=args.replica, steps=args.steps,
                                slow_steps=slow_steps, policy=policy).to_dict()
    result["job"] = job.name
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{job.name}: replica {args.replica} of {result['replicas']} {args.slowdown:.0%} slower "
          f"(clock ceiling {result['clock_ceiling_mhz']:.0f} MHz), {args.steps} steps")
    print(f"{'':22}{'time/iteration':>16}{'energy/iteration':>18}")
    for label, key in (("without re-selection", "without"), ("with re-selection", "with")):
        print(f"{label:22}{result[key]['time_s']:>14.4g} s{result[key]['energy_j']:>16.4g} J")
    print(f"time {result['time_change']:+.2%}, energy {-result['energy_saving']:+.2%}")
    for switch in result["with"]["switches"]:
        print(f"  step {switch['step']}: {switch['reason']} → frontier rows {switch['rows']}")
    return 0
