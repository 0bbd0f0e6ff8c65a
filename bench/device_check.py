"""A short, read-only check of one GPU machine: what the runtime and the simulator need to know.

    python bench/device_check.py [--out device_check.json] [--energy-window-s 2.6] [--only SECTION,...]

Needs only torch and nvidia-ml-py (Triton, which CUDA builds of torch bring, for the bounded copy
kernel); the sections that exercise Kareus itself import it lazily and record "skipped" where it
cannot be imported. It **never changes clocks or power limits** and never resets the GPU: NVML is
reached only through `ReadOnlyNVML`, which refuses every `nvmlDeviceSet*` / `nvmlDeviceReset*`
call by construction, and clock requests go to a recording client (no daemon). It writes one JSON
file (`SCHEMA`, `SCHEMA_VERSION`) — after every section, atomically, with `"complete": false` until
the last, so a hang or a kill loses only the section it was in — and prints a table. Collectives
get `NCCL_TIMEOUT_S` (60 s, not NCCL's 10 minutes: a device command's limit is shorter). Without a
GPU it prints one line and exits 2;
it exits 1 only when the JSON is unusable (it could not be written, NVML's inventory failed, or a
section left the CUDA context broken — later sections are then skipped with that reason).

The CUDA device checked is `cuda:0`; its NVML handle is found by UUID, never by index.
Sections, in order, each with a time budget (printed; the total stays under 8 minutes), each
guarded so that one failing records its error and the others still run:
- `nvml`: inventory (name, UUID, driver, MIG, supported clocks, power and limits, energy counter);
- `energy_idle`: the energy counter's update interval and step at idle, instant vs averaged power;
- `cpu_gpu_lead`: how far ahead of the GPU the CPU enqueues (CUDA events);
- `op_timings`: a GEMM and a memory-bound add alone, fp32 and bf16;
- `clock_landing`: the runtime's `ClockDispatcher` (loaded alone from `kareus/runtime/clocking.py`)
  on a synthetic instruction sequence with CUDA-event markers, the CPU far ahead: per instruction,
  request time − the GPU's boundary time in ms (negative: the request leads the boundary);
- `nccl_comms`: one-rank NCCL communicators per SM count (`kareus/runtime/comm.py`'s options):
  init time, device memory before/after, min/max CTAs read back. On one GPU the SM bound itself
  cannot be observed (NCCL short-circuits a one-rank collective: no CTA of it runs), and the
  section says so; its evidence is NCCL's own INIT log lines (`NCCL_DEBUG=INFO`, the channels each
  communicator was built with);
- `interference`: a GEMM and a memory-bound op alone and inside a long-running copy kernel (and an
  arithmetic-only spinner) on k = 1…32 blocks, the SMs those blocks actually got, the copy's own
  slowdown, and NVML energy windows ≥ 2.5 s (`energy_windows`): each op alone, each op beside the
  copy on K blocks (`op+copyK`), and the copy and the spinner alone on K blocks (`copyK`, `spinK`:
  K SMs working, every other SM idle at the working clock — what an exposed collective is);
- `energy_load`: the energy counter under a GEMM load, instant vs averaged power;
- `cuda_smoke`: `kareus.runtime.smoke.cuda_smoke` fp32 and bf16, default and explicit launch slots
  and SM counts (needs the runtime: torch, numpy and Kareus' pure core);
- `profiler`: the profiler's emulated partitions (`kareus.profiler.kernels`) for a few partition
  types at the current clock, beside the simulator's prediction (needs Kareus' pure core).
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import importlib.util
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

SCHEMA = "kareus.device_check"
SCHEMA_VERSION = 2
NO_GPU_EXIT = 2
UNUSABLE_EXIT = 1
TOTAL_BUDGET_S = 450.0  # 7.5 minutes of sections; the limit is 8
REFUSED_NVML_PREFIXES = ("nvmlDeviceSet", "nvmlDeviceReset")  # clocks, power limits, applications clocks
REPO = Path(__file__).resolve().parents[1]
# What a project module loaded on its own may import: the standard library, torch, numpy, and
# Kareus' stdlib-only base modules.
LIGHT_ROOTS = frozenset({"torch", "numpy"})
LIGHT_PROJECT = frozenset({"kareus", "kareus.errors", "kareus.daemon_client"})
INTERFERENCE_BLOCKS = (1, 2, 4, 8, 16, 32)
ENERGY_BLOCKS = (8, 32)
NCCL_SMS = (1, 2, 4, 8, 16, 32)
NCCL_TIMEOUT_S = 60.0  # NCCL's default is 10 minutes: a hang would outlive the device command
NCCL_EVIDENCE_LINES = 400
ONE_RANK_SM_BOUND = ("not observable on one GPU: NCCL short-circuits a one-rank collective (a local copy, none of "
                     "the communicator's CTAs run), so no timing here can show the SM bound; the evidence recorded "
                     "is NCCL's INIT lines (nccl_init_lines: the channels, i.e. CTAs, each communicator was built "
                     "with) and the CTAs read back. Observing the bound needs two or more GPUs.")
CALIBRATION_UNITS = {"copy": 1, "spin": 1 << 16}  # passes / iterations of one calibration launch


# -- NVML, read-only -------------------------------------------------------------------------------
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


def _failed(value: Any) -> bool:
    return isinstance(value, dict) and "error" in value


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


def gpu_for_uuid(gpus: Sequence[dict[str, Any]], cuda_uuid: str) -> dict[str, Any] | None:
    """The inventory entry of the CUDA device with `cuda_uuid` (torch prints it without "GPU-");
    never the device at the same index. None when NVML does not know it."""
    want = cuda_uuid.lower().removeprefix("gpu-")
    for gpu in gpus:
        if isinstance(gpu["uuid"], str) and gpu["uuid"].lower().removeprefix("gpu-") == want:
            return gpu
    return None


def power_sampling(nvml: ReadOnlyNVML, handle: Any, window_s: float, *,
                   clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                   poll_s: float = 0.001, tick: Callable[[], None] | None = None) -> dict[str, Any]:
    """Poll the cumulative energy counter (and the instant power) for `window_s`: how often the
    counter changes, by how much, and the mean power it implies vs NVML's power reading.
    `tick()` runs at every poll (to keep a load queued)."""
    start = clock()
    first = read(nvml, "nvmlDeviceGetTotalEnergyConsumption", handle)
    if _failed(first):
        return first
    last, changes, instant_w, sm_mhz = first, [], [], []
    while clock() - start < window_s:
        now_mj = nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        if now_mj != last:
            changes.append((clock() - start, now_mj))
            last = now_mj
        power = read(nvml, "nvmlDeviceGetPowerUsage", handle)
        if not _failed(power):
            instant_w.append(power / 1000.0)
        if len(instant_w) % 50 == 1:
            clock_mhz = read(nvml, "nvmlDeviceGetClockInfo", handle, nvml.NVML_CLOCK_SM)
            if not _failed(clock_mhz):
                sm_mhz.append(clock_mhz)
        if tick is not None:
            tick()
        sleep(poll_s)
    return {"window_s": window_s, **counter_statistics(changes, first),
            "instant_power_w": statistics.fmean(instant_w) if instant_w else None,
            "instant_power_samples": len(instant_w),
            "sm_clock_mhz": [min(sm_mhz), max(sm_mhz)] if sm_mhz else None,
            "field_values": field_power(nvml, handle)}


def counter_statistics(changes: Sequence[tuple[float, float]], first_mj: float) -> dict[str, Any]:
    """(time_s, counter_mj) at each change → update interval, step, and the counter's mean power
    between its first and last update (the only span the counter measures exactly)."""
    steps = [(b - a) / 1000.0 for a, b in itertools.pairwise([first_mj, *(c[1] for c in changes)])]
    intervals = [b[0] - a[0] for a, b in itertools.pairwise(changes)]
    averaged = None
    if len(changes) >= 2 and changes[-1][0] > changes[0][0]:
        averaged = (changes[-1][1] - changes[0][1]) / 1000.0 / (changes[-1][0] - changes[0][0])
    return {"updates": len(changes),
            "median_interval_s": statistics.median(intervals) if intervals else None,
            "median_step_j": statistics.median(steps) if steps else None,
            "counter_power_w": averaged}


def energy_counter_updates(nvml: ReadOnlyNVML, handle: Any, window_s: float,
                           clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """The counter part of `power_sampling` (kept for callers of the first version)."""
    return power_sampling(nvml, handle, window_s, clock=clock)


def field_power(nvml: ReadOnlyNVML, handle: Any) -> Any:
    """NVML's instant and averaged power fields (newer drivers), where this nvidia-ml-py names them."""
    ids = {name: getattr(nvml, f"NVML_FI_DEV_POWER_{name.upper()}", None) for name in ("instant", "average")}
    ids = {k: v for k, v in ids.items() if isinstance(v, int)}
    if not ids:
        return {"error": "this nvidia-ml-py has no NVML_FI_DEV_POWER_INSTANT/AVERAGE"}
    values = read(nvml, "nvmlDeviceGetFieldValues", handle, list(ids.values()))
    if _failed(values):
        return values
    out = {}
    for name, value in zip(ids, values, strict=False):
        status = getattr(value, "nvmlReturn", 0)
        out[f"{name}_w"] = (getattr(getattr(value, "value", None), "uiVal", None) or 0) / 1000.0 if status == 0 \
            else {"error": f"nvmlReturn {status}"}
    return out


