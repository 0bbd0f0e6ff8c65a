"""Checkpoints and progress on the operator's side: the claims and flags of the training pods, the
ledger that carries a job's progress across restarts, and what status shows (issue 27)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import yaml
from kareus_operator import manifests as mf
from kareus_operator.ledger import Ledger, latest_checkpoint, replay
from kareus_operator.progress import checkpoint_status, progress_fields
from kareus_operator.publish import _follow
from kareus_operator.settings import Settings

from kareus.spec import parse_job

QUICKSTART = Path(__file__).resolve().parents[1] / "tests" / "data" / "tiny-tp2.yaml"  # 8 steps
STEP_J = 123.0


def job_body(training: dict) -> dict:
    job = yaml.safe_load(QUICKSTART.read_text())
    job["metadata"].update(namespace="team-a", uid="1234-abcd")
    job["spec"]["training"].update(training)
    return job


def train_pod(job: dict) -> dict:
    spec = parse_job({k: job[k] for k in ("apiVersion", "kind", "metadata", "spec")}).spec
    return mf.train_job(job, spec, Settings())["spec"]["template"]["spec"]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_a_checkpoint_claim_is_mounted_and_named_to_the_runtime_and_the_publisher():
    pod = train_pod(job_body({"checkpoint": {"everySteps": 4, "keep": 3, "claimName": "ckpts"}}))
    [volume] = [v for v in pod["volumes"] if v["name"] == "kareus-checkpoints"]
    assert volume["persistentVolumeClaim"] == {"claimName": "ckpts"}
    container = pod["containers"][0]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "kareus-checkpoints"]
    assert mount == {"name": "kareus-checkpoints", "mountPath": "/var/kareus/checkpoints"}
    command = container["command"]
    runtime = command[command.index("--") + 1:]
    assert runtime[:2] == ["kareus", "train"]
    assert flag(runtime, "--checkpoint-dir") == "/var/kareus/checkpoints/quickstart"
    assert flag(runtime, "--checkpoint-every") == "4"
    assert flag(runtime, "--checkpoint-keep") == "3"
    publisher = command[:command.index("--")]
    assert flag(publisher, "--ledger") == "/var/kareus/checkpoints/quickstart/progress.jsonl"
    assert flag(publisher, "--checkpoint-dir") == "/var/kareus/checkpoints/quickstart"


def test_without_a_claim_nothing_is_mounted_or_passed():
    for training in ({}, {"checkpoint": {"everySteps": 4}}):
        pod = train_pod(job_body(training))
        names = {v["name"] for v in pod["volumes"]}
        assert not names & {"kareus-checkpoints", "kareus-data"}
        command = pod["containers"][0]["command"]
        assert not {"--checkpoint-dir", "--checkpoint-every", "--ledger", "--data"} & set(command)
    # keep is the runtime's default when the job names none
    command = train_pod(job_body({"checkpoint": {"everySteps": 2, "claimName": "c"}}))["containers"][0]["command"]
    assert "--checkpoint-keep" not in command and flag(command, "--checkpoint-every") == "2"


def test_a_data_claim_is_mounted_read_only_and_the_path_is_inside_it():
    pod = train_pod(job_body({"data": {"path": "corpus/tokens", "format": "megatron", "claimName": "corpus"}}))
    [volume] = [v for v in pod["volumes"] if v["name"] == "kareus-data"]
    assert volume["persistentVolumeClaim"] == {"claimName": "corpus", "readOnly": True}
    container = pod["containers"][0]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "kareus-data"]
    assert mount == {"name": "kareus-data", "mountPath": "/var/kareus/data", "readOnly": True}
    assert flag(container["command"], "--data") == "/var/kareus/data/corpus/tokens"
    assert flag(container["command"], "--data-format") == "megatron"
    # without a claim the path is the image's own
    command = train_pod(job_body({"data": {"path": "/data/t.npy", "format": "npy"}}))["containers"][0]["command"]
    assert flag(command, "--data") == "/data/t.npy" and flag(command, "--data-format") == "npy"


def test_the_users_args_come_after_the_operators_flags():
    command = train_pod(job_body({"args": ["--lr", "0.01"], "checkpoint": {"everySteps": 4, "claimName": "c"}})
                        )["containers"][0]["command"]
    assert command[-2:] == ["--lr", "0.01"]
    assert command.index("--checkpoint-dir") < command.index("--lr")


def steps(first: int, last: int, energy_j: float = STEP_J) -> list[dict]:
    return [{"step": s, "loss": 1.0, "iteration_time_s": 0.5, "energy_j": energy_j} for s in range(first, last)]


def test_ledger_counts_every_step_once_across_runs(tmp_path):
    path = tmp_path / "progress.jsonl"
    first = Ledger(path, "pod-a")
    first.add(steps(0, 12))  # killed after step 11; its last checkpoint was after 10 steps
    first.close()
    second = Ledger(path, "pod-b")
    assert second.state.summary()["iterations"] == 12  # what the first run left, read back
    second.add(steps(10, 20))
    second.close()
    summary = replay(path.read_text().splitlines()).summary()
    assert summary["iterations"] == 20
    assert summary["energyJoules"] == pytest.approx(20 * STEP_J)  # steps 10 and 11 once, not twice
    assert summary["redoneJoules"] == pytest.approx(2 * STEP_J)  # the first run's copies, thrown away
    assert summary["resumedFromStep"] == 10
    assert summary["lastStep"] == 19 and summary["runs"] == 2
    assert second.state.summary() == summary  # the in-memory state is the file's


def test_a_run_that_starts_over_is_not_a_resume(tmp_path):
    path = tmp_path / "progress.jsonl"
    for run in ("a", "b"):
        ledger = Ledger(path, run)
        ledger.add(steps(0, 3))
        ledger.close()
    summary = replay(path.read_text().splitlines()).summary()
    assert (summary["iterations"], summary["resumedFromStep"]) == (3, 0)
    assert summary["redoneJoules"] == pytest.approx(3 * STEP_J)


def test_a_half_written_ledger_line_is_ignored_and_kept_apart(tmp_path):
    path = tmp_path / "progress.jsonl"
    ledger = Ledger(path, "a")
    ledger.add(steps(0, 2))
    ledger.close()
    with path.open("a") as f:
        f.write('{"step": 2, "iteration_ti')  # the pod was killed mid-write
    ledger = Ledger(path, "b")
    ledger.add(steps(2, 4))
    ledger.close()
    assert replay(path.read_text().splitlines()).summary()["iterations"] == 4


class Writer:
    def __init__(self) -> None:
        self.published: list[dict] = []

    def write(self, data: dict) -> None:
        self.published.append(json.loads(data["progress.json"]))


def follow(train_jsonl: Path, ledger: Ledger, checkpoints: Path, lines: list[dict]) -> dict:
    """Run the publisher's follower while `lines` are written, as one pod would; its last summary."""
    writer, stop = Writer(), threading.Event()
    thread = threading.Thread(target=_follow, args=(train_jsonl, writer, 0.05, stop, ledger, checkpoints))
    thread.start()
    with train_jsonl.open("w") as log:
        for record in lines:
            log.write(json.dumps(record) + "\n")
            log.flush()
    stop.set()
    thread.join(timeout=10)
    ledger.close()
    return writer.published[-1]


