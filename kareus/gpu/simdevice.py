"""A simulated GPU shared by processes, as one physical GPU is shared by everything reading NVML.

On the dev cluster's emulated nodes every simulated GPU is one state file,
`<KAREUS_SIM_GPU_DIR>/<uuid>.json`. The emulated device plugin names the directory to every
container that gets GPUs (and to the node agent, which asks for all of them with
`NVIDIA_VISIBLE_DEVICES=all`), the way the NVIDIA container runtime exposes the GPUs named in
`NVIDIA_VISIBLE_DEVICES`. The file holds what the hardware holds:

- `energy_j`: the total-energy counter (NVML's `nvmlDeviceGetTotalEnergyConsumption`);
- `busy_s`: the modelled GPU time the work accounted on it took;
- `locked_mhz`: the SM clock lock, so a lock the node agent sets is the lock every process sees,
  and it survives the agent's restart as a real GPU's does;
- `power_limit_w`: the board power limit the agent set (null: the board's default), which the
  ranks model their work under (`run_power_limit_w`), as a real board's controller throttles;
- `recent`: the last seconds of accounted work, stamped with `time.monotonic()` (one clock for every
  process of the machine on Linux), from which power is read.

Time on this GPU is the *modelled* time. The training runtime runs on CPU, where a step may take
longer than the GPU time the simulator models for it (a tiny model: about 0.34 s against 30 ms) or
less (the quickstart's CPU proxy of Llama 3.2 3B: about 0.6 s against 2.9 s; the runtime then
waits out the modelled time, `TwinEnergy.run_step`, so the power read here is the modelled GPU's);
the GPU has no time of its own between the modelled steps. So the counter only advances by the
work accounted on it — each step's modelled energy, whose static power over the modelled
iteration (bubbles included) is already in it (`kareus.runtime.energy.SimulatedEnergy`) — and
never by wall time: no idle energy between steps, none while nobody uses the GPU. That makes the
node agent's counter and the workers' per-step energy the same numbers by construction.

Power is, as NVML reports it, an average over a recent window of (wall) time, so that integrating
the power gauge gives the counter's rise, as on hardware. NVML averages over 1 s; here a step's
energy arrives as one lump every few tenths of a second of wall time, and a 1 s window sampled
every 2 s would see about half of the lumps (±1 step per sample), so the window is 2 s
(`POWER_WINDOW_S`), the dev cluster's scrape interval: consecutive scrapes' windows then tile time.

Every change is a read-modify-write under an exclusive `fcntl.flock` of `<uuid>.lock`, written
to a temporary file and renamed into place, so concurrent ranks and the agent never lose an
update and a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kareus.gpu.sim import SimulatedGPU
from kareus.sim.gpus import GPUSpec, get_gpu
from kareus.sim.measurement import Measurement

SIM_GPU_DIR_ENV = "KAREUS_SIM_GPU_DIR"
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
POWER_WINDOW_S = 2.0  # the dev cluster's scrape interval (see above; NVML itself averages over 1 s)
_RECENT_KEPT_S = 10.0  # accounted work older than this cannot be in any power window


class SimDeviceFile:
    """The state file of one shared simulated GPU."""

    def __init__(self, directory: str | os.PathLike[str], uuid: str, *, product: str = "") -> None:
        self.directory = Path(directory)
        self.uuid = uuid
        self.product = product
        self.path = self.directory / f"{uuid}.json"
        self._lock_path = self.directory / f"{uuid}.lock"

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def _load(self) -> dict[str, Any]:
        try:
            state = json.loads(self.path.read_text())
        except FileNotFoundError:  # a GPU nobody has read yet: a fresh counter
            state = {}
        return {"uuid": self.uuid, "product": self.product, "energy_j": 0.0, "busy_s": 0.0, "locked_mhz": None,
                "power_limit_w": None, "recent": [], **state}

    def read(self) -> dict[str, Any]:
        with self._locked(exclusive=False):
            return self._load()

    def update(self, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Apply `change` to the state under the exclusive lock; the state as written."""
        with self._locked(exclusive=True):
            state = self._load()
            change(state)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.path)
            return state

    def account(self, energy_j: float, time_s: float, clock_mhz: float, *, now_s: float) -> dict[str, Any]:
        """Add work: `energy_j` onto the counter, `time_s` of modelled busy time, stamped `now_s`."""

        def change(state: dict[str, Any]) -> None:
            state["energy_j"] = float(state["energy_j"]) + float(energy_j)
            state["busy_s"] = float(state["busy_s"]) + float(time_s)
            recent = [entry for entry in state["recent"] if entry[0] > now_s - _RECENT_KEPT_S]
            state["recent"] = [*recent, [now_s, float(energy_j), float(clock_mhz)]]

        return self.update(change)

    def set_lock(self, lock_mhz: tuple[int, int] | None) -> None:
        def change(state: dict[str, Any]) -> None:
            state["locked_mhz"] = list(lock_mhz) if lock_mhz else None

        self.update(change)

    def set_power_limit(self, power_limit_w: float | None) -> None:
        """The board limit in watts (None: the board's default)."""

        def change(state: dict[str, Any]) -> None:
            state["power_limit_w"] = power_limit_w

        self.update(change)


