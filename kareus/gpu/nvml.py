"""The NVML backend: real GPUs through `nvidia-ml-py` (the `pynvml` module).

`pynvml` is imported when `discover_nvml` runs, never at import time of `kareus`, so machines
without the NVIDIA driver import Kareus fine and learn from a `KareusError` that NVML is missing.
Every NVML failure surfaces as a `KareusError` naming the GPU and the call.

Readings: the cumulative energy counter (`nvmlDeviceGetTotalEnergyConsumption`, mJ; updates about
every 100 ms), power (`nvmlDeviceGetPowerUsage`, mW; a 1 s average on post-GA100 parts), the SM
clock. Control: `nvmlDeviceSetGpuLockedClocks` / `nvmlDeviceResetGpuLockedClocks` (need root or
CAP_SYS_ADMIN). NVML cannot report the lock range, so this backend remembers what it set.
Power limit: `nvmlDeviceSetPowerManagementLimit` (mW, root), within
`nvmlDeviceGetPowerManagementLimitConstraints`; NVML has no reset for it, so a reset sets
`nvmlDeviceGetPowerManagementDefaultLimit`. The limit in force is read back
(`nvmlDeviceGetPowerManagementLimit`). Written against nvidia-ml-py's API and tested with a fake
`pynvml` only: no GPU has run it yet.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from kareus.errors import KareusError
from kareus.gpu.device import GPUDevice


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NVMLGPU(GPUDevice):
    """One GPU seen through NVML."""

    def __init__(self, nvml: ModuleType, index: int) -> None:
        self._nvml = nvml
        self.index = index
        self._handle = self._call("nvmlDeviceGetHandleByIndex", index, handle=False)
        self.uuid = _text(self._call("nvmlDeviceGetUUID"))
        self.pci_bus_id = _text(self._call("nvmlDeviceGetPciInfo").busId)
        self.name = _text(self._call("nvmlDeviceGetName"))
        self.sm_count = self._read_sm_count()
        self._locked: tuple[int, int] | None = None
        self._clocks: tuple[int, ...] | None = None
        self._power_range_w: tuple[float, float] | None = None

    def _call(self, function: str, *args: Any, handle: bool = True) -> Any:
        target = getattr(self._nvml, function)
        try:
            return target(self._handle, *args) if handle else target(*args)
        except self._nvml.NVMLError as error:
            who = getattr(self, "uuid", f"GPU index {self.index}")
            raise KareusError(f"NVML {function} failed on {who}: {error}") from error

    def _read_sm_count(self) -> int:
        try:
            return int(self._nvml.nvmlDeviceGetAttributes(self._handle).multiprocessorCount)
        except self._nvml.NVMLError:
            # Older drivers: fall back to the preset of this product, when known.
            from kareus.sim.gpus import get_gpu

            try:
                return get_gpu(self.name).sms
            except KareusError:
                return 0

    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        if self._clocks is None:
            memory = max(self._call("nvmlDeviceGetSupportedMemoryClocks"))
            clocks = self._call("nvmlDeviceGetSupportedGraphicsClocks", memory)
            self._clocks = tuple(sorted((int(c) for c in clocks), reverse=True))
        return self._clocks

    def lock_sm_clock(self, min_mhz: int, max_mhz: int) -> None:
        self.check_lock_range(min_mhz, max_mhz)
        self._call("nvmlDeviceSetGpuLockedClocks", int(min_mhz), int(max_mhz))
        self._locked = (int(min_mhz), int(max_mhz))

    def reset_sm_clock(self) -> None:
        self._call("nvmlDeviceResetGpuLockedClocks")
        self._locked = None

    def locked_clock_mhz(self) -> int | None:
        return None if self._locked is None else self._locked[1]

    def power_limit_range_w(self) -> tuple[float, float]:
        if self._power_range_w is None:  # a board property: read once
            low_mw, high_mw = self._call("nvmlDeviceGetPowerManagementLimitConstraints")
            self._power_range_w = (low_mw / 1000.0, high_mw / 1000.0)
        return self._power_range_w

    def default_power_limit_w(self) -> float:
        return self._call("nvmlDeviceGetPowerManagementDefaultLimit") / 1000.0

    def power_limit_w(self) -> float:
        return self._call("nvmlDeviceGetPowerManagementLimit") / 1000.0

    def set_power_limit_w(self, watts: float) -> None:
        self.check_power_limit(watts)
        self._call("nvmlDeviceSetPowerManagementLimit", round(watts * 1000))

    def reset_power_limit(self) -> None:
        self._call("nvmlDeviceSetPowerManagementLimit", self._call("nvmlDeviceGetPowerManagementDefaultLimit"))

    def energy_j(self) -> float:
        return self._call("nvmlDeviceGetTotalEnergyConsumption") / 1000.0

    def power_w(self) -> float:
        return self._call("nvmlDeviceGetPowerUsage") / 1000.0

    def sm_clock_mhz(self) -> int:
        return int(self._call("nvmlDeviceGetClockInfo", self._nvml.NVML_CLOCK_SM))

    def is_mig_enabled(self) -> bool:
        try:
            current, _pending = self._nvml.nvmlDeviceGetMigMode(self._handle)
        except self._nvml.NVMLError:
            return False  # GPUs without MIG support report NotSupported
        return current == self._nvml.NVML_DEVICE_MIG_ENABLE


def load_pynvml(module: str | ModuleType = "pynvml") -> ModuleType:
    """Import (by name, or take the given module: tests pass a fake) and initialise NVML; a
    `KareusError` when the library or the driver is missing."""
    try:
        nvml = importlib.import_module(module) if isinstance(module, str) else module
    except ImportError as error:
        raise KareusError("NVML backend needs nvidia-ml-py (pip install 'kareus[node]')") from error
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        raise KareusError(f"NVML is not available (no NVIDIA driver or GPU?): {error}") from error
    return nvml


def discover_nvml(module: str | ModuleType = "pynvml") -> list[NVMLGPU]:
    """Every GPU NVML sees, by index."""
    nvml = load_pynvml(module)
    try:
        count = nvml.nvmlDeviceGetCount()
    except nvml.NVMLError as error:
        raise KareusError(f"NVML nvmlDeviceGetCount failed: {error}") from error
    return [NVMLGPU(nvml, index) for index in range(count)]
