"""Hugging Face at the boundary: configs, tensor names and sliced reads of published weights.

A state-dict adapter in the torchtitan sense: small pure functions that translate between a
Hugging Face `config.json` / safetensors checkpoint (`LlamaForCausalLM`, `Qwen3ForCausalLM`) and a
Kareus `ModelShape` / parameter names. The runtime itself never sees a Hugging Face name.

Names. Kareus fuses what Hugging Face keeps apart, so one Kareus parameter is made of HF tensors:

- `layers.N.qkv`   = rows of `q_proj`, `k_proj`, `v_proj` stacked (q | k | v),
- `layers.N.fc1`   = rows of `gate_proj`, `up_proj` stacked (gate | up),
- `layers.N.proj`  = `o_proj`, `layers.N.fc2` = `down_proj`,
- `layers.N.norm_attn` / `norm_mlp` = `input_layernorm` / `post_attention_layernorm`,
- `layers.N.q_norm` / `k_norm` = `self_attn.q_norm` / `k_norm` (Qwen3),
- `embedding` = `model.embed_tokens`, `final_norm` = `model.norm`, `output` = `lm_head` (absent
  when the embeddings are tied).

RoPE needs no permutation: Hugging Face's Llama rotates (first half, second half) of each head
(`rotate_half`), exactly as `kareus.runtime.layer_ops.apply_rope` does; the parity tests check it.

Sliced reads. `read_param` returns only one tensor-parallel rank's slice of a Kareus parameter,
reading from the safetensors files only the rows (QKV heads, FC1 halves) or columns (projection,
FC2) that rank holds, through `safe_open(...).get_slice`, straight into the tensor it returns, one
64 MiB block of the file at a time, unmapping the file after each block. Replicated tensors (norms,
embedding, output) are read whole, in the same blocks. So a rank that loads its stage this way holds
its shard plus one read block — within the shard-plus-one-full-tensor bound of
`kareus.runtime.model`'s random initialisation.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kareus.errors import EXIT_CONFIG, KareusError
from kareus.runtime.layer_ops import LocalShape
from kareus.workload.models import PRESETS, ModelShape, RopeScaling

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# (config.json key, ModelShape attribute) of every plain dimension; qk-norm is the model type,
# rope theta and scaling have two spellings (transformers 4.x top level, 5.x `rope_parameters`).
HF_FIELDS: tuple[tuple[str, str], ...] = (
    ("num_hidden_layers", "num_layers"),
    ("hidden_size", "hidden_size"),
    ("intermediate_size", "ffn_hidden_size"),
    ("num_attention_heads", "num_heads"),
    ("num_key_value_heads", "num_kv_heads"),
    ("head_dim", "head_dim"),
    ("vocab_size", "vocab_size"),
    ("tie_word_embeddings", "tied_embeddings"),
    ("rope_theta", "rope_theta"),
    ("rms_norm_eps", "norm_eps"),
)
ROPE_SCALING_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


# configs ---------------------------------------------------------------------------------------

def read_config(directory: str | Path) -> dict[str, Any]:
    """`DIR/config.json` as a dict; a `KareusError` (exit 78) when it is missing or not JSON."""
    path = Path(directory) / CONFIG
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise KareusError(f"--init-from {directory}: no {CONFIG} (a Hugging Face model directory has config.json "
                          f"and model.safetensors or {INDEX})", exit_code=EXIT_CONFIG) from None
    except (OSError, ValueError) as error:
        raise KareusError(f"{path}: not a readable JSON config ({error})", exit_code=EXIT_CONFIG) from None


def shape_from_config(config: dict[str, Any], name: str = "hf") -> ModelShape:
    """The `ModelShape` of a Llama or Qwen3 `config.json`; one error naming every unsupported field."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise KareusError(f"config.json model_type: {model_type!r} is not supported; allowed: "
                          f"{', '.join(ARCHITECTURES)}", exit_code=EXIT_CONFIG)
    problems = []
    for key, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                         ("use_sliding_window", False)):
        if config.get(key, allowed) != allowed:
            problems.append(f"{key}: {config[key]!r} (allowed: {allowed!r})")
    if problems:
        raise KareusError(f"config.json: the runtime implements no {'; '.join(problems)}", exit_code=EXIT_CONFIG)
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        rope = config.get("rope_parameters") or {}
        values = {
            "num_layers": int(config["num_hidden_layers"]),
            "hidden_size": hidden,
            "ffn_hidden_size": int(config["intermediate_size"]),
            "num_heads": heads,
            "num_kv_heads": int(config.get("num_key_value_heads") or heads),
            "head_dim": int(config.get("head_dim") or hidden // heads),
            "vocab_size": int(config["vocab_size"]),
            "qk_norm": model_type == "qwen3",
            "tied_embeddings": bool(config.get("tie_word_embeddings", False)),
            "rope_theta": float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        }
    except KeyError as error:
        raise KareusError(f"config.json: missing {error.args[0]!r}", exit_code=EXIT_CONFIG) from None
    except (TypeError, ValueError) as error:
        raise KareusError(f"config.json: a dimension is not a number ({error})", exit_code=EXIT_CONFIG) from None
    scaling = _rope_scaling(config.get("rope_scaling") or rope)
    if scaling is not None:
        values["rope_scaling"] = scaling
    return ModelShape(name, **values)


def _rope_scaling(raw: dict[str, Any]):
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise KareusError(f"config.json rope_scaling.rope_type: {kind!r} is not supported; allowed: default, llama3",
                          exit_code=EXIT_CONFIG)
    try:
        return RopeScaling(type="llama3", factor=float(raw["factor"]), low_freq_factor=float(raw["low_freq_factor"]),
                           high_freq_factor=float(raw["high_freq_factor"]),
                           original_max_position_embeddings=int(raw["original_max_position_embeddings"]))
    except KeyError as error:
        raise KareusError(f"config.json rope_scaling: missing {error.args[0]!r}", exit_code=EXIT_CONFIG) from None
    except KareusError as error:
        raise KareusError(f"config.json rope_scaling: {error}", exit_code=EXIT_CONFIG) from None


def config_from_shape(shape: ModelShape, *, dtype: str = "float32", max_position_embeddings: int = 8192,
                      extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `config.json` for `shape`, in the released models' spelling (top-level `rope_theta` and
    `rope_scaling`, `torch_dtype`), which transformers 4.x and 5.x both read."""
    model_type = "qwen3" if shape.qk_norm else "llama"
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "max_position_embeddings": max_position_embeddings,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if model_type == "llama":
        config["mlp_bias"] = False
    else:
        config["use_sliding_window"] = False
    for key, attr in HF_FIELDS:
        config[key] = getattr(shape, attr)
    scaling = shape.rope_scaling
    config["rope_scaling"] = None if scaling is None else {
        "rope_type": scaling.type, **{k: getattr(scaling, k) for k in ROPE_SCALING_FIELDS}}
    return {**config, **(extra or {})}


def shape_differences(theirs: ModelShape, mine: ModelShape, *, mine_name: str = "job") -> list[str]:
    """Every field where the checkpoint's shape differs from the job's, in config.json's names:
    `num_key_value_heads: checkpoint 8, job 4`."""
    out = []
    for key, attr in (*HF_FIELDS, ("model_type (qk-norm)", "qk_norm")):
        a, b = getattr(theirs, attr), getattr(mine, attr)
        if key == "model_type (qk-norm)":
            a, b = ("qwen3" if a else "llama"), ("qwen3" if b else "llama")
        if not _same(a, b):
            out.append(f"{key}: checkpoint {a}, {mine_name} {b}")
    a, b = theirs.rope_scaling, mine.rope_scaling
    if a is None or b is None:
        if a is not b:
            out.append(f"rope_scaling: checkpoint {_scaling_words(a)}, {mine_name} {_scaling_words(b)}")
    else:
        for f in ("type", *ROPE_SCALING_FIELDS):
            if not _same(getattr(a, f), getattr(b, f)):
                out.append(f"rope_scaling.{f}: checkpoint {getattr(a, f)}, {mine_name} {getattr(b, f)}")
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    return a == b


def _scaling_words(scaling) -> str:
    return "none" if scaling is None else f"{scaling.type} ×{scaling.factor:g}"


def check_shape(theirs: ModelShape, mine: ModelShape, where: str) -> None:
    """One `KareusError` (exit 78: a retry cannot fix it) naming every differing field."""
    differences = shape_differences(theirs, mine)
    if differences:
        raise KareusError(f"{where}: the checkpoint is not this job's model: {'; '.join(differences)}",
                          exit_code=EXIT_CONFIG)


def matching_preset(shape: ModelShape) -> str | None:
    """The preset whose every dimension equals `shape`'s, if any."""
    for name, preset in PRESETS.items():
        if not shape_differences(preset, shape):
            return name
    return None


def spec_model_block(shape: ModelShape) -> dict[str, Any]:
    """The `spec.model` mapping of a job that trains `shape`: a preset when one matches."""
    preset = matching_preset(shape)
    if preset is not None:
        return {"preset": preset}
    block: dict[str, Any] = {
        "layers": shape.num_layers, "hidden": shape.hidden_size, "ffnHidden": shape.ffn_hidden_size,
        "heads": shape.num_heads, "kvHeads": shape.num_kv_heads, "headDim": shape.head_dim,
        "vocab": shape.vocab_size, "qkNorm": shape.qk_norm, "tiedEmbeddings": shape.tied_embeddings,
        "ropeTheta": shape.rope_theta, "normEps": shape.norm_eps,
    }
    scaling = shape.rope_scaling
    if scaling is not None:
        from kareus.spec.types import rope_scaling_manifest

        block["ropeScaling"] = rope_scaling_manifest(scaling)
    return block


def shape_from_dict(values: dict[str, Any]) -> ModelShape:
    """A `ModelShape` from `dataclasses.asdict` of one (a checkpoint manifest's `model`)."""
    known = {f.name for f in fields(ModelShape)}
    kwargs = {k: v for k, v in values.items() if k in known}
    if isinstance(kwargs.get("rope_scaling"), dict):
        kwargs["rope_scaling"] = RopeScaling(**kwargs["rope_scaling"])
    return ModelShape(**kwargs)


# names -----------------------------------------------------------------------------------------

_LAYER_TENSORS = {
    "norm_attn": ("input_layernorm",),
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "proj": ("self_attn.o_proj",),
    "norm_mlp": ("post_attention_layernorm",),
    "fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "fc2": ("mlp.down_proj",),
    "q_norm": ("self_attn.q_norm",),
    "k_norm": ("self_attn.k_norm",),
}
_END_TENSORS = {"embedding": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "output": "lm_head.weight"}


def hf_names(name: str) -> tuple[str, ...]:
    """The Hugging Face tensors a Kareus parameter is made of, in stacking order."""
    if name in _END_TENSORS:
        return (_END_TENSORS[name],)
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "layers" or parts[2] not in _LAYER_TENSORS:
        raise KareusError(f"no Hugging Face tensor for Kareus parameter {name!r}")
    return tuple(f"model.layers.{parts[1]}.{t}.weight" for t in _LAYER_TENSORS[parts[2]])


def split_full(name: str, full: Tensor, shape: ModelShape) -> dict[str, Tensor]:
    """The Hugging Face tensors of a full (unsharded) Kareus parameter (views of `full`)."""
    names = hf_names(name)
    base = name.rsplit(".", 1)[-1]
    if base == "qkv":
        pieces = full.split((shape.q_size, shape.kv_size, shape.kv_size))
    elif base == "fc1":
        pieces = full.chunk(2)
    else:
        pieces = (full,)
    return dict(zip(names, pieces, strict=True))


def stage_param_names(shape: ModelShape, first_layer: int, num_layers: int, *, is_first: bool,
                      is_last: bool) -> list[str]:
    """The parameters a stage holds, in `kareus.runtime.model.initial_params`' order."""
    bases = ["norm_attn", "qkv", "proj", "norm_mlp", "fc1", "fc2"] + (["q_norm", "k_norm"] if shape.qk_norm else [])
    names = [f"layers.{i}.{b}" for i in range(first_layer, first_layer + num_layers) for b in bases]
    if is_first or (is_last and shape.tied_embeddings):
        names.append("embedding")
    if is_last:
        names.append("final_norm")
        if not shape.tied_embeddings:
            names.append("output")
    return names


# sliced reads ----------------------------------------------------------------------------------

@dataclass
class HFCheckpoint:
    """A Hugging Face model directory, its safetensors files opened lazily (nothing is read until
    a tensor or a slice of one is asked for)."""

    directory: Path
    weight_map: dict[str, str]  # tensor name -> file name

    @classmethod
    def open(cls, directory: str | Path) -> HFCheckpoint:
        directory = Path(directory)
        if (directory / INDEX).exists():
            try:
                weight_map = dict(json.loads((directory / INDEX).read_text())["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise KareusError(f"{directory / INDEX}: not a safetensors index ({error})",
                                  exit_code=EXIT_CONFIG) from None
        elif (directory / SINGLE).exists():
            from safetensors import safe_open

            with safe_open(str(directory / SINGLE), framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE)
        else:
            raise KareusError(f"--init-from {directory}: neither {SINGLE} nor {INDEX} (only safetensors "
                              f"weights are read)", exit_code=EXIT_CONFIG)
        return cls(directory, weight_map)

    def __post_init__(self) -> None:
        self._handles: dict[str, Any] = {}

    def _file(self, tensor: str):
        from safetensors import safe_open

        if tensor not in self.weight_map:
            raise KareusError(f"{self.directory}: tensor {tensor!r} is missing from the checkpoint",
                              exit_code=EXIT_CONFIG)
        file = self.weight_map[tensor]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.directory / file), framework="pt")
        return self._handles[file]

    def dims(self, tensor: str) -> tuple[int, ...]:
        return tuple(self._file(tensor).get_slice(tensor).get_shape())

    def dtype(self, tensor: str) -> torch.dtype:
        code = self._file(tensor).get_slice(tensor).get_dtype()
        if code not in _SAFETENSORS_DTYPES:
            raise KareusError(f"{self.directory}: tensor {tensor} is {code}; allowed: "
                              f"{', '.join(_SAFETENSORS_DTYPES)}", exit_code=EXIT_CONFIG)
        return _SAFETENSORS_DTYPES[code]

    def read_into(self, out: Tensor, tensor: str, rows: tuple[int, int], columns: tuple[int, int] | None) -> None:
        """Copy rows `[a, b)` (and columns `[c, d)` of a matrix) of `tensor` into `out`, a block of
        at most `READ_BLOCK_BYTES` of the file at a time, unmapping the file after each block.

        The reads go through a memory map, and every page a read touched counts in the process's
        resident memory while the file stays mapped (a column slice touches whole rows): so
        besides `out` a read holds one block, never the tensor."""
        dims = self.dims(tensor)
        row_bytes = self.dtype(tensor).itemsize * (dims[1] if len(dims) > 1 else 1)
        step = max(1, READ_BLOCK_BYTES // row_bytes)
        start, stop = rows
        for first in range(start, stop, step):
            last = min(first + step, stop)
            view = self._file(tensor).get_slice(tensor)
            out[first - start:last - start] = view[first:last] if columns is None else view[first:last, slice(*columns)]
            del view
            self.release()

    def release(self) -> None:
        """Close (unmap) every file opened so far."""
        self._handles.clear()

    close = release


READ_BLOCK_BYTES = 64 * 2**20
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def read_param(ckpt: HFCheckpoint, name: str, shape: ModelShape, tp: int = 1, tp_rank: int = 0) -> Tensor:
    """Tensor-parallel rank `tp_rank`'s slice of Kareus parameter `name` (what
    `kareus.runtime.model.shard` cuts from the full tensor), reading only that slice, in blocks,
    straight into the one tensor it returns (its own storage, never a view of the file's map)."""
    try:
        return _read_param(ckpt, name, shape, tp, tp_rank)
    finally:
        ckpt.release()


def _read_param(ckpt: HFCheckpoint, name: str, shape: ModelShape, tp: int, tp_rank: int) -> Tensor:
    names = hf_names(name)
    base = name.rsplit(".", 1)[-1]
    dims = hf_dims(name, shape)
    _check_dims(ckpt, name, names, dims)
    dtype = ckpt.dtype(names[0])
    sharded = tp > 1 and base in ("qkv", "fc1", "proj", "fc2")
    if sharded and base in ("proj", "fc2"):
        n = dims[0][1] // tp
        out = torch.empty((dims[0][0], n), dtype=dtype)
        ckpt.read_into(out, names[0], (0, dims[0][0]), (tp_rank * n, (tp_rank + 1) * n))
        return out
    # Row-stacked pieces (q | k | v, gate | up): this rank's rows of each, one after the other.
    local = LocalShape.of(shape, tp) if sharded else None
    if local is None:
        counts = [d[0] for d in dims]
    elif base == "qkv":
        counts = [local.num_heads * shape.head_dim, local.num_kv_heads * shape.head_dim,
                  local.num_kv_heads * shape.head_dim]
    else:
        counts = [local.ffn_hidden_size] * 2
    out = torch.empty((sum(counts), *dims[0][1:]), dtype=dtype)
    filled = 0
    for tensor, count in zip(names, counts, strict=True):
        first = tp_rank * count if sharded else 0
        ckpt.read_into(out[filled:filled + count], tensor, (first, first + count), None)
        filled += count
    return out


def _check_dims(ckpt: HFCheckpoint, name: str, names: tuple[str, ...], expected: tuple[tuple[int, ...], ...]) -> None:
    types = {ckpt.dtype(t) for t in names}
    if len(types) > 1:
        raise KareusError(f"{ckpt.directory}: the tensors of {name} have different types {sorted(map(str, types))}",
                          exit_code=EXIT_CONFIG)
    for tensor, dims in zip(names, expected, strict=True):
        got = ckpt.dims(tensor)
        if got != dims:
            raise KareusError(f"{ckpt.directory}: tensor {tensor} is {list(got)}, the model needs {list(dims)}",
                              exit_code=EXIT_CONFIG)


def hf_dims(name: str, shape: ModelShape) -> tuple[tuple[int, ...], ...]:
    """The dimensions of each Hugging Face tensor of Kareus parameter `name`."""
    base = name.rsplit(".", 1)[-1]
    h = shape.hidden_size
    table = {
        "qkv": ((shape.q_size, h), (shape.kv_size, h), (shape.kv_size, h)),
        "proj": ((h, shape.q_size),),
        "fc1": ((shape.ffn_hidden_size, h),) * 2,
        "fc2": ((h, shape.ffn_hidden_size),),
        "q_norm": ((shape.head_dim,),), "k_norm": ((shape.head_dim,),),
        "norm_attn": ((h,),), "norm_mlp": ((h,),), "final_norm": ((h,),),
        "embedding": ((shape.vocab_size, h),), "output": ((shape.vocab_size, h),),
    }
    return table[base]

