"""Measuring on real GPUs through NVML: the thermally stable profiler (DESIGN.md §2.7).

For every candidate the backend locks the SM clock of the job's GPUs (min = max = the candidate's
clock), then:

1. warm-up: a few runs, then a timed calibration run decides how many repetitions fill the
   measurement window (NVML's energy counter only updates about every 100 ms, and a short window
   is biased low because the GPU has not warmed up);
2. cooldown: sleep `cooldown_s` so every candidate starts from a similar temperature;
3. measure: read every GPU's cumulative energy counter, run the repetitions, synchronise, read
   again. Time per run = window / repetitions (the window ends when the slowest GPU is done, so
   it is the max over ranks); energy = sum of the counter differences over GPUs / repetitions,
   stored per GPU (divided by the GPU count, as the profile document is per GPU).

Clocks are reset on every exit path (`try/finally` around each lock, and `close()`), including
when the workload raises or the process is interrupted — but only clocks this backend locked: a
backend that measures while the node daemon holds the clocks (`lock_clocks=False`) never resets
one (that would fail with NO_PERMISSION in an unprivileged pod, or undo the daemon's lock).

"The job's GPUs" are the first `num_gpus` CUDA devices this process sees (in a Kubernetes pod the
device plugin exposes exactly the allocated GPUs; outside one, choose with `CUDA_VISIBLE_DEVICES`),
each paired with its NVML device by UUID: NVML ignores `CUDA_VISIBLE_DEVICES` and numbers every GPU
of the machine, so NVML device i is not `cuda:i`. The work itself is the torch emulation in
`kernels.py`, one copy per GPU.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kareus.errors import KareusError
from kareus.gpu.device import GPUDevice
from kareus.profiler.backends import ProfilerBackend
from kareus.search.problem import Candidate
from kareus.workload.partitions import PartitionType, StageWorkload


class Runnable(Protocol):
    def run(self) -> None: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class WindowSettings:
    """The measurement protocol's knobs (tuned per machine; the paper uses 5 s and 5 s)."""

    measurement_s: float = 5.0
    cooldown_s: float = 5.0
    warmup_runs: int = 3
    settle_s: float = 0.0  # wait after locking clocks before the warm-up


def nvml_available(module: str = "pynvml") -> bool:
    """Whether NVML can be initialised and sees at least one GPU."""
    try:
        from kareus.gpu.nvml import discover_nvml

        return bool(discover_nvml(module))
    except KareusError:
        return False


@contextlib.contextmanager
def locked_clock(devices: Sequence[GPUDevice], clock_mhz: int, holding: set[str] | None = None) -> Iterator[None]:
    """Lock every device at `clock_mhz`; on the way out, whatever happens, reset every device whose
    lock was attempted (a failed call leaves its state unknown), never one after it. `holding`
    (UUIDs) gains each device as its lock is attempted and loses it once reset."""
    holding = set() if holding is None else holding
    attempted: list[GPUDevice] = []
    try:
        for device in devices:
            attempted.append(device)
            holding.add(device.uuid)
            device.lock_sm_clock(clock_mhz, clock_mhz)
        yield
    finally:
        reset_all(attempted)
        holding.difference_update(device.uuid for device in attempted)


def reset_all(devices: Sequence[GPUDevice]) -> None:
    """Reset every device's locked clocks; a failure on one does not stop the others."""
    failures = []
    for device in devices:
        try:
            device.reset_sm_clock()
        except KareusError as error:
            failures.append(str(error))
    if failures:
        raise KareusError("could not reset locked clocks: " + "; ".join(failures))


def measure_window(devices: Sequence[GPUDevice], workloads: Sequence[Runnable], settings: WindowSettings, *,
                   now: Callable[[], float] = time.perf_counter,
                   sleep: Callable[[float], None] = time.sleep) -> tuple[float, float]:
    """(time_s per run, energy_j per run per GPU) of `workloads` (one per device) run together."""

    def run_all(repetitions: int) -> float:
        start = now()
        for _ in range(repetitions):
            for workload in workloads:
                workload.run()
        for workload in workloads:
            workload.synchronize()
        return now() - start

    run_all(settings.warmup_runs)
    per_run_s = max(run_all(1), 1e-9)
    repetitions = max(1, math.ceil(settings.measurement_s / per_run_s))
    sleep(settings.cooldown_s)
    run_all(1)  # re-warm the caches after the cooldown
    before = [device.energy_j() for device in devices]
    window_s = run_all(repetitions)
    after = [device.energy_j() for device in devices]
    energy_j = sum(a - b for a, b in zip(after, before, strict=True))
    return window_s / repetitions, energy_j / repetitions / len(devices)


def cuda_uuids() -> list[str]:
    """UUIDs of the CUDA devices this process sees, in CUDA's order."""
    import torch

    return [str(torch.cuda.get_device_properties(index).uuid) for index in range(torch.cuda.device_count())]


