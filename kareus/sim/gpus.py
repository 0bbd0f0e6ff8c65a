"""GPU presets of the simulator: public hardware envelopes plus a few physical constants per chip.

The envelope columns (SMs, clock range and step, HBM bandwidth, bf16 dense peak, power limit,
P_static, NVLink bandwidth) are copied from `calibration/gpu_envelopes.csv` (nvidia-smi dumps and
datasheets). The physical columns are per-silicon estimates, documented in `docs/simulator.md`:

- `sm_dynamic_w_at_max`: dynamic power of all SMs running a dense bf16 GEMM at the maximum clock and
  voltage. A100: Perseus' GPT-3 layer draws 475 W at 1410 MHz on the (unthrottled) 500 W SKU; minus
  ~85 W static and ~60 W of HBM traffic leaves ~330 W for a layer that is ~90 % GEMM time, so a pure
  GEMM draws ~350 W on its SMs. The same silicon on the 400 W SKU therefore throttles.
  Hopper (700 W, 132 SMs, ~2× the switching per clock): ~560 W.
- `voltage_floor_mhz`, `voltage_min_ratio`, `voltage_curve_exponent`: V(f) is flat at
  `voltage_min_ratio`·V_max up to the floor clock (the lowest voltage the regulator gives) and rises
  smoothly above it, as ((f − floor)/(max − floor))^exponent, to V_max at the maximum clock. DVFS
  tables of A100/H100 give ~0.70 of V_max at the bottom of the boost range. The energy-minimum
  clock is *not* a parameter: it is where static and memory power, paid per second, balance the
  rising SM power per cycle; the A100 values come from `kareus sim calibrate` on Perseus' curve.
- `hbm_pj_per_byte`: energy of moving one byte to or from DRAM (HBM2e ~4-5 pJ/bit incl. PHY;
  HBM3 ~3.5 pJ/bit; GDDR6 ~7 pJ/bit).

Node-label spellings (`NVIDIA-A100-SXM4-40GB`, `NVIDIA A100-SXM4-40GB`, `H100-SXM`, `H200`) resolve
through `get_gpu`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kareus.errors import KareusError


@dataclass(frozen=True)
class GPUSpec:
    """A GPU model: hardware envelope and per-silicon physical constants."""

    name: str
    sms: int
    clock_min_mhz: int
    clock_max_mhz: int
    clock_step_mhz: int
    mem_clock_mhz: int
    hbm_gb_per_s: float
    bf16_dense_tflops_at_max: float
    power_limit_w: float
    power_limit_min_w: float
    p_static_w: float
    nvlink_gb_per_s: float
    sm_dynamic_w_at_max: float
    voltage_floor_mhz: float
    voltage_min_ratio: float
    hbm_pj_per_byte: float
    voltage_curve_exponent: float = 1.0
    memory_gib: float = 0.0  # device memory as nvidia-smi's memory.total reports it, in GiB

    @property
    def supported_clocks_mhz(self) -> tuple[int, ...]:
        """Supported SM clocks, highest first (as NVML lists them)."""
        return tuple(range(self.clock_max_mhz, self.clock_min_mhz - 1, -self.clock_step_mhz))

    @property
    def search_clocks_mhz(self) -> tuple[int, ...]:
        """The paper's clock grid: the maximum clock down in 30 MHz steps to ~64 % of it (A100:
        1410..900, 18 values; lower clocks no longer save energy), highest first."""
        floor = max(self.clock_min_mhz, 0.635 * self.clock_max_mhz)
        step = 2 * self.clock_step_mhz
        return tuple(clock for clock in range(self.clock_max_mhz, self.clock_min_mhz - 1, -step) if clock >= floor)

    @property
    def flops_per_sm_cycle(self) -> float:
        """Dense bf16 FLOPs one SM retires per clock cycle."""
        return self.bf16_dense_tflops_at_max * 1e12 / (self.sms * self.clock_max_mhz * 1e6)

    @property
    def idle_power_w(self) -> float:
        """Power with no kernel running (a GPU waiting on a receive: the paper's P_static)."""
        return self.p_static_w

    def voltage_ratio(self, clock_mhz: float) -> float:
        """V(f)/V_max: flat up to the floor clock, then rising as a power of the clock above it to 1
        at the maximum clock."""
        if clock_mhz <= self.voltage_floor_mhz:
            return self.voltage_min_ratio
        rise = min(1.0, (clock_mhz - self.voltage_floor_mhz) / (self.clock_max_mhz - self.voltage_floor_mhz))
        return self.voltage_min_ratio + (1.0 - self.voltage_min_ratio) * rise ** self.voltage_curve_exponent

    def switching_factor(self, clock_mhz: float) -> float:
        """f·V(f)² relative to the maximum clock: what one fully active SM's dynamic power scales with."""
        return clock_mhz / self.clock_max_mhz * self.voltage_ratio(clock_mhz) ** 2

    def check_clock(self, clock_mhz: float) -> None:
        if not self.clock_min_mhz <= clock_mhz <= self.clock_max_mhz:
            raise KareusError(f"clock_mhz {clock_mhz} outside {self.name}'s range "
                              f"{self.clock_min_mhz}..{self.clock_max_mhz} MHz")


_ENVELOPES = (
    # name, sms, clock min/max/step, mem clock, HBM GB/s, bf16 TFLOP/s, power limit/min, P_static, NVLink GB/s
    ("A100-SXM4-40GB", 108, 210, 1410, 15, 1215, 1555, 312, 400, 100, 85, 300),
    ("A100-SXM4-80GB", 108, 210, 1410, 15, 1593, 2039, 312, 400, 100, 85, 300),
    ("A40", 84, 210, 1740, 15, 7251, 696, 150, 300, 100, 70, 56),
    ("H100-SXM5-80GB", 132, 345, 1980, 15, 2619, 3350, 989, 700, 200, 72, 450),
    ("H200-SXM-141GB", 132, 345, 1980, 15, 3201, 4800, 989, 700, 200, 75, 450),
)

# sm_dynamic_w_at_max, voltage_floor_mhz, voltage_min_ratio, hbm_pj_per_byte, voltage_curve_exponent
# (module docstring). Hopper and A40 are scaled from the A100 fit (same relative floor), not fitted.
_PHYSICS = {
    "A100-SXM4-40GB": (432.0, 1064.0, 0.750, 38.2, 1.06),
    "A100-SXM4-80GB": (432.0, 1064.0, 0.750, 38.2, 1.06),
    "A40": (200.0, 1305.0, 0.70, 56.0, 1.0),
    "H100-SXM5-80GB": (560.0, 1500.0, 0.70, 28.0, 1.0),
    "H200-SXM-141GB": (560.0, 1500.0, 0.70, 28.0, 1.0),
}
# GPU fields a calibration may fit, with physical bounds.
GPU_FITTABLE: dict[str, tuple[float, float]] = {
    "sm_dynamic_w_at_max": (150.0, 700.0),
    "voltage_floor_mhz": (300.0, 1300.0),
    "voltage_min_ratio": (0.45, 0.95),
    "voltage_curve_exponent": (1.0, 3.0),
    "hbm_pj_per_byte": (20.0, 60.0),
    "p_static_w": (30.0, 150.0),
}

# Device memory, nvidia-smi's memory.total in MiB (the datasheets' 40/80 GB HBM2e, 48 GB GDDR6,
# 80 GB HBM3 and 141 GB HBM3e, less what the driver keeps for ECC and itself).
_MEMORY_MIB = {
    "A100-SXM4-40GB": 40960,
    "A100-SXM4-80GB": 81920,
    "A40": 46068,
    "H100-SXM5-80GB": 81559,
    "H200-SXM-141GB": 143771,
}

GPUS: dict[str, GPUSpec] = {
    row[0]: GPUSpec(*row, *_PHYSICS[row[0]], memory_gib=_MEMORY_MIB[row[0]] / 1024)  # type: ignore[arg-type]
    for row in _ENVELOPES
}

_ALIASES = {
    "A100": "A100-SXM4-40GB",
    "A100-SXM4": "A100-SXM4-40GB",
    "A100-40GB": "A100-SXM4-40GB",
    "A100-80GB": "A100-SXM4-80GB",
    "H100": "H100-SXM5-80GB",
    "H100-SXM": "H100-SXM5-80GB",
    "H100-SXM5": "H100-SXM5-80GB",
    "H100-80GB-HBM3": "H100-SXM5-80GB",
    "H200": "H200-SXM-141GB",
    "H200-SXM": "H200-SXM-141GB",
    "H200-141GB": "H200-SXM-141GB",
}


def _normalise(name: str) -> str:
    text = re.sub(r"[\s_]+", "-", name.strip().upper())
    return re.sub(r"^NVIDIA-", "", text)


def get_gpu(name: str) -> GPUSpec:
    """The preset for a product name, accepting node-label and nvidia-smi spellings."""
    key = _normalise(name)
    by_key = {_normalise(n): n for n in GPUS}
    by_key.update({_normalise(alias): target for alias, target in _ALIASES.items()})
    if key in by_key:
        return GPUS[by_key[key]]
    raise KareusError(f"unknown GPU product {name!r}; allowed: {', '.join(GPUS)} "
                      f"(also spelled NVIDIA-<name>, or {', '.join(sorted(_ALIASES))})")
