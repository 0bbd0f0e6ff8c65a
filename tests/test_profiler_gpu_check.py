"""`bench/gpu_check.py` is folded into the device check: it forwards to it (one line and exit 2
without a usable GPU), refuses the clock control it used to offer, and the no-GPU reasons it used
to give are the device check's."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.fakes import fake_pynvml

FAKE = "tests.fakes.fake_pynvml"
BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_it_forwards_to_the_device_check_which_says_no_gpu_in_one_line(tmp_path, capsys):
    fake_pynvml.reset(count=1)
    code = _load("gpu_check").main(["--nvml-module", FAKE, "--out", str(tmp_path / "r.json")])
    assert code == 2
    assert capsys.readouterr().out.splitlines() == ["device_check: no GPU to check: torch.cuda.is_available() is False"]
    assert not (tmp_path / "r.json").exists()
    assert fake_pynvml.calls == []  # torch said no before NVML was touched


def test_clock_control_is_refused_before_anything_runs(tmp_path, capsys):
    fake_pynvml.reset(count=1)
    code = _load("gpu_check").main(["--nvml-module", FAKE, "--out", str(tmp_path / "r.json"), "--allow-clock-control"])
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpu_check: --allow-clock-control was removed") and "\n" not in err
    assert fake_pynvml.calls == [] and not (tmp_path / "r.json").exists()


CUDA_TORCH = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))


@pytest.mark.parametrize(("setup", "message"), [
    (lambda: fake_pynvml.fail_init(), "NVML is not available"),
    (lambda: None, "NVML sees no GPU"),
])
def test_no_usable_nvml_is_a_reason_not_a_crash(setup, message):
    fake_pynvml.reset(count=0)
    setup()
    nvml, reason = _load("device_check").find_gpu(CUDA_TORCH, FAKE)
    assert nvml is None and message in reason and "\n" not in reason
    assert fake_pynvml.calls_of("nvmlDeviceSetGpuLockedClocks") == []


def test_a_gpu_nvml_sees_comes_back_read_only():
    fake_pynvml.reset(count=1)
    check = _load("device_check")
    nvml, reason = check.find_gpu(CUDA_TORCH, FAKE)
    assert reason is None and isinstance(nvml, check.ReadOnlyNVML)
    assert _load("device_check").find_gpu(None)[1] == "torch is not installed"
