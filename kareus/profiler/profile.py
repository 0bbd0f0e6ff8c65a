"""Profiling a job: search every partition type, sweep the rest per clock, write one document.

`profile_job` builds the job's workload, picks the clock grid from the GPU's supported clocks,
runs the chosen search (`paper` or `default` MBO preset, or `exhaustive`) on every partition type,
then measures every stage's non-partition work and whole sequential instructions at every clock of
the grid. Every measurement goes through the profile store first, so a killed run resumes without
measuring anything twice and a later job with the same key reuses what was measured.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kareus import __version__
from kareus.errors import EXIT_CONFIG, KareusError
from kareus.job import describe_job
from kareus.policy import default_floor_mhz
from kareus.profiler.backends import WORK_KINDS, ProfilerBackend, SimBackend
from kareus.profiler.document import (
    DIRECTIONS,
    ClockCost,
    PartitionPoint,
    PartitionProfile,
    ProfileDocument,
    Provenance,
)
from kareus.profiler.key import profile_key
from kareus.profiler.store import ProfileStore
from kareus.search.algorithms import Algorithm, get_algorithm, minimize
from kareus.search.problem import Candidate, Problem, SearchSpace
from kareus.workload.partitions import PartitionType, Workload, build_workload

CLOCK_STEP_MHZ = 30  # neighbours 15 MHz apart differ only marginally (paper, Appendix C)
CLOCK_FLOOR_RATIO = 900 / 1410  # the paper's A100 floor: below it energy no longer drops
BACKENDS = ("sim", "nvml", "auto")


@dataclass(frozen=True)
class ProfileProgress:
    """Where a profiling run stands, for progress bars."""

    partition: str
    evaluations: int  # candidates measured (or replayed from the store) so far, all types
    planned: int  # upper bound on candidates for the whole run
    hypervolume: float  # progress indicator of the current type's measured front
    types_done: int
    types_total: int


def clock_grid(supported_mhz: tuple[int, ...], *, step_mhz: int = CLOCK_STEP_MHZ,
               floor_ratio: float = CLOCK_FLOOR_RATIO, floor_mhz: int | None = None) -> tuple[int, ...]:
    """Clocks to profile, fastest first: from the maximum down to `floor_ratio` × maximum,
    `step_mhz` apart, each the supported clock nearest to its target; never below `floor_mhz`
    (None: the policy's default floor, `kareus.policy.default_floor_mhz`, which the node agent
    enforces where the policy sets no floor — so a plan never asks for a clock it would refuse)."""
    if not supported_mhz:
        raise KareusError("the GPU reports no supported SM clocks")
    top = max(supported_mhz)
    floor = floor_ratio * top
    hard_floor = default_floor_mhz(top) if floor_mhz is None else floor_mhz
    grid: list[int] = []
    target = float(top)
    while target >= floor - step_mhz / 2:
        nearest = min(supported_mhz, key=lambda clock: abs(clock - target))
        if nearest >= max(floor - step_mhz / 2, hard_floor) and nearest not in grid:
            grid.append(int(nearest))
        target -= step_mhz
    if not grid:
        raise KareusError(f"no supported SM clock from {top} MHz down to the {hard_floor} MHz floor to profile")
    return tuple(grid)


def resolve_backend(backend: str | ProfilerBackend, gpu_product: str, *, noise_std: float = 0.0,
                    seed: int = 0, num_gpus: int = 1, measurement_s: float = 5.0,
                    cooldown_s: float = 5.0, require_gpu: bool = False,
                    daemon_endpoint: str | None = None) -> ProfilerBackend:
    """A backend object for a backend name (`auto` = NVML when a GPU is visible, else simulated,
    unless `require_gpu`: then no visible GPU is an error, exit code 78). With `daemon_endpoint`
    the node daemon locks the clocks (`DaemonLocked`), as a profiling pod on a cluster does."""
    if isinstance(backend, ProfilerBackend):
        return _locked_by(backend, daemon_endpoint)
    if backend not in BACKENDS:
        raise KareusError(f"--backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend in ("nvml", "auto"):
        from kareus.profiler.nvml import NvmlBackend, nvml_available

        if backend == "nvml" or nvml_available():
            return _locked_by(NvmlBackend(num_gpus=num_gpus, measurement_s=measurement_s, cooldown_s=cooldown_s,
                                          lock_clocks=daemon_endpoint is None), daemon_endpoint)
        if require_gpu:
            raise KareusError(f"no GPU is visible to this process (profiling.backend auto for {gpu_product}): "
                              "NVML found no device, so the profile would be the simulator's; give the pod its "
                              "GPUs, or set spec.profiling.backend: sim to plan on the simulated GPU",
                              exit_code=EXIT_CONFIG)
    return _locked_by(SimBackend(gpu_product, noise_std=noise_std, seed=seed), daemon_endpoint)


def _locked_by(backend: ProfilerBackend, daemon_endpoint: str | None) -> ProfilerBackend:
    if daemon_endpoint is None:
        return backend
    from kareus.profiler.daemonlock import DaemonLocked

    return DaemonLocked(backend, daemon_endpoint)


def partition_problem(ptype: PartitionType, clocks_mhz: tuple[int, ...], backend: ProfilerBackend,
                      store: ProfileStore) -> Problem:
    """The search problem of one partition type, measuring through the store."""
    space = SearchSpace(clocks_mhz, tuple(ptype.comm_sms_grid), tuple(ptype.launch_slots))

    def measure(candidates: list[Candidate]) -> list[tuple[float, float]]:
        keys = [(ptype.name, c.clock_mhz, c.comm_sms, c.launch_slot) for c in candidates]
        missing = [c for c, key in zip(candidates, keys, strict=True) if key not in store.partitions]
        if missing:  # the whole missing batch at once, so the backend can run it in parallel
            for c, (time_s, energy_j) in zip(missing, backend.measure_partitions(ptype, missing), strict=True):
                store.add_partition((ptype.name, c.clock_mhz, c.comm_sms, c.launch_slot), time_s, energy_j)
            store.sync()
        return [store.partitions[key] for key in keys]

    return Problem(ptype.name, space, measure, backend.p_static_w, ptype.size_class)


def _type_seed(seed: int, name: str) -> int:
    """A per-type seed that does not depend on which other types the job has."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**31


