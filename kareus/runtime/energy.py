"""Iteration energy: measured on a real GPU, modelled on the simulated GPU otherwise.

DESIGN.md §2.1: every GPU pays static power for the whole iteration, bubbles included, so
`E_iter = Σ_instructions of all GPUs E_eff + N_gpus · P_static · T_iter`.

- `SimulatedEnergy` (CPU runs): each instruction of the schedule is executed by the simulator
  (`Simulator.instruction(stage_workload, direction, clock, configs or None)`) on the job's GPU
  model; the iteration time is the finish time of the 1F1B pipeline DAG over those instruction
  times (F(s,m) after F(s−1,m), B(s,m) after B(s+1,m), each stage in its own order). Deterministic,
  so computed once per schedule.
- `MeasuredEnergy` (CUDA): the NVML energy counter of this rank's GPU (through `kareus.gpu`),
  read at step boundaries; the trainer sums the ranks. The GPU is found by UUID only — CUDA and
  NVML number devices differently under `CUDA_VISIBLE_DEVICES`, so an index would read another
  GPU — and a UUID NVML does not know is an error (`EnergyAttributionError`), never a guess. Under
  MIG NVML's counter covers the whole card (every instance's work, not this one's), so MIG is
  refused with that reason rather than measured wrongly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kareus.errors import KareusError
from kareus.runtime.schedule import RunInstruction, Schedule
from kareus.workload.partitions import PartitionConfig, Workload

if TYPE_CHECKING:
    from kareus.gpu import GPUDevice


@dataclass(frozen=True)
class IterationEnergy:
    """One iteration: time, energy of all GPUs, and each stage's per-GPU energy."""

    time_s: float
    energy_j: float
    stage_gpu_energy_j: tuple[float, ...]


class SimulatedEnergy:
    """Modelled time and energy of one iteration of `schedule` on `gpu_product` GPUs."""

    def __init__(self, workload: Workload, gpu_product: str, schedule: Schedule, gpus_per_stage: int) -> None:
        from kareus.sim import Simulator, get_gpu  # the simulator is only needed for CPU accounting

        self.gpu = get_gpu(gpu_product)
        self.simulator = Simulator(self.gpu)
        self.workload = workload
        self.gpus_per_stage = gpus_per_stage
        if len(workload.stages) != schedule.num_stages:
            raise KareusError(f"schedule has {schedule.num_stages} stages, the job {len(workload.stages)}")
        self.result = self._iteration(schedule)

    def _instruction(self, stage: int, ins: RunInstruction) -> tuple[float, float]:
        clock = ins.clock_mhz or self.gpu.clock_max_mhz
        configs = self._configs(ins)
        m = self.simulator.instruction(self.workload.stages[stage], ins.kind, clock, configs)
        return m.time_s, m.effective_energy_j

    def _configs(self, ins: RunInstruction) -> dict[str, PartitionConfig] | None:
        types = self.workload.partition_types
        if ins.mode == "sequential" or not types:
            return None
        given = {**ins.recompute_configs, **ins.configs}
        needed = self.workload.stages[0].instances(ins.kind)
        return {name: given.get(name) or types[name].default_config() for name in needed}

    def _iteration(self, schedule: Schedule) -> IterationEnergy:
        costs = [[self._instruction(s, ins) for ins in stage] for s, stage in enumerate(schedule.stages)]
        time_s = pipeline_time_s(schedule, [[t for t, _ in stage] for stage in costs])
        p_static = self.gpu.p_static_w
        per_gpu = tuple(sum(e for _, e in stage) + p_static * time_s for stage in costs)
        return IterationEnergy(time_s, self.gpus_per_stage * sum(per_gpu), per_gpu)


def pipeline_time_s(schedule: Schedule, times_s: list[list[float]]) -> float:
    """Finish time of the pipeline DAG given each instruction's duration."""
    num_stages = schedule.num_stages
    done: dict[tuple[int, str, int], float] = {}
    cursor = [0] * num_stages
    clock = [0.0] * num_stages
    remaining = sum(len(stage) for stage in schedule.stages)
    while remaining:
        progressed = False
        for s in range(num_stages):
            while cursor[s] < len(schedule.stages[s]):
                ins = schedule.stages[s][cursor[s]]
                dep = (s - 1, "forward", ins.microbatch) if ins.kind == "forward" else (s + 1, "backward",
                                                                                      ins.microbatch)
                if 0 <= dep[0] < num_stages and dep not in done:
                    break
                start = max(clock[s], done.get(dep, 0.0))
                clock[s] = start + times_s[s][cursor[s]]
                done[(s, ins.kind, ins.microbatch)] = clock[s]
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise KareusError("schedule deadlocks: a stage waits for an instruction that never runs")
    return max(clock)


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
