"""The NVML profiler against the fake NVML module: window arithmetic, clock locking, resets on
every exit path. The work itself runs for real with torch on the CPU; no GPU is needed."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from kareus.errors import KareusError
from kareus.gpu import discover
from kareus.profiler import kernels
from kareus.profiler.nvml import NvmlBackend, WindowSettings, locked_clock, measure_window
from kareus.search.problem import Candidate
from kareus.workload.models import get_preset
from kareus.workload.partitions import build_workload
from tests.fakes import fake_pynvml

FAKE = "tests.fakes.fake_pynvml"


@pytest.fixture
def gpus():
    fake_pynvml.reset(count=2)
    return discover("nvml", module=FAKE)


@pytest.fixture
def workload():
    return build_workload(get_preset("tiny"), tp=2, cp=1, pp=1, seq_len=64, micro_batch_size=4)


class FakeClock:
    """Time that only moves when the test says so; sleeping lets the fake GPUs burn energy."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds
        fake_pynvml.advance(seconds)


class Kernel:
    """A run that takes `run_s` of fake time on the fake GPUs."""

    def __init__(self, clock: FakeClock, run_s: float) -> None:
        self.clock, self.run_s, self.runs = clock, run_s, 0

    def run(self) -> None:
        self.runs += 1
        self.clock.sleep(self.run_s)

    def synchronize(self) -> None:
        return None


def test_window_fills_the_measurement_time_and_divides_energy_per_run_and_gpu(gpus):
    fake_pynvml.devices()[0].power_w = 300.0
    fake_pynvml.devices()[1].power_w = 100.0
    clock = FakeClock()
    kernel = Kernel(clock, 0.002)
    settings = WindowSettings(measurement_s=1.0, cooldown_s=3.0, warmup_runs=3)
    time_s, energy_j = measure_window(gpus, [kernel], settings, now=clock.now, sleep=clock.sleep)
    assert time_s == pytest.approx(0.002)
    # Both GPUs burn their power during the window: (300 + 100) W × 2 ms, per GPU.
    assert energy_j == pytest.approx((300.0 + 100.0) * 0.002 / 2, rel=1e-6)
    repetitions = math.ceil(1.0 / 0.002)
    assert kernel.runs == 3 + 1 + 1 + repetitions  # warm-up, calibration, re-warm, window


def test_time_is_the_slowest_gpu_and_energy_sums_over_gpus(gpus):
    clock = FakeClock()
    fast, slow = Kernel(clock, 0.001), Kernel(clock, 0.003)
    time_s, energy_j = measure_window(gpus, [fast, slow], WindowSettings(0.1, 0.0, 1), now=clock.now,
                                      sleep=clock.sleep)
    # The fake runs the two GPUs' kernels back to back, so the window is their sum; the real
    # backend launches them asynchronously and the window ends with the slowest.
    assert time_s == pytest.approx(0.004)
    assert energy_j == pytest.approx(85.0 * 0.004, rel=1e-6)


def test_partitions_are_measured_with_clocks_locked_and_reset_after_each(gpus, workload):
    sleeps = []
    backend = NvmlBackend(num_gpus=2, devices=gpus, measurement_s=0.002, cooldown_s=5.0, warmup_runs=1,
                          torch_devices=["cpu", "cpu"], scale=1e-3, sleep=sleeps.append)
    ptype = workload.partition_types["fwd_mlp"]
    candidates = [Candidate(1410, 3, "norm_0"), Candidate(900, 6, "linear_0")]
    results = backend.measure_partitions(ptype, candidates)
    assert len(results) == 2 and all(t > 0 for t, _ in results)
    locks = [(uuid, args) for _, uuid, args in fake_pynvml.calls_of("nvmlDeviceSetGpuLockedClocks")]
    assert [args for _, args in locks] == [(1410, 1410)] * 2 + [(900, 900)] * 2
    assert {uuid for uuid, _ in locks} == {gpu.uuid for gpu in gpus}
    assert all(device.locked_mhz is None for device in fake_pynvml.devices())
    assert [device.reset_count for device in fake_pynvml.devices()] == [2, 2]
    assert 5.0 in sleeps  # the cooldown
    assert backend.p_static_w == 85.0  # the A100 preset
    assert backend.supported_clocks_mhz()[0] == 1410


def test_only_the_jobs_gpus_are_touched():
    fake_pynvml.reset(count=4)
    backend = NvmlBackend(num_gpus=2, devices=discover("nvml", module=FAKE), measurement_s=0.001,
                          cooldown_s=0.0, warmup_runs=0, torch_devices=["cpu", "cpu"], scale=1e-3,
                          sleep=lambda s: None)
    backend.measure_work("nonpartition", _stage(), "forward", 1200)
    touched = {uuid for _, uuid, _ in fake_pynvml.calls_of("nvmlDeviceSetGpuLockedClocks")}
    assert touched == {d.uuid for d in fake_pynvml.devices()[:2]}
    assert all(d.lock_count == 0 for d in fake_pynvml.devices()[2:])


def _stage():
    return build_workload(get_preset("tiny"), tp=2, cp=1, pp=1, seq_len=64, micro_batch_size=4).stages[0]


