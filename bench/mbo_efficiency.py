"""How many measurements does each search need for the exhaustive frontier? (issue 3, item 4)

For every partition type of the paper's configurations (Llama 3.2 3B and Qwen3 1.7B; TP8 and
CP2+TP4; sequence 4096/8192; microbatch 8/16) on the simulated A100 with measurement noise, every
grid point is measured once per seed with relative noise, drawn independently per partition type
(that table *is* the exhaustive search,
and every method measures by looking it up, so all methods see the same noisy measurements).
Every method is judged by the noise-free cost of the configurations on its measured front: against
the noisy table itself the exhaustive front is a collection of lucky draws among near-equivalent
configurations (within a clock the best few differ by less than the noise), and matching it would
reward measuring more rather than finding the right configurations. Then random search
(with the paper's budget), the `paper` MBO preset and the `default` preset run on it, and the
table reports per method (medians over partition types and seeds):

- evaluations used, and their share of the grid;
- hypervolume of the measured front relative to the exhaustive front, in the (time, effective
  energy) and (time, total energy) planes (axes normalised by the whole grid, reference 1.1);
- the worst partition type's median-over-seeds HV ratio (the acceptance is per type);
- evaluations needed to reach 99 % of the exhaustive HV in both planes, and the ratio
  default/paper of that number;
- coverage (a diagnostic, not the acceptance): the HV of the true front of the configurations a
  method measured against the noise-free optimum, i.e. whether it measured the right
  configurations, apart from which of them its own noisy measurements then put on its front.
  The gap between coverage and the HV ratio is the noise's selection loss: a true-front point
  dropped because a near-equivalent measured luckier; it grows with how many near-equivalents
  were measured next to it, so it differs between a search and the exhaustive grid;
- noise-free front points measured (a diagnostic): the share of the noise-free front's grid points
  each method measured, and for the `default` searches the counterfactual of adding the ones it
  missed: how many searches would then be below the target, at how many more evaluations. Where
  that leaves few below, what a search lacks is the front itself, not the band around it;
- searches below the target: the statistic a change must move. A type is below when two of its
  three seeds are, so the count of types below is a draw from it (at 12 % of searches below,
  about 5 of 128 types are expected below, and 4 to 10 are all likely);
- the lottery (a diagnostic for the `default` searches): how many types the median over seeds
  would put below the target if every type failed as often as the searches do overall (at a
  per-search rate p and three seeds, about 3p² − 2p³ of the types), and which types fail more
  often than that rate explains (binomial tail below 5 % / types, so with three seeds no type can
  be named; run more seeds): those are the search's systematic misses, the rest the noise's;
- repair (a diagnostic for the `default` searches below the target): the fewest exhaustive-front
  points a search did not measure that bring it back, added greedily, and where each sits on the
  noise-free front (at or next to its fastest, least-total-energy or least-effective-energy clock,
  or inside);
- oracles (ceilings, not methods), scored alike: the `default` search's number of evaluations spent
  on the grid points nearest the noise-free front (least `relative_gap` in either plane); the
  noise-free front alone; and that budget drawn at random from the points within 0.25 %, 0.5 % or
  1 % of the noise-free front, or the nearest ones where fewer lie within; and the nearest as
  ranked with a Gaussian error of 0.25 %, 0.5 % or 1 % on each point's gap, as a search whose
  predictions are that far off would rank them (how precisely a search must know the front to do
  as well). A measured subset's noisy front
  keeps every exhaustive-front point it contains (a point no other grid point dominates is
  dominated by none of the subset), so its hypervolume is at least theirs, and a search can lose
  against the exhaustive search only through exhaustive-front points it did not measure:
  near-equivalents of the front whose noise drew them onto it. Measuring the front alone
  then misses those; measuring the band around it catches them.

`--gpu` and `--models` run the same configurations on another simulated GPU or other models
(held-out ones: `--gpu H100-SXM5-80GB`, `--models llama3.1-8b`).

    .venv/bin/python bench/mbo_efficiency.py --quick          # two configurations, 2 seeds
    .venv/bin/python bench/mbo_efficiency.py --seeds 5 --workers 2 --json out.json
    .venv/bin/python bench/mbo_efficiency.py --seeds 20 --workers 2 --partitions fwd_ao_ar,bwd_o_ar
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
from scipy.stats import binom

from kareus.search.algorithms import get_algorithm, minimize
from kareus.search.indicators import Normaliser, hypervolume, pareto_mask, relative_gap
from kareus.search.problem import Candidate, Problem, SearchSpace
from kareus.sim import Simulator, get_gpu
from kareus.workload.models import get_preset
from kareus.workload.partitions import build_workload

GPU = "A100-SXM4-40GB"
MODELS = ("llama3.2-3b", "qwen3-1.7b")
PARALLELISM = ((8, 1), (4, 2))  # (tp, cp)
SEQUENCES = (4096, 8192)
MICROBATCHES = (8, 16)
METHODS = ("random", "paper", "default")
TARGET = 0.99
# Oracles drawing the default's budget at random from the points within this relative gap of the front.
WITHIN = {"within 0.25%": 0.0025, "within 0.5%": 0.005, "within 1%": 0.01}
# Oracles taking the default's budget nearest the front as ranked with this relative error: how
# precisely a search must predict the front to measure what the band oracle measures.
RANKED = {"ranked 0.25% off": 0.0025, "ranked 0.5% off": 0.005, "ranked 1% off": 0.01}
ORACLES = {"band": "the default's budget nearest the noise-free front", "front": "the noise-free front only",
           **{name: f"the default's budget at random from the points {name} of the noise-free front" for name in WITHIN},
           **{name: f"the default's budget nearest the noise-free front as ranked with a {error:.2%} Gaussian error "
                    "of the relative gap" for name, error in RANKED.items()}}


@dataclass(frozen=True)
class Case:
    model: str
    tp: int
    cp: int
    seq: int
    mbs: int
    partition: str
    seed: int
    noise: float
    gpu: str = GPU

    @property
    def config(self) -> str:
        where = "" if self.gpu == GPU else f"{self.gpu} "
        return f"{where}{self.model} tp{self.tp}cp{self.cp} s{self.seq} b{self.mbs}"

    def noise_rng(self) -> np.random.Generator:
        """The seed's noise stream for this partition type: types with the same grid shape must
        not share one noise pattern, or their medians over seeds are one draw, not independent."""
        return np.random.default_rng([self.seed, zlib.crc32(f"{self.config} {self.partition}".encode())])


def cases(quick: bool, seeds: int, noise: float, gpu: str = GPU, models: tuple[str, ...] = MODELS) -> list[Case]:
    if quick:
        configs = [(models[0], 8, 1, 4096, 8), (models[-1], 4, 2, 4096, 8)]
    else:
        configs = [(m, tp, cp, s, b) for m, (tp, cp), s, b in
                   itertools.product(models, PARALLELISM, SEQUENCES, MICROBATCHES)]
    out = []
    for model, tp, cp, seq, mbs in configs:
        workload = build_workload(get_preset(model), tp=tp, cp=cp, pp=1, seq_len=seq, micro_batch_size=mbs)
        for name in workload.partition_types:
            out.extend(Case(model, tp, cp, seq, mbs, name, seed, noise, gpu) for seed in range(seeds))
    return out


def _planes(time_s: np.ndarray, energy_j: np.ndarray, p_static_w: float) -> list[np.ndarray]:
    effective = energy_j - p_static_w * time_s
    return [np.column_stack((time_s, effective)), np.column_stack((time_s, energy_j))]


def _front(table: np.ndarray, p_static_w: float) -> list[int]:
    """Rows Pareto-optimal on (time, effective energy) or (time, total energy)."""
    planes = _planes(table[:, 0], table[:, 1], p_static_w)
    return sorted(set(np.flatnonzero(pareto_mask(planes[0]))) | set(np.flatnonzero(pareto_mask(planes[1]))))


def _front_ends(truth: np.ndarray, candidates: list[Candidate], p_static_w: float) -> Callable[[int], str]:
    """Where a grid point's clock sits on the noise-free front: at (or next to) one of its ends, or inside."""
    step = {clock: i for i, clock in enumerate(sorted({c.clock_mhz for c in candidates}))}
    effective = truth[:, 1] - p_static_w * truth[:, 0]
    ends = {"fast end": np.argmin(truth[:, 0]), "total-energy lean end": np.argmin(truth[:, 1]),
            "effective-energy lean end": np.argmin(effective)}
    end_steps = {name: step[candidates[int(point)].clock_mhz] for name, point in ends.items()}

    def where(index: int) -> str:
        at = step[candidates[index].clock_mhz]
        return next((name for name, end in end_steps.items() if abs(end - at) <= 1), "inside")
    return where


