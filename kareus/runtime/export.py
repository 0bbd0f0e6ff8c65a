"""A Kareus checkpoint out as a Hugging Face model directory that other tools load.

`export_checkpoint(CHECKPOINT_DIR, OUT)` reads a checkpoint of any tensor/pipeline/context/data
layout (its TP shards gathered into full tensors, one parameter at a time,
`kareus.runtime.init_from.KareusReader`), splits the fused parameters back into Hugging Face's
tensors (`kareus.runtime.hf_adapter`) and writes

- `config.json` (`LlamaForCausalLM`, or `Qwen3ForCausalLM` for a q/k-norm model; every shape
  field, rope theta and scaling, norm eps, `torch_dtype` the run's parameter type),
- safetensors shards of at most `shard_bytes` (default 5 GB) with `model.safetensors.index.json`,
- the tokenizer files of the Hugging Face directory the run started from (`--init-from`, followed
  back through Kareus checkpoints), when it had them.

`transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads the result. Host memory: one full
parameter plus the shard being filled.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kareus.errors import EXIT_CONFIG, KareusError
from kareus.runtime import hf_adapter
from kareus.runtime.checkpoint import MANIFEST, complete_checkpoints
from kareus.runtime.init_from import KareusReader, tokenizer_dir

DEFAULT_SHARD_BYTES = 5 * 10**9
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Fields of the source model's config.json that a shape does not determine but a tool reads.
_KEPT_CONFIG = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


@dataclass(frozen=True)
class Exported:
    """What an export wrote."""

    out_dir: Path
    step: int
    files: tuple[str, ...]
    total_bytes: int
    tokenizer_from: Path | None


def find_step(checkpoint_dir: str | Path, step: int | None = None) -> Path:
    """The checkpoint to export: `checkpoint_dir` itself when it is a `step-N`, else its step
    `step` (default: the newest complete one)."""
    root = Path(checkpoint_dir)
    if (root / MANIFEST).exists():
        if step is not None and int(json.loads((root / MANIFEST).read_text()).get("step", -1)) != step:
            raise KareusError(f"--step {step}: {root} is another step's checkpoint", exit_code=EXIT_CONFIG)
        return root
    found = complete_checkpoints(root)
    if not found:
        raise KareusError(f"{checkpoint_dir}: no complete checkpoint (a step-N directory with {MANIFEST})",
                          exit_code=EXIT_CONFIG)
    if step is None:
        return found[0]
    for path in found:
        if int(path.name.split("-", 1)[1]) == step:
            return path
    have = ", ".join(p.name.split("-", 1)[1].lstrip("0") or "0" for p in found)
    raise KareusError(f"--step {step}: no complete checkpoint of that step in {root}; allowed: {have}",
                      exit_code=EXIT_CONFIG)


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, *, step: int | None = None,
                      shard_bytes: int = DEFAULT_SHARD_BYTES) -> Exported:
    """Write the Hugging Face directory of a checkpoint; see the module docstring."""
    if shard_bytes < 1:
        raise KareusError(f"--shard-size must be >= 1 byte, got {shard_bytes}", exit_code=EXIT_CONFIG)
    path = find_step(checkpoint_dir, step)
    manifest = json.loads((path / MANIFEST).read_text())
    shape = hf_adapter.shape_from_dict(manifest["model"])
    dtype_name = manifest.get("dtype", "float32")
    dtype = DTYPES.get(dtype_name, torch.float32)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise KareusError(f"--out {out}: not empty; export into a new or empty directory", exit_code=EXIT_CONFIG)
    out.mkdir(parents=True, exist_ok=True)

    names = hf_adapter.stage_param_names(shape, 0, shape.num_layers, is_first=True, is_last=True)
    sizes = {t: _numel(dims) * dtype.itemsize for n in names
             for t, dims in zip(hf_adapter.hf_names(n), hf_adapter.hf_dims(n, shape), strict=True)}
    shards = _plan_shards(names, sizes, shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    reader = KareusReader(path, shape)
    weight_map: dict[str, str] = {}
    for file, members in zip(files, shards, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        for name in members:
            full = reader.full(name)
            for tensor, value in hf_adapter.split_full(name, full, shape).items():
                tensors[tensor] = value.to(dtype).contiguous().clone()  # own storage: safetensors refuses shared
                weight_map[tensor] = file
            del full
        _save(tensors, out / file)
        del tensors

    source_dir = tokenizer_dir(manifest.get("init_from"))
    source_config = _source_config(source_dir)
    extra = {k: source_config[k] for k in _KEPT_CONFIG if k in source_config}
    extra.setdefault("max_position_embeddings", max(8192, int(manifest["model"].get("sequence_length", 0))))
    config = hf_adapter.config_from_shape(shape, dtype=dtype_name, extra=extra)
    (out / hf_adapter.CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    total = sum(sizes.values())
    index = {"metadata": {"total_size": total, "kareus_checkpoint": str(path), "kareus_step": manifest.get("step")},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / hf_adapter.INDEX).write_text(json.dumps(index, indent=2) + "\n")
    written = [*files, hf_adapter.CONFIG, hf_adapter.INDEX]
    if source_dir is not None:
        for name in hf_adapter.TOKENIZER_FILES:
            if (source_dir / name).exists():
                shutil.copyfile(source_dir / name, out / name)
                written.append(name)
    return Exported(out, int(manifest.get("step", 0)), tuple(written), total, source_dir)


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _plan_shards(names: list[str], sizes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    """Kareus parameters grouped into files of at most `shard_bytes` (a larger parameter alone)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name in names:
        size = sum(sizes[t] for t in hf_adapter.hf_names(name))
        if shards[-1] and filled + size > shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _source_config(directory: Path | None) -> dict[str, Any]:
    if directory is None:
        return {}
    try:
        return json.loads((directory / hf_adapter.CONFIG).read_text())
    except (OSError, ValueError):
        return {}
