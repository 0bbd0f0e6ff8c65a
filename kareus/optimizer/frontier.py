"""The iteration frontier: time–energy trade-off of a whole 1F1B iteration, with `lowtime`.

The iteration is a DAG of pipeline instructions (stage × microbatch × {forward, backward}):
a chain inside every stage in 1F1B issue order, F(s, m) → F(s+1, m) and B(s+1, m) → B(s, m).
Each instruction picks one option from its stage's microbatch frontier (composition). The
Phillips–Dessouky algorithm (lowtime's Rust min-cut core) starts from the slowest, cheapest plan
and shortens the iteration one time unit at a time at the least added cost — the effective
energy of all instructions. Every step is a plan; the last is the max-throughput plan.

Static energy is not part of the cost: every GPU pays `P_static` for the whole iteration,
bubbles included, so it is added back in closed form, and the iteration energy over all GPUs is

    E_iter = gpus_per_stage · Σ_instructions E_eff + num_gpus · P_static · T_iter.

Lowtime works on quantised time and a fitted convex cost curve per instruction; both are only
the solver's search device. Each step's chosen options are re-evaluated exactly (critical path
with the options' real times, real energies), and the frontier keeps the Pareto set of those
exact points, downsampled to a table of at most `max_rows` rows that always holds the fastest
plan and the energy minimum. The time unit is chosen from the span between the all-slowest and
all-fastest schedules so the solver takes a bounded number of steps whatever the pipeline size.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np
from lowtime.cost_model import CostModel, ExponentialModel
from lowtime.graph_utils import add_sink_node, add_source_node
from lowtime.operation import CandidateExecutionOptions, ExecutionOption, Operation, OperationSpec
from lowtime.solver import PhillipsDessouky

from kareus.errors import KareusError
from kareus.plan import FrontierRow, FrontierTable, InstructionOption, StageOptions, one_f_one_b

logger = logging.getLogger(__name__)

# Largest per-unit cost change handed to lowtime, whose min-cut treats 10,000 as infinite
# capacity and rounds capacities to 1e-6: costs are rescaled into that comfortable range.
_MAX_SLOPE_PER_UNIT = 10.0


@dataclass(frozen=True)
class FrontierSettings:
    """Solver settings.

    `target_steps` None: adaptive, fewer Phillips–Dessouky steps for bigger DAGs (each step is a
    min-cut over the whole critical DAG). `solve_microbatches` None: pipelines with many more
    microbatches than stages are solved on a shorter pipeline with the same warm-up and
    cool-down and the steady-state choices repeated (see `expand_picks`); the result is always
    evaluated on the full pipeline.
    """

    target_steps: int | None = None
    max_rows: int = 200
    # "exponential" (lowtime's fit), "convex" (piecewise-linear lower hull of the options) or
    # "both": solve with each and keep the Pareto set of all steps — the solver's path depends
    # on the model, and two paths cover each other's detours.
    cost_model: str = "both"
    both_up_to_instructions: int = 512  # bigger DAGs solve once, with the convex model (time)
    solve_microbatches: int | None = None

    def steps_for(self, num_instructions: int) -> int:
        if self.target_steps is not None:
            return self.target_steps
        return int(np.clip(40_000 // max(num_instructions, 1), 150, 1000))

    def models_for(self, num_instructions: int) -> tuple[str, ...]:
        if self.cost_model != "both":
            return (self.cost_model,)
        return ("exponential", "convex") if num_instructions <= self.both_up_to_instructions else ("convex",)

    def microbatches_for(self, num_stages: int, num_microbatches: int) -> int:
        cap = self.solve_microbatches or max(2 * num_stages + 2, 12)
        return min(num_microbatches, cap)


@dataclass(frozen=True)
class PipelineDAG:
    """The 1F1B instruction DAG: node i is `nodes[i] = (stage, kind, microbatch)`."""

    num_stages: int
    num_microbatches: int
    nodes: tuple[tuple[int, str, int], ...]
    predecessors: tuple[tuple[int, ...], ...]  # in topological order of `nodes`
    successors: tuple[tuple[int, ...], ...]

    @classmethod
    def build(cls, num_stages: int, num_microbatches: int) -> PipelineDAG:
        orders = [one_f_one_b(num_stages, num_microbatches, s) for s in range(num_stages)]
        index = {(s, k, m): None for s in range(num_stages) for k, m in orders[s]}
        preds: dict[tuple[int, str, int], list[tuple[int, str, int]]] = {n: [] for n in index}
        for s, order in enumerate(orders):
            for (k0, m0), (k1, m1) in itertools.pairwise(order):
                preds[(s, k1, m1)].append((s, k0, m0))
            for m in range(num_microbatches):
                if s + 1 < num_stages:
                    preds[(s + 1, "forward", m)].append((s, "forward", m))
                    preds[(s, "backward", m)].append((s + 1, "backward", m))
        graph = nx.DiGraph()
        graph.add_nodes_from(index)
        graph.add_edges_from((p, n) for n, ps in preds.items() for p in ps)
        topo = list(nx.lexicographical_topological_sort(graph, key=str))
        position = {n: i for i, n in enumerate(topo)}
        predecessors = tuple(tuple(position[p] for p in preds[n]) for n in topo)
        successors: list[list[int]] = [[] for _ in topo]
        for i, ps in enumerate(predecessors):
            for p in ps:
                successors[p].append(i)
        return cls(num_stages, num_microbatches, tuple(topo), predecessors,
                   tuple(tuple(c) for c in successors))

    def makespan_s(self, durations_s: Sequence[float]) -> float:
        """Iteration time: the longest path through the DAG with these instruction durations."""
        finish = [0.0] * len(self.nodes)
        for i, preds in enumerate(self.predecessors):
            start = max((finish[p] for p in preds), default=0.0)
            finish[i] = start + durations_s[i]
        return max(finish)


class ConvexCostModel(CostModel):
    """Piecewise-linear lower convex hull of an instruction's (quantised time, cost) options.

    Exact at the hull's vertices, convex as Phillips–Dessouky requires, and defined for any
    number of options (the exponential fit needs at least three and may fail to converge).
    """

    def __init__(self, options: CandidateExecutionOptions) -> None:
        points = sorted({(o.quant_time, o.cost) for o in options.options})
        hull: list[tuple[int, float]] = []
        for p in points:
            while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
                hull.pop()
            hull.append(p)
        self.times = np.array([t for t, _ in hull], dtype=float)
        self.costs = np.array([c for _, c in hull], dtype=float)

    def __call__(self, quant_time: int) -> float:
        if len(self.times) == 1:
            return float(self.costs[0])
        return float(np.interp(quant_time, self.times, self.costs))


def _cross(o: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def _cost_model(candidates: CandidateExecutionOptions, kind: str) -> CostModel:
    if kind == "exponential" and len(candidates.options) >= 4:
        try:
            with warnings.catch_warnings():  # failed fits of the initial-guess grid are expected
                warnings.simplefilter("ignore")
                return ExponentialModel(candidates, search_strategy="best")
        except (ValueError, TypeError, RuntimeError) as error:
            logger.info("exponential fit failed (%s); using the convex hull", error)
    return ConvexCostModel(candidates)


@dataclass
class PipelineProblem:
    """Everything the solver loop needs: the DAG, option tables and the exact evaluator."""

    dag: PipelineDAG
    options: tuple[StageOptions, ...]
    p_static_w: float
    gpus_per_stage: int

    def table(self, node: int) -> tuple[InstructionOption, ...]:
        stage, kind, _ = self.dag.nodes[node]
        return self.options[stage].of(kind)

    def evaluate(self, picks: Sequence[int]) -> tuple[float, float]:
        """Exact (iteration time, iteration energy over all GPUs) of one option per node."""
        chosen = [self.table(i)[k] for i, k in enumerate(picks)]
        time_s = self.dag.makespan_s([o.time_s for o in chosen])
        effective_j = sum(o.effective_energy_j(self.p_static_w) for o in chosen)
        num_gpus = self.gpus_per_stage * self.dag.num_stages
        return time_s, self.gpus_per_stage * effective_j + num_gpus * self.p_static_w * time_s

    def picks_within(self, other: FrontierTable, row: FrontierRow) -> list[int]:
        """Per instruction, the least-energy option of this problem no slower than what `row` of
        another method's frontier runs there (the fastest option where none is that fast).

        Options are Pareto-sorted fastest first, so that is the last option within the time.
        """
        times = {(s, k): [o.time_s for o in self.options[s].of(k)]
                 for s in range(self.dag.num_stages) for k in ("forward", "backward")}
        picks = []
        for s, k, m in self.dag.nodes:
            budget_s = other.options[s].of(k)[row.choice[s][0 if k == "forward" else 1][m]].time_s
            picks.append(max(bisect.bisect_right(times[s, k], budget_s * (1 + 1e-12)) - 1, 0))
        return picks

    def row(self, picks: Sequence[int]) -> FrontierRow:
        time_s, energy_j = self.evaluate(picks)
        per_stage = {(s, k): [0] * self.dag.num_microbatches
                     for s in range(self.dag.num_stages) for k in ("forward", "backward")}
        for (s, k, m), pick in zip(self.dag.nodes, picks, strict=True):
            per_stage[(s, k)][m] = pick
        choice = tuple((tuple(per_stage[(s, "forward")]), tuple(per_stage[(s, "backward")]))
                       for s in range(self.dag.num_stages))
        return FrontierRow(time_s, energy_j, choice)


def iteration_frontier(options: Sequence[StageOptions], num_microbatches: int, *, p_static_w: float,
                       gpus_per_stage: int, settings: FrontierSettings = FrontierSettings(),
                       starts: Sequence[FrontierTable] = ()) -> FrontierTable:
    """The iteration frontier as one table (fastest first), solved with Phillips–Dessouky.

    `starts` are other methods' frontiers over the same pipeline: each of their plans, mapped onto
    these options instruction by instruction (`picks_within`), joins the candidates. Phillips–
    Dessouky is a heuristic on long pipelines; where it detours, a plan of a method whose options
    these dominate still fits here, so the result is never worse than those methods'.
    """
    options = tuple(options)
    for s, stage in enumerate(options):
        if not stage.forward or not stage.backward:
            raise KareusError(f"stage {s} has no measured way to run its "
                              f"{'forward' if not stage.forward else 'backward'} instruction: "
                              "the profile lacks points at every clock")
    full = PipelineProblem(PipelineDAG.build(len(options), num_microbatches), options, p_static_w, gpus_per_stage)
    solved_microbatches = settings.microbatches_for(len(options), num_microbatches)
    reduced = (full if solved_microbatches == num_microbatches else
               PipelineProblem(PipelineDAG.build(len(options), solved_microbatches), options, p_static_w, gpus_per_stage))
    rows = []
    models = settings.models_for(len(reduced.dag.nodes))
    for picks in (p for model in models for p in _solve(reduced, settings, model)):
        expanded = picks if reduced is full else expand_picks(reduced.dag, full.dag, picks)
        rows.append(full.row(reclaim_slack(full, expanded)))
    rows.append(full.row(reclaim_slack(full, _extreme_picks(full, fastest=True))))
    for table in starts:
        if len(table.options) != len(options):
            raise ValueError(f"a start frontier has {len(table.options)} stages, this pipeline {len(options)}")
        rows += [full.row(reclaim_slack(full, full.picks_within(table, row))) for row in table.rows]
    return FrontierTable(options, _pareto_rows(rows, settings.max_rows))


def _extreme_picks(problem: PipelineProblem, fastest: bool) -> list[int]:
    return [0 if fastest else len(problem.table(i)) - 1 for i in range(len(problem.dag.nodes))]


def unit_time_for(problem: PipelineProblem, steps: int) -> float:
    """The time unit giving about `steps` solver steps between the slowest and fastest plans."""
    slow_s, _ = problem.evaluate(_extreme_picks(problem, fastest=False))
    fast_s, _ = problem.evaluate(_extreme_picks(problem, fastest=True))
    shortest_s = min(o.time_s for st in problem.options for o in st.forward + st.backward)
    return max((slow_s - fast_s) / steps, shortest_s * 1e-4)


def expand_picks(reduced: PipelineDAG, full: PipelineDAG, picks: Sequence[int]) -> list[int]:
    """Map a shorter pipeline's choices onto the full one.

    The first half of the short pipeline's microbatches maps onto the first microbatches, the
    second half onto the last ones (warm-up and cool-down keep their choices), and the steady
    state in between repeats the two microbatches just before the middle, alternately.
    """
    short, long_ = reduced.num_microbatches, full.num_microbatches
    half = short // 2
    by_node = dict(zip(reduced.nodes, picks, strict=True))

    def source_microbatch(m: int) -> int:
        if m < half:
            return m
        if m >= long_ - (short - half):
            return m - (long_ - short)
        return max(half - 2, 0) + (m - half) % min(2, half)

    return [by_node[(s, k, source_microbatch(m))] for s, k, m in full.nodes]


def reclaim_slack(problem: PipelineProblem, picks: Sequence[int]) -> list[int]:
    """Slow every instruction that has slack down to the slowest option that still fits.

    Options are Pareto-sorted (slower = less effective energy), so this lowers energy and never
    lengthens the iteration: in reverse topological order each instruction may finish as late as
    its successors' latest starts allow, starting no earlier than it does now.
    """
    dag = problem.dag
    picks = list(picks)
    durations = [problem.table(i)[k].time_s for i, k in enumerate(picks)]
    earliest_start = [0.0] * len(picks)
    for i, preds in enumerate(dag.predecessors):
        earliest_start[i] = max((earliest_start[p] + durations[p] for p in preds), default=0.0)
    makespan_s = max(es + d for es, d in zip(earliest_start, durations, strict=True))
    latest_start = [makespan_s] * len(picks)
    for i in reversed(range(len(picks))):
        latest_finish = min((latest_start[c] for c in dag.successors[i]), default=makespan_s)
        room_s = (latest_finish - earliest_start[i]) * (1 + 1e-12)
        table = problem.table(i)
        k = picks[i]
        while k + 1 < len(table) and table[k + 1].time_s <= room_s:
            k += 1
        picks[i] = k
        latest_start[i] = latest_finish - table[k].time_s
    return picks


def _solve(problem: PipelineProblem, settings: FrontierSettings, cost_model: str) -> list[list[int]]:
    """The option picks of the starting plan and of every solver step."""
    unit_s = unit_time_for(problem, settings.steps_for(len(problem.dag.nodes)))
    specs = {key: _spec(problem, key, unit_s, cost_model)
             for key in {(s, k) for s, k, _ in problem.dag.nodes}}
    scale = _MAX_SLOPE_PER_UNIT / max(max(_max_slope(spec) for spec in specs.values()), 1e-12)
    for spec in specs.values():
        spec.cost_model = _ScaledCostModel(spec.cost_model, scale)

    graph = nx.DiGraph()
    ops = []
    for i, (s, k, _) in enumerate(problem.dag.nodes):
        op = Operation(spec=specs[(s, k)])
        ops.append(op)
        graph.add_node(i, op=op)
    graph.add_edges_from((p, i) for i, preds in enumerate(problem.dag.predecessors) for p in preds)
    source, sink = len(ops), len(ops) + 1
    add_source_node(graph, source)
    add_sink_node(graph, sink)
    graph.graph["source_node"], graph.graph["sink_node"] = source, sink

    steps = [[op.assigned_knob for op in ops]]
    for _ in PhillipsDessouky(graph).run():
        steps.append([op.assigned_knob for op in ops])
    return steps


def _spec(problem: PipelineProblem, key: tuple[int, str], unit_s: float, cost_model: str) -> OperationSpec:
    stage, kind = key
    table = problem.options[stage].of(kind)
    execution = [ExecutionOption(real_time=o.time_s, unit_time=unit_s,
                                 cost=o.effective_energy_j(problem.p_static_w), knob=k)
                 for k, o in enumerate(table)]
    candidates = CandidateExecutionOptions(options=execution)
    return OperationSpec(options=candidates, cost_model=_cost_model(candidates, cost_model))


def _max_slope(spec: OperationSpec) -> float:
    times = sorted({o.quant_time for o in spec.options.options})
    if len(times) < 2:
        return 0.0
    return max(abs(spec.cost_model(a) - spec.cost_model(b)) for a, b in itertools.pairwise(times))


class _ScaledCostModel(CostModel):
    """A cost model times a constant: keeps lowtime's flow capacities in a well-conditioned range."""

    def __init__(self, inner: CostModel, scale: float) -> None:
        self.inner = inner
        self.scale = scale

    def __call__(self, quant_time: int) -> float:
        return self.scale * self.inner(quant_time)


def _pareto_rows(rows: Sequence[FrontierRow], max_rows: int) -> tuple[FrontierRow, ...]:
    """Pareto set on (time, energy), deduplicated, fastest first, downsampled to `max_rows`.

    The downsampling keeps the fastest plan and the energy minimum (the two ends) and otherwise
    the rows nearest to evenly spaced iteration times.
    """
    unique = {row.choice: row for row in rows}
    ordered = sorted(unique.values(), key=lambda r: (r.time_s, r.energy_j))
    front: list[FrontierRow] = []
    for row in ordered:
        if not front or row.energy_j < front[-1].energy_j:
            front.append(row)
    if len(front) <= max_rows:
        return tuple(front)
    times = np.array([r.time_s for r in front])
    targets = np.linspace(times[0], times[-1], max_rows)
    picked = sorted(set(np.searchsorted(times, targets).clip(0, len(front) - 1)) | {0, len(front) - 1})
    return tuple(front[i] for i in picked)
