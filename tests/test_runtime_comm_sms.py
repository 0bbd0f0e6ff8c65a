"""Comm SM counts are enforced or refused, never silently dropped (CPU: a fake ProcessGroupNCCL)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from kareus.errors import KareusError
from kareus.runtime.comm import GroupComm, nccl_groups_by_sms


class _Config:
    min_ctas = max_ctas = -1


class _Options:
    def __init__(self) -> None:
        self.config = _Config()
        self.is_high_priority_stream = False


class _OldOptions:
    """A torch whose ProcessGroupNCCL.Options cannot bound CTAs."""


@pytest.fixture
def new_groups(monkeypatch):
    """Every `dist.new_group` call: ranks, CTA bounds, stream priority, device."""
    made = []

    def new_group(ranks, backend=None, pg_options=None, device_id=None, **_):
        made.append(SimpleNamespace(ranks=tuple(ranks), ctas=(pg_options.config.min_ctas, pg_options.config.max_ctas),
                                    high_priority=pg_options.is_high_priority_stream, device=device_id))
        return f"group{len(made)}"

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", SimpleNamespace(Options=_Options), raising=False)
    return made


def test_one_eager_high_priority_communicator_per_sm_count(new_groups):
    device = torch.device("cuda", 1)
    groups = nccl_groups_by_sms([(0, 1), (2, 3)], (2, 3), {8, 4}, device)
    assert groups == {4: "group2", 8: "group4"}  # this rank's group for each count
    assert [(g.ranks, g.ctas) for g in new_groups] == [((0, 1), (4, 4)), ((2, 3), (4, 4)), ((0, 1), (8, 8)),
                                                       ((2, 3), (8, 8))]
    assert all(g.high_priority and g.device == device for g in new_groups)


def test_a_torch_without_cta_bounds_is_an_error_not_the_default_communicator(new_groups, monkeypatch):
    """Fails where SM counts silently fall back to the default communicator."""
    monkeypatch.setattr(dist, "ProcessGroupNCCL", SimpleNamespace(Options=_OldOptions), raising=False)
    with pytest.raises(KareusError, match="min_ctas/max_ctas"):
        nccl_groups_by_sms([(0, 1)], (0, 1), {4}, torch.device("cuda", 0))
    assert new_groups == []


def test_a_launch_with_an_sm_count_without_communicator_is_refused():
    comm = GroupComm("default", 2, cuda=False, groups_by_sms={4: "group4"}, stream="stream")
    comm.cuda = True  # as on a GPU; no collective is issued by `group_for`
    assert comm.group_for(4) == "group4"
    assert comm.group_for(None) == "default"  # unconfigured (trailing) partitions
    with pytest.raises(KareusError, match="no NCCL communicator bounded to 16 SMs \\(created: 4\\)"):
        comm.group_for(16)


def test_on_gloo_sm_counts_mean_nothing():
    comm = GroupComm("gloo-group", 2, cuda=False)
    assert comm.group_for(16) == "gloo-group"


@pytest.mark.parametrize("variable", ["NCCL_MIN_CTAS", "NCCL_MAX_CTAS"])
def test_nccl_cta_variables_in_the_environment_are_refused(new_groups, monkeypatch, variable):
    """Fails where NCCL_MIN_CTAS/NCCL_MAX_CTAS silently override every communicator's SM bound."""
    monkeypatch.setenv(variable, "16")
    with pytest.raises(KareusError, match=f"{variable}=16 in the environment would override") as refused:
        nccl_groups_by_sms([(0, 1)], (0, 1), {4}, torch.device("cuda", 0))
    assert "unset NCCL_MIN_CTAS and NCCL_MAX_CTAS" in str(refused.value)
    assert new_groups == []
