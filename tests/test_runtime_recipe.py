"""The training recipe: learning-rate schedules, weight-decay groups, the global gradient norm and
clipping, resuming mid-schedule, and bf16 with fp32 master weights.

The layouts are compared, not assumed: a TP2 × PP2 run (gloo, 4 processes) must report the same
global gradient norm as one process, step by step, with clipping active, for an untied and a tied
model; a run resumed from a checkpoint at step 3 must step at the uninterrupted run's rates and
reach its losses.
"""

from __future__ import annotations

import json
import math
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kareus.errors import EXIT_CONFIG, KareusError
from kareus.runtime import Schedule, TrainConfig, run_rank
from kareus.runtime.grad_norm import clip_, counted_here, global_grad_norm
from kareus.runtime.lr_schedule import LrSchedule
from kareus.runtime.model import shard
from kareus.runtime.optimizer_recipe import OptimizerRecipe
from kareus.runtime.parallel import init_distributed, spawn_local
from kareus.workload.models import get_preset

torch.set_num_threads(1)
TINY = get_preset("tiny")


# schedules ------------------------------------------------------------------------------------

def test_warmup_then_each_decay_shape_at_chosen_steps():
    common = {"peak_lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 4, "decay_steps": 24}
    values = {kind: LrSchedule(kind=kind, **common) for kind in ("constant", "linear", "cosine", "wsd")}
    for schedule in values.values():  # warmup: peak · (step + 1) / warmup, the peak at its last step
        assert [schedule(s) for s in range(4)] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2])
    assert [values["constant"](s) for s in (4, 14, 24, 100)] == pytest.approx([1e-2] * 4)
    # 20 decay steps: progress 0, 1/2, 1 at steps 4, 14, 24, then the floor
    assert [values["linear"](s) for s in (4, 9, 14, 24, 100)] == pytest.approx([1e-2, 7.75e-3, 5.5e-3, 1e-3, 1e-3])
    quarter = 1e-3 + 9e-3 * (1 + math.cos(math.pi / 4)) / 2
    assert [values["cosine"](s) for s in (4, 9, 14, 24, 100)] == pytest.approx([1e-2, quarter, 5.5e-3, 1e-3, 1e-3])
    # WSD: stable at the peak until the last 20 % (4 steps: 20..24), then linear to the floor
    assert [values["wsd"](s) for s in (4, 19, 20, 22, 24, 100)] == pytest.approx(
        [1e-2, 1e-2, 1e-2, 5.5e-3, 1e-3, 1e-3])


def test_recipe_defaults_resolve_per_run():
    recipe = OptimizerRecipe()
    assert (recipe.name, recipe.beta1, recipe.beta2, recipe.eps, recipe.weight_decay, recipe.clip_grad_norm,
            recipe.schedule_kind) == ("adamw", 0.9, 0.95, 1e-8, 0.1, 1.0, "cosine")
    tiny = recipe.schedule(150, TINY)
    assert (tiny.peak_lr, tiny.min_lr, tiny.warmup_steps, tiny.decay_steps) == (1e-2, pytest.approx(1e-3), 15, 150)
    long = recipe.schedule(1_000_000, get_preset("llama3.1-8b"))
    assert (long.peak_lr, long.warmup_steps, long.decay_steps) == (3e-4, 2000, 1_000_000)
    assert recipe.schedule(10, get_preset("llama3.3-70b")).peak_lr == 1.5e-4
    explicit = recipe.with_overrides(lr=2e-3, min_lr=0.0, warmup_steps=3, decay_steps=None, schedule_kind="wsd")
    assert explicit.schedule(40, TINY) == LrSchedule(2e-3, 0.0, 3, 40, "wsd")


def test_bad_recipe_values_name_the_field():
    assert OptimizerRecipe(lr=0.0).lr == 0.0  # a frozen run: a weights round trip, a model's loss as it is
    for values, field in (({"lr": -1e-3}, "optimizer.lr"), ({"lr": 11.0}, "optimizer.lr"), ({"name": "lamb"}, "optimizer.name"),
                          ({"schedule_kind": "step"}, "optimizer.schedule"), ({"beta2": 1.0}, "optimizer.beta2"),
                          ({"lr": 1e-3, "min_lr": 1e-2}, "optimizer.minLr"),
                          ({"warmup_steps": 10, "decay_steps": 5}, "optimizer.decaySteps"),
                          ({"clip_grad_norm": -1.0}, "optimizer.clipGradNorm")):
        with pytest.raises(KareusError, match=field) as error:
            OptimizerRecipe(**values)
        assert error.value.exit_code == EXIT_CONFIG


