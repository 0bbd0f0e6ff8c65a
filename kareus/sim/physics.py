"""The physical model of the simulated GPU: kernel speed, collective speed and power.

All parameters are global (one `SimParams` for every model, layout and GPU; per-chip constants live
in `GPUSpec`). `docs/simulator.md` gives each one's source or reasoning. The model, in short:

- **Compute kernels** (GEMM, flash attention) retire `efficiency × FLOPs-per-SM-cycle × SMs × f`
  FLOPs per second; GEMM efficiency saturates with the GEMM's size per SM and is quantised by
  waves of output tiles on the SMs left to compute; attention efficiency grows with the keys per
  query and is quantised by its query tiles (small or split work fills the machine poorly: that
  is why splitting a microbatch in two can lose). A kernel is a roofline: its time is the larger
  of the FLOP time and the HBM time, plus a launch gap and a tail of `kernel_tail_cycles` cycles.
- **Memory-bound kernels** (norms, RoPE, SwiGLU, bias-dropout-add) stream their bytes at their share
  of the achievable HBM bandwidth, capped by what the SMs they run on can request per cycle (so
  their speed depends on the clock only weakly: through the kernel tail, and below ~75 % of the
  maximum clock through the request cap).
- **Collectives** are rings: each GPU moves `ring_bytes` at `min(link bandwidth, SMs × per-SM copy
  bandwidth)` after `2(n−1)` or `n−1` step latencies; the copy engine work reads and writes HBM
  (`comm_hbm_bytes_per_ring_byte`). The copy rate does not depend on the SM clock (NVLink round
  trips bound it, not instruction issue).
- **HBM contention**: concurrent kernels whose bandwidth demands exceed the achievable bandwidth are
  slowed by the same factor (proportional sharing); beside a copy a compute kernel also moves more
  bytes and stalls longer (L2 eviction, `copy_l2_interference`).
- **The partitioned engine's overheads**: a GPU-side join per partition (`partition_join_s`) and
  host time per kernel and per partition (`host_launch_s`, `partition_dispatch_s`) below which no
  partition or sequential run can finish.
- **Power** = P_static + SM dynamic power (activity-weighted SMs × `sm_dynamic_w_at_max/SMs` ×
  f·V(f)² relative to the maximum) + HBM energy per byte moved + NVLink energy per byte moved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kareus.sim.gpus import GPUSpec
from kareus.workload.ops import CommOp, ComputeOp


@dataclass(frozen=True)
class SimParams:
    """Global physical parameters of the simulator (see docs/simulator.md for each source).

    The shipped defaults are the A100 fit (`kareus/sim/data/a100-sxm4.json`, made by
    `kareus sim calibrate`); `FITTABLE` names the parameters a calibration may fit."""

    gemm_efficiency: float = 0.771
    gemm_half_efficiency_flops_per_sm: float = 1.0e7
    gemm_tile_rows: int = 128
    gemm_tile_cols: int = 128
    attention_forward_efficiency: float = 0.66
    attention_backward_efficiency: float = 0.53
    attention_half_efficiency_keys: float = 256.0
    attention_tile_queries: int = 128
    hbm_efficiency: float = 0.88
    sm_issue_headroom: float = 0.822
    kernel_launch_s: float = 2.0e-6
    kernel_tail_cycles: float = 3000.0
    host_launch_s: float = 0.0
    partition_dispatch_s: float = 0.0
    partition_join_s: float = 92.9e-6
    comm_bytes_per_s_per_sm: float = 31.2e9
    link_efficiency: float = 0.80
    comm_step_latency_s: float = 6.0e-6
    nccl_channels: int = 32
    nccl_bytes_per_s_per_channel: float = 20.0e9
    copy_l2_interference: float = 0.184
    activity_gemm: float = 1.0
    activity_attention: float = 0.85
    activity_memory: float = 0.569
    activity_comm: float = 0.522
    link_pj_per_byte: float = 20.0
    throttle_wobble_mhz: float = 60.0

    def comm_hbm_bytes_per_ring_byte(self, collective: str) -> float:
        """HBM traffic per byte sent: read the chunk to send, write the chunk received, and for
        reductions read the local chunk to add into (all-reduce, reduce-scatter)."""
        return 2.0 if collective == "all_gather" else 3.0


# Parameters a calibration may fit, with physical bounds (lower, upper) and units in the name.
FITTABLE: dict[str, tuple[float, float]] = {
    "gemm_efficiency": (0.55, 0.95),
    "gemm_half_efficiency_flops_per_sm": (1.0e5, 1.0e8),
    "attention_forward_efficiency": (0.35, 0.90),
    "attention_backward_efficiency": (0.30, 0.85),
    "attention_half_efficiency_keys": (1.0, 4096.0),
    "hbm_efficiency": (0.70, 0.95),
    "sm_issue_headroom": (0.8, 2.0),
    "kernel_launch_s": (0.0, 2.0e-5),
    "kernel_tail_cycles": (0.0, 2.0e4),
    "host_launch_s": (0.0, 1.0e-4),
    "partition_dispatch_s": (0.0, 2.0e-4),
    "partition_join_s": (0.0, 1.0e-4),
    "comm_bytes_per_s_per_sm": (10.0e9, 50.0e9),
    "link_efficiency": (0.5, 0.95),
    "comm_step_latency_s": (1.0e-6, 3.0e-5),
    "nccl_bytes_per_s_per_channel": (5.0e9, 40.0e9),
    "copy_l2_interference": (0.0, 2.0),
    "activity_attention": (0.4, 1.0),
    "activity_memory": (0.05, 0.8),
    "activity_comm": (0.1, 0.7),
    "link_pj_per_byte": (0.0, 60.0),
}


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
        """Share of the SMs' peak FLOP rate a compute kernel retires on `sms` SMs."""
        p = self.params
        if op.kind == "attention":
            peak = p.attention_backward_efficiency if op.backward else p.attention_forward_efficiency
            size = op.depth / (op.depth + p.attention_half_efficiency_keys) if op.depth > 0 else 1.0
            tiles = op.rows * math.ceil(op.cols / p.attention_tile_queries) if op.rows > 0 else 0.0
            return peak * size * wave_efficiency(tiles, sms)
        half = p.gemm_half_efficiency_flops_per_sm * sms
        fill = op.flops / (op.flops + half)
        return p.gemm_efficiency * fill * self.gemm_wave_efficiency(op, sms)

    def gemm_wave_efficiency(self, op: ComputeOp, sms: float) -> float:
        """Tile quantisation: output tiles run in waves of `sms` tiles, the last one partly empty.
        A backward GEMM is the input gradient (rows × depth) and the weight gradient (depth × cols),
        equal in FLOPs, so their times add."""
        if op.rows <= 0 or op.cols <= 0:
            return 1.0
        p = self.params

        def tiles(rows: float, cols: float) -> float:
            return math.ceil(rows / p.gemm_tile_rows) * math.ceil(cols / p.gemm_tile_cols)

        if not op.backward:
            return wave_efficiency(tiles(op.rows, op.cols), sms)
        dgrad = wave_efficiency(tiles(op.rows, op.depth), sms)
        wgrad = wave_efficiency(tiles(op.depth, op.cols), sms)
        return 2.0 / (1.0 / dgrad + 1.0 / wgrad)

    def kernel(self, op: ComputeOp, sms: float, clock_mhz: float, interference: float = 1.0) -> KernelDemand:
        """The kernel on `sms` SMs; `interference` ≥ 1 (a copy running beside it, see
        `copy_interference`) inflates its HBM traffic and stretches its FLOP time alike."""
        p = self.params
        hz = clock_mhz * 1e6
        if op.kind == "memory":
            flop_time, activity = 0.0, p.activity_memory
        else:
            rate = self.efficiency(op, sms) * self.spec.flops_per_sm_cycle * sms * hz
            flop_time = op.flops / rate * interference
            activity = p.activity_gemm if op.kind == "gemm" else p.activity_attention
        stream = min(self.hbm_bytes_per_s, self.issue_bytes_per_s(sms, clock_mhz))
        overhead = p.kernel_launch_s + p.kernel_tail_cycles / hz
        moved = op.hbm_bytes * interference
        return KernelDemand(flop_time, moved / stream, overhead, moved, activity)

    def copy_interference(self, comm_hbm_bytes_per_s: float) -> float:
        """Factor on a compute kernel's HBM traffic and FLOP time beside a copy moving
        `comm_hbm_bytes_per_s`: the copy streams through L2 and evicts the kernel's reused lines
        (operand tiles refetched, warps stalled on them), in proportion to the share of the
        bandwidth it takes."""
        return 1.0 + self.params.copy_l2_interference * comm_hbm_bytes_per_s / self.hbm_bytes_per_s

    def host_s(self, kernels: int, partitions: int = 0) -> float:
        """Host time to issue `kernels` kernels and `partitions` partition dispatches (event record
        and wait, stream switch); the GPU cannot run work the host has not issued yet."""
        return kernels * self.params.host_launch_s + partitions * self.params.partition_dispatch_s

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


def wave_efficiency(tiles: float, sms: float) -> float:
    """Share of SM·waves doing work when `tiles` equal tiles run on `sms` SMs, one tile per SM
    per wave (1 when the tile count is unknown)."""
    if tiles <= 0 or sms <= 0:
        return 1.0
    waves = math.ceil(tiles / math.floor(sms))
    return tiles / (waves * math.floor(sms))
