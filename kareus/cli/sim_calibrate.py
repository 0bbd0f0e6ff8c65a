"""`kareus sim calibrate` — fit the simulated GPU's parameters to measurements.

    kareus sim calibrate --targets kareus/sim/data/a100-targets.csv --out params.json \\
        [--fit gemm_efficiency,gpu.sm_dynamic_w_at_max,…] [--start FILE] [--json]
    kareus sim calibrate --device-check device_check.json --out params.json \\
        [--device-check-sections profiler,interference] [--fit activity_comm,…]
    kareus sim calibrate --profile-store STORE.jsonl --job JOB.yaml --out params.json

Reads targets (a CSV of published points, the device-check JSON of `bench/device_check.py`, or an
NVML profile store with its job; of a device check, the sections `--device-check-sections` names,
each that did not run printed as a note), fits the named parameters (default: `DEFAULT_FIT`) by bounded
least squares on the targets marked `fit` (a row registered held-out is refused, see
`kareus.sim.calibration.check_preregistration`), prints every target's value and error with the
held-out ones apart and the file's label history, and writes a parameter file that `kareus sim …`,
`kareus profile --backend sim`, `kareus compare` and `kareus run` take as `--sim-params FILE`. `--evaluate` only reports the
errors of `--start` (default: the shipped presets), fitting nothing. See docs/simulator.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from kareus.errors import KareusError

# The A100 fit's parameter subset (docs/simulator.md): the GPU's SM power and voltage curve, HBM
# energy per byte, GEMM efficiency, the copy kernel's speed and power, memory-bound kernels' power
# and request rate, and the partitioned engine's per-partition join.
DEFAULT_FIT = ("gpu.sm_dynamic_w_at_max", "gpu.voltage_floor_mhz", "gpu.voltage_min_ratio",
               "gpu.voltage_curve_exponent", "gpu.hbm_pj_per_byte", "gemm_efficiency", "activity_comm",
               "activity_memory", "sm_issue_headroom", "comm_bytes_per_s_per_sm", "copy_l2_interference",
               "partition_join_s")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="fit the simulator's parameters to measurements",
        description="Fit a documented subset of the simulator's parameters to measurements by bounded "
                    "least squares and report the error on held-out targets.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--targets", metavar="CSV", help="published points, one target per row (Target fields)")
    source.add_argument("--device-check", metavar="JSON", help="bench/device_check.py's output")
    source.add_argument("--profile-store", metavar="JSONL", help="an NVML profile store (needs --job)")
    parser.add_argument("--job", metavar="JOB.yaml", help="the job the profile store measured")
    parser.add_argument("--fit", default=",".join(DEFAULT_FIT),
                        help="comma-separated parameters to fit (SimParams fields or gpu.FIELD)")
    parser.add_argument("--start", metavar="FILE", default=None,
                        help="parameter file to start from (default: the shipped presets)")
    parser.add_argument("--device-check-sections", default="profiler,interference",
                        help="device check: the sections to take targets from (default profiler,interference; "
                             "the interference section's energy windows settle exposed communication's power)")
    parser.add_argument("--holdout-every", type=int, default=3,
                        help="device check / profile store: hold out every N-th measurement (default 3)")
    parser.add_argument("--max-evaluations", type=int, default=300, help="least-squares evaluations (default 300)")
    parser.add_argument("--evaluate", action="store_true", help="only report the errors of --start")
    parser.add_argument("--out", metavar="FILE", default=None, help="where to write the fitted parameter file")
    parser.add_argument("--json", action="store_true", help="print the fit record as JSON")
    parser.set_defaults(func=run)


def load_targets(args: argparse.Namespace, notes: list[str] | None = None):
    """The input's `TargetFile`: a CSV's rows with its label history, or the measurements of a
    device check or profile store split by `--holdout-every` (their registration is that rule).
    What a device check could not give (a section that did not run) is appended to `notes`."""
    from kareus.sim import calibration

    if args.targets:
        loaded = calibration.read_target_file(args.targets)
    elif args.device_check:
        sections = [name.strip() for name in args.device_check_sections.split(",") if name.strip()]
        found = calibration.read_device_check(args.device_check, args.holdout_every, sections)
        if notes is not None:
            notes.extend(f"{args.device_check}: {note}" for note in found.notes)
        loaded = calibration.TargetFile(found.targets)
    else:
        if not args.job:
            raise KareusError("--profile-store: needs --job JOB.yaml (the store does not record the workload)")
        from kareus.spec import load_job

        loaded = calibration.TargetFile(tuple(calibration.from_profile_store(args.profile_store, load_job(args.job),
                                                                             args.holdout_every)))
    if not loaded.targets:
        raise KareusError("calibrate: no targets to fit (the input has no rows)")
    return loaded


def run(args: argparse.Namespace) -> int:
    from kareus.sim import calibration, paramsfile

    if args.max_evaluations < 1:
        raise KareusError(f"--max-evaluations: must be >= 1, got {args.max_evaluations}")
    if not args.evaluate and not args.out:
        raise KareusError("--out: say where to write the fitted parameter file (or pass --evaluate)")
    notes: list[str] = []
    loaded = load_targets(args, notes)
    for note in notes:  # on stderr under --json, so stdout stays one JSON document
        print(f"note: {note}", file=sys.stderr if args.json else sys.stdout)
    targets, history = list(loaded.targets), loaded.history() if loaded.label_changes or loaded.model_choices else {}
    start = paramsfile.load_or_default(args.start)
    if args.evaluate:
        result = calibration.evaluate(start, targets, history)
    else:
        names = [name.strip() for name in args.fit.split(",") if name.strip()]
        result = calibration.fit(targets, names, start, max_evaluations=args.max_evaluations, history=history)
    if args.out:
        result.calibration.save(args.out)
    if args.json:
        json.dump(result.to_fit_record(), sys.stdout, indent=1)
        print()
    else:
        print_result(result)
    if args.out:
        print(f"written: {args.out} (use it as --sim-params {args.out})")
    return 0


def print_result(result) -> None:
    from rich.table import Table

    from kareus.cli import stdout_console

    console = stdout_console()
    if result.fitted:
        table = Table(title="Fitted parameters")
        table.add_column("parameter")
        table.add_column("value", justify="right")
        for name, value in result.fitted.items():
            table.add_row(name, f"{value:.4g}")
        console.print(table)
    for split, title in (("fit", "Fit set"), ("holdout", "Held-out set (not seen by the fit)")):
        table = Table(title=title)
        for header in ("target", "probe", "unit", "target value", "simulated", "error"):
            table.add_column(header, justify="left" if header in ("target", "probe", "unit") else "right")
        for row in result.rows:
            if row.target.split != split:
                continue
            error = (f"{100 * row.error:+.1f} %" if row.target.error_kind == "relative"
                     else f"{100 * row.error:+.1f} pts")
            table.add_row(row.target.name, row.target.probe, row.target.unit, f"{row.target.value:.4g}",
                          f"{row.predicted:.4g}", error)
        console.print(table)
    summary = result.summary()
    parts = [f"{key} {100 * value:.1f}{' %' if 'relative' in key else ' pts'}" for key, value in summary.items()]
    console.print("errors (rms / max): " + "; ".join(parts))
    for change in result.history.get("label_changes", []):
        console.print(f"label changed after results were seen ({change['date']}): {change['row']}: "
                      f"{change['from']} -> {change['to']} ({change['reason']})")
    for choice in result.history.get("model_choices", []):
        console.print(f"model choice informed by results ({choice['date']}): {choice['subject']}: "
                      f"{choice['choice']} ({choice['reason']})")
