"""Training runs end to end: plans, the CLI, train.jsonl, metrics, clocks, data, energy."""

from __future__ import annotations

import hashlib
import json
import math
import urllib.request

import numpy as np
import pytest
import torch
import yaml

from kareus import metric_names
from kareus.cli import main as cli_main
from kareus.daemon_client import RecordingClockClient
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
)
from kareus.runtime import PlanFollower, RunInstruction, Schedule, TrainConfig, run_rank, train
from kareus.runtime.data import Batcher, builtin_corpus, load_tokens
from kareus.runtime.energy import SimulatedEnergy, pipeline_time_s
from kareus.runtime.metrics import MetricsExporter, StepRecord
from kareus.runtime.optimizer_recipe import OptimizerRecipe
from kareus.runtime.parallel import init_distributed
from kareus.sim import get_gpu
from kareus.spec import parse_job
from kareus.workload.models import get_preset
from kareus.workload.partitions import PartitionConfig, build_workload

torch.set_num_threads(1)
TINY = get_preset("tiny")


def _manifest(tp: int = 1, pp: int = 1, mbs: int = 2, m: int = 2, seq: int = 16, steps: int = 2) -> dict:
    return {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob", "metadata": {"name": "rt-test"},
            "spec": {"model": {"preset": "tiny"}, "sequenceLength": seq,
                     "parallelism": {"tensor": tp, "pipeline": pp, "context": 1, "data": 1,
                                     "microBatchSize": mbs, "numMicroBatches": m},
                     "objective": {"maxThroughput": {}},
                     "training": {"image": "x", "steps": steps, "gpusPerNode": tp * pp, "nodes": 1}}}


def _plan(manifest: dict, clocks: tuple[int, int] = (1410, 1005)) -> Plan:
    """A valid plan whose microbatch 0 runs partitioned at clocks[0] and the others sequential at
    clocks[1] (two options per direction, chosen per microbatch)."""
    spec = parse_job(manifest).spec
    par = spec.parallelism
    workload = build_workload(TINY, tp=par.tensor, cp=1, pp=par.pipeline, seq_len=spec.sequence_length,
                              micro_batch_size=par.micro_batch_size)
    gpu = get_gpu(spec.gpu_product)
    job = PlanJob(TINY, spec.gpu_product, par.tensor, 1, par.pipeline, 1, par.micro_batch_size,
                  par.num_micro_batches, spec.sequence_length, True, workload.stage_layers,
                  gpu.supported_clocks_mhz, gpu.p_static_w, name="rt-test")
    options = []
    for stage in workload.stages:
        def opts(kind: str, stage=stage):
            types = workload.partition_types
            configs = {n: types[n].default_config() for n in stage.forward_instances if kind == "forward"}
            configs |= {n: PartitionConfig(types[n].launch_slots[-1], types[n].comm_sms_grid[0])
                        for n in stage.backward_instances if kind == "backward"}
            recompute = {n: types[n].default_config() for n in stage.recompute_instances} if kind == "backward" else {}
            return (InstructionOption(clocks[0], "partitioned", 1.0, 100.0, configs, recompute),
                    InstructionOption(clocks[1], "sequential", 1.2, 90.0))
        options.append(StageOptions(opts("forward"), opts("backward")))
    picks = tuple(0 if m == 0 else 1 for m in range(par.num_micro_batches))
    frontier = FrontierTable(tuple(options), (FrontierRow(1.0, 100.0, tuple((picks, picks) for _ in options)),))
    plan = Plan(job, {"maxThroughput": {}}, Prediction(1.0, 100.0), Provenance(method="kareus"),
                frontier.stages_for(0), frontier)
    return Plan.from_dict(plan.to_dict())  # validated like a plan file


def test_loss_decreases_over_50_steps_on_the_builtin_corpus():
    config = TrainConfig(shape=TINY, seq_len=64, micro_batch_size=4, num_microbatches=1, steps=50, seed=1,
                         device="cpu", recipe=OptimizerRecipe.constant("adamw", 3e-3))
    result, _ = run_rank(init_distributed(config.layout, device="cpu"), config, Schedule.uniform(1, 1))
    # Norms start at one since the init fix: the first steps already learn (5.54, 5.20, 4.95, 4.71, 4.48).
    assert result.losses[0] == pytest.approx(math.log(256), abs=0.1)  # uniform over the bytes at initialisation
    first, last = np.mean(result.losses[:5]), np.mean(result.losses[-5:])
    assert last < first - 2.5, result.losses  # 4.97 -> 1.89


