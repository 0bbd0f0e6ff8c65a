"""`kareus model from-hf DIR`: the `spec.model` block of a Hugging Face model.

Reads DIR/config.json (a Llama or Qwen3 model) and prints the job manifest's `model:` block: the
preset's name when every dimension equals a preset's, else the explicit shape (layers, hidden,
ffnHidden, heads, kvHeads, headDim, vocab, qkNorm, tiedEmbeddings, ropeTheta, normEps and, for
Llama 3.1+, ropeScaling), so nobody transcribes dimensions by hand. Paste it under `spec:`.
"""

from __future__ import annotations

import argparse

import yaml


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("from-hf", help="print the spec.model block of a Hugging Face model directory",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", metavar="DIR", help="a Hugging Face model directory (its config.json)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kareus.runtime import hf_adapter

    shape = hf_adapter.shape_from_config(hf_adapter.read_config(args.directory))
    print(yaml.safe_dump({"model": hf_adapter.spec_model_block(shape)}, sort_keys=False), end="")
    return 0