# -- sections: budgets and error capture -----------------------------------------------------------
class Skip(Exception):
    """Raised by a section that cannot run here; the message is the recorded reason."""


@dataclass
class Budget:
    """A section's time allowance; sections that loop ask `left_s()` and stop early."""

    budget_s: float
    clock: Callable[[], float] = time.monotonic
    started: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.clock()

    def elapsed_s(self) -> float:
        return self.clock() - self.started

    def left_s(self) -> float:
        return self.budget_s - self.elapsed_s()


@dataclass(frozen=True)
class Section:
    name: str
    budget_s: float
    run: Callable[[Budget], Any]
    required: bool = False  # its failure makes the JSON unusable (exit 1)


def run_sections(sections: Sequence[Section], *, total_budget_s: float = TOTAL_BUDGET_S,
                 clock: Callable[[], float] = time.monotonic, healthy: Callable[[], str | None] = lambda: None,
                 announce: Callable[[str], None] = print,
                 recorded: Callable[[dict[str, Any]], None] = lambda records: None) -> tuple[dict[str, Any], str | None]:
    """Run every section in order; returns ({name: record}, why the JSON is unusable | None).
    `recorded(records so far)` runs after each section (the report is written there).

    A record is {"status": "ok"|"error"|"skipped", "budget_s", "elapsed_s", "over_budget"} plus
    "result" (ok), "error" and "traceback" (error) or "reason" (skipped). A section is skipped when
    the total budget could not cover its own, or after one left the device unusable (`healthy()`
    returns why)."""
    records: dict[str, Any] = {}
    started = clock()
    broken: str | None = None
    unusable: str | None = None
    for section in sections:
        record: dict[str, Any] = {"budget_s": section.budget_s}
        left = total_budget_s - (clock() - started)
        if broken is not None:
            records[section.name] = {**record, "status": "skipped", "reason": broken}
            recorded(records)
            continue
        if section.budget_s > left:
            records[section.name] = {**record, "status": "skipped",
                                     "reason": f"total budget: {left:.0f} s left of {total_budget_s:.0f} s"}
            recorded(records)
            continue
        announce(f"device_check: {section.name} (budget {section.budget_s:.0f} s)")
        budget = Budget(section.budget_s, clock)
        try:
            record.update(status="ok", result=section.run(budget))
        except Skip as why:
            record.update(status="skipped", reason=str(why))
        except Exception as error:
            record.update(status="error", error=f"{type(error).__name__}: {error}",
                          traceback=traceback.format_exc(limit=-4).splitlines()[-12:])
            why = healthy()
            if why is not None:
                broken = f"not run: the device became unusable after {section.name}: {why}"
                unusable = broken
        record["elapsed_s"] = round(budget.elapsed_s(), 3)
        record["over_budget"] = record["elapsed_s"] > section.budget_s
        records[section.name] = record
        if record["status"] == "error" and section.required and unusable is None:
            unusable = f"{section.name} failed: {record['error']}"
        recorded(records)
    return records, unusable


def validate_report(report: dict[str, Any]) -> list[str]:
    """What makes a report unusable for its consumers (empty: fine)."""
    problems = []
    if report.get("schema") != SCHEMA or report.get("schema_version") != SCHEMA_VERSION:
        problems.append(f"schema must be {SCHEMA} v{SCHEMA_VERSION}")
    sections = report.get("sections")
    if not isinstance(sections, dict):
        return [*problems, "sections must be an object"]
    for name, record in sections.items():
        status = record.get("status") if isinstance(record, dict) else None
        need = {"ok": "result", "error": "error", "skipped": "reason"}.get(status)
        if need is None:
            problems.append(f"sections.{name}.status must be ok, error or skipped")
        elif need not in record:
            problems.append(f"sections.{name}: a {status} section needs {need!r}")
    return problems


def summary(name: str, record: dict[str, Any]) -> str:
    """One table cell for a section's outcome."""
    if record["status"] == "skipped":
        return f"skipped: {record['reason']}"
    if record["status"] == "error":
        return f"error: {record['error']}"
    result = record["result"]
    cell = result.get("summary") if isinstance(result, dict) else None
    return cell if isinstance(cell, str) else json.dumps(result, default=str)


def format_table(sections: dict[str, Any], width: int = 110) -> list[str]:
    """The compact table: section, status, time / budget, summary (cut at `width`)."""
    lines = [f"{'section':<14} {'status':<8} {'s / budget':>11}  summary"]
    for name, record in sections.items():
        timing = f"{record.get('elapsed_s', 0):.0f}/{record['budget_s']:.0f}"
        if record.get("over_budget"):
            timing += "!"
        text = summary(name, record).replace("\n", " ")
        lines.append(f"{name:<14} {record['status']:<8} {timing:>11}  {text[:width]}")
    return lines