def test_train_follows_the_plan_clock_by_clock(tmp_path):
    manifest = _manifest(m=3, steps=2)
    plan = _plan(manifest)
    clock = RecordingClockClient()
    result = train(parse_job(manifest), plan, clock=clock, out_dir=str(tmp_path), metrics_port=0,
                   metrics_addr="127.0.0.1", device="cpu")
    expected = [(f"stage0/{i.kind}/{i.microbatch}", i.clock_mhz) for _ in range(2)
                for i in plan.stages[0].instructions]
    assert [(r.instruction, r.clock_mhz) for r in clock.log] == [*expected, ("reset", None)]
    times = [r.time_s for r in clock.log]
    assert times == sorted(times)
    assert [(r.instruction, r.clock_mhz) for r in result.clock_log] == expected
    assert result.metrics_port and result.metrics_port > 0
    lines = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    for line in lines:
        assert {"step", "loss", "iteration_time_s", "energy_j", "tokens", "tokens_per_joule"} <= set(line)
        assert line["energy_source"] == "simulated" and line["energy_j"] > 0
        assert line["clock_mhz"] == {"min": 1005.0, "max": 1410.0, "mean": pytest.approx((1410 + 2 * 1005) / 3)}
        assert line["tokens"] == 3 * 2 * 16
    assert lines[0]["loss"] == pytest.approx(result.losses[0])


def test_plan_clocks_change_the_modelled_energy_not_the_numerics():
    manifest = _manifest(m=2, steps=2)
    fast = train(parse_job(manifest), _plan(manifest, (1410, 1410)), device="cpu")
    slow = train(parse_job(manifest), _plan(manifest, (1005, 1005)), device="cpu")
    assert fast.losses == slow.losses
    assert fast.modelled_time_s < slow.modelled_time_s


