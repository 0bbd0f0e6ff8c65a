"""The SM clock a piece of work actually runs at: the locked clock, a deliberate wobble, or what
the power controller leaves after throttling.

Kernel speed follows the time-average clock `f̄` (work is counted in cycles), while SM dynamic
power follows the time-average of f·V(f)² (the *switching factor*). A locked clock has both at
the same point. A clock alternating evenly between `f̄ ± δ` has the same speed but a larger
switching factor wherever f·V(f)² is convex — strictly so when the swing crosses the voltage knee
(Theorem 1). Below the knee V is flat, f·V² is linear and the wobble costs nothing extra.

Power-limit throttling: when a phase would draw more than the board limit at the locked clock,
the controller lowers the clock and dithers between two steps around a mean `f̄` such that the
phase's average power equals the limit; the upper step never exceeds the locked clock. The
controller reacts within about a millisecond, i.e. per steady state of the GPU (one kernel, or
one kernel beside a collective), so a GEMM phase can throttle while the collective beside it or
the memory-bound kernel after it does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kareus.sim.gpus import GPUSpec

_BISECTION_STEPS = 14  # 1200 MHz / 2^14 < 0.1 MHz


@dataclass(frozen=True)
class ClockPolicy:
    """How the clock of each phase is settled: `requested_mhz` locked, `wobble_mhz` of deliberate
    even swing around it, `throttle_wobble_mhz` of dithering while power-limited."""

    gpu: GPUSpec
    requested_mhz: float
    wobble_mhz: float = 0.0
    throttle_wobble_mhz: float = 60.0
    power_limit_w: float | None = None

    @property
    def limit_w(self) -> float:
        return self.gpu.power_limit_w if self.power_limit_w is None else self.power_limit_w

    def switching(self) -> float:
        """Switching factor of the requested (possibly deliberately wobbling) clock."""
        if self.wobble_mhz <= 0:
            return self.gpu.switching_factor(self.requested_mhz)
        return 0.5 * (self.gpu.switching_factor(self.requested_mhz + self.wobble_mhz)
                      + self.gpu.switching_factor(self.requested_mhz - self.wobble_mhz))

    def throttled_switching(self, mean_mhz: float) -> float:
        """Switching factor of the controller's dither around `mean_mhz`, capped at the lock."""
        high = min(mean_mhz + self.throttle_wobble_mhz, self.requested_mhz)
        low = max(2.0 * mean_mhz - high, float(self.gpu.clock_min_mhz))
        return 0.5 * (self.gpu.switching_factor(high) + self.gpu.switching_factor(low))

    def settle(self, dynamic_power_at: Callable[[float, float], float]) -> tuple[float, float, bool]:
        """(mean clock, switching factor, throttled) of a phase whose dynamic power at (clock,
        switching) is `dynamic_power_at`."""
        budget = self.limit_w - self.gpu.p_static_w
        switching = self.switching()
        if dynamic_power_at(self.requested_mhz, switching) <= budget:
            return self.requested_mhz, switching, False
        low, high = float(self.gpu.clock_min_mhz), self.requested_mhz
        for _ in range(_BISECTION_STEPS):
            mean = 0.5 * (low + high)
            if dynamic_power_at(mean, self.throttled_switching(mean)) > budget:
                high = mean
            else:
                low = mean
        return low, self.throttled_switching(low), True
