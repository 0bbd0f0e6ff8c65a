"""Peak host memory of one rank's `--init-from` against its stated bound.

The bound (kareus.runtime.init_from): a rank reading a Hugging Face checkpoint holds at most its
own shard plus one full tensor. This script writes a random-weight Hugging Face directory of a
model's shape (default Llama 3.1 8B in bf16; `--layers` fewer than the model's when disk is
short), then, in a fresh child process per measured rank, builds that rank's `StageModel` from
it and reports the process's peak resident memory (VmHWM, reset just before the load) above what
it held before, next to the shard's bytes and the bound:

    python bench/init_from_rss.py --dir /tmp/llama8b --layers 8 --tp 8 [--pp 1] [--stage 0] [--tp-rank 0]

`--keep` leaves the directory for another run (`--reuse` measures it without writing). Prints one
JSON line per measurement; exit 1 when a peak exceeds the bound.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def write_model(directory: Path, shape, dtype: torch.dtype, shard_bytes: int = 2 * 10**9) -> int:
    """A random-weight HF directory of `shape`; returns its weight bytes."""
    from safetensors.torch import save_file

    from kareus.runtime import hf_adapter

    directory.mkdir(parents=True, exist_ok=True)
    names = hf_adapter.stage_param_names(shape, 0, shape.num_layers, is_first=True, is_last=True)
    tensors = [(t, dims) for n in names for t, dims in zip(hf_adapter.hf_names(n), hf_adapter.hf_dims(n, shape),
                                                           strict=True)]
    files, current, filled, total = [], [], 0, 0
    for tensor, dims in tensors:
        size = torch.Size(dims).numel() * dtype.itemsize
        if current and filled + size > shard_bytes:
            files.append(current)
            current, filled = [], 0
        current.append((tensor, dims))
        filled += size
        total += size
    files.append(current)
    weight_map = {}
    generator = torch.Generator().manual_seed(0)
    for i, members in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        data = {}
        for tensor, dims in members:
            data[tensor] = (torch.ones(dims, dtype=dtype) if len(dims) == 1
                            else torch.empty(dims, dtype=dtype).normal_(0, 0.02, generator=generator))
            weight_map[tensor] = name
        save_file(data, str(directory / name), metadata={"format": "pt"})
        del data
    (directory / hf_adapter.INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                          "weight_map": weight_map}))
    config = hf_adapter.config_from_shape(shape, dtype=str(dtype).removeprefix("torch."))
    (directory / hf_adapter.CONFIG).write_text(json.dumps(config, indent=2))
    return total


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(directory: str, tp: int, tp_rank: int, pp: int, stage: int, dtype_name: str) -> dict:
    """In this process: load one rank's stage from `directory`; peak RSS above the start, in bytes."""
    from kareus.runtime.init_from import find_source, stage_params
    from kareus.runtime.model import StageLayout, StageModel
    from kareus.workload.partitions import split_layers

    torch.set_num_threads(1)
    source = find_source(directory)
    shape = source.shape
    layout = StageLayout.of(stage, split_layers(shape.num_layers, pp))
    dtype = DTYPES[dtype_name]
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    started = time.perf_counter()
    model = StageModel(shape, layout, tp=tp, tp_rank=tp_rank, dtype=dtype,
                       params=stage_params(source, shape, layout, tp, tp_rank))
    load_s = time.perf_counter() - started
    # Reads may be lazy (pages of a memory-mapped file come in when first touched): touch every
    # weight, so the peak counts all of the shard, as training's first step would.
    # (In chunks: a whole bf16 embedding cast to fp32 would itself be twice the tensor.)
    with torch.no_grad():
        checksum = sum(float(c.float().sum()) for p in model.parameters() for c in p.flatten().split(1 << 20))
    peak = _status_kib("VmHWM")
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    from kareus.runtime import hf_adapter
    from kareus.runtime.model import full_shapes

    largest = max([torch.Size(d).numel() for d in full_shapes(shape).values()]
                  + [shape.vocab_size * shape.hidden_size]) * dtype.itemsize
    return {"tp": tp, "tp_rank": tp_rank, "pp": pp, "stage": stage, "layers": shape.num_layers,
            "stage_layers": layout.num_layers, "dtype": dtype_name, "shard_bytes": shard,
            "largest_full_tensor_bytes": largest, "bound_bytes": shard + largest,
            "peak_rss_above_start_bytes": (peak - before) * 1024, "load_s": round(load_s, 2), "checksum": checksum,
            "checkpoint_files": len(set(hf_adapter.HFCheckpoint.open(directory).weight_map.values()))}


def measure_in_child(directory: str, tp: int, tp_rank: int, pp: int, stage: int, dtype_name: str) -> dict:
    """`measure` in a fresh interpreter: its peak is the load's alone."""
    here = Path(__file__).resolve().parent
    code = (f"import json, sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; import init_from_rss as b; "
            f"print(json.dumps(b.measure({directory!r}, {tp}, {tp_rank}, {pp}, {stage}, {dtype_name!r})))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from kareus.workload.models import get_preset

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="where the random HF model is written")
    parser.add_argument("--preset", default="llama3.1-8b")
    parser.add_argument("--layers", type=int, help="fewer layers than the preset's (disk, time)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--reuse", action="store_true", help="measure an existing --dir")
    parser.add_argument("--keep", action="store_true", help="leave --dir in place")
    args = parser.parse_args(argv)
    shape = get_preset(args.preset)
    if args.layers:
        shape = replace(shape, num_layers=args.layers)
    directory = Path(args.dir)
    if not args.reuse:
        started = time.perf_counter()
        total = write_model(directory, shape, DTYPES[args.dtype])
        print(json.dumps({"wrote_bytes": total, "write_s": round(time.perf_counter() - started, 1)}), flush=True)
    try:
        result = measure_in_child(str(directory), args.tp, args.tp_rank, args.pp, args.stage, args.dtype)
    finally:
        if not args.keep and not args.reuse:
            import shutil

            shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps(result))
    return 0 if result["peak_rss_above_start_bytes"] <= result["bound_bytes"] else 1


if __name__ == "__main__":
    sys.exit(main())
