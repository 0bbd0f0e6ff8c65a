"""The memory plan against measured peak memory on CPU (issue 44 item 7).

Each case trains two steps (fp32, AdamW, TP1 PP1, one process) in a fresh child process and reads
its peak resident set (`VmHWM`); a second child with torch imported, the batches made and the
model *not* built gives the baseline. measured = peak − baseline, against
`kareus.workload.memory.memory_plan` (no CUDA context; AdamW without foreach, CPU's default).
glibc would keep freed tensors in its arenas and inflate the peak of whatever comes later, so the
children run with one arena and mmap for anything over 64 KiB (returned to the OS on free).

    .venv/bin/python bench/memory_plan.py            # the table, every case
    .venv/bin/python bench/memory_plan.py --cases 6  # the first six (what the test runs)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's kareus, not another one the virtualenv may point at
MIB = 2**20


@dataclass(frozen=True)
class Case:
    """A model shape and a layout: `dims` are ModelShape fields over the `tiny` preset."""

    name: str
    dims: dict
    seq_len: int
    micro_batch_size: int
    num_microbatches: int = 1
    checkpointing: str = "none"  # none | stage | layer
    engine: str = "sequential"  # sequential | partitioned

    def shape(self):
        from dataclasses import replace

        from kareus.workload.models import get_preset

        return replace(get_preset("tiny"), name=self.name, **self.dims)

    def inputs(self):
        from kareus.workload.memory import MemoryInputs

        return MemoryInputs(self.shape(), self.seq_len, micro_batch_size=self.micro_batch_size,
                            num_microbatches=self.num_microbatches, checkpointing=self.checkpointing,
                            engine=self.engine, foreach_optimizer=False, context_gib=0.0)


_W256 = {"num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 704, "num_heads": 8, "num_kv_heads": 4,
         "head_dim": 32, "vocab_size": 2048}
_W128 = {"num_layers": 2, "hidden_size": 128, "ffn_hidden_size": 352, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 32, "vocab_size": 8192}
_QWENISH = {"num_layers": 3, "hidden_size": 192, "ffn_hidden_size": 512, "num_heads": 6, "num_kv_heads": 6,
            "head_dim": 32, "vocab_size": 4096, "qk_norm": True, "tied_embeddings": True}

CASES = (
    Case("w256-seq", _W256, 128, 8),
    Case("w256-part", _W256, 128, 8, engine="partitioned"),
    Case("w256-ckpt-2mb", _W256, 128, 8, 2, checkpointing="stage", engine="partitioned"),
    Case("w128-vocab8k", _W128, 64, 8),
    Case("qk-tied", _QWENISH, 64, 8, engine="partitioned"),
    Case("w256-long", {**_W256, "num_layers": 2}, 512, 2, 2),
    Case("tiny", {}, 32, 16),
    Case("w512", {"num_layers": 2, "hidden_size": 512, "ffn_hidden_size": 1408, "num_heads": 8, "num_kv_heads": 2,
                  "head_dim": 64, "vocab_size": 4096}, 128, 4, 2, engine="partitioned"),
    Case("w256-ckpt-seq", _W256, 128, 8, checkpointing="stage"),
    Case("w256-layer-2mb", _W256, 128, 8, 2, checkpointing="layer", engine="partitioned"),
    Case("w256x16-layer-2mb", {**_W256, "num_layers": 16}, 128, 8, 2, checkpointing="layer", engine="partitioned"),
    Case("w256-layer-seq", _W256, 128, 8, checkpointing="layer"),
)


# ----------------------------------------------------------------------------------------- child

def _hwm_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _train(case: Case, steps: int) -> None:
    import torch

    from kareus.runtime.comm import GroupComm
    from kareus.runtime.follower import PlanFollower
    from kareus.runtime.model import StageLayout, StageModel
    from kareus.runtime.parallel import DistContext, Layout
    from kareus.runtime.pipeline import StageExecutor
    from kareus.runtime.schedule import Schedule

    shape = case.shape()
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, shape.vocab_size, (case.micro_batch_size, case.seq_len), generator=generator),
                torch.randint(0, shape.vocab_size, (case.micro_batch_size, case.seq_len), generator=generator))
               for _ in range(case.num_microbatches)]
    model = StageModel(shape, StageLayout(0, 1, 0, shape.num_layers), seed=0)
    ctx = DistContext(Layout(1, 1, 1, 1), 0, torch.device("cpu"))
    schedule = Schedule.uniform(1, case.num_microbatches, mode=case.engine)
    executor = StageExecutor(model, ctx, GroupComm(None, 1), PlanFollower(schedule.stages[0]), case.seq_len,
                             case.micro_batch_size, case.checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    tokens = case.micro_batch_size * case.seq_len * case.num_microbatches
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        executor.run(batches, 1.0 / tokens, step)
        optimizer.step()


# Kilobyte-sized models through every path the cases take: the first forward, backward and AdamW
# step map and touch torch's kernels, thread pools and dispatch tables (~120 MiB of resident code
# and library state that no tensor accounts for). Both the baseline and the measured child run
# them first, so the difference is the cases' tensors alone.
_WARM_UP = tuple(
    Case("warm-up", {"num_layers": 1, "hidden_size": 16, "ffn_hidden_size": 32, "num_heads": heads, "num_kv_heads": 2,
                     "head_dim": 8, "vocab_size": 32, "qk_norm": qk_norm, "tied_embeddings": qk_norm},
         8, 2, 2, checkpointing, engine)
    for engine in ("sequential", "partitioned") for checkpointing in ("none", "stage")
    for heads, qk_norm in ((2, False), (4, True)))


def child(case: Case | None) -> int:
    """Peak resident bytes after the warm-up and two training steps of `case` (None: the baseline)."""
    import torch

    torch.set_num_threads(1)
    for warm in _WARM_UP:
        _train(warm, 1)
    if case is not None:
        _train(case, 2)
    return _hwm_bytes()


# ---------------------------------------------------------------------------------------- parent

def _run_child(case: Case | None) -> int:
    env = dict(os.environ, MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    arg = json.dumps(None if case is None else case.__dict__)
    out = subprocess.run([sys.executable, __file__, "--child", arg], capture_output=True, text=True, env=env,
                         check=True, timeout=300)
    return int(out.stdout.strip().splitlines()[-1])


def baseline_bytes() -> int:
    """Peak resident bytes of a child that imports torch and runs the warm-up only."""
    return _run_child(None)


def measure(case: Case, baseline: int) -> dict:
    """{case, estimate_bytes, measured_bytes, error} (error: estimate / measured − 1)."""
    from kareus.workload.memory import memory_plan

    measured = _run_child(case) - baseline
    estimate = memory_plan(case.inputs()).worst.peak_bytes
    return {"case": case.name, "estimate_bytes": estimate, "measured_bytes": measured,
            "error": estimate / measured - 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=len(CASES), help="measure the first N cases")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        print(child(None if spec is None else Case(**spec)))
        return 0
    baseline = baseline_bytes()
    print(f"baseline (torch imported, warm-up run): {baseline / MIB:.1f} MiB")
    print(f"{'case':<16}{'layout':<34}{'estimate MiB':>13}{'measured MiB':>13}{'error':>8}")
    for case in CASES[:args.cases]:
        row = measure(case, baseline)
        layout = (f"mbs{case.micro_batch_size}x{case.seq_len} nmb{case.num_microbatches} "
                  f"{case.engine[:4]} ckpt={case.checkpointing}")
        print(f"{case.name:<16}{layout:<34}{row['estimate_bytes'] / MIB:>13.1f}{row['measured_bytes'] / MIB:>13.1f}"
              f"{row['error']:>+8.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
