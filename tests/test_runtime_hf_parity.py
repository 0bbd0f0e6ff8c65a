"""The runtime is the released architectures: the same function as `transformers`' models.

Tiny random Hugging Face models are built in code (never downloaded), saved with
`save_pretrained`, loaded into Kareus through `--init-from`'s reader, and compared in fp32:

- a Llama with `llama3` rope scaling, grouped-query attention and a head_dim that is not
  hidden/heads; a Qwen3 with q/k norms and tied embeddings; both with random (not unit) norms and
  weights large enough that attention is sharp, so a wrong RoPE frequency shows;
- logits within 1e-5 of HF's and the loss within 1e-6, in both engines (sequential and
  partitioned), one process;
- the loss within 1e-6 and every parameter's gradient after one backward within 1e-5 (relative,
  in norm) at TP1, TP2, PP2 and TP2×CP2 (context parallelism runs only together with TP), in both
  engines, in gloo processes: the sharded model is the same function.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kareus.runtime import Schedule, TrainConfig, hf_adapter, run_rank
from kareus.runtime.comm import GroupComm
from kareus.runtime.data import Batcher, load_data
from kareus.runtime.engine import PartitionedBlock, SequentialBlock
from kareus.runtime.init_from import find_source, stage_params
from kareus.runtime.layer_ops import rms_norm, sequence_consts
from kareus.runtime.model import StageLayout, StageModel, shard
from kareus.runtime.optimizer_recipe import OptimizerRecipe
from kareus.runtime.parallel import init_distributed, spawn_local

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

SEQ = 16
MBS, M = 2, 2
VOCAB = 96
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8}


def make_hf(kind: str, directory: Path, seed: int = 0) -> Path:
    """A tiny random HF model, saved; norms random too (a unit norm would hide a misplaced one)."""
    torch.manual_seed(seed)
    common = {"vocab_size": VOCAB, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "initializer_range": 0.2, "max_position_embeddings": 64}
    if kind == "llama":
        config = transformers.LlamaConfig(hidden_size=48, intermediate_size=80, rope_theta=10000.0,
                                          rms_norm_eps=1e-5, rope_scaling=SCALING, **common)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen3Config(hidden_size=32, intermediate_size=64, rms_norm_eps=1e-6,
                                          tie_word_embeddings=True, **common)
        model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def hf_model(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def hf_loss_and_grads(directory: Path, tokens: torch.Tensor, targets: torch.Tensor):
    model = hf_model(directory)
    logits = model(tokens).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def kareus_grad(name: str, hf_grads: dict) -> torch.Tensor:
    """The full gradient of Kareus parameter `name` from HF's (tied: HF's one embedding)."""
    return torch.cat([hf_grads[t] for t in hf_adapter.hf_names(name)])


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


KINDS = ["llama", "qwen3"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: make_hf(kind, root / kind) for kind in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, VOCAB, 4096).astype(np.int32))
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_loss_match_hf_in_both_engines(hf_dirs, kind):
    directory = hf_dirs[kind]
    source = find_source(directory)
    shape = source.shape
    layout = StageLayout(0, 1, 0, shape.num_layers)
    model = StageModel(shape, layout, params=stage_params(source, shape, layout, 1, 0))
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(tokens, -1, 1)
    hf_logits, hf_loss, _ = hf_loss_and_grads(directory, tokens, targets)
    assert (shape.rope_scaling is not None) == (kind == "llama")
    consts = sequence_consts(SEQ, 1, 0, shape.head_dim, shape.rope_theta, scaling=shape.rope_scaling)
    out = model.param("embedding") if shape.tied_embeddings else model.param("output")
    with torch.no_grad():
        x = model.embed(tokens)
        hidden = {"sequential": SequentialBlock(model, GroupComm(None, 1), consts).forward(x),
                  "partitioned": PartitionedBlock(model, GroupComm(None, 1), consts).forward(x, {}, record=False)[0]}
        for engine, h in hidden.items():
            logits = F.linear(rms_norm(h, model.param("final_norm"), shape.norm_eps), out)
            assert (logits - hf_logits).abs().max() < 1e-5, engine
            loss = model.head_loss(h, targets, 1 / targets.numel())
            assert abs(float(loss) - float(hf_loss)) < 1e-6, engine
    assert hf_logits.std() > 0.5  # sharp enough that a wrong rotation would show


# Context parallelism runs with TP only (the simulated GPU's CP partitions are CP+TP ones).
LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "tp2cp2": (2, 1, 2)}


def _config(directory: Path, data: Path, tp: int, pp: int, cp: int) -> TrainConfig:
    source = find_source(directory)
    return TrainConfig(shape=source.shape, seq_len=SEQ, tp=tp, pp=pp, cp=cp, micro_batch_size=MBS,
                       num_microbatches=M, steps=1, recipe=OptimizerRecipe.constant("sgd", 0.0), device="cpu",
                       init_from=str(directory), data_path=str(data))


def _worker(rank: int, store, dirs: dict[str, Path], data: Path, tp: int, pp: int, cp: int, out: str) -> None:
    ctx = None
    saved = {}
    for kind, directory in dirs.items():
        config = _config(directory, data, tp, pp, cp)
        if ctx is None:
            ctx = init_distributed(config.layout, rank=rank, store=store, device="cpu")
        for engine in ("sequential", "partitioned"):
            result, model = run_rank(ctx, config, Schedule.uniform(pp, M, mode=engine), keep_model=True)
            saved[kind, engine] = {"loss": result.losses[0], "tp_rank": ctx.tp_rank,
                                   "grads": {n: p.grad.clone() for n, p in model.named_model_params().items()}}
    torch.save(saved, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, hf_dirs, data_file):
    """Each layout spawned once, training both models in both engines; the ranks' saved results."""
    cache: dict[str, list[dict]] = {}

    def runs(layout: str) -> list[dict]:
        if layout not in cache:
            tp, pp, cp = LAYOUTS[layout]
            out = tmp_path_factory.mktemp(layout)
            dirs = hf_dirs
            if tp * pp * cp == 1:
                _worker(0, None, dirs, data_file, 1, 1, 1, str(out))
            else:
                spawn_local(tp * pp * cp, _worker, dirs, data_file, tp, pp, cp, str(out))
            cache[layout] = [torch.load(out / f"rank{r}.pt") for r in range(tp * pp * cp)]
        return cache[layout]

    return runs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_and_gradients_match_hf_in_every_layout(layout_runs, hf_dirs, data_file, layout, kind):
    tp = LAYOUTS[layout][0]
    directory = hf_dirs[kind]
    shape = find_source(directory).shape
    ranks = layout_runs(layout)
    data = load_data(str(data_file), VOCAB)
    batches = Batcher(data.tokens, SEQ, MBS, M, 1, 0, data.order).microbatches(0, 0, "cpu")
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    _, hf_loss, hf_grads = hf_loss_and_grads(directory, x, y)
    for engine in ("sequential", "partitioned"):
        assert abs(ranks[0][kind, engine]["loss"] - float(hf_loss)) < 1e-6, engine
        seen = set()
        for saved in ranks:
            run = saved[kind, engine]
            for name, grad in run["grads"].items():
                expected = shard(name, kareus_grad(name, hf_grads), shape, run["tp_rank"], tp)
                assert _rel(grad, expected) < 1e-5, (engine, name, _rel(grad, expected))
                seen.add(name)
        assert len(seen) == len(hf_adapter.stage_param_names(shape, 0, shape.num_layers, is_first=True,
                                                             is_last=True))