# -- project modules, loaded on their own ----------------------------------------------------------
def _on_path() -> None:
    """Make the repository importable (the script runs as `python bench/device_check.py`)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def heavy_imports(path: Path) -> list[str]:
    """Imports of the file at `path` beyond the standard library, torch, numpy and Kareus' base
    modules (what `light_module` refuses)."""
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    allowed = set(sys.stdlib_module_names) | LIGHT_ROOTS
    return sorted({n for n in names if n.split(".")[0] not in allowed and n not in LIGHT_PROJECT})


def light_module(relative: str) -> Any:
    """The project module at `relative` (e.g. "kareus/runtime/clocking.py"), executed on its own —
    not through its package's `__init__`, which may pull the rest of the project — after checking
    that it imports only the standard library, torch, numpy and Kareus' base modules."""
    path = REPO / relative
    heavy = heavy_imports(path)
    if heavy:
        raise Skip(f"{relative} imports {', '.join(heavy)}")
    _on_path()
    name = "_device_check_" + relative.removesuffix(".py").replace("/", "_")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def project(modules: Iterable[str]) -> list[Any]:
    """Kareus modules a section needs, or Skip when this machine has no full project."""
    _on_path()
    try:
        return [importlib.import_module(name) for name in modules]
    except ImportError as error:
        raise Skip(f"needs the full project: {error}") from error


# -- CUDA helpers ----------------------------------------------------------------------------------
def _event(torch: Any, stream: Any = None) -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream) if stream is not None else event.record()
    return event


def _timed(torch: Any, fn: Callable[[], Any], repeats: int = 10) -> float:
    fn()
    start = _event(torch)
    for _ in range(repeats):
        fn()
    end = _event(torch)
    end.synchronize()
    return start.elapsed_time(end) / 1000.0 / repeats


def cpu_gpu_lead(torch: Any, steps: int = 64, n: int = 2048) -> dict[str, Any]:
    """Enqueue `steps` GEMMs with an event before each; compare when the CPU enqueued each
    boundary with when the GPU reached it. The lead is how early a CPU-timed request lands."""
    a = torch.randn(n, n, device="cuda")
    torch.cuda.synchronize()
    events, cpu_s = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        events.append(_event(torch))
        cpu_s.append(time.perf_counter() - t0)
        a = a @ a
        a = a / a.norm()
    torch.cuda.synchronize()
    gpu_s = [events[0].elapsed_time(e) / 1000.0 for e in events]
    leads = [g - c for g, c in zip(gpu_s, cpu_s, strict=True)]
    return {"boundaries": steps, "max_lead_s": max(leads), "final_lead_s": leads[-1],
            "gpu_step_s": (gpu_s[-1] - gpu_s[0]) / (steps - 1),
            "summary": f"CPU ahead by up to {max(leads) * 1e3:.1f} ms over {steps} GEMM boundaries"}


def op_timings(torch: Any) -> dict[str, Any]:
    """A GEMM and a memory-bound add alone, fp32 and bf16, timed with CUDA events."""
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
        x = torch.randn(1 << 28, device="cuda", dtype=dtype)
        for name, fn in (("gemm_8192", lambda a=a: a @ a), ("add_256M", lambda x=x: x + x)):
            out[f"{name}_{str(dtype).removeprefix('torch.')}_s"] = _timed(torch, fn)
        del a, x
    bf16 = out["gemm_8192_bfloat16_s"]
    out["summary"] = (f"gemm 8192 fp32 {out['gemm_8192_float32_s'] * 1e3:.2f} ms, bf16 {bf16 * 1e3:.2f} ms "
                      f"({2 * 8192 ** 3 / bf16 / 1e12:.0f} TFLOP/s); add 256M bf16 "
                      f"{out['add_256M_bfloat16_s'] * 1e3:.2f} ms")
    return out


def cuda_usable(torch: Any) -> str | None:
    """None when the CUDA context still works (a sticky error, e.g. an illegal address, breaks it)."""
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return None
    except Exception as error:
        return f"{type(error).__name__}: {error}"


# -- clock landing ---------------------------------------------------------------------------------
class RecordingClock:
    """A clock client that only writes down what it was asked (never a daemon, never a lock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.requests: list[tuple[str, int, float]] = []
        self._clock = clock

    def request_clock(self, clock_mhz: int, *, instruction: str | None = None,
                      stale_after_s: float | None = None) -> None:
        self.requests.append((str(instruction), int(clock_mhz), self._clock()))


def landing_rows(labels: Sequence[str], boundary_s: Sequence[float], enqueued_s: Sequence[float],
                 sent: Iterable[tuple[str, int, float]]) -> list[dict[str, Any]]:
    """Per instruction: when its clock request went out relative to the GPU reaching the
    instruction's start (`landing_ms` < 0: before, the lead), and how far the CPU was ahead
    when it enqueued that boundary. All times on one host clock."""
    sent_at = {label: time_s for label, _, time_s in sent}
    rows = []
    for label, gpu_s, cpu_s in zip(labels, boundary_s, enqueued_s, strict=True):
        at = sent_at.get(label)
        rows.append({"instruction": label,
                     "landing_ms": None if at is None else round((at - gpu_s) * 1e3, 3),
                     "cpu_ahead_ms": round((gpu_s - cpu_s) * 1e3, 3)})
    return rows


def clock_landing(torch: Any, *, instructions: int = 8, steps: int = 3, lead_s: float = 0.005,
                  n: int = 4096) -> dict[str, Any]:
    """The runtime's dispatcher with CUDA-event markers on GEMM "instructions" of 1–4 ms, submitted
    exactly as `PlanFollower` does: instruction 0's clock at the step-begin marker, i+1's between
    i's begin and end markers with i's duration from the previous step (the lead)."""
    clocking = light_module("kareus/runtime/clocking.py")
    client = RecordingClock()
    progress = clocking.CudaProgress()
    dispatcher = clocking.ClockDispatcher(client, progress, lead_s=lead_s)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    gemms = [1 + i % 4 for i in range(instructions)]
    torch.cuda.synchronize()
    ref = _event(torch)
    ref.synchronize()
    host_ref = time.monotonic()  # the GPU reached `ref` just before: the two clocks' offset
    expected: list[float | None] = [None] * instructions
    per_step = []
    for step in range(steps):
        labels = [f"step{step}/instr{i}" for i in range(instructions)]
        begins, ends, enqueued = [], [], []
        step_begin = progress.mark()
        enqueued.append(time.monotonic())
        dispatcher.submit(labels[0], 1000, anchor=step_begin, stale_in_s=expected[0])
        for i in range(instructions):
            begins.append(progress.mark() if i else step_begin)
            if i:
                enqueued.append(time.monotonic())
            for _ in range(gemms[i] * 4):
                a = a @ a
                a = a / a.norm()
            ends.append(progress.mark())
            if i + 1 < instructions:
                dispatcher.submit(labels[i + 1], 1000 + 15 * (i + 1), anchor=begins[i], end=ends[i],
                                  expected_s=expected[i], stale_in_s=expected[i + 1])
        torch.cuda.synchronize()  # the step's host sync
        dispatcher.settle()
        boundary = [host_ref + ref.elapsed_time(b.event) / 1000.0 for b in begins]
        per_step.append(landing_rows(labels, boundary, enqueued, client.requests))
        expected = [e.elapsed_s(b) for b, e in zip(begins, ends, strict=True)]
    dispatcher.close()
    last = [r["landing_ms"] for r in per_step[-1][1:] if r["landing_ms"] is not None]
    return {"lead_s": lead_s, "instruction_s": expected, "steps": per_step,
            "summary": (f"step {steps - 1}: requests land {min(last):+.2f}…{max(last):+.2f} ms from the GPU boundary "
                        f"(lead {lead_s * 1e3:.0f} ms)") if last else "no requests recorded"}


# -- NCCL communicators ----------------------------------------------------------------------------
def read_ctas(backend: Any) -> dict[str, Any]:
    """min/max CTAs a ProcessGroupNCCL reports back, wherever this torch exposes them."""
    options = getattr(backend, "options", None)
    if options is None:
        options = guarded(lambda: backend._get_options())  # some versions keep them private
    config = getattr(options, "config", None)
    if config is None:
        return {"error": "this torch exposes no options.config on the process group"}
    return {k: getattr(config, k, None) for k in ("min_ctas", "max_ctas", "cga_cluster_size", "nvls_ctas")
            if hasattr(config, k)}


def nccl_debug_env(log_dir: str) -> dict[str, str]:
    """What makes NCCL log its INIT lines to a file in `log_dir` (set before its first init)."""
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT", "NCCL_DEBUG_FILE": os.path.join(log_dir, "nccl.%p.log")}


def nccl_init_lines(log_dir: str, limit: int = NCCL_EVIDENCE_LINES) -> list[str]:
    """NCCL's INIT log lines written to `log_dir` (at most `limit`), in order."""
    lines: list[str] = []
    for path in sorted(Path(log_dir).glob("nccl.*.log")):
        lines += [line.rstrip() for line in path.read_text(errors="replace").splitlines() if "NCCL INFO" in line]
    return lines[:limit]


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ for the block; what was there before afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def one_rank_init(dist: Any, store: Any, device: Any) -> None:
    """The one-rank default group on `device`, with `NCCL_TIMEOUT_S`."""
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device,
                            timeout=timedelta(seconds=NCCL_TIMEOUT_S))


