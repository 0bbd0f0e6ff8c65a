"""Real-GPU check (issue 3, item 5): read NVML, measure partition-like work, compare with the twin.

On a machine with one NVIDIA GPU, in well under 5 minutes:

1. reads the NVML identity (name, UUID, PCI bus id, SMs, MIG mode), the supported SM clocks, the
   current clock, power and the cumulative energy counter;
2. measures at the **current** clock, each with the thermally stable window of the profiler
   (warm-up, repetitions filling `--window` seconds, `--cooldown` before, energy counter
   difference): a bf16 GEMM, a memory-bound elementwise op, the copy kernel that stands in for a
   collective with k thread blocks (≈ k SMs) alone, and the same copy running beside the GEMM —
   the interference the simulator models;
3. prints a short table with the simulator's prediction for the same work beside each
   measurement, and writes everything as one JSON record (`--out`).

It never changes clocks or power limits unless `--allow-clock-control` is given; then it also
measures the GEMM at three locked clocks and resets the clocks on every exit path. Without a GPU
(no NVML, no device, or torch without CUDA) it says so in one line and exits with status 2.

    .venv/bin/python bench/gpu_check.py --out gpu_check.json [--allow-clock-control]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from typing import Any

from kareus.errors import KareusError
from kareus.gpu import discover
from kareus.profiler.nvml import WindowSettings, locked_clock, measure_window

NO_GPU_EXIT = 2
GEMM_N = 8192
MEMORY_ELEMENTS = 1 << 27  # 128 Mi bf16 elements per tensor: 768 MiB moved per add
COPY_BYTES = 256 << 20
COPY_SMS = (2, 4, 8, 16, 32)


class _Work:
    """A callable as a profiler workload (run + synchronise)."""

    def __init__(self, torch: Any, device: Any, fn: Any) -> None:
        self.torch, self.device, self.fn = torch, device, fn

    def run(self) -> None:
        self.fn()

    def synchronize(self) -> None:
        self.torch.cuda.synchronize(self.device)


def _fail(message: str) -> int:
    print(f"gpu_check: {message}", file=sys.stderr)
    return NO_GPU_EXIT


def _workloads(torch: Any, device: Any) -> dict[str, tuple[Any, dict[str, float]]]:
    from kareus.profiler.kernels import copy_with_sms

    a = torch.randn(GEMM_N, GEMM_N, device=device, dtype=torch.bfloat16)
    b = torch.randn(GEMM_N, GEMM_N, device=device, dtype=torch.bfloat16)
    x, y, z = (torch.randn(MEMORY_ELEMENTS, device=device, dtype=torch.bfloat16) for _ in range(3))
    src = torch.empty(COPY_BYTES // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    side = torch.cuda.Stream(device)
    gemm_work = {"flops": 2.0 * GEMM_N**3, "hbm_bytes": 3.0 * GEMM_N * GEMM_N * 2}
    memory_work = {"flops": float(MEMORY_ELEMENTS), "hbm_bytes": 3.0 * MEMORY_ELEMENTS * 2}
    out: dict[str, tuple[Any, dict[str, float]]] = {
        "gemm": (lambda: a @ b, gemm_work),
        "memory": (lambda: torch.add(x, y, out=z), memory_work),
    }
    for sms in COPY_SMS:
        out[f"copy_{sms}sm"] = (lambda sms=sms: copy_with_sms(src, dst, sms), {"hbm_bytes": 2.0 * COPY_BYTES})

        def beside(sms=sms):
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                copy_with_sms(src, dst, sms)
            a @ b
            torch.cuda.current_stream(device).wait_stream(side)

        out[f"gemm+copy_{sms}sm"] = (beside, {**gemm_work, "copy_bytes": 2.0 * COPY_BYTES})
    return out


def _simulated(gpu_name: str, work: dict[str, float], clock_mhz: int, name: str) -> dict[str, float] | None:
    """The simulator's time and energy for the GEMM and memory-bound op (None where it has no twin)."""
    from kareus.sim import Simulator, get_gpu
    from kareus.workload.ops import ComputeOp

    if name not in ("gemm", "memory"):
        return None
    try:
        simulator = Simulator(get_gpu(gpu_name))
    except KareusError:
        return None
    op = ComputeOp(name, "gemm" if name == "gemm" else "memory", work["flops"], work["hbm_bytes"],
                   "linear" if name == "gemm" else "norm")
    measured = simulator.sequential([op], clock_mhz)
    return {"time_s": measured.time_s, "energy_j": measured.energy_j}


