"""`kareus plan show PLAN.json`: what a plan runs, stage by stage, and what it predicts.

Prints the job, the objective, the predicted iteration time and energy, the provenance and the
frontier's extent, then per pipeline stage the instructions in 1F1B order with clock, mode and
each partition type's launch slot and comm SMs (identical consecutive instructions are folded).
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from kareus.cli import stdout_console
from kareus.errors import KareusError
from kareus.objective import parse_objective
from kareus.plan import Instruction, Plan


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("show", help="print a plan", description=__doc__.splitlines()[0])
    parser.add_argument("plan", metavar="PLAN.json", help="plan written by kareus optimize")
    parser.add_argument("--stage", type=int, default=None, help="only this pipeline stage")
    parser.add_argument("--no-fold", action="store_true", help="one row per instruction, even when repeated")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    if args.stage is not None and not 0 <= args.stage < len(plan.stages):
        raise KareusError(f"--stage: must be in 0..{len(plan.stages) - 1}, got {args.stage}")
    console = stdout_console()
    print_summary(plan, console)
    for stage in plan.stages:
        if args.stage is None or stage.stage == args.stage:
            console.print(stage_table(plan, stage.stage, fold=not args.no_fold))
    return 0


def print_summary(plan: Plan, console: Console) -> None:
    job = plan.job
    rows = plan.frontier.rows
    console.print(f"[bold]plan[/bold] {job.name or '(unnamed)'}: {job.model.name} on {job.num_gpus}× {job.gpu} "
                  f"(TP{job.tensor} CP{job.context} PP{job.pipeline} DP{job.data}, microbatch {job.micro_batch_size}"
                  f" × {job.num_micro_batches}, sequence {job.sequence_length})")
    console.print(f"objective: {parse_objective(plan.objective).describe()}")
    console.print(f"predicted: {plan.predicted.iteration_time_s:.4f} s and "
                  f"{plan.predicted.iteration_energy_j / 1e3:.3f} kJ per iteration (all GPUs, static included)")
    console.print(f"frontier: {len(rows)} plans from {rows[0].time_s:.4f} s / {rows[0].energy_j / 1e3:.3f} kJ "
                  f"to {rows[-1].time_s:.4f} s / {rows[-1].energy_j / 1e3:.3f} kJ; chosen row {plan.selected_row}")
    prov = plan.provenance
    console.print(f"provenance: method {prov.method}, profile {prov.profile_key or '-'}, created {prov.created or '-'}, "
                  f"solver {', '.join(f'{k}={v}' for k, v in prov.solver.items()) or '-'}")
    if plan.baselines:
        console.print(f"baselines stored: {', '.join(plan.baselines)}")


def _configs_text(instruction: Instruction) -> str:
    if instruction.mode == "sequential":
        return "—"
    parts = [f"{name} {c.launch_slot}/{c.comm_sms}" for name, c in sorted(instruction.configs.items())]
    parts += [f"re:{name} {c.launch_slot}/{c.comm_sms}" for name, c in sorted(instruction.recompute_configs.items())]
    return ", ".join(parts)


def stage_table(plan: Plan, stage: int, *, fold: bool = True) -> Table:
    """One stage's instructions; with `fold`, runs of identical settings become one row."""
    table = Table(title=f"stage {stage}")
    for header in ("instructions", "clock MHz", "mode", "configs (type slot/SMs)"):
        table.add_column(header)
    rows: list[list] = []
    for instruction in plan.stages[stage].instructions:
        name = f"{instruction.kind[0].upper()}{instruction.microbatch}"
        settings = (instruction.clock_mhz, instruction.mode, _configs_text(instruction))
        if fold and rows and rows[-1][1] == settings:
            rows[-1][0].append(name)
        else:
            rows.append([[name], settings])
    for names, (clock, mode, configs) in rows:
        label = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]} ({len(names)})"
        table.add_row(label, str(clock), mode, configs)
    return table
