"""Iteration energy: measured on a real GPU, modelled on the simulated GPU otherwise.

DESIGN.md §2.1: every GPU pays static power for the whole iteration, bubbles included, so
`E_iter = Σ_instructions of all GPUs E_eff + N_gpus · P_static · T_iter`.

- `SimulatedEnergy` (CPU runs): each instruction of the schedule is executed by the simulator
  (`Simulator.instruction(stage_workload, direction, clock, configs or None)`) on the job's GPU
  model; the iteration time is the finish time of the 1F1B pipeline DAG over those instruction
  times (F(s,m) after F(s−1,m), B(s,m) after B(s+1,m), each stage in its own order) —
  `kareus.sim.replica`, which the twin's what-ifs use too. Deterministic, so computed once per
  schedule (and per clock ceiling of a simulated straggler, and per board power limit: under one
  the simulator's power controller throttles each phase to it, so the GPU draws less).
- `MeasuredEnergy` (CUDA): the NVML energy counter of this rank's GPU (through `kareus.gpu`),
  read at step boundaries; the trainer sums the ranks. The GPU is found by UUID only — CUDA and
  NVML number devices differently under `CUDA_VISIBLE_DEVICES`, so an index would read another
  GPU — and a UUID NVML does not know is an error (`EnergyAttributionError`), never a guess. Under
  MIG NVML's counter covers the whole card (every instance's work, not this one's), so MIG is
  refused with that reason rather than measured wrongly.
- `TwinEnergy` (CPU runs on a node whose simulated GPUs are shared devices, the dev cluster's
  emulated nodes: `KAREUS_SIM_GPU_DIR` and the pod's GPU UUIDs in `NVIDIA_VISIBLE_DEVICES`): this
  local rank's GPU is `NVIDIA_VISIBLE_DEVICES[LOCAL_RANK]`; every step the rank adds its modelled
  per-GPU energy (and modelled GPU time) to that GPU's counter and reads its step energy back as
  the counter's rise since the previous step — the way `MeasuredEnergy` laps NVML's counter —
  and the node agent exports the same counter (`kareus.gpu.simdevice`). A step the CPU finishes
  sooner than its modelled GPU time waits out the rest (`run_step`), and its energy goes onto the
  counter as that time passes, in slices of at most `ACCOUNT_SLICE_S`: NVML's counter rises while
  the GPU works, so a power read from the counter over any window (the agent's, Prometheus' 60 s
  rates) is the modelled GPU's, not a step's lump landing in one window and none in the next.
  Without such a device the modelled energy is used as it is.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kareus.errors import KareusError
from kareus.gpu.pairing import gpu_for_cuda_uuid
from kareus.runtime.schedule import RunInstruction, Schedule
from kareus.workload.partitions import Workload

if TYPE_CHECKING:
    from kareus.gpu.simdevice import SharedSimulatedGPU
    from kareus.sim.paramsfile import SimCalibration

log = logging.getLogger("kareus.runtime")
ACCOUNT_SLICE_S = 0.5  # how finely a held step's energy is put onto the shared counter


@dataclass(frozen=True)
class IterationEnergy:
    """One iteration: time, energy of all GPUs, and each stage's per-GPU energy."""

    time_s: float
    energy_j: float
    stage_gpu_energy_j: tuple[float, ...]


class SimulatedEnergy:
    """Modelled time and energy of one iteration of `schedule` on `gpu_product` GPUs.

    `clock_ceiling_mhz` caps every clock (a slower simulated GPU: the `KAREUS_SIM_STRAGGLER` knob);
    `replica` keeps the per-replica numbers (`kareus.sim.replica.ReplicaIteration`), so a replica
    that waits for a slower one can be charged static power for the wait. `calibration` is a
    `kareus sim calibrate` file's parameters (the shipped presets without one), as profiling used.
    `power_limit_w` is the board power limit the GPUs run under (None: the preset's)."""

    def __init__(self, workload: Workload, gpu_product: str, schedule: Schedule, gpus_per_stage: int, *,
                 clock_ceiling_mhz: float | None = None, calibration: SimCalibration | None = None,
                 power_limit_w: float | None = None) -> None:
        from kareus.sim.paramsfile import shipped  # the simulator is only needed for CPU accounting
        from kareus.sim.replica import power_limited, replica_iteration
        from kareus.sim.simulator import Simulator

        calibration = calibration or shipped()
        self.gpu = calibration.gpu(gpu_product)
        if power_limit_w is not None:  # as `kareus sim power-budget` runs a limited board (power_budget.twin)
            self.gpu = power_limited(self.gpu, power_limit_w)
        self.power_limit_w = power_limit_w
        self.simulator = Simulator(self.gpu, params=calibration.params)
        self.workload = workload
        self.gpus_per_stage = gpus_per_stage
        if len(workload.stages) != schedule.num_stages:
            raise KareusError(f"schedule has {schedule.num_stages} stages, the job {len(workload.stages)}")
        self.clock_ceiling_mhz = clock_ceiling_mhz
        self.replica = replica_iteration(self.simulator, workload, schedule.stages, clock_ceiling_mhz=clock_ceiling_mhz)
        per_gpu = self.replica.stage_gpu_energy_j()
        self.result = IterationEnergy(self.replica.time_s, self.gpus_per_stage * sum(per_gpu), per_gpu)

    def _instruction(self, stage: int, ins: RunInstruction) -> tuple[float, float]:
        """(time_s, effective energy per GPU) of one instruction."""
        from kareus.sim.replica import instruction_cost

        return instruction_cost(self.simulator, self.workload, stage, ins, clock_ceiling_mhz=self.clock_ceiling_mhz)


