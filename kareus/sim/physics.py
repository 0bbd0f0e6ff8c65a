"""The physical model of the simulated GPU: kernel speed, collective speed and power.

All parameters are global (one `SimParams` for every model, layout and GPU; per-chip constants live
in `GPUSpec`). `docs/simulator.md` gives each one's source or reasoning. The model, in short:

- **Compute kernels** (GEMM, flash attention) retire `efficiency × FLOPs-per-SM-cycle × SMs × f`
  FLOPs per second; GEMM efficiency saturates with the GEMM's size per SM (small GEMMs fill the
  machine poorly: that is why splitting a small microbatch in two can lose). A kernel is a roofline:
  its time is the larger of the FLOP time and the HBM time, plus a launch gap and a tail of
  `kernel_tail_cycles` cycles.
- **Memory-bound kernels** (norms, RoPE, SwiGLU, bias-dropout-add) stream their bytes at their share
  of the achievable HBM bandwidth, capped by what the SMs they run on can request per cycle (so
  their speed depends on the clock only weakly: through the kernel tail, and below ~75 % of the
  maximum clock through the request cap).
- **Collectives** are rings: each GPU moves `ring_bytes` at `min(link bandwidth, SMs × per-SM copy
  bandwidth)` after `2(n−1)` or `n−1` step latencies; the copy engine work reads and writes HBM
  (`comm_hbm_bytes_per_ring_byte`). The copy rate does not depend on the SM clock (NVLink round
  trips bound it, not instruction issue).
- **HBM contention**: concurrent kernels whose bandwidth demands exceed the achievable bandwidth are
  slowed by the same factor (proportional sharing).
- **Power** = P_static + SM dynamic power (activity-weighted SMs × `sm_dynamic_w_at_max/SMs` ×
  f·V(f)² relative to the maximum) + HBM energy per byte moved + NVLink energy per byte moved.
"""

from __future__ import annotations

from dataclasses import dataclass

from kareus.sim.gpus import GPUSpec
from kareus.workload.ops import CommOp, ComputeOp


@dataclass(frozen=True)
class SimParams:
    """Global physical parameters of the simulator (see docs/simulator.md for each source)."""

    gemm_efficiency: float = 0.80
    gemm_half_efficiency_flops_per_sm: float = 1.0e7
    attention_forward_efficiency: float = 0.62
    attention_backward_efficiency: float = 0.50
    hbm_efficiency: float = 0.88
    sm_issue_headroom: float = 1.15
    kernel_launch_s: float = 2.0e-6
    kernel_tail_cycles: float = 3000.0
    comm_bytes_per_s_per_sm: float = 30.0e9
    link_efficiency: float = 0.80
    comm_step_latency_s: float = 6.0e-6
    nccl_channels: int = 16
    nccl_bytes_per_s_per_channel: float = 20.0e9
    activity_gemm: float = 1.0
    activity_attention: float = 0.85
    activity_memory: float = 0.30
    activity_comm: float = 0.30
    link_pj_per_byte: float = 20.0
    throttle_wobble_mhz: float = 60.0

    def comm_hbm_bytes_per_ring_byte(self, collective: str) -> float:
        """HBM traffic per byte sent: read the chunk to send, write the chunk received, and for
        reductions read the local chunk to add into (all-reduce, reduce-scatter)."""
        return 2.0 if collective == "all_gather" else 3.0


@dataclass(frozen=True)
class KernelDemand:
    """A compute kernel running on `sms` SMs at clock `clock_mhz` with the whole HBM to itself."""

    flop_time_s: float
    byte_time_s: float
    overhead_s: float
    hbm_bytes: float
    activity_peak: float

    @property
    def core_s(self) -> float:
        return max(self.flop_time_s, self.byte_time_s)

    @property
    def hbm_rate(self) -> float:
        """Bandwidth it would use uncontended (bytes/s)."""
        return self.hbm_bytes / self.core_s if self.core_s > 0 else 0.0

    def time_s(self, slowdown: float = 1.0) -> float:
        """Its time when HBM contention stretches its byte-bound core by `slowdown` ≥ 1 (a
        proportional share scales its demand, so the whole core stretches)."""
        return self.core_s * slowdown + self.overhead_s

    def sm_activity(self, params: SimParams, slowdown: float = 1.0) -> float:
        """Average switching activity of its SMs (1 = a dense GEMM's)."""
        total = self.time_s(slowdown)
        if total <= 0:
            return 0.0
        busy_compute = self.activity_peak * self.flop_time_s
        busy_memory = params.activity_memory * self.byte_time_s * slowdown
        return max(busy_compute, busy_memory) / total


