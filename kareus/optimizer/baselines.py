"""The baselines and Kareus, built by the same composition and solver code (DESIGN.md §2.6).

| method              | execution                               | clocks                          |
|---------------------|-----------------------------------------|---------------------------------|
| `megatron`          | sequential (Megatron-LM)                | maximum                         |
| `megatron_perseus`  | sequential                              | per instruction (same solver)   |
| `nanobatch`         | partitioned, launch at the partition's  | maximum                         |
|                     | start, NCCL-default comm SMs            |                                 |
| `nanobatch_perseus` | as `nanobatch`                          | per instruction (same solver)   |
| `kareus`            | partitioned configs from the profile,   | per instruction, jointly chosen |
|                     | or sequential, per microbatch frontier  |                                 |

Sequential instructions come from the profile (measured per clock there); nanobatching's fixed
configurations were never part of the profile's search, so they are measured on the same
simulated GPU. `kareus_exhaustive` composes from every grid point of every partition type — the
physical limit of the method on this model, used to judge the search.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kareus.errors import KareusError
from kareus.job import job_spec_of
from kareus.optimizer import metrics
from kareus.optimizer.composition import CompositionSettings, MeasurementSource, compose_stages
from kareus.optimizer.frontier import FrontierSettings, iteration_frontier
from kareus.optimizer.planning import plan_job, solver_provenance
from kareus.optimizer.sources import ProfileSource, SimulatorSource, nanobatch_configs
from kareus.plan import FrontierTable, MethodFrontier, Plan, plan_from_frontier
from kareus.profiler.document import ProfileDocument

METHODS = ("megatron", "megatron_perseus", "nanobatch", "nanobatch_perseus", "kareus")
LABELS = {
    "megatron": "Megatron-LM",
    "megatron_perseus": "Megatron+Perseus",
    "nanobatch": "Nanobatching",
    "nanobatch_perseus": "Nanobatching+Perseus",
    "kareus": "Kareus",
    "kareus_exhaustive": "Kareus (exhaustive)",
}
REFERENCE = "megatron_perseus"  # iso-time / iso-energy reference
BASELINE = "megatron"  # max-throughput baseline


@dataclass(frozen=True)
class MethodResult:
    """One method's iteration frontier and how long composition + solver took."""

    name: str
    frontier: FrontierTable
    wall_s: float

    @property
    def points(self) -> list[tuple[float, float]]:
        return self.frontier.points()


@dataclass(frozen=True)
class Comparison:
    """Every method's frontier, the metrics, and the Kareus plan chosen for the job's objective."""

    methods: Mapping[str, MethodResult]
    metrics: Mapping[str, Any]
    plan: Plan | None = None

    def to_dict(self) -> dict:
        """`{"methods": {name: {"frontier": [{"time_s", "energy_j"}, …], …}}, "metrics": {…}}`."""
        methods = {}
        for name, result in self.methods.items():
            t, e = metrics.fastest(result.points)
            methods[name] = {"label": LABELS[name],
                             "frontier": [{"time_s": pt, "energy_j": pe} for pt, pe in result.points],
                             "max_throughput": {"time_s": t, "energy_j": e},
                             "optimizer_wall_s": round(result.wall_s, 3)}
        return {"methods": methods, "metrics": dict(self.metrics)}


def method_source(name: str, profile: ProfileDocument, simulator: Any, workload) -> MeasurementSource:
    """Where a method's numbers come from (see the module docstring)."""
    if name in ("megatron", "megatron_perseus", "kareus"):
        return ProfileSource(profile)
    if simulator is None:
        raise KareusError(f"method {name} needs the simulated GPU to measure configurations the profile "
                          "lacks; pass a simulator (kareus compare --backend sim)")
    fixed = nanobatch_configs(workload) if name in ("nanobatch", "nanobatch_perseus") else None
    return SimulatorSource(simulator, workload, tuple(profile.clocks_mhz), fixed)


