"""`kareus run JOB.yaml`: the whole job on this machine — profile, optimise, train — and a report.

The same code the cluster's pods run, in one process tree: the profiler measures every partition
type (on the real GPU through NVML, or on the simulated GPU of the job's `gpu.product`), the
optimizer builds every method's iteration frontier on the same backend and picks the plan the job's
objective asks for, and the runtime trains the model following that plan (on CPU with gloo when
there is no GPU; energy then comes from the simulated GPU). Outputs in `--out`: `profile.json`,
`plan.json`, `frontier.png`, `summary.json`, `train.jsonl` and a self-contained `report.html`.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kareus.cli import stdout_console
from kareus.errors import KareusError
from kareus.report import format_value, headline_text, percent, quantity

BACKENDS = ("auto", "sim", "nvml")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="profile, optimise and train a job on this machine",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("job", metavar="JOB.yaml", help="KareusJob manifest")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto (NVML when a GPU is present and clock control is permitted, else the "
                             "simulated GPU of spec.gpu.product), sim or nvml")
    parser.add_argument("--out", metavar="DIR", default="out", help="output directory (default: out)")
    parser.add_argument("--no-train", action="store_true", help="stop after planning (no training run)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: spec.training.steps)")
    parser.add_argument("--seed", type=int, default=0, help="profiling and training seed (default 0)")
    parser.add_argument("--preset", choices=("default", "paper"), default=None,
                        help="profiling search preset (default: spec.profiling.preset)")
    from kareus.sim import paramsfile

    paramsfile.add_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kareus.spec import load_job

    if args.steps is not None and args.steps < 1:
        raise KareusError(f"--steps: must be >= 1, got {args.steps}")
    job = load_job(args.job)
    out = _output_dir(args.out)
    backend = resolve_backend(args.backend)
    console = stdout_console()
    console.print(f"[bold]kareus run[/bold] {job.name}: {job.spec.model_shape().name} on "
                  f"{'NVML GPUs' if backend == 'nvml' else 'simulated ' + job.spec.gpu_product} → {out}")
    with _progress(console) as bar:
        profile = _profile(job, backend, args, bar)
        comparison = _compare(job, profile, backend, bar, args.sim_params)
    plan = comparison.plan
    profile.save(out / "profile.json")
    plan.save(out / "plan.json")
    from kareus.optimizer.plots import plot_plan

    plot_plan(plan, out / "frontier.png")
    records: list[dict] = []
    if not args.no_train:
        with _progress(console) as bar:
            records = _train(job, plan, out, args, bar)
    summary = build_summary(comparison, records, job)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    _write_report(job, summary, plan, out, records)
    print_summary(summary, console)
    outputs = ["profile.json", "plan.json", "frontier.png", "summary.json", "report.html"]
    if records:
        outputs.insert(4, "train.jsonl")
    console.print(f"outputs in {out}: {', '.join(outputs)}")
    return 0


def resolve_backend(requested: str) -> str:
    """`sim` or `nvml`: auto picks NVML only where a GPU is visible and clocks may be locked."""
    if requested == "sim":
        return "sim"
    from kareus.profiler.nvml import nvml_available

    present = nvml_available()
    if requested == "nvml":
        if not present:
            raise KareusError("--backend nvml: no NVIDIA GPU found (NVML could not be initialised); "
                              "use --backend sim to run on the simulated GPU")
        return "nvml"
    return "nvml" if present and clock_control_permitted() else "sim"


def clock_control_permitted() -> bool:
    """Locking SM clocks needs root (or the node daemon, which `kareus run` does not use)."""
    import os

    return os.geteuid() == 0


def _output_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise KareusError(f"--out: cannot create {out}: {error.strerror or error}") from None
    return out


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
                    disable=not console.is_terminal)


def _profile(job, backend: str, args: argparse.Namespace, bar: Progress):
    from kareus.profiler.profile import ProfileProgress, profile_job

    task = bar.add_task("profiling", total=None, info="")

    def show(progress: ProfileProgress) -> None:
        bar.update(task, completed=progress.evaluations, total=progress.planned,
                   info=f"{progress.partition} HV {progress.hypervolume:.3f}")

    if backend == "sim":
        from kareus.profiler.backends import SimBackend
        from kareus.sim import paramsfile

        backend = SimBackend(job.spec.gpu_product, seed=args.seed,
                             calibration=paramsfile.load_or_default(args.sim_params))
    profile = profile_job(job, backend=backend, preset=args.preset or job.spec.profiling.preset,
                          seed=args.seed, progress=show)
    bar.update(task, total=profile.evaluations, completed=profile.evaluations,
               info=f"{profile.evaluations} candidates measured")
    return profile


def _compare(job, profile, backend: str, bar: Progress, sim_params: str | None = None):
    """Every method on the same backend; on NVML only the methods its profile can serve."""
    from kareus.optimizer.baselines import (
        METHODS,
        Comparison,
        comparison_metrics,
        method_frontier,
        plan_from_result,
    )
    from kareus.plan import MethodFrontier

    simulator = None
    methods = tuple(METHODS)
    if backend == "sim":
        from kareus.sim import paramsfile

        simulator = paramsfile.load_or_default(sim_params).simulator(profile.gpu)
    else:  # nanobatching baselines need configurations outside the profile: only a simulator has them
        methods = tuple(m for m in METHODS if m in ("megatron", "megatron_perseus", "kareus"))
    task = bar.add_task("optimising", total=len(methods), info="")
    results = {}
    for name in methods:  # Kareus is last and starts from the baselines' plans
        bar.update(task, info=name)
        starts = [r.frontier for r in results.values()] if name == "kareus" else ()
        results[name] = method_frontier(name, job, profile, simulator, starts=starts)
        bar.advance(task)
    bar.update(task, info=f"{len(results['kareus'].points)} Kareus plans on the frontier")
    others = {name: MethodFrontier(tuple(r.points)) for name, r in results.items() if name != "kareus"}
    plan = plan_from_result(job, profile, results["kareus"], others)
    return Comparison(results, comparison_metrics({n: r.points for n, r in results.items()}), plan)


def _train(job, plan, out: Path, args: argparse.Namespace, bar: Progress) -> list[dict]:
    from kareus.runtime import train

    steps = args.steps or job.spec.training.steps
    log = out / "train.jsonl"
    log.unlink(missing_ok=True)
    task = bar.add_task("training", total=steps, info="")
    done = threading.Event()
    watcher = threading.Thread(target=_follow, args=(log, done, lambda r: bar.update(
        task, completed=r["step"] + 1, info=f"loss {r['loss']:.3f}  {r['energy_j'] / 1e3:.2f} kJ/step")),
        daemon=True)
    watcher.start()
    try:
        train(job, plan, steps=steps, seed=args.seed, out_dir=str(out), sim_params=args.sim_params)
    finally:
        done.set()
        watcher.join()
    records = read_records(log)
    if not records:
        raise KareusError(f"training wrote no steps to {log}")
    bar.update(task, completed=steps)
    return records


def _follow(path: Path, done: threading.Event, on_record: Callable[[dict], None]) -> None:
    """Report new `train.jsonl` lines as the ranks write them (training runs in child processes)."""
    seen = 0
    while True:
        finished = done.wait(0.2)
        records = read_records(path)
        for record in records[seen:]:
            on_record(record)
        seen = len(records)
        if finished:
            return


def read_records(path: Path) -> list[dict]:
    """Complete JSON lines of a `train.jsonl` (a line being written is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def build_summary(comparison, records: list[dict], job=None) -> dict:
    """`summary.json`: the headline (Kareus against Megatron+Perseus at iso-time), per method the
    max-throughput point and the paper's metrics, the chosen plan, and what trained."""
    from kareus.optimizer.baselines import LABELS
    from kareus.optimizer.metrics import fastest

    plan = comparison.plan
    per_method = comparison.metrics["per_method"]
    methods = {}
    for name, result in comparison.methods.items():
        time_s, energy_j = fastest(result.points)
        methods[name] = {"label": LABELS[name], "time_s": time_s, "energy_j": energy_j,
                         "frontier_points": len(result.points), **per_method.get(name, {})}
    kareus = per_method.get("kareus", {})
    chosen = {
        "objective": json.dumps(dict(plan.objective), sort_keys=True),
        "predicted_iteration_time_s": plan.predicted.iteration_time_s,
        "predicted_iteration_energy_j": plan.predicted.iteration_energy_j,
    }
    if records:
        measured = records[1:] or records  # the first step includes start-up work
        chosen["measured_steps"] = len(records)
        chosen["measured_iteration_energy_j"] = sum(r["energy_j"] for r in measured) / len(measured)
        chosen["measured_iteration_time_s"] = sum(r["iteration_time_s"] for r in measured) / len(measured)
        chosen["energy_source"] = records[-1].get("energy_source", "")
        if all(r.get("modelled_time_s") is not None for r in measured):
            # On CPU the wall time is the CPU's; the simulated GPU's time is what the plan predicts.
            chosen["measured_modelled_iteration_time_s"] = (
                sum(r["modelled_time_s"] for r in measured) / len(measured))
        chosen["first_loss"] = records[0]["loss"]
        chosen["last_loss"] = records[-1]["loss"]
    summary = {"headline": headline(per_method), "methods": methods, "metrics": dict(kareus), "plan": chosen,
               "profile_key": plan.provenance.profile_key}
    if job is not None and records:
        summary["training"] = trained_model(job, records)
    return summary


def headline(per_method: dict) -> dict:
    """The comparison the run leads with: Kareus' least energy at Megatron+Perseus' fastest
    iteration time (iso-time), and its fastest plan against Megatron-LM."""
    kareus = per_method.get("kareus", {})
    return {"iso_time_energy_reduction_vs_megatron_perseus": kareus.get("iso_time_energy_reduction"),
            "iso_energy_time_reduction_vs_megatron_perseus": kareus.get("iso_energy_time_reduction"),
            "max_throughput_time_reduction_vs_megatron": kareus.get("max_throughput_time_reduction"),
            "max_throughput_energy_reduction_vs_megatron": kareus.get("max_throughput_energy_reduction")}


def trained_model(job, records: list[dict]) -> dict:
    """The model the processes trained: the job's, or on CPU its proxy (time and energy stay the
    job's model's on the simulated GPU)."""
    spec = job.spec
    proxy = spec.cpu_proxy_shape() if records[-1].get("energy_source") != "nvml" else None
    shape = proxy or spec.model_shape()
    return {"model": spec.model_shape().name, "cpu_proxy": proxy is not None, "trained_layers": shape.num_layers,
            "trained_hidden": shape.hidden_size,
            "trained_sequence_length": spec.cpu_proxy_sequence_length if proxy else spec.sequence_length}


def print_summary(summary: dict, console: Console) -> None:
    if text := headline_text(summary):
        console.print(f"[bold]{text}[/bold]")
    table = Table(title="Per method: max-throughput iteration (all GPUs, static energy included) and "
                        "reductions (positive = less)")
    for header in ("method", "time", "energy", *METRIC_LABELS.values()):
        table.add_column(header, justify="left" if header == "method" else "right")
    for m in summary["methods"].values():
        table.add_row(m["label"], quantity(m["time_s"], "s"), quantity(m["energy_j"], "J"),
                      *(percent(m.get(key)) for key in METRIC_LABELS))
    console.print(table)
    console.print("Megatron = Megatron-LM at max clock; iso-time/iso-energy against Megatron+Perseus; "
                  "− = no plan meets the constraint")
    plan = Table(title="Chosen plan: predicted vs measured")
    plan.add_column("quantity")
    plan.add_column("value", justify="right")
    for key, value in summary["plan"].items():
        plan.add_row(key, format_value(value, key))
    console.print(plan)


METRIC_LABELS = {
    "max_throughput_time_reduction": "time vs Megatron",
    "max_throughput_energy_reduction": "energy vs Megatron",
    "iso_time_energy_reduction": "iso-time energy",
    "iso_energy_time_reduction": "iso-energy time",
}


def _write_report(job, summary: dict, plan, out: Path, records: list[dict]) -> None:
    from kareus.report import render_report

    page = render_report(title=f"Kareus run: {job.name}", summary=summary, plan=plan,
                         frontier_png=(out / "frontier.png").read_bytes(), train_records=records)
    (out / "report.html").write_text(page)
