"""Checkpoints of `kareus train`: a run resumed from its last complete checkpoint goes on exactly as
an uninterrupted run (losses within 1e-5 relative), whether it was SIGKILLed or stopped by SIGTERM;
a damaged checkpoint is skipped with its reason, a foreign one refused naming what differs; the
last K are kept; a save killed midway leaves the previous checkpoint usable."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kube_helpers import wait_until

from kareus.cli import main as cli_main
from kareus.errors import EXIT_CONFIG, NON_RETRYABLE_EXIT_CODES, KareusError
from kareus.runtime import stopping, train
from kareus.runtime.checkpoint import MANIFEST, CheckpointSettings
from kareus.runtime.optimizer_recipe import OptimizerRecipe
from kareus.spec import parse_job

REL = 1e-5


# A run extended to more steps continues with the same rates only without a decay over the run's steps.
CONSTANT_LR = {"schedule": "constant", "lr": 3e-3, "warmupSteps": 0, "weightDecay": 0, "clipGradNorm": 0}


def _manifest(name: str = "ckpt-test", *, tp: int = 1, steps: int = 6, seq: int = 16) -> dict:
    return {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob", "metadata": {"name": name},
            "spec": {"model": {"preset": "tiny"}, "sequenceLength": seq,
                     "parallelism": {"tensor": tp, "pipeline": 1, "context": 1, "data": 1,
                                     "microBatchSize": 2, "numMicroBatches": 2},
                     "objective": {"maxThroughput": {}},
                     "training": {"image": "x", "steps": steps, "gpusPerNode": tp, "nodes": 1,
                                  "optimizer": CONSTANT_LR}}}


def _train(manifest: dict, **overrides):
    job = parse_job(manifest)
    return train(job, job_name=job.name, **overrides)


def _close(resumed: list[float], reference: list[float]) -> bool:
    return len(resumed) == len(reference) and all(
        abs(a - b) <= REL * abs(b) for a, b in zip(resumed, reference, strict=True))


def _steps_in(directory: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in directory.glob("step-*"))


# one process, in this process ------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference() -> list[float]:
    """The uninterrupted run's losses, steps 0..5."""
    return list(_train(_manifest(), steps=6).losses)


def test_a_resumed_run_continues_the_uninterrupted_runs_losses(tmp_path, reference):
    ckpt = str(tmp_path / "ckpt")
    first = _train(_manifest(), steps=4, checkpoint_dir=ckpt, checkpoint_every=2)
    assert first.losses == tuple(reference[:4]) and first.checkpoint_step == 4
    manifest = json.loads((tmp_path / "ckpt" / "step-00000004" / MANIFEST).read_text())
    assert manifest["step"] == 4 and manifest["job"] == "ckpt-test" and manifest["layout"]["tensor"] == 1
    assert manifest["model"]["hidden_size"] > 0 and manifest["plan_revision"] == 0
    assert ".metadata" in manifest["files"] and all(len(f["sha256"]) == 64 for f in manifest["files"].values())
    second = _train(_manifest(), steps=6, checkpoint_dir=ckpt, checkpoint_every=2, out_dir=str(tmp_path / "out"))
    assert second.first_step == 4 and _close(list(second.losses), reference[4:])
    lines = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [4, 5]  # the first line is the first step after the checkpoint