def method_settings(name: str, profile: ProfileDocument) -> CompositionSettings:
    top = (max(profile.clocks_mhz),)
    return {
        "megatron": CompositionSettings(partitioned=False, clocks_mhz=top),
        "megatron_perseus": CompositionSettings(partitioned=False),
        "nanobatch": CompositionSettings(sequential=False, clocks_mhz=top),
        "nanobatch_perseus": CompositionSettings(sequential=False),
        "kareus": CompositionSettings(),
        "kareus_exhaustive": CompositionSettings(),
    }[name]


def method_frontier(name: str, job: Any, profile: ProfileDocument, simulator: Any = None,
                    settings: FrontierSettings = FrontierSettings(),
                    starts: Sequence[FrontierTable] = ()) -> MethodResult:
    """One method's iteration frontier for `job` on the profile's GPU.

    `starts`: other methods' frontiers whose plans, mapped onto this method's options, join the
    solver's candidates (see `iteration_frontier`); Kareus takes the baselines' here.
    """
    if name not in LABELS:
        raise KareusError(f"unknown method {name!r}; allowed: {', '.join(LABELS)}")
    pjob = plan_job(job, profile)
    workload = pjob.workload()
    started = time.perf_counter()
    options = compose_stages(workload, method_source(name, profile, simulator, workload),
                             method_settings(name, profile))
    frontier = iteration_frontier(options, pjob.num_micro_batches, p_static_w=profile.p_static_w,
                                  gpus_per_stage=pjob.gpus_per_stage, settings=settings, starts=starts)
    return MethodResult(name, frontier, time.perf_counter() - started)


def comparison_metrics(points: Mapping[str, Sequence[tuple[float, float]]]) -> dict:
    """The paper's metrics for every method present (see `kareus.optimizer.metrics`)."""
    out: dict[str, Any] = {"max_throughput_vs": BASELINE, "iso_reference": REFERENCE, "per_method": {}}
    for name, pts in points.items():
        row: dict[str, Any] = {}
        if BASELINE in points:
            mt = metrics.max_throughput_vs(pts, points[BASELINE])
            row["max_throughput_time_reduction"] = mt.time_reduction
            row["max_throughput_energy_reduction"] = mt.energy_reduction
        if REFERENCE in points:
            row["iso_time_energy_reduction"] = metrics.iso_time_energy_reduction(pts, points[REFERENCE])
            row["iso_energy_time_reduction"] = metrics.iso_energy_time_reduction(pts, points[REFERENCE])
        out["per_method"][name] = row
    return out


def compare_methods(job: Any, profile: ProfileDocument, simulator: Any = None, *,
                    methods: Sequence[str] = METHODS, settings: FrontierSettings = FrontierSettings(),
                    objective: Any = None) -> Comparison:
    """Run every method on the same backend; the Kareus plan carries the others' frontiers."""
    results: dict[str, MethodResult] = {}
    for name in sorted(methods, key=lambda m: m == "kareus"):  # Kareus last: it starts from the others
        starts = [r.frontier for r in results.values()] if name == "kareus" else ()
        results[name] = method_frontier(name, job, profile, simulator, settings, starts)
    results = {name: results[name] for name in methods}
    table = comparison_metrics({name: r.points for name, r in results.items()})
    plan = None
    if "kareus" in results:
        others = {name: MethodFrontier(tuple(r.points)) for name, r in results.items() if name != "kareus"}
        plan = plan_from_result(job, profile, results["kareus"], others, objective, settings)
    return Comparison(results, table, plan)


def plan_from_result(job: Any, profile: ProfileDocument, result: MethodResult,
                     baselines: Mapping[str, MethodFrontier], objective: Any = None,
                     settings: FrontierSettings = FrontierSettings()) -> Plan:
    """The Kareus plan from an already solved frontier (no second solve)."""
    pjob = plan_job(job, profile)
    chosen = objective if objective is not None else job_spec_of(job).objective
    provenance = solver_provenance(profile, pjob, settings, result.frontier, result.wall_s)
    return plan_from_frontier(pjob, result.frontier, chosen, provenance=provenance, baselines=baselines)
