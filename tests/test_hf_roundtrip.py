"""From a published model to a published model, through the command line.

A tiny random Llama-3-style Hugging Face model (made in code, with a tokenizer) goes in with
`kareus train --init-from` at TP2×PP2 with lr 0 for 2 steps, out of the checkpoint with
`kareus export`, and `transformers` loads the export: the original logits within 1e-5, the
tokenizer files copied. A Kareus checkpoint saved at TP2×PP2 starts a TP1×PP1 job and a TP2×PP2 job
at the same first-step loss (1e-5). `kareus model from-hf` prints the spec block; a config.json
that is not the job's model is one error naming every differing field, exit 78, before any
weight is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hf_models import hf_logits, write_job

from kareus.cli import main as cli_main
from kareus.errors import EXIT_CONFIG
from kareus.runtime import hf_adapter, train
from kareus.runtime.optimizer_recipe import OptimizerRecipe
from kareus.spec import parse_job

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

VOCAB, SEQ = 96, 16
# Llama 3.1's structure at a tiny size: GQA, rope theta 500000, eps 1e-5, llama3 rope scaling (with an
# original context of 8 positions, so that the scaling changes most frequencies at 16).
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8}
HF_SHAPE = {"vocab_size": VOCAB, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5, "initializer_range": 0.2, "max_position_embeddings": 64, "rope_scaling": SCALING}
SPEC_MODEL = {"layers": 2, "hidden": 48, "ffnHidden": 64, "heads": 4, "kvHeads": 2, "headDim": 16, "vocab": VOCAB,
              "ropeScaling": {"type": "llama3", "factor": 8.0, "lowFreqFactor": 1.0, "highFreqFactor": 4.0,
                              "originalMaxPositionEmbeddings": 8}}


def _make_hf(directory: Path, **changes) -> Path:
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF_SHAPE, **changes}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def _job(path: Path, name: str, tp: int, pp: int, model: dict | None = None) -> Path:
    return write_job(path, name, model or SPEC_MODEL, seq=SEQ, tp=tp, pp=pp, steps=2)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("roundtrip")
    hf = _make_hf(root / "hf")
    data = root / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, VOCAB, 4096).astype(np.int32))
    return root, hf, data


def test_hf_in_train_export_and_transformers_loads_the_same_model(world, capsys):
    root, hf, data = world
    job = _job(root / "job.yaml", "roundtrip", 2, 2)
    checkpoints = root / "ck"
    assert cli_main(["train", str(job), "--init-from", str(hf), "--lr", "0", "--steps", "2", "--data", str(data),
                     "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2", "--json"]) == 0
    manifest = json.loads((checkpoints / "step-00000002" / "kareus-checkpoint.json").read_text())
    assert manifest["init_from"] == str(hf.resolve())
    out = root / "export"
    assert cli_main(["export", str(checkpoints), "--out", str(out), "--shard-size", "60KB"]) == 0
    assert "step 2 ->" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded at 60 kB
    assert (out / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    assert (out / "tokenizer_config.json").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    original, exported = hf_logits(hf, tokens), hf_logits(out, tokens)
    assert (exported - original).abs().max() < 1e-5
    assert original.std() > 0.5


def test_a_kareus_checkpoint_starts_any_layout_at_the_same_loss(world):
    root, _, data = world
    checkpoints = root / "ck"
    if not checkpoints.exists():
        pytest.skip("needs the round trip's checkpoint")
    losses = {}
    for tp, pp in ((1, 1), (2, 2)):
        job = parse_job(yaml.safe_load(_job(root / f"job{tp}{pp}.yaml", f"from-ckpt-{tp}{pp}", tp, pp).read_text()))
        result = train(job, job_name=job.name, steps=1, init_from=str(checkpoints), data_path=str(data), recipe=OptimizerRecipe.constant("adamw", 1e-3),
                       device="cpu")
        losses[tp, pp] = result.losses[0]
    assert abs(losses[1, 1] - losses[2, 2]) <= 1e-5 * abs(losses[2, 2])


def test_model_from_hf_prints_the_spec_block(world, capsys, tmp_path):
    _, hf, _ = world
    assert cli_main(["model", "from-hf", str(hf)]) == 0
    block = yaml.safe_load(capsys.readouterr().out)["model"]
    assert {k: block[k] for k in SPEC_MODEL} == SPEC_MODEL
    assert block["ropeTheta"] == 500000.0 and block["normEps"] == 1e-5 and block["qkNorm"] is False
    # the block is a valid spec.model whose shape is the checkpoint's
    job = parse_job(yaml.safe_load(_job(tmp_path / "job.yaml", "from-hf", 1, 1, block).read_text()))
    assert not hf_adapter.shape_differences(hf_adapter.shape_from_config(json.loads((hf / "config.json").read_text())),
                                            job.spec.model_shape())


def test_from_hf_names_a_matching_preset():
    shape = hf_adapter.shape_from_config({"model_type": "qwen3", "num_hidden_layers": 28, "hidden_size": 2048,
                                          "intermediate_size": 6144, "num_attention_heads": 16,
                                          "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                                          "tie_word_embeddings": True, "rope_theta": 1000000.0,
                                          "rms_norm_eps": 1e-6})
    assert hf_adapter.spec_model_block(shape) == {"preset": "qwen3-1.7b"}
    # Llama 3.1 8B as released: its rope scaling makes it the preset
    llama = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}}
    assert hf_adapter.spec_model_block(hf_adapter.shape_from_config(llama)) == {"preset": "llama3.1-8b"}
    unscaled = hf_adapter.shape_from_config({**llama, "rope_scaling": None})
    assert "ropeTheta" in hf_adapter.spec_model_block(unscaled)


def test_a_mismatched_config_is_one_error_naming_every_field_exit_78(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    config = transformers.LlamaConfig(**{**HF_SHAPE, "num_key_value_heads": 4, "intermediate_size": 128})
    config.save_pretrained(hf)  # config only: the check must come before any weight is looked for
    job = _job(tmp_path / "job.yaml", "mismatch", 2, 2)
    assert cli_main(["train", str(job), "--init-from", str(hf), "--steps", "1"]) == EXIT_CONFIG
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "num_key_value_heads: checkpoint 4, job 2" in err[0]
    assert "intermediate_size: checkpoint 128, job 64" in err[0]


def test_the_runs_own_checkpoint_wins_over_init_from(tmp_path, caplog):
    """A restarted run resumes its own work: --init-from (here not even this model) is not read."""
    job = parse_job(yaml.safe_load(_job(tmp_path / "job.yaml", "wins", 1, 1).read_text()))
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, VOCAB, 2048).astype(np.int32))
    common = {"job_name": job.name, "data_path": str(data), "checkpoint_dir": str(tmp_path / "ck"), "device": "cpu"}
    train(job, steps=1, checkpoint_every=1, **common)
    other = tmp_path / "other"
    other.mkdir()
    transformers.LlamaConfig(**{**HF_SHAPE, "num_key_value_heads": 4}).save_pretrained(other)
    with caplog.at_level("INFO", logger="kareus.runtime"):
        result = train(job, steps=2, init_from=str(other), **common)
    assert result.first_step == 1 and len(result.losses) == 1
    assert "holds a checkpoint of this run, which wins" in caplog.text


def test_export_refuses_a_missing_step_and_a_bad_size(tmp_path, capsys):
    (tmp_path / "ck").mkdir()
    assert cli_main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "out")]) == EXIT_CONFIG
    assert "no complete checkpoint" in capsys.readouterr().err
    assert cli_main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "out"), "--shard-size", "5 parsecs"]) == 2
    assert "--shard-size: '5 parsecs' is not a size" in capsys.readouterr().err


def test_a_qwen3_model_with_tied_embeddings_exports_as_qwen3(tmp_path):
    """q/k norms and one shared embedding survive the trip (no lm_head written), TP1 in-process."""
    torch.manual_seed(1)
    config = transformers.Qwen3Config(**{**HF_SHAPE, "tie_word_embeddings": True, "rope_scaling": None})
    hf = tmp_path / "qwen3"
    transformers.Qwen3ForCausalLM(config).save_pretrained(hf)
    model = {**{k: v for k, v in SPEC_MODEL.items() if k != "ropeScaling"}, "qkNorm": True, "tiedEmbeddings": True,
             "ropeTheta": 500000.0, "normEps": 1e-5}
    job = parse_job(yaml.safe_load(_job(tmp_path / "job.yaml", "qwen", 1, 1, model).read_text()))
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, VOCAB, 2048).astype(np.int32))
    train(job, job_name=job.name, steps=1, recipe=OptimizerRecipe.constant("adamw", 0.0), init_from=str(hf), data_path=str(data), device="cpu",
          checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=1)
    assert cli_main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["tie_word_embeddings"] is True
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]
    assert "model.layers.1.self_attn.q_norm.weight" in index["weight_map"]
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    assert (hf_logits(tmp_path / "out", tokens) - hf_logits(hf, tokens)).abs().max() < 1e-5
