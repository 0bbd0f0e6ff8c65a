"""Cluster power budget: Kareus' allocation against closed-loop uniform power capping, on the twin.

Three mixes, every job profiled and planned on its simulated GPU (plans cached):

- **homogeneous** (the mix of before): the paper's ten testbed configurations (Llama 3.2 3B and
  Qwen3 1.7B, TP8 or CP2+TP4, PP2, 8 microbatches) on A100s, each alone, with 2 replicas, and with 4
  replicas under a 5 % time budget — 30 jobs, 1,120 GPUs;
- **heterogeneous**: five model shapes — Llama 3.2 3B TP8×PP2, Qwen3 1.7B TP4×PP4, Llama 3.1 8B
  TP8×PP2 (16 GPUs each), Qwen3 1.7B TP2×PP4 and Llama 3.2 3B TP4×PP2 at 8k tokens (8 GPUs each)
  — each on A100 and on H100, each alone and with 2 replicas: 20 jobs, 400 GPUs, no deadlines;
- **heterogeneous + deadlines**: the same and, per plan, one more job under a 5 % time budget:
  30 jobs, 520 GPUs.

For budgets at 45, 60, 75 and 90 % of a mix's max-throughput power,
`kareus.power_budget.compare_with_uniform_limit` runs on the twin: Kareus (every job at the point
the allocator assigns: a frontier row, or a row under a per-GPU power limit) against uniform
capping (every GPU limited to the same share of its board's maximum, each job at its plan's point)
— closed-loop (the share raised until the cluster draws the budget: **ratio at equal budget**) and
at the share that draws what Kareus draws (**ratio at equal drawn power**). Throughput is the sum of
the jobs' normalised throughputs (each job's fastest point = 1), what the allocator maximises (`late`:
the jobs capping slows past their time budget; the allocation keeps every time budget it can); with
`--weight gpus` it maximises each job's normalised throughput × its GPUs instead, and the ratios
are of that sum. The GPU-weighted ratio is printed beside the ratio either way. `gap` is the allocation's
certified gap (upper bound − value) over its value.

Last, the allocation time for 1,000 jobs on 10,000 GPUs: 750 copies of the heterogeneous mix's
8-GPU jobs and 250 of its 16-GPU ones, with their power-limited points, under a cluster budget at
60 % of their max-throughput power (best of three cold runs: the jobs built anew each time, as an
operator pass builds them).

    .venv/bin/python bench/power_budget.py [--quick] [--weight jobs|gpus] [--cache DIR] [--json OUT.json]

`--quick`: three testbed configurations and three heterogeneous shapes (of 8 and 16 GPUs), two budgets, for a
smoke run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from paper_table import TESTBED, Config, manifest

from kareus.optimizer.planning import optimize
from kareus.plan import FrontierRow, FrontierTable, Plan, Prediction, reselect
from kareus.policy import PowerBudget
from kareus.power_budget import PowerJob, Twin, allocate, compare_with_uniform_limit, power_limited_points
from kareus.profiler import profile_job
from kareus.spec import parse_job

FRACTIONS = (0.45, 0.6, 0.75, 0.9)  # of a mix's max-throughput power
TIME_BUDGET = {"timeBudget": {"maxSlowdownPercent": 5}}
PRODUCTS = ("A100-SXM4-40GB", "H100-SXM5-80GB")
SHAPES = (
    Config("llama3.2-3b", 8, 1, 8, 4096),
    Config("qwen3-1.7b", 4, 1, 8, 4096, pp=4),
    Config("llama3.1-8b", 8, 1, 4, 4096),
    Config("qwen3-1.7b", 2, 1, 4, 4096, pp=4),
    Config("llama3.2-3b", 4, 1, 4, 8192),
)
LARGE_JOBS, LARGE_GPUS = 1000, 10_000


def planned(config: Config, product: str, cache: Path) -> Plan:
    path = cache / f"{config.name.replace(' ', '_')}-{product}.json.gz"
    if path.exists():
        return Plan.load(path)
    document = manifest(config)
    document["spec"]["gpu"]["product"] = product
    job = parse_job(document)
    plan = optimize(job, profile_job(job, seed=0, store_path=str(cache / f"profiles-{product}.jsonl")))
    plan.save(path)
    return plan


def with_replicas(plan: Plan, data: int) -> Plan:
    """The same job with `data` replicas: same times, every energy × data (exact: per GPU terms)."""
    scale = data / plan.job.data
    rows = tuple(FrontierRow(r.time_s, r.energy_j * scale, r.choice) for r in plan.frontier.rows)
    frontier = FrontierTable(plan.frontier.options, rows)
    chosen = rows[plan.selected_row]
    return replace(plan, job=replace(plan.job, data=data), frontier=frontier,
                   predicted=Prediction(chosen.time_s, chosen.energy_j))


def homogeneous(plans: list[tuple[str, Plan]]) -> list[tuple[str, Plan]]:
    """Each configuration alone, with 2 replicas, and with 4 replicas under a 5 % time budget."""
    jobs = []
    for name, plan in plans:
        jobs += [(f"{name} DP1", plan), (f"{name} DP2", with_replicas(plan, 2)),
                 (f"{name} DP4 +5%", reselect(with_replicas(plan, 4), TIME_BUDGET))]
    return jobs


def heterogeneous(plans: list[tuple[str, Plan]], *, deadlines: bool) -> list[tuple[str, Plan]]:
    """Each plan alone and with 2 replicas; with `deadlines` one more job under a 5 % time budget."""
    jobs = []
    for name, plan in plans:
        jobs += [(f"{name} DP1", plan), (f"{name} DP2", with_replicas(plan, 2))]
        if deadlines:
            jobs.append((f"{name} DP1 +5%", reselect(plan, TIME_BUDGET)))
    return jobs


def full_power_w(jobs: list[tuple[str, Plan]]) -> float:
    return sum(r.energy_j / r.time_s for _, p in jobs for r in [min(p.frontier.rows, key=lambda r: r.time_s)])


RUNS: dict = {}  # the twin's runs, shared by the mixes (the heterogeneous ones share their layouts)


def run_mix(label: str, jobs: list[tuple[str, Plan]], fractions: tuple[float, ...], weight: str) -> list[dict]:
    twin = Twin(jobs, runs=RUNS)
    full_w = full_power_w(jobs)
    print(f"\n{label}: {len(jobs)} jobs on {sum(_gpus(p) for _, p in jobs)} GPUs "
          f"({', '.join(sorted({p.job.gpu for _, p in jobs}))}), max-throughput power {full_w / 1e3:.1f} kW")
    print(f"{'budget':>9} | {'Kareus norm.':>12} {'kW':>6} {'limited':>7} | {'closed-loop':>11} {'kW':>6} "
          f"{'ratio':>6} {'GPU-wt':>6} {'late':>4} | {'equal-power':>11} {'ratio':>6} {'GPU-wt':>6} | {'gap':>8} {'s':>5}")
    rows = []
    for fraction in fractions:
        started = time.perf_counter()
        r = compare_with_uniform_limit(jobs, fraction * full_w, twin=twin, weight=weight)
        elapsed_s = time.perf_counter() - started
        k, c, m = r["kareus"], r["uniform_closed_loop"], r["uniform_at_equal_power"]
        limited = sum(1 for j in k["jobs"] if j["power_limit_w"] is not None)
        gap = r["allocation"]["gap"] / r["allocation"]["value"]
        ratios = {"equal_budget": r.get("throughput_ratio_at_equal_budget"),
                  "equal_budget_gpu_weighted": (k["gpu_weighted_normalised_throughput"]
                                                / c["gpu_weighted_normalised_throughput"]) if c["feasible"] else None,
                  "equal_power": r["throughput_ratio_at_equal_power"],
                  "equal_power_gpu_weighted": (k["gpu_weighted_normalised_throughput"]
                                               / m["gpu_weighted_normalised_throughput"])}
        closed = (f"{c['normalised_throughput']:>11.3f} {c['power_w'] / 1e3:>6.1f} {ratios['equal_budget']:>6.3f} "
                  f"{ratios['equal_budget_gpu_weighted']:>6.3f} {len(c['time_budgets_missed']):>4}") \
            if c["feasible"] else f"{'infeasible':>38}"
        print(f"{r['budget_w'] / 1e3:>6.1f} kW | {k['normalised_throughput']:>12.3f} {k['power_w'] / 1e3:>6.1f} "
              f"{limited:>7} | {closed} | {m['normalised_throughput']:>11.3f} {ratios['equal_power']:>6.3f} "
              f"{ratios['equal_power_gpu_weighted']:>6.3f} | {gap:>8.1e} {elapsed_s:>5.0f}")
        rows.append({"mix": label, "fraction": fraction, "feasible": r["allocation"]["feasible"],
                     "kareus_power_w": k["power_w"], "relative_gap": gap, "ratios": ratios,
                     "power_limited_jobs": limited, **r})
    return rows


def large_instance(jobs: list[tuple[str, Plan]]) -> dict:
    """1,000 jobs on 10,000 GPUs from the heterogeneous jobs of 8 and 16 GPUs; allocation time."""
    twin = Twin(jobs, runs=RUNS)
    by_size: dict[int, list[PowerJob]] = {8: [], 16: []}
    for k, (name, plan) in enumerate(jobs):
        if _gpus(plan) in by_size:
            job = PowerJob.from_plan(name, plan)
            by_size[_gpus(plan)].append(replace(job, points=job.points + power_limited_points(twin, k)))
    counts = {8: 750, 16: 250}  # 750 × 8 + 250 × 16 = 10,000 GPUs
    templates = [(by_size[size][i % len(by_size[size])], size) for size, n in counts.items() for i in range(n)]
    full_w = sum(max(p.power_w for p in job.points) for job, _ in templates)
    budget = PowerBudget(cluster_w=0.6 * full_w)
    best_s, result = float("inf"), None
    for _ in range(3):
        fresh = [replace(job, name=f"{job.name} #{i}") for i, (job, _) in enumerate(templates)]
        started = time.perf_counter()
        result = allocate(fresh, budget)
        best_s = min(best_s, time.perf_counter() - started)
    points = sum(len(job.points) for job, _ in templates)
    print(f"\n{len(templates)} jobs on {sum(s for _, s in templates)} GPUs ({points} points), budget "
          f"{budget.cluster_w / 1e3:.0f} kW: allocation {1e3 * best_s:.0f} ms ({result.method}), "
          f"{result.total_power_w / 1e3:.1f} kW predicted, certified gap {result.gap / result.value:.1e} of the value")
    return {"jobs": len(templates), "gpus": sum(s for _, s in templates), "points": points,
            "budget_w": budget.cluster_w, "allocation_s": best_s, "method": result.method,
            "feasible": result.feasible, "predicted_power_w": result.total_power_w,
            "relative_gap": result.gap / result.value, "message": result.message}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer configurations and budgets")
    parser.add_argument("--cache", default="out/bench-power-budget", help="plan cache directory")
    parser.add_argument("--weight", choices=("jobs", "gpus"), default="jobs",
                        help="what the allocator maximises: the jobs' normalised throughputs, or each × its GPUs")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    testbed, shapes = (TESTBED[:3], SHAPES[1:4]) if args.quick else (TESTBED, SHAPES)
    fractions = FRACTIONS[1::2] if args.quick else FRACTIONS
    started = time.perf_counter()
    same = [(c.name, planned(c, PRODUCTS[0], cache)) for c in testbed]
    mixed = [(f"{c.name} {product.split('-')[0]}", planned(c, product, cache)) for c in shapes for product in PRODUCTS]
    print(f"planned {len(same) + len(mixed)} configurations in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    w = args.weight
    results = {"weight": w, "mixes": run_mix("homogeneous", homogeneous(same), fractions, w)
               + run_mix("heterogeneous", heterogeneous(mixed, deadlines=False), fractions, w)
               + run_mix("heterogeneous + deadlines", heterogeneous(mixed, deadlines=True), fractions, w)}
    results["large"] = large_instance(heterogeneous(mixed, deadlines=False))
    print(f"\nKareus allocation / uniform capping, summed normalised throughput ({'each job 1' if w == 'jobs' else 'each job × its GPUs'}; "
          "min..max over the budgets):")
    for label in ("homogeneous", "heterogeneous", "heterogeneous + deadlines"):
        rows = [r for r in results["mixes"] if r["mix"] == label]
        budget = [r["ratios"]["equal_budget"] for r in rows if r["ratios"]["equal_budget"] is not None]
        power = [r["ratios"]["equal_power"] for r in rows]
        print(f"  {label:26} at equal budget (closed loop) {min(budget):.3f}..{max(budget):.3f}; "
              f"at equal drawn power {min(power):.3f}..{max(power):.3f}; "
              f"largest certified gap {max(r['relative_gap'] for r in rows):.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def _gpus(plan: Plan) -> int:
    job = plan.job
    return job.tensor * job.context * job.pipeline * job.data


if __name__ == "__main__":
    sys.exit(main())
