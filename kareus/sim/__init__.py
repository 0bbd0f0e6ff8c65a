"""The simulated GPU (digital twin): GPU presets, the physical model and the `Simulator`."""

from kareus.sim.gpus import GPUS, GPUSpec, get_gpu
from kareus.sim.measurement import Measurement

__all__ = ["GPUS", "GPUSpec", "Measurement", "get_gpu"]