def pipeline_time_s(schedule: Schedule, times_s: list[list[float]]) -> float:
    """Finish time of the pipeline DAG given each instruction's duration."""
    from kareus.sim.replica import pipeline_time_s as dag_time_s

    return dag_time_s(schedule.stages, times_s)


class MeasuredEnergy:
    """This rank's GPU energy counter (NVML), matched to the CUDA device by UUID."""

    def __init__(self, device_index: int) -> None:
        import torch

        from kareus.gpu import discover

        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        self.device = gpu_for_cuda_uuid(uuid, discover("nvml"))
        self._start_j = self.device.energy_j()

    @property
    def uuid(self) -> str:
        return self.device.uuid

    def lap_j(self) -> float:
        """Energy since the previous lap (or construction)."""
        now = self.device.energy_j()
        spent, self._start_j = now - self._start_j, now
        return spent


class TwinEnergy:
    """This rank's simulated GPU as a shared device: modelled work goes onto its counter, and the
    step's energy is read back from the counter, as from NVML's on a real GPU."""

    def __init__(self, device: SharedSimulatedGPU) -> None:
        self.device = device
        self._start_j = device.energy_j()

    @classmethod
    def from_env(cls, gpu_product: str, environ: Mapping[str, str] = os.environ) -> TwinEnergy | None:
        """The GPU `NVIDIA_VISIBLE_DEVICES[LOCAL_RANK]` in `KAREUS_SIM_GPU_DIR`; None without both."""
        from kareus.gpu.simdevice import (
            SIM_GPU_DIR_ENV,
            VISIBLE_DEVICES_ENV,
            SharedSimulatedGPU,
            sim_index,
            visible_uuids,
        )

        directory, visible = environ.get(SIM_GPU_DIR_ENV), visible_uuids(environ.get(VISIBLE_DEVICES_ENV))
        if not directory or not visible:
            return None
        local_rank = int(environ.get("LOCAL_RANK", "0"))
        if local_rank >= len(visible):
            # Two ranks on one GPU would each read the other's work in the counter's rise (as on
            # NVML): count the modelled energy rather than double-count.
            log.warning("local rank %d has no simulated GPU of its own (%s names %d); using modelled energy",
                        local_rank, VISIBLE_DEVICES_ENV, len(visible))
            return None
        uuid = visible[local_rank]
        return cls(SharedSimulatedGPU(gpu_product, sim_index(uuid), device_dir=directory, uuid=uuid))

    @property
    def uuid(self) -> str:
        return self.device.uuid

    def run_step(self, started_s: float, energy_j: float, time_s: float, *, slice_s: float = ACCOUNT_SLICE_S,
                 now: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> tuple[float, float]:
        """The step begun at `started_s` (`time.perf_counter()`) that the modelled GPU takes
        `time_s` and `energy_j` for: its energy goes onto the counter in proportion to the modelled
        time passed, and the rest of that time is waited out. Returns (the step's wall time, its
        energy as the counter says). A GPU is busy for as long as its work takes: a step the CPU
        finished sooner (a narrow CPU proxy of a large model) would otherwise put the modelled
        energy into less wall time, and the power the node agent reads would exceed what the
        modelled GPU draws."""
        accounted = 0.0  # share of the step's energy and time already on the counter
        while True:
            elapsed = now() - started_s
            share = 1.0 if time_s <= 0 else min(1.0, elapsed / time_s)
            if share > accounted:
                self.device.account_work(energy_j * (share - accounted), time_s * (share - accounted))
                accounted = share
            if accounted >= 1.0:
                return elapsed, self.lap_j()
            sleep(min(slice_s, time_s - elapsed))

    def step_j(self, energy_j: float, time_s: float) -> float:
        """Account one step's modelled work (this GPU's energy, the modelled iteration time) and
        return the step's energy as the counter says: its rise since the previous step."""
        self.device.account_work(energy_j, time_s)
        return self.lap_j()

    def lap_j(self) -> float:
        """Energy on the counter since the previous lap (or construction)."""
        now = self.device.energy_j()
        spent, self._start_j = now - self._start_j, now
        return spent
