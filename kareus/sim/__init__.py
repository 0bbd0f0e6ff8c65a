"""The simulated GPU (digital twin): GPU presets, the physical model and the `Simulator`.

`Simulator(get_gpu("A100-SXM4-40GB")).partition(ptype, clock_mhz, comm_sms, launch_slot)` measures
one partition; `sequential_partition`, `sequential` and `instruction` measure Megatron-style work
and whole pipeline instructions. See `docs/simulator.md` for the model and its parameters.
"""

from kareus.sim.gpus import GPUS, GPUSpec, get_gpu
from kareus.sim.measurement import Measurement, combine
from kareus.sim.physics import SimParams
from kareus.sim.simulator import Simulator, as_config

__all__ = ["GPUS", "GPUSpec", "Measurement", "SimParams", "Simulator", "as_config", "combine", "get_gpu"]