def save_checkpoint(directory: Path, step: int) -> None:
    (directory / f"step-{step:08d}").mkdir(parents=True)
    (directory / f"step-{step:08d}" / "kareus-checkpoint.json").write_text(
        json.dumps({"step": step, "time": "2026-12-01T23:00:00+00:00"}))


def test_the_publisher_carries_progress_across_pods(tmp_path):
    checkpoints = tmp_path / "ckpt"
    ledger_path = checkpoints / "progress.jsonl"
    save_checkpoint(checkpoints, 4)
    first = follow(tmp_path / "a.jsonl", Ledger(ledger_path, "a"), checkpoints, steps(0, 6))
    assert (first["iterations"], first["resumedFromStep"]) == (6, 0)
    assert first["checkpoint"] == {"lastStep": 4, "lastTime": "2026-12-01T23:00:00Z"}
    # the next pod resumes from the checkpoint after 4 steps, in a train.jsonl of its own
    (checkpoints / ".partial-step-00000008").mkdir()  # a save killed midway does not count
    second = follow(tmp_path / "b.jsonl", Ledger(ledger_path, "b"), checkpoints, steps(4, 8))
    assert second["iterations"] == 8 and second["resumedFromStep"] == 4
    assert second["energyJoules"] == pytest.approx(8 * STEP_J)
    assert second["redoneJoules"] == pytest.approx(2 * STEP_J)
    assert second["checkpoint"]["lastStep"] == 4


