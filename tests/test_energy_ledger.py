"""The namespace energy ledger (kareus.energy_ledger), the periodic budgets of the policy, and the
verdicts of the Kueue admission check built on them — pure, no cluster."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from kareus_operator.admission_check import (
    clusterqueue_checks,
    judge,
    our_checks,
    pending_checks,
    rejection,
    remaining_kwh,
    reserved_kwh,
)
from kareus_operator.energy_ledgers import job_energy_j, ledger_status

from kareus.energy_ledger import (
    HISTORY_PERIODS,
    BudgetStanding,
    LedgerError,
    NamespaceLedger,
    period_bounds,
    standing,
)
from kareus.policy import PolicyError, check_job, load_policy
from kareus.spec import parse_job

KWH = 3.6e6


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@pytest.mark.parametrize(("period", "when", "start", "end"), [
    ("day", "2026-12-31 23:59:59", "2026-12-31", "2027-01-01"),
    ("week", "2026-12-02 10:00", "2026-11-30", "2026-12-07"),  # a Wednesday: the ISO week began Monday
    ("week", "2026-11-30 00:00", "2026-11-30", "2026-12-07"),
    ("month", "2026-12-15 12:00", "2026-12-01", "2027-01-01"),
    ("month", "2028-02-29 23:00", "2028-02-01", "2028-03-01"),
])
def test_periods_are_calendar_aligned_in_utc(period, when, start, end):
    assert period_bounds(period, at(when)) == (at(start), at(end))


def test_a_period_is_the_same_from_any_time_zone():
    from datetime import timedelta, timezone
    tokyo = datetime(2026, 12, 1, 3, 0, tzinfo=timezone(timedelta(hours=9)))  # 2026-11-30 18:00 UTC
    assert period_bounds("month", tokyo) == (at("2026-11-01"), at("2026-12-01"))
    assert period_bounds("lifetime", tokyo) == (None, None)
    with pytest.raises(LedgerError, match="period: must be one of lifetime, month, week, day, got 'year'"):
        period_bounds("year", tokyo)


def test_a_job_is_charged_what_its_counter_gained_and_a_reset_counter_is_a_new_run():
    ledger = NamespaceLedger("team-a").at(at("2026-12-02 10:00"), "day")
    ledger = ledger.record("u1", "a", 1000.0, at("2026-12-02 10:00"))
    ledger = ledger.record("u1", "a", 1500.0, at("2026-12-02 10:01"))
    ledger = ledger.record("u1", "a", 1500.0, at("2026-12-02 10:02"))  # read again: nothing new
    assert ledger.period_energy_j == 1500.0 and ledger.meters_j == {"u1": 1500.0}
    ledger = ledger.record("u1", "a", 200.0, at("2026-12-02 10:03"))  # a restarted run counts from 0
    assert ledger.period_energy_j == 1700.0 and ledger.lifetime_energy_j == 1700.0
    with pytest.raises(LedgerError, match="energy of job a: must be joules ≥ 0, got nan"):
        ledger.record("u1", "a", float("nan"), at("2026-12-02 10:04"))


def test_a_deleted_job_keeps_its_energy_and_a_new_period_starts_at_zero():
    ledger = NamespaceLedger("team-a").at(at("2026-12-31 20:00"), "day")
    ledger = ledger.record("u1", "a", 4000.0, at("2026-12-31 20:00")).record("u2", "b", 1000.0, at("2026-12-31 21:00"))
    ledger = ledger.forget(["u2"])  # job a was deleted
    assert ledger.meters_j == {"u2": 1000.0} and ledger.period_energy_j == 5000.0
    # New Year: the day closes into the history; b's later energy goes to the new day.
    ledger = ledger.record("u2", "b", 1600.0, at("2027-01-01 00:00:05"))
    assert ledger.period_start == at("2027-01-01") and ledger.period_energy_j == 600.0
    assert [(c.start, c.energy_j) for c in ledger.history] == [(at("2026-12-31"), 5000.0)]
    assert ledger.lifetime_energy_j == 5600.0


def test_the_history_keeps_the_last_periods():
    ledger = NamespaceLedger("ns").at(at("2026-01-01"), "day")
    for day in range(1, 20):
        ledger = ledger.record("u", "j", float(day), at(f"2026-01-{day:02d} 12:00"))
    assert len(ledger.history) == HISTORY_PERIODS and ledger.history[-1].start == at("2026-01-18")


def test_the_stored_status_round_trips_and_a_damaged_one_is_refused():
    ledger = NamespaceLedger("team-a").at(at("2026-12-02"), "month").record("u1", "a", 7.2e6, at("2026-12-02"))
    status = ledger_status(ledger, 5.0, at("2026-12-02 01:00"))
    assert status["usedKilowattHours"] == 2.0 and status["remainingKilowattHours"] == 3.0
    assert status["periodEnd"] == "2027-01-01T00:00:00Z" and status["jobs"] == [{"uid": "u1", "name": "a", "joules": 7.2e6}]
    assert NamespaceLedger.from_status("team-a", status) == ledger
    lifetime = ledger_status(NamespaceLedger("x"), None, at("2026-12-02"))
    assert lifetime["periodStart"] is None and lifetime["budgetKilowattHours"] is None  # removed by the merge patch
    for field, bad, message in [("usedJoules", -1, "status.usedJoules: must be joules ≥ 0, got -1"),
                                ("period", "year", "status.period: must be one of"),
                                ("jobs", [{"name": "x"}], r"status.jobs\[0\]: must be \{uid, name, joules\}"),
                                ("periodStart", "yesterday", "status.periodStart: must be an RFC 3339 time")]:
        with pytest.raises(LedgerError, match=message):
            NamespaceLedger.from_status("team-a", {**status, field: bad})


def test_a_budget_standing_fits_what_is_left_net_of_promises():
    ledger = NamespaceLedger("team-a").at(at("2026-12-02"), "month").record("u1", "a", 3 * KWH, at("2026-12-02"))
    budget = standing(ledger, 10.0, "month", at("2026-12-02 12:00"), reserved_kwh=4.0)
    assert budget.remaining_kwh == pytest.approx(3.0)
    assert budget.fits(3.0) and not budget.fits(3.5) and budget.ever_fits(10.0) and not budget.ever_fits(10.5)
    assert budget.text() == ("namespace 'team-a' has used 3 kWh of its 10 kWh monthly energy budget, 4 kWh promised "
                             "to admitted jobs; the period ends 2027-01-01T00:00:00Z")
    # Next month the same ledger starts over.
    assert standing(ledger, 10.0, "month", at("2027-01-01 00:00:01")).used_kwh == 0.0
    spent = BudgetStanding("b", 1.0, "lifetime", 1.0, 0.0, None)
    assert not spent.fits(0.0) and not spent.ever_fits(0.0)  # an exhausted lifetime budget never frees


def test_the_policy_takes_periodic_budgets_and_plain_numbers():
    policy = load_policy({"namespaceEnergyBudgets": {"team-a": 100, "team-b": {"kwh": 2.5, "period": "week"},
                                                     "team-c": {"kwh": 1}}})
    assert policy.namespace_energy_budgets_kwh == {"team-a": 100.0, "team-b": 2.5, "team-c": 1.0}
    assert [policy.energy_period(n) for n in ("team-a", "team-b", "team-c", "other")] == ["lifetime", "week", "lifetime",
                                                                                        "lifetime"]
    for bad, message in [({"team-a": {"kwh": 1, "period": "year"}},
                          "policy.namespaceEnergyBudgets.team-a.period: must be one of lifetime, month, week, day, got 'year'"),
                         ({"team-a": {"kwh": 0, "period": "day"}},
                          "policy.namespaceEnergyBudgets.team-a.kwh: must be"),
                         ({"team-a": {"kwh": 1, "every": "day"}},
                          "policy.namespaceEnergyBudgets.team-a.every: unknown key; allowed keys are kwh, period"),
                         ({"team-a": {"period": "day"}}, "policy.namespaceEnergyBudgets.team-a.kwh: must be")]:
        with pytest.raises(PolicyError, match=message):
            load_policy({"namespaceEnergyBudgets": bad})


def test_a_refusal_names_the_namespace_the_use_the_budget_and_the_periods_end():
    from operator_fakes import fake_manifest
    policy = load_policy({"namespaceEnergyBudgets": {"team-a": {"kwh": 2, "period": "day"}}})
    manifest = fake_manifest()
    manifest["metadata"]["namespace"] = "team-a"
    spec = parse_job(manifest)
    ledger = NamespaceLedger("team-a").at(at("2026-12-02"), "day").record("u", "a", 2.5 * KWH, at("2026-12-02"))
    [refused] = check_job(policy, "team-a", spec, energy=standing(ledger, 2, "day", at("2026-12-02 09:00")))
    assert refused.message == ("namespace 'team-a' has used 2.5 kWh of its 2 kWh daily energy budget; "
                               "the period ends 2026-12-03T00:00:00Z")
    # A queue that enforces the budget: the operator's own check leaves it out.
    assert check_job(policy, "team-a", spec, energy=standing(ledger, 2, "day", at("2026-12-02 09:00")),
                     check_energy=False) == []


def job(uid="u1", *, steps=100, done=0, plan_j=None, total_kwh=None, phase="Training", started=True, suspended=False,
        energy_j=0.0, redone_j=0.0):
    spec = {"training": {"steps": steps}}
    if total_kwh is not None:
        spec["objective"] = {"energyBudget": {"totalKilowattHours": total_kwh}}
    status = {"phase": phase, "measured": {"iterations": done, "energyJoules": energy_j, "redoneJoules": redone_j}}
    if plan_j is not None:
        status["plan"] = {"predictedIterationJoules": plan_j}
    if started:
        status["trainingStartTime"] = "2026-12-02T00:00:00Z"
    if suspended:
        status["suspendedSince"] = "2026-12-02T01:00:00Z"
    return {"metadata": {"uid": uid, "name": uid}, "spec": spec, "status": status}


def test_a_jobs_remaining_energy_and_the_promises_of_admitted_jobs():
    assert remaining_kwh(job(steps=100, done=40, plan_j=KWH / 10)) == pytest.approx(6.0)
    assert remaining_kwh(job(total_kwh=5, energy_j=KWH)) == pytest.approx(4.0)  # no plan yet: its own budget
    assert remaining_kwh(job()) == 0.0
    assert job_energy_j(job(energy_j=10.0, redone_j=2.5)) == 12.5  # redone steps were spent too
    jobs = [job("a", plan_j=KWH / 100), job("b", plan_j=KWH / 100, phase="Succeeded"),
            job("c", plan_j=KWH / 100, suspended=True), job("d", plan_j=KWH / 100, started=False),
            job("e", plan_j=KWH / 50)]
    assert reserved_kwh(jobs, except_uid="e") == pytest.approx(1.0)  # only a: running, not finished, not suspended
    assert reserved_kwh(jobs, except_uid="x") == pytest.approx(3.0)


def test_the_verdicts():
    now = at("2026-12-02 12:00")
    month = BudgetStanding("team-a", 10.0, "month", 6.0, 2.0, at("2027-01-01"))
    assert judge(month, 1.5, None, now).state == "Ready"
    assert "fits: the job needs 1.5 of the 2 kWh left" in judge(month, 1.5, None, now).message
    held = judge(month, 3.0, None, now)  # fits once a promise frees: retry soon
    assert (held.state, held.requeue_after_s) == ("Retry", 15)
    assert held.message.startswith("the job needs 3 kWh for its remaining steps, 2 kWh left: namespace 'team-a'")
    next_month = judge(month, 5.0, None, now)  # more than used leaves: only a new month helps
    assert (next_month.state, next_month.requeue_after_s) == ("Retry", int((at("2027-01-01") - now).total_seconds()) + 1)
    never = judge(month, 11.0, None, now)
    assert never.state == "Rejected" and never.message.endswith("waiting cannot make it fit")
    lifetime = BudgetStanding("team-a", 10.0, "lifetime", 9.0, 0.0, None)
    assert judge(lifetime, 2.0, None, now).state == "Rejected"
    assert judge(BudgetStanding("team-a", 10.0, "lifetime", 10.0, 0.0, None), 0.0, None, now).state == "Rejected"
    power = judge(None, 0.0, "no power left for it", now)
    assert (power.state, power.message) == ("Retry", "held by the cluster power budget: no power left for it")
    assert judge(None, 0.0, None, now).state == "Ready"


def test_the_check_reads_kueues_objects():
    assert our_checks([{"metadata": {"name": "b"}, "spec": {"controllerName": "kareus.dev/energy-budget"}},
                       {"metadata": {"name": "p"}, "spec": {"controllerName": "kueue.x-k8s.io/provisioning-request"}}]) == ["b"]
    reserved = {"conditions": [{"type": "QuotaReserved", "status": "True"}],
                "admissionChecks": [{"name": "b", "state": "Pending"}, {"name": "p", "state": "Pending"}]}
    assert pending_checks({"status": reserved}, ["b"]) == ["b"]
    assert pending_checks({"status": {**reserved, "conditions": []}}, ["b"]) == []  # no quota yet: not ours to judge
    assert rejection({"status": {"admissionChecks": [{"name": "b", "state": "Rejected", "message": "too big"}]}}) == \
        "AdmissionCheck b: too big"
    assert rejection({"status": reserved}) is None
    # Kueue deactivates a rejected Workload and resets the check to Pending: the annotation keeps why.
    deactivated = {"metadata": {"annotations": {"kareus.dev/admission-rejection": "AdmissionCheck b: too big"}},
                   "status": {"admissionChecks": [{"name": "b", "state": "Pending",
                                                   "message": "Reset to Pending after eviction. Previously: Rejected"}],
                              "conditions": [{"type": "Evicted", "status": "True", "reason": "DeactivatedDueToAdmissionCheck",
                                              "message": "The workload is deactivated due to Admission check(s): b"}]}}
    assert rejection(deactivated) == "AdmissionCheck b: too big"
    del deactivated["metadata"]["annotations"]
    assert rejection(deactivated) == "The workload is deactivated due to Admission check(s): b"
    suspended = {"status": {"conditions": [{"type": "Evicted", "status": "True", "reason": "Deactivated"}]}}
    assert rejection(suspended) is None  # spec.suspend deactivates it too: not a rejection
    assert clusterqueue_checks({"spec": {"admissionChecksStrategy": {"admissionChecks": [{"name": "b"}]}}}) == ["b"]
