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


def test_on_a_shared_simulated_gpu_the_rank_draws_under_the_limit_the_agent_set(tmp_path, monkeypatch):
    """The dev cluster's way: the node agent limits the pod's device, the rank's work on it is
    modelled under that limit (as a real board throttles to whatever limit it has), and the
    agent's counter shows the lower draw."""
    from kareus.gpu import discover

    manifest = _manifest(m=2, steps=2)
    drawn_w = {}
    for limit_w in (None, 150.0):
        device_dir = tmp_path / f"dev-{limit_w}"
        agent = discover("sim", count=1, node="node-a", device_dir=device_dir)[0]
        if limit_w is not None:
            agent.set_power_limit_w(limit_w)
        monkeypatch.setenv("KAREUS_SIM_GPU_DIR", str(device_dir))
        monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", agent.uuid)
        train(parse_job(manifest), _plan(manifest, (1410, 1410)), clock=RecordingClockClient(), device="cpu")
        drawn_w[limit_w] = agent.energy_j() / agent.busy_s()  # the device's counter over its modelled busy time
    assert drawn_w[150.0] <= 150.0 + 1e-6 < drawn_w[None]
    assert drawn_w[None] > 300.0  # unlimited, the tiny model at 1410 MHz draws near the 400 W board limit


def test_a_rolled_out_plan_that_changes_the_limit_is_asked_for_at_the_switch(tmp_path):
    """The operator rolls out another allotment: a new limit, then none (the board's default)."""
    import os

    from kareus.plan import Plan
    from kareus.runtime import TrainConfig, build_schedule, run_rank
    from kareus.runtime.parallel import init_distributed

    manifest = _manifest(m=2, steps=4)
    plan_a = replace(_plan(manifest), power_limit_w=300.0)
    swaps = {1: replace(plan_a, power_limit_w=200.0), 2: replace(plan_a, power_limit_w=None)}
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan_a.to_json())

    def swap(step: int) -> None:
        if step in swaps:
            (tmp_path / "next.json").write_text(swaps[step].to_json())
            os.replace(tmp_path / "next.json", plan_path)

    config = TrainConfig.from_job(parse_job(manifest), device="cpu", plan_path=str(plan_path))
    schedule = build_schedule(parse_job(manifest), Plan.loads(plan_path.read_bytes()), config)
    clock = RecordingClockClient()
    result, _ = run_rank(init_distributed(config.layout, device="cpu"), config, schedule, clock=clock, plan=plan_a,
                         step_hook=swap)
    assert result.plan_revisions == (0, 1, 2, 2)
    asked = [r.power_limit_w for r in clock.log if r.instruction == "power_limit"]
    assert asked == [300.0, 200.0, None]  # None: back to the board's default
    assert clock.log[-1].instruction == "reset"
