"""One GPU interface, two backends: NVML (real GPUs) and simulated (the digital twin).

`discover(backend, ...)` returns the node's GPUs as `GPUDevice`s:

- `discover("sim", count=2, product="A100-SXM4-40GB")` — simulated GPUs (`SimulatedGPU`) with
  deterministic UUIDs `GPU-sim-<n>-…`, PCI bus ids, lock validation and an energy counter; with
  `device_dir=DIR` the node's shared simulated GPUs (`kareus.gpu.simdevice.SharedSimulatedGPU`);
- `discover("nvml")` — every GPU NVML sees (`NVMLGPU`); raises `KareusError` when NVML is missing.

Nothing above this package imports `pynvml`.
"""

from __future__ import annotations

from typing import Any

from kareus.errors import KareusError
from kareus.gpu.device import GPUDevice, GPUInfo
from kareus.gpu.sim import SimulatedGPU, discover_sim, sim_uuid

BACKENDS = ("nvml", "sim")


def discover(backend: str = "nvml", **options: Any) -> list[GPUDevice]:
    """The GPUs of this node through `backend` ("nvml" or "sim"); `options` go to the backend."""
    if backend == "sim":
        device_dir = options.pop("device_dir", None)
        if device_dir is not None:
            from kareus.gpu.simdevice import discover_shared

            options.pop("state_dir", None)  # a shared GPU's lock lives in the device
            return list(discover_shared(device_dir=device_dir, **options))
        return list(discover_sim(**options))
    if backend == "nvml":
        from kareus.gpu.nvml import discover_nvml  # imports pynvml lazily

        return list(discover_nvml(**options))
    raise KareusError(f"unknown GPU backend {backend!r}; allowed: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "GPUDevice", "GPUInfo", "SimulatedGPU", "discover", "sim_uuid"]