def repair(measured: list[int], exhaustive_front: list[int], score: Callable[[list[int]], float],
           describe: Callable[[int], tuple], most: int = 5) -> list[dict]:
    """The fewest exhaustive-front points a search missed that bring it back to the target, found
    greedily (each step the point that adds the most), at most `most`; empty when it is at the target.

    A diagnostic for a search below the target: which points it would have needed, and where they
    sit on the front."""
    chosen, steps = set(measured), []
    missing = [i for i in exhaustive_front if i not in chosen]
    current = score(sorted(chosen))
    while current < TARGET and missing and len(steps) < most:
        gain, point = max((score(sorted(chosen | {i})) - current, i) for i in missing)
        chosen.add(point)
        missing.remove(point)
        current += gain
        candidate, where = describe(point)
        steps.append({"clock_mhz": candidate.clock_mhz, "comm_sms": candidate.comm_sms,
                      "launch_slot": candidate.launch_slot, "where": where, "gain": gain, "score": current})
    return steps


@dataclass(frozen=True)
class Grid:
    """One case's grid: every point's noise-free (time_s, energy_j) and the seed's noisy draw of it."""

    space: SearchSpace
    truth: np.ndarray
    noisy: np.ndarray
    p_static_w: float
    name: str
    size_class: str

    def problem(self) -> Problem:
        """The search problem that measures by looking the noisy draw up."""
        lookup = {self.space.candidate(i): tuple(self.noisy[i]) for i in range(self.space.size)}
        return Problem(self.name, self.space, lambda cs: [lookup[c] for c in cs], self.p_static_w, self.size_class)