def test_the_last_k_checkpoints_are_kept_and_a_partial_save_is_ignored(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    _train(_manifest(), steps=5, checkpoint_dir=str(ckpt), checkpoint_every=1, checkpoint_keep=2)
    assert _steps_in(ckpt) == [4, 5]
    # A save killed midway: the ranks' files written, no manifest, never renamed into place.
    shutil.copytree(ckpt / "step-00000005", ckpt / ".partial-step-00000006")
    (ckpt / ".partial-step-00000006" / MANIFEST).unlink()
    resumed = _train(_manifest(), steps=6, checkpoint_dir=str(ckpt), checkpoint_every=3, checkpoint_keep=2)
    assert resumed.first_step == 5 and _close(list(resumed.losses), reference[5:])
    assert _steps_in(ckpt) == [5, 6] and not list(ckpt.glob(".partial-*"))  # the next save cleared it


def test_a_damaged_checkpoint_is_skipped_with_its_reason(tmp_path, reference, caplog):
    ckpt = tmp_path / "ckpt"
    _train(_manifest(), steps=4, checkpoint_dir=str(ckpt), checkpoint_every=2)
    shard = next((ckpt / "step-00000004").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size: only the digest can tell
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kareus.runtime"):
        resumed = _train(_manifest(), steps=6, checkpoint_dir=str(ckpt), checkpoint_every=2)
    assert resumed.first_step == 2 and _close(list(resumed.losses), reference[2:])
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "skipping checkpoint" in warning and "step-00000004" in warning
    assert f"file {shard.name} does not match its SHA-256" in warning
    # The resumed run saved step 4 again, over the damaged one, and step 6: both check out now.
    assert _steps_in(ckpt) == [4, 6] and not list(ckpt.glob(".partial-*"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kareus.runtime"):
        assert _train(_manifest(), steps=6, checkpoint_dir=str(ckpt), checkpoint_keep=3).first_step == 6
        shutil.rmtree(ckpt / "step-00000006")
        again = _train(_manifest(), steps=6, checkpoint_dir=str(ckpt))
    assert again.first_step == 4 and _close(list(again.losses), reference[4:]) and not caplog.records


def test_every_checkpoint_damaged_is_refused_naming_each(tmp_path):
    ckpt = tmp_path / "ckpt"
    _train(_manifest(), steps=4, checkpoint_dir=str(ckpt), checkpoint_every=2)
    (ckpt / "step-00000004" / MANIFEST).write_text('{"step": 4, "files"')  # cut short
    next((ckpt / "step-00000002").glob("*.distcp")).write_bytes(b"short")
    with pytest.raises(KareusError) as error:
        _train(_manifest(), steps=6, checkpoint_dir=str(ckpt))
    message = str(error.value)
    assert "no usable checkpoint" in message and error.value.exit_code == EXIT_CONFIG
    assert f"step-00000004: its manifest {MANIFEST} is damaged" in message
    assert "step-00000002: file __0_0.distcp has 5 bytes, the manifest says" in message


@pytest.mark.parametrize("change,difference", [
    ({"recipe": OptimizerRecipe.constant("sgd")}, "optimizer: checkpoint 'adamw', this run 'sgd'"),
    ({"seq": 32}, "model.sequence_length: checkpoint 16, this run 32"),
    ({"name": "another-job"}, "job: checkpoint 'ckpt-test', this run 'another-job'"),
    ({"seed": 3}, "data.seed: checkpoint 0, this run 3"),
])
def test_a_foreign_checkpoint_is_refused_naming_what_differs(tmp_path, change, difference):
    ckpt = str(tmp_path / "ckpt")
    _train(_manifest(), steps=2, checkpoint_dir=ckpt, checkpoint_every=2)
    manifest = _manifest(change.get("name", "ckpt-test"), seq=change.get("seq", 16))
    overrides = {k: v for k, v in change.items() if k in ("recipe", "seed")}
    with pytest.raises(KareusError, match="checkpoint step-00000002 is not this run's") as error:
        _train(manifest, steps=4, checkpoint_dir=ckpt, **overrides)
    assert difference in str(error.value) and error.value.exit_code == EXIT_CONFIG


def test_a_checkpoint_beyond_the_total_steps_is_refused(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _train(_manifest(), steps=4, checkpoint_dir=ckpt, checkpoint_every=4)
    with pytest.raises(KareusError, match=r"after step 4, beyond --steps 3 \(the total, not steps to add\)"):
        _train(_manifest(), steps=3, checkpoint_dir=ckpt)


@pytest.mark.parametrize("settings,message", [
    ({"every_steps": -1}, "--checkpoint-every must be >= 0"),
    ({"keep": 0}, "--checkpoint-keep must be >= 1"),
])
def test_checkpoint_settings_are_checked(settings, message):
    with pytest.raises(KareusError, match=message):
        CheckpointSettings("/tmp/x", **settings)


# the CLI, two ranks (TP2, gloo): SIGKILL and SIGTERM -----------------------------------------

TOTAL = 10


@pytest.fixture(scope="module")
def tp2_reference() -> list[float]:
    return list(_train(_manifest("ckpt-cli", tp=2, steps=TOTAL), nproc=2).losses)


def _start(tmp_path: Path, out: str, *extra: str) -> subprocess.Popen:
    job_path = tmp_path / "job.yaml"
    job_path.write_text(yaml.safe_dump(_manifest("ckpt-cli", tp=2, steps=TOTAL)))
    return subprocess.Popen([sys.executable, "-m", "kareus", "train", str(job_path), "--nproc", "2",
                             "--out", str(tmp_path / out), "--checkpoint-dir", str(tmp_path / "ckpt"), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_sigkilled_train_resumes_from_its_last_complete_checkpoint(tmp_path, tp2_reference):
    trainer = _start(tmp_path, "out1", "--checkpoint-every", "2")

    def progress() -> int:
        assert trainer.poll() is None, trainer.communicate()
        return len(_lines(tmp_path / "out1" / "train.jsonl"))

    wait_until(progress, lambda steps: steps >= 5, timeout_s=300, what="five logged steps", interval_s=0.05)
    os.killpg(trainer.pid, signal.SIGKILL)  # the whole process group: no rank gets to clean up
    trainer.communicate(timeout=60)
    last = max(_steps_in(tmp_path / "ckpt"))
    assert 2 <= last < TOTAL and last % 2 == 0
    resumed = _start(tmp_path, "out2", "--checkpoint-every", "2", "--json")
    stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr
    assert json.loads(stdout.splitlines()[-1])["first_step"] == last
    lines = _lines(tmp_path / "out2" / "train.jsonl")
    assert [line["step"] for line in lines] == list(range(last, TOTAL))
    assert _close([line["loss"] for line in lines], tp2_reference[last:]), (lines, tp2_reference)
    assert f"resuming from {tmp_path / 'ckpt' / f'step-{last:08d}'} after step {last}" in stderr


def test_sigterm_saves_a_checkpoint_before_exiting_and_the_rest_runs_from_it(tmp_path, tp2_reference):
    trainer = _start(tmp_path, "out1")  # no --checkpoint-every: only the stop saves

    def progress() -> int:
        assert trainer.poll() is None, trainer.communicate()
        return len(_lines(tmp_path / "out1" / "train.jsonl"))

    wait_until(progress, lambda steps: steps >= 2, timeout_s=300, what="two logged steps", interval_s=0.05)
    trainer.send_signal(signal.SIGTERM)  # as the pod's PID 1 passes it on
    _, stderr = trainer.communicate(timeout=120)
    assert trainer.returncode == stopping.EXIT_CODE and stopping.EXIT_CODE not in NON_RETRYABLE_EXIT_CODES, stderr
    done = len(_lines(tmp_path / "out1" / "train.jsonl"))
    assert _steps_in(tmp_path / "ckpt") == [done] and done < TOTAL
    assert f"stopped by SIGTERM after {done} of the job's steps; checkpoint after step {done} saved" in stderr
    resumed = _start(tmp_path, "out2")
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr
    losses = [line["loss"] for line in _lines(tmp_path / "out2" / "train.jsonl")]
    assert _close(losses, tp2_reference[done:]), (losses, tp2_reference)


def test_two_ranks_skip_a_damaged_checkpoint_and_print_why(tmp_path, tp2_reference):
    first = _start(tmp_path, "out1", "--steps", "4", "--checkpoint-every", "2")
    _, stderr = first.communicate(timeout=600)
    assert first.returncode == 0 and _steps_in(tmp_path / "ckpt") == [2, 4], stderr
    newest = tmp_path / "ckpt" / "step-00000004"
    assert sorted(p.name for p in newest.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # a part per rank
    shard = newest / "__0_0.distcp"  # in rank 1's share of the digest checks
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    resumed = _start(tmp_path, "out2", "--json")
    stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr
    assert (f"skipping checkpoint {newest}: rank 1: file __0_0.distcp does not match its SHA-256 in the manifest"
            in stderr)
    assert json.loads(stdout.splitlines()[-1])["first_step"] == 2
    losses = [line["loss"] for line in _lines(tmp_path / "out2" / "train.jsonl")]
    assert _close(losses, tp2_reference[2:]), (losses, tp2_reference)


@pytest.mark.parametrize("args,message", [
    (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
    (["--checkpoint-dir", "/tmp/x", "--checkpoint-every", "-1"], "--checkpoint-every must be >= 0, got -1"),
    (["--checkpoint-dir", "/tmp/x", "--checkpoint-keep", "0"], "--checkpoint-keep must be >= 1, got 0"),
])
def test_checkpoint_flags_are_checked_in_one_line(tmp_path, capsys, args, message):
    job_path = tmp_path / "job.yaml"
    job_path.write_text(yaml.safe_dump(_manifest()))
    assert cli_main(["train", str(job_path), "--steps", "1", *args]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"kareus: error: {message}"


def test_two_ranks_refuse_a_foreign_checkpoint_with_the_non_retryable_code(tmp_path):
    first = _start(tmp_path, "out1", "--steps", "1", "--checkpoint-every", "1")
    _, stderr = first.communicate(timeout=600)
    assert first.returncode == 0 and _steps_in(tmp_path / "ckpt") == [1], stderr
    other = _start(tmp_path, "out2", "--optimizer", "sgd")
    _, stderr = other.communicate(timeout=600)
    # A retry cannot help: the pod failure policy fails the job at once on this code.
    assert other.returncode == EXIT_CONFIG and EXIT_CONFIG in NON_RETRYABLE_EXIT_CODES, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("kareus: error: rank ") and "checkpoint step-00000001 is not this run's: " \
        "optimizer: checkpoint 'adamw', this run 'sgd'" in last
