"""`kareus train --export-dir` (issue 43, the cluster's `spec.training.export`): after the final step
the run checkpoints that step if it has not, and rank 0 writes the Hugging Face export, through
`DIR.partial` renamed into place; a resumed run that finds the export done writes nothing, a killed
export's leftovers are replaced, and the flag without `--checkpoint-dir` is a config error (78)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hf_models import hf_logits, write_job

from kareus.cli import main as cli_main
from kareus.errors import EXIT_CONFIG, KareusError
from kareus.runtime import train
from kareus.spec import parse_job

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

VOCAB, SEQ = 64, 16
HF_SHAPE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 64}
SPEC_MODEL = {"layers": 2, "hidden": 32, "ffnHidden": 48, "heads": 4, "kvHeads": 2, "headDim": 8, "vocab": VOCAB}


def job_file(path: Path, tp: int) -> Path:
    return write_job(path, "exp", SPEC_MODEL, seq=SEQ, tp=tp, pp=1, steps=3)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("export-dir")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SHAPE)).save_pretrained(root / "hf")
    data = root / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, VOCAB, 4096).astype(np.int32))
    return root, root / "hf", data


def test_the_final_step_is_checkpointed_and_exported_by_rank_0(world, capsys):
    root, hf, data = world
    ck, out = root / "ck", root / "export"
    args = ["train", str(job_file(root / "job.yaml", 2)), "--init-from", str(hf), "--data", str(data),
            "--lr", "1e-2", "--checkpoint-dir", str(ck), "--export-dir", str(out)]
    assert cli_main(args) == 0  # no --checkpoint-every: only the final step's checkpoint
    assert f"export: {out}" in capsys.readouterr().out
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == ["step-00000003"]
    manifest = json.loads((ck / "step-00000003" / "kareus-checkpoint.json").read_text())
    assert manifest["reason"] == "final"
    assert not (root / "export.partial").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["kareus_step"] == 3
    # The export is the trained checkpoint: the same logits as `kareus export` of it, not the start's.
    assert cli_main(["export", str(ck), "--out", str(root / "again")]) == 0
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    exported = hf_logits(out, tokens)
    assert torch.equal(exported, hf_logits(root / "again", tokens))
    assert (exported - hf_logits(hf, tokens)).abs().max() > 1e-3  # 3 steps at lr 1e-2 moved the weights


def test_a_killed_export_is_replaced_a_finished_one_kept_another_steps_refused(world, tmp_path, caplog):
    _, hf, data = world
    job = parse_job(yaml.safe_load(job_file(tmp_path / "job.yaml", 1).read_text()))
    common = {"job_name": job.name, "data_path": str(data), "init_from": str(hf), "device": "cpu",
              "checkpoint_dir": str(tmp_path / "ck"), "export_dir": str(tmp_path / "out")}
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / "model-00001-of-00002.safetensors").write_bytes(b"half")  # a pod killed mid-export
    with caplog.at_level("INFO", logger="kareus.runtime"):
        result = train(job, steps=2, **common)
    assert result.exported == str(tmp_path / "out") and not partial.exists()
    written = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()}
    assert {"config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"} <= set(written)
    assert "model-00001-of-00002.safetensors" not in written  # nothing of the killed export survives
    assert "exported step 2 as a Hugging Face model" in caplog.text
    # Run again (a pod restarted after the export): it resumes at the final step and keeps the export.
    caplog.clear()
    with caplog.at_level("INFO", logger="kareus.runtime"):
        again = train(job, steps=2, **common)
    assert again.first_step == 2 and again.losses == () and again.exported == str(tmp_path / "out")
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir()} == written
    assert "export of step 2 already in" in caplog.text
    # A longer run into the same directory: never overwrites the export of another step.
    with pytest.raises(KareusError, match=r"holds an export of step 2, not of step 3") as refused:
        train(job, steps=3, **common)
    assert refused.value.exit_code == EXIT_CONFIG


def test_export_dir_needs_a_checkpoint_dir(tmp_path, capsys):
    assert cli_main(["train", str(job_file(tmp_path / "job.yaml", 1)), "--export-dir", str(tmp_path / "out")]) \
        == EXIT_CONFIG
    assert "--export-dir needs --checkpoint-dir" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
