"""Real multi-process training on CPU (gloo): TP2, DP2 and TP2×PP2.

Each layout is spawned once; inside it the ranks train the same model on the same data several
times — sequential, then partitioned with every launch slot of every partition type (slot i of
each type in run i), with layer checkpointing (the default), stage checkpointing and none — and save their losses,
parameters and clock logs. The test process then checks: partitioned == sequential, every run ==
a single-process reference on the same global batch, and the clock log == the schedule's clocks
instruction by instruction.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kareus.daemon_client import RecordingClockClient
from kareus.errors import EXIT_CONFIG, KareusError
from kareus.runtime import Schedule, TrainConfig, run_rank
from kareus.runtime.model import shard
from kareus.runtime.optimizer_recipe import OptimizerRecipe
from kareus.runtime.parallel import init_distributed, spawn_local
from kareus.runtime.schedule import RunInstruction
from kareus.workload.models import get_preset
from kareus.workload.partitions import PartitionConfig, build_workload

torch.set_num_threads(1)
TINY = get_preset("tiny")
STEPS = 5


def _config(tp: int, pp: int, dp: int, m: int, ac: bool | str = True, cp: int = 1) -> TrainConfig:
    # lr 0.1: stable (the loss falls every step), so layouts differ by round-off only (3.8e-7 relative);
    # at 0.5, with the norms at one since the init fix, the loss spikes and amplifies it past 1e-5.
    return TrainConfig(shape=TINY, seq_len=16, tp=tp, pp=pp, dp=dp, cp=cp, micro_batch_size=2, num_microbatches=m,
                       steps=STEPS, seed=5, recipe=OptimizerRecipe.constant("sgd", 0.1), activation_checkpointing=ac,
                       device="cpu")


def _types(tp: int, cp: int) -> dict:
    return build_workload(TINY, tp=tp, cp=cp, pp=1, seq_len=16, micro_batch_size=2).partition_types if tp > 1 else {}


def _slot_configs(run: int, tp: int, cp: int) -> dict[str, PartitionConfig]:
    """Launch slot number `run` (wrapping) of every partition type; SM counts vary too."""
    return {name: PartitionConfig(t.launch_slots[run % len(t.launch_slots)],
                                  t.comm_sms_grid[run % len(t.comm_sms_grid)]) for name, t in _types(tp, cp).items()}


def _clocked(schedule: Schedule) -> Schedule:
    """Give every instruction its own clock (numerics do not depend on clocks)."""
    stages = tuple(tuple(replace(ins, clock_mhz=1410 - 15 * (10 * s + i)) for i, ins in enumerate(stage))
                   for s, stage in enumerate(schedule.stages))
    return Schedule(stages, schedule.num_microbatches)


def _runs(pp: int, m: int, tp: int, cp: int) -> dict[str, tuple[Schedule, bool | str]]:
    runs = {"sequential": (_clocked(Schedule.uniform(pp, m, mode="sequential")), True)}
    for r in range(max((len(t.launch_slots) for t in _types(tp, cp).values()), default=1)):
        runs[f"slots{r}"] = (_clocked(Schedule.uniform(pp, m, configs=_slot_configs(r, tp, cp))), True)
    runs["stage_ac"] = (_clocked(Schedule.uniform(pp, m, configs=_slot_configs(1, tp, cp))), "stage")
    runs["sequential_stage_ac"] = (_clocked(Schedule.uniform(pp, m, mode="sequential")), "stage")
    runs["no_ac"] = (_clocked(Schedule.uniform(pp, m, configs=_slot_configs(1, tp, cp))), False)
    return runs


def _worker(rank: int, store, tp: int, pp: int, dp: int, cp: int, m: int, out: str) -> None:
    ctx = None
    saved = {}
    for name, (schedule, ac) in _runs(pp, m, tp, cp).items():
        config = _config(tp, pp, dp, m, ac, cp)
        if ctx is None:
            ctx = init_distributed(config.layout, rank=rank, store=store, device="cpu")
        clock = RecordingClockClient()
        result, model = run_rank(ctx, config, schedule, clock=clock, keep_model=True)
        saved[name] = {
            "losses": result.losses,
            "energy_j": result.energy_j,
            "params": {n: p.detach().clone() for n, p in model.named_model_params().items()},
            "clock_log": [(r.instruction, r.clock_mhz) for r in clock.log],
            "instructions": [(i.label(ctx.pp_rank), i.clock_mhz) for i in schedule.stages[ctx.pp_rank]],
            "coords": (ctx.dp_rank, ctx.pp_rank, ctx.tp_rank),
        }
    torch.save(saved, Path(out) / f"rank{rank}.pt")


def _reference(m_total: int) -> tuple[tuple[float, ...], dict[str, torch.Tensor]]:
    config = replace(_config(1, 1, 1, m_total))
    ctx = init_distributed(config.layout, device="cpu")
    result, model = run_rank(ctx, config, Schedule.uniform(1, m_total, mode="sequential"), keep_model=True)
    return result.losses, {n: p.detach().clone() for n, p in model.named_model_params().items()}


def _close(actual, expected, what: str) -> None:
    # Equal within 1e-5 of the tensor's scale: fp32 sums in another order differ by round-off relative to
    # the largest terms, so an element near zero (one embedding entry of 8.06e-5 at DP2) can be off by
    # more than 1e-5 of itself (measured worst: 1.8e-6 of the scale).
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=max(1e-7, 1e-5 * scale), msg=what)


@pytest.mark.parametrize("tp,pp,dp,cp,m", [(2, 1, 1, 1, 2), (1, 1, 2, 1, 2), (2, 2, 1, 1, 3), (2, 1, 1, 2, 2)],
                         ids=["tp2", "dp2", "tp2xpp2", "tp2xcp2"])
def test_partitioned_equals_sequential_and_single_process(tmp_path, tp, pp, dp, cp, m):
    world = tp * pp * dp * cp
    spawn_local(world, _worker, tp, pp, dp, cp, m, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    ref_losses, ref_params = _reference(m * dp)
    assert ref_losses[-1] < ref_losses[0]
    for rank, saved in enumerate(ranks):
        sequential = saved["sequential"]
        _, _, tp_rank = sequential["coords"]
        for name, run in saved.items():
            where = f"rank {rank} run {name}"
            if rank == 0:
                _close(torch.tensor(run["losses"]), torch.tensor(ref_losses), f"{where}: losses vs single process")
                _close(torch.tensor(run["losses"]), torch.tensor(sequential["losses"]), f"{where}: losses")
                assert all(e > 0 for e in run["energy_j"])
            for pname, value in run["params"].items():
                _close(value, sequential["params"][pname], f"{where}: {pname} vs sequential")
                _close(value, shard(pname, ref_params[pname], TINY, tp_rank, tp), f"{where}: {pname} vs reference")
            # One clock request per instruction, in schedule order, each step.
            expected = [(label, clock) for _ in range(STEPS) for label, clock in run["instructions"]]
            assert run["clock_log"][:len(expected)] == expected, where
            assert run["clock_log"][len(expected):] == [("reset", None)]
    if tp > 1:  # partitioned and sequential runs are modelled differently by the simulated GPU
        assert ranks[0]["slots0"]["energy_j"][0] != ranks[0]["sequential"]["energy_j"][0]


def test_tied_embeddings_across_pipeline_stages(tmp_path):
    """Tied embedding copies on the first and last stage stay equal and match one process."""
    shape = replace(TINY, tied_embeddings=True)

    config = replace(_config(1, 2, 1, 2), shape=shape, steps=3)
    spawn_local(2, _tied_worker, config, str(tmp_path))
    first, last = (torch.load(tmp_path / f"tied{r}.pt") for r in range(2))
    ref_config = replace(config, pp=1)
    ctx = init_distributed(ref_config.layout, device="cpu")
    ref, model = run_rank(ctx, ref_config, Schedule.uniform(1, 2), keep_model=True)
    ref_embedding = model.named_model_params()["embedding"].detach()
    _close(first["embedding"], last["embedding"], "embedding copies")
    _close(first["embedding"], ref_embedding, "embedding vs single process")
    _close(torch.tensor(first["losses"]), torch.tensor(ref.losses), "losses")


def _tied_worker(rank: int, store, config: TrainConfig, out: str) -> None:
    ctx = init_distributed(config.layout, rank=rank, store=store, device="cpu")
    result, model = run_rank(ctx, config, Schedule.uniform(2, 2), keep_model=True)
    torch.save({"embedding": model.named_model_params()["embedding"].detach(), "losses": result.losses},
               Path(out) / f"tied{rank}.pt")


def test_schedule_instruction_types_are_checked():
    with pytest.raises(Exception, match="backward of microbatch 0 before its forward"):
        Schedule(((RunInstruction("backward", 0), RunInstruction("forward", 0)),), 1)


def test_activation_checkpointing_modes_are_checked():
    assert _config(1, 1, 1, 1, ac="stage").activation_checkpointing == "stage"
    with pytest.raises(KareusError, match="activation_checkpointing: 'selective' is not allowed; allowed: true, "
                                          "false, none, stage, layer") as err:
        _config(1, 1, 1, 1, ac="selective")
    assert err.value.exit_code == EXIT_CONFIG