def grid(case: Case) -> Grid:
    gpu = get_gpu(case.gpu)
    workload = build_workload(get_preset(case.model), tp=case.tp, cp=case.cp, pp=1, seq_len=case.seq,
                              micro_batch_size=case.mbs)
    ptype = workload.partition_types[case.partition]
    space = SearchSpace(gpu.search_clocks_mhz, tuple(ptype.comm_sms_grid), tuple(ptype.launch_slots))
    exact = Simulator(gpu)
    truth = np.array([(m.time_s, m.energy_j) for m in (
        exact.partition(ptype, c.clock_mhz, c.comm_sms, c.launch_slot) for c in map(space.candidate, range(space.size)))])
    noisy = truth * np.maximum(1 + case.noise * case.noise_rng().standard_normal(truth.shape), 0.05)
    return Grid(space, truth, noisy, gpu.p_static_w, ptype.name, ptype.size_class)


def front_points_measured(measured: list[int], true_front: np.ndarray) -> float:
    """Share of the noise-free front's grid points among the `measured` ones."""
    return float(np.isin(true_front, measured).mean()) if len(true_front) else 1.0


def ranked_nearest(gap: np.ndarray, budget: int, error: float, rng: np.random.Generator) -> list[int]:
    """The `budget` points of least relative gap to the front as ranked with a Gaussian `error` on
    the gap: a search whose predictions of the gap are off by `error` (RMS) measuring the nearest."""
    ranked = gap + error * rng.standard_normal(gap.shape)
    return [int(i) for i in np.argsort(ranked, kind="stable")[:budget]]


