"""The simulated GPU backend: a `GPUDevice` whose physics come from `kareus.sim`.

A `SimulatedGPU` validates locks against its preset's clock list, keeps the lock it was given,
and runs an energy counter that advances with wall time at idle power (P_static) when nothing
runs. Work is accounted onto it with `account(measurement)` — a simulated partition or
instruction: the counter gains the measurement's energy and the following `time_s` of wall time
count as busy at the measured average power instead of idle. So a training run on CPU reads real
looking energy deltas from the same interface the NVML backend offers.

The board power limit is the preset's `power_limit_w` (settable within `power_limit_min_w` and
it, as `nvidia-smi -pl`). Work on a limited GPU is modelled on the preset under the limit in force
(`kareus.sim.replica.power_limited`, through `kareus.runtime.energy.SimulatedEnergy`), whose power
controller throttles each phase to the limit, so a limited GPU draws less; a training rank on a
shared device reads the limit the node agent set from the device (`run_power_limit_w`).

Locks and power limits can persist in a state directory (one JSON file per GPU, written
atomically), so that a restarted process — the node daemon after SIGKILL — sees the GPU still
locked and limited until it resets it, as a real GPU would.

A GPU shared by processes — the node agent and the pods allocated it — is
`kareus.gpu.simdevice.SharedSimulatedGPU`, built on this class in that module (`discover("sim",
device_dir=...)`); this module knows nothing of it, so the package has one direction: `device` ←
`sim` ← `simdevice`.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid as uuidlib
from collections.abc import Callable
from pathlib import Path

from kareus.gpu.device import GPUDevice
from kareus.sim.gpus import GPUSpec, get_gpu
from kareus.sim.measurement import Measurement

_UUID_NAMESPACE = uuidlib.UUID("6c1f3a0e-6b3f-4d0a-9e4b-4b617265757a")


def sim_uuid(node: str, product: str, index: int) -> str:
    """Deterministic UUID of simulated GPU `index` on `node`: `GPU-sim-<index>-<uuid5>`."""
    digest = uuidlib.uuid5(_UUID_NAMESPACE, f"{node}/{product}/{index}")
    return f"GPU-sim-{index}-{digest}"


class SimulatedGPU(GPUDevice):
    """A GPU of a `GPUSpec` preset with an energy counter driven by wall time and accounted work."""

    def __init__(self, spec: GPUSpec | str, index: int = 0, *, node: str = "localhost", mig_enabled: bool = False,
                 state_dir: str | os.PathLike[str] | None = None, clock: Callable[[], float] = time.monotonic,
                 uuid: str | None = None) -> None:
        self.spec = get_gpu(spec) if isinstance(spec, str) else spec
        self.index = index
        self.name = f"NVIDIA {self.spec.name}"
        self.sm_count = self.spec.sms
        self.uuid = uuid or sim_uuid(node, self.spec.name, index)
        self.pci_bus_id = f"00000000:{0x07 + 0x10 * index:02X}:00.0"
        self._mig = mig_enabled
        self._clock = clock
        self._mutex = threading.Lock()
        self._energy_j = 0.0
        self._last_s = clock()
        self._busy_until_s = self._last_s
        self._busy_power_w = self.spec.idle_power_w
        self._busy_clock_mhz = self.spec.clock_max_mhz
        self._state_path = Path(state_dir) / f"sim-gpu-{self.uuid}.json" if state_dir is not None else None
        self._lock_range, self._power_limit = self._load_state()
        self.lock_changes = 0

    # -- control -------------------------------------------------------------------------------
    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        return self.spec.supported_clocks_mhz

    def lock_sm_clock(self, min_mhz: int, max_mhz: int) -> None:
        self.check_lock_range(min_mhz, max_mhz)
        with self._mutex:
            self._lock_range = (int(min_mhz), int(max_mhz))
            self.lock_changes += 1
            self._save_lock()

    def reset_sm_clock(self) -> None:
        with self._mutex:
            self._lock_range = None
            self.lock_changes += 1
            self._save_lock()

    def locked_clock_mhz(self) -> int | None:
        with self._mutex:
            return None if self._lock_range is None else self._lock_range[1]

    def locked_range_mhz(self) -> tuple[int, int] | None:
        with self._mutex:
            return self._lock_range

    def is_mig_enabled(self) -> bool:
        return self._mig

    # -- the board power limit -----------------------------------------------------------------
    def power_limit_range_w(self) -> tuple[float, float]:
        return float(self.spec.power_limit_min_w), float(self.spec.power_limit_w)

    def default_power_limit_w(self) -> float:
        return float(self.spec.power_limit_w)

    def power_limit_w(self) -> float:
        limit = self.run_power_limit_w()
        return self.default_power_limit_w() if limit is None else limit

    def run_power_limit_w(self) -> float | None:
        """The limit work runs under now; None at the board's default (no limit below it)."""
        with self._mutex:
            return self._power_limit

    def set_power_limit_w(self, watts: float) -> None:
        self.check_power_limit(watts)
        with self._mutex:
            self._power_limit = None if watts >= self.spec.power_limit_w else float(watts)
            self._save_power_limit()

    def reset_power_limit(self) -> None:
        with self._mutex:
            self._power_limit = None
            self._save_power_limit()

    # -- measurement ---------------------------------------------------------------------------
    def energy_j(self) -> float:
        with self._mutex:
            self._advance()
            return self._energy_j

    def power_w(self) -> float:
        with self._mutex:
            self._advance()
            return self._busy_power_w if self._last_s < self._busy_until_s else self.spec.idle_power_w

    def sm_clock_mhz(self) -> int:
        with self._mutex:
            self._advance()
            if self._last_s < self._busy_until_s:
                return round(self._busy_clock_mhz)
            # Idle: the driver parks the clock low unless a lock holds it.
            return self._lock_range[0] if self._lock_range else self.spec.clock_min_mhz

    def run_clock_mhz(self) -> int:
        """The clock work runs at now: the lock's upper end, or the maximum clock when unlocked."""
        locked = self.locked_clock_mhz()
        return self.spec.clock_max_mhz if locked is None else locked

    def account(self, measurement: Measurement) -> None:
        """Add simulated work: its energy goes onto the counter and the next `time_s` of wall time
        are busy at its average power (no idle energy is counted for them)."""
        with self._mutex:
            self._advance()
            self._energy_j += measurement.energy_j
            start = max(self._busy_until_s, self._last_s)
            self._busy_until_s = start + measurement.time_s
            self._busy_power_w = measurement.avg_power_w
            self._busy_clock_mhz = measurement.avg_clock_mhz

    def _advance(self) -> None:
        now = self._clock()
        idle_from = max(self._last_s, self._busy_until_s)
        if now > idle_from:
            self._energy_j += (now - idle_from) * self.spec.idle_power_w
        self._last_s = max(now, self._last_s)

    # -- persistence ---------------------------------------------------------------------------
    def _load_state(self) -> tuple[tuple[int, int] | None, float | None]:
        """(lock, power limit) as a previous process left them (files of older versions: no limit)."""
        if self._state_path is None or not self._state_path.exists():
            return None, None
        data = json.loads(self._state_path.read_text())
        locked, limit = data.get("locked_mhz"), data.get("power_limit_w")
        return (int(locked[0]), int(locked[1])) if locked else None, None if limit is None else float(limit)

    def _save_lock(self) -> None:
        self._save_state()

    def _save_power_limit(self) -> None:
        self._save_state()

    def _save_state(self) -> None:
        if self._state_path is None:
            return
        self._state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._state_path.with_suffix(".tmp")
        with open(tmp, "w") as handle:
            json.dump({"uuid": self.uuid, "locked_mhz": list(self._lock_range) if self._lock_range else None,
                       "power_limit_w": self._power_limit}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self._state_path)


def discover_sim(count: int = 1, product: str = "A100-SXM4-40GB", *, node: str = "localhost",
                 mig_indices: tuple[int, ...] = (), state_dir: str | os.PathLike[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> list[SimulatedGPU]:
    """`count` simulated GPUs of `product` on `node`, each this process's own (for the node's
    shared devices see `kareus.gpu.simdevice.discover_shared`)."""
    spec = get_gpu(product)
    return [SimulatedGPU(spec, index, node=node, mig_enabled=index in mig_indices, state_dir=state_dir, clock=clock)
            for index in range(count)]
