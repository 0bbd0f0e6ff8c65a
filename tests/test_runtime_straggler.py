"""Straggler-aware re-selection: the decisions, the twin's what-if, and the runtime on gloo.

One of two data-parallel replicas gets slower (a simulated GPU with a lower clock ceiling,
`KAREUS_SIM_STRAGGLER`): after `patience_steps` the other replica re-selects the cheapest frontier
point that is not slower than the straggler, and returns `recovery_steps` after the slowdown ends.
The gloo test asserts the plan switches every rank recorded, never durations.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kareus.errors import KareusError
from kareus.job import PlanJob
from kareus.plan import (
    FrontierRow,
    FrontierTable,
    InstructionOption,
    Plan,
    Prediction,
    Provenance,
    StageOptions,
    plan_at_row,
)
from kareus.runtime import TrainConfig, build_schedule, run_rank
from kareus.runtime.parallel import init_distributed, spawn_local
from kareus.runtime.straggler import SimStraggler
from kareus.sim import Simulator, get_gpu
from kareus.sim.replica import ceiling_for_slowdown, instruction_cost, replica_iteration
from kareus.spec import parse_job
from kareus.straggler import StragglerPolicy, StragglerWatch, simulate_straggler
from kareus.workload.models import get_preset
from kareus.workload.partitions import build_workload

torch.set_num_threads(1)
GPU = "A100-SXM4-40GB"
CLOCKS_MHZ = (1320, 1230, 1140, 1050)  # the tiny model's time–energy frontier on the simulated A100
STEPS = 12
KNOB = "1:0.15@2-7"  # replica 1 is 15 % slower for steps 2..6
POLICY = {"straggler_patience_steps": 2, "straggler_recovery_steps": 2}


def manifest(steps: int = STEPS, objective: dict | None = None) -> dict:
    return {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob", "metadata": {"name": "straggler"},
            "spec": {"model": {"preset": "tiny"}, "sequenceLength": 16,
                     "parallelism": {"tensor": 1, "pipeline": 1, "context": 1, "data": 2, "microBatchSize": 2,
                                     "numMicroBatches": 2},
                     "objective": objective or {"maxThroughput": {}},
                     "training": {"image": "x", "steps": steps, "gpusPerNode": 2, "nodes": 1},
                     "gpu": {"product": GPU}}}


def tiny_plan(objective: dict | None = None, clocks_mhz: tuple[int, ...] = CLOCKS_MHZ) -> Plan:
    """A DP2 plan whose frontier rows run every instruction at one clock, with the simulator's own
    numbers (so predicted and modelled times agree): faster rows cost more energy. `clocks_mhz` must
    be such a frontier (fastest first)."""
    shape = get_preset("tiny")
    workload = build_workload(shape, tp=1, cp=1, pp=1, seq_len=16, micro_batch_size=2)
    gpu = get_gpu(GPU)
    job = PlanJob(shape, GPU, 1, 1, 1, 2, 2, 2, 16, True, workload.stage_layers, gpu.supported_clocks_mhz,
                  gpu.p_static_w, name="straggler", steps=STEPS)
    simulator = Simulator(gpu)

    def option(kind: str, clock: int) -> InstructionOption:
        time_s, effective_j = instruction_cost(simulator, workload, 0, InstructionOption(clock, "sequential", 1, 1)
                                               .instruction(kind, 0))
        return InstructionOption(clock, "sequential", time_s, effective_j + gpu.p_static_w * time_s)

    options = StageOptions(tuple(option("forward", c) for c in clocks_mhz),
                           tuple(option("backward", c) for c in clocks_mhz))
    rows = []
    for k in range(len(clocks_mhz)):
        choice = (((k, k), (k, k)),)
        probe = FrontierTable((options,), (FrontierRow(1.0, 1.0, choice),))
        run = replica_iteration(simulator, workload, [probe.stages_for(0)[0].instructions])
        rows.append(FrontierRow(run.time_s, 2 * run.energy_j(1), choice))
    frontier = FrontierTable((options,), tuple(rows))
    assert [r.time_s for r in rows] == sorted(r.time_s for r in rows)  # a frontier: slower ...
    assert [r.energy_j for r in rows] == sorted((r.energy_j for r in rows), reverse=True)  # ... is cheaper
    plan = Plan(job, objective or {"maxThroughput": {}}, Prediction(rows[0].time_s, rows[0].energy_j),
                Provenance(method="kareus"), frontier.stages_for(0), frontier)
    return Plan.from_dict(plan.to_dict())


# ---------------------------------------------------------------- the decisions


POINTS = [(1.00, 10.0), (1.05, 9.0), (1.10, 8.5), (1.20, 8.0), (1.40, 7.9)]


def test_watch_reselects_after_patience_and_returns_after_recovery():
    watch = StragglerWatch(POINTS, 0, 2, StragglerPolicy(threshold=0.05, patience_steps=3, recovery_steps=2))
    healthy = [1.0, 1.0]
    slow = [1.0, 1.12]  # replica 1 is 12 % slower
    assert watch.observe(0, healthy) is None
    assert watch.observe(1, slow) is None and watch.observe(2, slow) is None
    decision = watch.observe(3, slow)
    assert decision is not None and decision.reason == "straggler" and decision.straggler == 1
    assert decision.rows == (2, 0)  # the cheapest point predicted within 1.12 s
    assert decision.slowdown == pytest.approx(0.12)
    # replica 0 now runs row 2 (1.10 s predicted); its ratio stays 1, so the straggler stays visible
    assert watch.observe(4, [1.10, 1.12]) is None and watch.rows == [2, 0]
    assert watch.observe(5, [1.10, 1.0]) is None  # recovered for one step: not yet
    back = watch.observe(6, [1.10, 1.0])
    assert back is not None and back.reason == "recovered" and back.rows == (0, 0)


def test_watch_ignores_a_hiccup_and_small_differences():
    watch = StragglerWatch(POINTS, 0, 3, StragglerPolicy(threshold=0.05, patience_steps=2, recovery_steps=2))
    assert watch.observe(0, [1.0, 1.3, 1.0]) is None  # one slow step (a checkpoint, a stall)
    assert watch.observe(1, [1.0, 1.0, 1.0]) is None
    assert watch.observe(2, [1.0, 1.3, 1.0]) is None
    for step in range(3, 8):
        assert watch.observe(step, [1.0, 1.04, 1.0]) is None  # within the threshold
    assert watch.rows == [0, 0, 0]


def test_watch_never_goes_slower_than_the_objective_allows():
    watch = StragglerWatch(POINTS, 0, 2, StragglerPolicy(patience_steps=1), max_time_s=1.06)
    decision = watch.observe(0, [1.0, 1.3])
    assert decision is not None and decision.rows == (1, 0)  # 1.20 s would fit the straggler, not the budget


def test_watch_retargets_when_the_straggler_gets_slower():
    watch = StragglerWatch(POINTS, 0, 2, StragglerPolicy(patience_steps=1))
    assert watch.observe(0, [1.0, 1.07]).rows == (1, 0)
    assert watch.observe(1, [1.05, 1.25]).rows == (3, 0)


def test_sim_straggler_knob_parses_and_refuses_nonsense():
    assert SimStraggler.parse("1:0.15@2-7") == SimStraggler(1, 0.15, 2, 7)
    assert SimStraggler.parse("0:0.2") == SimStraggler(0, 0.2)
    assert SimStraggler.parse(None) is None
    knob = SimStraggler(1, 0.15, 2, 7)
    assert [knob.active(s) for s in (1, 2, 6, 7)] == [False, True, True, False]
    for bad in ("one:0.1", "1:0.1@5-3", "1:abc"):
        with pytest.raises(KareusError, match="KAREUS_SIM_STRAGGLER"):
            SimStraggler.parse(bad)
    with pytest.raises(KareusError, match="straggler"):
        TrainConfig.from_job(parse_job(manifest()), straggler_patience_steps=0)


def test_ceiling_for_slowdown_hits_the_fraction():
    plan = tiny_plan()
    simulator, workload = Simulator(get_gpu(GPU)), plan.job.workload()
    stages = [st.instructions for st in plan.stages]

    def time_at(ceiling):
        return replica_iteration(simulator, workload, stages, clock_ceiling_mhz=ceiling).time_s

    ceiling = ceiling_for_slowdown(time_at, simulator.gpu, 0.15)
    assert time_at(ceiling) == pytest.approx(1.15 * time_at(None), rel=1e-6)
    assert ceiling < CLOCKS_MHZ[0]
    with pytest.raises(KareusError, match="lowest clock"):
        ceiling_for_slowdown(time_at, simulator.gpu, 9.0)


def test_plan_at_row_runs_that_row_of_the_same_frontier():
    plan = tiny_plan()
    other = plan_at_row(plan, 2)
    assert other.selected_row == 2 and other.frontier == plan.frontier and other.objective == plan.objective
    assert {i.clock_mhz for i in other.stages[0].instructions} == {CLOCKS_MHZ[2]}
    assert other.predicted.iteration_time_s == plan.frontier.rows[2].time_s


# ---------------------------------------------------------------- the twin


def test_twin_keeps_the_iteration_time_and_saves_energy_at_15_percent():
    run = simulate_straggler(tiny_plan(), slowdown=0.15, steps=20).to_dict()
    assert abs(run["with"]["time_s"] / run["without"]["time_s"] - 1) < 0.01
    assert run["with"]["energy_j"] < run["without"]["energy_j"]
    assert run["with"]["switches"][0]["reason"] == "straggler" and run["with"]["final_rows"] == [2, 0]
    assert run["without"]["final_rows"] == [0, 0]


def test_twin_returns_when_the_straggler_recovers():
    run = simulate_straggler(tiny_plan(), slowdown=0.15, steps=20, slow_steps=(0, 8),
                             policy=StragglerPolicy(patience_steps=2, recovery_steps=2))
    assert [(d.step, d.reason) for d in run.decisions] == [(1, "straggler"), (9, "recovered")]
    assert run.with_reselection[-1].rows == (0, 0)
    pairs = list(zip(run.with_reselection, run.without, strict=True))
    assert all(c.time_s <= w.time_s * 1.01 for c, w in pairs[:8])  # while slow: the straggler's pace
    # the price of waiting for recovery: two steps at the re-selected point's pace, then as before
    assert all(c.time_s == pytest.approx(tiny_plan().frontier.rows[2].time_s) for c, _ in pairs[8:10])
    assert all(c == w for c, w in pairs[10:])


def test_twin_needs_two_replicas():
    plan = tiny_plan()
    single = replace(plan, job=replace(plan.job, data=1))
    with pytest.raises(KareusError, match="at least 2 data-parallel replicas"):
        simulate_straggler(single, slowdown=0.15)


# ---------------------------------------------------------------- the runtime (gloo, 2 replicas)


def _worker(rank: int, store, tmp: str) -> None:
    tmp_path = Path(tmp)
    plan = tiny_plan()
    job = parse_job(manifest())
    config = TrainConfig.from_job(job, seed=1, device="cpu", out_dir=str(tmp_path / "out"), sim_straggler=KNOB,
                                  **POLICY)
    ctx = init_distributed(config.layout, rank=rank, store=store, device="cpu")
    schedule = build_schedule(job, plan, config)
    slowed, _ = run_rank(ctx, config, schedule, plan=plan)
    steady, _ = run_rank(ctx, replace(config, out_dir=None, sim_straggler=None), schedule, plan=plan)
    (tmp_path / f"rank{rank}.pkl").write_bytes(pickle.dumps({"slowed": slowed, "steady": steady}))


def test_gloo_replica_switches_plan_while_the_other_is_slow_and_back():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spawn_local(2, _worker, tmp)
        runs = [pickle.loads((Path(tmp) / f"rank{r}.pkl").read_bytes()) for r in range(2)]
        records = [json.loads(line) for line in (Path(tmp) / "out" / "train.jsonl").read_text().splitlines()]
    # slow at steps 2..6; patience 2 → decided at step 3, replica 0 on the cheaper row from step 4;
    # calm from step 7; recovery 2 → decided at step 8, back from step 9
    healthy_rows = (0,) * 4 + (2,) * 5 + (0,) * 3
    assert runs[0]["slowed"].frontier_rows == healthy_rows
    assert runs[1]["slowed"].frontier_rows == (0,) * STEPS  # the straggler keeps its plan
    for run in runs:
        decisions = [(d.step, d.reason, d.rows) for d in run["slowed"].straggler_decisions]
        assert decisions == [(3, "straggler", (2, 0)), (8, "recovered", (0, 0))]
        assert run["slowed"].plan_revisions == (0,) * 4 + (1,) * 5 + (2,) * 3
        assert run["steady"].straggler_decisions == () and set(run["steady"].frontier_rows) == {0}
    assert runs[0]["slowed"].losses == runs[0]["steady"].losses  # plans change clocks, never the numerics
    assert [r["plan_revision_reason"] for r in records] == [""] * 4 + ["straggler"] * 5 + ["recovered"] * 3
    assert [r["replica_frontier_rows"] for r in records] == [[row, 0] for row in healthy_rows]
    assert [r["straggler_replica"] for r in records] == [None, None] + [1] * 5 + [None] * 5
    slow, fast = records[5], records[0]
    assert slow["replica_time_s"][1] == pytest.approx(1.15 * fast["replica_time_s"][1], rel=1e-6)
    # the job runs at the straggler's pace; re-selection keeps it and costs less energy
    unselected = records[3]  # slow, replica 0 still on row 0
    assert slow["modelled_time_s"] == pytest.approx(unselected["modelled_time_s"], rel=0.01)
    assert slow["energy_j"] < unselected["energy_j"]