def run(args: argparse.Namespace) -> int:
    try:
        gpus = discover("nvml", module=args.nvml_module)
    except KareusError as error:
        return _fail(str(error))
    if not gpus:
        return _fail("NVML sees no GPU")
    gpu = gpus[args.index] if args.index < len(gpus) else None
    if gpu is None:
        return _fail(f"--index {args.index}: NVML sees only {len(gpus)} GPU(s)")
    try:
        import torch
    except ImportError:
        return _fail("torch is not installed (pip install 'kareus[train]')")
    if not torch.cuda.is_available():
        return _fail("torch sees no CUDA device (CPU-only torch or CUDA_VISIBLE_DEVICES empty)")
    device = torch.device(f"cuda:{args.index}")
    clocks = gpu.supported_sm_clocks_mhz()
    record: dict[str, Any] = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "gpu": {"name": gpu.name, "uuid": gpu.uuid, "pci_bus_id": gpu.pci_bus_id, "sm_count": gpu.sm_count,
                "mig": gpu.is_mig_enabled(), "supported_sm_clocks_mhz": list(clocks),
                "sm_clock_mhz": gpu.sm_clock_mhz(), "power_w": gpu.power_w(), "energy_counter_j": gpu.energy_j(),
                "torch_device": torch.cuda.get_device_name(device)},
        "settings": {"window_s": args.window, "cooldown_s": args.cooldown, "clock_control": args.allow_clock_control},
        "measurements": [],
    }
    settings = WindowSettings(measurement_s=args.window, cooldown_s=args.cooldown, warmup_runs=3)
    started = time.perf_counter()
    workloads = _workloads(torch, device)
    for name, (fn, work) in workloads.items():
        time_s, energy_j = measure_window([gpu], [_Work(torch, device, fn)], settings)
        clock = gpu.sm_clock_mhz()
        record["measurements"].append({"name": name, "clock_mhz": clock, "locked": False, "time_s": time_s,
                                       "energy_j": energy_j, "work": work,
                                       "simulated": _simulated(gpu.name, work, clock, name)})
    if args.allow_clock_control:
        fn, work = workloads["gemm"]
        for clock in (max(clocks), clocks[len(clocks) // 3], clocks[len(clocks) // 2]):
            with locked_clock([gpu], clock):
                time_s, energy_j = measure_window([gpu], [_Work(torch, device, fn)], settings)
            record["measurements"].append({"name": "gemm", "clock_mhz": clock, "locked": True, "time_s": time_s,
                                           "energy_j": energy_j, "work": work,
                                           "simulated": _simulated(gpu.name, work, clock, "gemm")})
    record["elapsed_s"] = time.perf_counter() - started
    with open(args.out, "w") as out:
        json.dump(record, out, indent=1)
    _print(record)
    return 0


def _print(record: dict[str, Any]) -> None:
    gpu = record["gpu"]
    print(f"{gpu['name']} ({gpu['uuid']}), {gpu['sm_count']} SMs, clocks {min(gpu['supported_sm_clocks_mhz'])}-"
          f"{max(gpu['supported_sm_clocks_mhz'])} MHz, now {gpu['sm_clock_mhz']} MHz, {gpu['power_w']:.0f} W")
    print(f"{'workload':<16} {'MHz':>5} {'ms':>9} {'J':>9} {'W':>6} {'rate':>12} {'sim ms':>8} {'sim J':>8}")
    gemm_alone = next(m["time_s"] for m in record["measurements"] if m["name"] == "gemm")
    for m in record["measurements"]:
        work = m["work"]
        if "copy_bytes" in work:
            rate = f"{m['time_s'] / gemm_alone:.2f}x gemm"
        elif m["name"].startswith("copy"):
            rate = f"{work['hbm_bytes'] / m['time_s'] / 1e9:.0f} GB/s"
        elif m["name"] == "gemm":
            rate = f"{work['flops'] / m['time_s'] / 1e12:.0f} TFLOP/s"
        else:
            rate = f"{work['hbm_bytes'] / m['time_s'] / 1e9:.0f} GB/s"
        sim = m["simulated"]
        sim_text = f"{sim['time_s'] * 1e3:>8.3f} {sim['energy_j']:>8.3f}" if sim else f"{'-':>8} {'-':>8}"
        print(f"{m['name'] + (' (locked)' if m['locked'] else ''):<16} {m['clock_mhz']:>5} {m['time_s'] * 1e3:>9.3f} "
              f"{m['energy_j']:>9.3f} {m['energy_j'] / m['time_s']:>6.0f} {rate:>12} {sim_text}")
    print(f"done in {record['elapsed_s']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check.json", help="JSON record path (default gpu_check.json)")
    parser.add_argument("--index", type=int, default=0, help="NVML/CUDA index of the GPU (default 0)")
    parser.add_argument("--window", type=float, default=2.0, help="measurement window in seconds (default 2)")
    parser.add_argument("--cooldown", type=float, default=1.0, help="cooldown before each window (default 1)")
    parser.add_argument("--allow-clock-control", action="store_true",
                        help="also lock the SM clock at three values (reset afterwards); never done otherwise")
    parser.add_argument("--nvml-module", default="pynvml", help=argparse.SUPPRESS)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