def test_latest_checkpoint_needs_the_manifest(tmp_path):
    assert latest_checkpoint(tmp_path / "absent") is None
    save_checkpoint(tmp_path, 2)
    (tmp_path / "step-00000006").mkdir()  # no manifest: not complete
    (tmp_path / "step-00000005").mkdir()
    (tmp_path / "step-00000005" / "kareus-checkpoint.json").write_text("{not json")
    assert latest_checkpoint(tmp_path) == {"lastStep": 2, "lastTime": "2026-12-01T23:00:00Z"}


def test_percent_complete_and_eta_from_measured_iteration_times():
    measured = {"iterations": 25, "averageIterationSeconds": 2.0}
    fields = progress_fields({"recentIterationSeconds": 3.0}, measured, 100)
    assert fields == {"percentComplete": 25.0, "etaSeconds": 225.0}  # the recent steps' pace
    assert progress_fields({}, measured, 100)["etaSeconds"] == 150.0  # else the average
    done = progress_fields({"redoneJoules": 246.0}, {"iterations": 100, "averageIterationSeconds": 2.0}, 100)
    assert done == {"percentComplete": 100.0, "etaSeconds": 0.0, "redoneJoules": 246.0}
    assert "etaSeconds" not in progress_fields({}, {"iterations": 0, "averageIterationSeconds": 0.0}, 100)


def test_checkpoint_status_keeps_the_last_checkpoint_seen():
    assert checkpoint_status({"iterations": 3}, None) is None  # no ledger: no checkpoints kept
    first = checkpoint_status({"resumedFromStep": 0, "checkpoint": {"lastStep": 4, "lastTime": "T"}}, None)
    assert first == {"lastStep": 4, "lastTime": "T", "resumedFromStep": 0}
    assert checkpoint_status({"resumedFromStep": 4}, first) == {"lastStep": 4, "lastTime": "T", "resumedFromStep": 4}


def test_operator_exports_progress_while_training_only():
    from kareus_operator.metrics import OperatorMetrics
    from prometheus_client.parser import text_string_to_metric_families

    def samples(metrics) -> dict[str, float]:
        return {s.name: s.value for f in text_string_to_metric_families(metrics.exposition().decode())
                for s in f.samples if s.name.startswith(("kareus_job_progress", "kareus_job_eta", "kareus_job_projected"))}

    metrics = OperatorMetrics()
    job = {"metadata": {"uid": "u", "namespace": "team-a", "name": "llama"}}
    measured = {"energyJoules": 9e3, "percentComplete": 25.0, "etaSeconds": 600.0, "projectedTotalJoules": 3.6e4}
    metrics.observe_status(job, {"phase": "Training", "measured": measured})
    assert samples(metrics) == {"kareus_job_progress_ratio": 0.25, "kareus_job_eta_seconds": 600.0,
                                "kareus_job_projected_energy_joules": 3.6e4}
    metrics.observe_status(job, {"phase": "Succeeded", "measured": measured | {"percentComplete": 100.0}})
    assert samples(metrics) == {}


def test_the_jobs_dashboard_shows_eta_and_energy_still_to_spend():
    dashboard = json.loads((Path(__file__).resolve().parents[1] / "helm" / "kareus" / "dashboards" / "job.json")
                           .read_text())
    exprs = {panel["title"]: [t["expr"] for t in panel.get("targets", [])] for panel in dashboard["panels"]}
    assert "kareus_job_eta_seconds" in exprs["ETA"][0]
    [left] = exprs["Energy still to spend"]
    projected, measured = left.split(" - ")
    assert "kareus_job_projected_energy_joules" in projected and "kareus_job_measured_energy_joules" in measured


def test_a_step_copied_twice_within_a_run_counts_once(tmp_path):
    path = tmp_path / "progress.jsonl"
    ledger = Ledger(path, "a")
    ledger.add(steps(0, 3))
    ledger.add(steps(2, 4))  # a retried copy after a failed write repeats step 2
    ledger.close()
    summary = replay(path.read_text().splitlines()).summary()
    assert (summary["iterations"], summary["redoneJoules"]) == (4, 0.0)
