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
from kareus.profiler import profile_job

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
