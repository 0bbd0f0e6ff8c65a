"""Profiler backends: who actually runs a candidate and reports its time and energy.

A backend measures three kinds of work, always per GPU:
- a batch of candidates of one partition type (clock, comm SMs, launch slot);
- the non-partition work of a pipeline stage (embedding, output layer, loss) at one clock;
- the whole Megatron-style sequential instruction (one microbatch, no nanobatching) at one clock.

`SimBackend` asks the simulated GPU (`kareus.sim`), instantly, with optional seeded noise.
`kareus.profiler.nvml.NvmlBackend` runs the work on real GPUs through NVML.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kareus.search.problem import Candidate
from kareus.workload.partitions import PartitionType, StageWorkload

WORK_KINDS = ("nonpartition", "sequential")


class ProfilerBackend(ABC):
    """Measures partitions and whole-stage work on one GPU model."""

    name: str = "backend"
    gpu_name: str
    p_static_w: float

    @abstractmethod
    def supported_clocks_mhz(self) -> tuple[int, ...]:
        """The SM clocks the GPU can be locked to."""

    @abstractmethod
    def measure_partitions(self, ptype: PartitionType,
                           candidates: Sequence[Candidate]) -> list[tuple[float, float]]:
        """(time_s, energy_j per GPU) of every candidate, in order."""

    @abstractmethod
    def measure_work(self, what: str, stage: StageWorkload, direction: str,
                     clock_mhz: int) -> tuple[float, float]:
        """(time_s, energy_j per GPU) of a stage's non-partition or sequential work."""

    def close(self) -> None:
        """Release the hardware (reset clocks); the default has nothing to release."""
        return None

    def __enter__(self) -> ProfilerBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SimBackend(ProfilerBackend):
    """The simulated GPU: instant measurements, optionally with relative Gaussian noise."""

    name = "sim"

    def __init__(self, gpu: str, *, noise_std: float = 0.0, seed: int | None = 0, calibration=None) -> None:
        from kareus.sim.paramsfile import shipped

        # `calibration`: a `kareus.sim.paramsfile.SimCalibration` (`--sim-params`); the shipped presets otherwise.
        calibration = calibration or shipped()
        self.spec = calibration.gpu(gpu)
        self.gpu_name = self.spec.name
        self.p_static_w = float(self.spec.p_static_w)
        self.noise_std = noise_std
        self.simulator = calibration.simulator(self.spec, noise_std=noise_std, seed=seed)

    def supported_clocks_mhz(self) -> tuple[int, ...]:
        return tuple(int(clock) for clock in self.spec.supported_clocks_mhz)

    def measure_partitions(self, ptype: PartitionType,
                           candidates: Sequence[Candidate]) -> list[tuple[float, float]]:
        results = []
        for c in candidates:
            m = self.simulator.partition(ptype, c.clock_mhz, c.comm_sms, c.launch_slot)
            results.append((float(m.time_s), float(m.energy_j)))
        return results

    def measure_work(self, what: str, stage: StageWorkload, direction: str,
                     clock_mhz: int) -> tuple[float, float]:
        if what == "sequential":
            m = self.simulator.instruction(stage, direction, clock_mhz, None)
        else:
            ops = stage.nonpartition_forward_ops if direction == "forward" else stage.nonpartition_backward_ops
            if not ops:
                return (0.0, 0.0)
            m = self.simulator.sequential(ops, clock_mhz)
        return (float(m.time_s), float(m.energy_j))
