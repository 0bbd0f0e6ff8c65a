"""Golden losses: short training runs whose per-step losses are pinned in files, as torchtitan and
Megatron-LM guard their trainers against silent numerical regressions.

Each case is the `tiny` model on the built-in corpus for `STEPS` steps (fp32, a constant AdamW
learning rate, no activation checkpointing, seed 11, 8 sequences of 32 bytes per step) in one layout;
`tests/data/golden/<case>.json` holds its losses. Every case trains the same global batches, so
every layout's losses must also agree with the single-process case's. `make golden` (this module as
a script) regenerates the files: only when a change of the numbers is intended, said in the commit.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kareus.runtime import Schedule, TrainConfig, run_rank
from kareus.runtime.optimizer_recipe import OptimizerRecipe
from kareus.runtime.parallel import init_distributed, spawn_local
from kareus.workload.models import get_preset

GOLDEN_DIR = Path(__file__).resolve().parent / "data" / "golden"
STEPS = 30
SEQUENCES_PER_STEP = 8


@dataclass(frozen=True)
class Case:
    """A layout of the same training run; `overrides` are further `TrainConfig` fields."""

    name: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    num_microbatches: int = 2
    mode: str = "sequential"  # or "partitioned" (nanobatched, the overlap engine)
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def config(self) -> TrainConfig:
        mbs = SEQUENCES_PER_STEP // (self.dp * self.num_microbatches)
        base = TrainConfig(shape=get_preset("tiny"), seq_len=32, tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp,
                           micro_batch_size=mbs, num_microbatches=self.num_microbatches, steps=STEPS, seed=11,
                           recipe=OptimizerRecipe.constant("adamw", 3e-3), activation_checkpointing=False,
                           device="cpu")
        return replace(base, **self.overrides)

    def schedule(self) -> Schedule:
        return Schedule.uniform(self.pp, self.num_microbatches, mode=self.mode)


CASES = (
    Case("tp1_pp1"),
    Case("tp2_pp2_partitioned", tp=2, pp=2, mode="partitioned"),
    Case("cp2_tp2", tp=2, cp=2),  # the op graph defines context parallelism together with tensor parallelism
)


def run_case(case: Case) -> list[float]:
    """The case's per-step losses (whole-job means)."""
    if case.world == 1:
        torch.set_num_threads(1)
        result, _ = run_rank(init_distributed(case.config().layout, device="cpu"), case.config(), case.schedule())
        return list(result.losses)
    with tempfile.TemporaryDirectory(prefix="kareus-golden-") as tmp:
        spawn_local(case.world, _rank, case, tmp)
        return json.loads((Path(tmp) / "losses.json").read_text())


def _rank(rank: int, store, case: Case, out: str) -> None:
    ctx = init_distributed(case.config().layout, rank=rank, store=store, device="cpu")
    result, _ = run_rank(ctx, case.config(), case.schedule())
    if rank == 0:
        (Path(out) / "losses.json").write_text(json.dumps(list(result.losses)))


def golden(case: Case) -> list[float]:
    return json.loads((GOLDEN_DIR / f"{case.name}.json").read_text())["losses"]


def write(case: Case, losses: list[float]) -> Path:
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    path = GOLDEN_DIR / f"{case.name}.json"
    config = case.config()
    record = {"case": case.name, "steps": STEPS, "tp": case.tp, "pp": case.pp, "dp": case.dp, "cp": case.cp,
              "micro_batch_size": config.micro_batch_size, "num_microbatches": case.num_microbatches,
              "mode": case.mode, "seq_len": config.seq_len, "seed": config.seed, "losses": losses}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def main(names: list[str]) -> int:
    for case in CASES:
        if names and case.name not in names:
            continue
        losses = run_case(case)
        print(f"{write(case, losses)}: {losses[0]:.6f} -> {losses[-1]:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
