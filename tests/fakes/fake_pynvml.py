"""A fake `pynvml` module for tests: the subset of nvidia-ml-py that Kareus calls, with state.

Use it in place of the real module (`discover("nvml", module="tests.fakes.fake_pynvml")`, or
`monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml)`). Call `reset(...)` first; it installs
fresh devices and clears the call log. The fake records every call (`calls`: list of
(function, uuid or None, args)), keeps locked clocks and power limits (mW) per device, runs each device's cumulative
energy counter (mJ) at its `power_w` on a clock you control (`advance(seconds)`), reports MIG mode,
UUIDs and PCI bus ids, and injects failures: `fail("nvmlDeviceSetGpuLockedClocks",
NVML_ERROR_NO_PERMISSION, times=1, uuid=None)`; `fail_init(NVML_ERROR_LIBRARY_NOT_FOUND)` makes
`nvmlInit` fail like a machine without the driver.

Only tests use this module's global state; every test starts with `reset`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_UNKNOWN = 999

NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_TEMPERATURE_GPU = 0

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """Like pynvml's: `NVMLError(code)` builds the subclass for the code; `.value` is the code."""

    _by_code: ClassVar[dict[int, type[NVMLError]]] = {}

    def __new__(cls, value: int) -> NVMLError:
        target = NVMLError._by_code.get(value, cls) if cls is NVMLError else cls
        obj = Exception.__new__(target)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML error {self.value}")


def _error_class(name: str, code: int) -> type[NVMLError]:
    cls = type(name, (NVMLError,), {})
    NVMLError._by_code[code] = cls
    return cls