def recent_work(state: dict[str, Any], now_s: float, window_s: float = POWER_WINDOW_S) -> list[list[float]]:
    """The accounted work (stamp, joules, clock) within the last `window_s` before `now_s`."""
    return [entry for entry in state["recent"] if now_s - window_s < entry[0] <= now_s]


class SharedSimulatedGPU(SimulatedGPU):
    """A `SimulatedGPU` whose counter, lock and recent work live in its shared state file."""

    def __init__(self, spec: GPUSpec | str, index: int = 0, *, device_dir: str | os.PathLike[str],
                 node: str = "localhost", uuid: str | None = None, mig_enabled: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(spec, index, node=node, mig_enabled=mig_enabled, clock=clock, uuid=uuid)
        self.device = SimDeviceFile(device_dir, self.uuid, product=self.spec.name)

    # -- control: the lock and the power limit are the device's, whoever set them ------------
    def _load_state(self) -> tuple[tuple[int, int] | None, float | None]:
        return None, None  # not used: every read goes to the file

    def _save_lock(self) -> None:
        self.device.set_lock(self._lock_range)

    def _save_power_limit(self) -> None:
        self.device.set_power_limit(self._power_limit)

    def run_power_limit_w(self) -> float | None:
        limit = self.device.read()["power_limit_w"]
        return None if limit is None else float(limit)

    def locked_range_mhz(self) -> tuple[int, int] | None:
        locked = self.device.read()["locked_mhz"]
        return (int(locked[0]), int(locked[1])) if locked else None

    def locked_clock_mhz(self) -> int | None:
        locked = self.locked_range_mhz()
        return None if locked is None else locked[1]

    # -- measurement ---------------------------------------------------------------------------
    def energy_j(self) -> float:
        return float(self.device.read()["energy_j"])

    def busy_s(self) -> float:
        """Modelled GPU time of the work accounted on this GPU so far."""
        return float(self.device.read()["busy_s"])

    def power_w(self) -> float:
        """The energy accounted in the last `POWER_WINDOW_S` of wall time over that window."""
        recent = recent_work(self.device.read(), self._clock())
        return sum(joules for _, joules, _ in recent) / POWER_WINDOW_S

    def sm_clock_mhz(self) -> int:
        state = self.device.read()
        recent = recent_work(state, self._clock())
        if recent:
            return round(recent[-1][2])  # the clock the latest work ran at
        locked = state["locked_mhz"]
        return int(locked[0]) if locked else self.spec.clock_min_mhz  # parked low unless a lock holds it

    def account(self, measurement: Measurement) -> None:
        self.account_work(measurement.energy_j, measurement.time_s, measurement.avg_clock_mhz)

    def account_work(self, energy_j: float, time_s: float, clock_mhz: float | None = None) -> None:
        """Add modelled work (its energy and GPU time) at `clock_mhz` (default: the clock work runs at now)."""
        self.device.account(energy_j, time_s, self.run_clock_mhz() if clock_mhz is None else clock_mhz,
                            now_s=self._clock())


def discover_shared(count: int = 1, product: str = "A100-SXM4-40GB", *, device_dir: str | os.PathLike[str],
                    node: str = "localhost", mig_indices: tuple[int, ...] = (),
                    clock: Callable[[], float] = time.monotonic) -> list[SharedSimulatedGPU]:
    """The node's `count` shared simulated GPUs of `product` in `device_dir` (their lock lives in
    the device, so no state directory)."""
    spec = get_gpu(product)
    return [SharedSimulatedGPU(spec, index, device_dir=device_dir, node=node, mig_enabled=index in mig_indices,
                               clock=clock) for index in range(count)]


def visible_uuids(value: str | None) -> list[str]:
    """The GPU UUIDs an `NVIDIA_VISIBLE_DEVICES` value names (not `all`, `none` or indices)."""
    return [u.strip() for u in (value or "").split(",") if u.strip().startswith("GPU-")]


def sim_index(uuid: str) -> int:
    """The index in a simulated GPU's UUID (`GPU-sim-<index>-…`), 0 when it has none."""
    parts = uuid.split("-")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "sim" and parts[2].isdecimal() else 0