def test_cli_train_spawns_tp2_and_follows_a_plan_file(tmp_path, capsys):
    manifest = _manifest(tp=2, m=2, steps=2)
    job_path, plan_path = tmp_path / "job.yaml", tmp_path / "plan.json"
    job_path.write_text(yaml.safe_dump(manifest))
    _plan(manifest).save(plan_path)
    code = cli_main(["train", str(job_path), "--plan", str(plan_path), "--nproc", "2", "--out",
                     str(tmp_path / "out"), "--json", "--seed", "3"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["energy_source"] == "simulated"
    lines = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[1]["loss"] == pytest.approx(summary["final_loss"])
    digest = hashlib.sha256(plan_path.read_bytes()).hexdigest()
    assert [(r["plan_revision"], r["plan_sha256"], r["clock_control"]) for r in lines] == [(0, digest, "none")] * 2


@pytest.mark.parametrize("args,message", [
    (["--steps", "-1"], "--steps must be >= 0"),
    (["--nproc", "3"], "--nproc 3 × NNODES 1 = 3 processes, but tensor×context×pipeline×data = 1"),
    (["--metrics-port", "70000"], "--metrics-port must be <= 65535"),
    (["--plan", "/nonexistent/plan.json"], "cannot read plan"),
    (["--data", "/nonexistent/tokens.txt"], "--data /nonexistent/tokens.txt: cannot read tokens"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, args, message):
    job_path = tmp_path / "job.yaml"
    job_path.write_text(yaml.safe_dump(_manifest()))
    assert cli_main(["train", str(job_path), "--steps", "1", *args]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kareus: error:") and message in err and "\n" not in err


def test_plan_for_another_layout_is_refused(tmp_path):
    with pytest.raises(KareusError, match="numMicroBatches: job 2, plan 3"):
        train(parse_job(_manifest(m=2)), _plan(_manifest(m=3)), device="cpu")


def test_metrics_endpoint_serves_the_worker_metrics():
    exporter = MetricsExporter(0, addr="127.0.0.1", rank=3, stage=1, job="j", plan={"method": "kareus"})
    try:
        exporter.observe(StepRecord(0, 2.5, 0.25, 40.0, 800, 20.0, None, "simulated"), gpu_energy_j=10.0)
        text = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=5).read().decode()
    finally:
        exporter.close()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            metric, _, labels = name.partition("{")
            samples[(metric, frozenset(labels.rstrip("}").split(",")))] = float(value)
    base = {'kareusjob="j"', 'rank="3"', 'stage="1"'}

    def sample(metric: str, *extra: str) -> float:
        return samples[(metric, frozenset(base | set(extra)))]

    assert sample(metric_names.ITERATION_SECONDS) == 0.25
    assert sample(metric_names.ITERATION_ENERGY_JOULES, 'scope="gpu"') == 10.0
    assert sample(metric_names.ITERATION_ENERGY_JOULES, 'scope="job"') == 40.0
    assert sample(metric_names.TOKENS_PER_JOULE) == 20.0
    assert sample(metric_names.PLAN_INFO, 'method="kareus"') == 1.0


def test_plan_follower_hooks_for_another_training_loop():
    """A foreign loop (not our model) follows a schedule through the hooks."""
    configs = {"fwd_attn": PartitionConfig("rope_0", 6)}
    schedule = Schedule.uniform(2, 2, clock_mhz=1200, configs=configs)
    clock = RecordingClockClient()
    follower = PlanFollower(schedule.stages[1], stage=1, clock=clock)
    seen = []
    for _ in range(2):
        follower.on_step_begin()
        for kind, microbatch in (("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)):
            follower.on_instruction_begin(kind, microbatch)
            seen.append(follower.current_partition_config("fwd_attn"))
            follower.on_instruction_end(kind)
    assert seen == [configs["fwd_attn"], None] * 4
    assert len(clock.log) == 8 and {r.clock_mhz for r in clock.log} == {1200}
    follower.on_step_begin()
    with pytest.raises(KareusError, match="instruction 0 is forward of microbatch 0"):
        follower.on_instruction_begin("backward", 0)
    follower.on_instruction_begin("forward", 0)
    assert follower.current_partition_config("recompute:fwd_attn") is None  # forward: no recompute
    with pytest.raises(KareusError, match="outside that instruction"):
        follower.on_instruction_end("backward")


def test_batches_are_deterministic_and_split_by_data_rank():
    tokens = load_tokens(None, 256)
    one = Batcher(tokens, 16, 2, 4, dp=1, seed=9)
    two = Batcher(tokens, 16, 2, 2, dp=2, seed=9)
    whole = one.microbatches(3, 0)
    halves = two.microbatches(3, 0) + two.microbatches(3, 1)
    for (a, at), (b, bt) in zip(whole, halves, strict=True):
        assert torch.equal(a, b) and torch.equal(at, bt)
    assert torch.equal(whole[0][0][:, 1:], whole[0][1][:, :-1])  # targets are the next tokens
    assert not torch.equal(one.microbatches(4, 0)[0][0], whole[0][0])
    assert builtin_corpus() == builtin_corpus()


def test_token_files(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"hello world")
    assert load_tokens(tmp_path / "t.txt", 256).tolist() == list(b"hello world")
    np.save(tmp_path / "t.npy", np.array([1, 2, 300]))
    with pytest.raises(KareusError, match=r"token ids must be in 0..255"):
        load_tokens(tmp_path / "t.npy", 256)
    with pytest.raises(KareusError, match="too few"):
        Batcher(np.arange(10), 16, 2, 1)


def test_pipeline_time_is_the_1f1b_critical_path():
    schedule = Schedule.uniform(2, 2)
    # stage 0: F0 F1 B0 B1 ... order from 1F1B: stage0 = F0 F1 B0 B1, stage1 = F0 B0 F1 B1
    times = [[1.0, 1.0, 2.0, 2.0], [1.0, 2.0, 1.0, 2.0]]
    # s0: F0 0-1, F1 1-2; s1: F0 1-2, B0 2-4, F1 4-5, B1 5-7; s0: B0 4-6, B1 7-9
    assert pipeline_time_s(schedule, times) == pytest.approx(9.0)


def test_simulated_energy_adds_static_power_of_every_gpu_for_the_iteration():
    workload = build_workload(TINY, tp=2, cp=1, pp=2, seq_len=16, micro_batch_size=2)
    schedule = Schedule.uniform(2, 2, clock_mhz=1200)
    energy = SimulatedEnergy(workload, "A100-SXM4-40GB", schedule, gpus_per_stage=2)
    result = energy.result
    gpu = get_gpu("A100-SXM4-40GB")
    effective = [sum(energy._instruction(s, ins)[1] for ins in stage) for s, stage in enumerate(schedule.stages)]
    assert result.energy_j == pytest.approx(2 * sum(effective) + 4 * gpu.p_static_w * result.time_s)
    slower = SimulatedEnergy(workload, "A100-SXM4-40GB", Schedule.uniform(2, 2, clock_mhz=900), 2).result
    assert slower.time_s > result.time_s


def test_schedule_from_plan_keeps_modes_and_sequential_drops_configs():
    manifest = _manifest(m=2)
    schedule = Schedule.from_plan(_plan(manifest))
    assert [i.mode for i in schedule.stages[0]] == ["partitioned", "partitioned", "sequential", "sequential"]
    sequential = schedule.as_sequential()
    assert all(i.mode == "sequential" and not i.configs for i in sequential.stages[0])
    assert [i.clock_mhz for i in sequential.stages[0]] == [i.clock_mhz for i in schedule.stages[0]]
    with pytest.raises(KareusError, match="needs a forward and a backward"):
        Schedule(((RunInstruction("forward", 0),),), 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without a GPU")
def test_cuda_smoke_says_clearly_that_it_needs_a_gpu():
    from kareus.runtime.smoke import cuda_smoke

    with pytest.raises(KareusError, match="needs a CUDA GPU"):
        cuda_smoke()


def test_node_group_from_the_training_pod_environment(monkeypatch):
    from kareus.runtime.parallel import NodeGroup

    for var in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert NodeGroup.from_env() == NodeGroup()
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("NODE_RANK", "1")
    with pytest.raises(KareusError, match="needs MASTER_ADDR and MASTER_PORT"):
        NodeGroup.from_env()
    monkeypatch.setenv("MASTER_ADDR", "job-train-0.job-train.ns.svc")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert NodeGroup.from_env() == NodeGroup(2, 1, "job-train-0.job-train.ns.svc", 29500)
    monkeypatch.setenv("NODE_RANK", "2")
    with pytest.raises(KareusError, match=r"NODE_RANK must be in 0\.\.NNODES-1"):
        NodeGroup.from_env()
    monkeypatch.setenv("NODE_RANK", "1")
    with pytest.raises(KareusError, match=r"--nproc 3 × NNODES 2 = 6 processes, but tensor×context×pipeline×data = 2"):
        train(parse_job(_manifest(tp=2)), nproc=3, device="cpu")


def test_a_user_error_in_a_spawned_rank_is_one_line(tmp_path, capsys):
    job_path = tmp_path / "job.yaml"
    job_path.write_text(yaml.safe_dump(_manifest(tp=2)))
    (tmp_path / "tokens.npy").write_bytes(b"not numpy")
    assert cli_main(["train", str(job_path), "--steps", "1", "--data", str(tmp_path / "tokens.npy")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kareus: error: rank ") and "cannot read tokens" in err[-1]
    assert not any("Traceback" in line for line in err)


def test_clocks_reach_a_real_node_daemon_and_are_reset(tmp_path):
    """Training with `daemon_socket` locks this rank's (simulated) GPU per the plan, then resets it."""
    from test_daemon_support import start_daemon, wait_for

    from kareus.daemon_client import DaemonConnection
    from kareus.metric_names import GPU_CLOCK_CHANGES_TOTAL

    daemon = start_daemon(tmp_path, "--standalone")
    try:
        with DaemonConnection(daemon.socket_path) as connection:
            gpu = next(g.uuid for g in connection.discover() if g.controllable)
        manifest = _manifest(m=2, steps=2)
        train(parse_job(manifest), _plan(manifest, (1410, 1005)), daemon_socket=daemon.socket_path, device="cpu")
        # 2 steps × 4 instructions alternating 1410/1005 MHz, then the reset when training ends
        wait_for(lambda: daemon.metric(GPU_CLOCK_CHANGES_TOTAL, gpu_uuid=gpu) >= 2)
        with DaemonConnection(daemon.socket_path) as connection:
            wait_for(lambda: connection.read([gpu])[0].locked_clock_mhz is None)
    finally:
        assert daemon.stop() == 0
