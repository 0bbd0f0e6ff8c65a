"""What one measurement of a piece of work on one GPU reports.

The accounting of DESIGN.md §2.1: `energy_j` is the GPU's total energy for the work,
`static_energy_j = P_static × time_s` (paid whatever runs), `dynamic_energy_j = energy_j −
static_energy_j`, and the optimizer's per-operation cost is the effective energy, which is the same
quantity (`effective_energy_j`). `exposed_comm_s` is the time a collective ran with no computation
beside it; `avg_clock_mhz` the time-average SM clock actually realised (below the requested clock
when the power limit throttles); `avg_power_w = energy_j / time_s`. Energies are per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Measurement:
    """Time and energy of one piece of work on one GPU."""

    time_s: float
    energy_j: float
    static_energy_j: float
    dynamic_energy_j: float
    exposed_comm_s: float
    avg_clock_mhz: float
    avg_power_w: float
    throttled: bool = False

    @property
    def effective_energy_j(self) -> float:
        """E − P_static·T: the energy this work adds on top of what the idle GPU pays anyway."""
        return self.dynamic_energy_j

    @classmethod
    def from_parts(cls, *, time_s: float, energy_j: float, p_static_w: float, exposed_comm_s: float,
                   avg_clock_mhz: float, throttled: bool = False) -> Measurement:
        static = p_static_w * time_s
        return cls(time_s, energy_j, static, energy_j - static, exposed_comm_s, avg_clock_mhz,
                   energy_j / time_s if time_s > 0 else 0.0, throttled)

    def times(self, count: float) -> Measurement:
        """`count` back-to-back repetitions (the clock and power averages are unchanged)."""
        return replace(self, time_s=self.time_s * count, energy_j=self.energy_j * count,
                       static_energy_j=self.static_energy_j * count,
                       dynamic_energy_j=self.dynamic_energy_j * count, exposed_comm_s=self.exposed_comm_s * count)

    def to_dict(self) -> dict[str, float | bool]:
        return {"time_s": self.time_s, "energy_j": self.energy_j, "static_energy_j": self.static_energy_j,
                "dynamic_energy_j": self.dynamic_energy_j, "effective_energy_j": self.effective_energy_j,
                "exposed_comm_s": self.exposed_comm_s, "avg_clock_mhz": self.avg_clock_mhz,
                "avg_power_w": self.avg_power_w, "throttled": self.throttled}


def combine(parts: list[Measurement] | tuple[Measurement, ...], p_static_w: float) -> Measurement:
    """Work run back to back: times, energies and exposure add; clock is time-weighted."""
    time_s = sum(m.time_s for m in parts)
    energy_j = sum(m.energy_j for m in parts)
    clock = sum(m.avg_clock_mhz * m.time_s for m in parts) / time_s if time_s > 0 else 0.0
    return Measurement.from_parts(time_s=time_s, energy_j=energy_j, p_static_w=p_static_w,
                                  exposed_comm_s=sum(m.exposed_comm_s for m in parts), avg_clock_mhz=clock,
                                  throttled=any(m.throttled for m in parts))
