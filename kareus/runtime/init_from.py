"""Starting a run from trained weights: a Hugging Face model directory or another Kareus run.

`--init-from DIR` replaces the random initialisation of `kareus.runtime.model` with weights read
from DIR, which is either

- a Hugging Face model directory (`config.json` with `model.safetensors` or a sharded
  `model.safetensors.index.json`; Llama or Qwen3), or
- a Kareus checkpoint (`step-N`, or the checkpoint directory holding it: its newest complete one)
  of any job and any tensor/pipeline/context/data layout. Only the model weights are taken; the
  optimizer starts afresh and the step counts from 0.

The source's model shape is checked against the job's *before any weight is read*: one
`KareusError` (exit 78, the pod failure policy does not retry it) naming every differing field.

Memory. Each rank reads only its own stage's parameters. From a Hugging Face directory it reads
only its tensor-parallel slice of each (`safe_open(...).get_slice`: the rows of its heads, the
columns of its row-parallel inputs), in blocks, so its peak host memory is its shard plus one full
tensor at most (measured: its shard plus one 64 MiB read block; Llama 3.1 8B at TP8, bf16: 3.90 GB
peak for a 3.85 GB shard, `bench/init_from_rss.py`). From a Kareus
checkpoint the saved TP shards of a parameter are gathered into the full tensor and then sliced
for this rank (`kareus.runtime.model.shard`): its shard plus about two full tensors (the pieces and
the full tensor they are joined into), one parameter at a time.

A run that resumes from its own checkpoint (`--checkpoint-dir` holds a complete one) ignores
`--init-from`: its checkpoint carries the trained weights and the optimizer state.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kareus.errors import EXIT_CONFIG, KareusError
from kareus.runtime import hf_adapter
from kareus.runtime.checkpoint import MANIFEST, complete_checkpoints
from kareus.runtime.model import StageLayout, shard
from kareus.workload.models import ModelShape

log = logging.getLogger("kareus.runtime")


@dataclass(frozen=True)
class InitSource:
    """Where the starting weights are: `kind` "hf" (a Hugging Face directory) or "kareus" (one
    complete checkpoint directory `step-N`), and the model shape it holds."""

    kind: str
    path: Path
    shape: ModelShape
    manifest: dict[str, Any] | None = None  # a Kareus checkpoint's

    def describe(self) -> str:
        return f"Hugging Face model {self.path}" if self.kind == "hf" else f"Kareus checkpoint {self.path}"


def find_source(directory: str | Path) -> InitSource:
    """What `--init-from DIR` names; reads only config.json or the manifest."""
    path = Path(directory)
    if not path.is_dir():
        raise KareusError(f"--init-from {directory}: not a directory", exit_code=EXIT_CONFIG)
    if (path / hf_adapter.CONFIG).exists():
        return InitSource("hf", path, hf_adapter.shape_from_config(hf_adapter.read_config(path), path.name))
    step = path if (path / MANIFEST).exists() else next(iter(complete_checkpoints(path)), None)
    if step is None:
        raise KareusError(f"--init-from {directory}: neither a Hugging Face model directory (config.json) nor a "
                          f"Kareus checkpoint (a step-N directory with {MANIFEST}, or its parent)",
                          exit_code=EXIT_CONFIG)
    try:
        manifest = json.loads((step / MANIFEST).read_text())
        shape = hf_adapter.shape_from_dict(manifest["model"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise KareusError(f"--init-from {step}: its manifest {MANIFEST} is damaged ({error})",
                          exit_code=EXIT_CONFIG) from None
    return InitSource("kareus", step, shape, manifest)


def check_source(directory: str | Path, shape: ModelShape) -> InitSource:
    """The source of `--init-from DIR`, checked against the model the job trains."""
    source = find_source(directory)
    hf_adapter.check_shape(source.shape, shape, f"--init-from {source.path}")
    return source


def stage_params(source: InitSource, shape: ModelShape, layout: StageLayout, tp: int,
                 tp_rank: int) -> Iterator[tuple[str, Tensor]]:
    """(name, this rank's value) of every parameter of the stage, read one at a time (the order
    `kareus.runtime.model.StageModel` expects)."""
    names = hf_adapter.stage_param_names(shape, layout.first_layer, layout.num_layers, is_first=layout.is_first,
                                         is_last=layout.is_last)
    if source.kind == "hf":
        ckpt = hf_adapter.HFCheckpoint.open(source.path)
        try:
            for name in names:
                yield name, hf_adapter.read_param(ckpt, name, shape, tp, tp_rank)
        finally:
            ckpt.close()
        return
    reader = KareusReader(source.path, shape)
    for name in names:
        full = reader.full(name)
        local = shard(name, full, shape, tp_rank, tp)
        del full
        yield name, local


class KareusReader:
    """Full (unsharded) parameters out of a Kareus checkpoint of any layout, one at a time.

    A checkpoint keeps each parameter as its TP shards (`model/<name>/tp<r>of<T>`, written by the
    ranks of every stage); the full tensor is the inverse of `kareus.runtime.model.shard`."""

    def __init__(self, step_dir: Path, shape: ModelShape) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.path, self.shape = Path(step_dir), shape
        self._reader = FileSystemReader
        metadata = FileSystemReader(str(step_dir)).read_metadata()
        self.entries: dict[str, Any] = {k: v for k, v in metadata.state_dict_metadata.items()
                                        if k.startswith("model/")}

    def names(self) -> list[str]:
        return sorted({key.split("/")[1] for key in self.entries})

    def shards(self, name: str) -> int:
        keys = [k for k in self.entries if k.split("/")[1] == name]
        if not keys:
            raise KareusError(f"{self.path}: the checkpoint holds no parameter {name!r}", exit_code=EXIT_CONFIG)
        return int(keys[0].rsplit("of", 1)[1])

    def _load(self, keys: list[str]) -> list[Tensor]:
        import torch.distributed.checkpoint as dcp

        target = {k: torch.empty(tuple(self.entries[k].size), dtype=self.entries[k].properties.dtype) for k in keys}
        # no_dist: every rank reads what it needs on its own, whatever process group it is in
        # (DCP warns that it then assumes one process: that is the intent).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(target, storage_reader=self._reader(str(self.path)), no_dist=True)
        return [target[k] for k in keys]

    def full(self, name: str) -> Tensor:
        tp = self.shards(name)
        base = name.rsplit(".", 1)[-1]
        if tp == 1 or base not in ("qkv", "fc1", "proj", "fc2"):
            return self._load([f"model/{name}/tp0of{tp}"])[0]
        pieces = self._load([f"model/{name}/tp{r}of{tp}" for r in range(tp)])
        if base in ("proj", "fc2"):
            return torch.cat(pieces, dim=1)
        if base == "fc1":
            halves = [p.chunk(2) for p in pieces]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        hd = self.shape.head_dim
        q, kv = self.shape.num_heads // tp * hd, self.shape.num_kv_heads // tp * hd
        parts = [p.split((q, kv, kv)) for p in pieces]
        return torch.cat([p[i] for i in range(3) for p in parts])


def tokenizer_dir(init_from: str | None, depth: int = 0) -> Path | None:
    """The Hugging Face directory whose tokenizer a run's weights descend from: `init_from` itself,
    or, for a Kareus checkpoint, the directory its own run started from (followed back)."""
    if not init_from or depth > 8:
        return None
    path = Path(init_from)
    if (path / hf_adapter.CONFIG).exists():
        return path if any((path / f).exists() for f in hf_adapter.TOKENIZER_FILES) else None
    step = path if (path / MANIFEST).exists() else next(iter(complete_checkpoints(path)), None)
    if step is None:
        return None
    try:
        manifest = json.loads((step / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return tokenizer_dir(manifest.get("init_from"), depth + 1)
