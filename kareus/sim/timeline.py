"""Event timelines: how one partition, or a run of sequential kernels, plays out on one GPU.

A partition runs its compute ops one after another on the compute stream. The other nanobatch's
collective starts together with the op at the launch slot and holds `comm_sms` SMs until it ends,
so the ops it overlaps run on the remaining SMs and share HBM bandwidth with it. When the
collective ends mid-op, that op finishes on all SMs. When the compute ends first, the collective
runs alone — that is exposed communication, with the other SMs idle — and the partition ends at
the join, after `partition_join_s` (the compute stream's wait on the collective's event). The host
issues every kernel (`host_launch_s` each) and every partition (`partition_dispatch_s`: events and
stream switches); work the host has not issued cannot run, so a partition (or a sequential run of
kernels) takes at least its host time. Sequential (Megatron-style) execution runs every kernel
alone, collectives on NCCL's default channels.

Each steady state of the GPU (one kernel alone, or one kernel beside the collective) is a
**phase**. The clock of a phase is settled by `ClockPolicy`: the locked clock, unless the phase
would draw more than the power limit, in which case the power controller throttles it (see
`kareus.sim.clock`). The result is a `Tally` of wall time, dynamic energy (above P_static),
exposed-communication time and the clock·time integral.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kareus.sim.clock import ClockPolicy
from kareus.sim.physics import KernelDemand, Physics
from kareus.workload.ops import CommOp, ComputeOp, Op


@dataclass
class Tally:
    """Accumulated time (s), dynamic energy (J), exposed communication (s) and clock·time (MHz·s)."""

    time_s: float = 0.0
    dynamic_j: float = 0.0
    exposed_comm_s: float = 0.0
    clock_mhz_s: float = 0.0
    throttled: bool = False

    def add(self, duration_s: float, dynamic_power_w: float, clock_mhz: float) -> None:
        self.time_s += duration_s
        self.dynamic_j += duration_s * dynamic_power_w
        self.clock_mhz_s += duration_s * clock_mhz

    def add_scaled(self, other: Tally, count: float) -> None:
        self.time_s += other.time_s * count
        self.dynamic_j += other.dynamic_j * count
        self.exposed_comm_s += other.exposed_comm_s * count
        self.clock_mhz_s += other.clock_mhz_s * count
        self.throttled = self.throttled or other.throttled

    @property
    def avg_clock_mhz(self) -> float:
        return self.clock_mhz_s / self.time_s if self.time_s > 0 else 0.0


@dataclass(frozen=True)
class _Phase:
    """A steady state at one clock: how long its kernel takes and what it draws."""

    kernel: KernelDemand | None
    kernel_s: float
    slowdown: float
    power_w: float


class _Timeline:
    def __init__(self, physics: Physics, clock: ClockPolicy) -> None:
        self.physics = physics
        self.clock = clock
        self.tally = Tally()

    def settle(self, phase_at: Callable[[float, float], _Phase]) -> tuple[_Phase, float]:
        clock_mhz, switching, throttled = self.clock.settle(lambda f, s: phase_at(f, s).power_w)
        self.tally.throttled = self.tally.throttled or throttled
        return phase_at(clock_mhz, switching), clock_mhz

    def idle(self, duration_s: float) -> None:
        """The GPU waits (no kernel: static power only)."""
        if duration_s > 0:
            self.tally.add(duration_s, 0.0, self.clock.requested_mhz)

    def kernel_alone(self, op: ComputeOp, fraction: float = 1.0) -> None:
        physics, sms = self.physics, self.physics.spec.sms

        def phase_at(clock_mhz: float, switching: float) -> _Phase:
            kernel = physics.kernel(op, sms, clock_mhz)
            duration = kernel.time_s()
            power = physics.dynamic_power_w(
                sm_activity_units=sms * kernel.sm_activity(physics.params), switching=switching,
                hbm_bytes_per_s=kernel.hbm_bytes / duration if duration > 0 else 0.0, link_bytes_per_s=0.0)
            return _Phase(kernel, duration, 1.0, power)

        phase, clock_mhz = self.settle(phase_at)
        self.tally.add(phase.kernel_s * fraction, phase.power_w, clock_mhz)

    def comm_alone(self, comm: CommOp, rate: float, comm_sms: float, uncontended_s: float) -> float:
        physics = self.physics
        hbm_demand = physics.params.comm_hbm_bytes_per_ring_byte(comm.collective) * rate
        slowdown = physics.contention(hbm_demand)

        def phase_at(_clock_mhz: float, switching: float) -> _Phase:
            power = physics.dynamic_power_w(
                sm_activity_units=comm_sms * physics.params.activity_comm, switching=switching,
                hbm_bytes_per_s=hbm_demand / slowdown, link_bytes_per_s=2 * rate / slowdown)
            return _Phase(None, 0.0, slowdown, power)

        phase, clock_mhz = self.settle(phase_at)
        duration = uncontended_s * slowdown
        self.tally.add(duration, phase.power_w, clock_mhz)
        return duration

    def beside_comm(self, op: ComputeOp, comm: CommOp, rate: float, comm_sms: int, comm_left_s: float) -> float:
        """Run `op` beside the collective; returns the collective's remaining uncontended seconds."""
        physics = self.physics
        compute_sms = physics.spec.sms - comm_sms
        comm_hbm = physics.params.comm_hbm_bytes_per_ring_byte(comm.collective) * rate

        interference = physics.copy_interference(comm_hbm)

        def phase_at(clock_mhz: float, switching: float) -> _Phase:
            kernel = physics.kernel(op, compute_sms, clock_mhz, interference)
            slowdown = physics.contention(kernel.hbm_rate, comm_hbm)
            op_s = kernel.time_s(slowdown)
            power = physics.dynamic_power_w(
                sm_activity_units=compute_sms * kernel.sm_activity(physics.params, slowdown)
                + comm_sms * physics.params.activity_comm,
                switching=switching, hbm_bytes_per_s=kernel.hbm_bytes / op_s + comm_hbm / slowdown,
                link_bytes_per_s=2 * rate / slowdown)
            return _Phase(kernel, op_s, slowdown, power)

        phase, clock_mhz = self.settle(phase_at)
        together_s = min(phase.kernel_s, comm_left_s * phase.slowdown)
        self.tally.add(together_s, phase.power_w, clock_mhz)
        if together_s < phase.kernel_s:  # the collective ended mid-op: the op finishes on all SMs
            self.kernel_alone(op, 1.0 - together_s / phase.kernel_s)
            return 0.0
        return comm_left_s - together_s / phase.slowdown


