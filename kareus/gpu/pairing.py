"""A CUDA device's GPU among those a backend sees, found by UUID.

CUDA and NVML number devices differently (NVML ignores `CUDA_VISIBLE_DEVICES`), so pairing by index
would measure or clock another GPU; a UUID the backend does not know is an error, never a guess.
Both the profiler and the runtime's energy counter pair this way.
"""

from __future__ import annotations

from collections.abc import Sequence

from kareus.errors import KareusError
from kareus.gpu.device import GPUDevice


class EnergyAttributionError(KareusError):
    """This rank's energy cannot be attributed to its own GPU (unknown UUID, MIG)."""


def _bare_uuid(uuid: str) -> str:
    """NVML says `GPU-<uuid>` / `MIG-<uuid>`, torch the bare `<uuid>`."""
    uuid = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if uuid.startswith(prefix):
            return uuid[len(prefix):]
    return uuid


def gpu_for_cuda_uuid(cuda_uuid: str, devices: Sequence[GPUDevice]) -> GPUDevice:
    """The NVML device whose UUID is the CUDA device's; `EnergyAttributionError` otherwise."""
    matches = [d for d in devices if _bare_uuid(d.uuid) == _bare_uuid(cuda_uuid)]
    mig = [d for d in devices if d.is_mig_enabled()]
    if matches and matches[0].is_mig_enabled():
        raise EnergyAttributionError(
            f"GPU {matches[0].uuid} runs in MIG mode: NVML's energy counter covers the whole card, not this "
            f"instance, so its energy cannot be measured; disable MIG or train on a full GPU")
    if not matches:
        if mig:
            raise EnergyAttributionError(
                f"CUDA device {cuda_uuid} is not a full GPU NVML sees; MIG is enabled on "
                f"{', '.join(d.uuid for d in mig)} and NVML cannot measure one MIG instance's energy")
        known = ", ".join(d.uuid for d in devices) or "none"
        raise EnergyAttributionError(
            f"CUDA device {cuda_uuid} is not among the GPUs NVML sees ({known}); refusing to read another GPU's "
            f"energy counter (do CUDA_VISIBLE_DEVICES and the container's NVML view disagree?)")
    return matches[0]
