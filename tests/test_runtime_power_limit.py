"""The runtime applies a plan's per-GPU power limit through the node agent and gives the default
back when it exits (issue 28, item 1: the allocator's fallback below a frontier's low end)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_daemon_support import start_daemon, wait_for
from test_runtime_train import _manifest, _plan

from kareus.daemon_client import DaemonConnection, RecordingClockClient
from kareus.errors import KareusError
from kareus.runtime import train
from kareus.spec import parse_job


def test_the_plans_power_limit_is_asked_for_first_and_reset_on_exit_and_the_model_runs_under_it():
    manifest = _manifest(m=2, steps=2)
    plan = _plan(manifest, (1410, 1410))
    clock = RecordingClockClient()
    limited = train(parse_job(manifest), replace(plan, power_limit_w=150.0), clock=clock, device="cpu")
    assert (clock.log[0].instruction, clock.log[0].power_limit_w) == ("power_limit", 150.0)
    assert [r.instruction for r in clock.log].count("power_limit") == 1  # once, not per step
    assert clock.log[-1].instruction == "reset"  # close(): the lease ends, the board's default comes back
    free_clock = RecordingClockClient()
    free = train(parse_job(manifest), plan, clock=free_clock, device="cpu")
    assert "power_limit" not in [r.instruction for r in free_clock.log]  # an old plan asks for nothing new
    assert limited.losses == free.losses  # numerics untouched
    assert limited.modelled_time_s > free.modelled_time_s  # the limited board runs slower …
    limited_w = limited.energy_j[-1] / limited.modelled_time_s
    assert limited_w <= 150.0 + 1e-6 < free.energy_j[-1] / free.modelled_time_s  # … and draws at most the limit


def test_a_real_node_agent_applies_the_limit_and_restores_the_default_after_training(tmp_path):
    daemon = start_daemon(tmp_path, "--standalone", gpus=1)
    try:
        with DaemonConnection(daemon.socket_path) as connection:
            gpu = next(g.uuid for g in connection.discover() if g.controllable)
        manifest = _manifest(m=2, steps=2)
        train(parse_job(manifest), replace(_plan(manifest), power_limit_w=230.0), daemon_socket=daemon.socket_path,
              device="cpu")
        with DaemonConnection(daemon.socket_path) as connection:
            # set, then restored when the run's connection ended
            wait_for(lambda: {g["uuid"]: g for g in connection.status()["gpus"]}[gpu]["power_limit_changes"] == 2)
            assert connection.read([gpu])[0].power_limit_w == 400.0
    finally:
        assert daemon.stop() == 0
    assert f"GPU {gpu} back to default clocks and power limit" in (tmp_path / "daemon.log").read_text()


def test_a_limit_the_simulated_board_cannot_take_is_one_clear_error():
    manifest = _manifest(m=2, steps=1)
    with pytest.raises(KareusError, match="power_limit_w: the plan's 50 W is outside the settable range 100–400 W "
                                          "of the simulated A100-SXM4-40GB"):
        train(parse_job(manifest), replace(_plan(manifest), power_limit_w=50.0), clock=RecordingClockClient(),
              device="cpu")