@pytest.mark.parametrize("error", [RuntimeError("CUDA error: out of memory"), KeyboardInterrupt()])
def test_clocks_are_reset_when_the_workload_fails(gpus, workload, monkeypatch, error):
    def explode(self):
        raise error

    monkeypatch.setattr(kernels.EmulatedPartition, "run", explode)
    backend = NvmlBackend(num_gpus=2, devices=gpus, measurement_s=0.01, cooldown_s=0.0,
                          torch_devices=["cpu", "cpu"], scale=1e-3, sleep=lambda s: None)
    with pytest.raises(type(error)):
        backend.measure_partitions(workload.partition_types["fwd_attn"], [Candidate(1200, 3, "norm_0")])
    assert [d.locked_mhz for d in fake_pynvml.devices()] == [None, None]
    assert [d.reset_count for d in fake_pynvml.devices()] == [1, 1]


def test_a_lock_failing_half_way_still_resets_every_gpu(gpus):
    fake_pynvml.fail("nvmlDeviceSetGpuLockedClocks", fake_pynvml.NVML_ERROR_NO_PERMISSION,
                     uuid=gpus[1].uuid)
    with pytest.raises(KareusError, match="Insufficient Permissions"), locked_clock(gpus, 1200):
        pass
    assert fake_pynvml.devices()[0].locked_mhz is None
    assert [d.reset_count for d in fake_pynvml.devices()] == [1, 1]


def test_close_resets_only_what_is_still_locked_and_bad_setups_are_clear_errors(gpus):
    """Fails where close() resets every GPU: it locked none here."""
    backend = NvmlBackend(num_gpus=1, devices=gpus, torch_devices=["cpu"])
    with backend:
        pass
    assert fake_pynvml.devices()[0].reset_count == 0
    with pytest.raises(KareusError, match="needs 4 GPUs"):
        NvmlBackend(num_gpus=4, devices=gpus, torch_devices=["cpu"] * 4)
    fake_pynvml.devices()[0].mig_enabled = True
    with pytest.raises(KareusError, match="MIG"):
        NvmlBackend(num_gpus=1, devices=gpus, torch_devices=["cpu"])
    fake_pynvml.reset(count=1)
    fake_pynvml.fail_init()
    with pytest.raises(KareusError, match="NVML is not available"):
        NvmlBackend(num_gpus=1, nvml_module=FAKE)


def test_a_backend_measuring_under_the_daemons_lock_never_resets_a_clock(gpus, workload):
    """Fails where close() resets clocks it did not lock (NO_PERMISSION in an unprivileged pod, or
    the daemon's lock undone)."""
    fake_pynvml.fail("nvmlDeviceResetGpuLockedClocks", fake_pynvml.NVML_ERROR_NO_PERMISSION, times=10)
    with NvmlBackend(num_gpus=2, devices=gpus, measurement_s=0.001, cooldown_s=0.0, warmup_runs=0,
                     torch_devices=["cpu", "cpu"], scale=1e-3, sleep=lambda s: None, lock_clocks=False) as backend:
        backend.measure_partitions(workload.partition_types["fwd_mlp"], [Candidate(1200, 3, "norm_0")])
    assert fake_pynvml.calls_of("nvmlDeviceSetGpuLockedClocks") == []
    assert fake_pynvml.calls_of("nvmlDeviceResetGpuLockedClocks") == []


def test_a_reset_that_failed_is_retried_by_close_and_then_nothing_is_held(gpus):
    backend = NvmlBackend(num_gpus=2, devices=gpus, torch_devices=["cpu", "cpu"])
    fake_pynvml.fail("nvmlDeviceResetGpuLockedClocks", fake_pynvml.NVML_ERROR_UNKNOWN, uuid=gpus[1].uuid)
    with pytest.raises(KareusError, match="could not reset"), locked_clock(gpus, 1200, backend._holding):
        pass
    assert backend._holding == {gpus[0].uuid, gpus[1].uuid}  # reset_all cannot say which one failed
    backend.close()
    assert [d.locked_mhz for d in fake_pynvml.devices()] == [None, None]
    assert backend._holding == set()
    backend.close()  # nothing held: nothing reset again
    assert [d.reset_count for d in fake_pynvml.devices()] == [2, 1]  # GPU 1's first reset failed


def test_nvml_devices_are_paired_with_cuda_devices_by_uuid(monkeypatch):
    """Fails on pairing by index: with CUDA_VISIBLE_DEVICES=2,3 cuda:0 is NVML's device 2, not 0."""
    import torch

    fake = fake_pynvml.reset(count=4)
    visible = [fake[2].uuid.removeprefix("GPU-"), fake[3].uuid.removeprefix("GPU-")]  # torch's spelling
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid=visible[index]))
    backend = NvmlBackend(num_gpus=2, nvml_module=FAKE)
    assert [d.uuid for d in backend.devices] == [fake[2].uuid, fake[3].uuid]
    assert backend.torch_devices == ["cuda:0", "cuda:1"]
    with locked_clock(backend.devices, 1200, backend._holding):
        pass
    assert {uuid for _, uuid, _ in fake_pynvml.calls_of("nvmlDeviceSetGpuLockedClocks")} == {fake[2].uuid, fake[3].uuid}
    with pytest.raises(KareusError, match="needs 3 GPUs per partition group; CUDA sees 2"):
        NvmlBackend(num_gpus=3, nvml_module=FAKE)
    visible[1] = "deadbeef-0000-0000-0000-000000000000"  # a GPU NVML does not know: never a guess
    with pytest.raises(KareusError, match="not among the GPUs NVML sees"):
        NvmlBackend(num_gpus=2, nvml_module=FAKE)
