"""The paper's evaluation tables on the simulated A100, Kareus against the baselines side by side.

Ten testbed configurations (Llama 3.2 3B and Qwen3 1.7B, TP8 or CP2+TP4, PP2, 8 microbatches,
28 layers split 15/13) and the 70B emulation (Llama 3.3 70B, PP10 TP8, microbatch 4, sequence
4096, 16/32/64/128 microbatches). For each: profile with the default MBO preset, build every
method with the same composition and solver code, and print

- the max-throughput table (Table 3's form): each method's fastest point, and time and energy
  reductions against Megatron-LM at maximum clock;
- the frontier table (Table 4's form): iso-time energy reduction and iso-energy time reduction
  against Megatron+Perseus;
- the acceptance checks: Kareus never dominated, faster and cheaper than Megatron at max
  throughput, iso-time gain > 0, and (testbed configs) hypervolume within 1 % of the frontier
  composed from exhaustively measured partition types;
- the optimizer's wall time (composition + iteration frontier) per configuration;
- the calibration's errors, fit and held-out apart, on the pre-registered target file (`--targets`,
  default the shipped A100 points), rows relabelled after results were seen marked `*`.

    .venv/bin/python bench/paper_table.py [--quick] [--json OUT.json]

`--quick`: two testbed configurations and the 70B emulation at 128 microbatches only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

from kareus.optimizer import metrics
from kareus.optimizer.baselines import LABELS, METHODS, compare_methods, comparison_metrics, method_frontier
from kareus.profiler import profile_job
from kareus.profiler.backends import SimBackend
from kareus.sim import calibration as sim_calibration
from kareus.sim import paramsfile
from kareus.spec import parse_job

GPU = "A100-SXM4-40GB"


@dataclass(frozen=True)
class Config:
    model: str
    tp: int
    cp: int
    mbs: int
    seq: int
    pp: int = 2
    microbatches: int = 8

    @property
    def name(self) -> str:
        par = f"CP{self.cp}TP{self.tp}" if self.cp > 1 else f"TP{self.tp}"
        return f"{self.model} {par} PP{self.pp} mbs{self.mbs} seq{self.seq} M{self.microbatches}"


TESTBED = (
    Config("llama3.2-3b", 8, 1, 8, 4096),
    Config("llama3.2-3b", 4, 2, 8, 4096),
    Config("llama3.2-3b", 4, 2, 8, 8192),
    Config("llama3.2-3b", 4, 2, 16, 4096),
    Config("qwen3-1.7b", 8, 1, 8, 4096),
    Config("qwen3-1.7b", 8, 1, 8, 8192),
    Config("qwen3-1.7b", 8, 1, 16, 4096),
    Config("qwen3-1.7b", 4, 2, 8, 4096),
    Config("qwen3-1.7b", 4, 2, 8, 8192),
    Config("qwen3-1.7b", 4, 2, 16, 4096),
)
EMULATION_MICROBATCHES = (16, 32, 64, 128)


def manifest(config: Config) -> dict:
    gpus = config.tp * config.cp * config.pp
    return {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob", "metadata": {"name": "bench"},
            "spec": {"model": {"preset": config.model}, "sequenceLength": config.seq,
                     "parallelism": {"tensor": config.tp, "pipeline": config.pp, "context": config.cp, "data": 1,
                                     "microBatchSize": config.mbs, "numMicroBatches": config.microbatches},
                     "objective": {"maxThroughput": {}},
                     "training": {"image": "bench", "steps": 1000, "gpusPerNode": 8, "nodes": gpus // 8},
                     "gpu": {"product": GPU}}}


def run_config(config: Config, calibration: paramsfile.SimCalibration, *, exhaustive: bool, baselines: bool,
               profile=None) -> dict:
    job = parse_job(manifest(config))
    simulator = calibration.simulator(GPU)
    started = time.perf_counter()
    profile = profile or profile_job(job, backend=SimBackend(GPU, seed=0, calibration=calibration), seed=0)
    profile_s = time.perf_counter() - started
    others = compare_methods(job, profile, simulator, methods=[m for m in METHODS if m != "kareus"]) \
        if baselines else None
    # Kareus' optimizer time: composition + solver, starting (as `kareus compare` does) from the
    # baselines' plans when they were computed.
    started = time.perf_counter()
    kareus = method_frontier("kareus", job, profile, simulator,
                             starts=[r.frontier for r in others.methods.values()] if others else ()).frontier
    optimizer_s = time.perf_counter() - started
    result = {"config": config.name, "profile_s": profile_s, "optimizer_s": optimizer_s,
              "evaluations": profile.evaluations, "kareus_rows": len(kareus.rows),
              "kareus_fastest_sequential_share": sequential_share(kareus)}
    if others is None:
        result["methods"] = {"kareus": kareus.points()}
        return result
    points = {name: r.points for name, r in others.methods.items()} | {"kareus": kareus.points()}
    result["methods"] = points
    result["metrics"] = _metrics(points)
    checks = {
        "not_dominated": all(not metrics.dominated_by(points["kareus"], points[m]) for m in METHODS),
        "max_throughput_faster_and_cheaper": (result["metrics"]["kareus"]["max_throughput_time_reduction"] > 0
                                              and result["metrics"]["kareus"]["max_throughput_energy_reduction"] > 0),
        "iso_time_gain": (result["metrics"]["kareus"]["iso_time_energy_reduction"] or 0) > 0,
    }
    if exhaustive:
        reference = method_frontier("kareus_exhaustive", job, profile, simulator,
                                    starts=[r.frontier for r in others.methods.values()])
        result["hv_vs_exhaustive"] = metrics.hypervolume_ratio(points["kareus"], reference.points)
        checks["hv_within_1pct"] = result["hv_vs_exhaustive"] >= 0.99
    result["checks"] = checks
    return result


def sequential_share(frontier) -> float:
    """Share of the instructions of the fastest Kareus plan that run Megatron-style (sequential)."""
    instructions = [i for stage in frontier.stages_for(0) for i in stage.instructions]
    return sum(i.mode == "sequential" for i in instructions) / len(instructions)


def _metrics(points: dict) -> dict:
    return comparison_metrics(points)["per_method"]


def _pct(value: float | None) -> str:
    return "    −" if value is None else f"{100 * value:5.1f}"


def print_tables(results: list[dict]) -> None:
    print("\nMax throughput (vs Megatron-LM at max clock; energy = all GPUs, static included)")
    print(f"{'configuration':44} {'method':22} {'time s':>8} {'kJ':>9} {'time↓%':>7} {'energy↓%':>8}")
    for r in results:
        if "metrics" not in r:
            continue
        for name in METHODS:
            t, e = metrics.fastest(r["methods"][name])
            m = r["metrics"][name]
            print(f"{r['config']:44} {LABELS[name]:22} {t:8.3f} {e / 1e3:9.2f} "
                  f"{_pct(m['max_throughput_time_reduction']):>7} {_pct(m['max_throughput_energy_reduction']):>8}")
    print("\nFrontier (vs Megatron+Perseus): iso-time energy reduction % / iso-energy time reduction %")
    print(f"{'configuration':44} {'Nanobatching+Perseus':>22} {'Kareus':>16} {'HV/exh.':>8} {'opt. s':>7} "
          f"{'seq. share':>10}")
    for r in results:
        if "metrics" in r:
            np_, k = r["metrics"]["nanobatch_perseus"], r["metrics"]["kareus"]
            np_text = f"{_pct(np_['iso_time_energy_reduction'])} / {_pct(np_['iso_energy_time_reduction'])}"
            k_text = f"{_pct(k['iso_time_energy_reduction'])} / {_pct(k['iso_energy_time_reduction'])}"
        else:
            np_text, k_text = "(not run)", "(not run)"
        hv = f"{r['hv_vs_exhaustive']:.4f}" if "hv_vs_exhaustive" in r else "-"
        print(f"{r['config']:44} {np_text:>22} {k_text:>16} {hv:>8} {r['optimizer_s']:7.1f} "
              f"{100 * r['kareus_fastest_sequential_share']:9.0f}%")
    print("\nAcceptance checks")
    for r in results:
        if "checks" in r:
            failed = [name for name, ok in r["checks"].items() if not ok]
            print(f"{r['config']:44} {'ok' if not failed else 'FAILED: ' + ', '.join(failed)}")


def calibration_errors(calibration: paramsfile.SimCalibration, targets_path: str) -> dict:
    """Every target's error under `calibration` (nothing fitted), with the file's history."""
    loaded = sim_calibration.read_target_file(targets_path)
    result = sim_calibration.evaluate(calibration, list(loaded.targets), loaded.history())
    return result.to_fit_record()


def print_calibration(record: dict) -> None:
    relabelled = {change["row"] for change in record["history"]["label_changes"]}
    for split, title in (("fit", "Fit set"), ("holdout", "Held-out set (never fitted)")):
        print(f"\nCalibration: {title} (* = label changed after results were seen)")
        for row in record["targets"]:
            if row["split"] != split:
                continue
            error = (f"{100 * row['error']:+.1f} %" if row["error_kind"] == "relative"
                     else f"{100 * row['error']:+.1f} pts")
            mark = "*" if row["name"] in relabelled else " "
            print(f"{mark} {row['name'][:76]:76} {row['target']:>9.4g} {row['value']:>9.4g} {error:>10}")
    parts = [f"{key} {100 * value:.1f}{' %' if 'relative' in key else ' pts'}" for key, value in record.items()
             if key.endswith(("_rms", "_max"))]
    print("errors (rms / max): " + "; ".join(parts))
    for choice in record["history"]["model_choices"]:
        print(f"model choice informed by results ({choice['date']}): {choice['subject']}: {choice['choice']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two testbed configs and 70B at 128 microbatches")
    parser.add_argument("--json", metavar="OUT.json", help="write every number here")
    parser.add_argument("--no-exhaustive", action="store_true", help="skip the exhaustive-composition reference")
    parser.add_argument("--only", metavar="N,…", default=None, help="testbed configurations by index (0-9), no 70B")
    parser.add_argument("--targets", metavar="CSV", default=str(sim_calibration.SHIPPED_TARGETS),
                        help="the pre-registered calibration targets whose errors are printed")
    paramsfile.add_argument(parser)
    args = parser.parse_args(argv)
    calibration = paramsfile.load_or_default(args.sim_params)
    calibration_record = calibration_errors(calibration, args.targets)
    testbed = (TESTBED[0], TESTBED[7]) if args.quick else TESTBED
    emulation = (128,) if args.quick else EMULATION_MICROBATCHES
    if args.only is not None:
        testbed = tuple(TESTBED[int(i)] for i in args.only.split(","))
        emulation = ()
    results = []
    for config in testbed:
        results.append(run_config(config, calibration, exhaustive=not args.no_exhaustive, baselines=True))
        print(f"done: {config.name} ({results[-1]['optimizer_s']:.1f} s optimizer)", file=sys.stderr)
    profile_70b = None
    for microbatches in emulation:
        config = Config("llama3.3-70b", 8, 1, 4, 4096, pp=10, microbatches=microbatches)
        if profile_70b is None:
            profile_70b = profile_job(parse_job(manifest(config)), seed=0,
                                      backend=SimBackend(GPU, seed=0, calibration=calibration))
        results.append(run_config(config, calibration, exhaustive=False, baselines=not args.quick,
                                  profile=profile_70b))
        print(f"done: {config.name} ({results[-1]['optimizer_s']:.1f} s optimizer)", file=sys.stderr)
    print_tables(results)
    print("\n70B emulation: composition + iteration frontier wall time (acceptance: < 120 s at 128 microbatches)")
    for r in results:
        if r["config"].startswith("llama3.3-70b"):
            print(f"{r['config']:44} {r['optimizer_s']:7.1f} s, {r['kareus_rows']} frontier plans")
    print_calibration(calibration_record)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    failed = any(not all(r.get("checks", {}).values()) for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
