"""The one GPU interface everything above `kareus.gpu` talks to.

A `GPUDevice` is a physical GPU addressed by UUID and PCI bus id (never by ordinal: inside a pod
local index 0 can be host GPU 5). It offers measurement — the cumulative energy counter, power and
the current SM clock — and control — locking and resetting the SM clock — as separate
responsibilities, the way Zeus splits monitoring from control. Backends: NVML (`kareus.gpu.nvml`)
and the simulated GPU (`kareus.gpu.sim`). Nothing above this interface imports `pynvml`.

The backend tracks the lock it set (`locked_clock_mhz`), because NVML cannot report the current
lock range. The board power limit (what `nvidia-smi -pl` sets) is the second control: NVML reports
its settable range, its default and the limit in force, so those are read, not remembered.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from numbers import Integral, Real

from kareus.errors import KareusError


@dataclass(frozen=True)
class GPUInfo:
    """A device's identity, as reported by `GPUDevice.info()`."""

    index: int
    uuid: str
    pci_bus_id: str
    name: str
    sm_count: int
    mig_enabled: bool


class GPUDevice(ABC):
    """One GPU: identity, supported clocks, SM clock control, energy and power readings."""

    index: int
    uuid: str
    pci_bus_id: str
    name: str
    sm_count: int

    @abstractmethod
    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        """Supported SM clocks at the highest memory clock, highest first."""

    @abstractmethod
    def lock_sm_clock(self, min_mhz: int, max_mhz: int) -> None:
        """Lock the SM clock into [min_mhz, max_mhz]; both must be supported clocks."""

    @abstractmethod
    def reset_sm_clock(self) -> None:
        """Return the SM clock to the driver's default policy."""

    @abstractmethod
    def energy_j(self) -> float:
        """Cumulative energy counter since an arbitrary origin, in joules."""

    @abstractmethod
    def power_w(self) -> float:
        """Current power draw in watts."""

    @abstractmethod
    def sm_clock_mhz(self) -> int:
        """Current SM clock in MHz."""

    @abstractmethod
    def locked_clock_mhz(self) -> int | None:
        """The upper end of the lock this backend set, None when not locked."""

    @abstractmethod
    def power_limit_range_w(self) -> tuple[float, float]:
        """The board's settable power-management limits (min, max) in watts."""

    @abstractmethod
    def default_power_limit_w(self) -> float:
        """The board's default power limit in watts (what a reset restores)."""

    @abstractmethod
    def power_limit_w(self) -> float:
        """The power limit in force now, in watts."""

    @abstractmethod
    def set_power_limit_w(self, watts: float) -> None:
        """Limit the board's power to `watts`, which must be within `power_limit_range_w()`."""

    @abstractmethod
    def reset_power_limit(self) -> None:
        """Return the board to its default power limit."""

    @abstractmethod
    def is_mig_enabled(self) -> bool:
        """Whether MIG partitions this GPU (clock control is then refused)."""

    def info(self) -> GPUInfo:
        return GPUInfo(self.index, self.uuid, self.pci_bus_id, self.name, self.sm_count, self.is_mig_enabled())

    def check_lock_range(self, min_mhz: int, max_mhz: int) -> None:
        """Raise a `KareusError` unless [min_mhz, max_mhz] is an ordered pair of supported clocks."""
        supported = self.supported_sm_clocks_mhz()
        for field, value in (("min_mhz", min_mhz), ("max_mhz", max_mhz)):
            if isinstance(value, bool) or not isinstance(value, Integral) or value not in supported:
                raise KareusError(f"{field} {value!r} is not a supported SM clock of {self.uuid}; allowed: "
                                  f"{_describe_clocks(supported)}")
        if min_mhz > max_mhz:
            raise KareusError(f"min_mhz {min_mhz} must be <= max_mhz {max_mhz}")

    def check_power_limit(self, watts: float) -> None:
        """Raise a `KareusError` unless `watts` is a number within the board's settable limits."""
        low, high = self.power_limit_range_w()
        if isinstance(watts, bool) or not isinstance(watts, Real) or not low <= watts <= high:
            raise KareusError(f"power limit {watts!r} W is outside the settable range {low:g}–{high:g} W of {self.uuid}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(index={self.index}, uuid={self.uuid!r}, name={self.name!r})"


def _describe_clocks(clocks: tuple[int, ...]) -> str:
    if len(clocks) < 3:
        return ", ".join(map(str, clocks))
    ordered = sorted(clocks)
    steps = {b - a for a, b in itertools.pairwise(ordered)}
    if len(steps) == 1:
        return f"{ordered[0]}..{ordered[-1]} MHz in steps of {steps.pop()}"
    return ", ".join(map(str, ordered))
