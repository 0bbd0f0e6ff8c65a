"""What the Hugging Face round-trip tests share: a job file for a model block, and a saved model's
logits through `transformers` (the reference every export is loaded with)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
import yaml


def write_job(path: Path, name: str, model: dict, *, seq: int, tp: int, pp: int, steps: int) -> Path:
    """A KareusJob training `model` (a `spec.model` block) at TP `tp` × PP `pp`, 2 × 2 sequences a step."""
    manifest = {"apiVersion": "kareus.dev/v1alpha1", "kind": "KareusJob", "metadata": {"name": name},
                "spec": {"model": model, "sequenceLength": seq,
                         "parallelism": {"tensor": tp, "pipeline": pp, "context": 1, "data": 1,
                                         "microBatchSize": 2, "numMicroBatches": 2},
                         "objective": {"maxThroughput": {}},
                         "training": {"image": "x", "steps": steps, "gpusPerNode": tp * pp, "nodes": 1}}}
    path.write_text(yaml.safe_dump(manifest))
    return path


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of the Hugging Face model saved in `directory`, in fp32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits
