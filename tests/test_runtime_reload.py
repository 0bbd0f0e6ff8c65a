"""Plan roll-out at a step boundary, and the clock-control state in train.jsonl.

A running job's plan file changes (the operator re-selected a plan): every rank must switch at the
same step, the clock requests and train.jsonl must show it, a bad plan must be rejected without
stopping training, and the losses must be those of the same model and data (plans change clocks and
execution modes, never the numerics). Workers without clock control say so per step, in the fields
the operator reads for its ClockControlDegraded condition.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from kareus_operator.publish import summarise_progress
from test_runtime_train import _manifest, _plan

from kareus.daemon_client import RecordingClockClient, connect
from kareus.errors import KareusError
from kareus.plan import Plan, Prediction
from kareus.runtime import TrainConfig, build_schedule, run_rank, train
from kareus.runtime.parallel import Layout, init_distributed, spawn_local
from kareus.runtime.reload import PlanFileWatcher, PlanRollout, plan_digest
from kareus.spec import parse_job

torch.set_num_threads(1)
STEPS = 5
SWITCH_STEP = 2  # before this step rank 0 swaps in plan B; before the next two, bad plans


def _plans(tp: int) -> dict[str, bytes]:
    """Plan A (the start), plan B (other clocks, all partitioned, other prediction), and two plans
    that must be rejected: not JSON, and a valid plan for another layout."""
    manifest = _manifest(tp=tp, m=2, steps=STEPS)
    a = _plan(manifest, (1410, 1005))
    b = replace(a, predicted=Prediction(2.5, 80.0), stages=tuple(replace(st, instructions=_swap_modes(st.instructions))
                                                                   for st in a.stages))
    other = _plan(_manifest(tp=tp, m=3, steps=STEPS))
    return {"a": a.to_json().encode(), "b": Plan.from_dict(b.to_dict()).to_json().encode(),
            "garbage": b'{"apiVersion": "kareus.dev/v1alpha1", "kind": "Plan", "stages": [',
            "other_layout": other.to_json().encode()}


def _swap_modes(instructions: tuple) -> tuple:
    """Microbatch 0 sequential, the others partitioned (A has it the other way round), and every
    instruction at its own clock."""
    partitioned = {i.kind: i for i in instructions if i.mode == "partitioned"}
    sequential = {i.kind: i for i in instructions if i.mode == "sequential"}
    return tuple(replace(i, clock_mhz=1200 + 15 * k, mode=source.mode, configs=source.configs,
                         recompute_configs=source.recompute_configs)
                 for k, i in enumerate(instructions)
                 for source in [sequential[i.kind] if i.mode == "partitioned" else partitioned[i.kind]])


def _swapper(path: Path, plans: dict[str, bytes]):
    """Rank 0's step hook: write plan B before SWITCH_STEP, then the two bad plans (atomically,
    as the kubelet swaps a ConfigMap volume)."""
    order = {SWITCH_STEP: "b", SWITCH_STEP + 1: "garbage", SWITCH_STEP + 2: "other_layout"}

    def hook(step: int) -> None:
        if step in order:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(plans[order[step]])
            os.replace(tmp, path)
    return hook


def _config(tp: int, out_dir: Path | None, plan_path: Path | None) -> TrainConfig:
    manifest = _manifest(tp=tp, m=2, steps=STEPS)
    job = parse_job(manifest)
    return TrainConfig.from_job(job, seed=2, device="cpu", out_dir=str(out_dir) if out_dir else None,
                                plan_path=str(plan_path) if plan_path else None)


def _expected_clocks(plan_bytes: bytes, stage: int = 0) -> list[tuple[str, int]]:
    plan = Plan.loads(plan_bytes)
    return [(f"stage{stage}/{i.kind}/{i.microbatch}", i.clock_mhz) for i in plan.stages[stage].instructions]


def _per_step(log: list[tuple[str, int]], per_step: int) -> list[list[tuple[str, int]]]:
    return [log[k:k + per_step] for k in range(0, len(log), per_step)]


def _reload_worker(rank: int, store, tmp: str) -> None:
    """2 ranks (TP2): a run whose plan file changes mid-run, then the same run without changes."""
    tmp_path = Path(tmp)
    plans = _plans(tp=2)
    plan_path = tmp_path / "plan.json"
    config = _config(2, tmp_path / "out", plan_path)
    ctx = init_distributed(config.layout, rank=rank, store=store, device="cpu")
    job = parse_job(_manifest(tp=2, m=2, steps=STEPS))
    plan_a = Plan.loads(plans["a"])
    schedule = build_schedule(job, plan_a, config)
    # rank 0 controls clocks (recorded); rank 1 was given a daemon socket that does not exist
    clock = RecordingClockClient() if rank == 0 else connect(str(tmp_path / "missing" / "kareus.sock"))
    config = replace(config, plan_digest=plan_digest(plans["a"]))
    hook = _swapper(plan_path, plans) if rank == 0 else None
    result, _ = run_rank(ctx, config, schedule, clock=clock, plan=plan_a, step_hook=hook)
    reference, _ = run_rank(ctx, replace(config, out_dir=None, plan_path=None), schedule, plan=plan_a)
    (tmp_path / f"rank{rank}.pkl").write_bytes(pickle.dumps({"result": result, "reference": reference}))


def test_tp2_ranks_switch_plans_at_the_same_step_boundary(tmp_path):
    plans = _plans(tp=2)
    (tmp_path / "plan.json").write_bytes(plans["a"])
    spawn_local(2, _reload_worker, str(tmp_path))
    runs = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    clocks_a, clocks_b = _expected_clocks(plans["a"]), _expected_clocks(plans["b"])
    assert [c for _, c in clocks_a] != [c for _, c in clocks_b]
    for rank, run in enumerate(runs):
        result = run["result"]
        assert result.plan_revisions == (0, 0, 1, 1, 1), rank  # the two bad plans were rejected
        steps = _per_step([(r.instruction, r.clock_mhz) for r in result.clock_log], len(clocks_a))
        assert steps == [clocks_a] * SWITCH_STEP + [clocks_b] * (STEPS - SWITCH_STEP), rank
        # same model, same data: the plan changes clocks and modes, not the numerics
        assert result.losses == pytest.approx(run["reference"].losses, rel=1e-5), rank
        assert result.clock_control == ("degraded",) * STEPS
    assert runs[0]["result"].losses[-1] < runs[0]["result"].losses[0]

    lines = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(STEPS))
    assert [line["plan_revision"] for line in lines] == [0, 0, 1, 1, 1]
    assert [line["plan_predicted_iteration_time_s"] for line in lines] == [1.0, 1.0, 2.5, 2.5, 2.5]
    assert [line["plan_predicted_iteration_energy_j"] for line in lines] == [100.0, 100.0, 80.0, 80.0, 80.0]
    assert [line["plan_sha256"] for line in lines] == [plan_digest(plans["a"])] * 2 + [plan_digest(plans["b"])] * 3
    assert lines[1]["clock_mhz"] == {"min": 1005.0, "max": 1410.0, "mean": pytest.approx((1410 + 1005) / 2)}
    assert lines[2]["clock_mhz"] == {"min": 1200.0, "max": 1245.0, "mean": pytest.approx(1222.5)}
    assert lines[1]["modelled_time_s"] != lines[2]["modelled_time_s"]  # the simulated GPU follows the new plan
    # the worker without a daemon: degraded, with the rank and the missing socket in the reason
    for line in lines:
        assert line["clock_control"] == "degraded"
        assert line["clock_control_reason"].startswith("rank 1: ") and "missing" in line["clock_control_reason"]
    summary = summarise_progress((tmp_path / "out" / "train.jsonl").read_text().splitlines())
    assert summary["clockControlDegraded"] == lines[-1]["clock_control_reason"]


def test_one_process_rollout_logs_the_switch_and_each_rejection(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kareus.runtime")
    plans = _plans(tp=1)
    plan_path = tmp_path / "plan.json"
    plan_path.write_bytes(plans["a"])
    config = _config(1, tmp_path / "out", plan_path)  # no digest given: the file as found at start
    plan_a = Plan.loads(plans["a"])
    schedule = build_schedule(parse_job(_manifest(m=2, steps=STEPS)), plan_a, config)
    clock = RecordingClockClient()
    ctx = init_distributed(config.layout, device="cpu")
    result, _ = run_rank(ctx, config, schedule, clock=clock, plan=plan_a, step_hook=_swapper(plan_path, plans))
    assert result.plan_revisions == (0, 0, 1, 1, 1)
    requested = _per_step([(r.instruction, r.clock_mhz) for r in clock.log if r.instruction != "reset"], 4)
    assert requested == [_expected_clocks(plans["a"])] * 2 + [_expected_clocks(plans["b"])] * 3
    messages = [r.getMessage() for r in caplog.records if r.name == "kareus.runtime"]
    switches = [m for m in messages if "takes effect" in m]
    assert len(switches) == 1 and "plan revision 1" in switches[0] and "at step 2" in switches[0]
    assert "2.5 s, 80 J (was 1 s, 100 J)" in switches[0]
    rejections = [m for m in messages if "rejected" in m]
    assert len(rejections) == 2 and all("\n" not in m for m in rejections)
    assert "before step 3" in rejections[0] and "not valid JSON" in rejections[0]
    assert "before step 4" in rejections[1] and "numMicroBatches: job 2, plan 3" in rejections[1]
    lines = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert [line["clock_control"] for line in lines] == ["active"] * STEPS  # a clock client that works
    assert all(line["clock_control_reason"] == "" for line in lines)
    assert "clockControlDegraded" not in summarise_progress([json.dumps(line) for line in lines])


def test_a_missing_daemon_socket_marks_every_step_degraded(tmp_path):
    manifest = _manifest(m=2, steps=2)
    socket_path = tmp_path / "no-daemon.sock"
    result = train(parse_job(manifest), _plan(manifest), daemon_socket=str(socket_path), out_dir=str(tmp_path),
                   device="cpu")
    assert result.clock_control == ("degraded", "degraded")
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert all(r["clock_control"] == "degraded" and str(socket_path) in r["clock_control_reason"] for r in records)
    assert records[0]["clock_control_reason"].startswith("rank 0: ")
    assert str(socket_path) in summarise_progress(lines)["clockControlDegraded"]
    # without a daemon socket there is no clock control to lose: "none", and no condition
    quiet = train(parse_job(manifest), _plan(manifest), out_dir=str(tmp_path / "quiet"), device="cpu")
    assert quiet.clock_control == ("none", "none")
    assert "clockControlDegraded" not in summarise_progress((tmp_path / "quiet" / "train.jsonl").read_text()
                                                            .splitlines())


def test_watcher_reports_content_changes_once_and_ignores_rewrites(tmp_path):
    plans = _plans(tp=1)
    path = tmp_path / "plan.json"
    path.write_bytes(plans["a"])
    watcher = PlanFileWatcher(path, plan_digest(plans["a"]))
    assert watcher.poll() is None  # the plan in use
    tmp = tmp_path / "x"
    tmp.write_bytes(plans["a"])
    os.replace(tmp, path)  # a new file, same content: not a new plan
    assert watcher.poll() is None
    path.write_bytes(plans["b"])
    assert watcher.poll() == plans["b"]
    assert watcher.poll() is None  # reported once
    path.write_bytes(plans["garbage"])
    assert watcher.poll() == plans["garbage"]  # the rollout rejects it; it is not re-sent every step
    assert watcher.poll() is None
    path.unlink()  # mid-swap: unchanged, looked at again next time
    assert watcher.poll() is None
    path.write_bytes(plans["b"])
    assert watcher.poll() == plans["b"]
    started_late = PlanFileWatcher(path)  # no digest: the content found at start is the plan in use
    assert started_late.digest == plan_digest(plans["b"]) and started_late.poll() is None


def _refusal_worker(rank: int, store, tmp: str) -> None:
    """2 ranks, no training: rank 1 cannot run the new plan (as a stage whose configs do not fit)."""
    tmp_path = Path(tmp)
    plans = _plans(tp=1)
    path = tmp_path / "plan.json"
    init_distributed(Layout(tp=2), rank=rank, store=store, device="cpu")

    def build(plan: Plan) -> int:
        if rank == 1 and plan.predicted.iteration_time_s == 2.5:
            raise KareusError("stage 1 cannot run it")
        return rank

    handler = _ListHandler()
    logging.getLogger("kareus.runtime").addHandler(handler)
    rollout = PlanRollout(path, plan_digest(plans["a"]), build, rank=rank, distributed=True)
    seen = []
    for step, content in enumerate(("a", "b", "other_layout")):
        if rank == 0:
            path.write_bytes(plans[content])
        new = rollout.check(step)
        seen.append(None if new is None else (new.built, new.digest == plan_digest(plans[content])))
    (tmp_path / f"refusal{rank}.json").write_text(json.dumps({"seen": seen, "log": handler.lines}))


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_plan_one_rank_refuses_is_taken_by_none_and_rank_0_says_why(tmp_path):
    (tmp_path / "plan.json").write_bytes(_plans(tp=1)["a"])
    spawn_local(2, _refusal_worker, str(tmp_path))
    runs = [json.loads((tmp_path / f"refusal{r}.json").read_text()) for r in range(2)]
    # step 0: the plan in use (no change); step 1: refused by rank 1; step 2: a plan both accept
    assert runs[0]["seen"] == [None, None, [0, True]]
    assert runs[1]["seen"] == [None, None, [1, True]]
    assert len(runs[0]["log"]) == 1 and runs[1]["log"] == []
    assert "before step 1" in runs[0]["log"][0] and "rank 1: stage 1 cannot run it" in runs[0]["log"][0]
