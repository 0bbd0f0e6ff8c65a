"""Objectives: parsing with field paths, budgets, and the choice they make on a frontier."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kareus.errors import KareusError
from kareus.objective import Objective, iteration_budget, parse_objective, select_point
from kareus.spec import parse_job

FRONT = [(1.0, 10.0), (1.1, 8.0), (1.3, 7.0), (1.6, 6.5)]


@pytest.mark.parametrize(("value", "message"), [
    ({}, "objective: must set exactly one of maxThroughput, timeBudget, energyBudget, got 0"),
    ({"maxThroughput": {}, "timeBudget": {"iterationSeconds": 1}}, "got 2"),
    ({"fastest": {}}, "objective.fastest: unknown objective"),
    ({"timeBudget": {}}, "objective.timeBudget: must set exactly one of maxSlowdownPercent"),
    ({"timeBudget": {"iterationSeconds": 0}}, "objective.timeBudget.iterationSeconds: must be > 0"),
    ({"timeBudget": {"iterationSeconds": "1s"}}, "objective.timeBudget.iterationSeconds: must be a number"),
    ({"timeBudget": {"deadline": "tomorrow"}}, "objective.timeBudget.deadline: must be an RFC 3339 time"),
    ({"energyBudget": {"perIterationJoules": 1, "totalKilowattHours": 2}}, "objective.energyBudget: must set exactly one"),
    ({"energyBudget": {"joules": 1}}, "objective.energyBudget.joules: unknown field"),
    ({"maxThroughput": {"x": 1}}, "objective.maxThroughput: takes no fields"),
    ([1], "objective: must be a mapping"),
])
def test_bad_objectives_name_the_field(value, message):
    with pytest.raises(KareusError, match=re.escape(message)):
        parse_objective(value)


def test_spec_objectives_and_manifest_form_round_trip():
    manifest = {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob", "metadata": {"name": "x"},
                "spec": {"model": {"preset": "tiny"}, "sequenceLength": 64,
                         "parallelism": {"tensor": 2, "pipeline": 1, "context": 1, "data": 1,
                                         "microBatchSize": 4, "numMicroBatches": 2},
                         "objective": {"energyBudget": {"totalKilowattHours": 12.5}},
                         "training": {"image": "i", "steps": 10, "gpusPerNode": 2, "nodes": 1}}}
    objective = parse_objective(parse_job(manifest).spec.objective)
    assert objective == Objective(kind="energyBudget", total_energy_kwh=12.5)
    assert parse_objective(objective.to_dict()) == objective
    deadline = parse_objective({"timeBudget": {"deadline": "2027-01-01T00:00:00Z"}})
    assert deadline.to_dict() == {"timeBudget": {"deadline": "2027-01-01T00:00:00Z"}}


def test_budgets_per_iteration():
    assert iteration_budget(parse_objective({"timeBudget": {"maxSlowdownPercent": 10}}), FRONT).max_time_s == \
        pytest.approx(1.1)
    now = datetime(2027, 1, 1, tzinfo=UTC)
    deadline = parse_objective({"timeBudget": {"deadline": (now + timedelta(hours=1)).isoformat()}})
    assert iteration_budget(deadline, FRONT, steps=3600, now=now).max_time_s == pytest.approx(1.0)
    kwh = parse_objective({"energyBudget": {"totalKilowattHours": 1.0}})
    assert iteration_budget(kwh, FRONT, steps=1000).max_energy_j == pytest.approx(3600.0)
    with pytest.raises(KareusError, match=r"needs spec.training.steps"):
        iteration_budget(kwh, FRONT)


def test_selection_on_a_known_front():
    assert select_point(FRONT, {"maxThroughput": {}}) == 0
    assert select_point(FRONT, {"timeBudget": {"maxSlowdownPercent": 10}}) == 1
    assert select_point(FRONT, {"timeBudget": {"iterationSeconds": 100}}) == 3
    assert select_point(FRONT, {"energyBudget": {"perIterationJoules": 7.0}}) == 2


points = st.lists(st.tuples(st.floats(0.1, 100), st.floats(1, 1e6)), min_size=1, max_size=30)


@given(points, st.floats(0.05, 200))
def test_time_budget_picks_the_least_energy_within_budget(pts, budget_s):
    feasible = [p for p in pts if p[0] <= budget_s]
    objective = {"timeBudget": {"iterationSeconds": budget_s}}
    if not feasible:
        with pytest.raises(KareusError, match="closest feasible plan"):
            select_point(pts, objective)
        return
    chosen = pts[select_point(pts, objective)]
    assert chosen[0] <= budget_s and chosen[1] == min(e for _, e in feasible)


@given(points, st.floats(0.5, 2e6))
def test_energy_budget_picks_the_fastest_within_budget(pts, budget_j):
    feasible = [p for p in pts if p[1] <= budget_j]
    objective = {"energyBudget": {"perIterationJoules": budget_j}}
    if not feasible:
        with pytest.raises(KareusError, match="least-energy one"):
            select_point(pts, objective)
        return
    chosen = pts[select_point(pts, objective)]
    assert chosen[1] <= budget_j and chosen[0] == min(t for t, _ in feasible)
