"""A rank's NVML energy counter is its own GPU's, found by UUID, or an error — never a guess."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from kareus.errors import KareusError
from kareus.runtime import trainer
from kareus.runtime.energy import MeasuredEnergy
from tests.fakes import fake_pynvml


@pytest.fixture
def nvml(monkeypatch):
    """Two fake GPUs behind `pynvml`; `cuda(uuid)` makes CUDA device 0 report `uuid`."""
    devices = fake_pynvml.reset(count=2)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml)

    def cuda(uuid: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid=uuid))

    return SimpleNamespace(devices=devices, cuda=cuda)


def _bare(uuid: str) -> str:
    return uuid.removeprefix("GPU-")  # torch reports UUIDs without NVML's prefix


def test_the_counter_is_the_gpu_with_the_cuda_uuid_not_the_cuda_index(nvml):
    nvml.cuda(_bare(nvml.devices[1].uuid))  # CUDA_VISIBLE_DEVICES=1: cuda:0 is NVML's GPU 1
    meter = MeasuredEnergy(0)
    assert meter.uuid == nvml.devices[1].uuid
    fake_pynvml.devices()[1].energy_mj += 2500.0
    assert meter.lap_j() == pytest.approx(2.5)


def test_an_unknown_uuid_is_refused(nvml):
    """Fails where the meter falls back to the GPU at the CUDA index."""
    nvml.cuda("0badc0de-0000-0000-0000-000000000000")
    with pytest.raises(KareusError, match=r"0badc0de.*not among the GPUs NVML sees"):
        MeasuredEnergy(0)


def test_a_gpu_in_mig_mode_is_refused(nvml):
    nvml.devices[0].mig_enabled = True
    nvml.cuda(_bare(nvml.devices[0].uuid))
    with pytest.raises(KareusError, match=r"MIG.*whole card"):
        MeasuredEnergy(0)


def test_a_mig_instance_is_refused(nvml):
    nvml.devices[1].mig_enabled = True
    nvml.cuda("5e3a1f00-1111-2222-3333-444444444444")  # a MIG instance: no full GPU has its UUID
    with pytest.raises(KareusError, match="MIG is enabled on GPU-fake-0001"):
        MeasuredEnergy(0)


def test_training_does_not_swallow_a_wrong_attribution(nvml):
    """Only a missing NVML falls back to simulated accounting; a wrong GPU stops the run."""
    nvml.cuda("0badc0de-0000-0000-0000-000000000000")
    ctx = SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(KareusError, match="not among the GPUs NVML sees"):
        trainer._nvml_meter(ctx)
    fake_pynvml.reset(count=0)
    fake_pynvml.fail_init()  # no driver: simulated accounting, with a warning
    assert trainer._nvml_meter(ctx) is None