def nccl_comms(torch: Any, budget: Budget, sms_counts: Sequence[int] = NCCL_SMS) -> dict[str, Any]:
    """World size 1 over a FileStore: the default communicator bound to cuda:0, then one split,
    CTA-bounded group per SM count with the runtime's options; per group init time (creation plus
    a first all-reduce), device memory before/after, CTAs read back, and NCCL's INIT lines (the
    only evidence of the bound one GPU gives: `ONE_RANK_SM_BOUND`)."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_nccl_available():
        raise Skip("this torch has no NCCL")
    comm = light_module("kareus/runtime/comm.py")
    try:
        comm.nccl_options(1)
    except Exception as error:  # CommSmsError: no ProcessGroupNCCL.Options.config
        raise Skip(str(error)) from error
    if dist.is_initialized():
        raise Skip("a process group is already initialised in this process")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    out: dict[str, Any] = {"nccl_version": guarded(lambda: ".".join(map(str, torch.cuda.nccl.version()))),
                           "nccl_env": env, "communicators": [], "sm_bound": ONE_RANK_SM_BOUND,
                           "timeout_s": NCCL_TIMEOUT_S}
    # NCCL reads its debug variables at its first init in the process, which is the next line's.
    with tempfile.TemporaryDirectory() as tmp, environment(nccl_debug_env(tmp)):
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        free_before, total = torch.cuda.mem_get_info()
        start = time.perf_counter()
        one_rank_init(dist, store, device)
        probe = torch.ones(1024, device=device)
        dist.all_reduce(probe)
        torch.cuda.synchronize()
        out["default"] = {"init_s": time.perf_counter() - start,
                          "device_memory_mib": (free_before - torch.cuda.mem_get_info()[0]) / 2**20}
        try:
            for sms in sms_counts:
                if budget.left_s() < 5:
                    out["truncated"] = f"budget: stopped before {sms} SMs"
                    break
                free = torch.cuda.mem_get_info()[0]
                start = time.perf_counter()
                group = dist.new_group([0], backend="nccl", pg_options=comm.nccl_options(sms), device_id=device,
                                       timeout=timedelta(seconds=NCCL_TIMEOUT_S))
                created = time.perf_counter() - start
                dist.all_reduce(probe, group=group)
                torch.cuda.synchronize()
                row = {"comm_sms": sms, "create_s": created, "init_s": time.perf_counter() - start,
                       "device_memory_mib": (free - torch.cuda.mem_get_info()[0]) / 2**20,
                       "ctas_read_back": guarded(lambda g=group: read_ctas(g._get_backend(device)))}
                out["communicators"].append(row)
        finally:
            dist.destroy_process_group()
            out["nccl_init_lines"] = guarded(nccl_init_lines, tmp)
    rows = out["communicators"]
    out["device_memory_total_mib"] = total / 2**20
    out["summary"] = (f"{len(rows)} communicators: init {min(r['init_s'] for r in rows) * 1e3:.0f}–"
                      f"{max(r['init_s'] for r in rows) * 1e3:.0f} ms, "
                      f"{max(r['device_memory_mib'] for r in rows):.0f} MiB max each; SM bound not observable "
                      f"on one GPU (NCCL INIT lines kept)") if rows else "none created"
    return out


# -- the interference matrix -----------------------------------------------------------------------
@dataclass(frozen=True)
class Window:
    """One timed co-run on the device clock, in seconds from a common origin: the foreground op
    repeated (`op_reps`) and the background kernel on its blocks (None: alone)."""

    op_start: float
    op_end: float
    op_reps: int
    bg_start: float | None = None
    bg_end: float | None = None
    bg_sms: int | None = None  # distinct SMs the background's blocks ran on (None: not read back)

    @property
    def op_s(self) -> float:
        return (self.op_end - self.op_start) / self.op_reps

    @property
    def bg_s(self) -> float | None:
        return None if self.bg_start is None else self.bg_end - self.bg_start

    def overlap(self) -> float | None:
        """Share of the op's span that the background covered."""
        if self.bg_start is None:
            return None
        span = self.op_end - self.op_start
        both = min(self.op_end, self.bg_end) - max(self.op_start, self.bg_start)
        return max(0.0, both) / span if span > 0 else 0.0


class Timer(Protocol):
    """What the matrix needs from the device (a fake in tests); `mechanism` says what bounds the
    background's blocks and how the SMs it got are read."""

    mechanism: dict[str, str]

    def alone(self, op: str) -> Window: ...

    def background_alone(self, kind: str, blocks: int) -> Window: ...

    def op_inside(self, op: str, kind: str, blocks: int) -> Window:
        """The op's window inside a longer background run."""

    def background_inside(self, op: str, kind: str, blocks: int) -> Window:
        """A background run inside a longer stretch of the op (the background's slowdown)."""