def hv_ratios(table: Grid) -> tuple[Callable[[list[int]], list[float]], list[float]]:
    """How a set of measured grid points scores: the hypervolume of the noise-free cost of the
    configurations on its noisy front, against the exhaustive search's, in the (time, effective
    energy) and (time, total energy) planes (axes normalised by the whole grid). Returns that
    function and the exhaustive search's hypervolumes."""
    truth, noisy, p_static_w = table.truth, table.noisy, table.p_static_w
    scales = [Normaliser.fit(plane) for plane in _planes(truth[:, 0], truth[:, 1], p_static_w)]

    def true_hv(indices: list[int]) -> list[float]:
        front = [indices[i] for i in _front(noisy[indices], p_static_w)]
        sub = _planes(truth[front, 0], truth[front, 1], p_static_w)
        return [hypervolume(scale(plane)) for scale, plane in zip(scales, sub, strict=True)]

    exhaustive = true_hv(list(range(table.space.size)))
    return (lambda indices: [hv / ref for hv, ref in zip(true_hv(indices), exhaustive, strict=True)]), exhaustive


def run_case(case: Case) -> dict:
    table = grid(case)
    space, truth, noisy = table.space, table.truth, table.noisy
    gpu = get_gpu(case.gpu)
    candidates = [space.candidate(i) for i in range(space.size)]
    problem = table.problem()
    planes = _planes(truth[:, 0], truth[:, 1], gpu.p_static_w)
    scales = [Normaliser.fit(plane) for plane in planes]
    optimum = [hypervolume(scale(plane)) for scale, plane in zip(scales, planes, strict=True)]
    ratios, exhaustive = hv_ratios(table)

    def coverage(indices: list[int]) -> list[float]:
        """HV of the true front of the measured configurations against the noise-free optimum."""
        front = [indices[i] for i in _front(truth[indices], gpu.p_static_w)]
        sub = _planes(truth[front, 0], truth[front, 1], gpu.p_static_w)
        return [hypervolume(scale(plane)) / best for scale, plane, best in zip(scales, sub, optimum, strict=True)]

    # The oracle's order: grid points by their noise-free relative distance to the noise-free front.
    gap = np.min([relative_gap(plane) for plane in planes], axis=0)
    nearest = [int(i) for i in np.argsort(gap, kind="stable")]
    true_front = np.flatnonzero(gap == 0)
    paper_budget = get_algorithm("paper").max_evaluations(problem)
    measured: dict[str, list[int]] = {}
    out = {"case": case.__dict__, "config": case.config, "grid": space.size, "methods": {},
           "exhaustive_vs_optimum": [e / o for e, o in zip(exhaustive, optimum, strict=True)]}
    for method in METHODS:
        algorithm = get_algorithm(method, evaluations=paper_budget) if method == "random" else get_algorithm(method)
        started = time.perf_counter()
        result = minimize(problem, algorithm, seed=case.seed)
        search_s = time.perf_counter() - started
        indices = measured[method] = [space.index_of(e.candidate) for e in result.measured]
        to_target = None
        for step in result.history:
            if min(ratios(indices[:step.evaluations])) >= TARGET:
                to_target = step.evaluations
                break
        final = ratios(indices)
        covered = coverage(indices)
        out["methods"][method] = {
            "evaluations": result.evaluations, "hv_effective": final[0], "hv_total": final[1],
            "coverage": min(covered), "front_points_measured": front_points_measured(indices, true_front),
            "to_target": to_target, "batches": len(result.history) - 1, "search_s": search_s,
        }
    where = _front_ends(truth, candidates, gpu.p_static_w)
    out["methods"]["default"]["repair"] = repair(
        measured["default"], _front(noisy, gpu.p_static_w), lambda chosen: min(ratios(chosen)),
        lambda i: (candidates[i], where(i)))
    completed = sorted(set(measured["default"]) | set(true_front.tolist()))
    out["methods"]["default"]["front_completed"] = dict(
        zip(("hv_effective", "hv_total"), ratios(completed), strict=True), evaluations=len(completed))
    budget = out["methods"]["default"]["evaluations"]
    subsets = {"band": nearest[:budget], "front": nearest[:len(true_front)]}
    draw = np.random.default_rng([case.seed, 1])
    for name, eps in WITHIN.items():
        inside = np.flatnonzero(gap <= eps)
        subsets[name] = (subsets["band"] if len(inside) <= budget
                         else [int(i) for i in draw.choice(inside, budget, replace=False)])
    for name, error in RANKED.items():
        subsets[name] = ranked_nearest(gap, budget, error, np.random.default_rng([case.seed, 2, int(1e4 * error)]))
    out["oracle"] = {name: dict(zip(("hv_effective", "hv_total"), ratios(indices), strict=True), evaluations=len(indices))
                     for name, indices in subsets.items()}
    return out


