"""`bench/device_check.py`: runs on a bare machine (torch + nvidia-ml-py), exits 2 without a GPU,
and never changes a GPU (checked against the fake pynvml)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from kareus.profiler.kernels import payload
from tests.fakes import fake_pynvml

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "device_check.py"
HEAVY = ("pymoo", "xgboost", "scipy", "kopf", "kubernetes", "sklearn", "kareus")

# Runs the script with every heavy package unimportable, as on a machine with only torch and
# nvidia-ml-py; torch.cuda.is_available() is False here, so it must say so in one line.
BLOCKED_RUN = f"""
import runpy, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {HEAVY!r}:
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
sys.argv = [{str(SCRIPT)!r}]
runpy.run_path({str(SCRIPT)!r}, run_name="__main__")
"""


def _load():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_exits_2_with_one_line_and_imports_nothing_heavy():
    done = subprocess.run([sys.executable, "-c", BLOCKED_RUN], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stdout.splitlines() == ["device_check: no GPU to check: torch.cuda.is_available() is False"]
    assert "blocked" not in done.stderr


def test_nvml_is_read_only_by_construction():
    module = _load()
    fake_pynvml.reset(count=2)
    fake_pynvml.nvmlInit()
    nvml = module.ReadOnlyNVML(fake_pynvml)
    report = module.inventory(nvml)
    assert [g["uuid"] for g in report["gpus"]] == [d.uuid for d in fake_pynvml.devices()]
    assert report["gpus"][0]["supported_sm_clocks_mhz"][0] == 1410
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    module.energy_counter_updates(nvml, handle, window_s=0.0)
    for name in ("nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks", "nvmlDeviceSetPowerManagementLimit"):
        with pytest.raises(PermissionError):
            getattr(nvml, name)
    called = {call[0] for call in fake_pynvml.calls}
    assert not {c for c in called if c.startswith(("nvmlDeviceSet", "nvmlDeviceReset"))}
    assert all(d.lock_count == 0 and d.reset_count == 0 for d in fake_pynvml.devices())


def test_reads_nvml_cannot_answer_are_recorded_not_fatal():
    module = _load()
    fake_pynvml.reset(count=1)
    fake_pynvml.nvmlInit()
    fake_pynvml.fail("nvmlDeviceGetPowerUsage", fake_pynvml.NVML_ERROR_NOT_SUPPORTED)
    fake_pynvml.fail("nvmlDeviceGetPowerManagementLimit", fake_pynvml.NVML_ERROR_NO_PERMISSION)
    gpu = module.inventory(module.ReadOnlyNVML(fake_pynvml))["gpus"][0]
    assert gpu["power_w"] == {"error": "NVMLError_NotSupported: Not Supported"}
    assert gpu["power_limit_w"] == {"error": "NVMLError_NoPermission: Insufficient Permissions"}


def test_the_emulated_collective_moves_its_payload_not_twice_it():
    buffer = payload(8 << 20, "cpu")
    assert buffer.numel() * buffer.element_size() == 8 << 20
