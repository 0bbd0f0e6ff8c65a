"""The operator fails a job whose memory plan does not fit its GPU before it creates anything.

Reconciles run against the in-memory API of tests/test_operator_hostile.py; the condition's
message is `kareus validate`'s line for the same manifest.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kareus_operator.metrics import OperatorMetrics
from kareus_operator.reconcile import Reconciler
from kareus_operator.settings import Settings
from test_operator_hostile import JOBS, MemoryKube, job_manifest

from kareus.errors import KareusError

NOW = 1.0e9
ROOT = Path(__file__).resolve().parents[1]


def condition(status: dict, type_: str) -> dict | None:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


def llama70b_tp2(name: str = "big") -> dict:
    job = job_manifest(name)
    job["spec"]["model"] = {"preset": "llama3.3-70b"}
    job["spec"]["sequenceLength"] = 4096
    job["spec"]["parallelism"].update(microBatchSize=2, numMicroBatches=2)
    return job


async def reconcile(job: dict, **settings):
    kube = MemoryKube()
    kube.put(f"{JOBS}/{job['metadata']['name']}", job)
    rec = Reconciler(kube, Settings(**settings), OperatorMetrics())
    return kube, await rec.reconcile(await kube.get(f"{JOBS}/{job['metadata']['name']}"), now=NOW)


async def test_a_job_that_does_not_fit_fails_before_any_child_exists(tmp_path):
    job = llama70b_tp2()
    kube, outcome = await reconcile(job)
    failed = condition(outcome.status, "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "DoesNotFit")
    assert failed["message"].startswith("stage 0 rank needs ") and " GiB on A100-SXM4-40GB (weights " in failed["message"]
    assert outcome.status["phase"] == "Failed"
    assert kube.created == []  # no spec ConfigMap, no profiling Job
    # The same line as `kareus validate`, which exits 78 on it.
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(job))
    result = subprocess.run([sys.executable, "-m", "kareus", "validate", str(path)], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 78
    assert result.stderr.strip() == f"{path}: spec.gpu.product: {failed['message']}"
    assert "stage 0 (80 layers): peak " in result.stdout


async def test_a_job_that_fits_goes_on():
    kube, outcome = await reconcile(job_manifest("small"))
    assert condition(outcome.status, "Failed") is None
    assert any(url.endswith("/jobs/small-profile") for url in kube.created)


async def test_a_cpu_proxy_job_is_planned_for_its_gpu_model():
    job = llama70b_tp2("proxied")
    job["spec"]["training"]["cpuProxy"] = {"layers": 2, "hidden": 64, "ffnHidden": 176, "heads": 4, "kvHeads": 2,
                                           "vocab": 256, "sequenceLength": 32}
    _, outcome = await reconcile(job)
    assert condition(outcome.status, "Failed")["reason"] == "DoesNotFit"


async def test_warn_says_so_once_and_goes_on():
    kube, outcome = await reconcile(llama70b_tp2("warned"), memory_check="warn")
    warnings = [(t, m) for t, r, m in outcome.events if r == "DoesNotFit"]
    assert len(warnings) == 1 and warnings[0][0] == "Warning" and warnings[0][1].startswith("stage 0 rank needs ")
    assert condition(outcome.status, "Failed") is None
    assert any(url.endswith("/jobs/warned-profile") for url in kube.created)
    job = await kube.get(f"{JOBS}/warned")
    job["status"] = outcome.status
    rec = Reconciler(kube, Settings(memory_check="warn"), OperatorMetrics())
    again = await rec.reconcile(job, now=NOW + 5)
    assert not [r for _, r, _ in again.events if r == "DoesNotFit"]  # said once, on the admitting pass


async def test_off_skips_the_plan():
    _, outcome = await reconcile(llama70b_tp2("unchecked"), memory_check="off")
    assert condition(outcome.status, "Failed") is None
    assert all(reason != "DoesNotFit" for _, reason, _ in outcome.events)


def test_the_setting_takes_three_values():
    assert Settings.from_env({"KAREUS_OPERATOR_MEMORY_CHECK": "off"}).memory_check == "off"
    with pytest.raises(KareusError, match=r"KAREUS_OPERATOR_MEMORY_CHECK.*refuse, warn, off"):
        Settings.from_env({"KAREUS_OPERATOR_MEMORY_CHECK": "maybe"})
