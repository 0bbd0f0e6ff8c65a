"""`kareus sim straggler` and `kareus sim power-budget`: the twin's what-ifs on the command line.

Plans come from files (the tiny DP2 plan of `test_runtime_straggler`, simulator numbers), so the
tests do not profile. The acceptance: one of two replicas 15 % slower keeps the iteration time
(within 1 %) and costs less energy with re-selection; at the same cluster budget Kareus' allocation
is ahead of a uniform per-GPU power limit.
"""

from __future__ import annotations

import json

import pytest
import yaml
from test_runtime_straggler import manifest, tiny_plan

from kareus.cli import main
from kareus.plan import reselect

JOB = "tests/data/quickstart-dp2.yaml"


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "tiny-dp2.json"
    tiny_plan().save(path)
    return path


def run_json(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def job_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("jobs") / "straggler.yaml"
    path.write_text(yaml.safe_dump(manifest()))
    return path


def test_straggler_keeps_the_time_and_saves_energy(capsys, job_file, plan_file):
    result = run_json(capsys, "sim", "straggler", str(job_file), "--plan", str(plan_file), "--slowdown", "0.15",
                      "--json")
    without, with_ = result["without"], result["with"]
    assert set(without) >= {"time_s", "energy_j"} and set(with_) >= {"time_s", "energy_j", "switches"}
    assert abs(with_["time_s"] / without["time_s"] - 1) < 0.01
    assert with_["energy_j"] < without["energy_j"]
    assert result["energy_saving"] > 0 and result["straggler_replica"] == 1 and result["replicas"] == 2
    assert with_["switches"][0]["reason"] == "straggler"


def test_straggler_recovery_and_table_output(capsys, job_file, plan_file):
    assert main(["sim", "straggler", str(job_file), "--plan", str(plan_file), "--slowdown", "0.15",
                 "--recover-at", "8", "--patience", "2", "--recovery", "2"]) == 0
    out = capsys.readouterr().out
    assert "with re-selection" in out and "straggler → frontier rows [2, 0]" in out
    assert "recovered → frontier rows [0, 0]" in out


def test_straggler_refuses_a_plan_for_another_layout(capsys, plan_file):
    assert main(["sim", "straggler", JOB, "--plan", str(plan_file), "--slowdown", "0.15"]) == 1
    assert "another layout" in capsys.readouterr().err


def fine_plan():
    """The tiny DP2 job's frontier at every 15 MHz step where slower is cheaper (16 rows)."""
    runs = [(tiny_plan(clocks_mhz=(c,)).frontier.rows[0], c) for c in range(1320, 1049, -15)]
    clocks, cheapest_j = [], float("inf")
    for row, clock in sorted(runs, key=lambda rc: rc[0].time_s):
        if row.energy_j < cheapest_j:
            clocks.append(clock)
            cheapest_j = row.energy_j
    return tiny_plan(clocks_mhz=tuple(clocks))


def test_power_budget_kareus_ahead_of_a_uniform_limit(capsys, tmp_path):
    plan = fine_plan()
    assert len(plan.frontier.rows) >= 10
    fast, budgeted = tmp_path / "fast.json", tmp_path / "budgeted.json"
    plan.save(fast)
    reselect(plan, {"timeBudget": {"maxSlowdownPercent": 5}}).save(budgeted)
    fastest = plan.frontier.rows[0]
    budget_w = 0.9 * 3 * fastest.energy_j / fastest.time_s
    result = run_json(capsys, "sim", "power-budget", str(fast), str(fast), str(budgeted), "--budget-w",
                      f"{budget_w:.3f}", "--json")
    ours, theirs = result["kareus"], result["uniform_power_limit"]
    assert result["gpus"] == 6 and len(ours["jobs"]) == 3 and result["allocation"]["feasible"]
    assert ours["power_w"] <= result["budget_w"] * (1 + 1e-9)  # the twin agrees with the predictions
    assert theirs["power_w"] <= result["budget_w"] * (1 + 1e-9)
    assert result["throughput_ratio"] == pytest.approx(ours["normalised_throughput"] / theirs["normalised_throughput"])
    assert result["throughput_ratio"] > 1.0  # small on this toy model; bench/power_budget.py on the paper's
    assert ours["jobs"][2]["time_s"] <= 1.05 * fastest.time_s * (1 + 1e-9)  # the time budget is kept


def test_power_budget_refuses_a_budget_below_the_boards_minimum(capsys, plan_file):
    assert main(["sim", "power-budget", str(plan_file), "--budget-w", "50"]) == 1
    assert "below A100-SXM4-40GB's minimum power limit" in capsys.readouterr().err