NVMLError_Uninitialized = _error_class("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_InvalidArgument = _error_class("NVMLError_InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_NotSupported = _error_class("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NoPermission = _error_class("NVMLError_NoPermission", NVML_ERROR_NO_PERMISSION)
NVMLError_NotFound = _error_class("NVMLError_NotFound", NVML_ERROR_NOT_FOUND)
NVMLError_GpuIsLost = _error_class("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)
NVMLError_LibraryNotFound = _error_class("NVMLError_LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)


@dataclass
class FakeDevice:
    """One fake GPU. `mig_supported=False` makes `nvmlDeviceGetMigMode` raise NotSupported."""

    uuid: str
    pci_bus_id: str
    name: str = "NVIDIA A100-SXM4-40GB"
    sm_count: int = 108
    memory_clocks_mhz: tuple[int, ...] = (1215,)
    graphics_clocks_mhz: tuple[int, ...] = tuple(range(1410, 209, -15))
    power_w: float = 85.0
    temperature_c: int = 30
    mig_enabled: bool = False
    mig_supported: bool = True
    energy_mj: float = 0.0
    locked_mhz: tuple[int, int] | None = None
    lock_count: int = 0
    reset_count: int = 0
    power_limit_range_mw: tuple[int, int] = (100_000, 400_000)
    default_power_limit_mw: int = 400_000
    power_limit_mw: int = 400_000

    @property
    def sm_clock_mhz(self) -> int:
        return self.locked_mhz[1] if self.locked_mhz else max(self.graphics_clocks_mhz)


@dataclass
class _PciInfo:
    busId: str
    busIdLegacy: str


@dataclass
class _Attributes:
    multiprocessorCount: int


@dataclass
class _State:
    devices: list[FakeDevice] = field(default_factory=list)
    initialized: bool = False
    init_error: int | None = None
    calls: list[tuple[str, str | None, tuple[Any, ...]]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)


_state = _State()
calls = _state.calls


def default_devices(count: int = 2, name: str = "NVIDIA A100-SXM4-40GB") -> list[FakeDevice]:
    return [FakeDevice(uuid=f"GPU-fake-{index:04d}-0000-0000-0000-000000000000",
                       pci_bus_id=f"00000000:{0x07 + 0x10 * index:02X}:00.0", name=name) for index in range(count)]


def reset(devices: list[FakeDevice] | None = None, *, count: int = 2) -> list[FakeDevice]:
    """Fresh state: `devices` (or `count` default A100s), uninitialised, no calls, no failures."""
    global _state, calls
    _state = _State(devices=list(devices) if devices is not None else default_devices(count))
    calls = _state.calls
    return _state.devices


def devices() -> list[FakeDevice]:
    return _state.devices


def advance(seconds: float) -> None:
    """Let `seconds` pass: every energy counter grows by its power × seconds."""
    for device in _state.devices:
        device.energy_mj += device.power_w * seconds * 1000.0


def fail(function: str, code: int = NVML_ERROR_UNKNOWN, *, times: int = 1, uuid: str | None = None) -> None:
    """The next `times` calls of `function` (on `uuid`, or any device) raise NVMLError(code)."""
    _state.failures.append({"function": function, "code": code, "times": times, "uuid": uuid})


def fail_init(code: int = NVML_ERROR_LIBRARY_NOT_FOUND) -> None:
    _state.init_error = code


def calls_of(function: str) -> list[tuple[str, str | None, tuple[Any, ...]]]:
    return [call for call in _state.calls if call[0] == function]


def _enter(function: str, handle: FakeDevice | None = None, *args: Any, needs_init: bool = True) -> None:
    uuid = handle.uuid if isinstance(handle, FakeDevice) else None
    _state.calls.append((function, uuid, args))
    if needs_init and not _state.initialized:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    for failure in _state.failures:
        if failure["function"] == function and failure["times"] > 0 and failure["uuid"] in (None, uuid):
            failure["times"] -= 1
            raise NVMLError(failure["code"])


# -- the pynvml API ---------------------------------------------------------------------------
def nvmlInit() -> None:
    _enter("nvmlInit", needs_init=False)
    if _state.init_error is not None:
        raise NVMLError(_state.init_error)
    _state.initialized = True


def nvmlShutdown() -> None:
    _enter("nvmlShutdown")
    _state.initialized = False


def nvmlDeviceGetCount() -> int:
    _enter("nvmlDeviceGetCount")
    return len(_state.devices)


def nvmlDeviceGetHandleByIndex(index: int) -> FakeDevice:
    _enter("nvmlDeviceGetHandleByIndex", None, index)
    if not 0 <= index < len(_state.devices):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return _state.devices[index]


def nvmlDeviceGetHandleByUUID(uuid: str) -> FakeDevice:
    _enter("nvmlDeviceGetHandleByUUID", None, uuid)
    for device in _state.devices:
        if device.uuid == uuid:
            return device
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetUUID(handle: FakeDevice) -> str:
    _enter("nvmlDeviceGetUUID", handle)
    return handle.uuid


def nvmlDeviceGetName(handle: FakeDevice) -> str:
    _enter("nvmlDeviceGetName", handle)
    return handle.name


def nvmlDeviceGetPciInfo(handle: FakeDevice) -> _PciInfo:
    _enter("nvmlDeviceGetPciInfo", handle)
    return _PciInfo(handle.pci_bus_id, handle.pci_bus_id[4:])


def nvmlDeviceGetAttributes(handle: FakeDevice) -> _Attributes:
    _enter("nvmlDeviceGetAttributes", handle)
    return _Attributes(handle.sm_count)


def nvmlDeviceGetSupportedMemoryClocks(handle: FakeDevice) -> list[int]:
    _enter("nvmlDeviceGetSupportedMemoryClocks", handle)
    return list(handle.memory_clocks_mhz)


def nvmlDeviceGetSupportedGraphicsClocks(handle: FakeDevice, memory_clock_mhz: int) -> list[int]:
    _enter("nvmlDeviceGetSupportedGraphicsClocks", handle, memory_clock_mhz)
    if memory_clock_mhz not in handle.memory_clocks_mhz:
        raise NVMLError(NVML_ERROR_NOT_FOUND)
    return list(handle.graphics_clocks_mhz)


def nvmlDeviceSetGpuLockedClocks(handle: FakeDevice, min_mhz: int, max_mhz: int) -> None:
    _enter("nvmlDeviceSetGpuLockedClocks", handle, min_mhz, max_mhz)
    if handle.mig_enabled:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    if min_mhz > max_mhz:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    handle.locked_mhz = (min_mhz, max_mhz)
    handle.lock_count += 1


def nvmlDeviceResetGpuLockedClocks(handle: FakeDevice) -> None:
    _enter("nvmlDeviceResetGpuLockedClocks", handle)
    handle.locked_mhz = None
    handle.reset_count += 1


def nvmlDeviceGetPowerManagementLimitConstraints(handle: FakeDevice) -> list[int]:
    _enter("nvmlDeviceGetPowerManagementLimitConstraints", handle)
    return list(handle.power_limit_range_mw)


def nvmlDeviceGetPowerManagementDefaultLimit(handle: FakeDevice) -> int:
    _enter("nvmlDeviceGetPowerManagementDefaultLimit", handle)
    return handle.default_power_limit_mw


def nvmlDeviceGetPowerManagementLimit(handle: FakeDevice) -> int:
    _enter("nvmlDeviceGetPowerManagementLimit", handle)
    return handle.power_limit_mw


def nvmlDeviceSetPowerManagementLimit(handle: FakeDevice, limit_mw: int) -> None:
    _enter("nvmlDeviceSetPowerManagementLimit", handle, limit_mw)
    low, high = handle.power_limit_range_mw
    if not isinstance(limit_mw, int) or not low <= limit_mw <= high:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    handle.power_limit_mw = limit_mw


def nvmlDeviceGetTotalEnergyConsumption(handle: FakeDevice) -> int:
    _enter("nvmlDeviceGetTotalEnergyConsumption", handle)
    return int(handle.energy_mj)


def nvmlDeviceGetPowerUsage(handle: FakeDevice) -> int:
    _enter("nvmlDeviceGetPowerUsage", handle)
    return round(handle.power_w * 1000)


def nvmlDeviceGetClockInfo(handle: FakeDevice, clock_type: int) -> int:
    _enter("nvmlDeviceGetClockInfo", handle, clock_type)
    if clock_type == NVML_CLOCK_MEM:
        return max(handle.memory_clocks_mhz)
    return handle.sm_clock_mhz


def nvmlDeviceGetTemperature(handle: FakeDevice, sensor: int) -> int:
    _enter("nvmlDeviceGetTemperature", handle, sensor)
    return handle.temperature_c


def nvmlDeviceGetMigMode(handle: FakeDevice) -> tuple[int, int]:
    _enter("nvmlDeviceGetMigMode", handle)
    if not handle.mig_supported:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    mode = NVML_DEVICE_MIG_ENABLE if handle.mig_enabled else NVML_DEVICE_MIG_DISABLE
    return mode, mode