def median_window(measure: Callable[[], Window], repeats: int, key: Callable[[Window], float]) -> Window:
    """The median of `repeats` windows by `key` (an odd count picks a real one)."""
    windows = sorted((measure() for _ in range(repeats)), key=key)
    return windows[len(windows) // 2]


def interference_matrix(timer: Timer, ops: Sequence[str], kinds: Sequence[str], blocks: Sequence[int],
                        budget: Budget | None = None, min_left_s: float = 2.0, repeats: int = 3) -> dict[str, Any]:
    """Every op alone, every background alone on k blocks, and each pair both ways (median of
    `repeats`); slowdowns are times over the alone times. Stops (and says so) when the budget runs low."""
    def op_s(w: Window) -> float:
        return w.op_s

    def bg_s(w: Window) -> float:
        return w.bg_s or 0.0

    alone = {op: median_window(lambda op=op: timer.alone(op), repeats, op_s).op_s for op in ops}
    rows, truncated = [], None
    for kind, k in itertools.product(kinds, blocks):
        if budget is not None and budget.left_s() < min_left_s:
            truncated = f"budget: stopped before {kind} on {k} blocks"
            break
        bg = median_window(lambda kind=kind, k=k: timer.background_alone(kind, k), repeats, bg_s)
        for op in ops:
            inside = median_window(lambda op=op, kind=kind, k=k: timer.op_inside(op, kind, k), repeats, op_s)
            around = median_window(lambda op=op, kind=kind, k=k: timer.background_inside(op, kind, k), repeats, bg_s)
            rows.append({
                "op": op, "background": kind, "blocks": k,
                "sms_obtained": inside.bg_sms if inside.bg_sms is not None else bg.bg_sms,
                "op_s": inside.op_s, "op_slowdown": inside.op_s / alone[op],
                "op_covered": inside.overlap(),  # < 1: the background ended early, the figure is diluted
                "background_s": bg.bg_s, "background_slowdown": around.bg_s / bg.bg_s if bg.bg_s else None,
                "background_covered": _covered(around),
            })
    return {"alone_s": alone, "rows": rows, "mechanism": dict(timer.mechanism), "truncated": truncated}


def _covered(window: Window) -> float | None:
    """Share of the background's span inside the op's span."""
    if window.bg_start is None or window.bg_end <= window.bg_start:
        return None
    both = min(window.op_end, window.bg_end) - max(window.op_start, window.bg_start)
    return max(0.0, both) / (window.bg_end - window.bg_start)


def _triton_kernels() -> tuple[Any, Any]:
    """(copy kernel, spin kernel), Triton JIT functions launched on a grid of exactly k blocks;
    with SMID set each block writes the id of the SM it runs on. Skip without Triton."""
    if importlib.util.find_spec("triton") is None:
        raise Skip("no triton")
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(src, dst, smids, n, passes, BLOCK: tl.constexpr, SMID: tl.constexpr):
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        if SMID:
            smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
            tl.store(smids + pid, smid)
        for _ in range(passes):
            for offset in range(pid * BLOCK, n, programs * BLOCK):
                index = offset + tl.arange(0, BLOCK)
                mask = index < n
                tl.store(dst + index, tl.load(src + index, mask=mask), mask=mask)

    @triton.jit
    def spin_kernel(out, smids, iterations, BLOCK: tl.constexpr, SMID: tl.constexpr):
        pid = tl.program_id(0)
        if SMID:
            smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
            tl.store(smids + pid, smid)
        x = tl.arange(0, BLOCK).to(tl.float32)
        for _ in range(iterations):
            x = x * 0.999999 + 0.5
        tl.store(out + pid * BLOCK + tl.arange(0, BLOCK), x)

    return copy_kernel, spin_kernel


def warm_launches(passes: dict[tuple[str, int], int]) -> list[tuple[str, int, int]]:
    """(kind, blocks, passes) to launch once before anything is timed: Triton compiles a kernel
    per specialisation of its integer arguments (1, multiples of 16, …), so each pass count timed
    later is launched once first. On the most blocks (the grid is no part of the specialisation,
    and more blocks finish the warm-up sooner)."""
    most: dict[str, int] = {}
    for (kind, blocks) in passes:
        most[kind] = max(most.get(kind, 0), blocks)
    return sorted({(kind, most[kind], n) for (kind, _), n in passes.items()})


class CudaTimer(Timer):
    """The matrix on cuda:0: foreground on the current stream, background on a high-priority side
    stream, all spans from CUDA events against one origin event."""

    def __init__(self, torch: Any, *, target_s: float = 0.02) -> None:
        self.torch = torch
        self.target_s = target_s
        self.side = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
        bf16 = torch.bfloat16
        a = torch.randn(8192, 8192, device="cuda", dtype=bf16)
        x, y, z = (torch.randn(1 << 26, device="cuda", dtype=bf16) for _ in range(3))
        self.ops = {"gemm_bf16_8192": lambda: a @ a, "add_bf16_64M": lambda: torch.add(x, y, out=z)}
        self.reps = {op: max(1, math.ceil(target_s / _timed(torch, fn))) for op, fn in self.ops.items()}
        self.src = torch.randn(64 << 20, device="cuda", dtype=torch.float32)  # 256 MiB, read and written
        self.dst = torch.empty_like(self.src)
        self.smids = torch.full((1024,), -1, device="cuda", dtype=torch.int32)
        self.spin_out = torch.empty(1024 * 1024, device="cuda", dtype=torch.float32)
        self.mechanism: dict[str, str] = {}
        self._triton, self._smid = None, False
        self._setup_kernels()
        self._streams = [torch.cuda.Stream() for _ in range(max(INTERFERENCE_BLOCKS))] if not self._triton else []
        self.origin = _event(torch)
        self.passes = {("copy", k): self._calibrate("copy", k) for k in INTERFERENCE_BLOCKS}
        self.passes.update({("spin", k): self._calibrate("spin", k) for k in INTERFERENCE_BLOCKS})
        for kind, blocks, passes in warm_launches(self.passes):
            self._launch(kind, blocks, passes)
        torch.cuda.synchronize()

    def _setup_kernels(self) -> None:
        """Triton with %smid read-back, else Triton without it, else torch (block count not bounded)."""
        try:
            kernels = _triton_kernels()
        except Exception as error:  # Skip (no triton) or a broken install
            self.mechanism["triton"] = str(error)
            kernels = None
        for smid in (True, False) if kernels else ():
            self._triton, self._smid = kernels, smid
            try:  # compiles the calibration's specialisation too: the calibration is timed
                for kind, unit in CALIBRATION_UNITS.items():
                    self._launch(kind, 1, unit)
                self.torch.cuda.synchronize()
                break
            except Exception as error:  # e.g. the %smid inline asm refused
                self.mechanism[f"triton_smid_{smid}_error"] = f"{type(error).__name__}: {error}"[:300]
                self._triton, self._smid = None, False
        if self._triton is not None:
            self.mechanism["bound"] = "triton grid: each kernel is launched with exactly k blocks of 1024 threads"
        else:
            self.mechanism["bound"] = ("NOT bounded: no working triton; the copy is torch copy_ on a side stream (its "
                                       "own grid, k ignored), the spinner k torch.cuda._sleep launches (one "
                                       "1-thread block each) on k streams, concurrent only if the GPU runs them so")
        self.mechanism["sms_obtained"] = ("distinct %smid over the k blocks (blocks can share an SM)" if self._smid
                                          else "not read back")

    def _launch(self, kind: str, blocks: int, passes: int) -> None:
        torch = self.torch
        if self._triton is None:
            if kind == "copy":
                for _ in range(passes):
                    self.dst.copy_(self.src)
            else:
                for stream in self._streams[:blocks]:
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        torch.cuda._sleep(passes)
                    torch.cuda.current_stream().wait_stream(stream)
            return
        copy_kernel, spin_kernel = self._triton
        if kind == "copy":
            copy_kernel[(blocks,)](self.src, self.dst, self.smids, self.src.numel(), passes,
                                   BLOCK=4096, SMID=self._smid, num_warps=32)
        else:
            spin_kernel[(blocks,)](self.spin_out, self.smids, passes, BLOCK=1024, SMID=self._smid, num_warps=32)

    def _background(self, kind: str, blocks: int, passes: int) -> tuple[Any, Any]:
        torch = self.torch
        self.smids.fill_(-1)
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            start = _event(torch, self.side)
            self._launch(kind, blocks, passes)
            end = _event(torch, self.side)
        return start, end

    def _calibrate(self, kind: str, blocks: int) -> int:
        """Passes (copy) or iterations (spin) that keep k blocks busy ~4× an op window."""
        unit = CALIBRATION_UNITS[kind]
        start, end = self._background(kind, blocks, unit)
        end.synchronize()
        once_s = max(start.elapsed_time(end) / 1000.0, 1e-6)
        return max(1, math.ceil(4 * self.target_s / once_s)) * unit

    def _s(self, event: Any) -> float:
        return self.origin.elapsed_time(event) / 1000.0

    def _sms(self) -> int | None:
        if self._triton is None or not self._smid:
            return None
        ids = self.smids.cpu().tolist()
        return len({i for i in ids if i >= 0})

    def _op(self, op: str, reps: int) -> tuple[Any, Any]:
        start = _event(self.torch)
        for _ in range(reps):
            self.ops[op]()
        return start, _event(self.torch)

    def alone(self, op: str) -> Window:
        start, end = self._op(op, self.reps[op])
        end.synchronize()
        return Window(self._s(start), self._s(end), self.reps[op])

    def background_alone(self, kind: str, blocks: int) -> Window:
        bg_start, bg_end = self._background(kind, blocks, self.passes[(kind, blocks)])
        bg_end.synchronize()
        return Window(0.0, 0.0, 1, self._s(bg_start), self._s(bg_end), self._sms())

    def op_inside(self, op: str, kind: str, blocks: int) -> Window:
        bg_start, bg_end = self._background(kind, blocks, self.passes[(kind, blocks)])
        self.torch.cuda._sleep(1 << 20)  # ~0.5 ms on the main stream: the background is resident first
        start, end = self._op(op, self.reps[op])
        self.torch.cuda.synchronize()
        return Window(self._s(start), self._s(end), self.reps[op], self._s(bg_start), self._s(bg_end), self._sms())

    def background_inside(self, op: str, kind: str, blocks: int) -> Window:
        reps = self.reps[op] * 16  # ~16 op windows around a background of ~4 (covers a 3.5× slowdown)
        start = _event(self.torch)
        for _ in range(reps // 8):  # the side stream waits for these: the background starts inside the op
            self.ops[op]()
        bg_start, bg_end = self._background(kind, blocks, self.passes[(kind, blocks)])
        for _ in range(reps - reps // 8):
            self.ops[op]()
        end = _event(self.torch)
        self.torch.cuda.synchronize()
        return Window(self._s(start), self._s(end), reps, self._s(bg_start), self._s(bg_end), self._sms())

    def pair(self, op: str | None, kind: str | None, blocks: int) -> Callable[[], None]:
        """One energy-window iteration: one op window alone; with `kind`, one background run
        (~4 op windows long) beside 4 op windows, both starting together; with `op` None, the
        background run alone (the main stream only waits for it)."""
        reps = 0 if op is None else self.reps[op] * (1 if kind is None else 4)

        def run() -> None:
            if kind is not None:
                self._background(kind, blocks, self.passes[(kind, blocks)])
            for _ in range(reps):
                self.ops[op]()
            self.torch.cuda.current_stream().wait_stream(self.side)
        return run


def energy_window(nvml: ReadOnlyNVML, handle: Any, run: Callable[[], None], sync: Callable[[], None],
                  iteration_s: float, window_s: float, *, clock: Callable[[], float] = time.monotonic,
                  samples: int = 4) -> dict[str, Any]:
    """Energy per iteration of `run` over ≥ `window_s` of back-to-back iterations (the counter's
    update step limits a shorter window): counter difference around a synchronised stretch, with
    the SM clock and power sampled *inside* it (while the GPU works through the queue)."""
    iterations = max(samples, math.ceil(window_s / max(iteration_s, 1e-6)))
    chunk = max(1, iterations // samples)
    sync()
    before = nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    start = clock()
    clocks, powers = [], []
    for i in range(iterations):
        run()
        if (i + 1) % chunk == 0:
            clock_mhz = read(nvml, "nvmlDeviceGetClockInfo", handle, nvml.NVML_CLOCK_SM)
            power = read(nvml, "nvmlDeviceGetPowerUsage", handle)
            if not _failed(clock_mhz):
                clocks.append(clock_mhz)
            if not _failed(power):
                powers.append(power / 1000.0)
    sync()
    elapsed = clock() - start
    energy_j = (nvml.nvmlDeviceGetTotalEnergyConsumption(handle) - before) / 1000.0
    return {"iterations": iterations, "window_s": elapsed, "energy_j": energy_j / iterations,
            "time_s": elapsed / iterations, "power_w": energy_j / elapsed if elapsed > 0 else None,
            "sm_clock_mhz_inside": clocks, "instant_power_w_inside": powers}


# What one iteration of each energy window runs (the report's `energy.per_iteration`).
ENERGY_PER_ITERATION = ("op alone: op_reps ops; op+copyK: one copy run on K blocks beside 4 × op_reps ops, started "
                        "together; copyK / spinK: one copy / spinner run on K blocks alone, every other SM idle "
                        "(iterations back to back, each joined)")


@dataclass(frozen=True)
class EnergyWindow:
    """One NVML energy window of the interference section: `op` (None: no foreground op) beside
    `kind` on `blocks` blocks (None: the op alone)."""

    op: str | None
    kind: str | None
    blocks: int

    @property
    def name(self) -> str:
        """`op`, `op+copyK`, or `copyK` / `spinK` for a background alone."""
        if self.kind is None:
            return str(self.op)
        return f"{self.kind}{self.blocks}" if self.op is None else f"{self.op}+{self.kind}{self.blocks}"

    def iteration_s(self, target_s: float) -> float:
        """About how long one iteration runs: an op window, or a background run (~4 op windows)."""
        return target_s if self.kind is None else 4 * target_s


def energy_windows(ops: Sequence[str], kinds: Sequence[str], blocks: Sequence[int]) -> list[EnergyWindow]:
    """The windows, most needed first (a tight budget drops the last): each op alone, each op
    beside the copy on K ∈ `ENERGY_BLOCKS` blocks, then the copy and the spinner (those of `kinds`)
    alone on those K — the exposed phase itself, K SMs working and the rest idle."""
    ks = [k for k in ENERGY_BLOCKS if k in blocks]
    windows = [EnergyWindow(op, None, 0) for op in ops]
    windows += [EnergyWindow(op, "copy", k) for k in ks for op in ops] if "copy" in kinds else []
    windows += [EnergyWindow(None, kind, k) for kind in ("copy", "spin") if kind in kinds for k in ks]
    return windows


def measure_energy_windows(nvml: ReadOnlyNVML, handle: Any, windows: Sequence[EnergyWindow],
                           run_for: Callable[[EnergyWindow], Callable[[], None]], sync: Callable[[], None],
                           budget: Budget, window_s: float, target_s: float, *,
                           clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Each window's `energy_window`, in order, by name; stops (`truncated` says before which)
    when the budget cannot cover another window."""
    energy: dict[str, Any] = {}
    for window in windows:
        if budget.left_s() < window_s + 3:
            energy["truncated"] = (f"budget: stopped before {window.op or '(no op)'} + {window.kind} on "
                                   f"{window.blocks}")
            break
        energy[window.name] = guarded(lambda window=window: energy_window(
            nvml, handle, run_for(window), sync, window.iteration_s(target_s), window_s, clock=clock))
    energy["per_iteration"] = ENERGY_PER_ITERATION
    return energy


def interference(torch: Any, nvml: ReadOnlyNVML | None, handle: Any, budget: Budget, window_s: float) -> dict[str, Any]:
    timer = CudaTimer(torch)
    blocks = INTERFERENCE_BLOCKS if timer._triton else (1,)
    kinds = ("copy", "spin")
    windows = energy_windows(list(timer.ops), kinds, blocks)
    # The matrix leaves the windows their time (each ≥ window_s, plus two for rounding and syncs).
    matrix = interference_matrix(timer, list(timer.ops), kinds, blocks, budget,
                                 min_left_s=(len(windows) + 2) * window_s)
    matrix["op_reps"] = timer.reps
    if handle is None:
        energy: dict[str, Any] = {"error": "no NVML handle for cuda:0 (UUID not found in NVML)",
                                  "per_iteration": ENERGY_PER_ITERATION}
    else:
        energy = measure_energy_windows(nvml, handle, windows, lambda w: timer.pair(w.op, w.kind, w.blocks),
                                        torch.cuda.synchronize, budget, window_s, timer.target_s)
    matrix["energy"] = energy
    worst = max((r for r in matrix["rows"] if r["background"] == "copy"), key=lambda r: r["op_slowdown"],
                default=None)
    matrix["summary"] = (f"{len(matrix['rows'])} pairs; worst copy: {worst['op']} ×{worst['op_slowdown']:.2f} on "
                         f"{worst['blocks']} blocks ({worst['sms_obtained']} SMs); {matrix['mechanism']['bound'][:40]}"
                         if worst else "no pairs measured")
    return matrix


# -- energy under load -----------------------------------------------------------------------------
def energy_under_load(torch: Any, nvml: ReadOnlyNVML, handle: Any, window_s: float) -> dict[str, Any]:
    """The counter and the power reading while a GEMM queue keeps the GPU busy for the window."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    gemm_s = _timed(torch, lambda: torch.matmul(a, a, out=c))
    depth = max(4, math.ceil(0.05 / gemm_s))  # ~50 ms queued: never idle, never a full launch queue
    in_flight: collections.deque = collections.deque()

    def keep_busy() -> None:
        while in_flight and in_flight[0].query():
            in_flight.popleft()
        while len(in_flight) < depth:
            torch.matmul(a, a, out=c)
            done = torch.cuda.Event()
            done.record()
            in_flight.append(done)

    keep_busy()
    time.sleep(0.2)  # past the ramp-up
    result = power_sampling(nvml, handle, window_s, tick=keep_busy)
    torch.cuda.synchronize()
    result["gemm_s"], result["queued_gemms"] = gemm_s, depth
    result["summary"] = (f"counter every {result['median_interval_s']} s by {result['median_step_j']} J; "
                         f"instant {result['instant_power_w']} W vs counter {result['counter_power_w']} W")
    return result


# -- the runtime's own smoke test -------------------------------------------------------------------
def runtime_smoke(budget: Budget, comm_sms: int = 8) -> dict[str, Any]:
    smoke, models = project(["kareus.runtime.smoke", "kareus.workload.models"])
    shape = models.get_preset("tiny")
    configs = smoke.explicit_configs(shape, comm_sms)
    runs = {}
    for dtype, explicit in itertools.product(("float32", "bfloat16"), (False, True)):
        name = f"{dtype}_{'explicit' if explicit else 'default'}"
        if budget.left_s() < 15:
            runs[name] = {"error": "budget: not run"}
            continue
        runs[name] = guarded(lambda d=dtype, e=explicit: smoke.cuda_smoke(dtype=d, configs=configs if e else None))
    cells = [f"{k}: {'match' if v.get('losses_match') else 'DIFFER' if 'losses_match' in v else 'error'}"
             for k, v in runs.items()]
    return {"runs": runs, "summary": "; ".join(cells)}


# -- the profiler path at the current clock ---------------------------------------------------------
PROFILED_TYPES = ("fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn")


def profiler_current_clock(torch: Any, nvml: ReadOnlyNVML | None, handle: Any, budget: Budget, window_s: float,
                           gpu_product: str | None, preset: str = "llama3.1-8b") -> dict[str, Any]:
    """Each partition type's emulation (`EmulatedPartition`, what the NVML profiler backend runs)
    at its default config and at (first slot, fewest SMs), at whatever clock the GPU runs: CUDA-
    event time, an energy window when NVML knows the GPU, the simulator's prediction at the clock
    read inside the window. No lock: `kareus.profiler.nvml` locks, so it is not used here."""
    kernels, models, partitions = project(["kareus.profiler.kernels", "kareus.workload.models",
                                           "kareus.workload.partitions"])
    try:
        shape = models.get_preset(preset)
    except Exception:
        shape = models.get_preset("tiny")
    workload = partitions.build_workload(shape, tp=2, cp=1, pp=1, seq_len=4096, micro_batch_size=2)
    try:
        (sim,) = project(["kareus.sim"])
    except Skip:
        sim = None
    rows = []
    for name in PROFILED_TYPES:
        ptype = workload.partition_types.get(name)
        if ptype is None:
            continue
        default = ptype.default_config()
        for slot, sms in ((default.launch_slot, default.comm_sms), (ptype.launch_slots[0], min(ptype.comm_sms_grid))):
            if budget.left_s() < window_s + 5:
                rows.append({"type": name, "truncated": "budget"})
                break
            part = kernels.EmulatedPartition(ptype, slot, sms, "cuda:0")
            time_s = _timed(torch, part.run, repeats=5)
            row = {"type": name, "launch_slot": slot, "comm_sms": sms, "time_s": time_s, "sm_control": part.sm_control}
            if handle is not None:
                row["window"] = guarded(energy_window, nvml, handle, part.run, torch.cuda.synchronize, time_s, window_s)
            if sim is not None and handle is not None and not _failed(row.get("window", {})) and \
                    row["window"]["sm_clock_mhz_inside"]:
                clock_mhz = int(statistics.median(row["window"]["sm_clock_mhz_inside"]))
                row["simulated"] = guarded(lambda p=ptype, c=clock_mhz, s=sms, sl=slot:
                                           _simulate(sim, gpu_product, p, c, s, sl))
            rows.append(row)
            del part
    return {"preset": shape.name, "layout": "tp2 (one GPU's share)", "rows": rows,
            "summary": "; ".join(f"{r['type']}@{r.get('launch_slot')}/{r.get('comm_sms')}: "
                                 f"{r.get('time_s', float('nan')) * 1e3:.2f} ms" for r in rows if "time_s" in r)}


def _simulate(sim: Any, gpu_product: str | None, ptype: Any, clock_mhz: int, comm_sms: int,
              slot: str) -> dict[str, Any]:
    """The twin of this GPU model (an error where it has none) at the clock read in the window."""
    if gpu_product is None:
        raise ValueError("the GPU model is unknown (cuda:0 not found in NVML)")
    measured = sim.Simulator(sim.get_gpu(gpu_product)).partition(ptype, clock_mhz, comm_sms, slot)
    return {"gpu": gpu_product, "clock_mhz": clock_mhz, "time_s": measured.time_s, "energy_j": measured.energy_j}


# -- main -------------------------------------------------------------------------------------------
def _no_gpu(reason: str) -> int:
    print(f"device_check: no GPU to check: {reason}")
    return NO_GPU_EXIT


def find_gpu(torch: Any, nvml_module: str = "pynvml") -> tuple[ReadOnlyNVML | None, str | None]:
    """(read-only NVML, None), or (None, why there is no GPU to check)."""
    if torch is None:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "torch.cuda.is_available() is False"
    try:
        module = importlib.import_module(nvml_module)
        module.nvmlInit()
    except Exception as error:
        return None, f"NVML is not available ({error})"
    nvml = ReadOnlyNVML(module)
    count = read(nvml, "nvmlDeviceGetCount")
    if not isinstance(count, int) or count < 1:
        return None, "NVML sees no GPU"
    return nvml, None


def build_sections(torch: Any, nvml: ReadOnlyNVML, report: dict[str, Any], window_s: float) -> list[Section]:
    state: dict[str, Any] = {"handle": None, "product": None}

    def nvml_section(budget: Budget) -> dict[str, Any]:
        found = inventory(nvml)
        gpu = gpu_for_uuid(found["gpus"], report["cuda_device_0_uuid"])
        if gpu is None:
            found["cuda_device_0_nvml_index"] = {"error": "cuda:0's UUID is unknown to NVML"}
            found["summary"] = "cuda:0 not found in NVML by UUID: no energy readings"
            return found
        state["handle"] = nvml.nvmlDeviceGetHandleByIndex(gpu["nvml_index"])
        if isinstance(gpu["name"], str):
            state["product"] = gpu["name"].removeprefix("NVIDIA ").replace(" ", "-")
        found["cuda_device_0_nvml_index"] = gpu["nvml_index"]
        found["summary"] = (f"{gpu['name']} {gpu['uuid']}, driver {found['driver']}, {gpu['sm_clock_mhz']} MHz, "
                            f"{gpu['power_w']} W")
        return found

    def need_handle() -> Any:
        if state["handle"] is None:
            raise Skip("no NVML handle for cuda:0 (its UUID is unknown to NVML)")
        return state["handle"]

    def idle(budget: Budget) -> dict[str, Any]:
        result = power_sampling(nvml, need_handle(), window_s)
        if not _failed(result):
            result["summary"] = (f"idle: counter every {result['median_interval_s']} s by {result['median_step_j']} J;"
                                 f" instant {result['instant_power_w']} W vs counter {result['counter_power_w']} W")
        return result

    return [
        Section("nvml", 10, nvml_section, required=True),
        Section("energy_idle", window_s + 8, idle),
        Section("cpu_gpu_lead", 10, lambda b: cpu_gpu_lead(torch)),
        Section("op_timings", 20, lambda b: op_timings(torch)),
        Section("clock_landing", 20, lambda b: clock_landing(torch)),
        Section("nccl_comms", 60, lambda b: nccl_comms(torch, b)),
        Section("interference", 150, lambda b: interference(torch, nvml, state["handle"], b, window_s)),
        Section("energy_load", window_s + 10, lambda b: energy_under_load(torch, nvml, need_handle(), window_s)),
        Section("cuda_smoke", 80, runtime_smoke),
        Section("profiler", 60, lambda b: profiler_current_clock(torch, nvml, state["handle"], b, window_s,
                                                                 state["product"])),
    ]


def write_report(report: dict[str, Any], path: str) -> str | None:
    """Write the JSON (whole or not at all: a kill mid-write leaves the previous one); why it is
    unusable, or None."""
    problems = validate_report(report)
    try:
        text = json.dumps(report, indent=1, default=str)
        partial = Path(f"{path}.partial")
        partial.write_text(text)
        os.replace(partial, path)
    except (OSError, TypeError, ValueError) as error:
        problems.append(f"could not write {path}: {error}")
    return "; ".join(problems) or None


def report_writer(report: dict[str, Any], path: str) -> Callable[[dict[str, Any]], None]:
    """`run_sections`' `recorded`: the report so far, written after every section."""
    def write(records: dict[str, Any]) -> None:
        report["sections"] = dict(records)
        write_report(report, path)
    return write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="device_check.json")
    parser.add_argument("--energy-window-s", type=float, default=2.6, help="NVML energy window (>= 2.5 s)")
    parser.add_argument("--only", default=None, help="comma-separated section names (default: all)")
    parser.add_argument("--nvml-module", default="pynvml", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.energy_window_s < 2.5:
        parser.error("--energy-window-s must be >= 2.5 (the counter's update step biases shorter windows)")
    try:
        import torch
    except ImportError:
        torch = None
    nvml, reason = find_gpu(torch, args.nvml_module)
    if nvml is None:
        return _no_gpu(reason)
    report: dict[str, Any] = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_device_0": torch.cuda.get_device_name(0),
        "cuda_device_0_uuid": str(torch.cuda.get_device_properties(0).uuid),
        "read_only": "no clock, power-limit or reset call is possible (ReadOnlyNVML); clock requests are recorded only",
        "energy_window_s": args.energy_window_s, "total_budget_s": TOTAL_BUDGET_S,
    }
    sections = build_sections(torch, nvml, report, args.energy_window_s)
    if args.only:
        wanted = set(args.only.split(","))
        sections = [s for s in sections if s.name in wanted or s.name == "nvml"]
    started = time.monotonic()
    report["complete"] = False  # until every section has run
    report["sections"], unusable = run_sections(sections, healthy=lambda: cuda_usable(torch),
                                                recorded=report_writer(report, args.out))
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    report["complete"] = True
    problem = write_report(report, args.out)
    for line in format_table(report["sections"]):
        print(line)
    if unusable or problem:
        print(f"device_check: the JSON is unusable: {unusable or problem}")
        return UNUSABLE_EXIT
    print(f"written: {args.out} ({report['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