# weight decay groups ----------------------------------------------------------------------------

def test_weight_decay_on_matrices_only_embeddings_optional():
    params = {"layers.0.qkv": torch.zeros(4, 4), "layers.0.norm_attn": torch.zeros(4), "layers.0.q_norm": torch.zeros(2),
              "embedding": torch.zeros(8, 4), "output": torch.zeros(8, 4), "final_norm": torch.zeros(4)}
    groups = OptimizerRecipe().param_groups(params)
    assert [(g["names"], g["weight_decay"]) for g in groups] == [
        (["layers.0.qkv", "embedding", "output"], 0.1),
        (["layers.0.norm_attn", "layers.0.q_norm", "final_norm"], 0.0)]
    no_emb = OptimizerRecipe(decay_embeddings=False, weight_decay=0.05).param_groups(params)
    assert [g["names"] for g in no_emb] == [["layers.0.qkv", "output"],
                                            ["layers.0.norm_attn", "layers.0.q_norm", "embedding", "final_norm"]]
    optimizer = OptimizerRecipe(beta1=0.8).build(params, 1e-3)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    assert isinstance(OptimizerRecipe(name="sgd").build(params, 1e-3), torch.optim.SGD)


# gradient norm and clipping ---------------------------------------------------------------------

def test_which_copies_count_towards_the_norm():
    tied = replace(TINY, tied_embeddings=True)
    full_qkv = torch.zeros(TINY.q_size + 2 * TINY.kv_size, TINY.hidden_size)
    half_qkv = shard("layers.0.qkv", full_qkv, TINY, 1, 2)
    norm = torch.ones(TINY.hidden_size)
    coords = {"pp_rank": 0, "dp_rank": 0, "cp_rank": 0}
    assert counted_here("layers.0.qkv", half_qkv, TINY, tp_rank=1, **coords)  # a shard: every TP rank
    assert not counted_here("layers.0.norm_attn", norm, TINY, tp_rank=1, **coords)  # replicated: TP rank 0
    assert counted_here("layers.0.norm_attn", norm, TINY, tp_rank=0, **coords)
    table = torch.zeros(TINY.vocab_size, TINY.hidden_size)
    assert not counted_here("embedding", table, tied, tp_rank=0, pp_rank=1, dp_rank=0, cp_rank=0)
    assert counted_here("embedding", table, TINY, tp_rank=0, pp_rank=1, dp_rank=0, cp_rank=0)  # untied: its own
    for replica in ({"dp_rank": 1, "cp_rank": 0}, {"dp_rank": 0, "cp_rank": 1}):
        assert not counted_here("layers.0.qkv", half_qkv, TINY, tp_rank=0, pp_rank=0, **replica)


def test_clipping_scales_every_gradient_by_one_factor():
    grads = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[0.0, 4.0]])}
    counted = {"a": True, "b": True}
    norm = global_grad_norm(grads, counted, distributed=False)
    assert norm == pytest.approx(5.0)
    assert clip_(grads, norm, 10.0) == 1.0 and grads["a"][0] == 3.0  # under the limit: untouched
    coef = clip_(grads, norm, 1.0)
    assert coef == pytest.approx(1 / (5 + 1e-6))
    assert global_grad_norm(grads, counted, distributed=False) == pytest.approx(1.0, rel=1e-5)
    assert clip_(grads, 1e9, 0.0) == 1.0  # 0: no clipping


def _config(tp: int = 1, pp: int = 1, **fields) -> TrainConfig:
    base = TrainConfig(shape=TINY, seq_len=16, tp=tp, pp=pp, micro_batch_size=2, num_microbatches=2, steps=3,
                       seed=3, device="cpu", recipe=OptimizerRecipe(warmup_steps=1, clip_grad_norm=0.5))
    return replace(base, **fields)


def _layout_worker(rank: int, store, out: str) -> None:
    ctx = None
    saved = {}
    for tied in (False, True):
        config = _config(2, 2, shape=replace(TINY, tied_embeddings=tied))
        ctx = ctx or init_distributed(config.layout, rank=rank, store=store, device="cpu")
        result, _ = run_rank(ctx, config, Schedule.uniform(2, 2))
        saved[tied] = (result.grad_norms, result.losses, result.lrs)
    torch.save(saved, Path(out) / f"rank{rank}.pt")


