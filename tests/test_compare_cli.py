"""The optimizer's command lines: compare, optimize, plan show, frontier — and their errors."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import yaml
from optimizer_fixtures import job, job_manifest
from PIL import Image

from kareus.cli import main
from kareus.plan import Plan
from kareus.power_budget import Twin
from kareus.power_budget.twin import LADDER_STEPS
from kareus.profiler import profile_job
from kareus.sim import get_gpu

STEPS = ["--solver-steps", "200"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    manifest = job_manifest(microbatches=4)
    (root / "job.yaml").write_text(yaml.safe_dump(manifest))
    profile_job(job(microbatches=4), backend="sim", seed=0).save(root / "profile.json")
    other = job_manifest(microbatches=4, mbs=4)
    (root / "other.yaml").write_text(yaml.safe_dump(other))
    return root


@pytest.fixture(scope="module")
def compared(files):
    plan_path = files / "compared.json"
    capture = io.StringIO()
    with contextlib.redirect_stdout(capture):
        assert main(["compare", str(files / "job.yaml"), "--profile", str(files / "profile.json"), "--json",
                     "--plan-out", str(plan_path), *STEPS]) == 0
    return json.loads(capture.getvalue()), plan_path


def test_compare_json_has_the_issue_shape(compared):
    data, plan_path = compared
    assert {"megatron", "megatron_perseus", "nanobatch_perseus", "kareus"} <= set(data["methods"])
    for method in data["methods"].values():
        assert method["frontier"] and all(set(p) == {"time_s", "energy_j"} for p in method["frontier"])
    kareus = data["metrics"]["per_method"]["kareus"]
    assert kareus["iso_time_energy_reduction"] > 0 and kareus["max_throughput_time_reduction"] > 0
    assert len(Plan.load(plan_path).baselines) == 4


def test_compare_table(files, capsys):
    assert main(["compare", str(files / "job.yaml"), "--profile", str(files / "profile.json"),
                 "--solver-steps", "10"]) == 0
    out = capsys.readouterr().out
    for label in ("Megatron-LM", "Megatron+Perseus", "Nanobatching+Perseus", "Kareus", "frontier:"):
        assert label in out


def test_optimize_and_show(files, capsys):
    plan_path = files / "plan.json"
    assert main(["optimize", str(files / "job.yaml"), "--profile", str(files / "profile.json"), "--out",
                 str(plan_path), "--objective", '{"timeBudget": {"maxSlowdownPercent": 4}}', *STEPS]) == 0
    plan = Plan.load(plan_path)
    assert plan.objective == {"timeBudget": {"maxSlowdownPercent": 4.0}}
    assert plan.predicted.iteration_time_s <= plan.frontier.rows[0].time_s * 1.04 + 1e-12
    assert main(["plan", "show", str(plan_path)]) == 0
    out = capsys.readouterr().out
    assert "stage 0" in out and "stage 1" in out and "at most 4% slower" in out


def test_optimize_stores_power_limited_points_below_the_frontier(files, capsys):
    plan_path = files / "laddered.json"
    assert main(["optimize", str(files / "job.yaml"), "--profile", str(files / "profile.json"), "--out",
                 str(plan_path), *STEPS]) == 0
    plan = Plan.load(plan_path)
    points, rows = plan.power_limited_points, plan.frontier.rows
    assert f"{len(points)} power-limited points" in capsys.readouterr().out
    gpu = get_gpu(plan.job.gpu)
    bases = {plan.selected_row, min(range(len(rows)), key=lambda r: rows[r].time_s),
             min(range(len(rows)), key=lambda r: rows[r].energy_j / rows[r].time_s)}
    assert {p.row for p in points} == bases and len(points) <= 3 * LADDER_STEPS
    twin = Twin([("j", plan)])
    for p in points:
        row = rows[p.row]
        assert gpu.power_limit_min_w <= p.power_limit_w < gpu.power_limit_w
        assert p.time_s > row.time_s and p.energy_j / p.time_s < row.energy_j / row.time_s  # slower, less power
        # Profiled on the simulator, the plan's rows are the twin's runs, so the points are its limited runs.
        run = twin.run(0, p.row, p.power_limit_w)
        assert (p.time_s, p.energy_j) == (pytest.approx(run.time_s, rel=1e-9), pytest.approx(run.energy_j, rel=1e-9))
    # At the board's minimum limit the points reach below the frontier's least-power point.
    lowest = [p for p in points if p.power_limit_w == gpu.power_limit_min_w]
    assert lowest and max(p.energy_j / p.time_s for p in lowest) < min(r.energy_j / r.time_s for r in rows)
    for steps, most in (("0", 0), ("4", 12)):
        assert main(["optimize", str(files / "job.yaml"), "--profile", str(files / "profile.json"), "--out",
                     str(plan_path), "--power-limit-steps", steps, *STEPS]) == 0
        stored = Plan.load(plan_path).power_limited_points
        assert len(stored) <= most and (most == 0) == (not stored)
        assert {p.power_limit_w for p in stored} <= {gpu.power_limit_min_w + (gpu.power_limit_w - gpu.power_limit_min_w)
                                                     * i / 4 for i in range(4)}


def test_frontier_png_draws_every_stored_method(compared, files, capsys):
    png = files / "frontier.png"
    assert main(["frontier", str(compared[1]), "--png", str(png)]) == 0
    assert "5 frontiers" in capsys.readouterr().out
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 400


@pytest.mark.parametrize(("argv", "message"), [
    (["optimize", "{job}", "--profile", "{profile}", "--out", "{out}", "--objective", "fast"],
     "--objective: not valid JSON"),
    (["optimize", "{job}", "--profile", "{profile}", "--out", "{out}", "--objective", '{"speed": {}}'],
     "--objective.speed: unknown objective"),
    (["optimize", "{job}", "--profile", "{profile}", "--out", "{out}", "--objective",
      '{"energyBudget": {"perIterationJoules": 1}}', "--solver-steps", "50"],
     "closest feasible plan is the least-energy one"),
    (["optimize", "{other}", "--profile", "{profile}", "--out", "{out}"], "micro_batch_size=8, but the job has"),
    (["optimize", "{job}", "--profile", "{missing}", "--out", "{out}"], "not found"),
    (["optimize", "{job}", "--profile", "{profile}", "--out", "{out}", "--power-limit-steps", "22"],
     "--power-limit-steps must be 0..21, got 22"),
    (["compare", "{job}", "--backend", "nvml"], "--backend: only 'sim'"),
    (["compare", "{job}", "--solver-steps", "3"], "--solver-steps: must be >= 10"),
    (["plan", "show", "{profile}"], "invalid plan"),
])
def test_bad_input_is_one_clear_error(files, capsys, argv, message):
    paths = {"job": files / "job.yaml", "other": files / "other.yaml", "profile": files / "profile.json",
             "out": files / "never.json", "missing": files / "missing.json"}
    argv = [paths.get(a[1:-1], a) for a in argv]
    assert main([str(a) for a in argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kareus: error: ") and message in err and "Traceback" not in err
