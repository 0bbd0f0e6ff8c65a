"""`kareus validate`: exit 0 for valid manifests, every error and exit 1 otherwise, never a traceback.

The quickstart's Llama 3.2 3B does not fit its A100-40GB (tests/test_memory_plan.py): the manifest
checks here run with `--no-memory-plan`; the memory refusal is tested in tests/test_operator_memory.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kareus.cli import main

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
INVALID = ROOT / "tests" / "data" / "invalid"


def test_valid_manifests_exit_zero(capsys):
    assert main(["validate", "--no-memory-plan", str(QUICKSTART), str(ROOT / "examples" / "llama3.2-3b-a100.yaml")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2
    assert out[0].endswith("valid KareusJob default/quickstart: llama3.2-3b, TP4 PP1 CP1 DP1 on 4 GPUs, objective "
                           "maxThroughput; on CPU trains a proxy of 2 layers, hidden 128, 64 tokens")


def test_every_error_is_printed_with_file_and_path(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(QUICKSTART.read_text().replace("tensor: 4", "tensor: 0").replace("steps: 8", "steps: -1"))
    assert main(["validate", "--no-memory-plan", str(QUICKSTART), str(bad)]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"{bad}: spec.parallelism.tensor: must be an integer in [1, 4096], got 0",
        f"{bad}: spec.training.steps: must be an integer in [1, 1000000000], got -1",
    ]
    assert "quickstart.yaml: valid" in captured.out


def test_json_output(capsys):
    assert main(["validate", "--json", str(INVALID / "odd-microbatch.yaml")]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] is False
    assert report["errors"][0]["path"] == "spec.parallelism.microBatchSize"
    assert main(["validate", "--json", "--no-memory-plan", str(QUICKSTART)]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["parallelism"]["nanobatching"] is True


def test_missing_file_and_bad_yaml_are_one_line_each_without_traceback(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: {model: [\n")
    missing = tmp_path / "nope.yaml"
    result = subprocess.run([sys.executable, "-m", "kareus", "validate", str(missing), str(broken)],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and "Traceback" not in result.stderr
    assert lines[0] == f"{missing}: no such file"
    assert lines[1].startswith(f"{broken}: not valid YAML: ")


def test_usage_errors_exit_two(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["validate"])
    assert stop.value.code == 2
    assert "JOB.yaml" in capsys.readouterr().err


def test_the_memory_plan_is_printed_and_a_job_that_fits_exits_zero(capsys):
    qwen = ROOT / "examples" / "qwen3-1.7b-cp2tp4.yaml"
    assert main(["validate", str(qwen)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("  stage 0 (15 layers): peak ") and out[2].startswith("  stage 1 (13 layers): peak ")
    assert main(["validate", "--json", str(qwen)]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["fits"] and memory["gpu"] == "A100-SXM4-40GB" and len(memory["stages"]) == 2


def test_a_job_that_does_not_fit_exits_78_with_one_line(capsys):
    assert main(["validate", str(QUICKSTART)]) == 78
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"{QUICKSTART}: spec.gpu.product: stage 0 rank needs ")
