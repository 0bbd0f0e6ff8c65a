"""`bench/gpu_check.py` degrades to one clear line and exit status 2 without a usable GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.fakes import fake_pynvml

FAKE = "tests.fakes.fake_pynvml"
SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("setup", "message"), [
    (lambda: fake_pynvml.fail_init(), "NVML is not available"),
    (lambda: None, "NVML sees no GPU"),
])
def test_no_gpu_is_exit_2_with_one_line(setup, message, tmp_path, capsys):
    fake_pynvml.reset(count=0)
    setup()
    code = _gpu_check().main(["--nvml-module", FAKE, "--out", str(tmp_path / "r.json")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpu_check: ") and message in err and "\n" not in err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_nvml_without_cuda_torch_is_exit_2_and_touches_no_clock(tmp_path, capsys):
    fake_pynvml.reset(count=1)
    code = _gpu_check().main(["--nvml-module", FAKE, "--out", str(tmp_path / "r.json"), "--allow-clock-control"])
    assert code == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err
    assert fake_pynvml.calls_of("nvmlDeviceSetGpuLockedClocks") == []