def devices_of_cuda(devices: Sequence[GPUDevice], uuids: Sequence[str], num_gpus: int) -> list[GPUDevice]:
    """The NVML devices of the first `num_gpus` CUDA devices (`uuids` in CUDA order), by UUID."""
    from kareus.gpu.pairing import gpu_for_cuda_uuid

    if len(uuids) < num_gpus:
        raise KareusError(f"the job needs {num_gpus} GPUs per partition group; CUDA sees {len(uuids)}")
    return [gpu_for_cuda_uuid(uuid, devices) for uuid in uuids[:num_gpus]]


def _select_devices(devices: Sequence[GPUDevice], num_gpus: int) -> list[GPUDevice]:
    if len(devices) < num_gpus:
        raise KareusError(f"the job needs {num_gpus} GPUs per partition group; NVML sees {len(devices)}")
    chosen = list(devices[:num_gpus])
    for device in chosen:
        if device.is_mig_enabled():
            raise KareusError(f"GPU {device.uuid} is in MIG mode; clocks of a MIG GPU cannot be profiled")
    return chosen


class NvmlBackend(ProfilerBackend):
    """Measures on the job's GPUs, locking their clocks per candidate (see module docstring).

    Without `torch_devices` the work runs on `cuda:0…` and each is paired with its NVML device by
    UUID; with them (tests, CPU stand-ins) on those, with the first `num_gpus` NVML devices."""

    name = "nvml"

    def __init__(self, *, num_gpus: int = 1, devices: Sequence[GPUDevice] | None = None,
                 measurement_s: float = 5.0, cooldown_s: float = 5.0, warmup_runs: int = 3,
                 torch_devices: Sequence[Any] | None = None, scale: float = 1.0,
                 nvml_module: str = "pynvml", now: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep, lock_clocks: bool = True) -> None:
        if devices is None:
            from kareus.gpu import discover

            devices = discover("nvml", module=nvml_module)
        if torch_devices is None:
            devices = devices_of_cuda(devices, cuda_uuids(), num_gpus)
            torch_devices = [f"cuda:{index}" for index in range(num_gpus)]
        self.devices = _select_devices(devices, num_gpus)
        self.gpu_name = self.devices[0].name
        self.p_static_w = self._static_power_w()
        self.settings = WindowSettings(measurement_s, cooldown_s, warmup_runs)
        self.torch_devices = list(torch_devices)
        self.scale = scale
        self._now, self._sleep = now, sleep
        # False when the node daemon holds the clocks (`DaemonLocked`): reading energy needs no privilege.
        self.lock_clocks = lock_clocks
        self._holding: set[str] = set()  # UUIDs whose clock this backend locked and has not reset

    def _static_power_w(self) -> float:
        """P_static of this GPU model: the calibrated preset, else the idle power read now."""
        from kareus.sim import get_gpu

        try:
            return float(get_gpu(self.gpu_name).p_static_w)
        except KareusError:
            return float(sum(device.power_w() for device in self.devices) / len(self.devices))

    def supported_clocks_mhz(self) -> tuple[int, ...]:
        common = set(self.devices[0].supported_sm_clocks_mhz())
        for device in self.devices[1:]:
            common &= set(device.supported_sm_clocks_mhz())
        return tuple(sorted(common, reverse=True))

    def _measure(self, clock_mhz: int, make: Callable[[Any], Runnable]) -> tuple[float, float]:
        with locked_clock(self.devices if self.lock_clocks else [], clock_mhz, self._holding):
            self._sleep(self.settings.settle_s)
            workloads = [make(torch_device) for torch_device in self.torch_devices]
            return measure_window(self.devices, workloads, self.settings, now=self._now, sleep=self._sleep)

    def measure_partitions(self, ptype: PartitionType,
                           candidates: Sequence[Candidate]) -> list[tuple[float, float]]:
        from kareus.profiler.kernels import EmulatedPartition

        return [
            self._measure(c.clock_mhz, lambda device, c=c: EmulatedPartition(
                ptype, c.launch_slot, c.comm_sms, device, self.scale))
            for c in candidates
        ]

    def measure_work(self, what: str, stage: StageWorkload, direction: str,
                     clock_mhz: int) -> tuple[float, float]:
        from kareus.profiler.kernels import EmulatedWork

        if what == "sequential":
            ops = stage.sequential_forward_ops if direction == "forward" else stage.sequential_backward_ops
        else:
            ops = stage.nonpartition_forward_ops if direction == "forward" else stage.nonpartition_backward_ops
        if not ops:
            return (0.0, 0.0)
        return self._measure(clock_mhz, lambda device: EmulatedWork(ops, device, self.scale))

    def close(self) -> None:
        """Reset what this backend still holds locked (normally nothing: each lock is reset as its
        measurement ends); never a clock it did not lock."""
        holding = [device for device in self.devices if device.uuid in self._holding]
        self._holding.clear()
        reset_all(holding)
