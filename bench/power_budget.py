"""Cluster power budget: Kareus' allocation against a uniform per-GPU power limit, side by side.

The jobs: the paper's ten testbed configurations (Llama 3.2 3B and Qwen3 1.7B, TP8 or CP2+TP4,
PP2, 8 microbatches), each profiled and planned on the simulated A100, plus variants of them with
2 and 4 data-parallel replicas (the same frontier, energy scaled by the GPU count: exact, since
every term of the iteration energy scales with the replicas) and some with a time budget
(`maxSlowdownPercent: 5`) — 30 jobs. For cluster budgets between the least power the jobs can
run at (each at its cheapest point within its objective) and their combined max-throughput power,
`kareus.power_budget.compare_with_uniform_limit` runs on the twin

- Kareus: every job at the frontier point the allocator assigns (predicted power within budget);
- uniform: every GPU limited to budget ÷ GPUs, each job at its own plan's point, throttled by the
  simulated GPU's power controller;

and the bench prints aggregate normalised throughput (each job's fastest point = 1), iterations/s
and power of both, and their ratio — at the same budget, and with the uniform limit raised until
the cluster draws as much power as under Kareus' allocation (a uniform limit leaves power unused
where GPUs draw less than it).

    .venv/bin/python bench/power_budget.py [--quick] [--cache DIR] [--json OUT.json]

`--quick`: three configurations (9 jobs), for a smoke run. Plans are cached in `--cache`
(default out/bench-power-budget), so a second run only re-does the comparison.
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
from kareus.power_budget import PowerJob, compare_with_uniform_limit
from kareus.profiler import profile_job
from kareus.spec import parse_job

FRACTIONS = (0.2, 0.4, 0.6, 0.8)  # of the way from the least power the jobs can run at to their max-throughput power
TIME_BUDGET = {"timeBudget": {"maxSlowdownPercent": 5}}


def planned(config: Config, cache: Path) -> Plan:
    path = cache / (config.name.replace(" ", "_") + ".json.gz")
    if path.exists():
        return Plan.load(path)
    job = parse_job(manifest(config))
    plan = optimize(job, profile_job(job, seed=0, store_path=str(cache / "profiles.jsonl")))
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


def jobs_of(plans: list[tuple[str, Plan]]) -> list[tuple[str, Plan]]:
    """Each configuration alone, with 2 replicas, and with 4 replicas under a 5 % time budget."""
    jobs = []
    for name, plan in plans:
        jobs.append((f"{name} DP1", plan))
        jobs.append((f"{name} DP2", with_replicas(plan, 2)))
        jobs.append((f"{name} DP4 +5%", reselect(with_replicas(plan, 4), TIME_BUDGET)))
    return jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three configurations only")
    parser.add_argument("--cache", default="out/bench-power-budget", help="plan cache directory")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    configs = TESTBED[:3] if args.quick else TESTBED
    started = time.perf_counter()
    plans = [(c.name, planned(c, cache)) for c in configs]
    print(f"planned {len(plans)} configurations in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    jobs = jobs_of(plans)
    full_w = sum(plan.predicted.iteration_energy_j / plan.predicted.iteration_time_s
                 for plan in (reselect(p, {"maxThroughput": {}}) for _, p in jobs))
    floor_w = sum(min(pt.power_w for pt in PowerJob.from_plan(n, p).candidates()) for n, p in jobs)
    results = []
    print(f"{len(jobs)} jobs, {sum(_gpus(p) for _, p in jobs)} simulated A100 GPUs; power from {floor_w / 1e3:.1f} kW "
          f"(every job at its least-power point within its objective) to {full_w / 1e3:.1f} kW (max throughput)")
    print(f"{'budget':>10} {'per GPU':>8} | {'Kareus norm.':>12} {'it/s':>7} {'kW':>6} | {'uniform norm.':>13} "
          f"{'it/s':>7} {'kW':>6} | {'ratio':>6} | {'equal-power':>11} {'ratio':>6} | {'alloc gap':>9}")
    for fraction in FRACTIONS:
        budget_w = floor_w + fraction * (full_w - floor_w)
        r = compare_with_uniform_limit(jobs, budget_w)
        k, u, m = r["kareus"], r["uniform_power_limit"], r["uniform_at_equal_power"]
        print(f"{budget_w / 1e3:>7.1f} kW {r['uniform_limit_w_per_gpu']:>6.0f} W | {k['normalised_throughput']:>12.3f} "
              f"{k['iterations_per_s']:>7.3f} {k['power_w'] / 1e3:>6.1f} | {u['normalised_throughput']:>13.3f} "
              f"{u['iterations_per_s']:>7.3f} {u['power_w'] / 1e3:>6.1f} | {r['throughput_ratio']:>6.3f} | "
              f"{m['limit_w_per_gpu']:>9.0f} W {r['throughput_ratio_at_equal_power']:>6.3f} | "
              f"{r['allocation']['gap']:>9.2g}")
        results.append({"fraction": fraction, **r})
    ratios = [r["throughput_ratio"] for r in results]
    matched = [r["throughput_ratio_at_equal_power"] for r in results]
    print(f"Kareus allocation / uniform power limit, normalised throughput: at equal budget "
          f"{min(ratios):.3f}..{max(ratios):.3f}; at equal drawn power {min(matched):.3f}..{max(matched):.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def _gpus(plan: Plan) -> int:
    job = plan.job
    return job.tensor * job.context * job.pipeline * job.data


if __name__ == "__main__":
    sys.exit(main())
