"""The `Simulator`: measures partitions, kernel sequences and whole pipeline instructions on a
simulated GPU, the way the thermally stable profiler would on a real one.

A measurement locks the SM clock at the requested value and plays the work's event timeline
(`kareus.sim.timeline`). If the average power then exceeds the board's power limit, the power
controller throttles: the realised clock wobbles between two steps around a lower mean `f̄` such
that the average power equals the limit. Time follows `f̄`; dynamic power follows the
time-average of f·V(f)², which is larger than at `f̄` whenever V rises with f (Theorem 1) — so a
throttled run costs more energy than the same work locked at its realised mean clock. The
controller is resolved per phase (`kareus.sim.clock`), so an instruction is exactly the sum of its
separately measured partitions; docs/simulator.md says what a controller averaging over a whole
run would change.

Optional Gaussian measurement noise (relative `noise_std`, seeded) is applied to time and energy;
without it every result is deterministic and cached.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from numbers import Integral
from typing import Any

import numpy as np

from kareus.errors import KareusError
from kareus.sim.clock import ClockPolicy
from kareus.sim.gpus import GPUSpec, get_gpu
from kareus.sim.measurement import Measurement
from kareus.sim.physics import Physics, SimParams
from kareus.sim.timeline import Tally, host_bound, partition_tally, sequential_tally
from kareus.workload.ops import CommOp, Op
from kareus.workload.partitions import PartitionConfig, PartitionType, StageWorkload

Evaluate = Callable[[ClockPolicy], Tally]


def as_config(value: Any, name: str = "config") -> PartitionConfig:
    """A `PartitionConfig` from itself, a `{launch_slot, comm_sms}` mapping or a (slot, sms) pair."""
    if isinstance(value, PartitionConfig):
        return value
    if isinstance(value, Mapping) and {"launch_slot", "comm_sms"} <= set(value):
        return PartitionConfig(str(value["launch_slot"]), int(value["comm_sms"]))
    if isinstance(value, tuple | list) and len(value) == 2:
        return PartitionConfig(str(value[0]), int(value[1]))
    raise KareusError(f"{name}: expected {{launch_slot, comm_sms}}, got {value!r}")


class Simulator:
    """A simulated GPU of one model (`gpu`), optionally noisy (`noise_std` relative, `seed`)."""

    def __init__(self, gpu: GPUSpec | str, noise_std: float = 0.0, seed: int | None = None,
                 params: SimParams | None = None, power_limit_w: float | None = None) -> None:
        if noise_std < 0:
            raise KareusError(f"noise_std must be >= 0, got {noise_std}")
        self.gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
        self.params = params or SimParams()
        self.physics = Physics(self.gpu, self.params)
        self.noise_std = noise_std
        # A board limit other than the preset's (the same silicon ships as 400 W and 500 W parts).
        self.power_limit_w = power_limit_w
        self._rng = np.random.default_rng(seed)
        self._cache: dict[tuple[Any, ...], Measurement] = {}

    @property
    def p_static_w(self) -> float:
        return self.gpu.p_static_w

    # -- public measurements -------------------------------------------------------------------
    def partition(self, ptype: PartitionType, clock_mhz: float, comm_sms: int, launch_slot: str) -> Measurement:
        """One instance of `ptype` (one nanobatch's compute beside the other's collective)."""
        self._check_clock(clock_mhz)
        # numbers.Integral admits numpy integers (search grids are arrays).
        if isinstance(comm_sms, bool) or not isinstance(comm_sms, Integral) or not 1 <= comm_sms < self.gpu.sms:
            raise KareusError(f"comm_sms must be an integer in 1..{self.gpu.sms - 1}, got {comm_sms!r}")
        comm_sms = int(comm_sms)
        start = ptype.slot_op_index(launch_slot)
        key = ("partition", ptype, clock_mhz, comm_sms, start)
        return self._cached(key, lambda: self._measure(self._partition_eval(ptype, start, comm_sms), clock_mhz))

    def exposed(self, comm: CommOp, clock_mhz: float, comm_sms: int) -> Measurement:
        """`comm` on `comm_sms` SMs with no compute beside it (the other SMs idle): an exposed
        collective's phase alone, as the partition timeline plays a partition's tail."""
        self._check_clock(clock_mhz)
        if isinstance(comm_sms, bool) or not isinstance(comm_sms, Integral) or not 1 <= comm_sms < self.gpu.sms:
            raise KareusError(f"comm_sms must be an integer in 1..{self.gpu.sms - 1}, got {comm_sms!r}")
        return self._measure(lambda clock: partition_tally(self.physics, (), comm, 0, int(comm_sms), clock), clock_mhz)

    def sequential_partition(self, ptype: PartitionType, clock_mhz: float) -> Measurement:
        """The work of `ptype` executed Megatron-style: the whole microbatch's compute (both
        nanobatches at once), then its collective, reported per nanobatch (half) so it compares
        directly with `partition`."""
        self._check_clock(clock_mhz)
        ops = (*tuple(op.scaled(2.0) for op in ptype.compute_ops), ptype.comm.scaled(2.0))
        key = ("sequential_partition", ptype, clock_mhz)
        return self._cached(key, lambda: self._measure(self._sequential_eval(ops), clock_mhz).times(0.5))

    def sequential(self, ops: Iterable[Op], clock_mhz: float, *, wobble_mhz: float = 0.0) -> Measurement:
        """Kernels run one after another at a locked clock; with `wobble_mhz` > 0 the clock instead
        alternates evenly between `clock_mhz ± wobble_mhz` (same mean), as a throttling power
        controller makes it do."""
        self._check_clock(clock_mhz)
        ops = tuple(ops)
        if wobble_mhz < 0:
            raise KareusError(f"wobble_mhz must be >= 0, got {wobble_mhz}")
        if wobble_mhz:
            self._check_clock(clock_mhz - wobble_mhz)
            self._check_clock(clock_mhz + wobble_mhz)
        key = ("sequential", ops, clock_mhz, wobble_mhz)
        return self._cached(key, lambda: self._measure(self._sequential_eval(ops), clock_mhz, wobble_mhz))

    def instruction(self, stage: StageWorkload, direction: str, clock_mhz: float,
                    configs: Mapping[str, Any] | None,
                    recompute_configs: Mapping[str, Any] | None = None) -> Measurement:
        """One pipeline instruction (forward or backward of one microbatch) of `stage` at one clock.

        `configs is None` runs it Megatron-style (sequential). Otherwise every partition type of the
        direction needs a config; a backward under activation checkpointing also re-runs the
        forward partitions with `recompute_configs` (falling back to `configs` for those names).
        Non-partition work (embedding, output layer, loss) runs sequentially either way."""
        self._check_clock(clock_mhz)
        if direction not in ("forward", "backward"):
            raise KareusError(f"direction must be 'forward' or 'backward', got {direction!r}")
        nonpartition = stage.nonpartition_forward_ops if direction == "forward" else stage.nonpartition_backward_ops
        if configs is None or not stage.partition_types:
            body = stage.sequential_forward_ops if direction == "forward" else stage.sequential_backward_ops
            return self._measure(self._sequential_eval(body + nonpartition), clock_mhz)
        parts = self._instruction_parts(stage, direction, configs, recompute_configs or {})
        evaluate_rest = self._sequential_eval(nonpartition)

        def evaluate(clock: ClockPolicy) -> Tally:
            tally = evaluate_rest(clock)
            for ptype, start, comm_sms, count in parts:
                tally.add_scaled(partition_tally(self.physics, ptype.compute_ops, ptype.comm, start, comm_sms, clock),
                                 count)
            return tally

        return self._measure(evaluate, clock_mhz)

    # -- internals -----------------------------------------------------------------------------
    def _instruction_parts(self, stage: StageWorkload, direction: str, configs: Mapping[str, Any],
                           recompute_configs: Mapping[str, Any]) -> list[tuple[PartitionType, int, int, int]]:
        own = stage.forward_instances if direction == "forward" else stage.backward_instances
        groups = [(own, configs, "configs")]
        if direction == "backward" and stage.recompute_instances:
            merged = {**{k: v for k, v in configs.items() if k in stage.recompute_instances}, **recompute_configs}
            groups.append((stage.recompute_instances, merged, "recompute_configs"))
        parts = []
        for instances, chosen, label in groups:
            for name, count in instances.items():
                if name not in chosen:
                    raise KareusError(f"{label}: missing a config for partition type {name!r} "
                                      f"(needs {', '.join(instances)})")
                ptype = stage.partition_types[name]
                config = as_config(chosen[name], f"{label}.{name}")
                parts.append((ptype, ptype.slot_op_index(config.launch_slot), config.comm_sms, count))
        return parts

    def _partition_eval(self, ptype: PartitionType, start: int, comm_sms: int) -> Evaluate:
        return lambda clock: partition_tally(self.physics, ptype.compute_ops, ptype.comm, start, comm_sms, clock)

    def _sequential_eval(self, ops: tuple[Op, ...]) -> Evaluate:
        counted = Counter(ops)

        def evaluate(clock: ClockPolicy) -> Tally:
            tally = Tally()
            for op, count in counted.items():
                tally.add_scaled(sequential_tally(self.physics, (op,), clock), count)
            return host_bound(self.physics, tally, len(ops), clock)

        return evaluate

    def _measure(self, evaluate: Evaluate, clock_mhz: float, wobble_mhz: float = 0.0) -> Measurement:
        clock = ClockPolicy(self.gpu, float(clock_mhz), wobble_mhz, self.params.throttle_wobble_mhz,
                            self.power_limit_w)
        tally = evaluate(clock)
        energy = self.p_static_w * tally.time_s + tally.dynamic_j
        return Measurement.from_parts(time_s=tally.time_s, energy_j=energy, p_static_w=self.p_static_w,
                                      exposed_comm_s=tally.exposed_comm_s, avg_clock_mhz=tally.avg_clock_mhz,
                                      throttled=tally.throttled)

    def _cached(self, key: tuple[Any, ...], compute: Callable[[], Measurement]) -> Measurement:
        result = self._cache.get(key)
        if result is None:
            result = compute()
            self._cache[key] = result
        return self._noisy(result)

    def _noisy(self, result: Measurement) -> Measurement:
        if not self.noise_std:
            return result
        time_factor, energy_factor = np.maximum(1.0 + self.noise_std * self._rng.standard_normal(2), 0.05)
        return Measurement.from_parts(time_s=result.time_s * time_factor, energy_j=result.energy_j * energy_factor,
                                      p_static_w=self.p_static_w, exposed_comm_s=result.exposed_comm_s * time_factor,
                                      avg_clock_mhz=result.avg_clock_mhz, throttled=result.throttled)

    def _check_clock(self, clock_mhz: float) -> None:
        self.gpu.check_clock(clock_mhz)