def _ratio(scores: dict) -> float:
    """A search's score: its hypervolume ratio in the worse of the two planes."""
    return min(scores["hv_effective"], scores["hv_total"])


def _per_type(results: list[dict], value: Callable[[dict], float]) -> dict[tuple, list[float]]:
    """Per partition type (configuration, partition), `value(result)` of each of its seeds."""
    per_type: dict[tuple, list[float]] = {}
    for r in results:
        per_type.setdefault((r["config"], r["case"]["partition"]), []).append(value(r))
    return per_type


def _type_medians(results: list[dict], value: Callable[[dict], float]) -> dict[tuple, float]:
    """Per partition type, the median over seeds of `value(result)`."""
    return {k: statistics.median(v) for k, v in _per_type(results, value).items()}


def lottery(results: list[dict], method: str = "default") -> dict:
    """Types below the target that per-search failures alone explain, and types that fail more often.

    Under the null that every type's searches fall below the target independently at the pooled
    rate p, a type's count of searches below over its n seeds is binomial(n, p); its median is below
    when more than half are (for even n, when half are it may or may not be: the expected count is
    then a range)."""
    below = _per_type(results, lambda r: _ratio(r["methods"][method]) < TARGET)
    rate = sum(map(sum, below.values())) / len(results)
    low = high = 0.0
    for flags in below.values():
        n = len(flags)
        low += binom.sf(n // 2, n, rate)  # more than half below
        high += binom.sf((n - 1) // 2, n, rate)  # at least half below
    alpha = 0.05 / len(below)
    systematic = sorted((" ".join(key), int(sum(flags)), len(flags)) for key, flags in below.items()
                        if binom.sf(sum(flags) - 1, len(flags), rate) < alpha)
    return {"per_search_rate": rate, "expected_types_below": (float(low), float(high)), "systematic": systematic}


def summarise(results: list[dict]) -> dict:
    summary: dict = {}
    for method in METHODS:
        rows = [r["methods"][method] for r in results]
        medians = _type_medians(results, lambda r, method=method: _ratio(r["methods"][method]))
        coverage_medians = _type_medians(results, lambda r, method=method: r["methods"][method]["coverage"])
        worst_key, worst = min(medians.items(), key=lambda kv: kv[1])
        reached = [m["to_target"] for m in rows if m["to_target"] is not None]
        summary[method] = {
            "searches_below_target": sum(_ratio(m) < TARGET for m in rows),
            "evaluations": statistics.median(m["evaluations"] for m in rows),
            "grid_share": statistics.median(m["evaluations"] / r["grid"] for m, r in zip(rows, results, strict=True)),
            "max_grid_share": max(m["evaluations"] / r["grid"] for m, r in zip(rows, results, strict=True)),
            "hv_effective": statistics.median(m["hv_effective"] for m in rows),
            "hv_total": statistics.median(m["hv_total"] for m in rows),
            "worst_type_median_hv": worst,
            "worst_type": " ".join(worst_key),
            # The acceptance is per type: every type's median over seeds at the target or above.
            "types_below_target": sorted(" ".join(k) for k, v in medians.items() if v < TARGET),
            "types": len(medians),
            "reached_target": f"{len(reached)}/{len(rows)}",
            "to_target": statistics.median(reached) if reached else None,
            "coverage": statistics.median(m["coverage"] for m in rows),
            "front_points_measured": statistics.mean(m["front_points_measured"] for m in rows),
            "types_below_target_coverage": sorted(" ".join(k) for k, v in coverage_medians.items() if v < TARGET),
            "search_s_per_batch": statistics.median(
                m["search_s"] / max(1, m["batches"]) for m in rows),
        }
    completed = [r["methods"]["default"]["front_completed"] for r in results]
    summary["default_front_completed"] = {
        "searches_below_target": sum(_ratio(c) < TARGET for c in completed),
        "extra_evaluations": statistics.mean(
            c["evaluations"] / r["methods"]["default"]["evaluations"] - 1 for c, r in zip(completed, results, strict=True)),
    }
    summary["default_lottery"] = lottery(results)
    repairs = [r["methods"]["default"]["repair"] for r in results if r["methods"]["default"]["repair"]]
    summary["default_repair"] = {
        "searches": len(repairs),
        "by_one_point": sum(len(steps) == 1 for steps in repairs),
        "not_within_five": sum(steps[-1]["score"] < TARGET for steps in repairs),
        "first_point_where": dict(Counter(steps[0]["where"] for steps in repairs).most_common()),
        "first_point_clock_mhz": dict(Counter(steps[0]["clock_mhz"] for steps in repairs).most_common(3)),
    }
    pairs = [r["methods"]["default"]["to_target"] / r["methods"]["paper"]["to_target"] for r in results
             if r["methods"]["default"]["to_target"] and r["methods"]["paper"]["to_target"]]
    summary["default_over_paper_to_target"] = statistics.median(pairs) if pairs else None
    for name in ORACLES:
        medians = _type_medians(results, lambda r, name=name: _ratio(r["oracle"][name]))
        summary[f"oracle_{name}"] = {
            "grid_share": statistics.median(r["oracle"][name]["evaluations"] / r["grid"] for r in results),
            "searches_below_target": sum(_ratio(r["oracle"][name]) < TARGET for r in results),
            "types_below_target": sum(v < TARGET for v in medians.values()),
            "worst_type_median_hv": min(medians.values()),
        }
    summary["exhaustive_vs_optimum"] = statistics.median(min(r["exhaustive_vs_optimum"]) for r in results)
    summary["default_over_paper_evaluations"] = statistics.median(
        r["methods"]["default"]["evaluations"] / r["methods"]["paper"]["evaluations"] for r in results)
    return summary


def print_table(summary: dict, cases_run: int, elapsed_s: float) -> None:
    print(f"MBO efficiency on the simulated {summary.get('gpu', GPU)}: {cases_run} partition searches (types × configs × seeds), "
          f"{elapsed_s:.0f} s")
    header = (f"{'method':<9} {'evals':>6} {'grid%':>6} {'max%':>6} {'HV eff':>7} {'HV tot':>7} {'worst type':>10} "
              f"{'reach99':>8} {'evals→99':>9} {'s/batch':>8}")
    print(header)
    print("-" * len(header))
    for method in METHODS:
        s = summary[method]
        to_target = "-" if s["to_target"] is None else f"{s['to_target']:.0f}"
        print(f"{method:<9} {s['evaluations']:>6.0f} {100 * s['grid_share']:>5.1f}% {100 * s['max_grid_share']:>5.1f}% "
              f"{s['hv_effective']:>7.4f} {s['hv_total']:>7.4f} {s['worst_type_median_hv']:>10.4f} "
              f"{s['reached_target']:>8} {to_target:>9} {s['search_s_per_batch']:>8.3f}")
    ratio = summary["default_over_paper_to_target"]
    print(f"default/paper evaluations to reach {TARGET:.0%} of the exhaustive HV (median over searches): "
          f"{'-' if ratio is None else f'{ratio:.2f}'}; default/paper evaluations used: "
          f"{summary['default_over_paper_evaluations']:.2f}")
    print(f"worst type (default): {summary['default']['worst_type']}; exhaustive front under noise vs the "
          f"noise-free optimum: {summary['exhaustive_vs_optimum']:.4f} HV (median)")
    below = summary["default"]["types_below_target"]
    print(f"default: {len(below)} of {summary['default']['types']} partition types below {TARGET:.0%} "
          f"(median over seeds){': ' + ', '.join(below) if below else ''}")
    print("searches below " + f"{TARGET:.0%}: " + ", ".join(
        f"{method} {summary[method]['searches_below_target']}" for method in METHODS) + f" of {cases_run}")
    luck = summary["default_lottery"]
    low, high = luck["expected_types_below"]
    expected = f"{low:.1f}" if abs(high - low) < 0.05 else f"{low:.1f}–{high:.1f}"
    print(f"default, the lottery (diagnostic): {100 * luck['per_search_rate']:.1f}% of searches below {TARGET:.0%}; "
          f"were every type below that often, {expected} of {summary['default']['types']} types would be below "
          f"(median over seeds), {len(summary['default']['types_below_target'])} are; types below more often "
          f"than that rate explains (binomial tail < 5% / types): "
          + (", ".join(f"{name} ({k} of {n})" for name, k, n in luck["systematic"]) or "none"))
    fix = summary["default_repair"]
    if fix["searches"]:
        print(f"default, searches below {TARGET:.0%} repaired by adding exhaustive-front points they missed "
              f"(greedy, diagnostic): {fix['by_one_point']} of {fix['searches']} by one point, "
              f"{fix['not_within_five']} not by five; the first point: "
              + ", ".join(f"{where} {n}" for where, n in fix["first_point_where"].items())
              + "; at " + ", ".join(f"{clock} MHz {n}" for clock, n in fix["first_point_clock_mhz"].items()))
    done = summary["default_front_completed"]
    print("noise-free front points measured (mean share, diagnostic): " + ", ".join(
        f"{method} {summary[method]['front_points_measured']:.1%}" for method in METHODS)
          + f"; default with the noise-free front points it missed added ({done['extra_evaluations']:+.1%} "
          f"evaluations, mean): {done['searches_below_target']} of {cases_run} searches below {TARGET:.0%}")
    for name, what in ORACLES.items():
        o = summary[f"oracle_{name}"]
        print(f"oracle ({what}, {100 * o['grid_share']:.1f}% of the grid; a ceiling, not a method): "
              f"{o['searches_below_target']} of {cases_run} searches and {o['types_below_target']} of "
              f"{summary['default']['types']} types below {TARGET:.0%}, worst type {o['worst_type_median_hv']:.4f}")
    for method in METHODS:
        s = summary[method]
        below = s["types_below_target_coverage"]
        print(f"coverage ({method}; true front of the measured configurations vs the noise-free optimum, "
              f"diagnostic): median {s['coverage']:.4f}, {len(below)} of {s['types']} types below {TARGET:.0%}"
              f"{': ' + ', '.join(below) if below and method == 'default' else ''}")


def add_case_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that choose the cases and how they run (`cases`), shared by the MBO benches."""
    parser.add_argument("--quick", action="store_true", help="two configurations instead of sixteen")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per partition type (default 3)")
    parser.add_argument("--noise", type=float, default=0.01, help="relative measurement noise (default 0.01)")
    parser.add_argument("--workers", type=int, default=1, help="processes (default 1)")
    parser.add_argument("--json", metavar="PATH", help="also write every result and the summary as JSON")
    parser.add_argument("--gpu", default=GPU, help=f"simulated GPU (default {GPU}; held out: H100-SXM5-80GB, ...)")
    parser.add_argument("--models", metavar="M[,M...]", default=",".join(MODELS),
                        help=f"model presets (default {','.join(MODELS)}; --quick: the first at TP8, the last at CP2+TP4)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_arguments(parser)
    parser.add_argument("--partitions", metavar="P[,P...]",
                        help="only these partition types (e.g. fwd_ao_ar,bwd_o_ar: the single-slot grids)")
    args = parser.parse_args(argv)
    todo = cases(args.quick, args.seeds, args.noise, args.gpu, tuple(args.models.split(",")))
    if args.partitions:
        wanted = set(args.partitions.split(","))
        todo = [case for case in todo if case.partition in wanted]
        if not todo:
            parser.error(f"--partitions: no partition type of the configurations is named {sorted(wanted)}")
    started = time.perf_counter()
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as pool:
            results = list(pool.map(run_case, todo))
    else:
        results = []
        for number, case in enumerate(todo, 1):
            results.append(run_case(case))
            print(f"\r{number}/{len(todo)} {case.config} {case.partition} seed {case.seed}   ",
                  end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    summary = summarise(results)
    summary["gpu"] = args.gpu
    print_table(summary, len(results), time.perf_counter() - started)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"summary": summary, "results": results}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