def profile_job(job_spec: Any, *, backend: str | ProfilerBackend = "sim", preset: str = "default",
                seed: int = 0, store_path: str | Path | None = None,
                progress: Callable[[ProfileProgress], None] | None = None,
                noise_std: float = 0.0, require_gpu: bool = False,
                daemon_endpoint: str | None = None) -> ProfileDocument:
    """Profile every partition type of `job_spec` (a `KareusJob` or `JobSpec`) and its per-clock work."""
    spec = getattr(job_spec, "spec", job_spec)
    descriptor = describe_job(spec)
    workload = build_workload(
        spec.model_shape(), tp=descriptor.tp, cp=descriptor.cp, pp=descriptor.pp, seq_len=descriptor.seq_len,
        micro_batch_size=descriptor.micro_batch_size, activation_checkpointing=descriptor.activation_checkpointing)
    profiling = getattr(spec, "profiling", None)
    device = resolve_backend(
        backend, spec.gpu_product, noise_std=noise_std, seed=seed, num_gpus=descriptor.tp * descriptor.cp,
        measurement_s=getattr(profiling, "measurement_seconds", 5.0),
        cooldown_s=getattr(profiling, "cooldown_seconds", 5.0), require_gpu=require_gpu,
        daemon_endpoint=daemon_endpoint)
    # A job that pins no product is keyed by the GPU measured; a simulated one says so in its key.
    simulated = isinstance(getattr(device, "backend", device), SimBackend)
    measured_gpu = None if simulated or getattr(spec, "gpu_pinned", True) else device.gpu_name
    key = profile_key(spec, simulated=simulated, gpu_product=measured_gpu)
    algorithm = get_algorithm(preset)
    with device:
        clocks = clock_grid(device.supported_clocks_mhz())
        store = ProfileStore(store_path, key, {"gpu": device.gpu_name, "version": __version__})
        with store:
            partitions = _search_partitions(workload, clocks, device, store, algorithm, seed, progress)
            tables = {what: _sweep_work(what, workload, clocks, device, store) for what in WORK_KINDS}
    return ProfileDocument(
        key=key,
        gpu=device.gpu_name,
        p_static_w=device.p_static_w,
        clocks_mhz=clocks,
        job=descriptor,
        partitions=partitions,
        nonpartition=tables["nonpartition"],
        sequential=tables["sequential"],
        provenance=Provenance(
            software_version=__version__, preset=preset, seed=seed, backend=device.name,
            created=datetime.now(UTC).isoformat(timespec="seconds"), noise_std=noise_std),
    )


def _search_partitions(workload: Workload, clocks: tuple[int, ...], device: ProfilerBackend,
                       store: ProfileStore, algorithm: Algorithm, seed: int,
                       progress: Callable[[ProfileProgress], None] | None) -> dict[str, PartitionProfile]:
    problems = [partition_problem(ptype, clocks, device, store) for ptype in workload.partition_types.values()]
    planned = sum(algorithm.max_evaluations(problem) for problem in problems)
    done = 0
    partitions: dict[str, PartitionProfile] = {}
    for finished, problem in enumerate(problems):
        def report(step, problem=problem, finished=finished, base=done, planned=planned):
            if progress is not None:
                progress(ProfileProgress(problem.name, base + step.evaluations, planned, step.hypervolume,
                                         finished, len(problems)))

        result = minimize(problem, algorithm, seed=_type_seed(seed, problem.name), on_step=report)
        # The planned total shrinks when a search stops early.
        planned -= algorithm.max_evaluations(problem) - result.evaluations
        done += result.evaluations
        partitions[problem.name] = PartitionProfile(
            measured=tuple(PartitionPoint(e.candidate.clock_mhz, e.candidate.comm_sms, e.candidate.launch_slot,
                                          e.time_s, e.energy_j) for e in result.measured),
            evaluations=result.evaluations,
            grid_size=result.grid_size,
        )
    return partitions


def _sweep_work(what: str, workload: Workload, clocks: tuple[int, ...], device: ProfilerBackend,
                store: ProfileStore) -> dict[int, dict[str, dict[int, ClockCost]]]:
    table: dict[int, dict[str, dict[int, ClockCost]]] = {}
    for stage in workload.stages:
        for direction in DIRECTIONS:
            row = table.setdefault(stage.index, {}).setdefault(direction, {})
            for clock in clocks:
                key = (what, stage.index, direction, clock)
                if key not in store.work:
                    store.add_work(key, *device.measure_work(what, stage, direction, clock))
                row[clock] = ClockCost(*store.work[key])
    return table
