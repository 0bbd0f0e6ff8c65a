"""The plan format: round trip, schema, semantic validation with field paths, reselect."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import jsonschema
import pytest
from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec
from lowtime.perseus.instruction import Backward, Forward
from lowtime.perseus.schedule import Synchronous1F1B
from optimizer_fixtures import small_plan

from kareus.errors import KareusError
from kareus.plan import (
    MAX_POWER_LIMITED_POINTS,
    Plan,
    PlanError,
    PowerLimitedPoint,
    one_f_one_b,
    plan_at_row,
    plan_schema,
    reselect,
    run_length_decode,
    run_length_encode,
    validate_plan,
)


@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 8), (4, 4), (3, 7), (10, 16)])
def test_1f1b_order_is_lowtimes(stages, microbatches):
    option = ExecutionOption(real_time=1.0, unit_time=1.0, cost=1.0, knob=0)
    spec = OperationSpec(options=CandidateExecutionOptions(options=[option]), cost_model=None)
    for stage in range(stages):
        theirs = [("forward" if isinstance(i, Forward) else "backward", i.micro_batch_id)
                  for i in Synchronous1F1B(stages, microbatches, stage, {Forward: spec, Backward: spec})]
        assert one_f_one_b(stages, microbatches, stage) == theirs


def test_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(plan_schema())


def test_round_trip_through_a_file(tmp_path):
    plan = small_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    assert validate_plan(json.loads(path.read_text())) == []
    assert loaded.stages[0].instructions[0].kind == "forward"


def test_plan_follows_its_selected_row():
    plan = small_plan()
    assert plan.selected_row == 0  # max throughput: the fastest row
    assert plan.predicted.iteration_time_s == plan.frontier.rows[0].time_s
    assert plan.stages == plan.frontier.stages_for(0)
    times = [r.time_s for r in plan.frontier.rows]
    energies = [r.energy_j for r in plan.frontier.rows]
    assert times == sorted(times) and energies == sorted(energies, reverse=True)


def test_run_length_encoding_round_trips():
    values = [3, 3, 3, 0, 1, 1, 3]
    assert run_length_encode(values) == [3, 3, 0, 1, 1, 2, 3, 1]
    assert run_length_decode(run_length_encode(values)) == values


def _errors_after(edit) -> list[str]:
    data = copy.deepcopy(small_plan().to_dict())
    edit(data)
    return validate_plan(data)


def _first_partitioned(data):
    for k, instr in enumerate(data["stages"][0]["instructions"]):
        if instr["mode"] == "partitioned":
            return k, instr
    raise AssertionError("the fixture plan has no partitioned instruction")


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda d: d.update(apiVersion="kareus.dev/v2"), "apiVersion:"),
    (lambda d: d["stages"][1]["instructions"][0].update(clock_mhz=1000),
     "stages[1].instructions[0].clock_mhz: 1000 is not a supported clock"),
    (lambda d: d["stages"][0]["instructions"].reverse(), "stages[0].instructions: must follow the 1F1B order"),
    (lambda d: d["stages"][0]["instructions"][0].update(kind="sideways"), "stages[0].instructions[0].kind:"),
    (lambda d: d["frontier"]["rows"][0]["choice"][0].__setitem__(0, [0, 3]),
     "frontier.rows[0].choice[0][0]: counts must be >= 1 and sum to num_micro_batches (4)"),
    (lambda d: d["frontier"]["rows"][0]["choice"][1].__setitem__(1, [999, 4]),
     "frontier.rows[0].choice[1][1]: option index out of range"),
    (lambda d: d.update(objective={"timeBudget": {"maxSlowdownPercent": -1}}),
     "objective.timeBudget.maxSlowdownPercent: must be >= 0"),
    (lambda d: d.update(selected_row=10_000), "selected_row: must index frontier.rows"),
    (lambda d: d["job"].update(tensor=0), "job.tensor:"),
])
def test_invalid_plans_are_rejected_with_field_paths(edit, expected):
    errors = _errors_after(edit)
    assert any(expected in e for e in errors), errors


def test_partition_configs_are_checked_against_the_workload():
    def edit(data):
        _, instr = _first_partitioned(data)
        instr["configs"]["fwd_attn"] = {"launch_slot": "linear_9", "comm_sms": 4}
        instr["configs"]["fwd_nonsense"] = {"launch_slot": "norm_0", "comm_sms": 3}
        del instr["configs"]["fwd_mlp"]

    errors = "\n".join(_errors_after(edit))
    assert "configs.fwd_attn.launch_slot: 'linear_9' is not a launch slot of fwd_attn; allowed: norm_0" in errors
    assert "configs.fwd_attn.comm_sms: 4 is not in the SM grid of fwd_attn (3..30)" in errors
    assert "configs.fwd_nonsense: unknown partition type here; allowed: fwd_attn, fwd_mlp" in errors
    assert "configs.fwd_mlp: missing; every partition type of the stage needs a config" in errors


def test_sequential_instructions_carry_no_configs():
    def edit(data):
        _, instr = _first_partitioned(data)
        instr["mode"] = "sequential"

    assert any("configs: must be empty for a sequential instruction" in e for e in _errors_after(edit))


def test_load_reports_every_error_and_bad_json(tmp_path):
    data = small_plan().to_dict()
    data["stages"][0]["instructions"][0]["clock_mhz"] = 7
    data["stages"][1]["instructions"][0]["clock_mhz"] = 8
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as caught:
        Plan.load(path)
    assert len(caught.value.errors) == 2 and str(path) in str(caught.value)
    path.write_text("{not json")
    with pytest.raises(KareusError, match="not valid JSON"):
        Plan.load(path)
    with pytest.raises(KareusError, match="cannot read plan"):
        Plan.load(tmp_path / "missing.json")


def test_reselect_moves_along_the_stored_frontier():
    plan = small_plan()
    fastest, slowest = plan.frontier.rows[0], plan.frontier.rows[-1]
    frugal = reselect(plan, {"timeBudget": {"iterationSeconds": slowest.time_s * 2}})
    assert frugal.predicted.iteration_energy_j == min(r.energy_j for r in plan.frontier.rows)
    assert frugal.stages == plan.frontier.stages_for(frugal.selected_row)
    budget = (fastest.energy_j + slowest.energy_j) / 2
    capped = reselect(plan, {"energyBudget": {"perIterationJoules": budget}})
    assert capped.predicted.iteration_energy_j <= budget
    assert all(r.time_s >= capped.predicted.iteration_time_s for r in plan.frontier.rows if r.energy_j <= budget)
    slower = reselect(plan, {"timeBudget": {"maxSlowdownPercent": 3}})
    assert slower.predicted.iteration_time_s <= fastest.time_s * 1.03
    assert slower.objective == {"timeBudget": {"maxSlowdownPercent": 3.0}}
    # what was stored is valid again
    assert validate_plan(capped.to_dict()) == []


def test_reselect_whole_job_budgets_use_steps():
    plan = small_plan()
    now = datetime(2027, 1, 1, tzinfo=UTC)
    fastest = plan.frontier.rows[0]
    deadline = now + timedelta(seconds=fastest.time_s * 100 * 1.5)
    chosen = reselect(plan, {"timeBudget": {"deadline": deadline.isoformat()}}, steps=100, now=now)
    assert chosen.predicted.iteration_time_s <= fastest.time_s * 1.5
    kwh = fastest.energy_j * 1000 / 3.6e6
    chosen = reselect(plan, {"energyBudget": {"totalKilowattHours": kwh}}, steps=1000)
    assert chosen.predicted.iteration_energy_j <= fastest.energy_j


def test_infeasible_budget_names_the_closest_plan():
    plan = small_plan()
    fastest = plan.frontier.rows[0]
    with pytest.raises(KareusError, match=r"closest feasible plan is the fastest one: .*s and .*J per iteration"):
        reselect(plan, {"timeBudget": {"iterationSeconds": fastest.time_s / 2}})
    with pytest.raises(KareusError, match="closest feasible plan is the least-energy one"):
        reselect(plan, {"energyBudget": {"perIterationJoules": 1.0}})
    with pytest.raises(KareusError, match="has already passed"):
        reselect(plan, {"timeBudget": {"deadline": "2020-01-01T00:00:00Z"}})


def test_gzip_round_trip(tmp_path):
    plan = small_plan()
    path = tmp_path / "plan.json.gz"
    plan.save(path)
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    assert Plan.load(path) == plan
    assert Plan.loads(plan.to_gzip()) == plan
    assert len(plan.to_gzip()) < len(plan.to_json()) / 4
    with pytest.raises(PlanError, match="not a valid gzip stream"):
        Plan.loads(b"\x1f\x8b broken")


def test_a_plan_may_carry_a_power_limit_and_plans_without_one_load_unchanged(tmp_path):
    plan = small_plan()
    old = plan.to_dict()
    assert "power_limit_w" not in old  # what every plan written before the field looks like
    loaded = Plan.from_dict(copy.deepcopy(old))
    assert loaded.power_limit_w is None and loaded.to_dict() == old
    limited = replace(plan, power_limit_w=250.0)
    limited.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").power_limit_w == 250.0
    assert plan_at_row(limited, len(plan.frontier.rows) - 1).power_limit_w == 250.0  # moving along keeps it
    assert Plan.from_dict({**old, "power_limit_w": None}).power_limit_w is None
    for bad in (0, -5, "250"):
        assert any(e.startswith("power_limit_w:") for e in validate_plan({**old, "power_limit_w": bad})), bad


def test_power_limited_points_round_trip_survive_reselect_and_are_validated(tmp_path):
    plan = small_plan()
    old = plan.to_dict()
    assert "power_limited_points" not in old and Plan.from_dict(copy.deepcopy(old)).power_limited_points == ()
    last = len(plan.frontier.rows) - 1
    points = (PowerLimitedPoint(0, 250.0, 2.9, 9000.0), PowerLimitedPoint(last, 150.0, 6.5, 14000.0))
    carried = replace(plan, power_limited_points=points)
    carried.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").power_limited_points == points
    # The points are the frontier's: moving along it or another objective keeps them.
    assert plan_at_row(carried, last).power_limited_points == points
    assert reselect(carried, {"timeBudget": {"maxSlowdownPercent": 5}}).power_limited_points == points
    data = carried.to_dict()
    assert validate_plan(data) == []
    assert validate_plan({**data, "power_limited_points": [{**data["power_limited_points"][0], "row": last + 1}]}) == [
        f"power_limited_points[0].row: must index frontier.rows (0..{last})"]
    for field, bad in (("power_limit_w", 0), ("time_s", -1.0), ("energy_j", "9")):
        broken = {**data, "power_limited_points": [{**data["power_limited_points"][0], field: bad}]}
        assert any(e.startswith(f"power_limited_points[0].{field}:") for e in validate_plan(broken)), field
    too_many = {**data, "power_limited_points": data["power_limited_points"][:1] * (MAX_POWER_LIMITED_POINTS + 1)}
    assert any(e.startswith("power_limited_points:") for e in validate_plan(too_many))
