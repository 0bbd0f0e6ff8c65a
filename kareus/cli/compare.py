"""`kareus compare JOB.yaml --backend sim [--json]`: Kareus against the baselines, side by side.

Profiles the job (or reads `--profile`), then builds Megatron-LM, Megatron+Perseus,
Nanobatching, Nanobatching+Perseus and Kareus on the same simulated GPU with the same composition
and solver code, and prints per method the max-throughput point and the frontier, with the
paper's metrics: max-throughput time and energy reduction vs Megatron-LM, iso-time energy
reduction and iso-energy time reduction vs Megatron+Perseus. `--json` prints
`{"methods": {name: {"frontier": [{"time_s", "energy_j"}, …], …}, …}, "metrics": {…}}` where
energy is the iteration's energy over all GPUs of the job, static energy included.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from kareus.cli import stdout_console
from kareus.errors import KareusError
from kareus.optimizer.baselines import LABELS, Comparison, compare_methods
from kareus.optimizer.frontier import FrontierSettings
from kareus.profiler.document import ProfileDocument
from kareus.report import percent, quantity
from kareus.sim import paramsfile
from kareus.spec import load_job

FRONTIER_SAMPLES = 10  # the paper evaluates 10 plans per method


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("compare", help="Kareus vs Megatron, Perseus and nanobatching on one backend",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("job", metavar="JOB.yaml", help="KareusJob manifest")
    parser.add_argument("--backend", default="sim",
                        help="measurement backend; the baselines need the simulated GPU: sim (default)")
    parser.add_argument("--profile", metavar="PROFILE.json", default=None,
                        help="reuse a profile document instead of profiling the job")
    parser.add_argument("--preset", default=None, help="profiling search preset (default: spec.profiling.preset)")
    parser.add_argument("--seed", type=int, default=0, help="profiling seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.add_argument("--plan-out", metavar="PLAN.json", default=None,
                        help="also write the Kareus plan (with every method's frontier) here")
    parser.add_argument("--solver-steps", type=int, default=None, metavar="N",
                        help="Phillips–Dessouky steps between the slowest and fastest plan (default: adaptive)")
    parser.add_argument("--png", metavar="OUT.png", default=None, help="also draw the frontiers here")
    paramsfile.add_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = solver_settings(args.solver_steps)
    if args.backend != "sim":
        raise KareusError(f"--backend: only 'sim' is supported by compare (the baselines' configurations are "
                          f"measured on the simulated GPU), got {args.backend!r}")
    job = load_job(args.job)
    calibration = paramsfile.load_or_default(args.sim_params)
    profile = _profile(job, args, calibration)
    comparison = compare_methods(job, profile, calibration.simulator(profile.gpu), settings=settings)
    if args.plan_out and comparison.plan is not None:
        comparison.plan.save(args.plan_out)
    if args.png and comparison.plan is not None:
        from kareus.optimizer.plots import plot_plan

        plot_plan(comparison.plan, args.png)
    if args.json:
        json.dump(comparison.to_dict(), sys.stdout, indent=1)
        print()
    else:
        print_comparison(comparison, stdout_console())
    return 0


def solver_settings(steps: int | None, max_rows: int = FrontierSettings.max_rows) -> FrontierSettings:
    """Solver settings from the command line, checked."""
    if steps is not None and steps < 10:
        raise KareusError(f"--solver-steps: must be >= 10, got {steps}")
    if max_rows < 2:
        raise KareusError(f"--max-rows: must be >= 2, got {max_rows}")
    return FrontierSettings(target_steps=steps, max_rows=max_rows)


def _profile(job, args: argparse.Namespace, calibration: paramsfile.SimCalibration) -> ProfileDocument:
    if args.profile:
        return ProfileDocument.load(args.profile)
    from kareus.profiler.backends import SimBackend
    from kareus.profiler.profile import profile_job

    return profile_job(job, backend=SimBackend(job.spec.gpu_product, seed=args.seed, calibration=calibration),
                       preset=args.preset or job.spec.profiling.preset, seed=args.seed)


def print_comparison(comparison: Comparison, console: Console) -> None:
    """The paper's tables: max-throughput point and iso-time/iso-energy metrics, then frontiers."""
    metrics = comparison.metrics["per_method"]
    table = Table(title="Kareus vs baselines (reductions: positive = less)")
    for header in ("method", "max-thr. time", "energy", "time↓ vs M", "energy↓ vs M", "iso-time E↓", "iso-energy T↓",
                   "plans"):
        table.add_column(header, justify="left" if header == "method" else "right")
    for name, result in comparison.methods.items():
        t, e = min(result.points)
        row = metrics.get(name, {})
        table.add_row(LABELS[name], quantity(t, "s"), quantity(e, "J"),
                      percent(row.get("max_throughput_time_reduction")),
                      percent(row.get("max_throughput_energy_reduction")),
                      percent(row.get("iso_time_energy_reduction")),
                      percent(row.get("iso_energy_time_reduction")), str(len(result.points)))
    console.print(table)
    console.print("M = Megatron-LM at max clock; iso-time/iso-energy against Megatron+Perseus; energy = iteration "
                  "energy of all GPUs, static included; − = no plan meets the constraint")
    for name, result in comparison.methods.items():
        points = sample_points(result.points, FRONTIER_SAMPLES)
        shown = ", ".join(f"({quantity(t, 's')}, {quantity(e, 'J')})" for t, e in points)
        console.print(f"[bold]{LABELS[name]}[/bold] frontier: {shown}")


def sample_points(points: list[tuple[float, float]], count: int) -> list[tuple[float, float]]:
    """About `count` points evenly spread over the frontier, both ends included."""
    if len(points) <= count:
        return list(points)
    step = (len(points) - 1) / (count - 1)
    return [points[round(i * step)] for i in range(count)]