def test_tp2_pp2_global_grad_norm_equals_one_process_every_step(tmp_path):
    spawn_local(4, _layout_worker, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    for tied in (False, True):
        config = _config(shape=replace(TINY, tied_embeddings=tied))
        reference, _ = run_rank(init_distributed(config.layout, device="cpu"), config, Schedule.uniform(1, 2))
        assert max(reference.grad_norms) > 0.5  # clipping acts on these steps
        for rank, saved in enumerate(ranks):
            norms, losses, lrs = saved[tied]
            assert norms == pytest.approx(reference.grad_norms, rel=1e-5), (rank, tied)
            assert lrs == pytest.approx(reference.lrs, rel=1e-12)
            if rank == 0:  # whole-job losses: the clipped steps agree too
                assert losses == pytest.approx(reference.losses, rel=1e-5), tied


# resuming mid-schedule, and bf16 with fp32 masters ---------------------------------------------

class _Interrupted(Exception):
    pass


def _stop_at(step: int):
    def hook(now: int) -> None:
        if now == step:
            raise _Interrupted  # as a killed pod: after the checkpoint of `step` steps, before step `step`
    return hook


def test_resumed_bf16_run_continues_the_schedule_and_the_losses(tmp_path):
    import torch.distributed.checkpoint as dcp

    config = _config(steps=6, dtype="bfloat16", recipe=OptimizerRecipe(warmup_steps=2, clip_grad_norm=1.0))
    ctx = init_distributed(config.layout, device="cpu")
    reference, _ = run_rank(ctx, config, Schedule.uniform(1, 2))
    saving = replace(config, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=3)
    with pytest.raises(_Interrupted):
        run_rank(ctx, saving, Schedule.uniform(1, 2), step_hook=_stop_at(3))
    resumed, _ = run_rank(ctx, replace(saving, out_dir=str(tmp_path / "out")), Schedule.uniform(1, 2))
    assert resumed.first_step == 3
    lines = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert [(r["lr"], r["grad_norm"]) for r in lines] == list(zip(resumed.lrs, resumed.grad_norms, strict=True))
    assert resumed.lrs == reference.lrs[3:]  # the schedule's state is the step
    assert len(set(reference.lrs)) == 6  # warmup and decay: every step its own rate
    assert resumed.losses == pytest.approx(reference.losses[3:], rel=1e-5)
    # The checkpoint holds the fp32 masters, not the bf16 compute weights.
    metadata = dcp.FileSystemReader(str(tmp_path / "ckpt" / "step-00000003")).read_metadata()
    assert metadata.state_dict_metadata["model/final_norm/tp0of1"].properties.dtype == torch.float32
    assert metadata.state_dict_metadata["optim/final_norm/tp0of1/exp_avg"].properties.dtype == torch.float32


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_bf16_adamw_moves_every_final_norm_gain(tmp_path):
    """Updates below half a bf16 ulp accumulate in the fp32 master: after 20 AdamW steps at lr 3e-4
    every gain has moved (without masters none did), and the bf16 weights are the masters rounded."""
    import torch.distributed.checkpoint as dcp

    config = _config(steps=20, micro_batch_size=2, num_microbatches=1, dtype="bfloat16",
                     recipe=OptimizerRecipe.constant("adamw", 3e-4), checkpoint_dir=str(tmp_path),
                     checkpoint_every=20)
    result, model = run_rank(init_distributed(config.layout, device="cpu"), config, Schedule.uniform(1, 1),
                             keep_model=True)
    master = {"model/final_norm/tp0of1": torch.zeros(TINY.hidden_size)}
    dcp.load(master, checkpoint_id=str(tmp_path / "step-00000020"), no_dist=True)
    master = master["model/final_norm/tp0of1"]
    assert int((master != 1.0).sum()) == TINY.hidden_size == 64
    final_norm = model.param("final_norm").detach()
    assert final_norm.dtype == torch.bfloat16 and torch.equal(final_norm, master.to(torch.bfloat16))
    assert int((final_norm != 1.0).sum()) > 0
    assert result.losses[-1] < result.losses[0]


# the job spec and the command line ------------------------------------------------------------

def _manifest(training: dict) -> dict:
    return {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob", "metadata": {"name": "recipe"},
            "spec": {"model": {"preset": "tiny"}, "sequenceLength": 16,
                     "parallelism": {"tensor": 1, "pipeline": 1, "context": 1, "data": 1,
                                     "microBatchSize": 2, "numMicroBatches": 1},
                     "objective": {"maxThroughput": {}},
                     "training": {"image": "x", "steps": 6, "gpusPerNode": 1, "nodes": 1, **training}}}


def test_spec_training_optimizer_precision_and_tf32_reach_the_run():
    from kareus.spec import parse_job

    job = parse_job(_manifest({"precision": "bf16", "tf32": False, "optimizer": {
        "lr": 1e-3, "minLr": 0, "warmupSteps": 2, "schedule": "wsd", "beta2": 0.99, "clipGradNorm": 0.5,
        "decayEmbeddings": False}}))
    assert parse_job(_manifest(job.spec.training.to_dict())).spec == job.spec  # round trip
    config = TrainConfig.from_job(job)
    assert (config.dtype, config.tf32) == ("bfloat16", False)
    assert config.recipe == OptimizerRecipe(lr=1e-3, min_lr=0.0, warmup_steps=2, schedule_kind="wsd", beta2=0.99,
                                            clip_grad_norm=0.5, decay_embeddings=False)
    plain = TrainConfig.from_job(parse_job(_manifest({})))
    assert (plain.dtype, plain.tf32, plain.recipe) == ("float32", True, OptimizerRecipe())


@pytest.mark.parametrize("optimizer,field", [
    ({"name": "lamb"}, "name"), ({"lr": 0}, "lr"), ({"lr": 11}, "lr"), ({"minLr": -1}, "minLr"),
    ({"warmupSteps": -1}, "warmupSteps"), ({"schedule": "step"}, "schedule"), ({"decaySteps": 0}, "decaySteps"),
    ({"wsdDecayFraction": 0}, "wsdDecayFraction"), ({"weightDecay": 2}, "weightDecay"),
    ({"decayEmbeddings": "no"}, "decayEmbeddings"), ({"beta1": 1}, "beta1"), ({"beta2": -0.1}, "beta2"),
    ({"eps": 0}, "eps"), ({"clipGradNorm": -1}, "clipGradNorm"), ({"momentum": 0.9}, "momentum"),
    ({"lr": 1e-3, "minLr": 1e-2}, "minLr"), ({"warmupSteps": 10, "decaySteps": 5}, "decaySteps"),
])
def test_each_bad_optimizer_field_is_one_error_naming_it(optimizer, field):
    from kareus.spec import SpecError, parse_job

    with pytest.raises(SpecError) as error:
        parse_job(_manifest({"optimizer": optimizer}))
    assert [e.path for e in error.value.errors] == [f"spec.training.optimizer.{field}"], str(error.value)


def test_bad_precision_is_one_error():
    from kareus.spec import SpecError, parse_job

    with pytest.raises(SpecError, match=r"spec.training.precision: must be one of fp32, bf16, got 'fp16'"):
        parse_job(_manifest({"precision": "fp16"}))


def test_train_flags_override_the_spec(tmp_path):
    import argparse

    import yaml

    from kareus.cli import train as cli
    from kareus.spec import load_job

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_manifest({"optimizer": {"lr": 1e-3, "schedule": "linear"}})))
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["train", str(path), "--min-lr", "1e-5", "--clip-grad-norm", "0",
                              "--no-embedding-decay"])
    recipe = cli._recipe(load_job(path), args)
    assert recipe == OptimizerRecipe(lr=1e-3, schedule_kind="linear", min_lr=1e-5, clip_grad_norm=0.0,
                                     decay_embeddings=False)
    with pytest.raises(KareusError, match=r"--beta2 must be in \[0, 1\), got 1.0"):
        cli._check_args(parser.parse_args(["train", str(path), "--beta2", "1"]))


def test_grad_norm_and_lr_gauges():
    from kareus import metric_names
    from kareus.runtime.metrics import MetricsExporter, StepRecord

    exporter = MetricsExporter(0, addr="127.0.0.1", rank=0, job="recipe")
    try:
        exporter.observe(StepRecord(0, 5.5, 0.1, 1.0, 64, 64.0, None, "simulated", grad_norm=1.25, lr=7.5e-4), 0.5)
        text = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10).read().decode()
    finally:
        exporter.close()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith((metric_names.GRAD_NORM, metric_names.LEARNING_RATE))}
    assert values == {metric_names.GRAD_NORM: 1.25, metric_names.LEARNING_RATE: 7.5e-4}
