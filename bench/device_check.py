"""A short, read-only check of one GPU machine: what the runtime and the simulator need to know.

    python bench/device_check.py [--out device_check.json] [--energy-window-s 3]

Needs only torch and nvidia-ml-py (no other part of Kareus, no optimizer stack), so it runs on a
bare GPU machine. It **never changes clocks or power limits**: NVML is reached only through
`ReadOnlyNVML`, which refuses every `nvmlDeviceSet*` / `nvmlDeviceReset*` call by construction.
It writes one JSON file and prints a table. Without a GPU it prints one line and exits 2.

Sections (each guarded: a failing or unsupported read is recorded, never fatal):
- NVML inventory: name, UUID, driver, MIG mode, supported clocks, power limits, SM clock, power,
  and the energy counter's update interval and step over a window (idle);
- the CPU→GPU lead: how far ahead of the GPU the CPU enqueues (CUDA events), i.e. how early a
  clock request sent at CPU-enqueue time would land;
- GEMM and memory-bound op timings alone, fp32 and bf16 (CUDA events).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from typing import Any

NO_GPU_EXIT = 2
REFUSED_NVML_PREFIXES = ("nvmlDeviceSet", "nvmlDeviceReset")  # clocks, power limits, applications clocks


class ReadOnlyNVML:
    """`pynvml` without the calls that change a GPU."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        if name.startswith(REFUSED_NVML_PREFIXES):
            raise PermissionError(f"device_check is read-only: {name} is refused")
        return getattr(self._module, name)


def guarded(call: Callable[..., Any], *args: Any) -> Any:
    """`call(*args)`, or {"error": why} (NOT_SUPPORTED and friends are facts, not failures)."""
    try:
        return call(*args)
    except Exception as error:  # NVML raises one subclass per code
        return {"error": f"{type(error).__name__}: {error}"}


def read(nvml: ReadOnlyNVML, function: str, *args: Any) -> Any:
    """One guarded NVML read; a function this NVML lacks is recorded like any other failure."""
    return guarded(lambda: getattr(nvml, function)(*args))


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def inventory(nvml: ReadOnlyNVML) -> dict[str, Any]:
    """Every GPU NVML sees, read-only."""
    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = read(nvml, "nvmlDeviceGetSupportedMemoryClocks", handle)
        top_memory = max(memory) if isinstance(memory, list) and memory else None
        gpus.append({
            "nvml_index": index,
            "name": _text(read(nvml, "nvmlDeviceGetName", handle)),
            "uuid": _text(read(nvml, "nvmlDeviceGetUUID", handle)),
            "mig_mode": read(nvml, "nvmlDeviceGetMigMode", handle),
            "supported_memory_clocks_mhz": memory,
            "supported_sm_clocks_mhz": (read(nvml, "nvmlDeviceGetSupportedGraphicsClocks", handle, top_memory)
                                        if top_memory is not None else None),
            "sm_clock_mhz": read(nvml, "nvmlDeviceGetClockInfo", handle, nvml.NVML_CLOCK_SM),
            "power_w": _milli(read(nvml, "nvmlDeviceGetPowerUsage", handle)),
            "power_limit_w": _milli(read(nvml, "nvmlDeviceGetPowerManagementLimit", handle)),
            "power_limit_range_w": _milli(read(nvml, "nvmlDeviceGetPowerManagementLimitConstraints", handle)),
            "energy_counter_j": _milli(read(nvml, "nvmlDeviceGetTotalEnergyConsumption", handle)),
        })
    return {"driver": _text(read(nvml, "nvmlSystemGetDriverVersion")), "gpus": gpus}


def _milli(value: Any) -> Any:
    """NVML's mW / mJ in W / J (lists too); errors pass through."""
    if isinstance(value, (list, tuple)):
        return [_milli(v) for v in value]
    return value / 1000.0 if isinstance(value, (int, float)) else value


def energy_counter_updates(nvml: ReadOnlyNVML, handle: Any, window_s: float,
                           clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Poll the cumulative energy counter for `window_s`: how often it changes and by how much."""
    start = clock()
    last = read(nvml, "nvmlDeviceGetTotalEnergyConsumption", handle)
    if isinstance(last, dict):
        return last
    changes: list[tuple[float, float]] = []
    while clock() - start < window_s:
        now_mj = nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        if now_mj != last:
            changes.append((clock() - start, (now_mj - last) / 1000.0))
            last = now_mj
        time.sleep(0.001)
    intervals = [b[0] - a[0] for a, b in itertools.pairwise(changes)]
    return {"window_s": window_s, "updates": len(changes),
            "median_interval_s": sorted(intervals)[len(intervals) // 2] if intervals else None,
            "median_step_j": sorted(c[1] for c in changes)[len(changes) // 2] if changes else None}


def cpu_gpu_lead(torch: Any, steps: int = 64, n: int = 2048) -> dict[str, Any]:
    """Enqueue `steps` GEMMs with an event before each; compare when the CPU enqueued each
    boundary with when the GPU reached it. The lead is how early a CPU-timed request lands."""
    a = torch.randn(n, n, device="cuda")
    torch.cuda.synchronize()
    events, cpu_s = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        cpu_s.append(time.perf_counter() - t0)
        events.append(event)
        a = a @ a
        a = a / a.norm()
    torch.cuda.synchronize()
    gpu_s = [events[0].elapsed_time(e) / 1000.0 for e in events]
    leads = [g - c for g, c in zip(gpu_s, cpu_s, strict=True)]
    return {"boundaries": steps, "max_lead_s": max(leads), "final_lead_s": leads[-1],
            "gpu_step_s": (gpu_s[-1] - gpu_s[0]) / (steps - 1)}


def op_timings(torch: Any) -> dict[str, Any]:
    """A GEMM and a memory-bound add alone, fp32 and bf16, timed with CUDA events."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
        x = torch.randn(1 << 28, device="cuda", dtype=dtype)
        for name, fn in (("gemm_8192", lambda a=a: a @ a), ("add_256M", lambda x=x: x + x)):
            out[f"{name}_{str(dtype).removeprefix('torch.')}_s"] = _timed(torch, fn)
    return out


def _timed(torch: Any, fn: Callable[[], Any], repeats: int = 10) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0 / repeats


def _no_gpu(reason: str) -> int:
    print(f"device_check: no GPU to check: {reason}")
    return NO_GPU_EXIT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="device_check.json")
    parser.add_argument("--energy-window-s", type=float, default=3.0)
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        return _no_gpu("torch is not installed")
    if not torch.cuda.is_available():
        return _no_gpu("torch.cuda.is_available() is False")
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as error:
        return _no_gpu(f"NVML is not available ({error})")
    nvml = ReadOnlyNVML(pynvml)
    cuda_uuid = str(torch.cuda.get_device_properties(0).uuid)
    report: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_device_0_uuid": cuda_uuid}
    report["nvml"] = inventory(nvml)
    mine = [g for g in report["nvml"]["gpus"] if str(g["uuid"]).lower().endswith(cuda_uuid.lower())]
    if mine:  # the CUDA device by UUID, never by index
        handle = nvml.nvmlDeviceGetHandleByIndex(mine[0]["nvml_index"])
        report["energy_counter_idle"] = energy_counter_updates(nvml, handle, args.energy_window_s)
    report["cpu_gpu_lead"] = guarded(cpu_gpu_lead, torch)
    report["op_timings"] = guarded(op_timings, torch)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2, default=str)
    for section, value in report.items():
        print(f"{section:24} {json.dumps(value, default=str)[:150]}")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