def partition_tally(physics: Physics, ops: tuple[ComputeOp, ...], comm: CommOp, start_index: int, comm_sms: int,
                    clock: ClockPolicy) -> Tally:
    """One partition: ops before the launch slot alone, then compute beside the collective, then
    the collective's exposed tail (if any)."""
    timeline = _Timeline(physics, clock)
    for op in ops[:start_index]:
        timeline.kernel_alone(op)
    rate = physics.comm_rate(comm_sms)
    comm_left_s = physics.comm_duration_s(comm, rate)  # in uncontended seconds
    for op in ops[start_index:]:
        if comm_left_s > 0:
            comm_left_s = timeline.beside_comm(op, comm, rate, comm_sms, comm_left_s)
        else:
            timeline.kernel_alone(op)
    if comm_left_s > 0:
        timeline.tally.exposed_comm_s += timeline.comm_alone(comm, rate, comm_sms, comm_left_s)
    timeline.idle(physics.params.partition_join_s)
    # The host issues both nanobatches' kernels of the partition (compute ops and the collective)
    # plus the events that gate the launch and the join; when that takes longer than the GPU's
    # work, the GPU waits for it.
    timeline.idle(physics.host_s(len(ops) + 1, partitions=1) - timeline.tally.time_s)
    return timeline.tally


def host_bound(physics: Physics, tally: Tally, kernels: int, clock: ClockPolicy) -> Tally:
    """`tally` of `kernels` kernels issued back to back, stretched to the host's issue time."""
    gap = physics.host_s(kernels) - tally.time_s
    if gap > 0:
        tally.add(gap, 0.0, clock.requested_mhz)
    return tally


def sequential_tally(physics: Physics, ops: Iterable[Op], clock: ClockPolicy) -> Tally:
    """Kernels one after another, nothing overlapped; collectives on NCCL's default channels."""
    timeline = _Timeline(physics, clock)
    nccl_rate = physics.nccl_rate()
    for op in ops:
        if isinstance(op, CommOp):
            duration = physics.comm_duration_s(op, nccl_rate)
            timeline.tally.exposed_comm_s += timeline.comm_alone(op, nccl_rate, physics.params.nccl_channels,
                                                                 duration)
        else:
            timeline.kernel_alone(op)
    return timeline.tally
