"""SIGTERM to `kareus train` (a training pod's PID 1 passes the kubelet's on to it) stops every rank
after the same step, with a retryable exit code, and leaves no rank behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import yaml
from kube_helpers import wait_until

from kareus.errors import NON_RETRYABLE_EXIT_CODES
from kareus.runtime import stopping

STEPS = 500  # far more than run before the signal: the run must stop early


def test_sigterm_stops_every_rank_after_one_agreed_step(tmp_path):
    job = {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob", "metadata": {"name": "stop-test"},
           "spec": {"model": {"preset": "tiny"}, "sequenceLength": 16,
                    "parallelism": {"tensor": 2, "pipeline": 1, "context": 1, "data": 1,
                                    "microBatchSize": 2, "numMicroBatches": 2},
                    "objective": {"maxThroughput": {}},
                    "training": {"image": "x", "steps": STEPS, "gpusPerNode": 2, "nodes": 1}}}
    job_path, out = tmp_path / "job.yaml", tmp_path / "out"
    job_path.write_text(yaml.safe_dump(job))
    trainer = subprocess.Popen([sys.executable, "-m", "kareus", "train", str(job_path), "--nproc", "2", "--out",
                                str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log = out / "train.jsonl"

    def logged_steps() -> int:
        assert trainer.poll() is None, trainer.communicate()  # still training
        return len(log.read_text().splitlines()) if log.exists() else 0

    wait_until(logged_steps, lambda steps: steps >= 2, timeout_s=240, what="two logged steps", interval_s=0.1)
    ranks = [child for child in psutil.Process(trainer.pid).children(recursive=True)
             if "python" in child.name().lower() or "spawn" in " ".join(child.cmdline())]
    assert ranks, "the ranks are child processes of kareus train"
    trainer.send_signal(signal.SIGTERM)  # as the pod's PID 1 passes it on
    _, stderr = trainer.communicate(timeout=120)
    assert trainer.returncode == stopping.EXIT_CODE == 143, stderr
    assert stopping.EXIT_CODE not in NON_RETRYABLE_EXIT_CODES  # the pod failure policy retries it
    assert "stopped by SIGTERM" in stderr
    stopped = [line for line in stderr.splitlines() if "stopping after step" in line]
    assert len(stopped) == 2 and len({line.split("stopping after step")[1] for line in stopped}) == 1, stderr
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert 2 <= len(lines) < STEPS and [line["step"] for line in lines] == list(range(len(lines)))
    # Every child ends with the run (multiprocessing's resource tracker notices its parent's exit a moment
    # later, so the wait is bounded, not instant); psutil's handles never mistake a reused pid for a child.
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert not [child.pid for child in alive if child.status() != psutil.STATUS_ZOMBIE]