class Physics:
    """Kernel and collective rates and power of one GPU model under `SimParams`."""

    def __init__(self, spec: GPUSpec, params: SimParams) -> None:
        self.spec = spec
        self.params = params
        self.hbm_bytes_per_s = spec.hbm_gb_per_s * 1e9 * params.hbm_efficiency
        self.link_bytes_per_s = spec.nvlink_gb_per_s * 1e9 * params.link_efficiency
        self.sm_power_w = spec.sm_dynamic_w_at_max / spec.sms

    def efficiency(self, op: ComputeOp, sms: float) -> float:
        p = self.params
        if op.kind == "attention":
            return p.attention_backward_efficiency if op.backward else p.attention_forward_efficiency
        half = p.gemm_half_efficiency_flops_per_sm * sms
        return p.gemm_efficiency * op.flops / (op.flops + half)

    def kernel(self, op: ComputeOp, sms: float, clock_mhz: float) -> KernelDemand:
        p = self.params
        hz = clock_mhz * 1e6
        if op.kind == "memory":
            flop_time, activity = 0.0, p.activity_memory
        else:
            rate = self.efficiency(op, sms) * self.spec.flops_per_sm_cycle * sms * hz
            flop_time = op.flops / rate
            activity = p.activity_gemm if op.kind == "gemm" else p.activity_attention
        stream = min(self.hbm_bytes_per_s, self.issue_bytes_per_s(sms, clock_mhz))
        overhead = p.kernel_launch_s + p.kernel_tail_cycles / hz
        return KernelDemand(flop_time, op.hbm_bytes / stream, overhead, op.hbm_bytes, activity)

    def issue_bytes_per_s(self, sms: float, clock_mhz: float) -> float:
        """The most bandwidth `sms` SMs can request at `clock_mhz`: all SMs at the maximum clock
        request `sm_issue_headroom` × the HBM peak, scaling with SMs and clock."""
        spec = self.spec
        return (self.params.sm_issue_headroom * spec.hbm_gb_per_s * 1e9 * (sms / spec.sms)
                * (clock_mhz / spec.clock_max_mhz))

    def comm_rate(self, comm_sms: float) -> float:
        """Ring bytes per second a collective on `comm_sms` SMs moves with HBM to spare."""
        return min(self.link_bytes_per_s, comm_sms * self.params.comm_bytes_per_s_per_sm)

    def nccl_rate(self) -> float:
        """Rate of a default NCCL collective (Megatron's sequential path) on its default channels."""
        p = self.params
        return min(self.link_bytes_per_s, p.nccl_channels * p.nccl_bytes_per_s_per_channel)

    def comm_duration_s(self, comm: CommOp, rate: float) -> float:
        steps = 2 * (comm.group_size - 1) if comm.collective == "all_reduce" else comm.group_size - 1
        return steps * self.params.comm_step_latency_s + comm.ring_bytes_per_gpu / rate

    def contention(self, *demands_bytes_per_s: float) -> float:
        """Slowdown ≥ 1 that proportional HBM sharing imposes on every concurrent kernel."""
        total = sum(demands_bytes_per_s)
        return max(1.0, total / self.hbm_bytes_per_s)

    def dynamic_power_w(self, *, sm_activity_units: float, switching: float, hbm_bytes_per_s: float,
                        link_bytes_per_s: float) -> float:
        """Power above P_static: SMs (activity-weighted count × f·V² factor), HBM and NVLink traffic."""
        return (self.sm_power_w * sm_activity_units * switching
                + self.spec.hbm_pj_per_byte * 1e-12 * hbm_bytes_per_s
                + self.params.link_pj_per_byte * 1e-12 * link_bytes_per_s)
